//! # idemq-server
//!
//! idemq's HTTP API (v1, see docs/http-api.md) and operator dashboard, as a library.
//! It never touches SQL: every handler calls a method of [`idemq::Queue`].
//!
//! Mount it in your own axum application with [`router`], or run it with
//! [`serve`] on a listener you bound.

mod api;
mod dashboard;

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use idemq::Queue;

/// Settings of the server.
#[derive(Clone, Default)]
pub struct ServerOptions {
    /// With a token, every request but `GET /healthz` needs
    /// `Authorization: Bearer <token>` (or the dashboard's cookie).
    pub token: Option<String>,
    /// Without a token, the `Host` names besides the loopback ones
    /// (`127.0.0.1`, `[::1]`, `localhost`) the server answers; any other
    /// `Host` gets `403 forbidden-host`, so a web page cannot reach an open
    /// local server through DNS rebinding. A name without a port matches any
    /// port. Ignored with a token.
    pub allowed_hosts: Vec<String>,
}

impl std::fmt::Debug for ServerOptions {
    // The token never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("allowed_hosts", &self.allowed_hosts)
            .finish()
    }
}

/// What every handler shares.
#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) queue: Queue,
    pub(crate) options: Arc<ServerOptions>,
}

/// The API and the dashboard as one axum router.
pub fn router(queue: Queue, options: ServerOptions) -> Router {
    let state = AppState {
        queue,
        options: Arc::new(options),
    };
    let router = Router::new()
        .merge(api::routes(state.clone()))
        .merge(dashboard::routes(state.clone()))
        .fallback(api::not_found);
    // The token guards everything (API, dashboard, unknown routes) but /healthz;
    // without one, the Host check guards everything.
    api::auth::protect(router, state).layer(axum::middleware::map_response(
        api::problem::method_not_allowed,
    ))
}

/// Serves [`router`] on `listener` until `shutdown` resolves, then finishes
/// the requests in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    queue: Queue,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(queue, options))
        .with_graceful_shutdown(shutdown)
        .await
}
