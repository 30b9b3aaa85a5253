//! Conformance cases: jobs a worker claimed beyond its running slots
//! (`Worker::prefetch`, docs/worker.md) on every backend. Each case first
//! runs a quick job so the worker knows its handlers are short (it keeps no
//! job waiting before it knows), then gives it slow jobs: with one slot,
//! every slow job but one waits in the worker, leased to it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemq::worker::{HandlerContext, JobError, Worker, WorkerReport};
use idemq::{BatchOptions, EnqueueRequest, JobState, RetryPolicy};
use idemq_testkit::Harness;
use serde_json::{Value, json};
use tokio::sync::{Notify, oneshot};

idemq_testkit::instantiate!(
    jobs_waiting_for_a_slot_are_released_at_shutdown_unrun,
    a_job_cancelled_while_it_waits_ends_cancelled_unrun,
    a_waiting_jobs_timeout_counts_from_its_claim,
    a_waiting_jobs_deadline_is_the_stores_to_decide,
    without_prefetch_no_job_waits,
    no_waiting_job_starts_after_shutdown,
    a_waiting_job_the_store_ended_at_its_deadline_counts_as_failed,
);

/// The slow jobs' handler: counts its starts, then waits for `go`.
#[derive(Clone, Default)]
struct Slow {
    started: Arc<AtomicUsize>,
    go: Arc<Notify>,
}

impl Slow {
    /// Waits (at most 30 s) until a handler has started, and returns how
    /// many have. A job shows active as soon as its claim commits, a moment
    /// before the worker starts its handler: a case that counts starts right
    /// after seeing its jobs active would race the worker.
    async fn started(&self) -> usize {
        let start = tokio::time::Instant::now();
        while self.started.load(Ordering::SeqCst) == 0 {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "no handler started in 30 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.started.load(Ordering::SeqCst)
    }
}

/// A worker of one slot whose handler of `quick` returns at once and of
/// `slow` waits for `slow.go`.
fn one_slot(h: &Harness, slow: &Slow, prefetch: usize) -> Worker {
    one_slot_on(h.queue.clone(), slow, prefetch)
}

/// [`one_slot`] on `queue`.
fn one_slot_on(queue: idemq::Queue, slow: &Slow, prefetch: usize) -> Worker {
    let s = slow.clone();
    Worker::new(queue)
        .concurrency(1)
        .prefetch(prefetch)
        .poll_interval(Duration::from_millis(50))
        .lease(Duration::from_millis(300))
        .shutdown_grace(Duration::from_millis(200))
        .maintenance(false)
        .handle("quick", |_c: HandlerContext, _p: Value| async move {
            Ok::<_, JobError>(())
        })
        .handle("slow", move |_c: HandlerContext, _p: Value| {
            let s = s.clone();
            async move {
                s.started.fetch_add(1, Ordering::SeqCst);
                s.go.notified().await;
                Ok::<_, JobError>(())
            }
        })
}

fn no_retry_soon() -> RetryPolicy {
    RetryPolicy::Fixed {
        delay_ms: 3_600_000,
    }
}

/// Starts `worker`, runs one quick job through it, then enqueues `slow`
/// and waits (at most 30 s) until `ready` holds. Returns the ids of the
/// slow jobs, the shutdown trigger and the running worker.
async fn start_with(
    h: &Harness,
    worker: Worker,
    slow: Vec<EnqueueRequest>,
    ready: impl Fn(&[idemq::Job]) -> bool,
) -> (
    Vec<String>,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<idemq::Result<WorkerReport>>,
) {
    let (tx, rx) = oneshot::channel::<()>();
    let run = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    let quick = h.put(EnqueueRequest::new("quick")).await;
    wait_until(h, |jobs| {
        jobs.iter()
            .any(|j| j.id == quick && j.state == JobState::Completed)
    })
    .await;
    let ids = h
        .queue
        .enqueue_many(slow, BatchOptions { atomic: true })
        .await
        .expect("enqueue the slow jobs")
        .into_iter()
        .map(|r| r.expect("accepted").job_id)
        .collect::<Vec<_>>();
    wait_until(h, |jobs| {
        ready(
            &jobs
                .iter()
                .filter(|j| ids.contains(&j.id))
                .cloned()
                .collect::<Vec<_>>(),
        )
    })
    .await;
    (ids, tx, run)
}

async fn wait_until(h: &Harness, ready: impl Fn(&[idemq::Job]) -> bool) {
    let start = tokio::time::Instant::now();
    while !ready(&h.jobs().await) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "not there in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn slow_jobs(n: usize) -> Vec<EnqueueRequest> {
    (0..n)
        .map(|i| EnqueueRequest::new("slow").payload(json!({ "n": i })))
        .collect()
}

async fn jobs_waiting_for_a_slot_are_released_at_shutdown_unrun(h: Harness) {
    let slow = Slow::default();
    let (ids, stop, run) = start_with(&h, one_slot(&h, &slow, 8), slow_jobs(6), |jobs| {
        jobs.len() == 6 && jobs.iter().all(|j| j.state == JobState::Active)
    })
    .await;
    // Six jobs leased to a worker of one slot: five wait in it.
    assert_eq!(slow.started().await, 1, "one slot, one handler");
    let _ = stop.send(());
    let report = run.await.expect("worker task").expect("worker run");
    // Five released at once, the running one after the grace period.
    assert_eq!((report.released, report.completed), (6, 1));
    assert_eq!(slow.started.load(Ordering::SeqCst), 1, "no waiting job ran");
    for id in &ids {
        let job = h.job(id).await;
        assert_eq!((job.state, job.attempts_used), (JobState::Ready, 0), "{id}");
        let runs = h.queue.runs(id).await.unwrap();
        assert_eq!(runs.len(), 1, "{id}");
        assert_eq!(runs[0].outcome.as_deref(), Some("released"), "{id}");
    }
}

async fn a_job_cancelled_while_it_waits_ends_cancelled_unrun(h: Harness) {
    let slow = Slow::default();
    let (queue, faulty) = crate::worker::Faults::queue(&h);
    let (ids, stop, run) = start_with(&h, one_slot_on(queue, &slow, 8), slow_jobs(2), |jobs| {
        jobs.len() == 2 && jobs.iter().all(|j| j.state == JobState::Active)
    })
    .await;
    // The one that has not started waits in the worker.
    let waiting = ids[1].clone();
    assert_eq!(slow.started().await, 1);
    assert!(h.queue.cancel(&waiting).await.expect("cancel").cancelled);
    // Heartbeats run every 100 ms (lease 300 ms), one beat at a time, each
    // answer applied before the next beat: the second call to end from now
    // on began after the cancel, and the third began after the second's
    // answer (the request) reached the waiting job. Then the slot is freed.
    let beats = faulty.heartbeats.load(Ordering::SeqCst);
    let start = tokio::time::Instant::now();
    while faulty.heartbeats.load(Ordering::SeqCst) < beats + 3 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no heartbeat after the cancel"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    slow.go.notify_one();
    wait_until(&h, |jobs| {
        jobs.iter()
            .any(|j| j.id == waiting && j.state == JobState::Cancelled)
    })
    .await;
    let _ = stop.send(());
    run.await.expect("worker task").expect("worker run");
    assert_eq!(
        slow.started.load(Ordering::SeqCst),
        1,
        "its handler never ran"
    );
    let runs = h.queue.runs(&waiting).await.unwrap();
    assert_eq!(runs[0].outcome.as_deref(), Some("cancelled"));
    assert_eq!(h.job(&ids[0]).await.state, JobState::Completed);
}

async fn a_waiting_jobs_timeout_counts_from_its_claim(h: Harness) {
    let slow = Slow::default();
    let mut jobs = slow_jobs(1);
    jobs.push(
        EnqueueRequest::new("slow")
            .timeout(Duration::from_millis(300))
            .retry(no_retry_soon()),
    );
    let (ids, stop, run) = start_with(&h, one_slot(&h, &slow, 8), jobs, |jobs| {
        jobs.len() == 2 && jobs.iter().all(|j| j.state == JobState::Active)
    })
    .await;
    // The second job waits past its 300 ms timeout behind the first.
    tokio::time::sleep(Duration::from_millis(600)).await;
    slow.go.notify_one();
    wait_until(&h, |jobs| {
        jobs.iter()
            .any(|j| j.id == ids[1] && j.state == JobState::Scheduled)
    })
    .await;
    let _ = stop.send(());
    run.await.expect("worker task").expect("worker run");
    assert_eq!(slow.started.load(Ordering::SeqCst), 1, "it never ran");
    let job = h.job(&ids[1]).await;
    assert!(
        job.last_error
            .as_deref()
            .unwrap_or_default()
            .contains("timed out"),
        "{:?}",
        job.last_error
    );
    assert_eq!(job.attempts_used, 1, "a timed-out attempt is consumed");
}

async fn a_waiting_jobs_deadline_is_the_stores_to_decide(h: Harness) {
    let slow = Slow::default();
    let deadline = h.now().await + chrono::Duration::milliseconds(300);
    let mut jobs = slow_jobs(1);
    // Budget left and a retry 1 ms later: only the deadline rule makes it
    // dead.
    jobs.push(
        EnqueueRequest::new("slow")
            .deadline(deadline)
            .max_attempts(5)
            .retry(RetryPolicy::Fixed { delay_ms: 1 }),
    );
    let (ids, stop, run) = start_with(&h, one_slot(&h, &slow, 8), jobs, |jobs| {
        jobs.len() == 2 && jobs.iter().all(|j| j.state == JobState::Active)
    })
    .await;
    // The second job waits past its deadline on the worker's clock, not on
    // the clock of record, which stands still: once the slot frees, the
    // store says it is not there yet, so the handler starts.
    tokio::time::sleep(Duration::from_millis(600)).await;
    slow.go.notify_one();
    let start = tokio::time::Instant::now();
    while slow.started.load(Ordering::SeqCst) < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the waiting job did not start: {:?}",
            h.event_kinds(&ids[1]).await
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The clock of record reaches the deadline: the attempt ends there.
    h.advance(Duration::from_millis(300));
    wait_until(&h, |jobs| {
        jobs.iter()
            .any(|j| j.id == ids[1] && j.state == JobState::Dead)
    })
    .await;
    let _ = stop.send(());
    run.await.expect("worker task").expect("worker run");
    let events = h.queue.events(&ids[1]).await.expect("events");
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert!(!kinds.contains(&"retry_scheduled"), "{kinds:?}");
    let dead = events.iter().find(|e| e.kind == "dead").expect("dead");
    assert_eq!(dead.data["reason"], "deadline");
    let job = h.job(&ids[1]).await;
    assert_eq!((job.attempt, job.attempts_used), (1, 1));
}

async fn without_prefetch_no_job_waits(h: Harness) {
    let slow = Slow::default();
    let (ids, stop, run) = start_with(&h, one_slot(&h, &slow, 0), slow_jobs(3), |jobs| {
        jobs.iter().any(|j| j.state == JobState::Active)
    })
    .await;
    // Give the worker time to claim more if it would.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let active = h
        .jobs()
        .await
        .iter()
        .filter(|j| ids.contains(&j.id) && j.state == JobState::Active)
        .count();
    assert_eq!(active, 1, "one slot, one lease");
    let _ = stop.send(());
    let report = run.await.expect("worker task").expect("worker run");
    assert_eq!(report.released, 1);
}

/// Shutdown comes while a claim is still out: a slot that frees meanwhile
/// starts none of the jobs waiting in the worker; they are released unrun.
async fn no_waiting_job_starts_after_shutdown(h: Harness) {
    let slow = Slow::default();
    let (queue, faulty) = crate::worker::Faults::queue(&h);
    let (ids, stop, run) = start_with(&h, one_slot_on(queue, &slow, 8), slow_jobs(3), |jobs| {
        jobs.len() == 3 && jobs.iter().all(|j| j.state == JobState::Active)
    })
    .await;
    assert_eq!(slow.started().await, 1, "one slot, one handler");
    // The worker's next claim (it polls every 50 ms) stays out until let go.
    faulty.hold_claims();
    let start = tokio::time::Instant::now();
    while faulty.held.load(Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no claim went out"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = stop.send(());
    // The slot frees while the claim is out, right after shutdown: the
    // worker may see both at once, and takes the shutdown first.
    slow.go.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    faulty.let_go();
    let report = run.await.expect("worker task").expect("worker run");
    assert_eq!(
        slow.started.load(Ordering::SeqCst),
        1,
        "no waiting job started after shutdown"
    );
    // The quick job and the slow one that ran; the two waiting released.
    assert_eq!((report.completed, report.released), (2, 2), "{report:?}");
    let mut states = Vec::new();
    for id in &ids {
        let job = h.job(id).await;
        states.push((job.state, job.attempts_used));
    }
    states.sort_by_key(|(s, _)| *s != JobState::Completed);
    assert_eq!(
        states,
        vec![
            (JobState::Completed, 1),
            (JobState::Ready, 0),
            (JobState::Ready, 0)
        ]
    );
}

/// The store ends a waiting job's attempt at its deadline when a heartbeat
/// finds the deadline passed on its clock: the worker counts that attempt
/// failed (and dead), as it counts a running one, not lost.
async fn a_waiting_job_the_store_ended_at_its_deadline_counts_as_failed(h: Harness) {
    let slow = Slow::default();
    let deadline = h.now().await + chrono::Duration::seconds(2);
    let mut jobs = slow_jobs(1);
    jobs.push(
        EnqueueRequest::new("slow")
            .deadline(deadline)
            .max_attempts(5)
            .retry(RetryPolicy::Fixed { delay_ms: 1 }),
    );
    // A 3 s lease (heartbeats every second): moving the clock of record
    // 2.5 s passes the deadline, not the leases.
    let worker = one_slot(&h, &slow, 8).lease(Duration::from_secs(3));
    let (ids, stop, run) = start_with(&h, worker, jobs, |jobs| {
        jobs.len() == 2 && jobs.iter().all(|j| j.state == JobState::Active)
    })
    .await;
    assert_eq!(slow.started().await, 1);
    let dead_before = h.queue.stats().dead;
    h.advance(Duration::from_millis(2500));
    // The next heartbeat of the waiting job ends its attempt there.
    wait_until(&h, |jobs| {
        jobs.iter()
            .any(|j| j.id == ids[1] && j.state == JobState::Dead)
    })
    .await;
    slow.go.notify_one();
    wait_until(&h, |jobs| {
        jobs.iter()
            .any(|j| j.id == ids[0] && j.state == JobState::Completed)
    })
    .await;
    let _ = stop.send(());
    let report = run.await.expect("worker task").expect("worker run");
    assert_eq!(slow.started.load(Ordering::SeqCst), 1, "it never ran");
    // The quick job and the first slow one completed; the waiting one failed.
    assert_eq!(
        (report.completed, report.failed, report.lost),
        (2, 1, 0),
        "{report:?}"
    );
    assert_eq!(h.queue.stats().dead - dead_before, 1, "counted dead");
    let events = h.queue.events(&ids[1]).await.expect("events");
    let dead = events.iter().find(|e| e.kind == "dead").expect("dead");
    assert_eq!(dead.data["reason"], "deadline");
}
