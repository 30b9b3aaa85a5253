//! The worker workloads: W3 drain and W6 enqueue-to-start latency.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{BatchOptions, EnqueueRequest, Queue};
use serde_json::{Value, json};
use tokio::sync::Notify;

use super::enqueue::{NOOP, row, total_jobs};
use super::raw_pg::percentile;
use super::report::{Row, peak_memory_kib, reset_peak_memory};
use super::target::Backend;
use super::{Limit, bar, measure_limit, paired, rate};

/// The queue the drain fills (the default one).
const QUEUE: &str = "default";
/// Jobs a drain worker runs at once.
const DRAIN_CONCURRENCY: usize = 64;
/// Pause between two enqueues of the latency workload (well under saturation).
const LATENCY_GAP: Duration = Duration::from_millis(5);

fn index(payload: &Value) -> usize {
    payload["i"].as_u64().unwrap_or(u64::MAX) as usize
}

/// A running worker whose handler calls `on_run` with each job's index,
/// and the sender that stops it.
fn start_worker(
    queue: &Queue,
    concurrency: usize,
    poll: Duration,
    on_run: impl Fn(usize) + Send + Sync + 'static,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<idemq::Result<idemq::worker::WorkerReport>>,
) {
    let worker = Worker::new(queue.clone())
        .concurrency(concurrency)
        .poll_interval(poll)
        .handle(NOOP, move |_ctx: HandlerContext, payload: Value| {
            on_run(index(&payload));
            async move { Ok::<_, JobError>(()) }
        });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    (tx, handle)
}

/// Pauses the default queue and fills it with the no-op jobs of `range`
/// (payload `{"i": i}`), in batches of 1,000.
pub(crate) async fn fill_paused(queue: &Queue, range: std::ops::Range<usize>) -> Result<()> {
    queue.pause(QUEUE).await?;
    for chunk in range.collect::<Vec<_>>().chunks(1000) {
        let reqs = chunk
            .iter()
            .map(|&i| EnqueueRequest::new(NOOP).payload(json!({ "i": i })))
            .collect();
        for r in queue.enqueue_many(reqs, BatchOptions::default()).await? {
            r?;
        }
    }
    Ok(())
}

/// W3: pre-enqueued no-op jobs run to completion by one `Worker` that runs
/// for the whole workload, vs the two-step claim/complete loop of a minimal
/// queue, in alternating slices. Each slice fills its queue while the
/// queue is paused (not timed), then resumes it and times the drain; every
/// job must have run and completed once.
pub(crate) async fn drain(backend: &Backend, n: usize) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let limit = Limit::ClaimComplete;
            let queue = Queue::connect(db.url()).await?;
            let runs: Arc<Vec<AtomicU32>> = Arc::new((0..n).map(|_| AtomicU32::new(0)).collect());
            let handled = Arc::new(AtomicUsize::new(0));
            let goal = Arc::new(AtomicUsize::new(usize::MAX));
            let all_ran = Arc::new(Notify::new());
            let progress: Arc<Mutex<Option<indicatif::ProgressBar>>> = Arc::default();
            let (r, h, g, a, p) = (
                runs.clone(),
                handled.clone(),
                goal.clone(),
                all_ran.clone(),
                progress.clone(),
            );
            let (stop, worker) = start_worker(
                &queue,
                DRAIN_CONCURRENCY,
                Duration::from_millis(100),
                move |i| {
                    if let Some(c) = r.get(i) {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                    if let Some(b) = p.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                        b.inc(1);
                    }
                    if h.fetch_add(1, Ordering::Relaxed) + 1 == g.load(Ordering::Relaxed) {
                        a.notify_one();
                    }
                },
            );
            let measured = paired(db, limit, n, 4, "W3 drain", async |range, bar| {
                *progress.lock().unwrap_or_else(|e| e.into_inner()) = Some(bar.clone());
                fill_paused(&queue, range.clone()).await?;
                goal.store(handled.load(Ordering::Relaxed) + range.len(), Ordering::Relaxed);
                let start = Instant::now();
                queue.resume(QUEUE).await?;
                all_ran.notified().await;
                Ok(start.elapsed())
            })
            .await;
            // Shutdown waits for the running attempts to be recorded.
            let _ = stop.send(());
            let report = worker.await.context("the worker task failed")??;
            let (raw, ops_per_sec) = measured?;
            let completed: u64 = queue.queues().await?.iter().map(|q| q.counts.completed).sum();
            let not_once = runs.iter().filter(|c| c.load(Ordering::Relaxed) != 1).count();
            let reported = report.completed;
            let check = if completed != n as u64 || reported != n as u64 || not_once > 0 {
                Err(format!(
                    "{completed} completed ({reported} by the worker), {not_once} jobs not run exactly once"
                ))
            } else {
                Ok(())
            };
            Ok(row(
                "W3",
                backend,
                DRAIN_CONCURRENCY,
                n,
                ops_per_sec,
                limit.name(db.backend()),
                raw.ops_per_sec,
                check,
            ))
        })
        .await
}

/// W6: latency from the start of an enqueue call to the start of its
/// handler, with wake-ups on (the worker's poll interval is 1 s, so only a
/// wake-up makes the latency small), vs the raw commit latency of one insert.
pub(crate) async fn latency(backend: &Backend, n: usize) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let raw = measure_limit(db, Limit::InsertCommit { producers: 1 }, 200).await?;
            let queue = Queue::connect(db.url()).await?;
            reset_peak_memory();
            let enqueued: Arc<Vec<Mutex<Option<Instant>>>> =
                Arc::new((0..n).map(|_| Mutex::new(None)).collect());
            let latencies = Arc::new(Mutex::new(Vec::with_capacity(n)));
            let all_ran = Arc::new(Notify::new());
            let bar = bar("W6 latency", n);
            let (e, l, a, b) = (
                enqueued.clone(),
                latencies.clone(),
                all_ran.clone(),
                bar.clone(),
            );
            let (stop, worker) = start_worker(&queue, 16, Duration::from_secs(1), move |i| {
                let at = e
                    .get(i)
                    .and_then(|m| *m.lock().unwrap_or_else(|p| p.into_inner()));
                let mut l = l.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(at) = at {
                    l.push(at.elapsed().as_secs_f64() * 1e3);
                }
                b.inc(1);
                if l.len() == n {
                    a.notify_one();
                }
            });
            // Let the worker set up its LISTEN before the first enqueue.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let start = Instant::now();
            for i in 0..n {
                *enqueued[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                queue
                    .enqueue(EnqueueRequest::new(NOOP).payload(json!({ "i": i })))
                    .await?;
                tokio::time::sleep(LATENCY_GAP).await;
            }
            let ran = tokio::time::timeout(Duration::from_secs(30), all_ran.notified()).await;
            let elapsed = start.elapsed();
            let _ = stop.send(());
            worker.await.context("the worker task failed")??;
            bar.finish_and_clear();
            let mut l = latencies.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let (p50, p99) = (percentile(&mut l, 0.5), percentile(&mut l, 0.99));
            let limit_p50 = raw.p50_ms.unwrap_or(0.0);
            let jobs = total_jobs(&queue).await?;
            let mut row = Row::rate(
                "W6",
                backend,
                1,
                n,
                rate(n, elapsed),
                format!(
                    "{} (p50)",
                    Limit::InsertCommit { producers: 1 }.name(db.backend())
                ),
                raw.ops_per_sec,
                None,
            );
            row.limit_ops_per_sec = None;
            row.ratio = Some(limit_p50 / p50.max(1e-9));
            row.p50_ms = Some(p50);
            row.p99_ms = Some(p99);
            row.limit_p50_ms = Some(limit_p50);
            row.target = Some("p50 <= 5 ms".into());
            row.met = Some(p50 <= 5.0);
            row.peak_rss_kib = peak_memory_kib();
            if ran.is_err() || l.len() != n || jobs != n as u64 {
                row.check = format!("FAILED: {} of {n} handlers started, {jobs} jobs", l.len());
            }
            Ok(row)
        })
        .await
}
