//! Read-only queries on SQLite: jobs, their events, runs and checkpoints,
//! bindings and queue counts. States are derived from the clock on every read.

use std::collections::BTreeMap;

use rusqlite::{OptionalExtension, params};
use serde_json::Value;

use super::admin::derive;
use super::enqueue::{keyed_job, load_binding};
use super::{Cx, ts};
use crate::error::Result;
use crate::fingerprint::key_digest;
use crate::job::{Event, Job, JobDedupe, JobIdempotency, QueueInfo, Run};
use crate::request::DedupeMode;
use crate::store::{
    BindingInfo, BindingRef, CheckpointGet, DedupeRef, ExplainDedupe, JobList, JobPage,
};

const JOB_COLS: &str = "seq, id, type, queue, state, payload, result, priority, run_at, attempt,
    attempts_used, max_attempts, retry, timeout_ms, deadline, concurrency_key, tags, keep_ms,
    created_at, updated_at, finished_at, last_error, cancel_requested, lease_expires_at,
    idem_scope, idem_key_hash, idem_key_preview, dedupe_key, dedupe_mode";

struct Row {
    seq: i64,
    job: Job,
    idem: Option<(String, Vec<u8>, String)>,
    dedupe: Option<(String, String)>,
}

fn json(s: Option<String>) -> Option<Value> {
    s.map(|s| serde_json::from_str(&s).unwrap_or(Value::Null))
}

fn job_row(r: &rusqlite::Row, now: i64) -> rusqlite::Result<Row> {
    let stored: String = r.get(4)?;
    let run_at: i64 = r.get(8)?;
    let idem = match (
        r.get::<_, Option<String>>(24)?,
        r.get::<_, Option<Vec<u8>>>(25)?,
    ) {
        (Some(scope), Some(hash)) => Some((scope, hash, r.get::<_, String>(26)?)),
        _ => None,
    };
    let dedupe = match (
        r.get::<_, Option<String>>(27)?,
        r.get::<_, Option<String>>(28)?,
    ) {
        (Some(k), Some(m)) => Some((k, m)),
        _ => None,
    };
    Ok(Row {
        seq: r.get(0)?,
        job: Job {
            id: r.get(1)?,
            job_type: r.get(2)?,
            queue: r.get(3)?,
            state: derive(&stored, run_at, now),
            payload: json(r.get(5)?).unwrap_or(Value::Null),
            result: json(r.get(6)?),
            priority: r.get(7)?,
            run_at: ts(run_at),
            attempt: r.get(9)?,
            attempts_used: r.get(10)?,
            max_attempts: r.get(11)?,
            retry: serde_json::from_str(&r.get::<_, String>(12)?).unwrap_or_default(),
            timeout_ms: r.get(13)?,
            deadline: r.get::<_, Option<i64>>(14)?.map(ts),
            concurrency_key: r.get(15)?,
            tags: serde_json::from_str(&r.get::<_, String>(16)?).unwrap_or_default(),
            keep_ms: r.get(17)?,
            created_at: ts(r.get(18)?),
            updated_at: ts(r.get(19)?),
            finished_at: r.get::<_, Option<i64>>(20)?.map(ts),
            last_error: r.get(21)?,
            cancel_requested: r.get(22)?,
            lease_expires_at: r.get::<_, Option<i64>>(23)?.map(ts),
            idempotency: None,
            dedupe: None,
        },
        idem,
        dedupe,
    })
}

/// Fills in the key details a row only references.
fn finish_row(cx: &Cx, row: Row) -> Result<Job> {
    let mut job = row.job;
    if let Some((scope, hash, preview)) = row.idem {
        let expires_at: Option<i64> = cx
            .db
            .prepare_cached(
                "SELECT expires_at FROM idemq_idempotency
                 WHERE scope = ?1 AND key_hash = ?2 AND job_id = ?3 AND expires_at > ?4",
            )?
            .query_row(params![scope, hash, job.id, cx.now], |r| r.get(0))
            .optional()?;
        let mut h = [0u8; 32];
        if hash.len() == 32 {
            h.copy_from_slice(&hash);
        }
        job.idempotency = Some(JobIdempotency {
            scope,
            key_preview: preview,
            key_digest: key_digest(&h),
            expires_at: expires_at.map(ts),
        });
    }
    if let Some((key, mode)) = row.dedupe {
        let own = DedupeMode::parse(&mode).unwrap_or(DedupeMode::Pending);
        let holding = match load_binding(cx, &job.job_type, &key)? {
            Some(b) if b.job_id == job.id && b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => {
                Some(b)
            }
            _ => None,
        };
        job.dedupe = Some(JobDedupe {
            key,
            mode: holding.as_ref().map_or(own, |b| b.mode),
            window_until: holding.as_ref().and_then(|b| b.window_until).map(ts),
            holds_binding: holding.is_some(),
        });
    }
    Ok(job)
}

pub(super) fn job_get(cx: &Cx, id: &str) -> Result<Option<Job>> {
    let sql = format!("SELECT {JOB_COLS} FROM idemq_jobs WHERE id = ?1");
    let row = cx
        .db
        .prepare_cached(&sql)?
        .query_row([id], |r| job_row(r, cx.now))
        .optional()?;
    row.map(|r| finish_row(cx, r)).transpose()
}

pub(super) fn job_list(cx: &Cx, p: &JobList) -> Result<JobPage> {
    let (stored, due) = p.stored_state();
    let (cursor, limit) = (p.seq_cursor(), p.limit.clamp(1, 1000));
    let sql = format!(
        "SELECT {JOB_COLS} FROM idemq_jobs j
         WHERE (?1 IS NULL OR state = ?1)
           AND (?2 IS NULL OR (?2 = 1) = (run_at <= ?3))
           AND (?4 IS NULL OR queue = ?4)
           AND (?5 IS NULL OR type = ?5)
           AND (?6 IS NULL OR EXISTS (SELECT 1 FROM json_each(j.tags) WHERE value = ?6))
           AND (?7 IS NULL OR seq < ?7)
         ORDER BY seq DESC LIMIT ?8"
    );
    let rows: Vec<Row> = cx
        .db
        .prepare_cached(&sql)?
        .query_map(
            params![
                stored,
                due,
                cx.now,
                p.queue,
                p.job_type,
                p.tag,
                cursor,
                limit + 1
            ],
            |r| job_row(r, cx.now),
        )?
        .collect::<rusqlite::Result<_>>()?;
    let more = rows.len() as u32 > limit;
    let mut jobs = Vec::with_capacity(rows.len());
    let mut last = None;
    for row in rows.into_iter().take(limit as usize) {
        last = Some(row.seq);
        jobs.push(finish_row(cx, row)?);
    }
    Ok(JobPage {
        jobs,
        next_cursor: if more {
            last.map(|s| s.to_string())
        } else {
            None
        },
    })
}

/// A job's history, oldest first: the stored events and the routine ones
/// derived from the job row. `accepted` is derived from the row (under the
/// job's own number) unless it is stored (jobs accepted before the history
/// was derived); `claimed` for the current attempt while it runs or once it
/// completed (`claim_seq`), `completed` once it did (`done_seq`). An attempt
/// that ends otherwise writes its `claimed` event out under the same number,
/// so the order never depends on which events are stored.
pub(super) fn job_events(cx: &Cx, id: &str) -> Result<Vec<Event>> {
    let mut events: Vec<Event> = cx
        .db
        .prepare_cached(
            "SELECT seq, kind, at, data FROM idemq_events WHERE job_id = ?1 ORDER BY seq",
        )?
        .query_map([id], |r| {
            Ok(Event {
                seq: r.get(0)?,
                kind: r.get(1)?,
                at: ts(r.get(2)?),
                data: json(r.get(3)?).unwrap_or(Value::Null),
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    let derived = cx
        .db
        .prepare_cached(
            "SELECT seq, queue, created_at, first_run_at, idem_scope, idem_key_hash,
                    idem_key_preview, dedupe_key, dedupe_mode, claim_seq, started_at, attempt,
                    worker, done_seq, finished_at
             FROM idemq_jobs WHERE id = ?1",
        )?
        .query_row([id], |r| {
            let mut accepted = serde_json::json!({
                "queue": r.get::<_, String>(1)?,
                "run_at": ts(r.get::<_, Option<i64>>(3)?.unwrap_or(r.get(2)?)),
            });
            if let Some(scope) = r.get::<_, Option<String>>(4)? {
                let hash: Vec<u8> = r.get::<_, Option<Vec<u8>>>(5)?.unwrap_or_default();
                let digest = <[u8; 32]>::try_from(hash.as_slice())
                    .map(|h| key_digest(&h))
                    .unwrap_or_default();
                accepted["idempotency"] = serde_json::json!({
                    "scope": scope,
                    "key_preview": r.get::<_, Option<String>>(6)?,
                    "key_digest": digest,
                });
            }
            if let Some(key) = r.get::<_, Option<String>>(7)? {
                accepted["dedupe"] =
                    serde_json::json!({ "key": key, "mode": r.get::<_, Option<String>>(8)? });
            }
            let attempt: i32 = r.get(11)?;
            let mut out = vec![Event {
                seq: r.get(0)?,
                kind: "accepted".into(),
                at: ts(r.get(2)?),
                data: accepted,
            }];
            if let (Some(seq), Some(at)) = (r.get::<_, Option<i64>>(9)?, r.get(10)?) {
                out.push(Event {
                    seq,
                    kind: "claimed".into(),
                    at: ts(at),
                    data: serde_json::json!({
                        "attempt": attempt,
                        "worker": r.get::<_, Option<String>>(12)?,
                    }),
                });
            }
            if let (Some(seq), Some(at)) = (r.get::<_, Option<i64>>(13)?, r.get(14)?) {
                out.push(Event {
                    seq,
                    kind: "completed".into(),
                    at: ts(at),
                    data: serde_json::json!({ "attempt": attempt }),
                });
            }
            Ok(out)
        })
        .optional()?
        .unwrap_or_default();
    let stored_accepted = events.iter().any(|e| e.kind == "accepted");
    events.extend(
        derived
            .into_iter()
            .filter(|e| !(stored_accepted && e.kind == "accepted")),
    );
    events.sort_by_key(|e| e.seq);
    Ok(events)
}

/// A job's run ledger: the attempts written out (each ended other than
/// completed) and the current attempt, derived from the job row while it
/// runs and once it completed.
pub(super) fn job_runs(cx: &Cx, id: &str) -> Result<Vec<Run>> {
    let mut runs: Vec<Run> = cx
        .db
        .prepare_cached(
            "SELECT attempt, worker, started_at, finished_at, outcome, error
             FROM idemq_runs WHERE job_id = ?1
             UNION ALL
             SELECT attempt, coalesce(worker, ''), started_at,
                    CASE WHEN state = 'completed' THEN finished_at END,
                    CASE WHEN state = 'completed' THEN 'completed' END, NULL
             FROM idemq_jobs
             WHERE id = ?1 AND claim_seq IS NOT NULL AND started_at IS NOT NULL",
        )?
        .query_map([id], |r| {
            Ok(Run {
                attempt: r.get(0)?,
                worker: r.get(1)?,
                started_at: ts(r.get(2)?),
                finished_at: r.get::<_, Option<i64>>(3)?.map(ts),
                outcome: r.get(4)?,
                error: r.get(5)?,
            })
        })?
        .collect::<rusqlite::Result<_>>()?;
    runs.sort_by_key(|r| r.attempt);
    Ok(runs)
}

pub(super) fn checkpoint_list(cx: &Cx, id: &str) -> Result<BTreeMap<String, Value>> {
    Ok(cx
        .db
        .prepare_cached("SELECT name, value FROM idemq_checkpoints WHERE job_id = ?1")?
        .query_map([id], |r| {
            Ok((r.get(0)?, json(r.get(1)?).unwrap_or(Value::Null)))
        })?
        .collect::<rusqlite::Result<_>>()?)
}

pub(super) fn checkpoint_get(cx: &Cx, p: &CheckpointGet) -> Result<Option<Value>> {
    let v: Option<String> = cx
        .db
        .prepare_cached("SELECT value FROM idemq_checkpoints WHERE job_id = ?1 AND name = ?2")?
        .query_row([&p.job_id, &p.name], |r| r.get(0))
        .optional()?;
    Ok(json(v))
}

pub(super) fn binding_lookup(cx: &Cx, p: &BindingRef) -> Result<Option<BindingInfo>> {
    Ok(cx
        .db
        .prepare_cached(
            "SELECT job_id, key_preview, expires_at FROM idemq_idempotency
             WHERE scope = ?1 AND key_hash = ?2 AND expires_at > ?3",
        )?
        .query_row(params![p.scope, &p.hash[..], cx.now], |r| {
            Ok(BindingInfo {
                job_id: r.get(0)?,
                key_preview: r.get(1)?,
                key_digest: key_digest(&p.hash),
                expires_at: ts(r.get(2)?),
            })
        })
        .optional()?)
}

pub(super) fn dedupe_lookup(cx: &Cx, p: &DedupeRef) -> Result<Option<ExplainDedupe>> {
    Ok(match load_binding(cx, &p.job_type, &p.key)? {
        Some(b) if b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => Some(ExplainDedupe {
            job_id: b.job_id,
            mode: b.mode,
            window_until: b.window_until.map(ts),
        }),
        _ => None,
    })
}

pub(super) fn queue_list(cx: &Cx) -> Result<Vec<QueueInfo>> {
    let counts: Vec<(String, String, bool, i64)> = cx
        .db
        .prepare_cached(
            "SELECT queue, state, state = 'waiting' AND run_at <= ?1, count(*)
             FROM idemq_jobs GROUP BY 1, 2, 3",
        )?
        .query_map([cx.now], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })?
        .collect::<rusqlite::Result<_>>()?;
    let paused: Vec<(String, bool)> = cx
        .db
        .prepare_cached("SELECT name, paused FROM idemq_queues")?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut out: BTreeMap<String, QueueInfo> = BTreeMap::new();
    let blank = |name: &str| QueueInfo {
        name: name.to_owned(),
        paused: false,
        counts: Default::default(),
        estimated: Vec::new(),
    };
    for (name, is_paused) in paused {
        out.entry(name.clone())
            .or_insert_with(|| blank(&name))
            .paused = is_paused;
    }
    for (name, stored, due, n) in counts {
        let state = derive(&stored, if due { cx.now } else { cx.now + 1 }, cx.now);
        out.entry(name.clone())
            .or_insert_with(|| blank(&name))
            .counts
            .add(state, n as u64);
    }
    Ok(out.into_values().collect())
}
