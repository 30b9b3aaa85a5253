//! Conformance cases: validation (docs/http-api.md, docs/idempotency.md and docs/dedupe.md). Every bound is refused with a
//! typed error naming the field as an API dotted path, nothing is written for
//! a refused request, and the last accepted value on each side is accepted.

use std::time::Duration;

use idemq::{
    DedupeOptions, EnqueueRequest, Error, IdempotencyOptions, Outcome, Queue, QueueOptions,
    RetryPolicy,
};
use idemq_testkit::Harness;
use serde_json::{Value, json};

idemq_testkit::instantiate!(
    type_length_bounds,
    type_charset,
    payload_limit_default_is_one_mib,
    payload_limit_is_configurable,
    payload_nul_in_strings_is_refused,
    payload_nul_in_object_keys_is_refused,
    payload_numbers_beyond_a_double_are_refused_unless_integers,
    queue_bounds,
    job_id_bounds,
    priority_fits_i16,
    run_at_and_delay_not_both,
    delay_is_not_negative,
    max_attempts_bounds,
    retry_exponential_durations_are_positive,
    retry_factor_is_at_least_one,
    retry_fixed_delay_is_positive,
    retry_none_is_accepted,
    timeout_bounds,
    deadline_must_be_in_the_future,
    run_at_must_be_before_the_deadline,
    delay_must_end_before_the_deadline,
    deadline_is_not_checked_for_a_coalesced_request,
    concurrency_key_bounds,
    tags_count_bounds,
    duplicate_tags_collapse,
    tag_length_bounds,
    keep_is_not_negative,
    idempotency_key_bounds,
    idempotency_scope_bounds,
    idempotency_scope_reserved_prefix,
    idempotency_ttl_bounds,
    dedupe_key_bounds,
    dedupe_ttl_bounds,
    dedupe_max_wait_bounds,
    dedupe_extend_needs_ttl,
    dedupe_extend_excludes_replace,
    dedupe_max_wait_only_for_debounce_and_replace,
    dedupe_max_wait_not_below_ttl,
    refused_request_binds_neither_key,
    nul_in_ids_and_names_matches_nothing,
);

const PROBE_KEY: &str = "validation-probe";
const DAY_MS: i64 = 24 * 3600 * 1000;
const THIRTY_DAYS_MS: i64 = 30 * DAY_MS;

/// Adds an idempotency key and a dedupe key to a request that has none, so a
/// refusal can be checked to bind neither.
fn probed(mut req: EnqueueRequest) -> EnqueueRequest {
    if req.idempotency.is_none() {
        req.idempotency = Some(IdempotencyOptions::new(PROBE_KEY));
    }
    if req.dedupe.is_none() {
        req.dedupe = Some(DedupeOptions::key(PROBE_KEY));
    }
    req
}

/// Asserts the database holds nothing and no key of `req` is bound.
async fn assert_nothing_written(h: &Harness, req: &EnqueueRequest) {
    assert_eq!(h.totals().await, (0, 0), "a refused request writes nothing");
    if let Some(o) = &req.idempotency {
        let scope = o.scope.as_deref().unwrap_or("default");
        // An unusable key cannot be looked up, and cannot be bound either.
        if let Ok(found) = h.queue.lookup_key(scope, &o.key).await {
            assert!(
                found.is_none(),
                "a refused request binds no idempotency key"
            );
        }
    }
    if let Some(d) = &req.dedupe {
        let found = h
            .queue
            .dedupe_lookup(&req.job_type, &d.key)
            .await
            .expect("dedupe lookup");
        assert!(found.is_none(), "a refused request binds no dedupe key");
    }
}

/// Enqueues `req` on an empty database and asserts it is refused with a
/// validation error on `field` and that nothing was written.
async fn refused(h: &Harness, req: EnqueueRequest, field: &str) {
    refused_on(h, &h.queue, req, field).await;
}

async fn refused_on(h: &Harness, queue: &Queue, req: EnqueueRequest, field: &str) {
    assert_eq!(h.totals().await, (0, 0), "refusals are checked first");
    let req = probed(req);
    match queue.enqueue_with_result(req.clone()).await {
        Err(Error::Validation { field: f, reason }) => {
            assert_eq!(f, field, "wrong field (reason: {reason})");
            assert!(!reason.is_empty(), "a validation error names its bound");
        }
        other => panic!("expected a validation error on `{field}`, got {other:?}"),
    }
    assert_nothing_written(h, &req).await;
}

/// Enqueues `req` and asserts it is accepted as a new job; returns the job.
async fn accepted(h: &Harness, req: EnqueueRequest) -> idemq::Job {
    accepted_on(h, &h.queue, req).await
}

async fn accepted_on(h: &Harness, queue: &Queue, req: EnqueueRequest) -> idemq::Job {
    let r = queue
        .enqueue_with_result(req)
        .await
        .expect("the request is within bounds");
    assert_eq!(r.outcome, Outcome::Accepted);
    h.job(&r.job_id).await
}

fn t() -> EnqueueRequest {
    EnqueueRequest::new("t")
}

fn s(n: usize) -> String {
    "a".repeat(n)
}

/// A string of exactly `bytes` bytes made mostly of two-byte characters.
fn utf8(bytes: usize) -> String {
    let mut v = "é".repeat(bytes / 2);
    if bytes % 2 == 1 {
        v.push('a');
    }
    assert_eq!(v.len(), bytes);
    v
}

/// A string payload whose serialized form is exactly `bytes` bytes.
fn payload_of(bytes: usize) -> Value {
    Value::String("x".repeat(bytes - 2))
}

async fn type_length_bounds(h: Harness) {
    refused(&h, EnqueueRequest::new(""), "type").await;
    refused(&h, EnqueueRequest::new(s(129)), "type").await;
    let j = accepted(&h, EnqueueRequest::new(s(128))).await;
    assert_eq!(j.job_type, s(128));
    accepted(&h, EnqueueRequest::new("a")).await;
}

async fn type_charset(h: Harness) {
    for bad in ["a b", "a/b", "a~b", "é", "a\u{0}b", "a,b", "a\nb"] {
        refused(&h, EnqueueRequest::new(bad), "type").await;
    }
    let j = accepted(&h, EnqueueRequest::new("Az09._:-")).await;
    assert_eq!(j.job_type, "Az09._:-");
    accepted(&h, EnqueueRequest::new("invoice.capture_v2")).await;
}

async fn payload_limit_default_is_one_mib(h: Harness) {
    const MIB: usize = 1024 * 1024;
    let req = probed(t().payload(payload_of(MIB + 1)));
    match h.queue.enqueue(req.clone()).await {
        Err(Error::PayloadTooLarge { field, limit }) => {
            assert_eq!((field.as_str(), limit), ("payload", MIB));
        }
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    assert_nothing_written(&h, &req).await;
    let j = accepted(&h, t().payload(payload_of(MIB))).await;
    assert_eq!(j.payload, payload_of(MIB));
}

async fn payload_limit_is_configurable(h: Harness) {
    let small = Queue::from_store(
        h.queue.store().clone(),
        QueueOptions {
            payload_limit: 100,
            ..Default::default()
        },
    );
    let req = probed(t().payload(payload_of(101)));
    match small.enqueue(req.clone()).await {
        Err(Error::PayloadTooLarge { field, limit }) => {
            assert_eq!((field.as_str(), limit), ("payload", 100));
        }
        other => panic!("expected PayloadTooLarge, got {other:?}"),
    }
    assert_nothing_written(&h, &req).await;
    // The limit is on the serialized form: an object counts its syntax too.
    let obj = json!({ "k": "x".repeat(100 - r#"{"k":""}"#.len()) });
    assert_eq!(serde_json::to_string(&obj).unwrap().len(), 100);
    accepted_on(&h, &small, t().payload(obj)).await;
    accepted_on(&h, &small, t().payload(payload_of(100))).await;
    // The default queue on the same store still takes larger payloads.
    accepted(&h, t().payload(payload_of(1000))).await;
}

async fn payload_nul_in_strings_is_refused(h: Harness) {
    refused(&h, t().payload(json!("a\u{0}b")), "payload").await;
    refused(
        &h,
        t().payload(json!({"a": ["ok", {"b": "\u{0}"}]})),
        "payload",
    )
    .await;
    refused(&h, t().payload(json!([1, "\u{0}"])), "payload").await;
    // Other control characters and the escaped text `\u0000` are fine.
    let j = accepted(&h, t().payload(json!({"a": "\u{1}\t\n", "b": "\\u0000"}))).await;
    assert_eq!(j.payload, json!({"a": "\u{1}\t\n", "b": "\\u0000"}));
}

async fn payload_numbers_beyond_a_double_are_refused_unless_integers(h: Harness) {
    let parse = |text: &str| serde_json::from_str::<serde_json::Value>(text).unwrap();
    refused(&h, t().payload(parse("1e400")), "payload").await;
    refused(&h, t().payload(parse(r#"{"a":[1,-2.5E999]}"#)), "payload").await;
    assert_eq!(h.totals().await.0, 0, "nothing written");
    let j = accepted(
        &h,
        t().payload(parse(r#"{"a":1e308,"b":123456789012345678901234567890}"#)),
    )
    .await;
    let stored = serde_json::to_string(&j.payload).unwrap();
    assert!(
        stored.contains("123456789012345678901234567890"),
        "{stored}"
    );
}

async fn payload_nul_in_object_keys_is_refused(h: Harness) {
    refused(&h, t().payload(json!({"a\u{0}": 1})), "payload").await;
    refused(&h, t().payload(json!([{"x": {"\u{0}": null}}])), "payload").await;
    accepted(&h, t().payload(json!({"a": {"b": null}}))).await;
}

async fn queue_bounds(h: Harness) {
    refused(&h, t().queue(""), "queue").await;
    refused(&h, t().queue(s(65)), "queue").await;
    refused(&h, t().queue("a b"), "queue").await;
    refused(&h, t().queue("a~b"), "queue").await;
    let j = accepted(&h, t().queue(s(64))).await;
    assert_eq!(j.queue, s(64));
    let j = accepted(&h, t().queue("b")).await;
    assert_eq!(j.queue, "b");
    let j = accepted(&h, t().queue("Az09._:-")).await;
    assert_eq!(j.queue, "Az09._:-");
}

async fn job_id_bounds(h: Harness) {
    refused(&h, t().job_id(""), "job_id").await;
    refused(&h, t().job_id(s(129)), "job_id").await;
    refused(&h, t().job_id("a/b"), "job_id").await;
    refused(&h, t().job_id("a b"), "job_id").await;
    refused(&h, t().job_id("ü"), "job_id").await;
    let j = accepted(&h, t().job_id(s(128))).await;
    assert_eq!(j.id, s(128));
    let j = accepted(&h, t().job_id("x")).await;
    assert_eq!(j.id, "x");
    let j = accepted(&h, t().job_id("Az09._:~-")).await;
    assert_eq!(j.id, "Az09._:~-");
}

async fn priority_fits_i16(h: Harness) {
    for p in [40_000, 32_768, -32_769, i64::MAX] {
        let mut req = t();
        req.priority = Some(p);
        refused(&h, req, "priority").await;
    }
    assert_eq!(accepted(&h, t().priority(i16::MAX)).await.priority, 32_767);
    assert_eq!(accepted(&h, t().priority(i16::MIN)).await.priority, -32_768);
}

async fn run_at_and_delay_not_both(h: Harness) {
    let at = h.now().await + chrono::Duration::minutes(5);
    refused(
        &h,
        t().run_at(at).delay(Duration::from_secs(60)),
        "delay_ms",
    )
    .await;
    // Even a zero delay is a second way to say when.
    refused(&h, t().run_at(at).delay(Duration::ZERO), "delay_ms").await;
    assert_eq!(accepted(&h, t().run_at(at)).await.run_at, at);
    let j = accepted(&h, t().delay(Duration::from_secs(60))).await;
    assert_eq!(j.run_at, h.now().await + chrono::Duration::seconds(60));
}

async fn delay_is_not_negative(h: Harness) {
    for d in [-1, i64::MIN] {
        let mut req = t();
        req.delay_ms = Some(d);
        refused(&h, req, "delay_ms").await;
    }
    let j = accepted(&h, t().delay(Duration::ZERO)).await;
    assert_eq!(j.run_at, h.now().await);
    assert_eq!(j.state, idemq::JobState::Ready);
}

async fn max_attempts_bounds(h: Harness) {
    refused(&h, t().max_attempts(0), "max_attempts").await;
    refused(&h, t().max_attempts(1001), "max_attempts").await;
    let mut negative = t();
    negative.max_attempts = Some(-1);
    refused(&h, negative, "max_attempts").await;
    assert_eq!(accepted(&h, t().max_attempts(1)).await.max_attempts, 1);
    assert_eq!(
        accepted(&h, t().max_attempts(1000)).await.max_attempts,
        1000
    );
}

fn exponential(initial_ms: i64, factor: f64, max_ms: i64) -> RetryPolicy {
    RetryPolicy::Exponential {
        initial_ms,
        factor,
        max_ms,
        jitter: true,
    }
}

async fn retry_exponential_durations_are_positive(h: Harness) {
    refused(&h, t().retry(exponential(0, 2.0, 1000)), "retry.initial_ms").await;
    refused(
        &h,
        t().retry(exponential(-5, 2.0, 1000)),
        "retry.initial_ms",
    )
    .await;
    refused(&h, t().retry(exponential(1000, 2.0, 0)), "retry.max_ms").await;
    refused(&h, t().retry(exponential(1000, 2.0, -1)), "retry.max_ms").await;
    let j = accepted(&h, t().retry(exponential(1, 2.0, 1))).await;
    assert_eq!(j.retry, exponential(1, 2.0, 1));
}

async fn retry_factor_is_at_least_one(h: Harness) {
    for f in [0.999, 0.0, -2.0, f64::NAN, f64::INFINITY] {
        refused(&h, t().retry(exponential(1000, f, 60_000)), "retry.factor").await;
    }
    let j = accepted(&h, t().retry(exponential(1000, 1.0, 60_000))).await;
    assert_eq!(j.retry, exponential(1000, 1.0, 60_000));
    accepted(&h, t().retry(exponential(1000, 1.5, 60_000))).await;
}

async fn retry_fixed_delay_is_positive(h: Harness) {
    refused(
        &h,
        t().retry(RetryPolicy::Fixed { delay_ms: 0 }),
        "retry.delay_ms",
    )
    .await;
    refused(
        &h,
        t().retry(RetryPolicy::Fixed { delay_ms: -1 }),
        "retry.delay_ms",
    )
    .await;
    let j = accepted(&h, t().retry(RetryPolicy::Fixed { delay_ms: 1 })).await;
    assert_eq!(j.retry, RetryPolicy::Fixed { delay_ms: 1 });
}

async fn retry_none_is_accepted(h: Harness) {
    let j = accepted(&h, t().retry(RetryPolicy::None)).await;
    assert_eq!(j.retry, RetryPolicy::None);
    let j = accepted(&h, t()).await;
    assert_eq!(
        j.retry,
        RetryPolicy::default(),
        "omitted resolves to the default"
    );
}

async fn timeout_bounds(h: Harness) {
    refused(&h, t().timeout(Duration::ZERO), "timeout_ms").await;
    refused(
        &h,
        t().timeout(Duration::from_millis(86_400_001)),
        "timeout_ms",
    )
    .await;
    let mut negative = t();
    negative.timeout_ms = Some(-1);
    refused(&h, negative, "timeout_ms").await;
    assert_eq!(
        accepted(&h, t().timeout(Duration::from_millis(1)))
            .await
            .timeout_ms,
        1
    );
    let j = accepted(&h, t().timeout(Duration::from_secs(24 * 3600))).await;
    assert_eq!(j.timeout_ms, 86_400_000);
}

async fn deadline_must_be_in_the_future(h: Harness) {
    let now = h.now().await;
    refused(&h, t().deadline(now), "deadline").await;
    refused(
        &h,
        t().deadline(now - chrono::Duration::seconds(1)),
        "deadline",
    )
    .await;
    let soon = now + chrono::Duration::milliseconds(1);
    assert_eq!(accepted(&h, t().deadline(soon)).await.deadline, Some(soon));
}

async fn run_at_must_be_before_the_deadline(h: Harness) {
    let now = h.now().await;
    let deadline = now + chrono::Duration::hours(1);
    refused(&h, t().deadline(deadline).run_at(deadline), "run_at").await;
    refused(
        &h,
        t().deadline(deadline)
            .run_at(deadline + chrono::Duration::seconds(1)),
        "run_at",
    )
    .await;
    let last = deadline - chrono::Duration::milliseconds(1);
    let j = accepted(&h, t().deadline(deadline).run_at(last)).await;
    assert_eq!((j.run_at, j.deadline), (last, Some(deadline)));
    // A run_at in the past is fine: the job is simply due.
    let j = accepted(
        &h,
        t().deadline(deadline)
            .run_at(now - chrono::Duration::hours(1)),
    )
    .await;
    assert_eq!(j.state, idemq::JobState::Ready);
}

async fn delay_must_end_before_the_deadline(h: Harness) {
    let deadline = h.now().await + chrono::Duration::hours(1);
    refused(
        &h,
        t().deadline(deadline).delay(Duration::from_secs(3600)),
        "delay_ms",
    )
    .await;
    refused(
        &h,
        t().deadline(deadline).delay(Duration::from_secs(7200)),
        "delay_ms",
    )
    .await;
    let j = accepted(
        &h,
        t().deadline(deadline)
            .delay(Duration::from_millis(3_599_999)),
    )
    .await;
    assert_eq!(j.run_at, deadline - chrono::Duration::milliseconds(1));
}

async fn deadline_is_not_checked_for_a_coalesced_request(h: Harness) {
    let first = accepted(&h, t().dedupe(DedupeOptions::key("d"))).await;
    let past = h.now().await - chrono::Duration::seconds(1);
    let before = h.totals().await;
    let r = h
        .queue
        .enqueue_with_result(t().deadline(past).dedupe(DedupeOptions::key("d")))
        .await
        .expect("a coalesced request is not refused for its deadline");
    assert_eq!(
        (r.job_id, r.outcome),
        (first.id.clone(), Outcome::Coalesced)
    );
    assert_eq!(h.totals().await, before);
    // Without the live binding the same request would create a job: refused.
    h.queue.cancel(&first.id).await.unwrap();
    let err = h
        .queue
        .enqueue(t().deadline(past).dedupe(DedupeOptions::key("d")))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, Error::Validation { field, .. } if field == "deadline"),
        "{err:?}"
    );
    assert_eq!(h.jobs().await.len(), 1);
}

async fn concurrency_key_bounds(h: Harness) {
    refused(&h, t().concurrency_key(""), "concurrency_key").await;
    refused(&h, t().concurrency_key(s(256)), "concurrency_key").await;
    refused(&h, t().concurrency_key(utf8(256)), "concurrency_key").await;
    refused(&h, t().concurrency_key("a\u{0}b"), "concurrency_key").await;
    let j = accepted(&h, t().concurrency_key(utf8(255))).await;
    assert_eq!(j.concurrency_key, Some(utf8(255)));
    accepted(&h, t().concurrency_key(s(255))).await;
    // Any UTF-8 is fine, spaces and slashes included.
    accepted(&h, t().concurrency_key("x")).await;
    accepted(&h, t().concurrency_key("acct 1/β")).await;
}

fn with_tags(n: usize) -> EnqueueRequest {
    (0..n).fold(t(), |r, i| r.tag(format!("tag-{i:02}")))
}

async fn tags_count_bounds(h: Harness) {
    refused(&h, with_tags(17), "tags").await;
    refused(&h, with_tags(40), "tags").await;
    let j = accepted(&h, with_tags(16)).await;
    assert_eq!(j.tags.len(), 16);
    assert_eq!(accepted(&h, t()).await.tags, Vec::<String>::new());
}

async fn duplicate_tags_collapse(h: Harness) {
    // 17 tags, one of them twice: 16 distinct, accepted.
    let req = with_tags(16).tag("tag-07");
    assert_eq!(req.tags.len(), 17);
    let j = accepted(&h, req).await;
    let want: Vec<String> = (0..16).map(|i| format!("tag-{i:02}")).collect();
    assert_eq!(j.tags, want);
    // Stored sorted and de-duplicated, whatever order they came in.
    let j = accepted(&h, t().tag("zeta").tag("alpha").tag("zeta").tag("Mu")).await;
    assert_eq!(j.tags, vec!["Mu", "alpha", "zeta"]);
}

async fn tag_length_bounds(h: Harness) {
    refused(&h, t().tag(""), "tags").await;
    refused(&h, t().tag("ok").tag(""), "tags").await;
    refused(&h, t().tag(s(65)), "tags").await;
    refused(&h, t().tag(utf8(65)), "tags").await;
    refused(&h, t().tag("a\u{0}"), "tags").await;
    let j = accepted(&h, t().tag(utf8(64)).tag("b")).await;
    assert_eq!(j.tags, vec!["b".to_string(), utf8(64)]);
    accepted(&h, t().tag(s(64))).await;
}

async fn keep_is_not_negative(h: Harness) {
    for k in [-1, i64::MIN] {
        let mut req = t();
        req.keep_ms = Some(k);
        refused(&h, req, "keep_ms").await;
    }
    assert_eq!(
        accepted(&h, t().keep(Duration::ZERO)).await.keep_ms,
        Some(0)
    );
    assert_eq!(
        accepted(&h, t().keep(Duration::from_secs(60)))
            .await
            .keep_ms,
        Some(60_000)
    );
}

fn idem(key: impl Into<String>) -> IdempotencyOptions {
    IdempotencyOptions::new(key)
}

async fn idempotency_key_bounds(h: Harness) {
    refused(&h, t().idempotency_key(""), "idempotency.key").await;
    // The key's preview is stored as text: U+0000 is refused on every backend.
    refused(&h, t().idempotency_key("a\0b-key"), "idempotency.key").await;
    refused(&h, t().idempotency_key(s(256)), "idempotency.key").await;
    refused(&h, t().idempotency_key(utf8(256)), "idempotency.key").await;
    let j = accepted(&h, t().idempotency_key(utf8(255))).await;
    let found = h.queue.lookup_key("default", &utf8(255)).await.unwrap();
    assert_eq!(found.map(|b| b.job_id), Some(j.id));
    let j = accepted(&h, t().idempotency_key("k")).await;
    let found = h.queue.lookup_key("default", "k").await.unwrap();
    assert_eq!(found.map(|b| b.job_id), Some(j.id));
    accepted(&h, t().idempotency_key(s(255))).await;
}

async fn idempotency_scope_bounds(h: Harness) {
    refused(
        &h,
        t().idempotency(idem("k").scope("")),
        "idempotency.scope",
    )
    .await;
    refused(
        &h,
        t().idempotency(idem("k").scope(s(65))),
        "idempotency.scope",
    )
    .await;
    for bad in ["a b", "a/b", "a~b", "é"] {
        refused(
            &h,
            t().idempotency(idem("k").scope(bad)),
            "idempotency.scope",
        )
        .await;
    }
    let j = accepted(&h, t().idempotency(idem("k").scope(s(64)))).await;
    let found = h.queue.lookup_key(&s(64), "k").await.unwrap();
    assert_eq!(found.map(|b| b.job_id), Some(j.id));
    accepted(&h, t().idempotency(idem("k").scope("s"))).await;
    accepted(&h, t().idempotency(idem("k").scope("Az09._:-"))).await;
}

async fn idempotency_scope_reserved_prefix(h: Harness) {
    for reserved in ["idemq.", "idemq.redrive", "idemq.schedule", "idemq.mine"] {
        refused(
            &h,
            t().idempotency(idem("k").scope(reserved)),
            "idempotency.scope",
        )
        .await;
    }
    // Only the exact prefix `idemq.` is reserved.
    for fine in ["idemq", "idemq-app", "my.idemq.x", "IDEMQ.x"] {
        let j = accepted(&h, t().idempotency(idem("k").scope(fine))).await;
        assert_eq!(j.idempotency.map(|i| i.scope).as_deref(), Some(fine));
    }
}

async fn idempotency_ttl_bounds(h: Harness) {
    let ttl = |ms: i64| {
        let mut o = idem("k");
        o.ttl_ms = Some(ms);
        t().idempotency(o)
    };
    refused(&h, ttl(999), "idempotency.ttl_ms").await;
    refused(&h, ttl(0), "idempotency.ttl_ms").await;
    refused(&h, ttl(-1000), "idempotency.ttl_ms").await;
    refused(&h, ttl(THIRTY_DAYS_MS + 1), "idempotency.ttl_ms").await;
    let now = h.now().await;
    let j = accepted(&h, ttl(1000)).await;
    let b = h.queue.lookup_key("default", "k").await.unwrap().unwrap();
    assert_eq!(b.job_id, j.id);
    assert_eq!(b.expires_at, now + chrono::Duration::seconds(1));
    h.advance_ms(1000);
    let j = accepted(&h, ttl(THIRTY_DAYS_MS)).await;
    let b = h.queue.lookup_key("default", "k").await.unwrap().unwrap();
    assert_eq!(b.job_id, j.id);
    assert_eq!(b.expires_at, h.now().await + chrono::Duration::days(30));
}

fn dd(key: impl Into<String>) -> DedupeOptions {
    DedupeOptions::key(key)
}

async fn dedupe_key_bounds(h: Harness) {
    refused(&h, t().dedupe(dd("")), "dedupe.key").await;
    refused(&h, t().dedupe(dd(s(256))), "dedupe.key").await;
    refused(&h, t().dedupe(dd(utf8(256))), "dedupe.key").await;
    refused(&h, t().dedupe(dd("a\u{0}b")), "dedupe.key").await;
    let j = accepted(&h, t().dedupe(dd(utf8(255)))).await;
    let live = h.queue.dedupe_lookup("t", &utf8(255)).await.unwrap();
    assert_eq!(live.map(|b| b.job_id), Some(j.id.clone()));
    assert_eq!(j.dedupe.map(|d| d.key), Some(utf8(255)));
    accepted(&h, t().dedupe(dd(s(255)))).await;
    accepted(&h, t().dedupe(dd("k"))).await;
}

fn ttl_ms(mut d: DedupeOptions, ms: i64) -> DedupeOptions {
    d.ttl_ms = Some(ms);
    d
}

fn max_wait_ms(mut d: DedupeOptions, ms: i64) -> DedupeOptions {
    d.max_wait_ms = Some(ms);
    d
}

async fn dedupe_ttl_bounds(h: Harness) {
    refused(&h, t().dedupe(ttl_ms(dd("a"), 0)), "dedupe.ttl_ms").await;
    refused(&h, t().dedupe(ttl_ms(dd("a"), -1)), "dedupe.ttl_ms").await;
    refused(
        &h,
        t().dedupe(ttl_ms(dd("a"), THIRTY_DAYS_MS + 1)),
        "dedupe.ttl_ms",
    )
    .await;
    refused(
        &h,
        t().dedupe(ttl_ms(dd("a").extend(), THIRTY_DAYS_MS + 1)),
        "dedupe.ttl_ms",
    )
    .await;
    refused(
        &h,
        t().dedupe(ttl_ms(dd("a").replace(), 0)),
        "dedupe.ttl_ms",
    )
    .await;
    let now = h.now().await;
    accepted(&h, t().dedupe(ttl_ms(dd("a"), 1))).await;
    let b = h.queue.dedupe_lookup("t", "a").await.unwrap().unwrap();
    assert_eq!(
        b.window_until,
        Some(now + chrono::Duration::milliseconds(1))
    );
    accepted(&h, t().dedupe(ttl_ms(dd("b"), THIRTY_DAYS_MS))).await;
    let b = h.queue.dedupe_lookup("t", "b").await.unwrap().unwrap();
    assert_eq!(b.window_until, Some(now + chrono::Duration::days(30)));
    accepted(&h, t().dedupe(ttl_ms(dd("c").extend(), THIRTY_DAYS_MS))).await;
}

async fn dedupe_max_wait_bounds(h: Harness) {
    refused(
        &h,
        t().dedupe(max_wait_ms(dd("a").replace(), 0)),
        "dedupe.max_wait_ms",
    )
    .await;
    refused(
        &h,
        t().dedupe(max_wait_ms(dd("a").replace(), -1)),
        "dedupe.max_wait_ms",
    )
    .await;
    refused(
        &h,
        t().dedupe(max_wait_ms(dd("a").replace(), THIRTY_DAYS_MS + 1)),
        "dedupe.max_wait_ms",
    )
    .await;
    refused(
        &h,
        t().dedupe(max_wait_ms(ttl_ms(dd("a").extend(), 1), THIRTY_DAYS_MS + 1)),
        "dedupe.max_wait_ms",
    )
    .await;
    accepted(&h, t().dedupe(max_wait_ms(dd("a").replace(), 1))).await;
    accepted(
        &h,
        t().dedupe(max_wait_ms(dd("b").replace(), THIRTY_DAYS_MS)),
    )
    .await;
    accepted(
        &h,
        t().dedupe(max_wait_ms(ttl_ms(dd("c").extend(), 1), THIRTY_DAYS_MS)),
    )
    .await;
}

async fn dedupe_extend_needs_ttl(h: Harness) {
    refused(&h, t().dedupe(dd("a").extend()), "dedupe.extend").await;
    refused(
        &h,
        t().dedupe(dd("a").extend().max_wait(Duration::from_secs(5))),
        "dedupe.extend",
    )
    .await;
    let j = accepted(&h, t().dedupe(dd("a").extend().ttl(Duration::from_secs(5)))).await;
    assert_eq!(j.dedupe.map(|d| d.mode), Some(idemq::DedupeMode::Debounce));
}

async fn dedupe_extend_excludes_replace(h: Harness) {
    refused(
        &h,
        t().dedupe(dd("a").extend().replace().ttl(Duration::from_secs(5))),
        "dedupe.extend",
    )
    .await;
    let j = accepted(
        &h,
        t().dedupe(dd("a").replace().ttl(Duration::from_secs(5))),
    )
    .await;
    assert_eq!(j.dedupe.map(|d| d.mode), Some(idemq::DedupeMode::Replace));
}

async fn dedupe_max_wait_only_for_debounce_and_replace(h: Harness) {
    // Pending mode.
    refused(
        &h,
        t().dedupe(dd("a").max_wait(Duration::from_secs(5))),
        "dedupe.max_wait_ms",
    )
    .await;
    // Throttle mode.
    refused(
        &h,
        t().dedupe(
            dd("a")
                .ttl(Duration::from_secs(5))
                .max_wait(Duration::from_secs(10)),
        ),
        "dedupe.max_wait_ms",
    )
    .await;
    let debounce = dd("b")
        .extend()
        .ttl(Duration::from_secs(5))
        .max_wait(Duration::from_secs(10));
    let j = accepted(&h, t().dedupe(debounce)).await;
    assert_eq!(j.dedupe.map(|d| d.mode), Some(idemq::DedupeMode::Debounce));
    let j = accepted(
        &h,
        t().dedupe(dd("c").replace().max_wait(Duration::from_secs(10))),
    )
    .await;
    assert_eq!(j.dedupe.map(|d| d.mode), Some(idemq::DedupeMode::Replace));
}

async fn dedupe_max_wait_not_below_ttl(h: Harness) {
    let both = |d: DedupeOptions, ttl: u64, wait: u64| {
        t().dedupe(
            d.ttl(Duration::from_millis(ttl))
                .max_wait(Duration::from_millis(wait)),
        )
    };
    refused(&h, both(dd("a").extend(), 5000, 4999), "dedupe.max_wait_ms").await;
    refused(
        &h,
        both(dd("a").replace(), 5000, 4999),
        "dedupe.max_wait_ms",
    )
    .await;
    refused(&h, both(dd("a").extend(), 5000, 1), "dedupe.max_wait_ms").await;
    accepted(&h, both(dd("a").extend(), 5000, 5000)).await;
    accepted(&h, both(dd("b").replace(), 5000, 5000)).await;
    accepted(&h, both(dd("c").extend(), 5000, 5001)).await;
}

async fn refused_request_binds_neither_key(h: Harness) {
    // A request refused at the store (its deadline passed) binds no key: the
    // same keys then take a valid request as a new job, not a conflict.
    let past = h.now().await - chrono::Duration::seconds(1);
    let keyed = || t().idempotency_key("ik").dedupe(dd("dk"));
    refused(&h, keyed().deadline(past), "deadline").await;
    let r = h.queue.enqueue_with_result(keyed()).await.unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    let b = h.queue.lookup_key("default", "ik").await.unwrap().unwrap();
    assert_eq!(b.job_id, r.job_id);
    let d = h.queue.dedupe_lookup("t", "dk").await.unwrap().unwrap();
    assert_eq!(d.job_id, r.job_id);
    assert_eq!(h.totals().await, (1, 1));
}

/// U+0000 can be stored by no backend alike, so an id or a name holding it
/// matches nothing: lookups find nothing, actions are refused as on an
/// unknown job, filters are invalid, and a worker's error text keeps the
/// rest of its message.
async fn nul_in_ids_and_names_matches_nothing(h: Harness) {
    let q = &h.queue;
    let bad = "job\0id";
    assert!(q.get(bad).await.unwrap().is_none());
    assert!(q.events(bad).await.unwrap().is_empty());
    assert!(q.runs(bad).await.unwrap().is_empty());
    assert!(q.checkpoints(bad).await.unwrap().is_empty());
    assert!(q.checkpoint_get(bad, "step").await.unwrap().is_none());
    assert!(matches!(q.cancel(bad).await, Err(Error::NotFound { .. })));
    assert!(matches!(q.promote(bad).await, Err(Error::NotFound { .. })));
    assert!(matches!(
        q.redrive(bad, idemq::RedriveOptions::default()).await,
        Err(Error::NotFound { .. })
    ));
    assert!(!q.purge(bad).await.unwrap());
    assert!(!q.cancel_by_key("t", "k\0").await.unwrap());
    let (token, nul_token) = (
        idemq::LeaseToken::new("token"),
        idemq::LeaseToken::new("tok\0en"),
    );
    for lost in [
        q.heartbeat(bad, &token).await.map(|_| ()),
        q.complete(bad, &token, None).await,
        q.release("id", &nul_token).await.map(|_| ()),
        q.checkpoint_put(bad, &token, "step", &serde_json::json!(1))
            .await
            .map(|_| ()),
    ] {
        assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
    }
    let filter = idemq::JobList {
        limit: 10,
        queue: Some("q\0".into()),
        ..idemq::JobList::default()
    };
    assert!(matches!(
        q.list(filter).await,
        Err(Error::Validation { .. })
    ));
    let claim = idemq::ClaimOptions {
        queues: vec!["q\0".into()],
        ..idemq::ClaimOptions::default()
    };
    assert!(matches!(
        q.claim(claim).await,
        Err(Error::Validation { .. })
    ));
    // A worker's error text with U+0000 is kept, the character replaced.
    let id = h.put(t()).await;
    let c = h.claim_one().await;
    q.fail(
        &id,
        &c.lease_token,
        idemq::FailOptions {
            error: "bad\0byte".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        h.job(&id).await.last_error.as_deref(),
        Some("bad\u{fffd}byte")
    );
}
