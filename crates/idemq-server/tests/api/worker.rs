//! The worker protocol.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{Backend, Server};

instantiate!(
    claim_and_finish,
    fail_retry_and_snooze,
    stale_leases,
    long_poll_woken_by_enqueue,
    python_worker_example_runs_jobs
);

async fn claim_and_finish(b: Backend) {
    let s = Server::start(b).await;
    let id = s
        .enqueue(
            json!({"type": "invoice.capture", "queue": "billing", "payload": {"n": 1},
            "max_attempts": 3, "timeout_ms": 60000}),
        )
        .await;
    s.enqueue(json!({"type": "other", "queue": "billing"}))
        .await;
    let a = s
        .post(
            "/v1/claim",
            json!({"queues": ["billing"], "worker": "w-1", "limit": 10, "lease_ms": 30000,
                "types": ["invoice.capture"]}),
        )
        .await;
    let jobs = a.ok(200)["jobs"].as_array().unwrap().clone();
    assert_eq!(jobs.len(), 1);
    let job = &jobs[0];
    for field in [
        "id",
        "type",
        "queue",
        "payload",
        "attempt",
        "max_attempts",
        "lease_token",
        "lease_expires_at",
        "timeout_ms",
        "deadline",
    ] {
        assert!(job.get(field).is_some(), "missing {field}");
    }
    assert_eq!(job["id"], id.as_str());
    assert_eq!(job["attempt"], 1);
    assert_eq!(job["max_attempts"], 3);
    assert_eq!(job["timeout_ms"], 60000);
    let token = job["lease_token"].as_str().unwrap();
    let hb = s
        .post(
            &format!("/v1/jobs/{id}/heartbeat"),
            json!({"lease_token": token}),
        )
        .await;
    let hb = hb.ok(200).clone();
    assert!(hb["lease_expires_at"].is_string());
    assert_eq!(hb["cancel_requested"], false);
    let cp = format!("/v1/jobs/{id}/checkpoints/charge");
    let a = s.put(&cp, json!({"lease_token": token, "value": 1})).await;
    assert_eq!(a.ok(200).clone(), json!({"stored": true}));
    let a = s.put(&cp, json!({"lease_token": token, "value": 2})).await;
    assert_eq!(a.ok(200).clone(), json!({"stored": false}));
    let a = s
        .post(
            &format!("/v1/jobs/{id}/complete"),
            json!({"lease_token": token, "result": [1, 2]}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"state": "completed"}));

    // Release: ready again at once, the attempt not counted.
    let (other, token) = s.claim_one().await;
    let a = s
        .post(
            &format!("/v1/jobs/{other}/release"),
            json!({"lease_token": token}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"state": "ready"}));
    let job = s.get(&format!("/v1/jobs/{other}")).await.ok(200).clone();
    assert_eq!(job["state"], "ready");
    assert_eq!(job["attempts_used"], 0);
    // A release of a cancel-requested attempt cancels the job, and says so.
    let other = s.enqueue(json!({"type": "c"})).await;
    let a = s
        .post("/v1/claim", json!({"worker": "w", "types": ["c"]}))
        .await;
    let token = a.ok(200)["jobs"][0]["lease_token"].clone();
    s.post(&format!("/v1/jobs/{other}/cancel"), json!({}))
        .await
        .ok(200);
    let a = s
        .post(
            &format!("/v1/jobs/{other}/release"),
            json!({"lease_token": token}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"state": "cancelled"}));
    // Claim bounds.
    s.post("/v1/claim", json!({"worker": "w", "limit": 0}))
        .await
        .problem(422, "validation");
    s.post("/v1/claim", json!({"worker": "w", "lease_ms": 10}))
        .await
        .problem(422, "validation");
    s.post("/v1/claim", json!({"worker": "w", "wait_ms": 60001}))
        .await
        .problem(422, "validation");
    // `worker` is optional (`http`); an unknown member is still refused.
    let a = s.post("/v1/claim", json!({"limit": 1})).await;
    assert_eq!(a.ok(200)["jobs"].as_array().map(Vec::len), Some(1));
    s.post("/v1/claim", json!({"limit": 1, "workers": "w"}))
        .await
        .problem(400, "bad-request");
    s.stop().await;
}

async fn fail_retry_and_snooze(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "t", "max_attempts": 5})).await;
    let (_, token) = s.claim_one().await;
    let a = s
        .post(
            &format!("/v1/jobs/{id}/fail"),
            json!({"lease_token": token, "error": "flaky", "retryable": true,
                "retry_after_ms": 600000, "snooze_ms": null}),
        )
        .await;
    let out = a.ok(200).clone();
    assert_eq!(out["state"], "scheduled");
    let next: chrono::DateTime<chrono::Utc> =
        serde_json::from_value(out["next_run_at"].clone()).unwrap();
    let now = s.queue.store().now().await.unwrap();
    assert!(
        next > now + chrono::Duration::seconds(500),
        "retry_after_ms applies"
    );
    let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
    assert_eq!(job["attempts_used"], 1);
    assert_eq!(job["last_error"], "flaky");
    s.post(&format!("/v1/jobs/{id}/promote"), json!({}))
        .await
        .ok(200);
    let (_, token) = s.claim_one().await;
    let a = s
        .post(
            &format!("/v1/jobs/{id}/fail"),
            json!({"lease_token": token, "error": "later", "snooze_ms": 600000}),
        )
        .await;
    assert_eq!(a.ok(200)["state"], "scheduled");
    let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
    assert_eq!(job["attempts_used"], 1, "a snooze consumes no attempt");
    assert_eq!(job["attempt"], 2);
    s.stop().await;
}

async fn stale_leases(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "t"})).await;
    let (_, token) = s.claim_one().await;
    let stale = json!({"lease_token": "not-the-token"});
    for action in ["heartbeat", "complete", "release"] {
        let a = s
            .post(&format!("/v1/jobs/{id}/{action}"), stale.clone())
            .await;
        assert_eq!(a.problem(409, "lease-lost")["job_id"], id.as_str());
    }
    let a = s
        .post(
            &format!("/v1/jobs/{id}/fail"),
            json!({"lease_token": "not-the-token", "error": "x"}),
        )
        .await;
    a.problem(409, "lease-lost");
    let a = s
        .put(
            &format!("/v1/jobs/{id}/checkpoints/x"),
            json!({"lease_token": "not-the-token", "value": 1}),
        )
        .await;
    a.problem(409, "lease-lost");
    // The real token still works; afterwards it is stale too.
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token}),
    )
    .await
    .ok(200);
    s.post(
        &format!("/v1/jobs/{id}/heartbeat"),
        json!({"lease_token": token}),
    )
    .await
    .problem(409, "lease-lost");
    let metrics = s.get("/metrics").await;
    assert!(metrics.text.contains("idemq_lease_expiries_total"));
    s.stop().await;
}

async fn long_poll_woken_by_enqueue(b: Backend) {
    let s = Server::start(b).await;
    // An empty claim without wait answers at once.
    let a = s
        .post("/v1/claim", json!({"worker": "w", "queues": ["lp"]}))
        .await;
    assert_eq!(a.ok(200)["jobs"], json!([]));
    let client = s.client.clone();
    let url = format!("{}/v1/claim", s.base);
    let started = Instant::now();
    let poll = tokio::spawn(async move {
        let r = client
            .post(url)
            .json(&json!({"worker": "w", "queues": ["lp"], "wait_ms": 30000}))
            .send()
            .await
            .expect("claim");
        (
            r.status(),
            r.json::<serde_json::Value>().await.expect("json"),
        )
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!poll.is_finished(), "the claim waits for work");
    let id = s.enqueue(json!({"type": "t", "queue": "lp"})).await;
    let (status, body) = poll.await.expect("poll");
    assert_eq!(status, 200);
    assert_eq!(body["jobs"][0]["id"], id.as_str());
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "woken before the wait ran out"
    );
    // A wait with nothing to claim ends empty after wait_ms.
    let a = s
        .post(
            "/v1/claim",
            json!({"worker": "w", "queues": ["lp"], "wait_ms": 300}),
        )
        .await;
    assert_eq!(a.ok(200)["jobs"], json!([]));
    s.stop().await;
}

/// `examples/worker.py` (Python's standard library only) runs jobs end to end.
async fn python_worker_example_runs_jobs(b: Backend) {
    let s = Server::start(b).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            s.enqueue(json!({"type": "math.add", "payload": {"a": i, "b": 10}}))
                .await,
        );
    }
    let bad = s
        .enqueue(json!({"type": "unknown.kind", "max_attempts": 1}))
        .await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/worker.py");
    let out = tokio::process::Command::new("python3")
        .arg(script)
        .env("IDEMQ_URL", &s.base)
        .env("IDEMQ_EXIT_WHEN_IDLE", "1")
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("the Python worker finished in 60 s")
        .expect("python3 is installed");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for (i, id) in ids.iter().enumerate() {
        let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
        assert_eq!(job["state"], "completed");
        assert_eq!(job["result"], json!({"sum": i + 10}));
    }
    let job = s.get(&format!("/v1/jobs/{bad}")).await.ok(200).clone();
    assert_eq!(job["state"], "dead", "a failing handler fails the attempt");
    s.stop().await;
}
