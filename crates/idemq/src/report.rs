//! What the queue reports beyond jobs: an explain's findings, a binding, a
//! schema's standing, a key-check change. Public types, which the storage
//! seam returns as it returns a [`Job`](crate::Job); the seam's own
//! parameters live in [`crate::store`].

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::request::DedupeMode;

/// How a database's schema stands against this binary's (`idemq migrate
/// --check`). Reading it changes nothing.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MigrationStatus {
    /// The newest migration the database has.
    pub current: i64,
    /// The newest migration this binary knows.
    pub latest: i64,
    /// The migrations `idemq migrate` would apply, in order.
    pub pending: Vec<i64>,
    /// Whether the database's functions are this binary's (always true on
    /// backends without server-side functions).
    pub functions_current: bool,
    /// For a schema newer than this binary's (`current > latest`): the
    /// idemq version that wrote it, when the database recorded one.
    pub written_by: Option<String>,
}

impl MigrationStatus {
    /// Whether `idemq migrate` has nothing to do and this binary can run.
    pub fn is_current(&self) -> bool {
        self.current == self.latest && self.pending.is_empty() && self.functions_current
    }

    /// For a schema newer than this binary's: why this binary refuses it,
    /// in the words of `connect` and `migrate` (naming the idemq that wrote
    /// it when recorded). `None` when this binary knows the schema.
    pub fn newer_schema(&self) -> Option<String> {
        (self.current > self.latest).then(|| {
            crate::store::newer_schema_message(
                "the schema",
                self.current,
                self.latest,
                self.written_by.as_deref(),
            )
        })
    }
}

/// What an explain found: the outcome an enqueue would have now, and who holds the keys.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Explain {
    /// `accepted`, `replayed`, `coalesced`, `replaced`, `non_replaceable` or `conflict`.
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::ExplainOutcome))]
    pub outcome: String,
    /// For `non_replaceable`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::job::NonReplaceableReason>))]
    pub reason: Option<String>,
    /// The job the enqueue would return (`None` for a new job without an explicit id, and for a conflict).
    pub job_id: Option<String>,
    /// For `conflict`: the owning job and the differing fields.
    pub conflict: Option<ExplainConflict>,
    /// The live idempotency binding of the request's key, if any.
    pub idempotency: Option<ExplainIdempotency>,
    /// The live dedupe binding of the request's key, if any.
    pub dedupe: Option<ExplainDedupe>,
}

impl Explain {
    /// Records what the dry run of a request decided: its outcome and the
    /// job it would return (`explicit_id`, the request's own id, for a new
    /// job), or the conflict. Every backend explains through this, so the
    /// same decision reads the same everywhere.
    pub(crate) fn record(
        &mut self,
        decision: crate::Result<crate::job::EnqueueResult>,
        explicit_id: Option<String>,
    ) -> crate::Result<()> {
        match decision {
            Ok(r) => {
                self.outcome = r.outcome.as_str().into();
                self.reason = r.outcome.reason().map(|x| x.as_str().into());
                self.job_id = match r.outcome {
                    crate::job::Outcome::Accepted => explicit_id,
                    _ => Some(r.job_id),
                };
            }
            Err(crate::Error::EnqueueIdempotencyConflict(c)) => {
                self.outcome = "conflict".into();
                self.conflict = Some(ExplainConflict {
                    job_id: c.job_id,
                    fields: c.fields,
                });
            }
            Err(e) => return Err(e),
        }
        Ok(())
    }
}

/// Conflict details of an explain.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExplainConflict {
    /// The job that owns the key or id.
    pub job_id: String,
    /// The differing fields.
    pub fields: Vec<String>,
}

/// A live idempotency binding as explain reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExplainIdempotency {
    /// The job the key is bound to.
    pub job_id: String,
    /// When the binding expires.
    pub expires_at: DateTime<Utc>,
}

/// A live dedupe binding as explain and lookups report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = DedupeBinding))]
pub struct ExplainDedupe {
    /// The keyed job.
    pub job_id: String,
    /// The binding's mode.
    pub mode: DedupeMode,
    /// The end of its window (`None` for modes live while the job is pending).
    pub window_until: Option<DateTime<Utc>>,
}

/// A live idempotency binding as a lookup reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Binding))]
pub struct BindingInfo {
    /// The job the key is bound to.
    pub job_id: String,
    /// The key's preview.
    pub key_preview: String,
    /// The first 16 hex digits of the key hash.
    pub key_digest: String,
    /// When the binding expires.
    pub expires_at: DateTime<Utc>,
}

/// What replacing the installation's key check did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyCheckChange {
    /// The check recorded before (`None` on a fresh database).
    pub previous: Option<String>,
    /// Live idempotency bindings, made with the previous hashing, that no
    /// request hashed the new way will match again.
    pub live_bindings: u64,
}

/// What an acknowledgement from the store is worth: whether the backend
/// runs with the settings under which nothing acknowledged is lost.
/// `/healthz`, `/metrics` and the dashboard show it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Durability {
    /// Acknowledged work survives a crash of the database process: SQLite
    /// and PostgreSQL as idemq opens them, Redis with its durable settings
    /// checked at connect and again by every maintenance pass.
    Full,
    /// The store was opened without its durability settings checked
    /// (Redis with `?durability=relaxed`): acknowledged work may be lost.
    /// Also a strict Redis store whose server was found without them by a
    /// maintenance pass: it refuses writes until they are set back.
    Relaxed {
        /// Why, for an operator: what was skipped and what it risks.
        reason: String,
    },
}

impl Durability {
    /// `full` or `relaxed`: the word `/healthz` and the dashboard show.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Relaxed { .. } => "relaxed",
        }
    }

    /// Whether acknowledged work may be lost.
    pub fn is_relaxed(&self) -> bool {
        matches!(self, Self::Relaxed { .. })
    }

    /// Why durability is reduced (`None` when it is full).
    pub fn reason(&self) -> Option<&str> {
        match self {
            Self::Full => None,
            Self::Relaxed { reason } => Some(reason),
        }
    }
}
