//! `/jobs` (filtered, paged list) and `/jobs/{id}` (one job with its keys,
//! events, runs, checkpoints and actions).

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use idemq::{Job, JobList, JobState};
use serde::Deserialize;
use serde_json::Value;

use super::html::{
    Nav, action_button, ago, badge, esc, job_link, opt_time, page, pct, query, respond, time,
};
use super::{PageError, PageResult};
use crate::AppState;

/// Jobs per page of `/jobs`.
const PAGE_SIZE: u32 = 50;

/// The filters of `/jobs` (empty values mean "any").
#[derive(Deserialize, Default)]
pub(crate) struct ListQuery {
    state: Option<String>,
    queue: Option<String>,
    #[serde(rename = "type")]
    job_type: Option<String>,
    tag: Option<String>,
    cursor: Option<String>,
    flash: Option<String>,
}

fn non_empty(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
}

/// The first `n` characters of `s`, with `…` when cut.
pub(crate) fn clip(s: &str, n: usize) -> String {
    match s.char_indices().nth(n) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_owned(),
    }
}

/// A compact marker of the keys a job carries (previews only, never a raw key).
pub(crate) fn keys_cell(job: &Job) -> String {
    let mut out = Vec::new();
    if let Some(k) = &job.idempotency {
        out.push(format!(
            r#"<span class="key-chip" title="idempotency key digest {}">key {}</span>"#,
            esc(&k.key_digest),
            esc(&k.key_preview)
        ));
    }
    if let Some(d) = &job.dedupe {
        out.push(format!(
            r#"<span class="key-chip" title="dedupe key ({})">dedupe {}</span>"#,
            d.mode.as_str(),
            esc(&clip(&d.key, 24))
        ));
    }
    out.join(" ")
}

/// One table of jobs, as `/jobs` and `/dead` show them. `back` is where row
/// actions redirect to; `redrive` adds a redrive button to dead rows.
pub(crate) fn jobs_table(jobs: &[Job], now: &DateTime<Utc>, back: &str, redrive: bool) -> String {
    let mut t = String::from(
        r#"<div class="table-wrap"><table class="grid jobs"><thead><tr><th>id</th><th>type</th><th>queue</th><th>state</th><th class="num">attempt</th><th>run at</th><th>tags</th><th>keys</th><th>last error</th>"#,
    );
    if redrive {
        t.push_str("<th></th>");
    }
    t.push_str("</tr></thead><tbody>");
    for j in jobs {
        let tags: Vec<String> = j
            .tags
            .iter()
            .map(|tag| {
                format!(
                    r#"<a class="tag" href="/jobs{}">{}</a>"#,
                    query(&[("tag", Some(tag))]),
                    esc(tag)
                )
            })
            .collect();
        t.push_str(&format!(
            r#"<tr data-job="{}"><td>{}</td><td><a href="/jobs{}">{}</a></td><td><a href="/jobs{}">{}</a></td><td>{}</td><td class="num">{}/{}</td><td>{} <span class="muted">{}</span></td><td class="wrap">{}</td><td>{}</td><td class="err">{}</td>"#,
            esc(&j.id),
            job_link(&j.id),
            query(&[("type", Some(&j.job_type))]),
            esc(&j.job_type),
            query(&[("queue", Some(&j.queue))]),
            esc(&j.queue),
            badge(j.state),
            j.attempts_used,
            j.max_attempts,
            time(&j.run_at),
            ago(&j.run_at, now),
            tags.join(" "),
            keys_cell(j),
            esc(&clip(j.last_error.as_deref().unwrap_or(""), 80)),
        ));
        if redrive {
            let cell = if j.state == JobState::Dead {
                action_button(
                    &format!("/dashboard/actions/jobs/{}/redrive", pct(&j.id)),
                    "Redrive",
                    back,
                    "primary",
                    None,
                )
            } else {
                String::new()
            };
            t.push_str(&format!(r#"<td class="actions">{cell}</td>"#));
        }
        t.push_str("</tr>");
    }
    t.push_str("</tbody></table></div>");
    t
}

/// `GET /jobs`.
pub(crate) async fn list(State(state): State<AppState>, Query(q): Query<ListQuery>) -> PageResult {
    let st = non_empty(&q.state);
    let job_state = match st.as_deref() {
        Some(s) => Some(JobState::parse(s).ok_or_else(|| {
            PageError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("unknown state {s:?}"),
            )
        })?),
        None => None,
    };
    let (queue, job_type, tag) = (
        non_empty(&q.queue),
        non_empty(&q.job_type),
        non_empty(&q.tag),
    );
    let cursor = non_empty(&q.cursor);
    let jobs = state
        .queue
        .list_within(
            JobList {
                state: job_state,
                queue: queue.clone(),
                job_type: job_type.clone(),
                tag: tag.clone(),
                limit: PAGE_SIZE,
                cursor: cursor.clone(),
            },
            crate::api::MAX_PAGE_BYTES,
        )
        .await?;
    let queues = state.queue.queues().await?;
    let now = state.queue.store().now().await?;

    let mut body = String::from(
        r#"<form class="filters" method="get" action="/jobs"><label>state <select name="state"><option value="">any</option>"#,
    );
    for s in JobState::ALL {
        let sel = if job_state == Some(s) {
            " selected"
        } else {
            ""
        };
        body.push_str(&format!(
            r#"<option value="{0}"{sel}>{0}</option>"#,
            s.as_str()
        ));
    }
    body.push_str(
        r#"</select></label><label>queue <select name="queue"><option value="">any</option>"#,
    );
    let mut known = false;
    for qi in &queues {
        let sel = if queue.as_deref() == Some(qi.name.as_str()) {
            known = true;
            " selected"
        } else {
            ""
        };
        body.push_str(&format!(
            r#"<option value="{0}"{sel}>{0}</option>"#,
            esc(&qi.name)
        ));
    }
    if let (Some(qn), false) = (&queue, known) {
        body.push_str(&format!(
            r#"<option value="{0}" selected>{0}</option>"#,
            esc(qn)
        ));
    }
    body.push_str(&format!(
        r#"</select></label><label>type <input name="type" value="{}" placeholder="any" size="18"></label><label>tag <input name="tag" value="{}" placeholder="any" size="12"></label><button class="btn primary" type="submit">Filter</button> <a class="btn" href="/jobs">Clear</a></form>"#,
        esc(job_type.as_deref().unwrap_or("")),
        esc(tag.as_deref().unwrap_or("")),
    ));

    // Where row actions come back to: this very page.
    let here_q = query(&[
        ("state", st.as_deref()),
        ("queue", queue.as_deref()),
        ("type", job_type.as_deref()),
        ("tag", tag.as_deref()),
        ("cursor", cursor.as_deref()),
    ]);
    let back = format!("/jobs{}", here_q.replace("&amp;", "&"));
    if jobs.jobs.is_empty() {
        body.push_str(r#"<p class="muted empty">No jobs match.</p>"#);
    } else {
        body.push_str(&jobs_table(
            &jobs.jobs,
            &now,
            &back,
            job_state == Some(JobState::Dead),
        ));
    }
    body.push_str(r#"<nav class="pager">"#);
    if cursor.is_some() {
        body.push_str(&format!(
            r#"<a class="btn" href="/jobs{}">« First page</a>"#,
            query(&[
                ("state", st.as_deref()),
                ("queue", queue.as_deref()),
                ("type", job_type.as_deref()),
                ("tag", tag.as_deref()),
            ])
        ));
    }
    if let Some(next) = &jobs.next_cursor {
        body.push_str(&format!(
            r#"<a class="btn" rel="next" href="/jobs{}">Next page »</a>"#,
            query(&[
                ("state", st.as_deref()),
                ("queue", queue.as_deref()),
                ("type", job_type.as_deref()),
                ("tag", tag.as_deref()),
                ("cursor", Some(next)),
            ])
        ));
    }
    body.push_str(&format!(
        r#"<span class="muted">{} shown, newest first</span></nav>"#,
        jobs.jobs.len()
    ));
    Ok(respond(
        StatusCode::OK,
        page("Jobs", Nav::Jobs, q.flash.as_deref(), &body),
    ))
}

fn pretty(v: &Value) -> String {
    esc(&serde_json::to_string_pretty(v).unwrap_or_default())
}

fn row(k: &str, v: &str) -> String {
    format!("<tr><th>{k}</th><td>{v}</td></tr>")
}

/// The flash code after an action.
#[derive(Deserialize)]
pub(crate) struct Flash {
    flash: Option<String>,
}

/// `GET /jobs/{id}`.
pub(crate) async fn show(
    State(state): State<AppState>,
    Path(id): Path<String>,
    Query(f): Query<Flash>,
) -> PageResult {
    let job = state.queue.get(&id).await?.ok_or_else(|| {
        PageError::new(
            StatusCode::NOT_FOUND,
            format!("no job {id:?} (it may have been purged)"),
        )
    })?;
    let (events, runs, checkpoints, now) = (
        state.queue.events(&id).await?,
        state.queue.runs(&id).await?,
        state.queue.checkpoints(&id).await?,
        state.queue.store().now().await?,
    );
    let here = format!("/jobs/{}", pct(&job.id));
    let act = |a: &str| format!("/dashboard/actions/jobs/{}/{a}", pct(&job.id));

    let mut body = format!(
        r#"<p class="subtitle">{} <span class="mono">{}</span></p>"#,
        badge(job.state),
        esc(&job.id)
    );

    let mut actions = Vec::new();
    let pending = matches!(
        job.state,
        JobState::Scheduled | JobState::Ready | JobState::Active
    );
    if pending && !job.cancel_requested {
        actions.push(action_button(&act("cancel"), "Cancel", &here, "", None));
    }
    if job.state == JobState::Scheduled {
        actions.push(action_button(
            &act("promote"),
            "Promote (run now)",
            &here,
            "",
            None,
        ));
    }
    if job.state == JobState::Dead {
        actions.push(action_button(
            &act("redrive"),
            "Redrive",
            &here,
            "primary",
            None,
        ));
    }
    if job.state != JobState::Active {
        actions.push(action_button(
            &act("purge"),
            "Purge",
            "/jobs",
            "danger",
            Some("Delete this job record for good?"),
        ));
    }
    if !actions.is_empty() {
        body.push_str(&format!(
            r#"<div class="toolbar">{}</div>"#,
            actions.join("")
        ));
    }

    body.push_str(r#"<div class="cols"><section class="panel"><h2>Fields</h2><table class="kv">"#);
    body.push_str(&row(
        "type",
        &format!(
            r#"<a href="/jobs{}">{}</a>"#,
            query(&[("type", Some(&job.job_type))]),
            esc(&job.job_type)
        ),
    ));
    body.push_str(&row(
        "queue",
        &format!(
            r#"<a href="/jobs{}">{}</a>"#,
            query(&[("queue", Some(&job.queue))]),
            esc(&job.queue)
        ),
    ));
    body.push_str(&row("priority", &job.priority.to_string()));
    body.push_str(&row(
        "attempts",
        &format!(
            "{} used of {} ({} claims)",
            job.attempts_used, job.max_attempts, job.attempt
        ),
    ));
    body.push_str(&row(
        "run at",
        &format!(
            "{} <span class=\"muted\">{}</span>",
            time(&job.run_at),
            ago(&job.run_at, &now)
        ),
    ));
    body.push_str(&row("created", &time(&job.created_at)));
    body.push_str(&row("updated", &time(&job.updated_at)));
    body.push_str(&row("finished", &opt_time(job.finished_at.as_ref())));
    body.push_str(&row("timeout", &format!("{} ms", job.timeout_ms)));
    body.push_str(&row("deadline", &opt_time(job.deadline.as_ref())));
    body.push_str(&row(
        "retry",
        &format!(
            r#"<code>{}</code>"#,
            esc(&serde_json::to_string(&job.retry).unwrap_or_default())
        ),
    ));
    body.push_str(&row(
        "concurrency key",
        &job.concurrency_key
            .as_deref()
            .map_or_else(|| "—".into(), esc),
    ));
    let tags: Vec<String> = job
        .tags
        .iter()
        .map(|t| {
            format!(
                r#"<a class="tag" href="/jobs{}">{}</a>"#,
                query(&[("tag", Some(t))]),
                esc(t)
            )
        })
        .collect();
    body.push_str(&row(
        "tags",
        &if tags.is_empty() {
            "—".into()
        } else {
            tags.join(" ")
        },
    ));
    body.push_str(&row(
        "keep",
        &job.keep_ms
            .map_or_else(|| "default".into(), |ms| format!("{ms} ms")),
    ));
    body.push_str(&row(
        "cancel requested",
        if job.cancel_requested { "yes" } else { "no" },
    ));
    body.push_str(&row(
        "lease expires",
        &opt_time(job.lease_expires_at.as_ref()),
    ));
    body.push_str("</table></section>");

    body.push_str(r#"<section class="panel"><h2>Keys</h2>"#);
    match &job.idempotency {
        Some(k) => {
            let live = k.expires_at.is_some_and(|e| e > now);
            body.push_str(r#"<h3>Idempotency key</h3><table class="kv">"#);
            body.push_str(&row("scope", &esc(&k.scope)));
            body.push_str(&row(
                "preview",
                &format!("<code>{}</code>", esc(&k.key_preview)),
            ));
            body.push_str(&row(
                "digest",
                &format!(r#"<code class="digest">{}</code>"#, esc(&k.key_digest)),
            ));
            body.push_str(&row(
                "binding",
                &match &k.expires_at {
                    Some(e) if live => format!(r#"<span class="badge running">live</span> until {} <span class="muted">({})</span>"#, time(e), ago(e, &now)),
                    Some(e) => format!(r#"<span class="badge">expired</span> {}"#, time(e)),
                    None => r#"<span class="badge">released</span> no longer points at this job"#.into(),
                },
            ));
            body.push_str("</table>");
        }
        None => body.push_str(r#"<p class="muted">No idempotency key.</p>"#),
    }
    match &job.dedupe {
        Some(d) => {
            body.push_str(r#"<h3>Dedupe key</h3><table class="kv">"#);
            body.push_str(&row("key", &format!("<code>{}</code>", esc(&d.key))));
            body.push_str(&row("mode", d.mode.as_str()));
            body.push_str(&row(
                "window until",
                &d.window_until.as_ref().map_or_else(
                    || "—".into(),
                    |w| {
                        format!(
                            "{} <span class=\"muted\">({})</span>",
                            time(w),
                            ago(w, &now)
                        )
                    },
                ),
            ));
            body.push_str(&row(
                "binding",
                if d.holds_binding {
                    r#"<span class="badge running">held by this job</span>"#
                } else {
                    r#"<span class="badge">not held</span>"#
                },
            ));
            body.push_str("</table>");
        }
        None => body.push_str(r#"<p class="muted">No dedupe key.</p>"#),
    }
    body.push_str("</section></div>");

    body.push_str(&format!(
        r#"<section class="panel"><h2>Payload</h2><pre class="json">{}</pre>"#,
        pretty(&job.payload)
    ));
    if let Some(r) = &job.result {
        body.push_str(&format!(
            r#"<h3>Result</h3><pre class="json">{}</pre>"#,
            pretty(r)
        ));
    }
    if let Some(e) = &job.last_error {
        body.push_str(&format!(
            r#"<h3>Last error</h3><pre class="error-box">{}</pre>"#,
            esc(e)
        ));
    }
    body.push_str("</section>");

    body.push_str(r#"<div class="cols"><section class="panel"><h2>Events</h2>"#);
    if events.is_empty() {
        body.push_str(r#"<p class="muted">No events.</p>"#);
    } else {
        body.push_str(r#"<ol class="timeline">"#);
        for e in &events {
            let data = if e.data.is_null() || e.data.as_object().is_some_and(|o| o.is_empty()) {
                String::new()
            } else {
                format!(r#"<code class="data">{}</code>"#, esc(&e.data.to_string()))
            };
            body.push_str(&format!(
                r#"<li class="ev ev-{0}"><span class="kind">{0}</span> {1} <span class="muted">#{2}</span> {data}</li>"#,
                esc(&e.kind),
                time(&e.at),
                e.seq
            ));
        }
        body.push_str("</ol>");
    }
    body.push_str(r#"</section><section class="panel"><h2>Runs</h2>"#);
    if runs.is_empty() {
        body.push_str(r#"<p class="muted">Never claimed.</p>"#);
    } else {
        body.push_str(r#"<table class="grid"><thead><tr><th class="num">#</th><th>worker</th><th>started</th><th>finished</th><th>outcome</th><th>error</th></tr></thead><tbody>"#);
        for r in &runs {
            body.push_str(&format!(
                r#"<tr><td class="num">{}</td><td class="mono">{}</td><td>{}</td><td>{}</td><td>{}</td><td class="err">{}</td></tr>"#,
                r.attempt,
                esc(&r.worker),
                time(&r.started_at),
                opt_time(r.finished_at.as_ref()),
                esc(r.outcome.as_deref().unwrap_or("running")),
                esc(&clip(r.error.as_deref().unwrap_or(""), 200)),
            ));
        }
        body.push_str("</tbody></table>");
    }
    body.push_str(r#"<h2>Checkpoints</h2>"#);
    if checkpoints.is_empty() {
        body.push_str(r#"<p class="muted">No checkpoints.</p>"#);
    } else {
        body.push_str(
            r#"<table class="grid"><thead><tr><th>name</th><th>value</th></tr></thead><tbody>"#,
        );
        for (name, v) in &checkpoints {
            body.push_str(&format!(
                r#"<tr><td class="mono">{}</td><td><code>{}</code></td></tr>"#,
                esc(name),
                esc(&clip(&v.to_string(), 300))
            ));
        }
        body.push_str("</tbody></table>");
    }
    body.push_str("</section></div>");

    let title = format!("Job {}", job.job_type);
    Ok(respond(
        StatusCode::OK,
        page(&title, Nav::Jobs, f.flash.as_deref(), &body),
    ))
}
