//! Conformance cases: deduplication, the rate policy (docs/dedupe.md).
//!
//! The first block pins every cell of the decision table of docs/dedupe.md, one case per
//! cell, named `<mode>_vs_<keyed job>_<outcome>`. The rest pins the notes
//! around the table: re-arming, `max_wait`, modes meeting each other, release
//! by cancel and purge, the generation rule, `cancel_by_key`, what jobs,
//! lookups and explain show, concurrency and the deadline rule.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemq::store::ExplainDedupe;
use idemq::{
    BatchOptions, ClaimOptions, ClaimedJob, DedupeMode, DedupeOptions, EnqueueRequest,
    EnqueueResult, Error, FailOptions, Job, JobDedupe, JobState, NonReplaceableReason, Outcome,
    RetryPolicy,
};
use idemq_testkit::Harness;
use serde_json::json;

idemq_testkit::instantiate!(
    // The decision table: waiting, not due.
    pending_vs_waiting_not_due_coalesces,
    throttle_vs_waiting_not_due_coalesces,
    debounce_vs_waiting_not_due_coalesces_and_rearms,
    replace_vs_waiting_not_due_is_replaced,
    replace_ttl_vs_waiting_not_due_is_replaced_and_rearms,
    // Waiting, due.
    pending_vs_waiting_due_coalesces,
    throttle_vs_waiting_due_coalesces,
    debounce_vs_waiting_due_coalesces_and_rearms,
    replace_vs_waiting_due_is_window_elapsed,
    replace_ttl_vs_waiting_due_is_window_elapsed,
    // Active.
    pending_vs_active_coalesces,
    throttle_vs_active_coalesces,
    debounce_vs_active_coalesces_and_rearms,
    replace_vs_active_is_not_pending,
    replace_ttl_vs_active_is_not_pending,
    // Scheduled for a retry.
    pending_vs_retry_scheduled_coalesces,
    throttle_vs_retry_scheduled_coalesces,
    debounce_vs_retry_scheduled_coalesces_and_rearms,
    replace_vs_retry_scheduled_is_not_pending,
    replace_ttl_vs_retry_scheduled_is_not_pending,
    // Completed / dead.
    pending_vs_completed_is_accepted,
    throttle_vs_completed_coalesces,
    debounce_vs_completed_coalesces_and_rearms,
    replace_vs_completed_is_accepted,
    replace_ttl_vs_completed_is_not_pending,
    // Cancelled / purged.
    pending_vs_cancelled_is_accepted,
    throttle_vs_cancelled_is_accepted,
    debounce_vs_cancelled_is_accepted,
    replace_vs_cancelled_is_accepted,
    replace_ttl_vs_cancelled_is_accepted,
    // Window ended / max_wait passed.
    throttle_vs_window_ended_is_accepted,
    debounce_vs_window_ended_is_accepted,
    replace_ttl_vs_window_ended_is_accepted,
    // Debounce re-arm and max_wait.
    debounce_every_coalesced_request_pushes_the_window,
    debounce_key_frees_ttl_after_the_burst_ends,
    debounce_max_wait_frees_the_key_under_continuous_input,
    // Replace: max_wait, window, fields.
    replace_max_wait_caps_run_at_on_the_first_enqueue,
    replace_max_wait_caps_run_at_on_every_landed_replace,
    replace_binding_keeps_its_own_max_wait,
    replace_window_is_never_before_run_at,
    replace_overwrites_every_field_and_resets_omitted_ones,
    replace_keeps_the_original_idempotency_binding,
    // Modes meeting each other.
    replace_vs_live_pending_binding_is_incompatible_mode,
    replace_vs_live_throttle_binding_is_incompatible_mode,
    replace_vs_live_debounce_binding_is_incompatible_mode,
    other_modes_vs_live_replace_binding_coalesce,
    other_modes_rearm_a_debounce_binding_by_its_own_ttl,
    binding_keeps_the_ttl_it_was_created_with,
    binding_no_longer_live_is_taken_in_the_requests_mode,
    // Scope.
    dedupe_keys_are_scoped_per_job_type,
    coalesced_request_never_changes_the_job_id,
    // Release.
    cancel_of_an_active_job_releases_when_it_turns_cancelled,
    cancel_requested_then_completed_keeps_a_ttl_binding,
    completion_and_death_keep_a_ttl_binding,
    // The generation rule.
    generation_finished_job_never_frees_a_newer_binding,
    generation_cancelled_job_never_frees_a_newer_binding,
    // cancel_by_key.
    cancel_by_key_cancels_and_releases_then_is_false,
    cancel_by_key_is_scoped_by_type,
    cancel_by_key_requests_cancel_of_an_active_job,
    cancel_by_key_cancels_jobs_that_no_longer_hold_the_binding,
    // What jobs, lookups and explain show.
    job_shows_its_dedupe_binding,
    job_dedupe_after_release_and_handover,
    dedupe_lookup_reports_only_a_live_binding,
    explain_reports_the_holder_and_outcome_and_writes_nothing,
    explain_of_a_replace_changes_nothing,
    // Concurrency and batches.
    concurrent_debounce_enqueues_make_one_job,
    batch_items_see_the_bindings_of_earlier_items,
    // The deadline rule.
    coalesced_request_with_a_past_deadline_is_coalesced,
    non_replaceable_request_with_a_past_deadline_is_non_replaceable,
    replace_landing_with_a_past_deadline_is_refused,
    // Validation and maintenance.
    dedupe_options_are_validated,
    sweep_bindings_removes_only_bindings_that_are_not_live,
    finished_job_is_kept_while_its_window_holds_the_key,
);

/// The job type of every case unless it says otherwise.
const TYPE: &str = "sync.payments";
/// The dedupe key of every case unless it says otherwise.
const KEY: &str = "acct-1";
/// The ttl of the window modes.
const WINDOW: Duration = Duration::from_secs(600);
/// The delay of a job that waits and is not due.
const LATER: Duration = Duration::from_secs(60);
/// Every job here waits an hour for the retry after a failed attempt.
const RETRY_MS: i64 = 3_600_000;

fn pending() -> DedupeOptions {
    DedupeOptions::key(KEY)
}

fn throttle() -> DedupeOptions {
    DedupeOptions::key(KEY).ttl(WINDOW)
}

fn debounce() -> DedupeOptions {
    DedupeOptions::key(KEY).ttl(WINDOW).extend()
}

fn replace() -> DedupeOptions {
    DedupeOptions::key(KEY).replace()
}

fn replace_ttl() -> DedupeOptions {
    DedupeOptions::key(KEY).replace().ttl(WINDOW)
}

/// A request of `TYPE` with payload `{"n": n}` and the dedupe options `d`.
fn req(d: DedupeOptions, n: i64) -> EnqueueRequest {
    EnqueueRequest::new(TYPE)
        .payload(json!({ "n": n }))
        .retry(RetryPolicy::Fixed { delay_ms: RETRY_MS })
        .dedupe(d)
}

fn td(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).expect("duration in range")
}

fn secs(n: i64) -> chrono::Duration {
    chrono::Duration::seconds(n)
}

async fn send(h: &Harness, r: EnqueueRequest) -> EnqueueResult {
    h.queue.enqueue_with_result(r).await.expect("enqueue")
}

/// Enqueues a request that must create a job; returns its id.
async fn accept(h: &Harness, r: EnqueueRequest) -> String {
    let (jobs, _) = h.totals().await;
    let res = send(h, r).await;
    assert_eq!(res.outcome, Outcome::Accepted, "a new job");
    assert_eq!(h.totals().await.0, jobs + 1);
    res.job_id
}

/// Enqueues a request that must create a job other than `old`, which then
/// holds the request's key.
async fn accept_new(h: &Harness, r: EnqueueRequest, old: &str) -> String {
    let job_type = r.job_type.clone();
    let key = r.dedupe.as_ref().expect("a dedupe request").key.clone();
    let id = accept(h, r).await;
    assert_ne!(id, old);
    let b = h.queue.dedupe_lookup(&job_type, &key).await.unwrap();
    assert_eq!(
        b.map(|b| b.job_id),
        Some(id.clone()),
        "the new job holds the key"
    );
    id
}

/// What a dropped request must leave as it was.
fn snapshot(j: &Job) -> (serde_json::Value, DateTime<Utc>, DateTime<Utc>, JobState) {
    (j.payload.clone(), j.run_at, j.updated_at, j.state)
}

/// Enqueues a request a live binding must drop with `outcome`, naming the
/// keyed job: no job, no event, the keyed job unchanged.
async fn dropped(h: &Harness, r: EnqueueRequest, keyed: &str, outcome: Outcome) {
    let before = h.totals().await;
    let job = h.queue.get(keyed).await.unwrap().map(|j| snapshot(&j));
    let res = send(h, r).await;
    assert_eq!((res.job_id.as_str(), res.outcome), (keyed, outcome));
    assert_eq!(
        h.totals().await,
        before,
        "a dropped enqueue writes no job and no event"
    );
    let after = h.queue.get(keyed).await.unwrap().map(|j| snapshot(&j));
    assert_eq!(after, job, "the keyed job is unchanged");
}

async fn coalesced(h: &Harness, r: EnqueueRequest, keyed: &str) {
    dropped(h, r, keyed, Outcome::Coalesced).await;
}

async fn non_replaceable(
    h: &Harness,
    r: EnqueueRequest,
    keyed: &str,
    reason: NonReplaceableReason,
) {
    dropped(h, r, keyed, Outcome::NonReplaceable { reason }).await;
}

/// Enqueues a replace that must land on `keyed`: same id, the new payload,
/// no new job and one `replaced` event.
async fn replaced(h: &Harness, r: EnqueueRequest, keyed: &str) -> Job {
    let (jobs, events) = h.totals().await;
    let payload = r.payload.clone();
    let res = send(h, r).await;
    assert_eq!(
        (res.job_id.as_str(), res.outcome),
        (keyed, Outcome::Replaced)
    );
    assert_eq!(
        h.totals().await,
        (jobs, events + 1),
        "no new job, one `replaced` event"
    );
    assert_eq!(
        h.event_kinds(keyed).await.last().map(String::as_str),
        Some("replaced")
    );
    let job = h.job(keyed).await;
    assert_eq!(job.payload, payload, "the new fields");
    assert_eq!(job.updated_at, h.now().await);
    job
}

/// The live binding of `KEY` on `TYPE`.
async fn holder(h: &Harness) -> Option<ExplainDedupe> {
    h.queue.dedupe_lookup(TYPE, KEY).await.expect("lookup")
}

/// The job holding `KEY` on `TYPE`.
async fn holder_id(h: &Harness) -> Option<String> {
    holder(h).await.map(|b| b.job_id)
}

/// The end of the live window of `KEY` on `TYPE`.
async fn window_until(h: &Harness) -> DateTime<Utc> {
    holder(h)
        .await
        .expect("a live binding")
        .window_until
        .expect("a window")
}

/// Claims the one due job, which must be `id`, under a one-hour lease.
async fn claim(h: &Harness, id: &str) -> ClaimedJob {
    let mut jobs = h
        .claim_with(ClaimOptions {
            limit: 1,
            worker: "w-1".into(),
            lease: Duration::from_secs(3600),
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(jobs.len(), 1, "expected one claimable job");
    let c = jobs.remove(0);
    assert_eq!(c.id, id);
    assert_eq!(h.job(id).await.state, JobState::Active);
    c
}

fn failure() -> FailOptions {
    FailOptions {
        error: "x".into(),
        ..FailOptions::default()
    }
}

/// Claims `id` and fails the attempt: the job waits an hour for its retry.
async fn to_retry(h: &Harness, id: &str) {
    let c = claim(h, id).await;
    let out = h
        .queue
        .fail(&c.id, &c.lease_token, failure())
        .await
        .unwrap();
    assert_eq!(out.state, JobState::Scheduled);
    let next = h.now().await + chrono::Duration::milliseconds(RETRY_MS);
    assert_eq!(out.next_run_at, Some(next));
    let job = h.job(id).await;
    assert_eq!((job.state, job.attempt), (JobState::Scheduled, 1));
}

#[derive(Clone, Copy, Debug)]
enum End {
    Completed,
    Dead,
}

/// Claims `id` and ends it `end`.
async fn finish(h: &Harness, id: &str, end: End) {
    let c = claim(h, id).await;
    let state = match end {
        End::Completed => {
            h.queue.complete(id, &c.lease_token, None).await.unwrap();
            JobState::Completed
        }
        End::Dead => {
            let fail = FailOptions {
                permanent: true,
                ..failure()
            };
            let out = h.queue.fail(id, &c.lease_token, fail).await.unwrap();
            assert_eq!(out.state, JobState::Dead);
            JobState::Dead
        }
    };
    assert_eq!(h.job(id).await.state, state);
}

/// Asserts the debounce window of `KEY` was re-armed just now.
async fn assert_rearmed(h: &Harness) {
    assert_eq!(
        window_until(h).await,
        h.now().await + td(WINDOW),
        "re-armed: ttl after the last request"
    );
}

// ---------------------------------------------------------------------------
// The decision table, row "waiting, not due".

async fn pending_vs_waiting_not_due_coalesces(h: Harness) {
    let a = accept(&h, req(pending(), 1).delay(LATER)).await;
    assert_eq!(h.job(&a).await.state, JobState::Scheduled);
    coalesced(&h, req(pending(), 2).delay(LATER), &a).await;
    coalesced(&h, req(pending(), 3), &a).await;
    assert_eq!(holder_id(&h).await, Some(a));
}

async fn throttle_vs_waiting_not_due_coalesces(h: Harness) {
    let a = accept(&h, req(throttle(), 1).delay(LATER)).await;
    let until = window_until(&h).await;
    h.advance_ms(1_000);
    coalesced(&h, req(throttle(), 2).delay(LATER), &a).await;
    assert_eq!(window_until(&h).await, until, "throttle does not re-arm");
}

async fn debounce_vs_waiting_not_due_coalesces_and_rearms(h: Harness) {
    let a = accept(&h, req(debounce(), 1).delay(LATER)).await;
    assert_rearmed(&h).await;
    h.advance_ms(1_000);
    assert_eq!(h.job(&a).await.state, JobState::Scheduled);
    coalesced(&h, req(debounce(), 2).delay(LATER), &a).await;
    assert_rearmed(&h).await;
}

async fn replace_vs_waiting_not_due_is_replaced(h: Harness) {
    let a = accept(&h, req(replace(), 1).delay(LATER).priority(3)).await;
    h.advance_ms(1_000);
    let job = replaced(&h, req(replace(), 2).delay(Duration::from_secs(120)), &a).await;
    assert_eq!(job.run_at, h.now().await + secs(120));
    assert_eq!(job.state, JobState::Scheduled);
    assert_eq!(job.priority, 0, "an omitted field resets to its default");
    let b = holder(&h).await.expect("still held");
    assert_eq!(
        (b.job_id.as_str(), b.mode, b.window_until),
        (a.as_str(), DedupeMode::Replace, None)
    );
    // Latest wins, again and again.
    let job = replaced(&h, req(replace(), 3).delay(LATER), &a).await;
    assert_eq!(job.run_at, h.now().await + td(LATER));
    assert_eq!(
        h.event_kinds(&a).await,
        ["accepted", "replaced", "replaced"]
    );
}

async fn replace_ttl_vs_waiting_not_due_is_replaced_and_rearms(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1).delay(LATER)).await;
    let t0 = h.now().await;
    assert_eq!(window_until(&h).await, t0 + td(WINDOW));
    h.advance(Duration::from_secs(30));
    replaced(&h, req(replace_ttl(), 2).delay(LATER), &a).await;
    assert_eq!(
        window_until(&h).await,
        t0 + secs(30) + td(WINDOW),
        "a landed replace re-arms the window"
    );
    assert_eq!(h.job(&a).await.state, JobState::Scheduled);
}

// ---------------------------------------------------------------------------
// Row "waiting, due".

async fn pending_vs_waiting_due_coalesces(h: Harness) {
    let a = accept(&h, req(pending(), 1).delay(LATER)).await;
    h.advance(LATER);
    assert_eq!(h.job(&a).await.state, JobState::Ready);
    coalesced(&h, req(pending(), 2), &a).await;
}

async fn throttle_vs_waiting_due_coalesces(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    assert_eq!(h.job(&a).await.state, JobState::Ready);
    let until = window_until(&h).await;
    h.advance_ms(1_000);
    coalesced(&h, req(throttle(), 2), &a).await;
    assert_eq!(window_until(&h).await, until);
}

async fn debounce_vs_waiting_due_coalesces_and_rearms(h: Harness) {
    let a = accept(&h, req(debounce(), 1)).await;
    h.advance_ms(1_000);
    assert_eq!(h.job(&a).await.state, JobState::Ready);
    coalesced(&h, req(debounce(), 2), &a).await;
    assert_rearmed(&h).await;
}

async fn replace_vs_waiting_due_is_window_elapsed(h: Harness) {
    let a = accept(&h, req(replace(), 1).delay(LATER)).await;
    h.advance(LATER);
    assert_eq!(h.job(&a).await.state, JobState::Ready);
    non_replaceable(
        &h,
        req(replace(), 2).delay(LATER),
        &a,
        NonReplaceableReason::WindowElapsed,
    )
    .await;
    // A job due at once is due from its first instant.
    let b = accept(
        &h,
        EnqueueRequest::new(TYPE).dedupe(DedupeOptions::key("acct-2").replace()),
    )
    .await;
    let res = send(
        &h,
        EnqueueRequest::new(TYPE)
            .payload(json!(2))
            .dedupe(DedupeOptions::key("acct-2").replace()),
    )
    .await;
    assert_eq!(
        (res.job_id, res.outcome),
        (
            b,
            Outcome::NonReplaceable {
                reason: NonReplaceableReason::WindowElapsed
            }
        )
    );
}

async fn replace_ttl_vs_waiting_due_is_window_elapsed(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1).delay(LATER)).await;
    let until = window_until(&h).await;
    h.advance(LATER);
    assert_eq!(h.job(&a).await.state, JobState::Ready);
    non_replaceable(
        &h,
        req(replace_ttl(), 2).delay(LATER),
        &a,
        NonReplaceableReason::WindowElapsed,
    )
    .await;
    assert_eq!(
        window_until(&h).await,
        until,
        "a refused replace does not re-arm"
    );
}

// ---------------------------------------------------------------------------
// Row "active".

async fn pending_vs_active_coalesces(h: Harness) {
    let a = accept(&h, req(pending(), 1)).await;
    claim(&h, &a).await;
    coalesced(&h, req(pending(), 2), &a).await;
    coalesced(&h, req(pending(), 3).delay(LATER), &a).await;
}

async fn throttle_vs_active_coalesces(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    claim(&h, &a).await;
    coalesced(&h, req(throttle(), 2), &a).await;
}

async fn debounce_vs_active_coalesces_and_rearms(h: Harness) {
    let a = accept(&h, req(debounce(), 1)).await;
    claim(&h, &a).await;
    h.advance_ms(1_000);
    coalesced(&h, req(debounce(), 2), &a).await;
    assert_rearmed(&h).await;
}

async fn replace_vs_active_is_not_pending(h: Harness) {
    let a = accept(&h, req(replace(), 1)).await;
    claim(&h, &a).await;
    non_replaceable(
        &h,
        req(replace(), 2).delay(LATER),
        &a,
        NonReplaceableReason::NotPending,
    )
    .await;
}

async fn replace_ttl_vs_active_is_not_pending(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1)).await;
    claim(&h, &a).await;
    non_replaceable(
        &h,
        req(replace_ttl(), 2).delay(LATER),
        &a,
        NonReplaceableReason::NotPending,
    )
    .await;
}

// ---------------------------------------------------------------------------
// Row "scheduled for a retry".

async fn pending_vs_retry_scheduled_coalesces(h: Harness) {
    let a = accept(&h, req(pending(), 1)).await;
    to_retry(&h, &a).await;
    coalesced(&h, req(pending(), 2), &a).await;
}

async fn throttle_vs_retry_scheduled_coalesces(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    to_retry(&h, &a).await;
    coalesced(&h, req(throttle(), 2), &a).await;
}

async fn debounce_vs_retry_scheduled_coalesces_and_rearms(h: Harness) {
    let a = accept(&h, req(debounce(), 1)).await;
    to_retry(&h, &a).await;
    h.advance_ms(1_000);
    coalesced(&h, req(debounce(), 2), &a).await;
    assert_rearmed(&h).await;
}

async fn replace_vs_retry_scheduled_is_not_pending(h: Harness) {
    let a = accept(&h, req(replace(), 1)).await;
    to_retry(&h, &a).await;
    non_replaceable(
        &h,
        req(replace(), 2).delay(LATER),
        &a,
        NonReplaceableReason::NotPending,
    )
    .await;
}

async fn replace_ttl_vs_retry_scheduled_is_not_pending(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1)).await;
    to_retry(&h, &a).await;
    non_replaceable(
        &h,
        req(replace_ttl(), 2).delay(LATER),
        &a,
        NonReplaceableReason::NotPending,
    )
    .await;
}

// ---------------------------------------------------------------------------
// Row "completed / dead".

async fn pending_vs_completed_is_accepted(h: Harness) {
    let a = accept(&h, req(pending(), 1)).await;
    finish(&h, &a, End::Completed).await;
    assert_eq!(holder(&h).await, None, "completion frees a pending key");
    let b = accept_new(&h, req(pending(), 2), &a).await;
    finish(&h, &b, End::Dead).await;
    assert_eq!(holder(&h).await, None, "death frees a pending key");
    accept_new(&h, req(pending(), 3), &b).await;
}

async fn throttle_vs_completed_coalesces(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    finish(&h, &a, End::Completed).await;
    coalesced(&h, req(throttle(), 2), &a).await;
    h.advance(WINDOW);
    let b = accept_new(&h, req(throttle(), 3), &a).await;
    finish(&h, &b, End::Dead).await;
    coalesced(&h, req(throttle(), 4), &b).await;
}

async fn debounce_vs_completed_coalesces_and_rearms(h: Harness) {
    let a = accept(&h, req(debounce(), 1)).await;
    finish(&h, &a, End::Completed).await;
    h.advance_ms(1_000);
    coalesced(&h, req(debounce(), 2), &a).await;
    assert_rearmed(&h).await;
    h.advance(WINDOW);
    let b = accept_new(&h, req(debounce(), 3), &a).await;
    finish(&h, &b, End::Dead).await;
    h.advance_ms(1_000);
    coalesced(&h, req(debounce(), 4), &b).await;
    assert_rearmed(&h).await;
}

async fn replace_vs_completed_is_accepted(h: Harness) {
    let a = accept(&h, req(replace(), 1)).await;
    finish(&h, &a, End::Completed).await;
    let b = accept_new(&h, req(replace(), 2), &a).await;
    finish(&h, &b, End::Dead).await;
    let c = accept_new(&h, req(replace(), 3).delay(LATER), &b).await;
    replaced(&h, req(replace(), 4).delay(LATER), &c).await;
}

async fn replace_ttl_vs_completed_is_not_pending(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1)).await;
    finish(&h, &a, End::Completed).await;
    non_replaceable(
        &h,
        req(replace_ttl(), 2).delay(LATER),
        &a,
        NonReplaceableReason::NotPending,
    )
    .await;
    h.advance(WINDOW);
    let b = accept_new(&h, req(replace_ttl(), 3), &a).await;
    finish(&h, &b, End::Dead).await;
    non_replaceable(
        &h,
        req(replace_ttl(), 4).delay(LATER),
        &b,
        NonReplaceableReason::NotPending,
    )
    .await;
}

// ---------------------------------------------------------------------------
// Row "cancelled / purged": the binding is released at once, whatever the
// mode and window.

async fn cancel_and_purge_free_the_key(h: &Harness, d: fn() -> DedupeOptions) {
    // Cancelled while it waits.
    let a = accept(h, req(d(), 1).delay(LATER)).await;
    let out = h.queue.cancel(&a).await.unwrap();
    assert_eq!((out.cancelled, out.state), (true, JobState::Cancelled));
    assert_eq!(holder(h).await, None);
    let b = accept_new(h, req(d(), 2).delay(LATER), &a).await;
    // Purged while it waits.
    assert!(h.queue.purge(&b).await.unwrap());
    assert_eq!(holder(h).await, None);
    let c = accept_new(h, req(d(), 3), &b).await;
    // Purged after it ran (for the ttl modes, inside the window that holds the key).
    finish(h, &c, End::Completed).await;
    assert!(h.queue.purge(&c).await.unwrap());
    assert_eq!(holder(h).await, None);
    let d4 = accept_new(h, req(d(), 4), &c).await;
    // Cancelled after its attempt failed and it waits for a retry.
    to_retry(h, &d4).await;
    assert!(h.queue.cancel(&d4).await.unwrap().cancelled);
    accept_new(h, req(d(), 5), &d4).await;
}

async fn pending_vs_cancelled_is_accepted(h: Harness) {
    cancel_and_purge_free_the_key(&h, pending).await;
}

async fn throttle_vs_cancelled_is_accepted(h: Harness) {
    cancel_and_purge_free_the_key(&h, throttle).await;
}

async fn debounce_vs_cancelled_is_accepted(h: Harness) {
    cancel_and_purge_free_the_key(&h, debounce).await;
}

async fn replace_vs_cancelled_is_accepted(h: Harness) {
    cancel_and_purge_free_the_key(&h, replace).await;
}

async fn replace_ttl_vs_cancelled_is_accepted(h: Harness) {
    cancel_and_purge_free_the_key(&h, replace_ttl).await;
}

// ---------------------------------------------------------------------------
// Row "window ended / max_wait passed".

async fn throttle_vs_window_ended_is_accepted(h: Harness) {
    let a = accept(&h, req(throttle(), 1).delay(Duration::from_secs(3600))).await;
    h.advance(WINDOW - Duration::from_millis(1));
    coalesced(&h, req(throttle(), 2), &a).await;
    h.advance_ms(1);
    assert_eq!(holder(&h).await, None, "the window ended");
    // The old job still waits; the key is free all the same.
    let b = accept_new(&h, req(throttle(), 3), &a).await;
    assert_eq!(h.job(&a).await.state, JobState::Scheduled);
    assert_eq!(window_until(&h).await, h.now().await + td(WINDOW));
    coalesced(&h, req(throttle(), 4), &b).await;
}

async fn debounce_vs_window_ended_is_accepted(h: Harness) {
    // The window ends ttl after the last request.
    let a = accept(&h, req(debounce(), 1)).await;
    h.advance(WINDOW - Duration::from_millis(1));
    coalesced(&h, req(debounce(), 2), &a).await;
    h.advance(WINDOW);
    accept_new(&h, req(debounce(), 3), &a).await;
    // max_wait passed: the key frees at acceptance + max_wait even inside a window.
    let capped = || {
        DedupeOptions::key("acct-2")
            .ttl(Duration::from_secs(10))
            .extend()
            .max_wait(Duration::from_secs(15))
    };
    let c = accept(&h, EnqueueRequest::new(TYPE).dedupe(capped())).await;
    h.advance(Duration::from_secs(9));
    coalesced(&h, EnqueueRequest::new(TYPE).dedupe(capped()), &c).await;
    h.advance(Duration::from_secs(6));
    accept_new(&h, EnqueueRequest::new(TYPE).dedupe(capped()), &c).await;
}

async fn replace_ttl_vs_window_ended_is_accepted(h: Harness) {
    let r = |n| {
        req(
            DedupeOptions::key(KEY)
                .replace()
                .ttl(Duration::from_secs(60)),
            n,
        )
        .delay(Duration::from_secs(30))
    };
    let a = accept(&h, r(1)).await;
    let t0 = h.now().await;
    assert_eq!(window_until(&h).await, t0 + secs(60));
    h.advance(Duration::from_secs(59));
    non_replaceable(&h, r(2), &a, NonReplaceableReason::WindowElapsed).await;
    h.advance_ms(1_000);
    assert_eq!(holder(&h).await, None);
    let b = accept_new(&h, r(3), &a).await;
    assert_eq!(
        h.job(&a).await.state,
        JobState::Ready,
        "the old job still waits"
    );
    replaced(&h, r(4), &b).await;
}

// ---------------------------------------------------------------------------
// Debounce re-arm and max_wait.

async fn debounce_every_coalesced_request_pushes_the_window(h: Harness) {
    let d = || {
        DedupeOptions::key(KEY)
            .ttl(Duration::from_secs(60))
            .extend()
    };
    let a = accept(&h, req(d(), 1)).await;
    let t0 = h.now().await;
    assert_eq!(window_until(&h).await, t0 + secs(60));
    h.advance(Duration::from_secs(30));
    coalesced(&h, req(d(), 2), &a).await;
    assert_eq!(window_until(&h).await, t0 + secs(90));
    h.advance(Duration::from_secs(50));
    coalesced(&h, req(d(), 3), &a).await;
    assert_eq!(window_until(&h).await, t0 + secs(140));
    // 110 s after acceptance, past the first window: still held.
    h.advance(Duration::from_secs(59));
    coalesced(&h, req(d(), 4), &a).await;
    assert_eq!(window_until(&h).await, t0 + secs(199));
    h.advance(Duration::from_secs(60));
    accept_new(&h, req(d(), 5), &a).await;
}

async fn debounce_key_frees_ttl_after_the_burst_ends(h: Harness) {
    let d = || {
        DedupeOptions::key(KEY)
            .ttl(Duration::from_secs(60))
            .extend()
    };
    let a = accept(&h, req(d(), 0)).await;
    let t0 = h.now().await;
    for n in 1..10 {
        h.advance(Duration::from_secs(1));
        coalesced(&h, req(d(), n), &a).await;
    }
    let last = t0 + secs(9);
    assert_eq!(window_until(&h).await, last + secs(60));
    h.advance(Duration::from_millis(59_999));
    assert_eq!(holder_id(&h).await, Some(a.clone()));
    h.advance_ms(1);
    assert_eq!(holder(&h).await, None, "free ttl after the burst ended");
    assert_eq!(h.job(&a).await.payload, json!({ "n": 0 }), "leading edge");
    accept_new(&h, req(d(), 10), &a).await;
}

async fn debounce_max_wait_frees_the_key_under_continuous_input(h: Harness) {
    let d = || {
        DedupeOptions::key(KEY)
            .ttl(Duration::from_secs(10))
            .extend()
            .max_wait(Duration::from_secs(30))
    };
    let a = accept(&h, req(d(), 0)).await;
    let t0 = h.now().await;
    for n in 1..=5 {
        h.advance(Duration::from_secs(5));
        coalesced(&h, req(d(), n), &a).await;
    }
    // At t0 + 25 s the re-armed window is capped at t0 + 30 s.
    assert_eq!(window_until(&h).await, t0 + secs(30));
    h.advance(Duration::from_millis(4_999));
    coalesced(&h, req(d(), 6), &a).await;
    assert_eq!(window_until(&h).await, t0 + secs(30));
    h.advance_ms(1);
    let b = accept_new(&h, req(d(), 7), &a).await;
    // The new binding is a generation of its own: ttl and max_wait from its acceptance.
    assert_eq!(window_until(&h).await, t0 + secs(40));
    h.advance(Duration::from_secs(9));
    coalesced(&h, req(d(), 8), &b).await;
    assert_eq!(window_until(&h).await, t0 + secs(49));
}

// ---------------------------------------------------------------------------
// Replace: max_wait, window, fields.

async fn replace_max_wait_caps_run_at_on_the_first_enqueue(h: Harness) {
    let d = || {
        DedupeOptions::key(KEY)
            .replace()
            .max_wait(Duration::from_secs(60))
    };
    let t0 = h.now().await;
    let a = accept(&h, req(d(), 1).delay(Duration::from_secs(300))).await;
    assert_eq!(h.job(&a).await.run_at, t0 + secs(60));
    // An explicit run_at is capped the same way.
    let other = DedupeOptions::key("acct-2")
        .replace()
        .max_wait(Duration::from_secs(60));
    let b = accept(
        &h,
        EnqueueRequest::new(TYPE)
            .run_at(t0 + secs(3600))
            .dedupe(other),
    )
    .await;
    assert_eq!(h.job(&b).await.run_at, t0 + secs(60));
    // A run_at before the cap is kept.
    let c = accept(
        &h,
        EnqueueRequest::new(TYPE)
            .delay(Duration::from_secs(20))
            .dedupe(
                DedupeOptions::key("acct-3")
                    .replace()
                    .max_wait(Duration::from_secs(60)),
            ),
    )
    .await;
    assert_eq!(h.job(&c).await.run_at, t0 + secs(20));
}

async fn replace_max_wait_caps_run_at_on_every_landed_replace(h: Harness) {
    // Trailing-edge debounce: replace + delay (quiet period) + max_wait.
    let r = |n| {
        req(
            DedupeOptions::key(KEY)
                .replace()
                .max_wait(Duration::from_secs(60)),
            n,
        )
        .delay(Duration::from_secs(30))
    };
    let t0 = h.now().await;
    let a = accept(&h, r(1)).await;
    assert_eq!(h.job(&a).await.run_at, t0 + secs(30));
    h.advance(Duration::from_secs(20));
    assert_eq!(replaced(&h, r(2), &a).await.run_at, t0 + secs(50));
    h.advance(Duration::from_secs(20));
    assert_eq!(
        replaced(&h, r(3), &a).await.run_at,
        t0 + secs(60),
        "capped at first acceptance + max_wait"
    );
    h.advance(Duration::from_secs(19));
    assert_eq!(replaced(&h, r(4), &a).await.run_at, t0 + secs(60));
    h.advance(Duration::from_secs(1));
    assert_eq!(h.job(&a).await.state, JobState::Ready);
    non_replaceable(&h, r(5), &a, NonReplaceableReason::WindowElapsed).await;
    assert_eq!(
        h.job(&a).await.payload,
        json!({ "n": 4 }),
        "the latest payload runs"
    );
}

async fn replace_binding_keeps_its_own_max_wait(h: Harness) {
    let t0 = h.now().await;
    let capped = DedupeOptions::key(KEY)
        .replace()
        .max_wait(Duration::from_secs(60));
    let a = accept(&h, req(capped, 1).delay(Duration::from_secs(30))).await;
    h.advance(Duration::from_secs(10));
    // A replace without max_wait meets the binding as it is.
    let job = replaced(&h, req(replace(), 2).delay(Duration::from_secs(120)), &a).await;
    assert_eq!(
        job.run_at,
        t0 + secs(60),
        "the binding's max_wait caps every landed replace"
    );
}

async fn replace_window_is_never_before_run_at(h: Harness) {
    let r = |n, delay: u64| {
        req(
            DedupeOptions::key(KEY)
                .replace()
                .ttl(Duration::from_secs(10)),
            n,
        )
        .delay(Duration::from_secs(delay))
    };
    let t0 = h.now().await;
    let a = accept(&h, r(1, 60)).await;
    assert_eq!(
        window_until(&h).await,
        t0 + secs(60),
        "max(accepted + ttl, run_at)"
    );
    h.advance(Duration::from_secs(30));
    replaced(&h, r(2, 120), &a).await;
    assert_eq!(
        window_until(&h).await,
        t0 + secs(150),
        "a landed replace: max(replace + ttl, run_at) = run_at"
    );
    h.advance(Duration::from_secs(70));
    replaced(&h, r(3, 5), &a).await;
    assert_eq!(
        window_until(&h).await,
        t0 + secs(110),
        "a landed replace: max(replace + ttl, run_at) = replace + ttl"
    );
    h.advance(Duration::from_secs(6));
    non_replaceable(&h, r(4, 5), &a, NonReplaceableReason::WindowElapsed).await;
    h.advance(Duration::from_secs(4));
    accept_new(&h, r(5, 5), &a).await;
}

async fn replace_overwrites_every_field_and_resets_omitted_ones(h: Harness) {
    let t0 = h.now().await;
    let first = EnqueueRequest::new(TYPE)
        .queue("q1")
        .payload(json!({ "v": 1 }))
        .priority(5)
        .delay(LATER)
        .max_attempts(3)
        .retry(RetryPolicy::Fixed { delay_ms: 5_000 })
        .timeout(Duration::from_secs(10))
        .deadline(t0 + secs(3600))
        .concurrency_key("c-1")
        .tag("b")
        .tag("a")
        .keep(Duration::from_secs(7))
        .dedupe(replace());
    let a = accept(&h, first).await;
    h.advance_ms(1_000);
    let second = EnqueueRequest::new(TYPE)
        .queue("q2")
        .payload(json!({ "v": 2 }))
        .delay(Duration::from_secs(120))
        .dedupe(replace());
    let job = replaced(&h, second, &a).await;
    assert_eq!(job.id, a);
    assert_eq!(job.job_type, TYPE);
    assert_eq!(job.queue, "q1", "the queue is not replaced");
    assert_eq!(job.run_at, h.now().await + secs(120));
    assert_eq!(job.priority, 0);
    assert_eq!(job.max_attempts, 10);
    assert_eq!(job.retry, RetryPolicy::default());
    assert_eq!(job.timeout_ms, 30 * 60 * 1000);
    assert_eq!(job.deadline, None);
    assert_eq!(job.concurrency_key, None);
    assert!(job.tags.is_empty());
    assert_eq!(job.keep_ms, None);
    assert_eq!(job.created_at, t0, "acceptance time is kept");
    assert_eq!(job.attempt, 0);
    assert_eq!(
        job.dedupe,
        Some(JobDedupe {
            key: KEY.into(),
            mode: DedupeMode::Replace,
            window_until: None,
            holds_binding: true,
        })
    );
    // And every field back again.
    let third = EnqueueRequest::new(TYPE)
        .payload(json!({ "v": 3 }))
        .priority(-2)
        .delay(LATER)
        .max_attempts(4)
        .timeout(Duration::from_secs(20))
        .concurrency_key("c-2")
        .tag("z")
        .keep(Duration::from_secs(9))
        .dedupe(replace());
    let job = replaced(&h, third, &a).await;
    assert_eq!(
        (
            job.priority,
            job.max_attempts,
            job.timeout_ms,
            job.concurrency_key.as_deref(),
            job.tags.clone(),
            job.keep_ms
        ),
        (
            -2,
            4,
            20_000,
            Some("c-2"),
            vec!["z".to_string()],
            Some(9_000)
        )
    );
    assert!(h.queue.runs(&a).await.unwrap().is_empty());
}

async fn replace_keeps_the_original_idempotency_binding(h: Harness) {
    let keyed = |n, key: &str| req(replace(), n).delay(LATER).idempotency_key(key);
    let a = accept(&h, keyed(1, "i-1")).await;
    replaced(&h, req(replace(), 2).delay(LATER), &a).await;
    // The original request replays against its own stored fingerprint.
    let before = h.totals().await;
    let r = send(&h, keyed(1, "i-1")).await;
    assert_eq!(
        (r.job_id.as_str(), r.outcome),
        (a.as_str(), Outcome::Replayed)
    );
    assert_eq!(h.totals().await, before);
    assert_eq!(
        h.job(&a).await.payload,
        json!({ "n": 2 }),
        "a replay replaces nothing"
    );
    // A landed replace binds its own key to the keyed job.
    replaced(&h, keyed(3, "i-2"), &a).await;
    let r = send(&h, keyed(3, "i-2")).await;
    assert_eq!(
        (r.job_id.as_str(), r.outcome),
        (a.as_str(), Outcome::Replayed)
    );
    let err = h.queue.enqueue(keyed(4, "i-1")).await.unwrap_err();
    assert_eq!(err.conflict().expect("a conflict").fields, vec!["payload"]);
    assert_eq!(h.job(&a).await.payload, json!({ "n": 3 }));
}

// ---------------------------------------------------------------------------
// Modes meeting each other.

async fn replace_vs_live_pending_binding_is_incompatible_mode(h: Harness) {
    let a = accept(&h, req(pending(), 1).delay(LATER)).await;
    for d in [replace(), replace_ttl()] {
        non_replaceable(
            &h,
            req(d, 2).delay(LATER),
            &a,
            NonReplaceableReason::IncompatibleMode,
        )
        .await;
    }
    let b = holder(&h).await.unwrap();
    assert_eq!((b.job_id, b.mode), (a, DedupeMode::Pending));
}

async fn replace_vs_live_throttle_binding_is_incompatible_mode(h: Harness) {
    let a = accept(&h, req(throttle(), 1).delay(LATER)).await;
    non_replaceable(
        &h,
        req(replace(), 2).delay(LATER),
        &a,
        NonReplaceableReason::IncompatibleMode,
    )
    .await;
    // Also once the job finished, while the window holds the key.
    h.advance(LATER);
    finish(&h, &a, End::Completed).await;
    non_replaceable(
        &h,
        req(replace_ttl(), 3).delay(LATER),
        &a,
        NonReplaceableReason::IncompatibleMode,
    )
    .await;
}

async fn replace_vs_live_debounce_binding_is_incompatible_mode(h: Harness) {
    let a = accept(&h, req(debounce(), 1).delay(LATER)).await;
    let until = window_until(&h).await;
    h.advance_ms(1_000);
    non_replaceable(
        &h,
        req(replace(), 2).delay(LATER),
        &a,
        NonReplaceableReason::IncompatibleMode,
    )
    .await;
    assert_eq!(
        window_until(&h).await,
        until,
        "only a coalesced request re-arms a debounce window"
    );
}

async fn other_modes_vs_live_replace_binding_coalesce(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1).delay(LATER)).await;
    let before = holder(&h).await;
    h.advance_ms(1_000);
    for (n, d) in [pending(), throttle(), debounce()].into_iter().enumerate() {
        coalesced(&h, req(d, n as i64 + 2).delay(LATER), &a).await;
    }
    assert_eq!(holder(&h).await, before, "the replace binding is unchanged");
    // Also without a ttl, and while the keyed job is due.
    let other = || DedupeOptions::key("acct-2");
    let b = accept(&h, EnqueueRequest::new(TYPE).dedupe(other().replace())).await;
    coalesced(&h, EnqueueRequest::new(TYPE).dedupe(other()), &b).await;
    coalesced(
        &h,
        EnqueueRequest::new(TYPE).dedupe(other().ttl(WINDOW).extend()),
        &b,
    )
    .await;
}

async fn other_modes_rearm_a_debounce_binding_by_its_own_ttl(h: Harness) {
    let d = || {
        DedupeOptions::key(KEY)
            .ttl(Duration::from_secs(60))
            .extend()
    };
    let a = accept(&h, req(d(), 1)).await;
    h.advance(Duration::from_secs(30));
    coalesced(&h, req(pending(), 2), &a).await;
    assert_eq!(window_until(&h).await, h.now().await + secs(60));
    h.advance(Duration::from_secs(30));
    coalesced(&h, req(throttle(), 3), &a).await;
    assert_eq!(
        window_until(&h).await,
        h.now().await + secs(60),
        "the binding's own ttl, not the request's"
    );
    let b = holder(&h).await.unwrap();
    assert_eq!(
        (b.job_id.as_str(), b.mode),
        (a.as_str(), DedupeMode::Debounce)
    );
    h.advance(Duration::from_secs(60));
    accept_new(&h, req(throttle(), 4), &a).await;
    assert_eq!(holder(&h).await.unwrap().mode, DedupeMode::Throttle);
}

async fn binding_keeps_the_ttl_it_was_created_with(h: Harness) {
    let short = || DedupeOptions::key(KEY).ttl(Duration::from_secs(60));
    let a = accept(&h, req(short(), 1)).await;
    let until = window_until(&h).await;
    h.advance(Duration::from_secs(30));
    coalesced(
        &h,
        req(DedupeOptions::key(KEY).ttl(Duration::from_secs(3600)), 2),
        &a,
    )
    .await;
    coalesced(&h, req(pending(), 3), &a).await;
    assert_eq!(window_until(&h).await, until);
    h.advance(Duration::from_secs(30));
    accept_new(&h, req(short(), 4), &a).await;
}

async fn binding_no_longer_live_is_taken_in_the_requests_mode(h: Harness) {
    // A throttle window ends; a replace request takes the key.
    let a = accept(&h, req(throttle(), 1)).await;
    finish(&h, &a, End::Completed).await;
    h.advance(WINDOW);
    let b = accept_new(&h, req(replace(), 2).delay(LATER), &a).await;
    let bound = holder(&h).await.unwrap();
    assert_eq!(
        (bound.mode, bound.window_until),
        (DedupeMode::Replace, None)
    );
    replaced(&h, req(replace(), 3).delay(LATER), &b).await;
    // The replace job finishes; a debounce request takes the key.
    h.advance(LATER);
    finish(&h, &b, End::Completed).await;
    let c = accept_new(&h, req(debounce(), 4), &b).await;
    assert_eq!(holder(&h).await.unwrap().mode, DedupeMode::Debounce);
    non_replaceable(
        &h,
        req(replace(), 5),
        &c,
        NonReplaceableReason::IncompatibleMode,
    )
    .await;
    // The debounce window ends; a pending request takes the key.
    h.advance(WINDOW);
    let d = accept_new(&h, req(pending(), 6), &c).await;
    let bound = holder(&h).await.unwrap();
    assert_eq!(
        (bound.mode, bound.window_until),
        (DedupeMode::Pending, None)
    );
    assert_eq!(h.job(&d).await.dedupe.unwrap().mode, DedupeMode::Pending);
}

// ---------------------------------------------------------------------------
// Scope.

async fn dedupe_keys_are_scoped_per_job_type(h: Harness) {
    let on = |t: &str, d: DedupeOptions| EnqueueRequest::new(t).dedupe(d);
    let a = accept(&h, on("sync-payments", DedupeOptions::key("acct-1"))).await;
    let b = accept(&h, on("send-invite", DedupeOptions::key("acct-1"))).await;
    assert_ne!(a, b);
    coalesced(&h, on("sync-payments", DedupeOptions::key("acct-1")), &a).await;
    coalesced(&h, on("send-invite", DedupeOptions::key("acct-1")), &b).await;
    // Every mode, and replace landing on its own type only.
    let c = accept(&h, on("t1", throttle())).await;
    let d = accept(&h, on("t2", replace()).delay(LATER)).await;
    assert_ne!(c, d);
    let job = replaced(
        &h,
        on("t2", replace()).payload(json!("new")).delay(LATER),
        &d,
    )
    .await;
    assert_eq!(job.job_type, "t2");
    assert_eq!(h.job(&c).await.payload, serde_json::Value::Null);
    assert_eq!(h.totals().await.0, 4);
}

async fn coalesced_request_never_changes_the_job_id(h: Harness) {
    let a = accept(&h, req(pending(), 1).delay(LATER)).await;
    coalesced(&h, req(pending(), 2).job_id("explicit-1"), &a).await;
    assert!(h.queue.get("explicit-1").await.unwrap().is_none());
    let b = accept(
        &h,
        req(replace(), 1)
            .dedupe(DedupeOptions::key("acct-2").replace())
            .delay(LATER),
    )
    .await;
    let job = replaced(
        &h,
        req(replace(), 2)
            .dedupe(DedupeOptions::key("acct-2").replace())
            .delay(LATER)
            .job_id("explicit-2"),
        &b,
    )
    .await;
    assert_eq!(job.id, b, "a replace keeps the keyed job's id");
    assert!(h.queue.get("explicit-2").await.unwrap().is_none());
}

// ---------------------------------------------------------------------------
// Release.

async fn cancel_of_an_active_job_releases_when_it_turns_cancelled(h: Harness) {
    for (n, d) in [pending(), throttle(), debounce(), replace_ttl()]
        .into_iter()
        .enumerate()
    {
        let n = n as i64 * 10;
        let a = accept(&h, req(d.clone(), n)).await;
        let c = claim(&h, &a).await;
        let out = h.queue.cancel(&a).await.unwrap();
        assert_eq!((out.cancelled, out.state), (true, JobState::Active));
        assert_eq!(
            holder_id(&h).await,
            Some(a.clone()),
            "still active: still held"
        );
        if d.replace {
            non_replaceable(
                &h,
                req(d.clone(), n + 1),
                &a,
                NonReplaceableReason::NotPending,
            )
            .await;
        } else {
            coalesced(&h, req(d.clone(), n + 1), &a).await;
        }
        let out = h.queue.fail(&a, &c.lease_token, failure()).await.unwrap();
        assert_eq!(out.state, JobState::Cancelled);
        assert_eq!(holder(&h).await, None, "released when it turned cancelled");
        let b = accept_new(&h, req(d, n + 2).delay(LATER), &a).await;
        h.queue.cancel(&b).await.unwrap();
    }
    // A release of a cancel-requested attempt cancels it too.
    let a = accept(&h, req(throttle(), 100)).await;
    let c = claim(&h, &a).await;
    h.queue.cancel(&a).await.unwrap();
    h.queue.release(&a, &c.lease_token).await.unwrap();
    assert_eq!(h.job(&a).await.state, JobState::Cancelled);
    accept_new(&h, req(throttle(), 101), &a).await;
}

async fn cancel_requested_then_completed_keeps_a_ttl_binding(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    let c = claim(&h, &a).await;
    h.queue.cancel(&a).await.unwrap();
    h.queue.complete(&a, &c.lease_token, None).await.unwrap();
    assert_eq!(h.job(&a).await.state, JobState::Completed);
    coalesced(&h, req(throttle(), 2), &a).await;
}

async fn completion_and_death_keep_a_ttl_binding(h: Harness) {
    let types = ["t-throttle", "t-debounce", "t-replace"];
    let modes = [throttle(), debounce(), replace_ttl()];
    for end in [End::Completed, End::Dead] {
        for (t, d) in types.iter().zip(modes.clone()) {
            let a = accept(&h, EnqueueRequest::new(*t).dedupe(d.clone())).await;
            finish(&h, &a, end).await;
            let b = h.queue.dedupe_lookup(t, KEY).await.unwrap().expect("held");
            assert_eq!(b.job_id, a, "{t} {end:?}");
            assert!(h.job(&a).await.dedupe.unwrap().holds_binding);
            assert!(h.queue.purge(&a).await.unwrap(), "purge releases it");
            assert_eq!(h.queue.dedupe_lookup(t, KEY).await.unwrap(), None);
        }
    }
}

// ---------------------------------------------------------------------------
// The generation rule: a binding is released only by the job it belongs to.

async fn generation_finished_job_never_frees_a_newer_binding(h: Harness) {
    let a = accept(&h, req(pending(), 1)).await;
    finish(&h, &a, End::Completed).await;
    let b = accept_new(&h, req(pending(), 2).delay(LATER), &a).await;
    let out = h.queue.cancel(&a).await.unwrap();
    assert_eq!((out.cancelled, out.state), (false, JobState::Completed));
    coalesced(&h, req(pending(), 3), &b).await;
    assert!(h.queue.purge(&a).await.unwrap());
    coalesced(&h, req(pending(), 4), &b).await;
    assert_eq!(holder_id(&h).await, Some(b.clone()));
    // The same with a window mode: A died, its window ended, C holds the key.
    let t = || DedupeOptions::key("acct-2").ttl(WINDOW);
    let a2 = accept(&h, EnqueueRequest::new(TYPE).dedupe(t())).await;
    finish(&h, &a2, End::Dead).await;
    h.advance(WINDOW);
    let c = accept_new(&h, EnqueueRequest::new(TYPE).dedupe(t()).delay(LATER), &a2).await;
    assert!(h.queue.purge(&a2).await.unwrap());
    coalesced(&h, EnqueueRequest::new(TYPE).dedupe(t()), &c).await;
}

async fn generation_cancelled_job_never_frees_a_newer_binding(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    let c = claim(&h, &a).await;
    h.advance(WINDOW);
    let b = accept_new(&h, req(throttle(), 2).delay(LATER), &a).await;
    h.queue.cancel(&a).await.unwrap();
    let out = h.queue.fail(&a, &c.lease_token, failure()).await.unwrap();
    assert_eq!(out.state, JobState::Cancelled);
    coalesced(&h, req(throttle(), 3), &b).await;
    assert_eq!(holder_id(&h).await, Some(b.clone()));
    let shown = h.job(&a).await.dedupe.unwrap();
    assert_eq!((shown.holds_binding, shown.window_until), (false, None));
    assert!(h.queue.purge(&a).await.unwrap());
    coalesced(&h, req(throttle(), 4), &b).await;
}

// ---------------------------------------------------------------------------
// cancel_by_key.

async fn cancel_by_key_cancels_and_releases_then_is_false(h: Harness) {
    let a = accept(&h, req(throttle(), 1).delay(LATER)).await;
    assert!(h.queue.cancel_by_key(TYPE, KEY).await.unwrap());
    assert_eq!(h.job(&a).await.state, JobState::Cancelled);
    assert_eq!(
        holder(&h).await,
        None,
        "the binding is released inside its window"
    );
    assert!(
        !h.queue.cancel_by_key(TYPE, KEY).await.unwrap(),
        "idempotent"
    );
    let b = accept_new(&h, req(throttle(), 2), &a).await;
    // A finished job is not pending: nothing to cancel, its window stays.
    finish(&h, &b, End::Completed).await;
    assert!(!h.queue.cancel_by_key(TYPE, KEY).await.unwrap());
    assert_eq!(h.job(&b).await.state, JobState::Completed);
    coalesced(&h, req(throttle(), 3), &b).await;
    assert!(!h.queue.cancel_by_key(TYPE, "never-used").await.unwrap());
}

async fn cancel_by_key_is_scoped_by_type(h: Harness) {
    let a = accept(&h, EnqueueRequest::new("t1").dedupe(pending()).delay(LATER)).await;
    let b = accept(&h, EnqueueRequest::new("t2").dedupe(pending()).delay(LATER)).await;
    assert!(!h.queue.cancel_by_key("t3", KEY).await.unwrap());
    assert!(h.queue.cancel_by_key("t1", KEY).await.unwrap());
    assert_eq!(h.job(&a).await.state, JobState::Cancelled);
    assert_eq!(h.job(&b).await.state, JobState::Scheduled);
    assert_eq!(h.queue.dedupe_lookup("t1", KEY).await.unwrap(), None);
    assert_eq!(
        h.queue
            .dedupe_lookup("t2", KEY)
            .await
            .unwrap()
            .map(|x| x.job_id),
        Some(b)
    );
}

async fn cancel_by_key_requests_cancel_of_an_active_job(h: Harness) {
    let a = accept(&h, req(pending(), 1)).await;
    let c = claim(&h, &a).await;
    assert!(h.queue.cancel_by_key(TYPE, KEY).await.unwrap());
    let job = h.job(&a).await;
    assert_eq!((job.state, job.cancel_requested), (JobState::Active, true));
    let beat = h.queue.heartbeat(&a, &c.lease_token).await.unwrap();
    assert!(beat.cancel_requested);
    assert_eq!(holder(&h).await, None, "cancel_by_key releases the binding");
    let b = accept_new(&h, req(pending(), 2).delay(LATER), &a).await;
    // The old attempt ends cancelled; the newer binding stays.
    let out = h.queue.fail(&a, &c.lease_token, failure()).await.unwrap();
    assert_eq!(out.state, JobState::Cancelled);
    coalesced(&h, req(pending(), 3), &b).await;
}

async fn cancel_by_key_cancels_jobs_that_no_longer_hold_the_binding(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    claim(&h, &a).await;
    h.advance(WINDOW);
    let b = accept_new(&h, req(throttle(), 2).delay(LATER), &a).await;
    let other = accept(
        &h,
        EnqueueRequest::new(TYPE)
            .dedupe(DedupeOptions::key("acct-2"))
            .delay(LATER),
    )
    .await;
    assert!(h.queue.cancel_by_key(TYPE, KEY).await.unwrap());
    assert!(h.job(&a).await.cancel_requested, "A no longer held the key");
    assert_eq!(h.job(&b).await.state, JobState::Cancelled);
    assert_eq!(
        h.job(&other).await.state,
        JobState::Scheduled,
        "another key"
    );
    assert_eq!(holder(&h).await, None);
}

// ---------------------------------------------------------------------------
// What jobs, lookups and explain show.

async fn job_shows_its_dedupe_binding(h: Harness) {
    let t0 = h.now().await;
    let a = accept(&h, req(throttle(), 1).delay(LATER)).await;
    assert_eq!(
        h.job(&a).await.dedupe,
        Some(JobDedupe {
            key: KEY.into(),
            mode: DedupeMode::Throttle,
            window_until: Some(t0 + td(WINDOW)),
            holds_binding: true,
        })
    );
    let b = accept(&h, EnqueueRequest::new("t2").dedupe(pending())).await;
    assert_eq!(
        h.job(&b).await.dedupe,
        Some(JobDedupe {
            key: KEY.into(),
            mode: DedupeMode::Pending,
            window_until: None,
            holds_binding: true,
        })
    );
    let c = accept(&h, EnqueueRequest::new("t3").dedupe(debounce())).await;
    h.advance_ms(5_000);
    coalesced(&h, EnqueueRequest::new("t3").dedupe(debounce()), &c).await;
    assert_eq!(
        h.job(&c).await.dedupe.unwrap().window_until,
        Some(t0 + secs(5) + td(WINDOW)),
        "a re-armed window shows"
    );
    let d = accept(&h, EnqueueRequest::new("t4")).await;
    assert_eq!(h.job(&d).await.dedupe, None);
    // The list shows it too.
    let listed = h.jobs().await.into_iter().find(|j| j.id == a).unwrap();
    assert!(listed.dedupe.unwrap().holds_binding);
}

async fn job_dedupe_after_release_and_handover(h: Harness) {
    let released = |mode| {
        Some(JobDedupe {
            key: KEY.into(),
            mode,
            window_until: None,
            holds_binding: false,
        })
    };
    // Cancelled.
    let a = accept(&h, req(throttle(), 1).delay(LATER)).await;
    h.queue.cancel(&a).await.unwrap();
    assert_eq!(h.job(&a).await.dedupe, released(DedupeMode::Throttle));
    // Passed to a newer job when the window ended.
    let b = accept(&h, req(throttle(), 2).delay(Duration::from_secs(3600))).await;
    h.advance(WINDOW);
    assert_eq!(
        h.job(&b).await.dedupe,
        released(DedupeMode::Throttle),
        "ended"
    );
    let c = accept_new(&h, req(debounce(), 3).delay(LATER), &b).await;
    assert_eq!(h.job(&b).await.dedupe, released(DedupeMode::Throttle));
    assert!(h.job(&c).await.dedupe.unwrap().holds_binding);
    // A pending job that finished.
    let p = accept(&h, EnqueueRequest::new("t2").dedupe(pending())).await;
    h.queue.cancel(&c).await.unwrap();
    finish(&h, &p, End::Completed).await;
    let shown = h.job(&p).await.dedupe.unwrap();
    assert_eq!(
        (shown.mode, shown.holds_binding),
        (DedupeMode::Pending, false)
    );
}

async fn dedupe_lookup_reports_only_a_live_binding(h: Harness) {
    assert_eq!(holder(&h).await, None);
    let t0 = h.now().await;
    let a = accept(&h, req(throttle(), 1)).await;
    assert_eq!(
        holder(&h).await,
        Some(ExplainDedupe {
            job_id: a.clone(),
            mode: DedupeMode::Throttle,
            window_until: Some(t0 + td(WINDOW)),
        })
    );
    assert_eq!(
        h.queue.dedupe_lookup("other.type", KEY).await.unwrap(),
        None
    );
    assert_eq!(h.queue.dedupe_lookup(TYPE, "acct-2").await.unwrap(), None);
    finish(&h, &a, End::Completed).await;
    assert_eq!(holder_id(&h).await, Some(a));
    h.advance(WINDOW);
    assert_eq!(holder(&h).await, None, "ended, before any sweep");
    let p = accept(&h, req(pending(), 2)).await;
    assert_eq!(
        holder(&h).await,
        Some(ExplainDedupe {
            job_id: p.clone(),
            mode: DedupeMode::Pending,
            window_until: None,
        })
    );
    finish(&h, &p, End::Dead).await;
    assert_eq!(holder(&h).await, None);
}

async fn explain_reports_the_holder_and_outcome_and_writes_nothing(h: Harness) {
    let a = accept(&h, req(debounce(), 1).delay(LATER)).await;
    let until = window_until(&h).await;
    h.advance_ms(1_000);
    let before = h.totals().await;
    let e = h.queue.explain(req(debounce(), 2)).await.unwrap();
    assert_eq!(e.outcome, "coalesced");
    assert_eq!(e.reason, None);
    assert_eq!(e.job_id.as_deref(), Some(a.as_str()));
    let bound = Some(ExplainDedupe {
        job_id: a.clone(),
        mode: DedupeMode::Debounce,
        window_until: Some(until),
    });
    assert_eq!(e.dedupe, bound);
    assert_eq!(window_until(&h).await, until, "explain does not re-arm");
    let e = h.queue.explain(req(replace(), 3)).await.unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.reason.as_deref(), e.job_id.as_deref()),
        (
            "non_replaceable",
            Some("incompatible_mode"),
            Some(a.as_str())
        )
    );
    assert_eq!(e.dedupe, bound);
    // A free key: accepted, no holder, no id yet.
    let e = h
        .queue
        .explain(EnqueueRequest::new(TYPE).dedupe(DedupeOptions::key("acct-2")))
        .await
        .unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.job_id, e.dedupe),
        ("accepted", None, None)
    );
    assert_eq!(h.totals().await, before, "explain writes nothing");
    assert_eq!(h.queue.dedupe_lookup(TYPE, "acct-2").await.unwrap(), None);
    // Once the window ended: accepted, and no holder reported.
    h.advance(WINDOW);
    let e = h.queue.explain(req(debounce(), 4)).await.unwrap();
    assert_eq!((e.outcome.as_str(), e.dedupe), ("accepted", None));
}

async fn explain_of_a_replace_changes_nothing(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1).delay(LATER)).await;
    let until = window_until(&h).await;
    h.advance_ms(1_000);
    let before = (h.totals().await, snapshot(&h.job(&a).await));
    let e = h
        .queue
        .explain(req(replace_ttl(), 2).delay(LATER))
        .await
        .unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.reason, e.job_id.as_deref()),
        ("replaced", None, Some(a.as_str()))
    );
    assert_eq!(
        e.dedupe,
        Some(ExplainDedupe {
            job_id: a.clone(),
            mode: DedupeMode::Replace,
            window_until: Some(until),
        })
    );
    assert_eq!((h.totals().await, snapshot(&h.job(&a).await)), before);
    assert_eq!(window_until(&h).await, until);
    h.advance(LATER);
    let e = h.queue.explain(req(replace_ttl(), 3)).await.unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.reason.as_deref()),
        ("non_replaceable", Some("window_elapsed"))
    );
}

// ---------------------------------------------------------------------------
// Concurrency and batches.

async fn concurrent_debounce_enqueues_make_one_job(h: Harness) {
    let tasks: Vec<_> = (0..32)
        .map(|n| {
            let q = h.queue.clone();
            tokio::spawn(async move { q.enqueue_with_result(req(debounce(), n)).await })
        })
        .collect();
    let mut ids = HashSet::new();
    let (mut accepted, mut coalesced) = (0, 0);
    for t in tasks {
        let r = t.await.unwrap().expect("no caller sees an error");
        ids.insert(r.job_id);
        match r.outcome {
            Outcome::Accepted => accepted += 1,
            Outcome::Coalesced => coalesced += 1,
            other => panic!("unexpected outcome {other}"),
        }
    }
    assert_eq!((ids.len(), accepted, coalesced), (1, 1, 31));
    assert_eq!(h.totals().await, (1, 1));
    let id = ids.into_iter().next().unwrap();
    assert_eq!(holder_id(&h).await, Some(id));
}

async fn batch_items_see_the_bindings_of_earlier_items(h: Harness) {
    let other = || DedupeOptions::key("acct-2").replace();
    let results = h
        .queue
        .enqueue_many(
            vec![
                req(pending(), 1),
                req(pending(), 2),
                EnqueueRequest::new(TYPE)
                    .payload(json!(3))
                    .dedupe(other())
                    .delay(LATER),
                EnqueueRequest::new(TYPE)
                    .payload(json!(4))
                    .dedupe(other())
                    .delay(LATER),
                req(replace(), 5),
            ],
            BatchOptions::default(),
        )
        .await
        .unwrap();
    let results: Vec<EnqueueResult> = results.into_iter().map(Result::unwrap).collect();
    let outcomes: Vec<Outcome> = results.iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        vec![
            Outcome::Accepted,
            Outcome::Coalesced,
            Outcome::Accepted,
            Outcome::Replaced,
            Outcome::NonReplaceable {
                reason: NonReplaceableReason::IncompatibleMode
            },
        ]
    );
    assert_eq!(results[1].job_id, results[0].job_id);
    assert_eq!(results[3].job_id, results[2].job_id);
    assert_eq!(results[4].job_id, results[0].job_id);
    assert_eq!(h.totals().await.0, 2);
    assert_eq!(h.job(&results[2].job_id).await.payload, json!(4));
}

// ---------------------------------------------------------------------------
// The deadline rule: a dropped request is never refused for its deadline.

async fn coalesced_request_with_a_past_deadline_is_coalesced(h: Harness) {
    let a = accept(&h, req(debounce(), 1)).await;
    let past = h.now().await - secs(1);
    h.advance_ms(1_000);
    coalesced(&h, req(debounce(), 2).deadline(past), &a).await;
    assert_rearmed(&h).await;
    let b = accept(&h, EnqueueRequest::new("t2").dedupe(pending())).await;
    coalesced(
        &h,
        EnqueueRequest::new("t2").dedupe(pending()).deadline(past),
        &b,
    )
    .await;
}

async fn non_replaceable_request_with_a_past_deadline_is_non_replaceable(h: Harness) {
    let past = h.now().await - secs(1);
    let a = accept(&h, req(replace(), 1)).await;
    non_replaceable(
        &h,
        req(replace(), 2).deadline(past),
        &a,
        NonReplaceableReason::WindowElapsed,
    )
    .await;
    let b = accept(&h, EnqueueRequest::new("t2").dedupe(pending())).await;
    non_replaceable(
        &h,
        EnqueueRequest::new("t2").dedupe(replace()).deadline(past),
        &b,
        NonReplaceableReason::IncompatibleMode,
    )
    .await;
}

async fn replace_landing_with_a_past_deadline_is_refused(h: Harness) {
    let a = accept(&h, req(replace_ttl(), 1).delay(LATER)).await;
    let until = window_until(&h).await;
    h.advance_ms(1_000);
    let before = (h.totals().await, snapshot(&h.job(&a).await));
    let past = h.now().await - secs(1);
    let err = h
        .queue
        .enqueue(req(replace_ttl(), 2).delay(LATER).deadline(past))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "deadline"),
        "{err:?}"
    );
    // A deadline before the new run_at is refused the same way.
    let soon = h.now().await + secs(10);
    let err = h
        .queue
        .enqueue(req(replace_ttl(), 3).delay(LATER).deadline(soon))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Validation { ref field, .. } if field == "delay_ms"),
        "{err:?}"
    );
    assert_eq!(
        (h.totals().await, snapshot(&h.job(&a).await)),
        before,
        "nothing written"
    );
    assert_eq!(window_until(&h).await, until, "the window is not re-armed");
    // A valid deadline lands.
    let later = h.now().await + secs(3600);
    let job = replaced(&h, req(replace_ttl(), 4).delay(LATER).deadline(later), &a).await;
    assert_eq!(job.deadline, Some(later));
}

// ---------------------------------------------------------------------------
// Validation and maintenance.

async fn dedupe_options_are_validated(h: Harness) {
    let day = Duration::from_secs(86_400);
    let refused = [
        (DedupeOptions::key(""), "dedupe.key"),
        (DedupeOptions::key("k".repeat(256)), "dedupe.key"),
        (DedupeOptions::key(KEY).extend(), "dedupe.extend"),
        (
            DedupeOptions::key(KEY).ttl(WINDOW).extend().replace(),
            "dedupe.extend",
        ),
        (
            DedupeOptions::key(KEY).max_wait(WINDOW),
            "dedupe.max_wait_ms",
        ),
        (
            DedupeOptions::key(KEY).ttl(WINDOW).max_wait(WINDOW),
            "dedupe.max_wait_ms",
        ),
        (
            DedupeOptions::key(KEY).ttl(WINDOW).extend().max_wait(LATER),
            "dedupe.max_wait_ms",
        ),
        (
            DedupeOptions::key(KEY)
                .replace()
                .ttl(WINDOW)
                .max_wait(LATER),
            "dedupe.max_wait_ms",
        ),
        (DedupeOptions::key(KEY).ttl(Duration::ZERO), "dedupe.ttl_ms"),
        (DedupeOptions::key(KEY).ttl(day * 31), "dedupe.ttl_ms"),
        (
            DedupeOptions::key(KEY).replace().max_wait(day * 31),
            "dedupe.max_wait_ms",
        ),
    ];
    for (d, field) in refused {
        let err = h
            .queue
            .enqueue(EnqueueRequest::new(TYPE).dedupe(d.clone()))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::Validation { field: ref f, .. } if f == field),
            "{d:?}: {err:?}"
        );
    }
    assert_eq!(h.totals().await, (0, 0));
    let allowed = [
        DedupeOptions::key("k".repeat(255)),
        DedupeOptions::key("a").ttl(Duration::from_millis(1)),
        DedupeOptions::key("b")
            .ttl(day * 30)
            .extend()
            .max_wait(day * 30),
        DedupeOptions::key("c")
            .replace()
            .max_wait(Duration::from_millis(1)),
        DedupeOptions::key("d").replace().ttl(LATER).max_wait(LATER),
    ];
    for d in allowed {
        accept(&h, EnqueueRequest::new(TYPE).dedupe(d)).await;
    }
}

async fn sweep_bindings_removes_only_bindings_that_are_not_live(h: Harness) {
    let a = accept(&h, req(throttle(), 1)).await;
    finish(&h, &a, End::Completed).await;
    let p = accept(&h, EnqueueRequest::new("t2").dedupe(pending())).await;
    finish(&h, &p, End::Completed).await;
    let w = accept(&h, EnqueueRequest::new("t3").dedupe(pending()).delay(LATER)).await;
    assert_eq!(
        h.queue.sweep_bindings(100).await.unwrap(),
        1,
        "only the finished pending one"
    );
    coalesced(&h, req(throttle(), 2), &a).await;
    coalesced(&h, EnqueueRequest::new("t3").dedupe(pending()), &w).await;
    accept_new(&h, EnqueueRequest::new("t2").dedupe(pending()), &p).await;
    h.advance(WINDOW);
    assert_eq!(
        h.queue.sweep_bindings(100).await.unwrap(),
        1,
        "the ended window"
    );
    accept_new(&h, req(throttle(), 3), &a).await;
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 0);
}

async fn finished_job_is_kept_while_its_window_holds_the_key(h: Harness) {
    let a = accept(&h, req(throttle(), 1).keep(Duration::ZERO)).await;
    finish(&h, &a, End::Completed).await;
    h.advance(Duration::from_secs(1));
    assert_eq!(h.queue.sweep_retention(100).await.unwrap(), 0);
    coalesced(&h, req(throttle(), 2), &a).await;
    assert_eq!(
        h.job(&a).await.state,
        JobState::Completed,
        "the returned id resolves"
    );
    h.advance(WINDOW);
    assert_eq!(h.queue.sweep_retention(100).await.unwrap(), 1);
    assert!(h.queue.get(&a).await.unwrap().is_none());
    accept_new(&h, req(throttle(), 3), &a).await;
}
