//! Long-polling claims woken without a herd: a wake-up starts one waiting
//! claim of each group (the same queues and types), and a claim that got
//! jobs starts the next of its group.
//!
//! A waiting claim also looks by itself every 500 ms. The cases count the
//! looks the store sees, by time, only within a window no such look can
//! fall in: from the enqueue to 500 ms after the earliest first look (each
//! claim's next own look comes at least 500 ms after its first). A round
//! whose window is too short (first looks spread out on a loaded machine)
//! is run again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq_testkit::{Call, Tap, Through};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::harness::{Backend, Server};

instantiate!(
    a_wake_up_starts_one_waiting_claim_of_each_group,
    a_claim_that_got_jobs_starts_the_next_of_its_group
);

/// A waiting claim's own looks come at least this long apart.
const OWN_LOOK: Duration = Duration::from_millis(500);
/// The shortest window a round counts in.
const WINDOW: Duration = Duration::from_millis(150);
const ROUNDS: usize = 5;

/// When the store saw each look of a claim.
#[derive(Debug, Default)]
struct Looks(Mutex<Vec<Instant>>);

impl Looks {
    fn all(&self) -> Vec<Instant> {
        self.0.lock().unwrap().clone()
    }
    fn clear(&self) {
        self.0.lock().unwrap().clear();
    }
    fn between(&self, from: Instant, to: Instant) -> usize {
        self.all()
            .iter()
            .filter(|t| **t >= from && **t < to)
            .count()
    }
}

#[derive(Debug)]
struct Watch(Arc<Looks>);

#[async_trait::async_trait]
impl Tap for Watch {
    async fn before(&self, call: Call) -> idemq::Result<()> {
        if matches!(call, Call::Claim | Call::CompleteAndClaim { claims: true }) {
            self.0.0.lock().unwrap().push(Instant::now());
        }
        Ok(())
    }
}

async fn watched(b: Backend) -> (Server, Arc<Looks>) {
    let looks = Arc::new(Looks::default());
    let tap = looks.clone();
    let s = Server::start_wrapped(b, move |inner| Arc::new(Through::new(inner, Watch(tap)))).await;
    (s, looks)
}

/// A claim of one job from `queue` that waits up to 3 s.
fn waiting(s: &Server, queue: &str) -> JoinHandle<(Instant, Value)> {
    let (client, url) = (s.client.clone(), format!("{}/v1/claim", s.base));
    let body = json!({"worker": "w", "queues": [queue], "limit": 1, "wait_ms": 3000});
    tokio::spawn(async move {
        let r = client.post(url).json(&body).send().await.expect("claim");
        assert_eq!(r.status(), 200);
        let body: Value = r.json().await.expect("json");
        (Instant::now(), body)
    })
}

/// Starts `claims` (each made by `start`), waits until each made its first
/// look, and returns the end of the window no claim's own look falls in.
async fn all_waiting(
    looks: &Looks,
    n: usize,
    start: impl Fn() -> Vec<JoinHandle<(Instant, Value)>>,
) -> (Vec<JoinHandle<(Instant, Value)>>, Instant) {
    looks.clear();
    let claims = start();
    assert_eq!(claims.len(), n);
    let began = Instant::now();
    while looks.all().len() < n {
        assert!(began.elapsed() < Duration::from_secs(20), "first looks");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let earliest = looks.all().into_iter().min().expect("a look");
    (claims, earliest + OWN_LOOK)
}

async fn a_wake_up_starts_one_waiting_claim_of_each_group(b: Backend) {
    let (s, looks) = watched(b).await;
    const HERD: usize = 20;
    const ELSEWHERE: usize = 4;
    for round in 1..=ROUNDS {
        let (claims, clean_until) = all_waiting(&looks, HERD + ELSEWHERE, || {
            let mut v: Vec<_> = (0..HERD).map(|_| waiting(&s, "herd")).collect();
            v.extend((0..ELSEWHERE).map(|_| waiting(&s, "elsewhere")));
            v
        })
        .await;
        let enqueued = Instant::now();
        let id = s.enqueue(json!({"type": "t", "queue": "herd"})).await;
        let window_end = clean_until.min(enqueued + Duration::from_millis(400));
        tokio::time::sleep_until(window_end.into()).await;
        let seen = looks.between(enqueued, window_end);
        let mut got = Vec::new();
        for c in claims {
            let (at, body) = c.await.expect("claim task");
            if let Some(job) = body["jobs"].as_array().and_then(|j| j.first()) {
                got.push((at, job["id"].as_str().expect("id").to_owned()));
            }
        }
        assert_eq!(got.len(), 1, "one claim got the job: {got:?}");
        assert_eq!(got[0].1, id);
        if window_end.saturating_duration_since(enqueued) < WINDOW {
            assert!(round < ROUNDS, "no window of {WINDOW:?} in {ROUNDS} rounds");
            continue;
        }
        assert!(
            got[0].0 < window_end,
            "the job was claimed at once, not by a claim's own look"
        );
        // One claim of each group, and the next of the group whose claim
        // got the job: 3. A wake-up that reaches the hub more than once (the
        // embedded stores' signal leaves a permit beside waking, a Redis
        // subscription that reconnects wakes once more) adds as many per
        // group. A herd is every waiting claim.
        assert!(
            (2..=HERD / 2).contains(&seen),
            "{seen} looks after one enqueue, {} claims waiting",
            HERD + ELSEWHERE
        );
        break;
    }
    s.stop().await;
}

async fn a_claim_that_got_jobs_starts_the_next_of_its_group(b: Backend) {
    let (s, looks) = watched(b).await;
    const WAITING: usize = 5;
    const JOBS: usize = 3;
    for round in 1..=ROUNDS {
        let (claims, clean_until) = all_waiting(&looks, WAITING, || {
            (0..WAITING).map(|_| waiting(&s, "burst")).collect()
        })
        .await;
        let enqueued = Instant::now();
        let jobs: Vec<Value> = (0..JOBS)
            .map(|i| json!({"type": "t", "queue": "burst", "payload": {"i": i}}))
            .collect();
        let a = s.post("/v1/jobs/batch", json!({ "jobs": jobs })).await;
        assert_eq!(a.status, 200, "{}", a.text);
        let mut got = Vec::new();
        for c in claims {
            let (at, body) = c.await.expect("claim task");
            if !body["jobs"].as_array().expect("jobs").is_empty() {
                got.push(at);
            }
        }
        assert_eq!(got.len(), JOBS, "each job went to one claim");
        if clean_until.saturating_duration_since(enqueued) < WINDOW {
            assert!(round < ROUNDS, "no window of {WINDOW:?} in {ROUNDS} rounds");
            continue;
        }
        // One wake-up, and each claim that got a job started the next.
        let last = got.into_iter().max().expect("claimed");
        assert!(
            last < clean_until,
            "every job was claimed before any claim's own look ({:?} after the enqueue)",
            last - enqueued
        );
        break;
    }
    s.stop().await;
}
