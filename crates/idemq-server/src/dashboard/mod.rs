//! The operator dashboard: server-rendered pages, assets embedded in the binary.

use axum::Router;

use crate::AppState;

/// Every dashboard route (`/`, `/jobs`, …).
pub(crate) fn routes(state: AppState) -> Router {
    Router::new().with_state(state)
}
