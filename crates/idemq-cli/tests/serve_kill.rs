//! The real `idemq serve` binary SIGKILLed under HTTP load, on a SQLite file
//! and on a fresh PostgreSQL database.
//!
//! Eight clients send idempotent enqueues (`POST /v1/jobs`, one distinct key
//! per job) and retry every connection error, timeout and `503` with the
//! same key. The server is SIGKILLed three times while they run (after a
//! quarter, half and three quarters of the jobs were acknowledged) and
//! started again on the same database and port. Afterwards every job id a
//! client got a `2xx` for resolves (`GET /v1/jobs/{id}` → 200), each key's
//! binding (`POST /v1/idempotency/lookup`) names the acknowledged id, and no
//! key owns two jobs. The figures are printed (`-- --nocapture`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

const CLIENTS: usize = 8;
const PER_CLIENT: usize = 500;
const KILLS: usize = 3;
const JOB_TYPE: &str = "kill.enqueue";

/// A free loopback port (bound, then released for the server).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// One `idemq serve` process; its output goes to files (an unread pipe
/// could block it).
struct Serve {
    child: Child,
}

impl Serve {
    /// Starts `idemq serve` on `port` and waits until it answers `/healthz`.
    fn start(database: &str, port: u16, dir: &Path, round: usize) -> Self {
        let started = Instant::now();
        loop {
            let out = std::fs::File::create(dir.join(format!("serve-{round}.out"))).expect("out");
            let err = std::fs::File::create(dir.join(format!("serve-{round}.err"))).expect("err");
            let mut child = Command::new(env!("CARGO_BIN_EXE_idemq"))
                .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
                .env("IDEMQ_DATABASE_URL", database)
                .env("IDEMQ_DIR", dir)
                .env_remove("IDEMQ_TOKEN")
                .env_remove("IDEMQ_LISTEN")
                .env_remove("IDEMQ_KEY_SECRET")
                .stdout(Stdio::from(out))
                .stderr(Stdio::from(err))
                .spawn()
                .expect("spawn idemq serve");
            // Ready once it answers; a bind race (port still held) ends the process.
            loop {
                if let Some(status) = child.try_wait().expect("try_wait") {
                    let err = std::fs::read_to_string(dir.join(format!("serve-{round}.err")))
                        .unwrap_or_default();
                    assert!(
                        started.elapsed() < Duration::from_secs(15),
                        "idemq serve exited ({status}) and did not come back: {err}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                    break;
                }
                if healthy(port) {
                    return Self { child };
                }
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "idemq serve did not answer within 30 s"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    /// SIGKILL, then reap.
    fn kill(mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("wait");
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `GET /healthz` → 200, over a plain socket.
fn healthy(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.1 200")
}

#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    acknowledged: AtomicU64,
    retries: AtomicU64,
    replayed_on_retry: AtomicU64,
    unavailable: AtomicU64,
    connection_errors: AtomicU64,
}

/// One client: enqueues its keys one after another, retrying each with the
/// same key until a 2xx (budget 30 s per job). Returns (key, job id) pairs.
async fn client(
    base: String,
    run: String,
    c: usize,
    counts: Arc<Counts>,
) -> Result<Vec<(String, String)>, String> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("client");
    let mut acked = Vec::with_capacity(PER_CLIENT);
    for i in 0..PER_CLIENT {
        let key = format!("{run}:c{c}:j{i}");
        let body = json!({
            "type": JOB_TYPE,
            "queue": "kill",
            "payload": {"client": c, "i": i},
            "idempotency": {"key": key},
        });
        let start = Instant::now();
        let mut backoff = Duration::from_millis(20);
        let mut tries = 0;
        let id = loop {
            tries += 1;
            if tries > 1 {
                counts.retries.fetch_add(1, Ordering::Relaxed);
            }
            counts.requests.fetch_add(1, Ordering::Relaxed);
            let sent = http
                .post(format!("{base}/v1/jobs"))
                .json(&body)
                .send()
                .await;
            match sent {
                Ok(resp) if resp.status().is_success() => {
                    let status = resp.status().as_u16();
                    // An unreadable body (cut by the kill) is retried.
                    if let Ok(v) = resp.json::<Value>().await {
                        let id = v["job_id"].as_str().ok_or("no job_id")?.to_owned();
                        if status == 200 {
                            if v["outcome"] != "replayed" {
                                return Err(format!("{key}: unexpected 200 {v}"));
                            }
                            counts.replayed_on_retry.fetch_add(1, Ordering::Relaxed);
                        }
                        break id;
                    }
                }
                Ok(resp) if resp.status().as_u16() == 503 => {
                    counts.unavailable.fetch_add(1, Ordering::Relaxed);
                }
                Ok(resp) => {
                    let status = resp.status();
                    let text = resp.text().await.unwrap_or_default();
                    return Err(format!("{key}: {status} {text}"));
                }
                Err(_) => {
                    counts.connection_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            if start.elapsed() > Duration::from_secs(30) {
                return Err(format!("{key}: not acknowledged within 30 s"));
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(200));
        };
        counts.acknowledged.fetch_add(1, Ordering::Relaxed);
        acked.push((key, id));
    }
    Ok(acked)
}

/// Every stored job of the test's type, by (client, i).
async fn stored_jobs(http: &reqwest::Client, base: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{base}/v1/jobs?type={JOB_TYPE}&limit=1000");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page: Value = http
            .get(url)
            .send()
            .await
            .expect("list")
            .json()
            .await
            .expect("json");
        out.extend(page["jobs"].as_array().expect("jobs").iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return out,
        }
    }
}

async fn kill_under_load(database: &str, label: &str) {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().expect("temp dir");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let run = format!("run{}", std::process::id());
    let mut server = Some(Serve::start(database, port, dir.path(), 0));

    let counts = Arc::new(Counts::default());
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| {
            tokio::spawn(client(
                base.clone(),
                format!("{run}-{label}"),
                c,
                counts.clone(),
            ))
        })
        .collect();

    // SIGKILL at 1/4, 2/4 and 3/4 of the acknowledgements; restart at once.
    let total = (CLIENTS * PER_CLIENT) as u64;
    let mut kills = 0;
    let mut down_ms = Vec::new();
    for k in 1..=KILLS {
        let at = total * k as u64 / (KILLS as u64 + 1);
        let waited = Instant::now();
        while counts.acknowledged.load(Ordering::Relaxed) < at {
            assert!(
                waited.elapsed() < Duration::from_secs(60),
                "the clients stalled at {} acknowledgements",
                counts.acknowledged.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        server.take().expect("server").kill();
        kills += 1;
        let down = Instant::now();
        let (db, d) = (database.to_owned(), dir.path().to_owned());
        let s = tokio::task::spawn_blocking(move || Serve::start(&db, port, &d, k))
            .await
            .expect("restart");
        down_ms.push(down.elapsed().as_millis());
        server = Some(s);
    }
    let mut acked: Vec<(String, String)> = Vec::new();
    for t in tasks {
        match t.await.expect("client task") {
            Ok(v) => acked.extend(v),
            Err(e) => panic!("a client failed: {e}"),
        }
    }
    let load_s = t0.elapsed().as_secs_f64();

    // Checks, against the last server.
    let http = reqwest::Client::new();
    let mut lost = Vec::new();
    let mut wrong_binding = Vec::new();
    for (key, id) in &acked {
        let a = http
            .get(format!("{base}/v1/jobs/{id}"))
            .send()
            .await
            .expect("get");
        if a.status().as_u16() != 200 {
            lost.push(id.clone());
        }
        let b: Value = http
            .post(format!("{base}/v1/idempotency/lookup"))
            .json(&json!({"key": key}))
            .send()
            .await
            .expect("lookup")
            .json()
            .await
            .expect("json");
        if b["job_id"].as_str() != Some(id.as_str()) {
            wrong_binding.push(format!("{key}: {id} vs {b}"));
        }
    }
    let stored = stored_jobs(&http, &base).await;
    let mut per_key: HashMap<(u64, u64), usize> = HashMap::new();
    for j in &stored {
        let p = &j["payload"];
        let k = (
            p["client"].as_u64().expect("client"),
            p["i"].as_u64().expect("i"),
        );
        *per_key.entry(k).or_default() += 1;
    }
    let duplicates = per_key.values().filter(|n| **n > 1).count();
    let requests = counts.requests.load(Ordering::Relaxed);
    println!(
        "serve_kill {label}: {requests} requests, {} 2xx ({} replayed on retry), {} retries \
         ({} connection errors, {} 503), {kills} kills (restart took {down_ms:?} ms), \
         {} stored, lost = {}, duplicates = {}, wrong bindings = {}; {load_s:.1} s",
        acked.len(),
        counts.replayed_on_retry.load(Ordering::Relaxed),
        counts.retries.load(Ordering::Relaxed),
        counts.connection_errors.load(Ordering::Relaxed),
        counts.unavailable.load(Ordering::Relaxed),
        stored.len(),
        lost.len(),
        duplicates,
        wrong_binding.len(),
    );
    assert_eq!(acked.len() as u64, total, "every job acknowledged");
    assert!(lost.is_empty(), "acknowledged but lost: {lost:?}");
    assert_eq!(duplicates, 0, "keys with two jobs");
    assert!(wrong_binding.is_empty(), "{wrong_binding:?}");
    assert_eq!(stored.len(), acked.len(), "one stored job per key");
    assert_eq!(kills, KILLS);
    assert!(
        counts.retries.load(Ordering::Relaxed) > 0,
        "the kills were noticed by the clients"
    );
    server.take().expect("server").kill();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_sigkilled_under_load_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let file: PathBuf = dir.path().join("kill.db");
    kill_under_load(&format!("sqlite://{}", file.display()), "sqlite").await;
    // The file is sound after three kills.
    let conn = rusqlite::Connection::open(&file).expect("open");
    let check: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .expect("integrity_check");
    assert_eq!(check, "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn serve_sigkilled_under_load_postgres() {
    let db = idemq_testkit::PgDatabase::new();
    let url = db.url.clone();
    kill_under_load(&url, "postgres").await;
}
