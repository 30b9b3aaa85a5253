//! Every client connection is killed from a side connection (`CLIENT KILL
//! TYPE normal`), six times, while 4 producers enqueue with keys, 4
//! without, and a worker on a queue of its own drains. The producers and
//! the worker recover by themselves (the driver reconnects); nothing
//! acknowledged is lost; a command in flight when its connection dropped
//! is never sent again, so an enqueue without a key either failed
//! `Unavailable` or made one job, never two behind the caller's back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{EnqueueRequest, Error, JobState, Queue};
use serde_json::{Value, json};

use idemq_testkit::ledger::{Ledger, all_jobs, wait_completed};

use crate::server::{RedisServer, queue};

const PER_PRODUCER: u32 = 400;
const KEYED: u32 = 4;
const UNKEYED: u32 = 4;
const KILLS: u32 = 6;
const KILL_EVERY: Duration = Duration::from_millis(150);

#[derive(Default)]
struct Tally {
    /// Enqueues answered `Unavailable`.
    unavailable: AtomicU64,
    /// Unkeyed enqueues whose outcome is unknown (answered `Unavailable`;
    /// not retried, as a caller without a key cannot know).
    unknown: Mutex<Vec<String>>,
    /// Acknowledged job ids by marker (`k<p>-<i>` keyed, `u<p>-<i>` not).
    acked: Mutex<HashMap<String, String>>,
    failures: Mutex<Vec<String>>,
    /// Handler calls by job id.
    calls: Mutex<HashMap<String, u32>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn producer(queue: Queue, keyed: bool, p: u32, tally: Arc<Tally>) {
    for i in 0..PER_PRODUCER {
        let marker = format!("{}{p}-{i}", if keyed { 'k' } else { 'u' });
        let started = Instant::now();
        loop {
            let mut req = EnqueueRequest::new("drop.work").payload(json!({ "m": marker }));
            if keyed {
                req = req.idempotency_key(marker.clone());
            }
            match queue.enqueue(req).await {
                Ok(id) => {
                    lock(&tally.acked).insert(marker, id);
                    break;
                }
                Err(Error::Unavailable { .. }) => {
                    tally.unavailable.fetch_add(1, Ordering::Relaxed);
                    if !keyed {
                        lock(&tally.unknown).push(marker);
                        break;
                    }
                    if started.elapsed() > Duration::from_secs(20) {
                        lock(&tally.failures).push(format!("{marker}: still unavailable"));
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                Err(e) => {
                    lock(&tally.failures).push(format!("{marker}: {e:?}"));
                    break;
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connections_dropped_under_load_recover_by_themselves() {
    let server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let worker_queue = Queue::connect(&server.url()).await.expect("connect");
    let tally = Arc::new(Tally::default());
    let t0 = Instant::now();

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let calls = tally.clone();
    let worker = Worker::new(worker_queue)
        .name("drop-worker")
        .lease(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(100))
        .concurrency(8)
        .handle("drop.work", move |ctx: HandlerContext, _p: Value| {
            let calls = calls.clone();
            async move {
                *lock(&calls.calls)
                    .entry(ctx.job_id().to_owned())
                    .or_default() += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
                Ok::<_, JobError>(())
            }
        });
    let worker = tokio::spawn(worker.run(async move {
        let _ = stop_rx.await;
    }));

    let mut producers = tokio::task::JoinSet::new();
    for p in 0..KEYED {
        producers.spawn(producer(queue.clone(), true, p, tally.clone()));
    }
    for p in 0..UNKEYED {
        producers.spawn(producer(queue.clone(), false, p, tally.clone()));
    }
    let producing = Arc::new(AtomicBool::new(true));
    let killer = {
        let (url, producing) = (server.url(), producing.clone());
        tokio::spawn(async move {
            let client = redis::Client::open(url).expect("client");
            let mut side = client
                .get_multiplexed_async_connection()
                .await
                .expect("side connection");
            let mut killed = Vec::new();
            for _ in 0..KILLS {
                tokio::time::sleep(KILL_EVERY).await;
                if !producing.load(Ordering::Relaxed) {
                    break;
                }
                // SKIPME is the default: the side connection survives.
                let n: i64 = redis::cmd("CLIENT")
                    .arg("KILL")
                    .arg("TYPE")
                    .arg("normal")
                    .query_async(&mut side)
                    .await
                    .expect("CLIENT KILL");
                killed.push(n);
            }
            killed
        })
    };
    while let Some(r) = producers.join_next().await {
        r.expect("producer");
    }
    producing.store(false, Ordering::Relaxed);
    let killed = killer.await.expect("killer");
    let produced_in = t0.elapsed();

    let acked = lock(&tally.acked).clone();
    let unknown = lock(&tally.unknown).clone();
    let failures = lock(&tally.failures).clone();
    // Every job made, acknowledged or not, is drained by the worker.
    let total = all_jobs(&queue).await.len();
    wait_completed(&queue, total as u64, Duration::from_secs(30)).await;
    let _ = stop_tx.send(());
    let report = worker.await.expect("join").expect("worker");
    let jobs = all_jobs(&queue).await;

    let mut by_marker: HashMap<String, Vec<String>> = HashMap::new();
    let mut bad = Vec::new();
    for job in &jobs {
        let m = job.payload["m"].as_str().expect("marker").to_owned();
        by_marker.entry(m).or_default().push(job.id.clone());
        if job.state != JobState::Completed {
            bad.push(format!("{}: {:?}", job.id, job.state));
        }
        let l = Ledger::of(&queue, &job.id).await;
        bad.extend(l.problems(job));
        let calls = lock(&tally.calls).get(&job.id).copied().unwrap_or(0);
        if calls as usize > l.runs {
            bad.push(format!(
                "{}: {calls} handler calls, {} runs",
                job.id, l.runs
            ));
        }
    }
    for (marker, id) in &acked {
        if by_marker.get(marker) != Some(&vec![id.clone()]) {
            bad.push(format!(
                "{marker}: acknowledged {id}, stored {:?}",
                by_marker.get(marker)
            ));
        }
    }
    let twice: Vec<_> = by_marker.iter().filter(|(_, v)| v.len() > 1).collect();
    let unknown_made = unknown
        .iter()
        .filter(|m| by_marker.contains_key(*m))
        .count();

    println!(
        "redis_connection_drop: CLIENT KILL {KILLS} times (clients killed {killed:?}), \
         Unavailable answers {}, acknowledged {}, unkeyed unknown {} (of which stored once {}), \
         failures {}, jobs {}, worker completed {} lost {}, problems {}, produced in \
         {produced_in:?}, took {:?}",
        tally.unavailable.load(Ordering::Relaxed),
        acked.len(),
        unknown.len(),
        unknown_made,
        failures.len(),
        jobs.len(),
        report.completed,
        report.lost,
        bad.len(),
        t0.elapsed(),
    );
    assert!(failures.is_empty(), "{failures:?}");
    assert!(
        killed.iter().sum::<i64>() > 0,
        "CLIENT KILL found no client: {killed:?}"
    );
    assert!(
        tally.unavailable.load(Ordering::Relaxed) > 0,
        "no dropped connection met a command"
    );
    assert_eq!(
        acked.len() + unknown.len(),
        ((KEYED + UNKEYED) * PER_PRODUCER) as usize,
        "every enqueue answered"
    );
    assert!(twice.is_empty(), "made twice: {twice:?}");
    assert!(bad.is_empty(), "{bad:?}");
}
