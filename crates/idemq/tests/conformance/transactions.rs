//! Conformance cases: enqueue and completion inside the caller's own
//! transaction (docs/storage.md, docs/worker.md) on every backend. The
//! caller's business row and idemq's writes commit or roll back together;
//! a lost lease refuses the completion and the caller rolls back.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemq::rusqlite::{self, TransactionBehavior};
use idemq::sqlx::{self, Executor};
use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{EnqueueRequest, EnqueueResult, Error, JobState, Outcome, Queue, RetryPolicy};
use idemq_testkit::Harness;
use serde_json::{Value, json};

use crate::worker::run_until;

idemq_testkit::instantiate!(
    a_completion_in_a_committed_transaction_lands_with_the_business_row [needs CallerTransactions],
    a_completion_in_a_rolled_back_transaction_leaves_the_job_running [needs CallerTransactions],
    a_lost_lease_refuses_the_completion_and_the_caller_rolls_back [needs CallerTransactions],
    a_sqlite_completion_on_another_database_is_refused [needs CallerTransactions],
    a_postgres_connection_for_a_queue_on_another_backend_is_refused [needs CallerTransactions],
    a_handler_completes_its_job_in_its_own_transaction [needs CallerTransactions],
    a_handler_whose_transaction_rolled_back_fails_its_attempt [needs CallerTransactions],
    a_transactional_enqueue_commits_with_the_business_row [needs CallerTransactions],
    a_transactional_enqueue_rolls_back_with_the_business_row [needs CallerTransactions],
    a_refused_transactional_enqueue_leaves_the_transaction_usable [needs CallerTransactions],
    a_transactional_enqueue_uses_the_queues_clock [needs CallerTransactions],
    a_sqlite_enqueue_with_no_transaction_open_takes_the_write_lock_first [needs CallerTransactions],
);

/// The caller's own database access: a pool on PostgreSQL, a connection
/// to the queue's file on SQLite; one table of business rows.
enum Business {
    Pg(sqlx::PgPool),
    Lite(tokio::sync::Mutex<rusqlite::Connection>),
}

/// Where a completion comes from: the queue's call with a lease, or a
/// handler's context.
#[derive(Clone, Copy)]
enum By<'a> {
    Lease(&'a Queue, &'a str, &'a idemq::LeaseToken),
    Ctx(&'a HandlerContext),
}

impl Business {
    async fn open(h: &Harness) -> Self {
        match h.backend {
            "postgres" => {
                // Its sessions read the case's test clock, like the queue's.
                let pool = h.caller_pool().await;
                pool.execute("CREATE TABLE IF NOT EXISTS orders (id text PRIMARY KEY)")
                    .await
                    .expect("create table");
                Self::Pg(pool)
            }
            _ => {
                let conn = h
                    .queue
                    .sqlite_connection()
                    .expect("a connection to the file");
                conn.execute_batch("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
                    .expect("create table");
                Self::Lite(tokio::sync::Mutex::new(conn))
            }
        }
    }

    /// In one transaction: inserts the order row, completes the job with
    /// `result`, then commits (or rolls back). An error of the completion
    /// ends the transaction without a commit.
    async fn order_and_complete(
        &self,
        by: By<'_>,
        order: &str,
        result: Value,
        commit: bool,
    ) -> idemq::Result<()> {
        match self {
            Self::Pg(pool) => {
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                    .bind(order)
                    .execute(&mut *tx)
                    .await
                    .expect("insert");
                match by {
                    By::Lease(q, id, token) => {
                        q.complete_in(&mut tx, id, token, Some(result)).await?
                    }
                    By::Ctx(ctx) => ctx.complete_in(&mut tx, &result).await?,
                }
                if commit {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
                Ok(())
            }
            Self::Lite(conn) => {
                let mut conn = conn.lock().await;
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .expect("begin");
                tx.execute("INSERT INTO orders (id) VALUES (?1)", [order])
                    .expect("insert");
                match by {
                    By::Lease(q, id, token) => {
                        q.complete_in_sqlite(&tx, id, token, Some(result))?
                    }
                    By::Ctx(ctx) => ctx.complete_in_sqlite(&tx, &result)?,
                }
                if commit {
                    tx.commit().expect("commit");
                } else {
                    tx.rollback().expect("rollback");
                }
                Ok(())
            }
        }
    }

    /// In one transaction: enqueues every request, inserts the order row
    /// (when given), runs `check` with the answers, then commits (or rolls
    /// back).
    async fn enqueue_and_order(
        &self,
        queue: &Queue,
        reqs: Vec<EnqueueRequest>,
        order: Option<&str>,
        commit: bool,
        check: impl AsyncFnOnce(&[idemq::Result<EnqueueResult>]),
    ) -> Vec<idemq::Result<EnqueueResult>> {
        let mut results = Vec::new();
        match self {
            Self::Pg(pool) => {
                let mut tx = pool.begin().await.expect("begin");
                for req in reqs {
                    results.push(queue.enqueue_in(&mut tx, req).await);
                }
                if let Some(order) = order {
                    sqlx::query("INSERT INTO orders (id) VALUES ($1)")
                        .bind(order)
                        .execute(&mut *tx)
                        .await
                        .expect("the transaction is still usable");
                }
                check(&results).await;
                if commit {
                    tx.commit().await.expect("commit");
                } else {
                    tx.rollback().await.expect("rollback");
                }
            }
            Self::Lite(conn) => {
                let mut conn = conn.lock().await;
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .expect("begin");
                for req in reqs {
                    results.push(queue.enqueue_in_sqlite(&tx, req));
                }
                if let Some(order) = order {
                    tx.execute("INSERT INTO orders (id) VALUES (?1)", [order])
                        .expect("the transaction is still usable");
                }
                check(&results).await;
                if commit {
                    tx.commit().expect("commit");
                } else {
                    tx.rollback().expect("rollback");
                }
            }
        }
        results
    }

    async fn orders(&self) -> Vec<String> {
        match self {
            Self::Pg(pool) => sqlx::query_scalar("SELECT id FROM orders ORDER BY id")
                .fetch_all(pool)
                .await
                .expect("select"),
            Self::Lite(conn) => {
                let conn = conn.lock().await;
                let mut st = conn
                    .prepare("SELECT id FROM orders ORDER BY id")
                    .expect("prepare");
                st.query_map([], |r| r.get(0))
                    .expect("query")
                    .collect::<Result<_, _>>()
                    .expect("rows")
            }
        }
    }
}

async fn a_completion_in_a_committed_transaction_lands_with_the_business_row(h: Harness) {
    let db = Business::open(&h).await;
    let id = h.put(EnqueueRequest::new("order.place")).await;
    let claimed = h.claim_one().await;
    db.order_and_complete(
        By::Lease(&h.queue, &id, &claimed.lease_token),
        "ord-1",
        json!({"order": "ord-1"}),
        true,
    )
    .await
    .expect("completed in the transaction");
    assert_eq!(db.orders().await, vec!["ord-1".to_string()]);
    let job = h.job(&id).await;
    assert_eq!(job.state, JobState::Completed);
    assert_eq!(job.result, Some(json!({"order": "ord-1"})));
    let runs = h.queue.runs(&id).await.unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].outcome.as_deref(), Some("completed"));
    assert_eq!(
        h.event_kinds(&id)
            .await
            .iter()
            .filter(|k| *k == "completed")
            .count(),
        1
    );
    // Never completed twice: the lease ended with the commit.
    let again = h.queue.complete(&id, &claimed.lease_token, None).await;
    assert!(matches!(again, Err(Error::LeaseLost { .. })), "{again:?}");
    assert_eq!(h.job(&id).await.result, Some(json!({"order": "ord-1"})));
}

async fn a_completion_in_a_rolled_back_transaction_leaves_the_job_running(h: Harness) {
    let db = Business::open(&h).await;
    let id = h.put(EnqueueRequest::new("order.place")).await;
    let claimed = h.claim_one().await;
    let before = h.event_kinds(&id).await;
    db.order_and_complete(
        By::Lease(&h.queue, &id, &claimed.lease_token),
        "ord-2",
        json!(1),
        false,
    )
    .await
    .expect("completed, then rolled back");
    assert!(db.orders().await.is_empty());
    let job = h.job(&id).await;
    assert_eq!(job.state, JobState::Active);
    assert_eq!(job.result, None);
    assert_eq!(
        h.event_kinds(&id).await,
        before,
        "no event of the rolled back completion"
    );
    // The lease is intact: the attempt can still end, once.
    h.queue
        .heartbeat(&id, &claimed.lease_token)
        .await
        .expect("still ours");
    h.queue
        .complete(&id, &claimed.lease_token, Some(json!(2)))
        .await
        .expect("complete");
    assert_eq!(h.job(&id).await.result, Some(json!(2)));
}

async fn a_lost_lease_refuses_the_completion_and_the_caller_rolls_back(h: Harness) {
    let db = Business::open(&h).await;
    let id = h.put(EnqueueRequest::new("order.place")).await;
    let first = h.claim_one().await;
    // The lease runs out and another attempt claims the job.
    h.advance(Duration::from_secs(31));
    let second = h.claim_one().await;
    assert_eq!((second.id.as_str(), second.attempt), (id.as_str(), 2));
    let err = db
        .order_and_complete(
            By::Lease(&h.queue, &id, &first.lease_token),
            "ord-3",
            json!(1),
            true,
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::LeaseLost { ref job_id } if *job_id == id),
        "{err}"
    );
    assert!(
        db.orders().await.is_empty(),
        "the caller's transaction rolled back"
    );
    let job = h.job(&id).await;
    assert_eq!(
        (job.state, job.attempt, job.result),
        (JobState::Active, 2, None)
    );
    // The current attempt completes in its own transaction.
    db.order_and_complete(
        By::Lease(&h.queue, &id, &second.lease_token),
        "ord-3",
        json!(2),
        true,
    )
    .await
    .expect("the current lease completes");
    assert_eq!(db.orders().await, vec!["ord-3".to_string()]);
    assert_eq!(h.job(&id).await.state, JobState::Completed);
}

async fn a_sqlite_completion_on_another_database_is_refused(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let claimed = h.claim_one().await;
    let dir = tempfile::tempdir().expect("dir");
    let other = rusqlite::Connection::open(dir.path().join("other.db")).expect("open");
    let err = h
        .queue
        .complete_in_sqlite(&other, &id, &claimed.lease_token, None)
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "connection"),
        "{err}"
    );
    assert_eq!(h.job(&id).await.state, JobState::Active);
    if h.backend == "postgres" {
        let err = h.queue.sqlite_connection().unwrap_err();
        assert!(
            matches!(err, Error::Validation { ref field, .. } if field == "connection"),
            "{err}"
        );
    }
}

/// A PostgreSQL connection passed to a queue that is not on PostgreSQL
/// would put the job where the queue never reads it: refused with a
/// `Validation` error on `connection`, the queue's job untouched.
async fn a_postgres_connection_for_a_queue_on_another_backend_is_refused(h: Harness) {
    if h.backend == "postgres" {
        // The connection is of the queue's own database: covered by the
        // cases above.
        return;
    }
    let id = h.put(EnqueueRequest::new("t")).await;
    let claimed = h.claim_one().await;
    let pool = sqlx::PgPool::connect(&idemq_testkit::pg_admin_url())
        .await
        .expect("PostgreSQL for the caller's connection");
    let mut conn = pool.acquire().await.expect("a connection");
    let err = h
        .queue
        .enqueue_in(&mut conn, EnqueueRequest::new("elsewhere"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "connection"),
        "{err}"
    );
    let err = h
        .queue
        .complete_in(&mut conn, &id, &claimed.lease_token, None)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "connection"),
        "{err}"
    );
    assert_eq!(h.job(&id).await.state, JobState::Active);
    assert_eq!(h.queue.stats().completions, 0);
}

fn worker(h: &Harness) -> Worker {
    Worker::new(h.queue.clone())
        .poll_interval(Duration::from_millis(50))
        .maintenance(false)
}

async fn a_handler_completes_its_job_in_its_own_transaction(h: Harness) {
    let db = Arc::new(Business::open(&h).await);
    let mut ids = Vec::new();
    for i in 0..10 {
        ids.push(
            h.put(EnqueueRequest::new("order.place").payload(json!(format!("ord-{i}"))))
                .await,
        );
    }
    let business = db.clone();
    let w = worker(&h).concurrency(4).handle(
        "order.place",
        move |ctx: HandlerContext, order: String| {
            let db = business.clone();
            async move {
                db.order_and_complete(By::Ctx(&ctx), &order, json!({"placed": order}), true)
                    .await?;
                // Not stored: the result is the one completed in the transaction.
                Ok::<_, JobError>(json!("ignored"))
            }
        },
    );
    let report = run_until(w, || async {
        h.jobs()
            .await
            .iter()
            .all(|j| j.state == JobState::Completed)
    })
    .await;
    assert_eq!((report.completed, report.failed, report.lost), (10, 0, 0));
    assert_eq!(db.orders().await.len(), 10);
    for (i, id) in ids.iter().enumerate() {
        let job = h.job(id).await;
        assert_eq!(job.result, Some(json!({"placed": format!("ord-{i}")})));
        assert_eq!((job.attempt, job.attempts_used), (1, 1));
        assert_eq!(h.queue.runs(id).await.unwrap().len(), 1);
        assert_eq!(
            h.event_kinds(id)
                .await
                .iter()
                .filter(|k| *k == "completed")
                .count(),
            1
        );
    }
}

async fn a_handler_whose_transaction_rolled_back_fails_its_attempt(h: Harness) {
    let db = Arc::new(Business::open(&h).await);
    let id = h
        .put(
            EnqueueRequest::new("order.place")
                .payload(json!("ord-9"))
                .retry(RetryPolicy::Fixed { delay_ms: 60_000 }),
        )
        .await;
    let runs = Arc::new(AtomicUsize::new(0));
    let (business, counted) = (db.clone(), runs.clone());
    let w = worker(&h).handle("order.place", move |ctx: HandlerContext, order: String| {
        let (db, runs) = (business.clone(), counted.clone());
        async move {
            // The first attempt's transaction rolls back after completing.
            let commit = runs.fetch_add(1, Ordering::SeqCst) > 0;
            db.order_and_complete(By::Ctx(&ctx), &order, json!(ctx.attempt()), commit)
                .await?;
            Ok::<_, JobError>(())
        }
    });
    let report = run_until(w, || async {
        h.job(&id).await.state == JobState::Scheduled
    })
    .await;
    assert_eq!((report.completed, report.failed, report.lost), (0, 1, 0));
    assert!(db.orders().await.is_empty());
    let job = h.job(&id).await;
    assert_eq!(job.attempts_used, 1);
    let err = job.last_error.unwrap_or_default();
    assert!(err.contains("did not commit"), "{err}");
    // The retry commits.
    h.advance(Duration::from_secs(61));
    let w = worker(&h).handle("order.place", {
        let db = db.clone();
        move |ctx: HandlerContext, order: String| {
            let db = db.clone();
            async move {
                db.order_and_complete(By::Ctx(&ctx), &order, json!(ctx.attempt()), true)
                    .await?;
                Ok::<_, JobError>(())
            }
        }
    });
    let report = run_until(w, || async {
        h.job(&id).await.state == JobState::Completed
    })
    .await;
    assert_eq!((report.completed, report.lost), (1, 0));
    assert_eq!(db.orders().await, vec!["ord-9".to_string()]);
    assert_eq!(h.job(&id).await.result, Some(json!(2)));
}

fn keyed(key: &str, payload: Value) -> EnqueueRequest {
    EnqueueRequest::new("order.confirm")
        .payload(payload)
        .idempotency_key(key)
}

async fn a_transactional_enqueue_commits_with_the_business_row(h: Harness) {
    let db = Business::open(&h).await;
    let results = db
        .enqueue_and_order(
            &h.queue,
            vec![keyed("o-1", json!(1))],
            Some("o-1"),
            true,
            async |r| {
                let r = r[0].as_ref().expect("accepted");
                assert_eq!(r.outcome, Outcome::Accepted);
                // Not visible to others before the commit.
                assert!(h.queue.get(&r.job_id).await.unwrap().is_none());
                assert!(
                    h.queue
                        .lookup_key("default", "o-1")
                        .await
                        .unwrap()
                        .is_none()
                );
            },
        )
        .await;
    let id = results[0].as_ref().unwrap().job_id.clone();
    assert_eq!(db.orders().await, vec!["o-1".to_string()]);
    let job = h.job(&id).await;
    assert_eq!(job.state, JobState::Ready);
    assert_eq!(h.event_kinds(&id).await, vec!["accepted".to_string()]);
    let claimed = h.claim(10).await;
    assert_eq!(claimed.len(), 1, "claimable exactly once after the commit");
    assert_eq!(claimed[0].id, id);
    assert!(h.claim(10).await.is_empty());
    let again = h
        .queue
        .enqueue_with_result(keyed("o-1", json!(1)))
        .await
        .unwrap();
    assert_eq!((again.job_id, again.outcome), (id, Outcome::Replayed));
}

async fn a_transactional_enqueue_rolls_back_with_the_business_row(h: Harness) {
    let db = Business::open(&h).await;
    let results = db
        .enqueue_and_order(
            &h.queue,
            vec![
                keyed("o-2", json!(2)),
                EnqueueRequest::new("t").dedupe(idemq::DedupeOptions::key("d-2")),
            ],
            Some("o-2"),
            false,
            async |_| {},
        )
        .await;
    assert!(
        results
            .iter()
            .all(|r| r.as_ref().is_ok_and(|r| r.outcome == Outcome::Accepted))
    );
    assert!(db.orders().await.is_empty());
    assert_eq!(h.totals().await, (0, 0), "no job, no event");
    assert!(
        h.queue
            .lookup_key("default", "o-2")
            .await
            .unwrap()
            .is_none(),
        "no binding"
    );
    assert!(
        h.queue.dedupe_lookup("t", "d-2").await.unwrap().is_none(),
        "no dedupe binding"
    );
    assert!(h.claim(10).await.is_empty());
    // The keys are free: the same requests are accepted anew.
    let again = h
        .queue
        .enqueue_with_result(keyed("o-2", json!(2)))
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Accepted);
    let again = h
        .queue
        .enqueue_with_result(EnqueueRequest::new("t").dedupe(idemq::DedupeOptions::key("d-2")))
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Accepted);
}

async fn a_refused_transactional_enqueue_leaves_the_transaction_usable(h: Harness) {
    let db = Business::open(&h).await;
    let past = h.now().await - chrono::Duration::seconds(1);
    let results = db
        .enqueue_and_order(
            &h.queue,
            vec![
                keyed("o-3", json!(1)),
                // The same key with another payload: a conflict.
                keyed("o-3", json!(2)),
                // Refused by the store's clock.
                EnqueueRequest::new("t").deadline(past),
                // Refused before the store.
                EnqueueRequest::new("t").queue("no spaces"),
                // A replay of the first, inside the same transaction.
                keyed("o-3", json!(1)),
            ],
            Some("o-3"),
            true,
            async |_| {},
        )
        .await;
    let first = results[0].as_ref().expect("accepted").job_id.clone();
    let conflict = results[1]
        .as_ref()
        .unwrap_err()
        .conflict()
        .expect("a conflict");
    assert_eq!(
        (conflict.job_id.as_str(), conflict.fields.clone()),
        (first.as_str(), vec!["payload".to_string()])
    );
    assert!(
        matches!(results[2], Err(Error::Validation { ref field, .. }) if field == "deadline"),
        "{:?}",
        results[2]
    );
    assert!(
        matches!(results[3], Err(Error::Validation { ref field, .. }) if field == "queue"),
        "{:?}",
        results[3]
    );
    let replay = results[4].as_ref().expect("replayed");
    assert_eq!(
        (replay.job_id.as_str(), replay.outcome),
        (first.as_str(), Outcome::Replayed)
    );
    // The caller's row and the accepted job committed; the refused items wrote nothing.
    assert_eq!(db.orders().await, vec!["o-3".to_string()]);
    assert_eq!(h.totals().await, (1, 1));
    assert_eq!(h.job(&first).await.payload, json!(1));
}

async fn a_transactional_enqueue_uses_the_queues_clock(h: Harness) {
    let db = Business::open(&h).await;
    h.advance(Duration::from_secs(3600));
    let now = h.now().await;
    let results = db
        .enqueue_and_order(
            &h.queue,
            vec![EnqueueRequest::new("t").delay(Duration::from_secs(60))],
            None,
            true,
            async |_| {},
        )
        .await;
    let id = results[0].as_ref().expect("accepted").job_id.clone();
    let job = h.job(&id).await;
    assert_eq!(job.created_at, now, "accepted at the clock of record");
    assert_eq!(job.run_at, now + chrono::Duration::seconds(60));
    assert_eq!(job.state, JobState::Scheduled);
    assert!(h.claim(10).await.is_empty());
    h.advance(Duration::from_secs(60));
    assert_eq!(h.claim(10).await.len(), 1);
}

/// On a connection with no transaction open, the call is a transaction of
/// its own that takes the file's write lock before it reads anything
/// (`BEGIN IMMEDIATE`): while another connection holds the lock it waits
/// (the busy timeout), then reads the clock of record, and commits.
async fn a_sqlite_enqueue_with_no_transaction_open_takes_the_write_lock_first(h: Harness) {
    if h.backend == "postgres" {
        // No file lock: a connection with no transaction open runs the
        // enqueue as one statement, its own transaction.
        return;
    }
    let conn = h.queue.sqlite_connection().expect("a connection");
    assert!(conn.is_autocommit());
    let holder = h.queue.sqlite_connection().expect("another connection");
    holder
        .execute_batch("BEGIN IMMEDIATE")
        .expect("take the write lock");
    let before = h.now().await;
    let h = &h;
    let r = std::thread::scope(|s| {
        s.spawn(move || {
            // The clock moves while the lock is held, then the lock is released.
            std::thread::sleep(Duration::from_millis(300));
            h.advance(Duration::from_secs(60));
            holder.execute_batch("COMMIT").expect("release the lock");
        });
        h.queue.enqueue_in_sqlite(&conn, EnqueueRequest::new("t"))
    });
    let r = r.expect("waited for the lock, then accepted");
    assert!(conn.is_autocommit(), "no transaction left open");
    let job = h.job(&r.job_id).await;
    assert_eq!(
        job.created_at,
        before + chrono::Duration::seconds(60),
        "the clock is read once the lock is taken"
    );
    assert_eq!(job.state, JobState::Ready);
}
