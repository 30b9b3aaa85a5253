//! Conformance cases: execution (docs/worker.md) through the store-level primitives
//! a worker uses: claim, heartbeat, complete, fail, release, checkpoints,
//! cancel, promote, pause and redrive.

use std::collections::HashSet;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use idemq::{
    CancelOutcome, ClaimOptions, ClaimedJob, DedupeOptions, EnqueueRequest, Error, FailOptions,
    FailOutcome, JobState, Outcome, RedriveOptions, RetryPolicy,
};
use idemq_testkit::Harness;
use serde_json::json;

idemq_testkit::instantiate!(
    wait_returns_when_the_job_finishes_not_before,
    claim_takes_higher_priority_first,
    claim_orders_by_run_at_then_acceptance,
    claim_waits_for_run_at,
    claim_respects_the_limit,
    claim_filters_by_queue,
    claim_filters_by_type,
    claim_hands_out_the_job_and_a_lease,
    claim_refuses_bad_options,
    paused_queue_accepts_but_is_not_claimed,
    concurrency_key_admits_one_job_per_claim,
    concurrency_key_is_held_until_the_active_job_ends,
    concurrency_key_is_freed_by_fail_and_not_held_by_a_retry,
    concurrency_keys_are_global_across_queues,
    a_passed_deadline_behind_a_held_key_is_found_once_the_key_is_free,
    a_claim_ends_a_bounded_number_of_passed_deadlines,
    a_backlog_behind_a_held_key_hides_no_other_job,
    a_freed_key_offers_its_next_job_to_every_queue_and_type,
    a_freed_key_goes_on_when_its_next_job_is_cancelled,
    stale_token_is_refused_and_changes_nothing,
    token_is_dead_after_the_attempt_ends,
    complete_many_records_each_and_refuses_stale_items,
    complete_many_completes_a_job_named_twice_once,
    reclaimed_job_fences_the_old_holder,
    expired_lease_is_claimable_by_the_next_claim,
    expired_lease_without_budget_is_dead,
    expired_lease_after_the_deadline_is_dead,
    reap_records_expired_leases,
    heartbeat_renews_the_lease,
    heartbeat_after_expiry_before_it_is_recorded_renews,
    heartbeat_after_recorded_expiry_is_lease_lost,
    heartbeat_reports_cancel_requested,
    heartbeat_many_renews_each_and_refuses_stale_items,
    heartbeat_past_timeout_fails_the_attempt,
    heartbeat_past_deadline_kills_the_job,
    complete_stores_the_result,
    complete_without_result,
    complete_after_deadline_by_the_holder_is_accepted,
    complete_after_timeout_before_it_is_recorded_is_accepted,
    fail_schedules_a_retry_by_the_fixed_policy,
    fail_backs_off_exponentially_without_jitter,
    retry_after_overrides_the_backoff,
    zero_retry_after_is_ready_at_once,
    retry_policy_none_is_dead_on_first_failure,
    permanent_failure_is_dead_at_once,
    exhausted_budget_is_dead,
    retry_at_or_after_the_deadline_is_dead_at_once,
    error_text_is_truncated_to_8_kib,
    snooze_reschedules_without_consuming_the_attempt,
    snooze_ignores_permanent_and_retry_policy,
    snooze_to_or_past_the_deadline_is_dead,
    release_makes_the_job_ready_at_once,
    cancel_of_a_waiting_job_is_immediate,
    cancel_then_complete_completes,
    cancel_then_fail_cancels,
    cancel_then_snooze_cancels,
    cancel_then_release_cancels,
    cancel_then_lease_expiry_cancels,
    cancel_then_timeout_cancels,
    cancel_of_a_terminal_job_changes_nothing,
    checkpoint_first_value_wins,
    checkpoint_is_seen_by_a_later_attempt,
    oversized_result_and_checkpoint_are_refused,
    due_job_past_its_deadline_is_not_started,
    a_retry_past_its_deadline_ends_with_the_deadline_as_its_error,
    redrive_puts_a_dead_job_back_to_ready,
    redrive_of_a_job_that_is_not_dead_is_refused,
    redrive_with_a_key_is_replayed_not_repeated,
    redrive_key_for_another_job_conflicts,
    redrive_key_expires_after_a_day,
    redrive_overrides_max_attempts,
    redrive_keeps_checkpoints_unless_reset,
    redrive_clears_a_passed_deadline,
    redrive_with_run_at_and_deadline,
    redrive_does_not_take_a_dedupe_binding,
    promote_makes_a_scheduled_job_due,
    promote_of_a_job_that_is_not_scheduled_is_false,
    every_state_change_writes_its_event,
    concurrent_claimers_take_each_job_once,
);

// ---------------------------------------------------------------- helpers

fn fixed(delay_ms: i64) -> RetryPolicy {
    RetryPolicy::Fixed { delay_ms }
}

fn ms(n: i64) -> TimeDelta {
    TimeDelta::milliseconds(n)
}

fn secs(n: i64) -> TimeDelta {
    TimeDelta::seconds(n)
}

/// A job of type `t` with a fixed 1 s backoff, so every retry instant is exact.
fn job(t: &str) -> EnqueueRequest {
    EnqueueRequest::new(t).retry(fixed(1000))
}

/// Claims with a lease of `lease_ms` as `worker`.
async fn claim_as(h: &Harness, worker: &str, lease_ms: u64, limit: u32) -> Vec<ClaimedJob> {
    h.claim_with(ClaimOptions {
        worker: worker.into(),
        lease: Duration::from_millis(lease_ms),
        limit,
        ..ClaimOptions::default()
    })
    .await
}

/// Three jobs claimed at once by worker `w`, each with its lease token.
async fn three_claimed(h: &Harness, lease_ms: u64) -> [(String, idemq::LeaseToken); 3] {
    let ids = [
        h.put(job("t")).await,
        h.put(job("t")).await,
        h.put(job("t")).await,
    ];
    let claimed = claim_as(h, "w", lease_ms, 3).await;
    ids.map(|id| {
        let token = claimed
            .iter()
            .find(|x| x.id == id)
            .map(|x| x.lease_token.clone())
            .expect("claimed");
        (id, token)
    })
}

/// Claims exactly one job, which must be `id`.
async fn claim_id(h: &Harness, id: &str) -> ClaimedJob {
    let c = h.claim_one().await;
    assert_eq!(c.id, id, "claimed another job");
    c
}

fn ids(claimed: &[ClaimedJob]) -> Vec<String> {
    claimed.iter().map(|c| c.id.clone()).collect()
}

fn error(text: &str) -> FailOptions {
    FailOptions {
        error: text.into(),
        ..FailOptions::default()
    }
}

async fn fail(h: &Harness, c: &ClaimedJob, options: FailOptions) -> FailOutcome {
    h.queue
        .fail(&c.id, &c.lease_token, options)
        .await
        .expect("fail")
}

async fn complete(h: &Harness, c: &ClaimedJob) {
    h.queue
        .complete(&c.id, &c.lease_token, None)
        .await
        .expect("complete");
}

/// Asserts that a fenced call was refused with `LeaseLost` for `id`.
fn assert_lost<T: std::fmt::Debug>(r: idemq::Result<T>, id: &str) {
    match r {
        Err(Error::LeaseLost { job_id }) => assert_eq!(job_id, id),
        other => panic!("expected LeaseLost for {id}, got {other:?}"),
    }
}

/// Every fenced call with `token` on `id` is refused.
async fn assert_fenced(h: &Harness, id: &str, token: &idemq::LeaseToken) {
    assert_lost(h.queue.heartbeat(id, token).await, id);
    assert_lost(h.queue.complete(id, token, Some(json!("stale"))).await, id);
    assert_lost(h.queue.fail(id, token, error("stale")).await, id);
    assert_lost(
        h.queue
            .fail(
                id,
                token,
                FailOptions {
                    snooze: Some(Duration::from_secs(1)),
                    ..FailOptions::default()
                },
            )
            .await,
        id,
    );
    assert_lost(h.queue.release(id, token).await, id);
    assert_lost(
        h.queue
            .checkpoint_put(id, token, "stale", &json!("stale"))
            .await,
        id,
    );
}

/// The run ledger as (attempt, worker, outcome, error).
async fn runs(h: &Harness, id: &str) -> Vec<(i32, String, Option<String>, Option<String>)> {
    h.queue
        .runs(id)
        .await
        .expect("runs")
        .into_iter()
        .map(|r| (r.attempt, r.worker, r.outcome, r.error))
        .collect()
}

/// The outcomes of the run ledger, oldest first.
async fn outcomes(h: &Harness, id: &str) -> Vec<Option<String>> {
    runs(h, id).await.into_iter().map(|r| r.2).collect()
}

fn some(s: &str) -> Option<String> {
    Some(s.to_owned())
}

fn count(kinds: &[String], kind: &str) -> usize {
    kinds.iter().filter(|k| *k == kind).count()
}

/// The data of the last event of `kind`.
async fn last_event(h: &Harness, id: &str, kind: &str) -> serde_json::Value {
    h.queue
        .events(id)
        .await
        .expect("events")
        .into_iter()
        .rev()
        .find(|e| e.kind == kind)
        .unwrap_or_else(|| panic!("no {kind} event on {id}"))
        .data
}

async fn state(h: &Harness, id: &str) -> JobState {
    h.job(id).await.state
}

/// Drives `id` to `dead` with a permanent failure.
async fn kill(h: &Harness, id: &str) {
    let c = claim_id(h, id).await;
    let out = fail(
        h,
        &c,
        FailOptions {
            error: "boom".into(),
            permanent: true,
            ..FailOptions::default()
        },
    )
    .await;
    assert_eq!(out.state, JobState::Dead);
}

fn at(start: DateTime<Utc>, delta: TimeDelta) -> DateTime<Utc> {
    start + delta
}

// ---------------------------------------------------------------- claim

async fn claim_takes_higher_priority_first(h: Harness) {
    let low = h.put(job("t").priority(-5)).await;
    let mid = h.put(job("t")).await;
    let high = h.put(job("t").priority(7)).await;
    let top = h.put(job("t").priority(i16::MAX)).await;
    let claimed = h.claim(10).await;
    assert_eq!(ids(&claimed), vec![top, high, mid, low]);
}

async fn claim_orders_by_run_at_then_acceptance(h: Harness) {
    // Accepted in this order; due at +5 s, +2 s, 0, 0.
    let late = h.put(job("t").delay(Duration::from_secs(5))).await;
    let middle = h.put(job("t").delay(Duration::from_secs(2))).await;
    let first = h.put(job("t")).await;
    let second = h.put(job("t")).await;
    h.advance_ms(5000);
    let claimed = h.claim(10).await;
    assert_eq!(ids(&claimed), vec![first, second, middle, late]);
}

async fn claim_waits_for_run_at(h: Harness) {
    let start = h.now().await;
    let id = h.put(job("t").delay(Duration::from_secs(10))).await;
    assert_eq!(state(&h, &id).await, JobState::Scheduled);
    assert!(h.claim(10).await.is_empty());
    h.advance_ms(9_999);
    assert!(h.claim(10).await.is_empty(), "claimed before run_at");
    assert_eq!(state(&h, &id).await, JobState::Scheduled);
    h.advance_ms(1);
    assert_eq!(state(&h, &id).await, JobState::Ready);
    assert_eq!(h.job(&id).await.run_at, at(start, secs(10)));
    let c = claim_id(&h, &id).await;
    assert_eq!(c.attempt, 1);
}

async fn claim_respects_the_limit(h: Harness) {
    for _ in 0..5 {
        h.put(job("t")).await;
    }
    assert_eq!(h.claim(3).await.len(), 3);
    assert_eq!(h.claim(3).await.len(), 2);
    assert!(h.claim(3).await.is_empty());
    let active = h
        .jobs()
        .await
        .into_iter()
        .filter(|j| j.state == JobState::Active)
        .count();
    assert_eq!(active, 5);
}

async fn claim_filters_by_queue(h: Harness) {
    let a = h.put(job("t").queue("a")).await;
    let b = h.put(job("t").queue("b")).await;
    let c = h.put(job("t").queue("c")).await;
    let d = h.put(job("t")).await;
    let claimed = h
        .claim_with(ClaimOptions {
            queues: vec!["a".into(), "c".into()],
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(ids(&claimed), vec![a, c]);
    assert_eq!(claimed[0].queue, "a");
    let rest = h
        .claim_with(ClaimOptions {
            queues: vec!["default".into()],
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(ids(&rest), vec![d]);
    assert_eq!(state(&h, &b).await, JobState::Ready);
}

async fn claim_filters_by_type(h: Harness) {
    let mail = h.put(job("mail.send")).await;
    let sms = h.put(job("sms.send")).await;
    let push = h.put(job("push.send")).await;
    let claimed = h
        .claim_with(ClaimOptions {
            types: Some(vec!["push.send".into(), "mail.send".into()]),
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(ids(&claimed), vec![mail, push]);
    assert_eq!(claimed[1].job_type, "push.send");
    assert_eq!(state(&h, &sms).await, JobState::Ready);
    // Both filters at once.
    let other = h.put(job("sms.send").queue("q2")).await;
    let claimed = h
        .claim_with(ClaimOptions {
            queues: vec!["q2".into()],
            types: Some(vec!["sms.send".into()]),
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(ids(&claimed), vec![other]);
}

async fn claim_hands_out_the_job_and_a_lease(h: Harness) {
    let deadline = at(h.now().await, TimeDelta::hours(2));
    let id = h
        .put(
            job("report.build")
                .queue("reports")
                .payload(json!({"month": "2030-01", "n": [1, 2]}))
                .max_attempts(4)
                .timeout(Duration::from_secs(90))
                .deadline(deadline)
                .tag("b")
                .tag("a"),
        )
        .await;
    h.advance_ms(1500);
    let now = h.now().await;
    let claimed = claim_as(&h, "worker-7", 45_000, 5).await;
    assert_eq!(claimed.len(), 1);
    let c = &claimed[0];
    assert_eq!(c.id, id);
    assert_eq!(c.job_type, "report.build");
    assert_eq!(c.queue, "reports");
    assert_eq!(c.payload, json!({"month": "2030-01", "n": [1, 2]}));
    assert_eq!(c.attempt, 1);
    assert_eq!(c.max_attempts, 4);
    assert_eq!(c.timeout_ms, 90_000);
    assert_eq!(c.deadline, Some(deadline));
    assert_eq!(c.tags, vec!["a", "b"]);
    assert_eq!(c.lease_expires_at, at(now, ms(45_000)));
    assert!(!c.lease_token.as_str().is_empty());

    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Active);
    assert_eq!(j.attempt, 1);
    assert_eq!(j.attempts_used, 0);
    assert_eq!(j.lease_expires_at, Some(c.lease_expires_at));
    assert!(!j.cancel_requested);
    assert_eq!(j.finished_at, None);

    let ledger = h.queue.runs(&id).await.unwrap();
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0].attempt, 1);
    assert_eq!(ledger[0].worker, "worker-7");
    assert_eq!(ledger[0].started_at, now);
    assert_eq!(ledger[0].finished_at, None);
    assert_eq!(ledger[0].outcome, None);
    assert_eq!(h.event_kinds(&id).await, vec!["accepted", "claimed"]);

    // A second claim of the same job is impossible while it is active.
    assert!(h.claim(10).await.is_empty());
}

async fn claim_refuses_bad_options(h: Harness) {
    let id = h.put(job("t")).await;
    let bad = [
        ClaimOptions {
            limit: 0,
            ..ClaimOptions::default()
        },
        ClaimOptions {
            limit: 1001,
            ..ClaimOptions::default()
        },
        ClaimOptions {
            lease: Duration::from_millis(99),
            ..ClaimOptions::default()
        },
        ClaimOptions {
            lease: Duration::from_secs(3601),
            ..ClaimOptions::default()
        },
        ClaimOptions {
            worker: String::new(),
            ..ClaimOptions::default()
        },
    ];
    for options in bad {
        let err = h.queue.claim(options.clone()).await.unwrap_err();
        assert!(
            matches!(err, Error::Validation { .. }),
            "{options:?}: {err:?}"
        );
    }
    assert_eq!(state(&h, &id).await, JobState::Ready, "nothing was claimed");
}

// ---------------------------------------------------------------- pause

async fn paused_queue_accepts_but_is_not_claimed(h: Harness) {
    h.queue.pause("mail").await.unwrap();
    let mail = h.put(job("t").queue("mail")).await;
    let other = h.put(job("t").queue("sms")).await;
    assert_eq!(state(&h, &mail).await, JobState::Ready);

    let queues = h.queue.queues().await.unwrap();
    let info = queues.iter().find(|q| q.name == "mail").expect("mail");
    assert!(info.paused);
    assert_eq!(info.counts.ready, 1);
    assert!(!queues.iter().find(|q| q.name == "sms").unwrap().paused);

    assert_eq!(ids(&h.claim(10).await), vec![other]);
    let named = h
        .claim_with(ClaimOptions {
            queues: vec!["mail".into()],
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert!(
        named.is_empty(),
        "a paused queue is skipped even when named"
    );

    h.queue.resume("mail").await.unwrap();
    let queues = h.queue.queues().await.unwrap();
    assert!(!queues.iter().find(|q| q.name == "mail").unwrap().paused);
    assert_eq!(ids(&h.claim(10).await), vec![mail]);
}

// ---------------------------------------------------------------- concurrency keys

async fn concurrency_key_admits_one_job_per_claim(h: Harness) {
    let k1 = h.put(job("t").concurrency_key("acct-1")).await;
    let k2 = h.put(job("t").concurrency_key("acct-1")).await;
    let free = h.put(job("t")).await;
    let k3 = h.put(job("t").concurrency_key("acct-1")).await;
    let other = h.put(job("t").concurrency_key("acct-2")).await;
    let claimed = h.claim(10).await;
    assert_eq!(ids(&claimed), vec![k1, free, other]);
    assert_eq!(state(&h, &k2).await, JobState::Ready);
    assert_eq!(state(&h, &k3).await, JobState::Ready);
}

async fn concurrency_key_is_held_until_the_active_job_ends(h: Harness) {
    let a = h.put(job("t").concurrency_key("k")).await;
    let b = h.put(job("t").concurrency_key("k")).await;
    let c = h.put(job("t").concurrency_key("k")).await;
    let ca = claim_id(&h, &a).await;
    assert!(h.claim(10).await.is_empty(), "key k is held by {a}");
    complete(&h, &ca).await;
    let cb = h.claim(10).await;
    assert_eq!(ids(&cb), vec![b.clone()]);
    assert!(h.claim(10).await.is_empty(), "key k is held by {b}");
    // A permanent failure frees it too.
    let out = fail(
        &h,
        &cb[0],
        FailOptions {
            permanent: true,
            ..error("no")
        },
    )
    .await;
    assert_eq!(out.state, JobState::Dead);
    assert_eq!(ids(&h.claim(10).await), vec![c]);
}

async fn concurrency_key_is_freed_by_fail_and_not_held_by_a_retry(h: Harness) {
    let a = h.put(job("t").concurrency_key("k")).await;
    let b = h.put(job("t").concurrency_key("k")).await;
    let ca = claim_id(&h, &a).await;
    let out = fail(&h, &ca, error("flaky")).await;
    assert_eq!(out.state, JobState::Scheduled);
    // `a` waits for its retry and does not hold the key.
    let cb = claim_id(&h, &b).await;
    h.advance_ms(1000);
    assert_eq!(state(&h, &a).await, JobState::Ready);
    assert!(h.claim(10).await.is_empty(), "key k is held by {b}");
    complete(&h, &cb).await;
    let again = claim_id(&h, &a).await;
    assert_eq!(again.attempt, 2);
}

/// A job whose concurrency key an active job holds is not a claim
/// candidate at all: a claim leaves it as it is, its deadline passed or not,
/// and the first claim that finds the key free ends it `dead` (`deadline`).
async fn a_passed_deadline_behind_a_held_key_is_found_once_the_key_is_free(h: Harness) {
    let a = h.put(job("t").concurrency_key("k")).await;
    let deadline = at(h.now().await, secs(10));
    let b = h
        .put(job("t").concurrency_key("k").deadline(deadline))
        .await;
    let ca = claim_id(&h, &a).await;
    h.advance_ms(15_000);
    assert!(h.claim(10).await.is_empty(), "key k is held by {a}");
    assert_eq!(state(&h, &b).await, JobState::Ready);
    assert!(h.event_kinds(&b).await.iter().all(|k| k != "dead"));
    complete(&h, &ca).await;
    assert!(h.claim(10).await.is_empty());
    assert_eq!(state(&h, &b).await, JobState::Dead);
    assert_eq!(last_event(&h, &b, "dead").await["reason"], "deadline");
}

/// A claim ends at most 2,048 due jobs past their deadline (8 pages of 256
/// on SQL, the same bound on Redis), so one call never holds the store for
/// a backlog of any size; the claims after it end the rest, and the live
/// job behind them is handed out once they are gone.
async fn a_claim_ends_a_bounded_number_of_passed_deadlines(h: Harness) {
    const BOUND: u64 = 2048;
    const EXPIRED: u64 = BOUND + 100;
    h.put_past_deadline(job("t"), EXPIRED as usize).await;
    // Behind every job past its deadline in claim order.
    let live = h.put(job("t")).await;
    let ready = || async {
        let queues = h.queue.queues().await.expect("queues");
        queues.iter().map(|q| q.counts.ready).sum::<u64>()
    };
    assert_eq!(ready().await, EXPIRED + 1);
    assert!(
        h.claim(1).await.is_empty(),
        "the first claim stops at its bound"
    );
    assert_eq!(ready().await, EXPIRED - BOUND + 1);
    assert_eq!(ids(&h.claim(1).await), vec![live.clone()]);
    assert_eq!(ready().await, 0);
    // The newest thousand jobs: the live one, and the last expired ones,
    // ended by the second claim.
    for j in h.jobs().await.iter().filter(|j| j.id != live) {
        assert_eq!(j.state, JobState::Dead, "{}", j.id);
        assert_eq!(j.last_error.as_deref(), Some("deadline"), "{}", j.id);
    }
}

/// Many due jobs whose concurrency key is held, ahead of a free job in
/// claim order: a claim passes over all of them and hands out the free
/// job; once the key frees, the backlog goes on one job at a time, oldest
/// first. (A Redis claim walks its lanes entry by entry; it moves such
/// jobs aside, docs/storage.md.)
async fn a_backlog_behind_a_held_key_hides_no_other_job(h: Harness) {
    let a = h.put(job("t").concurrency_key("k")).await;
    let ca = claim_id(&h, &a).await;
    let mut backlog = Vec::new();
    for n in [1000, 500] {
        let reqs = (0..n).map(|_| job("t").concurrency_key("k")).collect();
        for r in h
            .queue
            .enqueue_many(reqs, idemq::BatchOptions::default())
            .await
            .expect("batch")
        {
            backlog.push(r.expect("item").job_id);
        }
    }
    let free = h.put(job("t")).await;
    assert_eq!(ids(&h.claim(10).await), vec![free.clone()]);
    assert!(h.claim(10).await.is_empty(), "key k is held by {a}");
    let queues = h.queue.queues().await.expect("queues");
    let default = queues
        .iter()
        .find(|q| q.name == "default")
        .expect("default");
    assert_eq!(default.counts.ready, 1500);
    assert_eq!(default.counts.active, 2);
    // Enqueued while the backlog waits: not hidden either.
    let later = h.put(job("t")).await;
    assert_eq!(ids(&h.claim(10).await), vec![later]);

    complete(&h, &ca).await;
    let mut previous = ca;
    for expected in &backlog[..3] {
        let next = h.claim(10).await;
        assert_eq!(
            ids(&next),
            vec![expected.clone()],
            "the backlog goes on in order"
        );
        assert!(h.claim(10).await.is_empty(), "key k is held by {expected}");
        complete(&h, &next[0]).await;
        previous = next.into_iter().next().expect("claimed");
    }
    assert_eq!(state(&h, &previous.id).await, JobState::Completed);
    let queues = h.queue.queues().await.expect("queues");
    let default = queues
        .iter()
        .find(|q| q.name == "default")
        .expect("default");
    assert_eq!(default.counts.ready, 1497);
}

/// When a concurrency key frees, its next job is found by a claim of any
/// queue and type that has one: jobs of the key in a paused queue, or of a
/// type no worker claims, do not hold up the others, and priority decides
/// among those a claim can take.
async fn a_freed_key_offers_its_next_job_to_every_queue_and_type(h: Harness) {
    let a = h.put(job("t").concurrency_key("k")).await;
    let ca = claim_id(&h, &a).await;
    let elsewhere = h.put(job("t").queue("other").concurrency_key("k")).await;
    let untaken = h.put(job("u").concurrency_key("k")).await;
    let low = h.put(job("t").concurrency_key("k")).await;
    let high = h.put(job("t").concurrency_key("k").priority(5)).await;
    // A claim of every queue and type meets all four while `a` holds k.
    assert!(h.claim(10).await.is_empty(), "key k is held by {a}");
    h.queue.pause("other").await.expect("pause");
    complete(&h, &ca).await;
    let only_t = ClaimOptions {
        types: Some(vec!["t".into()]),
        limit: 10,
        ..ClaimOptions::default()
    };
    let ch = h.claim_with(only_t.clone()).await;
    assert_eq!(ids(&ch), vec![high.clone()]);
    complete(&h, &ch[0]).await;
    let cl = h.claim_with(only_t.clone()).await;
    assert_eq!(ids(&cl), vec![low.clone()]);
    complete(&h, &cl[0]).await;
    // Nothing of type t is left in an unpaused queue.
    assert!(h.claim_with(only_t).await.is_empty());
    let cu = h.claim(10).await;
    assert_eq!(ids(&cu), vec![untaken.clone()]);
    complete(&h, &cu[0]).await;
    assert!(h.claim(10).await.is_empty(), "`other` is paused");
    h.queue.resume("other").await.expect("resume");
    assert_eq!(ids(&h.claim(10).await), vec![elsewhere]);
}

/// A key's next job cancelled before any claim takes it: the key goes on
/// to the job after it.
async fn a_freed_key_goes_on_when_its_next_job_is_cancelled(h: Harness) {
    let a = h.put(job("t").concurrency_key("k")).await;
    let ca = claim_id(&h, &a).await;
    let b = h.put(job("t").concurrency_key("k")).await;
    let c = h.put(job("t").concurrency_key("k")).await;
    assert!(h.claim(10).await.is_empty(), "key k is held by {a}");
    complete(&h, &ca).await;
    let out = h.queue.cancel(&b).await.expect("cancel");
    assert_eq!(out.state, JobState::Cancelled);
    assert_eq!(ids(&h.claim(10).await), vec![c]);
}

async fn concurrency_keys_are_global_across_queues(h: Harness) {
    let a = h.put(job("t").queue("a").concurrency_key("k")).await;
    let b = h.put(job("u").queue("b").concurrency_key("k")).await;
    let ca = h
        .claim_with(ClaimOptions {
            queues: vec!["a".into()],
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(ids(&ca), vec![a.clone()]);
    let from_b = h
        .claim_with(ClaimOptions {
            queues: vec!["b".into()],
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert!(from_b.is_empty(), "the key is held in queue a");
    assert!(h.claim(10).await.is_empty());
    h.queue
        .release(&ca[0].id, &ca[0].lease_token)
        .await
        .unwrap();
    // Released: the key is free, so `b` can take it from queue b …
    let cb = h
        .claim_with(ClaimOptions {
            queues: vec!["b".into()],
            limit: 10,
            ..ClaimOptions::default()
        })
        .await;
    assert_eq!(ids(&cb), vec![b]);
    // … and now `a`, ready again, waits for it.
    assert_eq!(state(&h, &a).await, JobState::Ready);
    assert!(h.claim(10).await.is_empty());
}

// ---------------------------------------------------------------- lease fencing

async fn stale_token_is_refused_and_changes_nothing(h: Harness) {
    let id = h.put(job("t")).await;
    let other = h.put(job("t")).await;
    let c = claim_as(&h, "w-1", 30_000, 2).await;
    assert_eq!(ids(&c), vec![id.clone(), other.clone()]);
    let before = h.job(&id).await;
    let events = h.queue.events(&id).await.unwrap();
    let ledger = h.queue.runs(&id).await.unwrap();
    let totals = h.totals().await;

    // A made-up token, and the token of another job.
    assert_fenced(&h, &id, &idemq::LeaseToken::new("not-a-token")).await;
    assert_fenced(&h, &id, &c[1].lease_token).await;
    // A token for a job that does not exist.
    assert_fenced(&h, "no-such-job", &c[0].lease_token).await;

    assert_eq!(h.job(&id).await, before);
    assert_eq!(h.queue.events(&id).await.unwrap(), events);
    assert_eq!(h.queue.runs(&id).await.unwrap(), ledger);
    assert_eq!(h.totals().await, totals, "no job and no event written");
    assert!(h.queue.checkpoints(&id).await.unwrap().is_empty());
    assert!(h.queue.get("no-such-job").await.unwrap().is_none());
    // The real token still works.
    h.queue.heartbeat(&id, &c[0].lease_token).await.unwrap();
    complete(&h, &c[0]).await;
}

async fn token_is_dead_after_the_attempt_ends(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    h.queue
        .complete(&id, &c.lease_token, Some(json!(1)))
        .await
        .unwrap();
    let before = h.job(&id).await;
    let events = h.queue.events(&id).await.unwrap();
    assert_fenced(&h, &id, &c.lease_token).await;
    assert_eq!(h.job(&id).await, before);
    assert_eq!(h.job(&id).await.result, Some(json!(1)));
    assert_eq!(h.queue.events(&id).await.unwrap(), events);

    // After a retry is scheduled, the old token is dead too.
    let id2 = h.put(job("t")).await;
    let c2 = claim_id(&h, &id2).await;
    fail(&h, &c2, error("x")).await;
    assert_fenced(&h, &id2, &c2.lease_token).await;
    assert_eq!(state(&h, &id2).await, JobState::Scheduled);
    assert_eq!(h.job(&id2).await.attempts_used, 1);
}

/// `complete_many` records each item as `complete` would, in one call; an
/// item with a dead token fails alone and changes nothing.
async fn complete_many_records_each_and_refuses_stale_items(h: Harness) {
    let claimed = three_claimed(&h, 30_000).await;
    let [(a, _), (b, _), (c, _)] = claimed.clone();
    let token = |id: &str| {
        claimed
            .iter()
            .find(|(x, _)| x == id)
            .map(|(_, t)| t.clone())
            .expect("claimed")
    };
    // `a` ends first, so its token is dead when the batch arrives.
    h.queue.complete(&a, &token(&a), None).await.unwrap();
    let a_before = h.job(&a).await;
    let a_events = h.queue.events(&a).await.unwrap();
    let item = |id: &str, result: Option<serde_json::Value>| idemq::Completion {
        job_id: id.into(),
        lease_token: token(id),
        result,
    };
    let results = h
        .queue
        .complete_many(vec![
            item(&b, Some(json!({"n": 2}))),
            item(&a, None),
            item(&c, None),
        ])
        .await
        .unwrap();
    assert_eq!(results.len(), 3);
    assert!(results[0].is_ok(), "{:?}", results[0]);
    assert_lost(results.into_iter().nth(1).unwrap(), &a);
    for id in [&b, &c] {
        let j = h.job(id).await;
        assert_eq!(j.state, JobState::Completed);
        assert_eq!(j.attempts_used, 1);
        let kinds: Vec<String> = h
            .queue
            .events(id)
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds.last().map(String::as_str), Some("completed"));
    }
    assert_eq!(h.job(&b).await.result, Some(json!({"n": 2})));
    assert_eq!(h.job(&c).await.result, None);
    assert_eq!(h.job(&a).await, a_before);
    assert_eq!(h.queue.events(&a).await.unwrap(), a_events);
    assert_fenced(&h, &b, &token(&b)).await;
    assert!(h.queue.complete_many(Vec::new()).await.unwrap().is_empty());
}

/// A job named twice in one batch is completed once, by its first item;
/// the second item finds the lease gone.
async fn complete_many_completes_a_job_named_twice_once(h: Harness) {
    let id = h.put(job("t")).await;
    let claimed = claim_as(&h, "w", 30_000, 1).await.remove(0);
    let item = |n: i64| idemq::Completion {
        job_id: id.clone(),
        lease_token: claimed.lease_token.clone(),
        result: Some(json!({"n": n})),
    };
    let mut results = h.queue.complete_many(vec![item(1), item(2)]).await.unwrap();
    assert_eq!(results.len(), 2);
    assert_lost(results.pop().unwrap(), &id);
    assert!(results[0].is_ok(), "{:?}", results[0]);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(j.result, Some(json!({"n": 1})));
    let completed = h
        .queue
        .events(&id)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.kind == "completed")
        .count();
    assert_eq!(completed, 1);
}

async fn reclaimed_job_fences_the_old_holder(h: Harness) {
    let id = h.put(job("t")).await;
    let first = claim_as(&h, "w-old", 1000, 1).await.remove(0);
    h.advance_ms(1001);
    let second = claim_as(&h, "w-new", 30_000, 1).await.remove(0);
    assert_eq!(second.id, id);
    assert_eq!(second.attempt, 2);
    assert_ne!(second.lease_token, first.lease_token);

    let before = h.job(&id).await;
    assert_fenced(&h, &id, &first.lease_token).await;
    assert_eq!(h.job(&id).await, before, "the old holder changed the job");
    assert!(h.queue.checkpoints(&id).await.unwrap().is_empty());

    h.queue
        .complete(&id, &second.lease_token, Some(json!("new")))
        .await
        .unwrap();
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.result, Some(json!("new")));
    assert_eq!(j.attempt, 2);
    assert_eq!(j.attempts_used, 2);
    // Even after the new attempt ended, the old token stays refused.
    assert_lost(h.queue.complete(&id, &first.lease_token, None).await, &id);
    assert_eq!(h.job(&id).await.result, Some(json!("new")));
    let r = runs(&h, &id).await;
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].0, r[0].1.as_str()), (1, "w-old"));
    assert_eq!(r[0].2, some("lease_expired"));
    assert_eq!((r[1].0, r[1].1.as_str()), (2, "w-new"));
    assert_eq!(r[1].2, some("completed"));
}

// ---------------------------------------------------------------- lease expiry

async fn expired_lease_is_claimable_by_the_next_claim(h: Harness) {
    let id = h.put(job("t").max_attempts(3)).await;
    let start = h.now().await;
    let c = claim_as(&h, "w-1", 2000, 1).await.remove(0);
    assert_eq!(c.lease_expires_at, at(start, ms(2000)));
    h.advance_ms(1999);
    assert!(h.claim(1).await.is_empty(), "the lease has not expired");
    h.advance_ms(1);
    let again = claim_as(&h, "w-2", 2000, 1).await;
    assert_eq!(ids(&again), vec![id.clone()]);
    assert_eq!(again[0].attempt, 2);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Active);
    assert_eq!(j.attempt, 2);
    assert_eq!(j.attempts_used, 1, "the expired attempt is consumed");
    let ledger = h.queue.runs(&id).await.unwrap();
    assert_eq!(ledger.len(), 2);
    assert_eq!(ledger[0].outcome, some("lease_expired"));
    assert_eq!(ledger[0].finished_at, Some(at(start, ms(2000))));
    assert_eq!(ledger[1].outcome, None);
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "lease_expired", "claimed"]
    );
}

async fn expired_lease_without_budget_is_dead(h: Harness) {
    let id = h.put(job("t").max_attempts(2)).await;
    claim_as(&h, "w-1", 1000, 1).await;
    h.advance_ms(1000);
    let c2 = claim_as(&h, "w-1", 1000, 1).await;
    assert_eq!(c2[0].attempt, 2);
    h.advance_ms(1000);
    let now = h.now().await;
    assert!(h.claim(10).await.is_empty());
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempts_used, 2);
    assert_eq!(j.finished_at, Some(now));
    assert!(j.last_error.is_some());
    assert_eq!(j.lease_expires_at, None);
    assert_eq!(
        outcomes(&h, &id).await,
        vec![some("lease_expired"), some("lease_expired")]
    );
    assert_eq!(
        h.event_kinds(&id).await,
        vec![
            "accepted",
            "claimed",
            "lease_expired",
            "claimed",
            "lease_expired",
            "dead"
        ]
    );
}

async fn expired_lease_after_the_deadline_is_dead(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let id = h.put(job("t").deadline(deadline).max_attempts(5)).await;
    let other = h.put(job("t").deadline(deadline).max_attempts(5)).await;
    claim_as(&h, "w-1", 15_000, 2).await;
    h.advance_ms(15_000);
    // Recorded by the reaper: the next attempt would start after the
    // deadline, so the job is dead at once, not ready.
    assert_eq!(h.queue.reap_leases(1).await.unwrap(), 1);
    assert_eq!(state(&h, &id).await, JobState::Dead);
    // Recorded by the next claim.
    assert!(h.claim(10).await.is_empty());
    assert_eq!(state(&h, &other).await, JobState::Dead);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(last_event(&h, &id, "dead").await["reason"], "deadline");
    assert_eq!(outcomes(&h, &id).await, vec![some("lease_expired")]);
}

async fn reap_records_expired_leases(h: Harness) {
    let a = h.put(job("t")).await;
    let b = h.put(job("t")).await;
    let c = h.put(job("t")).await;
    claim_as(&h, "w-1", 1000, 2).await;
    let long = claim_as(&h, "w-1", 60_000, 1).await;
    assert_eq!(ids(&long), vec![c.clone()]);
    h.advance_ms(999);
    assert_eq!(h.queue.reap_leases(100).await.unwrap(), 0);
    h.advance_ms(1);
    let now = h.now().await;
    assert_eq!(h.queue.reap_leases(100).await.unwrap(), 2);
    for id in [&a, &b] {
        let j = h.job(id).await;
        assert_eq!(j.state, JobState::Ready);
        assert_eq!(j.run_at, now);
        assert_eq!(j.attempts_used, 1);
        assert_eq!(j.lease_expires_at, None);
        assert_eq!(outcomes(&h, id).await, vec![some("lease_expired")]);
        assert_eq!(
            h.event_kinds(id).await,
            vec!["accepted", "claimed", "lease_expired"]
        );
    }
    assert_eq!(state(&h, &c).await, JobState::Active);
    assert_eq!(h.queue.reap_leases(100).await.unwrap(), 0);
    // The reaped jobs are claimable; attempt counts on.
    let again = h.claim(10).await;
    assert_eq!(ids(&again), vec![a, b]);
    assert!(again.iter().all(|c| c.attempt == 2));
}

async fn heartbeat_renews_the_lease(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_as(&h, "w-1", 10_000, 1).await.remove(0);
    h.advance_ms(8000);
    let now = h.now().await;
    let hb = h.queue.heartbeat(&id, &c.lease_token).await.unwrap();
    assert_eq!(hb.lease_expires_at, at(now, ms(10_000)));
    assert!(!hb.cancel_requested);
    assert_eq!(h.job(&id).await.lease_expires_at, Some(hb.lease_expires_at));
    // Past the first expiry, but within the renewed lease.
    h.advance_ms(9_999);
    assert!(h.claim(10).await.is_empty());
    assert_eq!(h.queue.reap_leases(100).await.unwrap(), 0);
    assert_eq!(state(&h, &id).await, JobState::Active);
    complete(&h, &c).await;
    assert_eq!(outcomes(&h, &id).await, vec![some("completed")]);
    assert_eq!(h.job(&id).await.attempts_used, 1);
}

async fn heartbeat_after_expiry_before_it_is_recorded_renews(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_as(&h, "w-1", 1000, 1).await.remove(0);
    h.advance_ms(5000);
    // The lease is past its expiry, but nothing recorded that yet.
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Active);
    let now = h.now().await;
    let hb = h.queue.heartbeat(&id, &c.lease_token).await.unwrap();
    assert_eq!(hb.lease_expires_at, at(now, ms(1000)));
    assert!(h.claim(10).await.is_empty(), "the renewed lease holds");
    complete(&h, &c).await;
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.attempt, 1);
    assert_eq!(outcomes(&h, &id).await, vec![some("completed")]);
}

async fn heartbeat_after_recorded_expiry_is_lease_lost(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_as(&h, "w-1", 1000, 1).await.remove(0);
    h.advance_ms(1500);
    assert_eq!(h.queue.reap_leases(10).await.unwrap(), 1);
    let before = h.job(&id).await;
    assert_eq!(before.state, JobState::Ready);
    assert_fenced(&h, &id, &c.lease_token).await;
    assert_eq!(h.job(&id).await, before);
    assert_eq!(outcomes(&h, &id).await, vec![some("lease_expired")]);
}

/// `heartbeat_many` answers each lease as `heartbeat` would, in order, in
/// one call: renewed, cancel requested, or lost (a dead token, one no claim
/// could have minted) without touching the job.
async fn heartbeat_many_renews_each_and_refuses_stale_items(h: Harness) {
    let [(a, ta), (b, tb), (c, tc)] = three_claimed(&h, 10_000).await;
    h.queue.complete(&a, &ta, None).await.unwrap();
    let a_before = h.job(&a).await;
    let a_events = h.queue.events(&a).await.unwrap();
    h.queue.cancel(&c).await.unwrap();
    h.advance_ms(8000);
    let now = h.now().await;
    let forged = idemq::LeaseToken::new("x\0y");
    let mut results = h
        .queue
        .heartbeat_many([
            (b.as_str(), &tb),
            (a.as_str(), &ta),
            (c.as_str(), &tc),
            (b.as_str(), &forged),
        ])
        .await
        .unwrap();
    assert_eq!(results.len(), 4);
    assert_lost(results.pop().unwrap(), &b);
    let hb_c = results.pop().unwrap().unwrap();
    assert!(hb_c.cancel_requested);
    assert_eq!(hb_c.lease_expires_at, at(now, ms(10_000)));
    assert_lost(results.pop().unwrap(), &a);
    let hb_b = results.pop().unwrap().unwrap();
    assert!(!hb_b.cancel_requested);
    assert_eq!(hb_b.lease_expires_at, at(now, ms(10_000)));
    assert_eq!(
        h.job(&b).await.lease_expires_at,
        Some(hb_b.lease_expires_at)
    );
    assert_eq!(h.job(&a).await, a_before);
    assert_eq!(h.queue.events(&a).await.unwrap(), a_events);
    // Past the first expiry, within the renewed leases: nothing to reclaim.
    h.advance_ms(9_999);
    assert!(h.claim(10).await.is_empty());
    assert_eq!(state(&h, &b).await, JobState::Active);
    assert!(h.queue.heartbeat_many([]).await.unwrap().is_empty());
    let many: Vec<(&str, &idemq::LeaseToken)> = (0..1001).map(|_| (b.as_str(), &tb)).collect();
    match h.queue.heartbeat_many(many).await {
        Err(Error::Validation { field, .. }) => assert_eq!(field, "items"),
        other => panic!("expected a validation error, got {other:?}"),
    }
}

async fn heartbeat_reports_cancel_requested(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    let hb = h.queue.heartbeat(&id, &c.lease_token).await.unwrap();
    assert!(!hb.cancel_requested);
    let out = h.queue.cancel(&id).await.unwrap();
    assert_eq!(
        out,
        CancelOutcome {
            cancelled: true,
            state: JobState::Active
        }
    );
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Active);
    assert!(j.cancel_requested);
    let hb = h.queue.heartbeat(&id, &c.lease_token).await.unwrap();
    assert!(hb.cancel_requested);
    // Sticky, and a repeated cancel writes no second event.
    let again = h.queue.cancel(&id).await.unwrap();
    assert_eq!(again, out);
    assert!(
        h.queue
            .heartbeat(&id, &c.lease_token)
            .await
            .unwrap()
            .cancel_requested
    );
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "cancel_requested"]
    );
}

async fn heartbeat_past_timeout_fails_the_attempt(h: Harness) {
    let id = h
        .put(
            job("t")
                .retry(fixed(2000))
                .timeout(Duration::from_secs(5))
                .max_attempts(3),
        )
        .await;
    let c = claim_as(&h, "w-1", 3000, 1).await.remove(0);
    assert_eq!(c.timeout_ms, 5000);
    h.advance_ms(2500);
    h.queue.heartbeat(&id, &c.lease_token).await.unwrap();
    h.advance_ms(2501); // 5001 ms into the attempt; the lease still holds
    let now = h.now().await;
    assert_lost(h.queue.heartbeat(&id, &c.lease_token).await, &id);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Scheduled);
    assert_eq!(j.run_at, at(now, ms(2000)));
    assert_eq!(j.attempts_used, 1);
    assert!(j.last_error.is_some());
    let r = runs(&h, &id).await;
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].2, some("failed"));
    assert!(r[0].3.is_some(), "the timeout is recorded as the error");
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "retry_scheduled"]
    );
    // The attempt is over: its token is refused everywhere.
    assert_fenced(&h, &id, &c.lease_token).await;
    h.advance_ms(2000);
    assert_eq!(claim_id(&h, &id).await.attempt, 2);
}

async fn heartbeat_past_deadline_kills_the_job(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let id = h.put(job("t").deadline(deadline).max_attempts(5)).await;
    let c = claim_as(&h, "w-1", 20_000, 1).await.remove(0);
    h.advance_ms(9_999);
    h.queue.heartbeat(&id, &c.lease_token).await.unwrap();
    h.advance_ms(1);
    assert_lost(h.queue.heartbeat(&id, &c.lease_token).await, &id);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.finished_at, Some(deadline));
    assert_eq!(j.attempts_used, 1);
    assert_eq!(last_event(&h, &id, "dead").await["reason"], "deadline");
    assert_eq!(outcomes(&h, &id).await, vec![some("failed")]);
    assert_fenced(&h, &id, &c.lease_token).await;
    assert_eq!(state(&h, &id).await, JobState::Dead);
}

// ---------------------------------------------------------------- complete

async fn complete_stores_the_result(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    h.advance_ms(1234);
    let now = h.now().await;
    let result = json!({"charged": 4200, "currency": "EUR", "ok": true});
    h.queue
        .complete(&id, &c.lease_token, Some(result.clone()))
        .await
        .unwrap();
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.result, Some(result));
    assert_eq!(j.finished_at, Some(now));
    assert_eq!(j.attempt, 1);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(j.lease_expires_at, None);
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "completed"]
    );
    let ledger = h.queue.runs(&id).await.unwrap();
    assert_eq!(ledger.len(), 1);
    assert_eq!(ledger[0].outcome, some("completed"));
    assert_eq!(ledger[0].finished_at, Some(now));
    assert_eq!(ledger[0].error, None);
    // `wait` returns the finished job at once.
    let waited = h.queue.wait(&id, Duration::from_secs(5)).await.unwrap();
    assert_eq!(waited.state, JobState::Completed);
}

async fn complete_without_result(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    complete(&h, &c).await;
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.result, None);
    assert!(h.claim(10).await.is_empty());
}

async fn complete_after_deadline_by_the_holder_is_accepted(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let id = h.put(job("t").deadline(deadline)).await;
    let c = claim_id(&h, &id).await; // 30 s lease
    h.advance_ms(20_000);
    h.queue
        .complete(&id, &c.lease_token, Some(json!("done late")))
        .await
        .unwrap();
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.result, Some(json!("done late")));
    assert_eq!(outcomes(&h, &id).await, vec![some("completed")]);
}

async fn complete_after_timeout_before_it_is_recorded_is_accepted(h: Harness) {
    let id = h.put(job("t").timeout(Duration::from_secs(1))).await;
    let c = claim_as(&h, "w-1", 1000, 1).await.remove(0);
    // Past both the timeout and the lease, but nothing recorded either.
    h.advance_ms(3000);
    complete(&h, &c).await;
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(outcomes(&h, &id).await, vec![some("completed")]);
}

// ---------------------------------------------------------------- fail

async fn fail_schedules_a_retry_by_the_fixed_policy(h: Harness) {
    let id = h.put(job("t").retry(fixed(5000)).max_attempts(3)).await;
    let c = claim_id(&h, &id).await;
    h.advance_ms(100);
    let now = h.now().await;
    let out = fail(&h, &c, error("card declined")).await;
    assert_eq!(
        out,
        FailOutcome {
            state: JobState::Scheduled,
            next_run_at: Some(at(now, ms(5000)))
        }
    );
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Scheduled);
    assert_eq!(j.run_at, at(now, ms(5000)));
    assert_eq!(j.attempt, 1);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(j.last_error, some("card declined"));
    assert_eq!(j.lease_expires_at, None);
    assert_eq!(j.finished_at, None);
    let ledger = h.queue.runs(&id).await.unwrap();
    assert_eq!(ledger[0].outcome, some("failed"));
    assert_eq!(ledger[0].error, some("card declined"));
    assert_eq!(ledger[0].finished_at, Some(now));
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "retry_scheduled"]
    );
    h.advance_ms(4999);
    assert!(h.claim(10).await.is_empty());
    h.advance_ms(1);
    let c2 = claim_id(&h, &id).await;
    assert_eq!(c2.attempt, 2);
    // A success afterwards leaves the last error for inspection.
    complete(&h, &c2).await;
    let j = h.job(&id).await;
    assert_eq!(j.attempts_used, 2);
    assert_eq!(
        outcomes(&h, &id).await,
        vec![some("failed"), some("completed")]
    );
}

async fn fail_backs_off_exponentially_without_jitter(h: Harness) {
    let id = h
        .put(
            EnqueueRequest::new("t")
                .retry(RetryPolicy::Exponential {
                    initial_ms: 1000,
                    factor: 2.0,
                    max_ms: 3000,
                    jitter: false,
                })
                .max_attempts(5),
        )
        .await;
    let mut delays = Vec::new();
    for _ in 0..4 {
        let c = claim_id(&h, &id).await;
        let now = h.now().await;
        let out = fail(&h, &c, error("again")).await;
        assert_eq!(out.state, JobState::Scheduled);
        let next = out.next_run_at.expect("next_run_at");
        delays.push((next - now).num_milliseconds());
        h.advance(Duration::from_millis(
            u64::try_from((next - now).num_milliseconds()).unwrap(),
        ));
    }
    assert_eq!(delays, vec![1000, 2000, 3000, 3000]);
    let c = claim_id(&h, &id).await;
    assert_eq!(c.attempt, 5);
    assert_eq!(fail(&h, &c, error("last")).await.state, JobState::Dead);
    assert_eq!(h.job(&id).await.attempts_used, 5);
}

async fn retry_after_overrides_the_backoff(h: Harness) {
    let id = h.put(job("t").retry(fixed(60_000))).await;
    let c = claim_id(&h, &id).await;
    let now = h.now().await;
    let out = fail(
        &h,
        &c,
        FailOptions {
            retry_after: Some(Duration::from_millis(250)),
            ..error("rate limited")
        },
    )
    .await;
    assert_eq!(out.next_run_at, Some(at(now, ms(250))));
    assert_eq!(h.job(&id).await.run_at, at(now, ms(250)));
    assert_eq!(h.job(&id).await.attempts_used, 1, "the attempt is consumed");
    h.advance_ms(250);
    assert_eq!(claim_id(&h, &id).await.attempt, 2);
}

async fn zero_retry_after_is_ready_at_once(h: Harness) {
    let id = h.put(job("t").retry(fixed(60_000))).await;
    let c = claim_id(&h, &id).await;
    let now = h.now().await;
    let out = fail(
        &h,
        &c,
        FailOptions {
            retry_after: Some(Duration::ZERO),
            ..error("try again now")
        },
    )
    .await;
    // The answer carries the derived state, like every read (docs/state-machine.md).
    assert_eq!(
        out,
        FailOutcome {
            state: JobState::Ready,
            next_run_at: Some(now)
        }
    );
    assert_eq!(state(&h, &id).await, JobState::Ready);
    assert_eq!(h.job(&id).await.attempts_used, 1);
    let c = claim_id(&h, &id).await;
    let out = fail(
        &h,
        &c,
        FailOptions {
            snooze: Some(Duration::ZERO),
            ..FailOptions::default()
        },
    )
    .await;
    assert_eq!(out.state, JobState::Ready);
    assert_eq!(claim_id(&h, &id).await.attempt, 3);
}

async fn retry_policy_none_is_dead_on_first_failure(h: Harness) {
    let id = h
        .put(EnqueueRequest::new("t").retry(RetryPolicy::None))
        .await;
    let c = claim_id(&h, &id).await;
    let now = h.now().await;
    // Even an error's own retry_after does not retry under `none`.
    let out = fail(
        &h,
        &c,
        FailOptions {
            retry_after: Some(Duration::from_secs(1)),
            ..error("nope")
        },
    )
    .await;
    assert_eq!(
        out,
        FailOutcome {
            state: JobState::Dead,
            next_run_at: None
        }
    );
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.max_attempts, 10);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(j.finished_at, Some(now));
    assert_eq!(j.last_error, some("nope"));
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "dead"]
    );
    assert_eq!(outcomes(&h, &id).await, vec![some("failed")]);
}

async fn permanent_failure_is_dead_at_once(h: Harness) {
    let id = h.put(job("t").max_attempts(10)).await;
    let c = claim_id(&h, &id).await;
    let out = fail(
        &h,
        &c,
        FailOptions {
            permanent: true,
            retry_after: Some(Duration::from_secs(1)),
            ..error("invalid card")
        },
    )
    .await;
    assert_eq!(out.state, JobState::Dead);
    assert_eq!(out.next_run_at, None);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(j.last_error, some("invalid card"));
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "dead"]
    );
    h.advance_ms(10_000);
    assert!(h.claim(10).await.is_empty());
}

async fn exhausted_budget_is_dead(h: Harness) {
    let id = h.put(job("t").max_attempts(2)).await;
    let c1 = claim_id(&h, &id).await;
    assert_eq!(fail(&h, &c1, error("one")).await.state, JobState::Scheduled);
    h.advance_ms(1000);
    let c2 = claim_id(&h, &id).await;
    assert_eq!(c2.attempt, 2);
    let out = fail(&h, &c2, error("two")).await;
    assert_eq!(out.state, JobState::Dead);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempts_used, 2);
    assert_eq!(j.last_error, some("two"));
    let r = runs(&h, &id).await;
    assert_eq!(
        r.iter().map(|r| r.3.clone()).collect::<Vec<_>>(),
        vec![some("one"), some("two")]
    );
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "retry_scheduled", "claimed", "dead"]
    );
}

async fn retry_at_or_after_the_deadline_is_dead_at_once(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let before = h.put(job("t").retry(fixed(9_999)).deadline(deadline)).await;
    let exactly = h
        .put(job("t").retry(fixed(10_000)).deadline(deadline))
        .await;
    let after = h.put(job("t").retry(fixed(1000)).deadline(deadline)).await;
    let cb = claim_id(&h, &before).await;
    let ce = claim_id(&h, &exactly).await;
    let ca = claim_id(&h, &after).await;

    let out = fail(&h, &cb, error("x")).await;
    assert_eq!(out.state, JobState::Scheduled);
    assert_eq!(out.next_run_at, Some(at(deadline, ms(-1))));

    let out = fail(&h, &ce, error("x")).await;
    assert_eq!(out.state, JobState::Dead);
    assert_eq!(last_event(&h, &exactly, "dead").await["reason"], "deadline");

    // retry_after counts too.
    let out = fail(
        &h,
        &ca,
        FailOptions {
            retry_after: Some(Duration::from_secs(11)),
            ..error("x")
        },
    )
    .await;
    assert_eq!(out.state, JobState::Dead);
    let j = h.job(&after).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(last_event(&h, &after, "dead").await["reason"], "deadline");
}

async fn error_text_is_truncated_to_8_kib(h: Harness) {
    let ascii = h.put(job("t")).await;
    let wide = h.put(job("t")).await;
    let short = h.put(job("t")).await;
    let c = h.claim(3).await;
    fail(&h, &c[0], error(&"e".repeat(20_000))).await;
    // 3-byte characters: the cut falls on a character boundary.
    fail(&h, &c[1], error(&"€".repeat(5000))).await;
    fail(&h, &c[2], error(&"s".repeat(8192))).await;
    let e = runs(&h, &ascii).await.remove(0).3.unwrap();
    assert_eq!(e, "e".repeat(8192));
    let e = runs(&h, &wide).await.remove(0).3.unwrap();
    assert_eq!(e, "€".repeat(2730));
    let e = runs(&h, &short).await.remove(0).3.unwrap();
    assert_eq!(e, "s".repeat(8192));
    let last = h.job(&ascii).await.last_error.unwrap();
    assert!(last.len() <= 8192 && last.starts_with("eee"));
}

// ---------------------------------------------------------------- snooze and release

async fn snooze_reschedules_without_consuming_the_attempt(h: Harness) {
    let id = h.put(job("t").max_attempts(1)).await;
    let c = claim_id(&h, &id).await;
    let now = h.now().await;
    let out = fail(
        &h,
        &c,
        FailOptions {
            snooze: Some(Duration::from_secs(60)),
            ..FailOptions::default()
        },
    )
    .await;
    assert_eq!(
        out,
        FailOutcome {
            state: JobState::Scheduled,
            next_run_at: Some(at(now, secs(60)))
        }
    );
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Scheduled);
    assert_eq!(j.run_at, at(now, secs(60)));
    assert_eq!(j.attempts_used, 0);
    assert_eq!(j.attempt, 1);
    assert_eq!(outcomes(&h, &id).await, vec![some("snoozed")]);
    assert_fenced(&h, &id, &c.lease_token).await;
    h.advance_ms(59_999);
    assert!(h.claim(10).await.is_empty());
    h.advance_ms(1);
    // The one-attempt budget is still whole.
    let c2 = claim_id(&h, &id).await;
    assert_eq!(c2.attempt, 2);
    assert_eq!(fail(&h, &c2, error("x")).await.state, JobState::Dead);
    let j = h.job(&id).await;
    assert_eq!(j.attempts_used, 1);
    assert_eq!(
        outcomes(&h, &id).await,
        vec![some("snoozed"), some("failed")]
    );
}

async fn snooze_ignores_permanent_and_retry_policy(h: Harness) {
    let id = h
        .put(EnqueueRequest::new("t").retry(RetryPolicy::None))
        .await;
    let c = claim_id(&h, &id).await;
    let now = h.now().await;
    let out = fail(
        &h,
        &c,
        FailOptions {
            error: "not yet".into(),
            permanent: true,
            retry_after: Some(Duration::from_secs(1)),
            snooze: Some(Duration::from_secs(5)),
        },
    )
    .await;
    assert_eq!(out.state, JobState::Scheduled);
    assert_eq!(out.next_run_at, Some(at(now, secs(5))));
    let j = h.job(&id).await;
    assert_eq!(j.attempts_used, 0);
    assert_eq!(j.run_at, at(now, secs(5)));
}

async fn snooze_to_or_past_the_deadline_is_dead(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let ok = h.put(job("t").deadline(deadline)).await;
    let exactly = h.put(job("t").deadline(deadline)).await;
    let c = h.claim(2).await;
    let snooze = |ms: u64| FailOptions {
        snooze: Some(Duration::from_millis(ms)),
        ..FailOptions::default()
    };
    let out = fail(&h, &c[0], snooze(9_999)).await;
    assert_eq!(out.state, JobState::Scheduled);
    assert_eq!(h.job(&ok).await.attempts_used, 0);
    let out = fail(&h, &c[1], snooze(10_000)).await;
    assert_eq!(out.state, JobState::Dead);
    let j = h.job(&exactly).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempts_used, 0);
    assert_eq!(last_event(&h, &exactly, "dead").await["reason"], "deadline");
}

async fn release_makes_the_job_ready_at_once(h: Harness) {
    let id = h.put(job("t").max_attempts(1)).await;
    let c = claim_id(&h, &id).await;
    h.advance_ms(700);
    let now = h.now().await;
    let released = h.queue.release(&id, &c.lease_token).await.unwrap();
    assert_eq!(released, JobState::Ready);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Ready);
    assert_eq!(j.run_at, now);
    assert_eq!(j.attempts_used, 0);
    assert_eq!(j.lease_expires_at, None);
    assert_eq!(j.finished_at, None);
    assert_eq!(outcomes(&h, &id).await, vec![some("released")]);
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "released"]
    );
    assert_fenced(&h, &id, &c.lease_token).await;
    let c2 = claim_id(&h, &id).await;
    assert_eq!(c2.attempt, 2);
    complete(&h, &c2).await;
    let j = h.job(&id).await;
    assert_eq!((j.attempt, j.attempts_used), (2, 1));
}

// ---------------------------------------------------------------- cancel

async fn cancel_of_a_waiting_job_is_immediate(h: Harness) {
    let ready = h.put(job("t")).await;
    let scheduled = h.put(job("t").delay(Duration::from_secs(60))).await;
    let retrying = h.put(job("t")).await;
    let c = h.claim(2).await;
    assert_eq!(ids(&c), vec![ready.clone(), retrying.clone()]);
    h.queue.release(&ready, &c[0].lease_token).await.unwrap();
    fail(&h, &c[1], error("x")).await;
    h.advance_ms(10);
    let now = h.now().await;
    for id in [&ready, &scheduled, &retrying] {
        let out = h.queue.cancel(id).await.unwrap();
        assert_eq!(
            out,
            CancelOutcome {
                cancelled: true,
                state: JobState::Cancelled
            }
        );
        let j = h.job(id).await;
        assert_eq!(j.state, JobState::Cancelled);
        assert_eq!(j.finished_at, Some(now));
        assert_eq!(h.event_kinds(id).await.last().unwrap(), "cancelled");
    }
    h.advance_ms(3_600_000);
    assert!(h.claim(10).await.is_empty());
    assert!(matches!(
        h.queue.cancel("no-such-job").await,
        Err(Error::NotFound { .. })
    ));
}

async fn cancel_then_complete_completes(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    h.queue.cancel(&id).await.unwrap();
    h.queue
        .complete(&id, &c.lease_token, Some(json!("effect happened")))
        .await
        .unwrap();
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Completed);
    assert_eq!(j.result, Some(json!("effect happened")));
    assert_eq!(outcomes(&h, &id).await, vec![some("completed")]);
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "cancel_requested", "completed"]
    );
}

async fn cancel_then_fail_cancels(h: Harness) {
    let retryable = h.put(job("t")).await;
    let permanent = h.put(job("t")).await;
    let c = h.claim(2).await;
    h.queue.cancel(&retryable).await.unwrap();
    h.queue.cancel(&permanent).await.unwrap();
    let now = h.now().await;
    let out = fail(&h, &c[0], error("stopped")).await;
    assert_eq!(
        out,
        FailOutcome {
            state: JobState::Cancelled,
            next_run_at: None
        }
    );
    let out = fail(
        &h,
        &c[1],
        FailOptions {
            permanent: true,
            ..error("stopped")
        },
    )
    .await;
    assert_eq!(out.state, JobState::Cancelled);
    for id in [&retryable, &permanent] {
        let j = h.job(id).await;
        assert_eq!(j.state, JobState::Cancelled);
        assert_eq!(j.finished_at, Some(now));
        assert_eq!(j.attempts_used, 1);
        assert_eq!(outcomes(&h, id).await, vec![some("cancelled")]);
        assert_eq!(
            h.event_kinds(id).await,
            vec!["accepted", "claimed", "cancel_requested", "cancelled"]
        );
    }
    h.advance_ms(60_000);
    assert!(h.claim(10).await.is_empty());
}

async fn cancel_then_snooze_cancels(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    h.queue.cancel(&id).await.unwrap();
    let out = fail(
        &h,
        &c,
        FailOptions {
            snooze: Some(Duration::from_secs(5)),
            ..FailOptions::default()
        },
    )
    .await;
    assert_eq!(out.state, JobState::Cancelled);
    assert_eq!(state(&h, &id).await, JobState::Cancelled);
    assert_eq!(outcomes(&h, &id).await, vec![some("cancelled")]);
}

async fn cancel_then_release_cancels(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    h.queue.cancel(&id).await.unwrap();
    let released = h.queue.release(&id, &c.lease_token).await.unwrap();
    assert_eq!(
        released,
        JobState::Cancelled,
        "the release says what it did"
    );
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(j.attempts_used, 0, "a released attempt is not consumed");
    assert_eq!(outcomes(&h, &id).await, vec![some("cancelled")]);
    assert_eq!(
        h.event_kinds(&id).await,
        vec!["accepted", "claimed", "cancel_requested", "cancelled"]
    );
    assert!(h.claim(10).await.is_empty());
}

async fn cancel_then_lease_expiry_cancels(h: Harness) {
    let by_claim = h.put(job("t").max_attempts(5)).await;
    let by_reap = h.put(job("t").max_attempts(5)).await;
    let c = claim_as(&h, "w-1", 1000, 2).await;
    assert_eq!(c.len(), 2);
    h.queue.cancel(&by_claim).await.unwrap();
    h.queue.cancel(&by_reap).await.unwrap();
    h.advance_ms(1000);
    assert_eq!(h.queue.reap_leases(1).await.unwrap(), 1);
    assert!(
        h.claim(10).await.is_empty(),
        "a cancelled job is not retried"
    );
    for id in [&by_claim, &by_reap] {
        let j = h.job(id).await;
        assert_eq!(j.state, JobState::Cancelled);
        assert_eq!(j.attempt, 1);
        let kinds = h.event_kinds(id).await;
        assert_eq!(count(&kinds, "lease_expired"), 1);
        assert_eq!(kinds.last().unwrap(), "cancelled");
        assert_eq!(count(&kinds, "claimed"), 1);
    }
}

async fn cancel_then_timeout_cancels(h: Harness) {
    let id = h.put(job("t").timeout(Duration::from_secs(1))).await;
    let c = claim_id(&h, &id).await;
    h.queue.cancel(&id).await.unwrap();
    h.advance_ms(1001);
    assert_lost(h.queue.heartbeat(&id, &c.lease_token).await, &id);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Cancelled);
    assert_eq!(j.attempts_used, 1);
    assert_eq!(h.event_kinds(&id).await.last().unwrap(), "cancelled");
}

async fn cancel_of_a_terminal_job_changes_nothing(h: Harness) {
    let completed = h.put(job("t")).await;
    let dead = h.put(job("t")).await;
    let cancelled = h.put(job("t")).await;
    let c = claim_id(&h, &completed).await;
    complete(&h, &c).await;
    kill(&h, &dead).await;
    h.queue.cancel(&cancelled).await.unwrap();
    h.advance_ms(5000);
    for (id, st) in [
        (&completed, JobState::Completed),
        (&dead, JobState::Dead),
        (&cancelled, JobState::Cancelled),
    ] {
        let before = h.job(id).await;
        let events = h.queue.events(id).await.unwrap();
        let out = h.queue.cancel(id).await.unwrap();
        assert_eq!(
            out,
            CancelOutcome {
                cancelled: false,
                state: st
            }
        );
        assert_eq!(h.job(id).await, before);
        assert_eq!(h.queue.events(id).await.unwrap(), events);
    }
}

// ---------------------------------------------------------------- checkpoints

async fn checkpoint_first_value_wins(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    let put = |name: &'static str, v: serde_json::Value| {
        let q = h.queue.clone();
        let (id, token) = (id.clone(), c.lease_token.clone());
        async move { q.checkpoint_put(&id, &token, name, &v).await.unwrap() }
    };
    assert!(put("charge", json!({"charge_id": "ch_1"})).await);
    assert!(!put("charge", json!({"charge_id": "ch_2"})).await);
    assert!(put("email", json!(true)).await);
    assert_eq!(
        h.queue.checkpoint_get(&id, "charge").await.unwrap(),
        Some(json!({"charge_id": "ch_1"}))
    );
    assert_eq!(h.queue.checkpoint_get(&id, "missing").await.unwrap(), None);
    let all = h.queue.checkpoints(&id).await.unwrap();
    assert_eq!(all.len(), 2);
    assert_eq!(all["charge"], json!({"charge_id": "ch_1"}));
    assert_eq!(all["email"], json!(true));
    let kinds = h.event_kinds(&id).await;
    assert_eq!(count(&kinds, "checkpointed"), 2, "{kinds:?}");
    assert_eq!(
        last_event(&h, &id, "checkpointed").await["name"],
        json!("email")
    );
}

async fn checkpoint_is_seen_by_a_later_attempt(h: Harness) {
    let id = h.put(job("t")).await;
    let c1 = claim_id(&h, &id).await;
    assert!(
        h.queue
            .checkpoint_put(&id, &c1.lease_token, "step-1", &json!(41))
            .await
            .unwrap()
    );
    fail(&h, &c1, error("crashed after step 1")).await;
    // Between attempts the value is readable.
    assert_eq!(
        h.queue.checkpoint_get(&id, "step-1").await.unwrap(),
        Some(json!(41))
    );
    h.advance_ms(1000);
    let c2 = claim_id(&h, &id).await;
    assert_eq!(c2.attempt, 2);
    assert_eq!(
        h.queue.checkpoint_get(&id, "step-1").await.unwrap(),
        Some(json!(41))
    );
    assert!(
        !h.queue
            .checkpoint_put(&id, &c2.lease_token, "step-1", &json!(99))
            .await
            .unwrap()
    );
    assert!(
        h.queue
            .checkpoint_put(&id, &c2.lease_token, "step-2", &json!([1, 2]))
            .await
            .unwrap()
    );
    let all = h.queue.checkpoints(&id).await.unwrap();
    assert_eq!(
        all.into_iter().collect::<Vec<_>>(),
        vec![
            ("step-1".to_string(), json!(41)),
            ("step-2".to_string(), json!([1, 2]))
        ]
    );
    // The first attempt's token cannot add one any more.
    assert_lost(
        h.queue
            .checkpoint_put(&id, &c1.lease_token, "step-3", &json!(0))
            .await,
        &id,
    );
    assert_eq!(h.queue.checkpoint_get(&id, "step-3").await.unwrap(), None);
}

async fn oversized_result_and_checkpoint_are_refused(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    let before = h.job(&id).await;
    let big = json!("x".repeat(1024 * 1024));
    let err = h
        .queue
        .complete(&id, &c.lease_token, Some(big.clone()))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err:?}");
    let err = h
        .queue
        .checkpoint_put(&id, &c.lease_token, "step", &big)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err:?}");
    let err = h
        .queue
        .checkpoint_put(&id, &c.lease_token, "", &json!(1))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Validation { .. }), "{err:?}");
    assert_eq!(h.job(&id).await, before, "nothing changed");
    assert!(h.queue.checkpoints(&id).await.unwrap().is_empty());
    // The attempt goes on: its token still works.
    let fits = json!("x".repeat(1024 * 1024 - 2));
    assert!(
        h.queue
            .checkpoint_put(&id, &c.lease_token, "step", &fits)
            .await
            .unwrap()
    );
    h.queue
        .complete(&id, &c.lease_token, Some(fits.clone()))
        .await
        .unwrap();
    assert_eq!(h.job(&id).await.result, Some(fits));
}

// ---------------------------------------------------------------- deadline

async fn due_job_past_its_deadline_is_not_started(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let late = h
        .put(job("t").priority(5).deadline(deadline).max_attempts(3))
        .await;
    let fine = h.put(job("t")).await;
    h.advance_ms(10_000);
    let now = h.now().await;
    // The late job is first in claim order, yet it is not started.
    let claimed = h.claim(1).await;
    assert_eq!(ids(&claimed), vec![fine]);
    let j = h.job(&late).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.attempt, 0);
    assert_eq!(j.attempts_used, 0);
    assert_eq!(j.finished_at, Some(now));
    assert_eq!(j.last_error, some("deadline"));
    assert!(h.queue.runs(&late).await.unwrap().is_empty());
    assert_eq!(h.event_kinds(&late).await, vec!["accepted", "dead"]);
    assert_eq!(last_event(&h, &late, "dead").await["reason"], "deadline");
}

/// A job waiting for its retry when its deadline passes ends `dead` at the
/// next claim with `deadline` as its last error, not its attempt's error.
async fn a_retry_past_its_deadline_ends_with_the_deadline_as_its_error(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let id = h.put(job("t").deadline(deadline)).await;
    let c = claim_id(&h, &id).await;
    let out = fail(&h, &c, error("flaky")).await;
    assert_eq!(out.state, JobState::Scheduled);
    assert_eq!(h.job(&id).await.last_error, some("flaky"));
    h.advance_ms(15_000);
    assert!(h.claim(10).await.is_empty());
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Dead);
    assert_eq!(j.last_error, some("deadline"));
    assert_eq!(last_event(&h, &id, "dead").await["reason"], "deadline");
}

// ---------------------------------------------------------------- redrive

async fn redrive_puts_a_dead_job_back_to_ready(h: Harness) {
    let id = h
        .put(job("t").max_attempts(2).payload(json!({"n": 1})))
        .await;
    let c = claim_id(&h, &id).await;
    fail(&h, &c, error("one")).await;
    h.advance_ms(1000);
    let c = claim_id(&h, &id).await;
    assert_eq!(fail(&h, &c, error("two")).await.state, JobState::Dead);
    h.advance_ms(5000);
    let now = h.now().await;
    let r = h
        .queue
        .redrive(&id, RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(r.job_id, id);
    assert_eq!(r.outcome, Outcome::Accepted);
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Ready);
    assert_eq!(j.run_at, now);
    assert_eq!(j.attempt, 2);
    assert_eq!(j.attempts_used, 0);
    assert_eq!(j.max_attempts, 2);
    assert_eq!(j.finished_at, None);
    assert_eq!(j.payload, json!({"n": 1}));
    assert_eq!(h.event_kinds(&id).await.last().unwrap(), "redriven");
    assert_eq!(h.jobs().await.len(), 1, "same job, no copy");
    // It gets max_attempts more attempts, and `attempt` keeps counting.
    let c3 = claim_id(&h, &id).await;
    assert_eq!(c3.attempt, 3);
    assert_eq!(
        fail(&h, &c3, error("three")).await.state,
        JobState::Scheduled
    );
    h.advance_ms(1000);
    let c4 = claim_id(&h, &id).await;
    assert_eq!(c4.attempt, 4);
    assert_eq!(fail(&h, &c4, error("four")).await.state, JobState::Dead);
    let j = h.job(&id).await;
    assert_eq!((j.attempt, j.attempts_used), (4, 2));
    assert_eq!(runs(&h, &id).await.len(), 4);
}

async fn redrive_of_a_job_that_is_not_dead_is_refused(h: Harness) {
    let ready = h.put(job("t")).await;
    let scheduled = h.put(job("t").delay(Duration::from_secs(60))).await;
    let active = h.put(job("t")).await;
    let completed = h.put(job("t")).await;
    let cancelled = h.put(job("t")).await;
    let cs = h.claim(3).await;
    assert_eq!(
        ids(&cs),
        vec![ready.clone(), active.clone(), completed.clone()]
    );
    h.queue.release(&ready, &cs[0].lease_token).await.unwrap();
    complete(&h, &cs[2]).await;
    h.queue.cancel(&cancelled).await.unwrap();
    for (id, st) in [
        (&ready, JobState::Ready),
        (&scheduled, JobState::Scheduled),
        (&active, JobState::Active),
        (&completed, JobState::Completed),
        (&cancelled, JobState::Cancelled),
    ] {
        let before = h.job(id).await;
        let events = h.event_kinds(id).await;
        match h.queue.redrive(id, RedriveOptions::default()).await {
            Err(Error::NotDead { job_id, state }) => {
                assert_eq!(&job_id, id);
                assert_eq!(state, st);
            }
            other => panic!("{st}: expected NotDead, got {other:?}"),
        }
        assert_eq!(h.job(id).await, before);
        assert_eq!(h.event_kinds(id).await, events);
    }
    assert!(matches!(
        h.queue
            .redrive("no-such-job", RedriveOptions::default())
            .await,
        Err(Error::NotFound { .. })
    ));
}

async fn redrive_with_a_key_is_replayed_not_repeated(h: Harness) {
    let id = h.put(job("t").max_attempts(1)).await;
    kill(&h, &id).await;
    let keyed = || RedriveOptions {
        idempotency_key: Some("redrive-ticket-77".into()),
        ..RedriveOptions::default()
    };
    let first = h.queue.redrive(&id, keyed()).await.unwrap();
    assert_eq!(
        (first.job_id.as_str(), first.outcome),
        (id.as_str(), Outcome::Accepted)
    );
    // Repeated while the job is ready: a replay, nothing written.
    let events = h.queue.events(&id).await.unwrap();
    let again = h.queue.redrive(&id, keyed()).await.unwrap();
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (id.as_str(), Outcome::Replayed)
    );
    assert_eq!(h.queue.events(&id).await.unwrap(), events);
    // The job dies a second time; the retried request still does not redrive.
    let c = claim_id(&h, &id).await;
    assert_eq!(c.attempt, 2);
    assert_eq!(fail(&h, &c, error("again")).await.state, JobState::Dead);
    let before = h.job(&id).await;
    let replay = h.queue.redrive(&id, keyed()).await.unwrap();
    assert_eq!(replay.outcome, Outcome::Replayed);
    assert_eq!(replay.job_id, id);
    assert_eq!(h.job(&id).await, before);
    assert_eq!(count(&h.event_kinds(&id).await, "redriven"), 1);
    // A redrive without the key is a new operator action.
    let fresh = h
        .queue
        .redrive(&id, RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(fresh.outcome, Outcome::Accepted);
    assert_eq!(count(&h.event_kinds(&id).await, "redriven"), 2);
}

async fn redrive_key_for_another_job_conflicts(h: Harness) {
    let a = h.put(job("t")).await;
    let b = h.put(job("t")).await;
    kill(&h, &a).await;
    kill(&h, &b).await;
    let keyed = || RedriveOptions {
        idempotency_key: Some("ticket-9".into()),
        ..RedriveOptions::default()
    };
    h.queue.redrive(&a, keyed()).await.unwrap();
    let before = h.job(&b).await;
    let err = h.queue.redrive(&b, keyed()).await.unwrap_err();
    let c = err.conflict().expect("an idempotency conflict");
    assert_eq!(c.job_id, a);
    assert!(c.fields.iter().any(|f| f == "job_id"), "{:?}", c.fields);
    assert_eq!(c.scope.as_deref(), Some("idemq.redrive"));
    assert_eq!(h.job(&b).await, before, "b stays dead");
    // The same key for the same job with other overrides conflicts too.
    let err = h
        .queue
        .redrive(
            &a,
            RedriveOptions {
                max_attempts: Some(3),
                ..keyed()
            },
        )
        .await
        .unwrap_err();
    let c = err.conflict().expect("an idempotency conflict");
    assert!(
        c.fields.iter().any(|f| f == "max_attempts"),
        "{:?}",
        c.fields
    );
    assert!(!c.fields.iter().any(|f| f == "job_id"), "{:?}", c.fields);
    let text = format!("{err} {err:?}");
    assert!(!text.contains("ticket-9"), "raw key in the error: {text}");
}

async fn redrive_key_expires_after_a_day(h: Harness) {
    let id = h.put(job("t").max_attempts(1)).await;
    kill(&h, &id).await;
    let keyed = || RedriveOptions {
        idempotency_key: Some("nightly-redrive".into()),
        ..RedriveOptions::default()
    };
    let first = h.queue.redrive(&id, keyed()).await.unwrap();
    assert_eq!(first.outcome, Outcome::Accepted);
    let binding = h
        .queue
        .lookup_key("idemq.redrive", "nightly-redrive")
        .await
        .unwrap()
        .expect("the redrive key is bound");
    assert_eq!(binding.job_id, id);
    assert_eq!(binding.expires_at, at(h.now().await, TimeDelta::hours(24)));
    kill(&h, &id).await;
    h.advance(Duration::from_secs(24 * 3600 - 1));
    assert_eq!(
        h.queue.redrive(&id, keyed()).await.unwrap().outcome,
        Outcome::Replayed
    );
    assert_eq!(state(&h, &id).await, JobState::Dead);
    h.advance(Duration::from_secs(1));
    // The window is over: the same key redrives again.
    assert_eq!(
        h.queue.redrive(&id, keyed()).await.unwrap().outcome,
        Outcome::Accepted
    );
    assert_eq!(state(&h, &id).await, JobState::Ready);
    assert_eq!(count(&h.event_kinds(&id).await, "redriven"), 2);
}

async fn redrive_overrides_max_attempts(h: Harness) {
    let id = h.put(job("t").max_attempts(1)).await;
    kill(&h, &id).await;
    assert!(matches!(
        h.queue
            .redrive(
                &id,
                RedriveOptions {
                    max_attempts: Some(0),
                    ..RedriveOptions::default()
                }
            )
            .await,
        Err(Error::Validation { .. })
    ));
    assert_eq!(state(&h, &id).await, JobState::Dead);
    h.queue
        .redrive(
            &id,
            RedriveOptions {
                max_attempts: Some(3),
                ..RedriveOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(h.job(&id).await.max_attempts, 3);
    for n in 0..3 {
        let c = claim_id(&h, &id).await;
        assert_eq!(c.max_attempts, 3);
        let out = fail(&h, &c, error("x")).await;
        let want = if n < 2 {
            JobState::Scheduled
        } else {
            JobState::Dead
        };
        assert_eq!(out.state, want, "failure {n}");
        h.advance_ms(1000);
    }
    let j = h.job(&id).await;
    assert_eq!((j.attempt, j.attempts_used), (4, 3));
}

async fn redrive_keeps_checkpoints_unless_reset(h: Harness) {
    let keep = h.put(job("t").max_attempts(1)).await;
    let reset = h.put(job("t").max_attempts(1)).await;
    for id in [&keep, &reset] {
        let c = claim_id(&h, id).await;
        h.queue
            .checkpoint_put(id, &c.lease_token, "step", &json!("done"))
            .await
            .unwrap();
        assert_eq!(fail(&h, &c, error("x")).await.state, JobState::Dead);
    }
    h.queue
        .redrive(&keep, RedriveOptions::default())
        .await
        .unwrap();
    h.queue
        .redrive(
            &reset,
            RedriveOptions {
                reset_checkpoints: true,
                ..RedriveOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        h.queue.checkpoint_get(&keep, "step").await.unwrap(),
        Some(json!("done"))
    );
    assert_eq!(h.queue.checkpoint_get(&reset, "step").await.unwrap(), None);
    assert!(h.queue.checkpoints(&reset).await.unwrap().is_empty());
    // The reset job stores the step afresh on its next attempt.
    let c = h.claim(2).await;
    assert_eq!(ids(&c), vec![keep.clone(), reset.clone()]);
    assert!(
        !h.queue
            .checkpoint_put(&keep, &c[0].lease_token, "step", &json!("new"))
            .await
            .unwrap()
    );
    assert!(
        h.queue
            .checkpoint_put(&reset, &c[1].lease_token, "step", &json!("new"))
            .await
            .unwrap()
    );
    assert_eq!(
        h.queue.checkpoint_get(&reset, "step").await.unwrap(),
        Some(json!("new"))
    );
}

async fn redrive_clears_a_passed_deadline(h: Harness) {
    let deadline = at(h.now().await, secs(10));
    let id = h.put(job("t").deadline(deadline)).await;
    h.advance_ms(10_000);
    assert!(h.claim(10).await.is_empty());
    assert_eq!(state(&h, &id).await, JobState::Dead);
    h.queue
        .redrive(&id, RedriveOptions::default())
        .await
        .unwrap();
    let j = h.job(&id).await;
    assert_eq!(j.deadline, None);
    assert_eq!(j.state, JobState::Ready);
    let c = claim_id(&h, &id).await;
    assert_eq!(c.attempt, 1);
    assert_eq!(c.deadline, None);

    // A deadline still ahead is kept.
    let ahead = at(h.now().await, secs(3600));
    let other = h.put(job("t").deadline(ahead)).await;
    kill(&h, &other).await;
    h.queue
        .redrive(&other, RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(h.job(&other).await.deadline, Some(ahead));
}

async fn redrive_with_run_at_and_deadline(h: Harness) {
    let id = h.put(job("t")).await;
    kill(&h, &id).await;
    let now = h.now().await;
    // A new deadline in the past is refused, and nothing changes.
    let err = h
        .queue
        .redrive(
            &id,
            RedriveOptions {
                deadline: Some(at(now, secs(-1))),
                ..RedriveOptions::default()
            },
        )
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Validation { .. }), "{err:?}");
    assert_eq!(state(&h, &id).await, JobState::Dead);
    let run_at = at(now, secs(30));
    let deadline = at(now, secs(60));
    h.queue
        .redrive(
            &id,
            RedriveOptions {
                run_at: Some(run_at),
                deadline: Some(deadline),
                ..RedriveOptions::default()
            },
        )
        .await
        .unwrap();
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Scheduled);
    assert_eq!(j.run_at, run_at);
    assert_eq!(j.deadline, Some(deadline));
    assert!(h.claim(10).await.is_empty());
    h.advance_ms(30_000);
    assert_eq!(claim_id(&h, &id).await.deadline, Some(deadline));
}

async fn redrive_does_not_take_a_dedupe_binding(h: Harness) {
    let keyed = || job("sync").dedupe(DedupeOptions::key("acct-1"));
    // Dead, then redriven before anything else used the key.
    let a = h.put(keyed()).await;
    kill(&h, &a).await;
    h.queue
        .redrive(&a, RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(state(&h, &a).await, JobState::Ready);
    let b = h.queue.enqueue_with_result(keyed()).await.unwrap();
    assert_eq!(
        b.outcome,
        Outcome::Accepted,
        "the redriven job took the key"
    );
    assert_ne!(b.job_id, a);
    // Redriven while another job holds the key: that job keeps it.
    kill(&h, &a).await;
    let c = claim_id(&h, &b.job_id).await;
    complete(&h, &c).await;
    let d = h.put(keyed()).await;
    kill(&h, &d).await;
    let f = h.put(keyed()).await;
    h.queue
        .redrive(&d, RedriveOptions::default())
        .await
        .unwrap();
    let g = h.queue.enqueue_with_result(keyed()).await.unwrap();
    assert_eq!((g.job_id, g.outcome), (f, Outcome::Coalesced));
    let dd = h.job(&d).await.dedupe.expect("d keeps its dedupe key");
    assert_eq!(dd.key, "acct-1");
    assert!(!dd.holds_binding, "the redriven job holds no binding");
}

// ---------------------------------------------------------------- promote

async fn promote_makes_a_scheduled_job_due(h: Harness) {
    let id = h.put(job("t").delay(Duration::from_secs(3600))).await;
    let later = h.put(job("t").delay(Duration::from_secs(7200))).await;
    h.advance_ms(10);
    let now = h.now().await;
    assert!(h.queue.promote(&id).await.unwrap());
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Ready);
    assert_eq!(j.run_at, now);
    assert_eq!(h.event_kinds(&id).await, vec!["accepted", "promoted"]);
    assert_eq!(ids(&h.claim(10).await), vec![id]);
    assert_eq!(state(&h, &later).await, JobState::Scheduled);

    // A job scheduled for a retry can be promoted too.
    let r = h.put(job("t").retry(fixed(60_000))).await;
    let c = claim_id(&h, &r).await;
    fail(&h, &c, error("x")).await;
    assert!(h.queue.promote(&r).await.unwrap());
    assert_eq!(claim_id(&h, &r).await.attempt, 2);
}

async fn promote_of_a_job_that_is_not_scheduled_is_false(h: Harness) {
    let ready = h.put(job("t")).await;
    let active = h.put(job("t")).await;
    let done = h.put(job("t")).await;
    let cancelled = h.put(job("t").delay(Duration::from_secs(60))).await;
    let cs = h.claim(3).await;
    assert_eq!(ids(&cs), vec![ready.clone(), active.clone(), done.clone()]);
    h.queue.release(&ready, &cs[0].lease_token).await.unwrap();
    complete(&h, &cs[2]).await;
    h.queue.cancel(&cancelled).await.unwrap();
    for id in [&ready, &active, &done, &cancelled] {
        let before = h.job(id).await;
        assert!(
            !h.queue.promote(id).await.unwrap(),
            "promoted {}",
            before.state
        );
        assert_eq!(h.job(id).await, before);
        assert_eq!(count(&h.event_kinds(id).await, "promoted"), 0);
    }
    assert!(matches!(
        h.queue.promote("no-such-job").await,
        Err(Error::NotFound { .. })
    ));
}

// ---------------------------------------------------------------- events

async fn every_state_change_writes_its_event(h: Harness) {
    let id = h
        .put(job("t").delay(Duration::from_secs(60)).max_attempts(5))
        .await;
    assert!(h.queue.promote(&id).await.unwrap());
    let c = claim_as(&h, "w-1", 1000, 1).await.remove(0);
    h.queue
        .checkpoint_put(&id, &c.lease_token, "a", &json!(1))
        .await
        .unwrap();
    h.queue.release(&id, &c.lease_token).await.unwrap();
    let c = claim_as(&h, "w-1", 1000, 1).await.remove(0);
    fail(&h, &c, error("x")).await;
    h.advance_ms(1000);
    claim_as(&h, "w-1", 1000, 1).await;
    h.advance_ms(1000);
    let c = claim_as(&h, "w-1", 1000, 1).await.remove(0);
    assert_eq!(c.attempt, 4);
    h.queue.cancel(&id).await.unwrap();
    h.advance_ms(100);
    let now = h.now().await;
    complete(&h, &c).await;
    assert_eq!(
        h.event_kinds(&id).await,
        vec![
            "accepted",
            "promoted",
            "claimed",
            "checkpointed",
            "released",
            "claimed",
            "retry_scheduled",
            "claimed",
            "lease_expired",
            "claimed",
            "cancel_requested",
            "completed",
        ]
    );
    let events = h.queue.events(&id).await.unwrap();
    assert_eq!(events.last().unwrap().at, now);
    assert!(events.windows(2).all(|w| w[0].seq < w[1].seq));
    assert!(events.windows(2).all(|w| w[0].at <= w[1].at));

    let other = h.put(job("t").max_attempts(1)).await;
    kill(&h, &other).await;
    h.queue
        .redrive(&other, RedriveOptions::default())
        .await
        .unwrap();
    h.queue.cancel(&other).await.unwrap();
    assert_eq!(
        h.event_kinds(&other).await,
        vec!["accepted", "claimed", "dead", "redriven", "cancelled"]
    );
}

// ---------------------------------------------------------------- races

async fn concurrent_claimers_take_each_job_once(h: Harness) {
    let reqs: Vec<EnqueueRequest> = (0..200).map(|i| job("t").payload(json!(i))).collect();
    for r in h
        .queue
        .enqueue_many(reqs, idemq::BatchOptions::default())
        .await
        .unwrap()
    {
        assert_eq!(r.unwrap().outcome, Outcome::Accepted);
    }
    let mut tasks = Vec::new();
    for w in 0..8 {
        let q = h.queue.clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = q
                    .claim(ClaimOptions {
                        worker: format!("w-{w}"),
                        limit: 7,
                        ..ClaimOptions::default()
                    })
                    .await
                    .expect("claim");
                if got.is_empty() {
                    return mine;
                }
                mine.extend(got);
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.expect("task"));
    }
    assert_eq!(all.len(), 200, "every job claimed, none twice");
    let unique: HashSet<&str> = all.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(unique.len(), 200);
    let tokens: HashSet<&str> = all.iter().map(|c| c.lease_token.as_str()).collect();
    assert_eq!(tokens.len(), 200);
    assert!(all.iter().all(|c| c.attempt == 1));
    let jobs = h.jobs().await;
    assert_eq!(jobs.len(), 200);
    assert!(
        jobs.iter()
            .all(|j| j.state == JobState::Active && j.attempt == 1)
    );
    for j in jobs.iter().take(20) {
        assert_eq!(h.queue.runs(&j.id).await.unwrap().len(), 1);
    }
}

/// `Queue::wait` blocks while the job is active, returns as soon as it
/// finishes, and returns the job as it is when the timeout passes first.
async fn wait_returns_when_the_job_finishes_not_before(h: Harness) {
    let id = h.put(job("t")).await;
    let c = claim_id(&h, &id).await;
    let q = h.queue.clone();
    let waiting_for = id.clone();
    let waiter = tokio::spawn(async move { q.wait(&waiting_for, Duration::from_secs(20)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiter.is_finished(),
        "the waiter waits while the job is active"
    );
    let t = tokio::time::Instant::now();
    complete(&h, &c).await;
    let waited = waiter.await.unwrap().unwrap();
    assert_eq!(waited.state, JobState::Completed);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "returned soon after the completion"
    );
    // A timeout that passes first returns the job unfinished.
    let other = h.put(job("t")).await;
    let start = tokio::time::Instant::now();
    let j = h
        .queue
        .wait(&other, Duration::from_millis(200))
        .await
        .unwrap();
    assert_eq!(j.state, JobState::Ready);
    assert!(start.elapsed() >= Duration::from_millis(200));
}
