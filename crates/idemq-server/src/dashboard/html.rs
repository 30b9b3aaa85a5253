//! HTML building blocks: escaping, the page layout, and small formatters.
//!
//! Every value that reaches a page goes through [`esc`] (text and attribute
//! values alike) or [`pct`] (inside a URL), so a job id, tag or error text
//! can never become markup.

use std::fmt::Write as _;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use idemq::JobState;

/// Escapes text for an HTML text node or a quoted attribute value.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes a URL query value or path segment (RFC 3986 unreserved
/// characters pass through).
pub(crate) fn pct(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// Builds a query string (`?a=1&b=2`, empty when every value is empty),
/// already escaped for use inside an `href` attribute.
pub(crate) fn query(pairs: &[(&str, Option<&str>)]) -> String {
    let parts: Vec<String> = pairs
        .iter()
        .filter_map(|(k, v)| {
            v.filter(|v| !v.is_empty())
                .map(|v| format!("{k}={}", pct(v)))
        })
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!("?{}", parts.join("&amp;"))
    }
}

/// A UTC time as `2026-11-01 12:00:03`, with the full RFC 3339 instant in
/// the tooltip.
pub(crate) fn time(t: &DateTime<Utc>) -> String {
    format!(
        r#"<time datetime="{}" title="{}">{}</time>"#,
        t.to_rfc3339(),
        t.to_rfc3339(),
        t.format("%Y-%m-%d %H:%M:%S")
    )
}

/// [`time`] for an optional instant (`—` when absent).
pub(crate) fn opt_time(t: Option<&DateTime<Utc>>) -> String {
    t.map_or_else(|| "—".into(), time)
}

/// A signed, human distance between `t` and `now` (`in 3m`, `5s ago`).
pub(crate) fn ago(t: &DateTime<Utc>, now: &DateTime<Utc>) -> String {
    let secs = (*now - *t).num_seconds();
    let (n, future) = if secs < 0 {
        (-secs, true)
    } else {
        (secs, false)
    };
    let span = if n < 60 {
        format!("{n}s")
    } else if n < 3600 {
        format!("{}m", n / 60)
    } else if n < 86_400 {
        format!("{}h", n / 3600)
    } else {
        format!("{}d", n / 86_400)
    };
    if future {
        format!("in {span}")
    } else {
        format!("{span} ago")
    }
}

/// A colour-coded state badge.
pub(crate) fn badge(state: JobState) -> String {
    format!(r#"<span class="badge s-{0}">{0}</span>"#, state.as_str())
}

/// A link to a job's page.
pub(crate) fn job_link(id: &str) -> String {
    format!(
        r#"<a class="mono" href="/jobs/{}">{}</a>"#,
        pct(id),
        esc(id)
    )
}

/// A one-button POST form for an operator action. `back` is where the action
/// redirects to; `confirm` asks the operator first (handled by dashboard.js).
pub(crate) fn action_button(
    action: &str,
    label: &str,
    back: &str,
    class: &str,
    confirm: Option<&str>,
) -> String {
    let confirm = confirm
        .map(|c| format!(r#" data-confirm="{}""#, esc(c)))
        .unwrap_or_default();
    format!(
        r#"<form class="inline" method="post" action="{}"{confirm}><input type="hidden" name="back" value="{}"><button type="submit" class="btn {}">{}</button></form>"#,
        esc(action),
        esc(back),
        esc(class),
        esc(label),
    )
}

/// Which navigation entry a page belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Nav {
    Overview,
    Jobs,
    Dead,
    Schedules,
    Bindings,
    None,
}

/// The operator's feedback after an action, from the `flash` query value.
/// Only these fixed messages are ever shown, so a crafted link cannot put
/// words on the page.
pub(crate) fn flash_message(code: Option<&str>) -> Option<(&'static str, &'static str)> {
    Some(match code? {
        "cancelled" => ("ok", "Job cancelled."),
        "cancel_requested" => (
            "ok",
            "Cancellation requested: the worker stops at its next heartbeat.",
        ),
        "not_cancelled" => (
            "warn",
            "The job is already finished; nothing was cancelled.",
        ),
        "purged" => ("ok", "Job purged."),
        "not_purged" => ("warn", "Nothing purged: the job is active or unknown."),
        "promoted" => ("ok", "Job promoted: it is due now."),
        "not_promoted" => ("warn", "Nothing promoted: the job is not scheduled."),
        "redriven" => ("ok", "Job redriven: it is ready again."),
        "paused" => ("ok", "Queue paused: workers skip it until it is resumed."),
        "resumed" => ("ok", "Queue resumed."),
        _ => return None,
    })
}

/// Wraps a page body in the layout: head, navigation, flash message.
pub(crate) fn page(title: &str, nav: Nav, flash: Option<&str>, body: &str) -> String {
    let link = |n: Nav, href: &str, label: &str| {
        let class = if n == nav { r#" class="active""# } else { "" };
        format!(r#"<a href="{href}"{class}>{label}</a>"#)
    };
    let flash = flash_message(flash)
        .map(|(kind, msg)| format!(r#"<div class="flash flash-{kind}" role="status">{msg}</div>"#))
        .unwrap_or_default();
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title} · idemq</title>
<link rel="stylesheet" href="/dashboard/static/dashboard.css">
<script src="/dashboard/static/dashboard.js" defer></script>
</head><body>
<header class="top"><a class="brand" href="/">idemq</a><nav>{}{}{}{}{}</nav></header>
<main>{flash}<h1>{title}</h1>
{body}</main>
</body></html>"#,
        link(Nav::Overview, "/", "Overview"),
        link(Nav::Jobs, "/jobs", "Jobs"),
        link(Nav::Dead, "/dead", "Dead letters"),
        link(Nav::Schedules, "/schedules", "Schedules"),
        link(Nav::Bindings, "/bindings", "Bindings"),
        title = esc(title),
    )
}

/// An HTML response with the dashboard's security headers: a strict content
/// security policy (scripts and styles only from this origin, no inline
/// script), no framing, no caching of operator data.
pub(crate) fn respond(status: StatusCode, html: String) -> Response {
    let mut res = (status, html).into_response();
    let h = res.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
             form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert("referrer-policy", HeaderValue::from_static("same-origin"));
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_and_quotes() {
        assert_eq!(
            esc(r#"<a href="x">'&'</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;"
        );
    }

    #[test]
    fn percent_encodes_everything_but_unreserved() {
        assert_eq!(pct("a b/c?d=é"), "a%20b%2Fc%3Fd%3D%C3%A9");
        assert_eq!(
            query(&[("state", Some("dead")), ("tag", None), ("q", Some(""))]),
            "?state=dead"
        );
        assert_eq!(
            query(&[("a", Some("1")), ("b", Some("&"))]),
            "?a=1&amp;b=%26"
        );
    }

    #[test]
    fn unknown_flash_codes_show_nothing() {
        assert!(flash_message(Some("<script>")).is_none());
        assert!(flash_message(Some("redriven")).is_some());
    }
}
