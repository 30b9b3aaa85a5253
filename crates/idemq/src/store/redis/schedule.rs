//! Schedules on Redis (docs/schedules.md): definitions, due schedules and
//! fired ticks, each one `FCALL`.

use super::codec::{Fields, array, int};
use super::{RedisStore, Result};
use crate::schedule::{Schedule, ScheduleList};
use crate::store::{DueSchedules, ScheduleDue, ScheduleMarkFired, SchedulePut};

fn opt(v: Option<i64>) -> String {
    v.map(|n| n.to_string()).unwrap_or_default()
}

/// A schedule's hash.
fn schedule(v: &::redis::Value) -> Result<Schedule> {
    let mut f = Fields::new(v, "sch", "schedule")?;
    let name = f.str("name")?.to_owned();
    f.named(format!("schedule {name:?}"));
    Ok(Schedule {
        job: f.json("job", "job template")?,
        cron: f.opt("cron").map(str::to_owned),
        every_ms: f.opt_int("every_ms")?,
        timezone: f.str("timezone")?.to_owned(),
        paused: f.opt("paused") == Some("1"),
        created_at: f.ts("created_at")?,
        updated_at: f.ts("updated_at")?,
        last_fired_at: f.opt_ts("last_fired_at")?,
        next_fire_at: f.opt_ts("next_fire_at")?,
        last_error: f.opt("last_error").map(str::to_owned),
        last_error_at: f.opt_ts("last_error_at")?,
        name,
    })
}

pub(super) async fn put(store: &RedisStore, p: SchedulePut) -> Result<bool> {
    let mut cmd = store.fcall("schedule_put")?;
    cmd.arg(&p.name)
        .arg(p.cron.as_deref().unwrap_or_default())
        .arg(opt(p.every_ms))
        .arg(&p.timezone)
        .arg(&p.job)
        .arg(if p.paused { "1" } else { "0" })
        .arg(p.at)
        .arg(opt(p.cron_next));
    Ok(int(&store.run(cmd).await?)? == 1)
}

/// The name a schedule's hash holds, if it holds one.
fn name_of(v: &::redis::Value) -> Option<String> {
    Fields::new(v, "sch", "schedule")
        .ok()?
        .opt("name")
        .map(str::to_owned)
}

pub(super) async fn list(store: &RedisStore) -> Result<ScheduleList> {
    let v = store.run(store.fcall("schedule_list")?).await?;
    let mut list = ScheduleList::default();
    for s in array(&v)? {
        list.push(schedule(s), || name_of(s));
    }
    list.schedules.sort_by(|a, b| a.name.cmp(&b.name));
    list.unreadable.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(list)
}

pub(super) async fn due(store: &RedisStore, p: ScheduleDue) -> Result<DueSchedules> {
    let mut cmd = store.fcall("schedule_due")?;
    cmd.arg(p.limit);
    let v = store.run(cmd).await?;
    let r = array(&v)?;
    let Some((now, rest)) = r.split_first() else {
        return Err(super::codec::corrupt("schedule_due"));
    };
    let (mut schedules, mut unreadable) = (Vec::new(), Vec::new());
    for s in rest.iter().map(schedule) {
        match s {
            Ok(s) => schedules.push(s),
            Err(e) => unreadable.push(e),
        }
    }
    Ok(DueSchedules {
        now: super::codec::ts(int(now)?)?,
        schedules,
        unreadable,
    })
}

pub(super) async fn mark_fired(store: &RedisStore, p: ScheduleMarkFired) -> Result<bool> {
    let mut cmd = store.fcall("schedule_mark_fired")?;
    cmd.arg(&p.name)
        .arg(p.cron.as_deref().unwrap_or_default())
        .arg(opt(p.every_ms))
        .arg(&p.timezone)
        .arg(opt(p.fired_at))
        .arg(opt(p.next_fire_at))
        .arg(if p.error.is_some() { "1" } else { "0" })
        .arg(p.error.as_deref().unwrap_or_default());
    let v = store.run(cmd).await?;
    Ok(int(&v)? == 1)
}
