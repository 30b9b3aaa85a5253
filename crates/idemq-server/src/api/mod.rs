//! The HTTP API v1 (docs/http-api.md): every route, its problem documents, the token
//! check, the body limits, metrics and the OpenAPI document.
//!
//! Handlers only call [`idemq::Queue`] methods. Request bodies and the
//! `Idempotency-Key` header are never logged.

pub(crate) mod auth;
mod bounded;
mod enqueue;
mod extract;
mod jobs;
mod keys;
mod long_poll;
mod metrics;
mod ops;
pub(crate) mod problem;
mod schedules;
pub(crate) mod schema;
mod worker;

use std::sync::Arc;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post, put};

use crate::AppState;

pub(crate) use jobs::MAX_PAGE_BYTES;

/// What the API handlers share: the server's state, the metrics recorder,
/// the wake-up source of long-polling claims and the bound on long-polls.
#[derive(Clone)]
pub(crate) struct ApiState {
    pub(crate) app: AppState,
    pub(crate) metrics: Arc<metrics::Metrics>,
    pub(crate) wakeups: Arc<worker::WakeHub>,
    pub(crate) long_polls: Arc<long_poll::LongPolls>,
}

impl ApiState {
    /// The queue.
    pub(crate) fn queue(&self) -> &idemq::Queue {
        &self.app.queue
    }
}

/// Every API route (and `/healthz`, `/metrics`, `/openapi.json`, `/problems/*`),
/// behind the token check.
pub(crate) fn routes(state: AppState) -> Router {
    let body_limit = state.queue.payload_limit() + extract::BODY_OVERHEAD;
    let api = ApiState {
        app: state.clone(),
        metrics: Arc::new(metrics::Metrics::new()),
        wakeups: Arc::new(worker::WakeHub::default()),
        long_polls: Arc::new(long_poll::LongPolls::new(state.options.max_long_polls)),
    };
    let router = Router::new()
        // Enqueue. A fixed path beside `/v1/jobs/{id}` wins over it, and a
        // job may have its name as id: each also serves that job's GET.
        .route("/v1/jobs", post(enqueue::enqueue).get(jobs::list))
        .route(
            "/v1/jobs/batch",
            post(enqueue::batch)
                .layer(DefaultBodyLimit::max(extract::BATCH_BODY_LIMIT))
                .merge(jobs::get_job_named("batch")),
        )
        .route(
            "/v1/jobs/explain",
            post(enqueue::explain).merge(jobs::get_job_named("explain")),
        )
        .route(
            "/v1/jobs/bulk",
            post(jobs::bulk).merge(jobs::get_job_named("bulk")),
        )
        .route(
            "/v1/jobs/complete",
            post(worker::complete_many)
                .layer(DefaultBodyLimit::max(extract::BATCH_BODY_LIMIT))
                .merge(jobs::get_job_named("complete")),
        )
        // Jobs.
        .route("/v1/jobs/{id}", get(jobs::get_job))
        .route("/v1/jobs/{id}/events", get(jobs::events))
        .route("/v1/jobs/{id}/runs", get(jobs::runs))
        .route("/v1/jobs/{id}/checkpoints", get(jobs::checkpoints))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route("/v1/jobs/{id}/purge", post(jobs::purge))
        .route("/v1/jobs/{id}/promote", post(jobs::promote))
        .route("/v1/jobs/{id}/redrive", post(jobs::redrive))
        // Keys.
        .route("/v1/dedupe/cancel", post(keys::dedupe_cancel))
        .route("/v1/dedupe/{type}/{key}", get(keys::dedupe_lookup))
        .route("/v1/idempotency/lookup", post(keys::idempotency_lookup))
        .route("/v1/idempotency/release", post(keys::idempotency_release))
        // Queues.
        .route("/v1/queues", get(keys::queues))
        .route("/v1/queues/{name}/pause", post(keys::pause))
        .route("/v1/queues/{name}/resume", post(keys::resume))
        // Worker protocol.
        .route(
            "/v1/claim",
            post(worker::claim).layer(DefaultBodyLimit::max(extract::BATCH_BODY_LIMIT)),
        )
        .route("/v1/jobs/{id}/heartbeat", post(worker::heartbeat))
        .route("/v1/jobs/{id}/complete", post(worker::complete))
        .route("/v1/jobs/{id}/fail", post(worker::fail))
        .route("/v1/jobs/{id}/release", post(worker::release))
        .route("/v1/jobs/{id}/checkpoints/{name}", put(worker::checkpoint))
        // Schedules.
        .route("/v1/schedules", get(schedules::list))
        .route(
            "/v1/schedules/{name}",
            put(schedules::put).delete(schedules::delete),
        )
        // Operations.
        .route("/healthz", get(ops::healthz))
        .route("/metrics", get(ops::metrics))
        .route("/openapi.json", get(ops::openapi))
        .route("/problems/{name}", get(problem::page))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::middleware::from_fn_with_state(
            (body_limit, extract::BATCH_BODY_LIMIT),
            extract::limit_declared_length,
        ))
        .with_state(api);
    auth::protect(router, state).layer(tower_http::trace::TraceLayer::new_for_http())
}

/// The 404 problem of every unknown route (the server's fallback).
pub(crate) async fn not_found() -> problem::Problem {
    problem::no_route().await
}
