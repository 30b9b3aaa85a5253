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
//! reads and checks) and then writes with commands that cannot fail; a
//! batch enqueue decides every item before it writes any. `idemq migrate`
//! loads the library (`FUNCTION LOAD REPLACE`; functions persist in the AOF
//! and survive restarts) and records its version under the installation's
//! key prefix; a binary refuses an installation migrated for another
//! version.
//!
//! **Durability.** "Nothing acknowledged is lost" holds only with
//! `appendonly yes`, `appendfsync always` and `maxmemory-policy
//! noeviction`; [`RedisStore::connect`] checks them and refuses a server
//! without them unless the URL says `?durability=relaxed`
//! ([`RedisStore::durability_relaxed`]). Replication is asynchronous: a
//! failover can lose acknowledged work.
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
pub mod layout;
mod library;
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
pub use library::LAYOUT;
use library::{LIBRARY, not_current};
pub use url::{DEFAULT_PREFIX, RedisUrl};

/// How long one call may take before it fails with `Unavailable`.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Maps a driver error: a dropped or refused connection, a timeout, a
/// server loading its data, read-only, busy or out of memory is
/// `Unavailable` (retryable); a missing function means the library is not
/// loaded.
pub(crate) fn redis_err(e: ::redis::RedisError) -> Error {
    use ::redis::{ErrorKind, ServerErrorKind};
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
    Ok((client, conn))
}

/// Refuses a server whose settings could lose acknowledged writes, naming
/// the setting to change.
async fn check_durability(conn: &mut ConnectionManager) -> Result<()> {
    let wanted = [
        ("appendonly", "yes"),
        ("appendfsync", "always"),
        ("maxmemory-policy", "noeviction"),
    ];
    for (name, value) in wanted {
        let got: std::collections::HashMap<String, String> = ::redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(conn)
            .await
            .map_err(|e| {
                Error::validation(
                    "database",
                    format!(
                        "cannot read the Redis setting {name} to check durability ({e}); add \
                         ?durability=relaxed to the URL to run without the check"
                    ),
                )
            })?;
        let got = got.get(name).map(String::as_str).unwrap_or("(unset)");
        if !got.eq_ignore_ascii_case(value) {
            return Err(Error::validation(
                "database",
                format!(
                    "the Redis server runs with {name} {got}, which can lose acknowledged \
                     jobs: set `{name} {value}` (appendonly yes, appendfsync always, \
                     maxmemory-policy noeviction), or add ?durability=relaxed to the URL to \
                     accept the loss"
                ),
            ));
        }
    }
    Ok(())
}

/// The layout and library version an installation was migrated for.
async fn installed(conn: &mut ConnectionManager, prefix: &str) -> Result<(i64, Option<String>)> {
    let (layout, version): (Option<i64>, Option<String>) = ::redis::pipe()
        .get(format!("{prefix}layout"))
        .get(format!("{prefix}version"))
        .query_async(conn)
        .await
        .map_err(redis_err)?;
    Ok((layout.unwrap_or(0), version))
}

/// Whether this binary's library is loaded on the server.
async fn loaded(conn: &mut ConnectionManager) -> Result<bool> {
    let found: Value = ::redis::cmd("FUNCTION")
        .arg("LIST")
        .arg("LIBRARYNAME")
        .arg(LIBRARY.name())
        .query_async(conn)
        .await
        .map_err(redis_err)?;
    // LIBRARYNAME matches a pattern; look for the exact name.
    let wanted = LIBRARY.name();
    Ok(array(&found)?.iter().any(|lib| match lib {
        Value::Array(fields) => fields.chunks(2).any(|kv| {
            matches!(kv, [k, v] if string(k).is_ok_and(|k| k == "library_name")
                && string(v).is_ok_and(|v| v == wanted))
        }),
        Value::Map(fields) => fields.iter().any(|(k, v)| {
            string(k).is_ok_and(|k| k == "library_name") && string(v).is_ok_and(|v| v == wanted)
        }),
        _ => false,
    }))
}

/// Loads this binary's library on the server the URL names and records
/// it as the installation's; returns the layout versions applied (none
/// when the installation was already current). Safe to run from several
/// processes at once.
pub async fn migrate(url: &str) -> Result<Vec<i64>> {
    let url = RedisUrl::parse(url)?;
    let (_, mut conn) = open(&url).await?;
    // A server the store would refuse gets nothing written either.
    if !url.relaxed {
        check_durability(&mut conn).await?;
    }
    let (layout, _) = installed(&mut conn, &url.prefix).await?;
    if layout > LAYOUT {
        return Err(newer(&mut conn, &url.prefix, layout).await);
    }
    let _: Value = ::redis::cmd("FUNCTION")
        .arg("LOAD")
        .arg("REPLACE")
        .arg(&LIBRARY.source)
        .query_async(&mut conn)
        .await
        .map_err(redis_err)?;
    if layout > 0 && layout < LAYOUT {
        // The data of an older layout is brought to this one, in one call,
        // before the layout is recorded: a store never reads it unconverted.
        let _: Value = ::redis::cmd("FCALL")
            .arg(LIBRARY.function("upgrade"))
            .arg(0)
            .arg(&url.prefix)
            .arg("0")
            .arg(layout)
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?;
    }
    let _: Value = ::redis::pipe()
        .atomic()
        .set(format!("{}layout", url.prefix), LAYOUT)
        .set(format!("{}version", url.prefix), &LIBRARY.version)
        .set(format!("{}idemq", url.prefix), IDEMQ_VERSION)
        .query_async(&mut conn)
        .await
        .map_err(redis_err)?;
    Ok(if layout < LAYOUT {
        vec![LAYOUT]
    } else {
        Vec::new()
    })
}

/// How the installation the URL names stands against this binary, changing nothing.
pub async fn migration_status(url: &str) -> Result<MigrationStatus> {
    let url = RedisUrl::parse(url)?;
    let (_, mut conn) = open(&url).await?;
    let (layout, version) = installed(&mut conn, &url.prefix).await?;
    let functions_current =
        version.as_deref() == Some(LIBRARY.version.as_str()) && loaded(&mut conn).await?;
    // Which idemq wrote a newer layout, when it recorded itself.
    let written_by: Option<String> = if layout > LAYOUT {
        ::redis::cmd("GET")
            .arg(format!("{}idemq", url.prefix))
            .query_async(&mut conn)
            .await
            .map_err(redis_err)?
    } else {
        None
    };
    Ok(MigrationStatus {
        current: layout,
        latest: LAYOUT,
        pending: if layout < LAYOUT {
            vec![LAYOUT]
        } else {
            Vec::new()
        },
        functions_current,
        written_by,
    })
}

/// The refusal of a layout newer than this binary's, naming the idemq
/// that recorded it when it did.
async fn newer(conn: &mut ConnectionManager, prefix: &str, layout: i64) -> Error {
    let written_by: Option<String> = ::redis::cmd("GET")
        .arg(format!("{prefix}idemq"))
        .query_async(conn)
        .await
        .ok()
        .flatten();
    newer_schema(
        &format!("the idemq data layout under the key prefix {prefix:?}"),
        layout,
        LAYOUT,
        written_by.as_deref(),
    )
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
            check_durability(&mut conn).await?;
        }
        let (layout, version) = installed(&mut conn, &url.prefix).await?;
        if layout > LAYOUT {
            return Err(newer(&mut conn, &url.prefix, layout).await);
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
    /// arguments every function takes first.
    fn fcall(&self, op: &str) -> Cmd {
        let mut cmd = ::redis::cmd("FCALL");
        cmd.arg(LIBRARY.function(op))
            .arg(0)
            .arg(&self.inner.prefix)
            .arg(if self.inner.test_clock { "1" } else { "0" });
        cmd
    }

    async fn run(&self, cmd: Cmd) -> Result<Value> {
        cmd.query_async(&mut self.inner.conn.clone())
            .await
            .map_err(redis_err)
    }

    /// Calls `op` with one more argument.
    async fn call1(&self, op: &str, arg: impl ::redis::ToRedisArgs) -> Result<Value> {
        let mut cmd = self.fcall(op);
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
