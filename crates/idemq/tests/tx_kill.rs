//! Fault test: a handler writes its effect (a business row) and completes
//! its job in the same transaction of its own database; its worker process
//! is killed with SIGKILL between that write and the commit. After the job
//! is retried by another worker, every effect exists exactly once: the
//! killed attempt's write never committed, and every job that committed
//! before the kill is not run again. On SQLite and on PostgreSQL; real
//! time, 1 s leases.
//!
//! Run: `cargo test -p idemq --test tx_kill -- --nocapture`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemq::rusqlite::TransactionBehavior;
use idemq::sqlx::{self, Executor};
use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{EnqueueRequest, JobState, Queue};
use serde_json::json;

const CHILD_ENV: &str = "IDEMQ_TX_KILL_CHILD_DATABASE";
const MARKER_ENV: &str = "IDEMQ_TX_KILL_MARKER";
const JOBS: usize = 20;
/// The job whose first attempt is killed between its write and its commit.
const KILLED: &str = "ord-7";
const LEASE: Duration = Duration::from_secs(1);

/// The caller's own database: where the effects go, with the queue.
enum Effects {
    Pg(sqlx::PgPool),
    Lite(Queue),
}

impl Effects {
    async fn open(url: &str, queue: &Queue) -> Self {
        if url.starts_with("postgres") {
            Self::Pg(sqlx::PgPool::connect(url).await.expect("connect"))
        } else {
            Self::Lite(queue.clone())
        }
    }

    async fn create_table(&self) {
        // No unique constraint: a second effect of one order would show.
        let sql =
            "CREATE TABLE IF NOT EXISTS effects (order_id text NOT NULL, attempt integer NOT NULL)";
        match self {
            Self::Pg(pool) => {
                pool.execute(sql).await.expect("create");
            }
            Self::Lite(queue) => {
                let conn = queue.sqlite_connection().expect("connection");
                conn.execute_batch(sql).expect("create");
            }
        }
    }

    /// The effect and the completion in one transaction. With `pause`,
    /// writes that marker file between them and waits to be killed (a
    /// blocking wait: the SQLite transaction is not kept across an await).
    async fn effect(
        &self,
        ctx: &HandlerContext,
        order: &str,
        pause: Option<&Path>,
    ) -> Result<(), JobError> {
        let wait_for_the_kill = || {
            if let Some(marker) = pause {
                std::fs::write(marker, b"between the write and the commit").expect("marker");
                std::thread::sleep(Duration::from_secs(600));
            }
        };
        let attempt = ctx.attempt();
        match self {
            Self::Pg(pool) => {
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO effects (order_id, attempt) VALUES ($1, $2)")
                    .bind(order)
                    .bind(attempt)
                    .execute(&mut *tx)
                    .await?;
                ctx.complete_in(&mut tx, &json!({ "order": order })).await?;
                wait_for_the_kill();
                tx.commit().await?;
            }
            Self::Lite(queue) => {
                let mut conn = queue.sqlite_connection()?;
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                tx.execute(
                    "INSERT INTO effects (order_id, attempt) VALUES (?1, ?2)",
                    idemq::rusqlite::params![order, attempt],
                )?;
                ctx.complete_in_sqlite(&tx, &json!({ "order": order }))?;
                wait_for_the_kill();
                tx.commit()?;
            }
        }
        Ok(())
    }

    /// (order, attempt) of every effect, sorted.
    async fn all(&self) -> Vec<(String, i32)> {
        let sql = "SELECT order_id, attempt FROM effects ORDER BY order_id, attempt";
        match self {
            Self::Pg(pool) => sqlx::query_as(sql).fetch_all(pool).await.expect("select"),
            Self::Lite(queue) => {
                let conn = queue.sqlite_connection().expect("connection");
                let mut st = conn.prepare(sql).expect("prepare");
                st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                    .expect("query")
                    .collect::<Result<_, _>>()
                    .expect("rows")
            }
        }
    }
}

/// A worker whose handler writes each order's effect and completes the
/// job in one transaction.
fn worker(queue: Queue, effects: Arc<Effects>, marker: Option<PathBuf>) -> Worker {
    Worker::new(queue)
        .lease(LEASE)
        .poll_interval(Duration::from_millis(50))
        .concurrency(4)
        .maintenance(false)
        .handle("order.place", move |ctx: HandlerContext, order: String| {
            let (effects, marker) = (effects.clone(), marker.clone());
            async move {
                let pause = marker.as_deref().filter(|_| order == KILLED);
                effects.effect(&ctx, &order, pause).await?;
                Ok::<_, JobError>(())
            }
        })
}

/// Not a test of its own: the entry point of the worker process the tests
/// below start (this test binary, run again with `CHILD_ENV` set) and kill.
/// Ignored, so a normal run neither runs nor counts it; the child is
/// started with `--ignored`.
#[test]
#[ignore = "the entry point of a child process the other tests start"]
fn tx_kill_child_worker_process() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    let marker = std::env::var(MARKER_ENV).ok().map(PathBuf::from);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let queue = Queue::connect(&url).await.expect("child connects");
        let effects = Arc::new(Effects::open(&url, &queue).await);
        worker(queue, effects, marker)
            .run(std::future::pending::<()>())
            .await
            .expect("child worker");
    });
}

fn spawn_child(url: &str, marker: &Path) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "tx_kill_child_worker_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, url)
        .env(MARKER_ENV, marker)
        .spawn()
        .expect("start the worker process")
}

async fn kill_between_write_and_commit(url: &str, backend: &str) {
    let queue = Queue::connect(url).await.expect("connect");
    let effects = Arc::new(Effects::open(url, &queue).await);
    effects.create_table().await;
    let mut ids = Vec::new();
    for i in 0..JOBS {
        let req = EnqueueRequest::new("order.place").payload(json!(format!("ord-{i}")));
        ids.push(queue.enqueue(req).await.expect("enqueue"));
    }
    let dir = tempfile::tempdir().expect("dir");
    let marker = dir.path().join("paused");
    let mut child = spawn_child(url, &marker);
    let start = Instant::now();
    while !marker.exists() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the child never reached the pause"
        );
        if let Some(status) = child.try_wait().expect("child status") {
            panic!("the worker process ended early: {status}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    child.kill().expect("SIGKILL the worker");
    child.wait().expect("reap the worker");

    // Another worker finishes the rest, the killed attempt's job once its
    // lease ran out.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let run = tokio::spawn(
        worker(queue.clone(), effects.clone(), None).run(async move {
            let _ = rx.await;
        }),
    );
    let start = Instant::now();
    loop {
        let done = queue
            .queues()
            .await
            .expect("queues")
            .iter()
            .map(|q| q.counts.completed)
            .sum::<u64>();
        if done == JOBS as u64 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "only {done} of {JOBS} completed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = tx.send(());
    let report = run.await.expect("worker task").expect("worker");
    assert_eq!(report.lost, 0, "{report:?}");

    let all = effects.all().await;
    let mut orders: Vec<&str> = all.iter().map(|(o, _)| o.as_str()).collect();
    orders.dedup();
    assert_eq!(orders.len(), JOBS, "an effect is missing: {all:?}");
    assert_eq!(all.len(), JOBS, "an effect happened twice: {all:?}");
    let killed_attempts: Vec<i32> = all
        .iter()
        .filter(|(o, _)| o == KILLED)
        .map(|(_, a)| *a)
        .collect();
    assert_eq!(
        killed_attempts,
        vec![2],
        "the killed attempt's write committed"
    );
    for (i, id) in ids.iter().enumerate() {
        let job = queue.get(id).await.expect("get").expect("job");
        let order = format!("ord-{i}");
        assert_eq!(job.state, JobState::Completed);
        assert_eq!(job.result, Some(json!({ "order": order })));
        let runs = queue.runs(id).await.expect("runs");
        if order == KILLED {
            let outcomes: Vec<Option<&str>> = runs.iter().map(|r| r.outcome.as_deref()).collect();
            assert_eq!(
                outcomes,
                vec![Some("lease_expired"), Some("completed")],
                "{order}"
            );
        }
        let completed = runs
            .iter()
            .filter(|r| r.outcome.as_deref() == Some("completed"))
            .count();
        assert_eq!(completed, 1, "{order} completed {completed} times");
    }
    println!(
        "tx_kill[{backend}]: jobs {JOBS}, faults injected (SIGKILL between the write and the commit) 1, \
         effects {} (each once), retried {}",
        all.len(),
        all.iter().filter(|(_, a)| *a > 1).count()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_effect_and_completion_commit_once_across_a_kill() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("tx.db").display());
    kill_between_write_and_commit(&url, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_effect_and_completion_commit_once_across_a_kill() {
    let db = idemq_testkit::PgDatabase::new();
    kill_between_write_and_commit(&db.url, "postgres").await;
}
