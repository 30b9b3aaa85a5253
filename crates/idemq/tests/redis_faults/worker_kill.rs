//! A worker process draining 1,000 jobs is SIGKILLed twice, each time
//! with jobs in its hands; a worker in this process finishes the rest.
//! Every job ends completed exactly once, and an attempt repeats only
//! when the one before it is recorded as `lease_expired` (lease expiry,
//! then reap and reclaim).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use idemq::worker::Worker;
use idemq::{BatchOptions, EnqueueRequest, JobState};
use serde_json::json;

use crate::server::{Ledger, RedisServer, all_jobs, counts, queue, wait_completed};
use crate::{CHILD_CONCURRENCY, CHILD_LEASE, drain_work, spawn_child};

const JOBS: usize = 1_000;
const KILLS: u64 = 2;
/// A kill happens once this many more jobs completed.
const KILL_EVERY: u64 = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_worker_killed_mid_drain_completes_every_job_once() {
    let server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let started = Instant::now();
    let reqs = (0..JOBS)
        .map(|n| {
            EnqueueRequest::new("drain.work")
                .payload(json!({ "n": n }))
                .max_attempts(10)
        })
        .collect();
    for r in queue
        .enqueue_many(reqs, BatchOptions::default())
        .await
        .expect("enqueue")
    {
        r.expect("enqueue item");
    }

    let mut killed = Vec::new();
    for k in 1..=KILLS {
        let name = format!("doomed-{k}");
        let mut child = spawn_child(&server.url(), &name);
        wait_completed(&queue, KILL_EVERY * k, Duration::from_secs(30)).await;
        // Kill while it holds jobs, so the kill cuts attempts short.
        let start = Instant::now();
        while counts(&queue).await.1 < CHILD_CONCURRENCY as u64 / 2 {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "no jobs in flight"
            );
        }
        child.kill().expect("SIGKILL the worker");
        child.wait().expect("reap the worker");
        killed.push(name);
    }

    // The survivor's maintenance reaps the dead workers' leases.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let survivor = Worker::new(queue.clone())
        .name("survivor")
        .lease(CHILD_LEASE)
        .poll_interval(Duration::from_millis(100))
        .concurrency(CHILD_CONCURRENCY)
        .handle("drain.work", drain_work);
    let handle = tokio::spawn(survivor.run(async move {
        let _ = rx.await;
    }));
    wait_completed(&queue, JOBS as u64, Duration::from_secs(30)).await;
    let _ = tx.send(());
    let report = handle.await.expect("join").expect("survivor");
    let took = started.elapsed();

    let jobs = all_jobs(&queue).await;
    let mut bad = Vec::new();
    let mut expired_per_worker: HashMap<String, usize> = HashMap::new();
    for job in &jobs {
        if job.state != JobState::Completed {
            bad.push(format!("{}: {:?}", job.id, job.state));
        }
        let l = Ledger::of(&queue, &job.id).await;
        bad.extend(l.problems(job));
        for w in l.expired_by {
            *expired_per_worker.entry(w).or_default() += 1;
        }
    }
    println!(
        "redis_worker_kill: jobs {JOBS}, SIGKILLs {}, attempts recorded lease_expired \
         {expired_per_worker:?}, survivor completed {}, problems {}, took {took:?}",
        killed.len(),
        report.completed,
        bad.len()
    );
    assert_eq!(jobs.len(), JOBS);
    assert!(bad.is_empty(), "{bad:?}");
    for name in &killed {
        assert!(
            expired_per_worker.get(name).copied().unwrap_or(0) >= 1,
            "the attempts {name} held are not recorded as lease_expired: {expired_per_worker:?}"
        );
    }
    assert!(
        expired_per_worker.keys().all(|w| killed.contains(w)),
        "a live worker lost a lease: {expired_per_worker:?}"
    );
}
