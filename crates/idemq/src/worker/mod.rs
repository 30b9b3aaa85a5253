//! The worker runtime: claims jobs of the types it has handlers for, runs
//! them under a lease, heartbeats, enforces timeouts, deadlines and
//! cancellation, and maps each handler's result onto the state machine.
//!
//! ```no_run
//! use idemq::worker::{HandlerContext, JobError, Worker};
//! use serde::Deserialize;
//!
//! #[derive(Deserialize)]
//! struct Capture { invoice_id: String }
//!
//! # async fn run(queue: idemq::Queue) -> idemq::Result<()> {
//! Worker::new(queue)
//!     .handle("invoice.capture", |ctx: HandlerContext, job: Capture| async move {
//!         let charge = ctx
//!             .checkpoint("charge", || async {
//!                 // Pass the job id to the provider as its idempotency key.
//!                 Ok::<_, JobError>(format!("ch_{}_{}", job.invoice_id, ctx.job_id()))
//!             })
//!             .await?;
//!         Ok(serde_json::json!({ "charge": charge }))
//!     })
//!     .concurrency(16)
//!     .run(async { let _ = tokio::signal::ctrl_c().await; })
//!     .await?;
//! # Ok(()) }
//! ```

mod complete;
mod context;
mod definition;
mod handler;
pub mod maintenance;
mod prefetch;
mod run;

use std::future::Future;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

pub use context::{HandlerContext, JobError};
pub use definition::{IntoEnqueueRequest, Job, JobOptions};
pub use maintenance::Maintenance;

use crate::error::Result;
use crate::queue::Queue;
use handler::Registry;

/// Counts of what a worker did, returned when it stops.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerReport {
    /// Attempts that completed.
    pub completed: u64,
    /// Attempts that failed (retried, dead, snoozed or cancelled).
    pub failed: u64,
    /// Attempts released at shutdown.
    pub released: u64,
    /// Attempts whose lease was lost (their results were not recorded).
    pub lost: u64,
}

/// A worker: handlers by job type and how to run them.
pub struct Worker {
    pub(crate) queue: Queue,
    pub(crate) registry: Registry,
    pub(crate) queues: Vec<String>,
    pub(crate) concurrency: usize,
    /// Most claimed jobs waiting for a slot; `None`: the default.
    pub(crate) prefetch: Option<usize>,
    pub(crate) lease: Duration,
    pub(crate) poll_interval: Duration,
    pub(crate) name: String,
    pub(crate) grace: Duration,
    /// How long a handler runs on once a cancel of its job is seen.
    pub(crate) cancel_grace: Duration,
    pub(crate) maintenance: bool,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.name)
            .field("types", &self.registry.types())
            .field("queues", &self.queues)
            .field("concurrency", &self.concurrency)
            .finish()
    }
}

impl Worker {
    /// A worker on `queue` with no handlers: 10 concurrent jobs, a 30 s
    /// lease, polling every second as the fallback of wake-ups, a 30 s
    /// shutdown grace period, a 1 s cancel grace period, and the
    /// maintenance loop on.
    pub fn new(queue: Queue) -> Self {
        let name = format!(
            "{}-{}-{}",
            std::env::var("HOSTNAME").unwrap_or_else(|_| "worker".into()),
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..6]
        );
        Self {
            queue,
            registry: Registry::default(),
            queues: Vec::new(),
            concurrency: 10,
            prefetch: None,
            lease: Duration::from_secs(30),
            poll_interval: Duration::from_secs(1),
            name,
            grace: Duration::from_secs(30),
            cancel_grace: Duration::from_secs(1),
            maintenance: true,
        }
    }

    /// Registers the handler of `job_type`. The payload is deserialized into
    /// `P` (a payload that does not fit fails the job permanently,
    /// `bad_payload`); the handler's `Ok` value is stored as the job's result.
    pub fn handle<P, R, F, Fut>(mut self, job_type: &str, handler: F) -> Self
    where
        P: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: Fn(HandlerContext, P) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R, JobError>> + Send + 'static,
    {
        self.registry
            .handlers
            .insert(job_type.to_owned(), handler::erase(handler));
        self
    }

    /// Registers the handler of a typed [`Job`]: jobs of type `J::TYPE`, the
    /// payload deserialized into `J` (one that does not fit fails the job
    /// permanently, `bad_payload`). The worker claims `J::TYPE` from the
    /// queues it claims from ([`queues`](Self::queues), every queue by
    /// default), not only from `J::QUEUE`: a job enqueued with another
    /// queue is still this handler's to run.
    pub fn job<J, R, F, Fut>(self, handler: F) -> Self
    where
        J: Job,
        R: Serialize + Send + 'static,
        F: Fn(HandlerContext, J) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R, JobError>> + Send + 'static,
    {
        self.handle(J::TYPE, handler)
    }

    /// Claims only from these queues (every queue when none are named).
    pub fn queues<I, S>(mut self, queues: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.queues = queues.into_iter().map(Into::into).collect();
        self
    }

    /// Runs at most `n` jobs at once (at least 1).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }

    /// Claims up to `n` jobs beyond the running ones while a backlog lasts,
    /// to wait in the worker for a free slot (default: 128, or
    /// `concurrency` if that is more; 0 turns it off). Each claim then moves more jobs, and
    /// the next one is in flight while the slots work. How many actually
    /// wait follows how long handlers take: the last job in line is
    /// expected to start within 100 ms, so a worker of slow jobs keeps none
    /// from other workers. A waiting job is leased and heartbeated like a
    /// running one; its timeout counts from its claim; at shutdown the
    /// jobs still waiting are released at once.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// The lease of each claim (heartbeats renew it every lease/3).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How often to look for work when no wake-up arrives.
    pub fn poll_interval(mut self, every: Duration) -> Self {
        self.poll_interval = every;
        self
    }

    /// The name recorded in the run ledger.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// How long running handlers may finish after shutdown is asked for;
    /// the rest are stopped and their leases released.
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// How long a handler runs on once a cancel of its job is seen (at a
    /// heartbeat; default 1 s): [`HandlerContext::cancelled`] has resolved,
    /// so it can clean up, and what it returns within this time ends the
    /// attempt (`Ok` completes the job: the effect happened). A handler
    /// still running then is stopped (its future dropped) and the job
    /// turns `cancelled`.
    pub fn cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    /// Runs the maintenance loop beside the worker (on by default).
    pub fn maintenance(mut self, on: bool) -> Self {
        self.maintenance = on;
        self
    }

    /// Runs until `shutdown` resolves: then stops claiming, lets running
    /// handlers finish for up to the grace period, stops the rest and
    /// releases their leases so other workers can claim them at once.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<WorkerReport> {
        run::run(self, shutdown).await
    }

    /// Registers a handler for every job type that has no handler of its
    /// own: the worker then claims jobs of any type (of its queues). The
    /// payload arrives as raw JSON; [`HandlerContext::job_type`] says which
    /// type it is. Used by `idemq worker --exec`.
    pub fn handle_any<R, F, Fut>(mut self, handler: F) -> Self
    where
        R: Serialize + Send + 'static,
        F: Fn(HandlerContext, serde_json::Value) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = std::result::Result<R, JobError>> + Send + 'static,
    {
        self.registry.catch_all = Some(handler::erase(handler));
        self
    }
}

/// Resolves on SIGINT or SIGTERM (on other platforms, Ctrl-C): the usual
/// `shutdown` future of [`Worker::run`] in a process of its own.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) {
            (Ok(mut int), Ok(mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
