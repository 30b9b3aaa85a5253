//! What one request may hold: the bound on long-polls held at once, and
//! the count bounds of lists, applied while a body is parsed.

use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{Value, json};

use crate::harness::{Answer, Backend, Server};

instantiate!(
    long_polls_are_bounded,
    a_claim_refused_by_the_bound_records_nothing,
    lists_stop_at_their_bound_while_parsed,
    claim_names_are_bounded
);

/// A server that holds at most `max` long-polls at once.
async fn bounded(b: Backend, max: usize) -> Server {
    Server::start_with_options(
        b,
        idemq_server::ServerOptions {
            max_long_polls: max,
            ..Default::default()
        },
    )
    .await
}

/// Sends a waiting request on a task of its own, again whenever the
/// bound refuses it (`503`), and answers its status and body once it was
/// held and ended.
fn hold(
    s: &Server,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> tokio::task::JoinHandle<(u16, Value)> {
    let client = s.client.clone();
    let url = format!("{}{path}", s.base);
    tokio::spawn(async move {
        loop {
            let mut req = client.request(method.clone(), &url);
            if let Some(body) = &body {
                req = req.json(body);
            }
            let r = req.send().await.expect("request");
            let status = r.status().as_u16();
            let body: Value = r.json().await.expect("json");
            if status != 503 {
                return (status, body);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// Sends short waiting claims, one after the other, until one is refused,
/// and returns that answer. Each probe that was taken waited for 50 ms and
/// ended before the next was sent, so when one is refused every permit is
/// held by the requests the test holds.
async fn probe_until_refused(s: &Server) -> Answer {
    let started = Instant::now();
    loop {
        let a = s
            .post(
                "/v1/claim",
                json!({"worker": "probe", "queues": ["probe"], "wait_ms": 50}),
            )
            .await;
        if a.status.as_u16() == 503 {
            return a;
        }
        assert_eq!(a.ok(200)["jobs"], json!([]), "{}", a.text);
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no waiting request was refused in 30 s: the bound never filled"
        );
    }
}

/// Asserts the `503` of a full bound.
#[track_caller]
fn assert_refused(a: &Answer) {
    let p = a.problem(503, "unavailable");
    assert!(
        p["detail"].as_str().unwrap().contains("long-polls"),
        "{}",
        a.text
    );
    assert_eq!(
        a.headers.get("retry-after").and_then(|v| v.to_str().ok()),
        Some("1"),
        "{:?}",
        a.headers
    );
}

async fn long_polls_are_bounded(b: Backend) {
    let s = bounded(b, 2).await;
    // Two waits fill the bound: a claim on an empty queue and a read of a
    // job that will not end on its own (scheduled in ten minutes).
    let later = s.enqueue(json!({"type": "t", "delay_ms": 600_000})).await;
    let claim = hold(
        &s,
        Method::POST,
        "/v1/claim",
        Some(json!({"worker": "w", "queues": ["lp"], "wait_ms": 30_000})),
    );
    let read = hold(
        &s,
        Method::GET,
        &format!("/v1/jobs/{later}?wait_ms=30000"),
        None,
    );

    // The next request that asks to wait is refused while both are held.
    let refused = probe_until_refused(&s).await;
    assert!(
        !claim.is_finished() && !read.is_finished(),
        "the bound was full of the two held waits when the 503 came"
    );
    assert_refused(&refused);
    assert_refused(&s.get(&format!("/v1/jobs/{later}?wait_ms=1000")).await);

    // Requests that do not wait are never refused.
    for path in [
        format!("/v1/jobs/{later}"),
        format!("/v1/jobs/{later}?wait_ms="),
        format!("/v1/jobs/{later}?wait_ms=0"),
    ] {
        assert_eq!(s.get(&path).await.ok(200)["state"], "scheduled");
    }
    for body in [
        json!({"worker": "w", "queues": ["probe"]}),
        json!({"worker": "w", "queues": ["probe"], "wait_ms": 0}),
        json!({"worker": "w", "queues": ["probe"], "wait_ms": null}),
    ] {
        assert_eq!(s.post("/v1/claim", body).await.ok(200)["jobs"], json!([]));
    }
    let done = s.enqueue(json!({"type": "t", "queue": "other"})).await;
    s.post(&format!("/v1/jobs/{done}/cancel"), json!({}))
        .await
        .ok(200);
    // Nor is a read that need not wait: its job already ended.
    let a = s.get(&format!("/v1/jobs/{done}?wait_ms=30000")).await;
    assert_eq!(a.ok(200)["state"], "cancelled");
    assert!(!claim.is_finished() && !read.is_finished());

    // Work for the held claim ends its wait; a new wait is taken then.
    let work = s.enqueue(json!({"type": "t", "queue": "lp"})).await;
    let (status, body) = claim.await.expect("claim");
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["jobs"][0]["id"], work.as_str());
    let a = s
        .post(
            "/v1/claim",
            json!({"worker": "w", "queues": ["probe"], "wait_ms": 200}),
        )
        .await;
    assert_eq!(a.ok(200)["jobs"], json!([]));
    // Both permits are held again: the read, and this one.
    let again = hold(
        &s,
        Method::POST,
        "/v1/claim",
        Some(json!({"worker": "w", "queues": ["lp"], "wait_ms": 30_000})),
    );
    assert_refused(&probe_until_refused(&s).await);

    // The held read ends once its job does.
    s.post(&format!("/v1/jobs/{later}/cancel"), json!({}))
        .await
        .ok(200);
    let (status, job) = read.await.expect("read");
    assert_eq!(status, 200, "{job}");
    assert_eq!(job["state"], "cancelled");
    s.enqueue(json!({"type": "t", "queue": "lp"})).await;
    assert_eq!(again.await.expect("claim").0, 200);
    s.stop().await;
}

/// A claim with `complete` items that asks to wait while the bound is full
/// is refused before it does anything: its completions are not recorded,
/// and the same request sent again once a wait ended records them.
async fn a_claim_refused_by_the_bound_records_nothing(b: Backend) {
    let s = bounded(b, 1).await;
    let id = s.enqueue(json!({"type": "t"})).await;
    let (claimed, token) = s.claim_one().await;
    assert_eq!(claimed, id);
    let held = hold(
        &s,
        Method::POST,
        "/v1/claim",
        Some(json!({"worker": "w", "queues": ["lp"], "wait_ms": 30_000})),
    );
    assert_refused(&probe_until_refused(&s).await);
    let body = json!({"worker": "w", "queues": ["probe"], "wait_ms": 100,
        "complete": [{"id": id, "lease_token": token, "result": 1}]});
    let a = s.post("/v1/claim", body.clone()).await;
    assert_refused(&a);
    assert!(!held.is_finished(), "the bound was full");
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}")).await.ok(200)["state"],
        "active",
        "the refused claim recorded its completion"
    );
    // Work for the held claim ends its wait; the same request is taken.
    s.enqueue(json!({"type": "t", "queue": "lp"})).await;
    assert_eq!(held.await.expect("held").0, 200);
    let a = s.post("/v1/claim", body).await;
    assert_eq!(a.ok(200)["completed"], json!([{"state": "completed"}]));
    let job = s.get(&format!("/v1/jobs/{id}")).await;
    assert_eq!(job.ok(200)["state"], "completed");
    assert_eq!(job.body["result"], 1);
    s.stop().await;
}

/// `n` copies of `item`, comma-separated.
fn items(item: &str, n: usize) -> String {
    vec![item; n].join(",")
}

/// A list's bound is applied while the body is parsed: the item past it
/// ends the parse, so what follows it is never read. Each body below
/// breaks off after that item with what is not JSON, which a parse of the
/// whole body would answer `400`; a truncated body of 16 MiB of zeros,
/// millions of values, is refused at its 1,001st.
async fn lists_stop_at_their_bound_while_parsed(b: Backend) {
    let s = Server::start(b).await;
    let junk = "] this is not JSON and is never read";

    // A batch: 413 at its 1,001st item, as a batch of 1,001 requests.
    let zeros = (idemq::MAX_BATCH_BYTES - 16) / 2;
    let huge = format!(r#"{{"jobs": [{}"#, "0,".repeat(zeros));
    assert!(huge.len() <= idemq::MAX_BATCH_BYTES);
    for body in [
        huge,
        format!(r#"{{"jobs": [{},{junk}"#, items("0", 1001)),
        format!(r#"{{"jobs": [{}]}}"#, items(r#"{"type": "t"}"#, 1001)),
    ] {
        let a = s.post_raw("/v1/jobs/batch", body).await;
        let p = a.problem(413, "payload-too-large");
        assert_eq!(p["field"], "jobs", "{}", a.text);
        assert_eq!(p["limit"], 1000);
        assert_eq!(p["detail"], "a batch holds at most 1000 items");
    }
    // 1,000 items are read, each on its own (here each is malformed).
    let a = s
        .post_raw(
            "/v1/jobs/batch",
            format!(r#"{{"jobs": [{}]}}"#, items("0", 1000)),
        )
        .await;
    let results = a.ok(200)["results"].as_array().unwrap().clone();
    assert_eq!(results.len(), 1000);
    assert_eq!(results[999]["error"]["type"], "/problems/bad-request");
    assert_eq!(s.job_count().await, 0);

    // Completions: 422 naming the list, nothing recorded.
    let id = s.enqueue(json!({"type": "t"})).await;
    let (_, token) = s.claim_one().await;
    let item = json!({"id": id, "lease_token": token}).to_string();
    for (path, field) in [("/v1/jobs/complete", "jobs"), ("/v1/claim", "complete")] {
        for body in [
            format!(r#"{{"{field}": [{},{junk}"#, items(&item, 1001)),
            format!(r#"{{"{field}": [{}]}}"#, items(&item, 1001)),
        ] {
            let a = s.post_raw(path, body).await;
            let p = a.problem(422, "validation");
            assert_eq!(p["field"], field, "{}", a.text);
            assert_eq!(p["reason"], "at most 1000 items per call");
        }
    }
    assert_eq!(
        s.get(&format!("/v1/jobs/{id}")).await.ok(200)["state"],
        "active"
    );
    // An item that is not an object is still named by its path.
    let a = s.post_raw("/v1/claim", r#"{"complete": [0]}"#).await;
    assert_eq!(a.problem(400, "bad-request")["field"], "complete.0");
    s.stop().await;
}

/// A claim names at most 1,000 queues and 1,000 types, each within the
/// length of a queue name (64 bytes) or a type (128 bytes); else `422`
/// naming the list. Names are otherwise taken as before (one no job has
/// matches nothing).
async fn claim_names_are_bounded(b: Backend) {
    let s = Server::start(b).await;
    let id = s
        .enqueue(json!({"type": "t".repeat(128), "queue": "q".repeat(64)}))
        .await;
    let queue = |n: usize| format!("q{n:063}");
    let mut queues: Vec<String> = (1..1000).map(queue).collect();
    queues.push("q".repeat(64));
    let mut types: Vec<String> = (1..1000).map(|n| format!("t{n:0127}")).collect();
    types.push("t".repeat(128));
    let a = s
        .post(
            "/v1/claim",
            json!({"worker": "w", "queues": queues, "types": types}),
        )
        .await;
    assert_eq!(a.ok(200)["jobs"][0]["id"], id.as_str());
    let a = s
        .post("/v1/claim", json!({"queues": ["", "not a queue"]}))
        .await;
    assert_eq!(a.ok(200)["jobs"], json!([]));

    for (body, field, reason) in [
        (
            json!({"queues": (0..1001).map(queue).collect::<Vec<_>>()}),
            "queues",
            "at most 1000 names",
        ),
        (
            json!({"types": (0..1001).map(queue).collect::<Vec<_>>()}),
            "types",
            "at most 1000 names",
        ),
        (
            json!({"queues": ["q", "q".repeat(65)]}),
            "queues",
            "each queue name must be at most 64 bytes",
        ),
        (
            json!({"types": ["t".repeat(129)]}),
            "types",
            "each type must be at most 128 bytes",
        ),
        // Bytes, not characters: 33 two-byte characters are 66 bytes.
        (
            json!({"queues": ["é".repeat(33)]}),
            "queues",
            "each queue name must be at most 64 bytes",
        ),
    ] {
        let a = s.post("/v1/claim", body).await;
        let p = a.problem(422, "validation");
        assert_eq!(p["field"], field, "{}", a.text);
        assert_eq!(p["reason"], reason);
    }
    // Counted while parsed: what follows the 1,001st name is never read.
    let a = s
        .post_raw(
            "/v1/claim",
            format!(
                r#"{{"queues": [{}, this is not JSON"#,
                items(r#""q""#, 1001)
            ),
        )
        .await;
    assert_eq!(a.problem(422, "validation")["field"], "queues");
    s.stop().await;
}
