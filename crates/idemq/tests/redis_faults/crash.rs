//! redis-server SIGKILLed while 8 producers run keyed enqueues, then
//! started again on the same files. Every acknowledged enqueue is there
//! afterwards, live and bound to its key; no key owns two jobs; every
//! error the producers saw was `Unavailable` (never a silent success,
//! never another error), and they carried on by themselves on the same
//! queue once the server was back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::{EnqueueRequest, Error, JobState, Outcome, Queue};
use serde_json::json;

use idemq_testkit::ledger::all_jobs;

use crate::server::{RedisServer, queue};

const PRODUCERS: u32 = 8;
const OPS: u32 = 4_000;
/// The kill lands once this many enqueues were acknowledged.
const KILL_AT: u64 = 1_500;
/// How long the server stays down.
const DOWN_FOR: Duration = Duration::from_millis(400);
/// How long one enqueue may keep retrying `Unavailable`.
const RETRY_BUDGET: Duration = Duration::from_secs(20);

#[derive(Default)]
struct Tally {
    acked: AtomicU64,
    unavailable: AtomicU64,
    /// Retries answered `replayed`: the try before had been written, but
    /// its reply was lost with the server.
    replayed_on_retry: AtomicU64,
    failures: Mutex<Vec<String>>,
    /// Acknowledged job ids by key number.
    ids: Mutex<HashMap<u32, String>>,
}

fn key(i: u32) -> String {
    format!("crash-key-{i}")
}

async fn producer(queue: Queue, p: u32, tally: Arc<Tally>) {
    for i in (p..OPS).step_by(PRODUCERS as usize) {
        let started = Instant::now();
        let mut retried = false;
        loop {
            let req = EnqueueRequest::new("crash.probe")
                .payload(json!({ "i": i }))
                .idempotency_key(key(i));
            match queue.enqueue_with_result(req).await {
                Ok(r) => {
                    match (retried, r.outcome) {
                        (_, Outcome::Accepted) => {}
                        (true, Outcome::Replayed) => {
                            tally.replayed_on_retry.fetch_add(1, Ordering::Relaxed);
                        }
                        (_, other) => lock(&tally.failures)
                            .push(format!("key {i}: unexpected outcome {other:?}")),
                    }
                    lock(&tally.ids).insert(i, r.job_id);
                    tally.acked.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(Error::Unavailable { .. }) if started.elapsed() < RETRY_BUDGET => {
                    tally.unavailable.fetch_add(1, Ordering::Relaxed);
                    retried = true;
                    tokio::time::sleep(Duration::from_millis(25)).await;
                }
                Err(e) => {
                    lock(&tally.failures).push(format!("key {i}: {e:?}"));
                    break;
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigkill_during_keyed_enqueues_loses_nothing_acknowledged() {
    let mut server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let t0 = Instant::now();
    let tally = Arc::new(Tally::default());
    let mut producers = tokio::task::JoinSet::new();
    for p in 0..PRODUCERS {
        producers.spawn(producer(queue.clone(), p, tally.clone()));
    }

    while tally.acked.load(Ordering::Relaxed) < KILL_AT {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the producers stalled before the kill"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let acked_at_kill = tally.acked.load(Ordering::Relaxed);
    server.kill9();
    tokio::time::sleep(DOWN_FOR).await;
    let acked_while_down = tally.acked.load(Ordering::Relaxed) - acked_at_kill;
    server.restart();
    server.assert_durable().await;

    while let Some(r) = producers.join_next().await {
        r.expect("producer");
    }
    let load_took = t0.elapsed();

    let ids = lock(&tally.ids).clone();
    let failures = lock(&tally.failures).clone();
    let jobs = all_jobs(&queue).await;
    let mut jobs_by_key: HashMap<u32, Vec<(String, JobState)>> = HashMap::new();
    for job in &jobs {
        let i = job.payload["i"]
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .expect("payload i");
        jobs_by_key
            .entry(i)
            .or_default()
            .push((job.id.clone(), job.state));
    }
    let mut lost = Vec::new();
    for (i, id) in &ids {
        match jobs_by_key.get(i) {
            Some(v) if v.iter().any(|(j, s)| j == id && *s == JobState::Ready) => {}
            other => lost.push(format!("key {i}: acknowledged {id}, stored {other:?}")),
        }
    }
    // Each acknowledged id read back alone, and bound to its key.
    let mut wrong = Vec::new();
    for (i, id) in &ids {
        let job = queue.get(id).await.expect("get");
        if job.as_ref().map(|j| j.state) != Some(JobState::Ready) {
            wrong.push(format!("{id}: {:?}", job.map(|j| j.state)));
        }
        let bound = queue.lookup_key("default", &key(*i)).await.expect("lookup");
        if bound.as_ref().map(|b| b.job_id.as_str()) != Some(id.as_str()) {
            wrong.push(format!("key {i}: acknowledged {id}, bound to {bound:?}"));
        }
    }
    let duplicates: Vec<_> = jobs_by_key.iter().filter(|(_, v)| v.len() > 1).collect();

    println!(
        "redis_crash: ops {OPS} by {PRODUCERS} producers, SIGKILL at {acked_at_kill} \
         acknowledged, down {DOWN_FOR:?} (acknowledged while down: {acked_while_down}), \
         Unavailable answers {}, replayed on retry {}, acknowledged {}, failures {}, lost {}, \
         wrong {}, duplicate keys {}, jobs stored {}, took {load_took:?}",
        tally.unavailable.load(Ordering::Relaxed),
        tally.replayed_on_retry.load(Ordering::Relaxed),
        ids.len(),
        failures.len(),
        lost.len(),
        wrong.len(),
        duplicates.len(),
        jobs.len(),
    );
    assert!(failures.is_empty(), "failures: {failures:?}");
    assert_eq!(ids.len(), OPS as usize, "every producer finished by itself");
    assert!(
        tally.unavailable.load(Ordering::Relaxed) > 0,
        "the kill met no enqueue"
    );
    assert!(lost.is_empty(), "acknowledged but lost: {lost:?}");
    assert!(wrong.is_empty(), "{wrong:?}");
    assert!(duplicates.is_empty(), "keys bound twice: {duplicates:?}");
    assert_eq!(jobs.len(), OPS as usize, "one job per key");
}
