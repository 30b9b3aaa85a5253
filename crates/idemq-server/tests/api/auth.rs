//! The token check.

use reqwest::Method;
use serde_json::json;

use crate::harness::{Backend, Server};

instantiate!(token_required);

async fn token_required(b: Backend) {
    let s = Server::start_with(b, Some("s3cret-token")).await;
    let none = [("authorization", "")];
    // Without a token, or with a wrong one: 401 problems, nothing written.
    for path in [
        "/v1/jobs",
        "/v1/queues",
        "/metrics",
        "/openapi.json",
        "/problems/validation",
        "/",
        "/no/such/route",
    ] {
        let a = s.send(Method::GET, path, None, &none).await;
        a.problem(401, "unauthorized");
    }
    let a = s
        .send(
            Method::POST,
            "/v1/jobs",
            Some(br#"{"type":"t"}"#.to_vec()),
            &none,
        )
        .await;
    a.problem(401, "unauthorized");
    let a = s
        .send(
            Method::POST,
            "/v1/jobs",
            Some(br#"{"type":"t"}"#.to_vec()),
            &[("authorization", "Bearer s3cret-tokeX")],
        )
        .await;
    a.problem(401, "unauthorized");
    assert!(!a.text.contains("s3cret"));
    assert_eq!(s.job_count().await, 0);
    // A browser opening a dashboard page without the cookie lands on the
    // login form instead of a problem document.
    let a = s
        .send(
            Method::GET,
            "/",
            None,
            &[("authorization", ""), ("accept", "text/html,*/*")],
        )
        .await;
    assert_eq!(a.status.as_u16(), 200);
    assert!(
        a.text.contains("name=\"token\""),
        "the login form: {}",
        a.text
    );
    // /healthz is open.
    let a = s.send(Method::GET, "/healthz", None, &none).await;
    assert_eq!(a.ok(200)["ok"], true);
    // The bearer token and the dashboard's cookie are accepted.
    s.post("/v1/jobs", json!({"type": "t"})).await.ok(201);
    let a = s
        .send(
            Method::GET,
            "/v1/queues",
            None,
            &[
                ("authorization", ""),
                ("cookie", "theme=dark; idemq_token=s3cret-token"),
            ],
        )
        .await;
    a.ok(200);
    let a = s
        .send(
            Method::GET,
            "/v1/queues",
            None,
            &[("authorization", ""), ("cookie", "idemq_token=wrong")],
        )
        .await;
    a.problem(401, "unauthorized");
    s.get("/metrics").await.ok(200);
    s.get("/openapi.json").await.ok(200);
    // With the token, an unknown route is a 404 problem.
    s.get("/no/such/route").await.problem(404, "not-found");
    s.stop().await;
}
