//! Schedules on PostgreSQL (docs/schedules.md): each call one statement or one
//! function of `migrations/postgres/0003_schedules.sql`.

use chrono::{DateTime, Utc};
use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::db::Db;
use super::db_err;
use crate::error::{Error, Result};
use crate::job::Undecodable;
use crate::schedule::{Schedule, ScheduleList};
use crate::store::{DueSchedules, ScheduleMarkFired, SchedulePut};

/// The columns of a schedule row, for `concat!`.
macro_rules! columns {
    () => {
        "s.name, s.cron, s.every_ms, s.timezone, s.job, s.paused, s.created_at, s.updated_at, \
         s.last_fired_at, s.next_fire_at, s.last_error, s.last_error_at"
    };
}

/// µs since the epoch → instant, for an instant the caller computed (the
/// clock, the next fire); one out of range is an error, never the epoch.
fn at(us: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| Error::Backend {
        message: format!("{us} µs since the epoch is not an instant in range"),
    })
}

fn schedule_of(r: &PgRow) -> Result<Schedule> {
    let name: String = r.try_get("name").map_err(db_err)?;
    let job: Value = r.try_get("job").map_err(db_err)?;
    let job = serde_json::from_value(job.clone()).map_err(|e| {
        Undecodable::unreadable("job template", &job.to_string(), e)
            .at(format!("schedule {name}"), "idemq.schedules.job")
    })?;
    Ok(Schedule {
        cron: r.try_get("cron").map_err(db_err)?,
        every_ms: r.try_get("every_ms").map_err(db_err)?,
        timezone: r.try_get("timezone").map_err(db_err)?,
        job,
        paused: r.try_get("paused").map_err(db_err)?,
        created_at: r.try_get("created_at").map_err(db_err)?,
        updated_at: r.try_get("updated_at").map_err(db_err)?,
        last_fired_at: r.try_get("last_fired_at").map_err(db_err)?,
        next_fire_at: r.try_get("next_fire_at").map_err(db_err)?,
        last_error: r.try_get("last_error").map_err(db_err)?,
        last_error_at: r.try_get("last_error_at").map_err(db_err)?,
        name,
    })
}

pub(super) async fn put(pool: Db<'_>, p: &SchedulePut) -> Result<bool> {
    sqlx::query_scalar("SELECT idemq.schedule_put($1, $2, $3, $4, $5::jsonb, $6, $7, $8)")
        .bind(&p.name)
        .bind(&p.cron)
        .bind(p.every_ms)
        .bind(&p.timezone)
        .bind(&p.job)
        .bind(p.paused)
        .bind(at(p.at)?)
        .bind(p.cron_next.map(at).transpose()?)
        .fetch_one(pool)
        .await
        .map_err(db_err)
}

pub(super) async fn delete(pool: Db<'_>, name: &str) -> Result<bool> {
    let done = sqlx::query("DELETE FROM idemq.schedules WHERE name = $1")
        .bind(name)
        .execute(pool)
        .await
        .map_err(db_err)?;
    Ok(done.rows_affected() > 0)
}

pub(super) async fn list(pool: Db<'_>) -> Result<ScheduleList> {
    let rows = sqlx::query(concat!(
        "SELECT ",
        columns!(),
        " FROM idemq.schedules s ORDER BY s.name COLLATE \"C\""
    ))
    .fetch_all(pool)
    .await
    .map_err(db_err)?;
    let mut list = ScheduleList::default();
    for r in &rows {
        list.push(schedule_of(r), || r.try_get("name").ok());
    }
    Ok(list)
}

pub(super) async fn due(pool: Db<'_>, limit: u32) -> Result<DueSchedules> {
    // One statement: the clock reading, and the schedules due at it (a row
    // of NULLs when there are none).
    let rows = sqlx::query(concat!(
        "WITH clock AS (SELECT idemq.now() AS now) SELECT clock.now AS clock_now, ",
        columns!(),
        " FROM clock LEFT JOIN LATERAL (
             SELECT * FROM idemq.schedules
             WHERE next_fire_at <= clock.now
             ORDER BY next_fire_at, name COLLATE \"C\"
             LIMIT $1
         ) s ON true"
    ))
    .bind(i64::from(limit))
    .fetch_all(pool)
    .await
    .map_err(db_err)?;
    let now = match rows.first() {
        Some(r) => r.try_get("clock_now").map_err(db_err)?,
        None => {
            return Err(Error::Backend {
                message: "schedule_due returned no clock reading".into(),
            });
        }
    };
    let (mut schedules, mut unreadable) = (Vec::with_capacity(rows.len()), Vec::new());
    for r in &rows {
        if r.try_get::<Option<String>, _>("name")
            .map_err(db_err)?
            .is_some()
        {
            match schedule_of(r) {
                Ok(s) => schedules.push(s),
                Err(e) => unreadable.push(e),
            }
        }
    }
    Ok(DueSchedules {
        now,
        schedules,
        unreadable,
    })
}

pub(super) async fn mark_fired(pool: Db<'_>, p: &ScheduleMarkFired) -> Result<bool> {
    sqlx::query_scalar("SELECT idemq.schedule_mark_fired($1, $2, $3, $4, $5, $6, $7)")
        .bind(&p.name)
        .bind(&p.cron)
        .bind(p.every_ms)
        .bind(&p.timezone)
        .bind(p.fired_at.map(at).transpose()?)
        .bind(p.next_fire_at.map(at).transpose()?)
        .bind(&p.error)
        .fetch_one(pool)
        .await
        .map_err(db_err)
}
