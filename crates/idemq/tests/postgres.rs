//! What only PostgreSQL can show: transactional enqueue on the caller's own
//! transaction, wake-ups by LISTEN/NOTIFY, concurrent migrations, and the
//! committed schema dump. These fail, never skip, when PostgreSQL is down.

use std::time::Duration;

use idemq::sqlx::{self, Connection, Executor};
use idemq::{EnqueueRequest, Error, Outcome, Queue};
use idemq_testkit::Harness;
use serde_json::json;

async fn exec(conn: &mut sqlx::PgConnection, sql: String) {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(conn)
        .await
        .expect("statement");
}

fn keyed(key: &str, payload: serde_json::Value) -> EnqueueRequest {
    EnqueueRequest::new("order.confirm")
        .payload(payload)
        .idempotency_key(key)
}

async fn orders_table(h: &Harness) -> sqlx::PgPool {
    let pool = h.caller_pool().await;
    pool.execute("CREATE TABLE orders (id text PRIMARY KEY)")
        .await
        .expect("orders table");
    pool
}

async fn orders(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(pool)
        .await
        .expect("count")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_enqueue_commits_with_the_callers_rows() {
    let h = Harness::postgres().await;
    let pool = orders_table(&h).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES ('o-1')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let r = h
        .queue
        .enqueue_in(&mut tx, keyed("o-1", json!({"order": 1})))
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    // Not visible, not claimable, before the commit.
    assert!(h.queue.get(&r.job_id).await.unwrap().is_none());
    assert!(h.claim(10).await.is_empty());
    tx.commit().await.unwrap();
    assert_eq!(orders(&pool).await, 1);
    assert_eq!(
        h.claim(10).await.len(),
        1,
        "claimable exactly once after the commit"
    );
    assert!(h.claim(10).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactional_enqueue_rolls_back_with_the_callers_rows() {
    let h = Harness::postgres().await;
    let pool = orders_table(&h).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO orders VALUES ('o-2')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let r = h
        .queue
        .enqueue_in(&mut tx, keyed("o-2", json!(2)))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(orders(&pool).await, 0);
    assert!(h.queue.get(&r.job_id).await.unwrap().is_none());
    assert_eq!(h.totals().await, (0, 0), "no job, no event");
    assert!(
        h.queue
            .lookup_key("default", "o-2")
            .await
            .unwrap()
            .is_none(),
        "no binding"
    );
    let again = h
        .queue
        .enqueue_with_result(keyed("o-2", json!(2)))
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Accepted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_transaction_stays_usable_after_a_refused_request() {
    let h = Harness::postgres().await;
    let pool = orders_table(&h).await;
    let mut tx = pool.begin().await.unwrap();
    h.queue
        .enqueue_in(&mut tx, keyed("o-3", json!(1)))
        .await
        .unwrap();
    let err = h
        .queue
        .enqueue_in(&mut tx, keyed("o-3", json!(2)))
        .await
        .unwrap_err();
    assert_eq!(
        err.conflict().map(|c| c.fields.clone()),
        Some(vec!["payload".to_owned()])
    );
    let past = h.now().await - chrono::Duration::seconds(1);
    let err = h
        .queue
        .enqueue_in(&mut tx, EnqueueRequest::new("t").deadline(past))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Validation { ref field, .. } if field == "deadline"));
    // The transaction is not aborted: more work and a commit succeed.
    sqlx::query("INSERT INTO orders VALUES ('o-3')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(orders(&pool).await, 1);
    assert_eq!(h.totals().await.0, 1);
}

/// A waiter behind a key held by a caller's open transaction: the job the
/// holder enqueued in it (the key `key`, the payload `held`), the
/// transaction, and another queue's request for the same key with the
/// payload `wanted`, checked to be blocked. It found no committed binding,
/// so it waits under the key's lock to insert one; what the holder does
/// next decides it.
async fn waiter_behind_a_held_key(
    h: &Harness,
    key: &'static str,
    held: serde_json::Value,
    wanted: serde_json::Value,
) -> (
    idemq::EnqueueResult,
    sqlx::Transaction<'static, sqlx::Postgres>,
    tokio::task::JoinHandle<idemq::Result<idemq::EnqueueResult>>,
) {
    let pool = orders_table(h).await;
    let mut tx = pool.begin().await.unwrap();
    let holder = h.queue.enqueue_in(&mut tx, keyed(key, held)).await.unwrap();
    let other = h.another_queue().await;
    let waiter = tokio::spawn(async move { other.enqueue_with_result(keyed(key, wanted)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "the waiter blocks on the held key");
    (holder, tx, waiter)
}

/// A waiter blocked on a key held by a transaction that rolls back gets
/// `accepted`, never `replayed` for a job that never committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_behind_a_rolled_back_holder_is_accepted() {
    let h = Harness::postgres().await;
    let (held, tx, waiter) = waiter_behind_a_held_key(&h, "o-4", json!(4), json!(4)).await;
    tx.rollback().await.unwrap();
    let r = waiter.await.unwrap().unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    assert_ne!(r.job_id, held.job_id);
    assert_eq!(h.totals().await, (1, 1));
}

/// Once the holder commits, the binding's primary key turns the waiter's
/// insert away and the request is decided again: a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_behind_a_committed_holder_is_replayed() {
    let h = Harness::postgres().await;
    let (held, tx, waiter) = waiter_behind_a_held_key(&h, "o-5", json!(5), json!(5)).await;
    tx.commit().await.unwrap();
    let r = waiter.await.unwrap().unwrap();
    assert_eq!((r.job_id, r.outcome), (held.job_id, Outcome::Replayed));
    assert_eq!(h.totals().await.0, 1);
}

/// The same race with another payload: the waiter's insert writes nothing
/// and the request is answered with the conflict naming the held job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_behind_a_committed_holder_with_another_payload_conflicts() {
    let h = Harness::postgres().await;
    let (held, tx, waiter) = waiter_behind_a_held_key(&h, "o-7", json!(7), json!(8)).await;
    tx.commit().await.unwrap();
    match waiter.await.unwrap() {
        Err(Error::EnqueueIdempotencyConflict(c)) => {
            assert_eq!(c.job_id, held.job_id);
            assert_eq!(c.fields, vec!["payload"]);
        }
        other => panic!("expected a conflict, got {other:?}"),
    }
    assert_eq!(h.totals().await.0, 1);
}

/// The key is decided before the clock (SPEC 5): a repeat whose deadline
/// passed while it waited for the key's lock, behind the transaction that
/// binds the key, is answered `replayed` once that commits, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiter_whose_deadline_passed_behind_a_committed_holder_is_replayed() {
    let h = Harness::postgres().await;
    let deadline = h.now().await + chrono::Duration::seconds(10);
    let req = move || keyed("o-9", json!(9)).deadline(deadline);
    let pool = orders_table(&h).await;
    let mut tx = pool.begin().await.unwrap();
    let held = h.queue.enqueue_in(&mut tx, req()).await.unwrap();
    h.advance(Duration::from_secs(20));
    let other = h.another_queue().await;
    let waiter = tokio::spawn(async move { other.enqueue_with_result(req()).await });
    // The race happened: the waiter found no committed binding and waits
    // for the key's lock, with the deadline already behind the clock.
    let mut admin = sqlx::PgConnection::connect(h.db_url.as_deref().unwrap())
        .await
        .unwrap();
    let mut blocked = false;
    for _ in 0..100 {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND wait_event = 'advisory'",
        )
        .fetch_one(&mut admin)
        .await
        .unwrap();
        if n > 0 {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(blocked, "the waiter blocks on the key's lock");
    assert!(!waiter.is_finished());
    tx.commit().await.unwrap();
    let r = waiter.await.unwrap().unwrap();
    assert_eq!((r.job_id, r.outcome), (held.job_id, Outcome::Replayed));
    assert_eq!(h.totals().await.0, 1);
}

/// A binding holds its request's compact fingerprint (`fp`, schema version
/// 13), whether the statement of a single keyed request or `idemq.enqueue`
/// (a batch, a request with an explicit id) wrote it, and a repeat is
/// answered from it. A binding without one, or with one that does not
/// match, is decided from its JSON fingerprint: the same request replays,
/// another conflicts, by either statement of a single request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binding_keeps_the_compact_fingerprint_and_without_it_the_json_decides() {
    let h = Harness::postgres().await;
    let url = h.db_url.clone().expect("postgres");
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let single = h
        .queue
        .enqueue_with_result(keyed("fp-1", json!(1)))
        .await
        .unwrap();
    let batch = h
        .queue
        .enqueue_many(vec![keyed("fp-2", json!(2))], Default::default())
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    let with_id = |payload| keyed("fp-3", payload).job_id("fp-3-job");
    let named = h
        .queue
        .enqueue_with_result(with_id(json!(3)))
        .await
        .unwrap();
    let with_fp: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idemq.idempotency WHERE fp IS NOT NULL")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(with_fp, 3, "every binding holds the compact fingerprint");
    let (job_fp, binding_fp): (Vec<u8>, Vec<u8>) = sqlx::query_as(
        "SELECT j.fingerprint, i.fp FROM idemq.jobs j
         JOIN idemq.idempotency i ON i.job_id = j.id WHERE j.id = $1",
    )
    .bind(&batch.job_id)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(binding_fp, job_fp, "the job row's compact form");
    // No compact form on the first, another one on the other two: the
    // JSON decides all three.
    exec(
        &mut conn,
        format!(
            "UPDATE idemq.idempotency SET fp = CASE job_id WHEN '{}' THEN NULL ELSE '\\x01'::bytea END",
            single.job_id
        ),
    )
    .await;
    let requests: [(&dyn Fn(i64) -> EnqueueRequest, &String); 3] = [
        (&|p| keyed("fp-1", json!(p)), &single.job_id),
        (&|p| keyed("fp-2", json!(p)), &batch.job_id),
        (&|p| with_id(json!(p)), &named.job_id),
    ];
    for (payload, (request, job)) in (1..).zip(requests) {
        let again = h.queue.enqueue_with_result(request(payload)).await.unwrap();
        assert_eq!((again.outcome, &again.job_id), (Outcome::Replayed, job));
        match h.queue.enqueue(request(payload + 10)).await {
            Err(Error::EnqueueIdempotencyConflict(c)) => {
                assert_eq!(&c.job_id, job);
                assert_eq!(c.fields, vec!["payload"]);
            }
            other => panic!("expected a conflict, got {other:?}"),
        }
    }
    assert_eq!(h.totals().await.0, 3);
}

/// Under REPEATABLE READ and SERIALIZABLE a key bound after the caller's
/// snapshot is a serialization failure (`Unavailable`); retrying the whole
/// transaction answers `replayed`. Never a second job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshot_isolation_callers_get_a_retryable_error_then_a_replay() {
    for level in ["REPEATABLE READ", "SERIALIZABLE"] {
        let h = Harness::postgres().await;
        let url = h.db_url.clone().expect("postgres");
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        exec(&mut conn, format!("BEGIN ISOLATION LEVEL {level}")).await;
        // Take the snapshot before the other client commits.
        conn.execute("SELECT count(*) FROM idemq.jobs")
            .await
            .unwrap();
        let first = h
            .queue
            .enqueue_with_result(keyed("o-6", json!(6)))
            .await
            .unwrap();
        let err = h
            .queue
            .enqueue_in(&mut conn, keyed("o-6", json!(6)))
            .await
            .unwrap_err();
        assert!(err.is_retryable(), "{level}: {err:?}");
        conn.execute("ROLLBACK").await.unwrap();
        exec(&mut conn, format!("BEGIN ISOLATION LEVEL {level}")).await;
        let retry = h
            .queue
            .enqueue_in(&mut conn, keyed("o-6", json!(6)))
            .await
            .unwrap();
        conn.execute("COMMIT").await.unwrap();
        assert_eq!(
            (retry.job_id, retry.outcome),
            (first.job_id, Outcome::Replayed),
            "{level}"
        );
        assert_eq!(h.totals().await.0, 1, "{level}");
    }
}

/// A session listening on idemq's wake-up channel.
async fn wakeup_listener(h: &Harness) -> sqlx::postgres::PgListener {
    let mut listener = sqlx::postgres::PgListener::connect(h.db_url.as_deref().unwrap())
        .await
        .unwrap();
    listener
        .listen(idemq::store::postgres::NOTIFY_CHANNEL)
        .await
        .unwrap();
    listener
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acceptance_notifies_and_a_replay_does_not() {
    let h = Harness::postgres().await;
    let mut listener = wakeup_listener(&h).await;
    let req = || keyed("o-7", json!(7)).queue("mail");
    h.queue.enqueue(req()).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("notified")
        .unwrap();
    assert_eq!(n.payload(), "mail", "the payload is only the queue name");
    assert_eq!(
        h.queue.enqueue_with_result(req()).await.unwrap().outcome,
        Outcome::Replayed
    );
    let quiet = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(
        quiet.is_err(),
        "a replay writes nothing, not even a notification"
    );
}

/// A request whose only key is its idempotency key is answered by one of
/// two statements, chosen by what the store's last such request was
/// (docs/storage.md): after a new key, the statement that reads the
/// binding and would bind the key; after a replay, a plain read first.
/// Each step below goes one known way; every replay writes nothing (no
/// job, no event, no notification, no lock on the binding) and every
/// conflict names the field either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_request_is_decided_alike_by_either_statement() {
    let h = Harness::postgres().await;
    let pool = h.caller_pool().await;
    let mut listener = wakeup_listener(&h).await;
    let locked = async |key: &str| -> i64 {
        sqlx::query_scalar(
            "SELECT count(*) FROM idemq.idempotency
             WHERE key_preview = $1 AND xmax::text <> '0'",
        )
        .bind(key)
        .fetch_one(&pool)
        .await
        .expect("binding")
    };
    let conflict = |e: Error| match e {
        Error::EnqueueIdempotencyConflict(c) => c.fields,
        other => panic!("a conflict, not {other:?}"),
    };

    // A new key (a fresh store has seen no replay): the one statement.
    let first = h.queue.enqueue(keyed("k-a", json!(1))).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("notified")
        .unwrap();
    let before = h.totals().await;
    // Its repeat: the same statement finds the binding and answers it.
    let again = h.queue.enqueue_with_result(keyed("k-a", json!(1))).await;
    assert_eq!(again.unwrap(), replayed(&first));
    // Now repeats come in: the plain read answers this one.
    let third = h.queue.enqueue_with_result(keyed("k-a", json!(1))).await;
    assert_eq!(third.unwrap(), replayed(&first));
    // A conflict after a replay: the read finds another fingerprint.
    let other = h.queue.enqueue(keyed("k-a", json!(2))).await.unwrap_err();
    assert_eq!(conflict(other), ["payload"]);
    assert_eq!(
        h.totals().await,
        before,
        "replays and conflicts write nothing"
    );
    assert_eq!(locked("k-a").await, 0, "nothing locked the binding");

    // A new key after a replay: the read finds it free, the statement binds it.
    let second = h.queue.enqueue(keyed("k-b", json!(1))).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("notified")
        .unwrap();
    assert_ne!(second, first);
    let before = h.totals().await;
    // A conflict after a new key: the statement finds another fingerprint.
    let other = h.queue.enqueue(keyed("k-b", json!(2))).await.unwrap_err();
    assert_eq!(conflict(other), ["payload"]);
    // And a replay after it, by the statement again.
    let again = h.queue.enqueue_with_result(keyed("k-b", json!(1))).await;
    assert_eq!(again.unwrap(), replayed(&second));
    assert_eq!(
        h.totals().await,
        before,
        "replays and conflicts write nothing"
    );
    assert_eq!(locked("k-b").await, 0, "nothing locked the binding");
    let quiet = tokio::time::timeout(Duration::from_millis(500), listener.recv()).await;
    assert!(quiet.is_err(), "a replay or a conflict notifies no one");
}

fn replayed(job_id: &str) -> idemq::EnqueueResult {
    idemq::EnqueueResult {
        job_id: job_id.to_owned(),
        outcome: Outcome::Replayed,
    }
}

/// The notifications `listener` receives within `wait`, by payload.
async fn notified(
    listener: &mut sqlx::postgres::PgListener,
    wait: Duration,
) -> std::collections::BTreeMap<String, usize> {
    let mut seen = std::collections::BTreeMap::new();
    while let Ok(n) = tokio::time::timeout(wait, listener.recv()).await {
        *seen.entry(n.unwrap().payload().to_owned()).or_insert(0) += 1;
    }
    seen
}

/// A landed replace keeps the job's queue (SPEC 5), so it wakes that queue,
/// not the one the replacing request named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landed_replace_wakes_the_jobs_own_queue() {
    let h = Harness::postgres().await;
    let mut listener = wakeup_listener(&h).await;
    let quiet = Duration::from_millis(500);
    let req = |queue: &str| {
        EnqueueRequest::new("t")
            .queue(queue)
            .delay(Duration::from_secs(60))
            .dedupe(idemq::DedupeOptions::key("d-1").replace())
    };
    let first = h.queue.enqueue_with_result(req("first")).await.unwrap();
    assert_eq!(
        notified(&mut listener, quiet).await,
        [("first".to_owned(), 1)].into()
    );
    let again = h.queue.enqueue_with_result(req("second")).await.unwrap();
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (first.job_id.as_str(), Outcome::Replaced)
    );
    assert_eq!(h.job(&first.job_id).await.queue, "first");
    assert_eq!(
        notified(&mut listener, quiet).await,
        [("first".to_owned(), 1)].into()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyless_enqueues_wake_their_queues_and_a_rollback_wakes_none() {
    let h = Harness::postgres().await;
    let mut listener = wakeup_listener(&h).await;
    let quiet = Duration::from_millis(500);

    // One request, then a batch over three queues: each queue that accepted
    // a job is woken.
    h.queue
        .enqueue(EnqueueRequest::new("t").queue("mail"))
        .await
        .unwrap();
    assert_eq!(
        notified(&mut listener, quiet).await,
        [("mail".to_owned(), 1)].into()
    );
    let batch = ["a", "b", "a", "c"]
        .map(|q| EnqueueRequest::new("t").queue(q))
        .to_vec();
    for r in h
        .queue
        .enqueue_many(batch, idemq::BatchOptions::default())
        .await
        .unwrap()
    {
        r.unwrap();
    }
    let seen = notified(&mut listener, quiet).await;
    assert_eq!(
        seen.keys().map(String::as_str).collect::<Vec<_>>(),
        ["a", "b", "c"],
        "{seen:?}"
    );

    // A refused request (its deadline passed) creates no job and wakes no one.
    let past = h.now().await - chrono::Duration::seconds(1);
    let refused = h
        .queue
        .enqueue(EnqueueRequest::new("t").queue("late").deadline(past))
        .await;
    assert!(
        matches!(refused, Err(Error::Validation { .. })),
        "{refused:?}"
    );
    assert!(notified(&mut listener, quiet).await.is_empty());

    // Concurrent single enqueues (which share statements) wake their queue.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let queue = h.queue.clone();
        tasks.spawn(async move {
            queue
                .enqueue(EnqueueRequest::new("t").queue("burst"))
                .await
                .unwrap()
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let seen = notified(&mut listener, quiet).await;
    assert!(
        seen.get("burst").is_some_and(|n| *n >= 1) && seen.len() == 1,
        "{seen:?}"
    );

    // In the caller's transaction the wake-up goes with its commit: none
    // for a rollback, one for a commit.
    let pool = h.caller_pool().await;
    let mut tx = pool.begin().await.unwrap();
    h.queue
        .enqueue_in(&mut tx, EnqueueRequest::new("t").queue("in-tx"))
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert!(notified(&mut listener, quiet).await.is_empty());
    let mut tx = pool.begin().await.unwrap();
    h.queue
        .enqueue_in(&mut tx, EnqueueRequest::new("t").queue("in-tx"))
        .await
        .unwrap();
    assert!(
        notified(&mut listener, quiet).await.is_empty(),
        "woken before the commit"
    );
    tx.commit().await.unwrap();
    assert_eq!(
        notified(&mut listener, quiet).await,
        [("in-tx".to_owned(), 1)].into()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_safe_to_run_concurrently() {
    let db = format!("idemq_m_{}", uuid::Uuid::new_v4().simple());
    let admin = idemq_testkit::pg_admin_url();
    let mut conn = sqlx::PgConnection::connect(&admin).await.unwrap();
    exec(&mut conn, format!("CREATE DATABASE {db}")).await;
    let url = idemq_testkit::pg_url(&db);
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            tokio::spawn(async move { Queue::migrate(&url).await })
        })
        .collect();
    let mut applied = Vec::new();
    for r in runs {
        applied.extend(r.await.unwrap().expect("migrate"));
    }
    applied.sort();
    let all: Vec<i64> = idemq::store::postgres::MIGRATIONS
        .iter()
        .map(|m| m.0)
        .collect();
    assert_eq!(applied, all, "each migration applied exactly once");
    let q = Queue::connect(&url).await.expect("the schema is current");
    assert_eq!(
        q.enqueue_with_result(EnqueueRequest::new("t"))
            .await
            .unwrap()
            .outcome,
        Outcome::Accepted
    );
    drop(q);
    exec(&mut conn, format!("DROP DATABASE {db} WITH (FORCE)")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unmigrated_database_is_refused_with_what_to_do() {
    let db = format!("idemq_m_{}", uuid::Uuid::new_v4().simple());
    let mut conn = sqlx::PgConnection::connect(&idemq_testkit::pg_admin_url())
        .await
        .unwrap();
    exec(&mut conn, format!("CREATE DATABASE {db}")).await;
    let err = Queue::connect(&idemq_testkit::pg_url(&db))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("idemq migrate"), "{err}");
    exec(&mut conn, format!("DROP DATABASE {db} WITH (FORCE)")).await;
}

/// Each schema version records the idemq that applied it, and a binary
/// meeting a newer schema refuses it, naming the idemq to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_newer_schema_is_refused_naming_the_idemq_that_wrote_it() {
    let h = Harness::postgres().await;
    let url = h.db_url.clone().expect("postgres");
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let unrecorded: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idemq.schema_migrations
         WHERE idemq_version IS DISTINCT FROM $1",
    )
    .bind(env!("CARGO_PKG_VERSION"))
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        unrecorded, 0,
        "every version names the idemq that applied it"
    );
    exec(
        &mut conn,
        "INSERT INTO idemq.schema_migrations (version, name, idemq_version)
         VALUES (9999, 'from_the_future', '9.9.9')"
            .into(),
    )
    .await;
    for err in [
        Queue::connect(&url).await.unwrap_err(),
        idemq::store::postgres::migrate_url(&url).await.unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(text.contains("version 9999"), "{text}");
        assert!(text.contains("run idemq 9.9.9"), "{text}");
    }
    // A newer schema whose writer recorded no version: still what to run.
    exec(
        &mut conn,
        "UPDATE idemq.schema_migrations SET idemq_version = NULL WHERE version = 9999".into(),
    )
    .await;
    let text = Queue::connect(&url).await.unwrap_err().to_string();
    assert!(text.contains("schema is version 9999 or later"), "{text}");
}

/// The functions record their revision and the idemq that installed them;
/// a binary whose functions are older refuses to replace newer ones (an
/// older `idemq serve` or `migrate` in a rolling upgrade) and to run on
/// them, naming the idemq to run, and leaves them as they are. Functions
/// recorded before revisions existed are replaced as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_functions_are_neither_replaced_nor_run_on() {
    let h = Harness::postgres().await;
    let url = h.db_url.clone().expect("postgres");
    let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
    let recorded = || async {
        let mut conn = sqlx::PgConnection::connect(&url).await.unwrap();
        sqlx::query_as::<_, (String, Option<i64>, Option<String>)>(
            "SELECT digest, revision, idemq_version FROM idemq.schema_functions",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap()
    };
    let (digest, revision, version) = recorded().await;
    assert_eq!(
        (revision, version.as_deref()),
        (
            Some(idemq::store::postgres::FUNCTIONS_REVISION),
            Some(env!("CARGO_PKG_VERSION"))
        )
    );
    // Functions a newer idemq installed: another body, a higher revision.
    exec(
        &mut conn,
        format!(
            "UPDATE idemq.schema_functions SET digest = 'newer', revision = {},
                 idemq_version = '9.9.9'",
            idemq::store::postgres::FUNCTIONS_REVISION + 1
        ),
    )
    .await;
    for err in [
        idemq::store::postgres::migrate_url(&url).await.unwrap_err(),
        Queue::connect(&url).await.unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(text.contains("revision of the idemq functions"), "{text}");
        assert!(text.contains("run idemq 9.9.9"), "{text}");
    }
    // Installing functions records their digest in the same transaction.
    assert_eq!(
        recorded().await.0,
        "newer",
        "the functions were left as they were"
    );
    // Recorded before revisions: the functions are this binary's again.
    exec(
        &mut conn,
        "UPDATE idemq.schema_functions SET revision = NULL, idemq_version = NULL".into(),
    )
    .await;
    idemq::store::postgres::migrate_url(&url)
        .await
        .expect("migrate");
    assert_eq!(recorded().await.0, digest);
    Queue::connect(&url).await.expect("connect after migrate");
}

/// The migrated schema, as pg_dump prints it, is committed in
/// `crates/idemq/schema/postgres.sql` so every change to it is reviewed.
/// `IDEMQ_UPDATE_SCHEMA=1` rewrites the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_schema_dump_matches_the_migrations() {
    let h = Harness::postgres().await;
    let out = std::process::Command::new("pg_dump")
        .args([
            "--schema-only",
            "--no-owner",
            "--no-privileges",
            "--schema=idemq",
        ])
        .arg(h.db_url.as_deref().unwrap())
        .output()
        .expect("pg_dump is installed (Debian: postgresql-client)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dump = normalize(&String::from_utf8_lossy(&out.stdout));
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("schema/postgres.sql");
    if std::env::var_os("IDEMQ_UPDATE_SCHEMA").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &dump).unwrap();
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == dump,
        "the schema drifted from crates/idemq/schema/postgres.sql: review the change and run \
         IDEMQ_UPDATE_SCHEMA=1 cargo test -p idemq --test postgres committed_schema"
    );
}

/// Drops what varies between runs and versions of pg_dump: comments, SET
/// lines, the restrict keys and blank-line runs.
fn normalize(dump: &str) -> String {
    let mut out =
        String::from("-- The idemq schema on PostgreSQL, as migrated: generated, do not edit.\n");
    let mut blank = false;
    for line in dump.lines() {
        let skip = line.starts_with("--")
            || line.starts_with("SET ")
            || line.starts_with("SELECT pg_catalog.set_config")
            || line.starts_with("\\restrict")
            || line.starts_with("\\unrestrict");
        if skip {
            continue;
        }
        if line.trim().is_empty() {
            if !blank {
                out.push('\n');
            }
            blank = true;
            continue;
        }
        blank = false;
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The test clock is per session: the case's own pools read it, any other
/// session of the same database (another process, an operator's psql) reads
/// the real clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_clock_is_seen_only_by_the_sessions_that_name_it() {
    let h = Harness::postgres().await;
    assert_eq!(h.now().await, idemq_testkit::epoch());
    let mine = h.caller_pool().await;
    let at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT idemq.now()")
        .fetch_one(&mine)
        .await
        .unwrap();
    assert_eq!(at, idemq_testkit::epoch());
    let url = h.db_url.clone().expect("postgres");
    let mut other = sqlx::PgConnection::connect(&url).await.unwrap();
    let real: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT idemq.now()")
        .fetch_one(&mut other)
        .await
        .unwrap();
    let drift = (real - chrono::Utc::now()).num_seconds().abs();
    assert!(drift < 60, "another session reads the real clock: {real}");
    // A session naming a clock that does not exist reads the real clock too.
    exec(&mut other, "SET idemq.test_clock = 'nope'".into()).await;
    let real: chrono::DateTime<chrono::Utc> = sqlx::query_scalar("SELECT idemq.now()")
        .fetch_one(&mut other)
        .await
        .unwrap();
    assert!((real - chrono::Utc::now()).num_seconds().abs() < 60);
}

/// `call_timeout_ms` bounds a call that gets no answer (here: one blocked on
/// a lock, as a call on a dead connection would wait for the kernel): it
/// fails with the retryable `Unavailable`. Like a lost connection it may
/// still commit; the retry with the same key makes it one job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_call_timeout_ms_is_unavailable() {
    let (url, db) = idemq_testkit::pg_database();
    let queue = Queue::connect(&format!("{url}?call_timeout_ms=300"))
        .await
        .expect("connect");
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("holder");
    exec(
        &mut holder,
        "BEGIN; LOCK TABLE idemq.jobs IN ACCESS EXCLUSIVE MODE".into(),
    )
    .await;
    let req = || EnqueueRequest::new("timeout.probe").idempotency_key("t-1");
    let started = std::time::Instant::now();
    let err = queue
        .enqueue(req())
        .await
        .expect_err("the enqueue waits on the lock");
    let waited = started.elapsed();
    exec(&mut holder, "ROLLBACK".into()).await;
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(err.to_string().contains("call_timeout_ms"), "{err}");
    assert!(waited < Duration::from_secs(5), "waited {waited:?}");
    // The pool recovers, and the retry with the same key is one job.
    let id = queue.enqueue(req()).await.expect("retry after the lock");
    let filter = idemq::JobList {
        limit: 10,
        ..Default::default()
    };
    let page = queue.list(filter).await.expect("list");
    assert_eq!(page.jobs.len(), 1);
    assert_eq!(page.jobs[0].id, id);
    drop(queue);
    idemq_testkit::drop_pg_database(&db);
}

/// Bad idemq connect parameters are refused before connecting.
#[tokio::test]
async fn bad_connect_parameters_are_refused() {
    for bad in [
        "pgbouncer=maybe",
        "call_timeout_ms=0",
        "call_timeout_ms=x",
        "enqueue_statements=0",
        "read_statements=0",
        "read_statements=many",
    ] {
        let url = format!("postgres://postgres@127.0.0.1:1/none?{bad}");
        let err = Queue::connect(&url).await.expect_err(bad);
        assert!(matches!(err, Error::Validation { .. }), "{bad}: {err:?}");
    }
}

/// Past its page bound `idemq.queue_counts` estimates the terminal states
/// (exact for the jobs after the boundary, sampled before it) and says so
/// with a row without a queue; the live states stay exact. With every page
/// sampled the estimate is the count itself, so this checks the arithmetic
/// of both parts exactly. `Queue::queues` on a small table is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminal_counts_of_a_large_table_are_estimated_and_say_so() {
    let h = Harness::postgres().await;
    for i in 0..12 {
        h.put(
            EnqueueRequest::new("count.me")
                .queue("a")
                .payload(json!({ "i": i })),
        )
        .await;
    }
    for j in h.claim(7).await {
        h.queue.complete(&j.id, &j.lease_token, None).await.unwrap();
    }
    h.claim(2).await;
    let pool = h.caller_pool().await;
    let counts = |exact_pages: i64| {
        let pool = pool.clone();
        async move {
            let rows: Vec<(Option<String>, Option<String>, i64, bool)> = sqlx::query_as(
                "SELECT queue, state, n, estimated FROM idemq.queue_counts($1, 1000000)
                 ORDER BY 1, 2",
            )
            .bind(exact_pages)
            .fetch_all(&pool)
            .await
            .unwrap();
            rows
        }
    };
    let a = |s: &str, n: i64, e: bool| (Some("a".to_string()), Some(s.to_string()), n, e);
    assert_eq!(
        counts(0).await,
        vec![
            a("active", 2, false),
            a("completed", 7, true),
            a("ready", 3, false),
            (None, None, 0, true),
        ]
    );
    assert_eq!(
        counts(1 << 20).await,
        vec![
            a("active", 2, false),
            a("completed", 7, false),
            a("ready", 3, false)
        ]
    );
    let queues = h.queue.queues().await.unwrap();
    assert_eq!(queues.len(), 1);
    assert!(queues[0].estimated.is_empty());
    assert_eq!(queues[0].counts.completed, 7);
}

/// The sweeps delete what they find in batches, with everything that
/// belongs to each job, and leave what is still live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweeps_delete_whole_batches_and_leave_the_live() {
    let h = Harness::postgres().await;
    let mut done = Vec::new();
    for i in 0..6 {
        let id = h
            .put(
                EnqueueRequest::new("sweep.me")
                    .payload(json!({ "i": i }))
                    .keep(Duration::from_millis(1000))
                    .idempotency(
                        idemq::IdempotencyOptions::new(format!("sweep-{i}"))
                            .ttl(Duration::from_millis(2000)),
                    ),
            )
            .await;
        done.push(id);
    }
    let kept = h
        .put(EnqueueRequest::new("sweep.me").payload(json!({"kept": true})))
        .await;
    for j in h.claim(6).await {
        assert_ne!(j.id, kept);
        h.queue.complete(&j.id, &j.lease_token, None).await.unwrap();
    }
    // Retention passed, bindings still live: nothing goes.
    h.advance_ms(1500);
    assert_eq!(h.queue.sweep_retention(1000).await.unwrap(), 0);
    h.advance_ms(1000);
    // Batches of 4: every job and binding goes, none twice.
    assert_eq!(h.queue.sweep_bindings(4).await.unwrap(), 4);
    assert_eq!(h.queue.sweep_bindings(4).await.unwrap(), 2);
    assert_eq!(h.queue.sweep_bindings(4).await.unwrap(), 0);
    assert_eq!(h.queue.sweep_retention(4).await.unwrap(), 4);
    assert_eq!(h.queue.sweep_retention(4).await.unwrap(), 2);
    assert_eq!(h.queue.sweep_retention(4).await.unwrap(), 0);
    for id in &done {
        assert!(h.queue.get(id).await.unwrap().is_none(), "{id} swept");
    }
    assert!(h.queue.get(&kept).await.unwrap().is_some());
}

/// Kept connections never starve the store's own calls: with more calls
/// at once than the pool has connections (a worker's heartbeats, say), a
/// finished call gives its connection back to the pool for a waiting one
/// instead of keeping it until the sweep (docs/storage.md). Forty reads at
/// once on a pool of two, three times over, each waiting at most a second
/// for a connection: kept until the sweep (250 ms), they would need about
/// five seconds a round and time out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_connections_go_to_calls_waiting_in_the_pool() {
    use idemq::store::postgres::{PgOptions, PgStore};
    let (url, db) = idemq_testkit::pg_database();
    let options = PgOptions {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(1),
        ..PgOptions::default()
    };
    let store = PgStore::connect(&url, options).await.expect("connect");
    let pool = store.pool().clone();
    let queue = Queue::from_store(std::sync::Arc::new(store), Default::default());
    let id = queue.enqueue(EnqueueRequest::new("kept")).await.unwrap();
    for round in 0..3 {
        let started = std::time::Instant::now();
        let mut calls = tokio::task::JoinSet::new();
        for _ in 0..40 {
            let (queue, id) = (queue.clone(), id.clone());
            calls.spawn(async move { queue.get(&id).await });
        }
        let mut found = 0;
        while let Some(done) = calls.join_next().await {
            let job = done.unwrap().expect("a read that waited for a connection");
            found += usize::from(job.is_some());
        }
        assert_eq!(found, 40);
        assert!(pool.size() <= 2);
        println!(
            "round {round}: 40 reads on 2 connections in {:?}",
            started.elapsed()
        );
    }
    drop(queue);
    pool.close().await;
    idemq_testkit::drop_pg_database(&db);
}

/// The store keeps the connection of a call that ended cleanly for its next
/// call (docs/storage.md), without giving it back to the pool (which would
/// check it with a round trip), and gives it back once the store has been
/// quiet for a moment: a store whose pool has room uses the connection it
/// keeps, and leaves every connection to the pool's other users once it is
/// quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_serves_the_next_call_and_goes_back_when_quiet() {
    use idemq::store::postgres::{PgOptions, PgStore};
    let (url, db) = idemq_testkit::pg_database();
    let max = 3;
    let options = PgOptions {
        max_connections: max,
        acquire_timeout: Duration::from_secs(3),
        ..PgOptions::default()
    };
    let store = PgStore::connect(&url, options).await.expect("connect");
    let pool = store.pool().clone();
    let queue = Queue::from_store(std::sync::Arc::new(store), Default::default());
    let first = queue.enqueue(EnqueueRequest::new("kept")).await.unwrap();
    // Kept: one of the pool's open connections is out of it, not idle there.
    let open = pool.size();
    assert_eq!(pool.num_idle(), open as usize - 1);
    // The next calls take it from the store: the pool opens no other, and
    // it is still out.
    let second = queue.enqueue(EnqueueRequest::new("kept")).await.unwrap();
    assert!(queue.get(&first).await.unwrap().is_some());
    assert!(queue.get(&second).await.unwrap().is_some());
    assert_eq!((pool.size(), pool.num_idle()), (open, open as usize - 1));
    // Quiet: back in the pool within two sweeps (250 ms each).
    let quiet = std::time::Instant::now();
    while pool.num_idle() < open as usize {
        assert!(
            quiet.elapsed() < Duration::from_secs(2),
            "the kept connection never went back to the pool"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "kept connection back in the pool after {:?}",
        quiet.elapsed()
    );
    // Other users of the pool get every connection, and the store waits.
    let mut others = Vec::new();
    for _ in 0..max {
        others.push(pool.acquire().await.expect("a connection of the pool"));
    }
    let waiting = tokio::spawn({
        let queue = queue.clone();
        async move { queue.enqueue(EnqueueRequest::new("kept")).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!waiting.is_finished(), "the store waits for the pool");
    let mut other = others.pop().expect("one");
    sqlx::query("SELECT 1").execute(&mut *other).await.unwrap();
    drop(other);
    waiting
        .await
        .unwrap()
        .expect("the enqueue once the pool has it back");
    drop(others);
    assert_eq!(
        queue
            .list(idemq::JobList {
                limit: 10,
                ..Default::default()
            })
            .await
            .unwrap()
            .jobs
            .len(),
        3
    );
    drop(queue);
    pool.close().await;
    idemq_testkit::drop_pg_database(&db);
}

/// A batch of heartbeats renews every lease it can at once: a job whose row
/// another transaction holds (a handler completing it in its own
/// transaction) is renewed on its own, after that transaction, and does not
/// hold up the renewal of the others, which commit while it waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_row_does_not_hold_up_the_other_heartbeats_of_a_batch() {
    let h = Harness::postgres().await;
    let held = h.put(EnqueueRequest::new("t")).await;
    let free = h.put(EnqueueRequest::new("t")).await;
    let claimed = h.claim(2).await;
    assert_eq!(claimed.len(), 2);
    let token = |id: &str| {
        claimed
            .iter()
            .find(|c| c.id == id)
            .map(|c| c.lease_token.clone())
            .unwrap()
    };
    let (t_held, t_free) = (token(&held), token(&free));
    let before = h.job(&free).await.lease_expires_at.unwrap();
    let pool = h.caller_pool().await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM idemq.jobs WHERE id = $1 FOR UPDATE")
        .bind(&held)
        .execute(&mut *tx)
        .await
        .unwrap();
    h.advance_ms(1000);
    let queue = h.queue.clone();
    let (hid, fid) = (held.clone(), free.clone());
    let batch = tokio::spawn(async move {
        queue
            .heartbeat_many([(hid.as_str(), &t_held), (fid.as_str(), &t_free)])
            .await
    });
    // The free job's lease is renewed and committed while the held one waits.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if h.job(&free).await.lease_expires_at.unwrap() > before {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the free job's lease was not renewed while the other row was held"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !batch.is_finished(),
        "the held job's renewal waits for the holder"
    );
    tx.rollback().await.unwrap();
    let results = batch.await.unwrap().unwrap();
    assert_eq!(results.len(), 2);
    let (a, b) = (results[0].as_ref().unwrap(), results[1].as_ref().unwrap());
    assert_eq!(a.lease_expires_at, b.lease_expires_at);
    assert_eq!(
        h.job(&held).await.lease_expires_at,
        Some(a.lease_expires_at)
    );
}

/// The two stored forms of a job's fingerprint and the NULL default retry
/// policy (schema version 10): the database's half of each agrees with the
/// library's, field by field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slim_row_forms_agree_with_the_library() {
    use idemq::fingerprint::{FIELDS, KeyHasher};
    let h = Harness::postgres().await;
    let pool = h.caller_pool().await;

    // The digests of `null` the database holds are those of the published
    // rule: SHA-256 of "idemq.fp.v1", NUL, the field's name, NUL, "null".
    let wrong: Vec<String> = sqlx::query_scalar(
        "SELECT c.name FROM idemq.fp_common() c
         WHERE c.null_digest <> encode(substring(sha256(
                   convert_to('idemq.fp.v1', 'UTF8') || '\\x00'::bytea
                   || convert_to(c.name, 'UTF8') || '\\x00'::bytea
                   || convert_to('null', 'UTF8')) FROM 1 FOR 16), 'hex')
            OR c.name <> ($1::text[])[c.at + 1]",
    )
    .bind(FIELDS.to_vec())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(
        wrong.is_empty(),
        "fields whose null digest differs: {wrong:?}"
    );

    let hasher = KeyHasher::plain();
    let at = chrono::DateTime::from_timestamp(4_000_000_000, 0).unwrap();
    let requests = [
        // Every field null or at its usual value but the type and payload.
        EnqueueRequest::new("t").payload(json!({"a": 1})),
        EnqueueRequest::new("t"),
        EnqueueRequest::new("t").payload(json!(null)),
        // Every field set to something else.
        EnqueueRequest::new("t")
            .queue("q")
            .payload(json!([1]))
            .job_id("j")
            .idempotency_key("k")
            .max_attempts(2)
            .timeout(Duration::from_secs(1))
            .tag("x")
            .concurrency_key("c")
            .delay(Duration::from_secs(1))
            .deadline(at)
            .retry(idemq::RetryPolicy::None),
        EnqueueRequest::new("t").run_at(at).max_attempts(10),
    ];
    for req in &requests {
        let fp = req.prepare(&hasher, 1 << 20).unwrap().fingerprint;
        let json: serde_json::Value = serde_json::from_str(&fp.to_json()).unwrap();
        // The database packs a request's fingerprint into the library's bytes.
        let packed: Vec<u8> = sqlx::query_scalar("SELECT idemq.fp_pack($1::jsonb)")
            .bind(&json)
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(packed, fp.compact(), "{json}");
        // Both forms unpack to every field, a missing one as zeros.
        let mut full = json.clone();
        for name in FIELDS {
            full.as_object_mut()
                .unwrap()
                .entry(name)
                .or_insert(json!("00000000000000000000000000000000"));
        }
        for form in [fp.compact(), fp.packed()] {
            let unpacked: serde_json::Value = sqlx::query_scalar("SELECT idemq.fp_unpack($1)")
                .bind(&form)
                .fetch_one(&pool)
                .await
                .unwrap();
            assert_eq!(unpacked, full, "{} bytes", form.len());
        }
    }

    // The NULL policy is the library's default, and a job row stores it so.
    let default: serde_json::Value = sqlx::query_scalar("SELECT idemq.default_retry()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        serde_json::from_value::<idemq::RetryPolicy>(default).unwrap(),
        idemq::RetryPolicy::default()
    );
    let fixed = idemq::RetryPolicy::Fixed { delay_ms: 5 };
    let plain = h.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
    let custom = h
        .queue
        .enqueue(EnqueueRequest::new("t").retry(fixed.clone()))
        .await
        .unwrap();
    let batch = h
        .queue
        .enqueue_many(
            vec![
                EnqueueRequest::new("t"),
                EnqueueRequest::new("t").retry(fixed.clone()),
            ],
            idemq::BatchOptions::default(),
        )
        .await
        .unwrap();
    let keyed = h
        .queue
        .enqueue(EnqueueRequest::new("t").idempotency_key("slim"))
        .await
        .unwrap();
    let ids = [
        plain.as_str(),
        custom.as_str(),
        batch[0].as_ref().unwrap().job_id.as_str(),
        batch[1].as_ref().unwrap().job_id.as_str(),
        keyed.as_str(),
    ];
    for (id, default) in ids.iter().zip([true, false, true, false, true]) {
        let (null, len): (bool, i32) = sqlx::query_as(
            "SELECT retry IS NULL, length(fingerprint) FROM idemq.jobs WHERE id = $1",
        )
        .bind(id)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(null, default, "job {id}: retry stored as NULL");
        assert_eq!(len % 16, 5, "job {id}: compact fingerprint");
        let job = h.queue.get(id).await.unwrap().unwrap();
        let expected = if default {
            idemq::RetryPolicy::default()
        } else {
            fixed.clone()
        };
        assert_eq!(job.retry, expected, "job {id}");
    }
}

/// Every column that holds a job's id compares byte by byte (schema
/// version 11): an index serves a comparison only under its own collation,
/// so a job-id column of another collation would lose its index in the
/// joins with the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_job_id_column_compares_bytewise() {
    let h = Harness::postgres().await;
    let pool = h.caller_pool().await;
    let columns: Vec<(String, String, String)> = sqlx::query_as(
        "SELECT c.relname::text, a.attname::text, coalesce(co.collname::text, '')
         FROM pg_attribute a
         JOIN pg_class c ON c.oid = a.attrelid AND c.relkind = 'r'
         JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'idemq'
         LEFT JOIN pg_collation co ON co.oid = a.attcollation
         WHERE (a.attname = 'job_id' OR (c.relname = 'jobs' AND a.attname = 'id'))
           AND a.attnum > 0 AND NOT a.attisdropped
         ORDER BY 1",
    )
    .fetch_all(&pool)
    .await
    .unwrap();
    let tables: Vec<&str> = columns.iter().map(|c| c.0.as_str()).collect();
    assert_eq!(
        tables,
        [
            "checkpoints",
            "dedupe",
            "events",
            "idempotency",
            "jobs",
            "runs"
        ]
    );
    for (table, column, collation) in &columns {
        assert_eq!(collation, "C", "idemq.{table}.{column}");
    }
}

/// A store that runs one statement of single enqueues, and one read of
/// replays' keys, at a time (`enqueue_statements=1&read_statements=1`), so
/// concurrent calls share the next one, and a queue over it.
async fn one_statement_out(url: &str) -> (idemq::store::postgres::PgStore, Queue) {
    let store = idemq::store::postgres::PgStore::connect(
        &format!("{url}?enqueue_statements=1&read_statements=1"),
        idemq::store::postgres::PgOptions::default(),
    )
    .await
    .expect("connect");
    let queue = Queue::from_store(std::sync::Arc::new(store.clone()), Default::default());
    (store, queue)
}

/// Single keyless enqueues of concurrent tasks share statements once
/// `enqueue_statements` are out (docs/storage.md): every caller gets its own
/// answer. When the server refuses a shared statement for one request's
/// sake (here a trigger refuses one payload), nothing of it was written and
/// each request is sent again alone: the refused caller gets the error, the
/// others their jobs. The first round shows that calls shared statements;
/// in the others, the trigger draws from a sequence (which a rollback
/// does not undo) when it refuses inside a shared statement, so the case
/// runs rounds until that happened, and checks every round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_single_enqueues_share_a_statement_and_a_refused_one_goes_alone() {
    let (url, db) = idemq_testkit::pg_database();
    let mut admin = sqlx::PgConnection::connect(&url).await.expect("admin");
    exec(
        &mut admin,
        "CREATE SEQUENCE shared_refusals;
         CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.payload ? 'refuse' THEN
                 IF current_query() LIKE '%unnest%' THEN
                     PERFORM nextval('shared_refusals');
                 END IF;
                 RAISE EXCEPTION 'refused by a trigger';
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER refuse BEFORE INSERT ON idemq.jobs
             FOR EACH ROW EXECUTE FUNCTION refuse();"
            .into(),
    )
    .await;
    let (store, queue) = one_statement_out(&url).await;
    let tasks = 32;
    let mut accepted = 0;
    let mut rounds = 0;
    loop {
        rounds += 1;
        let handles: Vec<_> = (0..tasks)
            .map(|i| {
                let q = queue.clone();
                let payload = if i == tasks / 2 && rounds > 1 {
                    json!({"refuse": rounds})
                } else {
                    json!({"round": rounds, "i": i})
                };
                tokio::spawn(async move {
                    q.enqueue_with_result(EnqueueRequest::new("shared").payload(payload))
                        .await
                })
            })
            .collect();
        for (i, handle) in handles.into_iter().enumerate() {
            let r = handle.await.expect("task");
            if i == tasks / 2 && rounds > 1 {
                let err = r.expect_err("the refused payload");
                assert!(matches!(err, Error::Backend { .. }), "{err:?}");
                assert!(err.to_string().contains("refused by a trigger"), "{err}");
            } else {
                let r = r.unwrap_or_else(|e| panic!("round {rounds}, {i}: {e:?}"));
                assert_eq!(r.outcome, Outcome::Accepted);
                let job = queue.get(&r.job_id).await.unwrap().expect("its job");
                assert_eq!(job.payload, json!({"round": rounds, "i": i}));
                accepted += 1;
            }
        }
        if rounds == 1 {
            // The first round refuses nothing: its calls shared statements.
            assert!(store.grouped_enqueues() > 0, "calls shared statements");
            continue;
        }
        let shared: bool = sqlx::query_scalar("SELECT is_called FROM shared_refusals")
            .fetch_one(&mut admin)
            .await
            .expect("sequence");
        if shared {
            break;
        }
        assert!(
            rounds < 50,
            "no refusal inside a shared statement in {rounds} rounds"
        );
    }
    let total: i64 = sqlx::query_scalar("SELECT count(*) FROM idemq.jobs")
        .fetch_one(&mut admin)
        .await
        .expect("count");
    assert_eq!(
        total, accepted,
        "one job per accepted call, none for the refused"
    );
    drop(queue);
    drop(store);
    drop(admin);
    idemq_testkit::drop_pg_database(&db);
}

/// Replays of concurrent callers share their reads once `read_statements`
/// are out (docs/storage.md): each caller gets the answer it would have had
/// alone. In every round, tasks replay bound keys (several on one key),
/// send a bound key with another payload (a conflict naming `payload`),
/// and send new keys (accepted), all after a replay, so every call reads
/// its binding first. The rounds run until reads were shared (the race
/// happened), and every round is checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replays_share_their_reads_and_each_gets_its_own_answer() {
    let (url, db) = idemq_testkit::pg_database();
    let (store, queue) = one_statement_out(&url).await;
    let keyed = |key: String, n: i64| {
        EnqueueRequest::new("replayed")
            .payload(json!({ "n": n }))
            .idempotency_key(key)
    };
    let mut bound = Vec::new();
    for n in 0..8 {
        let r = queue
            .enqueue_with_result(keyed(format!("bound-{n}"), n))
            .await
            .expect("bind");
        assert_eq!(r.outcome, Outcome::Accepted);
        bound.push(r.job_id);
    }
    let tasks = 48;
    let mut accepted = bound.len();
    let mut rounds = 0;
    while store.grouped_reads() == 0 {
        rounds += 1;
        assert!(rounds <= 50, "no read shared in {rounds} rounds");
        // The last answer a replay: the calls below read first.
        let first = queue
            .enqueue_with_result(keyed("bound-0".into(), 0))
            .await
            .expect("replay");
        assert_eq!(first.outcome, Outcome::Replayed);
        let handles: Vec<_> = (0..tasks)
            .map(|i| {
                let q = queue.clone();
                let n = (i % 8) as i64;
                let request = match i % 3 {
                    0 => keyed(format!("bound-{n}"), n),
                    1 => keyed(format!("bound-{n}"), n + 100),
                    _ => keyed(format!("new-{rounds}-{i}"), n),
                };
                tokio::spawn(async move { q.enqueue_with_result(request).await })
            })
            .collect();
        for (i, handle) in handles.into_iter().enumerate() {
            let answer = handle.await.expect("task");
            let n = i % 8;
            match i % 3 {
                0 => {
                    let r = answer.unwrap_or_else(|e| panic!("round {rounds}, {i}: {e:?}"));
                    assert_eq!(r.outcome, Outcome::Replayed, "round {rounds}, {i}");
                    assert_eq!(r.job_id, bound[n], "round {rounds}, {i}");
                }
                1 => {
                    let e = answer.expect_err("another payload on a bound key");
                    let conflict = e.conflict().unwrap_or_else(|| panic!("{e:?}"));
                    assert_eq!(conflict.job_id, bound[n]);
                    assert_eq!(conflict.fields, vec!["payload".to_string()]);
                }
                _ => {
                    let r = answer.unwrap_or_else(|e| panic!("round {rounds}, {i}: {e:?}"));
                    assert_eq!(r.outcome, Outcome::Accepted, "round {rounds}, {i}");
                    let job = queue.get(&r.job_id).await.unwrap().expect("its job");
                    assert_eq!(job.payload, json!({ "n": n }));
                    accepted += 1;
                }
            }
        }
    }
    let mut admin = sqlx::PgConnection::connect(&url).await.expect("admin");
    let (jobs, bindings): (i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM idemq.jobs), (SELECT count(*) FROM idemq.idempotency)",
    )
    .fetch_one(&mut admin)
    .await
    .expect("count");
    assert_eq!(jobs as usize, accepted, "one job per accepted call");
    assert_eq!(bindings as usize, accepted, "one binding per accepted key");
    drop(queue);
    drop(store);
    drop(admin);
    idemq_testkit::drop_pg_database(&db);
}

/// A caller that gives up while its enqueue waits for a statement's place
/// (its future dropped, here by a timeout) writes nothing: its request is
/// left out of the next shared statement. With `enqueue_statements=1` the
/// first call holds the only place, blocked on a table lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_gives_up_waiting_for_a_shared_statement_writes_nothing() {
    let (url, db) = idemq_testkit::pg_database();
    let (store, queue) = one_statement_out(&url).await;
    let mut holder = sqlx::PgConnection::connect(&url).await.expect("holder");
    exec(
        &mut holder,
        "BEGIN; LOCK TABLE idemq.jobs IN ACCESS EXCLUSIVE MODE".into(),
    )
    .await;
    let first = {
        let q = queue.clone();
        tokio::spawn(async move { q.enqueue(EnqueueRequest::new("first")).await })
    };
    // The first call is out, blocked on the lock, before the second comes.
    // Watched from a connection of its own: inside the holder's transaction
    // `pg_stat_activity` is read once and kept until the transaction ends,
    // so a first look taken before the call blocked would never change.
    let mut watch = sqlx::PgConnection::connect(&url).await.expect("watch");
    let mut waited = 0;
    loop {
        let blocked: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'
               AND query LIKE '%INSERT INTO idemq.jobs%'",
        )
        .fetch_one(&mut watch)
        .await
        .expect("activity");
        if blocked > 0 {
            break;
        }
        waited += 1;
        assert!(waited < 200, "the first enqueue never blocked on the lock");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        queue.enqueue(EnqueueRequest::new("gave.up")),
    )
    .await;
    assert!(gave_up.is_err(), "the second call waits for the only place");
    exec(&mut holder, "ROLLBACK".into()).await;
    first
        .await
        .expect("task")
        .expect("the first call is accepted");
    // Later calls are sent as usual; the one that gave up never was.
    queue
        .enqueue(EnqueueRequest::new("after"))
        .await
        .expect("a later call");
    let types: Vec<String> = sqlx::query_scalar("SELECT type FROM idemq.jobs ORDER BY type")
        .fetch_all(&mut holder)
        .await
        .expect("types");
    assert_eq!(types, ["after", "first"]);
    drop(queue);
    drop(store);
    drop(holder);
    drop(watch);
    idemq_testkit::drop_pg_database(&db);
}

/// A shared statement whose fate is unknown (its connection killed while it
/// runs) answers every caller of it `Unavailable`, as each alone would be
/// answered, and a retry goes through. With `enqueue_statements=1` a first
/// call holds the only place while three more wait: a trigger sleeps for a
/// payload that asks it to. Killing the first's connection hands the place
/// to the three, whose shared statement sleeps in turn (one of them asks
/// too) and is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_statement_cut_off_answers_every_caller_unavailable() {
    let (url, db) = idemq_testkit::pg_database();
    let mut admin = sqlx::PgConnection::connect(&url).await.expect("admin");
    exec(
        &mut admin,
        "CREATE FUNCTION slow() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             IF NEW.payload ? 'sleep' THEN
                 PERFORM pg_sleep(60);
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER slow BEFORE INSERT ON idemq.jobs
             FOR EACH ROW EXECUTE FUNCTION slow();"
            .into(),
    )
    .await;
    let (store, queue) = one_statement_out(&url).await;
    // The statement sleeping in the trigger: its pid, and whether it is the
    // shared form.
    async fn sleeping(admin: &mut sqlx::PgConnection, what: &str) -> (i32, bool) {
        for _ in 0..400 {
            let rows: Vec<(i32, bool)> = sqlx::query_as(
                "SELECT pid, query LIKE '%unnest%' FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event = 'PgSleep'",
            )
            .fetch_all(&mut *admin)
            .await
            .expect("activity");
            if let [one] = rows[..] {
                return one;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("{what}: no statement sleeping in the trigger");
    }
    let call = |name: &str, payload: serde_json::Value| {
        let q = queue.clone();
        let req = EnqueueRequest::new(name.to_owned()).payload(payload);
        tokio::spawn(async move { q.enqueue(req).await })
    };
    let kill = |pid: i32| format!("SELECT pg_terminate_backend({pid})");
    let first = call("first", json!({"sleep": 1}));
    let (pid, shared) = sleeping(&mut admin, "the first call").await;
    assert!(!shared, "the first call is a statement of its own");
    let waiting = vec![
        call("b", json!({"sleep": 1})),
        call("c", json!({})),
        call("d", json!({})),
    ];
    tokio::time::sleep(Duration::from_millis(200)).await;
    exec(&mut admin, kill(pid)).await;
    let err = first
        .await
        .expect("task")
        .expect_err("its connection was cut");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    let (pid, shared) = sleeping(&mut admin, "the shared statement").await;
    assert!(shared, "the three waiting calls share one statement");
    exec(&mut admin, kill(pid)).await;
    for task in waiting {
        let err = task
            .await
            .expect("task")
            .expect_err("the shared statement was cut");
        assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    }
    let jobs: i64 = sqlx::query_scalar("SELECT count(*) FROM idemq.jobs")
        .fetch_one(&mut admin)
        .await
        .expect("count");
    assert_eq!(jobs, 0, "nothing of a cut statement committed");
    queue
        .enqueue(EnqueueRequest::new("retry"))
        .await
        .expect("a retry after the cut");
    drop(queue);
    drop(store);
    drop(admin);
    idemq_testkit::drop_pg_database(&db);
}
