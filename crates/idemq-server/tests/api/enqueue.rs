//! Enqueue, batch and explain.

use serde_json::json;

use crate::harness::{Backend, Server};

instantiate!(
    enqueue_outcomes,
    idempotency_header,
    conflict_holds_no_raw_key,
    malformed_bodies_are_bad_requests,
    validation_and_limits,
    batch_items,
    batch_atomic,
    atomic_batch_keeps_the_item_problem,
    explain_writes_nothing,
    wire_forms_the_document_states,
    numbers_keep_their_digits,
);

async fn enqueue_outcomes(b: Backend) {
    let s = Server::start(b).await;
    let body = json!({"type": "invoice.capture", "payload": {"invoice_id": "inv_42"},
        "queue": "billing", "idempotency": {"key": "capture:inv_42", "scope": "invoice-capture"}});
    let a = s.post("/v1/jobs", body.clone()).await;
    let first = a.ok(201).clone();
    assert_eq!(first["outcome"], "accepted");
    assert!(first.get("reason").is_none());
    let a = s.post("/v1/jobs", body).await;
    assert_eq!(a.ok(200)["outcome"], "replayed");
    assert_eq!(a.body["job_id"], first["job_id"]);

    // Dedupe as a bare string: pending mode coalesces.
    let d = json!({"type": "sync", "dedupe": "acct-1"});
    let one = s.post("/v1/jobs", d.clone()).await.ok(201).clone();
    let two = s.post("/v1/jobs", d).await;
    assert_eq!(two.ok(200)["outcome"], "coalesced");
    assert_eq!(two.body["job_id"], one["job_id"]);

    // Replace meeting a pending binding: non_replaceable with a reason.
    let r = s
        .post(
            "/v1/jobs",
            json!({"type": "sync", "dedupe": {"key": "acct-1", "replace": true}}),
        )
        .await;
    assert_eq!(r.ok(200)["outcome"], "non_replaceable");
    assert_eq!(r.body["reason"], "incompatible_mode");

    // Replace landing on a waiting, not yet due job.
    let rep =
        json!({"type": "digest", "delay_ms": 600000, "dedupe": {"key": "u1", "replace": true}});
    let first = s.post("/v1/jobs", rep.clone()).await.ok(201).clone();
    let again = s.post("/v1/jobs", rep).await;
    assert_eq!(again.ok(200)["outcome"], "replaced");
    assert_eq!(again.body["job_id"], first["job_id"]);
    s.stop().await;
}

async fn idempotency_header(b: Backend) {
    let s = Server::start(b).await;
    let body = json!({"type": "email.send", "payload": {"to": "a@example.com"}});
    // A structured-field string and a bare token name the same key.
    let a = s
        .post_with(
            "/v1/jobs",
            body.clone(),
            &[("idempotency-key", "\"order-77\"")],
        )
        .await;
    let id = a.ok(201)["job_id"].clone();
    let a = s
        .post_with("/v1/jobs", body.clone(), &[("idempotency-key", "order-77")])
        .await;
    assert_eq!(a.ok(200)["outcome"], "replayed");
    assert_eq!(a.body["job_id"], id);
    // The header equals a body key: fine. It differs: 422, nothing written.
    let mut with_key = body.clone();
    with_key["idempotency"] = json!({"key": "order-77"});
    let a = s
        .post_with(
            "/v1/jobs",
            with_key.clone(),
            &[("idempotency-key", "order-77")],
        )
        .await;
    assert_eq!(a.ok(200)["outcome"], "replayed");
    let a = s
        .post_with(
            "/v1/jobs",
            with_key,
            &[("idempotency-key", "\"other-key\"")],
        )
        .await;
    let p = a.problem(422, "validation");
    assert_eq!(p["field"], "idempotency.key");
    assert!(!a.text.contains("other-key") && !a.text.contains("order-77"));
    // Scope from the body, key from the header: another binding.
    let mut scoped = body.clone();
    scoped["idempotency"] = json!({"scope": "mail"});
    let a = s
        .post_with("/v1/jobs", scoped, &[("idempotency-key", "order-77")])
        .await;
    assert_eq!(a.ok(201)["outcome"], "accepted");
    let job = s
        .get(&format!("/v1/jobs/{}", a.body["job_id"].as_str().unwrap()))
        .await;
    assert_eq!(job.ok(200)["idempotency"]["scope"], "mail");
    // A malformed structured-field string.
    let a = s
        .post_with("/v1/jobs", body, &[("idempotency-key", "\"open")])
        .await;
    a.problem(422, "validation");
    assert_eq!(s.job_count().await, 2);
    s.stop().await;
}

async fn conflict_holds_no_raw_key(b: Backend) {
    let s = Server::start(b).await;
    let key = "capture:inv_42-very-secret";
    let id = s
        .enqueue(
            json!({"type": "invoice.capture", "payload": {"n": 1}, "idempotency": {"key": key}}),
        )
        .await;
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "invoice.capture", "payload": {"n": 2}, "tags": ["x"], "idempotency": {"key": key}}),
        )
        .await;
    let p = a.problem(409, "idempotency-conflict").clone();
    assert_eq!(p["job_id"], id);
    assert_eq!(p["source"], "idempotency_key");
    assert_eq!(p["scope"], "default");
    assert_eq!(p["fields"], json!(["payload", "tags"]));
    assert!(p["key_preview"].as_str().unwrap().ends_with('…'));
    assert_eq!(p["key_digest"].as_str().unwrap().len(), 16);
    assert!(!a.text.contains(key), "raw key leaked: {}", a.text);
    // The same through the header.
    let a = s
        .post_with(
            "/v1/jobs",
            json!({"type": "invoice.capture", "payload": {"n": 3}}),
            &[("idempotency-key", key)],
        )
        .await;
    a.problem(409, "idempotency-conflict");
    assert!(!a.text.contains(key));
    // A wrongly typed idempotency object quoting the key: 400 without it.
    let a = s
        .post("/v1/jobs", json!({"type": "x", "idempotency": key}))
        .await;
    a.problem(400, "bad-request");
    assert!(!a.text.contains(key), "raw key leaked: {}", a.text);
    // An explicit job id conflict has null key members.
    s.enqueue(json!({"type": "t", "job_id": "fixed-1", "payload": 1}))
        .await;
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "t", "job_id": "fixed-1", "payload": 2}),
        )
        .await;
    let p = a.problem(409, "idempotency-conflict");
    assert_eq!(p["source"], "job_id");
    assert!(p["scope"].is_null() && p["key_preview"].is_null() && p["key_digest"].is_null());
    assert_eq!(s.job_count().await, 2);
    s.stop().await;
}

async fn malformed_bodies_are_bad_requests(b: Backend) {
    let s = Server::start(b).await;
    for body in [
        &b"{not json"[..],
        b"[1, 2]",
        b"\"a string\"",
        b"",
        br#"{"type": 5}"#,
        br#"{"type": "x", "unknown_field": 1}"#,
        br#"{"type": "x", "max_attempts": "ten"}"#,
    ] {
        let a = s.post_raw("/v1/jobs", body.to_vec()).await;
        a.problem(400, "bad-request");
    }
    // Nesting beyond the parser's recursion limit: 400, not a crash.
    let deep = format!(
        "{{\"type\": \"x\", \"payload\": {}{}}}",
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    s.post_raw("/v1/jobs", deep)
        .await
        .problem(400, "bad-request");
    // A declared non-JSON content type.
    let a = s
        .send(
            reqwest::Method::POST,
            "/v1/jobs",
            Some(b"type=x".to_vec()),
            &[("content-type", "application/x-www-form-urlencoded")],
        )
        .await;
    a.problem(400, "bad-request");
    // Malformed worker and operator bodies too.
    s.post_raw("/v1/claim", "{")
        .await
        .problem(400, "bad-request");
    s.post_raw("/v1/jobs/batch", "[]")
        .await
        .problem(400, "bad-request");
    assert_eq!(s.job_count().await, 0);
    s.stop().await;
}

async fn validation_and_limits(b: Backend) {
    let s = Server::start(b).await;
    let a = s.post("/v1/jobs", json!({"type": "bad type!"})).await;
    let p = a.problem(422, "validation");
    assert_eq!(p["field"], "type");
    assert!(p["reason"].is_string());
    let a = s
        .post("/v1/jobs", json!({"type": "x", "max_attempts": 0}))
        .await;
    assert_eq!(a.problem(422, "validation")["field"], "max_attempts");
    // A payload over 1 MiB inside a body under the body limit.
    let big = "x".repeat(1024 * 1024 + 10);
    let a = s
        .post("/v1/jobs", json!({"type": "x", "payload": big}))
        .await;
    assert_eq!(a.problem(413, "payload-too-large")["field"], "payload");
    // A body over the limit (payload limit + 64 KiB) is refused unread.
    let huge = "y".repeat(1024 * 1024 + 64 * 1024 + 100);
    let body = json!({"type": "x", "payload": huge}).to_string();
    let (status, text) = s.post_whole("/v1/jobs", &body).await;
    assert_eq!(status, 413);
    assert!(text.contains("/problems/payload-too-large"), "{text}");
    assert_eq!(s.job_count().await, 0);
    s.stop().await;
}

async fn batch_items(b: Backend) {
    let s = Server::start(b).await;
    s.enqueue(json!({"type": "t", "payload": 1, "idempotency": {"key": "k-held"}}))
        .await;
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [
                {"type": "t", "payload": 1, "idempotency": {"key": "k-new"}},
                {"type": "t", "payload": 1, "idempotency": {"key": "k-new"}},
                {"type": "t", "payload": 2, "idempotency": {"key": "k-held"}},
                {"type": "bad type"},
                [1],
                {"type": "t", "bogus": true},
            ]}),
        )
        .await;
    let results = a.ok(200)["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 6);
    assert_eq!(results[0]["outcome"], "accepted");
    assert_eq!(results[1]["outcome"], "replayed");
    assert_eq!(results[1]["job_id"], results[0]["job_id"]);
    assert_eq!(
        results[2]["error"]["type"],
        "/problems/idempotency-conflict"
    );
    assert!(!results[2].to_string().contains("k-held"));
    assert_eq!(results[3]["error"]["type"], "/problems/validation");
    assert_eq!(results[4]["error"]["type"], "/problems/bad-request");
    assert_eq!(results[5]["error"]["type"], "/problems/bad-request");
    assert_eq!(s.job_count().await, 2);

    // The header is refused on a batch.
    let a = s
        .post_with(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "t"}]}),
            &[("idempotency-key", "k")],
        )
        .await;
    assert_eq!(a.problem(422, "validation")["field"], "Idempotency-Key");
    // Over 1,000 items.
    let jobs: Vec<_> = (0..1001).map(|_| json!({"type": "t"})).collect();
    let a = s.post("/v1/jobs/batch", json!({ "jobs": jobs })).await;
    a.problem(413, "payload-too-large");
    assert_eq!(s.job_count().await, 2);
    s.stop().await;
}

async fn batch_atomic(b: Backend) {
    let s = Server::start(b).await;
    s.enqueue(json!({"type": "t", "payload": 1, "idempotency": {"key": "held"}}))
        .await;
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [
                {"type": "t", "payload": 5},
                {"type": "t", "payload": 2, "idempotency": {"key": "held"}},
                {"type": "bad type"},
            ]}),
        )
        .await;
    let p = a.problem(409, "idempotency-conflict");
    assert_eq!(p["index"], 1);
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [{"type": "t"}, {"type": "t"}, {"type": "bad type"}]}),
        )
        .await;
    let p = a.problem(422, "validation");
    assert_eq!(p["index"], 2);
    assert_eq!(p["field"], "type");
    // A malformed item after a conflicting one: the conflict is first.
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [
                {"type": "t", "payload": 9, "idempotency": {"key": "held"}}, "nope"]}),
        )
        .await;
    assert_eq!(a.problem(409, "idempotency-conflict")["index"], 0);
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [{"type": "t"}, {"type": 7}]}),
        )
        .await;
    assert_eq!(a.problem(400, "bad-request")["index"], 1);
    assert_eq!(
        s.job_count().await,
        1,
        "a refused atomic batch writes nothing"
    );
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [{"type": "t"}, {"type": "u"}]}),
        )
        .await;
    let results = a.ok(200)["results"].as_array().unwrap().clone();
    assert!(results.iter().all(|r| r["outcome"] == "accepted"));
    assert_eq!(s.job_count().await, 3);
    s.stop().await;
}

async fn atomic_batch_keeps_the_item_problem(b: Backend) {
    let s = Server::start(b).await;
    // A malformed item of an atomic batch is answered with that item's own
    // problem (its detail and dotted `field`, as in a non-atomic batch) and
    // member `index`.
    let item = json!({"type": "t", "dedupe": {"key": "k", "mode": "x"}});
    let plain = s
        .post("/v1/jobs/batch", json!({"jobs": [{"type": "t"}, item]}))
        .await;
    let own = plain.ok(200)["results"][1]["error"].clone();
    assert_eq!(own["field"], "dedupe.mode", "{own}");
    for (jobs, index, field) in [
        (json!([{"type": "t"}, item]), 1, "dedupe.mode"),
        (
            json!([{"type": "t", "retry": {"kind": "none"}}, {"type": "t", "priority": "high"}]),
            1,
            "priority",
        ),
        (
            json!([{"type": "t", "colour": 1}, {"type": "u"}]),
            0,
            "colour",
        ),
        (
            json!([{"type": "t"}, {"type": "t"}, {"type": "t", "idempotency": {"key": "k", "tll_ms": 1}}]),
            2,
            "idempotency.tll_ms",
        ),
    ] {
        let a = s
            .post("/v1/jobs/batch", json!({"atomic": true, "jobs": jobs}))
            .await;
        let p = a.problem(400, "bad-request");
        assert_eq!(p["index"], index, "{}", a.text);
        assert_eq!(p["field"], field, "{}", a.text);
        let detail = p["detail"].as_str().unwrap();
        assert!(detail.contains(field), "{detail}");
        assert!(!detail.contains("not a valid enqueue request"), "{detail}");
    }
    // The same problem as the non-atomic batch's item, with `index`.
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [{"type": "t"}, item]}),
        )
        .await;
    let mut expected = own.clone();
    expected["index"] = json!(1);
    assert_eq!(a.problem(400, "bad-request").clone(), expected);
    // A malformed item that is not an object at all keeps its own detail too.
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"atomic": true, "jobs": [{"type": "t"}, "nope"]}),
        )
        .await;
    let p = a.problem(400, "bad-request");
    assert_eq!(p["index"], 1);
    assert_eq!(
        p["detail"],
        plain_item_detail(&s, json!("nope")).await,
        "{}",
        a.text
    );
    assert_eq!(s.job_count().await, 1, "only the non-atomic batch wrote");
    s.stop().await;
}

/// The `detail` a non-atomic batch answers for one malformed item.
async fn plain_item_detail(s: &Server, item: serde_json::Value) -> serde_json::Value {
    let a = s.post("/v1/jobs/batch", json!({"jobs": [item]})).await;
    a.ok(200)["results"][0]["error"]["detail"].clone()
}

async fn explain_writes_nothing(b: Backend) {
    let s = Server::start(b).await;
    let req = json!({"type": "t", "payload": 1, "idempotency": {"key": "e-1"}, "dedupe": "d"});
    let a = s.post("/v1/jobs/explain", req.clone()).await;
    let e = a.ok(200).clone();
    assert_eq!(e["outcome"], "accepted");
    assert!(e["conflict"].is_null() && e["idempotency"].is_null() && e["dedupe"].is_null());
    assert_eq!(s.job_count().await, 0);
    let id = s.enqueue(req.clone()).await;
    let e = s.post("/v1/jobs/explain", req).await.ok(200).clone();
    assert_eq!(e["outcome"], "replayed");
    assert_eq!(e["job_id"], id);
    assert_eq!(e["idempotency"]["job_id"], id);
    assert!(e["idempotency"]["expires_at"].is_string());
    assert_eq!(e["dedupe"]["job_id"], id);
    let e = s
        .post(
            "/v1/jobs/explain",
            json!({"type": "t", "payload": 2, "idempotency": {"key": "e-1"}}),
        )
        .await
        .ok(200)
        .clone();
    assert_eq!(e["outcome"], "conflict");
    assert_eq!(e["conflict"], json!({"job_id": id, "fields": ["payload"]}));
    s.post("/v1/jobs/explain", json!({"type": ""}))
        .await
        .problem(422, "validation");
    assert_eq!(s.job_count().await, 1);
    s.stop().await;
}

/// The forms the OpenAPI document states and Schemathesis checks: integers
/// with a zero fraction part, object members that must be objects, lengths
/// in bytes, the cursor's form.
async fn wire_forms_the_document_states(b: Backend) {
    let s = Server::start(b).await;
    let body = json!({"type": "x", "max_attempts": 3.0, "timeout_ms": 1e3, "priority": -2.0,
        "idempotency": {"key": "float-ints", "ttl_ms": 60000.0}});
    let id = s.post("/v1/jobs", body).await.ok(201)["job_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
    assert_eq!(
        (
            job["max_attempts"].clone(),
            job["timeout_ms"].clone(),
            job["priority"].clone()
        ),
        (json!(3), json!(1000), json!(-2))
    );
    // The same request written with plain integers is a replay.
    let same = json!({"type": "x", "max_attempts": 3, "timeout_ms": 1000, "priority": -2,
        "idempotency": {"key": "float-ints", "ttl_ms": 60000}});
    assert_eq!(
        s.post("/v1/jobs", same).await.ok(200)["outcome"],
        "replayed"
    );
    for (body, field) in [
        (json!({"type": "x", "max_attempts": 3.5}), "max_attempts"),
        (json!({"type": "x", "delay_ms": 1e300}), "delay_ms"),
        (json!({"type": "x", "idempotency": ["k"]}), "idempotency"),
        (json!({"type": "x", "retry": ["none"]}), "retry"),
    ] {
        let a = s.post("/v1/jobs", body).await;
        assert_eq!(a.problem(400, "bad-request")["field"], field);
    }
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "purge", "filter": [null, null]}),
        )
        .await;
    assert_eq!(a.problem(400, "bad-request")["field"], "filter");
    s.post("/v1/claim", json!({"limit": 2.0, "lease_ms": 1000.0}))
        .await
        .ok(200);
    // Free text is bounded in bytes of UTF-8: 127 two-byte characters and
    // one ASCII pass, 128 two-byte characters (fewer than the document's
    // 255-character maxLength, but 256 bytes) are a 422.
    let key = format!("{}a", "é".repeat(127));
    s.post(
        "/v1/jobs",
        json!({"type": "x", "idempotency": {"key": key}}),
    )
    .await
    .ok(201);
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "x", "idempotency": {"key": "é".repeat(128)}}),
        )
        .await;
    assert_eq!(a.problem(422, "validation")["field"], "idempotency.key");
    s.post("/v1/claim", json!({"worker": "ü".repeat(64)}))
        .await
        .ok(200);
    let a = s.post("/v1/claim", json!({"worker": "ü".repeat(65)})).await;
    assert_eq!(a.problem(422, "validation")["field"], "worker");
    // A cursor is 1–19 decimal digits.
    s.get("/v1/jobs?cursor=123").await.ok(200);
    for bad in ["%2B5", "12345678901234567890", "abc"] {
        let a = s.get(&format!("/v1/jobs?cursor={bad}")).await;
        assert_eq!(a.problem(422, "validation")["field"], "cursor");
    }
    s.stop().await;
}

async fn numbers_keep_their_digits(b: Backend) {
    let s = Server::start(b).await;
    let body = |n: &str| -> serde_json::Value {
        serde_json::from_str(&format!(
            r#"{{"type": "x", "payload": {{"n": {n}}}, "idempotency": {{"key": "big"}},
                "retry": {{"kind": "exponential", "factor": 2.5}}}}"#
        ))
        .expect("a body")
    };
    let id = s
        .post("/v1/jobs", body("18446744073709551617123"))
        .await
        .ok(201)["job_id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
    assert_eq!(job["payload"]["n"].to_string(), "18446744073709551617123");
    assert_eq!(job["retry"]["factor"].as_f64(), Some(2.5));
    // One more in the last digit, which a double cannot tell apart: a
    // conflict over the payload, not a replay.
    let a = s.post("/v1/jobs", body("18446744073709551617124")).await;
    assert_eq!(
        a.problem(409, "idempotency-conflict")["fields"],
        json!(["payload"])
    );
    assert_eq!(
        s.post("/v1/jobs", body("18446744073709551617123"))
            .await
            .ok(200)["outcome"],
        "replayed"
    );
    // A number beyond a double's range that is not an integer is refused.
    let a = s.post("/v1/jobs", body("1e400")).await;
    assert_eq!(a.problem(422, "validation")["field"], "payload");
    s.stop().await;
}
