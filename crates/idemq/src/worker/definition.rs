//! Typed job definitions: a payload type that names its job type, its
//! queue, its default options and the keys derived from its payload, used
//! alike by producers ([`Queue::enqueue`](crate::Queue::enqueue)) and by
//! the worker ([`Worker::job`](super::Worker::job)).

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};
use crate::request::{DedupeOptions, EnqueueRequest, IdempotencyOptions, RetryPolicy};

/// A job type with a typed payload.
///
/// Only [`TYPE`](Self::TYPE) is required. Everything else has a default, so
/// a definition states only what differs: the queue its jobs go to, options
/// every job of the type gets, and an idempotency or dedupe key derived from
/// the payload. These are applied by the client before a request is sent;
/// the store knows nothing of definitions. An enqueue overrides any of them
/// with the [`EnqueueRequest`] setters (see [`EnqueueRequest::from_job`]).
///
/// ```
/// use std::time::Duration;
/// use idemq::worker::{Job, JobOptions};
/// use idemq::{DedupeOptions, IdempotencyOptions};
/// use serde::{Deserialize, Serialize};
///
/// #[derive(Serialize, Deserialize)]
/// struct SendReceipt { order: String, to: String }
///
/// impl Job for SendReceipt {
///     const TYPE: &'static str = "receipt.send";
///     const QUEUE: Option<&'static str> = Some("mail");
///     fn options(&self) -> JobOptions {
///         JobOptions::default().max_attempts(5).timeout(Duration::from_secs(30))
///     }
///     // One receipt per order, however often the order is confirmed.
///     fn idempotency(&self) -> Option<IdempotencyOptions> {
///         Some(IdempotencyOptions::new(format!("receipt:{}", self.order)))
///     }
/// }
/// ```
pub trait Job: Serialize + DeserializeOwned + Send + 'static {
    /// The job type, e.g. `email.send`.
    const TYPE: &'static str;

    /// The queue of this type's jobs when an enqueue names none (`None`:
    /// the `default` queue). The worker does not restrict its claims to it
    /// (docs/worker.md): use [`Worker::queues`](super::Worker::queues) for that.
    const QUEUE: Option<&'static str> = None;

    /// Options every job of this type gets unless an enqueue overrides them
    /// (none by default: the queue's defaults apply).
    fn options(&self) -> JobOptions {
        JobOptions::default()
    }

    /// An idempotency key derived from the payload (none by default).
    fn idempotency(&self) -> Option<IdempotencyOptions> {
        None
    }

    /// A dedupe key (and mode) derived from the payload (none by default).
    fn dedupe(&self) -> Option<DedupeOptions> {
        None
    }
}

/// The options a [`Job`] definition gives its jobs. Each one left unset
/// keeps the request's default; bounds are checked when the request is
/// enqueued, like any request's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobOptions {
    priority: Option<i16>,
    max_attempts: Option<u32>,
    retry: Option<RetryPolicy>,
    timeout: Option<Duration>,
    keep: Option<Duration>,
    concurrency_key: Option<String>,
    tags: Vec<String>,
}

impl JobOptions {
    /// Sets the priority.
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = Some(priority);
        self
    }
    /// Sets the attempt budget.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n);
        self
    }
    /// Sets the backoff policy.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }
    /// Sets the execution timeout of one attempt.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// Sets the retention after the job turns terminal.
    pub fn keep(mut self, keep: Duration) -> Self {
        self.keep = Some(keep);
        self
    }
    /// Sets the concurrency key (at most one active job per key).
    pub fn concurrency_key(mut self, key: impl Into<String>) -> Self {
        self.concurrency_key = Some(key.into());
        self
    }
    /// Adds a tag.
    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tags.push(tag.into());
        self
    }

    fn apply(self, mut req: EnqueueRequest) -> EnqueueRequest {
        if let Some(p) = self.priority {
            req = req.priority(p);
        }
        if let Some(n) = self.max_attempts {
            req = req.max_attempts(n);
        }
        if let Some(r) = self.retry {
            req = req.retry(r);
        }
        if let Some(t) = self.timeout {
            req = req.timeout(t);
        }
        if let Some(k) = self.keep {
            req = req.keep(k);
        }
        if let Some(k) = self.concurrency_key {
            req = req.concurrency_key(k);
        }
        for t in self.tags {
            req = req.tag(t);
        }
        req
    }
}

impl EnqueueRequest {
    /// The request a typed job makes: its type, its payload, and what its
    /// definition sets (queue, options, idempotency and dedupe keys). Chain
    /// the setters to override any of it for this enqueue.
    ///
    /// A payload that does not serialize to JSON (a map with non-string
    /// keys, a failing `Serialize` impl) is a validation error on `payload`.
    pub fn from_job<J: Job>(job: &J) -> Result<Self> {
        let payload = serde_json::to_value(job).map_err(|e| {
            Error::validation(
                "payload",
                format!("the {} job does not serialize: {e}", J::TYPE),
            )
        })?;
        let mut req = EnqueueRequest::new(J::TYPE).payload(payload);
        if let Some(queue) = J::QUEUE {
            req = req.queue(queue);
        }
        req = job.options().apply(req);
        req.idempotency = job.idempotency();
        req.dedupe = job.dedupe();
        Ok(req)
    }
}

/// What [`Queue::enqueue`](crate::Queue::enqueue) and its siblings take: an
/// [`EnqueueRequest`], or a typed [`Job`] (turned into its request by
/// [`EnqueueRequest::from_job`]).
pub trait IntoEnqueueRequest {
    /// The request.
    fn into_request(self) -> Result<EnqueueRequest>;
}

impl IntoEnqueueRequest for EnqueueRequest {
    fn into_request(self) -> Result<EnqueueRequest> {
        Ok(self)
    }
}

impl<J: Job> IntoEnqueueRequest for J {
    fn into_request(self) -> Result<EnqueueRequest> {
        EnqueueRequest::from_job(&self)
    }
}
