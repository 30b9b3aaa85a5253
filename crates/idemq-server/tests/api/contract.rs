//! The wire contract of docs/http-api.md: `null` as omitted, unknown members
//! by dotted path, JSON bodies only, 405 with `Allow`, the Host check, and
//! many completions in one round trip.

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{Backend, Server};

instantiate!(
    null_means_omitted_everywhere,
    unknown_members_are_named_by_path,
    retry_members_are_named_by_path,
    bodies_must_be_declared_json,
    bodyless_operations_refuse_a_body,
    streamed_body_over_the_limit_names_the_limit,
    wrong_method_is_405_with_allow,
    foreign_host_is_refused_without_a_token,
    claim_defaults,
    complete_many_in_one_call,
    claim_completes_first
);

async fn null_means_omitted_everywhere(b: Backend) {
    let s = Server::start(b).await;
    // Every optional enqueue member as null: the same job as leaving them out.
    let plain = json!({"type": "t", "idempotency": {"key": "k-null"}});
    let nulls = json!({"type": "t", "payload": null, "queue": null, "job_id": null,
        "priority": null, "run_at": null, "delay_ms": null, "max_attempts": null,
        "retry": null, "timeout_ms": null, "deadline": null, "concurrency_key": null,
        "tags": null, "keep_ms": null, "dedupe": null,
        "idempotency": {"key": "k-null", "scope": null, "ttl_ms": null}});
    let a = s.post("/v1/jobs", plain).await;
    let id = a.ok(201)["job_id"].clone();
    let a = s.post("/v1/jobs", nulls).await;
    assert_eq!(
        a.ok(200)["outcome"],
        "replayed",
        "null fingerprints as omitted"
    );
    assert_eq!(a.body["job_id"], id);
    // Nested members: retry's and dedupe's.
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "t", "retry": {"kind": "exponential", "initial_ms": null,
                "factor": null, "max_ms": null, "jitter": null},
                "dedupe": {"key": "d", "ttl_ms": null, "extend": null, "replace": null,
                "max_wait_ms": null}}),
        )
        .await;
    a.ok(201);
    // Batch `atomic`, claim's every member, fail's, redrive's, bulk's, schedule `paused`.
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "b"}], "atomic": null}),
        )
        .await;
    assert_eq!(a.ok(200)["results"][0]["outcome"], "accepted");
    let a = s
        .post(
            "/v1/claim",
            json!({"queues": null, "worker": null, "limit": null, "lease_ms": null,
                "types": null, "wait_ms": null, "complete": null}),
        )
        .await;
    let job = a.ok(200)["jobs"][0].clone();
    let a = s
        .post(
            &format!("/v1/jobs/{}/fail", job["id"].as_str().unwrap()),
            json!({"lease_token": job["lease_token"], "error": null, "retryable": null,
                "retry_after_ms": null, "snooze_ms": null}),
        )
        .await;
    assert!(a.ok(200)["state"].is_string());
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "cancel", "filter": null, "limit": null}),
        )
        .await;
    assert!(a.ok(200)["matched"].is_number());
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "purge", "filter": {"state": null, "queue": null, "type": null,
                "tag": null, "before": null}}),
        )
        .await;
    a.ok(200);
    let a = s
        .put(
            "/v1/schedules/nightly",
            json!({"cron": null, "every_ms": 60000, "timezone": null, "paused": null,
                "job": {"type": "report", "tags": null}}),
        )
        .await;
    assert_eq!(a.ok(201)["paused"], false);
    let a = s
        .post(
            "/v1/idempotency/lookup",
            json!({"scope": null, "key": "k-null"}),
        )
        .await;
    assert_eq!(a.ok(200)["job_id"], id);
    let a = s
        .post(
            "/v1/jobs/no-such-job/redrive",
            json!({"max_attempts": null, "deadline": null, "run_at": null,
                "reset_checkpoints": null}),
        )
        .await;
    a.problem(404, "not-found");
}

async fn unknown_members_are_named_by_path(b: Backend) {
    let s = Server::start(b).await;
    let cases = [
        (
            "/v1/jobs",
            json!({"type": "t", "dedupe": {"key": "k", "mode": "x"}}),
            "dedupe.mode",
        ),
        ("/v1/jobs", json!({"type": "t", "colour": 1}), "colour"),
        (
            "/v1/jobs",
            json!({"type": "t", "idempotency": {"key": "k", "tll_ms": 1}}),
            "idempotency.tll_ms",
        ),
        (
            "/v1/jobs",
            json!({"type": "t", "retry": {"kind": "fixed", "delay_ms": 5, "x": 1}}),
            "retry.x",
        ),
        (
            "/v1/jobs/explain",
            json!({"type": "t", "dedupe": {"key": "k", "mode": "x"}}),
            "dedupe.mode",
        ),
        ("/v1/claim", json!({"worker": "w", "lease": 5}), "lease"),
        (
            "/v1/jobs/complete",
            json!({"jobs": [{"id": "a", "lease_token": "b", "extra": 1}]}),
            "jobs.0.extra",
        ),
        (
            "/v1/jobs/bulk",
            json!({"action": "cancel", "filter": {"colour": "red"}}),
            "filter.colour",
        ),
    ];
    for (path, body, field) in cases {
        let a = s.post(path, body).await;
        let p = a.problem(400, "bad-request");
        assert_eq!(p["field"], field, "{path}: {}", a.text);
        let detail = p["detail"].as_str().unwrap();
        assert!(detail.contains(field), "{detail}");
        assert!(
            !detail.contains("untagged") && !detail.contains("variant"),
            "{detail}"
        );
    }
    // A batch item's error names the member inside the item.
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "t", "dedupe": {"key": "k", "mode": 1}}]}),
        )
        .await;
    assert_eq!(a.ok(200)["results"][0]["error"]["field"], "dedupe.mode");
    assert_eq!(s.job_count().await, 0, "nothing was written");
}

async fn retry_members_are_named_by_path(b: Backend) {
    let s = Server::start(b).await;
    // `retry` is read by its `kind`: a member of the wrong type, an unknown
    // kind, an unknown or missing member are each named by the dotted path.
    let cases = [
        (json!({"kind": "fixed", "delay_ms": "5"}), "retry.delay_ms"),
        (json!({"kind": "fixed", "delay_ms": 1.5}), "retry.delay_ms"),
        (
            json!({"kind": "exponential", "factor": "2"}),
            "retry.factor",
        ),
        (
            json!({"kind": "exponential", "jitter": "yes"}),
            "retry.jitter",
        ),
        (
            json!({"kind": "exponential", "initial_ms": true}),
            "retry.initial_ms",
        ),
        (
            json!({"kind": "exponential", "max_ms": [1]}),
            "retry.max_ms",
        ),
        (json!({"kind": "linear", "delay_ms": 5}), "retry.kind"),
        (json!({"kind": 3}), "retry.kind"),
        (json!({"kind": null}), "retry.kind"),
        (json!({"kind": "fixed", "delay_ms": 5, "x": 1}), "retry.x"),
        (json!({"kind": "none", "delay_ms": 5}), "retry.delay_ms"),
        (json!({"kind": "fixed"}), "retry.delay_ms"),
        (json!({"delay_ms": 5}), "retry.kind"),
    ];
    for (retry, field) in cases {
        let job = json!({"type": "t", "retry": retry});
        for path in ["/v1/jobs", "/v1/jobs/explain"] {
            let a = s.post(path, job.clone()).await;
            let p = a.problem(400, "bad-request");
            assert_eq!(p["field"], field, "{path} {retry}: {}", a.text);
            let detail = p["detail"].as_str().unwrap();
            assert!(detail.contains(field), "{detail}");
            assert!(
                !detail.contains("untagged") && !detail.contains("RetryPolicy"),
                "{detail}"
            );
        }
        // A batch item names the member inside the item.
        let a = s
            .post("/v1/jobs/batch", json!({"jobs": [job.clone()]}))
            .await;
        let item = &a.ok(200)["results"][0]["error"];
        assert_eq!(item["field"], field, "{retry}: {}", a.text);
        let a = s
            .post(
                "/v1/jobs/batch",
                json!({"atomic": true, "jobs": [{"type": "t"}, job.clone()]}),
            )
            .await;
        let p = a.problem(400, "bad-request");
        assert_eq!(p["field"], field, "{retry}: {}", a.text);
        assert_eq!(p["index"], 1);
        // A schedule's template names it below `job`.
        let a = s
            .put(
                "/v1/schedules/retry-paths",
                json!({"every_ms": 60000, "job": job}),
            )
            .await;
        let p = a.problem(400, "bad-request");
        assert_eq!(p["field"], format!("job.{field}"), "{retry}: {}", a.text);
    }
    // Each kind with good members is still taken.
    for retry in [
        json!({"kind": "fixed", "delay_ms": 5}),
        json!({"kind": "exponential", "factor": 1.5, "jitter": false}),
        json!({"kind": "none"}),
    ] {
        s.post("/v1/jobs", json!({"type": "t", "retry": retry}))
            .await
            .ok(201);
    }
    assert_eq!(s.job_count().await, 3);
    assert_eq!(s.get("/v1/schedules").await.ok(200)["schedules"], json!([]));
}

async fn bodies_must_be_declared_json(b: Backend) {
    let s = Server::start(b).await;
    for ct in ["application/x-www-form-urlencoded", "text/plain", ""] {
        let a = s
            .send(
                Method::POST,
                "/v1/jobs",
                Some(br#"{"type":"t"}"#.to_vec()),
                &[("content-type", if ct.is_empty() { "text/x" } else { ct })],
            )
            .await;
        let detail = a.problem(400, "bad-request")["detail"]
            .as_str()
            .unwrap()
            .to_owned();
        assert!(
            detail.contains("Content-Type: application/json"),
            "{detail}"
        );
        assert!(detail.contains("--json"), "{detail}");
    }
    // No Content-Type at all (what a page can send without a preflight).
    let (status, text) = s
        .raw(
            "POST /v1/jobs HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 12\r\n\
             Connection: close\r\n\r\n{\"type\":\"t\"}",
        )
        .await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("--json"), "{text}");
    // `application/json; charset=utf-8` is JSON.
    let a = s
        .send(
            Method::POST,
            "/v1/jobs",
            Some(br#"{"type":"t"}"#.to_vec()),
            &[("content-type", "application/json; charset=utf-8")],
        )
        .await;
    a.ok(201);
    assert_eq!(s.job_count().await, 1);
}

async fn bodyless_operations_refuse_a_body(b: Backend) {
    let s = Server::start(b).await;
    let id = s
        .enqueue(json!({"type": "t", "queue": "bq", "delay_ms": 3600000}))
        .await;
    s.put(
        "/v1/schedules/keep",
        json!({"every_ms": 60000, "job": {"type": "r"}}),
    )
    .await
    .ok(201);
    let ops = [
        (Method::POST, format!("/v1/jobs/{id}/cancel")),
        (Method::POST, format!("/v1/jobs/{id}/purge")),
        (Method::POST, format!("/v1/jobs/{id}/promote")),
        (Method::POST, "/v1/queues/bq/pause".to_owned()),
        (Method::POST, "/v1/queues/bq/resume".to_owned()),
        (Method::DELETE, "/v1/schedules/keep".to_owned()),
        (Method::POST, format!("/v1/jobs/{id}/redrive")),
    ];
    for (method, path) in &ops {
        // A body of another type: 400 saying how to send JSON.
        for (ct, body) in [
            ("text/plain", "x"),
            ("application/x-www-form-urlencoded", "force=1"),
            ("text/plain", "{}"),
        ] {
            let a = s
                .send(
                    method.clone(),
                    path,
                    Some(body.as_bytes().to_vec()),
                    &[("content-type", ct)],
                )
                .await;
            let detail = a.problem(400, "bad-request")["detail"].clone();
            assert!(
                detail.as_str().unwrap().contains("--json"),
                "{method} {path} ({ct}): {detail}"
            );
        }
        // A body without a Content-Type.
        let (status, text) = s
            .raw(&format!(
                "{method} {path} HTTP/1.1\r\nHost: {{addr}}\r\nContent-Length: 2\r\n\
                 Connection: close\r\n\r\n{{}}"
            ))
            .await;
        assert_eq!(status, 400, "{method} {path}: {text}");
        assert!(text.contains("/problems/bad-request"), "{text}");
        // JSON that is not an empty object: an unknown member is named.
        let a = s
            .send(
                method.clone(),
                path,
                Some(br#"{"force": true}"#.to_vec()),
                &[],
            )
            .await;
        let p = a.problem(400, "bad-request");
        assert_eq!(p["field"], "force", "{method} {path}: {}", a.text);
        let a = s
            .send(method.clone(), path, Some(b"[]".to_vec()), &[])
            .await;
        a.problem(400, "bad-request");
        // Nothing was done.
        assert_eq!(state_of(&s, &id).await, "scheduled", "{method} {path}");
        assert_eq!(queue_paused(&s, "bq").await, false, "{method} {path}");
        assert_eq!(schedule_count(&s).await, 1, "{method} {path}");
    }
    // No body, an empty one of any type, `{}` and `null` are taken.
    let a = s
        .send(
            Method::POST,
            "/v1/queues/bq/pause",
            Some(Vec::new()),
            &[("content-type", "application/x-www-form-urlencoded")],
        )
        .await;
    assert_eq!(a.ok(200)["paused"], true);
    let a = s
        .send(
            Method::POST,
            "/v1/queues/bq/resume",
            Some(b"null".to_vec()),
            &[],
        )
        .await;
    assert_eq!(a.ok(200)["paused"], false);
    let a = s
        .send(Method::POST, &format!("/v1/jobs/{id}/promote"), None, &[])
        .await;
    assert_eq!(a.ok(200)["promoted"], true);
    let (status, text) = s
        .raw(&format!(
            "POST /v1/jobs/{id}/cancel HTTP/1.1\r\nHost: {{addr}}\r\nContent-Length: 0\r\n\
             Connection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(state_of(&s, &id).await, "cancelled");
    let a = s
        .send(
            Method::POST,
            &format!("/v1/jobs/{id}/purge"),
            Some(b"{}".to_vec()),
            &[],
        )
        .await;
    assert_eq!(a.ok(200)["purged"], true);
    let a = s
        .send(
            Method::DELETE,
            "/v1/schedules/keep",
            Some(b" {} ".to_vec()),
            &[("content-type", "application/json; charset=utf-8")],
        )
        .await;
    assert_eq!(a.ok(200)["deleted"], true);
    assert_eq!(schedule_count(&s).await, 0);
    // The operations whose body is optional follow the same rule: an empty
    // body is read as none whatever its type, any other needs JSON.
    let a = s
        .send(
            Method::POST,
            "/v1/claim",
            Some(Vec::new()),
            &[("content-type", "application/x-www-form-urlencoded")],
        )
        .await;
    assert_eq!(a.ok(200)["jobs"], json!([]));
    let a = s
        .send(
            Method::POST,
            "/v1/claim",
            Some(b"limit=1".to_vec()),
            &[("content-type", "application/x-www-form-urlencoded")],
        )
        .await;
    a.problem(400, "bad-request");
    let other = s.enqueue(json!({"type": "t", "queue": "bq"})).await;
    let a = s
        .send(
            Method::POST,
            &format!("/v1/jobs/{other}/redrive"),
            Some(Vec::new()),
            &[("content-type", "text/plain")],
        )
        .await;
    a.problem(409, "not-dead");
}

async fn queue_paused(s: &Server, name: &str) -> Value {
    s.get("/v1/queues").await.ok(200)["queues"]
        .as_array()
        .unwrap()
        .iter()
        .find(|q| q["name"] == name)
        .map(|q| q["paused"].clone())
        .expect("the queue")
}

async fn schedule_count(s: &Server) -> usize {
    s.get("/v1/schedules").await.ok(200)["schedules"]
        .as_array()
        .unwrap()
        .len()
}

async fn streamed_body_over_the_limit_names_the_limit(b: Backend) {
    let s = Server::start(b).await;
    let limit = s.queue.payload_limit() + 64 * 1024;
    for path in ["/v1/jobs", "/v1/idempotency/lookup"] {
        let mut answers = Vec::new();
        // Streamed (chunked, no Content-Length), and declared up front.
        let (status, text) = s.post_chunked(path, limit + 4096).await;
        answers.push((status, text));
        let huge = format!(
            "{{\"type\":\"x\",\"payload\":\"{}\"}}",
            "h".repeat(limit + 4096)
        );
        answers.push(s.post_whole(path, &huge).await);
        for (status, text) in answers {
            assert_eq!(status, 413, "{path}: {}", &text[..text.len().min(300)]);
            let body = text.split("\r\n\r\n").nth(1).unwrap_or("");
            let p: Value =
                serde_json::from_str(body).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
            assert_eq!(p["type"], "/problems/payload-too-large", "{p}");
            assert_eq!(p["field"], "body", "{path}: {p}");
            assert_eq!(p["limit"], limit, "{path}: {p}");
        }
    }
    assert_eq!(s.job_count().await, 0);
}

async fn wrong_method_is_405_with_allow(b: Backend) {
    let s = Server::start(b).await;
    for (method, path, allow) in [
        (Method::DELETE, "/v1/jobs", "GET,HEAD,POST"),
        (Method::GET, "/v1/claim", "POST"),
        (Method::POST, "/v1/queues", "GET,HEAD"),
        (Method::PATCH, "/v1/schedules/x", "PUT,DELETE"),
        // A fixed path beside `/v1/jobs/{id}` serves GET too (a job of that id).
        (Method::DELETE, "/v1/jobs/complete", "GET,HEAD,POST"),
        (Method::PUT, "/v1/jobs/batch", "GET,HEAD,POST"),
        (Method::GET, "/v1/jobs/batch/cancel", "POST"),
        (Method::DELETE, "/v1/jobs/x/checkpoints", "GET,HEAD"),
    ] {
        let a = s.send(method.clone(), path, None, &[]).await;
        a.problem(405, "method-not-allowed");
        let got = a
            .headers
            .get("allow")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let mut got: Vec<&str> = got.split(',').map(str::trim).collect();
        let mut want: Vec<&str> = allow.split(',').collect();
        got.sort_unstable();
        want.sort_unstable();
        assert_eq!(got, want, "{method} {path}");
    }
    let a = s.get("/problems/method-not-allowed").await;
    a.ok(200);
}

async fn foreign_host_is_refused_without_a_token(b: Backend) {
    let s = Server::start(b).await;
    let body = r#"{"type":"t"}"#;
    for host in [
        "evil.example",
        "evil.example:8080",
        "127.0.0.1.evil.example",
    ] {
        let (status, text) = s
            .raw(&format!(
                "POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ))
            .await;
        assert_eq!(status, 403, "{text}");
        assert!(text.contains("/problems/forbidden-host"), "{text}");
        let (status, _) = s
            .raw(&format!(
                "GET /v1/jobs HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
            ))
            .await;
        assert_eq!(status, 403);
    }
    assert_eq!(s.job_count().await, 0, "a foreign Host writes nothing");
    // A loopback Host, but a write another site's page sent (a bodiless
    // POST needs no preflight): refused; the same from this origin passes.
    let id = s.enqueue(json!({"type": "t", "delay_ms": 3600000})).await;
    for header in [
        "Origin: http://evil.example",
        "Sec-Fetch-Site: cross-site",
        "Origin: null",
    ] {
        let (status, text) = s
            .raw(&format!(
                "POST /v1/jobs/{id}/cancel HTTP/1.1\r\nHost: {{addr}}\r\n{header}\r\n\
                 Content-Length: 0\r\nConnection: close\r\n\r\n"
            ))
            .await;
        assert_eq!(status, 403, "{header}: {text}");
        assert!(text.contains("/problems/forbidden-host"), "{text}");
    }
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}")).await.body["state"],
        "scheduled"
    );
    let (status, text) = s
        .raw(&format!(
            "POST /v1/jobs/{id}/cancel HTTP/1.1\r\nHost: {{addr}}\r\nOrigin: http://{{addr}}\r\n\
             Sec-Fetch-Site: same-origin\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ))
        .await;
    assert_eq!(status, 200, "{text}");
    let purge = s.post(&format!("/v1/jobs/{id}/purge"), json!({})).await;
    purge.ok(200);
    for host in ["localhost:1234", "127.0.0.1", "[::1]:80", "{addr}"] {
        let (status, text) = s
            .raw(&format!(
                "POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ))
            .await;
        assert_eq!(status, 201, "{host}: {text}");
    }
    // An allowed host is answered; a token makes the Host check moot.
    let allowed = Server::start_with_options(
        b,
        idemq_server::ServerOptions {
            allowed_hosts: vec!["queue.internal".into()],
            ..Default::default()
        },
    )
    .await;
    let (status, _) = allowed
        .raw("GET /v1/queues HTTP/1.1\r\nHost: queue.internal:8080\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(status, 200);
    let (status, _) = allowed
        .raw("GET /v1/queues HTTP/1.1\r\nHost: other.internal\r\nConnection: close\r\n\r\n")
        .await;
    assert_eq!(status, 403);
    let tokened = Server::start_with(b, Some("tok")).await;
    let (status, _) = tokened
        .raw(
            "GET /v1/queues HTTP/1.1\r\nHost: queue.example\r\nAuthorization: Bearer tok\r\n\
             Connection: close\r\n\r\n",
        )
        .await;
    assert_eq!(status, 200);
}

async fn claim_defaults(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "t"})).await;
    // An empty object and an empty body both claim with every default.
    let a = s.post("/v1/claim", json!({})).await;
    let jobs = a.ok(200)["jobs"].as_array().unwrap().clone();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0]["id"], id.as_str());
    assert!(a.body.get("completed").is_none());
    let runs = s.get(&format!("/v1/jobs/{id}/runs")).await;
    assert_eq!(runs.ok(200)["runs"][0]["worker"], "http");
    let a = s.send(Method::POST, "/v1/claim", None, &[]).await;
    assert_eq!(a.ok(200)["jobs"], json!([]));
    // The bounds stay: each is a 422 naming the member.
    for (body, field) in [
        (json!({"worker": ""}), "worker"),
        (json!({"worker": "w".repeat(129)}), "worker"),
        (json!({"limit": 0}), "limit"),
        (json!({"limit": 1001}), "limit"),
        (json!({"lease_ms": 99}), "lease_ms"),
        (json!({"wait_ms": 60001}), "wait_ms"),
    ] {
        let a = s.post("/v1/claim", body).await;
        assert_eq!(a.problem(422, "validation")["field"], field);
    }
}

async fn claimed(s: &Server, n: usize) -> Vec<(String, String)> {
    for i in 0..n {
        s.enqueue(json!({"type": "t", "payload": i})).await;
    }
    let a = s.post("/v1/claim", json!({"limit": n})).await;
    a.ok(200)["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| {
            (
                j["id"].as_str().unwrap().to_owned(),
                j["lease_token"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

async fn state_of(s: &Server, id: &str) -> Value {
    s.get(&format!("/v1/jobs/{id}")).await.ok(200)["state"].clone()
}

async fn complete_many_in_one_call(b: Backend) {
    let s = Server::start(b).await;
    let jobs = claimed(&s, 3).await;
    assert_eq!(jobs.len(), 3);
    let a = s
        .post(
            "/v1/jobs/complete",
            json!({"jobs": [
                {"id": jobs[0].0, "lease_token": jobs[0].1, "result": {"ok": 1}},
                {"id": jobs[1].0, "lease_token": "stale-token"},
                {"id": jobs[2].0, "lease_token": jobs[2].1, "result": null},
                {"id": "no\u{0}such", "lease_token": "x"},
            ]}),
        )
        .await;
    let results = a.ok(200)["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 4);
    assert_eq!(results[0], json!({"state": "completed"}));
    assert_eq!(results[1]["error"]["type"], "/problems/lease-lost");
    assert_eq!(results[1]["error"]["status"], 409);
    assert_eq!(results[2], json!({"state": "completed"}));
    assert_eq!(results[3]["error"]["type"], "/problems/lease-lost");
    assert_eq!(state_of(&s, &jobs[0].0).await, "completed");
    assert_eq!(
        state_of(&s, &jobs[1].0).await,
        "active",
        "a stale token fails alone"
    );
    assert_eq!(state_of(&s, &jobs[2].0).await, "completed");
    let job = s.get(&format!("/v1/jobs/{}", jobs[0].0)).await;
    assert_eq!(job.body["result"], json!({"ok": 1}));
    // Completing again: each item is lease-lost, nothing changes.
    let a = s
        .post(
            "/v1/jobs/complete",
            json!({"jobs": [{"id": jobs[0].0, "lease_token": jobs[0].1}]}),
        )
        .await;
    assert_eq!(
        a.ok(200)["results"][0]["error"]["type"],
        "/problems/lease-lost"
    );
    let a = s.post("/v1/jobs/complete", json!({"jobs": []})).await;
    assert_eq!(a.ok(200).clone(), json!({"results": []}));
    // Over 1,000 items: 422, nothing written.
    let many: Vec<Value> = (0..1001)
        .map(|_| json!({"id": jobs[1].0, "lease_token": jobs[1].1}))
        .collect();
    let a = s.post("/v1/jobs/complete", json!({"jobs": many})).await;
    assert_eq!(a.problem(422, "validation")["field"], "jobs");
    assert_eq!(state_of(&s, &jobs[1].0).await, "active");
    let a = s
        .post("/v1/jobs/complete", json!({"jobs": [{"id": "x"}]}))
        .await;
    assert_eq!(a.problem(400, "bad-request")["field"], "jobs.0.lease_token");
    let metrics = s.get("/metrics").await;
    assert!(
        metrics.text.contains("idemq_completions_total 2"),
        "{}",
        metrics.text
    );
}

async fn claim_completes_first(b: Backend) {
    let s = Server::start(b).await;
    let jobs = claimed(&s, 2).await;
    let next = s.enqueue(json!({"type": "t", "payload": "next"})).await;
    let a = s
        .post(
            "/v1/claim",
            json!({"worker": "w-2", "limit": 5, "complete": [
                {"id": jobs[0].0, "lease_token": jobs[0].1, "result": 7},
                {"id": jobs[1].0, "lease_token": "stale"},
            ]}),
        )
        .await;
    let body = a.ok(200).clone();
    assert_eq!(body["completed"][0], json!({"state": "completed"}));
    assert_eq!(
        body["completed"][1]["error"]["type"],
        "/problems/lease-lost"
    );
    let claimed: Vec<&str> = body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| j["id"].as_str().unwrap())
        .collect();
    assert_eq!(claimed, vec![next.as_str()]);
    assert_eq!(state_of(&s, &jobs[0].0).await, "completed");
    assert_eq!(state_of(&s, &jobs[1].0).await, "active");
    // A claim that breaks a bound records no completion either.
    let a = s
        .post(
            "/v1/claim",
            json!({"limit": 0, "complete": [{"id": jobs[1].0, "lease_token": jobs[1].1}]}),
        )
        .await;
    a.problem(422, "validation");
    assert_eq!(state_of(&s, &jobs[1].0).await, "active");
    let a = s
        .post(
            "/v1/claim",
            json!({"complete": [{"id": jobs[1].0, "lease_token": jobs[1].1}]}),
        )
        .await;
    assert_eq!(a.ok(200)["completed"][0], json!({"state": "completed"}));
    assert_eq!(a.body["jobs"], json!([]));
}
