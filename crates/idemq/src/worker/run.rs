//! The claim loop, the per-job supervisor and the heartbeat loop.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::complete::{Entry, Pending};
use super::context::{ErrorKind, HandlerContext, JobError, Signals, Stop};
use super::handler::BoxFuture;
use super::maintenance::Maintenance;
use super::prefetch::{Local, Queued};
use super::{Worker, WorkerReport};
use crate::error::{Error, Result};
use crate::job::{ClaimedJob, JobState};
use crate::queue::{ClaimOptions, FailOptions, Queue};
use crate::request::bounds::MAX_CLAIM_LIMIT;
use crate::store::Wakeups;

/// How long free slots wait for more to free up before a claim, while a
/// backlog is being worked off.
const CLAIM_WINDOW: Duration = Duration::from_millis(5);

/// The jobs that may wait for a slot by default, or `concurrency` if more.
const DEFAULT_PREFETCH: usize = 128;

/// A `complete_and_claim` call that ended: the completions it carried and
/// what the store answered.
struct Call {
    done: Vec<Entry>,
    outcome: Result<Answer>,
    /// When the call was sent: the leases it took started no earlier.
    sent: tokio::time::Instant,
}

/// What `complete_and_claim` answers: each completion's result, then the claim's.
type Answer = (Vec<Result<()>>, Result<Vec<ClaimedJob>>);

/// One attempt this worker holds: its job's id keys it, its lease token
/// tells it from an earlier attempt of the same job.
struct Slot {
    token: crate::LeaseToken,
    signals: Arc<Signals>,
}

/// The attempts this worker holds, running or waiting for a slot: at most
/// one per job, the newest. An entry is removed only by its own attempt
/// (same token), and a heartbeat's answer reaches only the attempt whose
/// token it renewed.
type Slots = Arc<Mutex<HashMap<String, Slot>>>;

/// Forgets the attempt of `id` holding `token`, not a newer one of the
/// same job.
fn forget(slots: &Slots, id: &str, token: &crate::LeaseToken) {
    let mut slots = lock(slots);
    if slots.get(id).is_some_and(|s| &s.token == token) {
        slots.remove(id);
    }
}

#[derive(Clone, Copy)]
enum Ended {
    /// Succeeded: the completion waits in [`Pending`] for the next call.
    Handed,
    /// Completed in the handler's own transaction, which committed.
    CompletedInTx,
    Failed,
    Released,
    Lost,
}

fn lock(slots: &Slots) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
    slots.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) async fn run(
    w: Worker,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<WorkerReport> {
    let types = w.registry.types();
    // A catch-all handler takes claims of any type.
    let claim_types = w.registry.catch_all.is_none().then(|| types.clone());
    if types.is_empty() && w.registry.catch_all.is_none() {
        return Err(Error::validation(
            "handlers",
            "register at least one handler before run",
        ));
    }
    // Settings a claim would refuse are refused here, before anything runs:
    // a worker that cannot claim must say so, not idle.
    let claim_options = |limit: u32| ClaimOptions {
        queues: w.queues.clone(),
        types: claim_types.clone(),
        worker: w.name.clone(),
        limit,
        lease: w.lease,
    };
    claim_options(1).validate()?;
    if w.poll_interval.is_zero() {
        return Err(Error::validation("poll_interval", "must be more than 0"));
    }
    // Wake-ups are an optimisation: polling alone still finds the work.
    let mut wakeups = match w.queue.store().wakeups().await {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "no wake-ups; polling for work only");
            None
        }
    };
    let slots: Slots = Arc::default();
    let (stop_all, stop_rx) = watch::channel(false);
    let heartbeats = tokio::spawn(heartbeat_loop(
        w.queue.clone(),
        slots.clone(),
        w.lease,
        stop_rx.clone(),
    ));
    let pending = Arc::new(Pending::default());
    let maintenance = w
        .maintenance
        .then(|| tokio::spawn(Maintenance::new(w.queue.clone()).run_until(stop_rx.clone())));

    let mut report = WorkerReport::default();
    // Each running attempt, ending with how long its slot was busy.
    let mut tasks: JoinSet<(Ended, Duration)> = JoinSet::new();
    // Claimed jobs waiting for a slot (see `prefetch`).
    let mut local: Local<Control> =
        Local::new(w.prefetch.unwrap_or(w.concurrency.max(DEFAULT_PREFETCH)));
    let count =
        |report: &mut WorkerReport,
         local: &mut Local<Control>,
         done: std::result::Result<(Ended, Duration), tokio::task::JoinError>| {
            let e = match done {
                Ok((e, took)) => {
                    local.ran(took);
                    e
                }
                Err(_) => Ended::Failed,
            };
            match e {
                Ended::Handed => {}
                Ended::CompletedInTx => report.completed += 1,
                Ended::Failed => report.failed += 1,
                Ended::Released => report.released += 1,
                Ended::Lost => report.lost += 1,
            }
        };
    tokio::pin!(shutdown);
    // Store calls in flight, and the slots each one's claim asked for.
    let mut calls: JoinSet<Call> = JoinSet::new();
    // Each call in flight: the slots its claim asked for, and `wakes` and
    // `ended` as it went out.
    let mut asked_by: HashMap<tokio::task::Id, (usize, u64, u64)> = HashMap::new();
    // Wake-ups received and handlers ended so far. Either, while a claim is
    // out, is news that claim could not take into account: a wake-up may
    // announce a job that committed after the claim began, and an ended
    // handler leaves a completion to record and a slot to fill. A short
    // answer is a reason to go idle only if nothing happened meanwhile.
    let (mut wakes, mut ended): (u64, u64) = (0, 0);
    let in_flight = w.queue.store().claims_in_flight().max(1);
    // Calls that ended while the loop waited, not yet taken in.
    let mut arrived: Vec<std::result::Result<(tokio::task::Id, Call), tokio::task::JoinError>> =
        Vec::new();
    // Whether the last claim took all it asked for: more work is waiting.
    let mut backlog = false;
    // Since when fewer slots than a batch have been free.
    let mut free_since: Option<tokio::time::Instant> = None;
    // After a failed call: no claim before this instant.
    let mut retry = Backoff::new(w.poll_interval);
    // A claim refused for good ends the run (after the running handlers).
    let mut fatal: Option<Error> = None;
    // Shutdown (or a fatal refusal) came: no more calls, and no job starts;
    // the calls in flight are taken in (their completions recorded, their
    // jobs released with the waiting ones) before the loop ends.
    let mut stopping = false;
    // The last claim came back short and nothing has happened since.
    let mut idle = false;
    loop {
        while let Some(done) = tasks.try_join_next() {
            ended += 1;
            count(&mut report, &mut local, done);
        }
        while let Some(done) = calls.try_join_next_with_id() {
            arrived.push(done);
        }
        let mut full = false;
        for done in arrived.drain(..) {
            let (call, (asked, wakes_then, ended_then)) = match done {
                Ok((id, call)) => (call, asked_by.remove(&id).unwrap_or((0, wakes, ended))),
                // The call's task panicked: its claim's slots are free again;
                // the completions it carried are not recorded (those jobs
                // run again once their leases expire).
                Err(e) => {
                    tracing::error!(error = %e, "a claim call ended without an answer");
                    asked_by.remove(&e.id());
                    continue;
                }
            };
            match call.outcome {
                Ok((recorded, claimed)) => {
                    retry.succeeded();
                    for r in recorded {
                        match r {
                            Ok(()) => report.completed += 1,
                            Err(_) => report.lost += 1,
                        }
                    }
                    let jobs = claimed.unwrap_or_default();
                    // A call that only carried completions says nothing
                    // of the backlog.
                    if asked > 0 {
                        let took_all = jobs.len() == asked;
                        full |= took_all;
                        backlog = took_all;
                        // Short of what it asked: claim again only when
                        // something changes (a slot frees, a wake-up, the
                        // poll interval, the window), or at once if
                        // something did while it was out.
                        let news = (wakes != wakes_then, ended != ended_then);
                        if !took_all && news.0 {
                            tracing::debug!(
                                worker = %w.name,
                                "a wake-up came while a short claim was out; claiming again"
                            );
                        }
                        idle |= !took_all && news == (false, false);
                    }
                    for job in jobs {
                        if let Some(queued) = admit(&w, &slots, job, call.sent) {
                            local.push(queued);
                        }
                    }
                }
                // The backend is down or busy: keep the completions (while
                // their leases last) and retry with backoff.
                Err(e) if e.is_retryable() => {
                    retry.failed(&e);
                    report.lost += pending.put_back(call.done);
                    backlog = false;
                }
                // One completion the store cannot take refuses the whole
                // call: record them one by one, then claim again.
                Err(e) if !call.done.is_empty() => {
                    tracing::debug!(error = %e, "a completion batch was refused; recording one by one");
                    one_by_one(&w.queue, &pending, call.done, &mut report).await;
                    backlog = false;
                }
                // A claim refused for good: nothing this worker does will
                // change the answer.
                Err(e) => {
                    if fatal.is_none() {
                        tracing::error!(error = %e, "the store refused this worker's claim; stopping");
                        fatal = Some(e);
                    }
                    stopping = true;
                }
            }
        }
        // After shutdown nothing starts: the jobs waiting, and those of a
        // call still in flight, are released once the calls are back. A
        // shutdown that came while something else woke this loop (a slot
        // freed, say) counts first.
        if !stopping && futures_util::FutureExt::now_or_never(&mut shutdown).is_some() {
            stopping = true;
        }
        while !stopping && tasks.len() < w.concurrency {
            let Some(queued) = local.pop() else { break };
            launch(&w, &slots, &pending, &mut tasks, queued);
        }
        if stopping && calls.is_empty() {
            break;
        }
        // Room for the running slots and for the jobs that may wait for
        // them at the current pace.
        let capacity = w.concurrency + local.room(w.concurrency);
        let free = capacity
            .saturating_sub(tasks.len())
            .saturating_sub(local.len())
            .saturating_sub(asked_by.values().map(|(asked, _, _)| asked).sum());
        // With a backlog, claim in batches: a claim costs about as much for
        // one job as for a dozen, so claiming each freed slot on its own
        // would spend the database on claims. Where the store runs calls
        // side by side, `in_flight` calls of a share of the slots each go
        // out at once, so the database works on the next batch while this
        // process starts and finishes the last one.
        // Without a backlog, any free slot claims at once (a new job starts
        // without delay), one call at a time. Completions ride along with
        // the claim. Slots (or completions) that wait for CLAIM_WINDOW are
        // served however few they are, so long-running handlers never hold
        // the rest back and a completion is recorded within the window.
        let (wanted, most, max_calls) = if backlog {
            let share = capacity.div_ceil(in_flight);
            (share, share, in_flight)
        } else {
            (1, capacity, 1)
        };
        let waiting = free > 0 || !pending.is_empty();
        if !waiting {
            free_since = None;
        } else if free < wanted && free_since.is_none() {
            free_since = Some(tokio::time::Instant::now());
        }
        let window_over = free_since.is_some_and(|t| t.elapsed() >= CLAIM_WINDOW);
        if !stopping
            && !idle
            && calls.len() < max_calls
            && waiting
            && (free >= wanted || window_over)
            && retry.ready()
        {
            free_since = None;
            let asked = free.min(most).min(MAX_CLAIM_LIMIT as usize);
            let options = claim_options(u32::try_from(asked).unwrap_or(MAX_CLAIM_LIMIT));
            let done = pending.take();
            let completions = done.iter().map(|e| e.completion.clone()).collect();
            let queue = w.queue.clone();
            let call = calls.spawn(async move {
                let sent = tokio::time::Instant::now();
                let outcome = queue.complete_and_claim(completions, options).await;
                Call {
                    done,
                    outcome,
                    sent,
                }
            });
            asked_by.insert(call.id(), (asked, wakes, ended));
            // Another call may go out at once.
            continue;
        }
        if full {
            continue;
        }
        // The window only matters while a claim could go out: with the
        // calls all out, or a retry not due, its end would wake this loop
        // again and again until they come back.
        let may_claim = calls.len() < max_calls && retry.ready();
        // Whatever ends the wait below may have made a claim worth making.
        idle = false;
        tokio::select! {
            () = &mut shutdown, if !stopping => stopping = true,
            () = retry.wait(), if !retry.ready() => {}
            Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                ended += 1;
                count(&mut report, &mut local, done);
            }
            Some(done) = calls.join_next_with_id(), if !calls.is_empty() => arrived.push(done),
            woken = wait(&mut wakeups, w.poll_interval), if !stopping => {
                if woken {
                    wakes += 1;
                }
            }
            () = async {
                match free_since {
                    Some(t) => tokio::time::sleep_until(t + CLAIM_WINDOW).await,
                    None => std::future::pending().await,
                }
            }, if !stopping && may_claim => {}
        }
    }

    // Jobs that waited for a slot never started: other workers may take
    // them at once (a release is not a consumed attempt).
    release_waiting(&w.queue, w.lease, &slots, &mut local, &mut report).await;
    // Shutdown: no more claims; running handlers get the grace period. A
    // completion is recorded as soon as its handler returns: it no longer
    // heartbeats, so waiting for the slowest handler could let its lease run
    // out.
    let grace = tokio::time::sleep(w.grace);
    tokio::pin!(grace);
    loop {
        tokio::select! {
            done = tasks.join_next() => match done {
                Some(done) => {
                    count(&mut report, &mut local, done);
                    flush(&w, &pending, &mut report).await;
                }
                None => break,
            },
            () = &mut grace => {
                for slot in lock(&slots).values() {
                    slot.signals.stop(Stop::Shutdown);
                }
                while let Some(done) = tasks.join_next().await {
                    count(&mut report, &mut local, done);
                }
                break;
            }
        }
    }
    flush(&w, &pending, &mut report).await;
    let _ = stop_all.send(true);
    let _ = heartbeats.await;
    if let Some(m) = maintenance {
        let _ = m.await;
    }
    match fatal {
        Some(e) => Err(e),
        None => Ok(report),
    }
}

/// Takes in one claimed attempt: leased to this worker from now on (the
/// heartbeat loop renews it, cancellation and a lost lease reach it), to
/// start when a slot is free.
fn admit(
    w: &Worker,
    slots: &Slots,
    job: ClaimedJob,
    sent: tokio::time::Instant,
) -> Option<Queued<Control>> {
    let claimed = tokio::time::Instant::now();
    let handler = w.registry.get(&job.job_type)?;
    let signals = Arc::new(Signals::default());
    signals.renewed(sent);
    let older = lock(slots).insert(
        job.id.clone(),
        Slot {
            token: job.lease_token.clone(),
            signals: signals.clone(),
        },
    );
    // This worker still held an earlier attempt of the job (its lease
    // expired while the store was unreachable or the process paused, and
    // this worker's own claim took the job again): that lease is gone, so
    // the older attempt stops as lost and its result is dropped.
    if let Some(older) = older.filter(|o| o.token != job.lease_token) {
        tracing::warn!(job_id = %job.id, attempt = job.attempt, "this worker claimed its own job again; stopping the earlier attempt");
        older.signals.stop(Stop::LeaseLost);
    }
    Some(Queued {
        job,
        handler,
        control: signals,
        claimed,
    })
}

/// Starts one taken-in attempt under its supervisor, in a slot.
fn launch(
    w: &Worker,
    slots: &Slots,
    pending: &Arc<Pending>,
    tasks: &mut JoinSet<(Ended, Duration)>,
    queued: Queued<Control>,
) {
    let (queue, slots, lease, cancel_grace) =
        (w.queue.clone(), slots.clone(), w.lease, w.cancel_grace);
    let pending = pending.clone();
    tasks.spawn(async move {
        let began = tokio::time::Instant::now();
        let (id, token) = (queued.job.id.clone(), queued.job.lease_token.clone());
        let ended = supervise(queue, &pending, queued, lease, cancel_grace).await;
        forget(&slots, &id, &token);
        (ended, began.elapsed())
    });
}

/// Releases the leases of the jobs still waiting for a slot, all at once.
async fn release_waiting(
    queue: &Queue,
    lease: Duration,
    slots: &Slots,
    local: &mut Local<Control>,
    report: &mut WorkerReport,
) {
    let mut releases = JoinSet::new();
    for queued in local.drain() {
        let queue = queue.clone();
        let slots = slots.clone();
        releases.spawn(async move {
            let (id, token) = (&queued.job.id, &queued.job.lease_token);
            let released = release(&queue, id, token, lease).await.is_ok();
            forget(&slots, id, token);
            released
        });
    }
    while let Some(done) = releases.join_next().await {
        match done {
            Ok(true) => report.released += 1,
            // Not released: the lease runs out and the job runs again
            // (its attempt recorded as expired).
            _ => report.lost += 1,
        }
    }
}

/// Exponential backoff after failed store calls: from 50 ms, doubling, up to
/// the poll interval (at least 1 s). The first failure of a streak is logged
/// as a warning, the rest at debug level, and the recovery once.
struct Backoff {
    until: Option<tokio::time::Instant>,
    delay: Duration,
    max: Duration,
    failures: u32,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(50);

    fn new(poll: Duration) -> Self {
        Self {
            until: None,
            delay: Self::FIRST,
            max: poll.max(Duration::from_secs(1)),
            failures: 0,
        }
    }

    fn ready(&self) -> bool {
        self.until.is_none_or(|t| tokio::time::Instant::now() >= t)
    }

    async fn wait(&self) {
        if let Some(t) = self.until {
            tokio::time::sleep_until(t).await;
        }
    }

    fn failed(&mut self, e: &Error) {
        self.failures += 1;
        if self.failures == 1 {
            tracing::warn!(error = %e, "claim failed; retrying with backoff");
        } else {
            tracing::debug!(error = %e, failures = self.failures, "claim failed again");
        }
        self.until = Some(tokio::time::Instant::now() + self.delay);
        self.delay = (self.delay * 2).min(self.max);
    }

    fn succeeded(&mut self) {
        if self.failures > 0 {
            tracing::info!(failures = self.failures, "claims succeed again");
        }
        self.failures = 0;
        self.until = None;
        self.delay = Self::FIRST;
    }
}

/// Records completions one at a time, after a call that carried them was
/// refused as a whole (one result over the payload limit refuses the call).
/// A completion the store cannot take fails its attempt permanently with
/// the reason: the same handler would produce the same result again. One
/// the backend could not record just then goes back to `pending` (while its
/// lease lasts); true when any did.
async fn one_by_one(
    queue: &Queue,
    pending: &Pending,
    done: Vec<Entry>,
    report: &mut WorkerReport,
) -> bool {
    let mut again = Vec::new();
    for entry in done {
        let c = entry.completion.clone();
        match queue.complete(&c.job_id, &c.lease_token, c.result).await {
            Ok(()) => report.completed += 1,
            Err(e @ (Error::PayloadTooLarge { .. } | Error::Validation { .. })) => {
                let options = FailOptions {
                    error: format!("the handler's result was refused: {e}"),
                    permanent: true,
                    ..FailOptions::default()
                };
                match queue.fail(&c.job_id, &c.lease_token, options).await {
                    Ok(_) => report.failed += 1,
                    Err(_) => report.lost += 1,
                }
            }
            // The backend is briefly down: recorded with a later call,
            // while its lease lasts.
            Err(e) if e.is_retryable() => again.push(entry),
            Err(_) => report.lost += 1,
        }
    }
    let put_back = !again.is_empty();
    report.lost += pending.put_back(again);
    put_back
}

/// Records the completions still pending at shutdown, retrying while the
/// backend is briefly unavailable and their leases last.
async fn flush(w: &Worker, pending: &Pending, report: &mut WorkerReport) {
    let mut backoff = Duration::from_millis(50);
    while !pending.is_empty() {
        let done: Vec<Entry> = pending.take();
        let completions = done.iter().map(|e| e.completion.clone()).collect();
        match w.queue.complete_many(completions).await {
            Ok(recorded) => {
                for r in recorded {
                    match r {
                        Ok(()) => report.completed += 1,
                        Err(_) => report.lost += 1,
                    }
                }
            }
            Err(e) if e.is_retryable() => {
                report.lost += pending.put_back(done);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(_) => {
                if one_by_one(&w.queue, pending, done, report).await {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }
}

/// Waits for a wake-up or the poll interval; true when woken.
async fn wait(wakeups: &mut Option<Wakeups>, poll: Duration) -> bool {
    match wakeups {
        Some(w) => w.wait(poll).await,
        None => {
            tokio::time::sleep(poll).await;
            false
        }
    }
}

/// Heartbeats every running job every lease/3, passing on cancellation and
/// lost leases.
async fn heartbeat_loop(
    queue: Queue,
    slots: Slots,
    lease: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let every = (lease / 3).max(Duration::from_millis(30));
    let mut pause = every;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(pause) => {}
        }
        let sent = tokio::time::Instant::now();
        // A job its handler completed in its own transaction is not
        // renewed: on PostgreSQL that transaction holds the job's row until
        // it ends, and a heartbeat waiting for it would hold up the others.
        let running: Vec<(String, crate::LeaseToken)> = lock(&slots)
            .iter()
            .filter(|(_, s)| !s.signals.completed_in_tx())
            .map(|(id, s)| (id.clone(), s.token.clone()))
            .collect();
        // One call per batch of leases (one round trip and one commit on
        // PostgreSQL, however many jobs run), the batches side by side: one
        // slow call (a stalled connection, bounded by the store's call
        // timeout) must not hold up the other batches' renewals.
        let mut beats = JoinSet::new();
        for batch in running.chunks(crate::queue::MAX_BATCH_ITEMS) {
            let queue = queue.clone();
            let batch = batch.to_vec();
            beats.spawn(async move {
                let outcome = queue
                    .heartbeat_many(batch.iter().map(|(id, token)| (id.as_str(), token)))
                    .await;
                (batch, outcome)
            });
        }
        let mut failed = 0usize;
        let mut first_error = None;
        while let Some(done) = beats.join_next().await {
            let Ok((batch, outcome)) = done else { continue };
            let outcomes: Vec<Result<crate::job::Heartbeat>> = match outcome {
                Ok(each) => each,
                // The whole call failed (the backend is down): every lease
                // of the batch is tried again at the next beat.
                Err(e) => {
                    failed += batch.len();
                    if let Some((id, _)) = batch.first() {
                        first_error.get_or_insert((id.clone(), e));
                    }
                    continue;
                }
            };
            let slots = lock(&slots);
            for ((id, token), outcome) in batch.into_iter().zip(outcomes) {
                // The answer is for the attempt whose token was sent: one
                // that ended meanwhile, or was replaced by a newer attempt
                // of the same job, is not this answer's.
                let Some(slot) = slots.get(&id).filter(|s| s.token == token) else {
                    continue;
                };
                if outcome.is_ok() {
                    slot.signals.renewed(sent);
                }
                match outcome {
                    Ok(hb) if hb.cancel_requested => {
                        slot.signals.cancel();
                    }
                    Ok(_) => {}
                    Err(Error::LeaseLost { .. }) => {
                        slot.signals.stop(Stop::LeaseLost);
                    }
                    // The backend is down: try again at the next beat; the
                    // lease outlives a few missed beats.
                    Err(e) => {
                        failed += 1;
                        first_error.get_or_insert((id, e));
                    }
                }
            }
        }
        // A failed beat is tried again soon: a lease outlives a few missed
        // beats, not an outage of a whole lease (the attempt then stops).
        pause = if failed > 0 {
            every.min(RETRY_BEAT)
        } else {
            every
        };
        if let Some((job_id, e)) = first_error {
            tracing::warn!(%job_id, error = %e, failed, retry_in = ?pause, "heartbeats failed");
        }
    }
}

/// How soon a heartbeat that failed is tried again (at most the beat's
/// own period).
const RETRY_BEAT: Duration = Duration::from_millis(500);

/// Resolves once a whole lease has passed since the last call that renewed
/// it was sent (the heartbeats failed all along: the store unreachable):
/// the store's lease has run out by then, or is about to, so the job may
/// be another worker's. Never for an attempt that completed its job in its
/// own transaction (its lease no longer matters) or whose renewals are not
/// known.
async fn lease_runs_out(signals: &Signals, lease: Duration) {
    loop {
        let Some(renewed) = signals.renewed_at() else {
            return std::future::pending().await;
        };
        let end = renewed + lease;
        if tokio::time::Instant::now() >= end && !signals.completed_in_tx() {
            return;
        }
        tokio::time::sleep_until(end.max(tokio::time::Instant::now() + RETRY_BEAT.min(lease)))
            .await;
    }
}

/// What the claim loop and the heartbeat loop share with one attempt's
/// supervisor.
type Control = Arc<Signals>;

/// Runs one attempt in this task: the handler's future is polled here (a
/// panic is a failed attempt, never a dead worker) and dropped when the
/// timeout, the deadline, cancellation, a lost lease or the end of the
/// shutdown grace period comes first.
async fn supervise(
    queue: Queue,
    pending: &Pending,
    queued: Queued<Control>,
    lease: Duration,
    cancel_grace: Duration,
) -> Ended {
    let Queued {
        job,
        handler,
        control: signals,
        claimed,
    } = queued;
    let job = Arc::new(job);
    let ctx = HandlerContext {
        job: job.clone(),
        queue: queue.clone(),
        signals: signals.clone(),
    };
    // A lease lost while the job waited for its slot: it is not ours to
    // run. A heartbeat may have found its attempt ended by the store (its
    // deadline, or its timeout, passed on the store's clock while it
    // waited): that attempt failed, as a running one would have; the store
    // says which.
    match signals.stopped() {
        Stop::Running => {}
        Stop::LeaseLost => return ended_by_store(&queue, &ctx).await,
        // The grace period ended before the attempt started: it never ran,
        // so its job goes back at once (a release does not count it).
        Stop::Shutdown => return give_back(&queue, &ctx, lease).await,
    }
    // The timeout counts from the claim, as the store counts it (a job may
    // have waited for its slot).
    let timeout = claimed + Duration::from_millis(u64::try_from(job.timeout_ms).unwrap_or(0));
    // The deadline is the store's to enforce, on its clock of record: this
    // worker's timer only says when to ask the store (docs/worker.md). The
    // claim happened at lease_expires_at - lease on that clock.
    let mut deadline = job
        .deadline
        .and_then(|d| on_this_clock(claimed, job.lease_expires_at - store_lease(lease), d));
    // Past its deadline while it waited for its slot: the store ends the
    // attempt (`dead`, `deadline`) and the handler never runs, unless the
    // store's clock is not there yet.
    if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
        let give_up = tokio::time::Instant::now() + lease;
        match ask_deadline(&queue, &job, &signals, lease, Some(give_up)).await {
            Asked::Ended => return ended_by_store(&queue, &ctx).await,
            Asked::NotYet(next) => deadline = next,
            // Unanswered for as long as the lease lasts: the lease runs
            // out, and the store records the expiry when it is back.
            Asked::Unanswered => return Ended::Lost,
        }
    }
    // Cancelled or timed out while it waited for its slot: the attempt ends
    // so, and the handler never runs.
    let now = tokio::time::Instant::now();
    let unrun = if signals.is_cancelled() {
        Some(JobError::retryable("cancelled"))
    } else if now >= timeout {
        Some(JobError::retryable(format!(
            "timed out after {} ms",
            job.timeout_ms
        )))
    } else {
        None
    };
    if let Some(e) = unrun {
        return record_failure(&queue, &ctx, &job, e, lease).await;
    }
    // The handler runs in this task (one task per attempt), its future
    // dropped when another branch ends the attempt first.
    let outcome: std::result::Result<Value, JobError> = tokio::select! {
        ran = Contained(Some(handler(ctx.clone()))) => ran,
        () = tokio::time::sleep_until(timeout) => {
            Err(JobError::retryable(format!("timed out after {} ms", job.timeout_ms)))
        }
        // The store ended the attempt at its deadline: nothing to record.
        () = deadline_passes(&queue, &job, &signals, lease, deadline) => {
            return ended_by_store(&queue, &ctx).await;
        }
        // A cancel seen: the handler runs on for the cancel grace, so it
        // can clean up (`ctx.cancelled()` has resolved); if it returns
        // within it, what it returns ends the attempt (`Ok` completes: the
        // effect happened). Else it is dropped and the attempt fails, and
        // the job turns cancelled.
        () = async {
            ctx.cancelled().await;
            tokio::time::sleep(cancel_grace).await;
        } => {
            Err(JobError::retryable("cancelled"))
        }
        // No heartbeat renewed the lease for a whole lease: another
        // worker may run the job now, so this attempt stops, its result
        // dropped, and the store records the expiry when it is back.
        () = lease_runs_out(&signals, lease) => {
            tracing::warn!(
                job_id = %job.id,
                attempt = job.attempt,
                "no heartbeat renewed this job's lease for a whole lease; stopping its handler"
            );
            return Ended::Lost;
        }
        stop = signals.until(|s| Some(s.stopped()).filter(|&s| s != Stop::Running)) => {
            return match stop {
                Stop::Shutdown => give_back(&queue, &ctx, lease).await,
                // Any heartbeat of a job with a deadline may find the
                // attempt ended there by the store (its clock past the
                // deadline before this worker's reckoning is): it says which.
                Stop::LeaseLost if job.deadline.is_some() => ended_by_store(&queue, &ctx).await,
                _ => lost_or_completed_in_tx(&queue, &ctx).await,
            };
        }
    };
    // A success is recorded with the claim loop's next call, many to a
    // round trip; the slot is free at once.
    let e = match outcome {
        // The handler completed the job in its own transaction: record
        // nothing if that committed; if it rolled back, the effect did not
        // happen, so the attempt fails and the job runs again.
        Ok(_) if ctx.completed_in_tx() => match committed_in_tx(&queue, &ctx).await {
            Ok(true) => return Ended::CompletedInTx,
            _ => JobError::retryable(
                "the handler completed its job in a transaction that did not commit",
            ),
        },
        Ok(value) => {
            let result = (!value.is_null()).then_some(value);
            pending.push(&job.id, &job.lease_token, result, lease);
            return Ended::Handed;
        }
        Err(e) => e,
    };
    record_failure(&queue, &ctx, &job, e, lease).await
}

/// Releases the attempt at shutdown (its job ready again at once, the
/// attempt not counted); if the release fails, whatever the store holds.
async fn give_back(queue: &Queue, ctx: &HandlerContext, lease: Duration) -> Ended {
    match release(queue, &ctx.job.id, &ctx.job.lease_token, lease).await {
        Ok(_) => Ended::Released,
        Err(_) => lost_or_completed_in_tx(queue, ctx).await,
    }
}

/// The lease as the store counts it: the claim sent it in whole
/// milliseconds.
fn store_lease(lease: Duration) -> chrono::Duration {
    let ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
    chrono::Duration::try_milliseconds(ms).unwrap_or_default()
}

/// The instant on this worker's monotonic clock at which the store's clock
/// should read `at`, given that it read `store_now` at `local_now`; `None`
/// beyond what the monotonic clock can name.
fn on_this_clock(
    local_now: tokio::time::Instant,
    store_now: DateTime<Utc>,
    at: DateTime<Utc>,
) -> Option<tokio::time::Instant> {
    local_now.checked_add((at - store_now).to_std().unwrap_or(Duration::ZERO))
}

/// The shortest wait before the store is asked about a deadline again, when
/// it said "not yet" but its clock should be there already.
const DEADLINE_RECHECK: Duration = Duration::from_millis(10);

/// What the store answers when this worker's clock says a job's deadline
/// has come.
enum Asked {
    /// The attempt is no longer this worker's: the store ended it (at its
    /// deadline, its timeout) or it was lost before.
    Ended,
    /// The store's clock has not reached the deadline: when it should, on
    /// this worker's clock (`None`: never, as far as this clock can tell).
    NotYet(Option<tokio::time::Instant>),
    /// The store did not answer before `give_up`.
    Unanswered,
}

/// Asks the store whether the attempt's deadline has passed, on its clock
/// of record, by the call that decides it for workers the server cannot
/// interrupt: a heartbeat. Past the deadline, the store ends the attempt
/// there and then (`dead`, reason `deadline`; the run `failed`, whatever the
/// retry policy and the budget) and answers `LeaseLost`; before it, it
/// renews the lease and its answer tells its clock (the renewed expiry less
/// the lease). While the backend is unavailable, asks again with backoff,
/// until `give_up` if given.
async fn ask_deadline(
    queue: &Queue,
    job: &ClaimedJob,
    signals: &Signals,
    lease: Duration,
    give_up: Option<tokio::time::Instant>,
) -> Asked {
    let mut backoff = Duration::from_millis(50);
    loop {
        match queue.heartbeat(&job.id, &job.lease_token).await {
            Err(Error::LeaseLost { .. }) => return Asked::Ended,
            Ok(hb) => {
                if hb.cancel_requested {
                    signals.cancel();
                }
                let Some(deadline) = job.deadline else {
                    return Asked::NotYet(None);
                };
                let now = tokio::time::Instant::now();
                let store_now = hb.lease_expires_at - store_lease(lease);
                let next = on_this_clock(now, store_now, deadline)
                    .map(|at| at.max(now + DEADLINE_RECHECK));
                return Asked::NotYet(next);
            }
            Err(e) => {
                if give_up.is_some_and(|g| tokio::time::Instant::now() + backoff >= g) {
                    return Asked::Unanswered;
                }
                tracing::debug!(job_id = %job.id, error = %e, "the deadline check failed; asking again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Resolves once the store has ended the attempt at its deadline: asks it
/// when this worker's clock says the deadline has come, and again when the
/// store's answer says it will have, for as long as the store's clock is
/// not there. A handler that completed its job in its own transaction is
/// left to finish (the completion counts even past the deadline; on
/// PostgreSQL its transaction holds the row the store would wait for).
async fn deadline_passes(
    queue: &Queue,
    job: &ClaimedJob,
    signals: &Signals,
    lease: Duration,
    mut at: Option<tokio::time::Instant>,
) {
    while let Some(d) = at {
        tokio::time::sleep_until(d).await;
        if signals.completed_in_tx() {
            break;
        }
        match ask_deadline(queue, job, signals, lease, None).await {
            Asked::Ended => return,
            Asked::NotYet(next) => at = next,
            // Not without a `give_up`: asked until the store answers.
            Asked::Unanswered => {}
        }
    }
    std::future::pending().await
}

/// An attempt the store ended when asked at its deadline (its lease is
/// gone): completed when the handler's own transaction completed it, failed
/// when the store recorded this attempt's end (at the deadline, or at its
/// timeout, as a heartbeat then records it), lost otherwise.
async fn ended_by_store(queue: &Queue, ctx: &HandlerContext) -> Ended {
    if ctx.completed_in_tx() {
        return lost_or_completed_in_tx(queue, ctx).await;
    }
    match queue.get(&ctx.job.id).await {
        Ok(Some(j))
            if j.attempt == ctx.job.attempt
                && !matches!(j.state, JobState::Active | JobState::Completed) =>
        {
            Ended::Failed
        }
        _ => Ended::Lost,
    }
}

/// A handler's future, run in its supervisor's task as it would run in a
/// task of its own: a panic while it is polled is a failed attempt, and a
/// panic while it is dropped (an interrupted attempt) goes no further.
struct Contained(Option<BoxFuture>);

impl Future for Contained {
    type Output = std::result::Result<Value, JobError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let Some(fut) = self.0.as_mut() else {
            return std::task::Poll::Pending;
        };
        let ended = match std::panic::catch_unwind(AssertUnwindSafe(|| fut.as_mut().poll(cx))) {
            Ok(std::task::Poll::Pending) => return std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(ended)) => ended,
            Err(panic) => {
                let text = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-string panic".into());
                Err(JobError::retryable(format!("handler panicked: {text}")))
            }
        };
        self.release();
        std::task::Poll::Ready(ended)
    }
}

impl Contained {
    /// Drops the handler's future; a panic of its destructors is dropped
    /// with it.
    fn release(&mut self) {
        if let Some(fut) = self.0.take() {
            let _ = std::panic::catch_unwind(AssertUnwindSafe(move || drop(fut)));
        }
    }
}

impl Drop for Contained {
    fn drop(&mut self) {
        self.release();
    }
}

/// Releases a lease at shutdown. While the backend is unavailable, keeps
/// trying for as long as the lease could still be ours, as a failure is
/// recorded: a job left to its lease's expiry would wait out the lease and
/// lose the attempt.
async fn release(
    queue: &Queue,
    job_id: &str,
    token: &crate::LeaseToken,
    lease: Duration,
) -> Result<JobState> {
    let give_up = tokio::time::Instant::now() + lease;
    let mut backoff = Duration::from_millis(50);
    loop {
        match queue.release(job_id, token).await {
            Err(e) if e.is_retryable() && tokio::time::Instant::now() + backoff < give_up => {
                tracing::debug!(%job_id, error = %e, "a release failed; trying again");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            done => return done,
        }
    }
}

/// Records an attempt's failure. While the backend is unavailable, keeps
/// trying for as long as the lease could still be ours: an attempt's end is
/// not dropped because the database restarted.
async fn record_failure(
    queue: &Queue,
    ctx: &HandlerContext,
    job: &ClaimedJob,
    e: JobError,
    lease: Duration,
) -> Ended {
    let give_up = tokio::time::Instant::now() + lease;
    let mut backoff = Duration::from_millis(50);
    // A delay past the store's bound (100 years; `Duration::MAX`, say) is
    // that bound: the store would refuse it, and the attempt, left to its
    // lease, would then count even for a snooze.
    let most = Duration::from_millis(crate::request::bounds::MAX_DURATION_MS.unsigned_abs());
    loop {
        let error = e.message.clone();
        let options = match e.kind {
            ErrorKind::Retryable { retry_after } => FailOptions {
                error,
                permanent: false,
                retry_after: retry_after.map(|d| d.min(most)),
                snooze: None,
            },
            ErrorKind::Permanent => FailOptions {
                error,
                permanent: true,
                ..FailOptions::default()
            },
            ErrorKind::Snooze(d) => FailOptions {
                error,
                snooze: Some(d.min(most)),
                ..FailOptions::default()
            },
        };
        let recorded = queue
            .fail(&job.id, &job.lease_token, options)
            .await
            .map(|_| Ended::Failed);
        match recorded {
            Ok(ended) => return ended,
            Err(err) if err.is_retryable() && tokio::time::Instant::now() + backoff < give_up => {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
            Err(_) => return lost_or_completed_in_tx(queue, ctx).await,
        }
    }
}

/// Whether this attempt's job is completed: by the handler's own
/// transaction, the only way a completion of this attempt is recorded
/// before the runtime records one.
async fn committed_in_tx(queue: &Queue, ctx: &HandlerContext) -> Result<bool> {
    let job = queue.get(&ctx.job.id).await?;
    let done = job.is_some_and(|j| j.state == JobState::Completed && j.attempt == ctx.job.attempt);
    if done {
        queue.count_completions(1);
    }
    Ok(done)
}

/// An attempt whose end could not be recorded (its lease is gone): counted
/// as completed when the handler's own transaction committed its
/// completion (a heartbeat or a failure record then finds the lease gone),
/// as lost otherwise.
async fn lost_or_completed_in_tx(queue: &Queue, ctx: &HandlerContext) -> Ended {
    if ctx.completed_in_tx() && matches!(committed_in_tx(queue, ctx).await, Ok(true)) {
        Ended::CompletedInTx
    } else {
        Ended::Lost
    }
}
