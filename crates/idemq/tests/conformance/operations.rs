//! Conformance cases: operator queries and maintenance (docs/state-machine.md, docs/idempotency.md, docs/worker.md, docs/operating.md and
//! the API's job and queue queries): get, list, queues, purge, promote,
//! explain, retention and binding sweeps.

use std::time::Duration;

use idemq::store::{ExplainConflict, ExplainDedupe, ExplainIdempotency};
use idemq::{
    DedupeMode, DedupeOptions, EnqueueRequest, Error, Explain, FailOptions, IdempotencyOptions,
    JobList, JobState, Outcome, QueueInfo, RedriveOptions, StateCounts,
};
use idemq_testkit::Harness;
use serde_json::json;

idemq_testkit::instantiate!(
    get_unknown_is_none,
    get_returns_the_job_as_accepted,
    list_is_newest_first,
    list_filters_by_queue_type_and_tag,
    list_filters_by_derived_state,
    list_state_follows_the_clock,
    list_pages_without_repeats_or_gaps,
    list_pages_with_a_filter,
    list_last_page_has_no_cursor,
    list_cursor_is_stable_when_jobs_arrive,
    list_limit_bounds,
    list_unknown_cursor_is_refused,
    queues_count_per_queue_and_state,
    queues_derive_scheduled_and_ready_from_the_clock,
    queues_include_paused_queues_without_jobs,
    purge_of_an_active_job_changes_nothing,
    purge_of_an_unknown_job_is_false,
    purge_deletes_events_runs_and_checkpoints,
    purge_of_waiting_and_terminal_jobs,
    promote_makes_a_scheduled_job_ready,
    promote_of_a_job_that_is_not_scheduled_is_false,
    explain_writes_nothing,
    explain_reports_a_replay_and_its_holder,
    explain_reports_a_conflict,
    explain_reports_the_dedupe_holder,
    explain_does_not_rearm_a_debounce_window,
    explain_of_a_replace_changes_nothing,
    explain_of_an_invalid_request_is_refused_like_enqueue,
    explain_after_the_binding_expired_is_accepted,
    retention_keeps_completed_and_cancelled_24_hours,
    retention_keeps_dead_14_days,
    retention_honours_explicit_keep,
    retention_with_keep_zero_deletes_at_the_next_sweep,
    retention_waits_for_a_live_idempotency_binding,
    retention_keeps_keep_when_longer_than_the_binding,
    retention_waits_for_the_latest_binding_of_a_job,
    retention_after_a_released_binding,
    retention_never_deletes_pending_jobs,
    retention_limit_bounds_one_pass,
    sweep_bindings_removes_expired_bindings,
    sweep_bindings_limit_bounds_one_pass,
    sweep_bindings_limit_counts_both_kinds,
    sweep_bindings_removes_dedupe_bindings_no_longer_live,
    stats_count_every_enqueue_and_claim,
    stats_count_what_claims_heartbeats_and_the_reaper_record,
);

const HOUR_MS: u64 = 3600 * 1000;
const DAY_MS: u64 = 24 * HOUR_MS;

fn t() -> EnqueueRequest {
    EnqueueRequest::new("t")
}

fn item(n: i64) -> EnqueueRequest {
    t().payload(json!({ "n": n }))
}

/// Enqueues `req`, which must be the only ready job, and claims it.
async fn active(h: &Harness, req: EnqueueRequest) -> (String, idemq::LeaseToken) {
    let id = h.put(req).await;
    let c = h.claim_one().await;
    assert_eq!(c.id, id, "the job is the only ready one");
    (id, c.lease_token)
}

async fn completed(h: &Harness, req: EnqueueRequest) -> String {
    let (id, token) = active(h, req).await;
    h.queue.complete(&id, &token, None).await.unwrap();
    assert_eq!(h.job(&id).await.state, JobState::Completed);
    id
}

async fn dead(h: &Harness, req: EnqueueRequest) -> String {
    let (id, token) = active(h, req).await;
    let out = h
        .queue
        .fail(
            &id,
            &token,
            FailOptions {
                error: "boom".into(),
                permanent: true,
                ..FailOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(out.state, JobState::Dead);
    id
}

async fn cancelled(h: &Harness, req: EnqueueRequest) -> String {
    let id = h.put(req).await;
    assert!(h.queue.cancel(&id).await.unwrap().cancelled);
    assert_eq!(h.job(&id).await.state, JobState::Cancelled);
    id
}

async fn list(h: &Harness, filter: JobList) -> Vec<String> {
    let page = h
        .queue
        .list(JobList {
            limit: 1000,
            ..filter
        })
        .await
        .unwrap();
    assert_eq!(page.next_cursor, None);
    page.jobs.into_iter().map(|j| j.id).collect()
}

fn by_state(state: JobState) -> JobList {
    JobList {
        state: Some(state),
        ..JobList::default()
    }
}

/// Every page of `filter` at `limit` per page.
async fn pages(h: &Harness, filter: JobList, limit: u32) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let page = h
            .queue
            .list(JobList {
                limit,
                cursor: cursor.clone(),
                ..filter.clone()
            })
            .await
            .unwrap();
        out.push(page.jobs.into_iter().map(|j| j.id).collect());
        assert!(out.len() <= 100, "paging does not end");
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return out,
        }
    }
}

async fn exists(h: &Harness, id: &str) -> bool {
    h.queue.get(id).await.unwrap().is_some()
}

async fn sweep(h: &Harness) -> u64 {
    h.queue.sweep_retention(1000).await.unwrap()
}

async fn get_unknown_is_none(h: Harness) {
    assert!(h.queue.get("no-such-job").await.unwrap().is_none());
    h.put(t().job_id("a")).await;
    assert!(h.queue.get("b").await.unwrap().is_none());
    assert!(h.queue.get("A").await.unwrap().is_none(), "ids are exact");
    assert!(h.queue.get("").await.unwrap().is_none());
}

async fn get_returns_the_job_as_accepted(h: Harness) {
    let now = h.now().await;
    let id = h
        .put(
            EnqueueRequest::new("invoice.capture")
                .queue("billing")
                .payload(json!({"invoice": 42}))
                .priority(5)
                .max_attempts(3)
                .timeout(Duration::from_secs(60))
                .concurrency_key("acct-1")
                .tag("b")
                .tag("a")
                .keep(Duration::from_secs(10)),
        )
        .await;
    let j = h.job(&id).await;
    assert_eq!(j.id, id);
    assert_eq!(
        (j.job_type.as_str(), j.queue.as_str()),
        ("invoice.capture", "billing")
    );
    assert_eq!(j.state, JobState::Ready);
    assert_eq!(j.payload, json!({"invoice": 42}));
    assert_eq!(j.result, None);
    assert_eq!((j.priority, j.attempt, j.attempts_used), (5, 0, 0));
    assert_eq!((j.max_attempts, j.timeout_ms), (3, 60_000));
    assert_eq!((j.run_at, j.created_at, j.finished_at), (now, now, None));
    assert_eq!(j.concurrency_key.as_deref(), Some("acct-1"));
    assert_eq!(j.tags, vec!["a", "b"]);
    assert_eq!(j.keep_ms, Some(10_000));
    assert_eq!((j.idempotency, j.dedupe), (None, None));
}

async fn list_is_newest_first(h: Harness) {
    let mut ids = Vec::new();
    for n in 0..5 {
        ids.push(h.put(item(n)).await);
        h.advance_ms(1);
    }
    // A scheduled job is still ordered by acceptance, not by run_at.
    ids.push(h.put(item(5).delay(Duration::from_secs(3600))).await);
    ids.push(h.put(item(6)).await);
    ids.reverse();
    assert_eq!(list(&h, JobList::default()).await, ids);
}

async fn list_filters_by_queue_type_and_tag(h: Harness) {
    let a = h.put(EnqueueRequest::new("t1").queue("q1").tag("x")).await;
    let b = h
        .put(EnqueueRequest::new("t2").queue("q1").tag("x").tag("y"))
        .await;
    let c = h.put(EnqueueRequest::new("t1").queue("q2").tag("y")).await;
    let d = h.put(EnqueueRequest::new("t2").queue("q2")).await;
    let e = h.put(EnqueueRequest::new("t1").queue("q1").tag("xy")).await;
    let f = |queue: Option<&str>, job_type: Option<&str>, tag: Option<&str>| JobList {
        queue: queue.map(String::from),
        job_type: job_type.map(String::from),
        tag: tag.map(String::from),
        ..JobList::default()
    };
    assert_eq!(
        list(&h, f(Some("q1"), None, None)).await,
        [e.as_str(), b.as_str(), a.as_str()]
    );
    assert_eq!(
        list(&h, f(Some("q2"), None, None)).await,
        [d.as_str(), c.as_str()]
    );
    assert_eq!(
        list(&h, f(None, Some("t1"), None)).await,
        [e.as_str(), c.as_str(), a.as_str()]
    );
    assert_eq!(
        list(&h, f(None, None, Some("x"))).await,
        [b.as_str(), a.as_str()]
    );
    assert_eq!(
        list(&h, f(None, None, Some("y"))).await,
        [c.as_str(), b.as_str()]
    );
    assert_eq!(list(&h, f(None, None, Some("xy"))).await, [e.as_str()]);
    assert_eq!(
        list(&h, f(Some("q2"), Some("t2"), None)).await,
        [d.as_str()]
    );
    assert_eq!(
        list(&h, f(Some("q1"), Some("t2"), Some("y"))).await,
        [b.as_str()]
    );
    assert!(list(&h, f(Some("q3"), None, None)).await.is_empty());
    assert!(list(&h, f(None, Some("t"), None)).await.is_empty());
    assert!(list(&h, f(Some("q2"), None, Some("x"))).await.is_empty());
    let ready_q2 = JobList {
        state: Some(JobState::Ready),
        ..f(Some("q2"), None, None)
    };
    assert_eq!(list(&h, ready_q2).await, [d.as_str(), c.as_str()]);
}

async fn list_filters_by_derived_state(h: Harness) {
    let done = completed(&h, item(1)).await;
    let gone = dead(&h, item(2)).await;
    let (running, _) = active(&h, item(3)).await;
    let stopped = cancelled(&h, item(4)).await;
    let later = h.put(item(5).delay(Duration::from_secs(10))).await;
    let now = h.put(item(6)).await;
    assert_eq!(
        list(&h, by_state(JobState::Scheduled)).await,
        [later.as_str()]
    );
    assert_eq!(list(&h, by_state(JobState::Ready)).await, [now.as_str()]);
    assert_eq!(
        list(&h, by_state(JobState::Active)).await,
        [running.as_str()]
    );
    assert_eq!(
        list(&h, by_state(JobState::Completed)).await,
        [done.as_str()]
    );
    assert_eq!(list(&h, by_state(JobState::Dead)).await, [gone.as_str()]);
    assert_eq!(
        list(&h, by_state(JobState::Cancelled)).await,
        [stopped.as_str()]
    );
    let all = list(&h, JobList::default()).await;
    assert_eq!(
        all,
        [
            now.as_str(),
            later.as_str(),
            stopped.as_str(),
            running.as_str(),
            gone.as_str(),
            done.as_str()
        ]
    );
    for j in h.jobs().await {
        let want = [
            (&done, JobState::Completed),
            (&gone, JobState::Dead),
            (&running, JobState::Active),
            (&stopped, JobState::Cancelled),
            (&later, JobState::Scheduled),
            (&now, JobState::Ready),
        ]
        .into_iter()
        .find(|(id, _)| **id == j.id)
        .map(|(_, s)| s);
        assert_eq!(Some(j.state), want, "state of {}", j.id);
    }
}

async fn list_state_follows_the_clock(h: Harness) {
    let later = h.put(item(1).delay(Duration::from_secs(10))).await;
    let now = h.put(item(2)).await;
    assert_eq!(h.job(&later).await.state, JobState::Scheduled);
    h.advance_ms(9_999);
    assert_eq!(
        list(&h, by_state(JobState::Scheduled)).await,
        [later.as_str()]
    );
    h.advance_ms(1);
    // Nothing was written: the clock alone made it ready.
    assert!(list(&h, by_state(JobState::Scheduled)).await.is_empty());
    assert_eq!(
        list(&h, by_state(JobState::Ready)).await,
        [now.as_str(), later.as_str()]
    );
    assert_eq!(h.job(&later).await.state, JobState::Ready);
    assert_eq!(h.event_kinds(&later).await, vec!["accepted"]);
}

async fn list_pages_without_repeats_or_gaps(h: Harness) {
    let mut ids = Vec::new();
    for n in 0..25 {
        ids.push(h.put(item(n)).await);
    }
    ids.reverse();
    let got = pages(&h, JobList::default(), 7).await;
    assert_eq!(
        got.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![7, 7, 7, 4]
    );
    assert_eq!(got.concat(), ids);
    let got = pages(&h, JobList::default(), 1).await;
    assert_eq!(got.len(), 25);
    assert_eq!(got.concat(), ids);
}

async fn list_pages_with_a_filter(h: Harness) {
    let mut a = Vec::new();
    for n in 0..12 {
        let q = if n % 2 == 0 { "a" } else { "b" };
        let id = h.put(item(n).queue(q)).await;
        if q == "a" {
            a.push(id);
        }
    }
    a.reverse();
    let filter = JobList {
        queue: Some("a".into()),
        ..JobList::default()
    };
    let got = pages(&h, filter, 4).await;
    assert_eq!(got.iter().map(Vec::len).collect::<Vec<_>>(), vec![4, 2]);
    assert_eq!(got.concat(), a);
}

async fn list_last_page_has_no_cursor(h: Harness) {
    let mut ids = Vec::new();
    for n in 0..10 {
        ids.push(h.put(item(n)).await);
    }
    ids.reverse();
    let got = pages(&h, JobList::default(), 5).await;
    assert_eq!(got, vec![ids[..5].to_vec(), ids[5..].to_vec()]);
    let got = pages(&h, JobList::default(), 10).await;
    assert_eq!(got, vec![ids.clone()]);
    let got = pages(&h, JobList::default(), 11).await;
    assert_eq!(got, vec![ids]);
    let empty = pages(
        &h,
        JobList {
            queue: Some("none".into()),
            ..JobList::default()
        },
        5,
    )
    .await;
    assert_eq!(empty, vec![Vec::<String>::new()]);
}

async fn list_cursor_is_stable_when_jobs_arrive(h: Harness) {
    let mut ids = Vec::new();
    for n in 0..6 {
        ids.push(h.put(item(n)).await);
    }
    ids.reverse();
    let first = h
        .queue
        .list(JobList {
            limit: 3,
            ..JobList::default()
        })
        .await
        .unwrap();
    assert_eq!(
        first.jobs.iter().map(|j| j.id.clone()).collect::<Vec<_>>(),
        ids[..3]
    );
    h.put(item(100)).await;
    h.put(item(101)).await;
    let second = h
        .queue
        .list(JobList {
            limit: 3,
            cursor: first.next_cursor.clone(),
            ..JobList::default()
        })
        .await
        .unwrap();
    assert_eq!(
        second.jobs.iter().map(|j| j.id.clone()).collect::<Vec<_>>(),
        ids[3..]
    );
    assert_eq!(second.next_cursor, None);
}

async fn list_limit_bounds(h: Harness) {
    h.put(item(1)).await;
    for limit in [0, 1001, u32::MAX] {
        let err = h
            .queue
            .list(JobList {
                limit,
                ..JobList::default()
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Validation { field, .. } if field == "limit"),
            "{err:?}"
        );
    }
    let page = h
        .queue
        .list(JobList {
            limit: 1000,
            ..JobList::default()
        })
        .await
        .unwrap();
    assert_eq!(page.jobs.len(), 1);
}

fn counts(
    scheduled: u64,
    ready: u64,
    active: u64,
    done: u64,
    dead: u64,
    cancelled: u64,
) -> StateCounts {
    StateCounts {
        scheduled,
        ready,
        active,
        completed: done,
        dead,
        cancelled,
    }
}

fn info(name: &str, paused: bool, counts: StateCounts) -> QueueInfo {
    QueueInfo {
        name: name.into(),
        paused,
        counts,
        estimated: Vec::new(),
    }
}

async fn queues_count_per_queue_and_state(h: Harness) {
    assert!(h.queue.queues().await.unwrap().is_empty());
    completed(&h, item(1).queue("a")).await;
    completed(&h, item(2).queue("a")).await;
    dead(&h, item(3).queue("a")).await;
    active(&h, item(4).queue("a")).await;
    cancelled(&h, item(5).queue("a")).await;
    h.put(item(6).queue("a").delay(Duration::from_secs(10)))
        .await;
    h.put(item(7).queue("a")).await;
    h.put(item(8).queue("b")).await;
    h.put(item(9).queue("b")).await;
    cancelled(&h, item(10).queue("b")).await;
    assert_eq!(
        h.queue.queues().await.unwrap(),
        vec![
            info("a", false, counts(1, 1, 1, 2, 1, 1)),
            info("b", false, counts(0, 2, 0, 0, 0, 1)),
        ]
    );
    // A purged job is no longer counted.
    let ids = list(
        &h,
        JobList {
            queue: Some("b".into()),
            state: Some(JobState::Cancelled),
            ..JobList::default()
        },
    )
    .await;
    assert!(h.queue.purge(&ids[0]).await.unwrap());
    assert_eq!(
        h.queue.queues().await.unwrap()[1],
        info("b", false, counts(0, 2, 0, 0, 0, 0))
    );
}

async fn queues_derive_scheduled_and_ready_from_the_clock(h: Harness) {
    h.put(item(1).queue("q").delay(Duration::from_secs(10)))
        .await;
    h.put(item(2).queue("q").delay(Duration::from_secs(20)))
        .await;
    h.put(item(3).queue("q")).await;
    let q = |h: &Harness| {
        let queue = h.queue.clone();
        async move { queue.queues().await.unwrap()[0].counts.clone() }
    };
    assert_eq!(q(&h).await, counts(2, 1, 0, 0, 0, 0));
    h.advance_ms(10_000);
    assert_eq!(q(&h).await, counts(1, 2, 0, 0, 0, 0));
    h.advance_ms(10_000);
    assert_eq!(q(&h).await, counts(0, 3, 0, 0, 0, 0));
}

async fn queues_include_paused_queues_without_jobs(h: Harness) {
    h.put(item(1).queue("busy")).await;
    assert!(h.queue.pause("empty").await.unwrap());
    assert!(h.queue.pause("busy").await.unwrap());
    assert_eq!(
        h.queue.queues().await.unwrap(),
        vec![
            info("busy", true, counts(0, 1, 0, 0, 0, 0)),
            info("empty", true, StateCounts::default()),
        ]
    );
    assert!(!h.queue.resume("busy").await.unwrap());
    let qs = h.queue.queues().await.unwrap();
    assert_eq!(qs[0], info("busy", false, counts(0, 1, 0, 0, 0, 0)));
    assert!(
        qs.iter().all(|q| q.name != "busy" || !q.paused),
        "resumed queues are not paused"
    );
    let err = h.queue.pause("bad queue").await.unwrap_err();
    assert!(
        matches!(&err, Error::Validation { field, .. } if field == "queue"),
        "{err:?}"
    );
    assert_eq!(h.queue.queues().await.unwrap().len(), 2);
}

async fn purge_of_an_active_job_changes_nothing(h: Harness) {
    let (id, token) = active(&h, item(1)).await;
    let before = h.job(&id).await;
    let events = h.queue.events(&id).await.unwrap();
    let runs = h.queue.runs(&id).await.unwrap();
    assert!(!h.queue.purge(&id).await.unwrap());
    assert_eq!(h.job(&id).await, before);
    assert_eq!(h.queue.events(&id).await.unwrap(), events);
    assert_eq!(h.queue.runs(&id).await.unwrap(), runs);
    // The lease is untouched: the attempt can still complete.
    h.queue.complete(&id, &token, None).await.unwrap();
    assert_eq!(h.job(&id).await.state, JobState::Completed);
}

async fn purge_of_an_unknown_job_is_false(h: Harness) {
    assert!(!h.queue.purge("no-such-job").await.unwrap());
    let id = h.put(item(1)).await;
    assert!(!h.queue.purge("other").await.unwrap());
    assert_eq!(h.totals().await, (1, 1));
    assert!(h.queue.purge(&id).await.unwrap());
    assert!(
        !h.queue.purge(&id).await.unwrap(),
        "a second purge finds nothing"
    );
}

async fn purge_deletes_events_runs_and_checkpoints(h: Harness) {
    let (id, token) = active(&h, item(1).max_attempts(3)).await;
    assert!(
        h.queue
            .checkpoint_put(&id, &token, "step-1", &json!({"charged": true}))
            .await
            .unwrap()
    );
    h.queue
        .fail(
            &id,
            &token,
            FailOptions {
                error: "try again".into(),
                ..FailOptions::default()
            },
        )
        .await
        .unwrap();
    h.advance(Duration::from_secs(2));
    let c = h.claim_one().await;
    h.queue
        .complete(&c.id, &c.lease_token, Some(json!("ok")))
        .await
        .unwrap();
    assert_eq!(h.queue.runs(&id).await.unwrap().len(), 2);
    assert_eq!(h.queue.checkpoints(&id).await.unwrap().len(), 1);
    assert!(h.event_kinds(&id).await.len() >= 4);
    assert!(h.queue.purge(&id).await.unwrap());
    assert!(h.queue.get(&id).await.unwrap().is_none());
    assert!(h.queue.events(&id).await.unwrap().is_empty());
    assert!(h.queue.runs(&id).await.unwrap().is_empty());
    assert!(h.queue.checkpoints(&id).await.unwrap().is_empty());
    assert_eq!(h.queue.checkpoint_get(&id, "step-1").await.unwrap(), None);
    assert_eq!(h.totals().await, (0, 0));
    assert!(
        h.queue
            .queues()
            .await
            .unwrap()
            .iter()
            .all(|q| q.counts == StateCounts::default())
    );
}

async fn purge_of_waiting_and_terminal_jobs(h: Harness) {
    let ids = [
        completed(&h, item(1)).await,
        dead(&h, item(2)).await,
        cancelled(&h, item(3)).await,
        h.put(item(4).delay(Duration::from_secs(60))).await,
        h.put(item(5)).await,
    ];
    assert_eq!(h.jobs().await.len(), 5);
    for (n, id) in ids.iter().enumerate() {
        assert!(h.queue.purge(id).await.unwrap(), "purge of job {n}");
        assert!(h.queue.get(id).await.unwrap().is_none());
        assert_eq!(h.jobs().await.len(), 4 - n);
    }
    assert_eq!(h.totals().await, (0, 0));
}

async fn promote_makes_a_scheduled_job_ready(h: Harness) {
    let id = h.put(item(1).delay(Duration::from_secs(3600))).await;
    assert!(h.claim(10).await.is_empty());
    h.advance_ms(1_000);
    assert!(h.queue.promote(&id).await.unwrap());
    let j = h.job(&id).await;
    assert_eq!(j.state, JobState::Ready);
    assert_eq!(j.run_at, h.now().await);
    assert_eq!(h.event_kinds(&id).await, vec!["accepted", "promoted"]);
    assert_eq!(h.claim_one().await.id, id);
}

async fn promote_of_a_job_that_is_not_scheduled_is_false(h: Harness) {
    let done = completed(&h, item(1)).await;
    let (running, _) = active(&h, item(2)).await;
    let ready = h.put(item(3)).await;
    let stopped = cancelled(&h, item(4).delay(Duration::from_secs(60))).await;
    for id in [&done, &running, &ready, &stopped] {
        let before = h.job(id).await;
        let events = h.event_kinds(id).await;
        assert!(!h.queue.promote(id).await.unwrap(), "promote of {id}");
        assert_eq!(h.job(id).await, before);
        assert_eq!(h.event_kinds(id).await, events);
    }
    let err = h.queue.promote("no-such-job").await.unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err:?}");
}

async fn explain_writes_nothing(h: Harness) {
    let req = || item(1).idempotency_key("k").dedupe(DedupeOptions::key("d"));
    let e = h.queue.explain(req()).await.unwrap();
    assert_eq!(
        e,
        Explain {
            outcome: "accepted".into(),
            reason: None,
            job_id: None,
            conflict: None,
            idempotency: None,
            dedupe: None,
        }
    );
    assert_eq!(h.totals().await, (0, 0));
    assert!(h.queue.lookup_key("default", "k").await.unwrap().is_none());
    assert!(h.queue.dedupe_lookup("t", "d").await.unwrap().is_none());
    // An explicit id is reported, and still not written.
    let e = h.queue.explain(req().job_id("order-1")).await.unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.job_id.as_deref()),
        ("accepted", Some("order-1"))
    );
    assert!(h.queue.get("order-1").await.unwrap().is_none());
    // The real request after the dry runs is accepted.
    let r = h.queue.enqueue_with_result(req()).await.unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    assert_eq!(h.totals().await, (1, 1));
}

async fn explain_reports_a_replay_and_its_holder(h: Harness) {
    let now = h.now().await;
    let req = || item(1).idempotency(IdempotencyOptions::new("k").ttl(Duration::from_secs(600)));
    let id = h.put(req()).await;
    h.advance_ms(5_000);
    let before = h.totals().await;
    let e = h.queue.explain(req()).await.unwrap();
    assert_eq!(
        e,
        Explain {
            outcome: "replayed".into(),
            reason: None,
            job_id: Some(id.clone()),
            conflict: None,
            idempotency: Some(ExplainIdempotency {
                job_id: id.clone(),
                expires_at: now + chrono::Duration::seconds(600),
            }),
            dedupe: None,
        }
    );
    assert_eq!(h.totals().await, before);
}

async fn explain_reports_a_conflict(h: Harness) {
    let now = h.now().await;
    let id = h.put(item(1).idempotency_key("k")).await;
    let before = h.totals().await;
    let e = h
        .queue
        .explain(item(2).idempotency_key("k").max_attempts(3))
        .await
        .unwrap();
    assert_eq!(
        e,
        Explain {
            outcome: "conflict".into(),
            reason: None,
            job_id: None,
            conflict: Some(ExplainConflict {
                job_id: id.clone(),
                fields: vec!["max_attempts".into(), "payload".into()],
            }),
            idempotency: Some(ExplainIdempotency {
                job_id: id.clone(),
                expires_at: now + chrono::Duration::hours(24),
            }),
            dedupe: None,
        }
    );
    assert_eq!(h.totals().await, before);
    assert_eq!(h.job(&id).await.payload, json!({"n": 1}));
    // An explicit id that exists with other fields is a conflict too.
    h.put(item(5).job_id("order-1")).await;
    let e = h.queue.explain(item(6).job_id("order-1")).await.unwrap();
    assert_eq!(e.outcome, "conflict");
    assert_eq!(
        e.conflict,
        Some(ExplainConflict {
            job_id: "order-1".into(),
            fields: vec!["payload".into()],
        })
    );
}

async fn explain_reports_the_dedupe_holder(h: Harness) {
    let now = h.now().await;
    let d = || DedupeOptions::key("acct-1").ttl(Duration::from_secs(60));
    let id = h.put(item(1).dedupe(d())).await;
    let before = h.totals().await;
    let e = h.queue.explain(item(2).dedupe(d())).await.unwrap();
    assert_eq!(
        e,
        Explain {
            outcome: "coalesced".into(),
            reason: None,
            job_id: Some(id.clone()),
            conflict: None,
            idempotency: None,
            dedupe: Some(ExplainDedupe {
                job_id: id.clone(),
                mode: DedupeMode::Throttle,
                window_until: Some(now + chrono::Duration::seconds(60)),
            }),
        }
    );
    // A replace request meeting it is reported non-replaceable.
    let e = h
        .queue
        .explain(item(3).dedupe(DedupeOptions::key("acct-1").replace()))
        .await
        .unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.reason.as_deref(), e.job_id.as_deref()),
        (
            "non_replaceable",
            Some("incompatible_mode"),
            Some(id.as_str())
        )
    );
    assert_eq!(h.totals().await, before);
}

async fn explain_does_not_rearm_a_debounce_window(h: Harness) {
    let d = || {
        DedupeOptions::key("k")
            .ttl(Duration::from_secs(10))
            .extend()
    };
    let first = h.put(item(1).dedupe(d())).await;
    h.advance_ms(5_000);
    let e = h.queue.explain(item(2).dedupe(d())).await.unwrap();
    assert_eq!(e.outcome, "coalesced");
    assert_eq!(e.job_id.as_deref(), Some(first.as_str()));
    h.advance_ms(5_000);
    // Only a real coalesced enqueue would have pushed the window out.
    let r = h
        .queue
        .enqueue_with_result(item(3).dedupe(d()))
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    assert_ne!(r.job_id, first);
}

async fn explain_of_a_replace_changes_nothing(h: Harness) {
    let r = |n| {
        item(n)
            .delay(Duration::from_secs(60))
            .dedupe(DedupeOptions::key("d").replace())
    };
    let id = h.put(r(1)).await;
    let before = h.job(&id).await;
    let e = h.queue.explain(r(2)).await.unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.job_id.as_deref()),
        ("replaced", Some(id.as_str()))
    );
    assert_eq!(h.job(&id).await, before);
    assert_eq!(h.event_kinds(&id).await, vec!["accepted"]);
}

async fn explain_of_an_invalid_request_is_refused_like_enqueue(h: Harness) {
    let bad = [
        (EnqueueRequest::new("bad type"), "type"),
        (item(1).max_attempts(0), "max_attempts"),
        (
            item(1).dedupe(DedupeOptions::key("d").extend()),
            "dedupe.extend",
        ),
        (
            item(1).deadline(h.now().await - chrono::Duration::seconds(1)),
            "deadline",
        ),
    ];
    for (req, want) in bad {
        for err in [
            h.queue.explain(req.clone()).await.unwrap_err(),
            h.queue.enqueue(req).await.unwrap_err(),
        ] {
            assert!(
                matches!(&err, Error::Validation { field, .. } if field == want),
                "{want}: {err:?}"
            );
        }
    }
    assert_eq!(h.totals().await, (0, 0));
}

async fn explain_after_the_binding_expired_is_accepted(h: Harness) {
    let req = || item(1).idempotency(IdempotencyOptions::new("k").ttl(Duration::from_secs(1)));
    h.put(req()).await;
    h.advance_ms(1_000);
    let e = h.queue.explain(req()).await.unwrap();
    assert_eq!(
        (e.outcome.as_str(), e.job_id, e.idempotency),
        ("accepted", None, None)
    );
}

async fn retention_keeps_completed_and_cancelled_24_hours(h: Harness) {
    let done = completed(&h, item(1)).await;
    let stopped = cancelled(&h, item(2)).await;
    assert_eq!(sweep(&h).await, 0);
    h.advance_ms(DAY_MS - 1);
    assert_eq!(sweep(&h).await, 0);
    assert!(exists(&h, &done).await && exists(&h, &stopped).await);
    h.advance_ms(2);
    assert_eq!(sweep(&h).await, 2);
    assert!(!exists(&h, &done).await && !exists(&h, &stopped).await);
    assert!(h.queue.events(&done).await.unwrap().is_empty());
    assert!(h.queue.runs(&done).await.unwrap().is_empty());
    assert!(h.queue.events(&stopped).await.unwrap().is_empty());
    assert_eq!(sweep(&h).await, 0);
}

async fn retention_keeps_dead_14_days(h: Harness) {
    let gone = dead(&h, item(1)).await;
    h.advance_ms(DAY_MS + 1);
    assert_eq!(sweep(&h).await, 0);
    h.advance_ms(13 * DAY_MS - 2);
    assert_eq!(sweep(&h).await, 0);
    assert!(exists(&h, &gone).await);
    h.advance_ms(2);
    assert_eq!(sweep(&h).await, 1);
    assert!(!exists(&h, &gone).await);
    assert!(h.queue.events(&gone).await.unwrap().is_empty());
}

async fn retention_honours_explicit_keep(h: Harness) {
    let hour = Duration::from_millis(HOUR_MS);
    let short = completed(&h, item(1).keep(hour)).await;
    let long = completed(&h, item(2).keep(Duration::from_millis(3 * DAY_MS))).await;
    let short_dead = dead(&h, item(3).keep(hour)).await;
    let short_cancelled = cancelled(&h, item(4).keep(hour)).await;
    h.advance_ms(HOUR_MS - 1);
    assert_eq!(sweep(&h).await, 0);
    h.advance_ms(2);
    assert_eq!(sweep(&h).await, 3);
    for id in [&short, &short_dead, &short_cancelled] {
        assert!(!exists(&h, id).await);
    }
    h.advance_ms(DAY_MS);
    assert_eq!(
        sweep(&h).await,
        0,
        "an explicit keep beyond the default holds"
    );
    assert!(exists(&h, &long).await);
    h.advance_ms(2 * DAY_MS - HOUR_MS);
    assert_eq!(sweep(&h).await, 1);
    assert!(!exists(&h, &long).await);
}

async fn retention_with_keep_zero_deletes_at_the_next_sweep(h: Harness) {
    let zero = Duration::ZERO;
    let a = completed(&h, item(1).keep(zero)).await;
    let b = dead(&h, item(2).keep(zero)).await;
    let c = cancelled(&h, item(3).keep(zero)).await;
    let kept = completed(&h, item(4)).await;
    assert_eq!(sweep(&h).await, 3);
    for id in [&a, &b, &c] {
        assert!(!exists(&h, id).await);
    }
    assert!(exists(&h, &kept).await);
    assert_eq!(h.totals().await, (1, 3));
}

async fn retention_waits_for_a_live_idempotency_binding(h: Harness) {
    let req = |key: &str, ttl_ms: u64| {
        item(1).idempotency(IdempotencyOptions::new(key).ttl(Duration::from_millis(ttl_ms)))
    };
    let long = completed(&h, req("long", 3 * DAY_MS)).await;
    let zero = completed(&h, req("zero", HOUR_MS).keep(Duration::ZERO)).await;
    assert_eq!(
        sweep(&h).await,
        0,
        "keep 0, but a live binding points at it"
    );
    h.advance_ms(HOUR_MS);
    assert_eq!(sweep(&h).await, 1);
    assert!(!exists(&h, &zero).await);
    h.advance_ms(DAY_MS);
    assert_eq!(sweep(&h).await, 0);
    // Every id a replay returns resolves.
    let r = h
        .queue
        .enqueue_with_result(req("long", 3 * DAY_MS))
        .await
        .unwrap();
    assert_eq!(
        (r.job_id.as_str(), r.outcome),
        (long.as_str(), Outcome::Replayed)
    );
    assert_eq!(h.job(&r.job_id).await.state, JobState::Completed);
    h.advance_ms(2 * DAY_MS - HOUR_MS - 1);
    assert_eq!(sweep(&h).await, 0);
    assert!(exists(&h, &long).await);
    h.advance_ms(1);
    assert_eq!(sweep(&h).await, 1, "deleted once the binding expired");
    assert!(!exists(&h, &long).await);
    assert!(
        h.queue
            .lookup_key("default", "long")
            .await
            .unwrap()
            .is_none()
    );
    let r = h
        .queue
        .enqueue_with_result(req("long", 3 * DAY_MS))
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Accepted);
    assert_ne!(r.job_id, long);
}

async fn retention_keeps_keep_when_longer_than_the_binding(h: Harness) {
    let id = completed(
        &h,
        item(1).idempotency(IdempotencyOptions::new("k").ttl(Duration::from_secs(1))),
    )
    .await;
    h.advance_ms(2_000);
    assert_eq!(sweep(&h).await, 0);
    h.advance_ms(DAY_MS - 2_000 - 1);
    assert_eq!(sweep(&h).await, 0);
    assert!(exists(&h, &id).await);
    h.advance_ms(2);
    assert_eq!(sweep(&h).await, 1);
}

async fn retention_waits_for_the_latest_binding_of_a_job(h: Harness) {
    let req = |key: &str, ttl_ms: u64| {
        t().job_id("order-1")
            .idempotency(IdempotencyOptions::new(key).ttl(Duration::from_millis(ttl_ms)))
    };
    // k1 binds at 0 for 24 h; a replay by the explicit id binds k2 at 12 h
    // for 48 h, so the record must stay until 60 h.
    h.put(req("k1", DAY_MS).delay(Duration::from_millis(12 * HOUR_MS)))
        .await;
    h.advance_ms(12 * HOUR_MS);
    let r = h
        .queue
        .enqueue_with_result(req("k2", 2 * DAY_MS).delay(Duration::from_millis(12 * HOUR_MS)))
        .await
        .unwrap();
    assert_eq!(
        (r.job_id.as_str(), r.outcome),
        ("order-1", Outcome::Replayed)
    );
    let c = h.claim_one().await;
    h.queue.complete(&c.id, &c.lease_token, None).await.unwrap();
    h.advance_ms(DAY_MS + 1); // 36 h: past keep and k1, not k2
    assert_eq!(sweep(&h).await, 0);
    h.advance_ms(DAY_MS - 2); // 60 h - 1 ms
    assert_eq!(sweep(&h).await, 0);
    assert!(exists(&h, "order-1").await);
    h.advance_ms(1);
    assert_eq!(sweep(&h).await, 1);
    assert!(!exists(&h, "order-1").await);
}

async fn retention_after_a_released_binding(h: Harness) {
    let id = completed(
        &h,
        item(1).idempotency(IdempotencyOptions::new("k").ttl(Duration::from_millis(7 * DAY_MS))),
    )
    .await;
    h.advance_ms(DAY_MS + 1);
    assert_eq!(sweep(&h).await, 0);
    assert!(h.queue.release_key("default", "k").await.unwrap());
    assert_eq!(sweep(&h).await, 1);
    assert!(!exists(&h, &id).await);
}

async fn retention_never_deletes_pending_jobs(h: Harness) {
    let zero = Duration::ZERO;
    let (running, _) = active(&h, item(1).keep(zero)).await;
    let (retrying, token) = active(&h, item(2).keep(zero)).await;
    let out = h
        .queue
        .fail(
            &retrying,
            &token,
            FailOptions {
                error: "again".into(),
                retry_after: Some(Duration::from_millis(40 * DAY_MS)),
                ..FailOptions::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(out.state, JobState::Scheduled);
    let redriven = dead(&h, item(3).keep(zero)).await;
    h.queue
        .redrive(&redriven, RedriveOptions::default())
        .await
        .unwrap();
    assert_eq!(h.job(&redriven).await.state, JobState::Ready);
    let ready = h.put(item(4).keep(zero)).await;
    let later = h
        .put(item(5).keep(zero).delay(Duration::from_millis(40 * DAY_MS)))
        .await;
    assert_eq!(sweep(&h).await, 0);
    h.advance_ms(30 * DAY_MS);
    assert_eq!(sweep(&h).await, 0);
    for id in [&running, &retrying, &redriven, &ready, &later] {
        assert!(exists(&h, id).await, "{id} is pending and kept");
    }
}

async fn retention_limit_bounds_one_pass(h: Harness) {
    for n in 0..5 {
        cancelled(&h, item(n).keep(Duration::ZERO)).await;
    }
    let kept = h.put(item(9)).await;
    for want in [2, 2, 1, 0] {
        assert_eq!(h.queue.sweep_retention(2).await.unwrap(), want);
    }
    assert_eq!(list(&h, JobList::default()).await, [kept.as_str()]);
}

async fn sweep_bindings_removes_expired_bindings(h: Harness) {
    let req = |key: &str, secs| {
        item(1).idempotency(IdempotencyOptions::new(key).ttl(Duration::from_secs(secs)))
    };
    h.put(req("a", 1)).await;
    h.put(req("b", 2)).await;
    let live = h.put(req("c", 3600)).await;
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 0);
    h.advance_ms(1_999);
    assert!(h.queue.lookup_key("default", "a").await.unwrap().is_none());
    assert!(h.queue.lookup_key("default", "b").await.unwrap().is_some());
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 1);
    h.advance_ms(1);
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 1);
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 0);
    assert!(h.queue.lookup_key("default", "a").await.unwrap().is_none());
    assert!(h.queue.lookup_key("default", "b").await.unwrap().is_none());
    // The live binding is untouched and still decides replays.
    let b = h.queue.lookup_key("default", "c").await.unwrap().unwrap();
    assert_eq!(b.job_id, live);
    let r = h.queue.enqueue_with_result(req("c", 3600)).await.unwrap();
    assert_eq!((r.job_id, r.outcome), (live, Outcome::Replayed));
    // Jobs are not touched by a binding sweep.
    assert_eq!(h.jobs().await.len(), 3);
}

async fn sweep_bindings_limit_bounds_one_pass(h: Harness) {
    for n in 0..5 {
        h.put(
            item(n)
                .idempotency(IdempotencyOptions::new(format!("k{n}")).ttl(Duration::from_secs(1))),
        )
        .await;
    }
    h.advance_ms(1_000);
    for want in [2, 2, 1, 0] {
        assert_eq!(h.queue.sweep_bindings(2).await.unwrap(), want);
    }
}

async fn sweep_bindings_removes_dedupe_bindings_no_longer_live(h: Harness) {
    let pending = completed(&h, item(1).dedupe(DedupeOptions::key("p"))).await;
    let throttled = completed(
        &h,
        item(2).dedupe(DedupeOptions::key("w").ttl(Duration::from_secs(3600))),
    )
    .await;
    let waiting = h.put(item(3).dedupe(DedupeOptions::key("q"))).await;
    // The pending binding of a completed job is no longer live.
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 1);
    assert!(h.queue.dedupe_lookup("t", "p").await.unwrap().is_none());
    let w = h.queue.dedupe_lookup("t", "w").await.unwrap().unwrap();
    assert_eq!(w.job_id, throttled);
    let q = h.queue.dedupe_lookup("t", "q").await.unwrap().unwrap();
    assert_eq!(q.job_id, waiting);
    h.advance_ms(HOUR_MS);
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 1);
    assert!(h.queue.dedupe_lookup("t", "w").await.unwrap().is_none());
    assert!(h.queue.dedupe_lookup("t", "q").await.unwrap().is_some());
    assert_eq!(h.queue.sweep_bindings(100).await.unwrap(), 0);
    assert!(exists(&h, &pending).await);
}

async fn list_unknown_cursor_is_refused(h: Harness) {
    for n in 0..3 {
        h.put(item(n)).await;
    }
    for cursor in ["", "garbage", "not-a-cursor", "9999999999999999999", "-1"] {
        let err = h
            .queue
            .list(JobList {
                limit: 2,
                cursor: Some(cursor.into()),
                ..JobList::default()
            })
            .await
            .unwrap_err();
        assert!(
            matches!(&err, Error::Validation { field, .. } if field == "cursor"),
            "{cursor:?}: {err:?}"
        );
    }
}

async fn sweep_bindings_limit_counts_both_kinds(h: Harness) {
    // Two dedupe bindings of finished jobs and two expired idempotency bindings.
    completed(&h, item(5).dedupe(DedupeOptions::key("a"))).await;
    completed(&h, item(6).dedupe(DedupeOptions::key("b"))).await;
    for n in 0..2 {
        h.put(
            item(n)
                .idempotency(IdempotencyOptions::new(format!("k{n}")).ttl(Duration::from_secs(1))),
        )
        .await;
    }
    h.advance_ms(1_000);
    assert_eq!(h.queue.sweep_bindings(3).await.unwrap(), 3);
    assert_eq!(h.queue.sweep_bindings(3).await.unwrap(), 1);
    assert_eq!(h.queue.sweep_bindings(3).await.unwrap(), 0);
}

/// The process's counters (`/metrics` renders them) see every enqueue
/// request, whichever path made it: single calls, the items of a batch (of
/// an all-or-nothing batch refused for one item, that item), and schedule
/// ticks; and every claim call, a worker's combined call included, but not
/// a call that only records completions.
async fn stats_count_every_enqueue_and_claim(h: Harness) {
    let q = &h.queue;
    let keyed = || t().idempotency_key("k");
    q.enqueue(keyed()).await.unwrap();
    q.enqueue(keyed()).await.unwrap();
    let conflict = q.enqueue(keyed().payload(json!(2))).await;
    assert!(matches!(
        conflict,
        Err(Error::EnqueueIdempotencyConflict(_))
    ));
    let invalid = q.enqueue(EnqueueRequest::new("")).await;
    assert!(matches!(invalid, Err(Error::Validation { .. })));
    let each = q
        .enqueue_many(
            vec![t(), keyed(), EnqueueRequest::new("")],
            idemq::BatchOptions { atomic: false },
        )
        .await
        .unwrap();
    assert_eq!(each.len(), 3);
    let refused = q
        .enqueue_many(
            vec![t(), keyed().payload(json!(3))],
            idemq::BatchOptions { atomic: true },
        )
        .await;
    assert!(matches!(refused, Err(Error::BatchItem { index: 1, .. })));
    let every = idemq::ScheduleDefinition::every(Duration::from_secs(90), t().queue("ticks"));
    assert!(q.schedule_set("s.every", every).await.unwrap());
    h.advance_ms(90_000);
    assert_eq!(q.fire_schedules(10).await.unwrap(), 1, "one tick fired");

    let counts = q.stats().enqueues;
    assert_eq!(
        counts,
        idemq::EnqueueCounts {
            accepted: 3,
            replayed: 2,
            conflict: 2,
            invalid: 2,
            ..idemq::EnqueueCounts::default()
        }
    );
    let latency = q.stats().enqueue_latency;
    assert_eq!(latency.count, 5, "one reading per answered request");
    assert!(latency.buckets.iter().sum::<u64>() <= latency.count);
    assert!(latency.sum > Duration::ZERO);
    assert_eq!(q.stats().claim_latency.count, 0);

    let claimed = h.claim(1).await;
    assert_eq!(claimed.len(), 1);
    let done = |c: &idemq::ClaimedJob| idemq::Completion {
        job_id: c.id.clone(),
        lease_token: c.lease_token.clone(),
        result: None,
    };
    let options = |limit| idemq::ClaimOptions {
        limit,
        worker: "w-1".into(),
        ..idemq::ClaimOptions::default()
    };
    let (completed, more) = q
        .complete_and_claim(vec![done(&claimed[0])], options(1))
        .await
        .unwrap();
    assert!(completed.iter().all(Result::is_ok));
    let more = more.unwrap();
    assert_eq!(more.len(), 1);
    let (completed, none) = q
        .complete_and_claim(vec![done(&more[0])], options(0))
        .await
        .unwrap();
    assert!(completed.iter().all(Result::is_ok));
    assert!(none.unwrap().is_empty());
    let stats = q.stats();
    assert_eq!(
        stats.claim_latency.count, 2,
        "the completions alone are no claim"
    );
    assert_eq!((stats.claims, stats.completions), (2, 2));
}

/// The counters see what a call records beside what it was asked: the
/// expired leases the reaper records, and a claim before it claims, each
/// also a retry or a death by where its job went; the jobs a claim ends
/// past their deadline; and the attempts a heartbeat (single or batched)
/// ends past their timeout or deadline. Each step counts once.
async fn stats_count_what_claims_heartbeats_and_the_reaper_record(h: Harness) {
    let q = &h.queue;
    let claim = |queue: &str, lease_ms: u64| idemq::ClaimOptions {
        queues: vec![queue.to_owned()],
        limit: 1,
        worker: "w-1".into(),
        lease: Duration::from_millis(lease_ms),
        ..idemq::ClaimOptions::default()
    };
    let counted = || {
        let s = q.stats();
        (s.lease_expiries, s.retries, s.dead)
    };
    let fixed = idemq::RetryPolicy::Fixed { delay_ms: 60_000 };

    // The reaper: one job back to run, one to the dead letters (its last
    // attempt was the one that expired).
    let back = h.put(t().queue("r").max_attempts(3)).await;
    h.put(t().queue("r").max_attempts(1)).await;
    for _ in 0..2 {
        assert_eq!(q.claim(claim("r", 1_000)).await.unwrap().len(), 1);
    }
    h.advance_ms(1_000);
    assert_eq!(q.reap_leases(100).await.unwrap(), 2);
    assert_eq!(counted(), (2, 1, 1), "the reaper");

    // A claim reaps the expired lease of `back` first, then claims it again.
    let c = q.claim(claim("r", 1_000)).await.unwrap();
    assert_eq!((c[0].id.as_str(), c[0].attempt), (back.as_str(), 2));
    h.advance_ms(1_000);
    let again = q.claim(claim("r", 30_000)).await.unwrap();
    assert_eq!((again[0].id.as_str(), again[0].attempt), (back.as_str(), 3));
    assert_eq!(counted(), (3, 2, 1), "a claim's reaping");
    q.complete(&back, &again[0].lease_token, None)
        .await
        .unwrap();

    // A claim ends the jobs it finds past their deadline.
    h.put_past_deadline(t().queue("late"), 2).await;
    assert!(q.claim(claim("late", 30_000)).await.unwrap().is_empty());
    assert_eq!(counted(), (3, 2, 3), "a claim's deadline deaths");

    // A heartbeat past the attempt's timeout: a retry.
    let slow = h
        .put(
            t().queue("to")
                .timeout(Duration::from_secs(5))
                .retry(fixed.clone()),
        )
        .await;
    let c = q.claim(claim("to", 30_000)).await.unwrap();
    h.advance_ms(5_000);
    let lost = q.heartbeat(&slow, &c[0].lease_token).await;
    assert!(matches!(lost, Err(Error::LeaseLost { .. })), "{lost:?}");
    assert_eq!(h.job(&slow).await.state, JobState::Scheduled);
    assert_eq!(counted(), (3, 3, 3), "a heartbeat past the timeout");

    // A batched heartbeat past the deadline: a death. A renewal beside it
    // counts nothing.
    let deadline = h.now().await + chrono::TimeDelta::seconds(10);
    let late = h.put(t().queue("dl").deadline(deadline).retry(fixed)).await;
    let fine = h.put(t().queue("ok")).await;
    let c = q.claim(claim("dl", 30_000)).await.unwrap();
    let f = q.claim(claim("ok", 60_000)).await.unwrap();
    h.advance_ms(10_000);
    let beats = q
        .heartbeat_many([
            (late.as_str(), &c[0].lease_token),
            (fine.as_str(), &f[0].lease_token),
        ])
        .await
        .unwrap();
    assert!(
        matches!(beats[0], Err(Error::LeaseLost { .. })),
        "{beats:?}"
    );
    assert!(beats[1].is_ok(), "{beats:?}");
    assert_eq!(h.job(&late).await.state, JobState::Dead);
    assert_eq!(
        counted(),
        (3, 3, 4),
        "a batched heartbeat past the deadline"
    );
}
