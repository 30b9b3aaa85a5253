//! The HTTP API v1.

use axum::Router;

use crate::AppState;

/// Every API route (and `/healthz`, `/metrics`, `/openapi.json`, `/problems/*`).
pub(crate) fn routes(state: AppState) -> Router {
    Router::new().with_state(state)
}
