//! The storage seam: one trait every backend implements, one params struct per
//! call.
//!
//! This is internal plumbing, public so that backends and the conformance
//! suite can reach it; the API for users is [`Queue`](crate::Queue). Every
//! method is one atomic operation of the backend (one `BEGIN IMMEDIATE`
//! transaction on SQLite). Methods that decide something a caller must be told
//! (a conflict, a lost lease) return it as a value or a typed error; nothing
//! is written for a refused request.

use std::collections::BTreeMap;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::error::Result;
use crate::fingerprint::Fingerprint;
use crate::job::{
    CancelOutcome, ClaimedJob, EnqueueResult, Event, FailOutcome, Heartbeat, Job, JobState,
    QueueInfo, Run,
};
use crate::request::{PreparedEnqueue, PreparedKey};
use crate::schedule::{Schedule, ScheduleList};

mod location;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqlite")]
pub mod sqlite;

pub use location::Location;

// The public types the seam returns (and the list filter it takes) are the
// queue's, defined outside the seam; named here too for the backends.
pub use crate::list::{JobList, JobPage};
pub use crate::report::{
    BindingInfo, Durability, Explain, ExplainConflict, ExplainDedupe, ExplainIdempotency,
    KeyCheckChange, MigrationStatus,
};

/// What a page cursor looks like: the decimal acceptance sequence number of
/// the last job of the previous page (`Queue::list` refuses anything else).
pub const CURSOR_PATTERN: &str = "^[0-9]{1,19}$";

/// Whether `cursor` has the form of [`CURSOR_PATTERN`].
pub fn is_cursor(cursor: &str) -> bool {
    (1..=19).contains(&cursor.len()) && cursor.bytes().all(|b| b.is_ascii_digit())
}

/// This library's version, recorded beside each schema version it writes
/// so that an older binary can say which one to run.
pub(crate) const IDEMQ_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The refusal of a schema (`what`) at version `found`, newer than the
/// `known` this binary has, recorded by the idemq `written_by` (none when
/// the binary that wrote it did not record its version).
#[cfg_attr(not(any(feature = "postgres", feature = "redis")), allow(dead_code))]
pub(crate) fn newer_schema(
    what: &str,
    found: i64,
    known: i64,
    written_by: Option<&str>,
) -> crate::Error {
    crate::Error::Backend {
        message: newer_schema_message(what, found, known, written_by),
    }
}

/// The words of [`newer_schema`].
pub(crate) fn newer_schema_message(
    what: &str,
    found: i64,
    known: i64,
    written_by: Option<&str>,
) -> String {
    let run = match written_by {
        Some(v) => format!("run idemq {v} (which wrote it) or later"),
        None => format!("run an idemq whose schema is version {found} or later"),
    };
    format!(
        "{what} is version {found}, newer than this idemq {IDEMQ_VERSION} knows ({known}): {run}"
    )
}

/// `job_enqueue`: one or many prepared requests, decided in order.
#[derive(Clone, Debug)]
pub struct JobEnqueue {
    /// The requests.
    pub items: Vec<PreparedEnqueue>,
    /// All-or-nothing: the first failing item fails the call and nothing is written.
    pub atomic: bool,
    /// Decide every item as a real call would, then write nothing. Used to
    /// find the first failing item of an atomic batch whose later items
    /// already failed validation.
    pub dry_run: bool,
}

/// `job_explain`: a dry run of one prepared request.
#[derive(Clone, Debug)]
pub struct JobExplain {
    /// The request.
    pub item: PreparedEnqueue,
}

/// A job id, for the single-job calls.
#[derive(Clone, Debug)]
pub struct JobRef {
    /// The job.
    pub job_id: String,
}

/// `job_list`: a validated filter as the stores read it.
#[derive(Clone, Debug, Default)]
pub struct JobListing {
    /// The stored state (`waiting` stands for both scheduled and ready).
    pub stored_state: Option<&'static str>,
    /// With `waiting`: only jobs whose `run_at` is due (`Some(true)`) or not
    /// yet due (`Some(false)`) by the clock of record.
    pub due: Option<bool>,
    /// Queue.
    pub queue: Option<String>,
    /// Job type.
    pub job_type: Option<String>,
    /// Tag.
    pub tag: Option<String>,
    /// Page size, 1–1000.
    pub limit: u32,
    /// Only jobs accepted before this sequence number (the last of the
    /// previous page).
    pub before_seq: Option<i64>,
    /// The most bytes of the page's JSON (as `JobPage` serializes,
    /// compact): the page ends before the first job that would take it
    /// past them, except that it always holds one job; its cursor is then
    /// the last job's sequence number. `None`: only `limit` bounds it.
    pub max_bytes: Option<usize>,
}

impl JobListing {
    /// The stores' reading of a public filter whose bounds
    /// [`Queue::list`](crate::Queue::list) checked. `scheduled` and `ready`
    /// are one stored state, split by whether `run_at` is due.
    pub fn new(filter: JobList, before_seq: Option<i64>) -> Self {
        let (stored_state, due) = match filter.state {
            None => (None, None),
            Some(JobState::Scheduled) => (Some("waiting"), Some(false)),
            Some(JobState::Ready) => (Some("waiting"), Some(true)),
            Some(s) => (Some(s.as_str()), None),
        };
        Self {
            stored_state,
            due,
            queue: filter.queue,
            job_type: filter.job_type,
            tag: filter.tag,
            limit: filter.limit.clamp(1, 1000),
            before_seq,
            max_bytes: None,
        }
    }
}

/// `job_cancel_by_key`.
#[derive(Clone, Debug)]
pub struct JobCancelByKey {
    /// The job type the dedupe key is scoped to.
    pub job_type: String,
    /// The dedupe key.
    pub key: String,
}

/// `job_redrive`.
#[derive(Clone, Debug)]
pub struct JobRedrive {
    /// The dead job.
    pub job_id: String,
    /// The redrive's idempotency key (scope `idemq.redrive`).
    pub key: Option<PreparedKey>,
    /// Fingerprint of the job id and overrides.
    pub fingerprint: Fingerprint,
    /// New attempt budget.
    pub max_attempts: Option<i32>,
    /// New deadline (µs).
    pub deadline: Option<i64>,
    /// When to run (µs); now when omitted.
    pub run_at: Option<i64>,
    /// Drop stored checkpoints.
    pub reset_checkpoints: bool,
}

/// `queue_pause`.
#[derive(Clone, Debug)]
pub struct QueuePause {
    /// The queue.
    pub queue: String,
    /// Pause (true) or resume (false).
    pub paused: bool,
}

/// `job_claim`.
#[derive(Clone, Debug)]
pub struct JobClaim {
    /// Queues to claim from; empty for every queue.
    pub queues: Vec<String>,
    /// Job types to claim; `None` for any.
    pub types: Option<Vec<String>>,
    /// The worker's name, kept in the run ledger.
    pub worker: String,
    /// At most this many jobs.
    pub limit: u32,
    /// Lease length in milliseconds.
    pub lease_ms: i64,
}

impl JobClaim {
    /// A claim of nothing: what a backend that completes through
    /// `job_complete_and_claim` passes to complete alone.
    pub fn nothing() -> Self {
        Self {
            queues: Vec::new(),
            types: None,
            worker: String::new(),
            limit: 0,
            lease_ms: 0,
        }
    }
}

/// A lease presented by a worker.
#[derive(Clone, Debug)]
pub struct LeaseRef {
    /// The job.
    pub job_id: String,
    /// The token minted by the claim.
    pub lease_token: String,
}

/// `job_complete`.
#[derive(Clone, Debug)]
pub struct JobComplete {
    /// The lease.
    pub lease: LeaseRef,
    /// The serialized result, if any.
    pub result: Option<String>,
}

/// `job_complete_many`: several completions in one transaction.
#[derive(Clone, Debug)]
pub struct JobCompleteMany {
    /// The completions; each is fenced by its own lease.
    pub items: Vec<JobComplete>,
}

/// `lease_heartbeat_many`: several leases renewed in one call.
#[derive(Clone, Debug)]
pub struct LeaseHeartbeatMany {
    /// The leases; each is renewed (or refused) on its own.
    pub items: Vec<LeaseRef>,
}

/// `job_fail`.
#[derive(Clone, Debug)]
pub struct JobFail {
    /// The lease.
    pub lease: LeaseRef,
    /// The error, truncated to 8 KiB.
    pub error: String,
    /// False: the failure is permanent (the job goes dead).
    pub retryable: bool,
    /// Overrides the backoff for this retry (ignored under retry policy `none`).
    pub retry_after_ms: Option<i64>,
    /// Reschedules without consuming the attempt.
    pub snooze_ms: Option<i64>,
}

/// `checkpoint_put`.
#[derive(Clone, Debug)]
pub struct CheckpointPut {
    /// The lease.
    pub lease: LeaseRef,
    /// The step name.
    pub name: String,
    /// The serialized value.
    pub value: String,
}

/// `checkpoint_get`.
#[derive(Clone, Debug)]
pub struct CheckpointGet {
    /// The job.
    pub job_id: String,
    /// The step name.
    pub name: String,
}

/// An idempotency binding, by hashed key.
#[derive(Clone, Debug)]
pub struct BindingRef {
    /// The scope.
    pub scope: String,
    /// The key hash.
    pub hash: [u8; 32],
}

/// A dedupe binding, by job type and key.
#[derive(Clone, Debug)]
pub struct DedupeRef {
    /// The job type.
    pub job_type: String,
    /// The dedupe key.
    pub key: String,
}

/// A bounded maintenance pass.
#[derive(Clone, Copy, Debug)]
pub struct Sweep {
    /// At most this many rows.
    pub limit: u32,
}

/// A worker's source of wake-ups: new claimable work was committed. It may
/// miss some (notifications can be lost), so workers also poll.
pub struct Wakeups(WakeSource);

enum WakeSource {
    /// An in-process signal (an embedded store).
    Local(std::sync::Arc<tokio::sync::Notify>),
    /// A backend's own channel (`LISTEN` on PostgreSQL).
    Channel(Box<dyn WakeChannel>),
}

/// A backend's channel of wake-ups, behind [`Wakeups`].
#[async_trait]
pub trait WakeChannel: Send {
    /// Waits for the next wake-up. An error means the channel is down for
    /// now (a backend reconnects it by itself, or the caller only polls).
    async fn recv(&mut self) -> Result<()>;
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            WakeSource::Local(_) => "Wakeups(local)",
            WakeSource::Channel(_) => "Wakeups(channel)",
        })
    }
}

impl Wakeups {
    /// Wake-ups from a signal raised in this process.
    pub fn local(notify: std::sync::Arc<tokio::sync::Notify>) -> Self {
        Self(WakeSource::Local(notify))
    }

    /// Wake-ups from a backend's channel.
    pub fn channel(channel: impl WakeChannel + 'static) -> Self {
        Self(WakeSource::Channel(Box::new(channel)))
    }

    /// Waits until work may be there or `timeout` passes. Returns true when
    /// woken. While a channel is down this waits (at most half a second at
    /// a time) and returns false, so a caller polls meanwhile.
    pub async fn wait(&mut self, timeout: std::time::Duration) -> bool {
        match &mut self.0 {
            WakeSource::Local(n) => tokio::time::timeout(timeout, n.notified()).await.is_ok(),
            WakeSource::Channel(c) => match tokio::time::timeout(timeout, c.recv()).await {
                Ok(Ok(())) => true,
                Ok(Err(_)) => {
                    tokio::time::sleep(timeout.min(std::time::Duration::from_millis(500))).await;
                    false
                }
                Err(_) => false,
            },
        }
    }
}

/// What a backend can do beyond the operations every backend has. A backend
/// without one refuses the calls that need it with a clear error, and the
/// conformance suite names the capability a case needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// Enqueue and complete inside a caller's own database transaction
    /// (`Queue::enqueue_in`, `Queue::enqueue_in_sqlite`, …), so the job
    /// commits or rolls back with the caller's rows.
    CallerTransactions,
}

impl Capability {
    /// Every capability, for listing what a backend has.
    pub const ALL: &[Capability] = &[Capability::CallerTransactions];

    /// Its name in docs and test output.
    pub fn name(self) -> &'static str {
        match self {
            Self::CallerTransactions => "caller_transactions",
        }
    }
}

/// What a call recorded beside what it was asked to do, for the queue's
/// counters (`/metrics`): the expired leases it reaped (the reaper, and a
/// claim, which reaps before it claims), and the attempts and jobs it ended
/// because their time was up (a heartbeat past an attempt's timeout or
/// deadline, a claim meeting jobs past their deadline), each counted by
/// where its job went: back to run again (`retries`) or to the dead
/// letters (`dead`). A job whose cancel was requested meanwhile is neither.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recorded {
    /// Expired leases recorded.
    pub lease_expiries: u64,
    /// Jobs sent back to run again.
    pub retries: u64,
    /// Jobs sent to the dead letters.
    pub dead: u64,
}

impl Recorded {
    /// An attempt or job the call ended, leaving its job in `state`.
    pub fn ended(&mut self, state: JobState) {
        match state {
            JobState::Ready | JobState::Scheduled => self.retries += 1,
            JobState::Dead => self.dead += 1,
            _ => {}
        }
    }

    /// An expired lease the call recorded, leaving its job in `state`.
    pub fn expired(&mut self, state: JobState) {
        self.lease_expiries += 1;
        self.ended(state);
    }

    /// Both together.
    pub fn add(&mut self, other: Recorded) {
        self.lease_expiries += other.lease_expiries;
        self.retries += other.retries;
        self.dead += other.dead;
    }
}

/// A store's answer with what the call recorded beside it.
#[derive(Debug)]
pub struct Recording<T> {
    /// The answer to what the call was asked.
    pub answer: T,
    /// What it recorded beside.
    pub recorded: Recorded,
}

impl<T> Recording<T> {
    /// An answer and what was recorded beside it.
    pub fn new(answer: T, recorded: Recorded) -> Self {
        Self { answer, recorded }
    }

    /// An answer with nothing recorded beside it.
    pub fn only(answer: T) -> Self {
        Self::new(answer, Recorded::default())
    }
}

/// The storage seam. See the module documentation.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug {
    /// `sqlite`, `postgres`, …
    fn backend(&self) -> &'static str;

    /// How many claim calls a worker keeps in flight while a backlog
    /// lasts. More than one only where the backend runs calls side by side:
    /// SQLite has one writer, so a second call would only wait for it.
    fn claims_in_flight(&self) -> usize {
        1
    }

    /// Whether this backend has a capability beyond the common operations.
    fn supports(&self, capability: Capability) -> bool;

    /// Whether the store runs with the settings under which nothing
    /// acknowledged is lost. Full unless the backend was opened with its
    /// durability check skipped (Redis `?durability=relaxed`).
    fn durability(&self) -> Durability {
        Durability::Full
    }

    /// Checks again that the server still has the settings
    /// [`durability`](Self::durability) rests on; the maintenance pass calls
    /// it. On a backend whose settings can change under a running store
    /// (Redis: `CONFIG SET`, a restart with another configuration), a
    /// strict store whose server lost them refuses every write
    /// (`Unavailable`, naming the setting and how to set it back) and
    /// reports relaxed durability until a check finds them again; the `Err`
    /// says why. The default has nothing to check.
    async fn durability_check(&self) -> Result<()> {
        Ok(())
    }

    /// The store as its own type, for a backend's extras that run on a
    /// caller's connection (`Queue::enqueue_in_sqlite`, …).
    fn as_any(&self) -> &dyn std::any::Any;

    /// A source of wake-ups for a worker.
    async fn wakeups(&self) -> Result<Wakeups>;
    /// The clock of record.
    async fn now(&self) -> Result<DateTime<Utc>>;
    /// Enqueue: one result per item, in order.
    async fn job_enqueue(&self, p: JobEnqueue) -> Result<Vec<Result<EnqueueResult>>>;
    /// Dry run of an enqueue; writes nothing.
    async fn job_explain(&self, p: JobExplain) -> Result<Explain>;
    /// One job.
    async fn job_get(&self, p: JobRef) -> Result<Option<Job>>;
    /// A page of jobs.
    async fn job_list(&self, p: JobListing) -> Result<JobPage>;
    /// A job's events, oldest first.
    async fn job_events(&self, p: JobRef) -> Result<Vec<Event>>;
    /// A job's run ledger.
    async fn job_runs(&self, p: JobRef) -> Result<Vec<Run>>;
    /// A job's checkpoints.
    async fn checkpoint_list(&self, p: JobRef) -> Result<BTreeMap<String, Value>>;
    /// Cancel one job.
    async fn job_cancel(&self, p: JobRef) -> Result<CancelOutcome>;
    /// Cancel every pending job of a type with a dedupe key, releasing the binding.
    async fn job_cancel_by_key(&self, p: JobCancelByKey) -> Result<bool>;
    /// Delete a job that is not active.
    async fn job_purge(&self, p: JobRef) -> Result<bool>;
    /// Make a scheduled job due now.
    async fn job_promote(&self, p: JobRef) -> Result<bool>;
    /// Put a dead job back to ready.
    async fn job_redrive(&self, p: JobRedrive) -> Result<EnqueueResult>;
    /// Pause or resume a queue.
    async fn queue_pause(&self, p: QueuePause) -> Result<bool>;
    /// Queues with counts by state.
    async fn queue_list(&self) -> Result<Vec<QueueInfo>>;
    /// Claim due jobs under a lease (reaping expired leases first).
    async fn job_claim(&self, p: JobClaim) -> Result<Recording<Vec<ClaimedJob>>>;
    /// Renew a lease: the renewal, or `LeaseLost` (which a heartbeat past
    /// the attempt's timeout or deadline answers once it recorded the
    /// attempt's end). An `Err` of the call renewed and recorded nothing.
    async fn lease_heartbeat(&self, p: LeaseRef) -> Result<Recording<Result<Heartbeat>>>;
    /// Renew many leases: one result per item, in order, each what
    /// [`lease_heartbeat`](Self::lease_heartbeat) would answer for it (a
    /// lost lease is that item's `LeaseLost`; the others stand). An `Err` of
    /// the whole call renewed nothing it can vouch for: the caller tries
    /// again at its next beat. The default renews them side by side, one
    /// call each.
    async fn lease_heartbeat_many(
        &self,
        p: LeaseHeartbeatMany,
    ) -> Result<Recording<Vec<Result<Heartbeat>>>> {
        let beats =
            futures_util::future::join_all(p.items.into_iter().map(|l| self.lease_heartbeat(l)))
                .await;
        let mut recorded = Recorded::default();
        let answer = beats
            .into_iter()
            .map(|b| {
                b.and_then(|r| {
                    recorded.add(r.recorded);
                    r.answer
                })
            })
            .collect();
        Ok(Recording::new(answer, recorded))
    }
    /// Finish an attempt successfully.
    async fn job_complete(&self, p: JobComplete) -> Result<()>;
    /// Finish many attempts successfully in one transaction (one round
    /// trip): one result per item, in order; an item whose lease is lost is
    /// that item's `LeaseLost` and changes nothing, the others stand. An
    /// `Err` of the whole call recorded nothing. The default completes the
    /// items one by one.
    async fn job_complete_many(&self, p: JobCompleteMany) -> Result<Vec<Result<()>>> {
        let mut out = Vec::with_capacity(p.items.len());
        for item in p.items {
            out.push(self.job_complete(item).await);
        }
        Ok(out)
    }
    /// [`job_complete_many`](Self::job_complete_many), then
    /// [`job_claim`](Self::job_claim) (nothing for a limit of 0), in one
    /// transaction where the backend can (PostgreSQL: one round trip, one
    /// commit). An `Err` of the whole call recorded nothing; the claim's own
    /// result is separate because the default records the completions
    /// first, on their own.
    async fn job_complete_and_claim(
        &self,
        done: JobCompleteMany,
        claim: JobClaim,
    ) -> Result<(Vec<Result<()>>, Result<Recording<Vec<ClaimedJob>>>)> {
        let completed = if done.items.is_empty() {
            Vec::new()
        } else {
            self.job_complete_many(done).await?
        };
        let claimed = if claim.limit == 0 {
            Ok(Recording::only(Vec::new()))
        } else {
            self.job_claim(claim).await
        };
        Ok((completed, claimed))
    }
    /// Finish an attempt with an error (or a snooze).
    async fn job_fail(&self, p: JobFail) -> Result<FailOutcome>;
    /// Give a lease back without consuming the attempt; the state it left
    /// the job in (`Ready`, or `Cancelled` when a cancel was requested).
    async fn job_release(&self, p: LeaseRef) -> Result<crate::job::JobState>;
    /// Store a step result; the first stored value wins.
    async fn checkpoint_put(&self, p: CheckpointPut) -> Result<bool>;
    /// A stored step result.
    async fn checkpoint_get(&self, p: CheckpointGet) -> Result<Option<Value>>;
    /// The job a live idempotency binding points at.
    async fn binding_lookup(&self, p: BindingRef) -> Result<Option<BindingInfo>>;
    /// Release a live idempotency binding (an operator action).
    async fn binding_release(&self, p: BindingRef) -> Result<bool>;
    /// The live dedupe binding of a key.
    async fn dedupe_lookup(&self, p: DedupeRef) -> Result<Option<ExplainDedupe>>;
    /// Remove expired and dead bindings.
    async fn binding_sweep(&self, p: Sweep) -> Result<u64>;
    /// Record expired leases (at most `limit`): how many, and where they
    /// sent their jobs.
    async fn lease_reap(&self, p: Sweep) -> Result<Recorded>;
    /// Delete terminal jobs past their retention that no live binding points at.
    async fn job_retention_sweep(&self, p: Sweep) -> Result<u64>;
    /// Create or replace a schedule's definition; true when it was created.
    async fn schedule_put(&self, p: SchedulePut) -> Result<bool>;
    /// Delete a schedule; false when there was none.
    async fn schedule_delete(&self, p: ScheduleRef) -> Result<bool>;
    /// Every schedule, by name; a row that cannot be read is listed among
    /// the unreadable ones, with why, and fails nothing else.
    async fn schedule_list(&self) -> Result<ScheduleList>;
    /// Schedules that are not paused and whose next fire is due, earliest first.
    async fn schedule_due(&self, p: ScheduleDue) -> Result<DueSchedules>;
    /// Record a fired tick and the next fire; false when the schedule is
    /// gone, paused, retimed, or already past that tick.
    async fn schedule_mark_fired(&self, p: ScheduleMarkFired) -> Result<bool>;
    /// Record `p.value` as the installation's key check when none is
    /// recorded yet, and return the recorded one (the first writer wins).
    async fn installation_key_check(&self, p: KeyCheck) -> Result<String>;
    /// Replace the installation's key check (an operator's deliberate act)
    /// and say what it costs.
    async fn installation_key_check_replace(&self, p: KeyCheck) -> Result<KeyCheckChange>;
}

/// The check value of a key hashing ([`crate::fingerprint::KeyHasher::check_value`]).
#[derive(Clone, Debug)]
pub struct KeyCheck {
    /// `sha256` or `hmac-sha256:<16 hex>`.
    pub value: String,
}

/// `schedule_put`: a validated definition.
#[derive(Clone, Debug)]
pub struct SchedulePut {
    /// The schedule's name.
    pub name: String,
    /// The cron expression (exactly one of `cron` and `every_ms`).
    pub cron: Option<String>,
    /// The interval in milliseconds.
    pub every_ms: Option<i64>,
    /// The IANA time zone of the cron expression (`UTC` for intervals).
    pub timezone: String,
    /// The job template: an `EnqueueRequest` as JSON.
    pub job: String,
    /// A paused schedule has no next fire.
    pub paused: bool,
    /// The clock of record when the caller computed `cron_next` (µs); the
    /// creation instant of a new schedule, the anchor of an interval.
    pub at: i64,
    /// For a cron schedule: its first fire after `at` (µs). An interval's
    /// next fire is computed by the store from the stored anchor.
    pub cron_next: Option<i64>,
}

/// A schedule, by name.
#[derive(Clone, Debug)]
pub struct ScheduleRef {
    /// The schedule's name.
    pub name: String,
}

/// `schedule_due`.
#[derive(Clone, Copy, Debug)]
pub struct ScheduleDue {
    /// At most this many schedules.
    pub limit: u32,
}

/// What `schedule_due` found.
#[derive(Debug)]
pub struct DueSchedules {
    /// The clock of record the schedules were found due at.
    pub now: DateTime<Utc>,
    /// The due schedules, earliest next fire first.
    pub schedules: Vec<Schedule>,
    /// Why each due schedule whose row could not be read (a template this
    /// binary cannot decode, say one a newer idemq wrote) was left out: the
    /// others fire all the same, and the row is left as it is for a process
    /// that can read it.
    pub unreadable: Vec<crate::Error>,
}

/// `schedule_mark_fired`: moves `last_fired_at` forward (never back) and
/// sets the next fire, if the schedule still has the timing the caller
/// computed them with and is not paused.
#[derive(Clone, Debug)]
pub struct ScheduleMarkFired {
    /// The schedule's name.
    pub name: String,
    /// The cron expression the caller computed with.
    pub cron: Option<String>,
    /// The interval the caller computed with.
    pub every_ms: Option<i64>,
    /// The time zone the caller computed with.
    pub timezone: String,
    /// The tick fired (µs); `None` when nothing was due to fire.
    pub fired_at: Option<i64>,
    /// The next fire (µs); `None` when the expression matches no later instant.
    pub next_fire_at: Option<i64>,
    /// Why a tick was passed without enqueueing its job (recorded as the
    /// schedule's `last_error`, at the clock of record); `None` clears the
    /// recorded error when a tick fired.
    pub error: Option<String>,
}
