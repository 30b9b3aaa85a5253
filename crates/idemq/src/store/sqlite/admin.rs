//! Operator actions on SQLite: cancel, purge, promote, redrive, pause, binding
//! release, and the bounded maintenance sweeps.

use rusqlite::{OptionalExtension, params};
use serde_json::json;

use super::decode::{Cols, one};
use super::enqueue::{bind_key, conflict, idem_live, keyed_job, load_binding};
use super::exec::finish;
use super::{Cx, ts};
use crate::error::{Error, Result};
use crate::job::{CancelOutcome, EnqueueResult, JobState, Outcome};
use crate::store::{BindingRef, JobCancelByKey, JobRedrive, QueuePause};

/// Releases the dedupe binding `job_id` holds, if it still holds one (the
/// generation rule: a job never frees a key another job now holds).
pub(super) fn release_dedupe(cx: &Cx, job_id: &str) -> Result<()> {
    cx.db
        .prepare_cached("DELETE FROM idemq_dedupe WHERE job_id = ?1")?
        .execute([job_id])?;
    Ok(())
}

/// The stored state and derived state of a job, its consumed attempts and retention.
type Status = (String, JobState, i32, Option<i64>);

fn state_of(cx: &Cx, job_id: &str) -> Result<Option<Status>> {
    one(
        cx.db.prepare_cached(
            "SELECT state, run_at, attempts_used, keep_ms FROM idemq_jobs WHERE id = ?1",
        )?,
        [job_id],
        |r| {
            let c = Cols::new(r, "idemq_jobs", format!("job {job_id}"));
            let run_at: i64 = c.get("run_at")?;
            Ok((
                c.get("state")?,
                c.state("state", run_at, cx.now)?,
                c.get("attempts_used")?,
                c.get("keep_ms")?,
            ))
        },
    )
}

fn cancel_waiting(cx: &Cx, id: &str, used: i32, keep: Option<i64>) -> Result<()> {
    finish(cx, id, "cancelled", used, None, keep)?;
    release_dedupe(cx, id)?;
    cx.event(id, "cancelled", json!({}))
}

fn request_cancel(cx: &Cx, id: &str) -> Result<()> {
    let changed = cx
        .db
        .prepare_cached(
            "UPDATE idemq_jobs SET cancel_requested = 1, updated_at = ?2
             WHERE id = ?1 AND cancel_requested = 0",
        )?
        .execute(params![id, cx.now])?;
    if changed == 1 {
        cx.event(id, "cancel_requested", json!({}))?;
    }
    Ok(())
}

pub(super) fn cancel(cx: &Cx, id: &str) -> Result<Result<CancelOutcome>> {
    let Some((stored, state, used, keep)) = state_of(cx, id)? else {
        return Ok(Err(Error::job_not_found(id)));
    };
    Ok(Ok(match stored.as_str() {
        "waiting" => {
            cancel_waiting(cx, id, used, keep)?;
            CancelOutcome {
                cancelled: true,
                state: JobState::Cancelled,
            }
        }
        "active" => {
            request_cancel(cx, id)?;
            CancelOutcome {
                cancelled: true,
                state: JobState::Active,
            }
        }
        _ => CancelOutcome {
            cancelled: false,
            state,
        },
    }))
}

pub(super) fn cancel_by_key(cx: &Cx, p: &JobCancelByKey) -> Result<bool> {
    let jobs: Vec<(String, String, i32, Option<i64>)> = cx
        .db
        .prepare_cached(
            "SELECT id, state, attempts_used, keep_ms FROM idemq_jobs
             WHERE type = ?1 AND dedupe_key = ?2 AND state IN ('waiting', 'active')",
        )?
        .query_map([&p.job_type, &p.key], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })?
        .collect::<rusqlite::Result<_>>()?;
    for (id, state, used, keep) in &jobs {
        if state == "waiting" {
            cancel_waiting(cx, id, *used, *keep)?;
        } else {
            request_cancel(cx, id)?;
        }
    }
    if !jobs.is_empty() {
        cx.db
            .prepare_cached("DELETE FROM idemq_dedupe WHERE type = ?1 AND key = ?2")?
            .execute([&p.job_type, &p.key])?;
    }
    Ok(!jobs.is_empty())
}

pub(super) fn purge(cx: &Cx, id: &str) -> Result<bool> {
    let row: Option<(String, i32)> = cx
        .db
        .prepare_cached("SELECT state, attempt FROM idemq_jobs WHERE id = ?1")?
        .query_row([id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    let Some((state, attempt)) = row else {
        return Ok(false);
    };
    if state == "active" {
        return Ok(false);
    }
    delete_job(cx, id)?;
    release_dedupe(cx, id)?;
    if attempt == 0 {
        // The work never happened, so its keys may own new work.
        cx.db
            .prepare_cached("DELETE FROM idemq_idempotency WHERE job_id = ?1")?
            .execute([id])?;
    }
    Ok(true)
}

fn delete_job(cx: &Cx, id: &str) -> Result<()> {
    for sql in [
        "DELETE FROM idemq_events WHERE job_id = ?1",
        "DELETE FROM idemq_runs WHERE job_id = ?1",
        "DELETE FROM idemq_checkpoints WHERE job_id = ?1",
        "DELETE FROM idemq_jobs WHERE id = ?1",
    ] {
        cx.db.prepare_cached(sql)?.execute([id])?;
    }
    Ok(())
}

pub(super) fn promote(cx: &Cx, id: &str) -> Result<Result<bool>> {
    let Some((_, state, _, _)) = state_of(cx, id)? else {
        return Ok(Err(Error::job_not_found(id)));
    };
    if state != JobState::Scheduled {
        return Ok(Ok(false));
    }
    cx.db
        .prepare_cached("UPDATE idemq_jobs SET run_at = ?2, updated_at = ?2 WHERE id = ?1")?
        .execute(params![id, cx.now])?;
    cx.event(id, "promoted", json!({}))?;
    Ok(Ok(true))
}

pub(super) fn redrive(cx: &Cx, p: &JobRedrive) -> Result<Result<EnqueueResult>> {
    // A live redrive key decides, as an idempotency key does for enqueue.
    if let Some(k) = &p.key
        && let Some(b) = idem_live(cx, k)?
    {
        let fields = p.fingerprint.diff(&b.fingerprint, false);
        return Ok(if fields.is_empty() {
            Ok(EnqueueResult {
                job_id: b.job_id,
                outcome: Outcome::Replayed,
            })
        } else {
            Err(conflict(b.job_id, Some(k), fields))
        });
    }
    let Some((_, state, _, _)) = state_of(cx, &p.job_id)? else {
        return Ok(Err(Error::job_not_found(&p.job_id)));
    };
    if state != JobState::Dead {
        return Ok(Err(Error::NotDead {
            job_id: p.job_id.clone(),
            state,
        }));
    }
    if let Some(d) = p.deadline
        && d <= cx.now
    {
        return Ok(Err(Error::validation("deadline", "must be in the future")));
    }
    let run_at = p.run_at.unwrap_or(cx.now);
    if let Some(d) = p.deadline
        && run_at >= d
    {
        return Ok(Err(Error::validation(
            "run_at",
            "must be before the deadline",
        )));
    }
    // A passed deadline is cleared unless a new one is given.
    cx.db
        .prepare_cached(
            "UPDATE idemq_jobs SET state = 'waiting', attempts_used = 0,
               max_attempts = coalesce(?2, max_attempts), run_at = ?3,
               deadline = CASE WHEN ?4 IS NOT NULL THEN ?4
                               WHEN deadline > ?5 THEN deadline ELSE NULL END,
               finished_at = NULL, purge_after = NULL, cancel_requested = 0, updated_at = ?5
             WHERE id = ?1",
        )?
        .execute(params![
            p.job_id,
            p.max_attempts,
            run_at,
            p.deadline,
            cx.now
        ])?;
    // Redrive does not take dedupe bindings (docs/worker.md). A binding without a
    // window lives while its job is pending, so one left behind by the dead
    // job would come back to life now; it ended when the job died, so drop it.
    cx.db
        .prepare_cached("DELETE FROM idemq_dedupe WHERE job_id = ?1 AND window_until IS NULL")?
        .execute([&p.job_id])?;
    if p.reset_checkpoints {
        cx.db
            .prepare_cached("DELETE FROM idemq_checkpoints WHERE job_id = ?1")?
            .execute([&p.job_id])?;
    }
    cx.event(
        &p.job_id,
        "redriven",
        json!({ "run_at": ts(run_at)?, "reset_checkpoints": p.reset_checkpoints }),
    )?;
    if let Some(k) = &p.key {
        bind_key(cx, k, &p.job_id, &p.fingerprint)?;
    }
    Ok(Ok(EnqueueResult {
        job_id: p.job_id.clone(),
        outcome: Outcome::Accepted,
    }))
}

pub(super) fn pause(cx: &Cx, p: &QueuePause) -> Result<bool> {
    cx.db
        .prepare_cached(
            "INSERT INTO idemq_queues (name, paused, updated_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (name) DO UPDATE SET paused = excluded.paused, updated_at = excluded.updated_at",
        )?
        .execute(params![p.queue, p.paused, cx.now])?;
    Ok(p.paused)
}

pub(super) fn binding_release(cx: &Cx, p: &BindingRef) -> Result<bool> {
    let row: Option<(String, String)> = cx
        .db
        .prepare_cached(
            "DELETE FROM idemq_idempotency WHERE scope = ?1 AND key_hash = ?2 AND expires_at > ?3
             RETURNING job_id, key_preview",
        )?
        .query_row(params![p.scope, &p.hash[..], cx.now], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .optional()?;
    let Some((job_id, preview)) = row else {
        return Ok(false);
    };
    let exists: bool = cx
        .db
        .prepare_cached("SELECT EXISTS (SELECT 1 FROM idemq_jobs WHERE id = ?1)")?
        .query_row([&job_id], |r| r.get(0))?;
    if exists {
        let digest = crate::fingerprint::key_digest(&p.hash);
        cx.event(
            &job_id,
            "binding_released",
            json!({ "scope": p.scope, "key_preview": preview, "key_digest": digest }),
        )?;
    }
    Ok(true)
}

/// Removes expired idempotency bindings and dedupe bindings that are no longer live.
pub(super) fn binding_sweep(cx: &Cx, limit: u32) -> Result<u64> {
    let idem = cx
        .db
        .prepare_cached(
            "DELETE FROM idemq_idempotency WHERE (scope, key_hash) IN (
               SELECT scope, key_hash FROM idemq_idempotency WHERE expires_at <= ?1 LIMIT ?2)",
        )?
        .execute(params![cx.now, limit])?;
    // One pass removes at most `limit` rows of both kinds together.
    let limit = limit.saturating_sub(idem as u32);
    let candidates: Vec<(String, String)> = cx
        .db
        .prepare_cached(
            "SELECT type, key FROM idemq_dedupe d
             WHERE window_until <= ?1
                OR (window_until IS NULL AND NOT EXISTS (
                      SELECT 1 FROM idemq_jobs j
                      WHERE j.id = d.job_id AND j.state IN ('waiting', 'active')))
             LIMIT ?2",
        )?
        .query_map(params![cx.now, limit], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut removed = idem as u64;
    for (t, k) in candidates {
        // Re-check liveness with the same rule enqueue uses.
        if let Some(b) = load_binding(cx, &t, &k)?
            && !b.is_live(keyed_job(cx, &b.job_id)?, cx.now)
        {
            removed += cx
                .db
                .prepare_cached("DELETE FROM idemq_dedupe WHERE type = ?1 AND key = ?2")?
                .execute([&t, &k])? as u64;
        }
    }
    Ok(removed)
}

/// Deletes terminal jobs past their retention, never one a live binding points at.
pub(super) fn retention_sweep(cx: &Cx, limit: u32) -> Result<u64> {
    let ids: Vec<String> = cx
        .db
        .prepare_cached(
            "SELECT id FROM idemq_jobs j
             WHERE purge_after <= ?1 AND state IN ('completed', 'dead', 'cancelled')
               AND NOT EXISTS (SELECT 1 FROM idemq_idempotency b
                               WHERE b.job_id = j.id AND b.expires_at > ?1)
               AND NOT EXISTS (SELECT 1 FROM idemq_dedupe d
                               WHERE d.job_id = j.id AND d.window_until > ?1)
             ORDER BY purge_after LIMIT ?2",
        )?
        .query_map(params![cx.now, limit], |r| r.get(0))?
        .collect::<rusqlite::Result<_>>()?;
    for id in &ids {
        delete_job(cx, id)?;
        release_dedupe(cx, id)?;
    }
    Ok(ids.len() as u64)
}
