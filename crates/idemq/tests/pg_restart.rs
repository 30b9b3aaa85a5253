//! Fault test: the PostgreSQL server is restarted (fast shutdown, then start)
//! while 8 producers run 20,000 idempotent enqueues. Producers retry
//! `Unavailable` with the same key (bounded), the pool reconnects by itself,
//! and afterwards every acknowledged job is there and no key owns two jobs.
//!
//! So that the restart always meets enqueues in flight (a single-statement
//! enqueue spends most of its time in a commit that a fast shutdown lets
//! finish, so a bare restart can fall between statements of every
//! producer), the injector first takes a lock on the jobs table, waits until
//! enqueues are queued behind it, and restarts then: those statements are
//! ended by the shutdown and their producers must retry. The lock is held by
//! a prepared transaction (`PREPARE TRANSACTION`), which outlives its session
//! and the restart: had an ordinary session held it, the shutdown could end
//! that session first and a waiting enqueue could take the lock and commit
//! before its own signal arrived. The injector rolls the prepared
//! transaction back once the server is up again.
//!
//! The test runs its own PostgreSQL server: `initdb` into a temporary
//! directory and `pg_ctl` on a free loopback port (as the `postgres` user
//! when run as root), so restarting it disturbs no other test, and a guard
//! stops it and removes its files even when the test fails. It needs the
//! server binaries (`/usr/lib/postgresql/<version>/bin`, or `pg_config
//! --bindir`).
//!
//! Run: `cargo test -p idemq --test pg_restart -- --nocapture`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::store::postgres::{PgOptions, PgStore};
use idemq::{EnqueueRequest, JobList, Outcome, Queue, QueueOptions};
use serde_json::json;
use sqlx::{Connection, PgConnection};

const OPS: u32 = 20_000;
const PRODUCERS: u32 = 8;
/// The restart happens once this many enqueues were acknowledged.
const RESTART_AT: u64 = 6_000;
/// How long one enqueue may keep retrying `Unavailable` before it gives up.
const RETRY_BUDGET: Duration = Duration::from_secs(30);

/// The directory of the PostgreSQL server binaries: `pg_config --bindir`
/// when it has `pg_ctl`, else the newest `/usr/lib/postgresql/<v>/bin`.
fn bindir() -> PathBuf {
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if dir.join("pg_ctl").is_file() {
            return dir;
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("/usr/lib/postgresql: install the PostgreSQL server (Debian: postgresql)")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("pg_ctl").is_file().then_some((v, bin))
        })
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("no PostgreSQL server binaries (pg_ctl) found")
        .1
}

/// A free TCP port on loopback (bound, then released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A PostgreSQL server of this test's own.
struct Server {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
}

impl Server {
    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// Runs a server binary (as `postgres` when this process is root:
    /// PostgreSQL refuses to run as root).
    fn run(&self, program: &str, args: &[&str]) -> std::process::Output {
        let path = self.bin.join(program);
        let mut cmd = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run a PostgreSQL binary")
    }

    fn start() -> Self {
        let as_postgres = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
        let dir = tempfile::tempdir().expect("temp dir");
        if as_postgres {
            let ok = Command::new("chown")
                .args(["postgres:", &dir.path().display().to_string()])
                .status()
                .is_ok_and(|s| s.success());
            assert!(ok, "chown the server's directory to postgres");
        }
        let server = Self {
            bin: bindir(),
            dir,
            port: free_port(),
            as_postgres,
        };
        let data = server.data().display().to_string();
        let init = server.run(
            "initdb",
            &["-D", &data, "-A", "trust", "-U", "postgres", "-N"],
        );
        assert!(init.status.success(), "initdb: {}", output(&init));
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=on -c max_connections=40 \
             -c max_prepared_transactions=2",
            server.port,
            server.dir.path().display()
        );
        let log = server.log_path().display().to_string();
        let start = server.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-o", &options, "-w", "-t", "60", "start",
            ],
        );
        assert!(
            start.status.success(),
            "pg_ctl start: {}\n{}",
            output(&start),
            server.log()
        );
        server
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("server.log")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A fast restart: active sessions are ended, then the server starts again.
    fn restart(&self) -> std::process::Output {
        let data = self.data().display().to_string();
        // `-l` again: the new server must not hold this call's output pipes
        // open (they would never reach end of file).
        let log = self.log_path().display().to_string();
        self.run(
            "pg_ctl",
            &[
                "-D", &data, "-l", &log, "-m", "fast", "-w", "-t", "60", "restart",
            ],
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let data = self.data().display().to_string();
        let _ = self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
        if self.as_postgres {
            // The temporary directory is postgres's; root removes it anyway.
            let _ = std::fs::remove_dir_all(self.dir.path().join("data"));
        }
    }
}

fn output(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[derive(Default)]
struct Tally {
    tried: AtomicU64,
    retries: AtomicU64,
    acked: AtomicU64,
    /// Retries answered `replayed`: the first try had committed, but its
    /// answer was lost with the connection (an indeterminate enqueue resolved).
    replayed_on_retry: AtomicU64,
    /// Keys whose enqueue was never acknowledged (error or retry budget spent).
    failures: Mutex<Vec<String>>,
    /// Acknowledged ids by key index.
    ids: Mutex<HashMap<u32, String>>,
}

fn request(i: u32) -> EnqueueRequest {
    EnqueueRequest::new("restart.probe")
        .payload(json!({ "i": i }))
        .idempotency_key(format!("restart-key-{i}"))
}

async fn producer(queue: Queue, p: u32, tally: Arc<Tally>) {
    for i in (p..OPS).step_by(PRODUCERS as usize) {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(20);
        let mut retried = false;
        loop {
            tally.tried.fetch_add(1, Ordering::Relaxed);
            match queue.enqueue_with_result(request(i)).await {
                Ok(r) => {
                    match (retried, r.outcome) {
                        (_, Outcome::Accepted) => {}
                        (true, Outcome::Replayed) => {
                            tally.replayed_on_retry.fetch_add(1, Ordering::Relaxed);
                        }
                        (_, other) => tally
                            .failures
                            .lock()
                            .unwrap()
                            .push(format!("key {i}: unexpected outcome {other:?}")),
                    }
                    tally.ids.lock().unwrap().insert(i, r.job_id);
                    tally.acked.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(e) if e.is_retryable() && started.elapsed() < RETRY_BUDGET => {
                    tally.retries.fetch_add(1, Ordering::Relaxed);
                    retried = true;
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    tally
                        .failures
                        .lock()
                        .unwrap()
                        .push(format!("key {i}: {e} (after {:?})", started.elapsed()));
                    break;
                }
            }
        }
    }
}

/// Takes an exclusive lock on `idemq.jobs` in a prepared transaction (which
/// outlives its session and the restart) and returns, once enqueues wait
/// behind it, how many. [`release_jobs`] rolls it back.
async fn hold_jobs_until_enqueues_wait(url: &str) -> i64 {
    let mut holder = PgConnection::connect(url).await.expect("lock holder");
    for sql in [
        "BEGIN",
        "LOCK TABLE idemq.jobs IN EXCLUSIVE MODE",
        "PREPARE TRANSACTION 'pg_restart_jobs_lock'",
    ] {
        sqlx::query(sql)
            .execute(&mut holder)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }
    let mut watcher = PgConnection::connect(url).await.expect("lock watcher");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        // Only client sessions count: an autovacuum worker of the busy
        // table waits behind the lock too, and is no enqueue.
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid \
             WHERE NOT l.granted AND l.relation = 'idemq.jobs'::regclass \
               AND a.backend_type = 'client backend'",
        )
        .fetch_one(&mut watcher)
        .await
        .expect("count waiting enqueues");
        if waiting >= i64::from(PRODUCERS / 2) || Instant::now() >= deadline {
            return waiting;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Rolls back the prepared transaction that holds the lock, once the server
/// takes connections again.
async fn release_jobs(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut conn = loop {
        match PgConnection::connect(url).await {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("connect after the restart: {e}"),
        }
    };
    sqlx::query("ROLLBACK PREPARED 'pg_restart_jobs_lock'")
        .execute(&mut conn)
        .await
        .expect("roll back the prepared transaction that holds the lock");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restart_during_idempotent_enqueues_loses_nothing() {
    let server = Server::start();
    let url = server.url();
    Queue::migrate(&url).await.expect("migrate the test server");
    let store = PgStore::connect(
        &url,
        PgOptions {
            max_connections: PRODUCERS,
            acquire_timeout: Duration::from_secs(2),
            ..PgOptions::default()
        },
    )
    .await
    .expect("connect");
    let queue = Queue::from_store(Arc::new(store), QueueOptions::default());

    let t0 = Instant::now();
    let tally = Arc::new(Tally::default());
    let mut producers = tokio::task::JoinSet::new();
    for p in 0..PRODUCERS {
        producers.spawn(producer(queue.clone(), p, tally.clone()));
    }

    // The fault: one fast restart once RESTART_AT enqueues were acknowledged.
    let done = Arc::new(AtomicBool::new(false));
    let server = Arc::new(server);
    let injector = {
        let (tally, done, server_ref) = (tally.clone(), done.clone(), server.clone());
        let url_ref = url.clone();
        tokio::spawn(async move {
            while tally.acked.load(Ordering::Relaxed) < RESTART_AT {
                if done.load(Ordering::Relaxed) {
                    return (0u64, Duration::ZERO, String::new(), 0i64);
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let waiting = hold_jobs_until_enqueues_wait(&url_ref).await;
            let started = Instant::now();
            let out = tokio::task::block_in_place(|| server_ref.restart());
            if out.status.success() {
                release_jobs(&url_ref).await;
            }
            let log = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (
                u64::from(out.status.success()),
                started.elapsed(),
                log,
                waiting,
            )
        })
    };
    while let Some(r) = producers.join_next().await {
        r.expect("producer");
    }
    done.store(true, Ordering::Relaxed);
    let (faults, restart_took, restart_log, waiting) = injector.await.expect("injector");
    let load_took = t0.elapsed();

    // Afterwards: every acknowledged id is there and owns its key, and no key
    // has two jobs.
    let ids = tally.ids.lock().unwrap().clone();
    let mut jobs_by_key: HashMap<u32, Vec<String>> = HashMap::new();
    let mut total_jobs = 0usize;
    let mut cursor = None;
    loop {
        let page = queue
            .list(JobList {
                limit: 1000,
                cursor: cursor.take(),
                ..JobList::default()
            })
            .await
            .expect("list after the restart");
        for job in page.jobs {
            total_jobs += 1;
            let i = u32::try_from(job.payload["i"].as_u64().expect("payload i")).unwrap();
            jobs_by_key.entry(i).or_default().push(job.id);
        }
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let mut lookups = tokio::task::JoinSet::new();
    let entries: Vec<(u32, String)> = ids.iter().map(|(k, v)| (*k, v.clone())).collect();
    for chunk in entries.chunks(entries.len().div_ceil(8).max(1)) {
        let (queue, chunk) = (queue.clone(), chunk.to_vec());
        lookups.spawn(async move {
            let mut wrong = Vec::new();
            for (i, id) in chunk {
                let bound = queue
                    .lookup_key("default", &format!("restart-key-{i}"))
                    .await
                    .expect("lookup_key");
                if bound.as_ref().map(|b| b.job_id.as_str()) != Some(id.as_str()) {
                    wrong.push(format!("key {i}: acknowledged {id}, bound to {bound:?}"));
                }
            }
            wrong
        });
    }
    let mut wrong_bindings = Vec::new();
    while let Some(r) = lookups.join_next().await {
        wrong_bindings.extend(r.expect("lookup task"));
    }
    let lost: Vec<(&u32, &String)> = ids
        .iter()
        .filter(|(i, id)| !jobs_by_key.get(i).is_some_and(|v| v.contains(id)))
        .collect();
    let duplicates = jobs_by_key.values().filter(|v| v.len() > 1).count();
    let failures = tally.failures.lock().unwrap().clone();

    println!(
        "pg_restart: ops {OPS} (tries {}), retries {}, faults injected {faults} \
         (restart took {restart_took:?}, enqueues waiting {waiting}), acknowledged {}, replayed on retry {}, \
         not acknowledged {}, acknowledged lost {}, duplicates {duplicates}, \
         wrong bindings {}, jobs stored {total_jobs}, load took {load_took:?}",
        tally.tried.load(Ordering::Relaxed),
        tally.retries.load(Ordering::Relaxed),
        ids.len(),
        tally.replayed_on_retry.load(Ordering::Relaxed),
        failures.len(),
        lost.len(),
        wrong_bindings.len(),
    );

    assert_eq!(
        faults,
        1,
        "the restart failed: {restart_log}\nserver log:\n{}",
        server.log()
    );
    assert!(waiting > 0, "no enqueue was in flight at the restart");
    // The restart met enqueues in flight, and producers saw it: the lock
    // outlived the shutdown, so every enqueue waiting behind it was ended and
    // its producer retried.
    let retries = tally.retries.load(Ordering::Relaxed);
    assert!(
        retries >= u64::try_from(waiting).unwrap(),
        "{waiting} enqueues were in flight at the restart, and only {retries} retries"
    );
    assert!(lost.is_empty(), "acknowledged jobs lost: {lost:?}");
    assert_eq!(duplicates, 0, "keys with two jobs");
    assert!(wrong_bindings.is_empty(), "{wrong_bindings:?}");
    assert!(
        failures.is_empty(),
        "producers did not recover by themselves: {failures:?}"
    );
    assert_eq!(ids.len(), OPS as usize, "every enqueue acknowledged");
    assert_eq!(total_jobs, OPS as usize, "one job per key");
}
