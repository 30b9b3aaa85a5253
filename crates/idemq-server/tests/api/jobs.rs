//! Job queries and operator actions.

use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{Backend, Server};

instantiate!(
    get_and_list,
    empty_query_values_mean_omitted,
    job_history,
    wait_for_terminal,
    cancel_purge_promote,
    redrive_dead_jobs,
    bulk_actions,
    ids_named_like_fixed_routes,
    ids_of_dots_are_answered_as_sent_or_encoded,
    list_pages_are_bounded_in_bytes,
    a_job_over_the_page_bound_is_a_page_of_its_own,
);

async fn get_and_list(b: Backend) {
    let s = Server::start(b).await;
    let a = s
        .enqueue(
            json!({"type": "a", "queue": "q1", "tags": ["red"], "payload": {"n": 1},
            "idempotency": {"key": "get-key-1"}, "dedupe": "dk"}),
        )
        .await;
    let bb = s.enqueue(json!({"type": "b", "queue": "q2"})).await;
    let c = s
        .enqueue(json!({"type": "a", "queue": "q1", "delay_ms": 600000}))
        .await;

    let job = s.get(&format!("/v1/jobs/{a}")).await.ok(200).clone();
    for field in [
        "id",
        "type",
        "queue",
        "state",
        "payload",
        "result",
        "priority",
        "attempt",
        "attempts_used",
        "max_attempts",
        "run_at",
        "created_at",
        "updated_at",
        "finished_at",
        "timeout_ms",
        "deadline",
        "concurrency_key",
        "tags",
        "last_error",
        "cancel_requested",
        "idempotency",
        "dedupe",
    ] {
        assert!(job.get(field).is_some(), "missing {field}: {job}");
    }
    assert_eq!(job["state"], "ready");
    assert_eq!(job["payload"], json!({"n": 1}));
    assert_eq!(job["idempotency"]["scope"], "default");
    assert!(!job.to_string().contains("get-key-1"));
    assert_eq!(job["dedupe"]["key"], "dk");
    assert_eq!(job["dedupe"]["mode"], "pending");
    assert_eq!(job["dedupe"]["holds_binding"], true);
    s.get("/v1/jobs/nope").await.problem(404, "not-found");

    let all = s.get("/v1/jobs").await.ok(200).clone();
    assert_eq!(all["jobs"].as_array().unwrap().len(), 3);
    let by_queue = s.get("/v1/jobs?queue=q1&type=a").await.ok(200).clone();
    assert_eq!(by_queue["jobs"].as_array().unwrap().len(), 2);
    let sched = s.get("/v1/jobs?state=scheduled").await.ok(200).clone();
    assert_eq!(sched["jobs"][0]["id"], c.as_str());
    let red = s.get("/v1/jobs?tag=red").await.ok(200).clone();
    assert_eq!(red["jobs"][0]["id"], a.as_str());
    // Paging with the cursor, newest first.
    let p1 = s.get("/v1/jobs?limit=2").await.ok(200).clone();
    assert_eq!(p1["jobs"].as_array().unwrap().len(), 2);
    assert_eq!(p1["jobs"][0]["id"], c.as_str());
    let cursor = p1["next_cursor"].as_str().expect("a next page");
    let p2 = s
        .get(&format!("/v1/jobs?limit=2&cursor={cursor}"))
        .await
        .ok(200)
        .clone();
    assert_eq!(p2["jobs"][0]["id"], a.as_str());
    assert!(p2["next_cursor"].is_null());
    let _ = bb;
    s.get("/v1/jobs?state=nonsense")
        .await
        .problem(422, "validation");
    s.get("/v1/jobs?limit=5000")
        .await
        .problem(422, "validation");
    s.get("/v1/jobs?limit=abc")
        .await
        .problem(400, "bad-request");
    s.stop().await;
}

async fn empty_query_values_mean_omitted(b: Backend) {
    let s = Server::start(b).await;
    let a = s.enqueue(json!({"type": "a", "queue": "q1"})).await;
    let bb = s.enqueue(json!({"type": "b", "queue": "q2"})).await;
    // Every filter sent empty, as an HTML form sends them: the first page of
    // every job, `limit` at its default.
    for query in [
        "?state=&queue=&type=&tag=&limit=&cursor=",
        "?limit=",
        "?limit=&state=",
    ] {
        let page = s.get(&format!("/v1/jobs{query}")).await.ok(200).clone();
        let ids: Vec<_> = page["jobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|j| j["id"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(ids, vec![bb.clone(), a.clone()], "{query}");
        assert!(page["next_cursor"].is_null(), "{query}");
    }
    // `wait_ms=` is no wait: the job at once.
    let started = std::time::Instant::now();
    let job = s
        .get(&format!("/v1/jobs/{a}?wait_ms="))
        .await
        .ok(200)
        .clone();
    assert_eq!(job["id"], a.as_str());
    assert!(started.elapsed() < Duration::from_secs(5));
    s.get("/v1/jobs/unknown?wait_ms=")
        .await
        .problem(404, "not-found");
    // A value that is not a number is still refused; so is one out of bounds.
    for query in ["limit=abc", "limit=-1", "limit=1.5", "limit=%20"] {
        let a = s.get(&format!("/v1/jobs?{query}")).await;
        a.problem(400, "bad-request");
        assert!(
            a.body["detail"].as_str().unwrap().contains("limit"),
            "{}",
            a.text
        );
    }
    s.get("/v1/jobs?limit=0").await.problem(422, "validation");
    for query in ["wait_ms=abc", "wait_ms=-5"] {
        let a = s.get(&format!("/v1/jobs/{a}?{query}")).await;
        a.problem(400, "bad-request");
        assert!(
            a.body["detail"].as_str().unwrap().contains("wait_ms"),
            "{}",
            a.text
        );
    }
    s.get(&format!("/v1/jobs/{a}?wait_ms=60001"))
        .await
        .problem(422, "validation");
    s.stop().await;
}

async fn job_history(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "t"})).await;
    let (cid, token) = s.claim_one().await;
    assert_eq!(cid, id);
    let a = s
        .put(
            &format!("/v1/jobs/{id}/checkpoints/step-1"),
            json!({"lease_token": token, "value": {"charged": true}}),
        )
        .await;
    assert_eq!(a.ok(200)["stored"], true);
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token, "result": {"ok": 1}}),
    )
    .await
    .ok(200);
    let events = s
        .get(&format!("/v1/jobs/{id}/events"))
        .await
        .ok(200)
        .clone();
    let kinds: Vec<_> = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds.first().map(String::as_str), Some("accepted"));
    assert_eq!(kinds.last().map(String::as_str), Some("completed"));
    for e in events["events"].as_array().unwrap() {
        assert!(e["seq"].is_number() && e["at"].is_string() && e.get("data").is_some());
    }
    let runs = s.get(&format!("/v1/jobs/{id}/runs")).await.ok(200).clone();
    let run = &runs["runs"][0];
    assert_eq!(run["attempt"], 1);
    assert_eq!(run["worker"], "w-1");
    assert_eq!(run["outcome"], "completed");
    assert!(run["started_at"].is_string() && run["finished_at"].is_string());
    assert!(run.get("error").is_some());
    let cps = s
        .get(&format!("/v1/jobs/{id}/checkpoints"))
        .await
        .ok(200)
        .clone();
    assert_eq!(cps["checkpoints"], json!({"step-1": {"charged": true}}));
    let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
    assert_eq!(job["result"], json!({"ok": 1}));
    for sub in ["events", "runs", "checkpoints"] {
        s.get(&format!("/v1/jobs/missing/{sub}"))
            .await
            .problem(404, "not-found");
    }
    s.stop().await;
}

async fn wait_for_terminal(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "t"})).await;
    let (_, token) = s.claim_one().await;
    let waiter = {
        let client = s.client.clone();
        let url = format!("{}/v1/jobs/{id}?wait_ms=30000", s.base);
        tokio::spawn(async move {
            let r = client.get(url).send().await.expect("wait");
            (
                r.status(),
                r.json::<serde_json::Value>().await.expect("json"),
            )
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter waits while the job is active"
    );
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token}),
    )
    .await
    .ok(200);
    let (status, job) = waiter.await.expect("waiter");
    assert_eq!(status, 200);
    assert_eq!(job["state"], "completed");
    s.get(&format!("/v1/jobs/{id}?wait_ms=60001"))
        .await
        .problem(422, "validation");
    s.get("/v1/jobs/unknown?wait_ms=100")
        .await
        .problem(404, "not-found");
    s.stop().await;
}

async fn cancel_purge_promote(b: Backend) {
    let s = Server::start(b).await;
    let waiting = s.enqueue(json!({"type": "t", "delay_ms": 600000})).await;
    let a = s
        .post(&format!("/v1/jobs/{waiting}/promote"), json!({}))
        .await;
    assert_eq!(a.ok(200)["promoted"], true);
    let a = s
        .post(&format!("/v1/jobs/{waiting}/promote"), json!({}))
        .await;
    assert_eq!(a.ok(200)["promoted"], false);
    let a = s
        .post(&format!("/v1/jobs/{waiting}/cancel"), json!({}))
        .await;
    assert_eq!(
        a.ok(200).clone(),
        json!({"cancelled": true, "state": "cancelled"})
    );
    let a = s
        .post(&format!("/v1/jobs/{waiting}/cancel"), json!({}))
        .await;
    assert_eq!(
        a.ok(200).clone(),
        json!({"cancelled": false, "state": "cancelled"})
    );
    let active = s.enqueue(json!({"type": "t"})).await;
    let (_, token) = s.claim_one().await;
    let a = s
        .post(&format!("/v1/jobs/{active}/cancel"), json!({}))
        .await;
    assert_eq!(
        a.ok(200).clone(),
        json!({"cancelled": true, "state": "active"})
    );
    let hb = s
        .post(
            &format!("/v1/jobs/{active}/heartbeat"),
            json!({"lease_token": token}),
        )
        .await;
    assert_eq!(hb.ok(200)["cancel_requested"], true);
    let a = s.post(&format!("/v1/jobs/{active}/purge"), json!({})).await;
    assert_eq!(a.ok(200)["purged"], false);
    let a = s
        .post(&format!("/v1/jobs/{waiting}/purge"), json!({}))
        .await;
    assert_eq!(a.ok(200)["purged"], true);
    let a = s.post("/v1/jobs/unknown/purge", json!({})).await;
    assert_eq!(a.ok(200)["purged"], false);
    s.get(&format!("/v1/jobs/{waiting}"))
        .await
        .problem(404, "not-found");
    s.stop().await;
}

/// Enqueues a job and kills it with a permanent failure.
async fn dead_job(s: &Server, ty: &str) -> String {
    let id = s.enqueue(json!({"type": ty})).await;
    let a = s
        .post("/v1/claim", json!({"worker": "w", "types": [ty]}))
        .await;
    let token = a.ok(200)["jobs"][0]["lease_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let a = s
        .post(
            &format!("/v1/jobs/{id}/fail"),
            json!({"lease_token": token, "error": "boom", "retryable": false}),
        )
        .await;
    assert_eq!(a.ok(200)["state"], "dead");
    id
}

async fn redrive_dead_jobs(b: Backend) {
    let s = Server::start(b).await;
    let id = dead_job(&s, "t").await;
    let a = s
        .send(
            reqwest::Method::POST,
            &format!("/v1/jobs/{id}/redrive"),
            None,
            &[("idempotency-key", "redrive-1")],
        )
        .await;
    assert_eq!(
        a.ok(200).clone(),
        json!({"job_id": id, "outcome": "accepted"})
    );
    let job = s.get(&format!("/v1/jobs/{id}")).await.ok(200).clone();
    assert_eq!(job["state"], "ready");
    // The same key again: a replay, not a second redrive.
    let a = s
        .send(
            reqwest::Method::POST,
            &format!("/v1/jobs/{id}/redrive"),
            None,
            &[("idempotency-key", "redrive-1")],
        )
        .await;
    assert_eq!(a.ok(200)["outcome"], "replayed");
    // Without a key on a job that is not dead.
    let a = s.post(&format!("/v1/jobs/{id}/redrive"), json!({})).await;
    let p = a.problem(409, "not-dead");
    assert_eq!(p["job_id"], id.as_str());
    // The same key for another job.
    let other = dead_job(&s, "u").await;
    let a = s
        .send(
            reqwest::Method::POST,
            &format!("/v1/jobs/{other}/redrive"),
            None,
            &[("idempotency-key", "redrive-1")],
        )
        .await;
    let p = a.problem(409, "idempotency-conflict");
    assert_eq!(p["fields"], json!(["job_id"]));
    assert!(!a.text.contains("redrive-1"));
    // With overrides in the body.
    let a = s
        .post(
            &format!("/v1/jobs/{other}/redrive"),
            json!({"max_attempts": 3, "reset_checkpoints": true}),
        )
        .await;
    assert_eq!(a.ok(200)["outcome"], "accepted");
    let job = s.get(&format!("/v1/jobs/{other}")).await.ok(200).clone();
    assert_eq!(job["max_attempts"], 3);
    s.post(
        &format!("/v1/jobs/{other}/redrive"),
        json!({"max_attempts": 0}),
    )
    .await
    .problem(422, "validation");
    s.post(&format!("/v1/jobs/{other}/redrive"), json!({"bogus": 1}))
        .await
        .problem(400, "bad-request");
    s.stop().await;
}

async fn bulk_actions(b: Backend) {
    let s = Server::start(b).await;
    for _ in 0..3 {
        s.enqueue(json!({"type": "old", "queue": "bulk"})).await;
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let cut = s.queue.store().now().await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    for _ in 0..2 {
        s.enqueue(json!({"type": "new", "queue": "bulk"})).await;
    }
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "cancel", "filter": {"queue": "bulk", "before": cut}, "limit": 2}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"matched": 2, "done": 2}));
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "cancel", "filter": {"queue": "bulk", "state": "ready"}}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"matched": 3, "done": 3}));
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "purge", "filter": {"type": "new"}}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"matched": 2, "done": 2}));
    let d = dead_job(&s, "d").await;
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "redrive", "filter": {"state": "dead"}}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"matched": 1, "done": 1}));
    assert_eq!(
        s.get(&format!("/v1/jobs/{d}")).await.ok(200)["state"],
        "ready"
    );
    s.post("/v1/jobs/bulk", json!({"action": "cancel", "limit": 10001}))
        .await
        .problem(422, "validation");
    s.post("/v1/jobs/bulk", json!({"action": "explode"}))
        .await
        .problem(400, "bad-request");
    s.stop().await;
}

/// A job whose id is the name of a fixed route beside `/v1/jobs/{id}`
/// (`batch`, `explain`, `bulk`, `complete`) is reached by every route of a
/// job id, and the fixed routes keep serving their POST.
async fn ids_named_like_fixed_routes(b: Backend) {
    let s = Server::start(b).await;
    for word in ["batch", "explain", "bulk", "complete"] {
        let ty = format!("t.{word}");
        s.get(&format!("/v1/jobs/{word}"))
            .await
            .problem(404, "not-found");
        s.get(&format!("/v1/jobs/{word}?wait_ms=50"))
            .await
            .problem(404, "not-found");
        for sub in ["events", "runs", "checkpoints"] {
            s.get(&format!("/v1/jobs/{word}/{sub}"))
                .await
                .problem(404, "not-found");
        }
        let id = s
            .enqueue(json!({"type": ty, "job_id": word, "delay_ms": 600000}))
            .await;
        assert_eq!(id, word);
        let job = s.get(&format!("/v1/jobs/{word}")).await.ok(200).clone();
        assert_eq!(job["id"], word);
        assert_eq!(job["state"], "scheduled");
        let a = s.post(&format!("/v1/jobs/{word}/promote"), json!({})).await;
        assert_eq!(a.ok(200)["promoted"], true, "{word}");

        // The worker protocol.
        let claim = json!({"worker": "w-1", "types": [ty]});
        let a = s.post("/v1/claim", claim.clone()).await;
        assert_eq!(a.ok(200)["jobs"][0]["id"], word);
        let token = a.body["jobs"][0]["lease_token"]
            .as_str()
            .unwrap()
            .to_owned();
        let a = s
            .post(
                &format!("/v1/jobs/{word}/heartbeat"),
                json!({"lease_token": token}),
            )
            .await;
        assert_eq!(a.ok(200)["cancel_requested"], false, "{word}");
        let a = s
            .put(
                &format!("/v1/jobs/{word}/checkpoints/step-1"),
                json!({"lease_token": token, "value": word}),
            )
            .await;
        assert_eq!(a.ok(200)["stored"], true, "{word}");
        let a = s
            .post(
                &format!("/v1/jobs/{word}/release"),
                json!({"lease_token": token}),
            )
            .await;
        assert_eq!(a.ok(200)["state"], "ready", "{word}");
        let a = s.post("/v1/claim", claim.clone()).await;
        let token = a.ok(200)["jobs"][0]["lease_token"]
            .as_str()
            .unwrap()
            .to_owned();
        let a = s
            .post(
                &format!("/v1/jobs/{word}/fail"),
                json!({"lease_token": token, "error": "boom", "retryable": false}),
            )
            .await;
        assert_eq!(a.ok(200)["state"], "dead", "{word}");

        // The job's history.
        let events = s
            .get(&format!("/v1/jobs/{word}/events"))
            .await
            .ok(200)
            .clone();
        assert_eq!(events["events"][0]["kind"], "accepted", "{word}");
        let runs = s
            .get(&format!("/v1/jobs/{word}/runs"))
            .await
            .ok(200)
            .clone();
        assert_eq!(runs["runs"].as_array().unwrap().len(), 2, "{word}");
        let cps = s
            .get(&format!("/v1/jobs/{word}/checkpoints"))
            .await
            .ok(200)
            .clone();
        assert_eq!(cps["checkpoints"], json!({"step-1": word}));

        // Operator actions, then the last attempt.
        let a = s.post(&format!("/v1/jobs/{word}/redrive"), json!({})).await;
        assert_eq!(
            a.ok(200).clone(),
            json!({"job_id": word, "outcome": "accepted"})
        );
        let a = s.post("/v1/claim", claim.clone()).await;
        let token = a.ok(200)["jobs"][0]["lease_token"]
            .as_str()
            .unwrap()
            .to_owned();
        let a = s.post(&format!("/v1/jobs/{word}/cancel"), json!({})).await;
        assert_eq!(
            a.ok(200).clone(),
            json!({"cancelled": true, "state": "active"})
        );
        let a = s
            .post(
                &format!("/v1/jobs/{word}/complete"),
                json!({"lease_token": token, "result": {"w": word}}),
            )
            .await;
        assert_eq!(a.ok(200)["state"], "completed", "{word}");
        let job = s
            .get(&format!("/v1/jobs/{word}?wait_ms=100"))
            .await
            .ok(200)
            .clone();
        assert_eq!(job["state"], "completed");
        assert_eq!(job["result"], json!({"w": word}));
        let a = s.post(&format!("/v1/jobs/{word}/purge"), json!({})).await;
        assert_eq!(a.ok(200)["purged"], true, "{word}");
        s.get(&format!("/v1/jobs/{word}"))
            .await
            .problem(404, "not-found");
    }

    // The fixed routes still serve their POST.
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "x", "job_id": "complete"}]}),
        )
        .await;
    assert_eq!(a.ok(200)["results"][0]["outcome"], "accepted");
    let a = s
        .post(
            "/v1/jobs/explain",
            json!({"type": "x", "job_id": "complete"}),
        )
        .await;
    assert_eq!(a.ok(200)["outcome"], "replayed");
    let a = s.post("/v1/claim", json!({"types": ["x"]})).await;
    let token = a.ok(200)["jobs"][0]["lease_token"]
        .as_str()
        .unwrap()
        .to_owned();
    let a = s
        .post(
            "/v1/jobs/complete",
            json!({"jobs": [{"id": "complete", "lease_token": token}]}),
        )
        .await;
    assert_eq!(
        a.ok(200).clone(),
        json!({"results": [{"state": "completed"}]})
    );
    assert_eq!(
        s.get("/v1/jobs/complete").await.ok(200)["state"],
        "completed"
    );
    let a = s
        .post(
            "/v1/jobs/bulk",
            json!({"action": "purge", "filter": {"type": "x"}}),
        )
        .await;
    assert_eq!(a.ok(200).clone(), json!({"matched": 1, "done": 1}));
    s.stop().await;
}

/// `.` and `..` are valid job ids. URL parsers drop such dot segments, so
/// this sends its requests over a raw socket: the server answers the job for
/// the id as written and with its dots percent-encoded (what the Python
/// client sends).
async fn ids_of_dots_are_answered_as_sent_or_encoded(b: Backend) {
    let s = Server::start(b).await;
    for id in [".", ".."] {
        let got = s.enqueue(json!({"type": "dots", "job_id": id})).await;
        assert_eq!(got, id);
        for path in [id.to_owned(), id.replace('.', "%2E")] {
            let (status, text) = s
                .raw(&format!(
                    "GET /v1/jobs/{path} HTTP/1.1\r\nHost: {{addr}}\r\nConnection: close\r\n\r\n"
                ))
                .await;
            assert_eq!(status, 200, "{path}: {text}");
            assert!(text.contains(&format!("\"id\":\"{id}\"")), "{path}: {text}");
            let (status, text) = s
                .raw(&format!(
                    "GET /v1/jobs/{path}/events HTTP/1.1\r\nHost: {{addr}}\r\nConnection: close\r\n\r\n"
                ))
                .await;
            assert_eq!(status, 200, "{path}/events: {text}");
            assert!(text.contains("\"accepted\""), "{path}/events: {text}");
        }
    }
    s.stop().await;
}

/// The most bytes of a page of jobs (16 MiB).
const MAX_PAGE_BYTES: usize = 16 * 1024 * 1024;

/// Every page of `GET /v1/jobs?<query>` from the first, each as its body
/// text and JSON.
async fn all_pages(s: &Server, query: &str) -> Vec<(String, Value)> {
    let mut pages = Vec::new();
    let mut cursor = String::new();
    loop {
        let a = s.get(&format!("/v1/jobs?{query}&cursor={cursor}")).await;
        let page = a.ok(200).clone();
        let next = page["next_cursor"].as_str().map(str::to_owned);
        pages.push((a.text, page));
        match next {
            Some(c) => cursor = c,
            None => return pages,
        }
        assert!(pages.len() < 100, "paging does not end");
    }
}

/// The ids of a page's jobs.
fn ids(page: &Value) -> Vec<String> {
    page["jobs"]
        .as_array()
        .expect("jobs")
        .iter()
        .map(|j| j["id"].as_str().expect("id").to_owned())
        .collect()
}

async fn list_pages_are_bounded_in_bytes(b: Backend) {
    let s = Server::start(b).await;
    // 30 jobs of about 700 KB each (21 MB), three of them with a result
    // as large: more than one page's bytes, far fewer than its limit.
    let big = "x".repeat(700_000);
    let mut enqueued = Vec::new();
    for i in 0..30 {
        let ty = if i % 10 == 0 { "done" } else { "wait" };
        enqueued.push(
            s.enqueue(json!({"type": ty, "payload": {"n": i, "blob": big}}))
                .await,
        );
    }
    for _ in 0..3 {
        let a = s
            .post(
                "/v1/claim",
                json!({"worker": "w-1", "types": ["done"], "limit": 1}),
            )
            .await;
        let job = &a.ok(200)["jobs"][0];
        let (id, token) = (
            job["id"].as_str().unwrap(),
            job["lease_token"].as_str().unwrap(),
        );
        s.post(
            &format!("/v1/jobs/{id}/complete"),
            json!({"lease_token": token, "result": {"blob": big}}),
        )
        .await
        .ok(200);
    }
    let newest_first: Vec<String> = enqueued.iter().rev().cloned().collect();

    let pages = all_pages(&s, "limit=1000").await;
    assert!(pages.len() >= 2, "one page of {} bytes", pages[0].0.len());
    let mut seen = Vec::new();
    for (i, (text, page)) in pages.iter().enumerate() {
        let jobs = page["jobs"].as_array().expect("jobs");
        assert!(!jobs.is_empty(), "page {i} is empty");
        assert!(
            text.len() <= MAX_PAGE_BYTES,
            "page {i} holds {} jobs in {} bytes",
            jobs.len(),
            text.len()
        );
        // A page ends where the next job would have taken it past the
        // bound (the envelope counted with the longest cursor).
        if let Some((_, next)) = pages.get(i + 1) {
            let first = serde_json::to_string(&next["jobs"][0]).unwrap().len();
            assert!(
                text.len() + 1 + first + 32 > MAX_PAGE_BYTES,
                "page {i} ({} bytes) had room for the next job ({first} bytes)",
                text.len()
            );
        }
        // Every job whole.
        for job in jobs {
            assert_eq!(job["payload"]["blob"].as_str().map(str::len), Some(700_000));
        }
        seen.extend(ids(page));
    }
    // Every job exactly once, newest first.
    assert_eq!(seen, newest_first);

    // The count bound still applies below the byte bound.
    let a = s.get("/v1/jobs?limit=5").await;
    let page = a.ok(200).clone();
    assert_eq!(ids(&page), newest_first[..5]);
    let next = page["next_cursor"]
        .as_str()
        .expect("a next page")
        .to_owned();
    let a = s.get(&format!("/v1/jobs?limit=5&cursor={next}")).await;
    assert_eq!(ids(a.ok(200)), newest_first[5..10]);

    // Filters page alike: the `wait` jobs (27), by bytes.
    let waiting: Vec<String> = pages
        .iter()
        .flat_map(|(_, p)| p["jobs"].as_array().unwrap().clone())
        .filter(|j| j["type"] == "wait")
        .map(|j| j["id"].as_str().unwrap().to_owned())
        .collect();
    let by_type = all_pages(&s, "type=wait&limit=1000").await;
    assert!(by_type.len() >= 2);
    let seen: Vec<String> = by_type.iter().flat_map(|(_, p)| ids(p)).collect();
    assert_eq!(seen, waiting);
    s.stop().await;
}

async fn a_job_over_the_page_bound_is_a_page_of_its_own(b: Backend) {
    let s = Server::start(b).await;
    // A producer with a larger payload limit than the server's writes a
    // job whose payload and result together pass the page's bound.
    let producer = s
        .queue_with(idemq::QueueOptions {
            payload_limit: 16 * 1024 * 1024,
            ..Default::default()
        })
        .await;
    let older = s
        .enqueue(json!({"type": "small", "payload": {"n": 1}}))
        .await;
    let nine = "y".repeat(9 * 1024 * 1024);
    let huge = producer
        .enqueue(idemq::EnqueueRequest::new("huge").payload(json!(nine)))
        .await
        .unwrap();
    let claimed = producer
        .claim(idemq::ClaimOptions {
            types: Some(vec!["huge".into()]),
            worker: "w-1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(claimed[0].id, huge);
    producer
        .complete(&huge, &claimed[0].lease_token, Some(json!(nine)))
        .await
        .unwrap();
    let newer = s
        .enqueue(json!({"type": "small", "payload": {"n": 2}}))
        .await;

    let pages = all_pages(&s, "limit=10").await;
    let shape: Vec<Vec<String>> = pages.iter().map(|(_, p)| ids(p)).collect();
    assert_eq!(
        shape,
        vec![vec![newer.clone()], vec![huge.clone()], vec![older.clone()]],
        "pages of {:?} bytes",
        pages.iter().map(|(t, _)| t.len()).collect::<Vec<_>>()
    );
    // The job over the bound is answered whole, alone.
    let (text, page) = &pages[1];
    assert!(text.len() > MAX_PAGE_BYTES, "{} bytes", text.len());
    let job = &page["jobs"][0];
    assert_eq!(job["payload"].as_str().map(str::len), Some(nine.len()));
    assert_eq!(job["result"].as_str().map(str::len), Some(nine.len()));
    assert!(page["next_cursor"].is_string());
    s.stop().await;
}
