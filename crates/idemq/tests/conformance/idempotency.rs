//! Conformance cases: idempotent enqueue (docs/idempotency.md).

use std::sync::Arc;
use std::time::Duration;

use idemq::{
    ConflictSource, DedupeOptions, EnqueueRequest, Error, IdempotencyOptions, Outcome, Queue,
    QueueOptions,
};
use idemq_testkit::Harness;
use serde_json::json;

idemq_testkit::instantiate!(
    replay_writes_nothing,
    conflict_names_exactly_the_differing_fields,
    conflict_writes_nothing_and_holds_no_raw_key,
    payload_key_order_and_whitespace_are_irrelevant,
    payload_number_forms_are_canonical,
    defaults_are_resolved_before_the_fingerprint,
    omitted_run_at_replays_later,
    delay_zero_is_the_same_as_omitted,
    explicit_run_at_is_compared_as_given,
    priority_keep_and_dedupe_are_not_fingerprinted,
    scopes_are_separate,
    key_ttl_is_part_of_the_fingerprint,
    binding_expires_after_its_ttl,
    replays_do_not_extend_the_window,
    purge_releases_the_key_of_a_never_started_job,
    purge_keeps_the_key_of_a_job_that_ran,
    explicit_job_id_replays_and_conflicts,
    explicit_job_id_ignores_key_retention,
    explicit_job_id_replay_binds_the_key,
    retried_request_after_its_deadline_is_replayed,
    new_request_with_a_past_deadline_is_refused,
    new_request_due_at_its_deadline_is_refused_for_the_field_that_set_it,
    raw_key_is_absent_from_the_database_files,
    job_shows_key_preview_and_digest,
    key_secret_changes_the_binding,
    concurrent_identical_requests_make_one_job,
    concurrent_conflicting_requests_accept_one,
    lookup_and_release_a_key,
    non_error_outcomes_bind_the_key,
    harness_reports_its_backend,
);

fn capture(payload: serde_json::Value) -> EnqueueRequest {
    EnqueueRequest::new("invoice.capture")
        .queue("billing")
        .payload(payload)
        .idempotency_key("capture:inv_42")
}

async fn replay_writes_nothing(h: Harness) {
    let first = h
        .queue
        .enqueue_with_result(capture(json!({"id": 42})))
        .await
        .unwrap();
    assert_eq!(first.outcome, Outcome::Accepted);
    let before = h.totals().await;
    assert_eq!(before, (1, 1), "one job, one `accepted` event");
    for _ in 0..3 {
        let again = h
            .queue
            .enqueue_with_result(capture(json!({"id": 42})))
            .await
            .unwrap();
        assert_eq!(again.outcome, Outcome::Replayed);
        assert_eq!(again.job_id, first.job_id);
    }
    assert_eq!(
        h.totals().await,
        before,
        "a replay writes no job and no event"
    );
}

async fn conflict_names_exactly_the_differing_fields(h: Harness) {
    let id = h.put(capture(json!({"id": 42}))).await;
    let err = h
        .queue
        .enqueue(capture(json!({"id": 43})).max_attempts(3).tag("x"))
        .await
        .unwrap_err();
    let c = err.conflict().expect("a conflict");
    assert_eq!(c.job_id, id);
    assert_eq!(c.source, ConflictSource::IdempotencyKey);
    assert_eq!(c.fields, vec!["max_attempts", "payload", "tags"]);
    assert_eq!(c.scope.as_deref(), Some("default"));
    assert_eq!(c.key_preview.as_deref(), Some("capture…"));
    assert_eq!(c.key_digest.as_ref().map(String::len), Some(16));
}

async fn conflict_writes_nothing_and_holds_no_raw_key(h: Harness) {
    let raw = "order-submit:customer-981:cart-5521";
    let req = |p| EnqueueRequest::new("t").payload(p).idempotency_key(raw);
    h.put(req(json!(1))).await;
    let before = h.totals().await;
    let err = h.queue.enqueue(req(json!(2))).await.unwrap_err();
    assert!(matches!(err, Error::EnqueueIdempotencyConflict(_)));
    assert_eq!(h.totals().await, before);
    let text = format!("{err} {err:?}");
    assert!(!text.contains(raw), "error text holds the raw key: {text}");
    assert!(
        !format!("{:?}", req(json!(1))).contains(raw),
        "Debug of a request holds the raw key"
    );
}

async fn payload_key_order_and_whitespace_are_irrelevant(h: Harness) {
    let a: serde_json::Value = serde_json::from_str(r#"{"b":1,"a":{"y":[1,2],"x":"s"}}"#).unwrap();
    let b: serde_json::Value =
        serde_json::from_str("{ \"a\" : { \"x\" : \"s\", \"y\" : [ 1 , 2 ] },\n \"b\" : 1 }")
            .unwrap();
    let id = h.put(capture(a)).await;
    let r = h.queue.enqueue_with_result(capture(b)).await.unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn payload_number_forms_are_canonical(h: Harness) {
    let a: serde_json::Value = serde_json::from_str(r#"{"n":1.0,"e":1e2}"#).unwrap();
    let b: serde_json::Value = serde_json::from_str(r#"{"n":1,"e":100}"#).unwrap();
    let id = h.put(capture(a)).await;
    assert_eq!(h.queue.enqueue(capture(b)).await.unwrap(), id);
    // Integers beyond 2^53 keep every digit: these two differ.
    let big1: serde_json::Value = serde_json::from_str(r#"{"n":9007199254740993}"#).unwrap();
    let big2: serde_json::Value = serde_json::from_str(r#"{"n":9007199254740992}"#).unwrap();
    let req = |p| EnqueueRequest::new("t").payload(p).idempotency_key("big");
    h.put(req(big1)).await;
    let err = h.queue.enqueue(req(big2)).await.unwrap_err();
    assert_eq!(err.conflict().unwrap().fields, vec!["payload"]);
    // And beyond 64 bits, where a double would make these two one number:
    // they conflict, and the job keeps every digit.
    let text = r#"{"n":18446744073709551617123,"m":-18446744073709551617}"#;
    let huge1: serde_json::Value = serde_json::from_str(text).unwrap();
    let huge2: serde_json::Value =
        serde_json::from_str(r#"{"n":18446744073709551617124,"m":-18446744073709551617}"#).unwrap();
    let req = |p| EnqueueRequest::new("t").payload(p).idempotency_key("huge");
    let id = h.put(req(huge1.clone())).await;
    let err = h.queue.enqueue(req(huge2)).await.unwrap_err();
    assert_eq!(err.conflict().unwrap().fields, vec!["payload"]);
    let again = h.queue.enqueue_with_result(req(huge1)).await.unwrap();
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (id.as_str(), Outcome::Replayed)
    );
    let stored = serde_json::to_string(&h.job(&id).await.payload).unwrap();
    assert!(stored.contains("18446744073709551617123"), "{stored}");
    assert!(stored.contains("-18446744073709551617"), "{stored}");
}

async fn defaults_are_resolved_before_the_fingerprint(h: Harness) {
    let bare = EnqueueRequest::new("t").idempotency_key("k");
    let id = h.put(bare).await;
    let explicit = EnqueueRequest::new("t")
        .queue("default")
        .max_attempts(10)
        .timeout(Duration::from_secs(30 * 60))
        .retry(idemq::RetryPolicy::default())
        .payload(serde_json::Value::Null)
        .idempotency(
            IdempotencyOptions::new("k")
                .scope("default")
                .ttl(Duration::from_secs(86_400)),
        );
    let r = h.queue.enqueue_with_result(explicit).await.unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn omitted_run_at_replays_later(h: Harness) {
    let id = h.put(EnqueueRequest::new("t").idempotency_key("k")).await;
    h.advance(Duration::from_secs(3600));
    let r = h
        .queue
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn delay_zero_is_the_same_as_omitted(h: Harness) {
    let id = h.put(EnqueueRequest::new("t").idempotency_key("k")).await;
    let r = h
        .queue
        .enqueue_with_result(
            EnqueueRequest::new("t")
                .delay(Duration::ZERO)
                .idempotency_key("k"),
        )
        .await
        .unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn explicit_run_at_is_compared_as_given(h: Harness) {
    let at = h.now().await + chrono::Duration::minutes(5);
    let req = |at| EnqueueRequest::new("t").run_at(at).idempotency_key("k");
    let id = h.put(req(at)).await;
    // Sub-microsecond differences are truncated away.
    let r = h
        .queue
        .enqueue_with_result(req(at + chrono::Duration::nanoseconds(300)))
        .await
        .unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
    let err = h
        .queue
        .enqueue(req(at + chrono::Duration::seconds(1)))
        .await
        .unwrap_err();
    assert_eq!(err.conflict().unwrap().fields, vec!["run_at"]);
    let err = h
        .queue
        .enqueue(
            EnqueueRequest::new("t")
                .delay(Duration::from_secs(300))
                .idempotency_key("k"),
        )
        .await
        .unwrap_err();
    assert_eq!(err.conflict().unwrap().fields, vec!["delay_ms", "run_at"]);
}

async fn priority_keep_and_dedupe_are_not_fingerprinted(h: Harness) {
    let id = h.put(EnqueueRequest::new("t").idempotency_key("k")).await;
    let r = h
        .queue
        .enqueue_with_result(
            EnqueueRequest::new("t")
                .priority(9)
                .keep(Duration::from_secs(5))
                .dedupe(DedupeOptions::key("d"))
                .idempotency_key("k"),
        )
        .await
        .unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn scopes_are_separate(h: Harness) {
    let req = |scope: &str| {
        EnqueueRequest::new("t").idempotency(IdempotencyOptions::new("same-key").scope(scope))
    };
    let a = h.queue.enqueue_with_result(req("alpha")).await.unwrap();
    let b = h.queue.enqueue_with_result(req("beta")).await.unwrap();
    assert_eq!(
        (a.outcome, b.outcome),
        (Outcome::Accepted, Outcome::Accepted)
    );
    assert_ne!(a.job_id, b.job_id);
    let d = h
        .queue
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("same-key"))
        .await;
    assert_eq!(
        d.unwrap().outcome,
        Outcome::Accepted,
        "the default scope is a third scope"
    );
}

async fn key_ttl_is_part_of_the_fingerprint(h: Harness) {
    let req = |secs| {
        EnqueueRequest::new("t")
            .idempotency(IdempotencyOptions::new("k").ttl(Duration::from_secs(secs)))
    };
    h.put(req(60)).await;
    let err = h.queue.enqueue(req(120)).await.unwrap_err();
    assert_eq!(err.conflict().unwrap().fields, vec!["idempotency.ttl_ms"]);
}

async fn binding_expires_after_its_ttl(h: Harness) {
    let req = || {
        EnqueueRequest::new("t")
            .idempotency(IdempotencyOptions::new("k").ttl(Duration::from_secs(10)))
    };
    let first = h.put(req()).await;
    h.advance_ms(9_999);
    assert_eq!(
        h.queue.enqueue_with_result(req()).await.unwrap().outcome,
        Outcome::Replayed
    );
    h.advance_ms(1);
    let second = h.queue.enqueue_with_result(req()).await.unwrap();
    assert_eq!(
        second.outcome,
        Outcome::Accepted,
        "an expired binding is ignored at once"
    );
    assert_ne!(second.job_id, first);
    // A different payload after expiry is a new job too, not a conflict.
    h.advance_ms(10_000);
    let third = h
        .queue
        .enqueue_with_result(req().payload(json!("other")))
        .await
        .unwrap();
    assert_eq!(third.outcome, Outcome::Accepted);
}

async fn replays_do_not_extend_the_window(h: Harness) {
    let req = || {
        EnqueueRequest::new("t")
            .idempotency(IdempotencyOptions::new("k").ttl(Duration::from_secs(10)))
    };
    let first = h.put(req()).await;
    h.advance_ms(5_000);
    assert_eq!(h.queue.enqueue(req()).await.unwrap(), first);
    h.advance_ms(5_000);
    assert_ne!(h.queue.enqueue(req()).await.unwrap(), first);
}

async fn purge_releases_the_key_of_a_never_started_job(h: Harness) {
    let first = h.put(EnqueueRequest::new("t").idempotency_key("k")).await;
    assert!(h.queue.purge(&first).await.unwrap());
    assert!(h.queue.get(&first).await.unwrap().is_none());
    let again = h
        .queue
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Accepted);
    assert_ne!(again.job_id, first);
}

async fn purge_keeps_the_key_of_a_job_that_ran(h: Harness) {
    let first = h.put(EnqueueRequest::new("t").idempotency_key("k")).await;
    let c = h.claim_one().await;
    h.queue.complete(&c.id, &c.lease_token, None).await.unwrap();
    assert!(h.queue.purge(&first).await.unwrap());
    let again = h
        .queue
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (first.as_str(), Outcome::Replayed)
    );
    assert!(
        h.queue.get(&first).await.unwrap().is_none(),
        "the purged id stays purged"
    );
    assert_eq!(h.totals().await, (0, 0));
}

async fn explicit_job_id_replays_and_conflicts(h: Harness) {
    let req = |p| EnqueueRequest::new("t").job_id("order-1").payload(p);
    let a = h.queue.enqueue_with_result(req(json!(1))).await.unwrap();
    assert_eq!(
        (a.job_id.as_str(), a.outcome),
        ("order-1", Outcome::Accepted)
    );
    let b = h.queue.enqueue_with_result(req(json!(1))).await.unwrap();
    assert_eq!(b.outcome, Outcome::Replayed);
    let before = h.totals().await;
    let err = h.queue.enqueue(req(json!(2))).await.unwrap_err();
    let c = err.conflict().unwrap();
    assert_eq!(c.source, ConflictSource::JobId);
    assert_eq!(
        (c.scope.clone(), c.key_preview.clone(), c.key_digest.clone()),
        (None, None, None)
    );
    assert_eq!(c.fields, vec!["payload"]);
    assert_eq!(h.totals().await, before);
}

async fn explicit_job_id_ignores_key_retention(h: Harness) {
    let req = |key: &str, secs| {
        EnqueueRequest::new("t")
            .job_id("order-2")
            .idempotency(IdempotencyOptions::new(key).ttl(Duration::from_secs(secs)))
    };
    h.put(req("k1", 60)).await;
    let r = h.queue.enqueue_with_result(req("k2", 120)).await.unwrap();
    assert_eq!(
        (r.job_id.as_str(), r.outcome),
        ("order-2", Outcome::Replayed)
    );
}

async fn explicit_job_id_replay_binds_the_key(h: Harness) {
    h.put(EnqueueRequest::new("t").job_id("order-3")).await;
    let keyed = EnqueueRequest::new("t")
        .job_id("order-3")
        .idempotency_key("k3");
    assert_eq!(
        h.queue
            .enqueue_with_result(keyed.clone())
            .await
            .unwrap()
            .outcome,
        Outcome::Replayed
    );
    let found = h
        .queue
        .lookup_key("default", "k3")
        .await
        .unwrap()
        .expect("bound");
    assert_eq!(found.job_id, "order-3");
}

async fn retried_request_after_its_deadline_is_replayed(h: Harness) {
    let deadline = h.now().await + chrono::Duration::minutes(1);
    let req = || {
        EnqueueRequest::new("t")
            .deadline(deadline)
            .idempotency_key("k")
    };
    let id = h.put(req()).await;
    h.advance(Duration::from_secs(120));
    let r = h.queue.enqueue_with_result(req()).await.unwrap();
    assert_eq!((r.job_id, r.outcome), (id, Outcome::Replayed));
}

async fn new_request_with_a_past_deadline_is_refused(h: Harness) {
    let past = h.now().await - chrono::Duration::seconds(1);
    let err = h
        .queue
        .enqueue(EnqueueRequest::new("t").deadline(past).idempotency_key("k"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "deadline"),
        "{err:?}"
    );
    assert_eq!(h.totals().await, (0, 0));
    assert!(
        h.queue.lookup_key("default", "k").await.unwrap().is_none(),
        "no binding written"
    );
}

async fn new_request_due_at_its_deadline_is_refused_for_the_field_that_set_it(h: Harness) {
    let deadline = h.now().await + chrono::Duration::hours(1);
    for (req, field) in [
        (EnqueueRequest::new("t").run_at(deadline), "run_at"),
        (
            EnqueueRequest::new("t").delay(Duration::from_secs(7200)),
            "delay_ms",
        ),
    ] {
        let err = h
            .queue
            .enqueue(req.deadline(deadline).idempotency_key("k"))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Validation { field: f, .. } if f == field),
            "{err:?}"
        );
    }
    assert_eq!(h.totals().await, (0, 0));
    assert!(
        h.queue.lookup_key("default", "k").await.unwrap().is_none(),
        "no binding written"
    );
    // Due just before its deadline, the same request is accepted.
    let due = deadline - chrono::Duration::milliseconds(1);
    let r = h
        .queue
        .enqueue_with_result(
            EnqueueRequest::new("t")
                .run_at(due)
                .deadline(deadline)
                .idempotency_key("k"),
        )
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    let job = h.queue.get(&r.job_id).await.unwrap().expect("its job");
    assert_eq!((job.run_at, job.deadline), (due, Some(deadline)));
}

async fn raw_key_is_absent_from_the_database_files(h: Harness) {
    let raw = "raw-key-7f3a9c-never-stored";
    let req = |p| EnqueueRequest::new("t").payload(p).idempotency_key(raw);
    h.put(req(json!(1))).await;
    h.put(req(json!(1))).await;
    assert!(h.queue.enqueue(req(json!(2))).await.is_err());
    h.queue.explain(req(json!(3))).await.unwrap();
    if let Some(url) = &h.db_url {
        // PostgreSQL: the whole database as pg_dump writes it, and the
        // statement statistics when pg_stat_statements is loaded.
        let dump = std::process::Command::new("pg_dump")
            .arg(url)
            .output()
            .expect("pg_dump is installed (Debian: postgresql-client)");
        assert!(
            dump.status.success(),
            "pg_dump failed: {}",
            String::from_utf8_lossy(&dump.stderr)
        );
        assert!(
            dump.stdout.len() > 1000,
            "the dump holds the schema and the rows"
        );
        assert!(
            !String::from_utf8_lossy(&dump.stdout).contains(raw),
            "the raw key is in pg_dump"
        );
        assert!(
            String::from_utf8_lossy(&dump.stdout).contains("raw-key-…"),
            "the preview is stored"
        );
        return;
    }
    if let (Some(url), Some(prefix)) = (&h.redis_url, &h.redis_prefix) {
        // Redis: every key and value of the installation, and the append-only
        // files of the server when the test kit started it.
        let contents = idemq_testkit::redis_contents(url, prefix)
            .await
            .expect("read the installation");
        assert!(!contents.contains(raw), "the raw key is stored in Redis");
        assert!(contents.contains("raw-key-…"), "the preview is stored");
        if let Some(dir) = idemq_testkit::redis_dir() {
            let mut scanned = 0;
            let mut files = vec![dir.to_path_buf()];
            while let Some(path) = files.pop() {
                if path.is_dir() {
                    files.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
                } else if let Ok(bytes) = std::fs::read(&path) {
                    scanned += bytes.len();
                    assert!(
                        !bytes.windows(raw.len()).any(|w| w == raw.as_bytes()),
                        "the raw key is in {}",
                        path.display()
                    );
                }
            }
            assert!(scanned > 0, "the server keeps its data on disk");
        }
        return;
    }
    let file = h
        .db_file
        .as_ref()
        .expect("a SQLite, PostgreSQL or Redis database");
    let dir = file.parent().unwrap();
    let mut scanned = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let bytes = std::fs::read(entry.unwrap().path()).unwrap();
        scanned += bytes.len();
        assert!(
            !bytes.windows(raw.len()).any(|w| w == raw.as_bytes()),
            "the raw key is in the database files"
        );
    }
    assert!(scanned > 0);
}

async fn job_shows_key_preview_and_digest(h: Harness) {
    let id = h.put(capture(json!(1))).await;
    let job = h.job(&id).await;
    let k = job.idempotency.expect("key details");
    assert_eq!(k.scope, "default");
    assert_eq!(k.key_preview, "capture…");
    assert_eq!(k.key_digest.len(), 16);
    assert_eq!(
        k.expires_at,
        Some(h.now().await + chrono::Duration::hours(24))
    );
}

async fn key_secret_changes_the_binding(h: Harness) {
    let plain = h.put(EnqueueRequest::new("t").idempotency_key("k")).await;
    let keyed = Queue::from_store(
        h.queue.store().clone(),
        QueueOptions {
            key_secret: Some(b"installation-secret".to_vec()),
            ..QueueOptions::default()
        },
    );
    let r = keyed
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    assert_eq!(
        r.outcome,
        Outcome::Accepted,
        "a keyed hash is another binding"
    );
    assert_ne!(r.job_id, plain);
    let again = keyed
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("k"))
        .await
        .unwrap();
    assert_eq!((again.job_id, again.outcome), (r.job_id, Outcome::Replayed));
}

async fn concurrent_identical_requests_make_one_job(h: Harness) {
    let queue = Arc::new(h.queue.clone());
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let q = queue.clone();
            tokio::spawn(async move { q.enqueue_with_result(capture(json!({"id": 42}))).await })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    let mut accepted = 0;
    for t in tasks {
        let r = t.await.unwrap().expect("no caller sees an error");
        ids.insert(r.job_id);
        accepted += usize::from(r.outcome == Outcome::Accepted);
    }
    assert_eq!((ids.len(), accepted), (1, 1));
    assert_eq!(h.totals().await, (1, 1));
}

async fn concurrent_conflicting_requests_accept_one(h: Harness) {
    let queue = Arc::new(h.queue.clone());
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            let q = queue.clone();
            tokio::spawn(async move { q.enqueue_with_result(capture(json!({"id": i}))).await })
        })
        .collect();
    let (mut accepted, mut conflicts) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => accepted += usize::from(r.outcome == Outcome::Accepted),
            Err(Error::EnqueueIdempotencyConflict(_)) => conflicts += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert_eq!((accepted, conflicts), (1, 15));
    assert_eq!(h.totals().await.0, 1);
}

async fn lookup_and_release_a_key(h: Harness) {
    let id = h
        .put(EnqueueRequest::new("t").idempotency_key("order-77"))
        .await;
    let found = h
        .queue
        .lookup_key("default", "order-77")
        .await
        .unwrap()
        .expect("bound");
    assert_eq!(found.job_id, id);
    assert_eq!(
        found.key_preview, "orde…",
        "min(8, n/2) characters of an 8-character key"
    );
    assert!(
        h.queue
            .lookup_key("other", "order-77")
            .await
            .unwrap()
            .is_none()
    );
    assert!(h.queue.release_key("default", "order-77").await.unwrap());
    assert!(
        !h.queue.release_key("default", "order-77").await.unwrap(),
        "released once"
    );
    assert!(
        h.event_kinds(&id)
            .await
            .contains(&"binding_released".to_string())
    );
    let again = h
        .queue
        .enqueue_with_result(EnqueueRequest::new("t").idempotency_key("order-77"))
        .await
        .unwrap();
    assert_eq!(again.outcome, Outcome::Accepted);
    assert_ne!(again.job_id, id);
}

async fn non_error_outcomes_bind_the_key(h: Harness) {
    let keyed = h
        .put(EnqueueRequest::new("sync").dedupe(DedupeOptions::key("acct-1")))
        .await;
    let req = || {
        EnqueueRequest::new("sync")
            .dedupe(DedupeOptions::key("acct-1"))
            .idempotency_key("k9")
    };
    let r = h.queue.enqueue_with_result(req()).await.unwrap();
    assert_eq!(
        (r.job_id.as_str(), r.outcome),
        (keyed.as_str(), Outcome::Coalesced)
    );
    // Once the keyed job is gone from the dedupe point of view, the key still replays.
    h.queue.cancel(&keyed).await.unwrap();
    let again = h.queue.enqueue_with_result(req()).await.unwrap();
    assert_eq!((again.job_id, again.outcome), (keyed, Outcome::Replayed));
}

async fn harness_reports_its_backend(h: Harness) {
    assert_eq!(h.queue.backend(), h.backend);
}
