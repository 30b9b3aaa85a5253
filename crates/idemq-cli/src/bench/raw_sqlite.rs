//! The raw limits of SQLite, measured through rusqlite on the bench file with
//! the pragmas idemq uses (WAL, `synchronous=FULL`), each write one
//! `BEGIN IMMEDIATE` transaction, in scratch tables dropped afterwards.
//!
//! SQLite has one writer: "8 producers" are 8 threads sharing one
//! connection, the way idemq's store serializes its writes in-process (8
//! connections would only add busy-handler sleeps).

use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use indicatif::ProgressBar;
use rusqlite::{Connection, TransactionBehavior, params};

use super::Limit;
use super::raw_pg::median;

const SETUP: &str = "
    CREATE TABLE bench_raw (
        id INTEGER PRIMARY KEY, k TEXT NOT NULL, payload TEXT NOT NULL, created_at INTEGER NOT NULL);
    CREATE TABLE bench_keys (k TEXT PRIMARY KEY, job TEXT NOT NULL, n INTEGER NOT NULL DEFAULT 1);
    CREATE TABLE bench_queue (id INTEGER PRIMARY KEY, queue TEXT NOT NULL DEFAULT 'default',
        state INTEGER NOT NULL DEFAULT 0, payload TEXT NOT NULL, run_at INTEGER NOT NULL DEFAULT 0,
        locked_by INTEGER);
    CREATE INDEX bench_queue_fetch ON bench_queue (queue, run_at, id) WHERE state = 0;";
const TEARDOWN: &str = "DROP TABLE IF EXISTS bench_raw; DROP TABLE IF EXISTS bench_keys;
                        DROP TABLE IF EXISTS bench_queue;";

fn open(path: &Path) -> Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
    anyhow::ensure!(mode.eq_ignore_ascii_case("wal"), "cannot enable WAL");
    conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")?;
    Ok(conn)
}

fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// A raw limit being measured on one connection.
pub(crate) struct Raw {
    conn: Arc<Mutex<Connection>>,
    limit: Limit,
    latencies: Arc<Mutex<Vec<f64>>>,
}

impl Raw {
    pub(crate) async fn open(path: &Path, limit: Limit) -> Result<Self> {
        let path = path.to_path_buf();
        let conn = blocking(move || {
            let conn = open(&path)?;
            conn.execute_batch(SETUP)?;
            Ok(conn)
        })
        .await?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            limit,
            latencies: Arc::default(),
        })
    }

    pub(crate) async fn close(self) -> Result<Option<f64>> {
        let conn = self.conn.clone();
        blocking(move || Ok(lock(&conn).execute_batch(TEARDOWN)?)).await?;
        let mut l = self.latencies.lock().unwrap_or_else(|p| p.into_inner());
        Ok((!l.is_empty()).then(|| median(&mut l)))
    }

    pub(crate) async fn run(&self, range: Range<usize>, bar: &ProgressBar) -> Result<Duration> {
        let (conn, limit, lat, bar) = (
            self.conn.clone(),
            self.limit,
            self.latencies.clone(),
            bar.clone(),
        );
        blocking(move || run(&conn, limit, range, &bar, &lat)).await
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .context("the SQLite bench thread failed")?
}

fn lock(m: &Mutex<Connection>) -> std::sync::MutexGuard<'_, Connection> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One `BEGIN IMMEDIATE` transaction running `f`.
fn tx<T>(conn: &Mutex<Connection>, f: impl FnOnce(&Connection) -> Result<T>) -> Result<T> {
    let mut conn = lock(conn);
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let out = f(&tx)?;
    tx.commit()?;
    Ok(out)
}

/// The calls of `range` over `threads` threads (call `i` on thread `i % threads`).
fn threads(
    threads: usize,
    range: Range<usize>,
    bar: &ProgressBar,
    f: impl Fn(usize) -> Result<()> + Send + Sync,
) -> Result<Duration> {
    let start = Instant::now();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let f = &f;
                let end = range.end;
                s.spawn(move || {
                    let mut i = range.start + t;
                    while i < end {
                        f(i)?;
                        bar.inc(1);
                        i += threads;
                    }
                    Ok::<_, anyhow::Error>(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(|h| {
            h.join()
                .map_err(|_| anyhow::anyhow!("a bench thread panicked"))?
        })
    })?;
    Ok(start.elapsed())
}

fn run(
    conn: &Mutex<Connection>,
    limit: Limit,
    range: Range<usize>,
    bar: &ProgressBar,
    latencies: &Mutex<Vec<f64>>,
) -> Result<Duration> {
    match limit {
        Limit::InsertCommit { producers } => threads(producers, range, bar, |i| {
            let t = Instant::now();
            tx(conn, |c| {
                c.prepare_cached(
                    "INSERT INTO bench_raw (k, payload, created_at) VALUES (?1, ?2, ?3)",
                )?
                .execute(params![
                    format!("k{i}"),
                    format!("{{\"i\":{i}}}"),
                    now_us()
                ])?;
                Ok(())
            })?;
            if producers == 1 {
                latencies
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(t.elapsed().as_secs_f64() * 1e3);
            }
            Ok(())
        }),
        Limit::MultiRow => {
            let start = Instant::now();
            let mut done = range.start;
            while done < range.end {
                let n = (range.end - done).min(1000);
                tx(conn, |c| {
                    let mut st = c.prepare_cached(
                        "INSERT INTO bench_raw (k, payload, created_at) VALUES (?1, ?2, ?3)",
                    )?;
                    for i in done..done + n {
                        st.execute(params![format!("k{i}"), format!("{{\"i\":{i}}}"), now_us()])?;
                    }
                    Ok(())
                })?;
                done += n;
                bar.inc(n as u64);
            }
            Ok(start.elapsed())
        }
        Limit::ClaimComplete => {
            // Filling the table is not timed; claiming it empty is.
            tx(conn, |c| {
                let mut st = c.prepare("INSERT INTO bench_queue (payload) VALUES (?1)")?;
                for i in range.clone() {
                    st.execute([format!("{{\"i\":{i}}}")])?;
                }
                Ok(())
            })?;
            let start = Instant::now();
            loop {
                // Claim (a transaction), then complete (another).
                let ids = tx(conn, |c| {
                    let mut st = c.prepare_cached(
                        "UPDATE bench_queue SET state = 1, locked_by = 1 WHERE id IN (
                             SELECT id FROM bench_queue
                             WHERE queue = 'default' AND state = 0 AND run_at <= ?1
                             ORDER BY run_at, id LIMIT 100)
                         RETURNING id",
                    )?;
                    let rows = st.query_map([now_us()], |r| r.get::<_, i64>(0))?;
                    Ok(rows.collect::<Result<Vec<_>, _>>()?)
                })?;
                if ids.is_empty() {
                    break;
                }
                tx(conn, |c| {
                    let mut st = c.prepare_cached(
                        "UPDATE bench_queue SET state = 2, locked_by = NULL WHERE id = ?1",
                    )?;
                    for id in &ids {
                        st.execute([id])?;
                    }
                    Ok(())
                })?;
                bar.inc(ids.len() as u64);
            }
            Ok(start.elapsed())
        }
        Limit::OnConflict { producers, keys }
        | Limit::OnConflictNoop { producers, keys }
        | Limit::Upsert { producers, keys } => {
            if matches!(limit, Limit::OnConflictNoop { .. }) {
                // Every key present before the clock starts.
                tx(conn, |c| {
                    let mut st = c.prepare(
                        "INSERT INTO bench_keys (k, job) VALUES (?1, ?2) ON CONFLICT DO NOTHING",
                    )?;
                    for k in 0..keys {
                        st.execute(params![format!("key-{k}"), format!("job-{k}")])?;
                    }
                    Ok(())
                })?;
            }
            let sql = if matches!(limit, Limit::Upsert { .. }) {
                "INSERT INTO bench_keys (k, job) VALUES (?1, ?2)
                 ON CONFLICT (k) DO UPDATE SET n = n + 1"
            } else {
                "INSERT INTO bench_keys (k, job) VALUES (?1, ?2) ON CONFLICT DO NOTHING"
            };
            threads(producers, range, bar, |i| {
                tx(conn, |c| {
                    c.prepare_cached(sql)?
                        .execute(params![format!("key-{}", i % keys), format!("job-{i}")])?;
                    Ok(())
                })
            })
        }
    }
}
