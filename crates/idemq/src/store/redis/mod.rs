//! The Redis backend (feature `redis`), for users whose queue already lives
//! in Redis.
//!
//! Opened from a URL like every backend (`redis://host:port[/db]`,
//! `redis+unix:///path.sock`; [`Location`]), so
//! [`Queue::connect`](crate::Queue::connect), `idemq serve`, `idemq worker`
//! and `idemq migrate` take it. The whole conformance suite, the model-based
//! test and the HTTP API tests run on it; it lacks only
//! [`Capability::CallerTransactions`](super::Capability) (Redis has no
//! transaction around the caller's own writes).
//!
//! **One round trip per operation.** Every operation of the [`Store`]
//! trait is one `FCALL` of a function of the idemq Redis Functions library
//! (`lua/`), which Redis runs atomically. Redis cannot roll back a
//! function that errors after a write, so each function decides first (all
//! reads and checks, every row it will write checked to read) and then
//! writes with commands that cannot fail; a batch enqueue decides every
//! item before it writes any, and a claim every job. A row that does not
//! read ends the call before its first write with the `Backend` error
//! naming it (`UNREADABLE`, `codec.rs`). `idemq migrate` loads the library
//! (`FUNCTION LOAD REPLACE`; functions persist in the AOF and survive
//! restarts) and records its version and revision under the installation's
//! key prefix; a binary refuses an installation migrated for another
//! version, and does not migrate one recorded for a higher revision.
//!
//! **One primary.** A server in cluster mode is refused at connect (and by
//! `idemq migrate`, which then writes nothing) with a `Validation` error on
//! `database`: a function reads and writes keys it learns from the data,
//! which Redis Cluster refuses unless every key is declared and on one slot.
//!
//! **Durability.** "Nothing acknowledged is lost" holds only with
//! `appendonly yes`, `appendfsync always`, `no-appendfsync-on-rewrite no`
//! and `maxmemory-policy noeviction`; [`RedisStore::connect`] checks them
//! and refuses a server without them unless the URL says
//! `?durability=relaxed` ([`RedisStore::durability_relaxed`]). Every
//! maintenance pass checks them again: while they are off, a strict store
//! refuses writes and reports relaxed durability (`durability.rs`).
//! Replication is asynchronous: a failover can lose acknowledged work.
//!
//! **Connections.** One multiplexed connection, re-established by the
//! driver's connection manager after a drop. A command in flight when the
//! connection dropped is never sent again (its outcome is unknown): it
//! fails with `Unavailable`, so an enqueue without a key cannot run twice
//! behind the caller's back.
//!
//! **Time.** The clock of record is the server's `TIME`, read once per
//! operation inside the function. Windows, leases and retention are stored
//! fields compared with that clock and swept by the maintenance operations,
//! never Redis key expiry (a test clock could not move it, and lookups
//! could not see it). Timestamps are integer microseconds, formatted in Lua
//! with `%d` only (Lua's `tostring` would round them).
//!
//! **Wake-ups.** Enqueue, release, retries, promote and resume `PUBLISH` the
//! queue's name on `<prefix>wake`; the store's subscriber, on a connection
//! of its own, signals waiting workers, which also poll.
//!
//! The data layout (every key under the prefix) is described in
//! `docs/storage.md` and in [`layout`].

mod args;
mod codec;
mod durability;
pub mod layout;
mod library;
mod migrate;
mod url;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Cmd, Value};
use async_trait::async_trait;
use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use serde_json::Value as Json;
use tokio::sync::Notify;

use super::*;
use crate::error::Error;
use crate::job::JobState;
use codec::{array, at, int, opt_string, string};
pub use durability::DURABLE as DURABLE_SETTINGS;
pub use library::{FUNCTIONS_REVISION, LAYOUT};
use library::{LIBRARY, not_current};
use migrate::{Installed, installed, loaded, newer, newer_functions};
pub use migrate::{migrate, migration_status};
pub use url::{DEFAULT_PREFIX, RedisUrl};

/// The library's functions that write nothing (registered `no-writes`):
/// what a store still answers while its server's durable settings are off.
const READS: [&str; 13] = [
    "now",
    "explain",
    "job_get",
    "job_list",
    "job_events",
    "job_runs",
    "checkpoint_list",
    "checkpoint_get",
    "binding_lookup",
    "dedupe_lookup",
    "queue_list",
    "schedule_list",
    "schedule_due",
];

/// How long one call may take before it fails with `Unavailable`.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Maps a driver error: a dropped or refused connection, a timeout, a
/// server loading its data, read-only, busy or out of memory is
/// `Unavailable` (retryable); a missing function means the library is not
/// loaded; a function that met a stored value it cannot act on
/// (`UNREADABLE`, before any write) is the `Backend` error naming it.
pub(crate) fn redis_err(e: ::redis::RedisError) -> Error {
    use ::redis::{ErrorKind, ServerErrorKind};
    if e.code() == Some("UNREADABLE") {
        return codec::unreadable(e.detail().unwrap_or_default());
    }
    let retryable = e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_timeout()
        || matches!(
            e.kind(),
            ErrorKind::Server(
                ServerErrorKind::BusyLoading
                    | ServerErrorKind::TryAgain
                    | ServerErrorKind::ClusterDown
                    | ServerErrorKind::MasterDown
                    | ServerErrorKind::ReadOnly
            )
        )
        || matches!(e.code(), Some("OOM" | "BUSY" | "NOREPLICAS"));
    if retryable {
        return Error::Unavailable {
            message: format!("redis: {e}"),
        };
    }
    if e.to_string().contains("Function not found") {
        return Error::Backend {
            message: "redis: the idemq functions are not loaded on this server: run `idemq \
                      migrate`"
                .into(),
        };
    }
    Error::Backend {
        message: format!("redis: {e}"),
    }
}

/// Connection settings of [`RedisStore::connect`].
#[derive(Clone, Debug, Default)]
pub struct RedisOptions {
    /// Test-only (feature `test-clock`): every function reads
    /// `<prefix>test_clock` (µs), when set, as the clock of record instead
    /// of the server's `TIME`; moved with [`RedisStore::set_test_clock`].
    /// Without this option the key is ignored.
    #[cfg(feature = "test-clock")]
    pub test_clock: bool,
}

struct Inner {
    client: ::redis::Client,
    conn: ConnectionManager,
    prefix: String,
    relaxed: bool,
    /// The durable settings since connect (a strict store only).
    watch: durability::Watch,
    test_clock: bool,
    wakeup: Arc<Notify>,
    /// The subscriber task, started by the first `wakeups` call.
    listener: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(task) = self
            .listener
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
    }
}

/// The Redis store. Cheap to clone.
#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("prefix", &self.inner.prefix)
            .field("relaxed", &self.inner.relaxed)
            .finish_non_exhaustive()
    }
}

async fn open(url: &RedisUrl) -> Result<(::redis::Client, ConnectionManager)> {
    let client = ::redis::Client::open(url.driver.as_str())
        .map_err(|e| Error::validation("database", format!("bad Redis URL: {e}")))?;
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_connection_timeout(Some(CONNECT_TIMEOUT));
    let conn = client
        .get_connection_manager_with_config(config)
        .await
        .map_err(|e| Error::Unavailable {
            message: format!("cannot connect to Redis: {e}"),
        })?;
    standalone(&mut conn.clone()).await?;
    Ok((client, conn))
}

/// Refuses a server in cluster mode (`INFO cluster` says
/// `cluster_enabled:1`), before anything is written: every function reads
/// and writes keys it learns from the data (a job's queue, its bindings,
/// its lane), which Redis Cluster refuses unless every key of a call is
/// declared and on one slot. A server that does not answer `INFO` (renamed
/// or refused by its ACL) is not checked.
async fn standalone(conn: &mut ConnectionManager) -> Result<()> {
    let info: String = match ::redis::cmd("INFO").arg("cluster").query_async(conn).await {
        Ok(info) => info,
        Err(e) => {
            let error = redis_err(e);
            return if error.is_retryable() {
                Err(error)
            } else {
                Ok(())
            };
        }
    };
    let cluster = info.lines().any(|l| {
        l.strip_prefix("cluster_enabled:")
            .is_some_and(|v| v.trim() == "1")
    });
    if cluster {
        return Err(Error::validation(
            "database",
            "the Redis server runs in cluster mode (cluster_enabled:1), and Redis Cluster is not \
             supported: an idemq function reads and writes keys it learns from the data, which a \
             cluster refuses across slots. Point idemq at a standalone Redis primary \
             (cluster-enabled no), with replicas and Sentinel for failover, or use PostgreSQL",
        ));
    }
    Ok(())
}

/// Checks the server `url` names as a strict store does at connect,
/// whatever the URL's `durability` says: `Ok` when it has every setting of
/// [`DURABLE_SETTINGS`]; else the `Validation` error on `database` a strict
/// store refuses it with (naming the setting that is off, or saying they
/// cannot be read, or that the server runs in cluster mode), or
/// `Unavailable` when it cannot be reached. `idemq bench` checks the
/// server it measures with it.
pub async fn check_durability(url: &RedisUrl) -> Result<()> {
    let (_, mut conn) = open(url).await?;
    durability::check(&mut conn).await
}

impl RedisStore {
    /// Connects to `url` (`redis://host:port[/db]` or
    /// `redis+unix:///path.sock`, with `?prefix=` (default `idemq:`) and
    /// `?durability=relaxed`), checks the server's durability settings and
    /// that `idemq migrate` installed this binary's functions.
    pub async fn connect(url: &str, options: RedisOptions) -> Result<Self> {
        let url = RedisUrl::parse(url)?;
        let (client, mut conn) = open(&url).await?;
        if !url.relaxed {
            durability::check(&mut conn).await?;
        }
        let Installed {
            layout,
            version,
            revision,
        } = installed(&mut conn, &url.prefix).await?;
        if layout > LAYOUT {
            return Err(newer(&mut conn, &url.prefix, layout).await);
        }
        if let Some(newer) = newer_functions(&mut conn, &url.prefix, revision).await {
            return Err(newer);
        }
        match version {
            None => return Err(not_current(&url.prefix, "is not set up")),
            Some(v) if v != LIBRARY.version => {
                return Err(not_current(
                    &url.prefix,
                    &format!(
                        "was migrated for the functions {v}, and this binary's are {}",
                        LIBRARY.version
                    ),
                ));
            }
            Some(_) => {}
        }
        if layout < LAYOUT {
            return Err(not_current(&url.prefix, "has an older layout"));
        }
        if !loaded(&mut conn).await? {
            return Err(not_current(
                &url.prefix,
                "needs functions this Redis server does not have loaded",
            ));
        }
        #[cfg(feature = "test-clock")]
        let test_clock = options.test_clock;
        #[cfg(not(feature = "test-clock"))]
        let test_clock = {
            let _ = options;
            false
        };
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                conn,
                prefix: url.prefix,
                relaxed: url.relaxed,
                watch: durability::Watch::default(),
                test_clock,
                wakeup: Arc::new(Notify::new()),
                listener: Mutex::new(None),
            }),
        })
    }

    /// Whether the store runs without the durability check
    /// (`?durability=relaxed`): acknowledged jobs may be lost.
    pub fn durability_relaxed(&self) -> bool {
        self.inner.relaxed
    }

    /// The prefix of every key of this installation.
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// Test-only (feature `test-clock`): sets the clock of record of this
    /// installation's stores opened with [`RedisOptions::test_clock`] to
    /// `at`; `None` returns them to the server's `TIME`.
    #[cfg(feature = "test-clock")]
    pub async fn set_test_clock(&self, at: Option<DateTime<Utc>>) -> Result<()> {
        if !self.inner.test_clock {
            return Err(Error::validation(
                "test_clock",
                "this store was connected without RedisOptions::test_clock",
            ));
        }
        let key = format!("{}test_clock", self.inner.prefix);
        let mut cmd = ::redis::cmd(if at.is_some() { "SET" } else { "DEL" });
        cmd.arg(&key);
        if let Some(at) = at {
            cmd.arg(at.timestamp_micros());
        }
        let _: Value = cmd
            .query_async(&mut self.inner.conn.clone())
            .await
            .map_err(redis_err)?;
        Ok(())
    }

    /// An `FCALL` of function `op` of this binary's library, with the
    /// arguments every function takes first; refused (`Unavailable`) for a
    /// function that writes while the server's durable settings are off
    /// (`durability.rs`).
    fn fcall(&self, op: &str) -> Result<Cmd> {
        if !READS.contains(&op)
            && let Some(refused) = self.inner.watch.refusal()
        {
            return Err(refused);
        }
        let mut cmd = ::redis::cmd("FCALL");
        cmd.arg(LIBRARY.function(op))
            .arg(0)
            .arg(&self.inner.prefix)
            .arg(if self.inner.test_clock { "1" } else { "0" });
        Ok(cmd)
    }

    /// Reads the server's durable settings again (a strict store; a
    /// relaxed one never checks): while they are off every write is
    /// refused and [`Store::durability`] says why; the first check that
    /// finds them again lifts both. The maintenance pass calls it.
    async fn recheck_durability(&self) -> Result<()> {
        if self.inner.relaxed {
            return Ok(());
        }
        self.inner.watch.recheck(&mut self.inner.conn.clone()).await
    }

    async fn run(&self, cmd: Cmd) -> Result<Value> {
        cmd.query_async(&mut self.inner.conn.clone())
            .await
            .map_err(redis_err)
    }

    /// Calls `op` with one more argument.
    async fn call1(&self, op: &str, arg: impl ::redis::ToRedisArgs) -> Result<Value> {
        let mut cmd = self.fcall(op)?;
        cmd.arg(arg);
        self.run(cmd).await
    }

    /// Starts the subscriber that turns `PUBLISH`ed wake-ups into signals,
    /// once. It reconnects by itself; a wake-up missed meanwhile is made up
    /// by the workers' polling, and a fresh subscription wakes everyone once.
    fn listen(&self) {
        let mut task = self
            .inner
            .listener
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if task.is_some() {
            return;
        }
        let client = self.inner.client.clone();
        let channel = format!("{}wake", self.inner.prefix);
        let wakeup = self.inner.wakeup.clone();
        *task = Some(tokio::spawn(async move {
            loop {
                if let Ok(mut pubsub) = client.get_async_pubsub().await
                    && pubsub.subscribe(&channel).await.is_ok()
                {
                    wake(&wakeup);
                    let mut messages = pubsub.on_message();
                    while messages.next().await.is_some() {
                        wake(&wakeup);
                    }
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }));
    }
}

/// Wakes every waiting worker, and leaves a permit for one between two
/// waits so the signal is not lost.
fn wake(n: &Notify) {
    n.notify_waiters();
    n.notify_one();
}

fn lease_lost(lease: &LeaseRef) -> Error {
    Error::LeaseLost {
        job_id: lease.job_id.clone(),
    }
}

/// The status word a function's reply starts with.
fn status(v: &Value) -> Result<(String, &[Value])> {
    let r = array(v)?;
    Ok((string(at(r, 0)?)?, r))
}

mod schedule;
mod store_impl;

#[cfg(test)]
mod tests {
    use super::*;

    /// A function that writes is refused while the durable settings are
    /// off: [`READS`] must name exactly the functions registered `no-writes`.
    #[test]
    fn reads_are_the_functions_registered_without_writes() {
        let mut registered: Vec<&str> = LIBRARY
            .source
            .split("\nreg('")
            .skip(1)
            .filter(|f| {
                // A function ends at the first `end` of a line of its own.
                f.find("\nend")
                    .is_some_and(|at| f[at..].starts_with("\nend, true)"))
            })
            .filter_map(|f| f.split('\'').next())
            .collect();
        registered.sort_unstable();
        let mut reads = READS.to_vec();
        reads.sort_unstable();
        assert_eq!(registered, reads);
    }
}
