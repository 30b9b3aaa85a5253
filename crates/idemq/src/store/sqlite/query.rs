//! Read-only queries on SQLite: jobs, their events, runs and checkpoints,
//! bindings and queue counts. States are derived from the clock on every read.

use std::collections::BTreeMap;

use rusqlite::params;
use serde_json::Value;

use super::decode::{Cols, all, one};
use super::enqueue::{keyed_job, load_binding};
use super::{Cx, ts};
use crate::error::Result;
use crate::fingerprint::key_digest;
use crate::job::{Event, Job, JobDedupe, JobIdempotency, JobState, QueueInfo, Run, Undecodable};
use crate::request::DedupeMode;
use crate::store::{
    BindingInfo, BindingRef, CheckpointGet, DedupeRef, ExplainDedupe, JobListing, JobPage,
};

const JOB_COLS: &str = "seq, id, type, queue, state, payload, result, priority, run_at, attempt,
    attempts_used, max_attempts, retry, timeout_ms, deadline, concurrency_key, tags, keep_ms,
    created_at, updated_at, finished_at, last_error, cancel_requested, lease_expires_at,
    idem_scope, idem_key_hash, idem_key_preview, dedupe_key, dedupe_mode";

struct Row {
    seq: i64,
    job: Job,
    idem: Option<(String, [u8; 32], String)>,
    dedupe: Option<(String, DedupeMode)>,
}

/// The row name of job `id` in errors.
fn job_named(id: &str) -> String {
    format!("job {id}")
}

/// A stored idempotency key hash: SHA-256, 32 bytes. Never shown.
fn key_hash(c: &Cols, col: &str, hash: &[u8]) -> Result<[u8; 32]> {
    <[u8; 32]>::try_from(hash).map_err(|_| {
        c.bad(
            col,
            Undecodable::described(format!("a key hash of {} bytes, not 32", hash.len())),
        )
    })
}

fn job_row(r: &rusqlite::Row, now: i64) -> Result<Row> {
    let mut c = Cols::new(r, "idemq_jobs", "job");
    let id: String = c.get("id")?;
    c.named(job_named(&id));
    let run_at: i64 = c.get("run_at")?;
    // A job accepted with an idempotency key stores its scope, hash and
    // preview together; a part without the others is a broken row.
    let idem = match (
        c.get::<Option<String>>("idem_scope")?,
        c.get::<Option<Vec<u8>>>("idem_key_hash")?,
    ) {
        (Some(scope), Some(hash)) => Some((
            scope,
            key_hash(&c, "idem_key_hash", &hash)?,
            c.get::<String>("idem_key_preview")?,
        )),
        (None, None) => None,
        (Some(_), None) => return Err(c.bad("idem_key_hash", Undecodable::null("key hash"))),
        (None, Some(_)) => return Err(c.bad("idem_scope", Undecodable::null("key scope"))),
    };
    let dedupe = match c.get::<Option<String>>("dedupe_key")? {
        Some(k) => Some((k, c.decode("dedupe_mode", DedupeMode::from_stored)?)),
        None => None,
    };
    Ok(Row {
        seq: c.get("seq")?,
        job: Job {
            job_type: c.get("type")?,
            queue: c.get("queue")?,
            state: c.state("state", run_at, now)?,
            payload: c.json("payload", "payload")?,
            result: c.opt_json("result", "result")?,
            priority: c.get("priority")?,
            run_at: c.instant("run_at", run_at)?,
            attempt: c.get("attempt")?,
            attempts_used: c.get("attempts_used")?,
            max_attempts: c.get("max_attempts")?,
            retry: c.json("retry", "retry policy")?,
            timeout_ms: c.get("timeout_ms")?,
            deadline: c.opt_time("deadline")?,
            concurrency_key: c.get("concurrency_key")?,
            tags: c.json("tags", "tag list")?,
            keep_ms: c.get("keep_ms")?,
            created_at: c.time("created_at")?,
            updated_at: c.time("updated_at")?,
            finished_at: c.opt_time("finished_at")?,
            last_error: c.get("last_error")?,
            cancel_requested: c.get("cancel_requested")?,
            lease_expires_at: c.opt_time("lease_expires_at")?,
            idempotency: None,
            dedupe: None,
            id,
        },
        idem,
        dedupe,
    })
}

/// Fills in the key details a row only references.
fn finish_row(cx: &Cx, row: Row) -> Result<Job> {
    let mut job = row.job;
    if let Some((scope, hash, preview)) = row.idem {
        let expires_at = one(
            cx.db.prepare_cached(
                "SELECT expires_at FROM idemq_idempotency
                 WHERE scope = ?1 AND key_hash = ?2 AND job_id = ?3 AND expires_at > ?4",
            )?,
            params![scope, &hash[..], job.id, cx.now],
            |r| {
                let what = format!("idempotency binding of job {}", job.id);
                Cols::new(r, "idemq_idempotency", what).time("expires_at")
            },
        )?;
        job.idempotency = Some(JobIdempotency {
            scope,
            key_preview: preview,
            key_digest: key_digest(&hash),
            expires_at,
        });
    }
    if let Some((key, own)) = row.dedupe {
        let holding = match load_binding(cx, &job.job_type, &key)? {
            Some(b) if b.job_id == job.id && b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => {
                Some(b)
            }
            _ => None,
        };
        job.dedupe = Some(JobDedupe {
            key,
            mode: holding.as_ref().map_or(own, |b| b.mode),
            window_until: holding
                .as_ref()
                .and_then(|b| b.window_until)
                .map(ts)
                .transpose()?,
            holds_binding: holding.is_some(),
        });
    }
    Ok(job)
}

pub(super) fn job_get(cx: &Cx, id: &str) -> Result<Option<Job>> {
    let sql = format!("SELECT {JOB_COLS} FROM idemq_jobs WHERE id = ?1");
    let row = one(cx.db.prepare_cached(&sql)?, [id], |r| job_row(r, cx.now))?;
    row.map(|r| finish_row(cx, r)).transpose()
}

pub(super) fn job_list(cx: &Cx, p: &JobListing) -> Result<JobPage> {
    let (stored, due) = (p.stored_state, p.due);
    let (cursor, limit) = (p.before_seq, p.limit);
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
    let rows: Vec<Row> = all(
        cx.db.prepare_cached(&sql)?,
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
    )?;
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
    let mut events: Vec<Event> = all(
        cx.db.prepare_cached(
            "SELECT seq, kind, at, data FROM idemq_events WHERE job_id = ?1 ORDER BY seq",
        )?,
        [id],
        |r| {
            let mut c = Cols::new(r, "idemq_events", format!("event of job {id}"));
            let seq: i64 = c.get("seq")?;
            c.named(format!("event {seq} of job {id}"));
            Ok(Event {
                seq,
                kind: c.decode("kind", |k| Event::kind_from_stored(k.to_owned()))?,
                at: c.time("at")?,
                data: c.json("data", "event data")?,
            })
        },
    )?;
    let derived = one(
        cx.db.prepare_cached(
            "SELECT seq, queue, created_at, first_run_at, idem_scope, idem_key_hash,
                    idem_key_preview, dedupe_key, dedupe_mode, claim_seq, started_at, attempt,
                    worker, done_seq, finished_at
             FROM idemq_jobs WHERE id = ?1",
        )?,
        [id],
        |r| {
            let c = Cols::new(r, "idemq_jobs", job_named(id));
            // Jobs accepted before `first_run_at` was stored were due at acceptance.
            let run_at = match c.opt_time("first_run_at")? {
                Some(at) => at,
                None => c.time("created_at")?,
            };
            let mut accepted = serde_json::json!({
                "queue": c.get::<String>("queue")?,
                "run_at": run_at,
            });
            if let Some(scope) = c.get::<Option<String>>("idem_scope")? {
                let hash: Vec<u8> = c.get("idem_key_hash")?;
                let digest = key_digest(&key_hash(&c, "idem_key_hash", &hash)?);
                accepted["idempotency"] = serde_json::json!({
                    "scope": scope,
                    "key_preview": c.get::<String>("idem_key_preview")?,
                    "key_digest": digest,
                });
            }
            if let Some(key) = c.get::<Option<String>>("dedupe_key")? {
                let mode = c.decode("dedupe_mode", DedupeMode::from_stored)?;
                accepted["dedupe"] = serde_json::json!({ "key": key, "mode": mode.as_str() });
            }
            let attempt: i32 = c.get("attempt")?;
            let mut out = vec![Event {
                seq: c.get("seq")?,
                kind: "accepted".into(),
                at: c.time("created_at")?,
                data: accepted,
            }];
            if let (Some(seq), Some(at)) = (c.get("claim_seq")?, c.opt_time("started_at")?) {
                out.push(Event {
                    seq,
                    kind: "claimed".into(),
                    at,
                    data: serde_json::json!({
                        "attempt": attempt,
                        "worker": c.get::<Option<String>>("worker")?,
                    }),
                });
            }
            if let (Some(seq), Some(at)) = (c.get("done_seq")?, c.opt_time("finished_at")?) {
                out.push(Event {
                    seq,
                    kind: "completed".into(),
                    at,
                    data: serde_json::json!({ "attempt": attempt }),
                });
            }
            Ok(out)
        },
    )?
    // No job row (purged): only the stored events are left.
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
    // The current attempt is read from the job row, whose worker may be
    // unset; the union's columns take their names from the first select.
    let mut runs: Vec<Run> = all(
        cx.db.prepare_cached(
            "SELECT attempt, worker, started_at, finished_at, outcome, error
             FROM idemq_runs WHERE job_id = ?1
             UNION ALL
             SELECT attempt, coalesce(worker, ''), started_at,
                    CASE WHEN state = 'completed' THEN finished_at END,
                    CASE WHEN state = 'completed' THEN 'completed' END, NULL
             FROM idemq_jobs
             WHERE id = ?1 AND claim_seq IS NOT NULL AND started_at IS NOT NULL",
        )?,
        [id],
        |r| {
            let mut c = Cols::new(r, "idemq_runs", format!("run of job {id}"));
            let attempt: i32 = c.get("attempt")?;
            c.named(format!("run {attempt} of job {id}"));
            Ok(Run {
                attempt,
                worker: c.get("worker")?,
                started_at: c.time("started_at")?,
                finished_at: c.opt_time("finished_at")?,
                outcome: Run::outcome_from_stored(c.get("outcome")?)
                    .map_err(|e| c.bad("outcome", e))?,
                error: c.get("error")?,
            })
        },
    )?;
    runs.sort_by_key(|r| r.attempt);
    Ok(runs)
}

/// A checkpoint's value.
fn checkpoint_value(r: &rusqlite::Row, job_id: &str, name: &str) -> Result<Value> {
    let row = format!("checkpoint {name:?} of job {job_id}");
    Cols::new(r, "idemq_checkpoints", row).json("value", "checkpoint value")
}

pub(super) fn checkpoint_list(cx: &Cx, id: &str) -> Result<BTreeMap<String, Value>> {
    Ok(all(
        cx.db
            .prepare_cached("SELECT name, value FROM idemq_checkpoints WHERE job_id = ?1")?,
        [id],
        |r| {
            let name: String = Cols::new(r, "idemq_checkpoints", "checkpoint").get("name")?;
            let value = checkpoint_value(r, id, &name)?;
            Ok((name, value))
        },
    )?
    .into_iter()
    .collect())
}

pub(super) fn checkpoint_get(cx: &Cx, p: &CheckpointGet) -> Result<Option<Value>> {
    one(
        cx.db.prepare_cached(
            "SELECT value FROM idemq_checkpoints WHERE job_id = ?1 AND name = ?2",
        )?,
        [&p.job_id, &p.name],
        |r| checkpoint_value(r, &p.job_id, &p.name),
    )
}

pub(super) fn binding_lookup(cx: &Cx, p: &BindingRef) -> Result<Option<BindingInfo>> {
    one(
        cx.db.prepare_cached(
            "SELECT job_id, key_preview, expires_at FROM idemq_idempotency
             WHERE scope = ?1 AND key_hash = ?2 AND expires_at > ?3",
        )?,
        params![p.scope, &p.hash[..], cx.now],
        |r| {
            let mut c = Cols::new(r, "idemq_idempotency", "idempotency binding");
            let job_id: String = c.get("job_id")?;
            c.named(format!("idempotency binding of job {job_id}"));
            Ok(BindingInfo {
                key_preview: c.get("key_preview")?,
                key_digest: key_digest(&p.hash),
                expires_at: c.time("expires_at")?,
                job_id,
            })
        },
    )
}

pub(super) fn dedupe_lookup(cx: &Cx, p: &DedupeRef) -> Result<Option<ExplainDedupe>> {
    Ok(match load_binding(cx, &p.job_type, &p.key)? {
        Some(b) if b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => Some(ExplainDedupe {
            job_id: b.job_id,
            mode: b.mode,
            window_until: b.window_until.map(ts).transpose()?,
        }),
        _ => None,
    })
}

pub(super) fn queue_list(cx: &Cx) -> Result<Vec<QueueInfo>> {
    let counts: Vec<(String, JobState, i64)> = all(
        cx.db.prepare_cached(
            "SELECT queue, state, state = 'waiting' AND run_at <= ?1 AS due, count(*) AS n
             FROM idemq_jobs GROUP BY 1, 2, 3",
        )?,
        [cx.now],
        |r| {
            let mut c = Cols::new(r, "idemq_jobs", "jobs");
            let queue: String = c.get("queue")?;
            c.named(format!("jobs of queue {queue}"));
            let due: bool = c.get("due")?;
            let state = c.decode("state", |s| JobState::from_stored(s, due))?;
            Ok((queue, state, c.get("n")?))
        },
    )?;
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
    for (name, state, n) in counts {
        out.entry(name.clone())
            .or_insert_with(|| blank(&name))
            .counts
            .add(state, n as u64);
    }
    Ok(out.into_values().collect())
}
