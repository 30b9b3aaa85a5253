//! What a handler sees of its job, and how it says how the attempt ended.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::watch;

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

/// The job a handler runs, and what it can do while it runs.
#[derive(Clone)]
pub struct HandlerContext {
    pub(crate) job: Arc<ClaimedJob>,
    pub(crate) queue: Queue,
    pub(crate) cancel: watch::Receiver<bool>,
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
        *self.cancel.borrow()
    }

    /// Resolves when the job is cancelled. The runtime also stops the handler
    /// then; this lets a handler clean up first.
    pub async fn cancelled(&self) {
        let mut rx = self.cancel.clone();
        while !*rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Renews the lease now (the runtime heartbeats every lease/3 anyway).
    pub async fn heartbeat(&self) -> Result<(), JobError> {
        self.queue
            .heartbeat(&self.job.id, &self.job.lease_token)
            .await
            .map(|_| ())
            .map_err(JobError::retryable)
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
