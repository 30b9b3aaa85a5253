//! What a handler sees of its job, and how it says how the attempt ended.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::Notify;

use crate::error::Error;
use crate::job::ClaimedJob;
use crate::queue::Queue;

/// How a handler's attempt failed. Any `std::error::Error` converts into a
/// retryable `JobError` with `?`; [`JobError::permanent`] sends the job to the
/// dead letters at once; [`JobError::snooze`] reschedules it without
/// consuming the attempt.
#[derive(Debug)]
pub struct JobError {
    pub(crate) message: String,
    pub(crate) kind: ErrorKind,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum ErrorKind {
    Retryable { retry_after: Option<Duration> },
    Permanent,
    Snooze(Duration),
}

impl JobError {
    /// A retryable failure: the next attempt follows the job's retry policy.
    pub fn retryable(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            kind: ErrorKind::Retryable { retry_after: None },
        }
    }

    /// A retryable failure whose next attempt comes after `delay` (unless
    /// the job's retry policy is `none`).
    pub fn retry_after(message: impl std::fmt::Display, delay: Duration) -> Self {
        Self {
            message: message.to_string(),
            kind: ErrorKind::Retryable {
                retry_after: Some(delay),
            },
        }
    }

    /// A permanent failure: no retry, the job goes dead.
    pub fn permanent(message: impl std::fmt::Display) -> Self {
        Self {
            message: message.to_string(),
            kind: ErrorKind::Permanent,
        }
    }

    /// Not a failure: run again after `delay`; the attempt is not consumed.
    pub fn snooze(delay: Duration) -> Self {
        Self {
            message: "snoozed".into(),
            kind: ErrorKind::Snooze(delay),
        }
    }

    /// The message recorded in the run ledger.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl<E: std::error::Error> From<E> for JobError {
    fn from(e: E) -> Self {
        Self::retryable(e)
    }
}

/// Why a supervisor must stop its handler early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    Running = 0,
    /// The lease was lost (expired and recorded, or the job reclaimed): the
    /// attempt is not ours to finish.
    LeaseLost = 1,
    /// The grace period ended: release the lease.
    Shutdown = 2,
}

/// What one attempt is told while it runs, shared by its slot in the
/// worker, its supervisor and its handler's context: one allocation per
/// attempt, where channels would take one each.
#[derive(Default)]
pub(crate) struct Signals {
    /// Cancellation was requested (seen at a heartbeat).
    cancelled: AtomicBool,
    /// A [`Stop`] other than `Running` once the handler must stop.
    stop: AtomicU8,
    /// Set once the handler completed the job in its own transaction.
    completed_in_tx: AtomicBool,
    /// Woken when `cancelled` or `stop` is set.
    changed: Notify,
    /// When the last call that renewed the lease (the claim, then each
    /// heartbeat answered) was sent, on this worker's clock: the store
    /// started the lease it holds no earlier.
    renewed: std::sync::Mutex<Option<tokio::time::Instant>>,
}

impl Signals {
    /// Tells the attempt that its job was cancelled.
    pub(crate) fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub(crate) fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::SeqCst)
    }

    /// Tells the attempt's supervisor to stop its handler.
    pub(crate) fn stop(&self, why: Stop) {
        self.stop.store(why as u8, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    pub(crate) fn stopped(&self) -> Stop {
        match self.stop.load(Ordering::SeqCst) {
            0 => Stop::Running,
            1 => Stop::LeaseLost,
            _ => Stop::Shutdown,
        }
    }

    /// Records that the handler completed the job in its own transaction.
    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn set_completed_in_tx(&self) {
        self.completed_in_tx.store(true, Ordering::SeqCst);
    }

    pub(crate) fn completed_in_tx(&self) -> bool {
        self.completed_in_tx.load(Ordering::SeqCst)
    }

    /// Records that a call sent at `sent` renewed the lease (or took it).
    pub(crate) fn renewed(&self, sent: tokio::time::Instant) {
        let mut at = self.renewed.lock().unwrap_or_else(|p| p.into_inner());
        if at.is_none_or(|at| at < sent) {
            *at = Some(sent);
        }
    }

    /// When the last call that renewed the lease was sent, if known.
    pub(crate) fn renewed_at(&self) -> Option<tokio::time::Instant> {
        *self.renewed.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves with what `check` finds, asked again at every change (a
    /// change between two asks is not missed: the waiter is registered
    /// before each ask).
    pub(crate) async fn until<T>(&self, check: impl Fn(&Self) -> Option<T>) -> T {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if let Some(found) = check(self) {
                return found;
            }
            changed.await;
        }
    }
}

/// The job a handler runs, and what it can do while it runs.
#[derive(Clone)]
pub struct HandlerContext {
    pub(crate) job: Arc<ClaimedJob>,
    pub(crate) queue: Queue,
    /// Cancellation, and whether the handler completed its job in its own
    /// transaction: the runtime then finds out whether that transaction
    /// committed instead of recording a completion of its own.
    pub(crate) signals: Arc<Signals>,
}

impl std::fmt::Debug for HandlerContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlerContext")
            .field("job_id", &self.job.id)
            .field("attempt", &self.job.attempt)
            .finish()
    }
}

impl HandlerContext {
    /// The job id.
    pub fn job_id(&self) -> &str {
        &self.job.id
    }
    /// The job type.
    pub fn job_type(&self) -> &str {
        &self.job.job_type
    }
    /// The queue.
    pub fn queue_name(&self) -> &str {
        &self.job.queue
    }
    /// This attempt's number: 1 on the first claim.
    pub fn attempt(&self) -> i32 {
        self.job.attempt
    }
    /// The attempt budget.
    pub fn max_attempts(&self) -> i32 {
        self.job.max_attempts
    }
    /// The deadline, if any.
    pub fn deadline(&self) -> Option<DateTime<Utc>> {
        self.job.deadline
    }
    /// The job's tags.
    pub fn tags(&self) -> &[String] {
        &self.job.tags
    }
    /// The raw payload.
    pub fn payload(&self) -> &Value {
        &self.job.payload
    }

    /// True once the job was cancelled while it ran (seen at a heartbeat).
    pub fn is_cancelled(&self) -> bool {
        self.signals.is_cancelled()
    }

    /// Resolves when the job is cancelled. The runtime stops the handler
    /// once the cancel grace ([`Worker::cancel_grace`](super::Worker::cancel_grace),
    /// 1 s by default) has passed; meanwhile the handler can clean up, and
    /// returning `Ok` then completes the job (the effect happened).
    pub async fn cancelled(&self) {
        self.signals.until(|s| s.is_cancelled().then_some(())).await;
    }

    /// Renews the lease now (the runtime heartbeats every lease/3 anyway),
    /// and passes on what the store answers as the runtime's heartbeat
    /// does: a cancel request is seen at once ([`is_cancelled`](Self::is_cancelled),
    /// [`cancelled`](Self::cancelled)), and a lost lease (an `Err`) stops
    /// the attempt, whose result is then dropped.
    pub async fn heartbeat(&self) -> Result<(), JobError> {
        match self
            .queue
            .heartbeat(&self.job.id, &self.job.lease_token)
            .await
        {
            Ok(hb) => {
                if hb.cancel_requested {
                    self.signals.cancel();
                }
                Ok(())
            }
            Err(e) => {
                if matches!(e, Error::LeaseLost { .. }) {
                    self.signals.stop(Stop::LeaseLost);
                }
                Err(JobError::retryable(e))
            }
        }
    }

    #[cfg(feature = "postgres")]
    /// Completes this job inside the handler's own PostgreSQL transaction,
    /// with `result` as the job's result: the business writes and the
    /// completion commit or roll back together, fenced by this attempt's
    /// lease. A lost lease fails with [`Error::LeaseLost`] and writes
    /// nothing: return the error (with `?`) so the transaction is dropped
    /// and rolls back. Call it last, just before the commit (the job's row
    /// stays locked until the transaction ends), then return `Ok`.
    ///
    /// When the handler returns, the runtime records nothing more if the
    /// transaction committed (the attempt counts as completed, the value the
    /// handler returns is not stored); if it rolled back, the attempt fails
    /// (a retryable failure) and the job runs again. See docs/worker.md.
    pub async fn complete_in<T: Serialize + ?Sized>(
        &self,
        conn: &mut sqlx::PgConnection,
        result: &T,
    ) -> Result<(), Error> {
        let value = self.result_value(result)?;
        self.queue
            .complete_in(conn, &self.job.id, &self.job.lease_token, value)
            .await?;
        self.signals.set_completed_in_tx();
        Ok(())
    }

    #[cfg(feature = "sqlite")]
    /// [`complete_in`](Self::complete_in) on the handler's own `rusqlite`
    /// connection to the queue's SQLite database file, inside its open
    /// transaction ([`Queue::sqlite_connection`] opens such a connection).
    ///
    /// ```
    /// use std::time::Duration;
    /// use idemq::rusqlite::TransactionBehavior;
    /// use idemq::worker::{HandlerContext, JobError, Worker};
    /// use idemq::{EnqueueRequest, JobState, Queue};
    /// use serde_json::json;
    ///
    /// # #[tokio::main]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # let dir = tempfile::tempdir()?;
    /// # let url = format!("sqlite://{}", dir.path().join("app.db").display());
    /// let queue = Queue::connect(&url).await?;
    /// queue.sqlite_connection()?.execute_batch("CREATE TABLE placed (id TEXT PRIMARY KEY)")?;
    /// let id = queue
    ///     .enqueue(EnqueueRequest::new("order.place").payload(json!("o-1")))
    ///     .await?;
    ///
    /// let app = queue.clone();
    /// let worker = Worker::new(queue.clone()).handle(
    ///     "order.place",
    ///     move |ctx: HandlerContext, order: String| {
    ///         let app = app.clone();
    ///         async move {
    ///             let mut conn = app.sqlite_connection()?;
    ///             let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    ///             tx.execute("INSERT INTO placed (id) VALUES (?1)", [&order])?;
    ///             // Last, just before the commit: the row and the completion land together.
    ///             ctx.complete_in_sqlite(&tx, &json!({ "placed": order }))?;
    ///             tx.commit()?;
    ///             Ok::<_, JobError>(())
    ///         }
    ///     },
    /// );
    /// let (watched, job_id) = (queue.clone(), id.clone());
    /// let report = worker
    ///     .run(async move {
    ///         let _ = watched.wait(&job_id, Duration::from_secs(10)).await;
    ///     })
    ///     .await?;
    /// assert_eq!((report.completed, report.lost), (1, 0));
    /// let placed: i64 = queue
    ///     .sqlite_connection()?
    ///     .query_row("SELECT count(*) FROM placed", [], |r| r.get(0))?;
    /// assert_eq!(placed, 1);
    /// # let job = queue.get(&id).await?.ok_or("the job")?;
    /// # assert_eq!((job.state, job.result), (JobState::Completed, Some(json!({ "placed": "o-1" }))));
    /// # Ok(())
    /// # }
    /// ```
    pub fn complete_in_sqlite<T: Serialize + ?Sized>(
        &self,
        conn: &rusqlite::Connection,
        result: &T,
    ) -> Result<(), Error> {
        let value = self.result_value(result)?;
        self.queue
            .complete_in_sqlite(conn, &self.job.id, &self.job.lease_token, value)?;
        self.signals.set_completed_in_tx();
        Ok(())
    }

    #[cfg_attr(not(any(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    fn result_value<T: Serialize + ?Sized>(&self, result: &T) -> Result<Option<Value>, Error> {
        let value = serde_json::to_value(result)
            .map_err(|e| Error::validation("result", format!("does not serialize: {e}")))?;
        Ok((!value.is_null()).then_some(value))
    }

    /// Whether the handler completed its job in a transaction of its own.
    pub(crate) fn completed_in_tx(&self) -> bool {
        self.signals.completed_in_tx()
    }

    /// A durable step: on the first attempt that reaches it, runs `step` and
    /// stores its JSON result under `name`; on every later attempt of the
    /// same job, returns the stored result without running `step` again. The
    /// first stored value wins.
    ///
    /// A crash between an external effect inside `step` and the checkpoint
    /// still repeats the effect: pass the job id (or a domain id) to the
    /// external system as its idempotency key.
    pub async fn checkpoint<T, F, Fut>(&self, name: &str, step: F) -> Result<T, JobError>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, JobError>>,
    {
        let decode = |v: Value| {
            serde_json::from_value::<T>(v)
                .map_err(|e| JobError::permanent(format!("checkpoint {name} does not decode: {e}")))
        };
        if let Some(stored) = self
            .queue
            .checkpoint_get(&self.job.id, name)
            .await
            .map_err(JobError::retryable)?
        {
            return decode(stored);
        }
        let value = step().await?;
        let json = serde_json::to_value(&value)
            .map_err(|e| JobError::permanent(format!("checkpoint {name} is not JSON: {e}")))?;
        // A value the store refuses (over the payload limit, a bad name)
        // would be refused at every attempt: the attempt fails for good.
        let stored = self
            .queue
            .checkpoint_put(&self.job.id, &self.job.lease_token, name, &json)
            .await
            .map_err(|e| match e {
                Error::PayloadTooLarge { .. } | Error::Validation { .. } => {
                    JobError::permanent(format!("checkpoint {name} was refused: {e}"))
                }
                e => JobError::retryable(e),
            })?;
        if stored {
            return Ok(value);
        }
        match self
            .queue
            .checkpoint_get(&self.job.id, name)
            .await
            .map_err(JobError::retryable)?
        {
            Some(first) => decode(first),
            None => Ok(value),
        }
    }
}
