//! Health, metrics, problem pages, unknown routes, backend failures.

use serde_json::json;

use crate::harness::{Backend, Server};

instantiate!(
    health_and_pages,
    undecodable_problem_name_is_a_problem,
    metrics_counted,
    backend_down
);

async fn health_and_pages(b: Backend) {
    let s = Server::start(b).await;
    let a = s.get("/healthz").await;
    let expected = match b {
        Backend::Sqlite => "sqlite",
        Backend::Postgres => "postgres",
        Backend::Redis => "redis",
    };
    assert_eq!(
        a.ok(200).clone(),
        json!({"ok": true, "backend": expected, "durability": "full"})
    );
    for name in [
        "bad-request",
        "validation",
        "idempotency-conflict",
        "lease-lost",
        "not-dead",
        "not-found",
        "unauthorized",
        "payload-too-large",
        "unavailable",
        "internal",
    ] {
        let a = s.get(&format!("/problems/{name}")).await;
        assert_eq!(a.status, 200);
        assert!(a.text.contains(&format!("/problems/{name}")));
        assert!(
            a.headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("text/html"),
            "{name}"
        );
    }
    s.get("/problems/nope").await.problem(404, "not-found");
    s.get("/v2/anything").await.problem(404, "not-found");
    s.post("/nowhere", json!({}))
        .await
        .problem(404, "not-found");
    let doc = s.get("/openapi.json").await.ok(200).clone();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    assert!(doc["paths"]["/v1/jobs"]["post"].is_object());
    s.stop().await;
}

async fn undecodable_problem_name_is_a_problem(b: Backend) {
    let s = Server::start(b).await;
    // A name that is not UTF-8 once decoded: a problem document, like every
    // other error, not the router's plain text.
    for path in ["/problems/%FF", "/problems/a%C3"] {
        let a = s.get(path).await;
        a.problem(400, "bad-request");
    }
    s.get("/problems/%6Eot-found").await.ok(200);
    s.stop().await;
}

async fn metrics_counted(b: Backend) {
    let s = Server::start(b).await;
    let req = json!({"type": "t", "queue": "m", "payload": 1, "idempotency": {"key": "mk"}});
    s.post("/v1/jobs", req.clone()).await.ok(201);
    s.post("/v1/jobs", req).await.ok(200);
    s.post(
        "/v1/jobs",
        json!({"type": "t", "queue": "m", "payload": 2, "idempotency": {"key": "mk"}}),
    )
    .await
    .problem(409, "idempotency-conflict");
    s.enqueue(json!({"type": "t", "queue": "m"})).await;
    let (id, token) = s.claim_one().await;
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token}),
    )
    .await
    .ok(200);
    let (id, token) = s.claim_one().await;
    s.post(
        &format!("/v1/jobs/{id}/fail"),
        json!({"lease_token": token, "error": "x", "retryable": false}),
    )
    .await
    .ok(200);
    let a = s.get("/metrics").await;
    assert_eq!(a.status, 200);
    assert!(
        a.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/plain")
    );
    let text = a.text;
    for needle in [
        "idemq_enqueue_total{outcome=\"accepted\"} 2",
        "idemq_enqueue_total{outcome=\"replayed\"} 1",
        "idemq_enqueue_total{outcome=\"conflict\"} 1",
        "idemq_idempotency_conflicts_total 1",
        "idemq_claims_total 2",
        "idemq_completions_total 1",
        "idemq_dead_total 1",
        "idemq_queue_depth{queue=\"m\",state=\"completed\"} 1",
        "idemq_queue_depth{queue=\"m\",state=\"dead\"} 1",
        "# TYPE idemq_enqueue_duration_seconds histogram",
        "idemq_enqueue_duration_seconds_bucket{le=\"+Inf\"} 3",
        "idemq_enqueue_duration_seconds_count 3",
        "idemq_enqueue_duration_seconds_sum ",
        "idemq_claim_duration_seconds_bucket{le=\"0.001\"} ",
        "idemq_claim_duration_seconds_count 2",
        "# HELP idemq_enqueue_total",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    assert!(!text.contains("mk\""));
    // A queue whose jobs are gone leaves the depths: they are the store's
    // now, not a gauge kept at its last value.
    let gone = s.enqueue(json!({"type": "t", "queue": "gone"})).await;
    let line = "idemq_queue_depth{queue=\"gone\",state=\"ready\"} 1";
    let text = s.get("/metrics").await.text;
    assert!(text.contains(line), "missing {line} in\n{text}");
    s.post_raw(&format!("/v1/jobs/{gone}/purge"), "")
        .await
        .ok(200);
    let text = s.get("/metrics").await.text;
    assert!(
        !text.contains("queue=\"gone\""),
        "a queue that is gone:\n{text}"
    );
    assert!(
        text.contains("idemq_queue_depth{queue=\"m\",state=\"dead\"} 1"),
        "{text}"
    );
    s.stop().await;
}

/// A backend that stops answering: `/healthz` says 503 `unavailable` with
/// `Retry-After`, and an enqueue answers 503 `unavailable` with
/// `Retry-After`, never 500.
async fn backend_down(b: Backend) {
    // On Redis, a server of the case's own, which it stops.
    let s = match b {
        Backend::Redis => {
            let url = format!("{}?prefix=down:", idemq_testkit::redis_own_server());
            Server::start_on_redis(url).await
        }
        _ => Server::start(b).await,
    };
    s.enqueue(json!({"type": "t"})).await;
    match b {
        Backend::Postgres => {
            let db = s.pg_db.clone().unwrap();
            idemq_testkit::drop_pg_database(&db);
        }
        Backend::Redis => {
            // The connection drops as the server exits: no reply to read.
            let url = s.redis_url.clone().unwrap();
            let _ = idemq_testkit::redis_command(&url, &["SHUTDOWN", "NOSAVE"]).await;
        }
        Backend::Sqlite => {
            // Overwrite the database file with bytes that are not a database.
            let path = s.db_file.clone().unwrap();
            for ext in ["", "-wal", "-shm"] {
                let p = format!("{}{ext}", path.display());
                if std::path::Path::new(&p).exists() {
                    std::fs::write(&p, vec![0x5a; 64 * 1024]).unwrap();
                }
            }
        }
    }
    let a = s.get("/healthz").await;
    let p = a.problem(503, "unavailable").clone();
    assert_eq!(p["ok"], false);
    assert!(a.headers.contains_key("retry-after"));
    for body in [
        json!({"type": "t"}),
        json!({"type": "t", "idempotency": {"key": "k"}}),
    ] {
        let a = s.post("/v1/jobs", body).await;
        a.problem(503, "unavailable");
        assert!(a.headers.contains_key("retry-after"));
    }
    let a = s.post("/v1/claim", json!({"worker": "w"})).await;
    a.problem(503, "unavailable");
    s.stop().await;
}
