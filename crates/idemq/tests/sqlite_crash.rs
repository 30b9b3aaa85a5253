//! Fault test: a process enqueuing into a SQLite file is killed with SIGKILL,
//! several rounds on the same file. Every enqueue the process acknowledged
//! (printed after `enqueue` returned) must be in the file afterwards, and the
//! file must pass `PRAGMA integrity_check`. Also reads back the durability
//! pragmas the store runs with (WAL, `synchronous=FULL`), and how a write
//! waits for the file lock another connection holds.
//!
//! Run: `cargo test -p idemq --test sqlite_crash -- --nocapture`.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::store::sqlite::SqliteStore;
use idemq::{EnqueueRequest, Queue, SystemClock};
use idemq_testkit::ledger::all_jobs;
use serde_json::json;

const CHILD_ENV: &str = "IDEMQ_SQLITE_CRASH_CHILD_DB";
const ROUND_ENV: &str = "IDEMQ_SQLITE_CRASH_ROUND";
const ROUNDS: u32 = 8;

/// Not a test of its own: the entry point of the writer process the test
/// below starts (this test binary, run again with `CHILD_ENV` set) and kills.
/// Ignored, so a normal run neither runs nor counts it; the child is
/// started with `--ignored`.
#[test]
#[ignore = "the entry point of a child process the other tests start"]
fn sqlite_crash_child_writer_process() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let round: u32 = std::env::var(ROUND_ENV)
        .expect("round")
        .parse()
        .expect("round number");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let queue = Queue::connect(&format!("sqlite://{path}"))
            .await
            .expect("child opens the database");
        let mut out = std::io::stdout().lock();
        for n in 0u64.. {
            let key = format!("crash-{round}-{n}");
            let id = queue
                .enqueue(
                    EnqueueRequest::new("crash.probe")
                        .payload(json!({ "round": round, "n": n, "pad": "x".repeat(200) }))
                        .idempotency_key(&key),
                )
                .await
                .expect("enqueue");
            // Acknowledged: the id is printed only after the commit returned.
            writeln!(out, "ack {key} {id} end").expect("stdout");
            out.flush().expect("flush");
        }
    });
}

/// Runs one writer until it acknowledged at least `min_acks` enqueues, waits
/// `extra` more, SIGKILLs it; returns its complete acknowledgement lines
/// (key, id) and the number of partial lines (cut by the kill).
fn run_and_kill(
    db: &Path,
    round: u32,
    min_acks: usize,
    extra: Duration,
) -> (Vec<(String, String)>, usize) {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "sqlite_crash_child_writer_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, db)
        .env(ROUND_ENV, round.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the writer process");
    let stdout = child.stdout.take().expect("stdout");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                match line {
                    Ok(l) => lines.lock().unwrap().push(l),
                    Err(_) => break,
                }
            }
        })
    };
    let start = Instant::now();
    while lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.starts_with("ack "))
        .count()
        < min_acks
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the writer acknowledged too little within 30 s"
        );
        assert!(
            child.try_wait().expect("try_wait").is_none(),
            "the writer exited by itself"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(extra);
    child.kill().expect("SIGKILL the writer");
    child.wait().expect("reap the writer");
    reader.join().expect("reader");
    let lines = lines.lock().unwrap().clone();
    let mut acks = Vec::new();
    let mut partial = 0;
    for l in lines {
        // libtest's "test … ... " prefix can share a line with the first ack.
        let Some(at) = l.find("ack ") else { continue };
        let parts: Vec<&str> = l[at..].split(' ').collect();
        match parts.as_slice() {
            ["ack", key, id, "end"] => acks.push(((*key).to_owned(), (*id).to_owned())),
            // A line cut by the kill.
            _ => partial += 1,
        }
    }
    (acks, partial)
}

fn integrity_check(db: &Path) -> String {
    // Read-only, as the crash left it (WAL and all): no recovery by a writer first.
    let conn =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
            .expect("open read-only");
    let rows: Vec<String> = conn
        .prepare("PRAGMA integrity_check")
        .expect("prepare")
        .query_map([], |r| r.get(0))
        .expect("integrity_check")
        .collect::<Result<_, _>>()
        .expect("rows");
    rows.join("; ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writer_killed_repeatedly_loses_no_acknowledged_enqueue() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("crash.db");
    let mut acked: HashMap<String, String> = HashMap::new();
    let mut partial_lines = 0;
    let mut checks = Vec::new();
    for round in 0..ROUNDS {
        let (min_acks, extra) = (
            200 + 100 * round as usize,
            Duration::from_millis(u64::from(round) * 7 % 23),
        );
        let db2 = db.clone();
        let (acks, partial) =
            tokio::task::spawn_blocking(move || run_and_kill(&db2, round, min_acks, extra))
                .await
                .unwrap();
        partial_lines += partial;
        for (k, id) in acks {
            assert!(
                acked.insert(k.clone(), id).is_none(),
                "key {k} acknowledged twice"
            );
        }
        // The file as the crash left it.
        let check = integrity_check(&db);
        assert_eq!(check, "ok", "integrity_check after kill {round}");
        checks.push(check);
    }

    // Reopen with the library: every acknowledged id is there and owns its key.
    let queue = Queue::connect(&format!("sqlite://{}", db.display()))
        .await
        .expect("reopen after the crashes");
    let mut missing = Vec::new();
    for (key, id) in &acked {
        let job = queue.get(id).await.expect("get");
        let bound = queue.lookup_key("default", key).await.expect("lookup_key");
        if job.is_none() || bound.as_ref().map(|b| b.job_id.as_str()) != Some(id.as_str()) {
            missing.push(format!(
                "{key} → {id}: job {:?}, binding {bound:?}",
                job.map(|j| j.id)
            ));
        }
    }
    let stored = all_jobs(&queue).await.len();

    // The durability the store runs with, read back from SQLite.
    let store = SqliteStore::open(Some(&db), Arc::new(SystemClock)).expect("open the store");
    let (synchronous, journal_mode) = store.durability().expect("pragmas");

    println!(
        "sqlite_crash: rounds {ROUNDS}, faults injected (SIGKILL) {ROUNDS}, \
         acknowledged {}, stored {stored}, acknowledged lost {}, partial lines {partial_lines}, \
         integrity_check {checks:?}, synchronous {synchronous}, journal_mode {journal_mode}",
        acked.len(),
        missing.len()
    );
    assert!(
        missing.is_empty(),
        "acknowledged enqueues lost: {missing:?}"
    );
    // A kill can land between a commit and its acknowledgement: at most one
    // unacknowledged job per round, never fewer jobs than acknowledgements.
    assert!(
        (acked.len()..=acked.len() + ROUNDS as usize).contains(&stored),
        "{stored} jobs stored for {} acknowledgements",
        acked.len()
    );
    assert_eq!(synchronous, 2, "synchronous=FULL");
    assert_eq!(journal_mode.to_ascii_lowercase(), "wal");
}

/// Another connection (another process, in effect) holds the file's write
/// lock: a write waits for it up to the busy timeout (5 s), then fails
/// `Unavailable` and writes nothing; a lock released within the timeout lets
/// the waiting write through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waits_for_the_file_lock_up_to_its_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locked.db");
    let queue = Queue::connect(&format!("sqlite://{}", db.display()))
        .await
        .expect("open");

    let holder = queue.sqlite_connection().expect("connection");
    holder
        .execute_batch("BEGIN IMMEDIATE")
        .expect("take the lock");
    let t0 = Instant::now();
    let err = queue
        .enqueue(EnqueueRequest::new("held"))
        .await
        .expect_err("the lock is held past the timeout");
    let waited = t0.elapsed();
    println!("sqlite lock held: refused after {waited:?}: {err}");
    assert!(
        matches!(err, idemq::Error::Unavailable { .. }),
        "a busy file is Unavailable (retryable): {err:?}"
    );
    assert!(
        (Duration::from_secs(5)..Duration::from_secs(15)).contains(&waited),
        "waited {waited:?}, the busy timeout is 5 s"
    );
    holder.execute_batch("COMMIT").expect("release");
    assert_eq!(
        all_jobs(&queue).await.len(),
        0,
        "the refused write wrote nothing"
    );

    // Held for 300 ms only: the write waits, then goes through.
    holder
        .execute_batch("BEGIN IMMEDIATE")
        .expect("take the lock");
    let release = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        holder.execute_batch("COMMIT").expect("release");
    });
    let t0 = Instant::now();
    queue
        .enqueue(EnqueueRequest::new("held"))
        .await
        .expect("the lock was released within the timeout");
    let waited = t0.elapsed();
    release.join().expect("holder");
    assert!(waited >= Duration::from_millis(250), "waited {waited:?}");
    assert_eq!(all_jobs(&queue).await.len(), 1);
}
