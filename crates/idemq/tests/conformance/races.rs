//! Conformance cases: races between clients on separate connections.
//!
//! Every case opens several client queues with `Harness::another_queue` (each
//! its own connections: its own pool on PostgreSQL, its own writer on
//! SQLite), spreads its tasks over them round-robin and starts the tasks
//! together behind a barrier. The assertions are invariants that hold
//! whichever way a race goes; where both ways are possible, each way is
//! checked for what it must leave behind. Every case also shows that its race
//! happened: each call records when it was in flight, and a case requires at
//! least one pair of calls in flight at once (in each race, or in at least one
//! round of a case that races two calls round after round).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::{
    BatchOptions, CancelOutcome, ClaimOptions, ClaimedJob, ConflictSource, DedupeOptions,
    EnqueueRequest, EnqueueResult, Error, FailOptions, JobState, NonReplaceableReason, Outcome,
    Queue, RedriveOptions, RetryPolicy,
};
use idemq_testkit::Harness;
use serde_json::{Value, json};
use tokio::sync::Barrier;
use tokio::task::JoinHandle;

idemq_testkit::instantiate!(
    identical_idempotent_enqueues_make_one_job,
    conflicting_idempotent_enqueues_accept_one,
    identical_explicit_job_id_enqueues_make_one_job,
    idempotent_requests_coalesced_on_one_dedupe_key_all_bind_it,
    debounce_enqueues_on_one_key_make_one_job,
    pending_dedupe_enqueues_on_one_key_make_one_job,
    replace_enqueues_on_one_key_make_one_job,
    replace_racing_promote_is_replaced_or_window_elapsed,
    replace_racing_promote_and_claim_never_loses_a_replace,
    claimers_take_every_job_exactly_once,
    claimers_never_run_two_jobs_of_one_concurrency_key,
    cancel_racing_complete_completes,
    cancel_racing_fail_ends_once,
    cancel_racing_release_or_snooze_cancels,
    complete_racing_a_reclaim_after_lease_expiry,
    batches_with_keys_in_opposite_orders_do_not_deadlock,
    redrive_with_one_key_from_many_clients_redrives_once,
    redrive_without_a_key_from_many_clients_redrives_once,
    concurrent_writes_on_one_queue_stand_or_fall_alone,
    concurrent_single_enqueues_on_one_queue_each_get_their_own_answer,
);

/// Client queues per case.
const CLIENTS: usize = 8;
/// Upper bound of a whole race: a deadlock or a livelock fails, never hangs.
const RACE_LIMIT: Duration = Duration::from_secs(60);

/// `n` new client queues on the harness's database, each over its own connections.
async fn clients(h: &Harness, n: usize) -> Vec<Queue> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(h.another_queue().await);
    }
    out
}

/// Rounds of a case in which at least two calls were in flight at once.
#[derive(Clone, Default)]
struct Interleavings(Arc<AtomicUsize>);

impl Interleavings {
    /// Fails the case unless some round interleaved: a race that never
    /// happened proves nothing.
    fn assert_seen(&self, what: &str) {
        let n = self.0.load(Ordering::SeqCst);
        assert!(n > 0, "{what}: no two calls were ever in flight at once");
    }
}

/// The start line of one race: a barrier, and when each call was in flight.
struct Start {
    barrier: Barrier,
    calls: usize,
    spans: Mutex<Vec<(tokio::time::Instant, tokio::time::Instant)>>,
    seen: Interleavings,
}

impl Start {
    /// A race of `calls` calls, counted in `seen` when two of them overlap.
    fn new(calls: usize, seen: &Interleavings) -> Arc<Self> {
        Arc::new(Self {
            barrier: Barrier::new(calls),
            calls,
            spans: Mutex::new(Vec::with_capacity(calls)),
            seen: seen.clone(),
        })
    }

    /// Records one finished call; the last one counts the race if any two
    /// calls were in flight at once.
    fn record(&self, span: (tokio::time::Instant, tokio::time::Instant)) {
        let mut spans = self.spans.lock().expect("spans");
        spans.push(span);
        if spans.len() == self.calls {
            let overlap = spans
                .iter()
                .enumerate()
                .any(|(i, a)| spans[i + 1..].iter().any(|b| a.0 < b.1 && b.0 < a.1));
            if overlap {
                self.seen.0.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// Spawns `fut`, which starts once every task of `start` is there.
fn spawn_at<T: Send + 'static>(
    start: &Arc<Start>,
    fut: impl Future<Output = T> + Send + 'static,
) -> JoinHandle<T> {
    let s = start.clone();
    tokio::spawn(async move {
        s.barrier.wait().await;
        let t0 = tokio::time::Instant::now();
        let out = fut.await;
        s.record((t0, tokio::time::Instant::now()));
        out
    })
}

/// Joins a task, failing the case if it panicked or the race took too long.
async fn join<T>(task: JoinHandle<T>) -> T {
    tokio::time::timeout(RACE_LIMIT, task)
        .await
        .expect("the race finished in time (no deadlock)")
        .expect("the task did not panic")
}

/// Runs `n` tasks together, task `i` on client `i % clients.len()`; their
/// results in task order.
async fn race<T, Fut>(clients: &[Queue], n: usize, f: impl Fn(usize, Queue) -> Fut) -> Vec<T>
where
    T: Send + 'static,
    Fut: Future<Output = T> + Send + 'static,
{
    let seen = Interleavings::default();
    let barrier = Start::new(n, &seen);
    let tasks: Vec<_> = (0..n)
        .map(|i| spawn_at(&barrier, f(i, clients[i % clients.len()].clone())))
        .collect();
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(join(t).await);
    }
    seen.assert_seen("race");
    out
}

fn claim_options(worker: &str, limit: u32) -> ClaimOptions {
    ClaimOptions {
        limit,
        worker: worker.into(),
        ..ClaimOptions::default()
    }
}

fn count(kinds: &[String], kind: &str) -> usize {
    kinds.iter().filter(|k| *k == kind).count()
}

/// Every job in the database, however many.
async fn all_jobs(h: &Harness) -> Vec<idemq::Job> {
    idemq_testkit::ledger::all_jobs(&h.queue).await
}

// ---------------------------------------------------------------------------
// Idempotent enqueue (docs/idempotency.md).

async fn identical_idempotent_enqueues_make_one_job(h: Harness) {
    let clients = clients(&h, CLIENTS).await;
    let results = race(&clients, 64, |_, q| async move {
        q.enqueue_with_result(
            EnqueueRequest::new("invoice.capture")
                .queue("billing")
                .payload(json!({"invoice": 42}))
                .idempotency_key("capture:inv_42"),
        )
        .await
    })
    .await;
    let mut ids = HashSet::new();
    let (mut accepted, mut replayed) = (0, 0);
    for r in results {
        let r = r.expect("no caller sees an error");
        match r.outcome {
            Outcome::Accepted => accepted += 1,
            Outcome::Replayed => replayed += 1,
            other => panic!("unexpected outcome {other}"),
        }
        ids.insert(r.job_id);
    }
    assert_eq!((accepted, replayed), (1, 63));
    assert_eq!(ids.len(), 1, "every caller got the same id");
    let id = ids.into_iter().next().unwrap();
    assert_eq!(h.totals().await, (1, 1), "one job, one event");
    assert_eq!(h.event_kinds(&id).await, vec!["accepted"]);
    let job = h.job(&id).await;
    assert_eq!(job.payload, json!({"invoice": 42}));
    assert_eq!(
        h.queue
            .lookup_key("default", "capture:inv_42")
            .await
            .unwrap()
            .map(|b| b.job_id),
        Some(id)
    );
}

async fn conflicting_idempotent_enqueues_accept_one(h: Harness) {
    let clients = clients(&h, CLIENTS).await;
    let results = race(&clients, 32, |i, q| async move {
        let r = q
            .enqueue_with_result(
                EnqueueRequest::new("invoice.capture")
                    .payload(json!({"attempt": i}))
                    .idempotency_key("capture:inv_7"),
            )
            .await;
        (i, r)
    })
    .await;
    let mut accepted = Vec::new();
    let mut conflicts = Vec::new();
    for (i, r) in results {
        match r {
            Ok(EnqueueResult {
                job_id,
                outcome: Outcome::Accepted,
            }) => accepted.push((i, job_id)),
            Ok(other) => panic!("a request with another payload got {other:?}"),
            Err(Error::EnqueueIdempotencyConflict(c)) => conflicts.push(c),
            Err(e) => panic!("unexpected error {e:?}"),
        }
    }
    assert_eq!(
        (accepted.len(), conflicts.len()),
        (1, 31),
        "one accepted, every other a conflict"
    );
    let (winner, id) = accepted.remove(0);
    for c in &conflicts {
        assert_eq!(c.job_id, id, "the conflict names the accepted job");
        assert_eq!(c.source, ConflictSource::IdempotencyKey);
        assert_eq!(c.fields, vec!["payload"]);
    }
    assert_eq!(h.totals().await, (1, 1), "one job, one event");
    assert_eq!(
        h.job(&id).await.payload,
        json!({"attempt": winner}),
        "the job holds the accepted request's payload"
    );
}

async fn identical_explicit_job_id_enqueues_make_one_job(h: Harness) {
    let clients = clients(&h, CLIENTS).await;
    let results = race(&clients, 32, |_, q| async move {
        q.enqueue_with_result(
            EnqueueRequest::new("order.ship")
                .job_id("order-1001")
                .payload(json!({"order": 1001})),
        )
        .await
    })
    .await;
    let (mut accepted, mut replayed) = (0, 0);
    for r in results {
        let r = r.expect("no caller sees an error");
        assert_eq!(r.job_id, "order-1001");
        match r.outcome {
            Outcome::Accepted => accepted += 1,
            Outcome::Replayed => replayed += 1,
            other => panic!("unexpected outcome {other}"),
        }
    }
    assert_eq!((accepted, replayed), (1, 31));
    assert_eq!(h.totals().await, (1, 1));
}

async fn idempotent_requests_coalesced_on_one_dedupe_key_all_bind_it(h: Harness) {
    // Each request has its own idempotency key and the same dedupe key: one
    // job, and every key, whatever its outcome, is bound to it (docs/dedupe.md,
    // "Order of checks").
    let clients = clients(&h, CLIENTS).await;
    let req = |i: usize| {
        EnqueueRequest::new("sync-payments")
            .payload(json!({"n": i}))
            .idempotency_key(format!("sync-request-{i}"))
            .dedupe(DedupeOptions::key("acct-1"))
    };
    let results = race(&clients, 32, move |i, q| async move {
        q.enqueue_with_result(req(i)).await
    })
    .await;
    let mut ids = HashSet::new();
    let mut accepted = 0;
    for r in results {
        let r = r.expect("no caller sees an error");
        match r.outcome {
            Outcome::Accepted => accepted += 1,
            Outcome::Coalesced => {}
            other => panic!("unexpected outcome {other}"),
        }
        ids.insert(r.job_id);
    }
    assert_eq!((accepted, ids.len()), (1, 1));
    let id = ids.into_iter().next().unwrap();
    assert_eq!(h.totals().await, (1, 1));
    for i in 0..32 {
        let bound = h
            .queue
            .lookup_key("default", &format!("sync-request-{i}"))
            .await
            .unwrap()
            .unwrap_or_else(|| panic!("key {i} is bound"));
        assert_eq!(bound.job_id, id, "key {i}");
        let again = h.queue.enqueue_with_result(req(i)).await.unwrap();
        assert_eq!(
            (again.job_id.as_str(), again.outcome),
            (id.as_str(), Outcome::Replayed)
        );
    }
    assert_eq!(h.totals().await, (1, 1), "replays write nothing");
}

// ---------------------------------------------------------------------------
// Deduplication (docs/dedupe.md): one job per binding generation.

/// 32 concurrent requests on one dedupe key, each with its own payload:
/// exactly one is accepted and every other gets `expected` naming it.
/// Returns the job and the index of the accepted request.
async fn dedupe_burst(
    h: &Harness,
    dedupe: DedupeOptions,
    delay: Option<Duration>,
    expected: Outcome,
) -> (String, usize, Vec<(usize, Outcome)>) {
    let clients = clients(h, CLIENTS).await;
    let key = dedupe.key.clone();
    let results = race(&clients, 32, move |i, q| {
        let mut req = EnqueueRequest::new("sync-payments")
            .payload(json!({"n": i}))
            .dedupe(dedupe.clone());
        if let Some(d) = delay {
            req = req.delay(d);
        }
        async move { (i, q.enqueue_with_result(req).await) }
    })
    .await;
    let mut accepted = Vec::new();
    let mut others = Vec::new();
    let mut ids = HashSet::new();
    for (i, r) in results {
        let r = r.expect("no caller sees an error");
        ids.insert(r.job_id.clone());
        if r.outcome == Outcome::Accepted {
            accepted.push(i);
        } else {
            assert_eq!(r.outcome, expected, "request {i}");
            others.push((i, r.outcome));
        }
    }
    assert_eq!(accepted.len(), 1, "exactly one request creates a job");
    assert_eq!(ids.len(), 1, "every request names that job");
    assert_eq!(others.len(), 31);
    let id = ids.into_iter().next().unwrap();
    assert_eq!(h.jobs().await.len(), 1, "one job");
    let binding = h
        .queue
        .dedupe_lookup("sync-payments", &key)
        .await
        .unwrap()
        .expect("a live binding");
    assert_eq!(binding.job_id, id, "the job holds the key");
    (id, accepted[0], others)
}

async fn debounce_enqueues_on_one_key_make_one_job(h: Harness) {
    let dedupe = DedupeOptions::key("acct-1")
        .ttl(Duration::from_secs(60))
        .extend();
    let (id, winner, _) = dedupe_burst(&h, dedupe, None, Outcome::Coalesced).await;
    assert_eq!(
        h.totals().await,
        (1, 1),
        "coalesced requests write no event"
    );
    assert_eq!(
        h.job(&id).await.payload,
        json!({"n": winner}),
        "leading edge: the first payload runs"
    );
}

async fn pending_dedupe_enqueues_on_one_key_make_one_job(h: Harness) {
    let (id, winner, _) =
        dedupe_burst(&h, DedupeOptions::key("acct-1"), None, Outcome::Coalesced).await;
    assert_eq!(
        h.totals().await,
        (1, 1),
        "coalesced requests write no event"
    );
    assert_eq!(h.job(&id).await.payload, json!({"n": winner}));
}

async fn replace_enqueues_on_one_key_make_one_job(h: Harness) {
    // Not due for a minute: every later request lands on the waiting job.
    let (id, _, others) = dedupe_burst(
        &h,
        DedupeOptions::key("acct-1").replace(),
        Some(Duration::from_secs(60)),
        Outcome::Replaced,
    )
    .await;
    let kinds = h.event_kinds(&id).await;
    assert_eq!(kinds[0], "accepted");
    assert_eq!(
        count(&kinds, "replaced"),
        others.len(),
        "one event per landed replace"
    );
    assert_eq!(kinds.len(), 1 + others.len());
    // The payload is the one of whichever request landed last.
    let payload = h.job(&id).await.payload;
    assert!(
        others.iter().any(|(i, _)| payload == json!({"n": i})),
        "the job holds the payload of a landed replace, got {payload}"
    );
}

// ---------------------------------------------------------------------------
// Replace racing promote and claim: a replace lands only on a job that is
// waiting and not due, and `promote` is what makes it due.

const DIGEST: &str = "digest";

/// A replace-mode request on `key`, due in a second.
fn digest(key: &str, payload: Value) -> EnqueueRequest {
    EnqueueRequest::new(DIGEST)
        .payload(payload)
        .delay(Duration::from_secs(1))
        .dedupe(DedupeOptions::key(key).replace())
}

/// Accepts a new keyed job (the key must be free), then races `promote` on
/// client 0 against a replace from each of clients 1..=`replacers`; when
/// `claim` is set, client 0 claims after its promote and the next client
/// claims at once, too. Returns the job, its first payload, the replaces'
/// payloads and outcomes, and what the claims got.
async fn race_replaces(
    seen: &Interleavings,
    clients: &[Queue],
    key: &'static str,
    round: usize,
    replacers: usize,
    claim: bool,
) -> (String, Value, Vec<(Value, Outcome)>, Vec<ClaimedJob>) {
    let old = json!({"round": round, "v": "old"});
    let first = clients[0]
        .enqueue_with_result(digest(key, old.clone()))
        .await
        .unwrap();
    assert_eq!(
        first.outcome,
        Outcome::Accepted,
        "round {round}: the previous job ended, so the key is free"
    );
    let id = first.job_id;
    let barrier = Start::new(1 + replacers + usize::from(claim), seen);
    let claim_digest = |worker: &str| ClaimOptions {
        types: Some(vec![DIGEST.into()]),
        ..claim_options(worker, 1)
    };
    let claimer = claim.then(|| {
        let (q, opts) = (clients[1 + replacers].clone(), claim_digest("claimer"));
        spawn_at(&barrier, async move { q.claim(opts).await.expect("claim") })
    });
    let promoter = {
        let (q, id, opts) = (clients[0].clone(), id.clone(), claim_digest("promoter"));
        spawn_at(&barrier, async move {
            let promoted = q.promote(&id).await.expect("promote");
            assert!(
                promoted,
                "round {round}: the job was scheduled until promoted"
            );
            if !claim {
                return Vec::new();
            }
            q.claim(opts).await.expect("claim")
        })
    };
    let payloads: Vec<Value> = (1..=replacers)
        .map(|k| json!({"round": round, "v": format!("new-{k}")}))
        .collect();
    let tasks: Vec<_> = payloads
        .iter()
        .enumerate()
        .map(|(k, p)| {
            let q = clients[1 + k].clone();
            let r = digest(key, p.clone());
            spawn_at(&barrier, async move { q.enqueue_with_result(r).await })
        })
        .collect();
    let mut claimed = join(promoter).await;
    if let Some(t) = claimer {
        claimed.extend(join(t).await);
    }
    let mut outcomes = Vec::new();
    for (p, t) in payloads.into_iter().zip(tasks) {
        let r = join(t).await.expect("a replace is answered, never refused");
        assert_eq!(
            r.job_id, id,
            "round {round}: the replace names the keyed job"
        );
        outcomes.push((p, r.outcome));
    }
    (id, old, outcomes, claimed)
}

/// The payloads of the replaces that reported `replaced`.
fn landed(outcomes: &[(Value, Outcome)]) -> Vec<&Value> {
    outcomes
        .iter()
        .filter(|(_, o)| *o == Outcome::Replaced)
        .map(|(p, _)| p)
        .collect()
}

/// The job's log: accepted, one `replaced` per landed replace, then `rest`.
async fn assert_log(h: &Harness, id: &str, round: usize, replaced: usize, rest: &[&str]) {
    let mut expected = vec!["accepted".to_string()];
    expected.extend(std::iter::repeat_n("replaced".to_string(), replaced));
    expected.extend(rest.iter().map(|k| k.to_string()));
    assert_eq!(h.event_kinds(id).await, expected, "round {round}");
}

async fn replace_racing_promote_is_replaced_or_window_elapsed(h: Harness) {
    let seen = Interleavings::default();
    const KEY: &str = "reminder-acct-1";
    let clients = clients(&h, 3).await;
    let mut tally: HashMap<String, usize> = HashMap::new();
    for round in 0..30 {
        let (id, old, outcomes, _) = race_replaces(&seen, &clients, KEY, round, 2, false).await;
        for (_, o) in &outcomes {
            // The job never started: it is either not due (the replace lands)
            // or due (`window_elapsed`), never `not_pending`.
            assert!(
                matches!(
                    o,
                    Outcome::Replaced
                        | Outcome::NonReplaceable {
                            reason: NonReplaceableReason::WindowElapsed
                        }
                ),
                "round {round}: {o} for a waiting job that never started"
            );
            *tally.entry(o.to_string()).or_default() += 1;
        }
        let landed = landed(&outcomes);
        let job = h.job(&id).await;
        assert_eq!(job.state, JobState::Ready, "round {round}: promoted");
        if landed.is_empty() {
            assert_eq!(job.payload, old, "round {round}");
        } else {
            assert!(
                landed.contains(&&job.payload),
                "round {round}: {}",
                job.payload
            );
        }
        assert_log(&h, &id, round, landed.len(), &["promoted"]).await;
        assert!(h.queue.cancel(&id).await.unwrap().cancelled);
    }
    eprintln!("[{}] replace vs promote: {tally:?}", h.backend);
    seen.assert_seen("replace_racing_promote_is_replaced_or_window_elapsed");
}

async fn replace_racing_promote_and_claim_never_loses_a_replace(h: Harness) {
    let seen = Interleavings::default();
    const KEY: &str = "digest-acct-1";
    let clients = clients(&h, 4).await;
    let mut tally: HashMap<&'static str, usize> = HashMap::new();
    for round in 0..20 {
        // Client 0 promotes then claims, clients 1 and 2 replace, client 3 claims.
        let (id, old, outcomes, mut claimed) =
            race_replaces(&seen, &clients, KEY, round, 2, true).await;
        assert!(claimed.len() <= 1, "round {round}: claimed twice");
        let raced = !claimed.is_empty();
        if !raced {
            // A claim skips a row another transaction holds (SKIP LOCKED);
            // once the race is over the job is there to claim.
            claimed = h
                .claim_with(ClaimOptions {
                    types: Some(vec![DIGEST.into()]),
                    ..claim_options("late", 1)
                })
                .await;
            assert_eq!(claimed.len(), 1, "round {round}: the job is claimable");
        }
        let c = claimed.remove(0);
        assert_eq!(c.id, id);
        let landed = landed(&outcomes);
        for (p, o) in &outcomes {
            match o {
                Outcome::Replaced => {}
                Outcome::NonReplaceable {
                    reason: NonReplaceableReason::WindowElapsed,
                } => assert_ne!(&c.payload, p, "round {round}: a refused replace ran"),
                Outcome::NonReplaceable {
                    reason: NonReplaceableReason::NotPending,
                } => {
                    assert!(raced, "round {round}: `not_pending` before any claim");
                    assert_ne!(&c.payload, p, "round {round}: a refused replace ran");
                }
                other => panic!("round {round}: unexpected outcome {other}"),
            }
        }
        if landed.is_empty() {
            assert_eq!(
                c.payload, old,
                "round {round}: no replace landed, the original payload runs"
            );
            *tally.entry("claim first").or_default() += 1;
        } else {
            assert!(
                landed.contains(&&c.payload),
                "round {round}: {} replace(s) reported `replaced` but the claim ran {}",
                landed.len(),
                c.payload
            );
            *tally.entry("replace first").or_default() += 1;
        }
        // Every landed replace happened before the promotion and the claim.
        assert_log(&h, &id, round, landed.len(), &["promoted", "claimed"]).await;
        // Never two pending jobs on the key, never more than one active.
        let jobs = h.jobs().await;
        let pending = jobs
            .iter()
            .filter(|j| j.dedupe.as_ref().is_some_and(|d| d.key == KEY))
            .filter(|j| !j.state.is_terminal())
            .count();
        assert_eq!(pending, 1, "round {round}: one pending job on the key");
        let active: Vec<_> = jobs
            .iter()
            .filter(|j| j.state == JobState::Active)
            .collect();
        assert_eq!(active.len(), 1, "round {round}");
        assert_eq!(active[0].id, id);
        assert_eq!(
            active[0].payload, c.payload,
            "the stored payload is the one that runs"
        );
        h.queue
            .complete(&c.id, &c.lease_token, None)
            .await
            .expect("complete");
    }
    eprintln!("[{}] replace vs claim: {tally:?}", h.backend);
    assert_eq!(h.jobs().await.len(), 20);
    seen.assert_seen("replace_racing_promote_and_claim_never_loses_a_replace");
}

// ---------------------------------------------------------------------------
// Claims (docs/worker.md).

async fn claimers_take_every_job_exactly_once(h: Harness) {
    const JOBS: usize = 1000;
    let reqs = (0..JOBS)
        .map(|i| EnqueueRequest::new("bulk").payload(json!(i)))
        .collect();
    let enqueued: HashSet<String> = h
        .queue
        .enqueue_many(reqs, BatchOptions::default())
        .await
        .expect("enqueue_many")
        .into_iter()
        .map(|r| r.expect("accepted").job_id)
        .collect();
    assert_eq!(enqueued.len(), JOBS);
    let clients = clients(&h, CLIENTS).await;
    let taken = Arc::new(AtomicUsize::new(0));
    let claims = race(&clients, CLIENTS, |w, q| {
        let taken = taken.clone();
        async move {
            let mut mine: Vec<ClaimedJob> = Vec::new();
            // Until every job is accounted for: an empty claim may only mean
            // that the other claimers hold the remaining rows right now.
            while taken.load(Ordering::SeqCst) < JOBS {
                let got = q
                    .claim(claim_options(&format!("w-{w}"), 10))
                    .await
                    .expect("claim");
                assert!(got.len() <= 10);
                if got.is_empty() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                taken.fetch_add(got.len(), Ordering::SeqCst);
                mine.extend(got);
            }
            mine
        }
    })
    .await;
    let all: Vec<&ClaimedJob> = claims.iter().flatten().collect();
    let distinct: HashSet<&str> = all.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(distinct.len(), all.len(), "a job was claimed twice");
    assert_eq!(all.len(), JOBS, "every job was claimed");
    assert!(
        all.iter()
            .all(|c| enqueued.contains(&c.id) && c.attempt == 1),
        "each claim is the first attempt of an enqueued job"
    );
    assert!(h.claim(10).await.is_empty(), "nothing is left to claim");
    // Each claimer completes what it claimed, all at once.
    let claims = Arc::new(claims);
    let done = race(&clients, CLIENTS, |w, q| {
        let claims = claims.clone();
        async move {
            for c in &claims[w] {
                q.complete(&c.id, &c.lease_token, None)
                    .await
                    .expect("complete");
            }
        }
    })
    .await;
    assert_eq!(done.len(), CLIENTS);
    let jobs = all_jobs(&h).await;
    assert_eq!(jobs.len(), JOBS);
    for j in &jobs {
        assert_eq!(j.state, JobState::Completed, "job {}", j.id);
        assert_eq!((j.attempt, j.attempts_used), (1, 1), "job {}", j.id);
    }
    let counts = &h.queue.queues().await.unwrap()[0].counts;
    assert_eq!((counts.completed, counts.active), (JOBS as u64, 0));
    assert_eq!(
        h.totals().await,
        (JOBS, 3 * JOBS),
        "accepted, claimed and completed once each"
    );
}

async fn claimers_never_run_two_jobs_of_one_concurrency_key(h: Harness) {
    const JOBS: usize = 200;
    const KEYS: usize = 10;
    let reqs = (0..JOBS)
        .map(|i| {
            let key = format!("acct-{}", i % KEYS);
            EnqueueRequest::new("ledger")
                .payload(json!({"n": i, "key": key}))
                .concurrency_key(key)
        })
        .collect();
    let ids: HashMap<String, String> = h
        .queue
        .enqueue_many(reqs, BatchOptions::default())
        .await
        .expect("enqueue_many")
        .into_iter()
        .enumerate()
        .map(|(i, r)| (r.expect("accepted").job_id, format!("acct-{}", i % KEYS)))
        .collect();
    assert_eq!(ids.len(), JOBS);
    let clients = clients(&h, CLIENTS).await;
    let active = Arc::new(Mutex::new(HashSet::<String>::new()));
    let completed = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let claimed = race(&clients, CLIENTS, |w, q| {
        let (active, completed, overlaps) = (active.clone(), completed.clone(), overlaps.clone());
        async move {
            let mut mine = Vec::new();
            while completed.load(Ordering::SeqCst) < JOBS {
                let got = q
                    .claim(claim_options(&format!("w-{w}"), 3))
                    .await
                    .expect("claim");
                if got.is_empty() {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                let keys: Vec<String> = got
                    .iter()
                    .map(|c| c.payload["key"].as_str().expect("key").to_owned())
                    .collect();
                {
                    let mut set = active.lock().unwrap();
                    for k in &keys {
                        if !set.insert(k.clone()) {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                }
                // Hold the keys a little while other claimers run.
                for _ in 0..3 {
                    tokio::task::yield_now().await;
                }
                for (c, k) in got.iter().zip(&keys) {
                    // Out of the set before the job ends: the next job of the
                    // key cannot be claimed until this complete commits.
                    active.lock().unwrap().remove(k);
                    q.complete(&c.id, &c.lease_token, None)
                        .await
                        .expect("complete");
                    completed.fetch_add(1, Ordering::SeqCst);
                    mine.push(c.id.clone());
                }
            }
            mine
        }
    })
    .await;
    assert_eq!(
        overlaps.load(Ordering::SeqCst),
        0,
        "a claimer was handed a key another claimer held"
    );
    let all: Vec<&String> = claimed.iter().flatten().collect();
    let distinct: HashSet<&String> = all.iter().copied().collect();
    assert_eq!(
        (all.len(), distinct.len()),
        (JOBS, JOBS),
        "each job ran once"
    );
    // The database's own order agrees: per key, the attempts' [claimed,
    // completed] intervals in the global event order never overlap.
    let mut spans: HashMap<&str, Vec<(i64, i64)>> = HashMap::new();
    for (id, key) in &ids {
        let events = h.queue.events(id).await.unwrap();
        let seq = |kind: &str| {
            let found: Vec<i64> = events
                .iter()
                .filter(|e| e.kind == kind)
                .map(|e| e.seq)
                .collect();
            assert_eq!(found.len(), 1, "job {id}: one `{kind}` event");
            found[0]
        };
        spans
            .entry(key.as_str())
            .or_default()
            .push((seq("claimed"), seq("completed")));
    }
    for (key, mut s) in spans {
        s.sort();
        for w in s.windows(2) {
            assert!(
                w[0].1 < w[1].0,
                "key {key}: a job was claimed (event {}) before the previous one completed (event {})",
                w[1].0,
                w[0].1
            );
        }
    }
    for j in all_jobs(&h).await {
        assert_eq!(j.state, JobState::Completed, "job {}", j.id);
        assert_eq!(j.attempt, 1, "job {}", j.id);
    }
}

// ---------------------------------------------------------------------------
// Cancel racing the end of an attempt (docs/worker.md, cancel).

async fn cancel_racing_complete_completes(h: Harness) {
    let seen = Interleavings::default();
    let clients = clients(&h, 2).await;
    let mut tally: HashMap<&'static str, usize> = HashMap::new();
    for round in 0..50 {
        let id = h
            .put(EnqueueRequest::new("t").payload(json!({"round": round})))
            .await;
        let c = h.claim_one().await;
        assert_eq!(c.id, id);
        let barrier = Start::new(2, &seen);
        let cancel = {
            let (q, id) = (clients[0].clone(), id.clone());
            spawn_at(&barrier, async move { q.cancel(&id).await })
        };
        let complete = {
            let (q, id, token) = (clients[1].clone(), id.clone(), c.lease_token.clone());
            spawn_at(&barrier, async move {
                q.complete(&id, &token, Some(json!({"round": round}))).await
            })
        };
        let cancelled = join(cancel).await.expect("cancel");
        join(complete)
            .await
            .expect("complete wins on an active job, whatever cancel did");
        let job = h.job(&id).await;
        assert_eq!(job.state, JobState::Completed, "round {round}");
        assert_eq!(job.result, Some(json!({"round": round})));
        let kinds = h.event_kinds(&id).await;
        let terminal = ["completed", "cancelled", "dead"]
            .iter()
            .map(|k| count(&kinds, k))
            .sum::<usize>();
        assert_eq!(
            terminal, 1,
            "round {round}: one terminal event in {kinds:?}"
        );
        let runs = h.queue.runs(&id).await.unwrap();
        assert_eq!(runs.len(), 1);
        assert_eq!(runs[0].outcome.as_deref(), Some("completed"));
        if cancelled
            == (CancelOutcome {
                cancelled: true,
                state: JobState::Active,
            })
        {
            assert!(job.cancel_requested);
            assert_eq!(
                kinds,
                vec!["accepted", "claimed", "cancel_requested", "completed"],
                "round {round}: cancel first"
            );
            *tally.entry("cancel first").or_default() += 1;
        } else {
            assert_eq!(
                cancelled,
                CancelOutcome {
                    cancelled: false,
                    state: JobState::Completed
                },
                "round {round}: cancel after complete changes nothing"
            );
            assert!(!job.cancel_requested);
            assert_eq!(
                kinds,
                vec!["accepted", "claimed", "completed"],
                "round {round}: complete first"
            );
            *tally.entry("complete first").or_default() += 1;
        }
    }
    eprintln!("[{}] cancel vs complete: {tally:?}", h.backend);
    seen.assert_seen("cancel_racing_complete_completes");
}

async fn cancel_racing_fail_ends_once(h: Harness) {
    let seen = Interleavings::default();
    let clients = clients(&h, 2).await;
    let mut tally: HashMap<String, usize> = HashMap::new();
    for round in 0..50 {
        // Odd rounds fail permanently; even rounds ask for a retry.
        let permanent = round % 2 == 1;
        let id = h
            .put(
                EnqueueRequest::new("t")
                    .payload(json!({"round": round}))
                    .retry(RetryPolicy::Fixed { delay_ms: 1000 }),
            )
            .await;
        let c = h.claim_one().await;
        assert_eq!(c.id, id);
        let barrier = Start::new(2, &seen);
        let cancel = {
            let (q, id) = (clients[0].clone(), id.clone());
            spawn_at(&barrier, async move { q.cancel(&id).await })
        };
        let fail = {
            let (q, id, token) = (clients[1].clone(), id.clone(), c.lease_token.clone());
            spawn_at(&barrier, async move {
                q.fail(
                    &id,
                    &token,
                    FailOptions {
                        error: "boom".into(),
                        permanent,
                        ..FailOptions::default()
                    },
                )
                .await
            })
        };
        let cancelled = join(cancel).await.expect("cancel");
        let failed = join(fail).await.expect("fail holds a valid lease");
        let job = h.job(&id).await;
        let kinds = h.event_kinds(&id).await;
        let runs = h.queue.runs(&id).await.unwrap();
        assert_eq!(runs.len(), 1, "round {round}: one attempt");
        let terminal = ["completed", "cancelled", "dead"]
            .iter()
            .map(|k| count(&kinds, k))
            .sum::<usize>();
        assert_eq!(
            terminal, 1,
            "round {round}: one terminal event in {kinds:?}"
        );
        let way = if cancelled.state == JobState::Active {
            // Cancel first: the attempt's end decides, and any fail cancels.
            assert!(cancelled.cancelled);
            assert_eq!(failed.state, JobState::Cancelled, "round {round}");
            assert_eq!(job.state, JobState::Cancelled);
            assert_eq!(runs[0].outcome.as_deref(), Some("cancelled"));
            assert_eq!(
                kinds,
                vec!["accepted", "claimed", "cancel_requested", "cancelled"],
                "round {round}"
            );
            "cancel first"
        } else if permanent {
            // Fail first, permanently: dead, and cancel of a dead job changes nothing.
            assert_eq!(failed.state, JobState::Dead, "round {round}");
            assert_eq!(
                cancelled,
                CancelOutcome {
                    cancelled: false,
                    state: JobState::Dead
                }
            );
            assert_eq!(job.state, JobState::Dead);
            assert_eq!(runs[0].outcome.as_deref(), Some("failed"));
            assert_eq!(kinds, vec!["accepted", "claimed", "dead"], "round {round}");
            "fail first (dead)"
        } else {
            // Fail first: a retry is scheduled, and cancel ends the waiting job at once.
            assert_eq!(failed.state, JobState::Scheduled, "round {round}");
            assert_eq!(
                cancelled,
                CancelOutcome {
                    cancelled: true,
                    state: JobState::Cancelled
                }
            );
            assert_eq!(job.state, JobState::Cancelled);
            assert_eq!(runs[0].outcome.as_deref(), Some("failed"));
            assert_eq!(
                kinds,
                vec!["accepted", "claimed", "retry_scheduled", "cancelled"],
                "round {round}"
            );
            "fail first (retry)"
        };
        assert_eq!(job.attempts_used, 1, "round {round}");
        *tally.entry(way.into()).or_default() += 1;
    }
    // Nothing comes back: no job is left to claim, now or later.
    h.advance(Duration::from_secs(3600));
    assert!(h.claim(100).await.is_empty());
    eprintln!("[{}] cancel vs fail: {tally:?}", h.backend);
    seen.assert_seen("cancel_racing_fail_ends_once");
}

async fn cancel_racing_release_or_snooze_cancels(h: Harness) {
    let seen = Interleavings::default();
    let clients = clients(&h, 2).await;
    let mut tally: HashMap<String, usize> = HashMap::new();
    for round in 0..40 {
        // Even rounds release the lease; odd rounds snooze.
        let snooze = round % 2 == 1;
        let id = h
            .put(EnqueueRequest::new("t").payload(json!({"round": round})))
            .await;
        let c = h.claim_one().await;
        assert_eq!(c.id, id);
        let barrier = Start::new(2, &seen);
        let cancel = {
            let (q, id) = (clients[0].clone(), id.clone());
            spawn_at(&barrier, async move { q.cancel(&id).await })
        };
        let end = {
            let (q, id, token) = (clients[1].clone(), id.clone(), c.lease_token.clone());
            spawn_at(&barrier, async move {
                if snooze {
                    let opts = FailOptions {
                        snooze: Some(Duration::from_secs(30)),
                        ..FailOptions::default()
                    };
                    q.fail(&id, &token, opts).await.map(|o| Some(o.state))
                } else {
                    q.release(&id, &token).await.map(Some)
                }
            })
        };
        let cancelled = join(cancel).await.expect("cancel");
        let ended = join(end).await.expect("the end holds a valid lease");
        let job = h.job(&id).await;
        assert_eq!(
            job.state,
            JobState::Cancelled,
            "round {round}: cancelled either way"
        );
        assert_eq!(
            job.attempts_used, 0,
            "round {round}: the attempt is not consumed"
        );
        let kinds = h.event_kinds(&id).await;
        let runs = h.queue.runs(&id).await.unwrap();
        assert_eq!(runs.len(), 1);
        let way = if cancelled.state == JobState::Active {
            assert!(cancelled.cancelled);
            assert_eq!(ended, Some(JobState::Cancelled), "round {round}");
            assert_eq!(runs[0].outcome.as_deref(), Some("cancelled"));
            assert_eq!(
                kinds,
                vec!["accepted", "claimed", "cancel_requested", "cancelled"],
                "round {round}"
            );
            "cancel first"
        } else {
            assert_eq!(
                cancelled,
                CancelOutcome {
                    cancelled: true,
                    state: JobState::Cancelled
                },
                "round {round}: the waiting job is cancelled at once"
            );
            let (outcome, event) = if snooze {
                assert_eq!(ended, Some(JobState::Scheduled), "round {round}");
                ("snoozed", "retry_scheduled")
            } else {
                assert_eq!(ended, Some(JobState::Ready), "round {round}");
                ("released", "released")
            };
            assert_eq!(runs[0].outcome.as_deref(), Some(outcome));
            assert_eq!(
                kinds,
                vec!["accepted", "claimed", event, "cancelled"],
                "round {round}"
            );
            if snooze {
                "snooze first"
            } else {
                "release first"
            }
        };
        *tally.entry(way.into()).or_default() += 1;
    }
    h.advance(Duration::from_secs(3600));
    assert!(h.claim(100).await.is_empty(), "nothing comes back");
    eprintln!("[{}] cancel vs release/snooze: {tally:?}", h.backend);
    seen.assert_seen("cancel_racing_release_or_snooze_cancels");
}

async fn complete_racing_a_reclaim_after_lease_expiry(h: Harness) {
    let seen = Interleavings::default();
    // The holder's token stays valid until the job is claimed again or its
    // expiry is recorded (docs/worker.md): a late complete and a claim that records
    // the expiry race, and exactly one of them wins.
    let clients = clients(&h, 2).await;
    let mut tally: HashMap<&'static str, usize> = HashMap::new();
    for round in 0..30 {
        let id = h
            .put(
                EnqueueRequest::new("t")
                    .payload(json!({"round": round}))
                    .max_attempts(5),
            )
            .await;
        let c = h
            .claim_with(ClaimOptions {
                lease: Duration::from_millis(1000),
                ..claim_options("slow", 1)
            })
            .await
            .remove(0);
        assert_eq!(c.id, id);
        h.advance_ms(1001);
        let barrier = Start::new(2, &seen);
        let complete = {
            let (q, id, token) = (clients[0].clone(), id.clone(), c.lease_token.clone());
            spawn_at(&barrier, async move { q.complete(&id, &token, None).await })
        };
        let reclaim = {
            let q = clients[1].clone();
            spawn_at(&barrier, async move {
                q.claim(claim_options("fast", 10)).await.expect("claim")
            })
        };
        let completed = join(complete).await;
        let reclaimed = join(reclaim).await;
        let kinds = h.event_kinds(&id).await;
        let runs: Vec<Option<String>> = h
            .queue
            .runs(&id)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.outcome)
            .collect();
        match completed {
            Ok(()) => {
                assert!(
                    reclaimed.is_empty(),
                    "round {round}: a completed job was claimed"
                );
                assert_eq!(h.job(&id).await.state, JobState::Completed);
                assert_eq!(runs, vec![Some("completed".to_string())], "round {round}");
                assert_eq!(
                    kinds,
                    vec!["accepted", "claimed", "completed"],
                    "round {round}"
                );
                *tally.entry("complete first").or_default() += 1;
            }
            Err(Error::LeaseLost { job_id }) => {
                assert_eq!(job_id, id);
                assert_eq!(reclaimed.len(), 1, "round {round}: the claim took the job");
                let again = &reclaimed[0];
                assert_eq!((again.id.as_str(), again.attempt), (id.as_str(), 2));
                assert_eq!(
                    runs,
                    vec![Some("lease_expired".to_string()), None],
                    "round {round}"
                );
                assert_eq!(
                    kinds,
                    vec!["accepted", "claimed", "lease_expired", "claimed"],
                    "round {round}"
                );
                h.queue
                    .complete(&id, &again.lease_token, None)
                    .await
                    .expect("the new holder completes");
                let job = h.job(&id).await;
                assert_eq!((job.state, job.attempts_used), (JobState::Completed, 2));
                *tally.entry("reclaim first").or_default() += 1;
            }
            Err(e) => panic!("round {round}: unexpected error {e:?}"),
        }
    }
    eprintln!("[{}] complete vs reclaim: {tally:?}", h.backend);
    seen.assert_seen("complete_racing_a_reclaim_after_lease_expiry");
}

// ---------------------------------------------------------------------------
// Batches (docs/http-api.md, "Batches"): keys locked in a canonical order.

async fn batches_with_keys_in_opposite_orders_do_not_deadlock(h: Harness) {
    const KEYS: usize = 10;
    const BATCHES: usize = 4;
    let clients = clients(&h, BATCHES).await;
    for round in 0..20 {
        let results = race(&clients, BATCHES, |b, q| {
            let mut order: Vec<usize> = (0..KEYS).collect();
            if b % 2 == 1 {
                order.reverse();
            }
            let reqs = order
                .iter()
                .map(|&k| {
                    EnqueueRequest::new("batch")
                        .payload(json!({"round": round, "k": k}))
                        .idempotency_key(format!("r{round}:idem-{k}"))
                        .dedupe(DedupeOptions::key(format!("r{round}:dedupe-{k}")))
                })
                .collect();
            async move {
                let results = q
                    .enqueue_many(reqs, BatchOptions::default())
                    .await
                    .expect("the batch is not refused (no deadlock)");
                order.into_iter().zip(results).collect::<Vec<_>>()
            }
        })
        .await;
        let mut per_key: HashMap<usize, Vec<EnqueueResult>> = HashMap::new();
        for (k, r) in results.into_iter().flatten() {
            per_key
                .entry(k)
                .or_default()
                .push(r.unwrap_or_else(|e| panic!("round {round} key {k}: {e:?}")));
        }
        assert_eq!(per_key.len(), KEYS);
        for (k, rs) in per_key {
            assert_eq!(rs.len(), BATCHES);
            let ids: HashSet<&String> = rs.iter().map(|r| &r.job_id).collect();
            assert_eq!(ids.len(), 1, "round {round} key {k}: one job");
            let accepted = rs.iter().filter(|r| r.outcome == Outcome::Accepted).count();
            let replayed = rs.iter().filter(|r| r.outcome == Outcome::Replayed).count();
            assert_eq!(
                (accepted, replayed),
                (1, BATCHES - 1),
                "round {round} key {k}"
            );
        }
    }
    let jobs = all_jobs(&h).await;
    assert_eq!(jobs.len(), 20 * KEYS, "each key exactly one job");
    let payloads: HashSet<String> = jobs.iter().map(|j| j.payload.to_string()).collect();
    assert_eq!(payloads.len(), 20 * KEYS);
}

// ---------------------------------------------------------------------------
// Redrive (docs/worker.md, dead letters and redrive).

/// A dead job (one attempt, failed permanently).
async fn dead_job(h: &Harness) -> String {
    let id = h.put(EnqueueRequest::new("t").max_attempts(1)).await;
    kill(h, &id).await;
    id
}

async fn kill(h: &Harness, id: &str) {
    let c = h.claim_one().await;
    assert_eq!(c.id, id);
    let out = h
        .queue
        .fail(
            id,
            &c.lease_token,
            FailOptions {
                error: "boom".into(),
                permanent: true,
                ..FailOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(out.state, JobState::Dead);
}

async fn redrive_with_one_key_from_many_clients_redrives_once(h: Harness) {
    let id = dead_job(&h).await;
    let clients = clients(&h, CLIENTS).await;
    let results = race(&clients, CLIENTS, |_, q| {
        let id = id.clone();
        async move {
            q.redrive(
                &id,
                RedriveOptions {
                    idempotency_key: Some("redrive-ticket-9".into()),
                    ..RedriveOptions::default()
                },
            )
            .await
        }
    })
    .await;
    let (mut accepted, mut replayed) = (0, 0);
    for r in results {
        let r = r.expect("no caller sees an error");
        assert_eq!(r.job_id, id);
        match r.outcome {
            Outcome::Accepted => accepted += 1,
            Outcome::Replayed => replayed += 1,
            other => panic!("unexpected outcome {other}"),
        }
    }
    assert_eq!((accepted, replayed), (1, CLIENTS - 1));
    let kinds = h.event_kinds(&id).await;
    assert_eq!(count(&kinds, "redriven"), 1, "{kinds:?}");
    let job = h.job(&id).await;
    assert_eq!(job.state, JobState::Ready);
    assert_eq!((job.attempt, job.attempts_used), (1, 0));
    assert_eq!(h.jobs().await.len(), 1);
}

async fn redrive_without_a_key_from_many_clients_redrives_once(h: Harness) {
    let id = dead_job(&h).await;
    let clients = clients(&h, CLIENTS).await;
    for round in 1..=3 {
        let results = race(&clients, CLIENTS, |_, q| {
            let id = id.clone();
            async move { q.redrive(&id, RedriveOptions::default()).await }
        })
        .await;
        let mut accepted = 0;
        for r in results {
            match r {
                Ok(r) => {
                    assert_eq!(
                        (r.job_id.as_str(), r.outcome),
                        (id.as_str(), Outcome::Accepted)
                    );
                    accepted += 1;
                }
                Err(Error::NotDead { job_id, state }) => {
                    assert_eq!(job_id, id);
                    assert_eq!(state, JobState::Ready, "round {round}");
                }
                Err(e) => panic!("round {round}: unexpected error {e:?}"),
            }
        }
        assert_eq!(accepted, 1, "round {round}: exactly one redrive succeeds");
        let kinds = h.event_kinds(&id).await;
        assert_eq!(count(&kinds, "redriven"), round, "{kinds:?}");
        let job = h.job(&id).await;
        assert_eq!(job.state, JobState::Ready);
        assert_eq!(job.attempts_used, 0);
        // Dead again for the next round.
        kill(&h, &id).await;
        assert_eq!(h.job(&id).await.attempt, round as i32 + 1);
    }
}

/// Writes racing on one queue (which a backend may commit together, as the
/// SQLite store groups the writes queued behind one another into one
/// transaction) stand or fall each on its own: an atomic batch refused for
/// a conflict the store finds writes nothing, not even its other item's key
/// binding, and every write beside it stands.
async fn concurrent_writes_on_one_queue_stand_or_fall_alone(h: Harness) {
    h.put(
        EnqueueRequest::new("group.taken")
            .job_id("group-taken")
            .payload(json!({"a": 1})),
    )
    .await;
    let tasks = 48;
    let seen = Interleavings::default();
    let barrier = Start::new(tasks, &seen);
    let mut handles = Vec::new();
    for i in 0..tasks {
        let q = h.queue.clone();
        handles.push(spawn_at(&barrier, async move {
            if i % 2 == 0 {
                let req = EnqueueRequest::new("group.ok").payload(json!({"i": i}));
                q.enqueue_with_result(req).await.map(|r| vec![Ok(r)])
            } else {
                let items = vec![
                    EnqueueRequest::new("group.keyed")
                        .payload(json!({"i": i}))
                        .idempotency_key(format!("group:{i}")),
                    // The explicit id is taken with another payload: a conflict
                    // only the store can find.
                    EnqueueRequest::new("group.taken")
                        .job_id("group-taken")
                        .payload(json!({"a": 2})),
                ];
                q.enqueue_many(items, BatchOptions { atomic: true }).await
            }
        }));
    }
    let mut accepted = 0;
    for (i, handle) in handles.into_iter().enumerate() {
        let r = tokio::time::timeout(RACE_LIMIT, handle)
            .await
            .expect("no write hangs")
            .expect("task");
        if i % 2 == 0 {
            let r = r.expect("a plain enqueue beside refused batches is accepted");
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].as_ref().expect("accepted").outcome, Outcome::Accepted);
            accepted += 1;
        } else {
            match r {
                Err(Error::BatchItem { index: 1, error }) => {
                    assert!(
                        matches!(*error, Error::EnqueueIdempotencyConflict(_)),
                        "{error:?}"
                    );
                }
                other => panic!("the atomic batch {i} must fail on its second item: {other:?}"),
            }
            assert_eq!(
                h.queue
                    .lookup_key("default", &format!("group:{i}"))
                    .await
                    .unwrap(),
                None,
                "a refused atomic batch binds none of its keys"
            );
        }
    }
    assert_eq!(accepted, tasks / 2);
    let jobs = h.jobs().await;
    assert_eq!(
        jobs.len(),
        1 + tasks / 2,
        "the taken job and every plain enqueue"
    );
    assert!(jobs.iter().all(|j| j.job_type != "group.keyed"));
    seen.assert_seen("concurrent writes on one queue");
}

/// Single keyless enqueues from many tasks of one queue (one store: on
/// PostgreSQL, those that find its statements out go together in one,
/// docs/storage.md): each caller gets its own answer, the one it would have
/// had alone. A refused request refuses only itself and writes nothing;
/// every accepted one is its own job, with its own options.
async fn concurrent_single_enqueues_on_one_queue_each_get_their_own_answer(h: Harness) {
    let now = h.now().await;
    let past = now - chrono::Duration::seconds(1);
    let soon = now + chrono::Duration::seconds(30);
    let tasks = 64;
    let seen = Interleavings::default();
    let barrier = Start::new(tasks, &seen);
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let q = h.queue.clone();
            let req = EnqueueRequest::new("single.each")
                .payload(json!({"i": i}))
                .priority(i as i16)
                .tag(format!("t{i}"));
            let req = match i % 4 {
                // Refused against the clock of record, by the store.
                0 => req.deadline(past),
                1 => req.delay(Duration::from_secs(60)).deadline(soon),
                2 => req
                    .delay(Duration::from_secs(i as u64))
                    .retry(RetryPolicy::Fixed {
                        delay_ms: 100 + i as i64,
                    }),
                _ => req,
            };
            spawn_at(&barrier, async move { q.enqueue_with_result(req).await })
        })
        .collect();
    let mut accepted = HashMap::new();
    for (i, handle) in handles.into_iter().enumerate() {
        let r = join(handle).await;
        match i % 4 {
            0 => assert!(
                matches!(&r, Err(Error::Validation { field, .. }) if field == "deadline"),
                "{i}: {r:?}"
            ),
            1 => assert!(
                matches!(&r, Err(Error::Validation { field, .. }) if field == "delay_ms"),
                "{i}: {r:?}"
            ),
            _ => {
                let r = r.unwrap_or_else(|e| panic!("{i} is accepted: {e:?}"));
                assert_eq!(r.outcome, Outcome::Accepted);
                assert!(
                    accepted.insert(r.job_id, i).is_none(),
                    "{i}: a job of its own"
                );
            }
        }
    }
    seen.assert_seen("concurrent single enqueues");
    let jobs = h.jobs().await;
    assert_eq!(
        jobs.len(),
        tasks / 2,
        "one job per accepted call, none for a refused one"
    );
    for job in jobs {
        let i = accepted[&job.id];
        assert_eq!(job.payload, json!({"i": i}));
        assert_eq!(job.priority, i as i16);
        assert_eq!(job.tags, vec![format!("t{i}")]);
        if i % 4 == 2 {
            assert_eq!(
                job.retry,
                RetryPolicy::Fixed {
                    delay_ms: 100 + i as i64
                }
            );
            assert_eq!(
                job.run_at,
                job.created_at + chrono::Duration::seconds(i as i64)
            );
        } else {
            assert_eq!(job.retry, RetryPolicy::default());
            assert_eq!(job.run_at, job.created_at);
        }
    }
}
