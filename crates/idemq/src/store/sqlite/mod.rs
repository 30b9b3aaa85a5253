//! The embedded SQLite backend.
//!
//! One file, zero setup. The database runs in WAL mode with
//! `synchronous=FULL`, so a transaction that committed survives a crash of
//! the process or the machine (NORMAL could lose the last commits on power
//! loss). All writes go through one connection, each operation one
//! `BEGIN IMMEDIATE` transaction: SQLite allows one writer at a time, and
//! taking the write lock up front means the busy timeout applies instead of an
//! immediate `SQLITE_BUSY` on a read-then-write upgrade. Reads use a small set
//! of separate connections, which WAL lets run beside the writer. Several
//! processes may share one file (a worker and a server, say): they queue on
//! the file lock for up to the busy timeout.
//!
//! Writes are committed in groups: the write thread takes every write
//! queued behind the one it starts with (up to 256), runs each in a
//! savepoint of one `BEGIN IMMEDIATE` transaction (a write that fails rolls
//! back its own savepoint only, exactly as if it had run alone), commits
//! once and only then answers them all. Under concurrent load one fsync
//! acknowledges many writes; a lone write is a group of one. WAL
//! checkpoints run on a thread of their own (`PASSIVE`, every 200 ms)
//! instead of inside whichever commit crossed the automatic threshold.
//!
//! The clock of record is the injectable [`Clock`]: every decision of one
//! operation reads it once, after the write lock is taken.

mod admin;
mod caller;
mod decode;
mod enqueue;
mod exec;
mod installation;
mod query;
mod schedule;

use std::cell::Cell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, mpsc};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use rusqlite::{Connection, ErrorCode, OpenFlags, TransactionBehavior, params};
use serde_json::Value;
use tokio::sync::Notify;

use super::*;
use crate::clock::Clock;
use crate::error::Error;

/// How long a write waits for the file lock held by another process.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a waiting connection tries the lock again ([`wait_for_lock`]).
const BUSY_STEP: Duration = Duration::from_millis(1);

thread_local! {
    /// When the current wait for the file lock began ([`wait_for_lock`]).
    static WAITING_SINCE: Cell<Option<std::time::Instant>> = const { Cell::new(None) };
}

/// SQLite's busy handler: whether to try the lock again after `tries`
/// failed tries of the same locking event. It sleeps [`BUSY_STEP`] between
/// tries, up to [`BUSY_TIMEOUT`] in all.
///
/// SQLite's own busy timeout sleeps longer the longer a connection has
/// waited (up to 100 ms a step), so under steady contention the connection
/// that waited longest tries least often: while the other writers take the
/// lock in turn, it could be refused past its timeout (a race of eight
/// writers on a disk syncing in 20 ms did that). Steps of one length give
/// every waiter the same chance at each release.
fn wait_for_lock(tries: i32) -> bool {
    let now = std::time::Instant::now();
    let since = WAITING_SINCE.with(|w| {
        // The handler runs on the thread of the statement that waits; a
        // first try starts a new wait.
        if tries == 0 || w.get().is_none() {
            w.set(Some(now));
        }
        w.get().unwrap_or(now)
    });
    if now.duration_since(since) >= BUSY_TIMEOUT {
        WAITING_SINCE.with(|w| w.set(None));
        return false;
    }
    std::thread::sleep(BUSY_STEP);
    true
}
/// Read connections of a file database.
const READERS: usize = 4;
/// Most writes committed together.
const GROUP: usize = 256;
/// The page cache of each read connection, in KiB (`PRAGMA cache_size`
/// takes a negative number as KiB). SQLite's default is 2,000 KiB per
/// connection; the reads are point lookups, whose interior pages fit in
/// far less, and counting scans of the whole table, which a cache smaller
/// than the table does not help. The heap profile of `idemq serve` showed
/// the readers' page caches as most of its memory in use
/// (docs/benchmarks.md).
const READER_CACHE_KIB: i64 = 512;
/// How often the checkpoint thread moves the WAL into the database file.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

/// (version, name, SQL), in order; applied by `migrate` in one transaction.
pub const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "init",
        include_str!("../../../migrations/sqlite/0001_init.sql"),
    ),
    (
        2,
        "schedules",
        include_str!("../../../migrations/sqlite/0002_schedules.sql"),
    ),
    (
        3,
        "installation",
        include_str!("../../../migrations/sqlite/0003_installation.sql"),
    ),
    (
        4,
        "no_state_index",
        include_str!("../../../migrations/sqlite/0004_no_state_index.sql"),
    ),
    (
        5,
        "schedule_errors",
        include_str!("../../../migrations/sqlite/0005_schedule_errors.sql"),
    ),
    (
        6,
        "derived_history",
        include_str!("../../../migrations/sqlite/0006_derived_history.sql"),
    ),
    (
        7,
        "state_check",
        include_str!("../../../migrations/sqlite/0007_state_check.sql"),
    ),
];

/// What a driver error means for the caller.
#[derive(Clone, Copy)]
enum Failure {
    /// Another connection holds the lock: retry.
    Busy,
    /// The file cannot serve now (gone, unreadable, not a database, the disk
    /// full or failing): the caller may retry once an operator restored it,
    /// so it is `Unavailable`, never an internal error.
    Gone,
    /// Anything else: a bug or a broken invariant.
    Other,
    /// This binary may no longer write the file (a newer idemq migrated it):
    /// the message says why and what to run.
    Refused,
}

impl Failure {
    fn of(e: &rusqlite::Error) -> Self {
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Self::Busy,
            Some(
                ErrorCode::CannotOpen
                | ErrorCode::NotADatabase
                | ErrorCode::DatabaseCorrupt
                | ErrorCode::SystemIoFailure
                | ErrorCode::DiskFull
                | ErrorCode::ReadOnly
                | ErrorCode::PermissionDenied
                | ErrorCode::FileLockingProtocolFailed,
            ) => Self::Gone,
            _ => Self::Other,
        }
    }

    fn error(self, message: &str) -> Error {
        match self {
            Self::Busy => Error::Unavailable {
                message: format!("sqlite is busy: {message}"),
            },
            Self::Gone => Error::Unavailable {
                message: format!("the sqlite database cannot be used: {message}"),
            },
            Self::Other => Error::Backend {
                message: format!("sqlite: {message}"),
            },
            Self::Refused => Error::Backend {
                message: message.to_owned(),
            },
        }
    }
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Failure::of(&e).error(&e.to_string())
    }
}

/// The context of one operation: its transaction and the instant it runs at.
pub(crate) struct Cx<'a> {
    db: &'a Connection,
    now: i64,
    /// The history's next number once this operation drew some: the
    /// counter row is written once, when the operation ends ([`Cx::run`]),
    /// not at every number drawn.
    drawn: Cell<Option<i64>>,
}

struct Inner {
    writer: Mutex<Connection>,
    /// One per read thread: thread `i` of the read lane uses `readers[i]`
    /// only, so a connection's page cache is allocated and freed by one
    /// thread (one malloc arena) instead of by whichever thread was free.
    readers: Vec<Mutex<Connection>>,
    clock: Arc<dyn Clock>,
    wakeup: Arc<Notify>,
    /// Writes (and every operation of an in-memory database) run on one
    /// long-lived thread, reads on READERS others: a fixed set of threads,
    /// so memory the allocator keeps per thread stays bounded, and reads
    /// never queue behind writes.
    write_lane: mpsc::Sender<Lane>,
    read_lane: mpsc::Sender<Lane>,
    /// Dropped with the store: the checkpoint thread then ends.
    _checkpoints: Option<mpsc::Sender<()>>,
    /// The file's `PRAGMA schema_version` as this store last checked it
    /// ([`check_schema`]).
    schema: AtomicI64,
}

/// One operation for a store thread, given the index of the thread that
/// runs it within its lane.
type Task = Box<dyn FnOnce(usize) + Send>;

/// What a grouped write does once its group's transaction ended: answer
/// its caller with its own result, or with the commit's failure.
type Finish = Box<dyn FnOnce(Option<&CommitFailed>) + Send>;

/// A write run inside a savepoint of a shared transaction (or told why the
/// transaction could not begin). It returns whether its savepoint stands.
type GroupedOp = Box<
    dyn FnOnce(std::result::Result<(&Connection, i64), &CommitFailed>) -> (bool, Finish) + Send,
>;

/// Why a group's transaction did not begin or commit.
struct CommitFailed {
    failure: Failure,
    message: String,
}

impl CommitFailed {
    fn of(e: &rusqlite::Error) -> Self {
        Self {
            failure: Failure::of(e),
            message: e.to_string(),
        }
    }

    fn error(&self) -> Error {
        self.failure.error(&self.message)
    }
}

/// A unit of work for a store thread.
enum Lane {
    /// Runs on its own.
    Solo(Task),
    /// A write committed together with the writes queued beside it.
    Grouped(Arc<Inner>, GroupedOp),
}

/// Starts `threads` threads taking tasks from one queue; they end when the
/// queue's sender is dropped (with the store). A panicking task is caught:
/// its caller sees an error, and the thread goes on.
fn lane(name: &str, threads: usize) -> Result<mpsc::Sender<Lane>> {
    let (tx, rx) = mpsc::channel::<Lane>();
    let rx = Arc::new(Mutex::new(rx));
    for i in 0..threads {
        let rx = rx.clone();
        std::thread::Builder::new()
            .name(format!("idemq-sqlite-{name}-{i}"))
            .spawn(move || {
                let mut next = None;
                loop {
                    let task = match next.take() {
                        Some(t) => t,
                        None => {
                            let got = rx.lock().unwrap_or_else(|p| p.into_inner()).recv();
                            let Ok(t) = got else { return };
                            t
                        }
                    };
                    match task {
                        Lane::Solo(task) => {
                            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                task(i);
                            }));
                        }
                        Lane::Grouped(inner, op) => {
                            // Everything queued behind it, up to GROUP writes;
                            // a solo task found meanwhile runs after the group.
                            let mut group = vec![op];
                            let queue = rx.lock().unwrap_or_else(|p| p.into_inner());
                            while group.len() < GROUP {
                                match queue.try_recv() {
                                    Ok(Lane::Grouped(_, op)) => group.push(op),
                                    Ok(solo) => {
                                        next = Some(solo);
                                        break;
                                    }
                                    Err(_) => break,
                                }
                            }
                            drop(queue);
                            commit_group(&inner, group);
                        }
                    }
                }
            })
            .map_err(|e| Error::Backend {
                message: format!("cannot start a sqlite thread: {e}"),
            })?;
    }
    Ok(tx)
}

/// Refuses to write a file whose schema a newer idemq migrated since this
/// store opened it (SPEC: a binary refuses a schema newer than it knows).
/// Opening a file migrates it, so a newer process started beside this one
/// (a newer `idemq jobs list`, say) moves the tables under this binary's
/// statements; each write transaction compares the file's
/// `PRAGMA schema_version`, which SQLite moves at every change of the
/// schema, with the one last checked, and reads the migrations only when it
/// moved (another change, an application's own table or index, is let be).
/// Run inside the write transaction, so no migration lands in between.
fn check_schema(inner: &Inner, conn: &Connection) -> std::result::Result<(), CommitFailed> {
    let seen: i64 = conn
        .query_row("PRAGMA schema_version", [], |r| r.get(0))
        .map_err(|e| CommitFailed::of(&e))?;
    if seen == inner.schema.load(Ordering::Relaxed) {
        return Ok(());
    }
    if let Some(message) = newer_migration(conn).map_err(|e| CommitFailed::of(&e))? {
        return Err(CommitFailed {
            failure: Failure::Refused,
            message,
        });
    }
    inner.schema.store(seen, Ordering::Relaxed);
    Ok(())
}

/// What to tell a caller when the file's schema is newer than this binary
/// knows, or `None`.
fn newer_migration(conn: &Connection) -> rusqlite::Result<Option<String>> {
    let (current, written_by): (i64, Option<String>) = conn.query_row(
        "SELECT coalesce(max(version), 0),
                (SELECT idemq_version FROM idemq_migrations ORDER BY version DESC LIMIT 1)
         FROM idemq_migrations",
        [],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    let latest = MIGRATIONS.last().map_or(0, |m| m.0);
    Ok((current > latest).then(|| {
        crate::store::newer_schema_message(
            "the database schema",
            current,
            latest,
            written_by.as_deref(),
        )
    }))
}

/// Runs `group` in one transaction, each write in its own savepoint, and
/// answers every caller once the transaction committed (or failed).
fn commit_group(inner: &Inner, mut group: Vec<GroupedOp>) {
    while !group.is_empty() {
        group = commit_once(inner, group);
    }
}

/// One transaction of [`commit_group`]: the writes it did not run, for a
/// transaction of their own, when SQLite ended it under them.
fn commit_once(inner: &Inner, group: Vec<GroupedOp>) -> Vec<GroupedOp> {
    let mut conn = lock(&inner.writer);
    let begun = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|e| CommitFailed::of(&e))
        .and_then(|tx| check_schema(inner, &tx).map(|()| tx));
    let mut tx = match begun {
        Ok(tx) => tx,
        Err(failed) => {
            for op in group {
                let (_, finish) = op(Err(&failed));
                finish(Some(&failed));
            }
            return Vec::new();
        }
    };
    // A write alone in its group needs no savepoint: the transaction is its
    // own, and a savepoint would copy every page the write touches into the
    // sub-journal first (perf of a drain: a tenth of the write thread).
    if group.len() == 1 {
        let Some(op) = group.into_iter().next() else {
            return Vec::new();
        };
        let now = inner.clock.now().timestamp_micros();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(Ok((&tx, now)))));
        match ran {
            Ok((true, finish)) => match tx.commit() {
                Ok(()) => finish(None),
                Err(e) => finish(Some(&CommitFailed::of(&e))),
            },
            Ok((false, finish)) => match tx.rollback() {
                Ok(()) => finish(None),
                Err(e) => finish(Some(&CommitFailed::of(&e))),
            },
            Err(_) => drop(tx),
        }
        return Vec::new();
    }
    let mut finishes: Vec<Finish> = Vec::with_capacity(group.len());
    let mut ops = group.into_iter();
    while let Some(op) = ops.next() {
        let now = inner.clock.now().timestamp_micros();
        let sp = match tx.savepoint() {
            Ok(sp) => sp,
            Err(e) => {
                let failed = CommitFailed::of(&e);
                let (_, finish) = op(Err(&failed));
                finish(Some(&failed));
                continue;
            }
        };
        // A panicking write is rolled back with its savepoint; its caller
        // sees its answer dropped.
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| op(Ok((&sp, now)))));
        // SQLite ends the whole transaction by itself after some errors (a
        // full disk, an I/O error, no memory: "automatic rollback"). Every
        // write of the group so far is then undone, and a savepoint taken
        // now would begin a transaction of its own and commit at its
        // release, outside the group, before the group's COMMIT failed and
        // answered it failed. So the writes run so far are answered failed
        // (nothing of them stands), the one that hit the error with its own
        // error, and the writes not yet run go to a new transaction.
        if sp.is_autocommit() {
            drop(sp);
            let failed = rolled_back();
            match ran {
                Ok((false, finish)) => finish(None),
                Ok((true, finish)) => finish(Some(&failed)),
                Err(_) => {}
            }
            finishes.into_iter().for_each(|f| f(Some(&failed)));
            return ops.collect();
        }
        match ran {
            Ok((true, finish)) => match sp.commit() {
                Ok(()) => finishes.push(finish),
                Err(e) => finish(Some(&CommitFailed::of(&e))),
            },
            Ok((false, finish)) => {
                drop(sp);
                finishes.push(finish);
            }
            Err(_) => drop(sp),
        }
    }
    match tx.commit() {
        Ok(()) => finishes.into_iter().for_each(|f| f(None)),
        Err(e) => {
            let failed = CommitFailed::of(&e);
            finishes.into_iter().for_each(|f| f(Some(&failed)));
        }
    }
    Vec::new()
}

/// The failure of a write whose group's transaction SQLite rolled back
/// after another write's error ([`commit_group`]).
fn rolled_back() -> CommitFailed {
    CommitFailed {
        failure: Failure::Gone,
        message: "the transaction was rolled back by SQLite after an error of a write \
                  committed with it (a full disk or an I/O error); nothing of this call \
                  was written, and it may be retried"
            .into(),
    }
}

/// Moves the WAL into the database file every [`CHECKPOINT_EVERY`] without
/// blocking writers (`PASSIVE`), until the store is dropped.
fn checkpoints(path: &Path) -> Result<mpsc::Sender<()>> {
    let conn = open_conn(Some(path))?;
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("idemq-sqlite-checkpoint".into())
        .spawn(move || {
            while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(CHECKPOINT_EVERY) {
                // A checkpoint that cannot finish (a reader holds old
                // frames) finishes at a later pass.
                let _ = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
            }
        })
        .map_err(|e| Error::Backend {
            message: format!("cannot start the sqlite checkpoint thread: {e}"),
        })?;
    Ok(tx)
}

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    inner: Arc<Inner>,
    path: Option<PathBuf>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

fn lock(m: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    // A panic inside an operation rolled its transaction back when the
    // transaction was dropped, so the connection is still sound.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn open_conn(path: Option<&Path>) -> Result<Connection> {
    let conn = match path {
        Some(p) => Connection::open_with_flags(
            p,
            OpenFlags::SQLITE_OPEN_READ_WRITE
                | OpenFlags::SQLITE_OPEN_CREATE
                | OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(|e| Error::Unavailable {
            message: format!("cannot open {}: {e}", p.display()),
        })?,
        None => Connection::open_in_memory()?,
    };
    conn.busy_handler(Some(wait_for_lock))?;
    if path.is_some() {
        let mode: String = conn.query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))?;
        if !mode.eq_ignore_ascii_case("wal") {
            return Err(Error::Backend {
                message: format!("cannot enable WAL (got {mode})"),
            });
        }
    }
    conn.execute_batch("PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON;")?;
    Ok(conn)
}

fn migrate(conn: &mut Connection) -> Result<Vec<i64>> {
    conn.execute_batch(
        "CREATE TABLE IF NOT EXISTS idemq_migrations (
            version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)",
    )?;
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    // Which idemq applied each version, so an older binary can say which
    // one to run (a column of the bookkeeping table, not a migration).
    let recorded: bool = tx.query_row(
        "SELECT count(*) > 0 FROM pragma_table_info('idemq_migrations')
         WHERE name = 'idemq_version'",
        [],
        |r| r.get(0),
    )?;
    if !recorded {
        tx.execute_batch("ALTER TABLE idemq_migrations ADD COLUMN idemq_version TEXT")?;
    }
    if let Some(message) = newer_migration(&tx)? {
        return Err(Error::Backend { message });
    }
    let current: i64 = tx.query_row(
        "SELECT coalesce(max(version), 0) FROM idemq_migrations",
        [],
        |r| r.get(0),
    )?;
    let mut applied = Vec::new();
    for (version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
        tx.execute_batch(sql)?;
        tx.execute(
            "INSERT INTO idemq_migrations (version, name, applied_at, idemq_version)
             VALUES (?1, ?2, ?3, ?4)",
            params![
                version,
                name,
                Utc::now().timestamp_micros(),
                crate::store::IDEMQ_VERSION
            ],
        )?;
        applied.push(*version);
    }
    tx.commit()?;
    Ok(applied)
}

/// Creates the database file at `path` if it is missing and applies the
/// pending migrations; returns the versions applied (`idemq migrate`).
pub fn migrate_file(path: &Path) -> Result<Vec<i64>> {
    migrate(&mut open_conn(Some(path))?)
}

/// How the database file at `path` stands against this binary's schema,
/// changing nothing (a missing file is version 0).
pub fn migration_status(path: &Path) -> Result<crate::store::MigrationStatus> {
    let latest = MIGRATIONS.last().map_or(0, |m| m.0);
    let mut written_by = None;
    let current: i64 = if path.exists() {
        let conn = Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
        let has: bool = conn.query_row(
            "SELECT count(*) > 0 FROM sqlite_master WHERE name = 'idemq_migrations'",
            [],
            |r| r.get(0),
        )?;
        if has {
            let current = conn.query_row(
                "SELECT coalesce(max(version), 0) FROM idemq_migrations",
                [],
                |r| r.get(0),
            )?;
            // Which idemq wrote a newer schema (a column an older database
            // may lack).
            if current > latest
                && conn.query_row(
                    "SELECT count(*) > 0 FROM pragma_table_info('idemq_migrations')
                     WHERE name = 'idemq_version'",
                    [],
                    |r| r.get::<_, bool>(0),
                )?
            {
                written_by = conn.query_row(
                    "SELECT idemq_version FROM idemq_migrations ORDER BY version DESC LIMIT 1",
                    [],
                    |r| r.get(0),
                )?;
            }
            current
        } else {
            0
        }
    } else {
        0
    };
    Ok(crate::store::MigrationStatus {
        current,
        latest,
        pending: MIGRATIONS
            .iter()
            .map(|m| m.0)
            .filter(|v| *v > current)
            .collect(),
        functions_current: true,
        written_by,
    })
}

impl SqliteStore {
    /// Opens (creating if missing) the database at `path`, or an in-memory
    /// database for `None`, and applies pending migrations.
    pub fn open(path: Option<&Path>, clock: Arc<dyn Clock>) -> Result<Self> {
        let mut writer = open_conn(path)?;
        migrate(&mut writer)?;
        // Checkpoints are the checkpoint thread's, not the committing call's.
        let checkpointer = match path {
            Some(p) => {
                writer.execute_batch("PRAGMA wal_autocheckpoint=0")?;
                Some(checkpoints(p)?)
            }
            None => None,
        };
        let readers = match path {
            Some(_) => (0..READERS)
                .map(|_| {
                    let conn = open_conn(path)?;
                    conn.pragma_update(None, "cache_size", -READER_CACHE_KIB)?;
                    Ok(Mutex::new(conn))
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let reader_threads = readers.len().max(1);
        let schema: i64 = writer.query_row("PRAGMA schema_version", [], |r| r.get(0))?;
        Ok(Self {
            inner: Arc::new(Inner {
                writer: Mutex::new(writer),
                readers,
                clock,
                wakeup: Arc::new(Notify::new()),
                write_lane: lane("write", 1)?,
                read_lane: lane("read", reader_threads)?,
                _checkpoints: checkpointer,
                schema: AtomicI64::new(schema),
            }),
            path: path.map(Path::to_path_buf),
        })
    }

    /// Signalled after every commit that made a job claimable (the in-process wake-up).
    pub fn wakeup(&self) -> Arc<Notify> {
        self.inner.wakeup.clone()
    }

    /// Wakes every waiting worker, and leaves a permit for one that is
    /// between two waits so the signal is not lost.
    fn wake(&self) {
        self.inner.wakeup.notify_waiters();
        self.inner.wakeup.notify_one();
    }

    /// The `synchronous` and `journal_mode` pragmas in force, for checks and metrics.
    pub fn durability(&self) -> Result<(i64, String)> {
        let conn = lock(&self.inner.writer);
        let sync: i64 = conn.query_row("PRAGMA synchronous", [], |r| r.get(0))?;
        let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0))?;
        Ok((sync, mode))
    }

    async fn run<T, F>(&self, mode: Mode, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Cx<'_>) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        let reads_apart = matches!(mode, Mode::Read) && !self.inner.readers.is_empty();
        let (reply, answer) = tokio::sync::oneshot::channel();
        if let Mode::Write = mode {
            let op: GroupedOp = Box::new(move |cx| match cx {
                Err(failed) => {
                    let _ = reply.send(Err(failed.error()));
                    (false, Box::new(|_| {}))
                }
                Ok((db, now)) => {
                    let out = Cx::run(db, now, f);
                    let stands = out.is_ok();
                    let finish: Finish = Box::new(move |failed| {
                        let _ = reply.send(match failed {
                            None => out,
                            Some(failed) => Err(failed.error()),
                        });
                    });
                    (stands, finish)
                }
            });
            self.inner
                .write_lane
                .send(Lane::Grouped(inner, op))
                .map_err(|_| Error::Backend {
                    message: "the sqlite threads have stopped".into(),
                })?;
            return answer.await.map_err(|_| Error::Backend {
                message: "sqlite operation panicked".into(),
            })?;
        }
        let task: Task = Box::new(move |thread| {
            let conn_lock = if reads_apart {
                // The read lane has one thread per read connection.
                &inner.readers[thread % inner.readers.len()]
            } else {
                &inner.writer
            };
            let out = (|| {
                let mut conn = lock(conn_lock);
                let behavior = match mode {
                    Mode::Read => TransactionBehavior::Deferred,
                    Mode::Write | Mode::DryRun => TransactionBehavior::Immediate,
                };
                let tx = conn.transaction_with_behavior(behavior)?;
                let now = inner.clock.now().timestamp_micros();
                let out = Cx::run(&tx, now, f)?;
                match mode {
                    Mode::DryRun => tx.rollback()?,
                    Mode::Read | Mode::Write => tx.commit()?,
                }
                Ok(out)
            })();
            let _ = reply.send(out);
        });
        let lane = if reads_apart {
            &self.inner.read_lane
        } else {
            &self.inner.write_lane
        };
        lane.send(Lane::Solo(task)).map_err(|_| Error::Backend {
            message: "the sqlite threads have stopped".into(),
        })?;
        answer.await.map_err(|_| Error::Backend {
            message: "sqlite operation panicked".into(),
        })?
    }

    async fn write<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Cx<'_>) -> Result<T> + Send + 'static,
    {
        self.run(Mode::Write, f).await
    }

    async fn read<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Cx<'_>) -> Result<T> + Send + 'static,
    {
        self.run(Mode::Read, f).await
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Read,
    Write,
    DryRun,
}

/// µs since the epoch → instant, for an instant an operation computed
/// (the clock plus a bounded delay). One out of range is an error, never the
/// epoch. Values read back go through [`decode::Cols`], which names the column.
pub(crate) fn ts(us: i64) -> Result<DateTime<Utc>> {
    decode::instant(us).ok_or_else(|| Error::Backend {
        message: format!("{us} µs since the epoch is not an instant in range"),
    })
}

impl<'a> Cx<'a> {
    /// Runs the operation `f` at `now` in the transaction of `db`, then
    /// writes the history counter past the numbers it drew.
    pub(super) fn run<T>(
        db: &'a Connection,
        now: i64,
        f: impl FnOnce(&Self) -> Result<T>,
    ) -> Result<T> {
        let cx = Self {
            db,
            now,
            drawn: Cell::new(None),
        };
        let out = f(&cx)?;
        cx.settle()?;
        Ok(out)
    }

    /// The next number of the history, which numbers jobs and events alike
    /// (stored and derived), so a job's history has one order: above the
    /// counter and above every job's own number. An enqueue takes it
    /// without moving the counter (the job's row is its record, and the
    /// counter's page stays out of the commit); events, claims and
    /// completions move the counter past it ([`Self::next_seq`]).
    fn peek_seq(&self) -> Result<i64> {
        // The counter first catches up with the numbers drawn so far.
        self.settle()?;
        self.stored_next()
    }

    /// The next number as the database holds it (the counter may lag
    /// behind the numbers this operation drew: [`Self::drawn`]).
    fn stored_next(&self) -> Result<i64> {
        Ok(self
            .db
            .prepare_cached(
                "SELECT max((SELECT next FROM idemq_history),
                            coalesce((SELECT max(seq) FROM idemq_jobs), 0) + 1)",
            )?
            .query_row([], |r| r.get(0))?)
    }

    /// Draws the next number of the history (see [`Self::peek_seq`]). The
    /// counter row is written once per operation ([`Self::settle`]): each
    /// number drawn is the one a write of the counter at every draw would
    /// have given, and the committed counter is the same.
    fn next_seq(&self) -> Result<i64> {
        let seq = match self.drawn.get() {
            Some(next) => next,
            None => self.stored_next()?,
        };
        self.drawn.set(Some(seq + 1));
        Ok(seq)
    }

    /// Draws the next number for `write`, which answers whether it used
    /// it: a number not used is given back (the next draw takes it).
    fn next_seq_if(&self, write: impl FnOnce(i64) -> Result<bool>) -> Result<bool> {
        let before = self.drawn.get();
        let used = write(self.next_seq()?)?;
        if !used {
            self.drawn.set(before);
        }
        Ok(used)
    }

    /// Writes the counter past the numbers drawn. Plain statements: SQLite
    /// runs an `UPDATE … RETURNING` through an ephemeral table of its own,
    /// which cost more than the update.
    fn settle(&self) -> Result<()> {
        if let Some(next) = self.drawn.take() {
            self.db
                .prepare_cached("UPDATE idemq_history SET next = ?1 WHERE one = 1")?
                .execute([next])?;
        }
        Ok(())
    }

    /// Appends an event to a job's log.
    fn event(&self, job_id: &str, kind: &str, data: Value) -> Result<()> {
        self.event_at(self.next_seq()?, job_id, kind, self.now, data)
    }

    /// Writes an event under a number already drawn (a derived event
    /// written out keeps its number).
    fn event_at(&self, seq: i64, job_id: &str, kind: &str, at: i64, data: Value) -> Result<()> {
        self.db
            .prepare_cached(
                "INSERT INTO idemq_events (seq, job_id, kind, at, data) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![seq, job_id, kind, at, data.to_string()])?;
        Ok(())
    }
}

/// Turns a logical outcome decided inside a committed transaction back into a `Result`.
fn flatten<T>(r: Result<Result<T>>) -> Result<T> {
    r.and_then(|inner| inner)
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn supports(&self, capability: Capability) -> bool {
        match capability {
            Capability::CallerTransactions => true,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    async fn wakeups(&self) -> Result<Wakeups> {
        Ok(Wakeups::local(self.inner.wakeup.clone()))
    }

    async fn now(&self) -> Result<DateTime<Utc>> {
        Ok(self.inner.clock.now())
    }

    async fn job_enqueue(&self, p: JobEnqueue) -> Result<Vec<Result<EnqueueResult>>> {
        let atomic = p.atomic;
        let dry_run = p.dry_run;
        let mode = if dry_run { Mode::DryRun } else { Mode::Write };
        let results = self
            .run(mode, move |cx| {
                let results = enqueue::enqueue_all(cx, &p.items)?;
                if atomic && let Some(index) = results.iter().position(Result::is_err) {
                    // Returning an error rolls the whole batch back.
                    let mut results = results;
                    let error = results.swap_remove(index).err().map(Box::new);
                    return Err(Error::BatchItem {
                        index,
                        error: error.unwrap_or_else(|| unreachable!("position found an error")),
                    });
                }
                Ok(results)
            })
            .await?;
        if !dry_run
            && results.iter().any(|r| {
                matches!(
                    r,
                    Ok(EnqueueResult {
                        outcome: crate::Outcome::Accepted | crate::Outcome::Replaced,
                        ..
                    })
                )
            })
        {
            self.wake();
        }
        Ok(results)
    }

    async fn job_explain(&self, p: JobExplain) -> Result<Explain> {
        self.run(Mode::DryRun, move |cx| enqueue::explain(cx, &p.item))
            .await
    }

    async fn job_get(&self, p: JobRef) -> Result<Option<Job>> {
        self.read(move |cx| query::job_get(cx, &p.job_id)).await
    }

    async fn job_list(&self, p: JobListing) -> Result<JobPage> {
        self.read(move |cx| query::job_list(cx, &p)).await
    }

    async fn job_events(&self, p: JobRef) -> Result<Vec<Event>> {
        self.read(move |cx| query::job_events(cx, &p.job_id)).await
    }

    async fn job_runs(&self, p: JobRef) -> Result<Vec<Run>> {
        self.read(move |cx| query::job_runs(cx, &p.job_id)).await
    }

    async fn checkpoint_list(&self, p: JobRef) -> Result<BTreeMap<String, Value>> {
        self.read(move |cx| query::checkpoint_list(cx, &p.job_id))
            .await
    }

    async fn job_cancel(&self, p: JobRef) -> Result<CancelOutcome> {
        flatten(self.write(move |cx| admin::cancel(cx, &p.job_id)).await)
    }

    async fn job_cancel_by_key(&self, p: JobCancelByKey) -> Result<bool> {
        self.write(move |cx| admin::cancel_by_key(cx, &p)).await
    }

    async fn job_purge(&self, p: JobRef) -> Result<bool> {
        self.write(move |cx| admin::purge(cx, &p.job_id)).await
    }

    async fn job_promote(&self, p: JobRef) -> Result<bool> {
        let promoted = flatten(self.write(move |cx| admin::promote(cx, &p.job_id)).await)?;
        if promoted {
            self.wake();
        }
        Ok(promoted)
    }

    async fn job_redrive(&self, p: JobRedrive) -> Result<EnqueueResult> {
        let r = flatten(self.write(move |cx| admin::redrive(cx, &p)).await)?;
        self.wake();
        Ok(r)
    }

    async fn queue_pause(&self, p: QueuePause) -> Result<bool> {
        let paused = self.write(move |cx| admin::pause(cx, &p)).await?;
        if !paused {
            self.wake();
        }
        Ok(paused)
    }

    async fn queue_list(&self) -> Result<Vec<QueueInfo>> {
        self.read(query::queue_list).await
    }

    async fn job_claim(&self, p: JobClaim) -> Result<Recording<Vec<ClaimedJob>>> {
        let (claimed, wake) = self.write(move |cx| exec::claim(cx, &p)).await?;
        if wake {
            self.wake();
        }
        Ok(claimed)
    }

    async fn lease_heartbeat(&self, p: LeaseRef) -> Result<Recording<Result<Heartbeat>>> {
        let (beat, waiting) = self.write(move |cx| exec::heartbeat(cx, &p)).await?;
        if waiting {
            self.wake();
        }
        Ok(beat)
    }

    async fn job_complete(&self, p: JobComplete) -> Result<()> {
        flatten(self.write(move |cx| exec::complete(cx, &p)).await)
    }

    async fn job_complete_many(&self, p: JobCompleteMany) -> Result<Vec<Result<()>>> {
        // One BEGIN IMMEDIATE transaction, so one WAL sync for the batch.
        self.write(move |cx| p.items.iter().map(|i| exec::complete(cx, i)).collect())
            .await
    }

    async fn job_complete_and_claim(
        &self,
        done: JobCompleteMany,
        claim: JobClaim,
    ) -> Result<(Vec<Result<()>>, Result<Recording<Vec<ClaimedJob>>>)> {
        // One transaction: the completions first, so a concurrency key they
        // free can be claimed at once.
        let (completed, claimed, wake) = self
            .write(move |cx| {
                let completed = done
                    .items
                    .iter()
                    .map(|i| exec::complete(cx, i))
                    .collect::<Result<Vec<_>>>()?;
                let (claimed, wake) = if claim.limit == 0 {
                    (Recording::only(Vec::new()), false)
                } else {
                    exec::claim(cx, &claim)?
                };
                Ok((completed, claimed, wake))
            })
            .await?;
        if wake {
            self.wake();
        }
        Ok((completed, Ok(claimed)))
    }

    async fn job_fail(&self, p: JobFail) -> Result<FailOutcome> {
        let r = flatten(self.write(move |cx| exec::fail(cx, &p)).await)?;
        self.wake();
        Ok(r)
    }

    async fn job_release(&self, p: LeaseRef) -> Result<crate::job::JobState> {
        let state = flatten(self.write(move |cx| exec::release(cx, &p)).await)?;
        self.wake();
        Ok(state)
    }

    async fn checkpoint_put(&self, p: CheckpointPut) -> Result<bool> {
        flatten(self.write(move |cx| exec::checkpoint_put(cx, &p)).await)
    }

    async fn checkpoint_get(&self, p: CheckpointGet) -> Result<Option<Value>> {
        self.read(move |cx| query::checkpoint_get(cx, &p)).await
    }

    async fn binding_lookup(&self, p: BindingRef) -> Result<Option<BindingInfo>> {
        self.read(move |cx| query::binding_lookup(cx, &p)).await
    }

    async fn binding_release(&self, p: BindingRef) -> Result<bool> {
        self.write(move |cx| admin::binding_release(cx, &p)).await
    }

    async fn dedupe_lookup(&self, p: DedupeRef) -> Result<Option<ExplainDedupe>> {
        self.read(move |cx| query::dedupe_lookup(cx, &p)).await
    }

    async fn binding_sweep(&self, p: Sweep) -> Result<u64> {
        self.write(move |cx| admin::binding_sweep(cx, p.limit))
            .await
    }

    async fn lease_reap(&self, p: Sweep) -> Result<Recorded> {
        let reaped = self.write(move |cx| exec::reap(cx, p.limit)).await?;
        if reaped.lease_expiries > 0 {
            self.wake();
        }
        Ok(reaped)
    }

    async fn job_retention_sweep(&self, p: Sweep) -> Result<u64> {
        self.write(move |cx| admin::retention_sweep(cx, p.limit))
            .await
    }

    async fn schedule_put(&self, p: SchedulePut) -> Result<bool> {
        self.write(move |cx| schedule::put(cx, &p)).await
    }

    async fn schedule_delete(&self, p: ScheduleRef) -> Result<bool> {
        self.write(move |cx| schedule::delete(cx, &p.name)).await
    }

    async fn installation_key_check(&self, p: KeyCheck) -> Result<String> {
        self.write(move |cx| installation::key_check(cx, &p.value))
            .await
    }

    async fn installation_key_check_replace(&self, p: KeyCheck) -> Result<KeyCheckChange> {
        self.write(move |cx| installation::key_check_replace(cx, &p.value))
            .await
    }

    async fn schedule_list(&self) -> Result<crate::schedule::ScheduleList> {
        self.read(schedule::list).await
    }

    async fn schedule_due(&self, p: ScheduleDue) -> Result<DueSchedules> {
        self.read(move |cx| schedule::due(cx, p.limit)).await
    }

    async fn schedule_mark_fired(&self, p: ScheduleMarkFired) -> Result<bool> {
        self.write(move |cx| schedule::mark_fired(cx, &p)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;

    fn cache_size(conn: &Mutex<Connection>) -> i64 {
        lock(conn)
            .query_row("PRAGMA cache_size", [], |r| r.get(0))
            .expect("cache_size")
    }

    #[test]
    fn read_connections_have_a_bounded_page_cache_and_the_writer_the_default() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            SqliteStore::open(Some(&dir.path().join("q.db")), Arc::new(SystemClock)).expect("open");
        assert_eq!(store.inner.readers.len(), READERS);
        for reader in &store.inner.readers {
            assert_eq!(cache_size(reader), -READER_CACHE_KIB);
        }
        assert_eq!(cache_size(&store.inner.writer), -2000);
    }

    /// The build settings of `.cargo/config.toml`: without them every
    /// allocation and every page fetch of every connection takes a
    /// process-wide lock (docs/storage.md, "Build settings").
    #[test]
    fn sqlite_is_built_without_global_mutexes() {
        let conn = Connection::open_in_memory().expect("open");
        let options: Vec<String> = conn
            .prepare("PRAGMA compile_options")
            .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
            .expect("compile_options");
        assert!(
            options.iter().any(|o| o == "DEFAULT_MEMSTATUS=0"),
            "{options:?}"
        );
        assert!(
            !options.iter().any(|o| o == "ENABLE_MEMORY_MANAGEMENT"),
            "{options:?}"
        );
    }

    /// A write of a group that inserts `n` into `t` (or, for `rollback`,
    /// ends the transaction as SQLite does after a full disk or an I/O
    /// error), and records how its caller was answered.
    fn op(n: i64, rollback: bool, answers: &Arc<Mutex<Vec<(i64, bool)>>>) -> GroupedOp {
        let answers = answers.clone();
        Box::new(move |cx| {
            let stands = match cx {
                Ok((db, _)) if rollback => {
                    db.execute_batch("ROLLBACK").expect("rollback");
                    false
                }
                Ok((db, _)) => db.execute("INSERT INTO t VALUES (?1)", [n]).is_ok(),
                Err(_) => false,
            };
            let finish: Finish = Box::new(move |failed| {
                answers
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((n, stands && failed.is_none()));
            });
            (stands, finish)
        })
    }

    /// SQLite may roll a whole transaction back by itself after an error
    /// of one statement. The writes of the group before it are undone and
    /// answered failed; the writes after it still commit, in a transaction
    /// of their own, and are answered so: every answer matches the file.
    #[test]
    fn a_group_ended_by_sqlite_answers_each_write_as_the_file_holds_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            SqliteStore::open(Some(&dir.path().join("q.db")), Arc::new(SystemClock)).expect("open");
        lock(&store.inner.writer)
            .execute_batch("CREATE TABLE t (n INTEGER)")
            .expect("table");
        let answers = Arc::new(Mutex::new(Vec::new()));
        let group = vec![
            op(1, false, &answers),
            op(2, false, &answers),
            op(3, true, &answers),
            op(4, false, &answers),
            op(5, false, &answers),
        ];
        commit_group(&store.inner, group);
        let stored: Vec<i64> = lock(&store.inner.writer)
            .prepare("SELECT n FROM t ORDER BY n")
            .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
            .expect("rows");
        assert_eq!(stored, vec![4, 5]);
        let mut answered = answers.lock().expect("answers").clone();
        answered.sort();
        assert_eq!(
            answered,
            vec![(1, false), (2, false), (3, false), (4, true), (5, true)]
        );
        assert!(lock(&store.inner.writer).is_autocommit());
    }

    #[tokio::test]
    async fn each_read_thread_uses_its_own_connection() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            SqliteStore::open(Some(&dir.path().join("q.db")), Arc::new(SystemClock)).expect("open");
        // Every connection answers with its own temp schema object, so the
        // connection a read used shows in its answer; the thread's name
        // ends with its index in the read lane.
        for (i, reader) in store.inner.readers.iter().enumerate() {
            lock(reader)
                .execute_batch(&format!("CREATE TEMP TABLE conn_{i} (x)"))
                .expect("temp table");
        }
        for _ in 0..32 {
            let (thread, conn): (String, String) = store
                .read(|cx| {
                    let name = std::thread::current().name().unwrap_or_default().to_owned();
                    let conn = cx.db.query_row(
                        "SELECT name FROM sqlite_temp_master WHERE type = 'table'",
                        [],
                        |r| r.get(0),
                    )?;
                    Ok((name, conn))
                })
                .await
                .expect("read");
            let index = thread.rsplit('-').next().expect("index");
            assert!(thread.starts_with("idemq-sqlite-read-"), "{thread}");
            assert_eq!(conn, format!("conn_{index}"));
        }
    }
}
