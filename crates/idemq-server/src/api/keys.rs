//! Bindings and queues: dedupe cancel and lookup, idempotency lookup and
//! release (the key travels in the body, never in a URL), queue list, pause
//! and resume.

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ApiState;
use super::extract::{Json, NoBody, Path};
use super::problem::{ApiResult, Problem};

/// The answer of a dedupe cancel.
#[derive(Serialize, ToSchema)]
#[schema(as = CancelledByKey)]
pub(crate) struct CancelledByKey {
    /// `false` when no pending job of that type has that key.
    cancelled: bool,
}

/// The answer of a release.
#[derive(Serialize, ToSchema)]
pub(crate) struct Released {
    /// Whether a live binding was released.
    released: bool,
}

/// Every queue.
#[derive(Serialize, ToSchema)]
pub(crate) struct Queues {
    queues: Vec<idemq::QueueInfo>,
}

/// Whether a queue is paused.
#[derive(Serialize, ToSchema)]
pub(crate) struct Paused {
    paused: bool,
}

/// A dedupe key of a job type (any strings: a type or key no job has
/// matches nothing).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct DedupeKeyBody {
    /// The job type the key is scoped to.
    #[serde(rename = "type")]
    job_type: String,
    /// The dedupe key.
    key: String,
}

/// An idempotency key and its scope. The key is never logged.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct KeyBody {
    /// The scope (`default` when omitted; the reserved `idemq.` scopes may be named).
    #[serde(default)]
    #[schema(value_type = Option<idemq::openapi::Scope>)]
    scope: Option<String>,
    /// The raw key (1–255 characters).
    #[schema(value_type = idemq::openapi::Key)]
    key: String,
}

impl std::fmt::Debug for KeyBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyBody")
            .field("scope", &self.scope)
            .finish_non_exhaustive()
    }
}

/// Cancels every pending job of a type with a dedupe key and releases the binding.
#[utoipa::path(
    post,
    path = "/v1/dedupe/cancel",
    operation_id = "cancelByDedupeKey",
    tag = "bindings",
    request_body = DedupeKeyBody,
    responses(
        (status = 200, description = "`false` when no pending job of that type has that key", body = CancelledByKey),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn dedupe_cancel(
    State(s): State<ApiState>,
    Json(body): Json<DedupeKeyBody>,
) -> ApiResult<axum::Json<CancelledByKey>> {
    let cancelled = s.queue().cancel_by_key(&body.job_type, &body.key).await?;
    Ok(axum::Json(CancelledByKey { cancelled }))
}

/// The live dedupe binding of a key.
#[utoipa::path(
    get,
    path = "/v1/dedupe/{type}/{key}",
    operation_id = "lookupDedupeKey",
    tag = "bindings",
    params(
        ("type" = String, Path, description = "The job type (one no job has matches nothing)"),
        ("key" = String, Path, description = "The dedupe key"),
    ),
    responses(
        (status = 200, description = "The binding", body = idemq::store::ExplainDedupe),
        (status = 404, description = "No live binding", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn dedupe_lookup(
    State(s): State<ApiState>,
    Path((job_type, key)): Path<(String, String)>,
) -> ApiResult<axum::Json<idemq::store::ExplainDedupe>> {
    s.queue()
        .dedupe_lookup(&job_type, &key)
        .await?
        .map(axum::Json)
        .ok_or_else(|| Problem::not_found("dedupe binding"))
}

/// Which job a live idempotency key is bound to.
#[utoipa::path(
    post,
    path = "/v1/idempotency/lookup",
    operation_id = "lookupIdempotencyKey",
    tag = "bindings",
    request_body = KeyBody,
    responses(
        (status = 200, description = "The binding (preview and digest only)", body = idemq::BindingInfo),
        (status = 404, description = "No live binding", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn idempotency_lookup(
    State(s): State<ApiState>,
    Json(body): Json<KeyBody>,
) -> ApiResult<axum::Json<idemq::BindingInfo>> {
    let scope = body.scope.as_deref().unwrap_or("default");
    s.queue()
        .lookup_key(scope, &body.key)
        .await?
        .map(axum::Json)
        .ok_or_else(|| Problem::not_found("idempotency binding"))
}

/// Releases a live idempotency binding (an operator action).
#[utoipa::path(
    post,
    path = "/v1/idempotency/release",
    operation_id = "releaseIdempotencyKey",
    tag = "bindings",
    request_body = KeyBody,
    responses(
        (status = 200, description = "Whether a live binding was released", body = Released),
        (status = 422, description = "Validation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn idempotency_release(
    State(s): State<ApiState>,
    Json(body): Json<KeyBody>,
) -> ApiResult<axum::Json<Released>> {
    let scope = body.scope.as_deref().unwrap_or("default");
    let released = s.queue().release_key(scope, &body.key).await?;
    Ok(axum::Json(Released { released }))
}

/// Queues with counts by state.
#[utoipa::path(
    get,
    path = "/v1/queues",
    operation_id = "listQueues",
    tag = "queues",
    responses((status = 200, description = "Every queue", body = Queues))
)]
pub(crate) async fn queues(State(s): State<ApiState>) -> ApiResult<axum::Json<Queues>> {
    let queues = s.queue().queues().await?;
    Ok(axum::Json(Queues { queues }))
}

/// Pauses a queue: enqueue still accepts, claims skip it.
#[utoipa::path(
    post,
    path = "/v1/queues/{name}/pause",
    operation_id = "pauseQueue",
    tag = "queues",
    params(("name" = idemq::openapi::QueueName, Path, description = "The queue")),
    responses(
        (status = 200, description = "The queue is paused", body = Paused),
        (status = 422, description = "Invalid queue name", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn pause(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    _: NoBody,
) -> ApiResult<axum::Json<Paused>> {
    let paused = s.queue().pause(&name).await?;
    Ok(axum::Json(Paused { paused }))
}

/// Resumes a paused queue.
#[utoipa::path(
    post,
    path = "/v1/queues/{name}/resume",
    operation_id = "resumeQueue",
    tag = "queues",
    params(("name" = idemq::openapi::QueueName, Path, description = "The queue")),
    responses(
        (status = 200, description = "The queue is not paused", body = Paused),
        (status = 422, description = "Invalid queue name", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn resume(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    _: NoBody,
) -> ApiResult<axum::Json<Paused>> {
    let paused = s.queue().resume(&name).await?;
    Ok(axum::Json(Paused { paused }))
}
