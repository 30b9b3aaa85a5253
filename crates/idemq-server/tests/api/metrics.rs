//! `/metrics` counts what this process did, whichever surface acted: the
//! API, a worker running on the server's queue, and maintenance. One case
//! per metric.

use std::time::{Duration, Instant};

use idemq::{HandlerContext, JobError, Worker};
use serde_json::{Value, json};

use crate::harness::{Backend, Server};

instantiate!(
    enqueues_count_api_library_and_schedule_ticks,
    claims_count_api_and_worker_claims,
    completions_count_api_and_worker_completions,
    retries_count_worker_retries,
    dead_counts_worker_dead_letters,
    lease_expiries_count_what_the_reaper_records,
    a_heartbeat_past_the_timeout_counts_its_retry_and_death,
    purges_count_operator_purges_and_retention
);

/// The value of the sample `name` (with its labels) in the exposition.
async fn sample(s: &Server, name: &str) -> f64 {
    let text = s.get("/metrics").await.text;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("no sample {name} in\n{text}"))
}

/// Runs `worker` on the server's queue until `done` holds (30 s at most).
async fn run_worker_until(s: &Server, worker: Worker, done: impl AsyncFn() -> bool) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    let start = Instant::now();
    while !done().await {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the worker did not get there"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = tx.send(());
    task.await.expect("worker task").expect("worker run");
    let _ = s;
}

fn worker(s: &Server) -> Worker {
    Worker::new(s.queue.clone())
        .poll_interval(Duration::from_millis(50))
        .maintenance(false)
}

async fn state(s: &Server, id: &str) -> Value {
    s.get(&format!("/v1/jobs/{id}")).await.body["state"].clone()
}

async fn claims_count_api_and_worker_claims(b: Backend) {
    let s = Server::start(b).await;
    assert_eq!(sample(&s, "idemq_claims_total").await, 0.0);
    s.enqueue(json!({"type": "api"})).await;
    s.claim_one().await;
    let id = s.enqueue(json!({"type": "w"})).await;
    let w = worker(&s).handle("w", |_c: HandlerContext, _p: Value| async move {
        Ok::<_, JobError>(())
    });
    run_worker_until(&s, w, async || state(&s, &id).await == "completed").await;
    assert_eq!(sample(&s, "idemq_claims_total").await, 2.0);
    // The API's claim and at least one of the worker's calls.
    assert!(sample(&s, "idemq_claim_duration_seconds_count").await >= 2.0);
}

async fn enqueues_count_api_library_and_schedule_ticks(b: Backend) {
    let s = Server::start(b).await;
    let accepted = "idemq_enqueue_total{outcome=\"accepted\"}";
    let replayed = "idemq_enqueue_total{outcome=\"replayed\"}";
    s.enqueue(json!({"type": "api", "idempotency": {"key": "k"}}))
        .await;
    // The same request through the library the server runs on (an
    // embedding application's call, or the built-in worker's).
    let again = idemq::EnqueueRequest::new("api").idempotency_key("k");
    s.queue.enqueue(again).await.expect("replay");
    // A schedule's tick, fired as the server's maintenance fires them.
    let every = idemq::ScheduleDefinition::every(
        Duration::from_secs(1),
        idemq::EnqueueRequest::new("tick"),
    );
    assert!(s.queue.schedule_set("s.every", every).await.expect("set"));
    let start = Instant::now();
    while s.queue.fire_schedules(10).await.expect("fire") == 0 {
        assert!(start.elapsed() < Duration::from_secs(10), "no tick fired");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(sample(&s, accepted).await, 2.0);
    assert_eq!(sample(&s, replayed).await, 1.0);
    assert_eq!(
        sample(&s, "idemq_enqueue_duration_seconds_count").await,
        3.0
    );
}

async fn completions_count_api_and_worker_completions(b: Backend) {
    let s = Server::start(b).await;
    s.enqueue(json!({"type": "api"})).await;
    let (id, token) = s.claim_one().await;
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token}),
    )
    .await
    .ok(200);
    assert_eq!(sample(&s, "idemq_completions_total").await, 1.0);
    let ids = [
        s.enqueue(json!({"type": "w"})).await,
        s.enqueue(json!({"type": "w"})).await,
    ];
    let w = worker(&s).handle("w", |_c: HandlerContext, _p: Value| async move {
        Ok::<_, JobError>(())
    });
    run_worker_until(&s, w, async || {
        state(&s, &ids[0]).await == "completed" && state(&s, &ids[1]).await == "completed"
    })
    .await;
    assert_eq!(sample(&s, "idemq_completions_total").await, 3.0);
}

async fn retries_count_worker_retries(b: Backend) {
    let s = Server::start(b).await;
    let id = s
        .enqueue(json!({"type": "w", "retry": {"kind": "fixed", "delay_ms": 3600000}}))
        .await;
    let w = worker(&s).handle("w", |_c: HandlerContext, _p: Value| async move {
        Err::<(), _>(JobError::retryable("try later"))
    });
    run_worker_until(&s, w, async || state(&s, &id).await == "scheduled").await;
    assert_eq!(sample(&s, "idemq_retries_total").await, 1.0);
    assert_eq!(sample(&s, "idemq_dead_total").await, 0.0);
}

async fn dead_counts_worker_dead_letters(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "w"})).await;
    let w = worker(&s).handle("w", |_c: HandlerContext, _p: Value| async move {
        Err::<(), _>(JobError::permanent("no"))
    });
    run_worker_until(&s, w, async || state(&s, &id).await == "dead").await;
    assert_eq!(sample(&s, "idemq_dead_total").await, 1.0);
}

async fn lease_expiries_count_what_the_reaper_records(b: Backend) {
    let s = Server::start(b).await;
    s.enqueue(json!({"type": "t"})).await;
    let a = s.post("/v1/claim", json!({"lease_ms": 100})).await;
    let (id, token) = {
        let j = &a.ok(200)["jobs"][0];
        (
            j["id"].as_str().unwrap().to_owned(),
            j["lease_token"].as_str().unwrap().to_owned(),
        )
    };
    // A refused worker call is not a lease expiry.
    s.post(
        &format!("/v1/jobs/{id}/heartbeat"),
        json!({"lease_token": "stale"}),
    )
    .await
    .problem(409, "lease-lost");
    assert_eq!(sample(&s, "idemq_lease_expiries_total").await, 0.0);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Maintenance (here called as the maintenance loop calls it) reaps it;
    // the job, with attempts left, runs again: a retry too.
    assert_eq!(s.queue.reap_leases(100).await.unwrap(), 1);
    assert_eq!(sample(&s, "idemq_lease_expiries_total").await, 1.0);
    assert_eq!(sample(&s, "idemq_retries_total").await, 1.0);
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token}),
    )
    .await
    .problem(409, "lease-lost");
    assert_eq!(sample(&s, "idemq_lease_expiries_total").await, 1.0);
}

/// A client's worker (Python, TypeScript, Go) learns of its timeout from a
/// heartbeat, which records the attempt's end: a retry while attempts are
/// left, then a death.
async fn a_heartbeat_past_the_timeout_counts_its_retry_and_death(b: Backend) {
    let s = Server::start(b).await;
    let id = s
        .enqueue(json!({
            "type": "t", "timeout_ms": 100, "max_attempts": 2,
            "retry": {"kind": "fixed", "delay_ms": 1},
        }))
        .await;
    for (attempt, retries, dead) in [(1, 1.0, 0.0), (2, 1.0, 1.0)] {
        // Past the retry's 1 ms delay.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let (claimed, token) = s.claim_one().await;
        assert_eq!(claimed, id, "attempt {attempt}");
        tokio::time::sleep(Duration::from_millis(150)).await;
        s.post(
            &format!("/v1/jobs/{id}/heartbeat"),
            json!({"lease_token": token}),
        )
        .await
        .problem(409, "lease-lost");
        assert_eq!(sample(&s, "idemq_retries_total").await, retries);
        assert_eq!(sample(&s, "idemq_dead_total").await, dead);
    }
    assert_eq!(state(&s, &id).await, "dead");
    assert_eq!(sample(&s, "idemq_lease_expiries_total").await, 0.0);
}

async fn purges_count_operator_purges_and_retention(b: Backend) {
    let s = Server::start(b).await;
    let id = s.enqueue(json!({"type": "t", "delay_ms": 3600000})).await;
    s.post(&format!("/v1/jobs/{id}/purge"), json!({}))
        .await
        .ok(200);
    assert_eq!(
        sample(&s, "idemq_purges_total{reason=\"operator\"}").await,
        1.0
    );
    // A job kept 0 ms after it finished is deleted by the retention sweep.
    s.enqueue(json!({"type": "t", "keep_ms": 0})).await;
    let (id, token) = s.claim_one().await;
    s.post(
        &format!("/v1/jobs/{id}/complete"),
        json!({"lease_token": token}),
    )
    .await
    .ok(200);
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(s.queue.sweep_retention(100).await.unwrap(), 1);
    assert_eq!(
        sample(&s, "idemq_purges_total{reason=\"retention\"}").await,
        1.0
    );
    assert_eq!(
        sample(&s, "idemq_purges_total{reason=\"operator\"}").await,
        1.0
    );
}
