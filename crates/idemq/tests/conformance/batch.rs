//! Conformance cases: batch enqueue (docs/http-api.md, "Batches"). One result per request in
//! order; items are decided in order, each seeing the earlier ones; a failing
//! item stands alone unless the batch is atomic, and then nothing is written.

use std::time::Duration;

use idemq::{
    BatchOptions, ConflictSource, DedupeOptions, EnqueueRequest, EnqueueResult, Error, Outcome,
    Queue, QueueOptions, RetryPolicy,
};
use idemq_testkit::Harness;
use serde_json::json;

idemq_testkit::instantiate!(
    empty_batch_returns_empty_results,
    results_follow_request_order,
    repeated_idempotency_key_is_replayed_against_the_earlier_item,
    repeated_dedupe_key_is_coalesced_against_the_earlier_item,
    replace_lands_on_an_earlier_item,
    repeated_explicit_job_id_is_replayed_or_conflicts,
    same_key_other_payload_fails_only_that_item,
    validation_failure_fails_only_that_item,
    deadline_failure_fails_only_that_item,
    oversized_item_fails_only_that_item,
    failed_item_binds_no_key_for_later_items,
    batch_meets_keys_bound_before_it,
    atomic_success_writes_every_item,
    atomic_conflict_writes_nothing,
    atomic_conflict_with_an_existing_binding_writes_nothing,
    atomic_validation_failure_writes_nothing,
    atomic_deadline_failure_writes_nothing,
    atomic_reports_the_first_failing_item_in_request_order,
    atomic_reports_a_validation_failure_before_a_later_conflict,
    more_than_1000_items_are_refused,
    batch_of_1000_items_is_accepted,
    batch_over_16_mib_is_refused,
    one_accepted_event_per_new_job,
    coalesced_item_binds_its_idempotency_key,
    keyless_batch_stores_each_request_as_a_single_enqueue_does,
);

fn batch(atomic: bool) -> BatchOptions {
    BatchOptions { atomic }
}

fn item(n: i64) -> EnqueueRequest {
    EnqueueRequest::new("t").payload(json!({ "n": n }))
}

fn keyed(key: &str, n: i64) -> EnqueueRequest {
    item(n).idempotency_key(key)
}

fn ok(r: &idemq::Result<EnqueueResult>) -> &EnqueueResult {
    r.as_ref().expect("the item succeeds")
}

fn outcomes(rs: &[idemq::Result<EnqueueResult>]) -> Vec<Option<Outcome>> {
    rs.iter()
        .map(|r| r.as_ref().ok().map(|r| r.outcome))
        .collect()
}

fn validation_field(e: &Error) -> &str {
    match e {
        Error::Validation { field, .. } => field,
        other => panic!("expected a validation error, got {other:?}"),
    }
}

async fn empty_batch_returns_empty_results(h: Harness) {
    for atomic in [false, true] {
        let rs = h.queue.enqueue_many(vec![], batch(atomic)).await.unwrap();
        assert!(rs.is_empty());
    }
    assert_eq!(h.totals().await, (0, 0));
}

async fn results_follow_request_order(h: Harness) {
    let reqs: Vec<_> = (0..5).map(item).collect();
    let rs = h.queue.enqueue_many(reqs, batch(false)).await.unwrap();
    assert_eq!(rs.len(), 5);
    for (n, r) in rs.iter().enumerate() {
        let r = ok(r);
        assert_eq!(r.outcome, Outcome::Accepted);
        assert_eq!(h.job(&r.job_id).await.payload, json!({ "n": n }));
    }
    let ids: Vec<String> = rs.iter().map(|r| ok(r).job_id.clone()).collect();
    let mut distinct = ids.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 5);
    // Newest first: the last item of the batch was accepted last.
    let listed: Vec<String> = h.jobs().await.into_iter().map(|j| j.id).collect();
    assert_eq!(listed, ids.into_iter().rev().collect::<Vec<_>>());
}

async fn repeated_idempotency_key_is_replayed_against_the_earlier_item(h: Harness) {
    let rs = h
        .queue
        .enqueue_many(
            vec![keyed("k", 1), item(2), keyed("k", 1), keyed("k", 1)],
            batch(false),
        )
        .await
        .unwrap();
    assert_eq!(
        outcomes(&rs),
        vec![
            Some(Outcome::Accepted),
            Some(Outcome::Accepted),
            Some(Outcome::Replayed),
            Some(Outcome::Replayed)
        ]
    );
    assert_eq!(ok(&rs[2]).job_id, ok(&rs[0]).job_id);
    assert_eq!(ok(&rs[3]).job_id, ok(&rs[0]).job_id);
    assert_ne!(ok(&rs[1]).job_id, ok(&rs[0]).job_id);
    assert_eq!(h.totals().await, (2, 2));
}

async fn repeated_dedupe_key_is_coalesced_against_the_earlier_item(h: Harness) {
    let d = |n| item(n).dedupe(DedupeOptions::key("acct-1"));
    let other_type = EnqueueRequest::new("u").dedupe(DedupeOptions::key("acct-1"));
    let rs = h
        .queue
        .enqueue_many(vec![d(1), d(2), other_type, d(3)], batch(false))
        .await
        .unwrap();
    assert_eq!(
        outcomes(&rs),
        vec![
            Some(Outcome::Accepted),
            Some(Outcome::Coalesced),
            Some(Outcome::Accepted),
            Some(Outcome::Coalesced)
        ]
    );
    assert_eq!(ok(&rs[1]).job_id, ok(&rs[0]).job_id);
    assert_eq!(ok(&rs[3]).job_id, ok(&rs[0]).job_id);
    assert_ne!(ok(&rs[2]).job_id, ok(&rs[0]).job_id, "keys are per type");
    assert_eq!(h.job(&ok(&rs[0]).job_id).await.payload, json!({"n": 1}));
    assert_eq!(h.totals().await, (2, 2));
}

async fn replace_lands_on_an_earlier_item(h: Harness) {
    let r = |n| {
        item(n)
            .delay(Duration::from_secs(60))
            .dedupe(DedupeOptions::key("d").replace())
    };
    let rs = h
        .queue
        .enqueue_many(vec![r(1), r(2), r(3)], batch(false))
        .await
        .unwrap();
    assert_eq!(
        outcomes(&rs),
        vec![
            Some(Outcome::Accepted),
            Some(Outcome::Replaced),
            Some(Outcome::Replaced)
        ]
    );
    let id = ok(&rs[0]).job_id.clone();
    assert!(rs.iter().all(|r| ok(r).job_id == id));
    assert_eq!(h.job(&id).await.payload, json!({"n": 3}));
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "replaced", "replaced"]
    );
    assert_eq!(h.totals().await, (1, 3));
}

async fn repeated_explicit_job_id_is_replayed_or_conflicts(h: Harness) {
    let j = |n| item(n).job_id("order-1");
    let rs = h
        .queue
        .enqueue_many(vec![j(1), j(1), j(2)], batch(false))
        .await
        .unwrap();
    assert_eq!(ok(&rs[0]).outcome, Outcome::Accepted);
    assert_eq!(ok(&rs[0]).job_id, "order-1");
    assert_eq!(ok(&rs[1]).outcome, Outcome::Replayed);
    assert_eq!(ok(&rs[1]).job_id, "order-1");
    let c = rs[2].as_ref().unwrap_err().conflict().expect("a conflict");
    assert_eq!(c.source, ConflictSource::JobId);
    assert_eq!(
        (c.job_id.as_str(), c.fields.clone()),
        ("order-1", vec!["payload".to_string()])
    );
    assert_eq!(h.totals().await, (1, 1));
}

async fn same_key_other_payload_fails_only_that_item(h: Harness) {
    let rs = h
        .queue
        .enqueue_many(
            vec![keyed("k", 1), item(2), keyed("k", 99), item(3)],
            batch(false),
        )
        .await
        .unwrap();
    assert_eq!(rs.len(), 4);
    assert_eq!(
        outcomes(&rs),
        vec![
            Some(Outcome::Accepted),
            Some(Outcome::Accepted),
            None,
            Some(Outcome::Accepted)
        ]
    );
    let c = rs[2].as_ref().unwrap_err().conflict().expect("a conflict");
    assert_eq!(c.job_id, ok(&rs[0]).job_id);
    assert_eq!(c.source, ConflictSource::IdempotencyKey);
    assert_eq!(c.fields, vec!["payload"]);
    // Neither request silently won: the key still holds the first payload.
    let first = &ok(&rs[0]).job_id;
    assert_eq!(h.job(first).await.payload, json!({"n": 1}));
    let b = h.queue.lookup_key("default", "k").await.unwrap().unwrap();
    assert_eq!(&b.job_id, first);
    assert_eq!(h.totals().await, (3, 3));
}

async fn validation_failure_fails_only_that_item(h: Harness) {
    let rs = h
        .queue
        .enqueue_many(
            vec![
                EnqueueRequest::new("bad type"),
                item(1),
                item(2).max_attempts(0),
                item(3),
                item(4).queue(""),
            ],
            batch(false),
        )
        .await
        .unwrap();
    assert_eq!(rs.len(), 5);
    assert_eq!(validation_field(rs[0].as_ref().unwrap_err()), "type");
    assert_eq!(
        validation_field(rs[2].as_ref().unwrap_err()),
        "max_attempts"
    );
    assert_eq!(validation_field(rs[4].as_ref().unwrap_err()), "queue");
    // The results of the valid items line up with their requests.
    assert_eq!(h.job(&ok(&rs[1]).job_id).await.payload, json!({"n": 1}));
    assert_eq!(h.job(&ok(&rs[3]).job_id).await.payload, json!({"n": 3}));
    assert_eq!(h.totals().await, (2, 2));
}

async fn deadline_failure_fails_only_that_item(h: Harness) {
    let past = h.now().await - chrono::Duration::seconds(1);
    let rs = h
        .queue
        .enqueue_many(vec![item(1), item(2).deadline(past), item(3)], batch(false))
        .await
        .unwrap();
    assert_eq!(ok(&rs[0]).outcome, Outcome::Accepted);
    assert_eq!(validation_field(rs[1].as_ref().unwrap_err()), "deadline");
    assert_eq!(ok(&rs[2]).outcome, Outcome::Accepted);
    assert_eq!(h.job(&ok(&rs[2]).job_id).await.payload, json!({"n": 3}));
    assert_eq!(h.totals().await, (2, 2));
}

async fn failed_item_binds_no_key_for_later_items(h: Harness) {
    let past = h.now().await - chrono::Duration::seconds(1);
    let d = || DedupeOptions::key("d");
    let rs = h
        .queue
        .enqueue_many(
            vec![
                keyed("k", 1).dedupe(d()).deadline(past),
                keyed("k", 2).dedupe(d()),
            ],
            batch(false),
        )
        .await
        .unwrap();
    assert_eq!(validation_field(rs[0].as_ref().unwrap_err()), "deadline");
    let second = ok(&rs[1]);
    assert_eq!(
        second.outcome,
        Outcome::Accepted,
        "the refused item left no binding behind"
    );
    let b = h.queue.lookup_key("default", "k").await.unwrap().unwrap();
    assert_eq!(b.job_id, second.job_id);
    let dd = h.queue.dedupe_lookup("t", "d").await.unwrap().unwrap();
    assert_eq!(dd.job_id, second.job_id);
    assert_eq!(h.totals().await, (1, 1));
}

async fn batch_meets_keys_bound_before_it(h: Harness) {
    let before = h.put(keyed("k", 1)).await;
    let pending = h.put(item(5).dedupe(DedupeOptions::key("d"))).await;
    let rs = h
        .queue
        .enqueue_many(
            vec![
                keyed("k", 1),
                keyed("k", 2),
                item(6).dedupe(DedupeOptions::key("d")),
            ],
            batch(false),
        )
        .await
        .unwrap();
    assert_eq!(
        (ok(&rs[0]).job_id.as_str(), ok(&rs[0]).outcome),
        (before.as_str(), Outcome::Replayed)
    );
    assert_eq!(
        rs[1]
            .as_ref()
            .unwrap_err()
            .conflict()
            .map(|c| c.job_id.as_str()),
        Some(before.as_str())
    );
    assert_eq!(
        (ok(&rs[2]).job_id.as_str(), ok(&rs[2]).outcome),
        (pending.as_str(), Outcome::Coalesced)
    );
    assert_eq!(h.totals().await, (2, 2));
}

async fn atomic_success_writes_every_item(h: Harness) {
    let rs = h
        .queue
        .enqueue_many(vec![keyed("k", 1), item(2), keyed("k", 1)], batch(true))
        .await
        .unwrap();
    assert_eq!(
        outcomes(&rs),
        vec![
            Some(Outcome::Accepted),
            Some(Outcome::Accepted),
            Some(Outcome::Replayed)
        ]
    );
    assert_eq!(ok(&rs[2]).job_id, ok(&rs[0]).job_id);
    assert_eq!(h.totals().await, (2, 2));
}

/// Asserts an atomic batch failed at `index` and returns the item's error.
fn batch_item(r: idemq::Result<Vec<idemq::Result<EnqueueResult>>>, want: usize) -> Error {
    match r {
        Err(Error::BatchItem { index, error }) => {
            assert_eq!(index, want, "the first failing item, in request order");
            *error
        }
        other => panic!("expected BatchItem {{ index: {want} }}, got {other:?}"),
    }
}

async fn atomic_conflict_writes_nothing(h: Harness) {
    let r = h
        .queue
        .enqueue_many(
            vec![
                keyed("k", 1).dedupe(DedupeOptions::key("d")),
                item(2),
                keyed("k", 99),
                item(4),
            ],
            batch(true),
        )
        .await;
    let e = batch_item(r, 2);
    let c = e.conflict().expect("a conflict");
    assert_eq!(c.fields, vec!["payload"]);
    assert_eq!(h.totals().await, (0, 0));
    assert!(h.queue.lookup_key("default", "k").await.unwrap().is_none());
    assert!(h.queue.dedupe_lookup("t", "d").await.unwrap().is_none());
    // The id the conflict named was never committed.
    assert!(h.queue.get(&c.job_id).await.unwrap().is_none());
    // And the keys are free for a new request.
    let again = h
        .queue
        .enqueue_with_result(keyed("k", 99).dedupe(DedupeOptions::key("d")))
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Accepted);
}

async fn atomic_conflict_with_an_existing_binding_writes_nothing(h: Harness) {
    let existing = h.put(keyed("k", 1)).await;
    let before = h.totals().await;
    let r = h
        .queue
        .enqueue_many(vec![item(2), item(3), keyed("k", 2)], batch(true))
        .await;
    let e = batch_item(r, 2);
    assert_eq!(
        e.conflict().map(|c| c.job_id.as_str()),
        Some(existing.as_str())
    );
    assert_eq!(h.totals().await, before);
}

async fn atomic_validation_failure_writes_nothing(h: Harness) {
    let r = h
        .queue
        .enqueue_many(
            vec![
                keyed("k", 1),
                item(2).dedupe(DedupeOptions::key("d")),
                item(3).tag(""),
            ],
            batch(true),
        )
        .await;
    let e = batch_item(r, 2);
    assert_eq!(validation_field(&e), "tags");
    assert_eq!(h.totals().await, (0, 0));
    assert!(h.queue.lookup_key("default", "k").await.unwrap().is_none());
    assert!(h.queue.dedupe_lookup("t", "d").await.unwrap().is_none());
    let r = h
        .queue
        .enqueue_many(vec![EnqueueRequest::new(""), item(1)], batch(true))
        .await;
    assert_eq!(validation_field(&batch_item(r, 0)), "type");
    assert_eq!(h.totals().await, (0, 0));
}

async fn atomic_deadline_failure_writes_nothing(h: Harness) {
    let past = h.now().await - chrono::Duration::seconds(1);
    let r = h
        .queue
        .enqueue_many(
            vec![keyed("k", 1), item(2), item(3).deadline(past), item(4)],
            batch(true),
        )
        .await;
    assert_eq!(validation_field(&batch_item(r, 2)), "deadline");
    assert_eq!(h.totals().await, (0, 0));
    assert!(h.queue.lookup_key("default", "k").await.unwrap().is_none());
}

async fn atomic_reports_the_first_failing_item_in_request_order(h: Harness) {
    // Item 1 conflicts with item 0 in the store; item 2 is invalid in shape.
    // The first failing item in request order is 1.
    let r = h
        .queue
        .enqueue_many(
            vec![
                keyed("k", 1),
                keyed("k", 2),
                EnqueueRequest::new("bad type"),
            ],
            batch(true),
        )
        .await;
    let e = batch_item(r, 1);
    assert_eq!(
        e.conflict().map(|c| c.fields.clone()),
        Some(vec!["payload".to_string()])
    );
    assert_eq!(h.totals().await, (0, 0));
    assert!(h.queue.lookup_key("default", "k").await.unwrap().is_none());
    // With two store-side failures, the earlier one is reported.
    let past = h.now().await - chrono::Duration::seconds(1);
    let r = h
        .queue
        .enqueue_many(
            vec![
                item(0),
                item(1).deadline(past),
                keyed("k", 1),
                keyed("k", 2),
            ],
            batch(true),
        )
        .await;
    assert_eq!(validation_field(&batch_item(r, 1)), "deadline");
    assert_eq!(h.totals().await, (0, 0));
}

async fn atomic_reports_a_validation_failure_before_a_later_conflict(h: Harness) {
    let r = h
        .queue
        .enqueue_many(
            vec![keyed("k", 1), item(2).max_attempts(1001), keyed("k", 2)],
            batch(true),
        )
        .await;
    assert_eq!(validation_field(&batch_item(r, 1)), "max_attempts");
    assert_eq!(h.totals().await, (0, 0));
    assert!(h.queue.lookup_key("default", "k").await.unwrap().is_none());
}

async fn more_than_1000_items_are_refused(h: Harness) {
    for atomic in [false, true] {
        let reqs: Vec<_> = (0..1001).map(item).collect();
        let err = h.queue.enqueue_many(reqs, batch(atomic)).await.unwrap_err();
        assert_eq!(validation_field(&err), "jobs");
        assert_eq!(h.totals().await, (0, 0));
    }
}

async fn batch_of_1000_items_is_accepted(h: Harness) {
    let reqs: Vec<_> = (0..1000).map(|n| keyed(&format!("k-{n}"), n)).collect();
    let rs = h.queue.enqueue_many(reqs, batch(true)).await.unwrap();
    assert_eq!(rs.len(), 1000);
    assert!(rs.iter().all(|r| ok(r).outcome == Outcome::Accepted));
    assert_eq!(h.totals().await, (1000, 1000));
    let b = h
        .queue
        .lookup_key("default", "k-999")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(b.job_id, ok(&rs[999]).job_id);
    assert_eq!(h.job(&ok(&rs[999]).job_id).await.payload, json!({"n": 999}));
    // The same batch again is 1,000 replays and writes nothing.
    let reqs: Vec<_> = (0..1000).map(|n| keyed(&format!("k-{n}"), n)).collect();
    let again = h.queue.enqueue_many(reqs, batch(false)).await.unwrap();
    assert!(again.iter().all(|r| ok(r).outcome == Outcome::Replayed));
    assert_eq!(h.totals().await, (1000, 1000));
}

async fn batch_over_16_mib_is_refused(h: Harness) {
    // 17 payloads just under 1 MiB each: every item is fine, the batch is not.
    let big = || item(0).payload(json!("x".repeat(1_000_000)));
    for atomic in [false, true] {
        let reqs: Vec<_> = (0..17).map(|_| big()).collect();
        match h.queue.enqueue_many(reqs, batch(atomic)).await {
            Err(Error::PayloadTooLarge { field, limit }) => {
                assert_eq!((field.as_str(), limit), ("jobs", 16 * 1024 * 1024));
            }
            other => panic!("expected PayloadTooLarge, got {:?}", other.map(|v| v.len())),
        }
        assert_eq!(h.totals().await, (0, 0));
    }
    let reqs: Vec<_> = (0..16).map(|_| big()).collect();
    let rs = h.queue.enqueue_many(reqs, batch(false)).await.unwrap();
    assert_eq!(rs.len(), 16);
    assert_eq!(h.totals().await, (16, 16));
}

async fn one_accepted_event_per_new_job(h: Harness) {
    let rs = h
        .queue
        .enqueue_many(
            vec![
                keyed("k", 1),
                keyed("k", 1),
                item(2).dedupe(DedupeOptions::key("d")),
                item(3).dedupe(DedupeOptions::key("d")),
                item(4),
                keyed("k", 5),
            ],
            batch(false),
        )
        .await
        .unwrap();
    let new: Vec<&String> = rs
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter(|r| r.outcome == Outcome::Accepted)
        .map(|r| &r.job_id)
        .collect();
    assert_eq!(new.len(), 3);
    for id in new {
        assert_eq!(h.event_kinds(id).await, vec!["accepted"]);
    }
    assert_eq!(h.totals().await, (3, 3));
}

async fn coalesced_item_binds_its_idempotency_key(h: Harness) {
    let rs = h
        .queue
        .enqueue_many(
            vec![
                item(1).dedupe(DedupeOptions::key("d")),
                keyed("k2", 2).dedupe(DedupeOptions::key("d")),
                keyed("k2", 2).dedupe(DedupeOptions::key("d")),
            ],
            batch(false),
        )
        .await
        .unwrap();
    let holder = ok(&rs[0]).job_id.clone();
    assert_eq!(
        (ok(&rs[1]).job_id.as_str(), ok(&rs[1]).outcome),
        (holder.as_str(), Outcome::Coalesced)
    );
    assert_eq!(
        (ok(&rs[2]).job_id.as_str(), ok(&rs[2]).outcome),
        (holder.as_str(), Outcome::Replayed)
    );
    let b = h.queue.lookup_key("default", "k2").await.unwrap().unwrap();
    assert_eq!(b.job_id, holder);
    assert_eq!(h.totals().await, (1, 1));
}

async fn oversized_item_fails_only_that_item(h: Harness) {
    let small = Queue::from_store(
        h.queue.store().clone(),
        QueueOptions {
            payload_limit: 100,
            ..Default::default()
        },
    );
    let big = || item(1).payload(json!("x".repeat(200)));
    let r = small
        .enqueue_many(vec![item(0), big(), item(2)], batch(true))
        .await;
    match batch_item(r, 1) {
        Error::PayloadTooLarge { field, limit } => {
            assert_eq!((field.as_str(), limit), ("payload", 100));
        }
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    assert_eq!(h.totals().await, (0, 0));
    let rs = small
        .enqueue_many(vec![item(0), big(), item(2)], batch(false))
        .await
        .unwrap();
    assert!(matches!(
        &rs[1],
        Err(Error::PayloadTooLarge { field, limit: 100 }) if field == "payload"
    ));
    assert_eq!(h.job(&ok(&rs[0]).job_id).await.payload, json!({"n": 0}));
    assert_eq!(h.job(&ok(&rs[2]).job_id).await.payload, json!({"n": 2}));
    assert_eq!(h.totals().await, (2, 2));
}

/// A batch without keys takes a set-based path and a single request a
/// straight one on some backends: every field lands the same either way,
/// a JSON null payload and retry policies repeated within the batch
/// included, and so does the `accepted` event.
async fn keyless_batch_stores_each_request_as_a_single_enqueue_does(h: Harness) {
    let now = h.now().await;
    let fixed = RetryPolicy::Fixed { delay_ms: 2_500 };
    let steep = RetryPolicy::Exponential {
        initial_ms: 100,
        factor: 3.5,
        max_ms: 60_000,
        jitter: false,
    };
    let requests = || {
        vec![
            EnqueueRequest::new("t").payload(serde_json::Value::Null),
            EnqueueRequest::new("t").retry(fixed.clone()),
            EnqueueRequest::new("t").retry(steep.clone()),
            EnqueueRequest::new("t").retry(fixed.clone()),
            EnqueueRequest::new("t").retry(RetryPolicy::None),
            EnqueueRequest::new("t")
                .payload(json!({"a": [1, 2], "b": "x"}))
                .queue("q2")
                .priority(5)
                .delay(Duration::from_secs(10))
                .deadline(now + chrono::Duration::hours(1))
                .max_attempts(3)
                .timeout(Duration::from_secs(7))
                .concurrency_key("ck")
                .keep(Duration::from_secs(60))
                .tag("b")
                .tag("a"),
            EnqueueRequest::new("t").run_at(now + chrono::Duration::seconds(30)),
        ]
    };
    let batched = h
        .queue
        .enqueue_many(requests(), batch(false))
        .await
        .unwrap();
    let mut singles = Vec::new();
    for r in requests() {
        singles.push(h.queue.enqueue_with_result(r).await.unwrap());
    }
    for (b, s) in batched.iter().zip(&singles) {
        let (b, s) = (ok(b), s);
        assert_eq!(b.outcome, Outcome::Accepted);
        let (jb, js) = (h.job(&b.job_id).await, h.job(&s.job_id).await);
        let strip = |mut j: idemq::Job| {
            j.id = String::new();
            j
        };
        assert_eq!(strip(jb), strip(js));
        let (eb, es) = (
            h.queue.events(&b.job_id).await.unwrap(),
            h.queue.events(&s.job_id).await.unwrap(),
        );
        assert_eq!((eb.len(), es.len()), (1, 1));
        assert_eq!(
            (&eb[0].kind, eb[0].at, &eb[0].data),
            (&es[0].kind, es[0].at, &es[0].data)
        );
    }
    let first = h.job(&ok(&batched[0]).job_id).await;
    assert_eq!(first.payload, serde_json::Value::Null);
    assert_eq!(first.retry, RetryPolicy::default());
    let mut retries = Vec::new();
    for r in &batched[1..5] {
        retries.push(h.job(&ok(r).job_id).await.retry);
    }
    assert_eq!(
        retries,
        vec![fixed.clone(), steep, fixed, RetryPolicy::None],
        "each job keeps its own retry policy"
    );
    let tagged = h.job(&ok(&batched[5]).job_id).await;
    assert_eq!(tagged.tags, vec!["a".to_owned(), "b".to_owned()]);
    assert_eq!(tagged.run_at, now + chrono::Duration::seconds(10));
}
