//! Conformance cases: typed job definitions (docs/worker.md) on every
//! backend. A definition's queue, options and keys reach the store as if the
//! request had been built by hand; the typed handler runs what it defines.

use std::collections::BTreeMap;
use std::time::Duration;

use idemq::worker::{HandlerContext, Job, JobError, JobOptions, Worker};
use idemq::{DedupeOptions, EnqueueRequest, Error, IdempotencyOptions, JobState, Outcome};
use idemq_testkit::Harness;
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::worker::run_until;

idemq_testkit::instantiate!(
    typed_enqueue_applies_the_definition,
    an_enqueue_overrides_the_definition,
    a_derived_idempotency_key_replays_and_conflicts,
    a_derived_dedupe_key_coalesces,
    a_payload_that_does_not_serialize_is_refused_and_writes_nothing,
    typed_worker_runs_its_type_from_any_queue,
    typed_worker_fails_a_bad_payload_permanently,
);

#[derive(Serialize, Deserialize)]
struct Receipt {
    order: String,
    to: String,
}

impl Job for Receipt {
    const TYPE: &'static str = "receipt.send";
    const QUEUE: Option<&'static str> = Some("mail");
    fn options(&self) -> JobOptions {
        JobOptions::default()
            .priority(3)
            .max_attempts(5)
            .timeout(Duration::from_secs(30))
            .keep(Duration::from_secs(600))
            .concurrency_key(format!("to:{}", self.to))
            .tag("receipts")
    }
    fn idempotency(&self) -> Option<IdempotencyOptions> {
        Some(IdempotencyOptions::new(format!("receipt:{}", self.order)).scope("shop"))
    }
}

/// No definition beyond its type: the request's defaults apply.
#[derive(Serialize, Deserialize)]
struct Plain {
    n: i64,
}

impl Job for Plain {
    const TYPE: &'static str = "plain";
}

#[derive(Serialize, Deserialize)]
struct Sync {
    account: String,
}

impl Job for Sync {
    const TYPE: &'static str = "account.sync";
    fn dedupe(&self) -> Option<DedupeOptions> {
        Some(DedupeOptions::key(&self.account))
    }
}

/// A payload JSON cannot hold: a map whose keys are not strings.
#[derive(Serialize, Deserialize)]
struct Unserializable {
    by_bytes: BTreeMap<Vec<u8>, i64>,
}

impl Job for Unserializable {
    const TYPE: &'static str = "unserializable";
}

fn receipt(order: &str, to: &str) -> Receipt {
    Receipt {
        order: order.into(),
        to: to.into(),
    }
}

async fn typed_enqueue_applies_the_definition(h: Harness) {
    let id = h.queue.enqueue(receipt("o1", "a@x")).await.unwrap();
    let job = h.job(&id).await;
    assert_eq!(job.job_type, "receipt.send");
    assert_eq!(job.queue, "mail");
    assert_eq!(job.payload, json!({"order": "o1", "to": "a@x"}));
    assert_eq!(job.priority, 3);
    assert_eq!(job.max_attempts, 5);
    assert_eq!(job.timeout_ms, 30_000);
    assert_eq!(job.keep_ms, Some(600_000));
    assert_eq!(job.concurrency_key.as_deref(), Some("to:a@x"));
    assert_eq!(job.tags, vec!["receipts".to_string()]);
    let key = job.idempotency.expect("the derived key is bound");
    assert_eq!(key.scope, "shop");
    // The same as a request built by hand with those fields.
    let by_hand = EnqueueRequest::new("receipt.send")
        .queue("mail")
        .payload(json!({"order": "o1", "to": "a@x"}))
        .priority(3)
        .max_attempts(5)
        .timeout(Duration::from_secs(30))
        .keep(Duration::from_secs(600))
        .concurrency_key("to:a@x")
        .tag("receipts")
        .idempotency(IdempotencyOptions::new("receipt:o1").scope("shop"));
    assert_eq!(
        EnqueueRequest::from_job(&receipt("o1", "a@x")).unwrap(),
        by_hand
    );
    let again = h.queue.enqueue_with_result(by_hand).await.unwrap();
    assert_eq!((again.job_id, again.outcome), (id, Outcome::Replayed));

    // A bare definition leaves every default alone.
    let id = h.queue.enqueue(Plain { n: 1 }).await.unwrap();
    let job = h.job(&id).await;
    assert_eq!(
        (job.queue.as_str(), job.priority, job.max_attempts),
        ("default", 0, 10)
    );
    assert!(job.idempotency.is_none() && job.dedupe.is_none());
}

async fn an_enqueue_overrides_the_definition(h: Harness) {
    let req = EnqueueRequest::from_job(&receipt("o2", "b@x"))
        .unwrap()
        .queue("bulk")
        .max_attempts(2)
        .priority(-1)
        .idempotency_key("receipt:o2:resend");
    let id = h.queue.enqueue(req).await.unwrap();
    let job = h.job(&id).await;
    assert_eq!(
        (job.queue.as_str(), job.max_attempts, job.priority),
        ("bulk", 2, -1)
    );
    assert_eq!(job.timeout_ms, 30_000, "what is not overridden stays");
    assert_eq!(job.idempotency.expect("key").scope, "default");
    // Bounds apply to definition values like any: a refused request writes nothing.
    let before = h.totals().await;
    let err = h
        .queue
        .enqueue(
            EnqueueRequest::from_job(&receipt("o3", "c@x"))
                .unwrap()
                .queue("no spaces"),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "queue"),
        "{err}"
    );
    assert_eq!(h.totals().await, before);
}

async fn a_derived_idempotency_key_replays_and_conflicts(h: Harness) {
    let first = h
        .queue
        .enqueue_with_result(receipt("o4", "d@x"))
        .await
        .unwrap();
    assert_eq!(first.outcome, Outcome::Accepted);
    let again = h
        .queue
        .enqueue_with_result(receipt("o4", "d@x"))
        .await
        .unwrap();
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (first.job_id.as_str(), Outcome::Replayed)
    );
    // Same order, another recipient: the key derived from the order conflicts.
    let before = h.totals().await;
    let err = h.queue.enqueue(receipt("o4", "e@x")).await.unwrap_err();
    let conflict = err.conflict().expect("a conflict");
    assert_eq!(conflict.job_id, first.job_id);
    assert!(
        conflict.fields.contains(&"payload".to_string()),
        "{:?}",
        conflict.fields
    );
    assert_eq!(h.totals().await, before);
}

async fn a_derived_dedupe_key_coalesces(h: Harness) {
    let sync = |a: &str| Sync { account: a.into() };
    let first = h.queue.enqueue_with_result(sync("acct-1")).await.unwrap();
    let second = h.queue.enqueue_with_result(sync("acct-1")).await.unwrap();
    let other = h.queue.enqueue_with_result(sync("acct-2")).await.unwrap();
    assert_eq!(first.outcome, Outcome::Accepted);
    assert_eq!(
        (second.job_id.as_str(), second.outcome),
        (first.job_id.as_str(), Outcome::Coalesced)
    );
    assert_eq!(other.outcome, Outcome::Accepted);
    let job = h.job(&first.job_id).await;
    assert_eq!(job.dedupe.expect("dedupe").key, "acct-1");
}

async fn a_payload_that_does_not_serialize_is_refused_and_writes_nothing(h: Harness) {
    let job = Unserializable {
        by_bytes: BTreeMap::from([(vec![1u8], 1)]),
    };
    let err = EnqueueRequest::from_job(&job).unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "payload"),
        "{err}"
    );
    let err = h.queue.enqueue(job).await.unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "payload"),
        "{err}"
    );
    assert_eq!(h.totals().await, (0, 0));
}

fn worker(h: &Harness) -> Worker {
    Worker::new(h.queue.clone())
        .poll_interval(Duration::from_millis(50))
        .maintenance(false)
}

async fn typed_worker_runs_its_type_from_any_queue(h: Harness) {
    let in_mail = h.queue.enqueue(receipt("o5", "f@x")).await.unwrap();
    let in_bulk = h
        .queue
        .enqueue(
            EnqueueRequest::from_job(&receipt("o6", "g@x"))
                .unwrap()
                .queue("bulk"),
        )
        .await
        .unwrap();
    let other_type = h.put(EnqueueRequest::new("not.mine").queue("mail")).await;
    let w = worker(&h).job(|ctx: HandlerContext, r: Receipt| async move {
        assert_eq!(ctx.job_type(), Receipt::TYPE);
        Ok::<_, JobError>(json!({"sent_to": r.to, "queue": ctx.queue_name()}))
    });
    let report = run_until(w, || async {
        let a = h.job(&in_mail).await.state == JobState::Completed;
        let b = h.job(&in_bulk).await.state == JobState::Completed;
        a && b
    })
    .await;
    assert_eq!(report.completed, 2);
    assert_eq!(
        h.job(&in_mail).await.result,
        Some(json!({"sent_to": "f@x", "queue": "mail"}))
    );
    assert_eq!(
        h.job(&in_bulk).await.result,
        Some(json!({"sent_to": "g@x", "queue": "bulk"}))
    );
    assert_eq!(
        h.job(&other_type).await.state,
        JobState::Ready,
        "only its type is claimed"
    );
}

async fn typed_worker_fails_a_bad_payload_permanently(h: Harness) {
    // Jobs of the type enqueued by hand (another client, an older producer)
    // whose payload is not a Receipt.
    let bad = h
        .put(
            EnqueueRequest::new(Receipt::TYPE)
                .payload(json!({"order": 7}))
                .max_attempts(5),
        )
        .await;
    let good = h.queue.enqueue(receipt("o7", "h@x")).await.unwrap();
    let w = worker(&h)
        .job(|_ctx: HandlerContext, r: Receipt| async move { Ok::<_, JobError>(r.order) });
    let report = run_until(w, || async {
        h.job(&bad).await.state == JobState::Dead && h.job(&good).await.state == JobState::Completed
    })
    .await;
    assert_eq!((report.completed, report.failed), (1, 1));
    let dead = h.job(&bad).await;
    assert_eq!(
        dead.attempts_used, 1,
        "no retry of a payload that cannot fit"
    );
    let err = dead.last_error.unwrap_or_default();
    assert!(err.starts_with("bad_payload"), "{err}");
    assert_eq!(h.job(&good).await.result, Some(json!("o7")));
}
