//! The one error type of the library.
//!
//! Every variant is classified (see [`Error::is_retryable`]) so callers can
//! decide what to do without matching on messages. No variant and no message
//! ever holds a raw idempotency key: only its preview and digest.

use serde::Serialize;

use crate::job::JobState;

/// Which of a request's identities an idempotency conflict was found on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConflictSource {
    /// The `(scope, key)` idempotency binding holds a different fingerprint.
    IdempotencyKey,
    /// A job with the explicit `job_id` exists and was accepted with other fields.
    JobId,
}

impl ConflictSource {
    /// The wire name (`idempotency_key` or `job_id`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IdempotencyKey => "idempotency_key",
            Self::JobId => "job_id",
        }
    }
}

/// The members of an idempotency conflict (docs/idempotency.md).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct IdempotencyConflict {
    /// The job that owns the key (or the explicit id).
    pub job_id: String,
    /// Where the conflict was found.
    pub source: ConflictSource,
    /// The key's scope (`None` when `source` is `job_id`).
    pub scope: Option<String>,
    /// The key's preview (`None` when `source` is `job_id`).
    pub key_preview: Option<String>,
    /// The first 16 hex digits of the stored key hash (`None` when `source` is `job_id`).
    pub key_digest: Option<String>,
    /// The request fields whose fingerprints differ, sorted (API dotted paths).
    pub fields: Vec<String>,
}

/// The error type of every idemq operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The request breaks a bound. Nothing was written.
    #[error("invalid {field}: {reason}")]
    Validation {
        /// The offending field, as an API dotted path (e.g. `dedupe.ttl_ms`).
        field: String,
        /// Which bound it breaks, in words.
        reason: String,
    },
    /// An idempotent request met a binding (or an explicit job id) with other fields.
    /// Nothing was written and neither request won.
    #[error(
        "idempotency conflict on {} with job {}: fields {:?} differ",
        .0.source.as_str(), .0.job_id, .0.fields
    )]
    EnqueueIdempotencyConflict(Box<IdempotencyConflict>),
    /// The payload (or a result or checkpoint value) is over the configured limit.
    #[error("{field} is larger than the limit of {limit} bytes")]
    PayloadTooLarge {
        /// The field that is too large (`payload`, `result`, `value`).
        field: String,
        /// The limit in bytes.
        limit: usize,
    },
    /// The lease token is stale or unknown: another attempt owns the job now, or
    /// this attempt was recorded as expired or timed out.
    #[error("lease lost on job {job_id}")]
    LeaseLost {
        /// The job whose lease was presented.
        job_id: String,
    },
    /// Redrive of a job that is not in the dead-letter set.
    #[error("job {job_id} is not dead (it is {state})")]
    NotDead {
        /// The job.
        job_id: String,
        /// Its current state.
        state: JobState,
    },
    /// The job (or other record) does not exist.
    #[error("{what} not found")]
    NotFound {
        /// What was looked up, e.g. `job 0190…`.
        what: String,
    },
    /// One item of an all-or-nothing batch failed; nothing of the batch was written.
    #[error("batch item {index} failed: {error}")]
    BatchItem {
        /// The index of the first failing item.
        index: usize,
        /// Its error.
        error: Box<Error>,
    },
    /// The backend is down or busy. Safe to retry (with the same idempotency key).
    #[error("backend unavailable: {message}")]
    Unavailable {
        /// What happened.
        message: String,
    },
    /// The store records another key hashing than this process's: another
    /// `IDEMQ_KEY_SECRET`, or a secret on one side only. Connecting anyway
    /// would accept a repeated idempotency key a second time.
    #[error(
        "this process hashes idempotency keys {process}, but the database was set up {stored}: \
         set IDEMQ_KEY_SECRET to the installation's secret (every process of one installation \
         must use the same one), or change the installation's secret deliberately with \
         `idemq key-secret reset` (docs/idempotency.md)"
    )]
    KeySecretMismatch {
        /// How this process hashes (`without a secret` or `with a secret (check …)`).
        process: String,
        /// How the store's installation hashes.
        stored: String,
    },
    /// Anything else the backend reported.
    #[error("backend error: {message}")]
    Backend {
        /// What happened.
        message: String,
    },
}

/// Shorthand for `Result<T, idemq::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// A validation error on `field`.
    pub fn validation(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::Validation {
            field: field.into(),
            reason: reason.into(),
        }
    }

    /// An idempotency conflict with `job_id`: on the request's key when
    /// `key` is given, else on its explicit job id. Every backend builds it
    /// here, so the members are the same whichever store found it.
    pub(crate) fn idempotency_conflict(
        job_id: String,
        key: Option<&crate::request::PreparedKey>,
        fields: Vec<String>,
    ) -> Self {
        Self::EnqueueIdempotencyConflict(Box::new(IdempotencyConflict {
            job_id,
            source: if key.is_some() {
                ConflictSource::IdempotencyKey
            } else {
                ConflictSource::JobId
            },
            scope: key.map(|k| k.scope.clone()),
            key_preview: key.map(|k| k.preview.clone()),
            key_digest: key.map(crate::request::PreparedKey::digest),
            fields,
        }))
    }

    /// `NotFound` for a job id.
    pub fn job_not_found(job_id: &str) -> Self {
        Self::NotFound {
            what: format!("job {job_id}"),
        }
    }

    /// True when the same call may succeed if retried (the backend was down or
    /// busy). Retrying an enqueue with the same idempotency key is always safe.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable { .. })
    }

    /// The conflict's members, when this is an idempotency conflict.
    pub fn conflict(&self) -> Option<&IdempotencyConflict> {
        match self {
            Self::EnqueueIdempotencyConflict(c) => Some(c),
            _ => None,
        }
    }
}
