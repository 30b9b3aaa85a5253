//! `idemq migrate` brings a database made by an earlier idemq forward with
//! its data intact. The old database is built here from the published
//! migrations 1–4 (the schema every earlier release installed) and filled
//! through its own functions with jobs in every state, live bindings, a
//! schedule and history; after `migrate` every job, event, run, binding and
//! schedule reads back as it was, lists in the same order, and the jobs
//! still run. Fails, never
//! skips, when PostgreSQL is down.

use idemq::fingerprint::{KeyHasher, hex};
use idemq::sqlx::{self, Connection, Row};
use idemq::store::postgres::MIGRATIONS;
use idemq::{EnqueueRequest, JobState, Outcome, Queue};
use serde_json::{Value, json};

/// The schema of the earlier releases: migrations up to this version.
const OLD_VERSION: i64 = 4;

/// An enqueue item as the version-4 `idemq.enqueue` reads it.
fn item(req: &EnqueueRequest, id: &str) -> Value {
    let p = req
        .prepare(&KeyHasher::plain(), 1 << 20)
        .expect("valid request");
    let mut it = json!({
        "type": p.job_type,
        "payload": serde_json::from_str::<Value>(&p.payload).unwrap(),
        "queue": p.queue,
        "new_id": id,
        "priority": p.priority,
        "max_attempts": p.max_attempts,
        "retry": serde_json::to_value(&p.retry).unwrap(),
        "timeout_ms": p.timeout_ms,
        "tags": p.tags,
        "fingerprint": serde_json::from_str::<Value>(&p.fingerprint.to_json()).unwrap(),
    });
    if let Some(j) = &p.job_id {
        it["job_id"] = json!(j);
    }
    if let Some(d) = p.delay_ms {
        it["delay_ms"] = json!(d);
    }
    if let Some(k) = &p.idempotency {
        it["idem"] = json!({"scope": k.scope, "hash": hex(&k.hash), "preview": k.preview,
                            "ttl_ms": k.ttl_ms});
    }
    if let Some(d) = &p.dedupe {
        it["dedupe"] = json!({"key": d.key, "mode": d.mode.as_str(), "ttl_ms": d.ttl_ms});
    }
    it
}

async fn old_enqueue(conn: &mut sqlx::PgConnection, req: &EnqueueRequest, id: &str) {
    let row = sqlx::query("SELECT job_id, outcome FROM idemq.enqueue($1)")
        .bind(Value::Array(vec![item(req, id)]))
        .fetch_one(&mut *conn)
        .await
        .expect("old enqueue");
    assert_eq!(
        row.get::<Option<String>, _>("outcome").as_deref(),
        Some("accepted")
    );
}

/// Claims the one ready job of `job_type` through the old claim; its lease token.
async fn old_claim(conn: &mut sqlx::PgConnection, job_type: &str) -> String {
    let row =
        sqlx::query("SELECT id, lease_token FROM idemq.claim(NULL, $1, 'old-worker', 1, 60000)")
            .bind(vec![job_type.to_owned()])
            .fetch_one(&mut *conn)
            .await
            .expect("old claim");
    row.get("lease_token")
}

type History = Vec<(String, Value)>;

/// A job's events (kind, data) and runs as the old schema stores them.
async fn old_history(conn: &mut sqlx::PgConnection, id: &str) -> (History, Vec<Value>) {
    let events = sqlx::query("SELECT kind, data FROM idemq.events WHERE job_id = $1 ORDER BY seq")
        .bind(id)
        .fetch_all(&mut *conn)
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get("kind"), r.get("data")))
        .collect();
    let runs = sqlx::query(
        "SELECT jsonb_build_object('attempt', attempt, 'worker', worker, 'started_at', started_at,
                'finished_at', finished_at, 'outcome', outcome, 'error', error) AS r
         FROM idemq.runs WHERE job_id = $1 ORDER BY attempt",
    )
    .bind(id)
    .fetch_all(&mut *conn)
    .await
    .unwrap()
    .iter()
    .map(|r| r.get("r"))
    .collect();
    (events, runs)
}

async fn new_history(q: &Queue, id: &str) -> (History, Vec<Value>) {
    let events = q
        .events(id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.kind, e.data))
        .collect();
    let runs = q
        .runs(id)
        .await
        .unwrap()
        .into_iter()
        .map(|r| {
            json!({"attempt": r.attempt, "worker": r.worker, "started_at": r.started_at,
                   "finished_at": r.finished_at, "outcome": r.outcome, "error": r.error})
        })
        .collect();
    (events, runs)
}

/// Timestamps as PostgreSQL's jsonb and chrono print them differ in form
/// only: compare instants.
fn same_runs(old: &[Value], new: &[Value]) -> bool {
    let norm = |v: &Value| -> Value {
        let mut v = v.clone();
        for k in ["started_at", "finished_at"] {
            if let Some(s) = v[k].as_str() {
                let t = chrono::DateTime::parse_from_rfc3339(s)
                    .unwrap()
                    .timestamp_micros();
                v[k] = json!(t);
            }
        }
        v
    };
    old.len() == new.len() && old.iter().zip(new).all(|(a, b)| norm(a) == norm(b))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_brings_a_version_4_database_forward_with_its_data() {
    let admin_url = idemq_testkit::pg_url("postgres");
    let mut admin = sqlx::PgConnection::connect(&admin_url)
        .await
        .expect("PostgreSQL is reachable (IDEMQ_TEST_DATABASE_URL)");
    let db = format!("idemq_m_{}", uuid::Uuid::new_v4().simple());
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let url = idemq_testkit::pg_url(&db);

    // The database an earlier idemq made: migrations 1–4, recorded as its
    // migrator records them.
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql(
        "CREATE SCHEMA idemq;
         CREATE TABLE idemq.schema_migrations (version bigint PRIMARY KEY, name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    for (version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 <= OLD_VERSION) {
        sqlx::raw_sql(*sql).execute(&mut conn).await.unwrap();
        sqlx::query("INSERT INTO idemq.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(&mut conn)
            .await
            .unwrap();
    }
    let status = Queue::migration_status(&url).await.unwrap();
    assert_eq!(status.current, OLD_VERSION);
    assert!(
        !status.is_current() && !status.functions_current,
        "{status:?}"
    );
    assert!(
        Queue::connect(&url).await.is_err(),
        "a binary must refuse an out-of-date schema"
    );

    // Jobs in every state, through the old functions.
    let keyed = EnqueueRequest::new("upgrade.keyed")
        .payload(json!({"order": 42}))
        .idempotency_key("upgrade:order-42");
    old_enqueue(&mut conn, &keyed, "job-ready").await;
    let scheduled = EnqueueRequest::new("upgrade.later")
        .delay(std::time::Duration::from_secs(3600))
        .dedupe(idemq::DedupeOptions::key("acct-7"));
    old_enqueue(&mut conn, &scheduled, "job-scheduled").await;
    for (id, t) in [
        ("job-active", "upgrade.active"),
        ("job-completed", "upgrade.completed"),
        ("job-dead", "upgrade.dead"),
        ("job-cancelled", "upgrade.cancelled"),
    ] {
        old_enqueue(
            &mut conn,
            &EnqueueRequest::new(t).payload(json!({"id": id})),
            id,
        )
        .await;
    }
    let explicit = EnqueueRequest::new("upgrade.explicit")
        .job_id("job-explicit")
        .payload(json!({"n": 1}));
    old_enqueue(&mut conn, &explicit, "job-explicit").await;
    let active_token = old_claim(&mut conn, "upgrade.active").await;
    let done_token = old_claim(&mut conn, "upgrade.completed").await;
    sqlx::query("SELECT * FROM idemq.complete_many($1, $2, $3)")
        .bind(vec!["job-completed".to_owned()])
        .bind(vec![done_token])
        .bind(vec![json!({"ok": true})])
        .execute(&mut conn)
        .await
        .unwrap();
    let dead_token = old_claim(&mut conn, "upgrade.dead").await;
    sqlx::query(
        "SELECT * FROM idemq.finish_attempt('job-dead', $1, 'failed', 'boom', false, NULL, NULL, NULL)",
    )
    .bind(dead_token)
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("SELECT * FROM idemq.cancel('job-cancelled')")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query(
        "SELECT idemq.schedule_put('nightly', NULL, 60000, 'UTC', $1, false, idemq.now(), NULL)",
    )
    .bind(json!({"type": "report.build"}))
    .execute(&mut conn)
    .await
    .unwrap();

    let ids = [
        "job-ready",
        "job-scheduled",
        "job-active",
        "job-completed",
        "job-dead",
        "job-cancelled",
        "job-explicit",
    ];
    let mut before = Vec::new();
    for id in ids {
        before.push(old_history(&mut conn, id).await);
    }
    conn.close().await.unwrap();

    // The upgrade.
    let applied = Queue::migrate(&url).await.unwrap();
    assert!(
        !applied.is_empty() && applied.iter().all(|v| *v > OLD_VERSION),
        "{applied:?}"
    );
    assert!(Queue::migration_status(&url).await.unwrap().is_current());
    assert_eq!(
        Queue::migrate(&url).await.unwrap(),
        Vec::<i64>::new(),
        "nothing left to apply"
    );

    // Everything reads back as it was.
    let q = Queue::connect(&url).await.unwrap();
    for (id, (events, runs)) in ids.iter().zip(&before) {
        let (new_events, new_runs) = new_history(&q, id).await;
        assert_eq!(&new_events, events, "events of {id}");
        assert!(
            same_runs(runs, &new_runs),
            "runs of {id}: {runs:?} / {new_runs:?}"
        );
    }
    // A state outside the five is still refused by the schema: since
    // version 14 by the column's type (`idemq.job_state`), not a table
    // constraint, and nothing is written.
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let refused = sqlx::query("UPDATE idemq.jobs SET state = 'zombie' WHERE id = 'job-ready'")
        .execute(&mut conn)
        .await
        .expect_err("an unknown state");
    assert!(refused.to_string().contains("job_state_known"), "{refused}");
    conn.close().await.unwrap();
    let state = async |id: &str| q.get(id).await.unwrap().expect("job kept").state;
    assert_eq!(state("job-ready").await, JobState::Ready);
    assert_eq!(state("job-scheduled").await, JobState::Scheduled);
    assert_eq!(state("job-active").await, JobState::Active);
    assert_eq!(state("job-completed").await, JobState::Completed);
    assert_eq!(state("job-dead").await, JobState::Dead);
    assert_eq!(state("job-cancelled").await, JobState::Cancelled);
    // Listed newest first across every state (two pages at a time, so the
    // cursor runs through the merge of the states' indexes), and by state.
    let mut listed = Vec::new();
    let mut cursor = None;
    loop {
        let page = q
            .list(idemq::JobList {
                limit: 2,
                cursor,
                ..Default::default()
            })
            .await
            .unwrap();
        listed.extend(page.jobs.into_iter().map(|j| j.id));
        cursor = page.next_cursor;
        if cursor.is_none() {
            break;
        }
    }
    let newest_first: Vec<&str> = ids.iter().rev().copied().collect();
    assert_eq!(listed, newest_first);
    let completed_only = q
        .list(idemq::JobList {
            state: Some(JobState::Completed),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    let completed_ids: Vec<&str> = completed_only.jobs.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(completed_ids, ["job-completed"]);
    let completed = q.get("job-completed").await.unwrap().unwrap();
    assert_eq!(completed.result, Some(json!({"ok": true})));
    // The live idempotency binding still replays, and a changed request
    // still conflicts (the binding has no compact fingerprint, version 13:
    // its JSON one decides); the dedupe binding still coalesces.
    let again = q.enqueue_with_result(keyed.clone()).await.unwrap();
    assert_eq!(
        (again.outcome, again.job_id.as_str()),
        (Outcome::Replayed, "job-ready")
    );
    match q.enqueue(keyed.payload(json!({"changed": true}))).await {
        Err(idemq::Error::EnqueueIdempotencyConflict(c)) => {
            assert_eq!(c.job_id, "job-ready");
            assert_eq!(c.fields, ["payload"]);
        }
        other => panic!("a changed payload on an old binding must conflict: {other:?}"),
    }
    let coalesced = q.enqueue_with_result(scheduled).await.unwrap();
    assert_eq!(
        (coalesced.outcome, coalesced.job_id.as_str()),
        (Outcome::Coalesced, "job-scheduled")
    );
    // The job's own fingerprint, stored in another form now, still decides
    // a request naming its id: the same request replays, another conflicts.
    let again = q.enqueue_with_result(explicit.clone()).await.unwrap();
    assert_eq!(
        (again.outcome, again.job_id.as_str()),
        (Outcome::Replayed, "job-explicit")
    );
    match q.enqueue(explicit.payload(json!({"n": 2}))).await {
        Err(idemq::Error::EnqueueIdempotencyConflict(c)) => {
            assert_eq!(c.job_id, "job-explicit");
            assert_eq!(c.fields, ["payload"]);
        }
        other => panic!("a changed payload on an existing id must conflict: {other:?}"),
    }
    // Rows written before version 10 keep their retry policy in full and
    // the fixed form of their fingerprint; a new row stores NULL for the
    // default policy and the compact form. Both read as the default.
    let fresh = q
        .enqueue(EnqueueRequest::new("upgrade.fresh").delay(std::time::Duration::from_secs(3600)))
        .await
        .unwrap();
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let forms: Vec<(bool, i32)> = sqlx::query_as(
        "SELECT retry IS NULL, length(fingerprint) FROM idemq.jobs WHERE id = ANY ($1)
         ORDER BY id = 'job-explicit'",
    )
    .bind(vec![fresh.clone(), "job-explicit".to_owned()])
    .fetch_all(&mut conn)
    .await
    .unwrap();
    conn.close().await.unwrap();
    assert!(
        forms[0].0 && forms[0].1 % 16 == 5,
        "new row: {:?}",
        forms[0]
    );
    assert_eq!(forms[1], (false, 208), "row of version 4");
    for id in [fresh.as_str(), "job-explicit"] {
        let job = q.get(id).await.unwrap().unwrap();
        assert_eq!(job.retry, idemq::RetryPolicy::default(), "{id}");
    }
    let schedules = q.schedules().await.unwrap();
    assert_eq!(schedules.len(), 1);
    assert_eq!(schedules[0].name, "nightly");

    // And the jobs still run: the attempt claimed before the upgrade
    // completes with its old lease; the dead job is redriven and runs.
    q.complete("job-active", &idemq::LeaseToken::new(active_token), None)
        .await
        .unwrap();
    let (events, runs) = new_history(&q, "job-active").await;
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(kinds, ["accepted", "claimed", "completed"]);
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["outcome"], json!("completed"));
    assert_eq!(runs[0]["worker"], json!("old-worker"));

    q.redrive("job-dead", Default::default()).await.unwrap();
    let claimed = q
        .claim(idemq::ClaimOptions {
            worker: "new-worker".into(),
            limit: 10,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut claimed_ids: Vec<&str> = claimed.iter().map(|j| j.id.as_str()).collect();
    claimed_ids.sort_unstable();
    assert_eq!(claimed_ids, ["job-dead", "job-explicit", "job-ready"]);
    for job in &claimed {
        q.complete(&job.id, &job.lease_token, None).await.unwrap();
    }
    let (events, runs) = new_history(&q, "job-dead").await;
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds,
        [
            "accepted",
            "claimed",
            "dead",
            "redriven",
            "claimed",
            "completed"
        ]
    );
    let outcomes: Vec<&Value> = runs.iter().map(|r| &r["outcome"]).collect();
    assert_eq!(outcomes, [&json!("failed"), &json!("completed")]);
    assert_eq!(state("job-dead").await, JobState::Completed);
    assert_eq!(state("job-ready").await, JobState::Completed);

    drop(q);
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    .unwrap();
}
