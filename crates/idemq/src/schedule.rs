//! Schedules (docs/schedules.md): when a repeatable job fires. Pure computation, no I/O.
//!
//! A schedule is a cron expression with seconds in an IANA time zone, or a
//! fixed interval anchored at the schedule's creation. [`ScheduleSpec`]
//! answers the two questions a scheduler asks: the next fire strictly after
//! an instant, and the latest fire at or before one.
//!
//! Cron follows the **wall clock** of its zone, with the rules of docs/schedules.md for
//! the two kinds of daylight-saving transition, for every pattern alike:
//! - a local time inside a spring-forward gap fires once, at the first
//!   instant after the gap (`02:30` on a day the clock jumps from `02:00` to
//!   `03:00` fires at `03:00`);
//! - a local time that repeats at a fall-back fires once, at its first
//!   occurrence (the second pass through `01:00`–`01:59` fires nothing).
//!
//! croner applies these rules only to patterns with one fixed hour, minute
//! and second; for any other pattern (`0 15 * * * *`, `*/10 * * * * *`) it
//! skips times in a gap and fires repeated times twice. So croner is used
//! only to match the pattern against wall clock times (on `NaiveDateTime`,
//! where no transition exists), and this module maps each matching wall
//! clock time to its instant itself. An interval (`every_ms`) follows the
//! absolute time line and knows nothing of zones.

use std::time::Duration;

use chrono::{DateTime, LocalResult, NaiveDateTime, SecondsFormat, TimeZone, Utc};
use chrono_tz::Tz;
use croner::Cron;
use croner::parser::{CronParser, Seconds, Year};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, KeyHasher};
use crate::request::{EnqueueRequest, PreparedEnqueue, bounds, prepare_key};

/// The reserved idempotency scope of schedule ticks.
pub const SCHEDULE_SCOPE: &str = "idemq.schedule";
/// How long a tick's key stays bound to its job (24 h, the default key retention).
pub const TICK_KEY_TTL_MS: i64 = 24 * 3600 * 1000;
/// The upper bound of the default misfire grace (60 s).
pub const MAX_MISFIRE_GRACE: Duration = Duration::from_secs(60);
/// Shortest interval (1 s): tick keys have seconds precision.
pub const MIN_EVERY_MS: i64 = 1000;
/// Longest cron expression (ASCII in any expression that parses).
pub const MAX_CRON_BYTES: usize = 255;
/// The members of an enqueue request a schedule's job template may not carry.
pub const TEMPLATE_REFUSES: &[&str] = &["idempotency", "job_id", "run_at", "deadline"];
/// Longest schedule name (of ASCII name characters).
pub const MAX_NAME_BYTES: usize = 128;
/// Longest time zone name in bytes.
const MAX_ZONE_BYTES: usize = 64;
/// Matches a search may step over before it gives up: an hour of
/// every-second matches in a repeated range, with room to spare.
const MAX_STEPS: usize = 10_000;
/// The longest spring-forward gap searched (a whole day was skipped by
/// Pacific/Apia in 2011).
const MAX_GAP_MINUTES: i64 = 48 * 60;

/// When a schedule fires: a cron expression in a time zone, or an interval.
/// Build it with [`ScheduleSpec::cron`] or [`ScheduleSpec::every`].
#[derive(Clone, Debug)]
pub struct ScheduleSpec {
    kind: Kind,
}

#[derive(Clone, Debug)]
enum Kind {
    /// A cron expression with seconds, on the wall clock of `zone`.
    Cron { cron: Box<Cron>, zone: Tz },
    /// Every `every_ms`, counted from `anchor` (truncated to the second):
    /// the ticks are `anchor + k × every_ms` for k ≥ 1.
    Every {
        every_ms: i64,
        anchor: DateTime<Utc>,
    },
}

/// Validates a cron expression: six fields, seconds first.
fn parse_cron(expr: &str) -> Result<Cron> {
    if expr.is_empty() || expr.len() > MAX_CRON_BYTES {
        return Err(Error::validation("cron", "must be 1–255 bytes"));
    }
    let parser = CronParser::builder()
        .seconds(Seconds::Required)
        .year(Year::Disallowed)
        .build();
    parser.parse(expr).map_err(|e| {
        Error::validation(
            "cron",
            format!("must be a cron expression of six fields, seconds first ({e})"),
        )
    })
}

/// Validates an IANA time zone name (`UTC`, `Europe/Berlin`, …).
fn parse_zone(name: &str) -> Result<Tz> {
    if name.is_empty() || name.len() > MAX_ZONE_BYTES {
        return Err(Error::validation("timezone", "must be 1–64 bytes"));
    }
    name.parse::<Tz>().map_err(|_| {
        Error::validation(
            "timezone",
            "must be an IANA time zone name such as UTC or Europe/Berlin",
        )
    })
}

/// Validates an interval in milliseconds (1 s – 100 years).
pub(crate) fn check_every(every_ms: i64) -> Result<()> {
    if !(MIN_EVERY_MS..=bounds::MAX_DURATION_MS).contains(&every_ms) {
        return Err(Error::validation(
            "every_ms",
            "must be from 1 s (1000) to 100 years",
        ));
    }
    Ok(())
}

/// The instant a wall clock time of `zone` stands for under docs/schedules.md: itself;
/// the first of two when it repeats; the first instant after the gap when
/// it does not exist.
fn resolve(zone: &Tz, local: NaiveDateTime) -> Option<DateTime<Utc>> {
    match zone.from_local_datetime(&local) {
        LocalResult::Single(t) => Some(t.with_timezone(&Utc)),
        LocalResult::Ambiguous(earlier, _) => Some(earlier.with_timezone(&Utc)),
        LocalResult::None => after_gap(zone, local),
    }
}

/// The first instant after the gap that holds `local`: the instant whose
/// wall clock time is the first one after `local` that exists.
fn after_gap(zone: &Tz, local: NaiveDateTime) -> Option<DateTime<Utc>> {
    let exists = |t: NaiveDateTime| !matches!(zone.from_local_datetime(&t), LocalResult::None);
    // Whole minutes first (gaps are long), then the seconds of the last one.
    let mut inside = local;
    let mut minutes = 0;
    loop {
        let next = inside.checked_add_signed(chrono::TimeDelta::minutes(1))?;
        if exists(next) {
            break;
        }
        inside = next;
        minutes += 1;
        if minutes > MAX_GAP_MINUTES {
            return None;
        }
    }
    (1..=60).find_map(|s| {
        let t = inside.checked_add_signed(chrono::TimeDelta::seconds(s))?;
        match zone.from_local_datetime(&t) {
            LocalResult::Single(at) => Some(at.with_timezone(&Utc)),
            LocalResult::Ambiguous(earlier, _) => Some(earlier.with_timezone(&Utc)),
            LocalResult::None => None,
        }
    })
}

/// Whole seconds, rounded down.
fn floor_second(t: DateTime<Utc>) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(t.timestamp(), 0)
}

/// The first interval tick strictly after `now_us`: `anchor + k × every`,
/// k ≥ 1, with the anchor truncated to the second. In µs.
pub(crate) fn every_next(anchor_us: i64, every_ms: i64, now_us: i64) -> Option<i64> {
    let anchor = anchor_us.div_euclid(1_000_000) * 1_000_000;
    let period = every_ms.checked_mul(1000)?;
    if period <= 0 {
        return None;
    }
    let k = if now_us < anchor {
        1
    } else {
        (now_us - anchor) / period + 1
    };
    anchor.checked_add(k.checked_mul(period)?)
}

/// The latest interval tick at or before `now_us` (`None` before the first). In µs.
pub(crate) fn every_latest(anchor_us: i64, every_ms: i64, now_us: i64) -> Option<i64> {
    let anchor = anchor_us.div_euclid(1_000_000) * 1_000_000;
    let period = every_ms.checked_mul(1000)?;
    if period <= 0 || now_us < anchor.checked_add(period)? {
        return None;
    }
    anchor.checked_add(((now_us - anchor) / period).checked_mul(period)?)
}

impl ScheduleSpec {
    /// A cron schedule: `expr` has six fields, seconds first (`0 */5 * * * *`),
    /// evaluated on the wall clock of the IANA zone `timezone`.
    pub fn cron(expr: &str, timezone: &str) -> Result<Self> {
        let cron = parse_cron(expr)?;
        let zone = parse_zone(timezone)?;
        Ok(Self {
            kind: Kind::Cron {
                cron: Box::new(cron),
                zone,
            },
        })
    }

    /// An interval schedule: every `every_ms` milliseconds after `anchor`.
    pub fn every(every_ms: i64, anchor: DateTime<Utc>) -> Result<Self> {
        check_every(every_ms)?;
        Ok(Self {
            kind: Kind::Every { every_ms, anchor },
        })
    }

    /// The first fire strictly after `t` (`None` when there is none).
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.kind {
            Kind::Every { every_ms, anchor } => {
                every_next(anchor.timestamp_micros(), *every_ms, t.timestamp_micros())
                    .and_then(DateTime::from_timestamp_micros)
            }
            Kind::Cron { cron, zone } => {
                // No wall clock time at or before local(t) maps past t (the
                // map is monotone), so the search starts after it; matches
                // of a repeated range already passed map to the past and
                // are stepped over.
                let mut local = floor_second(t)?.with_timezone(zone).naive_local();
                for _ in 0..MAX_STEPS {
                    let next = cron.find_next_occurrence(&local, false).ok()?;
                    if let Some(at) = resolve(zone, next)
                        && at > t
                    {
                        return Some(at);
                    }
                    local = next;
                }
                None
            }
        }
    }

    /// The latest fire at or before `t` (`None` when there is none).
    pub fn latest_at_or_before(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        match &self.kind {
            Kind::Every { every_ms, anchor } => {
                every_latest(anchor.timestamp_micros(), *every_ms, t.timestamp_micros())
                    .and_then(DateTime::from_timestamp_micros)
            }
            Kind::Cron { cron, zone } => {
                let local = floor_second(t)?.with_timezone(zone).naive_local();
                // The last match at or before local(t) maps at or before t…
                let mut cursor = cron.find_previous_occurrence(&local, true).ok()?;
                let mut best = None;
                for _ in 0..MAX_STEPS {
                    match resolve(zone, cursor) {
                        Some(at) if at <= t => {
                            best = Some(at);
                            break;
                        }
                        _ => cursor = cron.find_previous_occurrence(&cursor, false).ok()?,
                    }
                }
                let mut best = best?;
                // …but during the second pass of a repeated range, later
                // wall clock times already fired on the first: walk on.
                for _ in 0..MAX_STEPS {
                    let Ok(next) = cron.find_next_occurrence(&cursor, false) else {
                        break;
                    };
                    match resolve(zone, next) {
                        Some(at) if at <= t => {
                            best = best.max(at);
                            cursor = next;
                        }
                        _ => break,
                    }
                }
                Some(best)
            }
        }
    }

    /// The misfire grace of `tick` (docs/schedules.md): min(60 s, the time to the next
    /// tick). It is never longer than a period, so at most one tick is ever
    /// within its grace at a pass: the latest one.
    pub fn misfire_grace(&self, tick: DateTime<Utc>) -> Duration {
        let period = self
            .next_after(tick)
            .and_then(|next| (next - tick).to_std().ok())
            .unwrap_or(MAX_MISFIRE_GRACE);
        period.min(MAX_MISFIRE_GRACE)
    }
}

/// The ticks a pass at `now` fires for a due schedule, oldest first
/// (docs/schedules.md): the latest tick at or before `now` that is later than
/// the last one fired; when that tick is within its misfire grace it fires on
/// time, and the latest of the older ticks missed while the schedule was due
/// (at or after its stored `next_fire_at`) fires once, late, before it. When
/// it is later than its grace, it is itself the latest missed tick and fires
/// alone. Ticks older than those two never fire.
pub(crate) fn ticks_to_fire(
    spec: &ScheduleSpec,
    schedule: &Schedule,
    now: DateTime<Utc>,
) -> Vec<DateTime<Utc>> {
    let unfired = |t: &DateTime<Utc>| schedule.last_fired_at.is_none_or(|last| *t > last);
    let Some(latest) = spec.latest_at_or_before(now).filter(unfired) else {
        return Vec::new();
    };
    let late = (now - latest).to_std().unwrap_or_default();
    if late > spec.misfire_grace(latest) {
        return vec![latest];
    }
    // Ticks are whole seconds: the one before `latest` is at or before `latest - 1 s`.
    let missed = spec
        .latest_at_or_before(latest - chrono::Duration::seconds(1))
        .filter(unfired)
        .filter(|t| schedule.next_fire_at.is_some_and(|due| *t >= due));
    missed.into_iter().chain([latest]).collect()
}

/// The idempotency key of a tick: `schedule:<name>:<tick, RFC 3339 UTC, seconds, 'Z'>`.
pub fn tick_key(name: &str, tick: DateTime<Utc>) -> String {
    format!(
        "schedule:{name}:{}",
        tick.to_rfc3339_opts(SecondsFormat::Secs, true)
    )
}

/// Validates a schedule name: 1–128 bytes of `[A-Za-z0-9._:-]`.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(Error::validation(
            "name",
            "must be 1–128 bytes of [A-Za-z0-9._:-]",
        ))
    }
}

/// What [`Queue::schedule_set`](crate::Queue::schedule_set) stores: a cron
/// expression or an interval, and the job each tick enqueues. The same shape
/// as the HTTP API's `PUT /v1/schedules/{name}` body.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ScheduleDefinition {
    /// A cron expression of six fields, seconds first (`0 */5 * * * *`).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::CronExpression>))]
    pub cron: Option<String>,
    /// A fixed interval in milliseconds (≥ 1 s), anchored at the schedule's creation.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::EveryMs>))]
    pub every_ms: Option<i64>,
    /// The IANA time zone of a cron expression; `UTC` when omitted.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::TimeZone>))]
    pub timezone: Option<String>,
    /// The job every tick enqueues. It may not carry its own idempotency
    /// key, `job_id`, `run_at` or `deadline` (use `delay_ms`).
    #[serde(deserialize_with = "crate::wire::object")]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::ScheduleJob))]
    pub job: EnqueueRequest,
    /// A paused schedule does not fire.
    #[serde(default, deserialize_with = "crate::wire::null_as_default")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<bool>))]
    pub paused: bool,
}

impl ScheduleDefinition {
    /// A cron schedule in UTC.
    pub fn cron(expr: impl Into<String>, job: EnqueueRequest) -> Self {
        Self {
            cron: Some(expr.into()),
            every_ms: None,
            timezone: None,
            job,
            paused: false,
        }
    }

    /// An interval schedule.
    pub fn every(every: Duration, job: EnqueueRequest) -> Self {
        Self {
            cron: None,
            every_ms: Some(i64::try_from(every.as_millis()).unwrap_or(i64::MAX)),
            timezone: None,
            job,
            paused: false,
        }
    }

    /// Sets the IANA time zone of the cron expression.
    pub fn timezone(mut self, zone: impl Into<String>) -> Self {
        self.timezone = Some(zone.into());
        self
    }

    /// Pauses (or resumes) the schedule.
    pub fn paused(mut self, paused: bool) -> Self {
        self.paused = paused;
        self
    }
}

/// A stored schedule.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Schedule {
    /// Its name.
    pub name: String,
    /// Its cron expression, if it is a cron schedule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cron: Option<String>,
    /// Its interval, if it is an interval schedule.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub every_ms: Option<i64>,
    /// The cron expression's time zone (`UTC` for intervals).
    pub timezone: String,
    /// The job template.
    pub job: EnqueueRequest,
    /// A paused schedule does not fire.
    pub paused: bool,
    /// When it was created (the anchor of an interval).
    pub created_at: DateTime<Utc>,
    /// When its definition last changed.
    pub updated_at: DateTime<Utc>,
    /// The last tick fired.
    pub last_fired_at: Option<DateTime<Utc>>,
    /// The next tick (`None` while paused, or when the expression matches no later instant).
    pub next_fire_at: Option<DateTime<Utc>>,
    /// Why the latest tick that could not be enqueued was passed (its
    /// template over the payload limit, say); cleared by the next tick that
    /// fires.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
    /// When that was recorded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_error_at: Option<DateTime<Utc>>,
}

impl Schedule {
    /// When it fires.
    pub fn spec(&self) -> Result<ScheduleSpec> {
        match (&self.cron, self.every_ms) {
            (Some(expr), _) => ScheduleSpec::cron(expr, &self.timezone),
            (None, Some(every_ms)) => ScheduleSpec::every(every_ms, self.created_at),
            (None, None) => Err(Error::Backend {
                message: format!("schedule {} has neither cron nor every_ms", self.name),
            }),
        }
    }
}

/// Every schedule, by name: those this version can read, and the others.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ScheduleList {
    /// The schedules, by name.
    pub schedules: Vec<Schedule>,
    /// The schedules whose stored row this version cannot read (a template
    /// written by a newer idemq, say), by name. They are left as they are:
    /// they do not fire here, and setting one anew replaces its row.
    pub unreadable: Vec<UnreadableSchedule>,
}

/// A schedule whose stored row cannot be read.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UnreadableSchedule {
    /// Its name, or `null` when the name itself cannot be read.
    pub name: Option<String>,
    /// Why: the schedule, the column and the value that cannot be read.
    pub error: String,
}

impl ScheduleList {
    /// Adds a stored row as it decoded: the schedule, or why it could not
    /// be read with its `name` (read only then) as far as that reads.
    #[cfg_attr(
        not(any(feature = "sqlite", feature = "postgres", feature = "redis")),
        allow(dead_code)
    )]
    pub(crate) fn push(
        &mut self,
        decoded: Result<Schedule>,
        name: impl FnOnce() -> Option<String>,
    ) {
        match decoded {
            Ok(s) => self.schedules.push(s),
            Err(e) => self.unreadable.push(UnreadableSchedule {
                name: name(),
                error: match e {
                    Error::Backend { message } => message,
                    other => other.to_string(),
                },
            }),
        }
    }
}

/// A definition after validation: its timing and its template as stored.
#[derive(Debug)]
pub(crate) struct CheckedDefinition {
    /// The parsed cron expression, for a cron schedule.
    pub cron: Option<ScheduleSpec>,
    /// The time zone name as stored.
    pub timezone: String,
    /// The template, serialized.
    pub job: String,
}

/// Validates a template: every bound of docs/http-api.md ("Enqueue"), and none of the fields that
/// would make every tick the same job or a job of the past.
fn check_template(
    job: &EnqueueRequest,
    hasher: &KeyHasher,
    payload_limit: usize,
) -> Result<PreparedEnqueue> {
    let refuse = |field: &str, reason: &str| Err(Error::validation(format!("job.{field}"), reason));
    if job.idempotency.is_some() {
        return refuse(
            "idempotency",
            "a schedule's job may not carry an idempotency key: every tick is keyed by the schedule",
        );
    }
    if job.job_id.is_some() {
        return refuse("job_id", "a schedule's job may not name a job id");
    }
    if job.run_at.is_some() {
        return refuse(
            "run_at",
            "a schedule's job may not carry run_at: use delay_ms",
        );
    }
    if job.deadline.is_some() {
        return refuse(
            "deadline",
            "a schedule's job may not carry an absolute deadline",
        );
    }
    job.prepare(hasher, payload_limit).map_err(|e| match e {
        Error::Validation { field, reason } => Error::Validation {
            field: format!("job.{field}"),
            reason,
        },
        Error::PayloadTooLarge { field, limit } => Error::PayloadTooLarge {
            field: format!("job.{field}"),
            limit,
        },
        other => other,
    })
}

/// Validates a name and a definition; writes and reads nothing.
pub(crate) fn check_definition(
    name: &str,
    def: &ScheduleDefinition,
    hasher: &KeyHasher,
    payload_limit: usize,
) -> Result<CheckedDefinition> {
    check_name(name)?;
    let (cron, timezone) = match (&def.cron, def.every_ms) {
        (Some(_), Some(_)) | (None, None) => {
            return Err(Error::validation(
                "cron",
                "give exactly one of cron and every_ms",
            ));
        }
        (Some(expr), None) => {
            let zone = def.timezone.as_deref().unwrap_or("UTC");
            (Some(ScheduleSpec::cron(expr, zone)?), zone.to_owned())
        }
        (None, Some(every_ms)) => {
            check_every(every_ms)?;
            if def.timezone.as_deref().is_some_and(|z| z != "UTC") {
                return Err(Error::validation(
                    "timezone",
                    "applies only to cron schedules (an interval follows absolute time)",
                ));
            }
            (None, "UTC".to_owned())
        }
    };
    check_template(&def.job, hasher, payload_limit)?;
    let job =
        serde_json::to_string(&def.job).map_err(|e| Error::validation("job", e.to_string()))?;
    Ok(CheckedDefinition {
        cron,
        timezone,
        job,
    })
}

/// The enqueue of one tick: the template, keyed by the tick in the reserved
/// scope, its fingerprint retaken with the key's retention.
pub(crate) fn tick_request(
    schedule: &Schedule,
    tick: DateTime<Utc>,
    hasher: &KeyHasher,
    payload_limit: usize,
) -> Result<PreparedEnqueue> {
    let mut item = check_template(&schedule.job, hasher, payload_limit)?;
    item.idempotency = Some(prepare_key(
        "idempotency",
        &tick_key(&schedule.name, tick),
        SCHEDULE_SCOPE,
        TICK_KEY_TTL_MS,
        hasher,
    )?);
    item.fingerprint = Fingerprint::of(&item, &schedule.job.payload);
    Ok(item)
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
mod tests;
