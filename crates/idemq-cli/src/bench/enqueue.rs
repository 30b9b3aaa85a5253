//! The producer workloads: W1 single enqueue, W2 batch enqueue, W4
//! idempotent enqueue with duplicates, W4r pure replays, W5 debounce storm.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use idemq::{BatchOptions, DedupeOptions, EnqueueRequest, Queue};
use serde_json::json;

use super::report::{Row, peak_memory_kib};
use super::target::Backend;
use indicatif::ProgressBar;

use super::{Limit, ROUNDS, drive, paired};

/// The job type of every bench job (a no-op).
pub(crate) const NOOP: &str = "bench.noop";

/// Every job of the database, in every state.
pub(crate) async fn total_jobs(queue: &Queue) -> Result<u64> {
    Ok(queue
        .queues()
        .await?
        .iter()
        .map(|q| {
            let c = &q.counts;
            c.scheduled + c.ready + c.active + c.completed + c.dead + c.cancelled
        })
        .sum())
}

fn plain(i: usize) -> EnqueueRequest {
    EnqueueRequest::new(NOOP).payload(json!({ "i": i }))
}

fn keyed(key: usize) -> EnqueueRequest {
    EnqueueRequest::new(NOOP)
        .payload(json!({ "k": key }))
        .idempotency_key(format!("key-{key}"))
}

/// The targets (docs/benchmarks.md), as minimum ratios. Redis has none:
/// its target is to be ahead of BullMQ on the same server, which the bench
/// cannot measure.
fn target(workload: &str, backend: &Backend, producers: usize) -> Option<f64> {
    let pg = matches!(backend, Backend::Postgres { .. });
    let sqlite = matches!(backend, Backend::Sqlite { .. });
    match (workload, producers) {
        ("W1", 1) if pg || sqlite => Some(0.8),
        ("W1", _) if pg => Some(0.6),
        ("W2", _) if pg => Some(0.4),
        ("W3", _) if pg => Some(0.5),
        ("W3", _) if sqlite => Some(0.4),
        ("W4", 8) if pg => Some(1.0),
        ("W4r", _) if pg => Some(1.0),
        ("W1h", _) if pg => Some(0.8),
        ("W3h", _) if pg => Some(0.5),
        _ => None,
    }
}

/// A row with its target, memory and check filled in.
#[allow(clippy::too_many_arguments)]
pub(crate) fn row(
    workload: &'static str,
    backend: &Backend,
    producers: usize,
    ops: usize,
    ops_per_sec: f64,
    limit: String,
    limit_ops_per_sec: f64,
    check: std::result::Result<(), String>,
) -> Row {
    let mut row = Row::rate(
        workload,
        backend,
        producers,
        ops,
        ops_per_sec,
        limit,
        limit_ops_per_sec,
        target(workload, backend, producers),
    );
    row.peak_rss_kib = peak_memory_kib();
    if let Err(e) = check {
        row.check = format!("FAILED: {e}");
    }
    row
}

fn expect(what: &str, got: u64, want: usize) -> std::result::Result<(), String> {
    if got == want as u64 {
        Ok(())
    } else {
        Err(format!("{got} {what}, expected {want}"))
    }
}

/// Single enqueues of the calls of `range`, each its own transaction,
/// over `producers` tasks.
async fn enqueue_each(
    queue: &Queue,
    producers: usize,
    range: std::ops::Range<usize>,
    bar: &ProgressBar,
    request: fn(usize) -> EnqueueRequest,
) -> Result<Duration> {
    let q = queue.clone();
    drive(producers, range, bar, move |i| {
        let q = q.clone();
        async move {
            q.enqueue(request(i)).await?;
            Ok(())
        }
    })
    .await
}

/// W1: single enqueue vs single-row insert commits.
pub(crate) async fn single(backend: &Backend, producers: usize, ops: usize) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let limit = Limit::InsertCommit { producers };
            let queue = Queue::connect(db.url()).await?;
            let name = format!("W1 x{producers}");
            let (raw, ops_per_sec) = paired(db, limit, ops, ROUNDS, &name, async |range, bar| {
                enqueue_each(&queue, producers, range, bar, plain).await
            })
            .await?;
            let check = expect("jobs", total_jobs(&queue).await?, ops);
            Ok(row(
                "W1",
                backend,
                producers,
                ops,
                ops_per_sec,
                limit.name(db.backend()),
                raw.ops_per_sec,
                check,
            ))
        })
        .await
}

/// W2: `enqueue_many` in batches of 1,000 vs multi-row inserts.
pub(crate) async fn batch(backend: &Backend, ops: usize) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let limit = Limit::MultiRow;
            let queue = Queue::connect(db.url()).await?;
            let (raw, ops_per_sec) = paired(
                db,
                limit,
                ops,
                (ops / 1000).clamp(1, 10),
                "W2 batches",
                async |range, bar| {
                    let start = Instant::now();
                    let mut done = range.start;
                    while done < range.end {
                        let n = (range.end - done).min(1000);
                        let reqs = (done..done + n).map(plain).collect();
                        for r in queue.enqueue_many(reqs, BatchOptions::default()).await? {
                            r?;
                        }
                        done += n;
                        bar.inc(n as u64);
                    }
                    Ok(start.elapsed())
                },
            )
            .await?;
            let check = expect("jobs", total_jobs(&queue).await?, ops);
            Ok(row(
                "W2",
                backend,
                1,
                ops,
                ops_per_sec,
                limit.name(db.backend()),
                raw.ops_per_sec,
                check,
            ))
        })
        .await
}

/// W4: `calls` idempotent enqueues over `keys` keys, each key `calls/keys`
/// times, interleaved, vs `INSERT … ON CONFLICT DO NOTHING`; exactly `keys`
/// jobs must exist afterwards.
pub(crate) async fn duplicates(
    backend: &Backend,
    producers: usize,
    calls: usize,
    keys: usize,
) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let limit = Limit::OnConflict { producers, keys };
            let queue = Queue::connect(db.url()).await?;
            let name = format!("W4 x{producers}");
            let (raw, ops_per_sec) = paired(db, limit, calls, ROUNDS, &name, async |range, bar| {
                let q = queue.clone();
                drive(producers, range, bar, move |i| {
                    let q = q.clone();
                    async move {
                        q.enqueue(keyed(i % keys)).await?;
                        Ok(())
                    }
                })
                .await
            })
            .await?;
            let check = expect("jobs", total_jobs(&queue).await?, keys);
            Ok(row(
                "W4",
                backend,
                producers,
                calls,
                ops_per_sec,
                limit.name(db.backend()),
                raw.ops_per_sec,
                check,
            ))
        })
        .await
}

/// W4r: replays only (every key already bound), vs idemq's own single
/// enqueue at the same producer count (`w1`, measured here when absent).
pub(crate) async fn replay(
    backend: &Backend,
    producers: usize,
    calls: usize,
    keys: usize,
) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let limit = Limit::OnConflictNoop { producers, keys };
            let queue = Queue::connect(db.url()).await?;
            for chunk in (0..keys).collect::<Vec<_>>().chunks(1000) {
                let reqs = chunk.iter().map(|&k| keyed(k)).collect();
                for r in queue.enqueue_many(reqs, BatchOptions::default()).await? {
                    r?;
                }
            }
            let name = format!("W4r x{producers}");
            let (raw, ops_per_sec) = paired(db, limit, calls, ROUNDS, &name, async |range, bar| {
                let q = queue.clone();
                drive(producers, range, bar, move |i| {
                    let q = q.clone();
                    async move {
                        let r = q.enqueue_with_result(keyed(i % keys)).await?;
                        ensure!(r.outcome == idemq::Outcome::Replayed, "not a replay");
                        Ok(())
                    }
                })
                .await
            })
            .await?;
            let check = expect("jobs", total_jobs(&queue).await?, keys);
            Ok(row(
                "W4r",
                backend,
                producers,
                calls,
                ops_per_sec,
                limit.name(db.backend()),
                raw.ops_per_sec,
                check,
            ))
        })
        .await
}

/// W5: `producers` producers hammering `keys` debounce keys, vs an upsert
/// of a counter over as many keys; exactly `keys` jobs must exist.
pub(crate) async fn storm(
    backend: &Backend,
    producers: usize,
    calls: usize,
    keys: usize,
) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let limit = Limit::Upsert { producers, keys };
            let queue = Queue::connect(db.url()).await?;
            let name = format!("W5 x{producers}");
            let (raw, ops_per_sec) = paired(db, limit, calls, ROUNDS, &name, async |range, bar| {
                let q = queue.clone();
                drive(producers, range, bar, move |i| {
                    let q = q.clone();
                    async move {
                        let dedupe = DedupeOptions::key(format!("d{}", i % keys))
                            .ttl(Duration::from_secs(3600))
                            .extend();
                        q.enqueue(plain(i).dedupe(dedupe)).await?;
                        Ok(())
                    }
                })
                .await
            })
            .await?;
            let check = expect("jobs", total_jobs(&queue).await?, keys);
            Ok(row(
                "W5",
                backend,
                producers,
                calls,
                ops_per_sec,
                limit.name(db.backend()),
                raw.ops_per_sec,
                check,
            ))
        })
        .await
}
