//! The OpenAPI 3.1 document: the schemas of the library's wire types (which
//! live in `idemq` and cannot derive `ToSchema` there) and the list of every
//! documented path. Request bodies the server defines itself derive their
//! schema where they are declared. `tests/openapi.rs` pins the output.

#![allow(dead_code)] // The schema structs are never built: they only describe JSON.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::Value;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi, ToSchema};

/// An RFC 9457 problem document (`application/problem+json`).
#[derive(Serialize, ToSchema)]
#[schema(as = Problem)]
pub(crate) struct ProblemDoc {
    /// `/problems/<name>`: bad-request, validation, idempotency-conflict,
    /// lease-lost, not-dead, not-found, unauthorized, forbidden-host,
    /// method-not-allowed, payload-too-large, unavailable, internal.
    #[serde(rename = "type")]
    problem_type: String,
    /// A short summary of the type.
    title: String,
    /// The HTTP status.
    status: u16,
    /// What happened (never a raw idempotency key).
    detail: String,
    /// `validation`: the dotted path of the field; `payload-too-large`: the too large field.
    field: Option<String>,
    /// `validation`: the bound broken.
    reason: Option<String>,
    /// `idempotency-conflict`, `lease-lost`, `not-dead`: the job.
    job_id: Option<String>,
    /// `idempotency-conflict`: `idempotency_key` or `job_id`.
    source: Option<String>,
    /// `idempotency-conflict`: the key's scope (null for `job_id`).
    scope: Option<String>,
    /// `idempotency-conflict`: the key's preview (null for `job_id`).
    key_preview: Option<String>,
    /// `idempotency-conflict`: 16 hex digits of the key hash (null for `job_id`).
    key_digest: Option<String>,
    /// `idempotency-conflict`: the differing fields, sorted dotted paths.
    fields: Option<Vec<String>>,
    /// Atomic batches: the index of the first failing item.
    index: Option<usize>,
}

/// The backoff between failed attempts.
#[derive(Serialize, ToSchema)]
#[schema(as = RetryPolicy)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum RetryDoc {
    /// `initial × factor^(n-1)`, capped at `max_ms`, with optional full jitter.
    Exponential {
        /// First delay (1000).
        initial_ms: Option<i64>,
        /// Growth factor ≥ 1 (2.0).
        factor: Option<f64>,
        /// Largest delay (3600000).
        max_ms: Option<i64>,
        /// Full jitter (true).
        jitter: Option<bool>,
    },
    /// The same delay after every failure.
    Fixed {
        /// The delay.
        delay_ms: i64,
    },
    /// No retries.
    None,
}

/// `idempotency: { key, scope?, ttl_ms? }`.
#[derive(Serialize, ToSchema)]
#[schema(as = Idempotency)]
#[serde(deny_unknown_fields)]
pub(crate) struct IdempotencyDoc {
    /// The caller's stable id of the operation (1–255 bytes; never stored raw).
    #[schema(min_length = 1, max_length = 255, pattern = "^[^\\u0000]+$")]
    key: String,
    /// Namespace of keys (`default`); 1–64 bytes, not starting with `idemq.`.
    #[schema(
        min_length = 1,
        max_length = 64,
        pattern = "^(?!idemq\\.)[A-Za-z0-9._:-]+$"
    )]
    scope: Option<String>,
    /// Retention window, 1 s – 30 d (86400000).
    #[schema(minimum = 1000, maximum = 2592000000_i64)]
    ttl_ms: Option<i64>,
}

/// `dedupe: { key, ttl_ms?, extend?, replace?, max_wait_ms? }`.
#[derive(Serialize, ToSchema)]
#[schema(as = DedupeOptions)]
#[serde(deny_unknown_fields)]
pub(crate) struct DedupeOptionsDoc {
    /// The dedupe key, scoped per job type (1–255 bytes).
    #[schema(min_length = 1, max_length = 255, pattern = "^[^\\u0000]+$")]
    key: String,
    /// Window, 1 ms – 30 d (throttle; with `extend`, debounce).
    #[schema(minimum = 1, maximum = 2592000000_i64)]
    ttl_ms: Option<i64>,
    /// Debounce: every dropped enqueue re-arms the window.
    extend: Option<bool>,
    /// Replace: latest wins while the keyed job waits.
    replace: Option<bool>,
    /// Cap of the window and of `run_at` from first acceptance (with `extend` or `replace`).
    #[schema(minimum = 1, maximum = 2592000000_i64)]
    max_wait_ms: Option<i64>,
}

/// A dedupe key alone (pending mode) or its options.
#[derive(Serialize, ToSchema)]
#[schema(as = Dedupe)]
#[serde(untagged)]
pub(crate) enum DedupeDoc {
    /// The key (pending mode).
    Key(String),
    /// The options.
    Options(DedupeOptionsDoc),
}

/// An enqueue request (docs/http-api.md, "Enqueue"). Only `type` is required.
#[derive(Serialize, ToSchema)]
#[schema(as = EnqueueRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct EnqueueDoc {
    /// The job type (1–128 bytes of `[A-Za-z0-9._:-]`).
    #[serde(rename = "type")]
    #[schema(min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9._:-]+$")]
    job_type: String,
    /// Any JSON value (≤ the payload limit, 1 MiB by default).
    payload: Option<Value>,
    /// The queue (`default`).
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9._:-]+$")]
    queue: Option<String>,
    /// An explicit job id (a UUIDv7 is generated otherwise).
    #[schema(min_length = 1, max_length = 128, pattern = "^[A-Za-z0-9._:~-]+$")]
    job_id: Option<String>,
    /// Higher runs first among due jobs (i16; 0).
    #[schema(minimum = -32768, maximum = 32767)]
    priority: Option<i64>,
    /// When the job becomes due (not with `delay_ms`).
    run_at: Option<DateTime<Utc>>,
    /// Delay before the job becomes due.
    #[schema(minimum = 0, maximum = 3162240000000_i64)]
    delay_ms: Option<i64>,
    /// Attempt budget, 1–1000 (10).
    #[schema(minimum = 1, maximum = 1000)]
    max_attempts: Option<i64>,
    /// Backoff policy.
    retry: Option<RetryDoc>,
    /// Execution timeout of one attempt, 1 ms – 24 h (1800000).
    #[schema(minimum = 1, maximum = 86400000)]
    timeout_ms: Option<i64>,
    /// The job must not start or go on after this instant.
    deadline: Option<DateTime<Utc>>,
    /// At most one active job per key (1–255 bytes).
    #[schema(min_length = 1, max_length = 255, pattern = "^[^\\u0000]+$")]
    concurrency_key: Option<String>,
    /// Labels (≤ 16 of 1–64 bytes).
    #[schema(max_items = 16)]
    tags: Option<Vec<String>>,
    /// Retention after the job turns terminal.
    #[schema(minimum = 0, maximum = 3162240000000_i64)]
    keep_ms: Option<i64>,
    /// Idempotent acceptance.
    idempotency: Option<IdempotencyDoc>,
    /// Rate policy.
    dedupe: Option<DedupeDoc>,
}

/// What an enqueue did.
#[derive(Serialize, ToSchema)]
#[schema(as = EnqueueResult)]
pub(crate) struct EnqueuedDoc {
    /// The job the request refers to.
    job_id: String,
    /// `accepted`, `replayed`, `coalesced`, `replaced` or `non_replaceable`.
    outcome: String,
    /// With `non_replaceable` only: `incompatible_mode`, `not_pending` or `window_elapsed`.
    reason: Option<String>,
}

/// `POST /v1/jobs/batch`.
#[derive(Serialize, ToSchema)]
#[schema(as = BatchRequest)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchDoc {
    /// At most 1,000 requests (16 MiB).
    #[schema(max_items = 1000)]
    jobs: Vec<EnqueueDoc>,
    /// All or nothing (false).
    atomic: Option<bool>,
}

/// One item of a batch's answer.
#[derive(Serialize, ToSchema)]
#[schema(as = BatchItem)]
#[serde(untagged)]
pub(crate) enum BatchItemDoc {
    /// The item's result.
    Result(EnqueuedDoc),
    /// The item's error.
    Error {
        /// The problem document.
        error: Box<ProblemDoc>,
    },
}

/// A batch's answer.
#[derive(Serialize, ToSchema)]
#[schema(as = BatchResults)]
pub(crate) struct BatchResultsDoc {
    /// One per request, in order.
    results: Vec<BatchItemDoc>,
}

/// Conflict details of an explain.
#[derive(Serialize, ToSchema)]
#[schema(as = ExplainConflict)]
pub(crate) struct ExplainConflictDoc {
    job_id: String,
    fields: Vec<String>,
}

/// A live idempotency binding as explain reports it.
#[derive(Serialize, ToSchema)]
#[schema(as = ExplainIdempotency)]
pub(crate) struct ExplainIdempotencyDoc {
    job_id: String,
    expires_at: DateTime<Utc>,
}

/// A live dedupe binding.
#[derive(Serialize, ToSchema)]
#[schema(as = DedupeBinding)]
pub(crate) struct DedupeBindingDoc {
    /// The keyed job.
    job_id: String,
    /// `pending`, `throttle`, `debounce` or `replace`.
    mode: String,
    /// The end of its window (null for modes live while the job is pending).
    window_until: Option<DateTime<Utc>>,
}

/// What an enqueue would do now, and why.
#[derive(Serialize, ToSchema)]
#[schema(as = Explain)]
pub(crate) struct ExplainDoc {
    /// As enqueue's outcome, or `conflict`.
    outcome: String,
    /// For `non_replaceable`.
    reason: Option<String>,
    /// The job the enqueue would return.
    job_id: Option<String>,
    conflict: Option<ExplainConflictDoc>,
    idempotency: Option<ExplainIdempotencyDoc>,
    dedupe: Option<DedupeBindingDoc>,
}

/// The idempotency key a job was accepted under.
#[derive(Serialize, ToSchema)]
#[schema(as = JobIdempotency)]
pub(crate) struct JobIdempotencyDoc {
    scope: String,
    key_preview: String,
    key_digest: String,
    expires_at: Option<DateTime<Utc>>,
}

/// The job's own dedupe key.
#[derive(Serialize, ToSchema)]
#[schema(as = JobDedupe)]
pub(crate) struct JobDedupeDoc {
    key: String,
    mode: String,
    window_until: Option<DateTime<Utc>>,
    holds_binding: bool,
}

/// A job.
#[derive(Serialize, ToSchema)]
#[schema(as = Job)]
pub(crate) struct JobDoc {
    id: String,
    #[serde(rename = "type")]
    job_type: String,
    queue: String,
    /// `scheduled`, `ready`, `active`, `completed`, `dead` or `cancelled`.
    state: String,
    payload: Value,
    result: Option<Value>,
    priority: i16,
    /// Claims so far.
    attempt: i32,
    /// Consumed attempts.
    attempts_used: i32,
    max_attempts: i32,
    run_at: DateTime<Utc>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    retry: RetryDoc,
    timeout_ms: i64,
    deadline: Option<DateTime<Utc>>,
    concurrency_key: Option<String>,
    tags: Vec<String>,
    keep_ms: Option<i64>,
    last_error: Option<String>,
    cancel_requested: bool,
    lease_expires_at: Option<DateTime<Utc>>,
    idempotency: Option<JobIdempotencyDoc>,
    dedupe: Option<JobDedupeDoc>,
}

/// A page of jobs, newest first.
#[derive(Serialize, ToSchema)]
#[schema(as = JobPage)]
pub(crate) struct JobPageDoc {
    jobs: Vec<JobDoc>,
    /// The cursor of the next page.
    next_cursor: Option<String>,
}

/// One event.
#[derive(Serialize, ToSchema)]
#[schema(as = Event)]
pub(crate) struct EventDoc {
    seq: i64,
    kind: String,
    at: DateTime<Utc>,
    data: Value,
}

/// A job's events, oldest first.
#[derive(Serialize, ToSchema)]
#[schema(as = Events)]
pub(crate) struct EventsDoc {
    events: Vec<EventDoc>,
}

/// One attempt.
#[derive(Serialize, ToSchema)]
#[schema(as = Run)]
pub(crate) struct RunDoc {
    attempt: i32,
    worker: String,
    started_at: DateTime<Utc>,
    finished_at: Option<DateTime<Utc>>,
    /// `completed`, `failed`, `lease_expired`, `released`, `snoozed`, `cancelled`.
    outcome: Option<String>,
    error: Option<String>,
}

/// A job's run ledger.
#[derive(Serialize, ToSchema)]
#[schema(as = Runs)]
pub(crate) struct RunsDoc {
    runs: Vec<RunDoc>,
}

/// A job's checkpoints.
#[derive(Serialize, ToSchema)]
#[schema(as = Checkpoints)]
pub(crate) struct CheckpointsDoc {
    /// Stored values by step name.
    checkpoints: BTreeMap<String, Value>,
}

/// The answer of a cancel.
#[derive(Serialize, ToSchema)]
#[schema(as = Cancelled)]
pub(crate) struct CancelledDoc {
    /// True when the job turned cancelled, or an active job was flagged.
    cancelled: bool,
    /// Its state after the call.
    state: String,
}

/// The answer of a dedupe cancel.
#[derive(Serialize, ToSchema)]
#[schema(as = CancelledByKey)]
pub(crate) struct CancelledKeyDoc {
    cancelled: bool,
}

/// The answer of a purge.
#[derive(Serialize, ToSchema)]
#[schema(as = Purged)]
pub(crate) struct PurgedDoc {
    purged: bool,
}

/// The answer of a promote.
#[derive(Serialize, ToSchema)]
#[schema(as = Promoted)]
pub(crate) struct PromotedDoc {
    promoted: bool,
}

/// A live idempotency binding.
#[derive(Serialize, ToSchema)]
#[schema(as = Binding)]
pub(crate) struct BindingDoc {
    job_id: String,
    key_preview: String,
    key_digest: String,
    expires_at: DateTime<Utc>,
}

/// The answer of a release.
#[derive(Serialize, ToSchema)]
#[schema(as = Released)]
pub(crate) struct ReleasedDoc {
    released: bool,
}

/// Jobs per state.
#[derive(Serialize, ToSchema)]
#[schema(as = StateCounts)]
pub(crate) struct CountsDoc {
    scheduled: u64,
    ready: u64,
    active: u64,
    completed: u64,
    dead: u64,
    cancelled: u64,
}

/// A queue.
#[derive(Serialize, ToSchema)]
#[schema(as = QueueInfo)]
pub(crate) struct QueueDoc {
    name: String,
    paused: bool,
    counts: CountsDoc,
    /// The states whose count is an estimate (empty: every count is exact).
    /// On PostgreSQL, the terminal states of a large table.
    estimated: Vec<String>,
}

/// Every queue.
#[derive(Serialize, ToSchema)]
#[schema(as = Queues)]
pub(crate) struct QueuesDoc {
    queues: Vec<QueueDoc>,
}

/// Whether a queue is paused.
#[derive(Serialize, ToSchema)]
#[schema(as = Paused)]
pub(crate) struct PausedDoc {
    paused: bool,
}

/// A claimed job.
#[derive(Serialize, ToSchema)]
#[schema(as = ClaimedJob)]
pub(crate) struct ClaimedJobDoc {
    id: String,
    #[serde(rename = "type")]
    job_type: String,
    queue: String,
    payload: Value,
    /// 1 on the first claim.
    attempt: i32,
    max_attempts: i32,
    /// Presented by every later call of this attempt.
    lease_token: String,
    lease_expires_at: DateTime<Utc>,
    timeout_ms: i64,
    deadline: Option<DateTime<Utc>>,
    tags: Vec<String>,
}

/// The answer of a claim.
#[derive(Serialize, ToSchema)]
#[schema(as = Claimed)]
pub(crate) struct ClaimedDoc {
    jobs: Vec<ClaimedJobDoc>,
    /// With a `complete` member only: one result per completion, in order.
    completed: Option<Vec<CompletionItemDoc>>,
}

/// One completion's result.
#[derive(Serialize, ToSchema)]
#[schema(as = CompletionItem)]
#[serde(untagged)]
pub(crate) enum CompletionItemDoc {
    /// `{"state": "completed"}`.
    Completed(StateDoc),
    /// The item's error (`lease-lost` for a stale token).
    Error {
        /// The problem document.
        error: Box<ProblemDoc>,
    },
}

/// The answer of `POST /v1/jobs/complete`.
#[derive(Serialize, ToSchema)]
#[schema(as = CompletionResults)]
pub(crate) struct CompletedDoc {
    /// One per item, in request order.
    results: Vec<CompletionItemDoc>,
}

/// The answer of a heartbeat.
#[derive(Serialize, ToSchema)]
#[schema(as = Heartbeat)]
pub(crate) struct HeartbeatDoc {
    lease_expires_at: DateTime<Utc>,
    /// The job was cancelled: stop.
    cancel_requested: bool,
}

/// A job's state after a worker call.
#[derive(Serialize, ToSchema)]
#[schema(as = JobStateAnswer)]
pub(crate) struct StateDoc {
    state: String,
}

/// The answer of a fail.
#[derive(Serialize, ToSchema)]
#[schema(as = FailOutcome)]
pub(crate) struct FailDoc {
    /// `scheduled`, `dead` or `cancelled`.
    state: String,
    /// When the next attempt is due, for `scheduled`.
    next_run_at: Option<DateTime<Utc>>,
}

/// `PUT /v1/schedules/{name}`: a cron expression or an interval, and a job template.
#[derive(Serialize, ToSchema)]
#[schema(as = ScheduleDefinition)]
#[serde(deny_unknown_fields)]
pub(crate) struct ScheduleDefinitionDoc {
    /// Six fields, seconds first (`0 */5 * * * *`).
    cron: Option<String>,
    /// An interval ≥ 1000, anchored at the schedule's creation.
    #[schema(minimum = 1000, maximum = 3162240000000_i64)]
    every_ms: Option<i64>,
    /// IANA zone of the cron expression (`UTC`).
    timezone: Option<String>,
    /// The template (no idempotency key, `job_id`, `run_at` or `deadline`).
    job: EnqueueDoc,
    /// A paused schedule does not fire.
    paused: Option<bool>,
}

/// A schedule.
#[derive(Serialize, ToSchema)]
#[schema(as = Schedule)]
pub(crate) struct ScheduleDoc {
    name: String,
    cron: Option<String>,
    every_ms: Option<i64>,
    timezone: String,
    job: EnqueueDoc,
    paused: bool,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    last_fired_at: Option<DateTime<Utc>>,
    next_fire_at: Option<DateTime<Utc>>,
    /// Present when the latest tick that could not be enqueued (its template
    /// over the payload limit, say) was passed: why. Cleared by the next tick
    /// that fires.
    last_error: Option<String>,
    /// When `last_error` was recorded.
    last_error_at: Option<DateTime<Utc>>,
}

/// Every schedule.
#[derive(Serialize, ToSchema)]
#[schema(as = Schedules)]
pub(crate) struct SchedulesDoc {
    schedules: Vec<ScheduleDoc>,
}

/// The answer of a delete.
#[derive(Serialize, ToSchema)]
#[schema(as = Deleted)]
pub(crate) struct DeletedDoc {
    deleted: bool,
}

/// The answer of `/healthz`.
#[derive(Serialize, ToSchema)]
#[schema(as = Health)]
pub(crate) struct HealthDoc {
    ok: bool,
    /// `sqlite`, `postgres`, …
    backend: String,
}

/// Adds the bearer token scheme.
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Adds to every operation the problem responses every route can answer:
/// the token and Host checks (401, 403), another method on the path (405),
/// a body the server cannot read or accept (400, 413, 422), a path or query
/// that names nothing valid (400, 404, 422), and the backend (500, 503).
/// An operation's own description of one of these is kept.
struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let problem = |text: &str| {
            ResponseBuilder::new().description(text).content(
                "application/problem+json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            )
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                let has_body = op.request_body.is_some();
                let has_params = op.parameters.as_ref().is_some_and(|p| !p.is_empty());
                let mut add = |code: &str, text: &str| {
                    op.responses
                        .responses
                        .entry(code.to_owned())
                        .or_insert_with(|| problem(text).build().into());
                };
                if path != "/healthz" {
                    add(
                        "401",
                        "`unauthorized`: the server has a token and the request did not present it",
                    );
                }
                add(
                    "403",
                    "`forbidden-host`: the server has no token and the Host is not a loopback or allowed name",
                );
                add(
                    "405",
                    "`method-not-allowed`: another method on this path (the `Allow` header lists those served)",
                );
                if has_body {
                    add(
                        "400",
                        "`bad-request`: the body is not JSON, not sent as application/json, or a member is unknown or of the wrong type",
                    );
                    add(
                        "413",
                        "`payload-too-large`: the body or a payload is over its limit",
                    );
                    add(
                        "422",
                        "`validation`: a member breaks a bound (members `field`, `reason`)",
                    );
                }
                if has_params {
                    add(
                        "400",
                        "`bad-request`: a path or query parameter cannot be read",
                    );
                    add("404", "`not-found`");
                    add(
                        "422",
                        "`validation`: a parameter breaks a bound (members `field`, `reason`)",
                    );
                }
                add(
                    "500",
                    "`internal`: an unexpected failure, logged by the server",
                );
                let unavailable = problem(
                    "`unavailable`: the backend is down or busy; retry after `Retry-After` seconds",
                )
                .header(
                    "Retry-After",
                    utoipa::openapi::HeaderBuilder::new()
                        .schema(Some(
                            utoipa::openapi::ObjectBuilder::new()
                                .schema_type(utoipa::openapi::schema::Type::Integer),
                        ))
                        .description(Some("Seconds to wait before retrying"))
                        .build(),
                );
                op.responses
                    .responses
                    .entry("503".to_owned())
                    .or_insert_with(|| unavailable.build().into());
            }
        }
    }
}

/// The whole API.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "idemq HTTP API",
        version = "1",
        description = "A durable job queue whose promise is: each piece of work is accepted once. \
            Every error is an RFC 9457 problem document. With a token configured, every request \
            but GET /healthz needs `Authorization: Bearer <token>`."
    ),
    modifiers(&BearerToken, &CommonResponses),
    security(("token" = [])),
    paths(
        super::enqueue::enqueue,
        super::enqueue::batch,
        super::enqueue::explain,
        super::jobs::get_job,
        super::jobs::list,
        super::jobs::events,
        super::jobs::runs,
        super::jobs::checkpoints,
        super::jobs::cancel,
        super::jobs::purge,
        super::jobs::promote,
        super::jobs::redrive,
        super::jobs::bulk,
        super::keys::dedupe_cancel,
        super::keys::dedupe_lookup,
        super::keys::idempotency_lookup,
        super::keys::idempotency_release,
        super::keys::queues,
        super::keys::pause,
        super::keys::resume,
        super::worker::claim,
        super::worker::complete_many,
        super::worker::heartbeat,
        super::worker::complete,
        super::worker::fail,
        super::worker::release,
        super::worker::checkpoint,
        super::schedules::list,
        super::schedules::put,
        super::schedules::delete,
        super::ops::healthz,
        super::ops::metrics,
        super::ops::openapi,
        super::problem::page,
    ),
    tags(
        (name = "enqueue", description = "Enqueue, batch and explain"),
        (name = "jobs", description = "Job queries and operator actions"),
        (name = "bindings", description = "Idempotency and dedupe bindings"),
        (name = "queues", description = "Queues"),
        (name = "worker", description = "The worker protocol"),
        (name = "schedules", description = "Repeatable jobs"),
        (name = "operations", description = "Health, metrics, this document, problem pages"),
    )
)]
struct ApiDoc;

/// The OpenAPI document as pretty JSON.
pub(crate) fn openapi_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    use idemq::request::bounds;
    use serde_json::Value;

    /// The document names every problem type the server answers with.
    #[test]
    fn every_problem_type_is_named() {
        let doc: Value = serde_json::from_str(&super::openapi_json()).expect("json");
        let described =
            doc["components"]["schemas"]["Problem"]["properties"]["type"]["description"]
                .as_str()
                .expect("Problem.type is described");
        let listed = described.split_once(':').map_or("", |(_, l)| l);
        let listed: Vec<&str> = listed
            .split(',')
            .map(|n| n.trim_matches(|c: char| c == '.' || c.is_whitespace()))
            .collect();
        let types: Vec<&str> = crate::api::problem::TYPES.iter().map(|t| t.0).collect();
        assert_eq!(
            listed, types,
            "Problem.type lists the types of problem.rs, in order"
        );
    }

    /// The bounds the document states are the library's constants: an
    /// attribute cannot name a constant, so this pins each literal to it.
    #[test]
    fn stated_bounds_are_the_library_bounds() {
        let doc: Value = serde_json::from_str(&super::openapi_json()).expect("json");
        let schemas = &doc["components"]["schemas"];
        let prop = |schema: &str, member: &str, key: &str| {
            schemas[schema]["properties"][member][key]
                .as_i64()
                .unwrap_or_else(|| panic!("{schema}.{member} states no {key}"))
        };
        let n = |v: usize| v as i64;
        let cases: &[(&str, &str, &str, i64)] = &[
            (
                "EnqueueRequest",
                "type",
                "maxLength",
                n(bounds::MAX_TYPE_BYTES),
            ),
            (
                "EnqueueRequest",
                "queue",
                "maxLength",
                n(bounds::MAX_QUEUE_BYTES),
            ),
            (
                "EnqueueRequest",
                "job_id",
                "maxLength",
                n(bounds::MAX_JOB_ID_BYTES),
            ),
            (
                "EnqueueRequest",
                "max_attempts",
                "maximum",
                bounds::MAX_ATTEMPTS,
            ),
            (
                "EnqueueRequest",
                "timeout_ms",
                "maximum",
                bounds::MAX_TIMEOUT_MS,
            ),
            (
                "EnqueueRequest",
                "delay_ms",
                "maximum",
                bounds::MAX_DURATION_MS,
            ),
            (
                "EnqueueRequest",
                "keep_ms",
                "maximum",
                bounds::MAX_DURATION_MS,
            ),
            ("EnqueueRequest", "tags", "maxItems", n(bounds::MAX_TAGS)),
            (
                "EnqueueRequest",
                "concurrency_key",
                "maxLength",
                n(bounds::MAX_KEY_BYTES),
            ),
            ("Idempotency", "key", "maxLength", n(bounds::MAX_KEY_BYTES)),
            (
                "Idempotency",
                "scope",
                "maxLength",
                n(bounds::MAX_SCOPE_BYTES),
            ),
            (
                "Idempotency",
                "ttl_ms",
                "minimum",
                bounds::MIN_IDEMPOTENCY_TTL_MS,
            ),
            ("Idempotency", "ttl_ms", "maximum", bounds::THIRTY_DAYS_MS),
            (
                "DedupeOptions",
                "key",
                "maxLength",
                n(bounds::MAX_KEY_BYTES),
            ),
            ("DedupeOptions", "ttl_ms", "maximum", bounds::THIRTY_DAYS_MS),
            (
                "DedupeOptions",
                "max_wait_ms",
                "maximum",
                bounds::THIRTY_DAYS_MS,
            ),
            (
                "ClaimBody",
                "worker",
                "maxLength",
                n(bounds::MAX_WORKER_BYTES),
            ),
            (
                "ClaimBody",
                "limit",
                "maximum",
                i64::from(bounds::MAX_CLAIM_LIMIT),
            ),
            ("ClaimBody", "lease_ms", "minimum", bounds::MIN_LEASE_MS),
            ("ClaimBody", "lease_ms", "maximum", bounds::MAX_LEASE_MS),
            (
                "ClaimBody",
                "wait_ms",
                "maximum",
                super::super::jobs::MAX_WAIT_MS as i64,
            ),
            (
                "ClaimBody",
                "complete",
                "maxItems",
                n(idemq::MAX_BATCH_ITEMS),
            ),
            (
                "CompleteManyBody",
                "jobs",
                "maxItems",
                n(idemq::MAX_BATCH_ITEMS),
            ),
            (
                "BatchRequest",
                "jobs",
                "maxItems",
                n(idemq::MAX_BATCH_ITEMS),
            ),
            ("KeyBody", "key", "maxLength", n(bounds::MAX_KEY_BYTES)),
            ("KeyBody", "scope", "maxLength", n(bounds::MAX_SCOPE_BYTES)),
            (
                "RedriveBody",
                "max_attempts",
                "maximum",
                bounds::MAX_ATTEMPTS,
            ),
            ("FailBody", "snooze_ms", "maximum", bounds::MAX_DURATION_MS),
            (
                "FailBody",
                "retry_after_ms",
                "maximum",
                bounds::MAX_DURATION_MS,
            ),
            (
                "ScheduleDefinition",
                "every_ms",
                "minimum",
                idemq::schedule::MIN_EVERY_MS,
            ),
        ];
        for (schema, member, key, want) in cases {
            assert_eq!(prop(schema, member, key), *want, "{schema}.{member} {key}");
        }
    }
}
