//! The token check: with [`ServerOptions::token`](crate::ServerOptions), every
//! request but `GET /healthz` needs `Authorization: Bearer <token>` or the
//! dashboard's cookie `idemq_token=<token>`, compared in constant time.

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use subtle::ConstantTimeEq;

use super::problem::Problem;
use crate::AppState;

/// The cookie the dashboard keeps the token in.
pub(crate) const COOKIE: &str = "idemq_token";

/// The one path that never needs the token (load balancers probe it).
const OPEN_PATH: &str = "/healthz";

/// Marks a request that already passed the check, so a router protected at
/// two levels (the API inside the whole server) checks once.
#[derive(Clone, Copy, Debug)]
struct Authenticated;

/// Applies the token check to every route of `router` (and its fallback)
/// except `/healthz`. Without a token configured it lets everything through.
pub(crate) fn protect(router: Router, state: AppState) -> Router {
    router.layer(axum::middleware::from_fn_with_state(state, require_token))
}

/// The middleware behind [`protect`].
pub(crate) async fn require_token(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Response {
    let Some(token) = state.options.token.as_deref() else {
        if req.extensions().get::<Authenticated>().is_some() {
            return next.run(req).await;
        }
        if host_allowed(req.headers(), &state.options.allowed_hosts) {
            // A page on another site can still send a bodiless POST to a
            // loopback server (no preflight needed); browsers say so.
            if is_cross_site_write(&req) {
                return Problem::new(
                    "forbidden-host",
                    "this server has no token, so it refuses a state-changing request another \
                     site's page sent (Origin or Sec-Fetch-Site says so)",
                )
                .into_response();
            }
            req.extensions_mut().insert(Authenticated);
            return next.run(req).await;
        }
        return Problem::new(
            "forbidden-host",
            "this server has no token, so it answers only requests whose Host is a loopback \
             name (127.0.0.1, [::1], localhost) or a host given with --allowed-host \
             (IDEMQ_ALLOWED_HOSTS)",
        )
        .into_response();
    };
    let path = req.uri().path();
    // The dashboard's login form and its assets are reachable before the
    // operator holds the cookie.
    if path == OPEN_PATH
        || crate::dashboard::is_public(path)
        || req.extensions().get::<Authenticated>().is_some()
    {
        return next.run(req).await;
    }
    let bearer = bearer_tokens(req.headers()).any(|t| equal(t, token));
    if bearer || cookie_tokens(req.headers()).any(|t| equal(t, token)) {
        // The cookie goes with every request a browser sends to this host,
        // a same-site page's too (another port of it, a sibling subdomain:
        // SameSite=Strict does not tell those apart), so a write the cookie
        // alone authorizes must come from this server's own pages, as the
        // dashboard's actions must. API clients send the bearer token.
        if !bearer && is_cross_site_write(&req) {
            return Problem::new(
                "forbidden-host",
                "a state-changing request authorized by the dashboard's cookie alone must come                  from this server's own pages (Origin or Sec-Fetch-Site says it did not); API                  clients send Authorization: Bearer <token>",
            )
            .into_response();
        }
        req.extensions_mut().insert(Authenticated);
        return next.run(req).await;
    }
    // A person opening a dashboard page is sent to the login form; API
    // clients get the problem document.
    if req.method() == axum::http::Method::GET && wants_html(req.headers()) {
        return axum::response::Redirect::to("/login").into_response();
    }
    Problem::new(
        "unauthorized",
        "this server needs a token: send Authorization: Bearer <token>",
    )
    .into_response()
}

/// True for an API write (not GET/HEAD/OPTIONS) whose browser headers say
/// another site sent it. Clients that are not browsers send neither header.
fn is_cross_site_write(req: &Request) -> bool {
    use axum::http::Method;
    let read = matches!(*req.method(), Method::GET | Method::HEAD | Method::OPTIONS);
    !read
        && req.uri().path().starts_with("/v1/")
        && crate::dashboard::check_same_origin(req.headers()).is_err()
}

/// True when the `Host` header names a loopback address or an allowed host.
/// A request without one (HTTP/1.0) cannot be told from a rebound name and
/// is refused.
fn host_allowed(headers: &HeaderMap, allowed: &[String]) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let host = host.trim().to_ascii_lowercase();
    let name = split_port(&host);
    if is_loopback(name) {
        return true;
    }
    allowed.iter().any(|a| {
        let a = a.trim().to_ascii_lowercase();
        a == host || (split_port(&a) == a && a == name)
    })
}

/// The host part of `host[:port]` (brackets of an IPv6 literal kept).
fn split_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(i) => &host[..=i],
            None => host,
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// `localhost`, `[::1]` or an address of 127.0.0.0/8.
fn is_loopback(name: &str) -> bool {
    name == "localhost"
        || name == "[::1]"
        || name
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// True for a browser navigation (`Accept: text/html…`).
fn wants_html(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("text/html"))
}

/// The bearer tokens the request presents.
fn bearer_tokens(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::AUTHORIZATION)
        .iter()
        .filter_map(|v| {
            let v = v.as_bytes();
            let scheme = v.get(..7)?;
            scheme
                .eq_ignore_ascii_case(b"bearer ")
                .then(|| v[7..].trim_ascii())
        })
}

/// The tokens the request presents in the dashboard's cookie.
fn cookie_tokens(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|b| *b == b';'))
        .filter_map(|pair| {
            let pair = pair.trim_ascii();
            let (name, value) = pair.split_at(pair.iter().position(|b| *b == b'=')?);
            (name == COOKIE.as_bytes()).then(|| &value[1..])
        })
}

/// Constant-time comparison (the length may leak, the content does not).
fn equal(presented: &[u8], token: &str) -> bool {
    presented.ct_eq(token.as_bytes()).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn loopback_and_allowed_hosts() {
        let host = |v: &'static str, allowed: &[&str]| {
            let mut h = HeaderMap::new();
            h.insert(header::HOST, HeaderValue::from_static(v));
            let allowed: Vec<String> = allowed.iter().map(|a| a.to_string()).collect();
            host_allowed(&h, &allowed)
        };
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "localhost:1",
            "LOCALHOST",
            "[::1]:9",
            "127.1.2.3",
        ] {
            assert!(host(ok, &[]), "{ok}");
        }
        for bad in [
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "[::2]:1",
            "0.0.0.0",
        ] {
            assert!(!host(bad, &[]), "{bad}");
        }
        assert!(host("queue.internal:8080", &["queue.internal"]));
        assert!(host("queue.internal:8080", &["Queue.Internal:8080"]));
        assert!(!host("queue.internal:9090", &["queue.internal:8080"]));
        assert!(!HeaderMap::new().contains_key(header::HOST));
        assert!(!host_allowed(&HeaderMap::new(), &[]));
    }

    #[test]
    fn finds_bearer_and_cookie() {
        let mut h = HeaderMap::new();
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer abc"),
        );
        h.insert(
            header::COOKIE,
            HeaderValue::from_static("theme=dark; idemq_token=xyz"),
        );
        let bearer: Vec<&[u8]> = bearer_tokens(&h).collect();
        let cookie: Vec<&[u8]> = cookie_tokens(&h).collect();
        assert_eq!((bearer, cookie), (vec![&b"abc"[..]], vec![&b"xyz"[..]]));
        assert!(equal(b"abc", "abc"));
        assert!(!equal(b"abd", "abc"));
        assert!(!equal(b"ab", "abc"));
    }
}
