//! Reading the replies of the library's functions. Decoding is strict: a
//! value the functions never write (an unknown state, a number that does
//! not parse, corrupt JSON) is an error, never a default.

use std::collections::HashMap;

use ::redis::Value;
use chrono::{DateTime, Utc};
use serde_json::Value as Json;

use crate::error::{Error, Result};
use crate::fingerprint::{FIELDS, Fingerprint};
use crate::job::{Event, Job, JobDedupe, JobIdempotency, JobState, Run, Undecodable};
use crate::request::DedupeMode;

/// An error of a reply that does not have the shape the functions give.
pub(super) fn corrupt(what: impl std::fmt::Display) -> Error {
    Error::Backend {
        message: format!("redis: unexpected reply: {what}"),
    }
}

/// The error of a function that met a stored value it cannot act on
/// (`unreadable` in lua/common.lua), from the detail of its `UNREADABLE`
/// error reply: the function ended before its first write, so this is the
/// `Backend` error naming the record and the field that the SQL backends
/// give for an unreadable row, after a rollback.
pub(super) fn unreadable(detail: &str) -> Error {
    #[derive(serde::Deserialize)]
    struct Stored {
        row: String,
        column: String,
        kind: String,
        what: String,
        value: Option<String>,
        detail: Option<String>,
    }
    // The reply goes on after the JSON with where the function raised it.
    let first = serde_json::Deserializer::from_str(detail)
        .into_iter::<Stored>()
        .next();
    let Some(Ok(s)) = first else {
        return corrupt(format!("UNREADABLE {detail}"));
    };
    let value = s.value.unwrap_or_default();
    let e = match s.kind.as_str() {
        "null" => Undecodable::null(&s.what),
        "unknown" => Undecodable::unknown(&s.what, &value),
        "unreadable" => Undecodable::unreadable(&s.what, &value, s.detail.unwrap_or_default()),
        _ => Undecodable::invalid(&s.what, value),
    };
    e.at(s.row, &s.column)
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

/// A stored record: its fields by name, and how errors name it.
pub(super) struct Fields {
    map: HashMap<String, String>,
    /// The kind of key it came from, as in the layout (`job`, `sch`):
    /// errors name a field `job.state` (field `state` of `P job:<id>`).
    record: &'static str,
    /// The record in errors (`job 0190…`).
    row: String,
}

impl Fields {
    /// The record of a `record` key (`job`, `sch`, …) named `row` in errors.
    pub(super) fn new(v: &Value, record: &'static str, row: impl Into<String>) -> Result<Self> {
        Ok(Self {
            map: pairs(v)?,
            record,
            row: row.into(),
        })
    }

    /// Names the record once its identity was read (a job's id, say).
    pub(super) fn named(&mut self, row: impl Into<String>) {
        self.row = row.into();
    }

    /// Whether the key held nothing (a job that is gone).
    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The `Backend` error for the value of `field` this record holds.
    pub(super) fn bad(&self, field: &str, e: Undecodable) -> Error {
        e.at(&self.row, &format!("{}.{field}", self.record))
    }

    pub(super) fn opt(&self, name: &str) -> Option<&str> {
        self.map.get(name).map(String::as_str)
    }

    /// A field that must be there.
    pub(super) fn str(&self, name: &str) -> Result<&str> {
        self.opt(name)
            .ok_or_else(|| self.bad(name, Undecodable::null("value")))
    }

    pub(super) fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        self.opt(name)
            .map(|s| {
                s.parse()
                    .map_err(|_| self.bad(name, Undecodable::invalid("a non-integer value", s)))
            })
            .transpose()
    }

    pub(super) fn int(&self, name: &str) -> Result<i64> {
        self.opt_int(name)?
            .ok_or_else(|| self.bad(name, Undecodable::null("value")))
    }

    pub(super) fn int32(&self, name: &str) -> Result<i32> {
        let n = self.int(name)?;
        i32::try_from(n)
            .map_err(|_| self.bad(name, Undecodable::invalid("an integer out of range", n)))
    }

    /// `us`, read from `name`, as an instant.
    fn instant(&self, name: &str, us: i64) -> Result<DateTime<Utc>> {
        DateTime::from_timestamp_micros(us)
            .ok_or_else(|| self.bad(name, Undecodable::invalid("an instant out of range", us)))
    }

    pub(super) fn opt_ts(&self, name: &str) -> Result<Option<DateTime<Utc>>> {
        self.opt_int(name)?
            .map(|us| self.instant(name, us))
            .transpose()
    }

    pub(super) fn ts(&self, name: &str) -> Result<DateTime<Utc>> {
        self.instant(name, self.int(name)?)
    }

    /// JSON text holding `what` (`payload`, `retry policy`, …).
    pub(super) fn json<T: serde::de::DeserializeOwned>(&self, name: &str, what: &str) -> Result<T> {
        self.parse(name, what, self.str(name)?)
    }

    /// Optional JSON text holding `what`.
    pub(super) fn opt_json<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        what: &str,
    ) -> Result<Option<T>> {
        self.opt(name)
            .map(|text| self.parse(name, what, text))
            .transpose()
    }

    fn parse<T: serde::de::DeserializeOwned>(
        &self,
        name: &str,
        what: &str,
        text: &str,
    ) -> Result<T> {
        serde_json::from_str(text)
            .map_err(|e| self.bad(name, Undecodable::unreadable(what, text, e)))
    }

    /// A field decoded by `f` (an enum's `from_stored`).
    pub(super) fn decode<T>(
        &self,
        name: &str,
        f: impl FnOnce(&str) -> std::result::Result<T, Undecodable>,
    ) -> Result<T> {
        f(self.str(name)?).map_err(|e| self.bad(name, e))
    }

    /// An idempotency key hash (64 hex digits), as its public digest.
    fn key_digest(&self, name: &str) -> Result<String> {
        let hash = self.str(name)?;
        if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(self.bad(
                name,
                Undecodable::described(format!(
                    "a key hash of {} characters, not 64 hex digits",
                    hash.len()
                )),
            ));
        }
        Ok(hash[..16].to_ascii_lowercase())
    }
}

/// A public state name `function` answered with for job `job_id`.
pub(super) fn state(s: &str, function: &str, job_id: &str) -> Result<JobState> {
    JobState::from_derived(s)
        .map_err(|e| e.at(format!("answer of {function} for job {job_id}"), "state"))
}

/// A job view of the functions: the hash's fields and `~idem`, `~dd_mode`,
/// `~dd_wu` (the live bindings it holds).
pub(super) fn job(v: &Value, now: i64) -> Result<Job> {
    job_of(&mut Fields::new(v, "job", "job")?, now)
}

/// A job of a list, with its sequence number (a page's cursor).
pub(super) fn listed_job(v: &Value, now: i64) -> Result<(i64, Job)> {
    let mut f = Fields::new(v, "job", "job")?;
    let job = job_of(&mut f, now)?;
    Ok((f.int("seq")?, job))
}

fn job_of(f: &mut Fields, now: i64) -> Result<Job> {
    let id = f.str("id")?.to_owned();
    f.named(format!("job {id}"));
    let run_at = f.int("run_at")?;
    let job_type = f.str("type")?.to_owned();
    let idempotency = match f.opt("idem_scope") {
        Some(scope) => Some(JobIdempotency {
            scope: scope.to_owned(),
            key_preview: f.str("idem_key_preview")?.to_owned(),
            key_digest: f.key_digest("idem_key_hash")?,
            expires_at: f
                .opt("~idem")
                .map(|s| {
                    instant(s).map_err(|e| {
                        e.at(format!("idempotency binding of job {id}"), "idem.expires")
                    })
                })
                .transpose()?,
        }),
        None => None,
    };
    let dedupe = match f.opt("dedupe_key") {
        Some(key) => {
            let own = f.decode("dedupe_mode", DedupeMode::from_stored)?;
            let holding = f.opt("~dd_mode").map(|s| mode(s, &id)).transpose()?;
            Some(JobDedupe {
                key: key.to_owned(),
                mode: holding.unwrap_or(own),
                window_until: f
                    .opt("~dd_wu")
                    .map(|s| {
                        instant(s).map_err(|e| e.at(format!("dedupe binding of job {id}"), "dd.wu"))
                    })
                    .transpose()?,
                holds_binding: holding.is_some(),
            })
        }
        None => None,
    };
    let priority = f.int("priority")?;
    Ok(Job {
        state: f.decode("state", |s| JobState::from_stored(s, run_at <= now))?,
        payload: f.json("payload", "payload")?,
        result: f.opt_json("result", "result")?,
        priority: i16::try_from(priority).map_err(|_| {
            f.bad(
                "priority",
                Undecodable::invalid("a priority out of range", priority),
            )
        })?,
        run_at: f.ts("run_at")?,
        attempt: f.int32("attempt")?,
        attempts_used: f.int32("attempts_used")?,
        max_attempts: f.int32("max_attempts")?,
        retry: f.json("retry", "retry policy")?,
        timeout_ms: f.int("timeout_ms")?,
        deadline: f.opt_ts("deadline")?,
        concurrency_key: f.opt("concurrency_key").map(str::to_owned),
        tags: f.json("tags", "tags")?,
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

/// An instant stored as µs text.
fn instant(s: &str) -> std::result::Result<DateTime<Utc>, Undecodable> {
    let us: i64 = s
        .parse()
        .map_err(|_| Undecodable::invalid("a non-integer value", s))?;
    DateTime::from_timestamp_micros(us)
        .ok_or_else(|| Undecodable::invalid("an instant out of range", us))
}

/// A dedupe mode the functions returned from a binding (`dd.mode`) of job `job_id`.
pub(super) fn mode(s: &str, job_id: &str) -> Result<DedupeMode> {
    DedupeMode::from_stored(s)
        .map_err(|e| e.at(format!("dedupe binding of job {job_id}"), "dd.mode"))
}

/// Checkpoint `name` of job `id` (hash `cp:<id>`).
pub(super) fn checkpoint(text: &str, id: &str, name: &str) -> Result<Json> {
    serde_json::from_str(text).map_err(|e| {
        Undecodable::unreadable("checkpoint value", text, e)
            .at(format!("checkpoint {name:?} of job {id}"), "cp")
    })
}

/// A fingerprint as stored in `column` of `row` (a job's `job.fingerprint`,
/// a binding's `idem.fp`): the 13 packed field digests in hex (a job, an
/// enqueue binding), or JSON (a redrive binding). A value of another length,
/// or not hex, is an error naming the record; the value is never shown.
pub(super) fn fingerprint(stored: &str, row: &str, column: &str) -> Result<Fingerprint> {
    if stored.starts_with('{') {
        return serde_json::from_str(stored).map_err(|e| {
            Undecodable::described(format!("an unreadable fingerprint: {e}")).at(row, column)
        });
    }
    let want = FIELDS.len() * 32;
    if stored.len() != want || !stored.bytes().all(|b| b.is_ascii_hexdigit()) {
        let why = if stored.len() == want {
            format!("a fingerprint of {want} characters that are not all hex digits")
        } else {
            format!(
                "a fingerprint of {} characters, not {want} hex digits",
                stored.len()
            )
        };
        return Err(Undecodable::described(why).at(row, column));
    }
    let mut fields = std::collections::BTreeMap::new();
    for (i, name) in FIELDS.iter().enumerate() {
        let h = &stored[i * 32..(i + 1) * 32];
        // All zeros: the field was absent (no digest equals it).
        if h.bytes().any(|b| b != b'0') {
            fields.insert((*name).to_owned(), h.to_ascii_lowercase());
        }
    }
    Ok(Fingerprint::from_fields(fields))
}

/// The stored events of job `id` (`seq at kind data`, list `ev`), with
/// the timestamps the functions keep as integers turned into instants, and
/// the routine events derived from its hash.
pub(super) fn events(stored: &Value, job: &Value, id: &str) -> Result<Vec<Event>> {
    let mut out = Vec::new();
    for entry in array(stored)? {
        let entry = string(entry)?;
        let mut parts = entry.splitn(4, ' ');
        let (Some(seq), Some(at), Some(kind), Some(data)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(
                Undecodable::described("an event that is not `<seq> <at> <kind> <data>`")
                    .at(format!("event of job {id}"), "ev"),
            );
        };
        let seq: i64 = seq.parse().map_err(|_| {
            Undecodable::invalid("a non-integer value", seq)
                .at(format!("event of job {id}"), "ev.seq")
        })?;
        let row = format!("event {seq} of job {id}");
        let at = instant(at).map_err(|e| e.at(&row, "ev.at"))?;
        let kind = Event::kind_from_stored(kind.to_owned()).map_err(|e| e.at(&row, "ev.kind"))?;
        let mut data: Json = serde_json::from_str(data)
            .map_err(|e| Undecodable::unreadable("event data", data, e).at(&row, "ev.data"))?;
        instant_field(&mut data, "run_at").map_err(|e| e.at(&row, "ev.data"))?;
        out.push(Event {
            seq,
            kind,
            at,
            data,
        });
    }
    let f = Fields::new(job, "job", format!("job {id}"))?;
    if f.is_empty() {
        // The job is gone (purged): only its stored events are left.
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
            "key_preview": f.str("idem_key_preview")?,
            "key_digest": f.key_digest("idem_key_hash")?,
        });
    }
    if let Some(key) = f.opt("dedupe_key") {
        let mode = f.decode("dedupe_mode", DedupeMode::from_stored)?;
        accepted["dedupe"] = serde_json::json!({ "key": key, "mode": mode.as_str() });
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
fn instant_field(data: &mut Json, name: &str) -> std::result::Result<(), Undecodable> {
    if let Some(v) = data.get_mut(name)
        && let Some(us) = v.as_i64()
    {
        let at = DateTime::from_timestamp_micros(us)
            .ok_or_else(|| Undecodable::invalid("an instant out of range", us))?;
        *v = serde_json::to_value(at).map_err(|e| Undecodable::described(e.to_string()))?;
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

/// Job `id`'s run ledger: the attempts written out (list `runs`, each
/// ended other than completed) and the current one, derived from the hash
/// while it runs and once it completed.
pub(super) fn runs(stored: &Value, job: &Value, id: &str) -> Result<Vec<Run>> {
    let mut out = Vec::new();
    for entry in array(stored)? {
        let text = string(entry)?;
        let r: StoredRun = serde_json::from_str(&text).map_err(|e| {
            Undecodable::unreadable("run", &text, e).at(format!("run of job {id}"), "runs")
        })?;
        let row = format!("run {} of job {id}", r.attempt);
        let at = |us: i64, column: &str| {
            DateTime::from_timestamp_micros(us)
                .ok_or_else(|| Undecodable::invalid("an instant out of range", us).at(&row, column))
        };
        out.push(Run {
            attempt: r.attempt,
            worker: r.worker,
            started_at: at(r.started_at, "runs.started_at")?,
            finished_at: r
                .finished_at
                .map(|us| at(us, "runs.finished_at"))
                .transpose()?,
            outcome: Run::outcome_from_stored(r.outcome).map_err(|e| e.at(&row, "runs.outcome"))?,
            error: r.error,
        });
    }
    let f = Fields::new(job, "job", format!("job {id}"))?;
    if !f.is_empty()
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
