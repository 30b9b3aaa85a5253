//! The raw limits of a Redis server, measured through redis-rs (the driver
//! idemq's store uses) with the shapes a minimal at-least-once queue on
//! Redis would use, in scratch keys under the workload's prefix
//! (`<prefix>bench:…`, unlinked afterwards). With `appendfsync always`
//! every write command is in the append-only file and fsync'd before its
//! reply, as every idemq operation is.
//!
//! Each "producer" of a raw limit has a connection of its own and waits for
//! each reply before sending the next command, so a command is one round
//! trip, and commands of different producers that reach the server in the
//! same event-loop turn share one fsync (Redis's own group commit), as
//! idemq's calls do.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use idemq::store::redis::{DURABLE_SETTINGS, RedisUrl, check_durability};
use indicatif::ProgressBar;
use redis::aio::MultiplexedConnection;

use super::raw_pg::median;
use super::{Limit, drive};

/// Loopers of the claim/complete limit, as on PostgreSQL.
const CLAIMERS: usize = 2;
/// Jobs a raw claim moves at once.
const CLAIM_BATCH: usize = 100;
/// Keys one `SCAN` page asks for (and one `UNLINK` deletes).
const SCAN_PAGE: usize = 1000;

/// Opens one connection to the driver URL `driver`.
pub(crate) async fn connect(driver: &str) -> Result<MultiplexedConnection> {
    let client = redis::Client::open(driver).context("bad Redis URL")?;
    client
        .get_multiplexed_async_connection()
        .await
        .context("cannot connect to Redis")
}

/// Deletes every key that starts with `prefix`: `SCAN MATCH prefix*` a page
/// at a time, each page `UNLINK`ed (freed off the server's main thread), so
/// no call blocks the server for long however many keys there are.
pub(crate) async fn unlink_prefixed(conn: &mut MultiplexedConnection, prefix: &str) -> Result<u64> {
    let mut cursor: u64 = 0;
    let mut deleted = 0;
    loop {
        let (next, keys) = scan_page(conn, cursor, &format!("{prefix}*")).await?;
        if !keys.is_empty() {
            let n: u64 = redis::cmd("UNLINK").arg(&keys).query_async(conn).await?;
            deleted += n;
        }
        if next == 0 {
            return Ok(deleted);
        }
        cursor = next;
    }
}

/// How many keys match `pattern` (walks the whole key space a page at a time).
pub(crate) async fn count_matching(conn: &mut MultiplexedConnection, pattern: &str) -> Result<u64> {
    let mut cursor: u64 = 0;
    let mut count = 0;
    loop {
        let (next, keys) = scan_page(conn, cursor, pattern).await?;
        count += keys.len() as u64;
        if next == 0 {
            return Ok(count);
        }
        cursor = next;
    }
}

async fn scan_page(
    conn: &mut MultiplexedConnection,
    cursor: u64,
    pattern: &str,
) -> Result<(u64, Vec<String>)> {
    Ok(redis::cmd("SCAN")
        .arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_PAGE)
        .query_async(conn)
        .await?)
}

/// The clients connected to the server, not counting the one asking.
pub(crate) async fn other_clients(conn: &mut MultiplexedConnection) -> Result<i64> {
    let info: String = redis::cmd("INFO").arg("clients").query_async(conn).await?;
    let n: i64 = info_field(&info, "connected_clients")
        .and_then(|v| v.parse().ok())
        .context("INFO clients has no connected_clients")?;
    Ok(n - 1)
}

fn info_field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// The server `--database` names, as the bench found it.
#[derive(Clone, Debug)]
pub(crate) struct Server {
    driver: String,
    relaxed: bool,
    settings: String,
}

impl Server {
    /// Connects to the server of `url` and reads its version and persistence
    /// settings. Refuses a server the idemq store would refuse (its own
    /// check: `appendonly yes`, `appendfsync always`,
    /// `no-appendfsync-on-rewrite no`, `maxmemory-policy noeviction`)
    /// unless the URL says `?durability=relaxed` (then warns): figures
    /// measured without fsync would not compare with a durable queue's.
    pub(crate) async fn connect(url: &str) -> Result<Self> {
        let parsed = RedisUrl::parse(url)?;
        let mut conn = connect(&parsed.driver).await?;
        let info: String = redis::cmd("INFO")
            .arg("server")
            .query_async(&mut conn)
            .await?;
        let version = info_field(&info, "redis_version").unwrap_or("(unknown)");
        // The settings the store checks, and `save`, for the run's header.
        let names: Vec<&str> = DURABLE_SETTINGS
            .iter()
            .map(|(name, _)| *name)
            .chain(["save"])
            .collect();
        let config: Result<HashMap<String, String>, _> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(&names)
            .query_async(&mut conn)
            .await;
        let config = match config {
            Ok(c) => names
                .iter()
                .map(|name| {
                    let value = c.get(*name).map_or("(unset)", String::as_str);
                    if *name == "save" {
                        format!("{name} {value:?}")
                    } else {
                        format!("{name} {value}")
                    }
                })
                .collect::<Vec<_>>()
                .join(", "),
            Err(e) => format!("settings unreadable ({e})"),
        };
        // The store's own check, so the bench demands what the store does.
        let refused = match check_durability(&parsed).await {
            Ok(()) => None,
            Err(e @ idemq::Error::Validation { .. }) => Some(e),
            Err(e) => return Err(e.into()),
        };
        if let Some(why) = &refused {
            if !parsed.relaxed {
                bail!(
                    "this Redis server ({config}) is one idemq's store refuses, so its figures \
                     would not compare with a durable queue's: {why}"
                );
            }
            eprintln!(
                "warning: this Redis server ({config}) can lose acknowledged writes ({why}): the \
                 figures measure a queue that can lose acknowledged jobs"
            );
        }
        let durability = if refused.is_none() {
            "durable"
        } else {
            "NOT durable (?durability=relaxed)"
        };
        Ok(Self {
            driver: parsed.driver,
            relaxed: parsed.relaxed,
            settings: format!("Redis {version}: {config}; {durability}"),
        })
    }

    /// The driver's URL (idemq's parameters taken out).
    pub(crate) fn driver(&self) -> &str {
        &self.driver
    }

    /// The version and persistence settings, for the run's header.
    pub(crate) fn settings(&self) -> &str {
        &self.settings
    }

    /// The URL of the installation under `prefix` on this server.
    pub(crate) fn url_with_prefix(&self, prefix: &str) -> String {
        with_prefix(&self.driver, prefix, self.relaxed)
    }
}

/// `driver` with idemq's parameters `prefix` and, when `relaxed`,
/// `durability=relaxed` added to its query.
fn with_prefix(driver: &str, prefix: &str, relaxed: bool) -> String {
    let sep = if driver.contains('?') { '&' } else { '?' };
    let mut url = format!("{driver}{sep}prefix={prefix}");
    if relaxed {
        url.push_str("&durability=relaxed");
    }
    url
}

/// A raw limit being measured: one connection per producer, scratch keys
/// under `<prefix>bench:`.
pub(crate) struct Raw {
    conns: Vec<MultiplexedConnection>,
    keys: String,
    limit: Limit,
    latencies: Arc<Mutex<Vec<f64>>>,
}

impl Raw {
    pub(crate) async fn open(driver: &str, prefix: &str, limit: Limit) -> Result<Self> {
        let connections = match limit {
            Limit::InsertCommit { producers }
            | Limit::OnConflict { producers, .. }
            | Limit::OnConflictNoop { producers, .. }
            | Limit::Upsert { producers, .. } => producers,
            Limit::MultiRow => 1,
            Limit::ClaimComplete => CLAIMERS,
        };
        let mut conns = Vec::with_capacity(connections);
        for _ in 0..connections {
            conns.push(connect(driver).await?);
        }
        Ok(Self {
            conns,
            keys: format!("{prefix}bench:"),
            limit,
            latencies: Arc::default(),
        })
    }

    pub(crate) async fn close(self) -> Result<Option<f64>> {
        if let Some(conn) = self.conns.first() {
            unlink_prefixed(&mut conn.clone(), &self.keys).await?;
        }
        let mut l = lock(&self.latencies);
        Ok((!l.is_empty()).then(|| median(&mut l)))
    }

    /// The connection of producer `i % conns`.
    fn conn(&self, i: usize) -> MultiplexedConnection {
        self.conns[i % self.conns.len()].clone()
    }

    pub(crate) async fn run(&self, range: Range<usize>, bar: &ProgressBar) -> Result<Duration> {
        let keys = self.keys.clone();
        match self.limit {
            Limit::InsertCommit { producers } => {
                let (conns, lat) = (self.conns.clone(), self.latencies.clone());
                drive(producers, range, bar, move |i| {
                    let (mut conn, lat) = (conns[i % conns.len()].clone(), lat.clone());
                    let key = format!("{keys}raw:{i}");
                    async move {
                        let t = Instant::now();
                        let () = redis::cmd("SET")
                            .arg(key)
                            .arg(format!("{{\"i\":{i}}}"))
                            .query_async(&mut conn)
                            .await?;
                        if producers == 1 {
                            lock(&lat).push(t.elapsed().as_secs_f64() * 1e3);
                        }
                        Ok(())
                    }
                })
                .await
            }
            Limit::MultiRow => {
                let (mut conn, list) = (self.conn(0), format!("{keys}list"));
                let start = Instant::now();
                let mut done = range.start;
                while done < range.end {
                    let n = (range.end - done).min(1000);
                    let () = redis::cmd("RPUSH")
                        .arg(&list)
                        .arg(payloads(done..done + n))
                        .query_async(&mut conn)
                        .await?;
                    done += n;
                    bar.inc(n as u64);
                }
                Ok(start.elapsed())
            }
            Limit::ClaimComplete => {
                let (waiting, processing) = (format!("{keys}waiting"), format!("{keys}processing"));
                // Filling the list is not timed; claiming it empty is.
                let mut conn = self.conn(0);
                for chunk in range.clone().step_by(1000) {
                    let () = redis::cmd("RPUSH")
                        .arg(&waiting)
                        .arg(payloads(chunk..(chunk + 1000).min(range.end)))
                        .query_async(&mut conn)
                        .await?;
                }
                let start = Instant::now();
                let mut tasks = tokio::task::JoinSet::new();
                for c in 0..CLAIMERS {
                    let (mut conn, bar) = (self.conn(c), bar.clone());
                    let (waiting, processing) = (waiting.clone(), processing.clone());
                    tasks.spawn(async move {
                        loop {
                            // Claim: move 100 jobs to the processing list
                            // (one round trip; each LMOVE atomic, so a
                            // crashed consumer leaves its jobs there to be
                            // found), then complete: remove them from it (a
                            // second round trip).
                            let mut claim = redis::pipe();
                            for _ in 0..CLAIM_BATCH {
                                claim
                                    .cmd("LMOVE")
                                    .arg(&waiting)
                                    .arg(&processing)
                                    .arg("LEFT")
                                    .arg("RIGHT");
                            }
                            let got: Vec<Option<String>> = claim.query_async(&mut conn).await?;
                            let jobs: Vec<String> = got.into_iter().flatten().collect();
                            if jobs.is_empty() {
                                return Ok::<_, anyhow::Error>(());
                            }
                            let mut complete = redis::pipe();
                            for job in &jobs {
                                complete
                                    .cmd("LREM")
                                    .arg(&processing)
                                    .arg(1)
                                    .arg(job)
                                    .ignore();
                            }
                            let () = complete.query_async(&mut conn).await?;
                            bar.inc(jobs.len() as u64);
                        }
                    });
                }
                while let Some(done) = tasks.join_next().await {
                    done??;
                }
                Ok(start.elapsed())
            }
            Limit::OnConflict { producers, keys: n }
            | Limit::OnConflictNoop { producers, keys: n }
            | Limit::Upsert { producers, keys: n } => {
                let key = move |k: usize| format!("{keys}key:key-{k}");
                if matches!(self.limit, Limit::OnConflictNoop { .. }) {
                    // Every key present before the clock starts.
                    let mut fill = redis::pipe();
                    for k in 0..n {
                        fill.cmd("SET").arg(key(k)).arg(format!("job-{k}")).ignore();
                    }
                    let () = fill.query_async(&mut self.conn(0)).await?;
                }
                let upsert = matches!(self.limit, Limit::Upsert { .. });
                let conns = self.conns.clone();
                drive(producers, range, bar, move |i| {
                    let mut conn = conns[i % conns.len()].clone();
                    let cmd = if upsert {
                        // A counter per key: the write every call makes.
                        let mut c = redis::cmd("INCR");
                        c.arg(key(i % n));
                        c
                    } else {
                        // Bind the key unless bound: a write only the first
                        // time (SET NX writes and logs nothing otherwise).
                        let mut c = redis::cmd("SET");
                        c.arg(key(i % n)).arg(format!("job-{i}")).arg("NX");
                        c
                    };
                    async move {
                        let _: redis::Value = cmd.query_async(&mut conn).await?;
                        Ok(())
                    }
                })
                .await
            }
        }
    }
}

/// The payloads `{"i":i}` of `range`.
fn payloads(range: Range<usize>) -> Vec<String> {
    range.map(|i| format!("{{\"i\":{i}}}")).collect()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::{info_field, with_prefix};

    #[test]
    fn adds_the_prefix_and_keeps_the_driver_s_parameters() {
        assert_eq!(
            with_prefix("redis://127.0.0.1:6391", "b-1-0:", false),
            "redis://127.0.0.1:6391?prefix=b-1-0:"
        );
        assert_eq!(
            with_prefix("redis://h:1/2?protocol=resp3", "b:", true),
            "redis://h:1/2?protocol=resp3&prefix=b:&durability=relaxed"
        );
        assert_eq!(
            with_prefix("redis+unix:///tmp/r.sock", "b:", false),
            "redis+unix:///tmp/r.sock?prefix=b:"
        );
    }

    #[test]
    fn reads_a_field_of_info() {
        let info = "# Server\r\nredis_version:7.0.15\r\nredis_mode:standalone\r\n";
        assert_eq!(info_field(info, "redis_version"), Some("7.0.15"));
        assert_eq!(info_field(info, "redis"), None);
        assert_eq!(info_field(info, "tcp_port"), None);
    }
}
