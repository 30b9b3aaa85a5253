//! Redis installations for tests: one key prefix per case on one durable
//! `redis-server` per test process.
//!
//! The machine's shared Redis (if any) keeps nothing on disk, and a test of
//! durability needs a server that does, so the kit starts its own in a
//! temporary directory with the settings the store demands (`appendonly
//! yes`, `appendfsync always`, `no-appendfsync-on-rewrite no`,
//! `maxmemory-policy noeviction`). It runs under
//! a small shell watchdog that stops it, and removes its directory, once the
//! test process is gone: a crashed or killed test run leaves no server
//! behind. `IDEMQ_TEST_REDIS_URL` names a server to use instead (it must
//! have the same settings). A missing or failing `redis-server` panics with
//! how to install it: a missing Redis fails the run, never skips it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

/// The server the Redis cases run on.
struct Server {
    /// Its URL without idemq's parameters.
    url: String,
    /// Its data directory, when the kit started it (`None` for
    /// `IDEMQ_TEST_REDIS_URL`).
    dir: Option<PathBuf>,
}

/// What to tell someone whose machine cannot start the server.
const INSTALL: &str = "install it (Debian: `apt-get install redis-server`) or set \
                       IDEMQ_TEST_REDIS_URL to a redis-server with appendonly yes, appendfsync \
                       always, no-appendfsync-on-rewrite no and maxmemory-policy noeviction";

/// Runs redis-server with the arguments after the first two, and stops it
/// once the test process (`$1`) is gone, then removes its directory (`$2`).
/// `kill -0` asks only whether a pid exists, so the test process needs no
/// signal handler (and no unsafe code) for its server to end with it.
const WATCHDOG: &str = r#"
parent=$1; dir=$2; shift 2
redis-server "$@" &
server=$!
while kill -0 "$parent" 2>/dev/null && kill -0 "$server" 2>/dev/null; do sleep 1; done
kill "$server" 2>/dev/null
wait "$server" 2>/dev/null
rm -rf "$dir"
"#;

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| match std::env::var("IDEMQ_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => Server { url, dir: None },
        _ => start(&[]).unwrap_or_else(|e| panic!("cannot start redis-server for the tests: {e}")),
    })
}

/// Starts a server with the durable settings, then `settings` (a later
/// setting wins), and waits until it answers.
fn start(settings: &[&str]) -> Result<Server, String> {
    match Command::new("redis-server").arg("--version").output() {
        Ok(out) if out.status.success() => {}
        Ok(out) => {
            return Err(format!(
                "`redis-server --version` failed ({}); {INSTALL}",
                out.status
            ));
        }
        Err(e) => return Err(format!("redis-server is not installed ({e}); {INSTALL}")),
    }
    // Kept on purpose: the watchdog removes the directory after the server
    // has stopped, which a TempDir dropped by this process could not wait for.
    let dir = tempfile::Builder::new()
        .prefix("idemq-redis-")
        .tempdir()
        .map_err(|e| format!("cannot make a temporary directory: {e}"))?
        .keep();
    let sock = dir.join("r.sock");
    let log = dir.join("redis.log");
    let path = |p: &Path| p.display().to_string();
    Command::new("sh")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("sh")
        .arg(std::process::id().to_string())
        .arg(path(&dir))
        .args(["--port", "0", "--unixsocket"])
        .arg(path(&sock))
        .arg("--dir")
        .arg(path(&dir))
        .arg("--logfile")
        .arg(path(&log))
        .args([
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--no-appendfsync-on-rewrite",
            "no",
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
        ])
        .args(settings)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run sh to start redis-server: {e}"))?;
    let url = format!("redis+unix://{}", sock.display());
    // The socket appears once the server listens; a PING proves it serves.
    for _ in 0..400 {
        if sock.exists() && ping(&url) {
            return Ok(Server {
                url,
                dir: Some(dir),
            });
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    Err(format!(
        "redis-server did not answer on {} within 10 s; {INSTALL}. Its log:\n{log}",
        sock.display()
    ))
}

fn ping(url: &str) -> bool {
    ::redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(1)))
        .and_then(|mut c| ::redis::cmd("PING").query::<String>(&mut c))
        .is_ok()
}

/// The URL of a fresh installation: a new key prefix (`t<uuid>:`) on the
/// test process's server, not migrated yet; returns the URL and the prefix.
pub fn redis_url() -> (String, String) {
    let base = &server().url;
    let prefix = format!("t{}:", uuid::Uuid::new_v4().simple());
    let join = if base.contains('?') { '&' } else { '?' };
    (format!("{base}{join}prefix={prefix}"), prefix)
}

/// A redis-server of the caller's own, started like the shared one (durable
/// settings, a temporary directory, ended with the test process), for a
/// case that stops it: its URL. `SHUTDOWN NOSAVE` through
/// [`redis_command`] stops it.
///
/// # Panics
///
/// When redis-server cannot be started, saying how to install it.
pub fn redis_own_server() -> String {
    redis_own_server_with(&[])
}

/// [`redis_own_server`] with `settings` after the durable ones (e.g.
/// `["--appendfsync", "everysec"]` for a server the store must refuse).
///
/// # Panics
///
/// When redis-server cannot be started, saying how to install it.
pub fn redis_own_server_with(settings: &[&str]) -> String {
    start(settings)
        .unwrap_or_else(|e| panic!("cannot start redis-server for the test: {e}"))
        .url
}

/// The data directory of the test process's server (its AOF files), when
/// the kit started it; `None` with `IDEMQ_TEST_REDIS_URL`.
pub fn redis_dir() -> Option<&'static Path> {
    server().dir.as_deref()
}

/// Runs one command on the server the URL names (idemq's parameters are
/// ignored) and returns its reply.
pub async fn redis_command(url: &str, args: &[&str]) -> Result<::redis::Value, String> {
    let base = url.split_once('?').map_or(url, |(base, _)| base);
    let client = ::redis::Client::open(base).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut cmd = ::redis::cmd(args.first().copied().unwrap_or("PING"));
    for a in args.iter().skip(1) {
        cmd.arg(*a);
    }
    cmd.query_async(&mut conn).await.map_err(|e| e.to_string())
}

/// Every key under `prefix` and every value it holds, as text (one line a
/// key): what an installation keeps, for cases that look for a value at rest.
pub async fn redis_contents(url: &str, prefix: &str) -> Result<String, String> {
    let base = url.split_once('?').map_or(url, |(base, _)| base);
    let client = ::redis::Client::open(base).map_err(|e| e.to_string())?;
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| e.to_string())?;
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, page): (u64, Vec<String>) = ::redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("{prefix}*"))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        keys.extend(page);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let mut out = String::new();
    for key in keys {
        let kind: String = ::redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let read = match kind.as_str() {
            "string" => ::redis::cmd("GET").arg(&key).clone(),
            "hash" => ::redis::cmd("HGETALL").arg(&key).clone(),
            "list" => ::redis::cmd("LRANGE").arg(&key).arg(0).arg(-1).clone(),
            "set" => ::redis::cmd("SMEMBERS").arg(&key).clone(),
            "zset" => ::redis::cmd("ZRANGE")
                .arg(&key)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES")
                .clone(),
            // Gone since the scan.
            "none" => continue,
            other => return Err(format!("{key}: unexpected Redis type {other}")),
        };
        let value: ::redis::Value = read
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        out.push_str(&format!("{key} {}\n", text(&value)));
    }
    Ok(out)
}

/// A reply as text, bytes read as (lossy) UTF-8.
fn text(v: &::redis::Value) -> String {
    use ::redis::Value;
    match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::SimpleString(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        Value::Double(d) => d.to_string(),
        Value::Array(items) | Value::Set(items) => {
            items.iter().map(text).collect::<Vec<_>>().join(" ")
        }
        Value::Map(pairs) => pairs
            .iter()
            .map(|(k, v)| format!("{} {}", text(k), text(v)))
            .collect::<Vec<_>>()
            .join(" "),
        other => format!("{other:?}"),
    }
}
