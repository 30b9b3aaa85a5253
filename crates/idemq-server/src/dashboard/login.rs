//! `GET /login`, `POST /login` and `POST /logout`: the dashboard takes the
//! server token once and keeps it in the `idemq_token` cookie (HttpOnly,
//! SameSite=Strict), which the auth middleware accepts like a bearer token.

use axum::Form;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;
use subtle::ConstantTimeEq;

use super::html::{Nav, page, respond};
use super::{PageResult, check_same_origin};
use crate::AppState;

/// The cookie the dashboard keeps the token in.
pub(crate) const COOKIE: &str = "idemq_token";

fn form_page(status: StatusCode, message: Option<&str>, open: bool) -> Response {
    let note = match (message, open) {
        (Some(m), _) => format!(r#"<p class="error-box" role="alert">{m}</p>"#),
        (None, true) => r#"<p class="flash flash-warn">No token is configured on this server: the dashboard is open to anyone who can reach it.</p>"#.into(),
        (None, false) => String::new(),
    };
    let body = format!(
        r#"{note}<form class="stack login" method="post" action="/login">
<label>Token <input name="token" type="password" autocomplete="current-password" autofocus required></label>
<p class="muted small">The server's <code>IDEMQ_TOKEN</code>. It is kept in an HttpOnly cookie for this browser session.</p>
<button class="btn primary" type="submit">Sign in</button></form>"#
    );
    respond(status, page("Sign in", Nav::None, None, &body))
}

/// `GET /login`.
pub(crate) async fn form(State(state): State<AppState>) -> Response {
    form_page(StatusCode::OK, None, state.options.token.is_none())
}

/// The login form.
#[derive(Deserialize)]
pub(crate) struct LoginForm {
    token: String,
}

/// Whether `given` is the token, compared in constant time.
fn token_matches(expected: &str, given: &str) -> bool {
    // ct_eq on slices of different lengths is false without comparing
    // contents; the length of the token is not a secret worth hiding.
    bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

/// Whether a value can be a cookie value as it is (RFC 6265 cookie-octets).
fn cookie_safe(s: &str) -> bool {
    s.bytes()
        .all(|b| matches!(b, 0x21 | 0x23..=0x2B | 0x2D..=0x3A | 0x3C..=0x5B | 0x5D..=0x7E))
}

/// `POST /login`: checks the token and sets the cookie, then goes to `/`.
pub(crate) async fn submit(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> PageResult {
    check_same_origin(&headers)?;
    let Some(expected) = state.options.token.as_deref() else {
        return Ok(Redirect::to("/").into_response());
    };
    if !token_matches(expected, &f.token) {
        tracing::warn!("dashboard login with a wrong token");
        return Ok(form_page(
            StatusCode::UNAUTHORIZED,
            Some("Wrong token."),
            false,
        ));
    }
    if !cookie_safe(expected) {
        return Ok(form_page(
            StatusCode::UNPROCESSABLE_ENTITY,
            Some(
                "This token holds characters a cookie cannot carry; use <code>Authorization: Bearer</code> instead, or pick a token of letters, digits and punctuation.",
            ),
            false,
        ));
    }
    let cookie = format!("{COOKIE}={expected}; HttpOnly; SameSite=Strict; Path=/");
    let mut res = Redirect::to("/").into_response();
    let value = HeaderValue::from_str(&cookie).map_err(|_| {
        super::PageError::new(StatusCode::INTERNAL_SERVER_ERROR, "cannot build the cookie")
    })?;
    res.headers_mut().insert(header::SET_COOKIE, value);
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(res)
}

/// `POST /logout`: forgets the cookie.
pub(crate) async fn logout(headers: HeaderMap) -> PageResult {
    check_same_origin(&headers)?;
    let mut res = Redirect::to("/login").into_response();
    res.headers_mut().insert(
        header::SET_COOKIE,
        HeaderValue::from_static("idemq_token=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
    );
    Ok(res)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(token_matches("s3cret", "s3cret"));
        assert!(!token_matches("s3cret", "s3cre"));
        assert!(!token_matches("s3cret", "s3cret!"));
        assert!(!token_matches("s3cret", ""));
    }

    #[test]
    fn cookie_values_are_checked() {
        assert!(cookie_safe("abc-DEF_123.~!"));
        assert!(!cookie_safe("a b"));
        assert!(!cookie_safe("a;b"));
        assert!(!cookie_safe("a\"b"));
    }
}
