//! `/dead` (dead letters with redrive), `/schedules`, and `/bindings` (the
//! live idempotency and dedupe bindings of recent jobs, plus key lookups).

use axum::Form;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use chrono::{DateTime, Utc};
use idemq::{Job, JobList, JobState};
use serde::Deserialize;

use super::html::{Nav, ago, badge, esc, job_link, opt_time, page, query, respond, time};
use super::jobs::{clip, jobs_table};
use super::{PageResult, check_same_origin};
use crate::AppState;

/// Paging and flash of `/dead` and `/bindings`.
#[derive(Deserialize, Default)]
pub(crate) struct PageQuery {
    cursor: Option<String>,
    flash: Option<String>,
    /// `/bindings`: also show bindings that ended.
    all: Option<String>,
}

/// `GET /dead`.
pub(crate) async fn dead(State(state): State<AppState>, Query(q): Query<PageQuery>) -> PageResult {
    let cursor = q.cursor.filter(|c| !c.is_empty());
    let jobs = state
        .queue
        .list_within(
            JobList {
                state: Some(JobState::Dead),
                limit: 50,
                cursor: cursor.clone(),
                ..Default::default()
            },
            crate::api::MAX_PAGE_BYTES,
        )
        .await?;
    let now = state.queue.store().now().await?;
    let mut body = String::from(
        r#"<p class="muted">Jobs out of attempts, failed permanently or past their deadline. Redrive puts a job back to ready under the same id with a fresh attempt budget.</p>"#,
    );
    if jobs.jobs.is_empty() {
        body.push_str(r#"<p class="muted empty">No dead letters. 🎉</p>"#);
    } else {
        let back = match &cursor {
            Some(c) => format!("/dead?cursor={}", super::html::pct(c)),
            None => "/dead".into(),
        };
        body.push_str(&jobs_table(&jobs.jobs, &now, &back, true));
    }
    body.push_str(r#"<nav class="pager">"#);
    if cursor.is_some() {
        body.push_str(r#"<a class="btn" href="/dead">« First page</a>"#);
    }
    if let Some(next) = &jobs.next_cursor {
        body.push_str(&format!(
            r#"<a class="btn" rel="next" href="/dead{}">Next page »</a>"#,
            query(&[("cursor", Some(next))])
        ));
    }
    body.push_str("</nav>");
    Ok(respond(
        StatusCode::OK,
        page("Dead letters", Nav::Dead, q.flash.as_deref(), &body),
    ))
}

/// `GET /schedules`.
pub(crate) async fn schedules(State(state): State<AppState>) -> PageResult {
    let idemq::ScheduleList {
        schedules: list,
        unreadable,
    } = state.queue.schedule_list().await?;
    let now = state.queue.store().now().await?;
    let mut body = String::new();
    if list.is_empty() && unreadable.is_empty() {
        body.push_str(r#"<p class="muted empty">No schedules. Declare them with <code>Queue::schedule_set</code> or <code>PUT /v1/schedules/{name}</code>.</p>"#);
    } else {
        body.push_str(r#"<table class="grid"><thead><tr><th>name</th><th>when</th><th>time zone</th><th>job type</th><th>queue</th><th>last fired</th><th>next fire</th><th>status</th></tr></thead><tbody>"#);
        for s in &list {
            let when = match (&s.cron, s.every_ms) {
                (Some(c), _) => format!("<code>{}</code>", esc(c)),
                (None, Some(ms)) => format!("every {} ms", ms),
                (None, None) => "—".into(),
            };
            let queue = s.job.queue.as_deref().unwrap_or("default");
            let next = match &s.next_fire_at {
                Some(n) => format!("{} <span class=\"muted\">{}</span>", time(n), ago(n, &now)),
                None => "—".into(),
            };
            body.push_str(&format!(
                r#"<tr><td class="mono">{}</td><td>{when}</td><td>{}</td><td><a href="/jobs{}">{}</a></td><td><a href="/jobs{}">{}</a></td><td>{}</td><td>{next}</td><td>{}</td></tr>"#,
                esc(&s.name),
                esc(&s.timezone),
                query(&[("type", Some(&s.job.job_type))]),
                esc(&s.job.job_type),
                query(&[("queue", Some(queue))]),
                esc(queue),
                opt_time(s.last_fired_at.as_ref()),
                schedule_state(s),
            ));
        }
        // A row this server cannot read: its name and why, in place of the
        // columns it could not fill.
        for u in &unreadable {
            body.push_str(&format!(
                r#"<tr class="unreadable"><td class="mono">{}</td><td colspan="6" class="muted">{}</td><td><span class="badge dead">unreadable</span></td></tr>"#,
                u.name.as_deref().map_or_else(|| "—".to_owned(), esc),
                esc(&u.error),
            ));
        }
        body.push_str("</tbody></table>");
    }
    Ok(respond(
        StatusCode::OK,
        page("Schedules", Nav::Schedules, None, &body),
    ))
}

/// A schedule's state cell: paused or active, and the reason its latest
/// unenqueueable tick was passed, if any.
fn schedule_state(s: &idemq::Schedule) -> String {
    let mut cell = if s.paused {
        r#"<span class="badge paused">paused</span>"#.to_owned()
    } else {
        r#"<span class="badge running">active</span>"#.to_owned()
    };
    if let Some(error) = &s.last_error {
        cell.push_str(&format!(
            r#" <span class="badge dead">tick passed</span> <span class="muted">{}</span>"#,
            esc(error)
        ));
    }
    cell
}

/// How many recent jobs `/bindings` looks through per page.
const BINDINGS_SCAN: u32 = 500;

fn binding_rows(jobs: &[Job], now: &DateTime<Utc>, all: bool) -> (String, usize) {
    let mut rows = String::new();
    let mut n = 0;
    for j in jobs {
        if let Some(k) = &j.idempotency {
            let live = k.expires_at.is_some_and(|e| e > *now);
            if live || all {
                n += 1;
                let status = match &k.expires_at {
                    Some(e) if live => format!(
                        r#"<span class="badge running">live</span> until {} <span class="muted">({})</span>"#,
                        time(e),
                        ago(e, now)
                    ),
                    Some(e) => format!(r#"<span class="badge">expired</span> {}"#, time(e)),
                    None => r#"<span class="badge">released</span>"#.into(),
                };
                rows.push_str(&format!(
                    r#"<tr><td>idempotency</td><td>{}</td><td><code>{}</code> <code class="digest">{}</code></td><td>{}</td><td>{}</td><td class="wrap">{status}</td></tr>"#,
                    esc(&k.scope),
                    esc(&k.key_preview),
                    esc(&k.key_digest),
                    job_link(&j.id),
                    badge(j.state),
                ));
            }
        }
        if let Some(d) = &j.dedupe
            && (d.holds_binding || all)
        {
            n += 1;
            let status = if d.holds_binding {
                match &d.window_until {
                    Some(w) => format!(
                        r#"<span class="badge running">live</span> until {} <span class="muted">({})</span>"#,
                        time(w),
                        ago(w, now)
                    ),
                    None => r#"<span class="badge running">live</span> while pending"#.into(),
                }
            } else {
                r#"<span class="badge">not held</span>"#.into()
            };
            rows.push_str(&format!(
                r#"<tr><td>dedupe ({})</td><td>type {}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td class="wrap">{status}</td></tr>"#,
                d.mode.as_str(),
                esc(&j.job_type),
                esc(&clip(&d.key, 64)),
                job_link(&j.id),
                badge(j.state),
            ));
        }
    }
    (rows, n)
}

const LOOKUP_FORMS: &str = r#"<section class="panel"><h2>Look up a key</h2><div class="cols">
<form class="stack" method="post" action="/bindings/lookup"><input type="hidden" name="kind" value="idempotency">
<h3>Idempotency key</h3><label>scope <input name="scope" value="default"></label>
<label>key <input name="key" type="password" autocomplete="off" required></label>
<p class="muted small">The key travels in the request body and is never shown back: only its preview and digest.</p>
<button class="btn primary" type="submit">Look up</button></form>
<form class="stack" method="post" action="/bindings/lookup"><input type="hidden" name="kind" value="dedupe">
<h3>Dedupe key</h3><label>job type <input name="type" required></label>
<label>key <input name="key" required></label>
<button class="btn primary" type="submit">Look up</button></form></div></section>"#;

async fn bindings_page(state: &AppState, q: PageQuery, lookup: Option<String>) -> PageResult {
    let all = q.all.as_deref().is_some_and(|a| !a.is_empty() && a != "0");
    let cursor = q.cursor.filter(|c| !c.is_empty());
    let jobs = state
        .queue
        .list_within(
            JobList {
                limit: BINDINGS_SCAN,
                cursor: cursor.clone(),
                ..Default::default()
            },
            crate::api::MAX_PAGE_BYTES,
        )
        .await?;
    let now = state.queue.store().now().await?;
    let mut body = String::new();
    if let Some(result) = lookup {
        body.push_str(&format!(
            r#"<section class="panel lookup-result"><h2>Lookup</h2>{result}</section>"#
        ));
    }
    let (rows, n) = binding_rows(&jobs.jobs, &now, all);
    body.push_str(&format!(
        r#"<section class="panel"><h2>{} of the {} most recent jobs <small>{}</small></h2>"#,
        if all { "Keys" } else { "Live bindings" },
        jobs.jobs.len(),
        if all {
            r#"<a href="/bindings">live only</a>"#.to_string()
        } else {
            r#"<a href="/bindings?all=1">include ended bindings</a>"#.to_string()
        }
    ));
    if n == 0 {
        body.push_str(r#"<p class="muted empty">None.</p>"#);
    } else {
        body.push_str(r#"<table class="grid"><thead><tr><th>kind</th><th>scope</th><th>key (preview · digest)</th><th>job</th><th>state</th><th>binding</th></tr></thead><tbody>"#);
        body.push_str(&rows);
        body.push_str("</tbody></table>");
    }
    body.push_str(r#"<nav class="pager">"#);
    if let Some(next) = &jobs.next_cursor {
        body.push_str(&format!(
            r#"<a class="btn" rel="next" href="/bindings{}">Older jobs »</a>"#,
            query(&[("cursor", Some(next)), ("all", all.then_some("1"))])
        ));
    }
    body.push_str("</nav></section>");
    body.push_str(LOOKUP_FORMS);
    Ok(respond(
        StatusCode::OK,
        page("Bindings", Nav::Bindings, q.flash.as_deref(), &body),
    ))
}

/// `GET /bindings`.
pub(crate) async fn bindings(
    State(state): State<AppState>,
    Query(q): Query<PageQuery>,
) -> PageResult {
    bindings_page(&state, q, None).await
}

/// The lookup form.
#[derive(Deserialize)]
pub(crate) struct LookupForm {
    kind: String,
    scope: Option<String>,
    #[serde(rename = "type")]
    job_type: Option<String>,
    key: String,
}

/// `POST /bindings/lookup`: answers on the page itself (a read, so no
/// redirect: the key must not travel into a URL). The raw idempotency key is
/// never echoed.
pub(crate) async fn binding_lookup(
    State(state): State<AppState>,
    headers: HeaderMap,
    Form(f): Form<LookupForm>,
) -> PageResult {
    check_same_origin(&headers)?;
    let result = if f.kind == "dedupe" {
        let ty = f.job_type.unwrap_or_default();
        match state.queue.dedupe_lookup(&ty, &f.key).await? {
            Some(d) => format!(
                r#"<p>Dedupe key <code>{}</code> of type <code>{}</code> is bound to {} (mode {}, window until {}).</p>"#,
                esc(&clip(&f.key, 64)),
                esc(&ty),
                job_link(&d.job_id),
                d.mode.as_str(),
                opt_time(d.window_until.as_ref()),
            ),
            None => format!(
                r#"<p class="muted">No live dedupe binding for that key of type <code>{}</code>.</p>"#,
                esc(&ty)
            ),
        }
    } else {
        let scope = f
            .scope
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "default".into());
        match state.queue.lookup_key(&scope, &f.key).await {
            Ok(Some(b)) => format!(
                r#"<p>Key <code>{}</code> <code class="digest">{}</code> in scope <code>{}</code> is bound to {} until {}.</p>"#,
                esc(&b.key_preview),
                esc(&b.key_digest),
                esc(&scope),
                job_link(&b.job_id),
                time(&b.expires_at),
            ),
            Ok(None) => format!(
                r#"<p class="muted">No live binding for that key in scope <code>{}</code>.</p>"#,
                esc(&scope)
            ),
            // A validation error names the field and bound, never the key.
            Err(e @ idemq::Error::Validation { .. }) => {
                format!(r#"<p class="error-box">{}</p>"#, esc(&e.to_string()))
            }
            Err(e) => return Err(e.into()),
        }
    };
    bindings_page(&state, PageQuery::default(), Some(result)).await
}
