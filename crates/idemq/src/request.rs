//! The enqueue request (docs/http-api.md, "Enqueue"): its fields, its builder, its defaults and the
//! validation of every bound.
//!
//! The request has the same shape as the HTTP API's JSON body, so the server
//! deserializes straight into it and both surfaces share one validation.
//! Defaults are resolved in one place, [`EnqueueRequest::prepare`], before the
//! fingerprint is taken.

use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::fingerprint::{self, Fingerprint, KeyHasher};

/// Defaults of the enqueue request (docs/http-api.md), in one place.
pub mod defaults {
    /// Queue of a request that names none.
    pub const QUEUE: &str = "default";
    /// Attempt budget.
    pub const MAX_ATTEMPTS: i64 = 10;
    /// Execution timeout of one attempt (30 min).
    pub const TIMEOUT_MS: i64 = 30 * 60 * 1000;
    /// Idempotency scope.
    pub const SCOPE: &str = "default";
    /// Idempotency binding retention (24 h).
    pub const IDEMPOTENCY_TTL_MS: i64 = 24 * 3600 * 1000;
    /// Retention of completed and cancelled jobs (24 h).
    pub const KEEP_COMPLETED_MS: i64 = 24 * 3600 * 1000;
    /// Retention of dead jobs (14 d).
    pub const KEEP_DEAD_MS: i64 = 14 * 24 * 3600 * 1000;
    /// Exponential backoff: first delay (1 s).
    pub const RETRY_INITIAL_MS: i64 = 1000;
    /// Exponential backoff: growth factor.
    pub const RETRY_FACTOR: f64 = 2.0;
    /// Exponential backoff: largest delay (1 h).
    pub const RETRY_MAX_MS: i64 = 3600 * 1000;
    /// Default payload limit (1 MiB).
    pub const PAYLOAD_LIMIT: usize = 1024 * 1024;
}

/// Bounds of docs/http-api.md, docs/idempotency.md and docs/dedupe.md that are not defaults.
pub mod bounds {
    /// Longest accepted duration of any kind (100 years), so instants never overflow.
    pub const MAX_DURATION_MS: i64 = 100 * 366 * 24 * 3600 * 1000;
    /// 30 days, the longest idempotency and dedupe window.
    pub const THIRTY_DAYS_MS: i64 = 30 * 24 * 3600 * 1000;
    /// Longest execution timeout (24 h).
    pub const MAX_TIMEOUT_MS: i64 = 24 * 3600 * 1000;
    /// Most tags on a job.
    pub const MAX_TAGS: usize = 16;
    /// Longest job type in bytes.
    pub const MAX_TYPE_BYTES: usize = 128;
    /// Longest queue name in bytes.
    pub const MAX_QUEUE_BYTES: usize = 64;
    /// Longest explicit job id in bytes.
    pub const MAX_JOB_ID_BYTES: usize = 128;
    /// Longest idempotency key, dedupe key, concurrency key and checkpoint name in bytes.
    pub const MAX_KEY_BYTES: usize = 255;
    /// Longest idempotency scope in bytes.
    pub const MAX_SCOPE_BYTES: usize = 64;
    /// Longest tag in bytes.
    pub const MAX_TAG_BYTES: usize = 64;
    /// Longest worker name in bytes.
    pub const MAX_WORKER_BYTES: usize = 128;
    /// Most jobs one claim hands out.
    pub const MAX_CLAIM_LIMIT: u32 = 1000;
    /// Shortest lease (100 ms).
    pub const MIN_LEASE_MS: i64 = 100;
    /// Longest lease (1 h).
    pub const MAX_LEASE_MS: i64 = 3600 * 1000;
    /// Most attempts of a job.
    pub const MAX_ATTEMPTS: i64 = 1000;
    /// Shortest idempotency retention (1 s).
    pub const MIN_IDEMPOTENCY_TTL_MS: i64 = 1000;
    /// Smallest growth factor of an exponential backoff.
    pub const MIN_RETRY_FACTOR: f64 = 1.0;
    /// Largest growth factor of an exponential backoff.
    pub const MAX_RETRY_FACTOR: f64 = 1000.0;
    /// Largest page of a job list.
    pub const MAX_PAGE_LIMIT: u32 = 1000;
}

/// The backoff between failed attempts.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(
    tag = "kind",
    rename_all = "snake_case",
    deny_unknown_fields,
    from = "RetryWire"
)]
pub enum RetryPolicy {
    /// `initial × factor^(n-1)`, capped at `max`; with full jitter a delay is
    /// drawn uniformly from `[0, that]`.
    Exponential {
        /// First delay in milliseconds.
        #[serde(default = "d_initial")]
        #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::PositiveMs>))]
        initial_ms: i64,
        /// Growth factor (≥ 1).
        #[serde(default = "d_factor")]
        #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::RetryFactor>))]
        factor: f64,
        /// Largest delay in milliseconds.
        #[serde(default = "d_max")]
        #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::PositiveMs>))]
        max_ms: i64,
        /// Full jitter.
        #[serde(default = "d_jitter")]
        #[cfg_attr(feature = "openapi", schema(value_type = Option<bool>))]
        jitter: bool,
    },
    /// The same delay after every failure.
    Fixed {
        /// The delay in milliseconds.
        #[serde(deserialize_with = "crate::wire::int")]
        #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::PositiveMs))]
        delay_ms: i64,
    },
    /// No retries: the first failure is final.
    None,
}

/// A retry policy as it is read: one member form per kind
/// ([`crate::wire::retry`]), each refusing a member it does not have. A
/// unit variant would not: serde lets an internally tagged unit variant
/// ignore every member beside its tag (`{"kind": "none", "delay_ms": 5}`
/// read as `none`).
#[derive(Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum RetryWire {
    Exponential(crate::wire::retry::Exponential),
    Fixed(crate::wire::retry::Fixed),
    None(crate::wire::retry::NoRetries),
}

impl From<RetryWire> for RetryPolicy {
    fn from(w: RetryWire) -> Self {
        match w {
            RetryWire::Exponential(e) => Self::Exponential {
                initial_ms: e.initial_ms,
                factor: e.factor,
                max_ms: e.max_ms,
                jitter: e.jitter,
            },
            RetryWire::Fixed(f) => Self::Fixed {
                delay_ms: f.delay_ms,
            },
            RetryWire::None(crate::wire::retry::NoRetries {}) => Self::None,
        }
    }
}

pub(crate) fn d_initial() -> i64 {
    defaults::RETRY_INITIAL_MS
}
pub(crate) fn d_factor() -> f64 {
    defaults::RETRY_FACTOR
}
pub(crate) fn d_max() -> i64 {
    defaults::RETRY_MAX_MS
}
pub(crate) fn d_jitter() -> bool {
    true
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::Exponential {
            initial_ms: d_initial(),
            factor: d_factor(),
            max_ms: d_max(),
            jitter: d_jitter(),
        }
    }
}

/// `idempotency: { key, scope?, ttl? }` (docs/idempotency.md).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "openapi", schema(as = Idempotency))]
#[serde(deny_unknown_fields)]
pub struct IdempotencyOptions {
    /// The caller's stable id of the business operation (1–255 bytes).
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::Key))]
    pub key: String,
    /// Namespace of keys; `default` when omitted.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::EnqueueScope>))]
    pub scope: Option<String>,
    /// Retention window in milliseconds (1 s – 30 d); 24 h when omitted.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::IdempotencyTtlMs>))]
    pub ttl_ms: Option<i64>,
}

impl std::fmt::Debug for IdempotencyOptions {
    // The raw key never reaches a log line, so Debug shows only its preview.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyOptions")
            .field("key_preview", &fingerprint::key_preview(&self.key))
            .field("scope", &self.scope)
            .field("ttl_ms", &self.ttl_ms)
            .finish()
    }
}

/// `dedupe: { key, ttl?, extend?, replace?, max_wait? }` (docs/dedupe.md). A bare
/// string deserializes as `{ key }`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
// For the schema: the object form refuses unknown members (see `Full` below).
#[serde(deny_unknown_fields)]
pub struct DedupeOptions {
    /// The dedupe key, scoped per job type (1–255 bytes).
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::Key))]
    pub key: String,
    /// Window in milliseconds (1 ms – 30 d).
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::WindowMs>))]
    pub ttl_ms: Option<i64>,
    /// Debounce: every dropped enqueue pushes the window out again.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<bool>, required = false))]
    pub extend: bool,
    /// Replace: latest wins while the keyed job is waiting and not due.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<bool>, required = false))]
    pub replace: bool,
    /// Debounce and replace: cap on the window (and on `run_at`) from first acceptance.
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::WindowMs>))]
    pub max_wait_ms: Option<i64>,
}

impl<'de> Deserialize<'de> for DedupeOptions {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Full {
            key: String,
            #[serde(default, deserialize_with = "crate::wire::opt_int")]
            ttl_ms: Option<i64>,
            #[serde(default)]
            extend: Option<bool>,
            #[serde(default)]
            replace: Option<bool>,
            #[serde(default, deserialize_with = "crate::wire::opt_int")]
            max_wait_ms: Option<i64>,
        }
        // A string or an object, told apart by the visitor rather than an
        // untagged enum, so an error inside the object names its member.
        struct Form;
        impl<'de> serde::de::Visitor<'de> for Form {
            type Value = DedupeOptions;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a dedupe key (string) or an object {key, ttl_ms, extend, replace, max_wait_ms}")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<DedupeOptions, E> {
                Ok(DedupeOptions {
                    key: key.to_owned(),
                    ..DedupeOptions::default()
                })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                map: A,
            ) -> Result<DedupeOptions, A::Error> {
                let f = Full::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(DedupeOptions {
                    key: f.key,
                    ttl_ms: f.ttl_ms,
                    extend: f.extend.unwrap_or(false),
                    replace: f.replace.unwrap_or(false),
                    max_wait_ms: f.max_wait_ms,
                })
            }
        }
        d.deserialize_any(Form)
    }
}

/// The mode a dedupe request selects (docs/dedupe.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DedupeMode {
    /// `{ key }`: dedupe while the keyed job is pending.
    Pending,
    /// `{ key, ttl }`: one job per window from acceptance.
    Throttle,
    /// `{ key, ttl, extend }`: leading-edge debounce.
    Debounce,
    /// `{ key, replace }`: latest wins while the keyed job waits.
    Replace,
}

impl DedupeMode {
    /// The stored and wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Throttle => "throttle",
            Self::Debounce => "debounce",
            Self::Replace => "replace",
        }
    }

    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        [Self::Pending, Self::Throttle, Self::Debounce, Self::Replace]
            .into_iter()
            .find(|m| m.as_str() == s)
    }

    /// Decodes a mode read back from a store: an unknown name is an error,
    /// never a default mode (which would decide the next request wrongly).
    #[cfg_attr(not(all(feature = "sqlite", feature = "postgres")), allow(dead_code))]
    pub(crate) fn from_stored(s: &str) -> Result<Self, crate::job::Undecodable> {
        Self::parse(s).ok_or_else(|| crate::job::Undecodable::unknown("dedupe mode", s))
    }
}

/// An enqueue request. Only the type is required; build it with
/// [`EnqueueRequest::new`] and the chained setters, or deserialize it from the
/// API's JSON body.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EnqueueRequest {
    /// The job type (1–128 bytes of `[A-Za-z0-9._:-]`).
    #[serde(rename = "type")]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::JobType))]
    pub job_type: String,
    /// Any JSON value; `null` when omitted.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = crate::openapi::JsonValue))]
    pub payload: Value,
    /// The queue; `default` when omitted.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::QueueName>))]
    pub queue: Option<String>,
    /// An explicit job id; a UUIDv7 is generated when omitted.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::JobId>))]
    pub job_id: Option<String>,
    /// Higher runs first among due jobs (an i16); 0 when omitted.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::Priority>))]
    pub priority: Option<i64>,
    /// Absolute time the job becomes due.
    #[serde(default)]
    pub run_at: Option<DateTime<Utc>>,
    /// Relative delay before the job becomes due, in milliseconds.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::DurationMs>))]
    pub delay_ms: Option<i64>,
    /// Attempt budget (1–1000); 10 when omitted.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::MaxAttempts>))]
    pub max_attempts: Option<i64>,
    /// Backoff policy; exponential 1 s ×2, max 1 h, full jitter when omitted.
    #[serde(default, deserialize_with = "crate::wire::opt_object")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::Retry>))]
    pub retry: Option<RetryPolicy>,
    /// Execution timeout of one attempt (1 ms – 24 h); 30 min when omitted.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::TimeoutMs>))]
    pub timeout_ms: Option<i64>,
    /// The job must not start or go on after this instant.
    #[serde(default)]
    pub deadline: Option<DateTime<Utc>>,
    /// At most one active job per key at a time.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::Key>))]
    pub concurrency_key: Option<String>,
    /// Labels for operators (≤ 16 distinct, 1–64 bytes each).
    #[serde(default, deserialize_with = "crate::wire::null_as_default")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::Tags>))]
    pub tags: Vec<String>,
    /// Retention after the job turns terminal, in milliseconds.
    #[serde(default, deserialize_with = "crate::wire::opt_int")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::DurationMs>))]
    pub keep_ms: Option<i64>,
    /// Idempotent acceptance (docs/idempotency.md).
    #[serde(default, deserialize_with = "crate::wire::opt_object")]
    pub idempotency: Option<IdempotencyOptions>,
    /// Rate policy (docs/dedupe.md).
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<crate::openapi::Dedupe>))]
    pub dedupe: Option<DedupeOptions>,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl EnqueueRequest {
    /// A request for a job of `job_type` with every other field defaulted.
    pub fn new(job_type: impl Into<String>) -> Self {
        Self {
            job_type: job_type.into(),
            ..Self::default()
        }
    }
    /// Sets the payload.
    pub fn payload(mut self, payload: Value) -> Self {
        self.payload = payload;
        self
    }
    /// Sets the queue.
    pub fn queue(mut self, queue: impl Into<String>) -> Self {
        self.queue = Some(queue.into());
        self
    }
    /// Sets an explicit job id.
    pub fn job_id(mut self, id: impl Into<String>) -> Self {
        self.job_id = Some(id.into());
        self
    }
    /// Sets the priority.
    pub fn priority(mut self, priority: i16) -> Self {
        self.priority = Some(priority.into());
        self
    }
    /// Makes the job due at `at`.
    pub fn run_at(mut self, at: DateTime<Utc>) -> Self {
        self.run_at = Some(at);
        self
    }
    /// Makes the job due after `delay` (resolved by the store's clock).
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay_ms = Some(ms(delay));
        self
    }
    /// Sets the attempt budget.
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = Some(n.into());
        self
    }
    /// Sets the backoff policy.
    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.retry = Some(policy);
        self
    }
    /// Sets the execution timeout of one attempt.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout_ms = Some(ms(timeout));
        self
    }
    /// Sets the deadline.
    pub fn deadline(mut self, at: DateTime<Utc>) -> Self {
        self.deadline = Some(at);
        self
    }
    /// Sets the concurrency key.
    pub fn concurrency_key(mut self, key: impl Into<String>) -> Self {
        self.concurrency_key = Some(key.into());
        self
    }
    /// Adds a tag.
    pub fn tag(mut self, tag: impl Into<String>) -> Self {
        self.tags.push(tag.into());
        self
    }
    /// Sets the retention after the job turns terminal.
    pub fn keep(mut self, keep: Duration) -> Self {
        self.keep_ms = Some(ms(keep));
        self
    }
    /// Binds the idempotency key `key` in the default scope for 24 h.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency = Some(IdempotencyOptions {
            key: key.into(),
            scope: None,
            ttl_ms: None,
        });
        self
    }
    /// Sets the idempotency options in full.
    pub fn idempotency(mut self, options: IdempotencyOptions) -> Self {
        self.idempotency = Some(options);
        self
    }
    /// Sets the dedupe options (a bare key is pending mode: `DedupeOptions::key("k")`).
    pub fn dedupe(mut self, options: DedupeOptions) -> Self {
        self.dedupe = Some(options);
        self
    }
}

impl IdempotencyOptions {
    /// Options with `key` in the default scope and retention.
    pub fn new(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            scope: None,
            ttl_ms: None,
        }
    }
    /// Sets the scope.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = Some(scope.into());
        self
    }
    /// Sets the retention window.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl_ms = Some(ms(ttl));
        self
    }
}

impl DedupeOptions {
    /// Pending mode on `key`.
    pub fn key(key: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            ..Self::default()
        }
    }
    /// Sets the window (throttle; with [`extend`](Self::extend), debounce).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl_ms = Some(ms(ttl));
        self
    }
    /// Debounce: every dropped enqueue re-arms the window.
    pub fn extend(mut self) -> Self {
        self.extend = true;
        self
    }
    /// Replace: latest wins while the keyed job waits.
    pub fn replace(mut self) -> Self {
        self.replace = true;
        self
    }
    /// Caps the window and `run_at` at first acceptance + `max_wait`.
    pub fn max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait_ms = Some(ms(max_wait));
        self
    }
}

/// An idempotency key after hashing: what the store sees (never the raw key).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedKey {
    /// The scope.
    pub scope: String,
    /// SHA-256 (or HMAC-SHA-256) of the length-prefixed scope and key.
    pub hash: [u8; 32],
    /// The key's preview.
    pub preview: String,
    /// Retention in milliseconds.
    pub ttl_ms: i64,
}

impl PreparedKey {
    /// The first 16 hex digits of the hash.
    pub fn digest(&self) -> String {
        fingerprint::key_digest(&self.hash)
    }
}

/// The dedupe part of a prepared request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedDedupe {
    /// The key.
    pub key: String,
    /// The mode.
    pub mode: DedupeMode,
    /// The window, if any.
    pub ttl_ms: Option<i64>,
    /// The cap from first acceptance, if any.
    pub max_wait_ms: Option<i64>,
}

/// A validated request with every default resolved, its key hashed and its
/// fingerprint taken. This is what a store receives.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedEnqueue {
    /// Job type.
    pub job_type: String,
    /// Payload, serialized.
    pub payload: String,
    /// Queue.
    pub queue: String,
    /// Explicit job id.
    pub job_id: Option<String>,
    /// Priority.
    pub priority: i16,
    /// Absolute due time in µs since the epoch.
    pub run_at: Option<i64>,
    /// Relative delay in ms (`None` for 0).
    pub delay_ms: Option<i64>,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Backoff policy.
    pub retry: RetryPolicy,
    /// Timeout in ms.
    pub timeout_ms: i64,
    /// Deadline in µs since the epoch.
    pub deadline: Option<i64>,
    /// Concurrency key.
    pub concurrency_key: Option<String>,
    /// Sorted, de-duplicated tags.
    pub tags: Vec<String>,
    /// Explicit retention in ms.
    pub keep_ms: Option<i64>,
    /// The hashed idempotency key.
    pub idempotency: Option<PreparedKey>,
    /// The dedupe policy.
    pub dedupe: Option<PreparedDedupe>,
    /// Per-field digests.
    pub fingerprint: Fingerprint,
}

/// A job type: 1–[`bounds::MAX_TYPE_BYTES`] bytes of `[A-Za-z0-9._:-]`.
pub fn check_job_type(field: &str, v: &str) -> Result<()> {
    check_name(field, v, bounds::MAX_TYPE_BYTES, "")
}

/// A queue name: 1–[`bounds::MAX_QUEUE_BYTES`] bytes of `[A-Za-z0-9._:-]`.
pub fn check_queue_name(field: &str, v: &str) -> Result<()> {
    check_name(field, v, bounds::MAX_QUEUE_BYTES, "")
}

/// An idempotency scope as a lookup names it: 1–[`bounds::MAX_SCOPE_BYTES`]
/// bytes of `[A-Za-z0-9._:-]` (the reserved `idemq.` scopes included; only
/// enqueue refuses them).
pub fn check_scope(field: &str, v: &str) -> Result<()> {
    check_name(field, v, bounds::MAX_SCOPE_BYTES, "")
}

/// A dedupe key: 1–[`bounds::MAX_KEY_BYTES`] bytes, no U+0000.
pub fn check_dedupe_key(field: &str, v: &str) -> Result<()> {
    check_text(field, v, bounds::MAX_KEY_BYTES)
}

/// A worker name: 1–[`bounds::MAX_WORKER_BYTES`] bytes, no U+0000.
pub fn check_worker_name(field: &str, v: &str) -> Result<()> {
    check_text(field, v, bounds::MAX_WORKER_BYTES)
}

/// A checkpoint (step) name: 1–[`bounds::MAX_KEY_BYTES`] bytes, no U+0000.
pub fn check_checkpoint_name(field: &str, v: &str) -> Result<()> {
    check_text(field, v, bounds::MAX_KEY_BYTES)
}

fn check_name(field: &str, v: &str, max: usize, extra: &str) -> Result<()> {
    let ok_len = !v.is_empty() && v.len() <= max;
    let ok_chars = v.bytes().all(|b| {
        b.is_ascii_alphanumeric() || b"._:-".contains(&b) || extra.as_bytes().contains(&b)
    });
    if ok_len && ok_chars {
        Ok(())
    } else {
        Err(Error::validation(
            field,
            format!("must be 1–{max} bytes of [A-Za-z0-9._:{extra}-]"),
        ))
    }
}

/// Free text: 1–`max` bytes of UTF-8, no U+0000.
fn check_text(field: &str, v: &str, max: usize) -> Result<()> {
    if v.is_empty() || v.len() > max {
        return Err(Error::validation(field, format!("must be 1–{max} bytes")));
    }
    if v.contains('\0') {
        return Err(Error::validation(field, "must not contain U+0000"));
    }
    Ok(())
}

/// An attempt budget: 1–[`bounds::MAX_ATTEMPTS`].
pub fn check_max_attempts(field: &str, n: i64) -> Result<()> {
    if !(1..=bounds::MAX_ATTEMPTS).contains(&n) {
        return Err(Error::validation(
            field,
            format!("must be 1–{}", bounds::MAX_ATTEMPTS),
        ));
    }
    Ok(())
}

fn check_ms(field: &str, v: i64, min: i64, max: i64, words: &str) -> Result<()> {
    if v < min || v > max {
        return Err(Error::validation(field, format!("must be {words}")));
    }
    Ok(())
}

/// What a stored JSON value may not hold, found in one walk: U+0000 in a
/// string or a key (PostgreSQL's `jsonb` cannot store it; refused on every
/// backend alike), and a number with a fraction or an exponent beyond the
/// range of a double (`1e400`), which JSON's grammar allows but neither its
/// fingerprint (RFC 8785) nor most readers can hold. Integers of any length
/// are kept exactly.
#[derive(Default)]
struct Refusals {
    nul: bool,
    unbounded: bool,
}

impl Refusals {
    fn of(v: &Value) -> Self {
        let mut r = Self::default();
        r.scan(v);
        r
    }

    fn scan(&mut self, v: &Value) {
        if self.nul && self.unbounded {
            return;
        }
        match v {
            Value::String(s) => self.nul |= s.contains('\0'),
            Value::Number(n) if !self.unbounded => {
                // The text, as written (serde_json's arbitrary precision):
                // an integer needs no parse.
                self.unbounded =
                    !crate::fingerprint::is_integer_text(n.as_str()) && n.as_f64().is_none();
            }
            Value::Array(a) => a.iter().for_each(|x| self.scan(x)),
            Value::Object(o) => {
                for (k, x) in o {
                    self.nul |= k.contains('\0');
                    self.scan(x);
                }
            }
            _ => {}
        }
    }
}

/// Serializes a JSON value under a size limit, refusing U+0000 and numbers
/// beyond a double's range that are not integers.
pub(crate) fn encode_json(field: &str, v: &Value, limit: usize) -> Result<String> {
    let refusals = Refusals::of(v);
    if refusals.nul {
        return Err(Error::validation(
            field,
            "must not contain U+0000 in any string",
        ));
    }
    if refusals.unbounded {
        return Err(Error::validation(
            field,
            "must not contain a number with a fraction or an exponent beyond the range of a \
             64-bit float (integers of any length are kept exactly)",
        ));
    }
    let s = serde_json::to_string(v).map_err(|e| Error::validation(field, e.to_string()))?;
    if s.len() > limit {
        return Err(Error::PayloadTooLarge {
            field: field.into(),
            limit,
        });
    }
    Ok(s)
}

pub(crate) fn micros(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

fn validate_retry(p: &RetryPolicy) -> Result<()> {
    let max = bounds::MAX_DURATION_MS;
    match *p {
        RetryPolicy::Exponential {
            initial_ms,
            factor,
            max_ms,
            ..
        } => {
            check_ms(
                "retry.initial_ms",
                initial_ms,
                1,
                max,
                "a positive duration",
            )?;
            check_ms("retry.max_ms", max_ms, 1, max, "a positive duration")?;
            if !(factor.is_finite()
                && (bounds::MIN_RETRY_FACTOR..=bounds::MAX_RETRY_FACTOR).contains(&factor))
            {
                return Err(Error::validation(
                    "retry.factor",
                    format!(
                        "must be a number from {} to {}",
                        bounds::MIN_RETRY_FACTOR,
                        bounds::MAX_RETRY_FACTOR
                    ),
                ));
            }
        }
        RetryPolicy::Fixed { delay_ms } => {
            check_ms("retry.delay_ms", delay_ms, 1, max, "a positive duration")?;
        }
        RetryPolicy::None => {}
    }
    Ok(())
}

fn prepare_dedupe(d: &DedupeOptions) -> Result<PreparedDedupe> {
    check_dedupe_key("dedupe.key", &d.key)?;
    let window = "from 1 ms to 30 days";
    if let Some(t) = d.ttl_ms {
        check_ms("dedupe.ttl_ms", t, 1, bounds::THIRTY_DAYS_MS, window)?;
    }
    if let Some(w) = d.max_wait_ms {
        check_ms("dedupe.max_wait_ms", w, 1, bounds::THIRTY_DAYS_MS, window)?;
    }
    if d.extend && d.ttl_ms.is_none() {
        return Err(Error::validation("dedupe.extend", "needs dedupe.ttl_ms"));
    }
    if d.extend && d.replace {
        return Err(Error::validation(
            "dedupe.extend",
            "cannot be combined with replace",
        ));
    }
    if d.max_wait_ms.is_some() && !d.extend && !d.replace {
        return Err(Error::validation(
            "dedupe.max_wait_ms",
            "applies only to debounce (extend) and replace modes",
        ));
    }
    if let (Some(t), Some(w)) = (d.ttl_ms, d.max_wait_ms)
        && w < t
    {
        return Err(Error::validation(
            "dedupe.max_wait_ms",
            "must be at least dedupe.ttl_ms",
        ));
    }
    let mode = match (d.replace, d.extend, d.ttl_ms) {
        (true, _, _) => DedupeMode::Replace,
        (false, true, _) => DedupeMode::Debounce,
        (false, false, Some(_)) => DedupeMode::Throttle,
        (false, false, None) => DedupeMode::Pending,
    };
    Ok(PreparedDedupe {
        key: d.key.clone(),
        mode,
        ttl_ms: d.ttl_ms,
        max_wait_ms: d.max_wait_ms,
    })
}

/// Validates an idempotency key and its scope and hashes the key.
pub(crate) fn prepare_key(
    field: &str,
    key: &str,
    scope: &str,
    ttl_ms: i64,
    hasher: &KeyHasher,
) -> Result<PreparedKey> {
    if key.is_empty() || key.len() > bounds::MAX_KEY_BYTES {
        return Err(Error::validation(
            format!("{field}.key"),
            format!("must be 1–{} bytes of UTF-8", bounds::MAX_KEY_BYTES),
        ));
    }
    // Its preview is stored as text, which PostgreSQL cannot hold with U+0000.
    if key.contains('\0') {
        return Err(Error::validation(
            format!("{field}.key"),
            "must not contain U+0000",
        ));
    }
    Ok(PreparedKey {
        scope: scope.to_owned(),
        hash: hasher.hash(scope, key),
        preview: fingerprint::key_preview(key),
        ttl_ms,
    })
}

impl EnqueueRequest {
    /// Validates every bound and resolves every default, hashing the key with
    /// `hasher` and refusing payloads over `payload_limit` bytes. Checks
    /// against the clock (a deadline in the future) are left to the store,
    /// which applies them only when the request would create or replace a job.
    pub fn prepare(&self, hasher: &KeyHasher, payload_limit: usize) -> Result<PreparedEnqueue> {
        check_job_type("type", &self.job_type)?;
        let payload = encode_json("payload", &self.payload, payload_limit)?;
        let queue = self.queue.as_deref().unwrap_or(defaults::QUEUE);
        check_queue_name("queue", queue)?;
        if let Some(id) = &self.job_id {
            check_name("job_id", id, bounds::MAX_JOB_ID_BYTES, "~")?;
        }
        let priority = match self.priority {
            None => 0,
            Some(p) => i16::try_from(p)
                .map_err(|_| Error::validation("priority", "must be an i16 (-32768 to 32767)"))?,
        };
        if self.run_at.is_some() && self.delay_ms.is_some() {
            return Err(Error::validation(
                "delay_ms",
                "cannot be combined with run_at",
            ));
        }
        if let Some(d) = self.delay_ms {
            check_ms(
                "delay_ms",
                d,
                0,
                bounds::MAX_DURATION_MS,
                "from 0 to 100 years",
            )?;
        }
        let max_attempts = self.max_attempts.unwrap_or(defaults::MAX_ATTEMPTS);
        check_max_attempts("max_attempts", max_attempts)?;
        let retry = self.retry.clone().unwrap_or_default();
        validate_retry(&retry)?;
        let timeout_ms = self.timeout_ms.unwrap_or(defaults::TIMEOUT_MS);
        check_ms(
            "timeout_ms",
            timeout_ms,
            1,
            bounds::MAX_TIMEOUT_MS,
            "from 1 ms to 24 h",
        )?;
        if let (Some(run_at), Some(deadline)) = (self.run_at, self.deadline)
            && run_at >= deadline
        {
            return Err(Error::validation("run_at", "must be before the deadline"));
        }
        if let Some(k) = &self.concurrency_key {
            check_text("concurrency_key", k, bounds::MAX_KEY_BYTES)?;
        }
        let mut tags = self.tags.clone();
        tags.sort();
        tags.dedup();
        if tags.len() > bounds::MAX_TAGS {
            return Err(Error::validation(
                "tags",
                format!("at most {} distinct tags", bounds::MAX_TAGS),
            ));
        }
        for t in &tags {
            check_text("tags", t, bounds::MAX_TAG_BYTES)?;
        }
        if let Some(k) = self.keep_ms {
            check_ms(
                "keep_ms",
                k,
                0,
                bounds::MAX_DURATION_MS,
                "from 0 to 100 years",
            )?;
        }
        let idempotency = match &self.idempotency {
            None => None,
            Some(o) => {
                let scope = o.scope.as_deref().unwrap_or(defaults::SCOPE);
                check_scope("idempotency.scope", scope)?;
                if scope.starts_with("idemq.") {
                    return Err(Error::validation(
                        "idempotency.scope",
                        "scopes starting with `idemq.` are reserved",
                    ));
                }
                let ttl = o.ttl_ms.unwrap_or(defaults::IDEMPOTENCY_TTL_MS);
                let bound = "from 1 s to 30 days";
                check_ms(
                    "idempotency.ttl_ms",
                    ttl,
                    bounds::MIN_IDEMPOTENCY_TTL_MS,
                    bounds::THIRTY_DAYS_MS,
                    bound,
                )?;
                Some(prepare_key("idempotency", &o.key, scope, ttl, hasher)?)
            }
        };
        let dedupe = self.dedupe.as_ref().map(prepare_dedupe).transpose()?;
        let delay_ms = self.delay_ms.filter(|d| *d != 0);
        let mut p = PreparedEnqueue {
            job_type: self.job_type.clone(),
            payload,
            queue: queue.to_owned(),
            job_id: self.job_id.clone(),
            priority,
            run_at: self.run_at.map(micros),
            delay_ms,
            max_attempts: max_attempts as i32,
            retry,
            timeout_ms,
            deadline: self.deadline.map(micros),
            concurrency_key: self.concurrency_key.clone(),
            tags,
            keep_ms: self.keep_ms,
            idempotency,
            dedupe,
            fingerprint: Fingerprint::default(),
        };
        p.fingerprint = Fingerprint::of(&p, &self.payload);
        Ok(p)
    }
}

#[cfg(test)]
mod retry_wire_tests {
    use super::RetryPolicy;
    use serde_json::json;

    #[test]
    fn every_kind_refuses_a_member_it_does_not_have() {
        for bad in [
            json!({"kind": "none", "delay_ms": 5}),
            json!({"kind": "fixed", "delay_ms": 5, "factor": 2}),
            json!({"kind": "exponential", "delay_ms": 5}),
        ] {
            let err = serde_json::from_value::<RetryPolicy>(bad.clone()).unwrap_err();
            assert!(err.to_string().contains("unknown field"), "{bad}: {err}");
        }
        for (good, want) in [
            (json!({"kind": "none"}), RetryPolicy::None),
            (
                json!({"kind": "fixed", "delay_ms": 5}),
                RetryPolicy::Fixed { delay_ms: 5 },
            ),
            (json!({"kind": "exponential"}), RetryPolicy::default()),
        ] {
            let read: RetryPolicy = serde_json::from_value(good.clone()).unwrap();
            assert_eq!(read, want, "{good}");
            let again: RetryPolicy =
                serde_json::from_value(serde_json::to_value(&read).unwrap()).unwrap();
            assert_eq!(again, want, "{good} round trip");
        }
    }
}
