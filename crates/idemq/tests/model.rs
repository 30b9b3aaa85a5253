//! Model-based property test: random operation sequences run against a small
//! in-memory reference model written from docs/ (state-machine, http-api, idempotency, dedupe, worker) and against a backend;
//! every outcome, returned job id, typed error, job state and attempt count,
//! and every live binding must agree step by step.
//!
//! The model covers jobs (stored state, `run_at`, attempt, `attempts_used`,
//! `max_attempts`, deadline, timeout, `cancel_requested`, concurrency key,
//! priority), idempotency bindings (scope/key → job, the request's
//! fingerprint fields, ttl), explicit job ids, dedupe bindings (pending,
//! throttle, debounce, replace, with ttl and `max_wait`, by the decision table
//! of docs/dedupe.md), batches (plain and atomic) and the execution primitives
//! (claim, heartbeat, complete, fail, snooze, release, lease expiry, timeout,
//! deadline, cancel, cancel_by_key, purge, promote, redrive with a key).
//! Values come from small pools (two types, two payloads, two keys) so keys
//! collide often; retry policies have no jitter, so every instant is exact.
//!
//! Cases: `IDEMQ_MODEL_CASES` (default 200 on SQLite, half that on
//! PostgreSQL and Redis); `IDEMQ_MODEL_STEPS` bounds the sequence length (default 30).
//! A failure reports the shrunk sequence, the step, and both answers.

// Observations are plain comparable values, not errors that travel.
#![allow(clippy::result_large_err, clippy::type_complexity)]

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use idemq::fingerprint::{KeyHasher, key_digest, key_preview};
use idemq::{
    BatchOptions, ClaimOptions, DedupeMode, DedupeOptions, EnqueueRequest, EnqueueResult, Error,
    FailOptions, IdempotencyOptions, JobState, RedriveOptions, RetryPolicy,
};
use proptest::prelude::*;
use serde_json::{Value, json};

use idemq_testkit::{Harness, epoch};

// ------------------------------------------------------------------ pools

const TYPES: [&str; 2] = ["ta", "tb"];
const JOB_IDS: [&str; 2] = ["j1", "j2"];
const IKEYS: [&str; 2] = ["key-one", "key-two"];
const DKEYS: [&str; 2] = ["d1", "d2"];
const RKEY: &str = "redrive-ticket";
const REDRIVE_SCOPE: &str = "idemq.redrive";
const DAY: i64 = 24 * 3600 * 1000;

fn payload(i: u8) -> Value {
    json!({ "n": i })
}

/// Retry policies without jitter: every retry instant is predictable.
fn policy(i: u8) -> RetryPolicy {
    match i {
        0 => RetryPolicy::Fixed { delay_ms: 1000 },
        1 => RetryPolicy::Fixed { delay_ms: 5000 },
        2 => RetryPolicy::None,
        _ => RetryPolicy::Exponential {
            initial_ms: 1000,
            factor: 2.0,
            max_ms: 4000,
            jitter: false,
        },
    }
}

/// The delay before the next attempt after `used` consumed attempts.
fn policy_delay(i: u8, used: i32) -> Option<i64> {
    match policy(i) {
        RetryPolicy::None => None,
        RetryPolicy::Fixed { delay_ms } => Some(delay_ms),
        RetryPolicy::Exponential {
            initial_ms, max_ms, ..
        } => {
            let mut d = initial_ms;
            for _ in 1..used.max(1) {
                d = (d * 2).min(max_ms);
            }
            Some(d.min(max_ms))
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Pending,
    Throttle,
    Debounce,
    Replace,
}

impl Mode {
    fn api(self) -> DedupeMode {
        match self {
            Mode::Pending => DedupeMode::Pending,
            Mode::Throttle => DedupeMode::Throttle,
            Mode::Debounce => DedupeMode::Debounce,
            Mode::Replace => DedupeMode::Replace,
        }
    }
}

/// The dedupe options of the pool: (mode, ttl, max_wait).
fn dedupe_pool(i: u8) -> (Mode, Option<i64>, Option<i64>) {
    match i % 8 {
        0 => (Mode::Pending, None, None),
        1 => (Mode::Throttle, Some(30_000), None),
        2 => (Mode::Debounce, Some(20_000), None),
        3 => (Mode::Debounce, Some(20_000), Some(45_000)),
        4 => (Mode::Replace, None, None),
        5 => (Mode::Replace, Some(30_000), None),
        6 => (Mode::Replace, None, Some(45_000)),
        _ => (Mode::Replace, Some(20_000), Some(45_000)),
    }
}

// ------------------------------------------------------------------ operations

#[derive(Clone, Copy, Debug)]
enum Timing {
    Omitted,
    DelayZero,
    Delay(i64),
    /// Absolute, in ms after the epoch of the case.
    RunAt(i64),
}

#[derive(Clone, Copy, Debug)]
enum Deadline {
    /// Absolute, in ms after the epoch of the case.
    At(i64),
    /// Relative to the clock when the request is sent.
    In(i64),
}

#[derive(Clone, Debug)]
struct Req {
    ty: u8,
    payload: u8,
    job_id: Option<u8>,
    /// (key, scope: 0 omitted / 1 "default" / 2 "other", ttl: 0 omitted / 1 60 s / 2 24 h)
    idem: Option<(u8, u8, u8)>,
    /// (key, pool index)
    dedupe: Option<(u8, u8)>,
    timing: Timing,
    deadline: Option<Deadline>,
    /// 0 omitted, 1, 2, 10 (the default spelled out)
    max_attempts: u8,
    retry: u8,
    /// 0 omitted, 10 s, 30 min (the default spelled out)
    timeout: u8,
    ck: bool,
    priority: u8,
}

#[derive(Clone, Copy, Debug)]
enum FailKind {
    Retryable,
    RetryAfter(i64),
    Permanent,
    Snooze(i64),
}

#[derive(Clone, Debug)]
enum Op {
    Enqueue(Req),
    EnqueueMany(Vec<Req>, bool),
    Claim {
        limit: u32,
        lease_ms: i64,
    },
    Heartbeat(usize),
    Complete(usize),
    Fail(usize, FailKind),
    Release(usize),
    Cancel(usize),
    CancelByKey(u8, u8),
    Purge(usize),
    Promote(usize),
    Redrive(usize, bool),
    Reap,
    Advance(i64),
    /// To the n-th next instant something changes, plus -1, 0 or +1 ms.
    AdvanceToBoundary(usize, i64),
}

fn req_strategy() -> impl Strategy<Value = Req> {
    let timing = prop_oneof![
        4 => Just(Timing::Omitted),
        1 => Just(Timing::DelayZero),
        2 => prop::sample::select(vec![10_000i64, 60_000]).prop_map(Timing::Delay),
        1 => prop::sample::select(vec![30_000i64, 150_000]).prop_map(Timing::RunAt),
    ];
    let deadline = prop_oneof![
        5 => Just(None),
        1 => prop::sample::select(vec![20_000i64, 300_000]).prop_map(|v| Some(Deadline::At(v))),
        1 => Just(Some(Deadline::In(15_000))),
    ];
    let idem = prop_oneof![
        2 => Just(None),
        3 => (0..2u8, prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)],
              prop_oneof![4 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)])
            .prop_map(Some),
    ];
    let dedupe = prop_oneof![
        2 => Just(None),
        3 => (0..2u8, 0..8u8).prop_map(Some),
    ];
    let job_id = prop_oneof![4 => Just(None), 1 => (0..2u8).prop_map(Some)];
    (
        (0..2u8, 0..2u8, job_id, idem, dedupe),
        (
            timing,
            deadline,
            prop_oneof![3 => Just(0u8), 1 => 1..4u8],
            0..4u8,
            prop_oneof![4 => Just(0u8), 1 => 1..3u8],
            prop::bool::weighted(0.2),
            prop_oneof![3 => Just(0u8), 1 => Just(1u8)],
        ),
    )
        .prop_map(
            |(
                (ty, payload, job_id, idem, dedupe),
                (timing, deadline, ma, retry, timeout, ck, priority),
            )| Req {
                ty,
                payload,
                job_id,
                idem,
                dedupe,
                timing,
                deadline,
                max_attempts: ma,
                retry,
                timeout,
                ck,
                priority,
            },
        )
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let fail_kind = prop_oneof![
        3 => Just(FailKind::Retryable),
        1 => prop::sample::select(vec![0i64, 2000]).prop_map(FailKind::RetryAfter),
        1 => Just(FailKind::Permanent),
        1 => prop::sample::select(vec![0i64, 3000, 30_000]).prop_map(FailKind::Snooze),
    ];
    prop_oneof![
        12 => req_strategy().prop_map(Op::Enqueue),
        2 => (prop::collection::vec(req_strategy(), 1..4), prop::bool::weighted(0.3))
            .prop_map(|(r, a)| Op::EnqueueMany(r, a)),
        6 => (1..4u32, prop::sample::select(vec![1000i64, 30_000]))
            .prop_map(|(limit, lease_ms)| Op::Claim { limit, lease_ms }),
        2 => any::<usize>().prop_map(Op::Heartbeat),
        3 => any::<usize>().prop_map(Op::Complete),
        3 => (any::<usize>(), fail_kind).prop_map(|(t, k)| Op::Fail(t, k)),
        1 => any::<usize>().prop_map(Op::Release),
        2 => any::<usize>().prop_map(Op::Cancel),
        1 => (0..2u8, 0..2u8).prop_map(|(t, k)| Op::CancelByKey(t, k)),
        1 => any::<usize>().prop_map(Op::Purge),
        1 => any::<usize>().prop_map(Op::Promote),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(j, k)| Op::Redrive(j, k)),
        1 => Just(Op::Reap),
        4 => prop::sample::select(vec![0i64, 1, 999, 1000, 5000, 10_000, 30_000, 60_000, 180_000])
            .prop_map(Op::Advance),
        4 => (0..3usize, -1..=1i64).prop_map(|(n, d)| Op::AdvanceToBoundary(n, d)),
    ]
}

// ------------------------------------------------------------------ a request, resolved

/// A request with the clock-relative parts resolved at `now`.
#[derive(Clone, Debug)]
struct Resolved {
    ty: &'static str,
    payload: u8,
    job_id: Option<&'static str>,
    scope: Option<&'static str>,
    key: Option<&'static str>,
    key_ttl: Option<i64>,
    dedupe: Option<(&'static str, Mode, Option<i64>, Option<i64>)>,
    run_at: Option<i64>,
    /// As given (0 kept: `delay: 0` ≡ omitted only for the fingerprint).
    delay: Option<i64>,
    deadline: Option<i64>,
    max_attempts: Option<i64>,
    retry: u8,
    timeout: Option<i64>,
    ck: bool,
    priority: i16,
}

fn resolve(r: &Req, now: i64) -> Resolved {
    let (run_at, delay) = match r.timing {
        Timing::Omitted => (None, None),
        Timing::DelayZero => (None, Some(0)),
        Timing::Delay(d) => (None, Some(d)),
        Timing::RunAt(t) => (Some(t), None),
    };
    Resolved {
        ty: TYPES[r.ty as usize % 2],
        payload: r.payload,
        job_id: r.job_id.map(|i| JOB_IDS[i as usize % 2]),
        scope: r.idem.and_then(|(_, s, _)| match s {
            0 => None,
            1 => Some("default"),
            _ => Some("other"),
        }),
        key: r.idem.map(|(k, _, _)| IKEYS[k as usize % 2]),
        key_ttl: r.idem.and_then(|(_, _, t)| match t {
            0 => None,
            1 => Some(60_000),
            _ => Some(DAY),
        }),
        dedupe: r.dedupe.map(|(k, i)| {
            let (m, ttl, mw) = dedupe_pool(i);
            (DKEYS[k as usize % 2], m, ttl, mw)
        }),
        run_at,
        delay,
        deadline: r.deadline.map(|d| match d {
            Deadline::At(t) => t,
            Deadline::In(d) => now + d,
        }),
        max_attempts: match r.max_attempts {
            0 => None,
            1 => Some(1),
            2 => Some(2),
            _ => Some(10),
        },
        retry: r.retry,
        timeout: match r.timeout {
            0 => None,
            1 => Some(10_000),
            _ => Some(30 * 60 * 1000),
        },
        ck: r.ck,
        priority: i16::from(r.priority),
    }
}

fn instant(ms: i64) -> DateTime<Utc> {
    epoch() + chrono::Duration::milliseconds(ms)
}

fn to_ms(t: DateTime<Utc>) -> i64 {
    let us = (t - epoch()).num_microseconds().expect("in range");
    // Every instant of the model is a whole millisecond; keep finer ones visible.
    if us % 1000 == 0 {
        us / 1000
    } else {
        i64::MIN + us
    }
}

impl Resolved {
    fn request(&self) -> EnqueueRequest {
        let mut r = EnqueueRequest::new(self.ty)
            .payload(payload(self.payload))
            .retry(policy(self.retry));
        if let Some(id) = self.job_id {
            r = r.job_id(id);
        }
        if let Some(key) = self.key {
            let mut o = IdempotencyOptions::new(key);
            if let Some(s) = self.scope {
                o = o.scope(s);
            }
            if let Some(t) = self.key_ttl {
                o = o.ttl(Duration::from_millis(t as u64));
            }
            r = r.idempotency(o);
        }
        if let Some((key, mode, ttl, mw)) = self.dedupe {
            let mut d = DedupeOptions::key(key);
            if let Some(t) = ttl {
                d = d.ttl(Duration::from_millis(t as u64));
            }
            match mode {
                Mode::Debounce => d = d.extend(),
                Mode::Replace => d = d.replace(),
                _ => {}
            }
            if let Some(w) = mw {
                d = d.max_wait(Duration::from_millis(w as u64));
            }
            r = r.dedupe(d);
        }
        if let Some(t) = self.run_at {
            r = r.run_at(instant(t));
        }
        if let Some(d) = self.delay {
            r = r.delay(Duration::from_millis(d as u64));
        }
        if let Some(d) = self.deadline {
            r = r.deadline(instant(d));
        }
        if let Some(n) = self.max_attempts {
            r = r.max_attempts(n as u32);
        }
        if let Some(t) = self.timeout {
            r = r.timeout(Duration::from_millis(t as u64));
        }
        if self.ck {
            r = r.concurrency_key("ck");
        }
        if self.priority != 0 {
            r = r.priority(self.priority);
        }
        r
    }

    /// The fingerprint of docs/idempotency.md, field by field, after defaults are
    /// resolved (`run_at` / `delay` as given, `delay: 0` ≡ omitted).
    fn fingerprint(&self) -> Fp {
        let null = || "null".to_string();
        let opt = |v: Option<i64>| v.map_or_else(null, |v| v.to_string());
        let mut f = BTreeMap::new();
        f.insert(
            "concurrency_key",
            if self.ck { "ck".into() } else { null() },
        );
        f.insert("deadline", opt(self.deadline));
        f.insert("delay_ms", opt(self.delay.filter(|d| *d != 0)));
        f.insert(
            "idempotency.ttl_ms",
            opt(self.key.map(|_| self.key_ttl.unwrap_or(DAY))),
        );
        f.insert("job_id", self.job_id.map_or_else(null, str::to_owned));
        f.insert("max_attempts", self.max_attempts.unwrap_or(10).to_string());
        f.insert("payload", self.payload.to_string());
        f.insert("queue", "default".into());
        f.insert("retry", self.retry.to_string());
        f.insert("run_at", opt(self.run_at));
        f.insert("tags", "[]".into());
        f.insert(
            "timeout_ms",
            self.timeout.unwrap_or(30 * 60 * 1000).to_string(),
        );
        f.insert("type", self.ty.into());
        Fp(f)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Fp(BTreeMap<&'static str, String>);

impl Fp {
    /// Names of the differing fields; against a job record, key retention
    /// and the id itself are not compared (docs/decisions.md).
    fn diff(&self, other: &Fp, against_job: bool) -> Vec<String> {
        self.0
            .iter()
            .filter(|(k, _)| !(against_job && (**k == "idempotency.ttl_ms" || **k == "job_id")))
            .filter(|(k, v)| other.0.get(*k) != Some(v))
            .map(|(k, _)| (*k).to_owned())
            .collect()
    }
}

// ------------------------------------------------------------------ observations

/// A job id inside an observation: printed in brackets so ids can be
/// unified (model ids against generated backend ids) by position.
#[derive(Clone, PartialEq, Eq)]
struct Id(String);

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "⟦{}⟧", self.0)
    }
}

#[derive(Clone, Debug, PartialEq)]
enum ErrObs {
    Validation(String),
    Conflict {
        job_id: Id,
        source: &'static str,
        scope: Option<String>,
        key_preview: Option<String>,
        key_digest: Option<String>,
        fields: Vec<String>,
    },
    LeaseLost(Id),
    NotDead(Id, JobState),
    NotFound,
    Batch(usize, Box<ErrObs>),
    Other(String),
}

#[derive(Clone, Debug, PartialEq)]
enum Obs {
    Enqueue(Result<(Id, String), ErrObs>),
    Many(Result<Vec<Result<(Id, String), ErrObs>>, ErrObs>),
    /// (job, attempt, lease expiry)
    Claimed(Vec<(Id, i32, i64)>),
    Heartbeat(Result<(i64, bool), ErrObs>),
    Unit(Result<(), ErrObs>),
    /// (state, next run_at)
    Failed(Result<(JobState, Option<i64>), ErrObs>),
    Cancel(Result<(bool, JobState), ErrObs>),
    /// The state a release left the job in.
    Released(Result<JobState, ErrObs>),
    Bool(Result<bool, ErrObs>),
    Count(u64),
    Advanced(i64),
    Skipped,
}

fn err_obs(e: &Error) -> ErrObs {
    match e {
        Error::Validation { field, .. } => ErrObs::Validation(field.clone()),
        Error::EnqueueIdempotencyConflict(c) => ErrObs::Conflict {
            job_id: Id(c.job_id.clone()),
            source: c.source.as_str(),
            scope: c.scope.clone(),
            key_preview: c.key_preview.clone(),
            key_digest: c.key_digest.clone(),
            fields: c.fields.clone(),
        },
        Error::LeaseLost { job_id } => ErrObs::LeaseLost(Id(job_id.clone())),
        Error::NotDead { job_id, state } => ErrObs::NotDead(Id(job_id.clone()), *state),
        Error::NotFound { .. } => ErrObs::NotFound,
        Error::BatchItem { index, error } => ErrObs::Batch(*index, Box::new(err_obs(error))),
        other => ErrObs::Other(other.to_string()),
    }
}

fn result_obs(r: &EnqueueResult) -> (Id, String) {
    (Id(r.job_id.clone()), r.outcome.to_string())
}

/// What a job looks like at the end of a step.
#[derive(Clone, Debug, PartialEq)]
struct JobSnap {
    ty: String,
    payload: Value,
    state: JobState,
    priority: i16,
    attempt: i32,
    attempts_used: i32,
    max_attempts: i32,
    run_at: i64,
    deadline: Option<i64>,
    timeout_ms: i64,
    retry: RetryPolicy,
    concurrency_key: Option<String>,
    cancel_requested: bool,
    dedupe_key: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
struct Snapshot {
    jobs: BTreeMap<String, JobSnap>,
    /// Live dedupe bindings by (type, key): (job, mode, window end).
    dedupe: Vec<Option<(String, DedupeMode, Option<i64>)>>,
    /// Live idempotency bindings by (scope, key): (job, expiry).
    keys: Vec<Option<(String, i64)>>,
}

const LOOKUP_SCOPES: [&str; 2] = ["default", "other"];

// ------------------------------------------------------------------ the model

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Waiting,
    Active,
    Completed,
    Dead,
    Cancelled,
}

#[derive(Clone, Debug)]
struct MJob {
    ty: &'static str,
    payload: u8,
    fp: Fp,
    seq: u64,
    st: St,
    run_at: i64,
    attempt: i32,
    attempts_used: i32,
    max_attempts: i32,
    deadline: Option<i64>,
    timeout_ms: i64,
    retry: u8,
    ck: bool,
    priority: i16,
    cancel_requested: bool,
    dedupe_key: Option<&'static str>,
    token: Option<usize>,
    lease_ms: i64,
    lease_expires: i64,
    started_at: i64,
}

impl MJob {
    fn pending(&self) -> bool {
        matches!(self.st, St::Waiting | St::Active)
    }
}

#[derive(Clone, Debug)]
struct IdemBinding {
    job: String,
    fp: Fp,
    expires: i64,
}

#[derive(Clone, Debug)]
struct DedupeBinding {
    job: String,
    mode: Mode,
    ttl: Option<i64>,
    max_wait: Option<i64>,
    accepted_at: i64,
    /// `None` for the modes that live while their job is pending.
    window_until: Option<i64>,
}

#[derive(Clone, Debug)]
enum Decision {
    Coalesce { rearm: bool },
    Replace,
    NonReplaceable(&'static str),
}

#[derive(Clone, Debug, Default)]
struct Model {
    now: i64,
    jobs: BTreeMap<String, MJob>,
    /// Every job id ever created, in creation order (also purged ones).
    known: Vec<String>,
    next_generated: u64,
    next_seq: u64,
    keys: HashMap<(String, String), IdemBinding>,
    /// Redrive keys: key → (job, expiry); fingerprint = the job id.
    redrive_keys: HashMap<String, (String, i64)>,
    dedupe: HashMap<(String, String), DedupeBinding>,
    /// token index → job id
    tokens: Vec<String>,
}

enum End {
    Completed,
    Failed {
        permanent: bool,
        retry_after: Option<i64>,
    },
    Snoozed(i64),
    Released,
    LeaseExpired,
    TimedOut,
    DeadlinePassed,
}

impl Model {
    fn state(&self, j: &MJob) -> JobState {
        match j.st {
            St::Waiting if j.run_at <= self.now => JobState::Ready,
            St::Waiting => JobState::Scheduled,
            St::Active => JobState::Active,
            St::Completed => JobState::Completed,
            St::Dead => JobState::Dead,
            St::Cancelled => JobState::Cancelled,
        }
    }

    fn dedupe_live(&self, b: &DedupeBinding) -> bool {
        match b.window_until {
            None => self.jobs.get(&b.job).is_some_and(MJob::pending),
            Some(until) => self.now < until,
        }
    }

    /// Cancel and purge release the job's own dedupe binding (generation rule).
    fn release_dedupe_of(&mut self, id: &str) {
        self.dedupe.retain(|_, b| b.job != id);
    }

    fn conflict_key(&self, scope: &str, key: &str, job: &str, fields: Vec<String>) -> ErrObs {
        ErrObs::Conflict {
            job_id: Id(job.to_owned()),
            source: "idempotency_key",
            scope: Some(scope.to_owned()),
            key_preview: Some(key_preview(key)),
            key_digest: Some(key_digest(&KeyHasher::plain().hash(scope, key))),
            fields,
        }
    }

    fn enqueue(&mut self, r: &Resolved) -> Result<(Id, String), ErrObs> {
        let now = self.now;
        // Shape (the only shape error the pools can produce).
        if let (Some(run_at), Some(deadline)) = (r.run_at, r.deadline)
            && run_at >= deadline
        {
            return Err(ErrObs::Validation("run_at".into()));
        }
        let fp = r.fingerprint();
        let scope = r.scope.unwrap_or("default");
        // Idempotency: a live binding decides.
        if let Some(key) = r.key
            && let Some(b) = self.keys.get(&(scope.to_owned(), key.to_owned()))
            && now < b.expires
        {
            let fields = b.fp.diff(&fp, false);
            return if fields.is_empty() {
                Ok((Id(b.job.clone()), "replayed".into()))
            } else {
                Err(self.conflict_key(scope, key, &b.job, fields))
            };
        }
        let result = self.decide(r, &fp)?;
        if let Some(key) = r.key {
            self.keys.insert(
                (scope.to_owned(), key.to_owned()),
                IdemBinding {
                    job: result.0.0.clone(),
                    fp,
                    expires: now + r.key_ttl.unwrap_or(DAY),
                },
            );
        }
        Ok(result)
    }

    /// Explicit job id, dedupe, then the clock checks and the write.
    fn decide(&mut self, r: &Resolved, fp: &Fp) -> Result<(Id, String), ErrObs> {
        let now = self.now;
        if let Some(id) = r.job_id
            && let Some(j) = self.jobs.get(id)
        {
            let fields = j.fp.diff(fp, true);
            return if fields.is_empty() {
                Ok((Id(id.to_owned()), "replayed".into()))
            } else {
                Err(ErrObs::Conflict {
                    job_id: Id(id.to_owned()),
                    source: "job_id",
                    scope: None,
                    key_preview: None,
                    key_digest: None,
                    fields,
                })
            };
        }
        if let Some((dkey, mode, _, _)) = r.dedupe {
            let bkey = (r.ty.to_owned(), dkey.to_owned());
            if let Some(b) = self.dedupe.get(&bkey).cloned()
                && self.dedupe_live(&b)
            {
                let j = self.jobs.get(&b.job);
                let decision = match (b.mode, mode) {
                    (Mode::Replace, Mode::Replace) => match j {
                        Some(j) if j.st == St::Waiting && j.attempt == 0 => {
                            if j.run_at > now {
                                Decision::Replace
                            } else {
                                Decision::NonReplaceable("window_elapsed")
                            }
                        }
                        _ => Decision::NonReplaceable("not_pending"),
                    },
                    (Mode::Replace, _) => Decision::Coalesce { rearm: false },
                    (_, Mode::Replace) => Decision::NonReplaceable("incompatible_mode"),
                    (bound, _) => Decision::Coalesce {
                        rearm: bound == Mode::Debounce,
                    },
                };
                let holder = Id(b.job.clone());
                match decision {
                    Decision::Coalesce { rearm } => {
                        if rearm {
                            let ttl = b.ttl.unwrap_or(0);
                            let mut until = now + ttl;
                            if let Some(w) = b.max_wait {
                                until = until.min(b.accepted_at + w);
                            }
                            if let Some(b) = self.dedupe.get_mut(&bkey) {
                                b.window_until = Some(until);
                            }
                        }
                        return Ok((holder, "coalesced".into()));
                    }
                    Decision::NonReplaceable(reason) => {
                        return Ok((holder, format!("non_replaceable ({reason})")));
                    }
                    Decision::Replace => {
                        let mut run_at = self.run_at_of(r);
                        if let Some(w) = b.max_wait {
                            run_at = run_at.min(b.accepted_at + w);
                        }
                        self.clock_checks(r, run_at)?;
                        let j = self.jobs.get_mut(&b.job).expect("holder exists");
                        j.payload = r.payload;
                        j.fp = fp.clone();
                        j.run_at = run_at;
                        j.max_attempts = r.max_attempts.unwrap_or(10) as i32;
                        j.deadline = r.deadline;
                        j.timeout_ms = r.timeout.unwrap_or(30 * 60 * 1000);
                        j.retry = r.retry;
                        j.ck = r.ck;
                        j.priority = r.priority;
                        if let Some(ttl) = b.ttl
                            && let Some(b) = self.dedupe.get_mut(&bkey)
                        {
                            b.window_until = Some((now + ttl).max(run_at));
                        }
                        return Ok((holder, "replaced".into()));
                    }
                }
            }
        }
        let mut run_at = self.run_at_of(r);
        // docs/dedupe.md: with max_wait (debounce or replace), a job's run_at
        // is never later than first acceptance + max_wait.
        if let Some((_, _, _, Some(w))) = r.dedupe {
            run_at = run_at.min(now + w);
        }
        self.clock_checks(r, run_at)?;
        let id = match r.job_id {
            Some(id) => id.to_owned(),
            None => {
                self.next_generated += 1;
                format!("g{}", self.next_generated)
            }
        };
        self.next_seq += 1;
        self.jobs.insert(
            id.clone(),
            MJob {
                ty: r.ty,
                payload: r.payload,
                fp: fp.clone(),
                seq: self.next_seq,
                st: St::Waiting,
                run_at,
                attempt: 0,
                attempts_used: 0,
                max_attempts: r.max_attempts.unwrap_or(10) as i32,
                deadline: r.deadline,
                timeout_ms: r.timeout.unwrap_or(30 * 60 * 1000),
                retry: r.retry,
                ck: r.ck,
                priority: r.priority,
                cancel_requested: false,
                dedupe_key: r.dedupe.map(|d| d.0),
                token: None,
                lease_ms: 0,
                lease_expires: 0,
                started_at: 0,
            },
        );
        if !self.known.contains(&id) {
            self.known.push(id.clone());
        }
        if let Some((dkey, mode, ttl, max_wait)) = r.dedupe {
            let window_until = ttl.map(|ttl| match mode {
                Mode::Replace => (now + ttl).max(run_at),
                _ => now + ttl,
            });
            self.dedupe.insert(
                (r.ty.to_owned(), dkey.to_owned()),
                DedupeBinding {
                    job: id.clone(),
                    mode,
                    ttl,
                    max_wait,
                    accepted_at: now,
                    window_until,
                },
            );
        }
        Ok((Id(id), "accepted".into()))
    }

    /// Checks against the clock, only for a request that creates or replaces,
    /// with the `run_at` the job would get (a delay capped by `max_wait`
    /// counts as capped).
    fn clock_checks(&self, r: &Resolved, run_at: i64) -> Result<(), ErrObs> {
        if let Some(d) = r.deadline {
            if d <= self.now {
                return Err(ErrObs::Validation("deadline".into()));
            }
            if r.delay.is_some() && run_at >= d {
                return Err(ErrObs::Validation("delay_ms".into()));
            }
        }
        Ok(())
    }

    fn run_at_of(&self, r: &Resolved) -> i64 {
        r.run_at.unwrap_or(self.now + r.delay.unwrap_or(0))
    }

    fn enqueue_many(&mut self, reqs: &[Resolved], atomic: bool) -> Obs {
        if atomic {
            let mut trial = self.clone();
            let mut out = Vec::new();
            for (i, r) in reqs.iter().enumerate() {
                match trial.enqueue(r) {
                    Ok(x) => out.push(Ok(x)),
                    Err(e) => {
                        // Rolled back; generated ids are never reused.
                        self.next_generated = trial.next_generated;
                        return Obs::Many(Err(ErrObs::Batch(i, Box::new(e))));
                    }
                }
            }
            *self = trial;
            Obs::Many(Ok(out))
        } else {
            Obs::Many(Ok(reqs.iter().map(|r| self.enqueue(r)).collect()))
        }
    }

    fn end_attempt(&mut self, id: &str, end: End) -> (JobState, Option<i64>) {
        let now = self.now;
        let j = self.jobs.get(id).expect("active job").clone();
        let consumed = !matches!(end, End::Released | End::Snoozed(_));
        let used = j.attempts_used + i32::from(consumed);
        let past = |at: i64| j.deadline.is_some_and(|d| at >= d);
        let retry_at = |delay: i64| {
            if past(now + delay) {
                None
            } else {
                Some(now + delay)
            }
        };
        // Some(at): waiting again; None: dead; cancelled/completed apart.
        enum Next {
            Completed,
            Cancelled,
            Waiting(i64),
            Dead,
        }
        let next = match end {
            End::Completed => Next::Completed,
            _ if j.cancel_requested => Next::Cancelled,
            End::Released => Next::Waiting(now),
            End::Snoozed(ms) => retry_at(ms).map_or(Next::Dead, Next::Waiting),
            End::DeadlinePassed => Next::Dead,
            End::Failed {
                permanent: true, ..
            } => Next::Dead,
            _ if used >= j.max_attempts => Next::Dead,
            End::LeaseExpired if past(now) => Next::Dead,
            End::LeaseExpired => Next::Waiting(now),
            End::Failed { retry_after, .. } => match policy_delay(j.retry, used) {
                None => Next::Dead,
                Some(d) => retry_at(retry_after.unwrap_or(d)).map_or(Next::Dead, Next::Waiting),
            },
            End::TimedOut => match policy_delay(j.retry, used) {
                None => Next::Dead,
                Some(d) => retry_at(d).map_or(Next::Dead, Next::Waiting),
            },
        };
        let m = self.jobs.get_mut(id).expect("job");
        m.attempts_used = used;
        m.token = None;
        match next {
            Next::Completed => {
                m.st = St::Completed;
                (JobState::Completed, None)
            }
            Next::Dead => {
                m.st = St::Dead;
                (JobState::Dead, None)
            }
            Next::Cancelled => {
                m.st = St::Cancelled;
                self.release_dedupe_of(id);
                (JobState::Cancelled, None)
            }
            Next::Waiting(at) => {
                m.st = St::Waiting;
                m.run_at = at;
                let s = if at <= now {
                    JobState::Ready
                } else {
                    JobState::Scheduled
                };
                (s, Some(at))
            }
        }
    }

    fn expired_leases(&self) -> Vec<String> {
        self.jobs
            .iter()
            .filter(|(_, j)| j.st == St::Active && j.lease_expires <= self.now)
            .map(|(id, _)| id.clone())
            .collect()
    }

    fn reap(&mut self) -> u64 {
        let ids = self.expired_leases();
        for id in &ids {
            self.end_attempt(id, End::LeaseExpired);
        }
        ids.len() as u64
    }

    fn claim(&mut self, limit: u32, lease_ms: i64) -> Obs {
        self.reap();
        let now = self.now;
        let ck_active = self.jobs.values().any(|j| j.st == St::Active && j.ck);
        let mut due: Vec<(String, i16, i64, u64)> = self
            .jobs
            .iter()
            .filter(|(_, j)| j.st == St::Waiting && j.run_at <= now && !(j.ck && ck_active))
            .map(|(id, j)| (id.clone(), j.priority, j.run_at, j.seq))
            .collect();
        due.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.3.cmp(&b.3)));
        let mut out = Vec::new();
        let mut ck_taken = false;
        for (id, ..) in due {
            if out.len() as u32 >= limit {
                break;
            }
            let j = self.jobs.get_mut(&id).expect("job");
            if j.deadline.is_some_and(|d| d <= now) {
                // Past its deadline: never started.
                j.st = St::Dead;
                continue;
            }
            if j.ck {
                if ck_taken {
                    continue;
                }
                ck_taken = true;
            }
            j.st = St::Active;
            j.attempt += 1;
            j.token = Some(self.tokens.len());
            j.lease_ms = lease_ms;
            j.lease_expires = now + lease_ms;
            j.started_at = now;
            out.push((Id(id.clone()), j.attempt, now + lease_ms));
            self.tokens.push(id);
        }
        Obs::Claimed(out)
    }

    /// The job a token belongs to, if it is still the current lease.
    fn holder(&self, token: usize) -> Result<String, ErrObs> {
        let id = &self.tokens[token];
        match self.jobs.get(id) {
            Some(j) if j.st == St::Active && j.token == Some(token) => Ok(id.clone()),
            _ => Err(ErrObs::LeaseLost(Id(id.clone()))),
        }
    }

    fn heartbeat(&mut self, token: usize) -> Result<(i64, bool), ErrObs> {
        let id = self.holder(token)?;
        let now = self.now;
        let j = &self.jobs[&id];
        if now >= j.started_at + j.timeout_ms {
            self.end_attempt(&id, End::TimedOut);
            return Err(ErrObs::LeaseLost(Id(id)));
        }
        if j.deadline.is_some_and(|d| now >= d) {
            self.end_attempt(&id, End::DeadlinePassed);
            return Err(ErrObs::LeaseLost(Id(id)));
        }
        let j = self.jobs.get_mut(&id).expect("job");
        j.lease_expires = now + j.lease_ms;
        Ok((j.lease_expires, j.cancel_requested))
    }

    fn cancel_one(&mut self, id: &str) -> (bool, JobState) {
        let j = self.jobs.get_mut(id).expect("job");
        match j.st {
            St::Waiting => {
                j.st = St::Cancelled;
                self.release_dedupe_of(id);
                (true, JobState::Cancelled)
            }
            St::Active => {
                j.cancel_requested = true;
                (true, JobState::Active)
            }
            _ => {
                let s = self.state(&self.jobs[id]);
                (false, s)
            }
        }
    }

    fn redrive(&mut self, id: &str, key: bool) -> Result<(Id, String), ErrObs> {
        let now = self.now;
        if key
            && let Some((job, expires)) = self.redrive_keys.get(RKEY)
            && now < *expires
        {
            return if job == id {
                Ok((Id(id.to_owned()), "replayed".into()))
            } else {
                Err(self.conflict_key(REDRIVE_SCOPE, RKEY, job, vec!["job_id".into()]))
            };
        }
        let Some(j) = self.jobs.get(id) else {
            return Err(ErrObs::NotFound);
        };
        if j.st != St::Dead {
            return Err(ErrObs::NotDead(Id(id.to_owned()), self.state(j)));
        }
        let (ty, dkey) = (j.ty, j.dedupe_key);
        let j = self.jobs.get_mut(id).expect("job");
        j.st = St::Waiting;
        j.run_at = now;
        j.attempts_used = 0;
        if j.deadline.is_some_and(|d| d <= now) {
            j.deadline = None;
        }
        // A binding that lives while its job is pending would come back to life.
        if let Some(dkey) = dkey {
            let bkey = (ty.to_owned(), dkey.to_owned());
            if self
                .dedupe
                .get(&bkey)
                .is_some_and(|b| b.job == id && b.window_until.is_none())
            {
                self.dedupe.remove(&bkey);
            }
        }
        if key {
            self.redrive_keys
                .insert(RKEY.to_owned(), (id.to_owned(), now + DAY));
        }
        Ok((Id(id.to_owned()), "accepted".into()))
    }

    /// Instants after now at which something changes.
    fn boundaries(&self) -> Vec<i64> {
        let mut v = Vec::new();
        for j in self.jobs.values() {
            match j.st {
                St::Waiting => v.push(j.run_at),
                St::Active => {
                    v.push(j.lease_expires);
                    v.push(j.started_at + j.timeout_ms);
                }
                _ => {}
            }
            if j.pending()
                && let Some(d) = j.deadline
            {
                v.push(d);
            }
        }
        for b in self.dedupe.values() {
            if let Some(u) = b.window_until {
                v.push(u);
            }
        }
        for b in self.keys.values() {
            v.push(b.expires);
        }
        for d in [20_000, 300_000] {
            v.push(d);
        }
        v.retain(|t| *t > self.now);
        v.sort_unstable();
        v.dedup();
        v
    }

    /// The step's target, resolved from the op's indices.
    fn job_at(&self, i: usize) -> String {
        let n = self.known.len();
        if n == 0 || i % (n + 1) == n {
            "no-such-job".into()
        } else {
            self.known[i % (n + 1)].clone()
        }
    }

    fn snapshot(&self) -> Snapshot {
        let jobs = self
            .jobs
            .iter()
            .map(|(id, j)| {
                (
                    id.clone(),
                    JobSnap {
                        ty: j.ty.into(),
                        payload: payload(j.payload),
                        state: self.state(j),
                        priority: j.priority,
                        attempt: j.attempt,
                        attempts_used: j.attempts_used,
                        max_attempts: j.max_attempts,
                        run_at: j.run_at,
                        deadline: j.deadline,
                        timeout_ms: j.timeout_ms,
                        retry: policy(j.retry),
                        concurrency_key: j.ck.then(|| "ck".into()),
                        cancel_requested: j.cancel_requested,
                        dedupe_key: j.dedupe_key.map(str::to_owned),
                    },
                )
            })
            .collect();
        let mut dedupe = Vec::new();
        for ty in TYPES {
            for key in DKEYS {
                let b = self
                    .dedupe
                    .get(&(ty.to_owned(), key.to_owned()))
                    .filter(|b| self.dedupe_live(b));
                dedupe.push(b.map(|b| (b.job.clone(), b.mode.api(), b.window_until)));
            }
        }
        let mut keys = Vec::new();
        for scope in LOOKUP_SCOPES {
            for key in IKEYS {
                let b = self
                    .keys
                    .get(&(scope.to_owned(), key.to_owned()))
                    .filter(|b| self.now < b.expires);
                keys.push(b.map(|b| (b.job.clone(), b.expires)));
            }
        }
        Snapshot { jobs, dedupe, keys }
    }
}

/// An op with its targets resolved against the model before it runs.
#[derive(Clone, Debug)]
enum Step {
    Enqueue(Resolved),
    Many(Vec<Resolved>, bool),
    Claim(u32, i64),
    Heartbeat(usize),
    Complete(usize),
    Fail(usize, FailKind),
    Release(usize),
    Cancel(String),
    CancelByKey(&'static str, &'static str),
    Purge(String),
    Promote(String),
    Redrive(String, bool),
    Reap,
    Advance(i64),
    Skip,
}

impl Model {
    fn resolve(&self, op: &Op) -> Step {
        let tok = |i: usize| (!self.tokens.is_empty()).then(|| i % self.tokens.len());
        match op {
            Op::Enqueue(r) => Step::Enqueue(resolve(r, self.now)),
            Op::EnqueueMany(rs, atomic) => {
                Step::Many(rs.iter().map(|r| resolve(r, self.now)).collect(), *atomic)
            }
            Op::Claim { limit, lease_ms } => Step::Claim(*limit, *lease_ms),
            Op::Heartbeat(i) => tok(*i).map_or(Step::Skip, Step::Heartbeat),
            Op::Complete(i) => tok(*i).map_or(Step::Skip, Step::Complete),
            Op::Fail(i, k) => tok(*i).map_or(Step::Skip, |t| Step::Fail(t, *k)),
            Op::Release(i) => tok(*i).map_or(Step::Skip, Step::Release),
            Op::Cancel(i) => Step::Cancel(self.job_at(*i)),
            Op::CancelByKey(t, k) => {
                Step::CancelByKey(TYPES[*t as usize % 2], DKEYS[*k as usize % 2])
            }
            Op::Purge(i) => Step::Purge(self.job_at(*i)),
            Op::Promote(i) => Step::Promote(self.job_at(*i)),
            Op::Redrive(i, k) => Step::Redrive(self.job_at(*i), *k),
            Op::Reap => Step::Reap,
            Op::Advance(ms) => Step::Advance(*ms),
            Op::AdvanceToBoundary(n, delta) => {
                let b = self.boundaries();
                let by = b
                    .get((*n).min(b.len().saturating_sub(1)))
                    .map_or(1000, |t| (t + delta - self.now).max(0));
                Step::Advance(by)
            }
        }
    }

    fn apply(&mut self, step: &Step) -> Obs {
        match step {
            Step::Enqueue(r) => Obs::Enqueue(self.enqueue(r)),
            Step::Many(rs, atomic) => self.enqueue_many(rs, *atomic),
            Step::Claim(limit, lease) => self.claim(*limit, *lease),
            Step::Heartbeat(t) => Obs::Heartbeat(self.heartbeat(*t)),
            Step::Complete(t) => Obs::Unit(self.holder(*t).map(|id| {
                self.end_attempt(&id, End::Completed);
            })),
            Step::Fail(t, kind) => Obs::Failed(self.holder(*t).map(|id| {
                let end = match *kind {
                    FailKind::Retryable => End::Failed {
                        permanent: false,
                        retry_after: None,
                    },
                    FailKind::RetryAfter(ms) => End::Failed {
                        permanent: false,
                        retry_after: Some(ms),
                    },
                    FailKind::Permanent => End::Failed {
                        permanent: true,
                        retry_after: None,
                    },
                    FailKind::Snooze(ms) => End::Snoozed(ms),
                };
                self.end_attempt(&id, end)
            })),
            Step::Release(t) => Obs::Released(
                self.holder(*t)
                    .map(|id| self.end_attempt(&id, End::Released).0),
            ),
            Step::Cancel(id) => Obs::Cancel(if self.jobs.contains_key(id) {
                Ok(self.cancel_one(id))
            } else {
                Err(ErrObs::NotFound)
            }),
            Step::CancelByKey(ty, key) => {
                let ids: Vec<String> = self
                    .jobs
                    .iter()
                    .filter(|(_, j)| j.ty == *ty && j.dedupe_key == Some(*key) && j.pending())
                    .map(|(id, _)| id.clone())
                    .collect();
                for id in &ids {
                    self.cancel_one(id);
                }
                if !ids.is_empty() {
                    self.dedupe.remove(&((*ty).to_owned(), (*key).to_owned()));
                }
                Obs::Bool(Ok(!ids.is_empty()))
            }
            Step::Purge(id) => Obs::Bool(Ok(match self.jobs.get(id) {
                None => false,
                Some(j) if j.st == St::Active => false,
                Some(j) => {
                    let never_started = j.attempt == 0;
                    self.jobs.remove(id);
                    self.release_dedupe_of(id);
                    // Redrive keys are idempotency keys too (scope `idemq.redrive`).
                    if never_started {
                        self.keys.retain(|_, b| b.job != *id);
                        self.redrive_keys.retain(|_, (job, _)| job != id);
                    }
                    true
                }
            })),
            Step::Promote(id) => Obs::Bool(match self.jobs.get_mut(id) {
                None => Err(ErrObs::NotFound),
                Some(j) if j.st == St::Waiting && j.run_at > self.now => {
                    j.run_at = self.now;
                    Ok(true)
                }
                Some(_) => Ok(false),
            }),
            Step::Redrive(id, key) => Obs::Enqueue(self.redrive(id, *key)),
            Step::Reap => Obs::Count(self.reap()),
            Step::Advance(ms) => {
                self.now += ms;
                Obs::Advanced(*ms)
            }
            Step::Skip => Obs::Skipped,
        }
    }
}

// ------------------------------------------------------------------ the backend

struct Backend<'h> {
    h: &'h Harness,
    /// token index → (backend job id, lease token)
    tokens: Vec<(String, idemq::LeaseToken)>,
    b2m: HashMap<String, String>,
    m2b: HashMap<String, String>,
}

impl Backend<'_> {
    fn b(&self, model_id: &str) -> String {
        self.m2b
            .get(model_id)
            .cloned()
            .unwrap_or_else(|| model_id.to_owned())
    }

    fn m(&self, backend_id: &str) -> String {
        if JOB_IDS.contains(&backend_id) {
            return backend_id.to_owned();
        }
        self.b2m
            .get(backend_id)
            .cloned()
            .unwrap_or_else(|| format!("?{backend_id}"))
    }

    async fn apply(&mut self, step: &Step) -> Obs {
        let q = self.h.queue.clone();
        match step {
            Step::Enqueue(r) => Obs::Enqueue(
                q.enqueue_with_result(r.request())
                    .await
                    .map(|r| result_obs(&r))
                    .map_err(|e| err_obs(&e)),
            ),
            Step::Many(rs, atomic) => Obs::Many(
                q.enqueue_many(
                    rs.iter().map(Resolved::request).collect(),
                    BatchOptions { atomic: *atomic },
                )
                .await
                .map(|v| {
                    v.iter()
                        .map(|r| r.as_ref().map(result_obs).map_err(err_obs))
                        .collect()
                })
                .map_err(|e| err_obs(&e)),
            ),
            Step::Claim(limit, lease_ms) => {
                let claimed = q
                    .claim(ClaimOptions {
                        limit: *limit,
                        lease: Duration::from_millis(*lease_ms as u64),
                        worker: "w".into(),
                        ..ClaimOptions::default()
                    })
                    .await;
                match claimed {
                    Ok(c) => Obs::Claimed(
                        c.into_iter()
                            .map(|c| {
                                self.tokens.push((c.id.clone(), c.lease_token));
                                (Id(c.id), c.attempt, to_ms(c.lease_expires_at))
                            })
                            .collect(),
                    ),
                    Err(e) => Obs::Unit(Err(err_obs(&e))),
                }
            }
            Step::Heartbeat(t) => {
                let (id, tok) = &self.tokens[*t];
                Obs::Heartbeat(
                    q.heartbeat(id, tok)
                        .await
                        .map(|h| (to_ms(h.lease_expires_at), h.cancel_requested))
                        .map_err(|e| err_obs(&e)),
                )
            }
            Step::Complete(t) => {
                let (id, tok) = &self.tokens[*t];
                Obs::Unit(q.complete(id, tok, None).await.map_err(|e| err_obs(&e)))
            }
            Step::Fail(t, kind) => {
                let (id, tok) = &self.tokens[*t];
                let d = |ms: i64| Some(Duration::from_millis(ms as u64));
                let options = match *kind {
                    FailKind::Retryable => FailOptions {
                        error: "boom".into(),
                        ..FailOptions::default()
                    },
                    FailKind::RetryAfter(ms) => FailOptions {
                        error: "later".into(),
                        retry_after: d(ms),
                        ..FailOptions::default()
                    },
                    FailKind::Permanent => FailOptions {
                        error: "fatal".into(),
                        permanent: true,
                        ..FailOptions::default()
                    },
                    FailKind::Snooze(ms) => FailOptions {
                        snooze: d(ms),
                        ..FailOptions::default()
                    },
                };
                Obs::Failed(
                    q.fail(id, tok, options)
                        .await
                        .map(|o| (o.state, o.next_run_at.map(to_ms)))
                        .map_err(|e| err_obs(&e)),
                )
            }
            Step::Release(t) => {
                let (id, tok) = &self.tokens[*t];
                Obs::Released(q.release(id, tok).await.map_err(|e| err_obs(&e)))
            }
            Step::Cancel(id) => Obs::Cancel(
                q.cancel(&self.b(id))
                    .await
                    .map(|o| (o.cancelled, o.state))
                    .map_err(|e| err_obs(&e)),
            ),
            Step::CancelByKey(ty, key) => {
                Obs::Bool(q.cancel_by_key(ty, key).await.map_err(|e| err_obs(&e)))
            }
            Step::Purge(id) => Obs::Bool(q.purge(&self.b(id)).await.map_err(|e| err_obs(&e))),
            Step::Promote(id) => Obs::Bool(q.promote(&self.b(id)).await.map_err(|e| err_obs(&e))),
            Step::Redrive(id, key) => Obs::Enqueue(
                q.redrive(
                    &self.b(id),
                    RedriveOptions {
                        idempotency_key: key.then(|| RKEY.to_owned()),
                        ..RedriveOptions::default()
                    },
                )
                .await
                .map(|r| result_obs(&r))
                .map_err(|e| err_obs(&e)),
            ),
            Step::Reap => Obs::Count(q.reap_leases(100).await.unwrap_or(u64::MAX)),
            Step::Advance(ms) => {
                self.h.advance(Duration::from_millis(*ms as u64));
                Obs::Advanced(*ms)
            }
            Step::Skip => Obs::Skipped,
        }
    }

    /// Unifies the ids of two observations of the same shape: explicit ids
    /// must be equal, generated ones map one-to-one by first appearance.
    fn unify(&mut self, model: &Obs, backend: &Obs) -> Result<(), String> {
        let (ms, mids) = split_ids(&format!("{model:?}"));
        let (bs, bids) = split_ids(&format!("{backend:?}"));
        if ms != bs || mids.len() != bids.len() {
            return Err("answers differ".into());
        }
        for (m, b) in mids.iter().zip(&bids) {
            let explicit = JOB_IDS.contains(&m.as_str()) || m == "no-such-job";
            if explicit || JOB_IDS.contains(&b.as_str()) {
                if m != b {
                    return Err(format!("job id {b} where the model has {m}"));
                }
                continue;
            }
            match (self.b2m.get(b), self.m2b.get(m)) {
                (Some(x), _) if x == m => {}
                (None, None) => {
                    self.b2m.insert(b.clone(), m.clone());
                    self.m2b.insert(m.clone(), b.clone());
                }
                _ => return Err(format!("backend job {b} is not the model's {m}")),
            }
        }
        Ok(())
    }

    async fn snapshot(&self) -> Snapshot {
        let q = &self.h.queue;
        let mut jobs = BTreeMap::new();
        for j in self.h.jobs().await {
            jobs.insert(
                self.m(&j.id),
                JobSnap {
                    ty: j.job_type,
                    payload: j.payload,
                    state: j.state,
                    priority: j.priority,
                    attempt: j.attempt,
                    attempts_used: j.attempts_used,
                    max_attempts: j.max_attempts,
                    run_at: to_ms(j.run_at),
                    deadline: j.deadline.map(to_ms),
                    timeout_ms: j.timeout_ms,
                    retry: j.retry,
                    concurrency_key: j.concurrency_key,
                    cancel_requested: j.cancel_requested,
                    dedupe_key: j.dedupe.map(|d| d.key),
                },
            );
        }
        let mut dedupe = Vec::new();
        for ty in TYPES {
            for key in DKEYS {
                let b = q.dedupe_lookup(ty, key).await.expect("dedupe lookup");
                dedupe.push(b.map(|b| (self.m(&b.job_id), b.mode, b.window_until.map(to_ms))));
            }
        }
        let mut keys = Vec::new();
        for scope in LOOKUP_SCOPES {
            for key in IKEYS {
                let b = q.lookup_key(scope, key).await.expect("key lookup");
                keys.push(b.map(|b| (self.m(&b.job_id), to_ms(b.expires_at))));
            }
        }
        Snapshot { jobs, dedupe, keys }
    }
}

/// The observation's text with ids blanked out, and the ids in order.
fn split_ids(s: &str) -> (String, Vec<String>) {
    let mut shape = String::new();
    let mut ids = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find('⟦') {
        shape.push_str(&rest[..start]);
        shape.push_str("⟦⟧");
        let after = &rest[start + '⟦'.len_utf8()..];
        let end = after.find('⟧').expect("closed id");
        ids.push(after[..end].to_owned());
        rest = &after[end + '⟧'.len_utf8()..];
    }
    shape.push_str(rest);
    (shape, ids)
}

// ------------------------------------------------------------------ running

async fn run(h: &Harness, ops: Vec<Op>) -> Result<(), String> {
    let backend_name = h.backend;
    let mut model = Model::default();
    let mut backend = Backend {
        h,
        tokens: Vec::new(),
        b2m: HashMap::new(),
        m2b: HashMap::new(),
    };
    for (i, op) in ops.iter().enumerate() {
        let step = model.resolve(op);
        let before = model.clone();
        let m = model.apply(&step);
        let b = backend.apply(&step).await;
        let fail = |why: String| {
            Err(format!(
                "{backend_name}: step {i} ({op:?}) at t={} ms: {why}\n  step:    {step:?}\n  model:   {m:?}\n  backend: {b:?}",
                before.now
            ))
        };
        if let Err(why) = backend.unify(&m, &b) {
            return fail(why);
        }
        let ms = model.snapshot();
        let bs = backend.snapshot().await;
        if ms != bs {
            let mut diff = String::new();
            for (id, mj) in &ms.jobs {
                match bs.jobs.get(id) {
                    Some(bj) if bj == mj => {}
                    other => diff.push_str(&format!(
                        "\n  job {id}: model {mj:?}\n        backend {other:?}"
                    )),
                }
            }
            for (id, bj) in &bs.jobs {
                if !ms.jobs.contains_key(id) {
                    diff.push_str(&format!("\n  job {id} only on the backend: {bj:?}"));
                }
            }
            if ms.dedupe != bs.dedupe {
                diff.push_str(&format!(
                    "\n  dedupe bindings: model {:?}\n                   backend {:?}",
                    ms.dedupe, bs.dedupe
                ));
            }
            if ms.keys != bs.keys {
                diff.push_str(&format!(
                    "\n  idempotency bindings: model {:?}\n                        backend {:?}",
                    ms.keys, bs.keys
                ));
            }
            return fail(format!("state differs after the step:{diff}"));
        }
    }
    Ok(())
}

fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn config(default_cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases: env_usize("IDEMQ_MODEL_CASES").map_or(default_cases, |n| n as u32),
        max_shrink_iters: 4096,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let steps = env_usize("IDEMQ_MODEL_STEPS").unwrap_or(30);
    prop::collection::vec(op_strategy(), 1..=steps)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// Databases of finished cases, dropped in the background.
type Drops = std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>;

fn check(
    rt: &tokio::runtime::Runtime,
    drops: &Drops,
    backend: &'static str,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    // On a worker thread: the harness's `advance` uses `block_in_place`.
    let (outcome, h) = rt
        .block_on(rt.spawn(async move {
            let h = Harness::for_backend(backend).await;
            (run(&h, ops).await, h)
        }))
        .expect("case task");
    // Dropping a PostgreSQL database takes longer than a case: overlap it.
    let dropping = rt.spawn_blocking(move || drop(h));
    drops.lock().expect("drops").push(dropping);
    outcome.map_err(TestCaseError::fail)
}

fn finish(rt: &tokio::runtime::Runtime, drops: Drops) {
    for d in drops.into_inner().expect("drops") {
        rt.block_on(d).expect("drop the case's database");
    }
}

#[test]
fn model_sqlite() {
    let (rt, drops) = (runtime(), Drops::default());
    proptest!(config(200), |(ops in ops())| {
        check(&rt, &drops, "sqlite", ops)?;
    });
    finish(&rt, drops);
}

/// A server backend runs half the cases of SQLite (each case makes a
/// database or installation of its own on the server).
fn server_config() -> ProptestConfig {
    let cases = config(100);
    ProptestConfig {
        cases: env_usize("IDEMQ_MODEL_CASES").map_or(cases.cases, |n| (n as u32).div_ceil(2)),
        ..cases
    }
}

#[test]
fn model_postgres() {
    let (rt, drops) = (runtime(), Drops::default());
    proptest!(server_config(), |(ops in ops())| {
        check(&rt, &drops, "postgres", ops)?;
    });
    finish(&rt, drops);
}

#[test]
fn model_redis() {
    let (rt, drops) = (runtime(), Drops::default());
    proptest!(server_config(), |(ops in ops())| {
        check(&rt, &drops, "redis", ops)?;
    });
    finish(&rt, drops);
}
