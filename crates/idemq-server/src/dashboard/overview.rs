//! `/`: queues with counts by state, pause/resume, the throughput chart, and
//! the job types whose ready jobs no worker is taking; `/dashboard/stats.json`
//! feeds the chart.

use std::collections::BTreeMap;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::IntoResponse;
use chrono::{DateTime, Utc};
use idemq::{JobList, JobState, StateCounts};
use serde::Deserialize;
use serde_json::json;

use super::html::{Nav, action_button, ago, esc, pct, query, respond, time};
use super::{PageError, PageResult};
use crate::AppState;

/// How long the oldest ready job of a type may wait, with no job of that
/// type active, before the overview says no worker seems to take it.
const STALE_AFTER_SECS: i64 = 60;
/// How many of the newest ready jobs the "ready by type" table looks at
/// (fewer when their JSON passes the page byte bound first): what the
/// overview reads does not grow with the table.
const READY_SAMPLE: u32 = 200;

/// The flash code after an action.
#[derive(Deserialize)]
pub(crate) struct Flash {
    flash: Option<String>,
}

fn total(queues: &[idemq::QueueInfo]) -> StateCounts {
    let mut t = StateCounts::default();
    for q in queues {
        let c = &q.counts;
        for (s, n) in [
            (JobState::Scheduled, c.scheduled),
            (JobState::Ready, c.ready),
            (JobState::Active, c.active),
            (JobState::Completed, c.completed),
            (JobState::Dead, c.dead),
            (JobState::Cancelled, c.cancelled),
        ] {
            t.add(s, n);
        }
    }
    t
}

/// The states whose count is an estimate in some queue.
fn estimated(queues: &[idemq::QueueInfo]) -> Vec<JobState> {
    JobState::ALL
        .into_iter()
        .filter(|s| queues.iter().any(|q| q.estimated.contains(s)))
        .collect()
}

/// A count as shown: `≈` before an estimate.
fn shown(n: u64, estimate: bool) -> String {
    if estimate {
        format!("≈{n}")
    } else {
        n.to_string()
    }
}

fn count(c: &StateCounts, s: JobState) -> u64 {
    match s {
        JobState::Scheduled => c.scheduled,
        JobState::Ready => c.ready,
        JobState::Active => c.active,
        JobState::Completed => c.completed,
        JobState::Dead => c.dead,
        JobState::Cancelled => c.cancelled,
    }
}

/// Ready jobs of one type.
struct ReadyType {
    count: u64,
    oldest: DateTime<Utc>,
    queues: Vec<String>,
    active: bool,
}

/// The newest ready jobs (at most [`READY_SAMPLE`]) grouped by type, with
/// the oldest `run_at`, and whether any job of the type is active (a worker
/// is on it: one job of that type and state looked up per type). `usize`:
/// how many ready jobs were looked at, when there were more.
async fn ready_by_type(
    state: &AppState,
) -> Result<(BTreeMap<String, ReadyType>, Option<usize>), idemq::Error> {
    let mut by_type: BTreeMap<String, ReadyType> = BTreeMap::new();
    let page = state
        .queue
        .list_within(
            JobList {
                state: Some(JobState::Ready),
                limit: READY_SAMPLE,
                ..Default::default()
            },
            crate::api::MAX_PAGE_BYTES,
        )
        .await?;
    let sampled = page.next_cursor.is_some().then_some(page.jobs.len());
    for job in page.jobs {
        let e = by_type.entry(job.job_type).or_insert_with(|| ReadyType {
            count: 0,
            oldest: job.run_at,
            queues: Vec::new(),
            active: false,
        });
        e.count += 1;
        e.oldest = e.oldest.min(job.run_at);
        if !e.queues.contains(&job.queue) {
            e.queues.push(job.queue);
        }
    }
    for (job_type, e) in &mut by_type {
        let active = state
            .queue
            .list(JobList {
                state: Some(JobState::Active),
                job_type: Some(job_type.clone()),
                limit: 1,
                ..Default::default()
            })
            .await?;
        e.active = !active.jobs.is_empty();
    }
    Ok((by_type, sampled))
}

/// `GET /`.
pub(crate) async fn page(State(state): State<AppState>, Query(f): Query<Flash>) -> PageResult {
    let queues = state.queue.queues().await?;
    let now = state.queue.store().now().await?;
    let t = total(&queues);
    let est = estimated(&queues);
    let mut body = String::new();

    // The operator must see, before any count, that what the counts show
    // may not survive a crash of the database.
    if let Some(reason) = state.queue.durability().reason() {
        body.push_str(&format!(
            r#"<div class="banner banner-warn" id="durability-warning" role="alert"><strong>Durability relaxed:</strong> acknowledged jobs may be lost. {}</div>"#,
            esc(reason)
        ));
    }

    body.push_str(r#"<section class="cards">"#);
    for s in JobState::ALL {
        body.push_str(&format!(
            r#"<a class="card s-{0}" href="/jobs?state={0}"><span class="n" data-total="{0}">{1}</span><span class="l">{0}</span></a>"#,
            s.as_str(),
            shown(count(&t, s), est.contains(&s))
        ));
    }
    body.push_str("</section>");
    if !est.is_empty() {
        let names: Vec<&str> = est.iter().map(|s| s.as_str()).collect();
        body.push_str(&format!(
            r#"<p class="muted small" id="estimated">≈ {}: estimated from a sample of the table (the newest jobs counted exactly); the other counts are exact.</p>"#,
            names.join(", ")
        ));
    }

    body.push_str(
        r#"<section class="panel"><h2>Throughput <small>jobs per second, sampled every 2 s</small></h2>
<div class="chart-wrap"><canvas id="throughput" width="1100" height="180" aria-label="throughput chart"></canvas></div>
<p class="legend"><span class="key k-enq"></span>enqueued <span class="key k-done"></span>completed <span class="key k-dead"></span>dead <span id="rate-now" class="muted"></span></p></section>"#,
    );

    body.push_str(r#"<section class="panel"><h2>Queues</h2>"#);
    if queues.is_empty() {
        body.push_str(r#"<p class="muted">No queues yet: enqueue a job to create one.</p>"#);
    } else {
        body.push_str(r#"<table class="grid"><thead><tr><th>queue</th>"#);
        for s in JobState::ALL {
            body.push_str(&format!(r#"<th class="num">{}</th>"#, s.as_str()));
        }
        body.push_str("<th>status</th><th></th></tr></thead><tbody>");
        for q in &queues {
            let name = esc(&q.name);
            body.push_str(&format!(
                r#"<tr data-queue="{name}"><td><a href="/jobs{}">{name}</a></td>"#,
                query(&[("queue", Some(&q.name))])
            ));
            for s in JobState::ALL {
                let n = count(&q.counts, s);
                let shown = shown(n, q.estimated.contains(&s));
                let cell = if n == 0 {
                    format!(r#"<span class="muted">{shown}</span>"#)
                } else {
                    format!(
                        r#"<a href="/jobs{}">{shown}</a>"#,
                        query(&[("queue", Some(&q.name)), ("state", Some(s.as_str()))])
                    )
                };
                body.push_str(&format!(r#"<td class="num">{cell}</td>"#));
            }
            let (status, button) = if q.paused {
                (
                    r#"<span class="badge paused">paused</span>"#,
                    action_button(
                        &format!("/dashboard/actions/queues/{}/resume", pct(&q.name)),
                        "Resume",
                        "/",
                        "primary",
                        None,
                    ),
                )
            } else {
                (
                    r#"<span class="badge running">running</span>"#,
                    action_button(
                        &format!("/dashboard/actions/queues/{}/pause", pct(&q.name)),
                        "Pause",
                        "/",
                        "",
                        None,
                    ),
                )
            };
            body.push_str(&format!(
                "<td>{status}</td><td class=\"actions\">{button}</td></tr>"
            ));
        }
        body.push_str("</tbody></table>");
    }
    body.push_str("</section>");

    let (ready, sampled) = ready_by_type(&state).await?;
    body.push_str(
        r#"<section class="panel"><h2>Ready jobs by type <small>a type whose oldest ready job has waited long, with none of its jobs active, has no worker taking it</small></h2>"#,
    );
    if ready.is_empty() {
        body.push_str(r#"<p class="muted">No ready jobs.</p>"#);
    } else {
        body.push_str(
            r#"<table class="grid" id="ready-types"><thead><tr><th>type</th><th>queues</th><th class="num">ready</th><th>oldest ready since</th><th>worker</th></tr></thead><tbody>"#,
        );
        for (ty, r) in &ready {
            let waited = (now - r.oldest).num_seconds();
            let worker = if r.active {
                r#"<span class="badge running">active jobs</span>"#
            } else if waited > STALE_AFTER_SECS {
                r#"<span class="badge s-dead">none seen lately</span>"#
            } else {
                r#"<span class="muted">—</span>"#
            };
            let queues: Vec<String> = r.queues.iter().map(|q| esc(q)).collect();
            body.push_str(&format!(
                r#"<tr><td><a href="/jobs{}">{}</a></td><td>{}</td><td class="num">{}</td><td>{} <span class="muted">({})</span></td><td>{worker}</td></tr>"#,
                query(&[("state", Some("ready")), ("type", Some(ty))]),
                esc(ty),
                queues.join(", "),
                r.count,
                time(&r.oldest),
                ago(&r.oldest, &now),
            ));
        }
        body.push_str("</tbody></table>");
        if let Some(n) = sampled {
            body.push_str(&format!(
                r#"<p class="muted">Counted over the newest {n} ready jobs.</p>"#
            ));
        }
    }
    body.push_str("</section>");

    Ok(respond(
        StatusCode::OK,
        super::html::page("Overview", Nav::Overview, f.flash.as_deref(), &body),
    ))
}

/// `GET /dashboard/stats.json`: totals per state now, for the chart (which
/// turns successive samples into rates) and the live counters.
pub(crate) async fn stats(
    State(state): State<AppState>,
) -> Result<axum::response::Response, PageError> {
    let queues = state.queue.queues().await?;
    let now = state.queue.store().now().await?;
    let t = total(&queues);
    let all = t.scheduled + t.ready + t.active + t.completed + t.dead + t.cancelled;
    let mut res = Json(json!({
        "at": now.to_rfc3339(),
        "totals": t,
        // Every job ever accepted and still on record: its growth is the
        // enqueue rate (purges and retention only make it dip).
        "jobs": all,
        // The states whose totals are estimates (docs/dashboard.md).
        "estimated": estimated(&queues),
        // `full` or `relaxed` (acknowledged jobs may be lost), as /healthz.
        "durability": state.queue.durability().as_str(),
        "queues": queues,
    }))
    .into_response();
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    Ok(res)
}
