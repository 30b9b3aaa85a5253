//! Jobs as callers see them: states, enqueue outcomes and the records the
//! queries return.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::Error;
use crate::request::{DedupeMode, RetryPolicy};

/// A value read back from a store that this version cannot decode: an
/// unknown name, unreadable JSON, an instant out of range, a NULL where a
/// value must be. The store names the row and column it came from
/// ([`Undecodable::at`]); it is never read as a default, which would show a
/// wrong job (or act on one) instead of a broken row.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
pub(crate) struct Undecodable {
    /// What the value is, as the message says it: `an unknown state`.
    what: String,
    /// The value, truncated; `None` when there is none to show (a NULL).
    value: Option<String>,
    /// Why it does not decode, when the value alone does not say (a JSON error).
    detail: Option<String>,
}

/// The longest part of a bad value an error shows: enough to recognise it,
/// never a whole payload.
#[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
const SHOWN_BYTES: usize = 40;

#[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
impl Undecodable {
    /// `value` is not one of the names of `what` (`state`, `dedupe mode`, …).
    pub(crate) fn unknown(what: &str, value: &str) -> Self {
        Self {
            what: format!("an unknown {what}"),
            value: Some(shorten(value)),
            detail: None,
        }
    }

    /// `value` was read where `what` must be, and is not one.
    pub(crate) fn unreadable(what: &str, value: &str, detail: impl std::fmt::Display) -> Self {
        Self {
            what: format!("an unreadable {what}"),
            value: Some(shorten(value)),
            detail: Some(detail.to_string()),
        }
    }

    /// A NULL where `what` must be.
    pub(crate) fn null(what: &str) -> Self {
        Self {
            what: format!("no {what} (NULL)"),
            value: None,
            detail: None,
        }
    }

    /// Something else wrong with the value, in words (`an instant out of range`),
    /// with the value shown as it was read.
    pub(crate) fn invalid(what: &str, value: impl std::fmt::Display) -> Self {
        Self {
            what: what.to_owned(),
            value: Some(shorten(&value.to_string())),
            detail: None,
        }
    }

    /// Something wrong that the value cannot show (a value of another type,
    /// a hash of the wrong length), in words.
    pub(crate) fn described(what: impl Into<String>) -> Self {
        Self {
            what: what.into(),
            value: None,
            detail: None,
        }
    }

    /// The `Backend` error for the value found in `column` (`idemq.jobs.state`)
    /// of `row` (`job 0190…`): `stored job 0190… has an unknown state "zombie"
    /// (idemq.jobs.state)`.
    pub(crate) fn at(self, row: impl std::fmt::Display, column: &str) -> Error {
        let mut message = format!("stored {row} has {}", self.what);
        if let Some(v) = &self.value {
            message.push_str(&format!(" {v:?}"));
        }
        message.push_str(&format!(" ({column})"));
        if let Some(d) = &self.detail {
            message.push_str(&format!(": {d}"));
        }
        Error::Backend { message }
    }
}

/// At most [`SHOWN_BYTES`] of `s`, cut at a character boundary, then `…`.
#[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
fn shorten(s: &str) -> String {
    if s.len() <= SHOWN_BYTES {
        return s.to_owned();
    }
    let mut end = SHOWN_BYTES;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

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

    /// Decodes a job's state as stored: `waiting` (scheduled or ready, as
    /// `due` says) or the name of another state. The stored names are the
    /// same on every backend, so this is their one table.
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_stored(stored: &str, due: bool) -> Result<Self, Undecodable> {
        match stored {
            "waiting" if due => Ok(Self::Ready),
            "waiting" => Ok(Self::Scheduled),
            // `scheduled` and `ready` are derived, never stored.
            "scheduled" | "ready" => Err(Undecodable::unknown("state", stored)),
            _ => Self::parse(stored).ok_or_else(|| Undecodable::unknown("state", stored)),
        }
    }

    /// Decodes a state a store's function answered with, already derived
    /// from the clock (`scheduled`, `ready`, `active`, …).
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_derived(name: &str) -> Result<Self, Undecodable> {
        Self::parse(name).ok_or_else(|| Undecodable::unknown("state", name))
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

    /// Decodes a reason a store answered with.
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_stored(name: &str) -> Result<Self, Undecodable> {
        [
            Self::IncompatibleMode,
            Self::NotPending,
            Self::WindowElapsed,
        ]
        .into_iter()
        .find(|r| r.as_str() == name)
        .ok_or_else(|| Undecodable::unknown("non-replaceable reason", name))
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

    /// Decodes an outcome a store answered with: its name, and the reason
    /// that must come with `non_replaceable` (and only with it).
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_stored(name: &str, reason: Option<&str>) -> Result<Self, Undecodable> {
        let plain = match name {
            "accepted" => Self::Accepted,
            "replayed" => Self::Replayed,
            "coalesced" => Self::Coalesced,
            "replaced" => Self::Replaced,
            "non_replaceable" => {
                let reason = reason.ok_or_else(|| Undecodable::null("non-replaceable reason"))?;
                return Ok(Self::NonReplaceable {
                    reason: NonReplaceableReason::from_stored(reason)?,
                });
            }
            _ => return Err(Undecodable::unknown("outcome", name)),
        };
        match reason {
            None => Ok(plain),
            Some(r) => Err(Undecodable::invalid(
                &format!("the outcome {name:?} with a reason"),
                r,
            )),
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

impl Event {
    /// Every kind of event a store writes.
    pub(crate) const KINDS: [&'static str; 14] = [
        "accepted",
        "replaced",
        "claimed",
        "checkpointed",
        "retry_scheduled",
        "completed",
        "dead",
        "cancelled",
        "cancel_requested",
        "promoted",
        "redriven",
        "lease_expired",
        "released",
        "binding_released",
    ];

    /// Decodes an event's kind as stored: one of [`Self::KINDS`].
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn kind_from_stored(kind: String) -> Result<String, Undecodable> {
        if Self::KINDS.contains(&kind.as_str()) {
            Ok(kind)
        } else {
            Err(Undecodable::unknown("event kind", &kind))
        }
    }
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

impl Run {
    /// Every way an attempt ends, as the run ledger stores it.
    pub(crate) const OUTCOMES: [&'static str; 6] = [
        "completed",
        "failed",
        "lease_expired",
        "released",
        "snoozed",
        "cancelled",
    ];

    /// Decodes a run's outcome as stored: one of [`Self::OUTCOMES`], or
    /// none while the attempt runs.
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn outcome_from_stored(
        outcome: Option<String>,
    ) -> Result<Option<String>, Undecodable> {
        match outcome {
            Some(o) if !Self::OUTCOMES.contains(&o.as_str()) => {
                Err(Undecodable::unknown("run outcome", &o))
            }
            o => Ok(o),
        }
    }
}

/// The fencing token of one attempt: minted by its claim, presented by every
/// later call of that attempt (heartbeat, complete, fail, release,
/// checkpoint). A type of its own so that a job id cannot be passed where the
/// token goes, nor the other way round; it serializes as the plain string.
///
/// ```compile_fail
/// # async fn swapped(queue: idemq::Queue, job: idemq::ClaimedJob) {
/// // The arguments in the wrong order do not compile.
/// queue.complete(&job.lease_token, &job.id, None).await.unwrap();
/// # }
/// ```
///
/// ```
/// # async fn right(queue: idemq::Queue, job: idemq::ClaimedJob) {
/// queue.complete(&job.id, &job.lease_token, None).await.unwrap();
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseToken(String);

impl LeaseToken {
    /// A token received from outside the library, such as over the HTTP API.
    pub fn new(token: impl Into<String>) -> Self {
        Self(token.into())
    }

    /// The token's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
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
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub lease_token: LeaseToken,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undecodable_value_names_its_row_column_and_value() {
        let e = JobState::from_stored("zombie", true)
            .unwrap_err()
            .at("job 0190", "idemq.jobs.state");
        let Error::Backend { message } = e else {
            panic!("not a Backend error: {e:?}");
        };
        assert_eq!(
            message,
            "stored job 0190 has an unknown state \"zombie\" (idemq.jobs.state)"
        );
    }

    #[test]
    fn a_long_value_is_shown_truncated() {
        let long = "é".repeat(100);
        let Error::Backend { message } = Undecodable::unknown("state", &long).at("job 1", "c")
        else {
            panic!("not a Backend error");
        };
        assert!(message.len() < 100, "{message}");
        assert!(message.contains("…"), "{message}");
    }

    #[test]
    fn stored_states_decode_by_one_table() {
        assert_eq!(JobState::from_stored("waiting", true), Ok(JobState::Ready));
        assert_eq!(
            JobState::from_stored("waiting", false),
            Ok(JobState::Scheduled)
        );
        for s in [
            JobState::Active,
            JobState::Completed,
            JobState::Dead,
            JobState::Cancelled,
        ] {
            assert_eq!(JobState::from_stored(s.as_str(), false), Ok(s));
        }
        // Derived names are never stored.
        assert!(JobState::from_stored("ready", true).is_err());
        assert!(JobState::from_stored("", true).is_err());
        for s in JobState::ALL {
            assert_eq!(JobState::from_derived(s.as_str()), Ok(s));
        }
    }

    #[test]
    fn outcomes_decode_with_their_reason_only() {
        assert_eq!(
            Outcome::from_stored("accepted", None),
            Ok(Outcome::Accepted)
        );
        assert_eq!(
            Outcome::from_stored("non_replaceable", Some("window_elapsed")),
            Ok(Outcome::NonReplaceable {
                reason: NonReplaceableReason::WindowElapsed
            })
        );
        assert!(Outcome::from_stored("non_replaceable", None).is_err());
        assert!(Outcome::from_stored("non_replaceable", Some("tired")).is_err());
        assert!(Outcome::from_stored("accepted", Some("not_pending")).is_err());
        assert!(Outcome::from_stored("teleported", None).is_err());
    }

    #[test]
    fn event_kinds_and_run_outcomes_are_a_closed_set() {
        assert!(Event::kind_from_stored("binding_released".into()).is_ok());
        assert!(Event::kind_from_stored("teleported".into()).is_err());
        assert_eq!(Run::outcome_from_stored(None), Ok(None));
        assert!(Run::outcome_from_stored(Some("snoozed".into())).is_ok());
        assert!(Run::outcome_from_stored(Some("vanished".into())).is_err());
    }
}
