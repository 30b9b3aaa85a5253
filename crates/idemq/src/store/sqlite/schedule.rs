//! Schedules on SQLite (docs/schedules.md): definitions, due schedules and fired ticks.

use rusqlite::{OptionalExtension, Row, params};

use super::decode::{Cols, all};
use super::{Cx, ts};
use crate::error::Result;
use crate::schedule::{Schedule, ScheduleList, every_next};
use crate::store::{DueSchedules, ScheduleMarkFired, SchedulePut};

const COLUMNS: &str = "name, cron, every_ms, timezone, job, paused, created_at, updated_at, \
                       last_fired_at, next_fire_at, last_error, last_error_at";

fn schedule_of(r: &Row) -> Result<Schedule> {
    let mut c = Cols::new(r, "idemq_schedules", "schedule");
    let name: String = c.get("name")?;
    c.named(format!("schedule {name}"));
    Ok(Schedule {
        cron: c.get("cron")?,
        every_ms: c.get("every_ms")?,
        timezone: c.get("timezone")?,
        job: c.json("job", "job template")?,
        paused: c.get("paused")?,
        created_at: c.time("created_at")?,
        updated_at: c.time("updated_at")?,
        last_fired_at: c.opt_time("last_fired_at")?,
        next_fire_at: c.opt_time("next_fire_at")?,
        last_error: c.get("last_error")?,
        last_error_at: c.opt_time("last_error_at")?,
        name,
    })
}

/// Creates or replaces a definition. A schedule whose timing is unchanged
/// and that was not paused keeps its next fire, so a process declaring its
/// schedules at every start neither skips nor repeats a tick; any other
/// change computes the next fire afresh (an interval from its creation).
pub(super) fn put(cx: &Cx, p: &SchedulePut) -> Result<bool> {
    type Old = (Option<String>, Option<i64>, String, i64, Option<i64>);
    let old: Option<Old> = cx
        .db
        .prepare_cached(
            "SELECT cron, every_ms, timezone, created_at, next_fire_at
             FROM idemq_schedules WHERE name = ?1",
        )?
        .query_row([&p.name], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
        })
        .optional()?;
    let anchor = old.as_ref().map_or(p.at, |o| o.3);
    let fresh = match p.every_ms {
        Some(every_ms) => every_next(anchor, every_ms, p.at),
        None => p.cron_next,
    };
    let next = match &old {
        _ if p.paused => None,
        Some((cron, every_ms, timezone, _, Some(next)))
            if *cron == p.cron && *every_ms == p.every_ms && *timezone == p.timezone =>
        {
            Some(*next)
        }
        _ => fresh,
    };
    match old {
        None => {
            cx.db
                .prepare_cached(
                    "INSERT INTO idemq_schedules (name, cron, every_ms, timezone, job, paused,
                         created_at, updated_at, last_fired_at, next_fire_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, NULL, ?8)",
                )?
                .execute(params![
                    p.name, p.cron, p.every_ms, p.timezone, p.job, p.paused, p.at, next
                ])?;
            Ok(true)
        }
        Some(_) => {
            cx.db
                .prepare_cached(
                    "UPDATE idemq_schedules SET cron = ?2, every_ms = ?3, timezone = ?4, job = ?5,
                         paused = ?6, updated_at = ?7, next_fire_at = ?8
                     WHERE name = ?1",
                )?
                .execute(params![
                    p.name, p.cron, p.every_ms, p.timezone, p.job, p.paused, p.at, next
                ])?;
            Ok(false)
        }
    }
}

pub(super) fn delete(cx: &Cx, name: &str) -> Result<bool> {
    let n = cx
        .db
        .prepare_cached("DELETE FROM idemq_schedules WHERE name = ?1")?
        .execute([name])?;
    Ok(n > 0)
}

/// A row's name as far as it reads: text as it is, a number or bytes as
/// text; `None` for a NULL.
fn name_of(r: &Row) -> Option<String> {
    use rusqlite::types::ValueRef;
    match r.get_ref("name").ok()? {
        ValueRef::Null => None,
        ValueRef::Integer(n) => Some(n.to_string()),
        ValueRef::Real(x) => Some(x.to_string()),
        ValueRef::Text(b) | ValueRef::Blob(b) => Some(String::from_utf8_lossy(b).into_owned()),
    }
}

pub(super) fn list(cx: &Cx) -> Result<ScheduleList> {
    let stmt = cx.db.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM idemq_schedules ORDER BY name"
    ))?;
    let mut list = ScheduleList::default();
    for (decoded, name) in all(stmt, [], |r| {
        let decoded = schedule_of(r);
        let name = decoded.is_err().then(|| name_of(r)).flatten();
        Ok((decoded, name))
    })? {
        list.push(decoded, || name);
    }
    Ok(list)
}

pub(super) fn due(cx: &Cx, limit: u32) -> Result<DueSchedules> {
    let stmt = cx.db.prepare_cached(&format!(
        "SELECT {COLUMNS} FROM idemq_schedules
         WHERE next_fire_at IS NOT NULL AND next_fire_at <= ?1
         ORDER BY next_fire_at, name LIMIT ?2"
    ))?;
    let (mut schedules, mut unreadable) = (Vec::new(), Vec::new());
    for s in all(stmt, params![cx.now, limit], |r| Ok(schedule_of(r)))? {
        match s {
            Ok(s) => schedules.push(s),
            Err(e) => unreadable.push(e),
        }
    }
    Ok(DueSchedules {
        now: ts(cx.now)?,
        schedules,
        unreadable,
    })
}

pub(super) fn mark_fired(cx: &Cx, p: &ScheduleMarkFired) -> Result<bool> {
    // Ticks of one timing only move forward, so the next fire never moves
    // back either (a slower scheduler's mark changes nothing).
    let n = cx
        .db
        .prepare_cached(
            "UPDATE idemq_schedules
             SET last_fired_at = coalesce(?5, last_fired_at),
                 next_fire_at = CASE WHEN ?6 IS NULL THEN NULL ELSE max(next_fire_at, ?6) END,
                 last_error = CASE WHEN ?7 IS NOT NULL THEN ?7
                                   WHEN ?5 IS NOT NULL THEN NULL ELSE last_error END,
                 last_error_at = CASE WHEN ?7 IS NOT NULL THEN ?8
                                      WHEN ?5 IS NOT NULL THEN NULL ELSE last_error_at END
             WHERE name = ?1 AND next_fire_at IS NOT NULL
               AND cron IS ?2 AND every_ms IS ?3 AND timezone = ?4
               AND (?5 IS NULL OR last_fired_at IS NULL OR last_fired_at <= ?5)",
        )?
        .execute(params![
            p.name,
            p.cron,
            p.every_ms,
            p.timezone,
            p.fired_at,
            p.next_fire_at,
            p.error,
            cx.now
        ])?;
    Ok(n > 0)
}
