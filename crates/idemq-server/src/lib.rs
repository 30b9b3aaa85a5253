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
use std::time::Duration;

use axum::Router;
use idemq::Queue;

/// Settings of the server.
#[derive(Clone)]
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
    /// How many long-polls the server holds at once: requests that asked
    /// to wait (`POST /v1/claim` and `GET /v1/jobs/{id}` with a `wait_ms`
    /// above 0), each of which looks at the store again and again while it
    /// waits. A request that asks to wait once this many are held is
    /// answered `503 unavailable` with `Retry-After`; a request that does
    /// not wait is never refused by this bound. 0 refuses every wait.
    /// [`DEFAULT_MAX_LONG_POLLS`] by default.
    pub max_long_polls: usize,
}

/// The default of [`ServerOptions::max_long_polls`]. Each wait holds a
/// connection, and so a file descriptor, for up to 60 s: 512 is half the
/// soft limit of 1,024 descriptors many systems give a process, leaving
/// the rest to the requests that do not wait and to the database. Idle,
/// a waiting claim looks again at least every 500 ms and a waiting job
/// read about every second, so 512 waits cost the store about a thousand
/// empty looks a second, not more.
pub const DEFAULT_MAX_LONG_POLLS: usize = 512;

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            token: None,
            allowed_hosts: Vec::new(),
            max_long_polls: DEFAULT_MAX_LONG_POLLS,
        }
    }
}

impl std::fmt::Debug for ServerOptions {
    // The token never reaches a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("allowed_hosts", &self.allowed_hosts)
            .field("max_long_polls", &self.max_long_polls)
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

/// How long [`serve`] waits for a client, and for its own requests to end.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    /// A request's head (its line and headers) must arrive within this
    /// long of the connection's last response, or of its opening; otherwise
    /// the connection is closed. So a client that sends part of a head and
    /// stops, or keeps an idle connection open, holds it this long at most.
    pub header_read: Duration,
    /// A request body that sends nothing for this long ends the request
    /// (`400`): a client that starts a body and stops.
    pub body_idle: Duration,
    /// Once `shutdown` resolved, how long the requests in flight may take
    /// to end (the longest wait a request may ask for is 60 s); the
    /// connections still open then are closed.
    pub drain: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(60),
            body_idle: Duration::from_secs(60),
            drain: Duration::from_secs(65),
        }
    }
}

/// Serves [`router`] on `listener` until `shutdown` resolves, then finishes
/// the requests in flight (see [`Timeouts`] for the bounds).
pub async fn serve(
    listener: tokio::net::TcpListener,
    queue: Queue,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, queue, options, Timeouts::default(), shutdown).await
}

/// [`serve`] with other [`Timeouts`].
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    queue: Queue,
    options: ServerOptions,
    timeouts: Timeouts,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(queue, options).layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        timeouts.body_idle,
    ));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut connections = tokio::task::JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        // Connections that ended.
        while connections.try_join_next().is_some() {}
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // A connection that failed before it was accepted, or
                    // a process out of descriptors: go on after a pause.
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(hyper_util::rt::TokioTimer::new())
            .header_read_timeout(timeouts.header_read)
            .serve_connection(
                hyper_util::rt::TokioIo::new(stream),
                hyper_util::service::TowerToHyperService::new(app.clone()),
            );
        let connection = graceful.watch(connection);
        connections.spawn(async move {
            // A client that went away, or sent something not HTTP: its own
            // connection's end, nothing to report.
            let _ = connection.await;
        });
    }
    drop(listener);
    if tokio::time::timeout(timeouts.drain, graceful.shutdown())
        .await
        .is_err()
    {
        while connections.try_join_next().is_some() {}
        tracing::warn!(
            connections = connections.len(),
            drain_ms = timeouts.drain.as_millis() as u64,
            "requests still running when the drain time ran out: their connections are closed"
        );
    }
    connections.shutdown().await;
    Ok(())
}
