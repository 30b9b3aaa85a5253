//! The arguments of the library's functions, and the reading of the
//! replies that carry a decision. What does not depend on stored state is
//! computed here, before the call (new ids, lease nonces, jitter draws,
//! fingerprints), so the functions stay a decision over stored state.

use ::redis::{Cmd, Value};

use super::codec::{self, array, at, int, string, ts};
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, hex};
use crate::job::{ClaimedJob, EnqueueResult, Outcome, Undecodable};
use crate::request::PreparedEnqueue;
use crate::store::{JobClaim, JobComplete};

/// Longest error text kept in the run ledger.
const MAX_ERROR_BYTES: usize = 8 * 1024;

/// An error cut to [`MAX_ERROR_BYTES`] on a character boundary.
pub(super) fn truncate(s: &str) -> &str {
    let mut end = s.len().min(MAX_ERROR_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn opt_int(v: Option<i64>) -> String {
    v.map(|n| n.to_string()).unwrap_or_default()
}

/// The packed fingerprint in hex: what jobs and enqueue bindings store.
pub(super) fn packed(fp: &Fingerprint) -> String {
    hex(&fp.packed())
}

/// Appends one enqueue item (24 arguments; see `item` in enqueue.lua).
pub(super) fn item(cmd: &mut Cmd, p: &PreparedEnqueue) {
    let k = p.idempotency.as_ref();
    let d = p.dedupe.as_ref();
    cmd.arg(&p.job_type)
        .arg(&p.queue)
        .arg(p.job_id.as_deref().unwrap_or_default())
        .arg(&p.payload)
        .arg(p.priority.to_string())
        .arg(opt_int(p.run_at))
        .arg(opt_int(p.delay_ms))
        .arg(p.max_attempts.to_string())
        .arg(serde_json::to_string(&p.retry).unwrap_or_default())
        .arg(p.timeout_ms.to_string())
        .arg(opt_int(p.deadline))
        .arg(p.concurrency_key.as_deref().unwrap_or_default())
        .arg(serde_json::to_string(&p.tags).unwrap_or_default())
        .arg(opt_int(p.keep_ms))
        .arg(packed(&p.fingerprint))
        .arg(k.map(|k| k.scope.as_str()).unwrap_or_default())
        .arg(k.map(|k| hex(&k.hash)).unwrap_or_default())
        .arg(k.map(|k| k.preview.as_str()).unwrap_or_default())
        .arg(opt_int(k.map(|k| k.ttl_ms)))
        .arg(d.map(|d| d.key.as_str()).unwrap_or_default())
        .arg(d.map(|d| d.mode.as_str()).unwrap_or_default())
        .arg(opt_int(d.and_then(|d| d.ttl_ms)))
        .arg(opt_int(d.and_then(|d| d.max_wait_ms)))
        .arg(uuid::Uuid::now_v7().to_string());
}

/// The conflict error of a request whose key or explicit id is held by a
/// job with another fingerprint.
/// `stored` is the holder's fingerprint: the binding's (`idem.fp`) for a
/// key, the job's (`job.fingerprint`) for an explicit id.
fn conflict(p: &PreparedEnqueue, job_id: String, source: &str, stored: &str) -> Result<Error> {
    let by_key = source == "idempotency_key";
    let stored = if by_key {
        codec::fingerprint(
            stored,
            &format!("idempotency binding of job {job_id}"),
            "idem.fp",
        )?
    } else {
        codec::fingerprint(stored, &format!("job {job_id}"), "job.fingerprint")?
    };
    let key = if by_key { p.idempotency.as_ref() } else { None };
    let fields = p.fingerprint.diff(&stored, !by_key);
    Ok(Error::idempotency_conflict(job_id, key, fields))
}

/// The validation error of a request refused against the clock.
pub(super) fn clock_error(field: &str) -> Error {
    match field {
        "deadline" => Error::validation("deadline", "must be in the future"),
        other => Error::validation(other, "must be before the deadline"),
    }
}

/// An outcome the enqueue function answered with for `job_id`:
/// `<outcome>` or `non_replaceable:<reason>`.
fn outcome(s: &str, job_id: &str) -> Result<Outcome> {
    let (name, reason) = match s.split_once(':') {
        Some((name, reason)) => (name, Some(reason)),
        None => (s, None),
    };
    Outcome::from_stored(name, reason)
        .map_err(|e| e.at(format!("answer of enqueue for job {job_id}"), "outcome"))
}

/// One item's decision: `{'ok', id, outcome}`, `{'conflict', id, source,
/// fingerprint}` or `{'invalid', field}`.
pub(super) fn decision(p: &PreparedEnqueue, v: &Value) -> Result<Result<EnqueueResult>> {
    let r = array(v)?;
    Ok(match string(at(r, 0)?)?.as_str() {
        "ok" => {
            let job_id = string(at(r, 1)?)?;
            Ok(EnqueueResult {
                outcome: outcome(&string(at(r, 2)?)?, &job_id)?,
                job_id,
            })
        }
        "conflict" => Err(conflict(
            p,
            string(at(r, 1)?)?,
            &string(at(r, 2)?)?,
            &string(at(r, 3)?)?,
        )?),
        "invalid" => Err(clock_error(&string(at(r, 1)?)?)),
        other => return Err(codec::corrupt(format!("decision {other:?}"))),
    })
}

/// Appends a claim's arguments (see `claim_args` in exec.lua).
pub(super) fn claim(cmd: &mut Cmd, c: &JobClaim) {
    cmd.arg(c.limit)
        .arg(c.lease_ms)
        .arg(&c.worker)
        .arg(uuid::Uuid::new_v4().simple().to_string())
        .arg(c.queues.len())
        .arg(&c.queues);
    match &c.types {
        Some(types) => cmd.arg(types.len()).arg(types),
        None => cmd.arg(-1),
    };
}

/// Appends completions: (id, token, has result, result) each.
pub(super) fn completions(cmd: &mut Cmd, items: &[JobComplete]) {
    cmd.arg(items.len());
    for i in items {
        cmd.arg(&i.lease.job_id)
            .arg(&i.lease.lease_token)
            .arg(if i.result.is_some() { "1" } else { "0" })
            .arg(i.result.as_deref().unwrap_or_default());
    }
}

/// The answers of completions: 1 done, 0 lease lost.
pub(super) fn completed(items: &[JobComplete], v: &Value) -> Result<Vec<Result<()>>> {
    let flags = array(v)?;
    if flags.len() != items.len() {
        return Err(codec::corrupt("completions"));
    }
    items
        .iter()
        .zip(flags)
        .map(|(i, f)| {
            Ok(if int(f)? == 1 {
                Ok(())
            } else {
                Err(Error::LeaseLost {
                    job_id: i.lease.job_id.clone(),
                })
            })
        })
        .collect()
}

/// The jobs a claim took.
pub(super) fn claimed(v: &Value) -> Result<Vec<ClaimedJob>> {
    array(v)?
        .iter()
        .map(|j| {
            let f = array(j)?;
            let s = |i| string(at(f, i)?);
            let deadline = s(9)?;
            let id = s(0)?;
            Ok(ClaimedJob {
                job_type: s(1)?,
                queue: s(2)?,
                payload: job_json(&s(3)?, &id, "payload")?,
                attempt: int32(at(f, 4)?)?,
                max_attempts: int32(at(f, 5)?)?,
                lease_token: crate::LeaseToken::new(s(6)?),
                lease_expires_at: ts(int(at(f, 7)?)?)?,
                timeout_ms: int(at(f, 8)?)?,
                deadline: if deadline.is_empty() {
                    None
                } else {
                    Some(ts(parse_i64(&deadline)?)?)
                },
                tags: job_json(&s(10)?, &id, "tags")?,
                id,
            })
        })
        .collect()
}

/// JSON field `field` of job `id`, as a claim answered it.
fn job_json<T: serde::de::DeserializeOwned>(text: &str, id: &str, field: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| {
        Undecodable::unreadable(field, text, e).at(format!("job {id}"), &format!("job.{field}"))
    })
}

fn int32(v: &Value) -> Result<i32> {
    let n = int(v)?;
    i32::try_from(n).map_err(|_| codec::corrupt(format!("{n} for a 32-bit integer")))
}

/// A decimal integer the functions returned as text.
pub(super) fn parse_i64(s: &str) -> Result<i64> {
    s.parse()
        .map_err(|_| codec::corrupt(format!("{s:?} for an integer")))
}
