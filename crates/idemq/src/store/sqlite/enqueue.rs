//! Enqueue on SQLite: the order of checks of SPEC 5 inside one transaction.
//! Every decision is made before anything is written, so a refused item
//! leaves no trace and a batch needs no per-item savepoints.

use rusqlite::params;
use serde_json::json;

use super::decode::{Cols, one};
use super::{Cx, ts};
use crate::dedupe::{Binding, Decision, KeyedJob};
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;
use crate::job::{EnqueueResult, JobState, Outcome};
use crate::request::{DedupeMode, PreparedEnqueue, PreparedKey, defaults};
use crate::store::{Explain, ExplainDedupe, ExplainIdempotency};

/// A live idempotency binding.
pub(super) struct IdemBinding {
    pub(super) job_id: String,
    pub(super) fingerprint: Fingerprint,
    expires_at: i64,
}

pub(super) fn idem_live(cx: &Cx, k: &PreparedKey) -> Result<Option<IdemBinding>> {
    one(
        cx.db.prepare_cached(
            "SELECT job_id, fingerprint, expires_at FROM idemq_idempotency
             WHERE scope = ?1 AND key_hash = ?2 AND expires_at > ?3",
        )?,
        params![k.scope, &k.hash[..], cx.now],
        |r| {
            let mut c = Cols::new(r, "idemq_idempotency", "idempotency binding");
            let job_id: String = c.get("job_id")?;
            c.named(format!("idempotency binding of job {job_id}"));
            let expires_at: i64 = c.get("expires_at")?;
            c.instant("expires_at", expires_at)?;
            Ok(IdemBinding {
                fingerprint: c.json("fingerprint", "fingerprint")?,
                expires_at,
                job_id,
            })
        },
    )
}

/// Binds `key` to `job_id` for its ttl. Any row already there is expired
/// (a live one would have decided the request), so it is replaced.
pub(super) fn bind_key(cx: &Cx, k: &PreparedKey, job_id: &str, fp: &Fingerprint) -> Result<()> {
    cx.db
        .prepare_cached(
            "INSERT OR REPLACE INTO idemq_idempotency
               (scope, key_hash, key_preview, job_id, fingerprint, created_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        )?
        .execute(params![
            k.scope,
            &k.hash[..],
            k.preview,
            job_id,
            fp.to_json(),
            cx.now,
            cx.now + k.ttl_ms * 1000
        ])?;
    Ok(())
}

pub(super) fn conflict(job_id: String, key: Option<&PreparedKey>, fields: Vec<String>) -> Error {
    Error::idempotency_conflict(job_id, key, fields)
}

pub(super) fn load_binding(cx: &Cx, job_type: &str, key: &str) -> Result<Option<Binding>> {
    one(
        cx.db.prepare_cached(
            "SELECT job_id, mode, ttl_ms, max_wait_ms, accepted_at, window_until
             FROM idemq_dedupe WHERE type = ?1 AND key = ?2",
        )?,
        params![job_type, key],
        |r| {
            let mut c = Cols::new(r, "idemq_dedupe", "dedupe binding");
            let job_id: String = c.get("job_id")?;
            c.named(format!("dedupe binding of job {job_id}"));
            // The instants stay µs for the decisions; each must be one.
            let accepted_at: i64 = c.get("accepted_at")?;
            c.instant("accepted_at", accepted_at)?;
            let window_until: Option<i64> = c.get("window_until")?;
            if let Some(us) = window_until {
                c.instant("window_until", us)?;
            }
            Ok(Binding {
                mode: c.decode("mode", DedupeMode::from_stored)?,
                ttl_ms: c.get("ttl_ms")?,
                max_wait_ms: c.get("max_wait_ms")?,
                accepted_at,
                window_until,
                job_id,
            })
        },
    )
}

/// Where a job stands for dedupe.
pub(super) fn keyed_job(cx: &Cx, job_id: &str) -> Result<KeyedJob> {
    let row = one(
        cx.db
            .prepare_cached("SELECT state, attempt, run_at FROM idemq_jobs WHERE id = ?1")?,
        [job_id],
        |r| {
            let c = Cols::new(r, "idemq_jobs", format!("job {job_id}"));
            let run_at: i64 = c.get("run_at")?;
            Ok((c.state("state", run_at, cx.now)?, c.get::<i32>("attempt")?))
        },
    )?;
    Ok(match row {
        None => KeyedJob::Missing,
        Some((state, attempt)) => match state {
            JobState::Scheduled | JobState::Ready => KeyedJob::Waiting {
                started: attempt > 0,
                due: state == JobState::Ready,
            },
            JobState::Active => KeyedJob::Active,
            JobState::Cancelled => KeyedJob::Cancelled,
            JobState::Completed | JobState::Dead => KeyedJob::Finished,
        },
    })
}

/// The due time of a new or replacing job: `run_at`, or now + `delay`, or
/// now; never later than first acceptance + `max_wait` (the request's for a
/// new job, the binding's own for a replace: a binding keeps the max_wait it
/// was created with).
fn resolve_run_at(
    p: &PreparedEnqueue,
    now: i64,
    first_accepted: i64,
    max_wait_ms: Option<i64>,
) -> i64 {
    let run_at = p
        .run_at
        .unwrap_or_else(|| now + p.delay_ms.unwrap_or(0) * 1000);
    match max_wait_ms {
        Some(w) => run_at.min(first_accepted + w * 1000),
        None => run_at,
    }
}

/// The checks against the clock, applied only when a job is created or replaced.
fn check_clock(p: &PreparedEnqueue, run_at: i64, now: i64) -> Result<()> {
    if let Some(deadline) = p.deadline {
        if deadline <= now {
            return Err(Error::validation("deadline", "must be in the future"));
        }
        if run_at >= deadline {
            let field = if p.delay_ms.is_some() {
                "delay_ms"
            } else {
                "run_at"
            };
            return Err(Error::validation(field, "must be before the deadline"));
        }
    }
    Ok(())
}

/// Inserts an accepted job. Its `accepted` event is derived from the row
/// (its number is the job's `seq`, the history's next number).
fn insert_job(cx: &Cx, p: &PreparedEnqueue, id: &str, run_at: i64) -> Result<()> {
    let k = p.idempotency.as_ref();
    let d = p.dedupe.as_ref();
    let seq = cx.peek_seq()?;
    cx.db
        .prepare_cached(
            "INSERT INTO idemq_jobs (id, type, queue, state, payload, priority, run_at,
               max_attempts, retry, timeout_ms, deadline, concurrency_key, tags, keep_ms,
               fingerprint, idem_scope, idem_key_hash, idem_key_preview, dedupe_key,
               dedupe_mode, created_at, updated_at, seq, first_run_at)
             VALUES (?1, ?2, ?3, 'waiting', ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14,
               ?15, ?16, ?17, ?18, ?19, ?20, ?20, ?21, ?22)",
        )?
        .execute(params![
            id,
            p.job_type,
            p.queue,
            p.payload,
            p.priority,
            run_at,
            p.max_attempts,
            serde_json::to_string(&p.retry).expect("a retry policy is numbers and flags"),
            p.timeout_ms,
            p.deadline,
            p.concurrency_key,
            serde_json::to_string(&p.tags).expect("tags are strings"),
            p.keep_ms,
            p.fingerprint.to_json(),
            k.map(|k| &k.scope),
            k.map(|k| &k.hash[..]),
            k.map(|k| &k.preview),
            d.map(|d| &d.key),
            d.map(|d| d.mode.as_str()),
            cx.now,
            seq,
            (run_at != cx.now).then_some(run_at),
        ])?;
    Ok(())
}

/// A landed replace: every field of SPEC 3 but type, queue, id and keys.
fn replace_job(cx: &Cx, p: &PreparedEnqueue, id: &str, run_at: i64) -> Result<()> {
    cx.db
        .prepare_cached(
            "UPDATE idemq_jobs SET payload = ?2, priority = ?3, run_at = ?4, max_attempts = ?5,
               retry = ?6, timeout_ms = ?7, deadline = ?8, concurrency_key = ?9, tags = ?10,
               keep_ms = ?11, fingerprint = ?12, updated_at = ?13
             WHERE id = ?1",
        )?
        .execute(params![
            id,
            p.payload,
            p.priority,
            run_at,
            p.max_attempts,
            serde_json::to_string(&p.retry).expect("a retry policy is numbers and flags"),
            p.timeout_ms,
            p.deadline,
            p.concurrency_key,
            serde_json::to_string(&p.tags).expect("tags are strings"),
            p.keep_ms,
            p.fingerprint.to_json(),
            cx.now,
        ])?;
    cx.event(id, "replaced", json!({ "run_at": ts(run_at)? }))
}

fn set_window(cx: &Cx, job_type: &str, key: &str, until: i64) -> Result<()> {
    cx.db
        .prepare_cached("UPDATE idemq_dedupe SET window_until = ?3 WHERE type = ?1 AND key = ?2")?
        .execute(params![job_type, key, until])?;
    Ok(())
}

fn done(job_id: String, outcome: Outcome) -> Result<Result<EnqueueResult>> {
    Ok(Ok(EnqueueResult { job_id, outcome }))
}

/// Decides and applies one request. The outer `Result` is the database's;
/// the inner one is the request's own answer (a refused request wrote nothing).
fn enqueue_one(cx: &Cx, p: &PreparedEnqueue) -> Result<Result<EnqueueResult>> {
    let now = cx.now;
    let key = p.idempotency.as_ref();
    // 1. A live idempotency binding decides: replay or conflict.
    if let Some(k) = key
        && let Some(b) = idem_live(cx, k)?
    {
        let fields = p.fingerprint.diff(&b.fingerprint, false);
        return if fields.is_empty() {
            done(b.job_id, Outcome::Replayed)
        } else {
            Ok(Err(conflict(b.job_id, Some(k), fields)))
        };
    }
    // 2. An existing record with the explicit id: replay or conflict.
    if let Some(id) = &p.job_id {
        let stored: Option<Fingerprint> = one(
            cx.db
                .prepare_cached("SELECT fingerprint FROM idemq_jobs WHERE id = ?1")?,
            [id],
            |r| Cols::new(r, "idemq_jobs", format!("job {id}")).json("fingerprint", "fingerprint"),
        )?;
        if let Some(stored) = stored {
            let fields = p.fingerprint.diff(&stored, true);
            if !fields.is_empty() {
                return Ok(Err(conflict(id.clone(), None, fields)));
            }
            if let Some(k) = key {
                bind_key(cx, k, id, &p.fingerprint)?;
            }
            return done(id.clone(), Outcome::Replayed);
        }
    }
    // 3. A live dedupe binding: coalesce, replace or refuse to replace.
    let mut first_accepted = now;
    if let Some(d) = &p.dedupe
        && let Some(b) = load_binding(cx, &p.job_type, &d.key)?
    {
        let job = keyed_job(cx, &b.job_id)?;
        if b.is_live(job, now) {
            let outcome = match b.decide(job, d.mode) {
                Decision::Coalesce { rearm } => {
                    if rearm && let Some(ttl) = b.ttl_ms {
                        let until =
                            Binding::debounce_window(ttl, b.max_wait_ms, b.accepted_at, now);
                        set_window(cx, &p.job_type, &d.key, until)?;
                    }
                    Outcome::Coalesced
                }
                Decision::NonReplaceable(reason) => Outcome::NonReplaceable { reason },
                Decision::Replace => {
                    first_accepted = b.accepted_at;
                    let run_at = resolve_run_at(p, now, first_accepted, b.max_wait_ms);
                    if let Err(e) = check_clock(p, run_at, now) {
                        return Ok(Err(e));
                    }
                    replace_job(cx, p, &b.job_id, run_at)?;
                    if let Some(ttl) = b.ttl_ms {
                        set_window(cx, &p.job_type, &d.key, (now + ttl * 1000).max(run_at))?;
                    }
                    Outcome::Replaced
                }
            };
            if let Some(k) = key {
                bind_key(cx, k, &b.job_id, &p.fingerprint)?;
            }
            return done(b.job_id, outcome);
        }
    }
    // 4. A new job.
    let max_wait_ms = p.dedupe.as_ref().and_then(|d| d.max_wait_ms);
    let run_at = resolve_run_at(p, now, first_accepted, max_wait_ms);
    if let Err(e) = check_clock(p, run_at, now) {
        return Ok(Err(e));
    }
    let id = p
        .job_id
        .clone()
        .unwrap_or_else(|| uuid::Uuid::now_v7().to_string());
    insert_job(cx, p, &id, run_at)?;
    if let Some(k) = key {
        bind_key(cx, k, &id, &p.fingerprint)?;
    }
    if let Some(d) = &p.dedupe {
        let window = Binding::initial_window(d.mode, d.ttl_ms, d.max_wait_ms, now, run_at);
        cx.db
            .prepare_cached(
                "INSERT OR REPLACE INTO idemq_dedupe
                   (type, key, job_id, mode, ttl_ms, max_wait_ms, accepted_at, window_until)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )?
            .execute(params![
                p.job_type,
                d.key,
                id,
                d.mode.as_str(),
                d.ttl_ms,
                d.max_wait_ms,
                now,
                window
            ])?;
    }
    done(id, Outcome::Accepted)
}

/// Decides every item in order, each seeing the effects of the earlier ones.
pub(super) fn enqueue_all(
    cx: &Cx,
    items: &[PreparedEnqueue],
) -> Result<Vec<Result<EnqueueResult>>> {
    items.iter().map(|p| enqueue_one(cx, p)).collect()
}

/// The real enqueue path, run inside a transaction the caller rolls back.
pub(super) fn explain(cx: &Cx, p: &PreparedEnqueue) -> Result<Explain> {
    let idempotency = match &p.idempotency {
        Some(k) => match idem_live(cx, k)? {
            Some(b) => Some(ExplainIdempotency {
                job_id: b.job_id,
                expires_at: ts(b.expires_at)?,
            }),
            None => None,
        },
        None => None,
    };
    let dedupe = match &p.dedupe {
        Some(d) => match load_binding(cx, &p.job_type, &d.key)? {
            Some(b) if b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => Some(ExplainDedupe {
                job_id: b.job_id,
                mode: b.mode,
                window_until: b.window_until.map(ts).transpose()?,
            }),
            _ => None,
        },
        None => None,
    };
    let mut out = Explain {
        outcome: String::new(),
        reason: None,
        job_id: None,
        conflict: None,
        idempotency,
        dedupe,
    };
    out.record(enqueue_one(cx, p)?, p.job_id.clone())?;
    Ok(out)
}

/// Retention of a job in `state` (µs), from its own `keep` or the defaults.
pub(super) fn keep_us(keep_ms: Option<i64>, state: &str) -> i64 {
    let default = if state == "dead" {
        defaults::KEEP_DEAD_MS
    } else {
        defaults::KEEP_COMPLETED_MS
    };
    keep_ms.unwrap_or(default) * 1000
}
