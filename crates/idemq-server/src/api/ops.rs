//! Operations: `/healthz`, `/metrics` and `/openapi.json`.

use std::sync::OnceLock;
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};

use super::ApiState;
use super::problem::{ApiResult, Problem, unavailable};

/// The answer of `/healthz`.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub(crate) struct Health {
    ok: bool,
    /// `sqlite`, `postgres`, …
    backend: &'static str,
    durability: Durability,
}

/// `full`, or `relaxed` when the store was opened without its durability
/// settings checked (Redis `?durability=relaxed`): acknowledged jobs may
/// then be lost.
#[derive(serde::Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Durability {
    /// Every acknowledged job is on disk.
    Full,
    /// The store's durable settings were not checked.
    Relaxed,
}

impl From<&idemq::Durability> for Durability {
    fn from(d: &idemq::Durability) -> Self {
        if d.is_relaxed() {
            Self::Relaxed
        } else {
            Self::Full
        }
    }
}

/// How long the health probe waits for the backend.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Whether the backend answers. Never needs the token.
#[utoipa::path(
    get,
    path = "/healthz",
    operation_id = "getHealth",
    tag = "operations",
    security(()),
    responses(
        (status = 200, description = "The backend answers", body = Health),
        (status = 503, description = "The backend is unreachable (members `ok: false`, `backend`)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn healthz(State(s): State<ApiState>) -> ApiResult<Response> {
    let backend = s.queue().backend();
    // A key lookup reaches the database on every backend (the embedded
    // store's clock alone would answer without it).
    match tokio::time::timeout(HEALTH_TIMEOUT, s.queue().get("healthz")).await {
        Ok(Ok(_)) => Ok(axum::Json(Health {
            ok: true,
            backend,
            durability: Durability::from(&s.queue().durability()),
        })
        .into_response()),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "health check failed");
            Err(unavailable("the backend is unreachable", 1)
                .with("ok", false)
                .with("backend", backend))
        }
        Err(_) => Err(unavailable("the backend did not answer in time", 1)
            .with("ok", false)
            .with("backend", backend)),
    }
}

/// Prometheus text exposition.
#[utoipa::path(
    get,
    path = "/metrics",
    operation_id = "getMetrics",
    tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String))
)]
pub(crate) async fn metrics(State(s): State<ApiState>) -> Response {
    // Queue depth is read at scrape time; a backend that cannot answer
    // leaves the depths out rather than failing the whole scrape.
    let queues = match s.queue().queues().await {
        Ok(q) => q,
        Err(e) => {
            tracing::warn!(error = %e, "queue depth unavailable for metrics");
            Vec::new()
        }
    };
    let relaxed = s.queue().durability().is_relaxed();
    let mut response = s
        .metrics
        .render(&queues, s.queue().stats(), relaxed)
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

/// The OpenAPI 3.1 document of the API, generated from the code.
#[utoipa::path(
    get,
    path = "/openapi.json",
    operation_id = "getOpenApi",
    tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document", content_type = "application/json", body = Object))
)]
pub(crate) async fn openapi() -> Response {
    static DOC: OnceLock<String> = OnceLock::new();
    let doc = DOC.get_or_init(super::schema::openapi_json);
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        doc.clone(),
    )
        .into_response()
}
