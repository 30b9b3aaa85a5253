//! Bindings and queues: dedupe cancel and lookup, idempotency lookup and
//! release (the key travels in the body, never in a URL), queue list, pause
//! and resume.

use axum::extract::State;
use serde::Deserialize;
use serde_json::{Value, json};
use utoipa::ToSchema;

use super::ApiState;
use super::extract::{Json, Path};
use super::problem::{ApiResult, Problem};
use super::schema::{
    BindingDoc, CancelledKeyDoc, DedupeBindingDoc, PausedDoc, ProblemDoc, QueuesDoc, ReleasedDoc,
};

/// A dedupe key of a job type.
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
    #[schema(min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9._:-]+$")]
    scope: Option<String>,
    /// The raw key (1–255 bytes of UTF-8).
    #[schema(min_length = 1, max_length = 255, pattern = r"^[^\u0000]+$")]
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
        (status = 200, description = "`false` when no pending job of that type has that key", body = CancelledKeyDoc),
        (status = 400, description = "Malformed body", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn dedupe_cancel(
    State(s): State<ApiState>,
    Json(body): Json<DedupeKeyBody>,
) -> ApiResult<axum::Json<Value>> {
    let cancelled = s.queue().cancel_by_key(&body.job_type, &body.key).await?;
    Ok(axum::Json(json!({ "cancelled": cancelled })))
}

/// The live dedupe binding of a key.
#[utoipa::path(
    get,
    path = "/v1/dedupe/{type}/{key}",
    operation_id = "lookupDedupeKey",
    tag = "bindings",
    params(
        ("type" = String, Path, description = "The job type"),
        ("key" = String, Path, description = "The dedupe key"),
    ),
    responses(
        (status = 200, description = "The binding", body = DedupeBindingDoc),
        (status = 404, description = "No live binding", body = ProblemDoc, content_type = "application/problem+json"),
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
        (status = 200, description = "The binding (preview and digest only)", body = BindingDoc),
        (status = 404, description = "No live binding", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "Validation", body = ProblemDoc, content_type = "application/problem+json"),
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
        (status = 200, description = "Whether a live binding was released", body = ReleasedDoc),
        (status = 422, description = "Validation", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn idempotency_release(
    State(s): State<ApiState>,
    Json(body): Json<KeyBody>,
) -> ApiResult<axum::Json<Value>> {
    let scope = body.scope.as_deref().unwrap_or("default");
    let released = s.queue().release_key(scope, &body.key).await?;
    Ok(axum::Json(json!({ "released": released })))
}

/// Queues with counts by state.
#[utoipa::path(
    get,
    path = "/v1/queues",
    operation_id = "listQueues",
    tag = "queues",
    responses((status = 200, description = "Every queue", body = QueuesDoc))
)]
pub(crate) async fn queues(State(s): State<ApiState>) -> ApiResult<axum::Json<Value>> {
    let queues = s.queue().queues().await?;
    Ok(axum::Json(json!({ "queues": queues })))
}

/// Pauses a queue: enqueue still accepts, claims skip it.
#[utoipa::path(
    post,
    path = "/v1/queues/{name}/pause",
    operation_id = "pauseQueue",
    tag = "queues",
    params(("name" = String, Path, description = "The queue", min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9._:-]+$")),
    responses(
        (status = 200, description = "The queue is paused", body = PausedDoc),
        (status = 422, description = "Invalid queue name", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn pause(
    State(s): State<ApiState>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<Value>> {
    let paused = s.queue().pause(&name).await?;
    Ok(axum::Json(json!({ "paused": paused })))
}

/// Resumes a paused queue.
#[utoipa::path(
    post,
    path = "/v1/queues/{name}/resume",
    operation_id = "resumeQueue",
    tag = "queues",
    params(("name" = String, Path, description = "The queue", min_length = 1, max_length = 64, pattern = r"^[A-Za-z0-9._:-]+$")),
    responses(
        (status = 200, description = "The queue is not paused", body = PausedDoc),
        (status = 422, description = "Invalid queue name", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn resume(
    State(s): State<ApiState>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<Value>> {
    let paused = s.queue().resume(&name).await?;
    Ok(axum::Json(json!({ "paused": paused })))
}
