//! How the store's calls reach PostgreSQL: every call has a deadline, and
//! behind a transaction-pooling PgBouncer every call is an unprepared
//! statement inside a transaction of its own.
//!
//! The deadline is what bounds a call on a dead TCP connection (a
//! partitioned host, a server that vanished without a FIN): the driver sets
//! no TCP keepalive, so without it a call waits for the kernel to give up
//! retransmitting (about 15 minutes with Linux's default `tcp_retries2`).
//! A call past its deadline fails `Unavailable`; the connection it was
//! using is dropped, and a pooled connection is pinged (within the acquire
//! timeout) before it is used again.
//!
//! Transaction pooling hands each transaction any server connection: a
//! statement the driver prepared and named on one is unknown on the next,
//! and an unnamed one parsed outside a transaction may be gone by the time
//! it is bound. So [`Db`] in PgBouncer mode runs each call as `BEGIN`,
//! the unprepared statement, `COMMIT`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use futures_core::future::BoxFuture;
use futures_core::stream::BoxStream;
use futures_util::{StreamExt, TryStreamExt, stream};
use sqlx::error::BoxDynError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{
    PgArguments, PgConnection, PgPool, PgQueryResult, PgRow, PgStatement, PgTypeInfo,
};
use sqlx::{Either, Execute, Executor, Postgres, SqlStr};

/// The connect options of [`super::PgStore`] that shape each call, read
/// from the URL's query string (docs/storage.md).
#[derive(Clone, Debug)]
pub(crate) struct Net {
    /// `pgbouncer=true`: unprepared statements, each call in a transaction,
    /// no `LISTEN` on the pool.
    pub(crate) bouncer: bool,
    /// `call_timeout_ms`: the most one call may take, connection included.
    pub(crate) deadline: Duration,
    /// Behind PgBouncer: the direct URL wake-ups `LISTEN` on.
    pub(crate) wakeup: Option<String>,
    /// `enqueue_statements`: the most single-enqueue statements out at
    /// once; more concurrent calls go together (group.rs).
    pub(crate) statements: usize,
    /// `read_statements`: the most reads of replays' keys out at once;
    /// more concurrent replays read together (group.rs).
    pub(crate) reads: usize,
}

/// The default of `call_timeout_ms`.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(30);

impl Default for Net {
    fn default() -> Self {
        Self {
            bouncer: false,
            deadline: CALL_TIMEOUT,
            wakeup: None,
            statements: DEFAULT_STATEMENTS,
            reads: DEFAULT_READS,
        }
    }
}

/// The default of `enqueue_statements`: one statement out at a time, so
/// every call that comes while it runs shares the next one and its flush.
/// A second statement out splits the callers waiting between two commits,
/// each of which waits for its own flush: on 2 cores, 8 producers measured
/// the same or fewer jobs/s with 2, and about 15% fewer through the HTTP API
/// (docs/benchmarks.md, "Optimisations made"). A database whose inserts,
/// not its flushes, bound a store's enqueues can be given more.
const DEFAULT_STATEMENTS: usize = 1;

/// The default of `read_statements`: two reads of replays' keys out at
/// once. A read commits nothing, so there is no flush to share: its round
/// trip is the server's work and the wake-ups on both sides, and one read
/// out left a core of the 2-core bench machine idle while the replays
/// waiting for it queued. Eight producers replaying keys measured about
/// 18% more calls/s with 2 than with 1, and no more with 3 or 4
/// (docs/benchmarks.md, "Optimisations made").
const DEFAULT_READS: usize = 2;

/// How many statements of a kind a store keeps out at once, from the URL
/// parameter `key`: 1 … 10,000.
fn statements(key: &str, value: &str) -> Result<usize, String> {
    value
        .parse()
        .ok()
        .filter(|n| (1..=10_000).contains(n))
        .ok_or_else(|| format!("{key} must be 1 … 10000, not {value:?}"))
}

/// Splits idemq's own parameters (`pgbouncer`, `call_timeout_ms`,
/// `enqueue_statements`, `read_statements`) off a PostgreSQL URL; the rest
/// is the driver's.
pub(crate) fn split_url(url: &str) -> Result<(String, Net), String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), Net::default()));
    };
    let mut net = Net::default();
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match key {
            "pgbouncer" => {
                net.bouncer = match value {
                    "true" | "1" | "on" => true,
                    "false" | "0" | "off" => false,
                    _ => return Err(format!("pgbouncer must be true or false, not {value:?}")),
                }
            }
            "call_timeout_ms" => {
                let ms: u64 = value
                    .parse()
                    .ok()
                    .filter(|ms| (100..=86_400_000).contains(ms))
                    .ok_or_else(|| {
                        format!("call_timeout_ms must be 100 … 86400000 (ms), not {value:?}")
                    })?;
                net.deadline = Duration::from_millis(ms);
            }
            "enqueue_statements" => net.statements = statements(key, value)?,
            "read_statements" => net.reads = statements(key, value)?,
            _ => rest.push(pair),
        }
    }
    if rest.is_empty() {
        Ok((base.to_owned(), net))
    } else {
        Ok((format!("{base}?{}", rest.join("&")), net))
    }
}

/// Set once this process connected a store through PgBouncer.
static UNPREPARED: AtomicBool = AtomicBool::new(false);

/// Whether the statements run on a connection the store did not pick
/// ([`super::PgStore::enqueue_in`]: the caller's) are prepared and cached:
/// not once this process has connected a store with `pgbouncer=true`, since
/// the caller's connection may then be PgBouncer's too.
pub(crate) fn prepared() -> bool {
    !UNPREPARED.load(Ordering::Relaxed)
}

/// Records that this process talks to PostgreSQL through PgBouncer.
pub(crate) fn mark_unprepared() {
    UNPREPARED.store(true, Ordering::Relaxed);
}

/// How long a connection the store keeps ([`Kept`]) waits for its next
/// call before it goes back to the pool.
const KEEP_FOR: Duration = Duration::from_millis(250);

/// Connections the store keeps out of the pool between its calls, each
/// for [`KEEP_FOR`] at most.
///
/// sqlx's pool checks every connection given back to it with a round trip
/// (a `Sync` and its `ReadyForQuery`), in a task of its own, whatever the
/// call did: one round trip more per call, which on a busy machine costs
/// as much CPU as a small statement. A call that ended cleanly (its
/// statement answered, or the server refused it with an error of its own)
/// leaves its connection in step with the server, so the store keeps it
/// for the next call instead. A call that failed otherwise (a lost
/// connection, a protocol error) or was cancelled (its deadline, a caller
/// that went away) gives its connection back to the pool, which checks it.
/// A connection kept longer than [`KEEP_FOR`] goes back to the pool too, so
/// a quiet store holds no connection another user of the pool may need;
/// one idle for a second or more is checked before its next use, as the
/// pool checks it (`IDLE_CHECK`).
///
/// A connection is never kept while someone may be waiting for one: while
/// a call of the store waits in the pool, or while the pool has every
/// connection it may open out and none idle (its other users may be
/// waiting), a finished call gives its connection back to the pool, which
/// hands it on. Kept otherwise, those waiters would wait for the sweep.
#[derive(Default)]
pub(crate) struct Kept {
    idle: Mutex<Idle>,
    /// Whether a task gives expired connections back ([`Kept::sweep`]).
    sweeping: AtomicBool,
}

/// What [`Kept`] guards with one lock.
#[derive(Default)]
struct Idle {
    conns: Vec<(PoolConnection<Postgres>, Instant)>,
    /// The store's calls waiting in the pool for a connection.
    waiting: usize,
}

impl std::fmt::Debug for Kept {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let idle = self.idle();
        f.debug_struct("Kept")
            .field("idle", &idle.conns.len())
            .field("waiting", &idle.waiting)
            .finish()
    }
}

impl Kept {
    fn idle(&self) -> MutexGuard<'_, Idle> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The connection kept last, if it was kept less than [`KEEP_FOR`] ago;
    /// otherwise the caller is counted as waiting in the pool until the
    /// [`Waiting`] it gets is dropped.
    fn take(self: &Arc<Self>) -> Result<PoolConnection<Postgres>, Waiting> {
        let mut idle = self.idle();
        let expired = match idle.conns.pop() {
            Some((conn, since)) if since.elapsed() < KEEP_FOR => return Ok(conn),
            // The newest has expired, so have the others: all go back.
            Some(newest) => {
                let mut all: Vec<_> = idle.conns.drain(..).collect();
                all.push(newest);
                all
            }
            None => Vec::new(),
        };
        idle.waiting += 1;
        drop(idle);
        drop(expired);
        Err(Waiting(self.clone()))
    }

    /// Keeps `conn` for the next call, and starts the task that gives it
    /// back to the pool once expired, unless one runs; gives it back at
    /// once if a call of the store waits in `pool`, or `pool` has none
    /// idle and may open no more.
    fn put(self: &Arc<Self>, conn: PoolConnection<Postgres>, pool: &PgPool) {
        let mut idle = self.idle();
        let exhausted = pool.num_idle() == 0 && pool.size() >= pool.options().get_max_connections();
        if idle.waiting > 0 || exhausted {
            drop(idle);
            drop(conn);
            return;
        }
        idle.conns.push((conn, Instant::now()));
        let sweeping = self.sweeping.swap(true, Ordering::AcqRel);
        drop(idle);
        if !sweeping {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(Self::sweep(Arc::downgrade(self)));
            } else {
                self.sweeping.store(false, Ordering::Release);
            }
        }
    }

    /// Gives expired connections back to the pool, every [`KEEP_FOR`],
    /// until none is kept or the store is gone.
    async fn sweep(kept: Weak<Self>) {
        // A runtime shut down under the task drops it: the next connection
        // kept then starts another.
        let mut stopped = Stopped {
            kept: kept.clone(),
            armed: true,
        };
        loop {
            tokio::time::sleep(KEEP_FOR).await;
            let Some(kept) = kept.upgrade() else { return };
            let expired: Vec<_> = {
                let mut idle = kept.idle();
                let (fresh, old) = idle
                    .conns
                    .drain(..)
                    .partition(|(_, since)| since.elapsed() < KEEP_FOR);
                idle.conns = fresh;
                old
            };
            drop(expired);
            let idle = kept.idle();
            if idle.conns.is_empty() {
                // Cleared under the lock, so a connection kept after it
                // starts a new task (`put` pushes under the same lock).
                kept.sweeping.store(false, Ordering::Release);
                stopped.armed = false;
                return;
            }
        }
    }
}

/// A call of the store waiting in the pool for a connection, counted in
/// [`Kept`] until dropped (acquired, failed or cancelled).
pub(crate) struct Waiting(Arc<Kept>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.idle().waiting -= 1;
    }
}

/// Clears [`Kept::sweeping`] when its sweeping task is dropped before it
/// ended (its runtime shut down).
struct Stopped {
    kept: Weak<Kept>,
    armed: bool,
}

impl Drop for Stopped {
    fn drop(&mut self) {
        if self.armed
            && let Some(kept) = self.kept.upgrade()
        {
            kept.sweeping.store(false, Ordering::Release);
        }
    }
}

impl Drop for Kept {
    fn drop(&mut self) {
        let idle: Vec<_> = self.idle().conns.drain(..).collect();
        if tokio::runtime::Handle::try_current().is_ok() {
            // Each goes back to the pool, checked, in a task of sqlx's.
            drop(idle);
        } else {
            // Outside a runtime, sqlx could not spawn that task: the
            // connections are closed (the pool opens others as needed).
            for (conn, _) in idle {
                drop(conn.detach());
            }
        }
    }
}

/// A connection for one call of the store: kept from the previous call or
/// acquired from the pool. [`Lent::keep`] keeps it for the next call;
/// dropped otherwise, it goes back to the pool.
pub(crate) struct Lent<'a> {
    conn: Option<PoolConnection<Postgres>>,
    kept: &'a Arc<Kept>,
    pool: &'a PgPool,
}

impl<'a> Lent<'a> {
    /// A connection of `db` for one call.
    pub(crate) async fn of(db: Db<'a>) -> Result<Self, sqlx::Error> {
        let conn = match db.kept.take() {
            Ok(conn) => conn,
            Err(waiting) => {
                // Boxed: the pool's acquire is a future of about 9 KB,
                // which would otherwise sit in the state of every call's
                // future (moved and copied with it) though most calls take
                // a kept connection.
                let conn = Box::pin(db.pool.acquire()).await?;
                drop(waiting);
                conn
            }
        };
        Ok(Self {
            conn: Some(conn),
            kept: db.kept,
            pool: db.pool,
        })
    }

    /// Keeps the connection for the next call when `outcome` leaves it in
    /// step with the server: a result, or an error the server answered.
    pub(crate) fn keep<T>(self, outcome: &Result<T, sqlx::Error>) {
        self.keep_if(match outcome {
            Ok(_) => true,
            Err(e) => matches!(e, sqlx::Error::Database(_) | sqlx::Error::RowNotFound),
        });
    }

    /// Keeps the connection for the next call if `clean`.
    pub(crate) fn keep_if(mut self, clean: bool) {
        if clean && let Some(conn) = self.conn.take() {
            self.kept.put(conn, self.pool);
        }
    }
}

impl std::ops::Deref for Lent<'_> {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.conn
            .as_deref()
            .expect("a lent connection until dropped")
    }
}

impl std::ops::DerefMut for Lent<'_> {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn
            .as_deref_mut()
            .expect("a lent connection until dropped")
    }
}

/// The store's executor: the pool, under the call deadline (and, behind
/// PgBouncer, one transaction per call).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Db<'a> {
    pub(crate) pool: &'a PgPool,
    pub(crate) net: &'a Net,
    /// Connections kept between calls ([`Kept`]).
    pub(crate) kept: &'a Arc<Kept>,
}

impl Db<'_> {
    /// Runs `query` under the deadline and hands its rows to `take` one at
    /// a time, as they arrive, until it answers `false` or fails; the rows
    /// after that are read and dropped. So the call holds one row at a
    /// time, however large the result, where [`Executor::fetch_all`] holds
    /// them all (a page of large jobs).
    pub(crate) async fn each_row<'q, E>(
        self,
        query: E,
        mut take: impl FnMut(&PgRow) -> crate::Result<bool> + Send,
    ) -> crate::Result<()>
    where
        E: 'q + Execute<'q, Postgres>,
    {
        let mut taking = true;
        let mut refused = None;
        let mut offer = |row: PgRow| {
            if taking {
                match take(&row) {
                    Ok(more) => taking = more,
                    Err(e) => {
                        refused = Some(e);
                        taking = false;
                    }
                }
            }
        };
        let read = within(self.net.deadline, async {
            if self.net.bouncer {
                // Boxed, as in `Lent::of`: the pool's begin is a large future.
                let mut tx = Box::pin(self.pool.begin()).await?;
                {
                    let mut rows = (&mut *tx).fetch(Unnamed(query));
                    while let Some(row) = rows.try_next().await? {
                        offer(row);
                    }
                }
                tx.commit().await
            } else {
                let mut conn = Lent::of(self).await?;
                let read = async {
                    let mut rows = (&mut *conn).fetch(query);
                    while let Some(row) = rows.try_next().await? {
                        offer(row);
                    }
                    Ok(())
                }
                .await;
                conn.keep(&read);
                read
            }
        })
        .await;
        read.map_err(super::db_err)?;
        refused.map_or(Ok(()), Err)
    }

    /// Runs a call made of several statements under the deadline.
    pub(crate) async fn bounded<T>(
        &self,
        call: impl Future<Output = crate::Result<T>>,
    ) -> crate::Result<T> {
        tokio::time::timeout(self.net.deadline, call)
            .await
            .unwrap_or_else(|_| Err(super::db_err(timed_out(self.net.deadline))))
    }
}

/// A query run without a named prepared statement.
struct Unnamed<E>(E);

impl<'q, E: Execute<'q, Postgres>> Execute<'q, Postgres> for Unnamed<E> {
    fn sql(self) -> SqlStr {
        self.0.sql()
    }
    fn statement(&self) -> Option<&PgStatement> {
        self.0.statement()
    }
    fn take_arguments(&mut self) -> Result<Option<PgArguments>, BoxDynError> {
        self.0.take_arguments()
    }
    fn persistent(&self) -> bool {
        false
    }
}

/// The error of a call past its deadline: retryable, like a lost connection.
pub(crate) fn timed_out(deadline: Duration) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer from PostgreSQL within {} ms (call_timeout_ms)",
            deadline.as_millis()
        ),
    ))
}

/// How long [`probe_wakeups`] waits for its notification.
const PROBE_WAIT: Duration = Duration::from_secs(5);

/// Checks that a notification sent through the store's pool arrives on the
/// direct wake-up connection: a wake-up URL that does not deliver them (one
/// that also goes through transaction pooling) is refused at connect time
/// rather than leaving workers to find out by polling.
pub(crate) async fn probe_wakeups(url: &str, db: Db<'_>) -> crate::Result<()> {
    let field = "IDEMQ_WAKEUP_DATABASE_URL";
    let mut listener = sqlx::postgres::PgListener::connect(url)
        .await
        .map_err(|e| crate::Error::Unavailable {
            message: format!("cannot connect to {field}: {e}"),
        })?;
    let channel = format!("idemq_probe_{}", uuid::Uuid::new_v4().simple());
    listener.listen(&channel).await.map_err(super::db_err)?;
    let sent = sqlx::query("SELECT pg_notify($1, '')")
        .bind(&channel)
        .execute(db)
        .await;
    let missing = match sent {
        // A pooled LISTEN can even hand the notification to the sender's
        // own server connection, where the driver reports a protocol error.
        Err(e) => match super::db_err(e) {
            e @ crate::Error::Unavailable { .. } => return Err(e),
            e => format!("sending it failed: {e}"),
        },
        Ok(_) => match tokio::time::timeout(PROBE_WAIT, listener.recv()).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => return Err(super::db_err(e)),
            Err(_) => format!("none arrived within {} s", PROBE_WAIT.as_secs()),
        },
    };
    Err(crate::Error::validation(
        field,
        format!(
            "a notification sent through the database URL must arrive on {field}, \
             but {missing}: it must reach PostgreSQL directly or through session \
             pooling, not through PgBouncer's transaction pooling"
        ),
    ))
}

/// The answer of `wakeups()` behind PgBouncer without a wake-up URL:
/// workers then find work by polling alone.
pub(crate) fn no_wakeups() -> crate::Error {
    crate::Error::Unavailable {
        message: "no wake-ups behind PgBouncer (pgbouncer=true) without \
                  IDEMQ_WAKEUP_DATABASE_URL: workers poll"
            .into(),
    }
}

/// Runs `call` under `deadline`.
pub(crate) async fn within<T>(
    deadline: Duration,
    call: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(deadline, call)
        .await
        .unwrap_or_else(|_| Err(timed_out(deadline)))
}

type Item = Either<PgQueryResult, PgRow>;

impl<'a> Executor<'a> for Db<'a> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, E>(self, query: E) -> BoxStream<'e, Result<Item, sqlx::Error>>
    where
        'a: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        // The store's statements return a handful of rows: they are read in
        // full under the deadline, then handed out.
        let all = within(self.net.deadline, async move {
            if self.net.bouncer {
                // Boxed, as in `Lent::of`: the pool's begin is a large future.
                let mut tx = Box::pin(self.pool.begin()).await?;
                let items: Vec<Item> = (&mut *tx).fetch_many(Unnamed(query)).try_collect().await?;
                tx.commit().await?;
                Ok(items)
            } else {
                let mut conn = Lent::of(self).await?;
                let items: Result<Vec<Item>, _> =
                    (&mut *conn).fetch_many(query).try_collect().await;
                conn.keep(&items);
                items
            }
        });
        stream::once(all)
            .map_ok(|items| stream::iter(items.into_iter().map(Ok)))
            .try_flatten()
            .boxed()
    }

    fn fetch_optional<'e, 'q: 'e, E>(
        self,
        query: E,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'a: 'e,
        E: 'q + Execute<'q, Postgres>,
    {
        Box::pin(within(self.net.deadline, async move {
            if self.net.bouncer {
                // Boxed, as in `Lent::of`: the pool's begin is a large future.
                let mut tx = Box::pin(self.pool.begin()).await?;
                let row = (&mut *tx).fetch_optional(Unnamed(query)).await?;
                tx.commit().await?;
                Ok(row)
            } else {
                let mut conn = Lent::of(self).await?;
                let row = (&mut *conn).fetch_optional(query).await;
                conn.keep(&row);
                row
            }
        }))
    }

    fn prepare_with<'e>(
        self,
        sql: SqlStr,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement, sqlx::Error>>
    where
        'a: 'e,
    {
        Box::pin(within(
            self.net.deadline,
            self.pool.prepare_with(sql, parameters),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idemq_parameters_are_split_off() {
        let (url, net) = split_url("postgres://u@h/db").unwrap();
        assert_eq!(url, "postgres://u@h/db");
        assert!(!net.bouncer);
        assert_eq!(net.deadline, CALL_TIMEOUT);
        assert_eq!(net.statements, 1);

        let (url, net) =
            split_url("postgres://u@h:6432/db?sslmode=disable&pgbouncer=true&call_timeout_ms=5000")
                .unwrap();
        assert_eq!(url, "postgres://u@h:6432/db?sslmode=disable");
        assert!(net.bouncer);
        assert_eq!(net.deadline, Duration::from_secs(5));

        let (url, net) = split_url("postgres://u@h/db?enqueue_statements=16").unwrap();
        assert_eq!(url, "postgres://u@h/db");
        assert_eq!(net.statements, 16);
        assert_eq!(net.reads, 2);

        let (url, net) =
            split_url("postgres://u@h/db?read_statements=1&enqueue_statements=3").unwrap();
        assert_eq!(url, "postgres://u@h/db");
        assert_eq!((net.statements, net.reads), (3, 1));

        let (url, net) = split_url("postgres://u@h/db?pgbouncer=false").unwrap();
        assert_eq!(url, "postgres://u@h/db");
        assert!(!net.bouncer);
    }

    #[test]
    fn bad_values_are_refused() {
        assert!(split_url("postgres://h/db?pgbouncer=yes").is_err());
        assert!(split_url("postgres://h/db?call_timeout_ms=0").is_err());
        assert!(split_url("postgres://h/db?call_timeout_ms=abc").is_err());
        assert!(split_url("postgres://h/db?call_timeout_ms=99").is_err());
        assert!(split_url("postgres://h/db?enqueue_statements=0").is_err());
        assert!(split_url("postgres://h/db?enqueue_statements=10001").is_err());
        assert!(split_url("postgres://h/db?enqueue_statements=two").is_err());
        assert!(split_url("postgres://h/db?read_statements=0").is_err());
        assert!(split_url("postgres://h/db?read_statements=10001").is_err());
        assert!(split_url("postgres://h/db?read_statements=").is_err());
    }
}
