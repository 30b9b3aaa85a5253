//! Fault test: the PostgreSQL server is restarted (fast shutdown, then start)
//! while 8 producers run 20,000 idempotent enqueues. Producers retry
//! `Unavailable` with the same key (bounded), the pool reconnects by itself,
//! and afterwards every acknowledged job is there and no key owns two jobs.
//!
//! This binary holds this one test only: it restarts the server every other
//! PostgreSQL test uses (cargo runs test binaries one after another, but the
//! tests of one binary in parallel). A guard starts the server again even
//! when the test fails.
//!
//! Run: `cargo test -p idemq --test pg_restart -- --nocapture` (as a user
//! allowed to run `pg_ctlcluster`, e.g. root, on the machine of the server).

#[allow(dead_code)]
#[path = "conformance/support.rs"]
mod support;

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::store::postgres::{PgOptions, PgStore};
use idemq::{EnqueueRequest, JobList, Outcome, Queue, QueueOptions};
use serde_json::json;

const OPS: u32 = 20_000;
const PRODUCERS: u32 = 8;
/// The restart happens once this many enqueues were acknowledged.
const RESTART_AT: u64 = 6_000;
/// How long one enqueue may keep retrying `Unavailable` before it gives up.
const RETRY_BUDGET: Duration = Duration::from_secs(30);

/// The local cluster's version (`ls /etc/postgresql`), highest first.
fn pg_version() -> String {
    let mut versions: Vec<String> = std::fs::read_dir("/etc/postgresql")
        .expect("/etc/postgresql: this test restarts a local Debian-style cluster")
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("main").is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    versions.sort_by_key(|v| v.parse::<u32>().unwrap_or(0));
    versions.pop().expect("a PostgreSQL cluster named main")
}

fn pg_ctlcluster(version: &str, action: &str) -> std::process::Output {
    Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            "--mode",
            "fast",
            version,
            "main",
            action,
        ])
        .output()
        .expect("run pg_ctlcluster")
}

/// Waits until the server accepts connections again (up to 60 s).
fn wait_until_up() -> bool {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let up = std::thread::spawn(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(async {
                    use sqlx::Connection;
                    match sqlx::PgConnection::connect(&support::pg_admin_url()).await {
                        Ok(c) => {
                            let _ = c.close().await;
                            true
                        }
                        Err(_) => false,
                    }
                })
        })
        .join()
        .unwrap_or(false);
        if up {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

/// Leaves the server running and drops the test database, whatever happened.
struct ServerGuard {
    version: String,
    db: String,
}

impl Drop for ServerGuard {
    fn drop(&mut self) {
        // "already running" is fine: start is idempotent for our purpose.
        let _ = pg_ctlcluster(&self.version, "start");
        if wait_until_up() {
            support::drop_pg_database(&self.db);
        } else {
            eprintln!(
                "pg_restart: PostgreSQL {} main did not come back up: start it by hand",
                self.version
            );
        }
    }
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_restart_during_idempotent_enqueues_loses_nothing() {
    let version = pg_version();
    let (url, db) = support::pg_database();
    let _guard = ServerGuard {
        version: version.clone(),
        db,
    };
    let store = PgStore::connect(
        &url,
        PgOptions {
            max_connections: PRODUCERS,
            acquire_timeout: Duration::from_secs(2),
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
    let injector = {
        let (tally, done) = (tally.clone(), done.clone());
        tokio::spawn(async move {
            while tally.acked.load(Ordering::Relaxed) < RESTART_AT {
                if done.load(Ordering::Relaxed) {
                    return (0u64, Duration::ZERO, String::new());
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let started = Instant::now();
            let out = tokio::task::spawn_blocking(move || pg_ctlcluster(&version, "restart"))
                .await
                .expect("restart task");
            let log = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (u64::from(out.status.success()), started.elapsed(), log)
        })
    };
    while let Some(r) = producers.join_next().await {
        r.expect("producer");
    }
    done.store(true, Ordering::Relaxed);
    let (faults, restart_took, restart_log) = injector.await.expect("injector");
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
         (restart took {restart_took:?}), acknowledged {}, replayed on retry {}, \
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

    assert_eq!(faults, 1, "the restart failed: {restart_log}");
    assert!(
        tally.retries.load(Ordering::Relaxed) > 0,
        "no producer noticed the restart: the fault was not injected during the load"
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
