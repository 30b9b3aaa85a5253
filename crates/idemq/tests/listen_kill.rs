//! Fault test on PostgreSQL: the `LISTEN` connection of a running worker is
//! terminated (`pg_terminate_backend`) again and again while jobs are
//! enqueued. Every job enqueued during the gap is still run (polling is the
//! fallback), and afterwards wake-ups work again: new jobs start well within
//! the poll interval, so the worker listens again by itself.
//!
//! Run: `cargo test -p idemq --test listen_kill -- --nocapture`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idemq::sqlx::{self, Connection, Row};
use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{EnqueueRequest, Queue};
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// Long, so a job started by a wake-up is told apart from one found by polling.
const POLL: Duration = Duration::from_secs(2);
/// A job started within this after its enqueue was woken up for.
const PROMPT: Duration = Duration::from_millis(500);
const GAP: Duration = Duration::from_secs(2);
const GAP_JOBS: usize = 40;
const SILENT_JOBS: usize = 5;

/// The listener's row in `pg_stat_activity` (other than ours): its last
/// statement is `LISTEN "idemq_jobs"`.
const LISTENERS: &str = "SELECT pid, state, query FROM pg_stat_activity \
     WHERE query ILIKE '%LISTEN%' AND datname = current_database() AND pid <> pg_backend_pid()";
const TERMINATE: &str = "SELECT pid, pg_terminate_backend(pid) AS killed FROM pg_stat_activity \
     WHERE query ILIKE '%LISTEN%' AND datname = current_database() AND pid <> pg_backend_pid()";

async fn listeners(admin: &mut sqlx::PgConnection) -> Vec<(i32, Option<String>, String)> {
    sqlx::query(LISTENERS)
        .fetch_all(admin)
        .await
        .expect("pg_stat_activity")
        .iter()
        .map(|r| (r.get("pid"), r.get("state"), r.get("query")))
        .collect()
}

async fn wait_for_listener(
    admin: &mut sqlx::PgConnection,
    within: Duration,
) -> Vec<(i32, Option<String>, String)> {
    let start = Instant::now();
    loop {
        let rows = listeners(admin).await;
        if !rows.is_empty() {
            return rows;
        }
        assert!(
            start.elapsed() < within,
            "no LISTEN connection after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Enqueues one job and returns how long until its handler started.
async fn latency(
    queue: &Queue,
    started: &mut mpsc::UnboundedReceiver<String>,
    n: usize,
) -> Duration {
    let id = queue
        .enqueue(EnqueueRequest::new("listen.work").payload(json!({ "probe": n })))
        .await
        .expect("enqueue");
    let t = Instant::now();
    loop {
        let got = tokio::time::timeout(POLL * 3, started.recv())
            .await
            .expect("the probe job did not start within three poll intervals")
            .expect("worker alive");
        if got == id {
            return t.elapsed();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_survives_its_listen_connection_being_killed() {
    let (url, db) = idemq_testkit::pg_database();
    let _drop = DropDb(db);
    let queue = Queue::connect(&url).await.expect("connect");
    let mut admin = sqlx::PgConnection::connect(&url)
        .await
        .expect("admin connection");

    let (tx, mut started) = mpsc::unbounded_channel::<String>();
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let worker = Worker::new(queue.clone())
        .name("listener-victim")
        .lease(Duration::from_secs(5))
        .poll_interval(POLL)
        .concurrency(8)
        .maintenance(false)
        .handle("listen.work", move |ctx: HandlerContext, _p: Value| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(ctx.job_id().to_owned());
                Ok::<_, JobError>(())
            }
        });
    let handle = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));

    // Before the fault: the worker listens, and wake-ups are prompt.
    let before = wait_for_listener(&mut admin, Duration::from_secs(10)).await;
    let mut baseline = Vec::new();
    for n in 0..3 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        baseline.push(latency(&queue, &mut started, n).await);
    }

    // The gap: the LISTEN connection is terminated every 25 ms while jobs
    // are enqueued.
    let mut gap_ids = HashSet::new();
    let mut terminated = 0u64;
    let gap_start = Instant::now();
    let mut next_job = Instant::now();
    while gap_start.elapsed() < GAP || gap_ids.len() < GAP_JOBS {
        for row in sqlx::query(TERMINATE)
            .fetch_all(&mut admin)
            .await
            .expect("pg_terminate_backend")
        {
            terminated += u64::from(row.get::<bool, _>("killed"));
        }
        if gap_ids.len() < GAP_JOBS && Instant::now() >= next_job {
            let id = queue
                .enqueue(
                    EnqueueRequest::new("listen.work").payload(json!({ "gap": gap_ids.len() })),
                )
                .await
                .expect("enqueue during the gap");
            gap_ids.insert(id);
            next_job += GAP / GAP_JOBS as u32;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let gap_ended = Instant::now();
    // Every job of the gap runs, by polling if no wake-up reached the worker.
    let mut pending = gap_ids.clone();
    while !pending.is_empty() {
        let left = (POLL * 2 + Duration::from_secs(1)).saturating_sub(gap_ended.elapsed());
        match tokio::time::timeout(left, started.recv()).await {
            Ok(Some(id)) => {
                pending.remove(&id);
            }
            Ok(None) => panic!("the worker stopped"),
            Err(_) => panic!(
                "{} of {GAP_JOBS} jobs enqueued during the gap did not start within two poll intervals",
                pending.len()
            ),
        }
    }
    let gap_drained = gap_ended.elapsed();

    // Lost notifications: while this connection holds the advisory lock
    // `idemq.wake` takes before it notifies, enqueues send no NOTIFY at all,
    // so only polling can find these jobs.
    let silence = "hashtextextended('idemq.notify:' || 'default', 0)";
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_lock({silence})"
    )))
    .execute(&mut admin)
    .await
    .expect("silence notifications");
    for row in sqlx::query(TERMINATE)
        .fetch_all(&mut admin)
        .await
        .expect("pg_terminate_backend")
    {
        terminated += u64::from(row.get::<bool, _>("killed"));
    }
    let mut silent = Vec::new();
    for n in 0..SILENT_JOBS {
        tokio::time::sleep(Duration::from_millis(50)).await;
        silent.push(latency(&queue, &mut started, 200 + n).await);
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "SELECT pg_advisory_unlock({silence})"
    )))
    .execute(&mut admin)
    .await
    .expect("notifications again");
    let silent_max = silent.iter().max().copied().unwrap_or_default();

    // After the fault: the worker listens again, and wake-ups are prompt again.
    let after = wait_for_listener(&mut admin, POLL * 2).await;
    let mut recovered = Vec::new();
    for n in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        recovered.push(latency(&queue, &mut started, 100 + n).await);
    }
    let _ = stop.send(());
    let report = handle.await.expect("join").expect("worker");

    println!(
        "listen_kill: listener before {before:?}, after {after:?}; faults injected \
         (LISTEN backends terminated) {terminated}; gap jobs {GAP_JOBS}, all started \
         {gap_drained:?} after the gap; without notifications {SILENT_JOBS} jobs found by \
         polling within {silent_max:?}; wake-up latency before {baseline:?}, after {recovered:?}; \
         worker completed {}, lost {}",
        report.completed, report.lost
    );
    assert!(terminated >= 1, "no LISTEN connection was terminated");
    assert!(
        baseline.iter().all(|l| *l < PROMPT),
        "wake-ups were not prompt even before the fault: {baseline:?}"
    );
    assert!(
        recovered.iter().all(|l| *l < PROMPT),
        "after its LISTEN connection was killed the worker is no longer woken up \
         (latencies {recovered:?}, poll interval {POLL:?})"
    );
    assert!(
        silent_max <= POLL + PROMPT,
        "without notifications a job waited {silent_max:?}, more than the poll interval {POLL:?}"
    );
    assert_eq!(report.completed, (3 + GAP_JOBS + SILENT_JOBS + 5) as u64);
    assert_eq!(report.lost, 0);
}

/// Drops the test database, also when the test fails.
struct DropDb(String);

impl Drop for DropDb {
    fn drop(&mut self) {
        idemq_testkit::drop_pg_database(&self.0);
    }
}
