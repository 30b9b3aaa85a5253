//! `idemq bench --soak DURATION`: a mixed load (idempotent enqueues, half of
//! them replays; a worker draining; the maintenance loop sweeping) for a
//! long time, sampling what could grow without bound: resident memory, open
//! file descriptors, database connections, job rows and idempotency
//! bindings. Jobs keep 1 s after they finish and keys bind for 2 s, so a
//! healthy run reaches a steady state within seconds; the run fails when the
//! last third of the samples stands clearly above the middle third.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use idemq::worker::{HandlerContext, JobError, Maintenance, Worker};
use idemq::{EnqueueRequest, IdempotencyOptions, Queue};
use serde_json::{Value, json};
use sqlx::Connection as _;

use super::target::{Backend, Fresh};

/// One sample of the soak.
#[derive(Clone, Copy, Debug, serde::Serialize)]
struct Sample {
    secs: u64,
    enqueues: u64,
    completed: u64,
    rss_kib: u64,
    fds: u64,
    connections: i64,
    jobs: u64,
    bindings: i64,
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn open_fds() -> u64 {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count() as u64)
}

/// (connections, idempotency bindings) as the database counts them.
async fn database_counts(db: &Fresh) -> Result<(i64, i64)> {
    match db {
        Fresh::Postgres { url, .. } => {
            let mut conn = sqlx::PgConnection::connect(url).await?;
            let connections: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()",
            )
            .fetch_one(&mut conn)
            .await?;
            let bindings: i64 = sqlx::query_scalar("SELECT count(*) FROM idemq.idempotency")
                .fetch_one(&mut conn)
                .await?;
            conn.close().await.ok();
            // Not counting the connection that asked.
            Ok((connections - 1, bindings))
        }
        Fresh::Sqlite { path, .. } => {
            let path = path.clone();
            let bindings = tokio::task::spawn_blocking(move || -> Result<i64> {
                let conn = rusqlite::Connection::open_with_flags(
                    &path,
                    rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY,
                )?;
                Ok(conn.query_row("SELECT count(*) FROM idemq_idempotency", [], |r| r.get(0))?)
            })
            .await??;
            // Connections of an embedded database are file descriptors.
            Ok((0, bindings))
        }
        Fresh::Redis { driver, prefix, .. } => {
            let mut conn = super::raw_redis::connect(driver).await?;
            // Every client of the server: the bench runs on a server of its own.
            let connections = super::raw_redis::other_clients(&mut conn).await?;
            let bindings =
                super::raw_redis::count_matching(&mut conn, &format!("{prefix}idem:*")).await?;
            Ok((connections, bindings as i64))
        }
    }
}

/// Runs the soak for `duration` and prints a line per sample.
pub(crate) async fn run(backend: &Backend, duration: Duration, json: bool) -> Result<()> {
    let outcome = backend
        .with_fresh(async |db| soak(db, duration, json).await)
        .await?;
    if !json {
        println!("{outcome}");
    }
    Ok(())
}

async fn soak(db: &Fresh, duration: Duration, json: bool) -> Result<String> {
    let queue = Queue::connect(db.url()).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let enqueues = Arc::new(AtomicU64::new(0));
    let completed = Arc::new(AtomicU64::new(0));

    let mut producers = tokio::task::JoinSet::new();
    for p in 0..4u64 {
        let (queue, stop, enqueues) = (queue.clone(), stop.clone(), enqueues.clone());
        producers.spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Each key is sent twice: an acceptance, then a replay.
                let key = format!("soak-{p}-{}", i / 2);
                let req = EnqueueRequest::new("soak.noop")
                    .payload(json!({ "n": i / 2 }))
                    .keep(Duration::from_secs(1))
                    .idempotency(IdempotencyOptions::new(key).ttl(Duration::from_secs(2)));
                queue.enqueue(req).await?;
                enqueues.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    let done = completed.clone();
    let worker = Worker::new(queue.clone())
        .concurrency(16)
        .maintenance(false)
        .poll_interval(Duration::from_millis(100))
        .handle("soak.noop", move |_ctx: HandlerContext, _p: Value| {
            done.fetch_add(1, Ordering::Relaxed);
            async move { Ok::<_, JobError>(()) }
        });
    let (worker_stop, worker_stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(worker.run(async move {
        let _ = worker_stopped.await;
    }));
    let (maintenance_stop, maintenance_stopped) = tokio::sync::watch::channel(false);
    let maintenance = tokio::spawn(Maintenance::new(queue.clone()).run_until(maintenance_stopped));

    let every = (duration / 20).clamp(Duration::from_secs(1), Duration::from_secs(30));
    let start = Instant::now();
    let mut samples: Vec<Sample> = Vec::new();
    if !json {
        println!(
            "{:>6} {:>10} {:>10} {:>8} {:>5} {:>6} {:>8} {:>9}",
            "secs", "enqueues", "completed", "rss MiB", "fds", "conns", "jobs", "bindings"
        );
    }
    while start.elapsed() < duration {
        tokio::time::sleep(every.min(duration.saturating_sub(start.elapsed()))).await;
        // A producer that failed ends the run at once.
        if let Some(failed) = producers.try_join_next() {
            failed??;
            bail!("a producer stopped early");
        }
        let (connections, bindings) = database_counts(db).await?;
        let queues = queue.queues().await?;
        let jobs = queues.iter().map(|q| {
            let c = &q.counts;
            c.scheduled + c.ready + c.active + c.completed + c.dead + c.cancelled
        });
        let s = Sample {
            secs: start.elapsed().as_secs(),
            enqueues: enqueues.load(Ordering::Relaxed),
            completed: completed.load(Ordering::Relaxed),
            rss_kib: rss_kib(),
            fds: open_fds(),
            connections,
            jobs: jobs.sum(),
            bindings,
        };
        if json {
            println!("{}", serde_json::to_string(&s)?);
        } else {
            println!(
                "{:>6} {:>10} {:>10} {:>8.1} {:>5} {:>6} {:>8} {:>9}",
                s.secs,
                s.enqueues,
                s.completed,
                s.rss_kib as f64 / 1024.0,
                s.fds,
                s.connections,
                s.jobs,
                s.bindings
            );
        }
        samples.push(s);
    }
    stop.store(true, Ordering::Relaxed);
    while let Some(p) = producers.join_next().await {
        p??;
    }
    let _ = worker_stop.send(());
    worker.await??;
    let _ = maintenance_stop.send(true);
    maintenance.await?;
    verdict(&samples)
}

/// Flat when the median of the last third of the samples stays within 25%
/// (plus a small absolute slack) of the median of the middle third, for
/// every measure: a spike that drains again is load, a level that keeps
/// rising is growth.
fn verdict(samples: &[Sample]) -> Result<String> {
    if samples.len() < 6 {
        return Ok(format!(
            "soak: {} samples, too few to judge growth",
            samples.len()
        ));
    }
    let third = samples.len() / 3;
    let (middle, last) = (&samples[third..2 * third], &samples[2 * third..]);
    let measures: [Measure; 5] = [
        ("rss", |s| s.rss_kib as f64, 8192.0),
        ("fds", |s| s.fds as f64, 8.0),
        ("connections", |s| s.connections as f64, 4.0),
        ("jobs", |s| s.jobs as f64, 2000.0),
        ("bindings", |s| s.bindings as f64, 2000.0),
    ];
    let mut growing = Vec::new();
    for (name, get, slack) in measures {
        let (before, after) = (median(middle, get), median(last, get));
        if after > before * 1.25 + slack {
            growing.push(format!("{name} {before:.0} -> {after:.0}"));
        }
    }
    let ops = samples.last().map_or(0, |s| s.enqueues);
    if growing.is_empty() {
        Ok(format!(
            "soak: {ops} enqueues, {} samples: memory, descriptors, connections, jobs and bindings stay flat",
            samples.len()
        ))
    } else {
        bail!("soak: unbounded growth in {}", growing.join(", "))
    }
}

/// A name, how to read it from a sample, and the absolute slack allowed.
type Measure = (&'static str, fn(&Sample) -> f64, f64);

fn median(samples: &[Sample], get: fn(&Sample) -> f64) -> f64 {
    let mut v: Vec<f64> = samples.iter().map(get).collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
