//! Unit tests of [`super`]: DST edges in several zones, intervals, keys and
//! validation. Instants are written in UTC with the local time beside them.

use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;

use super::*;
use crate::error::Error;
use crate::fingerprint::KeyHasher;
use crate::request::{EnqueueRequest, defaults};

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s)
        .expect("an RFC 3339 instant")
        .with_timezone(&Utc)
}

fn cron(expr: &str, zone: &str) -> ScheduleSpec {
    ScheduleSpec::cron(expr, zone).expect("a valid schedule")
}

/// The first `n` fires strictly after `from`.
fn fires(spec: &ScheduleSpec, from: &str, n: usize) -> Vec<String> {
    let mut at = utc(from);
    let mut out = Vec::new();
    for _ in 0..n {
        at = spec.next_after(at).expect("a next fire");
        out.push(at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true));
    }
    out
}

fn field_of(e: Error) -> String {
    match e {
        Error::Validation { field, .. } => field,
        other => panic!("expected a validation error, got {other:?}"),
    }
}

#[test]
fn new_york_spring_forward_fires_a_gap_time_once_after_the_gap() {
    // 2030-03-10: 02:00 EST jumps to 03:00 EDT; 02:30 does not exist.
    let spec = cron("0 30 2 * * *", "America/New_York");
    assert_eq!(
        fires(&spec, "2030-03-09T00:00:00Z", 3),
        [
            "2030-03-09T07:30:00Z", // 02:30 EST
            "2030-03-10T07:00:00Z", // 03:00 EDT, the first instant after the gap
            "2030-03-11T06:30:00Z", // 02:30 EDT
        ]
    );
    let gap_fire = utc("2030-03-10T07:00:00Z");
    assert_eq!(spec.latest_at_or_before(gap_fire), Some(gap_fire));
    assert_eq!(
        spec.latest_at_or_before(utc("2030-03-10T06:59:59Z")),
        Some(utc("2030-03-09T07:30:00Z"))
    );
    assert_eq!(
        spec.latest_at_or_before(utc("2030-03-11T06:29:59Z")),
        Some(gap_fire)
    );
}

#[test]
fn new_york_fall_back_fires_a_repeated_time_once_at_its_first_occurrence() {
    // 2030-11-03: 02:00 EDT falls back to 01:00 EST; 01:30 happens twice.
    let spec = cron("0 30 1 * * *", "America/New_York");
    assert_eq!(
        fires(&spec, "2030-11-02T00:00:00Z", 3),
        [
            "2030-11-02T05:30:00Z", // 01:30 EDT
            "2030-11-03T05:30:00Z", // 01:30 EDT, the first occurrence
            "2030-11-04T06:30:00Z", // 01:30 EST; 2030-11-03T06:30Z never fires
        ]
    );
    // During the second pass the latest fire is still the first occurrence.
    assert_eq!(
        spec.latest_at_or_before(utc("2030-11-03T06:45:00Z")),
        Some(utc("2030-11-03T05:30:00Z"))
    );
    assert_eq!(
        spec.next_after(utc("2030-11-03T06:29:59Z")),
        Some(utc("2030-11-04T06:30:00Z"))
    );
}

#[test]
fn an_hourly_pattern_follows_the_same_rules_across_both_transitions() {
    let spec = cron("0 15 * * * *", "America/New_York");
    assert_eq!(
        fires(&spec, "2030-03-10T05:00:00Z", 4),
        [
            "2030-03-10T05:15:00Z", // 00:15 EST
            "2030-03-10T06:15:00Z", // 01:15 EST
            "2030-03-10T07:00:00Z", // 02:15 is in the gap: 03:00 EDT
            "2030-03-10T07:15:00Z", // 03:15 EDT
        ]
    );
    assert_eq!(
        fires(&spec, "2030-11-03T04:00:00Z", 3),
        [
            "2030-11-03T04:15:00Z", // 00:15 EDT
            "2030-11-03T05:15:00Z", // 01:15 EDT; 01:15 EST (06:15Z) repeats it
            "2030-11-03T07:15:00Z", // 02:15 EST
        ]
    );
    assert_eq!(
        spec.latest_at_or_before(utc("2030-11-03T06:30:00Z")),
        Some(utc("2030-11-03T05:15:00Z"))
    );
}

#[test]
fn croner_alone_differs_from_spec_8_for_patterns_without_a_fixed_time() {
    // Why this module maps wall clock times itself: croner, searching on
    // zoned times, carries a gap time past the gap only for fixed-time
    // patterns, and fires other patterns on both passes of a repeated hour.
    let ny: Tz = "America/New_York".parse().expect("zone");
    let fixed = Cron::from_str("0 30 2 * * *").expect("pattern");
    let from = ny
        .with_ymd_and_hms(2030, 3, 10, 0, 0, 0)
        .single()
        .expect("time");
    let next = fixed.find_next_occurrence(&from, false).expect("next");
    assert_eq!(
        next.with_timezone(&Utc),
        utc("2030-03-10T07:00:00Z"),
        "agrees"
    );

    let hourly = Cron::from_str("0 15 * * * *").expect("pattern");
    let from = ny
        .with_ymd_and_hms(2030, 3, 10, 1, 30, 0)
        .single()
        .expect("time");
    let next = hourly.find_next_occurrence(&from, false).expect("next");
    assert_eq!(
        next.with_timezone(&Utc),
        utc("2030-03-10T07:15:00Z"),
        "croner skips 02:15 (docs/schedules.md: fire at 03:00 EDT)"
    );
    let from = ny
        .with_ymd_and_hms(2030, 11, 3, 1, 20, 0)
        .earliest()
        .expect("time");
    let next = hourly.find_next_occurrence(&from, false).expect("next");
    assert_eq!(
        next.with_timezone(&Utc),
        utc("2030-11-03T06:15:00Z"),
        "croner fires 01:15 again on the second pass (docs/schedules.md: once)"
    );
}

#[test]
fn cairo_midnight_gap_fires_on_that_day_and_the_repeated_hour_once() {
    // 2030-04-26: midnight jumps to 01:00 (the day a naive scheduler skips).
    let midnight = cron("0 0 0 * * *", "Africa/Cairo");
    assert_eq!(
        fires(&midnight, "2030-04-24T12:00:00Z", 3),
        [
            "2030-04-24T22:00:00Z", // 04-25 00:00 EET
            "2030-04-25T22:00:00Z", // 04-26 01:00 EEST, after the gap
            "2030-04-26T21:00:00Z", // 04-27 00:00 EEST
        ]
    );
    // 2030-10-31: 24:00 EEST falls back to 23:00 EET; 23:30 happens twice.
    let late = cron("0 30 23 * * *", "Africa/Cairo");
    assert_eq!(
        fires(&late, "2030-10-31T12:00:00Z", 2),
        [
            "2030-10-31T20:30:00Z", // 23:30 EEST, the first occurrence
            "2030-11-01T21:30:00Z", // 11-01 23:30 EET
        ]
    );
}

#[test]
fn half_hour_shifts_and_a_skipped_day_follow_the_same_rules() {
    // Lord Howe Island moves its clock by 30 minutes: 02:00 -> 02:30.
    let spec = cron("0 15 2 * * *", "Australia/Lord_Howe");
    assert_eq!(
        fires(&spec, "2030-10-05T12:00:00Z", 2),
        [
            "2030-10-05T15:30:00Z", // 10-06 02:30 +11, after the gap
            "2030-10-06T15:15:00Z", // 10-07 02:15 +11
        ]
    );
    // Samoa skipped 2011-12-30 entirely: its noon fires at the first
    // instant of 12-31, and 12-31's own noon fires too.
    let noon = cron("0 0 12 * * *", "Pacific/Apia");
    assert_eq!(
        fires(&noon, "2011-12-29T12:00:00Z", 3),
        [
            "2011-12-29T22:00:00Z", // 12-29 12:00 -10
            "2011-12-30T10:00:00Z", // 12-31 00:00 +14, after the skipped day
            "2011-12-30T22:00:00Z", // 12-31 12:00 +14
        ]
    );
}

#[test]
fn every_n_seconds_fires_on_the_wall_clock_seconds() {
    let spec = cron("*/10 * * * * *", "UTC");
    assert_eq!(
        fires(&spec, "2030-01-01T00:00:05.500Z", 3),
        [
            "2030-01-01T00:00:10Z",
            "2030-01-01T00:00:20Z",
            "2030-01-01T00:00:30Z"
        ]
    );
    assert_eq!(
        spec.latest_at_or_before(utc("2030-01-01T00:00:19.999Z")),
        Some(utc("2030-01-01T00:00:10Z"))
    );
    assert_eq!(
        spec.latest_at_or_before(utc("2030-01-01T00:00:20Z")),
        Some(utc("2030-01-01T00:00:20Z"))
    );
    // Every second, on the wall clock: the repeated hour fires nothing.
    let every_second = cron("* * * * * *", "America/New_York");
    assert_eq!(
        every_second.next_after(utc("2030-11-03T05:59:59Z")),
        Some(utc("2030-11-03T07:00:00Z"))
    );
    assert_eq!(
        every_second.latest_at_or_before(utc("2030-11-03T06:59:59Z")),
        Some(utc("2030-11-03T05:59:59Z"))
    );
}

#[test]
fn an_interval_is_anchored_at_creation_to_the_second() {
    let created = utc("2030-01-01T00:00:07.250Z");
    let spec = ScheduleSpec::every(60_000, created).expect("valid");
    assert_eq!(
        spec.next_after(utc("2029-12-31T00:00:00Z")),
        Some(utc("2030-01-01T00:01:07Z"))
    );
    assert_eq!(spec.next_after(created), Some(utc("2030-01-01T00:01:07Z")));
    assert_eq!(
        spec.latest_at_or_before(utc("2030-01-01T00:01:06.999Z")),
        None
    );
    assert_eq!(
        spec.latest_at_or_before(utc("2030-01-01T00:01:07Z")),
        Some(utc("2030-01-01T00:01:07Z"))
    );
    assert_eq!(
        spec.next_after(utc("2030-01-01T00:01:07Z")),
        Some(utc("2030-01-01T00:02:07Z"))
    );
    assert_eq!(
        spec.latest_at_or_before(utc("2030-01-01T10:00:00Z")),
        Some(utc("2030-01-01T09:59:07Z"))
    );
    // Absolute time: a DST transition changes nothing.
    assert_eq!(every_next(0, 1000, 999_999), Some(1_000_000));
    assert_eq!(every_latest(0, 1000, 999_999), None);
}

#[test]
fn misfire_grace_is_min_of_60_s_and_the_period() {
    let at = utc("2030-01-01T00:00:00Z");
    let ten = ScheduleSpec::every(10_000, at).expect("valid");
    assert_eq!(
        ten.misfire_grace(utc("2030-01-01T00:00:10Z")),
        Duration::from_secs(10)
    );
    let five_min = cron("0 */5 * * * *", "UTC");
    assert_eq!(five_min.misfire_grace(at), MAX_MISFIRE_GRACE);
}

#[test]
fn invalid_cron_and_unknown_zone_are_typed_validation_errors() {
    for bad in [
        "",
        "0 */5 * * *",
        "bogus",
        "0 0 0 * * * 2030",
        "61 * * * * *",
    ] {
        let err = ScheduleSpec::cron(bad, "UTC").expect_err(bad);
        assert_eq!(field_of(err), "cron", "{bad:?}");
    }
    for bad in ["", "Mars/Olympus", "america/new_york", "EST5EDT6"] {
        let err = ScheduleSpec::cron("0 * * * * *", bad).expect_err(bad);
        assert_eq!(field_of(err), "timezone", "{bad:?}");
    }
    let err = ScheduleSpec::every(999, Utc::now()).expect_err("too short");
    assert_eq!(field_of(err), "every_ms");
    // February 30th parses but never comes: the queue refuses it by this.
    assert_eq!(cron("0 0 0 30 2 *", "UTC").next_after(Utc::now()), None);
}

#[test]
fn tick_key_is_rfc_3339_utc_to_the_second() {
    assert_eq!(
        tick_key("nightly", utc("2030-03-10T03:00:00-04:00")),
        "schedule:nightly:2030-03-10T07:00:00Z"
    );
}

#[test]
fn definitions_are_checked_before_anything_is_written() {
    let hasher = KeyHasher::plain();
    let limit = defaults::PAYLOAD_LIMIT;
    let check = |name: &str, def: ScheduleDefinition| {
        check_definition(name, &def, &hasher, limit).map(|_| ())
    };
    let job = || EnqueueRequest::new("report.build");
    assert!(check("nightly", ScheduleDefinition::cron("0 0 2 * * *", job())).is_ok());
    let cases: Vec<(&str, ScheduleDefinition, &str)> = vec![
        ("", ScheduleDefinition::cron("0 * * * * *", job()), "name"),
        (
            "a b",
            ScheduleDefinition::cron("0 * * * * *", job()),
            "name",
        ),
        (
            "x",
            ScheduleDefinition {
                every_ms: Some(1000),
                ..ScheduleDefinition::cron("0 * * * * *", job())
            },
            "cron",
        ),
        (
            "x",
            ScheduleDefinition::every(Duration::from_secs(5), job()).timezone("Europe/Paris"),
            "timezone",
        ),
        (
            "x",
            ScheduleDefinition::cron("0 * * * * *", job().idempotency_key("k")),
            "job.idempotency",
        ),
        (
            "x",
            ScheduleDefinition::cron("0 * * * * *", job().job_id("j")),
            "job.job_id",
        ),
        (
            "x",
            ScheduleDefinition::cron("0 * * * * *", job().run_at(Utc::now())),
            "job.run_at",
        ),
        (
            "x",
            ScheduleDefinition::cron("0 * * * * *", EnqueueRequest::new("bad type")),
            "job.type",
        ),
    ];
    for (name, def, field) in cases {
        let err = check(name, def).expect_err(field);
        assert_eq!(field_of(err), field);
    }
}

#[test]
fn a_tick_request_is_keyed_in_the_reserved_scope() {
    let hasher = KeyHasher::plain();
    let schedule = Schedule {
        name: "nightly".into(),
        cron: Some("0 0 2 * * *".into()),
        every_ms: None,
        timezone: "UTC".into(),
        job: EnqueueRequest::new("report.build"),
        paused: false,
        created_at: utc("2030-01-01T00:00:00Z"),
        updated_at: utc("2030-01-01T00:00:00Z"),
        last_fired_at: None,
        next_fire_at: None,
        last_error: None,
        last_error_at: None,
    };
    let tick = utc("2030-01-02T02:00:00Z");
    let item = tick_request(&schedule, tick, &hasher, defaults::PAYLOAD_LIMIT).expect("item");
    let key = item.idempotency.as_ref().expect("keyed");
    assert_eq!(key.scope, SCHEDULE_SCOPE);
    assert_eq!(
        key.hash,
        hasher.hash(SCHEDULE_SCOPE, "schedule:nightly:2030-01-02T02:00:00Z")
    );
    assert_eq!(key.ttl_ms, TICK_KEY_TTL_MS);
    let again = tick_request(&schedule, tick, &hasher, defaults::PAYLOAD_LIMIT).expect("item");
    assert_eq!(
        item.fingerprint, again.fingerprint,
        "every scheduler agrees"
    );
}

#[test]
fn next_and_latest_agree_around_every_transition() {
    // Walking forward with next_after and looking back with
    // latest_at_or_before must see the same strictly increasing fires.
    let zones = [
        "America/New_York",
        "Africa/Cairo",
        "Australia/Lord_Howe",
        "UTC",
    ];
    let patterns = [
        "0 15 * * * *",
        "0 30 2 * * *",
        "0 30 1 * * *",
        "0 */20 * * * *",
        "0 0 0 * * *",
        "30 59 23 * * *",
    ];
    let windows = [
        "2030-03-08T00:00:00Z",
        "2030-04-24T00:00:00Z",
        "2030-10-04T00:00:00Z",
        "2030-10-30T00:00:00Z",
        "2030-11-01T00:00:00Z",
    ];
    for zone in zones {
        for pattern in patterns {
            let spec = cron(pattern, zone);
            for start in windows {
                let mut prev = spec.latest_at_or_before(utc(start));
                let mut at = utc(start);
                let end = at + chrono::TimeDelta::days(4);
                while at < end {
                    let next = spec.next_after(at).expect("a next fire");
                    assert!(next > at, "{zone} {pattern}: {next} after {at}");
                    assert_eq!(
                        spec.latest_at_or_before(next),
                        Some(next),
                        "{zone} {pattern}"
                    );
                    let just_before = next - chrono::TimeDelta::microseconds(1);
                    assert_eq!(
                        spec.latest_at_or_before(just_before),
                        prev,
                        "{zone} {pattern}: the fire before {next}"
                    );
                    prev = Some(next);
                    at = next;
                }
            }
        }
    }
}

fn due(spec_created: &str, last: Option<&str>, next: &str) -> Schedule {
    Schedule {
        name: "s".into(),
        cron: None,
        every_ms: Some(10_000),
        timezone: "UTC".into(),
        job: EnqueueRequest::new("t"),
        paused: false,
        created_at: utc(spec_created),
        updated_at: utc(spec_created),
        last_fired_at: last.map(utc),
        next_fire_at: Some(utc(next)),
        last_error: None,
        last_error_at: None,
    }
}

#[test]
fn an_on_time_tick_fires_alone_when_nothing_was_missed() {
    let s = due(
        "2030-01-01T00:00:00Z",
        Some("2030-01-01T00:00:20Z"),
        "2030-01-01T00:00:30Z",
    );
    let spec = s.spec().expect("spec");
    assert_eq!(
        ticks_to_fire(&spec, &s, utc("2030-01-01T00:00:34Z")),
        vec![utc("2030-01-01T00:00:30Z")]
    );
    // Already fired: nothing.
    let fired = due(
        "2030-01-01T00:00:00Z",
        Some("2030-01-01T00:00:30Z"),
        "2030-01-01T00:00:40Z",
    );
    assert!(ticks_to_fire(&spec, &fired, utc("2030-01-01T00:00:34Z")).is_empty());
}

#[test]
fn after_downtime_the_latest_missed_tick_fires_late_then_the_on_time_one() {
    // Due since 00:00:10; the pass comes at 00:01:05: 00:01:00 is 5 s late
    // (within its 10 s grace), 00:00:50 is the latest of the missed ones.
    let s = due("2030-01-01T00:00:00Z", None, "2030-01-01T00:00:10Z");
    let spec = s.spec().expect("spec");
    assert_eq!(
        ticks_to_fire(&spec, &s, utc("2030-01-01T00:01:05Z")),
        vec![utc("2030-01-01T00:00:50Z"), utc("2030-01-01T00:01:00Z")]
    );
}

#[test]
fn a_tick_later_than_its_grace_fires_alone_as_the_latest_missed() {
    let s = Schedule {
        cron: Some("0 0 * * * *".into()),
        every_ms: None,
        ..due(
            "2030-01-01T00:00:00Z",
            Some("2030-01-01T01:00:00Z"),
            "2030-01-01T02:00:00Z",
        )
    };
    let spec = s.spec().expect("spec");
    // Five minutes late for an hourly tick (grace 60 s): it fires, late, alone.
    assert_eq!(
        ticks_to_fire(&spec, &s, utc("2030-01-01T02:05:00Z")),
        vec![utc("2030-01-01T02:00:00Z")]
    );
    // Down for three hours: only the latest missed tick fires.
    assert_eq!(
        ticks_to_fire(&spec, &s, utc("2030-01-01T04:30:00Z")),
        vec![utc("2030-01-01T04:00:00Z")]
    );
}

#[test]
fn ticks_before_the_schedule_was_due_never_fire() {
    // Resumed (or created) with its next fire at 00:00:40: the 00:00:30
    // tick fell while it was paused, so a pass at 00:00:41 fires 00:00:40 only.
    let s = due(
        "2030-01-01T00:00:00Z",
        Some("2030-01-01T00:00:10Z"),
        "2030-01-01T00:00:40Z",
    );
    let spec = s.spec().expect("spec");
    assert_eq!(
        ticks_to_fire(&spec, &s, utc("2030-01-01T00:00:41Z")),
        vec![utc("2030-01-01T00:00:40Z")]
    );
}
