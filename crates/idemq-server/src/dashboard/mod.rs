//! The operator dashboard: server-rendered pages, assets embedded in the binary.
//!
//! Pages (`GET`): `/` overview, `/jobs` list, `/jobs/{id}` one job, `/dead`
//! dead letters, `/schedules`, `/bindings`, `/login`. Operator actions are
//! `POST` forms under `/dashboard/actions/…` that redirect back
//! (post/redirect/get). The throughput chart polls `/dashboard/stats.json`;
//! the CSS and JS are served from `/dashboard/static/`. Every call goes
//! through [`idemq::Queue`]; none touches SQL.

mod actions;
mod html;
mod jobs;
mod login;
mod overview;
mod pages;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::AppState;
use html::{Nav, esc, page, respond};

/// Paths the auth middleware lets through without a token, so an operator
/// can reach the login form (and its stylesheet) before holding the cookie.
/// An entry ending in `/` is a prefix; any other entry matches exactly.
/// `GET /healthz` is exempt on its own account (the API's).
pub(crate) const PUBLIC_PATHS: &[&str] = &["/login", "/dashboard/static/"];

/// Whether `path` needs no token (see [`PUBLIC_PATHS`]).
pub(crate) fn is_public(path: &str) -> bool {
    PUBLIC_PATHS.iter().any(|p| {
        if p.ends_with('/') {
            path.starts_with(p)
        } else {
            path == *p
        }
    })
}

/// Every dashboard route (`/`, `/jobs`, …).
pub(crate) fn routes(state: AppState) -> Router {
    Router::new()
        .route("/", get(overview::page))
        .route("/dashboard/stats.json", get(overview::stats))
        .route("/jobs", get(jobs::list))
        .route("/jobs/{id}", get(jobs::show))
        .route("/dead", get(pages::dead))
        .route("/schedules", get(pages::schedules))
        .route("/bindings", get(pages::bindings))
        .route("/bindings/lookup", post(pages::binding_lookup))
        .route("/login", get(login::form).post(login::submit))
        .route("/logout", post(login::logout))
        .route("/dashboard/actions/jobs/{id}/{action}", post(actions::job))
        .route(
            "/dashboard/actions/queues/{name}/{action}",
            post(actions::queue),
        )
        .route("/dashboard/static/dashboard.css", get(css))
        .route("/dashboard/static/dashboard.js", get(js))
        .with_state(state)
}

async fn css() -> Response {
    asset(
        "text/css; charset=utf-8",
        include_str!("../../assets/dashboard.css"),
    )
}

async fn js() -> Response {
    asset(
        "text/javascript; charset=utf-8",
        include_str!("../../assets/dashboard.js"),
    )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut res = body.into_response();
    let h = res.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("public, max-age=300"),
    );
    h.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    res
}

/// What a dashboard handler can fail with, rendered as an error page.
#[derive(Debug)]
pub(crate) struct PageError {
    status: StatusCode,
    message: String,
}

impl PageError {
    /// A page error with a status and a message for the operator.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl From<idemq::Error> for PageError {
    fn from(e: idemq::Error) -> Self {
        use idemq::Error as E;
        let status = match &e {
            E::Validation { .. } | E::PayloadTooLarge { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            E::EnqueueIdempotencyConflict(_) | E::LeaseLost { .. } | E::NotDead { .. } => {
                StatusCode::CONFLICT
            }
            E::NotFound { .. } => StatusCode::NOT_FOUND,
            E::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!(error = %e, "dashboard request failed");
        }
        // idemq errors never hold a raw key, so the message may be shown.
        Self {
            status,
            message: e.to_string(),
        }
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        let body = format!(
            r#"<p class="error-box">{}</p><p><a href="/">Back to the overview</a></p>"#,
            esc(&self.message)
        );
        let title = self.status.canonical_reason().unwrap_or("Error");
        respond(self.status, page(title, Nav::None, None, &body))
    }
}

/// A dashboard handler's result.
pub(crate) type PageResult = Result<Response, PageError>;

/// Refuses a state-changing request that another site's page sent.
///
/// With a token the cookie is `SameSite=Strict`, which already keeps it off
/// cross-site requests; without one the dashboard is open on loopback, so a
/// hostile page in the operator's browser could otherwise post an action.
/// Browsers send `Origin` (and `Sec-Fetch-Site`) on form posts; a request
/// with neither (curl, tests) is let through.
pub(crate) fn check_same_origin(headers: &HeaderMap) -> Result<(), PageError> {
    let forbidden = || PageError::new(StatusCode::FORBIDDEN, "cross-site request refused");
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && !matches!(site, "same-origin" | "none")
    {
        return Err(forbidden());
    }
    if let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        let origin_host = origin.split_once("://").map_or("", |(_, h)| h);
        if origin == "null" || origin_host != host {
            return Err(forbidden());
        }
    }
    Ok(())
}

/// A local path to redirect back to; anything else (another host, a
/// protocol-relative URL) falls back to `default`.
pub(crate) fn local_back<'a>(back: Option<&'a str>, default: &'a str) -> &'a str {
    match back {
        Some(b) if b.starts_with('/') && !b.starts_with("//") && !b.contains('\\') => b,
        _ => default,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_paths_cover_login_and_assets_only() {
        assert!(is_public("/login"));
        assert!(is_public("/dashboard/static/dashboard.css"));
        assert!(!is_public("/login/x"));
        assert!(!is_public("/"));
        assert!(!is_public("/dashboard/actions/queues/q/pause"));
    }

    #[test]
    fn back_must_be_local() {
        assert_eq!(
            local_back(Some("/jobs?state=dead"), "/"),
            "/jobs?state=dead"
        );
        assert_eq!(local_back(Some("//evil.example/"), "/"), "/");
        assert_eq!(local_back(Some("https://evil.example/"), "/"), "/");
        assert_eq!(local_back(Some("/\\evil"), "/"), "/");
        assert_eq!(local_back(None, "/dead"), "/dead");
    }

    #[test]
    fn cross_site_posts_are_refused() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(check_same_origin(&h).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://127.0.0.1:8080"),
        );
        assert!(check_same_origin(&h).is_ok());
        h.insert(
            header::ORIGIN,
            HeaderValue::from_static("http://evil.example"),
        );
        assert!(check_same_origin(&h).is_err());
        h.remove(header::ORIGIN);
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(check_same_origin(&h).is_err());
    }
}
