//! Conformance cases: schedules (docs/schedules.md).
//!
//! Every tick is an idempotent enqueue keyed `schedule:<name>:<tick>` in the
//! reserved scope `idemq.schedule`; the cases find a tick's job by that key.
//! Time moves through the harness clock; a "pass" is one `fire_schedules`.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, TimeDelta, Utc};
use idemq::fingerprint::{Fingerprint, KeyHasher, key_preview};
use idemq::request::{PreparedKey, defaults};
use idemq::store::JobEnqueue;
use idemq::{DedupeOptions, EnqueueRequest, Error, Outcome, Schedule, ScheduleDefinition};
use idemq_testkit::{Harness, epoch};
use serde_json::json;
use tokio::sync::Barrier;

idemq_testkit::instantiate!(
    set_list_update_delete,
    cron_tick_fires_one_job_keyed_in_the_reserved_scope,
    three_schedulers_fire_ten_ticks_exactly_once,
    after_downtime_the_latest_missed_tick_fires_once_then_the_on_time_one,
    a_tick_later_than_its_grace_fires_alone_and_late,
    a_tick_whose_template_cannot_be_enqueued_is_recorded_and_passed,
    interval_is_anchored_at_creation,
    paused_schedule_does_not_fire_and_resume_does_not_catch_up,
    dst_zone_fires_at_the_right_instants_across_transitions,
    deleting_a_schedule_stops_it,
    invalid_definitions_are_refused_and_write_nothing,
    redeclaring_a_schedule_keeps_its_next_fire,
    a_tick_another_scheduler_fired_differently_does_not_fail_the_pass,
    template_dedupe_skips_ticks_while_the_last_job_is_pending,
);

const SCOPE: &str = "idemq.schedule";

fn at_secs(secs: i64) -> DateTime<Utc> {
    epoch() + TimeDelta::seconds(secs)
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s)
        .expect("an RFC 3339 instant")
        .with_timezone(&Utc)
}

fn tick_key(name: &str, tick: DateTime<Utc>) -> String {
    format!(
        "schedule:{name}:{}",
        tick.to_rfc3339_opts(SecondsFormat::Secs, true)
    )
}

fn report(n: i64) -> EnqueueRequest {
    EnqueueRequest::new("report.build")
        .queue("reports")
        .payload(json!({ "n": n }))
}

/// The job a tick enqueued, if any.
async fn tick_job(h: &Harness, name: &str, tick: DateTime<Utc>) -> Option<String> {
    h.queue
        .lookup_key(SCOPE, &tick_key(name, tick))
        .await
        .expect("lookup")
        .map(|b| b.job_id)
}

async fn fire(h: &Harness) -> u64 {
    h.queue.fire_schedules(100).await.expect("fire schedules")
}

async fn schedule(h: &Harness, name: &str) -> Schedule {
    h.queue
        .schedules()
        .await
        .expect("schedules")
        .into_iter()
        .find(|s| s.name == name)
        .expect("the schedule exists")
}

/// Moves the clock of record forward to `to`.
async fn advance_to(h: &Harness, to: DateTime<Utc>) {
    let now = h.now().await;
    let by = (to - now).to_std().expect("the clock only moves forward");
    h.advance(by);
}

async fn set_list_update_delete(h: Harness) {
    let def = ScheduleDefinition::cron("0 */5 * * * *", report(1)).timezone("Europe/Berlin");
    assert!(
        h.queue
            .schedule_set("reports.hourly", def.clone())
            .await
            .unwrap()
    );
    let every = ScheduleDefinition::every(Duration::from_secs(90), report(2));
    assert!(h.queue.schedule_set("a.interval", every).await.unwrap());

    let all = h.queue.schedules().await.unwrap();
    let names: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["a.interval", "reports.hourly"], "sorted by name");
    let cron = &all[1];
    assert_eq!(cron.cron.as_deref(), Some("0 */5 * * * *"));
    assert_eq!(cron.every_ms, None);
    assert_eq!(cron.timezone, "Europe/Berlin");
    assert_eq!(cron.job, report(1));
    assert!(!cron.paused);
    assert_eq!(cron.created_at, epoch());
    assert_eq!(cron.last_fired_at, None);
    assert_eq!(cron.next_fire_at, Some(at_secs(300)));
    let interval = &all[0];
    assert_eq!(
        (interval.cron.as_deref(), interval.every_ms),
        (None, Some(90_000))
    );
    assert_eq!(interval.timezone, "UTC");
    assert_eq!(interval.next_fire_at, Some(at_secs(90)));

    // Setting the same definition again is an update, not a creation.
    assert!(!h.queue.schedule_set("reports.hourly", def).await.unwrap());
    // A new template applies to the ticks after the change.
    h.advance_ms(1000);
    let changed = ScheduleDefinition::cron("0 */5 * * * *", report(3)).timezone("Europe/Berlin");
    assert!(
        !h.queue
            .schedule_set("reports.hourly", changed)
            .await
            .unwrap()
    );
    let cron = schedule(&h, "reports.hourly").await;
    assert_eq!(cron.job, report(3));
    assert_eq!(
        cron.created_at,
        epoch(),
        "an update keeps the creation instant"
    );
    assert_eq!(cron.updated_at, at_secs(1));
    assert_eq!(cron.next_fire_at, Some(at_secs(300)));
    advance_to(&h, at_secs(300)).await;
    assert_eq!(
        fire(&h).await,
        3,
        "both schedules are due; the interval's latest missed tick fires late"
    );
    assert!(tick_job(&h, "a.interval", at_secs(270)).await.is_some());
    assert!(tick_job(&h, "a.interval", at_secs(180)).await.is_some());
    assert!(tick_job(&h, "a.interval", at_secs(90)).await.is_none());
    let id = tick_job(&h, "reports.hourly", at_secs(300))
        .await
        .expect("fired");
    assert_eq!(h.job(&id).await.payload, json!({ "n": 3 }));
    assert_eq!(h.job(&id).await.queue, "reports");

    assert!(h.queue.schedule_delete("reports.hourly").await.unwrap());
    assert!(!h.queue.schedule_delete("reports.hourly").await.unwrap());
    let names: Vec<String> = h
        .queue
        .schedules()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["a.interval"]);
}

async fn cron_tick_fires_one_job_keyed_in_the_reserved_scope(h: Harness) {
    let def = ScheduleDefinition::cron("*/10 * * * * *", report(1));
    h.queue.schedule_set("tick", def).await.unwrap();
    assert_eq!(fire(&h).await, 0, "nothing is due at creation");
    h.advance(Duration::from_secs(9));
    assert_eq!(fire(&h).await, 0, "nothing is due before the tick");
    assert!(h.jobs().await.is_empty());

    h.advance(Duration::from_secs(1));
    assert_eq!(fire(&h).await, 1);
    let jobs = h.jobs().await;
    assert_eq!(jobs.len(), 1, "one tick, one job");
    let job = &jobs[0];
    assert_eq!(job.job_type, "report.build");
    assert_eq!(job.payload, json!({ "n": 1 }));
    let binding = job.idempotency.as_ref().expect("the job is keyed");
    assert_eq!(binding.scope, SCOPE);
    assert_eq!(
        tick_job(&h, "tick", at_secs(10)).await.as_deref(),
        Some(job.id.as_str()),
        "the key schedule:tick:2030-01-01T00:00:10Z finds the job"
    );

    assert_eq!(fire(&h).await, 0, "a tick fires once");
    assert_eq!(h.jobs().await.len(), 1);
    let s = schedule(&h, "tick").await;
    assert_eq!(s.last_fired_at, Some(at_secs(10)));
    assert_eq!(s.next_fire_at, Some(at_secs(20)));

    // A public request cannot reach the reserved scope.
    let err = h
        .queue
        .enqueue(report(1).idempotency(
            idemq::IdempotencyOptions::new(tick_key("tick", at_secs(20))).scope(SCOPE),
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Validation { ref field, .. } if field == "idempotency.scope"));
}

async fn three_schedulers_fire_ten_ticks_exactly_once(h: Harness) {
    let def = ScheduleDefinition::cron("*/10 * * * * *", report(1));
    h.queue.schedule_set("race", def).await.unwrap();
    let mut schedulers = Vec::new();
    for _ in 0..3 {
        schedulers.push(h.another_queue().await);
    }
    let mut fired = 0;
    for _ in 0..10 {
        h.advance(Duration::from_secs(10));
        let barrier = Arc::new(Barrier::new(schedulers.len()));
        let tasks: Vec<_> = schedulers
            .iter()
            .map(|q| {
                let (q, b) = (q.clone(), barrier.clone());
                tokio::spawn(async move {
                    b.wait().await;
                    q.fire_schedules(100).await
                })
            })
            .collect();
        for t in tasks {
            fired += t
                .await
                .expect("task")
                .expect("a pass never fails on a race");
        }
    }
    assert_eq!(
        fired, 10,
        "each tick counted by the one scheduler that fired it"
    );
    let jobs = h.jobs().await;
    assert_eq!(jobs.len(), 10, "ten ticks, ten jobs");
    let mut ids = Vec::new();
    for k in 1..=10 {
        ids.push(
            tick_job(&h, "race", at_secs(10 * k))
                .await
                .expect("each tick fired"),
        );
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10, "one job per tick");
    assert_eq!(schedule(&h, "race").await.last_fired_at, Some(at_secs(100)));
}

async fn after_downtime_the_latest_missed_tick_fires_once_then_the_on_time_one(h: Harness) {
    let def = ScheduleDefinition::cron("0 * * * * *", report(1));
    h.queue.schedule_set("minutely", def).await.unwrap();
    // Down for 1,000 minutes and a half: the tick of minute 1,000 is 30 s
    // late, within its 60 s grace (on time); of the 999 older missed ticks
    // only the latest, minute 999, fires, late and once.
    h.advance(Duration::from_secs(1000 * 60 + 30));
    assert_eq!(fire(&h).await, 2);
    assert_eq!(fire(&h).await, 0);
    assert_eq!(
        h.jobs().await.len(),
        2,
        "the missed ticks collapse into one fire"
    );
    let late = tick_job(&h, "minutely", at_secs(999 * 60)).await;
    let on_time = tick_job(&h, "minutely", at_secs(1000 * 60)).await;
    assert!(late.is_some() && on_time.is_some() && late != on_time);
    assert_eq!(tick_job(&h, "minutely", at_secs(998 * 60)).await, None);
    assert_eq!(tick_job(&h, "minutely", at_secs(60)).await, None);
    let s = schedule(&h, "minutely").await;
    assert_eq!(s.last_fired_at, Some(at_secs(1000 * 60)));
    assert_eq!(s.next_fire_at, Some(at_secs(1001 * 60)));
    // Then it runs on time again: one tick per pass.
    h.advance(Duration::from_secs(30));
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "minutely", at_secs(1001 * 60)).await.is_some());
    // A pass within the grace of the only due tick fires that tick alone.
    h.advance(Duration::from_secs(60 + 59));
    assert_eq!(fire(&h).await, 1, "59 s late is within the grace");
    assert!(tick_job(&h, "minutely", at_secs(1002 * 60)).await.is_some());
    assert_eq!(h.jobs().await.len(), 4);
}

async fn a_tick_later_than_its_grace_fires_alone_and_late(h: Harness) {
    // Hourly: the grace is 60 s. A pass five minutes after the 01:00 tick
    // finds it later than its grace: it is the latest missed tick, so it
    // fires, once; the schedule was due only since 01:00, so nothing older.
    let def = ScheduleDefinition::cron("0 0 * * * *", report(1));
    h.queue.schedule_set("hourly", def).await.unwrap();
    advance_to(&h, at_secs(3600 + 300)).await;
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "hourly", at_secs(3600)).await.is_some());
    // Down from 01:05 to 04:30: of 02:00, 03:00 and 04:00 (30 minutes
    // late) only 04:00 fires.
    advance_to(&h, at_secs(4 * 3600 + 1800)).await;
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "hourly", at_secs(4 * 3600)).await.is_some());
    assert!(tick_job(&h, "hourly", at_secs(3 * 3600)).await.is_none());
    assert!(tick_job(&h, "hourly", at_secs(2 * 3600)).await.is_none());
    assert_eq!(h.jobs().await.len(), 2);
}

async fn a_tick_whose_template_cannot_be_enqueued_is_recorded_and_passed(h: Harness) {
    let big = EnqueueRequest::new("report.build").payload(json!({ "pad": "x".repeat(400) }));
    let def = ScheduleDefinition::every(Duration::from_secs(10), big);
    h.queue.schedule_set("big", def).await.unwrap();
    let small = ScheduleDefinition::every(Duration::from_secs(10), report(1));
    h.queue.schedule_set("small", small).await.unwrap();
    // A process whose payload limit is lower than the template (an operator
    // lowered it after the schedule was set) cannot enqueue that tick.
    let strict = idemq::Queue::from_store(
        h.queue.store().clone(),
        idemq::QueueOptions {
            payload_limit: 200,
            ..idemq::QueueOptions::default()
        },
    );
    advance_to(&h, at_secs(10)).await;
    assert_eq!(
        strict.fire_schedules(100).await.expect("the pass succeeds"),
        1,
        "the other schedule still fires"
    );
    assert!(tick_job(&h, "small", at_secs(10)).await.is_some());
    assert!(tick_job(&h, "big", at_secs(10)).await.is_none());
    let s = schedule(&h, "big").await;
    let error = s.last_error.as_deref().expect("the reason is recorded");
    assert!(
        error.contains("1970") || error.contains("2030-01-01T00:00:10Z"),
        "names the tick: {error}"
    );
    assert!(error.contains("payload"), "says why: {error}");
    assert_eq!(s.last_error_at, Some(at_secs(10)));
    assert_eq!(s.last_fired_at, Some(at_secs(10)), "the tick is passed");
    assert_eq!(s.next_fire_at, Some(at_secs(20)));
    // The same pass again: the passed tick is not retried.
    assert_eq!(strict.fire_schedules(100).await.unwrap(), 0);
    // A process that can enqueue it fires the next tick, which clears the error.
    advance_to(&h, at_secs(20)).await;
    assert_eq!(fire(&h).await, 2);
    assert!(tick_job(&h, "big", at_secs(20)).await.is_some());
    let s = schedule(&h, "big").await;
    assert_eq!((s.last_error, s.last_error_at), (None, None));
}

async fn interval_is_anchored_at_creation(h: Harness) {
    // Created at +7.25 s: the ticks are +67 s, +127 s, … (the anchor to the second).
    h.advance_ms(7250);
    let def = ScheduleDefinition::every(Duration::from_secs(60), report(1));
    assert!(h.queue.schedule_set("every", def).await.unwrap());
    let s = schedule(&h, "every").await;
    assert_eq!(s.created_at, epoch() + TimeDelta::milliseconds(7250));
    assert_eq!(s.next_fire_at, Some(at_secs(67)));

    advance_to(&h, at_secs(66)).await;
    assert_eq!(fire(&h).await, 0);
    advance_to(&h, at_secs(67)).await;
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "every", at_secs(67)).await.is_some());
    advance_to(&h, at_secs(127)).await;
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "every", at_secs(127)).await.is_some());

    // A new period keeps the anchor: +7 s + k × 30 s.
    let def = ScheduleDefinition::every(Duration::from_secs(30), report(1));
    assert!(!h.queue.schedule_set("every", def).await.unwrap());
    assert_eq!(schedule(&h, "every").await.next_fire_at, Some(at_secs(157)));
    advance_to(&h, at_secs(157)).await;
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "every", at_secs(157)).await.is_some());
    assert_eq!(h.jobs().await.len(), 3);
}

async fn paused_schedule_does_not_fire_and_resume_does_not_catch_up(h: Harness) {
    let def = ScheduleDefinition::cron("*/10 * * * * *", report(1));
    h.queue
        .schedule_set("p", def.clone().paused(true))
        .await
        .unwrap();
    let s = schedule(&h, "p").await;
    assert!(s.paused);
    assert_eq!(s.next_fire_at, None, "a paused schedule has no next fire");
    h.advance(Duration::from_secs(60));
    assert_eq!(fire(&h).await, 0);
    assert!(h.jobs().await.is_empty());

    // Resuming fires at the next tick, not the ones missed while paused.
    h.advance_ms(500);
    h.queue.schedule_set("p", def.clone()).await.unwrap();
    assert_eq!(schedule(&h, "p").await.next_fire_at, Some(at_secs(70)));
    assert_eq!(fire(&h).await, 0);
    advance_to(&h, at_secs(70)).await;
    assert_eq!(fire(&h).await, 1);
    assert!(tick_job(&h, "p", at_secs(70)).await.is_some());

    h.queue.schedule_set("p", def.paused(true)).await.unwrap();
    h.advance(Duration::from_secs(30));
    assert_eq!(fire(&h).await, 0);
    assert_eq!(h.jobs().await.len(), 1);
    assert_eq!(schedule(&h, "p").await.last_fired_at, Some(at_secs(70)));
}

async fn dst_zone_fires_at_the_right_instants_across_transitions(h: Harness) {
    let ny = |expr: &str| ScheduleDefinition::cron(expr, report(1)).timezone("America/New_York");
    // 02:30 does not exist on 2030-03-10; 01:30 happens twice on 2030-11-03.
    h.queue
        .schedule_set("spring", ny("0 30 2 * * *"))
        .await
        .unwrap();
    h.queue
        .schedule_set("fall", ny("0 30 1 * * *"))
        .await
        .unwrap();
    assert_eq!(
        schedule(&h, "spring").await.next_fire_at,
        Some(utc("2030-01-01T07:30:00Z")),
        "02:30 EST"
    );

    advance_to(&h, utc("2030-03-09T07:30:00Z")).await;
    fire(&h).await;
    assert!(
        tick_job(&h, "spring", utc("2030-03-09T07:30:00Z"))
            .await
            .is_some()
    );
    assert_eq!(
        schedule(&h, "spring").await.next_fire_at,
        Some(utc("2030-03-10T07:00:00Z")),
        "the gap time fires at 03:00 EDT, the first instant after the gap"
    );
    advance_to(&h, utc("2030-03-10T06:59:59Z")).await;
    fire(&h).await;
    advance_to(&h, utc("2030-03-10T07:00:00Z")).await;
    fire(&h).await;
    assert!(
        tick_job(&h, "spring", utc("2030-03-10T07:00:00Z"))
            .await
            .is_some()
    );
    advance_to(&h, utc("2030-03-10T08:00:00Z")).await;
    fire(&h).await;
    for never in ["2030-03-10T06:30:00Z", "2030-03-10T07:30:00Z"] {
        assert_eq!(tick_job(&h, "spring", utc(never)).await, None, "{never}");
    }
    assert_eq!(
        schedule(&h, "spring").await.next_fire_at,
        Some(utc("2030-03-11T06:30:00Z")),
        "02:30 EDT the day after"
    );

    advance_to(&h, utc("2030-11-03T05:30:00Z")).await;
    fire(&h).await;
    assert!(
        tick_job(&h, "fall", utc("2030-11-03T05:30:00Z"))
            .await
            .is_some(),
        "01:30 EDT, the first occurrence"
    );
    assert_eq!(
        schedule(&h, "fall").await.next_fire_at,
        Some(utc("2030-11-04T06:30:00Z"))
    );
    advance_to(&h, utc("2030-11-03T06:30:00Z")).await;
    assert_eq!(fire(&h).await, 0, "01:30 EST repeats a time that fired");
    assert_eq!(
        tick_job(&h, "fall", utc("2030-11-03T06:30:00Z")).await,
        None
    );
    advance_to(&h, utc("2030-11-04T06:30:00Z")).await;
    fire(&h).await;
    assert!(
        tick_job(&h, "fall", utc("2030-11-04T06:30:00Z"))
            .await
            .is_some()
    );
}

async fn deleting_a_schedule_stops_it(h: Harness) {
    let def = ScheduleDefinition::every(Duration::from_secs(10), report(1));
    h.queue.schedule_set("gone", def).await.unwrap();
    h.advance(Duration::from_secs(10));
    assert_eq!(fire(&h).await, 1);
    assert!(h.queue.schedule_delete("gone").await.unwrap());
    h.advance(Duration::from_secs(60));
    assert_eq!(fire(&h).await, 0);
    assert_eq!(h.jobs().await.len(), 1, "the job it enqueued stays");
    assert!(h.queue.schedules().await.unwrap().is_empty());
}

async fn invalid_definitions_are_refused_and_write_nothing(h: Harness) {
    let good = ScheduleDefinition::cron("0 * * * * *", report(1));
    let cases: Vec<(&str, ScheduleDefinition, &str)> = vec![
        (
            "bad",
            ScheduleDefinition::cron("0 * * * *", report(1)),
            "cron",
        ),
        (
            "bad",
            ScheduleDefinition::cron("not a cron", report(1)),
            "cron",
        ),
        (
            "bad",
            ScheduleDefinition::cron("0 0 0 30 2 *", report(1)),
            "cron",
        ),
        ("bad", good.clone().timezone("Mars/Olympus"), "timezone"),
        (
            "bad",
            ScheduleDefinition::every(Duration::from_millis(500), report(1)),
            "every_ms",
        ),
        (
            "bad",
            ScheduleDefinition::cron("0 * * * * *", EnqueueRequest::new("")),
            "job.type",
        ),
        (
            "bad",
            ScheduleDefinition::cron("0 * * * * *", report(1).idempotency_key("k")),
            "job.idempotency",
        ),
        (
            "bad",
            ScheduleDefinition::cron("0 * * * * *", report(1).max_attempts(0)),
            "job.max_attempts",
        ),
        ("bad name", good.clone(), "name"),
        ("", good.clone(), "name"),
    ];
    for (name, def, field) in cases {
        match h.queue.schedule_set(name, def).await {
            Err(Error::Validation { field: f, .. }) => assert_eq!(f, field),
            other => panic!("{field}: expected a validation error, got {other:?}"),
        }
    }
    assert!(
        h.queue.schedules().await.unwrap().is_empty(),
        "nothing written"
    );

    // A refused update leaves the schedule as it was.
    h.queue.schedule_set("ok", good.clone()).await.unwrap();
    let before = schedule(&h, "ok").await;
    let bad = ScheduleDefinition::cron("0 * * * * *", report(9)).timezone("Nowhere/City");
    assert!(h.queue.schedule_set("ok", bad).await.is_err());
    assert_eq!(schedule(&h, "ok").await, before);
    assert!(h.jobs().await.is_empty());
}

async fn redeclaring_a_schedule_keeps_its_next_fire(h: Harness) {
    let def = ScheduleDefinition::cron("0 * * * * *", report(1));
    h.queue.schedule_set("boot", def.clone()).await.unwrap();
    // The scheduler was down across the first tick, and the process
    // declares its schedules again when it starts.
    h.advance(Duration::from_secs(90));
    assert!(!h.queue.schedule_set("boot", def).await.unwrap());
    assert_eq!(schedule(&h, "boot").await.next_fire_at, Some(at_secs(60)));
    assert_eq!(fire(&h).await, 1, "the missed tick still fires");
    assert!(tick_job(&h, "boot", at_secs(60)).await.is_some());

    // A new timing starts afresh from now.
    h.advance(Duration::from_secs(90)); // +180: the +180 tick is due
    let retimed = ScheduleDefinition::cron("30 * * * * *", report(1));
    h.queue.schedule_set("boot", retimed).await.unwrap();
    assert_eq!(schedule(&h, "boot").await.next_fire_at, Some(at_secs(210)));
    assert_eq!(fire(&h).await, 0);
}

async fn a_tick_another_scheduler_fired_differently_does_not_fail_the_pass(h: Harness) {
    let def = ScheduleDefinition::cron("*/10 * * * * *", report(1));
    h.queue.schedule_set("changed", def).await.unwrap();
    // Another scheduler fired the first tick with the template as it was
    // before a change: the key is bound to a job with another payload.
    let hasher = KeyHasher::plain();
    let key = tick_key("changed", at_secs(10));
    let old = report(0);
    let mut item = old.prepare(&hasher, defaults::PAYLOAD_LIMIT).unwrap();
    item.idempotency = Some(PreparedKey {
        scope: SCOPE.into(),
        hash: hasher.hash(SCOPE, &key),
        preview: key_preview(&key),
        ttl_ms: 24 * 3600 * 1000,
    });
    item.fingerprint = Fingerprint::of(&item, &old.payload);
    let before = h
        .queue
        .store()
        .job_enqueue(JobEnqueue {
            items: vec![item],
            atomic: false,
            dry_run: false,
        })
        .await
        .unwrap()
        .pop()
        .unwrap()
        .unwrap();
    assert_eq!(before.outcome, Outcome::Accepted);

    h.advance(Duration::from_secs(10));
    assert_eq!(
        fire(&h).await,
        0,
        "the tick was fired by the other scheduler"
    );
    assert_eq!(h.jobs().await.len(), 1);
    assert_eq!(
        tick_job(&h, "changed", at_secs(10)).await,
        Some(before.job_id)
    );
    let s = schedule(&h, "changed").await;
    assert_eq!(
        s.last_fired_at,
        Some(at_secs(10)),
        "the tick counts as fired"
    );
    assert_eq!(s.next_fire_at, Some(at_secs(20)));
    h.advance(Duration::from_secs(10));
    assert_eq!(fire(&h).await, 1);
}

async fn template_dedupe_skips_ticks_while_the_last_job_is_pending(h: Harness) {
    // A dedupe key in the template: a tick whose previous job is still
    // pending is coalesced into it instead of piling up.
    let job = report(1).dedupe(DedupeOptions::key("sync"));
    let def = ScheduleDefinition::every(Duration::from_secs(10), job);
    h.queue.schedule_set("sync", def).await.unwrap();
    h.advance(Duration::from_secs(10));
    assert_eq!(fire(&h).await, 1);
    h.advance(Duration::from_secs(10));
    assert_eq!(fire(&h).await, 1, "the tick fired, and was coalesced");
    assert_eq!(h.jobs().await.len(), 1);
    let first = tick_job(&h, "sync", at_secs(10)).await.expect("fired");
    assert_eq!(tick_job(&h, "sync", at_secs(20)).await, Some(first.clone()));

    let claimed = h.claim_one().await;
    h.queue
        .complete(&claimed.id, &claimed.lease_token, None)
        .await
        .unwrap();
    h.advance(Duration::from_secs(10));
    assert_eq!(fire(&h).await, 1);
    assert_eq!(
        h.jobs().await.len(),
        2,
        "a new job once the last one finished"
    );
}
