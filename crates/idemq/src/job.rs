//! Jobs as callers see them: states, enqueue outcomes and the records the
//! queries return.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::request::{DedupeMode, RetryPolicy};

/// The state of a job (docs/state-machine.md). `Scheduled` and `Ready` are one stored state;
/// which one a job is in is derived from the clock: ready iff `run_at <= now`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting, not yet due.
    Scheduled,
    /// Waiting and due: claimable.
    Ready,
    /// Claimed by a worker under a lease.
    Active,
    /// Finished successfully (terminal).
    Completed,
    /// Out of attempts, failed permanently or past its deadline (terminal; the dead letters).
    Dead,
    /// Cancelled (terminal).
    Cancelled,
}

impl JobState {
    /// Every state, in lifecycle order.
    pub const ALL: [JobState; 6] = [
        Self::Scheduled,
        Self::Ready,
        Self::Active,
        Self::Completed,
        Self::Dead,
        Self::Cancelled,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Scheduled => "scheduled",
            Self::Ready => "ready",
            Self::Active => "active",
            Self::Completed => "completed",
            Self::Dead => "dead",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|st| st.as_str() == s)
    }

    /// Completed, dead or cancelled.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Dead | Self::Cancelled)
    }
}

impl std::fmt::Display for JobState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a `replace` request could not land (docs/dedupe.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NonReplaceableReason {
    /// A live binding of another mode holds the key.
    IncompatibleMode,
    /// The keyed job is no longer waiting: an attempt started, or it finished
    /// while a ttl window still holds the key.
    NotPending,
    /// The keyed job is waiting but already due.
    WindowElapsed,
}

impl NonReplaceableReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IncompatibleMode => "incompatible_mode",
            Self::NotPending => "not_pending",
            Self::WindowElapsed => "window_elapsed",
        }
    }
}

/// What an enqueue did (docs/dedupe.md, "Outcomes").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A new job was created.
    Accepted,
    /// An equivalent idempotent request (or explicit job id): the original job, nothing written.
    Replayed,
    /// Dropped by a live pending, throttle or debounce binding: the keyed job.
    Coalesced,
    /// A replace landed on the waiting keyed job (same id, new fields).
    Replaced,
    /// A replace could not land.
    NonReplaceable {
        /// Why.
        reason: NonReplaceableReason,
    },
}

impl Outcome {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Replayed => "replayed",
            Self::Coalesced => "coalesced",
            Self::Replaced => "replaced",
            Self::NonReplaceable { .. } => "non_replaceable",
        }
    }

    /// The reason, present exactly for `NonReplaceable`.
    pub fn reason(self) -> Option<NonReplaceableReason> {
        match self {
            Self::NonReplaceable { reason } => Some(reason),
            _ => None,
        }
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.reason() {
            Some(r) => write!(f, "non_replaceable ({})", r.as_str()),
            None => f.write_str(self.as_str()),
        }
    }
}

/// The result of [`Queue::enqueue_with_result`](crate::Queue::enqueue_with_result).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnqueueResult {
    /// The job the request now refers to (new, original or keyed).
    pub job_id: String,
    /// What happened.
    pub outcome: Outcome,
}

impl Serialize for EnqueueResult {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let reason = self.outcome.reason();
        let mut m = s.serialize_map(Some(if reason.is_some() { 3 } else { 2 }))?;
        m.serialize_entry("job_id", &self.job_id)?;
        m.serialize_entry("outcome", self.outcome.as_str())?;
        if let Some(r) = reason {
            m.serialize_entry("reason", r.as_str())?;
        }
        m.end()
    }
}

/// The idempotency key a job was accepted under, as it may be shown.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobIdempotency {
    /// The key's scope.
    pub scope: String,
    /// First characters of the key, then `…`.
    pub key_preview: String,
    /// First 16 hex digits of the stored key hash.
    pub key_digest: String,
    /// When the binding expires; `None` once it no longer points at this job.
    pub expires_at: Option<DateTime<Utc>>,
}

/// The job's own dedupe key and whether it still holds the binding.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobDedupe {
    /// The dedupe key (scoped per job type).
    pub key: String,
    /// The mode of the binding (or of the job's request once released).
    pub mode: DedupeMode,
    /// The end of the live window; `None` without a window or once released.
    pub window_until: Option<DateTime<Utc>>,
    /// False once the binding was released, ended, or passed to a newer job.
    pub holds_binding: bool,
}

/// A job record as queries return it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Job {
    /// The job id.
    pub id: String,
    /// The job type.
    #[serde(rename = "type")]
    pub job_type: String,
    /// The queue.
    pub queue: String,
    /// The derived state.
    pub state: JobState,
    /// The payload.
    pub payload: Value,
    /// The result stored by `complete`, if any.
    pub result: Option<Value>,
    /// Higher runs first among due jobs.
    pub priority: i16,
    /// Claims so far (1 on the first).
    pub attempt: i32,
    /// Consumed attempts (released and snoozed attempts are not consumed).
    pub attempts_used: i32,
    /// The attempt budget.
    pub max_attempts: i32,
    /// When the job is (or was) due.
    pub run_at: DateTime<Utc>,
    /// Acceptance time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// When it turned terminal.
    pub finished_at: Option<DateTime<Utc>>,
    /// The backoff policy.
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::Retry))]
    pub retry: RetryPolicy,
    /// Execution timeout of one attempt, in milliseconds.
    pub timeout_ms: i64,
    /// The deadline, if any.
    pub deadline: Option<DateTime<Utc>>,
    /// The concurrency key, if any.
    pub concurrency_key: Option<String>,
    /// Sorted, de-duplicated tags.
    pub tags: Vec<String>,
    /// Retention after turning terminal, if set explicitly (milliseconds).
    pub keep_ms: Option<i64>,
    /// The last error recorded by an attempt.
    pub last_error: Option<String>,
    /// Sticky flag set by cancelling an active job.
    pub cancel_requested: bool,
    /// The lease expiry of the current attempt (active jobs).
    pub lease_expires_at: Option<DateTime<Utc>>,
    /// The idempotency key the job was accepted under.
    pub idempotency: Option<JobIdempotency>,
    /// The job's dedupe key.
    pub dedupe: Option<JobDedupe>,
}

/// One entry of a job's event log.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Event {
    /// Global order.
    pub seq: i64,
    /// `accepted`, `replaced`, `claimed`, `checkpointed`, `retry_scheduled`,
    /// `completed`, `dead`, `cancelled`, `cancel_requested`, `promoted`,
    /// `redriven`, `lease_expired`, `released`, `binding_released`.
    pub kind: String,
    /// When it happened (clock of record).
    pub at: DateTime<Utc>,
    /// Details; never a raw key.
    pub data: Value,
}

/// One attempt in a job's run ledger.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Run {
    /// The attempt number (claim count).
    pub attempt: i32,
    /// The worker that claimed it.
    pub worker: String,
    /// Claim time.
    pub started_at: DateTime<Utc>,
    /// End time; `None` while running.
    pub finished_at: Option<DateTime<Utc>>,
    /// `completed`, `failed`, `lease_expired`, `released`, `snoozed`,
    /// `cancelled`; `None` while running.
    pub outcome: Option<String>,
    /// The error, truncated to 8 KiB.
    pub error: Option<String>,
}

/// A job handed to a worker by a claim.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClaimedJob {
    /// The job id.
    pub id: String,
    /// The job type.
    #[serde(rename = "type")]
    pub job_type: String,
    /// The queue.
    pub queue: String,
    /// The payload.
    pub payload: Value,
    /// This attempt's number (1 on the first claim).
    pub attempt: i32,
    /// The attempt budget.
    pub max_attempts: i32,
    /// The fencing token every later call of this attempt presents.
    pub lease_token: String,
    /// When the lease ends unless renewed by a heartbeat.
    pub lease_expires_at: DateTime<Utc>,
    /// Execution timeout of the attempt, in milliseconds.
    pub timeout_ms: i64,
    /// The deadline, if any.
    pub deadline: Option<DateTime<Utc>>,
    /// The job's tags.
    pub tags: Vec<String>,
}

/// The answer to a heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Heartbeat {
    /// The renewed lease expiry.
    pub lease_expires_at: DateTime<Utc>,
    /// True once the job was cancelled while active: the handler should stop.
    pub cancel_requested: bool,
}

/// The answer to a `fail`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FailOutcome {
    /// `scheduled` (a retry or snooze), `dead` or `cancelled`.
    pub state: JobState,
    /// When the next attempt is due, for `scheduled`.
    pub next_run_at: Option<DateTime<Utc>>,
}

/// The answer to a `cancel`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Cancelled))]
pub struct CancelOutcome {
    /// True when the job turned cancelled, or an active job was flagged.
    pub cancelled: bool,
    /// The job's state after the call.
    pub state: JobState,
}

/// A queue with its counts by state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueInfo {
    /// The queue name.
    pub name: String,
    /// Whether claims skip it.
    pub paused: bool,
    /// Jobs per state.
    pub counts: StateCounts,
    /// The states whose count is an estimate (empty: every count is exact).
    /// On PostgreSQL the terminal states of a large table are estimated
    /// (docs/scaling.md, "Big tables"); the live states are always exact.
    pub estimated: Vec<JobState>,
}

/// Jobs per state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StateCounts {
    /// Waiting, not due.
    pub scheduled: u64,
    /// Waiting, due.
    pub ready: u64,
    /// Claimed.
    pub active: u64,
    /// Completed.
    pub completed: u64,
    /// Dead.
    pub dead: u64,
    /// Cancelled.
    pub cancelled: u64,
}

impl StateCounts {
    /// Adds `n` jobs in `state`.
    pub fn add(&mut self, state: JobState, n: u64) {
        match state {
            JobState::Scheduled => self.scheduled += n,
            JobState::Ready => self.ready += n,
            JobState::Active => self.active += n,
            JobState::Completed => self.completed += n,
            JobState::Dead => self.dead += n,
            JobState::Cancelled => self.cancelled += n,
        }
    }
}
