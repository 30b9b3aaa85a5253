//! The PostgreSQL backend, for production and many machines.
//!
//! Every public operation is one call of a SQL function in the `idemq` schema
//! (installed by `idemq migrate`), atomic inside the database: one round trip.
//! The functions return outcomes as rows and never raise for a conflict, a
//! replay, a dedupe outcome or a validation failure, so a caller's own
//! transaction stays usable ([`PgStore::enqueue_in`]). Uniqueness is enforced
//! by primary keys and `ON CONFLICT`; requests on one key are serialized by
//! transaction-scoped advisory locks taken in a canonical order.
//!
//! The clock of record is the database's statement clock
//! (`clock_timestamp()`, read once per operation), so many hosts share one
//! clock.

mod db;
mod enqueue;
mod group;
mod installation;
mod migrate;
mod query;
mod schedule;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{PgConnection, Row};

pub use migrate::{
    BOOKKEEPING, FUNCTIONS, FUNCTIONS_REVISION, MIGRATIONS, latest as schema_version, migrate,
    migrate_url, status as migration_status, status_url as migration_status_url,
};

use super::*;
use crate::error::Error;
use crate::job::{JobState, LeaseToken};

/// The channel `LISTEN`ers are told of new work on; the payload is the queue name.
pub const NOTIFY_CHANNEL: &str = "idemq_jobs";

/// `LISTEN idemq_jobs` as a source of wake-ups. A lost connection is
/// reconnected by the driver at the next receive.
struct Listener(sqlx::postgres::PgListener);

#[async_trait]
impl WakeChannel for Listener {
    async fn recv(&mut self) -> Result<()> {
        self.0.recv().await.map(drop).map_err(db_err)
    }
}

/// Maps a driver error: lost connections, serialization failures, deadlocks,
/// lock timeouts, shutdowns, a database that is gone and a server out of
/// resources are `Unavailable` (retryable).
pub(crate) fn db_err(e: sqlx::Error) -> Error {
    let retryable = match &e {
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Tls(_) => true,
        sqlx::Error::Database(d) => d.code().is_some_and(|c| {
            matches!(
                c.as_ref(),
                "40001" | "40P01" | "55P03" | "57014" | "57P01" | "57P02" | "57P03" | "3D000"
            ) || c.starts_with("08")
                || c.starts_with("53")
                || c.starts_with("58")
        }),
        _ => false,
    };
    if retryable {
        Error::Unavailable {
            message: format!("postgres: {e}"),
        }
    } else {
        Error::Backend {
            message: format!("postgres: {e}"),
        }
    }
}

/// The PostgreSQL store. Cheap to clone (it is a connection pool).
#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    /// The id of this store's test clock (its sessions read it).
    #[cfg(feature = "test-clock")]
    test_clock: Option<String>,
    net: std::sync::Arc<db::Net>,
    /// Connections kept between calls (docs/storage.md).
    kept: std::sync::Arc<db::Kept>,
    /// Concurrent single enqueues that share a statement (docs/storage.md).
    grouper: std::sync::Arc<group::Grouper>,
    /// The reads of concurrent replays (group.rs).
    reads: std::sync::Arc<group::Reads>,
    /// Whether keyed enqueues are coming in as repeats (docs/storage.md).
    repeating: std::sync::Arc<enqueue::Repeating>,
}

/// Connection settings of [`PgStore::connect`].
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// Most connections in the pool.
    pub max_connections: u32,
    /// How long to wait for a free connection before `Unavailable`.
    pub acquire_timeout: Duration,
    /// Test-only (feature `test-clock`): the id of a test clock that every
    /// session of this pool reads as the clock of record, moved with
    /// [`PgStore::set_test_clock`]. Other sessions, of other pools and
    /// processes, keep the real clock.
    #[cfg(feature = "test-clock")]
    pub test_clock: Option<String>,
}

impl Default for PgOptions {
    fn default() -> Self {
        Self {
            max_connections: 10,
            acquire_timeout: Duration::from_secs(10),
            #[cfg(feature = "test-clock")]
            test_clock: None,
        }
    }
}

impl PgStore {
    /// Connects to `url` and checks that the schema is installed and current.
    ///
    /// Besides the driver's parameters the URL takes `pgbouncer=true` (for a
    /// PgBouncer in transaction pooling: no prepared statements, one
    /// transaction per call, wake-ups from `IDEMQ_WAKEUP_DATABASE_URL`) and
    /// `call_timeout_ms` (the most one call may take, 30 s by default: what
    /// bounds a call on a dead connection). See docs/storage.md.
    pub async fn connect(url: &str, options: PgOptions) -> Result<Self> {
        let (url, mut net) = db::split_url(url).map_err(|e| Error::validation("database", e))?;
        let mut connect: PgConnectOptions = url
            .parse()
            .map_err(|e| Error::validation("database", format!("bad PostgreSQL URL: {e}")))?;
        #[cfg(feature = "test-clock")]
        if let Some(id) = &options.test_clock {
            connect = connect.options([("idemq.test_clock", id.as_str())]);
        }
        if net.bouncer {
            // PgBouncer refuses startup parameters it does not know.
            connect = connect.statement_cache_capacity(0).extra_float_digits(None);
            db::mark_unprepared();
            net.wakeup = wakeup_url()?;
        }
        // sqlx checks an idle connection with a round trip (a `Sync`) at
        // every acquire by default: one more round trip per call, and a
        // wake-up of the server, on every hot path. A connection idle for
        // less than IDLE_CHECK is handed out as it is (one that broke
        // meanwhile fails its call `Unavailable`, like a call in flight);
        // one idle for longer is checked first, and replaced if broken.
        let pool = PgPoolOptions::new()
            .max_connections(options.max_connections)
            .acquire_timeout(options.acquire_timeout)
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for >= IDLE_CHECK {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect_with(connect)
            .await
            .map_err(|e| Error::Unavailable {
                message: format!("cannot connect to PostgreSQL: {e}"),
            })?;
        migrate::check(&pool).await?;
        let store = Self {
            pool,
            grouper: std::sync::Arc::new(group::Grouper::new(net.statements)),
            reads: std::sync::Arc::new(group::Reads::new(net.reads)),
            net: std::sync::Arc::new(net),
            kept: std::sync::Arc::default(),
            repeating: std::sync::Arc::default(),
            #[cfg(feature = "test-clock")]
            test_clock: options.test_clock,
        };
        if let Some(url) = &store.net.wakeup {
            db::probe_wakeups(url, store.db()).await?;
        }
        Ok(store)
    }

    /// A store over an existing pool (the schema must be installed).
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            #[cfg(feature = "test-clock")]
            test_clock: None,
            grouper: std::sync::Arc::new(group::Grouper::new(db::Net::default().statements)),
            reads: std::sync::Arc::new(group::Reads::new(db::Net::default().reads)),
            net: std::sync::Arc::default(),
            kept: std::sync::Arc::default(),
            repeating: std::sync::Arc::default(),
        }
    }

    /// The executor of the store's calls (docs/storage.md: deadline, PgBouncer).
    fn db(&self) -> db::Db<'_> {
        db::Db {
            pool: &self.pool,
            net: &self.net,
            kept: &self.kept,
        }
    }

    /// How many single enqueues were answered by a statement shared by
    /// several concurrent callers (docs/storage.md, "Concurrent enqueues
    /// share a statement").
    pub fn grouped_enqueues(&self) -> u64 {
        self.grouper.grouped()
    }

    /// How many replays' reads were answered by a statement shared by
    /// several concurrent callers (docs/storage.md, "Concurrent enqueues
    /// share a statement").
    pub fn grouped_reads(&self) -> u64 {
        self.reads.grouped()
    }

    /// The pool, for callers that run their own transactions.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Enqueue inside the caller's own transaction or connection: the jobs,
    /// their bindings and their events commit or roll back with the caller's
    /// rows. Nothing in it raises for a conflict or a validation failure, so
    /// the transaction stays usable after a refused item.
    pub async fn enqueue_in(
        conn: &mut PgConnection,
        items: &[PreparedEnqueue],
    ) -> Result<Vec<Result<EnqueueResult>>> {
        enqueue::enqueue(conn, items, &enqueue::Repeating::default()).await
    }

    /// Completes an attempt inside the caller's own transaction or
    /// connection, fenced by its lease: the completion commits or rolls
    /// back with the caller's rows. A lost lease is `LeaseLost` and writes
    /// nothing; nothing in it raises, so the transaction stays usable.
    pub async fn complete_in(conn: &mut PgConnection, p: &JobComplete) -> Result<()> {
        let row = sqlx::query(
            "SELECT ok FROM idemq.finish_attempt($1, $2, 'completed', NULL, true, NULL, NULL, $3::jsonb)",
        )
        .bind(&p.lease.job_id)
        .bind(&p.lease.lease_token)
        .bind(p.result.as_deref())
        .fetch_one(conn)
        .await
        .map_err(db_err)?;
        if !row.try_get::<bool, _>("ok").map_err(db_err)? {
            return Err(Error::LeaseLost {
                job_id: p.lease.job_id.clone(),
            });
        }
        Ok(())
    }

    /// Test-only (feature `test-clock`): sets this store's test clock (see
    /// [`PgOptions::test_clock`]) to `at`, so tests move time without
    /// sleeping; `None` returns its sessions to `clock_timestamp()`. Only
    /// the sessions of pools opened with the same clock id read it.
    #[cfg(feature = "test-clock")]
    pub async fn set_test_clock(&self, at: Option<DateTime<Utc>>) -> Result<()> {
        let Some(id) = &self.test_clock else {
            return Err(Error::validation(
                "test_clock",
                "this store was connected without PgOptions::test_clock",
            ));
        };
        let query = match at {
            Some(at) => sqlx::query(
                "INSERT INTO idemq.test_clocks (id, at) VALUES ($1, $2)
                 ON CONFLICT (id) DO UPDATE SET at = excluded.at",
            )
            .bind(id)
            .bind(at),
            None => sqlx::query("DELETE FROM idemq.test_clocks WHERE id = $1").bind(id),
        };
        query.execute(&self.pool).await.map_err(db_err)?;
        Ok(())
    }

    /// Test-only (feature `test-clock`): the id of this store's test clock.
    #[cfg(feature = "test-clock")]
    pub fn test_clock(&self) -> Option<&str> {
        self.test_clock.as_deref()
    }

    async fn lease_call(&self, sql: &'static str, p: &LeaseRef) -> Result<sqlx::postgres::PgRow> {
        sqlx::query(sql)
            .bind(&p.job_id)
            .bind(&p.lease_token)
            .fetch_one(self.db())
            .await
            .map_err(db_err)
    }

    #[allow(clippy::too_many_arguments)]
    async fn finish(
        &self,
        lease: &LeaseRef,
        kind: &str,
        error: Option<&str>,
        retryable: bool,
        retry_after_ms: Option<i64>,
        snooze_ms: Option<i64>,
        result: Option<&str>,
    ) -> Result<FailOutcome> {
        let row = sqlx::query(
            "SELECT ok, state, next_run_at FROM idemq.finish_attempt($1, $2, $3, $4, $5, $6, $7, $8::jsonb)",
        )
        .bind(&lease.job_id)
        .bind(&lease.lease_token)
        .bind(kind)
        .bind(error)
        .bind(retryable)
        .bind(retry_after_ms)
        .bind(snooze_ms)
        .bind(result)
        .fetch_one(self.db())
        .await
        .map_err(db_err)?;
        if !row.try_get::<bool, _>("ok").map_err(db_err)? {
            return Err(Error::LeaseLost {
                job_id: lease.job_id.clone(),
            });
        }
        let state: String = row.try_get("state").map_err(db_err)?;
        Ok(FailOutcome {
            state: JobState::from_derived(&state).map_err(|e| {
                e.at(
                    format!("job {}", lease.job_id),
                    "idemq.finish_attempt.state",
                )
            })?,
            next_run_at: row.try_get("next_run_at").map_err(db_err)?,
        })
    }
}

fn not_found(id: &str) -> Error {
    Error::job_not_found(id)
}

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn supports(&self, capability: Capability) -> bool {
        match capability {
            Capability::CallerTransactions => true,
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Two: the database works on one claim while the worker runs the jobs
    /// of the other (W3 in docs/benchmarks.md).
    fn claims_in_flight(&self) -> usize {
        2
    }

    async fn wakeups(&self) -> Result<Wakeups> {
        let mut listener = match (&self.net.wakeup, self.net.bouncer) {
            (Some(url), _) => sqlx::postgres::PgListener::connect(url).await,
            (None, false) => sqlx::postgres::PgListener::connect_with(&self.pool).await,
            (None, true) => return Err(db::no_wakeups()),
        }
        .map_err(db_err)?;
        listener.listen(NOTIFY_CHANNEL).await.map_err(db_err)?;
        Ok(Wakeups::channel(Listener(listener)))
    }

    async fn now(&self) -> Result<DateTime<Utc>> {
        sqlx::query_scalar("SELECT idemq.now()")
            .fetch_one(self.db())
            .await
            .map_err(db_err)
    }

    async fn job_enqueue(&self, mut p: JobEnqueue) -> Result<Vec<Result<EnqueueResult>>> {
        // One caller's single keyless request may share a statement with
        // other callers' (group.rs); behind PgBouncer every call keeps to
        // itself.
        if p.items.len() == 1
            && !p.atomic
            && !p.dry_run
            && !self.net.bouncer
            && enqueue::is_plain(&p.items[0])
        {
            let item = p.items.pop().expect("one item");
            return self
                .db()
                .bounded(async { Ok(vec![self.enqueue_single(item).await]) })
                .await;
        }
        // After a replay, concurrent callers' replays share their reads
        // (group.rs). Behind PgBouncer a call keeps to its own transaction,
        // which holds its server connection between the statement's parse
        // and its execution.
        if p.items.len() == 1
            && !p.atomic
            && !p.dry_run
            && !self.net.bouncer
            && self.repeating.get()
            && enqueue::only_key(&p.items[0]).is_some()
        {
            let item = p.items.pop().expect("one item");
            return self
                .db()
                .bounded(async { Ok(vec![self.enqueue_repeat(item).await?]) })
                .await;
        }
        self.db().bounded(self.enqueue_call(p)).await
    }

    async fn job_explain(&self, p: JobExplain) -> Result<Explain> {
        self.db()
            .bounded(async {
                let mut conn = db::Lent::of(self.db()).await.map_err(db_err)?;
                let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(db_err)?;
                let out = enqueue::explain(&mut tx, &p.item).await;
                tx.rollback().await.map_err(db_err)?;
                conn.keep_if(true);
                out
            })
            .await
    }

    async fn job_get(&self, p: JobRef) -> Result<Option<Job>> {
        query::job_get(self.db(), &p.job_id).await
    }

    async fn job_list(&self, p: JobListing) -> Result<JobPage> {
        query::job_list(self.db(), &p).await
    }

    async fn job_events(&self, p: JobRef) -> Result<Vec<Event>> {
        query::job_events(self.db(), &p.job_id).await
    }

    async fn job_runs(&self, p: JobRef) -> Result<Vec<Run>> {
        query::job_runs(self.db(), &p.job_id).await
    }

    async fn checkpoint_list(&self, p: JobRef) -> Result<BTreeMap<String, Value>> {
        query::checkpoint_list(self.db(), &p.job_id).await
    }

    async fn job_cancel(&self, p: JobRef) -> Result<CancelOutcome> {
        let row = sqlx::query("SELECT o_found, o_cancelled, o_state FROM idemq.cancel($1)")
            .bind(&p.job_id)
            .fetch_one(self.db())
            .await
            .map_err(db_err)?;
        if !row.try_get::<bool, _>("o_found").map_err(db_err)? {
            return Err(not_found(&p.job_id));
        }
        let stored: String = row.try_get("o_state").map_err(db_err)?;
        let state = JobState::from_derived(&stored)
            .map_err(|e| e.at(format!("job {}", p.job_id), "idemq.cancel.o_state"))?;
        Ok(CancelOutcome {
            cancelled: row.try_get("o_cancelled").map_err(db_err)?,
            state,
        })
    }

    async fn job_cancel_by_key(&self, p: JobCancelByKey) -> Result<bool> {
        sqlx::query_scalar("SELECT idemq.cancel_by_key($1, $2)")
            .bind(&p.job_type)
            .bind(&p.key)
            .fetch_one(self.db())
            .await
            .map_err(db_err)
    }

    async fn job_purge(&self, p: JobRef) -> Result<bool> {
        sqlx::query_scalar("SELECT idemq.purge($1)")
            .bind(&p.job_id)
            .fetch_one(self.db())
            .await
            .map_err(db_err)
    }

    async fn job_promote(&self, p: JobRef) -> Result<bool> {
        let promoted: Option<bool> = sqlx::query_scalar("SELECT idemq.promote($1)")
            .bind(&p.job_id)
            .fetch_one(self.db())
            .await
            .map_err(db_err)?;
        promoted.ok_or_else(|| not_found(&p.job_id))
    }

    async fn job_redrive(&self, p: JobRedrive) -> Result<EnqueueResult> {
        enqueue::redrive(self.db(), &p).await
    }

    async fn queue_pause(&self, p: QueuePause) -> Result<bool> {
        sqlx::query(
            "INSERT INTO idemq.queues (name, paused, updated_at) VALUES ($1, $2, idemq.now())
             ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at",
        )
        .bind(&p.queue)
        .bind(p.paused)
        .execute(self.db())
        .await
        .map_err(db_err)?;
        if !p.paused {
            sqlx::query("SELECT pg_notify($1, $2)")
                .bind(NOTIFY_CHANNEL)
                .bind(&p.queue)
                .execute(self.db())
                .await
                .map_err(db_err)?;
        }
        Ok(p.paused)
    }

    async fn queue_list(&self) -> Result<Vec<QueueInfo>> {
        query::queue_list(self.db()).await
    }

    async fn job_claim(&self, p: JobClaim) -> Result<Recording<Vec<ClaimedJob>>> {
        let (_, claimed) = self
            .job_complete_and_claim(JobCompleteMany { items: Vec::new() }, p)
            .await?;
        claimed
    }

    async fn lease_heartbeat(&self, p: LeaseRef) -> Result<Recording<Result<Heartbeat>>> {
        let row = self
            .lease_call(
                "SELECT ok, lease_expires_at, cancel_requested, ended
                 FROM idemq.heartbeat($1, $2)",
                &p,
            )
            .await?;
        let mut recorded = Recorded::default();
        let beat = heartbeat_row(&row, &p, &mut recorded)?;
        Ok(Recording::new(beat, recorded))
    }

    async fn lease_heartbeat_many(
        &self,
        p: LeaseHeartbeatMany,
    ) -> Result<Recording<Vec<Result<Heartbeat>>>> {
        if p.items.is_empty() {
            return Ok(Recording::only(Vec::new()));
        }
        let ids: Vec<&str> = p.items.iter().map(|l| l.job_id.as_str()).collect();
        let tokens: Vec<&str> = p.items.iter().map(|l| l.lease_token.as_str()).collect();
        let rows = sqlx::query(
            "SELECT idx, ok, busy, lease_expires_at, cancel_requested, ended
             FROM idemq.heartbeat_many($1, $2)",
        )
        .bind(&ids)
        .bind(&tokens)
        .fetch_all(self.db())
        .await
        .map_err(db_err)?;
        let mut out: Vec<Option<Result<Heartbeat>>> = (0..p.items.len()).map(|_| None).collect();
        let mut recorded = Recorded::default();
        let mut busy = Vec::new();
        for row in &rows {
            let idx: i32 = row.try_get("idx").map_err(db_err)?;
            let Some(i) = usize::try_from(idx).ok().filter(|&i| i < out.len()) else {
                return Err(Error::Backend {
                    message: format!("idemq.heartbeat_many answered for an unknown item {idx}"),
                });
            };
            if row.try_get::<bool, _>("busy").map_err(db_err)? {
                busy.push(i);
                continue;
            }
            out[i] = Some(heartbeat_row(row, &p.items[i], &mut recorded)?);
        }
        // A job another transaction holds: renewed on its own, waiting for
        // that transaction as a single heartbeat does, beside the others.
        let waited = futures_util::future::join_all(
            busy.iter()
                .map(|&i| self.lease_heartbeat(p.items[i].clone())),
        )
        .await;
        for (i, outcome) in busy.into_iter().zip(waited) {
            out[i] = Some(outcome.and_then(|r| {
                recorded.add(r.recorded);
                r.answer
            }));
        }
        let answer = out
            .into_iter()
            .enumerate()
            .map(|(i, o)| {
                o.ok_or_else(|| Error::Backend {
                    message: format!("idemq.heartbeat_many gave no answer for item {i}"),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Recording::new(answer, recorded))
    }

    async fn job_complete(&self, p: JobComplete) -> Result<()> {
        self.finish(
            &p.lease,
            "completed",
            None,
            true,
            None,
            None,
            p.result.as_deref(),
        )
        .await?;
        Ok(())
    }

    async fn job_complete_many(&self, p: JobCompleteMany) -> Result<Vec<Result<()>>> {
        let claim = JobClaim::nothing();
        let (completed, _) = self.job_complete_and_claim(p, claim).await?;
        Ok(completed)
    }

    async fn job_complete_and_claim(
        &self,
        done: JobCompleteMany,
        claim: JobClaim,
    ) -> Result<(Vec<Result<()>>, Result<Recording<Vec<ClaimedJob>>>)> {
        // Rows are locked in job-id order, so two batches cannot deadlock.
        let items = &done.items;
        let mut order: Vec<usize> = (0..items.len()).collect();
        order.sort_by(|&a, &b| items[a].lease.job_id.cmp(&items[b].lease.job_id));
        let ids: Vec<&str> = order
            .iter()
            .map(|&i| items[i].lease.job_id.as_str())
            .collect();
        let tokens: Vec<&str> = order
            .iter()
            .map(|&i| items[i].lease.lease_token.as_str())
            .collect();
        let results: Vec<Option<&str>> =
            order.iter().map(|&i| items[i].result.as_deref()).collect();
        let queues = (!claim.queues.is_empty()).then_some(&claim.queues);
        let rows = sqlx::query(
            "SELECT idx, ok, id, type, queue, payload, attempt, max_attempts, lease_token,
                    lease_expires_at, timeout_ms, deadline, tags, r_expired, r_retries, r_dead
             FROM idemq.complete_and_claim($1, $2, $3::text[]::jsonb[], $4, $5, $6, $7, $8)",
        )
        .bind(&ids)
        .bind(&tokens)
        .bind(&results)
        .bind(queues)
        .bind(claim.types.as_ref())
        .bind(&claim.worker)
        .bind(i32::try_from(claim.limit).unwrap_or(i32::MAX))
        .bind(claim.lease_ms)
        .fetch_all(self.db())
        .await
        .map_err(db_err)?;
        let mut completed: Vec<Result<()>> = items
            .iter()
            .map(|i| {
                Err(Error::Backend {
                    message: format!("no completion result for job {}", i.lease.job_id),
                })
            })
            .collect();
        let mut claimed = Vec::new();
        let mut recorded = Recorded::default();
        for r in &rows {
            let decoded = (|| -> Result<(), sqlx::Error> {
                if let Some(idx) = r.try_get::<Option<i32>, _>("idx")? {
                    let ok: bool = r.try_get("ok")?;
                    if let Some(&item) = usize::try_from(idx).ok().and_then(|i| order.get(i)) {
                        completed[item] = if ok {
                            Ok(())
                        } else {
                            Err(Error::LeaseLost {
                                job_id: items[item].lease.job_id.clone(),
                            })
                        };
                    }
                } else if r.try_get::<Option<i32>, _>("r_expired")?.is_some() {
                    // What the claim recorded beside (its last row).
                    let n = |c| -> Result<u64, sqlx::Error> {
                        Ok(u64::try_from(r.try_get::<i32, _>(c)?).unwrap_or(0))
                    };
                    recorded.add(Recorded {
                        lease_expiries: n("r_expired")?,
                        retries: n("r_retries")?,
                        dead: n("r_dead")?,
                    });
                } else {
                    claimed.push(ClaimedJob {
                        id: r.try_get("id")?,
                        job_type: r.try_get("type")?,
                        queue: r.try_get("queue")?,
                        payload: r.try_get("payload")?,
                        attempt: r.try_get("attempt")?,
                        max_attempts: r.try_get("max_attempts")?,
                        lease_token: LeaseToken::new(r.try_get::<String, _>("lease_token")?),
                        lease_expires_at: r.try_get("lease_expires_at")?,
                        timeout_ms: r.try_get("timeout_ms")?,
                        deadline: r.try_get("deadline")?,
                        tags: r.try_get("tags")?,
                    });
                }
                Ok(())
            })();
            decoded.map_err(db_err)?;
        }
        Ok((completed, Ok(Recording::new(claimed, recorded))))
    }

    async fn job_fail(&self, p: JobFail) -> Result<FailOutcome> {
        let kind = if p.snooze_ms.is_some() {
            "snoozed"
        } else {
            "failed"
        };
        self.finish(
            &p.lease,
            kind,
            Some(&p.error),
            p.retryable,
            p.retry_after_ms,
            p.snooze_ms,
            None,
        )
        .await
    }

    async fn job_release(&self, p: LeaseRef) -> Result<JobState> {
        Ok(self
            .finish(&p, "released", None, true, None, None, None)
            .await?
            .state)
    }

    async fn checkpoint_put(&self, p: CheckpointPut) -> Result<bool> {
        let row = sqlx::query("SELECT ok, stored FROM idemq.checkpoint_put($1, $2, $3, $4::jsonb)")
            .bind(&p.lease.job_id)
            .bind(&p.lease.lease_token)
            .bind(&p.name)
            .bind(&p.value)
            .fetch_one(self.db())
            .await
            .map_err(db_err)?;
        if !row.try_get::<bool, _>("ok").map_err(db_err)? {
            return Err(Error::LeaseLost {
                job_id: p.lease.job_id,
            });
        }
        row.try_get("stored").map_err(db_err)
    }

    async fn checkpoint_get(&self, p: CheckpointGet) -> Result<Option<Value>> {
        sqlx::query_scalar("SELECT value FROM idemq.checkpoints WHERE job_id = $1 AND name = $2")
            .bind(&p.job_id)
            .bind(&p.name)
            .fetch_optional(self.db())
            .await
            .map_err(db_err)
    }

    async fn binding_lookup(&self, p: BindingRef) -> Result<Option<BindingInfo>> {
        query::binding_lookup(self.db(), &p).await
    }

    async fn binding_release(&self, p: BindingRef) -> Result<bool> {
        sqlx::query_scalar("SELECT idemq.binding_release($1, $2)")
            .bind(&p.scope)
            .bind(&p.hash[..])
            .fetch_one(self.db())
            .await
            .map_err(db_err)
    }

    async fn dedupe_lookup(&self, p: DedupeRef) -> Result<Option<ExplainDedupe>> {
        query::dedupe_lookup(self.db(), &p).await
    }

    async fn binding_sweep(&self, p: Sweep) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT idemq.binding_sweep($1)")
            .bind(i32::try_from(p.limit).unwrap_or(i32::MAX))
            .fetch_one(self.db())
            .await
            .map_err(db_err)?;
        Ok(n as u64)
    }

    async fn lease_reap(&self, p: Sweep) -> Result<Recorded> {
        let (expired, retries, dead): (i32, i32, i32) =
            sqlx::query_as("SELECT expired, retries, dead FROM idemq.lease_reap($1)")
                .bind(i32::try_from(p.limit).unwrap_or(i32::MAX))
                .fetch_one(self.db())
                .await
                .map_err(db_err)?;
        let n = |v: i32| u64::try_from(v).unwrap_or(0);
        Ok(Recorded {
            lease_expiries: n(expired),
            retries: n(retries),
            dead: n(dead),
        })
    }

    async fn job_retention_sweep(&self, p: Sweep) -> Result<u64> {
        let n: i64 = sqlx::query_scalar("SELECT idemq.retention_sweep($1)")
            .bind(i32::try_from(p.limit).unwrap_or(i32::MAX))
            .fetch_one(self.db())
            .await
            .map_err(db_err)?;
        Ok(n as u64)
    }

    async fn schedule_put(&self, p: SchedulePut) -> Result<bool> {
        schedule::put(self.db(), &p).await
    }

    async fn schedule_delete(&self, p: ScheduleRef) -> Result<bool> {
        schedule::delete(self.db(), &p.name).await
    }

    async fn installation_key_check(&self, p: KeyCheck) -> Result<String> {
        installation::key_check(self.db(), &p.value).await
    }

    async fn installation_key_check_replace(&self, p: KeyCheck) -> Result<KeyCheckChange> {
        installation::key_check_replace(self.db(), &p.value).await
    }

    async fn schedule_list(&self) -> Result<crate::schedule::ScheduleList> {
        schedule::list(self.db()).await
    }

    async fn schedule_due(&self, p: ScheduleDue) -> Result<DueSchedules> {
        schedule::due(self.db(), p.limit).await
    }

    async fn schedule_mark_fired(&self, p: ScheduleMarkFired) -> Result<bool> {
        schedule::mark_fired(self.db(), &p).await
    }
}

impl PgStore {
    /// A request whose only key is its idempotency key, after a replay:
    /// its binding read first (with concurrent callers' reads), then, if
    /// that found no binding with its fingerprint, on to `only_keyed`.
    async fn enqueue_repeat(&self, item: PreparedEnqueue) -> Result<Result<EnqueueResult>> {
        let Some(key) = enqueue::only_key(&item) else {
            return Err(Error::Backend {
                message: "a repeat without an idempotency key".into(),
            });
        };
        let found = self.read_bound(key, item.fingerprint.compact()).await?;
        if let enqueue::Bound::Same(job_id) = found {
            return Ok(Ok(enqueue::replayed(job_id)));
        }
        let mut conn = db::Lent::of(self.db()).await.map_err(db_err)?;
        let out = enqueue::only_keyed(&mut conn, &item, key, &self.repeating, Some(found)).await;
        conn.keep_if(out.is_ok());
        out
    }

    /// An enqueue call: one statement, in a transaction for an atomic batch,
    /// a dry run, or behind PgBouncer.
    async fn enqueue_call(&self, p: JobEnqueue) -> Result<Vec<Result<EnqueueResult>>> {
        // Behind PgBouncer a plain batch runs in a transaction too, to keep
        // its server connection.
        if !p.atomic && !p.dry_run && !self.net.bouncer {
            let mut conn = db::Lent::of(self.db()).await.map_err(db_err)?;
            let out = enqueue::enqueue(&mut conn, &p.items, &self.repeating).await;
            // A refused item is an answer in `Ok`; an error here is the
            // call's own, so the connection goes back to the pool, checked.
            conn.keep_if(out.is_ok());
            return out;
        }
        // All-or-nothing and dry runs: the function never raises for an
        // item, so the batch runs in a transaction that is rolled back on the
        // first error (or always, for a dry run).
        let mut conn = db::Lent::of(self.db()).await.map_err(db_err)?;
        let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(db_err)?;
        let mut results = enqueue::enqueue(&mut tx, &p.items, &self.repeating).await?;
        let failed = if p.atomic {
            results.iter().position(Result::is_err)
        } else {
            None
        };
        if p.dry_run || failed.is_some() {
            tx.rollback().await.map_err(db_err)?;
        } else {
            tx.commit().await.map_err(db_err)?;
        }
        conn.keep_if(true);
        if let Some(index) = failed {
            let error = match results.swap_remove(index) {
                Err(e) => e,
                Ok(_) => Error::Backend {
                    message: "batch item error vanished".into(),
                },
            };
            return Err(Error::BatchItem {
                index,
                error: Box::new(error),
            });
        }
        Ok(results)
    }
}

/// How long a pooled connection may sit idle before it is checked with a
/// round trip when next acquired.
const IDLE_CHECK: std::time::Duration = std::time::Duration::from_secs(1);

/// `IDEMQ_WAKEUP_DATABASE_URL`: the direct connection of wake-ups behind PgBouncer.
fn wakeup_url() -> Result<Option<String>> {
    match std::env::var("IDEMQ_WAKEUP_DATABASE_URL") {
        Ok(url) if url.trim().is_empty() => Ok(None),
        Ok(url) => Ok(Some(
            db::split_url(&url)
                .map_err(|e| Error::validation("IDEMQ_WAKEUP_DATABASE_URL", e))?
                .0,
        )),
        Err(_) => Ok(None),
    }
}

/// A row of `idemq.heartbeat` or `idemq.heartbeat_many` for `lease`: the
/// renewal, or the lost lease, counting in `recorded` the attempt's end the
/// heartbeat recorded (past its timeout or deadline).
fn heartbeat_row(
    row: &sqlx::postgres::PgRow,
    lease: &LeaseRef,
    recorded: &mut Recorded,
) -> Result<Result<Heartbeat>> {
    if let Some(state) = row.try_get::<Option<String>, _>("ended").map_err(db_err)? {
        recorded.ended(
            JobState::from_derived(&state)
                .map_err(|e| e.at(format!("job {}", lease.job_id), "idemq.heartbeat.ended"))?,
        );
    }
    if !row.try_get::<bool, _>("ok").map_err(db_err)? {
        return Ok(Err(Error::LeaseLost {
            job_id: lease.job_id.clone(),
        }));
    }
    Ok(Ok(Heartbeat {
        lease_expires_at: row.try_get("lease_expires_at").map_err(db_err)?,
        cancel_requested: row.try_get("cancel_requested").map_err(db_err)?,
    }))
}
