//! # idemq
//!
//! A durable background-job queue whose promise is **each piece of work is
//! accepted once**. A double-clicked "Place order", a webhook redelivery or a
//! retrying client repeats a request; idemq recognises the repeat, writes
//! nothing, and returns the job that already owns it.
//!
//! ```
//! use idemq::{EnqueueRequest, Outcome, Queue};
//! use serde_json::json;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> idemq::Result<()> {
//! let queue = Queue::connect("sqlite::memory:").await?;
//! let request = EnqueueRequest::new("invoice.capture")
//!     .queue("billing")
//!     .payload(json!({ "invoice_id": "inv_42" }))
//!     .idempotency_key("capture:inv_42");
//!
//! let first = queue.enqueue_with_result(request.clone()).await?;
//! assert_eq!(first.outcome, Outcome::Accepted);
//!
//! // The same request again: recognised, nothing written, same job.
//! let again = queue.enqueue_with_result(request).await?;
//! assert_eq!(again.outcome, Outcome::Replayed);
//! assert_eq!(again.job_id, first.job_id);
//!
//! // The same key with another payload is a typed conflict naming the field.
//! let other = EnqueueRequest::new("invoice.capture")
//!     .queue("billing")
//!     .payload(json!({ "invoice_id": "inv_43" }))
//!     .idempotency_key("capture:inv_42");
//! let err = queue.enqueue(other).await.unwrap_err();
//! assert_eq!(err.conflict().map(|c| c.fields.clone()), Some(vec!["payload".to_string()]));
//! # Ok(())
//! # }
//! ```
//!
//! Guarantees: acceptance is exactly-once inside the replay window;
//! execution is at-least-once; nothing acknowledged is lost. See the
//! repository's `docs/` for idempotency, dedupe and the state machine.

mod caller_tx;
pub mod clock;
pub mod dedupe;
mod error;
pub mod fingerprint;
mod job;
mod list;
#[cfg(feature = "openapi")]
pub mod openapi;
mod queue;
mod report;
pub mod request;
pub mod retry;
pub mod schedule;
mod stats;
pub mod store;
pub mod wire;
pub mod worker;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::{ConflictSource, Error, IdempotencyConflict, Result};
pub use job::{
    CancelOutcome, ClaimedJob, EnqueueResult, Event, FailOutcome, Heartbeat, Job, JobDedupe,
    JobIdempotency, JobState, LeaseToken, NonReplaceableReason, Outcome, QueueInfo, Run,
    StateCounts,
};
pub use list::{JobList, JobPage};
pub use queue::{
    BatchOptions, ClaimOptions, Completion, FailOptions, MAX_BATCH_BYTES, MAX_BATCH_ITEMS, Queue,
    QueueOptions, RedriveOptions, key_secret_from_env,
};
pub use report::{
    BindingInfo, Durability, Explain, ExplainConflict, ExplainDedupe, ExplainIdempotency,
    KeyCheckChange, MigrationStatus,
};
pub use request::{DedupeMode, DedupeOptions, EnqueueRequest, IdempotencyOptions, RetryPolicy};
pub use schedule::{Schedule, ScheduleDefinition, ScheduleList, ScheduleSpec, UnreadableSchedule};
pub use stats::{EnqueueCounts, LATENCY_BOUNDS_SECONDS, Latency, Stats};
pub use worker::{HandlerContext, JobError, Worker};

/// The PostgreSQL driver idemq uses, for [`Queue::enqueue_in`] on your own transactions.
#[cfg(feature = "postgres")]
pub use sqlx;

/// The SQLite driver idemq uses, for [`Queue::enqueue_in_sqlite`] and
/// [`Queue::complete_in_sqlite`] on your own connection to the queue's file.
#[cfg(feature = "sqlite")]
pub use rusqlite;

/// The README's Rust example, compiled by `cargo test --doc`.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
