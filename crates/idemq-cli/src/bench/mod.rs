//! `idemq bench`: measures what idemq does against what the database under
//! it can do, in the same run on the same database. Every workload runs on a
//! fresh database (SQLite: a new file; PostgreSQL: a new database on the
//! URL's server, dropped afterwards; Redis: a new key prefix on the URL's
//! server, its keys deleted afterwards) and is reported next to the raw
//! limit of that database for the same shape of work, as a ratio.
//!
//! Files by concern: `target` makes and drops the fresh databases, `raw_pg`,
//! `raw_sqlite` and `raw_redis` measure the raw limits, `enqueue` and
//! `worker` run the idemq workloads, `report` prints rows and tracks memory.

mod enqueue;
mod http;
mod raw_pg;
mod raw_redis;
mod raw_sqlite;
mod report;
mod soak;
mod target;
mod worker;

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};

use crate::CliError;
pub(crate) use report::Row;
use target::{Backend, Fresh};

/// Arguments of `idemq bench` (the database is the global `--database`).
#[derive(clap::Args, Debug)]
pub(crate) struct BenchArgs {
    /// Small counts (a smoke run of a few seconds per backend).
    #[arg(long)]
    quick: bool,
    /// Run only these workloads (comma-separated: W1,W2,W3,W4,W4r,W5,W6, and
    /// W1h,W3h over HTTP; W3h runs W3 too, to compare with it).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// Instead of the workloads, a mixed load for this long (e.g. 10m),
    /// sampling memory, descriptors, connections, job rows and bindings;
    /// fails on unbounded growth.
    #[arg(long, value_parser = humantime::parse_duration, conflicts_with_all = ["quick", "only"])]
    soak: Option<Duration>,
}

/// Operation counts of one run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub single_1: usize,
    pub single_8: usize,
    pub batch: usize,
    pub drain: usize,
    pub dup_calls: usize,
    pub dup_keys: usize,
    pub storm_calls: usize,
    pub storm_keys: usize,
    pub latency_jobs: usize,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            Self {
                single_1: 200,
                single_8: 400,
                batch: 2_000,
                drain: 1_000,
                dup_calls: 1_000,
                dup_keys: 100,
                storm_calls: 800,
                storm_keys: 100,
                latency_jobs: 40,
            }
        } else {
            Self {
                single_1: 3_000,
                single_8: 8_000,
                batch: 50_000,
                drain: 20_000,
                dup_calls: 10_000,
                dup_keys: 1_000,
                storm_calls: 10_000,
                storm_keys: 100,
                latency_jobs: 500,
            }
        }
    }
}

/// Runs the bench and prints its rows.
pub(crate) async fn run(args: BenchArgs, database: &str, json: bool) -> Result<(), CliError> {
    bench(args, database, json).await.map_err(|e| {
        CliError::Lib(idemq::Error::Backend {
            message: format!("bench: {e:#}"),
        })
    })
}

async fn bench(args: BenchArgs, database: &str, json: bool) -> Result<()> {
    let backend = Backend::connect(database).await?;
    if let Some(duration) = args.soak {
        return soak::run(&backend, duration, json).await;
    }
    // Figures from an unoptimised build say nothing about idemq: a full run
    // needs a release build; a smoke run (--quick) checks correctness only.
    if cfg!(debug_assertions) && !args.quick {
        bail!(
            "this idemq is a debug build, whose figures are not comparable with anything; \
             build it with `cargo build --release -p idemq-cli` and run ./target/release/idemq bench \
             (or pass --quick for a smoke run that checks correctness only)"
        );
    }
    let sizes = Sizes::new(args.quick);
    let wanted =
        |name: &str| args.only.is_empty() || args.only.iter().any(|o| o.eq_ignore_ascii_case(name));
    let known = ["W1", "W2", "W3", "W4", "W4r", "W5", "W6", "W1h", "W3h"];
    if let Some(bad) = args
        .only
        .iter()
        .find(|o| !known.iter().any(|k| k.eq_ignore_ascii_case(o)))
    {
        bail!("unknown workload {bad} (known: {})", known.join(","));
    }
    let out = report::Printer::new(json);
    out.header(&backend, &sizes);
    let mut rows: Vec<Row> = Vec::new();
    let emit = |row: Row, rows: &mut Vec<Row>| {
        out.row(&row);
        rows.push(row);
    };
    if wanted("W1") {
        for producers in [1, 8] {
            let ops = if producers == 1 {
                sizes.single_1
            } else {
                sizes.single_8
            };
            emit(enqueue::single(&backend, producers, ops).await?, &mut rows);
        }
    }
    if wanted("W2") {
        emit(enqueue::batch(&backend, sizes.batch).await?, &mut rows);
    }
    // W3h compares with the library's W3 of the same run, so it runs W3 too.
    let mut library_drain = None;
    if wanted("W3") || wanted("W3h") {
        let row = worker::drain(&backend, sizes.drain).await?;
        library_drain = Some(row.ops_per_sec);
        emit(row, &mut rows);
    }
    if wanted("W4") {
        for producers in [1, 8] {
            let row = enqueue::duplicates(&backend, producers, sizes.dup_calls, sizes.dup_keys);
            emit(row.await?, &mut rows);
        }
    }
    if wanted("W4r") {
        for producers in [1, 8] {
            let row = enqueue::replay(&backend, producers, sizes.dup_calls, sizes.dup_keys);
            emit(row.await?, &mut rows);
        }
    }
    if wanted("W5") {
        let row = enqueue::storm(&backend, 8, sizes.storm_calls, sizes.storm_keys);
        emit(row.await?, &mut rows);
    }
    if wanted("W6") {
        emit(
            worker::latency(&backend, sizes.latency_jobs).await?,
            &mut rows,
        );
    }
    if wanted("W1h") {
        emit(http::enqueue(&backend, sizes.single_8).await?, &mut rows);
    }
    if let Some(library) = library_drain.filter(|_| wanted("W3h")) {
        emit(
            http::drain(&backend, sizes.drain, library).await?,
            &mut rows,
        );
    }
    out.table(&rows);
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| r.check != "ok")
        .map(|r| r.workload)
        .collect();
    if !failed.is_empty() {
        bail!("correctness checks failed: {}", failed.join(", "));
    }
    Ok(())
}

/// A progress bar of `len` operations (drawn on stderr, hidden when it is
/// not a terminal).
pub(crate) fn bar(name: &str, len: usize) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    let style = ProgressStyle::with_template("{prefix:>12} [{bar:30}] {pos}/{len} {per_sec} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    bar.set_style(style);
    bar.set_prefix(name.to_owned());
    bar
}

/// Runs the calls of `range` over `producers` concurrent tasks; call `i`
/// goes to producer `i % producers`, so calls on one key (keyed by `i`
/// modulo the key count) come from different producers at once. Returns the
/// wall time from the first call to the last answer.
pub(crate) async fn drive<F, Fut>(
    producers: usize,
    range: Range<usize>,
    bar: &ProgressBar,
    call: F,
) -> Result<Duration>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    let call = Arc::new(call);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for p in 0..producers {
        let (call, bar, end) = (call.clone(), bar.clone(), range.end);
        let mut i = range.start + p;
        tasks.spawn(async move {
            while i < end {
                call(i).await?;
                bar.inc(1);
                i += producers;
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.context("a producer task failed")??;
    }
    Ok(start.elapsed())
}

/// Rounds a paired measurement of single calls alternates over: the raw
/// limit and idemq take turns on slices of the work, so load from elsewhere
/// on the machine (fsync latency on a shared disk varies many-fold from one
/// second to the next) hits both alike.
pub(crate) const ROUNDS: usize = 20;

/// The slices of `0..ops` of `rounds` paired rounds.
pub(crate) fn slices(ops: usize, rounds: usize) -> Vec<Range<usize>> {
    let rounds = rounds.clamp(1, ops.max(1));
    (0..rounds)
        .map(|r| r * ops / rounds..(r + 1) * ops / rounds)
        .collect()
}

/// Measures `limit` and idemq's `run` on the same database, in alternating
/// slices of `0..ops`; returns the raw measurement and idemq's rate.
pub(crate) async fn paired<F>(
    db: &Fresh,
    limit: Limit,
    ops: usize,
    rounds: usize,
    name: &str,
    mut run: F,
) -> Result<(Measured, f64)>
where
    F: AsyncFnMut(Range<usize>, &ProgressBar) -> Result<Duration>,
{
    let raw_bar = bar(&limit.name(db.backend()), ops);
    let idemq_bar = bar(name, ops);
    let raw = Raw::open(db, limit).await?;
    let (mut raw_time, mut idemq_time) = (Duration::ZERO, Duration::ZERO);
    let mut out = Ok(());
    for slice in slices(ops, rounds) {
        match raw.run(slice.clone(), &raw_bar).await {
            Ok(t) => raw_time += t,
            Err(e) => {
                out = Err(e);
                break;
            }
        }
        reset_peak_memory_once(&slice);
        match run(slice, &idemq_bar).await {
            Ok(t) => idemq_time += t,
            Err(e) => {
                out = Err(e);
                break;
            }
        }
    }
    let p50 = raw.close().await;
    raw_bar.finish_and_clear();
    idemq_bar.finish_and_clear();
    out?;
    Ok((
        Measured {
            ops_per_sec: rate(ops, raw_time),
            p50_ms: p50?,
        },
        rate(ops, idemq_time),
    ))
}

/// The peak memory of a paired workload counts from its first idemq slice.
fn reset_peak_memory_once(slice: &Range<usize>) {
    if slice.start == 0 {
        report::reset_peak_memory();
    }
}

/// A raw limit being measured: its scratch tables exist until `close`.
pub(crate) enum Raw {
    Postgres(raw_pg::Raw),
    Sqlite(raw_sqlite::Raw),
    Redis(raw_redis::Raw),
}

impl Raw {
    pub(crate) async fn open(db: &Fresh, limit: Limit) -> Result<Self> {
        Ok(match db {
            Fresh::Postgres { url, .. } => Self::Postgres(raw_pg::Raw::open(url, limit).await?),
            Fresh::Sqlite { path, .. } => Self::Sqlite(raw_sqlite::Raw::open(path, limit).await?),
            Fresh::Redis { driver, prefix, .. } => {
                Self::Redis(raw_redis::Raw::open(driver, prefix, limit).await?)
            }
        })
    }

    /// Runs the slice `range` of the work; returns its timed part.
    pub(crate) async fn run(&self, range: Range<usize>, bar: &ProgressBar) -> Result<Duration> {
        match self {
            Self::Postgres(r) => r.run(range, bar).await,
            Self::Sqlite(r) => r.run(range, bar).await,
            Self::Redis(r) => r.run(range, bar).await,
        }
    }

    /// Drops the scratch tables; returns the median single-insert latency
    /// (one producer) when that was measured.
    pub(crate) async fn close(self) -> Result<Option<f64>> {
        match self {
            Self::Postgres(r) => r.close().await,
            Self::Sqlite(r) => r.close().await,
            Self::Redis(r) => r.close().await,
        }
    }
}

/// `n` operations in `elapsed`, per second.
pub(crate) fn rate(n: usize, elapsed: Duration) -> f64 {
    n as f64 / elapsed.as_secs_f64().max(1e-9)
}

/// What a workload compares against: a raw limit of the database. The
/// shapes are SQL's; on Redis each is the command a minimal queue on Redis
/// would send instead (`raw_redis`).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Limit {
    /// Single-row `INSERT`, each its own transaction, over `producers`
    /// connections (Redis: `SET`).
    InsertCommit { producers: usize },
    /// Multi-row `INSERT`s of 1,000 rows (Redis: `RPUSH` of 1,000 values).
    MultiRow,
    /// The two-step loop of a minimal at-least-once queue until every job
    /// is done: claim 100 due jobs (one transaction, `UPDATE … SKIP
    /// LOCKED`), then mark them done (a second transaction). Redis: 100
    /// `LMOVE`s to a processing list in one round trip, then 100 `LREM`s
    /// in a second.
    ClaimComplete,
    /// `INSERT … ON CONFLICT DO NOTHING` over `keys` keys (Redis: `SET … NX`).
    OnConflict { producers: usize, keys: usize },
    /// The same over `keys` keys that all exist already (filled before the
    /// clock starts): every statement finds its key and writes nothing.
    OnConflictNoop { producers: usize, keys: usize },
    /// `INSERT … ON CONFLICT DO UPDATE` (a counter) over `keys` keys
    /// (Redis: `INCR`).
    Upsert { producers: usize, keys: usize },
}

impl Limit {
    /// The name printed beside the workload on `backend` (`Backend::name`).
    pub(crate) fn name(self, backend: &str) -> String {
        if backend == "redis" {
            return match self {
                Self::InsertCommit { producers } => format!("raw SET x{producers}"),
                Self::MultiRow => "raw RPUSH of 1,000".into(),
                Self::ClaimComplete => "raw LMOVE-100 + LREM".into(),
                Self::OnConflict { producers, .. } => format!("raw SET NX x{producers}"),
                Self::OnConflictNoop { producers, .. } => format!("raw SET NX no-op x{producers}"),
                Self::Upsert { producers, .. } => format!("raw INCR x{producers}"),
            };
        }
        match self {
            Self::InsertCommit { producers } => format!("raw insert commit x{producers}"),
            Self::MultiRow => "raw multi-row insert".into(),
            Self::ClaimComplete => "raw claim-100 + complete".into(),
            Self::OnConflict { producers, .. } => format!("raw on-conflict-nothing x{producers}"),
            Self::OnConflictNoop { producers, .. } => {
                format!("raw on-conflict no-op x{producers}")
            }
            Self::Upsert { producers, .. } => format!("raw upsert x{producers}"),
        }
    }
}

/// A raw measurement: a rate and, for single inserts on one connection, the
/// median commit latency.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Measured {
    pub ops_per_sec: f64,
    pub p50_ms: Option<f64>,
}

/// Measures `limit` alone with `ops` operations on the fresh database `db`.
pub(crate) async fn measure_limit(db: &Fresh, limit: Limit, ops: usize) -> Result<Measured> {
    let bar = bar(&limit.name(db.backend()), ops);
    let raw = Raw::open(db, limit).await?;
    let timed = raw.run(0..ops, &bar).await;
    let p50 = raw.close().await;
    bar.finish_and_clear();
    Ok(Measured {
        ops_per_sec: rate(ops, timed?),
        p50_ms: p50?,
    })
}
