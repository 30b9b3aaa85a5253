//! Fault test: a worker process draining 5,000 jobs is killed with SIGKILL
//! three times (each time after another thousand jobs completed); a worker
//! in this process finishes the rest. Every job ends completed exactly once
//! in state, and the run ledger records the attempts the kills cut short as
//! `lease_expired`. On SQLite, PostgreSQL and Redis (the test kit's
//! durable redis-server); real time, 2 s leases (heartbeats every 667 ms; a
//! shorter lease let a stall of this process on a busy 2-core machine end a
//! live worker's lease).
//!
//! Run: `cargo test -p idemq --test drain_kill -- --nocapture`.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{BatchOptions, EnqueueRequest, JobState, Queue};
use idemq_testkit::ledger::{Ledger, all_jobs, counts, wait_completed};
use serde_json::{Value, json};

const CHILD_ENV: &str = "IDEMQ_DRAIN_CHILD_DATABASE";
const NAME_ENV: &str = "IDEMQ_DRAIN_CHILD_NAME";
const JOBS: usize = 5_000;
const KILLS: usize = 3;
/// A kill happens once this many more jobs completed.
const KILL_EVERY: u64 = 1_000;
const LEASE: Duration = Duration::from_secs(2);
const CONCURRENCY: usize = 32;

async fn work(_ctx: HandlerContext, _p: Value) -> Result<(), JobError> {
    // Long enough that jobs are always in flight when the kill lands.
    tokio::time::sleep(Duration::from_millis(60)).await;
    Ok(())
}

/// Not a test of its own: the entry point of the worker process the tests
/// below start (this test binary, run again with `CHILD_ENV` set) and kill.
/// Ignored, so a normal run neither runs nor counts it; the child is
/// started with `--ignored`.
#[test]
#[ignore = "the entry point of a child process the other tests start"]
fn drain_child_worker_process() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    let name = std::env::var(NAME_ENV).expect("worker name");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let queue = Queue::connect(&url).await.expect("child connects");
        Worker::new(queue)
            .name(name)
            .lease(LEASE)
            .poll_interval(Duration::from_millis(100))
            .concurrency(CONCURRENCY)
            .maintenance(false)
            .handle("drain.work", work)
            .run(std::future::pending::<()>())
            .await
            .expect("child worker");
    });
}

fn spawn_child(url: &str, name: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "drain_child_worker_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, url)
        .env(NAME_ENV, name)
        .spawn()
        .expect("start the worker process")
}

async fn drain_with_kills(url: &str, backend: &str) {
    let queue = Queue::connect(url).await.expect("connect");
    let started = Instant::now();
    for batch in 0..JOBS / 1000 {
        let reqs = (0..1000)
            .map(|i| {
                EnqueueRequest::new("drain.work")
                    .payload(json!({ "n": batch * 1000 + i }))
                    .max_attempts(10)
            })
            .collect();
        for r in queue
            .enqueue_many(reqs, BatchOptions::default())
            .await
            .expect("enqueue batch")
        {
            r.expect("enqueue item");
        }
    }

    let mut killed = Vec::new();
    for k in 1..=KILLS {
        let name = format!("doomed-{backend}-{k}");
        let mut child = spawn_child(url, &name);
        wait_completed(&queue, KILL_EVERY * k as u64, Duration::from_secs(40)).await;
        // Kill while it holds jobs (not between two claims), so the kill
        // cuts attempts short.
        let start = Instant::now();
        while counts(&queue).await.1 < CONCURRENCY as u64 / 2 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no jobs in flight"
            );
        }
        child.kill().expect("SIGKILL the worker");
        child.wait().expect("reap the worker");
        killed.push(name);
    }

    // A worker in this process finishes the rest, the dead ones' jobs included.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let survivor = Worker::new(queue.clone())
        .name(format!("survivor-{backend}"))
        .lease(LEASE)
        .poll_interval(Duration::from_millis(100))
        .concurrency(CONCURRENCY)
        .handle("drain.work", work);
    let handle = tokio::spawn(survivor.run(async move {
        let _ = rx.await;
    }));
    wait_completed(&queue, JOBS as u64, Duration::from_secs(40)).await;
    let _ = tx.send(());
    let report = handle.await.expect("join").expect("survivor");
    let drained_in = started.elapsed();

    // Every job's state, events and runs.
    let jobs = all_jobs(&queue).await;
    assert_eq!(jobs.len(), JOBS, "jobs stored");
    let not_completed: Vec<(String, JobState)> = jobs
        .iter()
        .filter(|j| j.state != JobState::Completed)
        .map(|j| (j.id.clone(), j.state))
        .collect();
    let mut tasks = tokio::task::JoinSet::new();
    let chunk = jobs.len().div_ceil(8);
    for part in jobs.chunks(chunk) {
        let (queue, part) = (queue.clone(), part.to_vec());
        tasks.spawn(async move {
            let mut out = Vec::new();
            for job in part {
                let l = Ledger::of(&queue, &job.id).await;
                out.push((job, l));
            }
            out
        });
    }
    let mut ledgers = Vec::new();
    while let Some(r) = tasks.join_next().await {
        ledgers.extend(r.expect("ledger task"));
    }

    let mut bad = Vec::new();
    let mut expired_per_worker: HashMap<String, usize> = HashMap::new();
    let mut lease_expired_runs = 0;
    let mut rerun_jobs = 0;
    for (job, l) in &ledgers {
        bad.extend(l.problems(job));
        lease_expired_runs += l.expired_by.len();
        rerun_jobs += usize::from(!l.expired_by.is_empty());
        for w in &l.expired_by {
            *expired_per_worker.entry(w.clone()).or_default() += 1;
        }
    }

    println!(
        "drain_kill[{backend}]: jobs {JOBS}, faults injected (SIGKILL) {}, lost attempts \
         recorded lease_expired {lease_expired_runs} on {rerun_jobs} jobs {expired_per_worker:?}, \
         completed {} (survivor completed {}), completed twice {}, \
         not completed {}, took {drained_in:?}",
        killed.len(),
        jobs.len() - not_completed.len(),
        report.completed,
        ledgers
            .iter()
            .filter(|(_, l)| l.completed_events > 1)
            .count(),
        not_completed.len(),
    );
    assert!(
        not_completed.is_empty(),
        "jobs not completed: {not_completed:?}"
    );
    assert!(bad.is_empty(), "ledger inconsistencies: {bad:?}");
    for name in &killed {
        assert!(
            expired_per_worker.get(name).copied().unwrap_or(0) >= 1,
            "the attempts {name} held when killed are not recorded as lease_expired: \
             {expired_per_worker:?}"
        );
    }
    assert!(
        expired_per_worker.keys().all(|w| killed.contains(w)),
        "a live worker lost a lease: {expired_per_worker:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_drain_survives_repeated_worker_kills() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("drain.db").display());
    drain_with_kills(&url, "sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_drain_survives_repeated_worker_kills() {
    let (url, db) = idemq_testkit::pg_database();
    let _drop = DropDb(db);
    drain_with_kills(&url, "postgres").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_drain_survives_repeated_worker_kills() {
    let (url, _prefix) = idemq_testkit::redis_url();
    idemq::Queue::migrate(&url).await.expect("migrate");
    drain_with_kills(&url, "redis").await;
}

/// Drops the test database, also when the test fails.
struct DropDb(String);

impl Drop for DropDb {
    fn drop(&mut self) {
        idemq_testkit::drop_pg_database(&self.0);
    }
}
