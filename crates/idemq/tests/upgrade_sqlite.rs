//! `idemq migrate` brings a SQLite database made by an earlier idemq forward
//! with its data intact. The old database is built here from the published
//! migrations 1–5 and filled the way those releases wrote it (every event
//! and run stored): a waiting job, a running one, a completed one and a
//! dead one. After the upgrade (version 6: the routine history derived from
//! the job row) every job's events and runs read back as they were, the
//! running job's lease still holds and its completion reads as a new one's
//! would, and new jobs are numbered after every old number. A file of
//! version 6 moved to version 7 (the job table rebuilt) keeps every row,
//! column by column, and every index.

use idemq::fingerprint::KeyHasher;
use idemq::store::sqlite::MIGRATIONS;
use idemq::{EnqueueRequest, JobState, Queue};
use rusqlite::{Connection, params};
use serde_json::{Value, json};

/// The schema of the earlier releases: migrations up to this version.
const OLD_VERSION: i64 = 5;

const T0: i64 = 1_780_000_000_000_000;

fn old_database(path: &std::path::Path) -> Connection {
    database_at(path, OLD_VERSION)
}

/// A database of the published migrations up to `version`.
fn database_at(path: &std::path::Path, version: i64) -> Connection {
    let conn = Connection::open(path).expect("open");
    conn.execute_batch(
        "CREATE TABLE idemq_migrations (
            version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)",
    )
    .unwrap();
    for (v, name, sql) in MIGRATIONS.iter().filter(|m| m.0 <= version) {
        conn.execute_batch(sql).expect("old migration");
        conn.execute(
            "INSERT INTO idemq_migrations (version, name, applied_at) VALUES (?1, ?2, ?3)",
            params![v, name, T0],
        )
        .unwrap();
    }
    conn
}

/// Inserts a job row as the version-5 store did (its `accepted` event stored).
fn old_job(conn: &Connection, id: &str, state: &str) {
    let p = EnqueueRequest::new("old.type")
        .payload(json!({ "id": id }))
        .prepare(&KeyHasher::plain(), 1 << 20)
        .expect("valid request");
    conn.execute(
        "INSERT INTO idemq_jobs (id, type, queue, state, payload, run_at, max_attempts, retry,
           timeout_ms, tags, fingerprint, created_at, updated_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, '[]', ?10, ?6, ?6)",
        params![
            id,
            p.job_type,
            p.queue,
            state,
            p.payload,
            T0,
            p.max_attempts,
            serde_json::to_string(&p.retry).unwrap(),
            p.timeout_ms,
            p.fingerprint.to_json(),
        ],
    )
    .unwrap();
    old_event(
        conn,
        id,
        "accepted",
        T0,
        json!({ "queue": "default", "run_at": "2026-05-28T20:26:40Z" }),
    );
}

fn old_event(conn: &Connection, id: &str, kind: &str, at: i64, data: Value) {
    conn.execute(
        "INSERT INTO idemq_events (job_id, kind, at, data) VALUES (?1, ?2, ?3, ?4)",
        params![id, kind, at, data.to_string()],
    )
    .unwrap();
}

/// A claim as the version-5 store wrote it: the job row, an open run and a
/// `claimed` event.
fn old_claim(conn: &Connection, id: &str, token: &str) {
    conn.execute(
        "UPDATE idemq_jobs SET state = 'active', attempt = attempt + 1, lease_token = ?2,
           lease_expires_at = ?3, lease_ms = 3600000, worker = 'old-worker', started_at = ?4
         WHERE id = ?1",
        params![id, token, i64::MAX / 2, T0 + 1],
    )
    .unwrap();
    conn.execute(
        "INSERT INTO idemq_runs (job_id, attempt, worker, started_at) VALUES (?1, 1, 'old-worker', ?2)",
        params![id, T0 + 1],
    )
    .unwrap();
    old_event(
        conn,
        id,
        "claimed",
        T0 + 1,
        json!({ "attempt": 1, "worker": "old-worker" }),
    );
}

/// A job's events as (seq, kind, data) and its runs as (attempt, outcome).
async fn history(q: &Queue, id: &str) -> (Vec<(i64, String, Value)>, Vec<(i32, Option<String>)>) {
    let events = q
        .events(id)
        .await
        .expect("events")
        .into_iter()
        .map(|e| (e.seq, e.kind, e.data))
        .collect();
    let runs = q
        .runs(id)
        .await
        .expect("runs")
        .into_iter()
        .map(|r| (r.attempt, r.outcome))
        .collect();
    (events, runs)
}

fn kinds(events: &[(i64, String, Value)]) -> Vec<&str> {
    events.iter().map(|e| e.1.as_str()).collect()
}

#[tokio::test]
async fn migrate_keeps_every_history_and_derives_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("old.db");
    {
        let conn = old_database(&path);
        old_job(&conn, "waiting", "waiting");
        old_job(&conn, "running", "waiting");
        old_claim(&conn, "running", "token-running");
        old_job(&conn, "done", "waiting");
        old_claim(&conn, "done", "token-done");
        conn.execute(
            "UPDATE idemq_jobs SET state = 'completed', finished_at = ?2, attempts_used = 1,
               lease_token = NULL, lease_expires_at = NULL, worker = NULL, started_at = NULL
             WHERE id = ?1",
            params!["done", T0 + 2],
        )
        .unwrap();
        conn.execute(
            "UPDATE idemq_runs SET finished_at = ?2, outcome = 'completed' WHERE job_id = ?1",
            params!["done", T0 + 2],
        )
        .unwrap();
        old_event(&conn, "done", "completed", T0 + 2, json!({ "attempt": 1 }));
        old_job(&conn, "failed", "waiting");
        old_claim(&conn, "failed", "token-failed");
        conn.execute(
            "UPDATE idemq_jobs SET state = 'dead', finished_at = ?2, attempts_used = 1,
               last_error = 'boom', lease_token = NULL, worker = NULL, started_at = NULL
             WHERE id = ?1",
            params!["failed", T0 + 2],
        )
        .unwrap();
        conn.execute(
            "UPDATE idemq_runs SET finished_at = ?2, outcome = 'failed', error = 'boom'
             WHERE job_id = ?1",
            params!["failed", T0 + 2],
        )
        .unwrap();
        old_event(
            &conn,
            "failed",
            "dead",
            T0 + 2,
            json!({ "reason": "permanent", "attempt": 1 }),
        );
    }
    let url = format!("sqlite://{}", path.display());
    let before = Queue::migration_status(&url).await.expect("status");
    assert_eq!(before.current, OLD_VERSION);
    let q = Queue::connect(&url).await.expect("connect migrates");
    let after = Queue::migration_status(&url).await.expect("status");
    assert_eq!(after.current, MIGRATIONS.last().unwrap().0);

    // Old histories read back as they were stored.
    let (events, runs) = history(&q, "waiting").await;
    assert_eq!(kinds(&events), ["accepted"]);
    assert_eq!(events[0].2["queue"], "default");
    assert!(runs.is_empty());
    let (events, runs) = history(&q, "done").await;
    assert_eq!(kinds(&events), ["accepted", "claimed", "completed"]);
    assert_eq!(runs, [(1, Some("completed".into()))]);
    let (events, runs) = history(&q, "failed").await;
    assert_eq!(kinds(&events), ["accepted", "claimed", "dead"]);
    assert_eq!(runs, [(1, Some("failed".into()))]);

    // The running attempt: its run and `claimed` event are now derived,
    // under the same number, and its lease still holds.
    let (running_before, runs) = history(&q, "running").await;
    assert_eq!(kinds(&running_before), ["accepted", "claimed"]);
    assert_eq!(
        running_before[1].2,
        json!({ "attempt": 1, "worker": "old-worker" })
    );
    assert_eq!(runs, [(1, None)]);
    q.complete(
        "running",
        &idemq::LeaseToken::new("token-running"),
        Some(json!("ok")),
    )
    .await
    .expect("the old lease completes");
    let (events, runs) = history(&q, "running").await;
    assert_eq!(kinds(&events), ["accepted", "claimed", "completed"]);
    assert_eq!(events[..2], running_before[..]);
    assert_eq!(runs, [(1, Some("completed".into()))]);
    let job = q.get("running").await.unwrap().expect("job");
    assert_eq!(
        (job.state, job.result),
        (JobState::Completed, Some(json!("ok")))
    );

    // New work: numbered after every old number, its history derived.
    let highest = ["waiting", "done", "failed", "running"];
    let mut old_max = 0;
    for id in highest {
        old_max = old_max.max(history(&q, id).await.0.iter().map(|e| e.0).max().unwrap());
    }
    let fresh = q
        .enqueue(EnqueueRequest::new("old.type"))
        .await
        .expect("enqueue");
    let claimed = q
        .claim(idemq::ClaimOptions {
            queues: Vec::new(),
            types: None,
            worker: "new-worker".into(),
            limit: 10,
            lease: std::time::Duration::from_secs(30),
        })
        .await
        .expect("claim");
    let mine = claimed.iter().find(|c| c.id == fresh).expect("claimed");
    q.complete(&fresh, &mine.lease_token, None)
        .await
        .expect("complete");
    let (events, runs) = history(&q, &fresh).await;
    assert_eq!(kinds(&events), ["accepted", "claimed", "completed"]);
    assert!(events[0].0 > old_max, "{events:?} after {old_max}");
    assert!(events.windows(2).all(|w| w[0].0 < w[1].0));
    assert_eq!(runs, [(1, Some("completed".into()))]);
}

/// Each schema version records the idemq that applied it (an earlier
/// database gains the column at its next migrate), and a binary meeting a
/// newer schema refuses it, naming the idemq to run.
#[tokio::test]
async fn a_newer_schema_is_refused_naming_the_idemq_that_wrote_it() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("newer.db");
    drop(old_database(&path));
    idemq::store::sqlite::migrate_file(&path).expect("migrate");
    let conn = Connection::open(&path).expect("open");
    let recorded: Vec<(i64, Option<String>)> = conn
        .prepare("SELECT version, idemq_version FROM idemq_migrations ORDER BY version")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    for (version, by) in &recorded {
        let expected = (*version > OLD_VERSION).then_some(env!("CARGO_PKG_VERSION"));
        assert_eq!(by.as_deref(), expected, "version {version}");
    }
    conn.execute(
        "INSERT INTO idemq_migrations (version, name, applied_at, idemq_version)
         VALUES (9999, 'from_the_future', ?1, '9.9.9')",
        params![T0],
    )
    .unwrap();
    let url = format!("sqlite://{}", path.display());
    for err in [
        Queue::connect(&url).await.expect_err("newer"),
        idemq::store::sqlite::migrate_file(&path).expect_err("newer"),
    ] {
        let text = err.to_string();
        assert!(text.contains("version 9999"), "{text}");
        assert!(text.contains("run idemq 9.9.9"), "{text}");
    }
}

/// A process already running on a file that a newer idemq migrated (opening
/// a file migrates it: a newer `idemq jobs list` beside a running worker is
/// enough) refuses every write from then on, naming the idemq to run, and
/// writes nothing; its statements were written for the tables it opened.
/// A change of the schema that is not a migration (the application's own
/// table) changes nothing.
#[tokio::test]
async fn a_running_process_refuses_to_write_once_a_newer_idemq_migrated_its_file() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("running.db");
    let url = format!("sqlite://{}", path.display());
    let queue = Queue::connect(&url).await.expect("connect");
    queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("enqueue");
    let conn = Connection::open(&path).expect("open");
    conn.busy_timeout(std::time::Duration::from_secs(5))
        .unwrap();
    conn.execute_batch("CREATE TABLE app_orders (id TEXT PRIMARY KEY)")
        .unwrap();
    queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("an application's table changes nothing");
    // What a newer idemq's migration does: new tables, and its version.
    conn.execute_batch(
        "BEGIN IMMEDIATE;
         CREATE TABLE idemq_from_the_future (x INTEGER);
         INSERT INTO idemq_migrations (version, name, applied_at, idemq_version)
         VALUES (9999, 'from_the_future', 0, '9.9.9');
         COMMIT;",
    )
    .unwrap();
    let jobs = || -> i64 {
        conn.query_row("SELECT count(*) FROM idemq_jobs", [], |r| r.get(0))
            .unwrap()
    };
    let refused = |err: idemq::Error| {
        let text = err.to_string();
        assert!(!err.is_retryable(), "{err:?}");
        assert!(text.contains("version 9999"), "{text}");
        assert!(text.contains("run idemq 9.9.9"), "{text}");
    };
    refused(
        queue
            .enqueue(EnqueueRequest::new("t"))
            .await
            .expect_err("enqueue after the migration"),
    );
    refused(
        queue
            .claim(idemq::ClaimOptions::default())
            .await
            .expect_err("claim after the migration"),
    );
    let own = queue
        .sqlite_connection()
        .expect("a connection of the store's");
    refused(
        queue
            .enqueue_in_sqlite(&own, EnqueueRequest::new("t"))
            .expect_err("an enqueue on a connection of the application's"),
    );
    assert_eq!(jobs(), 2, "nothing written after the migration");
}

/// Every row of `idemq_jobs` in `seq` order, every column as stored.
fn job_rows(conn: &Connection) -> Vec<Vec<rusqlite::types::Value>> {
    let mut stmt = conn
        .prepare("SELECT * FROM idemq_jobs ORDER BY seq")
        .unwrap();
    let n = stmt.column_count();
    stmt.query_map([], |r| (0..n).map(|i| r.get(i)).collect())
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// The indexes of `idemq_jobs` (SQLite's own included) as (name, SQL).
fn job_indexes(conn: &Connection) -> Vec<(String, Option<String>)> {
    conn.prepare(
        "SELECT name, sql FROM sqlite_master
         WHERE type = 'index' AND tbl_name = 'idemq_jobs' ORDER BY name",
    )
    .unwrap()
    .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
    .unwrap()
    .collect::<Result<_, _>>()
    .unwrap()
}

/// Version 7 rebuilds the job table (its check of `state` as comparisons,
/// not a list): every row of every state comes back as it was stored,
/// under the same `seq`, with the same indexes; the check still refuses a
/// state idemq does not know, and the jobs run on.
#[tokio::test]
async fn version_7_rebuilds_the_job_table_with_every_row_and_index() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("v6.db");
    let (rows, indexes) = {
        let conn = database_at(&path, 6);
        // Enqueued alike, then moved to the five states below.
        for id in ["w", "a", "c", "d", "x"] {
            old_job(&conn, id, "waiting");
        }
        conn.execute_batch(
            "UPDATE idemq_jobs SET concurrency_key = 'ck', dedupe_key = 'dk',
                 dedupe_mode = 'pending', tags = '[\"t\"]', priority = 3 WHERE id = 'w';
             UPDATE idemq_jobs SET state = 'active', attempt = 1, lease_token = 'tok-a',
                 lease_expires_at = 9000000000000000, lease_ms = 30000, worker = 'old',
                 started_at = 1780000000000001, claim_seq = 100, concurrency_key = 'ck2'
             WHERE id = 'a';
             UPDATE idemq_jobs SET state = 'completed', attempt = 1, attempts_used = 1,
                 result = '{\"ok\":true}', finished_at = 1780000000000002,
                 purge_after = 9000000000000000, claim_seq = 101, done_seq = 102,
                 first_run_at = 1780000000000001 WHERE id = 'c';
             UPDATE idemq_jobs SET state = 'dead', attempt = 1, attempts_used = 1,
                 last_error = 'boom', finished_at = 1780000000000003 WHERE id = 'd';
             UPDATE idemq_jobs SET state = 'cancelled', cancel_requested = 1,
                 idem_scope = 'default', idem_key_hash = zeroblob(32), idem_key_preview = 'k…',
                 finished_at = 1780000000000004 WHERE id = 'x';",
        )
        .unwrap();
        (job_rows(&conn), job_indexes(&conn))
    };
    assert_eq!(rows.len(), 5);
    assert_eq!(
        idemq::store::sqlite::migrate_file(&path).expect("migrate"),
        [7]
    );
    let conn = Connection::open(&path).expect("open");
    assert_eq!(job_rows(&conn), rows, "every row as it was");
    assert_eq!(job_indexes(&conn), indexes, "the same indexes");
    let table: String = conn
        .query_row(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'idemq_jobs'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert!(!table.contains(" IN ("), "{table}");
    let ok: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    for statement in [
        "UPDATE idemq_jobs SET state = 'paused' WHERE id = 'w'",
        "UPDATE idemq_jobs SET state = NULL WHERE id = 'w'",
    ] {
        let err = conn.execute(statement, []).expect_err(statement);
        assert!(err.to_string().contains("constraint failed"), "{err}");
    }
    assert_eq!(job_rows(&conn), rows, "nothing written by the refusals");
    drop(conn);

    let url = format!("sqlite://{}", path.display());
    let q = Queue::connect(&url).await.expect("connect");
    for (id, state) in [
        ("w", JobState::Ready),
        ("a", JobState::Active),
        ("c", JobState::Completed),
        ("d", JobState::Dead),
        ("x", JobState::Cancelled),
    ] {
        let job = q.get(id).await.expect("get").expect(id);
        assert_eq!(job.state, state, "{id}");
    }
    q.complete("a", &idemq::LeaseToken::new("tok-a"), None)
        .await
        .expect("the old lease completes");
    let claimed = q
        .claim(idemq::ClaimOptions {
            limit: 10,
            ..idemq::ClaimOptions::default()
        })
        .await
        .expect("claim");
    assert_eq!(
        claimed.iter().map(|c| c.id.as_str()).collect::<Vec<_>>(),
        ["w"]
    );
}
