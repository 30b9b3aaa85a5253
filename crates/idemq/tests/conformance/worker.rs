//! Conformance cases: the worker runtime and maintenance (docs/worker.md, docs/operating.md) on
//! every backend. Handlers run in real time; the clock of record moves only
//! when a case moves it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idemq::worker::{HandlerContext, JobError, Maintenance, Worker, WorkerReport};
use idemq::{EnqueueRequest, JobState, RetryPolicy};
use idemq_testkit::{Call, Harness, Through};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::oneshot;

idemq_testkit::instantiate!(
    typed_handler_completes_jobs_with_results,
    handler_error_schedules_a_retry,
    permanent_error_is_dead,
    bad_payload_is_dead,
    panicking_handler_fails_only_its_attempt,
    timeout_interrupts_the_handler,
    a_handler_that_panics_when_interrupted_fails_only_its_attempt,
    deadline_interrupts_the_handler,
    a_regular_heartbeat_past_the_deadline_is_the_deadline,
    cancel_of_a_running_job_stops_it_at_the_next_heartbeat,
    checkpoint_is_not_run_again_on_a_later_attempt,
    shutdown_releases_jobs_past_the_grace_period,
    shutdown_lets_quick_handlers_finish,
    only_registered_types_are_claimed,
    catch_all_handler_claims_every_type,
    concurrency_limit_is_respected,
    lost_lease_stops_the_handler_and_drops_its_result,
    wakeups_start_new_work_without_waiting_for_the_poll,
    a_heartbeat_that_records_a_timeout_wakes_the_workers,
    a_claim_stopped_by_passed_deadlines_wakes_the_workers,
    a_wake_up_while_a_claim_is_out_is_not_lost,
    snooze_from_a_handler_keeps_the_attempt,
    worker_without_handlers_is_refused,
    drain_500_jobs_each_completed_once,
    concurrent_maintenance_passes_reap_each_lease_once,
    maintenance_loop_catches_up_beyond_one_batch,
    maintenance_loop_ends_when_its_stop_sender_is_dropped,
    a_waiting_maintenance_step_holds_up_no_other,
    an_oversized_result_fails_its_own_job_and_no_other,
    a_late_result_after_a_lost_lease_is_refused,
    a_worker_whose_claims_would_be_refused_fails_at_run,
    a_failing_maintenance_step_does_not_stop_the_others,
    an_oversized_checkpoint_fails_the_attempt_for_good,
    a_job_the_worker_reclaims_itself_stops_its_older_attempt,
    a_release_at_shutdown_is_retried_while_the_store_is_briefly_down,
    a_heartbeat_from_the_handler_passes_on_a_cancel,
    a_cancelled_handler_may_clean_up_and_complete,
    a_handler_that_ignores_a_cancel_is_stopped_after_the_cancel_grace,
    a_claim_that_cannot_go_out_does_not_spin_the_worker,
    a_lease_no_heartbeat_renews_stops_its_handler,
    a_snooze_beyond_the_bound_keeps_the_attempt,
    a_completion_the_store_could_not_take_just_then_is_recorded_later,
);

/// Sets its flag when dropped: a handler holding one was stopped (its
/// future dropped) if the flag is set while `finished` is not.
struct DropFlag(Arc<std::sync::atomic::AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[derive(Deserialize)]
struct Add {
    a: i64,
    b: i64,
}

/// Runs `worker` until `done` holds (checked every 20 ms, at most 30 s), then
/// shuts it down and returns its report. Shared by the cases of other files.
pub(crate) async fn run_until<F, Fut>(worker: Worker, mut done: F) -> WorkerReport
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let (tx, handle) = start(worker);
    let start = tokio::time::Instant::now();
    while !done().await {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the worker did not get there in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = tx.send(());
    handle.await.expect("worker task").expect("worker run")
}

fn worker(h: &Harness) -> Worker {
    Worker::new(h.queue.clone())
        .poll_interval(Duration::from_millis(50))
        .lease(Duration::from_secs(30))
        .maintenance(false)
}

async fn state(h: &Harness, id: &str) -> JobState {
    h.job(id).await.state
}

/// Runs `w` until the sender it returns is used or dropped.
fn start(
    w: Worker,
) -> (
    oneshot::Sender<()>,
    tokio::task::JoinHandle<idemq::Result<WorkerReport>>,
) {
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(w.run(async move {
        let _ = rx.await;
    }));
    (tx, handle)
}

/// A worker of jobs of type `t` that succeed, polling only every 120 s
/// and running no maintenance: only a wake-up starts its work soon.
fn sleepy_worker(h: &Harness) -> Worker {
    Worker::new(h.queue.clone())
        .poll_interval(Duration::from_secs(120))
        .maintenance(false)
        .handle("t", |_c: HandlerContext, _p: Value| async move {
            Ok::<_, JobError>(())
        })
}

/// Waits (every 20 ms) until job `id` is `want`; fails with `why` once
/// `within` passed since `since`.
async fn until_state(
    h: &Harness,
    id: &str,
    want: JobState,
    since: tokio::time::Instant,
    within: Duration,
    why: &str,
) {
    while state(h, id).await != want {
        assert!(since.elapsed() < within, "{why}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn no_retry_soon() -> RetryPolicy {
    RetryPolicy::Fixed {
        delay_ms: 3_600_000,
    }
}

async fn typed_handler_completes_jobs_with_results(h: Harness) {
    let mut ids = Vec::new();
    for i in 0..20 {
        ids.push(
            h.put(EnqueueRequest::new("math.add").payload(json!({"a": i, "b": 1})))
                .await,
        );
    }
    let w = worker(&h)
        .concurrency(4)
        .handle("math.add", |_ctx: HandlerContext, p: Add| async move {
            Ok::<_, JobError>(json!({"sum": p.a + p.b}))
        });
    let report = run_until(w, || async {
        h.jobs()
            .await
            .iter()
            .all(|j| j.state == JobState::Completed)
    })
    .await;
    assert_eq!(report.completed, 20);
    for (i, id) in ids.iter().enumerate() {
        let job = h.job(id).await;
        assert_eq!(job.result, Some(json!({"sum": i as i64 + 1})));
        assert_eq!((job.attempt, job.attempts_used), (1, 1));
    }
}

async fn handler_error_schedules_a_retry(h: Harness) {
    let id = h.put(EnqueueRequest::new("t").retry(no_retry_soon())).await;
    let w = worker(&h).handle("t", |_c: HandlerContext, _p: Value| async move {
        Err::<(), _>(JobError::retryable("upstream said 503"))
    });
    run_until(w, || async { state(&h, &id).await == JobState::Scheduled }).await;
    let job = h.job(&id).await;
    assert_eq!(job.attempts_used, 1);
    assert_eq!(job.last_error.as_deref(), Some("upstream said 503"));
    let runs = h.queue.runs(&id).await.unwrap();
    assert_eq!(runs[0].outcome.as_deref(), Some("failed"));
}

async fn permanent_error_is_dead(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let w = worker(&h).handle("t", |_c: HandlerContext, _p: Value| async move {
        Err::<(), _>(JobError::permanent("card declined"))
    });
    run_until(w, || async { state(&h, &id).await == JobState::Dead }).await;
    assert_eq!(h.job(&id).await.attempts_used, 1);
}

/// Completions travel in batches; a result over the payload limit must not
/// take the others of its batch down with it.
async fn an_oversized_result_fails_its_own_job_and_no_other(h: Harness) {
    let big = h
        .put(EnqueueRequest::new("r").payload(json!({"big": true})))
        .await;
    for i in 0..30 {
        h.put(EnqueueRequest::new("r").payload(json!({"big": false, "i": i})))
            .await;
    }
    let w = worker(&h)
        .concurrency(16)
        .handle("r", |_c: HandlerContext, p: Value| async move {
            // Every handler waits a little so the results gather in batches.
            tokio::time::sleep(Duration::from_millis(20)).await;
            let size = if p["big"] == json!(true) {
                (1 << 20) + 1
            } else {
                10
            };
            Ok::<_, JobError>(json!("x".repeat(size)))
        });
    let report = run_until(w, || async {
        h.jobs().await.iter().all(|j| j.state.is_terminal())
    })
    .await;
    assert_eq!((report.completed, report.failed, report.lost), (30, 1, 0));
    let jobs = h.jobs().await;
    for j in &jobs {
        if j.id == big {
            assert_eq!(
                j.state,
                JobState::Dead,
                "the oversized result fails its job permanently"
            );
            let err = j.last_error.clone().unwrap_or_default();
            assert!(err.contains("result"), "{err}");
            assert_eq!(j.attempts_used, 1);
        } else {
            assert_eq!(j.state, JobState::Completed);
            assert_eq!(j.result, Some(json!("x".repeat(10))));
        }
    }
}

async fn bad_payload_is_dead(h: Harness) {
    let id = h
        .put(EnqueueRequest::new("math.add").payload(json!({"a": "not a number"})))
        .await;
    let w = worker(&h).handle("math.add", |_c: HandlerContext, p: Add| async move {
        Ok::<_, JobError>(p.a + p.b)
    });
    run_until(w, || async { state(&h, &id).await == JobState::Dead }).await;
    let err = h.job(&id).await.last_error.unwrap_or_default();
    assert!(err.starts_with("bad_payload"), "{err}");
}

async fn panicking_handler_fails_only_its_attempt(h: Harness) {
    let bad = h
        .put(
            EnqueueRequest::new("t")
                .payload(json!("boom"))
                .retry(no_retry_soon()),
        )
        .await;
    let mut good = Vec::new();
    for i in 0..5 {
        good.push(h.put(EnqueueRequest::new("t").payload(json!(i))).await);
    }
    let w = worker(&h)
        .concurrency(2)
        .handle("t", |_c: HandlerContext, p: Value| async move {
            if p == json!("boom") {
                panic!("handler bug");
            }
            Ok::<_, JobError>(())
        });
    let report = run_until(w, || async {
        let jobs = h.jobs().await;
        jobs.iter()
            .filter(|j| j.state == JobState::Completed)
            .count()
            == 5
            && jobs.iter().any(|j| j.state == JobState::Scheduled)
    })
    .await;
    assert_eq!((report.completed, report.failed), (5, 1));
    let job = h.job(&bad).await;
    assert!(job.last_error.unwrap_or_default().contains("handler bug"));
    for id in good {
        assert_eq!(state(&h, &id).await, JobState::Completed);
    }
}

async fn timeout_interrupts_the_handler(h: Harness) {
    let id = h
        .put(
            EnqueueRequest::new("t")
                .timeout(Duration::from_millis(200))
                .retry(no_retry_soon()),
        )
        .await;
    let finished = Arc::new(AtomicUsize::new(0));
    let f = finished.clone();
    let w = worker(&h).handle("t", move |_c: HandlerContext, _p: Value| {
        let f = f.clone();
        async move {
            tokio::time::sleep(Duration::from_secs(20)).await;
            f.fetch_add(1, Ordering::SeqCst);
            Ok::<_, JobError>(())
        }
    });
    run_until(w, || async { state(&h, &id).await == JobState::Scheduled }).await;
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the handler was stopped"
    );
    assert!(
        h.job(&id)
            .await
            .last_error
            .unwrap_or_default()
            .contains("timed out")
    );
}

/// Panics when dropped: a handler holding one panics as it is interrupted.
struct PanicOnDrop;

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("a destructor's bug");
        }
    }
}

/// A handler runs in its supervisor's task: a panic while its future is
/// dropped (here, at its timeout) must fail only that attempt, as a panic
/// while it runs does. The worker records the timeout, frees the slot
/// (concurrency 1) and runs the next job.
async fn a_handler_that_panics_when_interrupted_fails_only_its_attempt(h: Harness) {
    let stuck = h
        .put(
            EnqueueRequest::new("t")
                .payload(json!("stuck"))
                .timeout(Duration::from_millis(200))
                .retry(no_retry_soon()),
        )
        .await;
    let w = worker(&h)
        .concurrency(1)
        .handle("t", |_c: HandlerContext, p: Value| async move {
            if p == json!("stuck") {
                let _guard = PanicOnDrop;
                tokio::time::sleep(Duration::from_secs(20)).await;
            }
            Ok::<_, JobError>(())
        });
    let (tx, handle) = start(w);
    let start = tokio::time::Instant::now();
    until_state(
        &h,
        &stuck,
        JobState::Scheduled,
        start,
        Duration::from_secs(30),
        "no timeout in 30 s",
    )
    .await;
    // Enqueued after the first attempt ended, so the one slot takes it next.
    let next = h.put(EnqueueRequest::new("t").payload(json!("next"))).await;
    until_state(
        &h,
        &next,
        JobState::Completed,
        start,
        Duration::from_secs(30),
        "the worker did not run the next job",
    )
    .await;
    let _ = tx.send(());
    let report = handle.await.expect("worker task").expect("worker run");
    assert_eq!((report.completed, report.failed), (1, 1));
    assert!(
        h.job(&stuck)
            .await
            .last_error
            .unwrap_or_default()
            .contains("timed out")
    );
}

/// The store's clock passes the deadline long before the worker's own timer
/// says so: a regular heartbeat, not the question asked at the deadline, is
/// the first to find the attempt ended there. That is the deadline (a
/// failed attempt, the job dead), not a lost lease.
async fn a_regular_heartbeat_past_the_deadline_is_the_deadline(h: Harness) {
    let deadline = h.now().await + chrono::Duration::seconds(3);
    let id = h
        .put(
            EnqueueRequest::new("t")
                .deadline(deadline)
                .max_attempts(5)
                .retry(RetryPolicy::Fixed { delay_ms: 1 }),
        )
        .await;
    let starts = Arc::new(AtomicUsize::new(0));
    let s = starts.clone();
    // Heartbeats every 2 s; the worker would ask about the deadline 3 s
    // after the claim.
    let w = worker(&h).lease(Duration::from_secs(6)).handle(
        "t",
        move |_c: HandlerContext, _p: Value| {
            let s = s.clone();
            async move {
                s.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(20)).await;
                Ok::<_, JobError>(())
            }
        },
    );
    let (tx, handle) = start(w);
    let start = tokio::time::Instant::now();
    while starts.load(Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the handler did not start in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The clock of record reaches the deadline at once; the lease (6 s on
    // that clock) still holds at the first heartbeat, 2 s on.
    h.advance(Duration::from_secs(3));
    while state(&h, &id).await != JobState::Dead {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the job was not dead in 30 s: {:?}",
            h.event_kinds(&id).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = tx.send(());
    let report = handle.await.expect("worker task").expect("worker run");
    assert_eq!(starts.load(Ordering::SeqCst), 1, "one attempt only");
    assert_eq!((report.completed, report.failed, report.lost), (0, 1, 0));
    let dead: Vec<Value> = h
        .queue
        .events(&id)
        .await
        .expect("events")
        .into_iter()
        .filter(|e| e.kind == "dead")
        .map(|e| e.data)
        .collect();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0]["reason"], "deadline");
}

async fn deadline_interrupts_the_handler(h: Harness) {
    let deadline = h.now().await + chrono::Duration::milliseconds(300);
    // Budget left and a policy that would retry 1 ms later, well before the
    // deadline: an interruption recorded as a retryable failure would
    // schedule a retry here, never a `dead` (`deadline`).
    let id = h
        .put(
            EnqueueRequest::new("t")
                .deadline(deadline)
                .max_attempts(5)
                .retry(RetryPolicy::Fixed { delay_ms: 1 }),
        )
        .await;
    let starts = Arc::new(AtomicUsize::new(0));
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, d, f) = (starts.clone(), dropped.clone(), finished.clone());
    let w = worker(&h).handle("t", move |_c: HandlerContext, _p: Value| {
        let (s, d, f) = (s.clone(), d.clone(), f.clone());
        async move {
            s.fetch_add(1, Ordering::SeqCst);
            let _flag = DropFlag(d);
            tokio::time::sleep(Duration::from_secs(20)).await;
            f.store(true, Ordering::SeqCst);
            Ok::<_, JobError>(())
        }
    });
    let (tx, handle) = start(w);
    let start = tokio::time::Instant::now();
    while starts.load(Ordering::SeqCst) == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the handler did not start in 30 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The worker's own timer passes the deadline, but the clock of record
    // stands still: the store decides, so the attempt goes on untouched.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(state(&h, &id).await, JobState::Active);
    assert!(
        !dropped.load(Ordering::SeqCst),
        "interrupted before the deadline"
    );
    // The clock of record reaches the deadline: the running attempt is
    // interrupted and the job goes straight to the dead letters.
    h.advance(Duration::from_millis(300));
    while state(&h, &id).await != JobState::Dead {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the job was not dead in 30 s: {:?}",
            h.event_kinds(&id).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = tx.send(());
    let report = handle.await.expect("worker task").expect("worker run");
    assert!(
        dropped.load(Ordering::SeqCst),
        "the handler was not stopped"
    );
    assert!(
        !finished.load(Ordering::SeqCst),
        "the handler ran to its end"
    );
    assert_eq!(starts.load(Ordering::SeqCst), 1, "one attempt only");
    assert_eq!((report.completed, report.failed, report.lost), (0, 1, 0));
    let events = h.queue.events(&id).await.expect("events");
    let kinds: Vec<&str> = events.iter().map(|e| e.kind.as_str()).collect();
    assert!(!kinds.contains(&"retry_scheduled"), "a retry: {kinds:?}");
    let dead: Vec<&Value> = events
        .iter()
        .filter(|e| e.kind == "dead")
        .map(|e| &e.data)
        .collect();
    assert_eq!(dead.len(), 1, "{kinds:?}");
    assert_eq!(dead[0]["reason"], "deadline");
    let job = h.job(&id).await;
    assert_eq!((job.attempt, job.attempts_used), (1, 1));
    assert_eq!(job.finished_at, Some(deadline));
    let runs = h.queue.runs(&id).await.expect("runs");
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].outcome.as_deref(), Some("failed"));
    assert_eq!(runs[0].error.as_deref(), Some("deadline passed"));
}

async fn cancel_of_a_running_job_stops_it_at_the_next_heartbeat(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let s = started.clone();
    let w = worker(&h).lease(Duration::from_millis(300)).handle(
        "t",
        move |ctx: HandlerContext, _p: Value| {
            let s = s.clone();
            async move {
                s.notify_one();
                ctx.cancelled().await;
                // A handler that stops on cancellation reports it as a failure:
                // an `Ok` here would complete the job (the effect happened).
                Err::<(), _>(JobError::retryable("stopped: cancelled"))
            }
        },
    );
    cancel_once_started(&h, &id, started);
    run_until(w, || async { state(&h, &id).await == JobState::Cancelled }).await;
    let runs = h.queue.runs(&id).await.unwrap();
    assert_eq!(runs[0].outcome.as_deref(), Some("cancelled"));
}

async fn checkpoint_is_not_run_again_on_a_later_attempt(h: Harness) {
    let id = h.put(EnqueueRequest::new("charge")).await;
    let charges = Arc::new(AtomicUsize::new(0));
    let c = charges.clone();
    let w = worker(&h).handle("charge", move |ctx: HandlerContext, _p: Value| {
        let c = c.clone();
        async move {
            let charge: String = ctx
                .checkpoint("charge", || async {
                    c.fetch_add(1, Ordering::SeqCst);
                    Ok(format!("ch_{}", ctx.job_id()))
                })
                .await?;
            if ctx.attempt() == 1 {
                return Err(JobError::retry_after(
                    "crashed after charging",
                    Duration::ZERO,
                ));
            }
            Ok(json!({ "charge": charge }))
        }
    });
    run_until(w, || async { state(&h, &id).await == JobState::Completed }).await;
    assert_eq!(charges.load(Ordering::SeqCst), 1, "the step ran once");
    let job = h.job(&id).await;
    assert_eq!(job.attempt, 2);
    assert_eq!(job.result, Some(json!({ "charge": format!("ch_{id}") })));
    assert_eq!(h.queue.checkpoints(&id).await.unwrap().len(), 1);
}

async fn shutdown_releases_jobs_past_the_grace_period(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let w = worker(&h)
        .shutdown_grace(Duration::from_millis(200))
        .handle("t", |_c: HandlerContext, _p: Value| async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            Ok::<_, JobError>(())
        });
    let report = run_until(w, || async { state(&h, &id).await == JobState::Active }).await;
    assert_eq!(report.released, 1);
    let job = h.job(&id).await;
    assert_eq!(
        (job.state, job.attempts_used),
        (JobState::Ready, 0),
        "ready at once, attempt not used"
    );
    assert_eq!(
        h.queue.runs(&id).await.unwrap()[0].outcome.as_deref(),
        Some("released")
    );
}

async fn shutdown_lets_quick_handlers_finish(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let w = worker(&h).shutdown_grace(Duration::from_secs(10)).handle(
        "t",
        move |_c: HandlerContext, _p: Value| {
            s.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, JobError>(())
            }
        },
    );
    // Shut down once the handler runs: a job not started by then is
    // released unrun.
    let report = run_until(w, || async { started.load(Ordering::SeqCst) > 0 }).await;
    assert_eq!((report.completed, report.released), (1, 0));
    assert_eq!(state(&h, &id).await, JobState::Completed);
}

async fn only_registered_types_are_claimed(h: Harness) {
    let mine = h.put(EnqueueRequest::new("mine")).await;
    let other = h.put(EnqueueRequest::new("other")).await;
    let w = worker(&h).handle("mine", |_c: HandlerContext, _p: Value| async move {
        Ok::<_, JobError>(())
    });
    run_until(w, || async {
        state(&h, &mine).await == JobState::Completed
    })
    .await;
    let job = h.job(&other).await;
    assert_eq!((job.state, job.attempt), (JobState::Ready, 0));
}

async fn catch_all_handler_claims_every_type(h: Harness) {
    let a = h.put(EnqueueRequest::new("a").payload(json!(1))).await;
    let b = h.put(EnqueueRequest::new("b").payload(json!(2))).await;
    let own = h.put(EnqueueRequest::new("own")).await;
    let w = worker(&h)
        .handle("own", |_c: HandlerContext, _p: Value| async move {
            Ok::<_, JobError>(json!("own"))
        })
        .handle_any(|c: HandlerContext, p: Value| async move {
            Ok::<_, JobError>(json!({"type": c.job_type(), "payload": p}))
        });
    run_until(w, || async {
        h.jobs()
            .await
            .iter()
            .all(|j| j.state == JobState::Completed)
    })
    .await;
    assert_eq!(
        h.job(&a).await.result,
        Some(json!({"type": "a", "payload": 1}))
    );
    assert_eq!(
        h.job(&b).await.result,
        Some(json!({"type": "b", "payload": 2}))
    );
    assert_eq!(h.job(&own).await.result, Some(json!("own")));
}

async fn concurrency_limit_is_respected(h: Harness) {
    for _ in 0..6 {
        h.put(EnqueueRequest::new("t")).await;
    }
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let (r, p) = (running.clone(), peak.clone());
    let w = worker(&h)
        .concurrency(2)
        .handle("t", move |_c: HandlerContext, _p: Value| {
            let (r, p) = (r.clone(), p.clone());
            async move {
                let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                p.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(50)).await;
                r.fetch_sub(1, Ordering::SeqCst);
                Ok::<_, JobError>(())
            }
        });
    run_until(w, || async {
        h.jobs()
            .await
            .iter()
            .all(|j| j.state == JobState::Completed)
    })
    .await;
    assert_eq!(peak.load(Ordering::SeqCst), 2);
}

async fn lost_lease_stops_the_handler_and_drops_its_result(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let s = started.clone();
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (d, f) = (dropped.clone(), finished.clone());
    // A 3 s lease: heartbeats every second, so the takeover below (within
    // milliseconds of moving the clock) happens before the next renewal.
    let w = worker(&h)
        .concurrency(1)
        .lease(Duration::from_secs(3))
        .shutdown_grace(Duration::from_millis(100))
        .handle("t", move |_c: HandlerContext, _p: Value| {
            let (s, d, f) = (s.clone(), d.clone(), f.clone());
            async move {
                let _guard = DropFlag(d);
                s.notify_one();
                tokio::time::sleep(Duration::from_secs(30)).await;
                f.store(true, Ordering::SeqCst);
                Ok::<_, JobError>(json!("from the zombie"))
            }
        });
    let (tx, handle) = start(w);
    started.notified().await;
    // The store's clock passes the lease; another worker takes the job over.
    take_over(&h, &id, Duration::from_secs(60)).await;
    // The first worker's next heartbeat finds the lease lost and stops the
    // handler, which is still running (it sleeps 30 s), while the worker
    // itself keeps running: not a shutdown that failed to release.
    let start = tokio::time::Instant::now();
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the heartbeat did not stop the handler"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!finished.load(Ordering::SeqCst), "stopped while it ran");
    assert!(!handle.is_finished(), "the worker runs on");
    let _ = tx.send(());
    let report = handle.await.unwrap().unwrap();
    assert_eq!((report.lost, report.released, report.completed), (1, 0, 0));
    let job = h.job(&id).await;
    assert_eq!(
        (job.state, job.result),
        (JobState::Completed, Some(json!("from w-2")))
    );
    let outcomes = run_outcomes(&h, &id).await;
    assert_eq!(
        outcomes,
        vec![
            Some("lease_expired".to_string()),
            Some("completed".to_string())
        ]
    );
}

async fn wakeups_start_new_work_without_waiting_for_the_poll(h: Harness) {
    let (tx, handle) = start(sleepy_worker(&h));
    // Let the worker reach its first wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id = h.put(EnqueueRequest::new("t")).await;
    let start = tokio::time::Instant::now();
    until_state(
        &h,
        &id,
        JobState::Completed,
        start,
        Duration::from_secs(20),
        "not woken: the poll interval is 120 s",
    )
    .await;
    let _ = tx.send(());
    handle.await.unwrap().unwrap();
}

/// A heartbeat past the timeout ends the attempt and puts the job back to
/// waiting for its retry, which frees its concurrency key: the heartbeat's
/// wake-up starts the job waiting behind that key without waiting for the
/// poll (120 s here).
async fn a_heartbeat_that_records_a_timeout_wakes_the_workers(h: Harness) {
    let first = h
        .put(
            EnqueueRequest::new("t")
                .concurrency_key("k")
                .timeout(Duration::from_secs(1))
                .retry(no_retry_soon()),
        )
        .await;
    let held = h.claim_one().await;
    let next = h.put(EnqueueRequest::new("t").concurrency_key("k")).await;
    let (tx, handle) = start(sleepy_worker(&h));
    // Let the worker reach its first wait; its claims find the key held.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(state(&h, &next).await, JobState::Ready);
    h.advance(Duration::from_secs(2));
    let lost = h.queue.heartbeat(&first, &held.lease_token).await;
    assert!(
        matches!(lost, Err(idemq::Error::LeaseLost { .. })),
        "{lost:?}"
    );
    assert_eq!(state(&h, &first).await, JobState::Scheduled);
    let start = tokio::time::Instant::now();
    until_state(
        &h,
        &next,
        JobState::Completed,
        start,
        Duration::from_secs(20),
        "not woken by the heartbeat: the poll interval is 120 s",
    )
    .await;
    let _ = tx.send(());
    handle.await.unwrap().unwrap();
}

/// A claim ends at most 2,048 jobs past their deadline; one that stopped
/// at that bound took nothing here, and the live job behind all of them
/// must still start at once: such a claim wakes the workers, whose poll
/// interval is 120 s. (Before, the live job waited for polls: a new
/// subscription or an enqueue leaves a wake-up or two, not three.)
async fn a_claim_stopped_by_passed_deadlines_wakes_the_workers(h: Harness) {
    h.put_past_deadline(EnqueueRequest::new("t"), 3 * 2048 + 100)
        .await;
    // Behind every job past its deadline in claim order.
    let live = h.put(EnqueueRequest::new("t")).await;
    let (tx, handle) = start(sleepy_worker(&h));
    let start = tokio::time::Instant::now();
    until_state(
        &h,
        &live,
        JobState::Completed,
        start,
        Duration::from_secs(30),
        "the live job did not start: its claims stopped at the bound and the poll is 120 s",
    )
    .await;
    let _ = tx.send(());
    handle.await.unwrap().unwrap();
    let ready: u64 = h
        .queue
        .queues()
        .await
        .expect("queues")
        .iter()
        .map(|q| q.counts.ready)
        .sum();
    assert_eq!(ready, 0, "every job past its deadline was ended");
}

/// The worker runtime's debug events, captured for the whole test process
/// (the first case that asks installs the subscriber).
fn worker_events() -> Arc<std::sync::Mutex<Vec<u8>>> {
    static EVENTS: std::sync::OnceLock<Arc<std::sync::Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    EVENTS
        .get_or_init(|| {
            let buf = Arc::new(std::sync::Mutex::new(Vec::new()));
            let b = buf.clone();
            let _ = tracing_subscriber::fmt()
                .with_env_filter("idemq::worker::run=debug")
                .with_ansi(false)
                .with_writer(move || Captured(b.clone()))
                .try_init();
            buf
        })
        .clone()
}

struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(data);
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A claim that went out before a job committed answers short; the job's
/// wake-up, arriving while that claim is out, must send another claim at
/// once. Before, the worker took the wake-up in while the claim was out,
/// then went idle on the short answer and waited for its poll interval
/// (120 s here). Each round pauses the queue, enqueues (each enqueue wakes
/// the worker into a claim that finds the queue paused) and resumes: the
/// resume's wake-up races those claims. Every round must run within 20 s,
/// and the worker must report that the race happened in some round. (On
/// the previous code this failed within 20 rounds on PostgreSQL and in the
/// first on Redis.)
async fn a_wake_up_while_a_claim_is_out_is_not_lost(h: Harness) {
    const ROUNDS: usize = 40;
    let events = worker_events();
    let name = format!("rewake-{}", uuid::Uuid::new_v4().simple());
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let w = Worker::new(h.queue.clone())
        .name(name.clone())
        .concurrency(8)
        .poll_interval(Duration::from_secs(120))
        .maintenance(false)
        .handle("t", move |_c: HandlerContext, _p: Value| {
            r.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, JobError>(()) }
        });
    let (tx, handle) = start(w);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let raced = || {
        let text = events.lock().unwrap_or_else(|e| e.into_inner());
        String::from_utf8_lossy(&text)
            .lines()
            .filter(|l| {
                l.contains(&name) && l.contains("a wake-up came while a short claim was out")
            })
            .count()
    };
    let mut expected = 0;
    let mut round = 0;
    // At least ROUNDS rounds, and more (up to ten times as many) until the
    // race has happened.
    while round < ROUNDS || (raced() == 0 && round < 10 * ROUNDS) {
        round += 1;
        h.queue.pause("default").await.unwrap();
        for _ in 0..3 {
            let reqs = (0..5).map(|_| EnqueueRequest::new("t")).collect();
            for r in h
                .queue
                .enqueue_many(reqs, idemq::BatchOptions::default())
                .await
                .unwrap()
            {
                r.unwrap();
            }
        }
        expected += 15;
        h.queue.resume("default").await.unwrap();
        let start = tokio::time::Instant::now();
        while ran.load(Ordering::SeqCst) < expected {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "round {round}: {} of {expected} jobs ran in 20 s; a wake-up was lost \
                 (the poll interval is 120 s)",
                ran.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert!(
        raced() > 0,
        "no wake-up came while a claim was out in {round} rounds: the race did not happen"
    );
    let _ = tx.send(());
    handle.await.unwrap().unwrap();
}

async fn snooze_from_a_handler_keeps_the_attempt(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let w = worker(&h).handle("t", |_c: HandlerContext, _p: Value| async move {
        Err::<(), _>(JobError::snooze(Duration::from_secs(60)))
    });
    run_until(w, || async { state(&h, &id).await == JobState::Scheduled }).await;
    let job = h.job(&id).await;
    assert_eq!((job.attempt, job.attempts_used), (1, 0));
    assert_eq!(job.run_at, h.now().await + chrono::Duration::seconds(60));
}

async fn worker_without_handlers_is_refused(h: Harness) {
    let err = Worker::new(h.queue.clone())
        .run(async {})
        .await
        .unwrap_err();
    assert!(matches!(err, idemq::Error::Validation { .. }), "{err:?}");
}

async fn drain_500_jobs_each_completed_once(h: Harness) {
    let reqs: Vec<_> = (0..500)
        .map(|i| EnqueueRequest::new("noop").payload(json!(i)))
        .collect();
    h.queue
        .enqueue_many(reqs, idemq::BatchOptions::default())
        .await
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let w = worker(&h)
        .concurrency(16)
        .handle("noop", move |_c: HandlerContext, _p: Value| {
            c.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, JobError>(()) }
        });
    let report = run_until(w, || async {
        h.queue
            .queues()
            .await
            .unwrap()
            .iter()
            .map(|q| q.counts.completed)
            .sum::<u64>()
            == 500
    })
    .await;
    assert_eq!(report.completed, 500);
    assert_eq!(calls.load(Ordering::SeqCst), 500, "each handler ran once");
    assert!(
        h.jobs()
            .await
            .iter()
            .all(|j| j.attempt == 1 && j.attempts_used == 1)
    );
}

async fn concurrent_maintenance_passes_reap_each_lease_once(h: Harness) {
    for _ in 0..40 {
        h.put(EnqueueRequest::new("t").retry(no_retry_soon())).await;
    }
    assert_eq!(h.claim(40).await.len(), 40);
    h.advance(Duration::from_secs(60));
    let mut passes = Vec::new();
    for _ in 0..4 {
        let m = Maintenance::new(h.another_queue().await).batch(7);
        passes.push(tokio::spawn(async move {
            let mut reaped = 0;
            for _ in 0..20 {
                let pass = m.pass().await;
                assert!(pass.errors.is_empty(), "{:?}", pass.errors);
                reaped += pass.leases_reaped;
            }
            reaped
        }));
    }
    let mut total = 0;
    for p in passes {
        total += p.await.unwrap();
    }
    assert_eq!(total, 40, "each expired lease recorded exactly once");
    for j in h.jobs().await {
        let kinds = h.event_kinds(&j.id).await;
        assert_eq!(kinds.iter().filter(|k| *k == "lease_expired").count(), 1);
        assert_eq!((j.state, j.attempts_used), (JobState::Ready, 1));
    }
}

/// A pass is bounded in rows, but the loop runs the next pass at once while
/// passes come back full, so a backlog larger than a batch is cleared long
/// before the next tick (here a minute away).
async fn maintenance_loop_catches_up_beyond_one_batch(h: Harness) {
    let reqs: Vec<_> = (0..60)
        .map(|_| EnqueueRequest::new("t").keep(Duration::ZERO))
        .collect();
    h.queue
        .enqueue_many(reqs, idemq::BatchOptions::default())
        .await
        .unwrap();
    for c in h.claim(60).await {
        h.queue.complete(&c.id, &c.lease_token, None).await.unwrap();
    }
    assert_eq!(h.jobs().await.len(), 60);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let m = Maintenance::new(h.queue.clone())
        .batch(7)
        .every(Duration::from_secs(60));
    let task = tokio::spawn(m.run_until(stopped));
    let start = tokio::time::Instant::now();
    while !h.jobs().await.is_empty() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "the loop waited for its next tick"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(true);
    task.await.unwrap();
}

/// A maintenance loop whose stop sender is gone (a dropped `Worker::run`,
/// say) ends, before or after it started, instead of running passes back
/// to back with nothing to stop it.
async fn maintenance_loop_ends_when_its_stop_sender_is_dropped(h: Harness) {
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let m = Maintenance::new(h.queue.clone()).every(Duration::from_millis(50));
    let task = tokio::spawn(m.clone().run_until(stopped));
    tokio::time::sleep(Duration::from_millis(120)).await;
    drop(stop);
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the loop ended after its sender was dropped")
        .unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    drop(stop);
    tokio::time::timeout(Duration::from_secs(5), m.run_until(stopped))
        .await
        .expect("a loop started without a sender ends at once");
}

/// The maintenance loop runs each step on its own: while firing schedules
/// waits (a tick's enqueue waiting for a lock an application's transaction
/// holds, say), expired leases are still reaped, pass after pass.
async fn a_waiting_maintenance_step_holds_up_no_other(h: Harness) {
    let (queue, faulty) = Faults::queue(&h);
    faulty.hold_schedules();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(
        Maintenance::new(queue)
            .every(Duration::from_millis(50))
            .run_until(stopped),
    );
    // Two leases expire one after the other while the schedule step waits.
    for round in 0..2 {
        let id = h.put(EnqueueRequest::new("t").retry(no_retry_soon())).await;
        assert_eq!(h.claim_one().await.id, id);
        h.advance(Duration::from_secs(120));
        let reaped = tokio::time::timeout(Duration::from_secs(10), async {
            while state(&h, &id).await != JobState::Ready {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(reaped.is_ok(), "round {round}: the lease was not reaped");
        h.queue.cancel(&id).await.unwrap();
    }
    assert_eq!(
        faulty.held_schedules.load(Ordering::SeqCst),
        1,
        "the schedule step was waiting all along"
    );
    faulty.let_go();
    let _ = stop.send(true);
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("the loop ends once the waiting step goes on")
        .unwrap();
}

/// Cancels `id` once its handler signals `started`.
fn cancel_once_started(h: &Harness, id: &str, started: Arc<tokio::sync::Notify>) {
    let (queue, id) = (h.queue.clone(), id.to_owned());
    tokio::spawn(async move {
        started.notified().await;
        queue.cancel(&id).await.expect("cancel");
    });
}

/// The outcome of each recorded run of `id`, oldest first.
async fn run_outcomes(h: &Harness, id: &str) -> Vec<Option<String>> {
    h.queue
        .runs(id)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.outcome)
        .collect()
}

/// Moves the clock `by` (past the job's lease), then another worker on its
/// own connections claims the job, as its second attempt, and completes it
/// with the result "from w-2".
///
/// The first worker's heartbeats keep running: one that lands between the
/// move and the claim renews the expired lease (SPEC: a token stays valid
/// until its expiry is recorded), and the claim finds nothing. The clock
/// then moves again, up to a few times.
async fn take_over(h: &Harness, id: &str, by: Duration) {
    let other = h.another_queue().await;
    let mut claimed = Vec::new();
    for _ in 0..5 {
        h.advance(by);
        claimed = other
            .claim(idemq::ClaimOptions {
                worker: "w-2".into(),
                ..idemq::ClaimOptions::default()
            })
            .await
            .unwrap();
        if !claimed.is_empty() {
            break;
        }
    }
    assert_eq!(claimed.len(), 1, "the expired lease is taken over");
    assert_eq!((claimed[0].id.as_str(), claimed[0].attempt), (id, 2));
    other
        .complete(id, &claimed[0].lease_token, Some(json!("from w-2")))
        .await
        .unwrap();
}

/// The handler finishes after its lease was taken over, before any
/// heartbeat noticed: its result reaches the store and is refused as
/// lease-lost, and the other worker's result stands.
async fn a_late_result_after_a_lost_lease_is_refused(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let go = Arc::new(tokio::sync::Notify::new());
    let (s, g) = (started.clone(), go.clone());
    // A 60 s lease: the first heartbeat is 20 s away, after the test. One
    // slot, busy with the handler: the worker cannot reclaim the job itself.
    let w = worker(&h)
        .concurrency(1)
        .lease(Duration::from_secs(60))
        .handle("t", move |_c: HandlerContext, _p: Value| {
            let (s, g) = (s.clone(), g.clone());
            async move {
                s.notify_one();
                g.notified().await;
                Ok::<_, JobError>(json!("from the zombie"))
            }
        });
    let (tx, handle) = start(w);
    started.notified().await;
    take_over(&h, &id, Duration::from_secs(120)).await;
    // Now the first handler returns its result.
    go.notify_one();
    let _ = tx.send(());
    let report = handle.await.unwrap().unwrap();
    assert_eq!((report.completed, report.lost), (0, 1), "{report:?}");
    let job = h.job(&id).await;
    assert_eq!(job.result, Some(json!("from w-2")));
    assert_eq!(job.attempt, 2);
}

async fn a_worker_whose_claims_would_be_refused_fails_at_run(h: Harness) {
    let noop = |_c: HandlerContext, _p: Value| async move { Ok::<_, JobError>(()) };
    let cases = [
        (
            Worker::new(h.queue.clone()).lease(Duration::from_millis(50)),
            "lease_ms",
        ),
        (
            Worker::new(h.queue.clone()).lease(Duration::from_secs(2 * 3600)),
            "lease_ms",
        ),
        (Worker::new(h.queue.clone()).name(""), "worker"),
        (Worker::new(h.queue.clone()).name("w".repeat(300)), "worker"),
        (
            Worker::new(h.queue.clone()).poll_interval(Duration::ZERO),
            "poll_interval",
        ),
    ];
    for (w, field) in cases {
        let run = w.handle("t", noop).run(std::future::pending());
        let err = tokio::time::timeout(Duration::from_secs(5), run)
            .await
            .expect("refused at once, not idling")
            .expect_err("refused");
        match err {
            idemq::Error::Validation { field: f, .. } => assert_eq!(f, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    assert!(h.jobs().await.is_empty());
}

async fn a_failing_maintenance_step_does_not_stop_the_others(h: Harness) {
    use idemq::worker::maintenance::Step;
    // A lease that will expire, and a finished job past its retention.
    let leased = h.put(EnqueueRequest::new("t").retry(no_retry_soon())).await;
    assert_eq!(h.claim_one().await.id, leased);
    let done = h.put(EnqueueRequest::new("t").keep(Duration::ZERO)).await;
    let c = h.claim_one().await;
    assert_eq!(c.id, done);
    h.queue.complete(&done, &c.lease_token, None).await.unwrap();
    // A schedule whose stored template no longer reads back (one a newer
    // idemq wrote, say), beside one that does.
    let def = idemq::ScheduleDefinition::every(Duration::from_secs(10), EnqueueRequest::new("s"));
    h.queue.schedule_set("broken", def.clone()).await.unwrap();
    h.queue.schedule_set("fine", def).await.unwrap();
    let redis_key = format!("{}sch:broken", h.redis_prefix.as_deref().unwrap_or(""));
    raw_write(
        &h,
        r#"UPDATE idemq_schedules SET job = '{"type": 5}' WHERE name = 'broken'"#,
        r#"UPDATE idemq.schedules SET job = '{"type": 5}' WHERE name = 'broken'"#,
        &["HSET", &redis_key, "job", r#"{"type": 5}"#],
    )
    .await;
    h.advance(Duration::from_secs(60));
    let m = Maintenance::new(h.queue.clone());
    let pass = m.pass().await;
    let failed: Vec<Step> = pass.errors.iter().map(|e| e.step).collect();
    assert_eq!(failed, [Step::FireSchedules], "{:?}", pass.errors);
    assert!(
        pass.errors[0].error.to_string().contains("broken"),
        "{:?}",
        pass.errors
    );
    assert_eq!((pass.leases_reaped, pass.jobs_deleted), (1, 1));
    // The schedule that reads back fired all the same; the other is left
    // as it was, still due, for a process that can read it. (A failed step
    // counts nothing in the report: the jobs show what it did.)
    let fired = || async {
        h.jobs()
            .await
            .into_iter()
            .filter(|j| j.job_type == "s")
            .count()
    };
    let ticks = fired().await;
    assert!(ticks > 0, "the readable schedule fired");
    // The next pass runs every step again.
    let again = m.pass().await;
    assert_eq!(again.errors.len(), 1);
    assert_eq!(fired().await, ticks);
    assert_eq!(h.job(&leased).await.state, JobState::Ready);
    assert!(h.queue.get(&done).await.unwrap().is_none());
}

async fn an_oversized_checkpoint_fails_the_attempt_for_good(h: Harness) {
    let id = h
        .put(
            EnqueueRequest::new("t")
                .max_attempts(5)
                .retry(RetryPolicy::Fixed { delay_ms: 1 }),
        )
        .await;
    let limit = h.queue.payload_limit();
    let w = worker(&h).handle("t", move |ctx: HandlerContext, _p: Value| async move {
        ctx.checkpoint(
            "big",
            || async move { Ok::<_, JobError>("x".repeat(limit + 1)) },
        )
        .await?;
        Ok::<_, JobError>(())
    });
    run_until(w, || async { state(&h, &id).await == JobState::Dead }).await;
    let job = h.job(&id).await;
    assert_eq!(job.attempts_used, 1, "one attempt, not all five");
    let error = job.last_error.unwrap_or_default();
    assert!(error.contains("checkpoint big"), "{error}");
}

/// Runs one statement on the backend's own connection, outside idemq
/// (`sqlite` on SQLite, `postgres` on PostgreSQL, the command `redis` on
/// Redis): for a row idemq would never write.
async fn raw_write(h: &Harness, sqlite: &str, postgres: &str, redis: &[&str]) {
    if let Some(url) = &h.redis_url {
        idemq_testkit::redis_command(url, redis)
            .await
            .expect("raw Redis command");
        return;
    }
    match (&h.db_file, &h.db_url) {
        (Some(path), _) => {
            let db = rusqlite::Connection::open(path).expect("open the file");
            db.busy_timeout(Duration::from_secs(5))
                .expect("busy timeout");
            db.execute_batch(sqlite).expect("raw SQLite statement");
        }
        (None, Some(url)) => {
            use sqlx::Connection;
            let mut c = sqlx::PgConnection::connect(url).await.expect("connect");
            sqlx::raw_sql(sqlx::AssertSqlSafe(postgres.to_owned()))
                .execute(&mut c)
                .await
                .expect("raw PostgreSQL statement");
        }
        (None, None) => panic!("the harness has no database"),
    }
}

/// The faults of a store that passes every call to the harness's store
/// ([`Through`]), but can fail the next releases with `Unavailable` and
/// hold claims until let go: the backend briefly down, or slow, at a
/// chosen moment.
#[derive(Debug)]
pub(crate) struct Faults {
    /// Releases still to fail with `Unavailable`.
    pub(crate) fail_releases: AtomicUsize,
    /// Releases asked for (failed or not).
    pub(crate) releases: AtomicUsize,
    /// While set, claim calls wait until it is cleared.
    hold: std::sync::atomic::AtomicBool,
    /// Claim calls that waited (or wait) while held.
    pub(crate) held: AtomicUsize,
    /// While set, reads of the due schedules wait until it is cleared.
    hold_schedules: std::sync::atomic::AtomicBool,
    /// Reads of the due schedules that waited (or wait) while held.
    pub(crate) held_schedules: AtomicUsize,
    /// Heartbeat calls answered (one job or many).
    pub(crate) heartbeats: AtomicUsize,
    /// While set, heartbeat calls fail with `Unavailable`.
    fail_heartbeats: std::sync::atomic::AtomicBool,
    /// Completions of one job still to fail with `Unavailable`.
    pub(crate) fail_completes: AtomicUsize,
    open: tokio::sync::Notify,
}

impl Faults {
    /// A queue over the harness's store, through a store with these faults.
    pub(crate) fn queue(h: &Harness) -> (idemq::Queue, Arc<Through<Faults>>) {
        let faults = Faults {
            fail_releases: AtomicUsize::new(0),
            releases: AtomicUsize::new(0),
            hold: std::sync::atomic::AtomicBool::new(false),
            held: AtomicUsize::new(0),
            hold_schedules: std::sync::atomic::AtomicBool::new(false),
            held_schedules: AtomicUsize::new(0),
            heartbeats: AtomicUsize::new(0),
            fail_heartbeats: std::sync::atomic::AtomicBool::new(false),
            fail_completes: AtomicUsize::new(0),
            open: tokio::sync::Notify::new(),
        };
        let faulty = Arc::new(Through::new(h.queue.store().clone(), faults));
        let queue = idemq::Queue::from_store(faulty.clone(), idemq::QueueOptions::default());
        (queue, faulty)
    }

    /// Fails every heartbeat from now on with `Unavailable`.
    pub(crate) fn fail_heartbeats(&self) {
        self.fail_heartbeats.store(true, Ordering::SeqCst);
    }

    /// Holds every claim call from now on until [`let_go`](Self::let_go).
    pub(crate) fn hold_claims(&self) {
        self.hold.store(true, Ordering::SeqCst);
    }

    /// Holds every read of the due schedules from now on until
    /// [`let_go`](Self::let_go): a schedule step that waits (for a lock,
    /// say).
    pub(crate) fn hold_schedules(&self) {
        self.hold_schedules.store(true, Ordering::SeqCst);
    }

    pub(crate) fn let_go(&self) {
        self.hold.store(false, Ordering::SeqCst);
        self.hold_schedules.store(false, Ordering::SeqCst);
        self.open.notify_waiters();
    }

    async fn gate(&self) {
        Self::wait_while(&self.hold, &self.held, &self.open).await;
    }

    async fn wait_while(
        hold: &std::sync::atomic::AtomicBool,
        held: &AtomicUsize,
        open: &tokio::sync::Notify,
    ) {
        if !hold.load(Ordering::SeqCst) {
            return;
        }
        held.fetch_add(1, Ordering::SeqCst);
        loop {
            let opened = open.notified();
            if !hold.load(Ordering::SeqCst) {
                return;
            }
            opened.await;
        }
    }
}

#[async_trait::async_trait]
impl idemq_testkit::Tap for Faults {
    async fn before(&self, call: Call) -> idemq::Result<()> {
        let down = |what: &str| {
            Err(idemq::Error::Unavailable {
                message: format!("the test's store is {what}"),
            })
        };
        let take = |n: &AtomicUsize| {
            n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        };
        match call {
            Call::Claim | Call::CompleteAndClaim { claims: true } => self.gate().await,
            Call::ScheduleDue => {
                Self::wait_while(&self.hold_schedules, &self.held_schedules, &self.open).await;
            }
            Call::Heartbeat if self.fail_heartbeats.load(Ordering::SeqCst) => {
                return down("down for heartbeats");
            }
            Call::Complete if take(&self.fail_completes) => return down("briefly down"),
            Call::Release => {
                self.releases.fetch_add(1, Ordering::SeqCst);
                if take(&self.fail_releases) {
                    return down("briefly down");
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn after(&self, call: Call) {
        if call == Call::Heartbeat {
            self.heartbeats.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// The worker's own claim takes back its job whose lease expired while the
/// handler still ran (the store unreachable, or the process paused, past
/// the lease): the older attempt is stopped as lease-lost, its result
/// dropped, and the newer one is the one heartbeated, stopped and released.
async fn a_job_the_worker_reclaims_itself_stops_its_older_attempt(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let attempts = Arc::new(std::sync::Mutex::new(Vec::new()));
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (a, d, f) = (attempts.clone(), dropped.clone(), finished.clone());
    // A 30 s lease: the first heartbeat is 10 s away. Two slots: one is
    // free for the worker's own claim of the expired lease.
    let grace = Duration::from_millis(300);
    let w = worker(&h).concurrency(2).shutdown_grace(grace).handle(
        "t",
        move |ctx: HandlerContext, _p: Value| {
            let (a, d, f) = (a.clone(), d.clone(), f.clone());
            async move {
                a.lock().unwrap().push(ctx.attempt());
                let _guard = (ctx.attempt() == 1).then(|| DropFlag(d));
                tokio::time::sleep(Duration::from_secs(60)).await;
                if ctx.attempt() == 1 {
                    f.store(true, Ordering::SeqCst);
                }
                Ok::<_, JobError>(json!(format!("attempt {}", ctx.attempt())))
            }
        },
    );
    let (tx, handle) = start(w);
    let wait_for = |n: i32| {
        let attempts = attempts.clone();
        async move {
            let start = tokio::time::Instant::now();
            while !attempts.lock().unwrap().contains(&n) {
                assert!(
                    start.elapsed() < Duration::from_secs(20),
                    "attempt {n} did not start"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    wait_for(1).await;
    // The clock of record passes the lease: the worker's next claim (every
    // 50 ms) takes the job back, as attempt 2.
    h.advance(Duration::from_secs(60));
    wait_for(2).await;
    let start = tokio::time::Instant::now();
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "attempt 1 still runs beside attempt 2"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!finished.load(Ordering::SeqCst), "stopped while it ran");
    assert_eq!(*attempts.lock().unwrap(), vec![1, 2]);
    assert_eq!(h.job(&id).await.state, JobState::Active);
    // Attempt 2 is still this worker's: at shutdown it is stopped after
    // the grace period and released.
    let _ = tx.send(());
    let report = tokio::time::timeout(grace + Duration::from_secs(10), handle)
        .await
        .expect("run returns after the grace period, not the handler's minute")
        .expect("worker task")
        .expect("worker run");
    assert_eq!(
        (report.lost, report.released, report.completed),
        (1, 1, 0),
        "{report:?}"
    );
    let job = h.job(&id).await;
    assert_eq!(
        (job.state, job.attempt, job.result),
        (JobState::Ready, 2, None)
    );
    let outcomes = run_outcomes(&h, &id).await;
    assert_eq!(
        outcomes,
        vec![
            Some("lease_expired".to_string()),
            Some("released".to_string())
        ]
    );
}

/// The backend is unavailable when the worker releases a lease at shutdown:
/// the release is tried again while the lease lasts, so the job is ready
/// at once, not left to its lease's expiry.
async fn a_release_at_shutdown_is_retried_while_the_store_is_briefly_down(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let (queue, faulty) = Faults::queue(&h);
    faulty.fail_releases.store(1, Ordering::SeqCst);
    let started = Arc::new(AtomicUsize::new(0));
    let s = started.clone();
    let w = Worker::new(queue)
        .poll_interval(Duration::from_millis(50))
        .lease(Duration::from_secs(30))
        .maintenance(false)
        .shutdown_grace(Duration::from_millis(200))
        .handle("t", move |_c: HandlerContext, _p: Value| {
            s.fetch_add(1, Ordering::SeqCst);
            async move {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok::<_, JobError>(())
            }
        });
    // Shut down once the handler runs: its lease is released after the
    // grace period.
    let report = run_until(w, || async { started.load(Ordering::SeqCst) > 0 }).await;
    assert_eq!((report.released, report.lost), (1, 0), "{report:?}");
    assert!(faulty.releases.load(Ordering::SeqCst) >= 2, "tried again");
    let job = h.job(&id).await;
    assert_eq!((job.state, job.attempts_used), (JobState::Ready, 0));
}

/// `ctx.heartbeat()` passes on what the heartbeat says: a cancel request is
/// seen by the handler at once, not at the worker's next beat.
async fn a_heartbeat_from_the_handler_passes_on_a_cancel(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let go = Arc::new(tokio::sync::Notify::new());
    let (s, g) = (started.clone(), go.clone());
    // A 30 s lease: the worker's own first heartbeat is 10 s away.
    let w = worker(&h).handle("t", move |ctx: HandlerContext, _p: Value| {
        let (s, g) = (s.clone(), g.clone());
        async move {
            s.notify_one();
            g.notified().await;
            ctx.heartbeat().await?;
            Ok::<_, JobError>(json!(ctx.is_cancelled()))
        }
    });
    let q = h.queue.clone();
    let id2 = id.clone();
    tokio::spawn(async move {
        started.notified().await;
        q.cancel(&id2).await.expect("cancel");
        go.notify_one();
    });
    run_until(w, || async {
        matches!(
            state(&h, &id).await,
            JobState::Completed | JobState::Cancelled
        )
    })
    .await;
    let job = h.job(&id).await;
    assert_eq!(
        (job.state, job.result),
        (JobState::Completed, Some(json!(true)))
    );
}

/// A cancelled handler keeps running for the cancel grace (1 s by
/// default) once the cancel is seen: one that cleans up and returns `Ok`
/// completes its job (the effect happened).
async fn a_cancelled_handler_may_clean_up_and_complete(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let cleaned = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, c) = (started.clone(), cleaned.clone());
    let w = worker(&h).lease(Duration::from_millis(300)).handle(
        "t",
        move |ctx: HandlerContext, _p: Value| {
            let (s, c) = (s.clone(), c.clone());
            async move {
                s.notify_one();
                ctx.cancelled().await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                c.store(true, Ordering::SeqCst);
                Ok::<_, JobError>(json!("cleaned up"))
            }
        },
    );
    cancel_once_started(&h, &id, started);
    run_until(w, || async {
        matches!(
            state(&h, &id).await,
            JobState::Completed | JobState::Cancelled
        )
    })
    .await;
    assert!(cleaned.load(Ordering::SeqCst), "the handler cleaned up");
    let job = h.job(&id).await;
    assert_eq!(
        (job.state, job.result),
        (JobState::Completed, Some(json!("cleaned up")))
    );
}

/// A handler that goes on after a cancel is stopped once the cancel grace
/// (1 s by default) has passed, and the job ends cancelled.
async fn a_handler_that_ignores_a_cancel_is_stopped_after_the_cancel_grace(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let seen = Arc::new(std::sync::Mutex::new(None));
    let stopped = Arc::new(std::sync::Mutex::new(None));
    let (s, sn, st) = (started.clone(), seen.clone(), stopped.clone());
    /// Records when it is dropped.
    struct At(Arc<std::sync::Mutex<Option<tokio::time::Instant>>>);
    impl Drop for At {
        fn drop(&mut self) {
            *self.0.lock().unwrap() = Some(tokio::time::Instant::now());
        }
    }
    let w = worker(&h).lease(Duration::from_millis(300)).handle(
        "t",
        move |ctx: HandlerContext, _p: Value| {
            let (s, sn, st) = (s.clone(), sn.clone(), st.clone());
            async move {
                let _at = At(st);
                s.notify_one();
                ctx.cancelled().await;
                *sn.lock().unwrap() = Some(tokio::time::Instant::now());
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok::<_, JobError>(json!("too late"))
            }
        },
    );
    cancel_once_started(&h, &id, started);
    run_until(w, || async {
        matches!(
            state(&h, &id).await,
            JobState::Completed | JobState::Cancelled
        )
    })
    .await;
    let seen = seen.lock().unwrap().expect("the handler saw the cancel");
    let stopped = stopped.lock().unwrap().expect("the handler was stopped");
    let ran_on = stopped - seen;
    assert!(
        ran_on >= Duration::from_millis(900) && ran_on < Duration::from_secs(5),
        "ran on for {ran_on:?} after the cancel"
    );
    let job = h.job(&id).await;
    assert_eq!((job.state, job.result), (JobState::Cancelled, None));
    let runs = h.queue.runs(&id).await.unwrap();
    assert_eq!(runs[0].outcome.as_deref(), Some("cancelled"));
}

/// CPU time this thread has used (user and system), from
/// `/proc/thread-self/stat`, in clock ticks (1/100 s).
fn thread_cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("thread stat");
    // Fields after the command name (which may hold spaces), from state on:
    // utime and stime are the 12th and 13th of them.
    let rest = &stat[stat.rfind(')').expect("stat") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    fields[11].parse::<u64>().expect("utime") + fields[12].parse::<u64>().expect("stime")
}

/// While its claim cannot go out (one is out already and the store holds
/// it, as a lock or a slow database would), the claim loop waits instead of
/// going round: the worker's thread is nearly idle for the second measured.
/// (It used a whole core: the end of the claim window, passed, woke the
/// loop at once every time.)
async fn a_claim_that_cannot_go_out_does_not_spin_the_worker(h: Harness) {
    let (queue, faulty) = Faults::queue(&h);
    for _ in 0..200 {
        h.put(EnqueueRequest::new("t")).await;
    }
    let ran = Arc::new(AtomicUsize::new(0));
    let r = ran.clone();
    let w = Worker::new(queue)
        .poll_interval(Duration::from_millis(50))
        .maintenance(false)
        .concurrency(4)
        .handle("t", move |_c: HandlerContext, _p: Value| {
            let r = r.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                r.fetch_add(1, Ordering::SeqCst);
                Ok::<_, JobError>(())
            }
        });
    // The worker runs on a thread of its own, so that thread's CPU time is
    // the worker's alone.
    let (measure_tx, measure_rx) = oneshot::channel::<()>();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async move {
            let run = tokio::spawn(w.run(async move {
                let _ = stop_rx.await;
            }));
            let _ = measure_rx.await;
            let before = thread_cpu_ticks();
            tokio::time::sleep(Duration::from_secs(1)).await;
            let used = thread_cpu_ticks() - before;
            let report = run.await.expect("worker task").expect("worker run");
            (used, report)
        })
    });
    // Some jobs ran (the claims take whole batches: a backlog), then the
    // claims are held: the next one goes out and waits.
    let since = tokio::time::Instant::now();
    while ran.load(Ordering::SeqCst) < 8 {
        assert!(since.elapsed() < Duration::from_secs(30), "no job ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    faulty.hold_claims();
    while faulty.held.load(Ordering::SeqCst) == 0 {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "no claim was held"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The jobs it had finish; then the worker has nothing to do but wait.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = measure_tx.send(());
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let _ = stop_tx.send(());
    faulty.let_go();
    let (used, _report) =
        tokio::task::spawn_blocking(move || thread.join().expect("worker thread"))
            .await
            .expect("join");
    assert!(
        faulty.held.load(Ordering::SeqCst) >= 1,
        "a claim was held while the thread was measured"
    );
    assert!(
        used <= 20,
        "the worker's thread used {used} ticks (1/100 s) of the second it waited for its claim"
    );
}

/// A worker that cannot renew a lease (every heartbeat fails: the store
/// is unreachable for it) stops the handler once a whole lease has passed
/// since the last renewal was sent: by then the store may have given the
/// job to another worker. The handler's result is dropped.
async fn a_lease_no_heartbeat_renews_stops_its_handler(h: Harness) {
    let (queue, faulty) = Faults::queue(&h);
    let id = h.put(EnqueueRequest::new("t")).await;
    let started = Arc::new(tokio::sync::Notify::new());
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, d, f) = (started.clone(), dropped.clone(), finished.clone());
    let w = Worker::new(queue)
        .poll_interval(Duration::from_millis(50))
        .maintenance(false)
        .concurrency(1)
        .lease(Duration::from_millis(600))
        .handle("t", move |_c: HandlerContext, _p: Value| {
            let (s, d, f) = (s.clone(), d.clone(), f.clone());
            async move {
                let _guard = DropFlag(d);
                s.notify_one();
                tokio::time::sleep(Duration::from_secs(20)).await;
                f.store(true, Ordering::SeqCst);
                Ok::<_, JobError>(json!("from a worker that lost its lease"))
            }
        });
    faulty.fail_heartbeats();
    let (tx, handle) = start(w);
    started.notified().await;
    let since = tokio::time::Instant::now();
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            since.elapsed() < Duration::from_secs(5),
            "the handler ran on with its lease unrenewed"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!finished.load(Ordering::SeqCst), "stopped while it ran");
    assert!(
        faulty.heartbeats.load(Ordering::SeqCst) == 0,
        "no heartbeat was answered"
    );
    let _ = tx.send(());
    let report = handle.await.unwrap().unwrap();
    assert_eq!((report.lost, report.completed), (1, 0));
    // Nothing of the attempt was recorded: the job is active until the
    // store's clock passes the lease.
    let job = h.job(&id).await;
    assert_eq!((job.state, job.result), (JobState::Active, None));
}

/// A snooze longer than the store takes (`Duration::MAX`) is the longest
/// it takes (100 years): recorded as a snooze, the attempt not counted,
/// not refused and left to the lease (whose expiry would count it).
async fn a_snooze_beyond_the_bound_keeps_the_attempt(h: Harness) {
    let id = h.put(EnqueueRequest::new("t")).await;
    let w = worker(&h).handle("t", |_c: HandlerContext, _p: Value| async move {
        Err::<(), _>(JobError::snooze(Duration::MAX))
    });
    let report = run_until(w, || async { state(&h, &id).await == JobState::Scheduled }).await;
    assert_eq!((report.lost, report.failed), (0, 1));
    let job = h.job(&id).await;
    assert_eq!(job.attempts_used, 0, "a snooze keeps the attempt");
    let years = (job.run_at - job.updated_at).num_days() / 365;
    assert!((99..=100).contains(&years), "due in {years} years");
}

/// After a batch of completions was refused as a whole (one result over the
/// payload limit), each is recorded on its own; one the store could not
/// take just then (`Unavailable`) goes back with the completions to carry,
/// and is recorded by a later call, not counted lost.
async fn a_completion_the_store_could_not_take_just_then_is_recorded_later(h: Harness) {
    let (queue, faulty) = Faults::queue(&h);
    let big = h
        .put(EnqueueRequest::new("r").payload(json!({"big": true})))
        .await;
    for i in 0..30 {
        h.put(EnqueueRequest::new("r").payload(json!({"big": false, "i": i})))
            .await;
    }
    faulty.fail_completes.store(3, Ordering::SeqCst);
    let (go, gate) = tokio::sync::watch::channel(false);
    // One slot more than the jobs: the worker keeps claiming for it, every
    // poll interval, so a claim call is out when the handlers return.
    let w = Worker::new(queue)
        .poll_interval(Duration::from_millis(50))
        .maintenance(false)
        .concurrency(32)
        .handle("r", move |_c: HandlerContext, p: Value| {
            let mut gate = gate.clone();
            async move {
                let _ = gate.wait_for(|&open| open).await;
                let size = if p["big"] == json!(true) {
                    (1 << 20) + 1
                } else {
                    10
                };
                Ok::<_, JobError>(json!("x".repeat(size)))
            }
        });
    let (tx, handle) = start(w);
    let since = tokio::time::Instant::now();
    while !h.jobs().await.iter().all(|j| j.state == JobState::Active) {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "not every job ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A claim call is held while every handler returns: their completions
    // wait together, and the next call carries them all, the oversized
    // result among them, which refuses the whole call.
    faulty.hold_claims();
    while faulty.held.load(Ordering::SeqCst) == 0 {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "no claim was held"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = go.send(true);
    tokio::time::sleep(Duration::from_millis(200)).await;
    faulty.let_go();
    while !h.jobs().await.iter().all(|j| j.state.is_terminal()) {
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "some completions were never recorded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = tx.send(());
    let report = handle.await.expect("worker task").expect("worker run");
    assert_eq!(
        faulty.fail_completes.load(Ordering::SeqCst),
        0,
        "completions of one job failed"
    );
    assert_eq!((report.completed, report.failed, report.lost), (30, 1, 0));
    for j in h.jobs().await {
        let want = if j.id == big {
            JobState::Dead
        } else {
            JobState::Completed
        };
        assert_eq!(j.state, want, "{}", j.id);
    }
}
