//! Reading the replies of the library's functions. Decoding is strict: a
//! value the functions never write (an unknown state, a number that does
//! not parse, corrupt JSON) is an error, never a default.

use std::collections::HashMap;

use ::redis::Value;
use chrono::{DateTime, Utc};
use serde_json::Value as Json;

use crate::error::{Error, Result};
use crate::fingerprint::{FIELDS, Fingerprint};
use crate::job::{Event, Job, JobDedupe, JobIdempotency, JobState, Run};
use crate::request::DedupeMode;

/// An error of a reply that does not have the shape the functions give.
pub(super) fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::Backend {
        message: format!("redis: unexpected reply: {what}"),
    }
}

/// µs since the epoch → instant.
pub(super) fn ts(us: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us).ok_or_else(|| corrupt(format!("instant {us} µs")))
}

/// A string reply (integers read as their decimal text).
pub(super) fn string(v: &Value) -> Result<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).map_err(|_| corrupt("not UTF-8")),
        Value::SimpleString(s) => Ok(s.clone()),
        Value::Int(n) => Ok(n.to_string()),
        Value::Okay => Ok("OK".into()),
        other => Err(corrupt(format!("{other:?} for a string"))),
    }
}

/// A string reply, `None` for nil.
pub(super) fn opt_string(v: &Value) -> Result<Option<String>> {
    match v {
        Value::Nil => Ok(None),
        v => string(v).map(Some),
    }
}

/// An integer reply, or a string holding one.
pub(super) fn int(v: &Value) -> Result<i64> {
    match v {
        Value::Int(n) => Ok(*n),
        v => {
            let s = string(v)?;
            s.parse()
                .map_err(|_| corrupt(format!("{s:?} for an integer")))
        }
    }
}

/// An array reply (nil reads as empty).
pub(super) fn array(v: &Value) -> Result<&[Value]> {
    match v {
        Value::Array(items) | Value::Set(items) => Ok(items),
        Value::Nil => Ok(&[]),
        other => Err(corrupt(format!("{other:?} for an array"))),
    }
}

/// Element `i` of an array reply.
pub(super) fn at(items: &[Value], i: usize) -> Result<&Value> {
    items
        .get(i)
        .ok_or_else(|| corrupt(format!("a reply of {} items", items.len())))
}

/// A flat list of field/value pairs.
pub(super) fn pairs(v: &Value) -> Result<HashMap<String, String>> {
    let items = array(v)?;
    let mut out = HashMap::with_capacity(items.len() / 2);
    for pair in items.chunks(2) {
        let [k, v] = pair else {
            return Err(corrupt("an odd list of pairs"));
        };
        out.insert(string(k)?, string(v)?);
    }
    Ok(out)
}

/// A stored record: its fields by name.
pub(super) struct Fields(pub HashMap<String, String>);

impl Fields {
    pub(super) fn opt(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    pub(super) fn str(&self, name: &str) -> Result<&str> {
        self.opt(name)
            .ok_or_else(|| corrupt(format!("no field {name}")))
    }

    pub(super) fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        self.opt(name)
            .map(|s| {
                s.parse()
                    .map_err(|_| corrupt(format!("field {name} = {s:?}")))
            })
            .transpose()
    }

    pub(super) fn int(&self, name: &str) -> Result<i64> {
        self.opt_int(name)?
            .ok_or_else(|| corrupt(format!("no field {name}")))
    }

    pub(super) fn int32(&self, name: &str) -> Result<i32> {
        let n = self.int(name)?;
        i32::try_from(n).map_err(|_| corrupt(format!("field {name} = {n}")))
    }

    pub(super) fn opt_ts(&self, name: &str) -> Result<Option<DateTime<Utc>>> {
        self.opt_int(name)?.map(ts).transpose()
    }

    pub(super) fn ts(&self, name: &str) -> Result<DateTime<Utc>> {
        ts(self.int(name)?)
    }

    pub(super) fn json<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<T> {
        parse_json(self.str(name)?, name)
    }
}

pub(super) fn parse_json<T: serde::de::DeserializeOwned>(s: &str, what: &str) -> Result<T> {
    serde_json::from_str(s).map_err(|e| corrupt(format!("{what}: {e}")))
}

/// The public state of a stored one at `now`.
pub(super) fn derive(stored: &str, run_at: i64, now: i64) -> Result<JobState> {
    Ok(match stored {
        "waiting" if run_at <= now => JobState::Ready,
        "waiting" => JobState::Scheduled,
        "active" => JobState::Active,
        "completed" => JobState::Completed,
        "dead" => JobState::Dead,
        "cancelled" => JobState::Cancelled,
        other => return Err(corrupt(format!("state {other:?}"))),
    })
}

/// A public state name the functions returned.
pub(super) fn state(s: &str) -> Result<JobState> {
    JobState::parse(s).ok_or_else(|| corrupt(format!("state {s:?}")))
}

/// A job view of the functions: the hash's fields and `~idem`, `~dd_mode`,
/// `~dd_wu` (the live bindings it holds).
pub(super) fn job(v: &Value, now: i64) -> Result<Job> {
    let f = Fields(pairs(v)?);
    let run_at = f.int("run_at")?;
    let id = f.str("id")?.to_owned();
    let job_type = f.str("type")?.to_owned();
    let idempotency = match f.opt("idem_scope") {
        Some(scope) => Some(JobIdempotency {
            scope: scope.to_owned(),
            key_preview: f.str("idem_key_preview")?.to_owned(),
            key_digest: digest(f.str("idem_key_hash")?),
            expires_at: f.opt_ts("~idem")?,
        }),
        None => None,
    };
    let dedupe = match f.opt("dedupe_key") {
        Some(key) => {
            let own = mode(f.str("dedupe_mode")?)?;
            let holding = f.opt("~dd_mode").map(mode).transpose()?;
            Some(JobDedupe {
                key: key.to_owned(),
                mode: holding.unwrap_or(own),
                window_until: f.opt_ts("~dd_wu")?,
                holds_binding: holding.is_some(),
            })
        }
        None => None,
    };
    let priority = f.int("priority")?;
    Ok(Job {
        state: derive(f.str("state")?, run_at, now)?,
        payload: f.json("payload")?,
        result: f
            .opt("result")
            .map(|s| parse_json(s, "result"))
            .transpose()?,
        priority: i16::try_from(priority).map_err(|_| corrupt(format!("priority {priority}")))?,
        run_at: ts(run_at)?,
        attempt: f.int32("attempt")?,
        attempts_used: f.int32("attempts_used")?,
        max_attempts: f.int32("max_attempts")?,
        retry: f.json("retry")?,
        timeout_ms: f.int("timeout_ms")?,
        deadline: f.opt_ts("deadline")?,
        concurrency_key: f.opt("concurrency_key").map(str::to_owned),
        tags: f.json("tags")?,
        keep_ms: f.opt_int("keep_ms")?,
        created_at: f.ts("created_at")?,
        updated_at: f.ts("updated_at")?,
        finished_at: f.opt_ts("finished_at")?,
        last_error: f.opt("last_error").map(str::to_owned),
        cancel_requested: f.opt("cancel_requested") == Some("1"),
        lease_expires_at: f.opt_ts("lease_expires_at")?,
        queue: f.str("queue")?.to_owned(),
        idempotency,
        dedupe,
        id,
        job_type,
    })
}

pub(super) fn mode(s: &str) -> Result<DedupeMode> {
    DedupeMode::parse(s).ok_or_else(|| corrupt(format!("dedupe mode {s:?}")))
}

/// The first 16 hex digits of a stored key hash (64 hex digits).
pub(super) fn digest(hash_hex: &str) -> String {
    hash_hex.get(..16).unwrap_or(hash_hex).to_owned()
}

/// A fingerprint as stored: packed digests in hex (a job or an enqueue
/// binding), or JSON (a redrive binding).
pub(super) fn fingerprint(stored: &str) -> Fingerprint {
    if stored.starts_with('{') {
        return Fingerprint::from_json(stored);
    }
    let mut fields = std::collections::BTreeMap::new();
    for (i, name) in FIELDS.iter().enumerate() {
        if let Some(h) = stored.get(i * 32..(i + 1) * 32)
            && h.bytes().any(|b| b != b'0')
        {
            fields.insert((*name).to_owned(), h.to_owned());
        }
    }
    Fingerprint { fields }
}

/// The stored events of a job (`seq at kind data`), with the timestamps
/// the functions keep as integers turned into instants.
pub(super) fn events(stored: &Value, job: &Value) -> Result<Vec<Event>> {
    let mut out = Vec::new();
    for entry in array(stored)? {
        let entry = string(entry)?;
        let mut parts = entry.splitn(4, ' ');
        let (Some(seq), Some(at), Some(kind), Some(data)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(corrupt(format!("event {entry:?}")));
        };
        let mut data: Json = parse_json(data, "event data")?;
        instant_field(&mut data, "run_at")?;
        out.push(Event {
            seq: seq
                .parse()
                .map_err(|_| corrupt(format!("event {entry:?}")))?,
            kind: kind.to_owned(),
            at: ts(at
                .parse()
                .map_err(|_| corrupt(format!("event {entry:?}")))?)?,
            data,
        });
    }
    let f = Fields(pairs(job)?);
    if f.0.is_empty() {
        out.sort_by_key(|e| e.seq);
        return Ok(out);
    }
    // The routine events, derived from the job's hash: `accepted` from the
    // hash itself, `claimed` for the current attempt while it runs or once
    // it completed, `completed` once it did.
    let mut accepted = serde_json::json!({
        "queue": f.str("queue")?,
        "run_at": f.opt_ts("first_run_at")?.map_or_else(|| f.ts("created_at"), Ok)?,
    });
    if let Some(scope) = f.opt("idem_scope") {
        accepted["idempotency"] = serde_json::json!({
            "scope": scope,
            "key_preview": f.opt("idem_key_preview"),
            "key_digest": digest(f.str("idem_key_hash")?),
        });
    }
    if let Some(key) = f.opt("dedupe_key") {
        accepted["dedupe"] = serde_json::json!({ "key": key, "mode": f.opt("dedupe_mode") });
    }
    let attempt = f.int32("attempt")?;
    out.push(Event {
        seq: f.int("seq")?,
        kind: "accepted".into(),
        at: f.ts("created_at")?,
        data: accepted,
    });
    if let (Some(seq), Some(at)) = (f.opt_int("claim_seq")?, f.opt_ts("started_at")?) {
        out.push(Event {
            seq,
            kind: "claimed".into(),
            at,
            data: serde_json::json!({ "attempt": attempt, "worker": f.opt("worker") }),
        });
    }
    if let (Some(seq), Some(at)) = (f.opt_int("done_seq")?, f.opt_ts("finished_at")?) {
        out.push(Event {
            seq,
            kind: "completed".into(),
            at,
            data: serde_json::json!({ "attempt": attempt }),
        });
    }
    out.sort_by_key(|e| e.seq);
    Ok(out)
}

/// Turns an integer µs member of an event's data into an instant.
fn instant_field(data: &mut Json, name: &str) -> Result<()> {
    if let Some(v) = data.get_mut(name)
        && let Some(us) = v.as_i64()
    {
        *v = serde_json::to_value(ts(us)?).map_err(corrupt)?;
    }
    Ok(())
}

#[derive(serde::Deserialize)]
struct StoredRun {
    attempt: i32,
    worker: String,
    started_at: i64,
    finished_at: Option<i64>,
    outcome: Option<String>,
    error: Option<String>,
}

/// A job's run ledger: the attempts written out (each ended other than
/// completed) and the current one, derived from the hash while it runs and
/// once it completed.
pub(super) fn runs(stored: &Value, job: &Value) -> Result<Vec<Run>> {
    let mut out = Vec::new();
    for entry in array(stored)? {
        let r: StoredRun = parse_json(&string(entry)?, "run")?;
        out.push(Run {
            attempt: r.attempt,
            worker: r.worker,
            started_at: ts(r.started_at)?,
            finished_at: r.finished_at.map(ts).transpose()?,
            outcome: r.outcome,
            error: r.error,
        });
    }
    let f = Fields(pairs(job)?);
    if !f.0.is_empty()
        && f.opt("claim_seq").is_some()
        && let Some(started_at) = f.opt_ts("started_at")?
    {
        let completed = f.opt("state") == Some("completed");
        out.push(Run {
            attempt: f.int32("attempt")?,
            worker: f.opt("worker").unwrap_or_default().to_owned(),
            started_at,
            finished_at: if completed {
                f.opt_ts("finished_at")?
            } else {
                None
            },
            outcome: completed.then(|| "completed".to_owned()),
            error: None,
        });
    }
    out.sort_by_key(|r| r.attempt);
    Ok(out)
}
