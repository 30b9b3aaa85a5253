//! Job queries and operator actions: get (with long-poll), list, events,
//! runs, checkpoints, cancel, purge, promote, redrive and bulk actions.

use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::{MethodRouter, get};
use chrono::{DateTime, Utc};
use idemq::{JobList, JobState, RedriveOptions};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::ApiState;
use super::extract::{Json, NoBody, OptionalJson, Path, Query, idempotency_key, query_number};
use super::long_poll::UNAVAILABLE_WAIT;
use super::problem::{ApiResult, Problem};
use super::schema::{BulkLimit, WaitMs};

/// Longest `wait_ms` of a long-poll (60 s).
pub(crate) const MAX_WAIT_MS: u64 = 60_000;
/// Page size of a list without `limit`.
const DEFAULT_LIST_LIMIT: u32 = 100;
/// The most bytes of a page of jobs (its JSON): a page ends before the job
/// that would take it past them, unless that is its first job (16 MiB).
pub(crate) const MAX_PAGE_BYTES: usize = 16 * 1024 * 1024;
/// Jobs a bulk action touches without `limit`, and at most.
const BULK_DEFAULT: u32 = 1000;
pub(crate) const BULK_MAX: u32 = 10_000;

/// A job's events, oldest first.
#[derive(Serialize, ToSchema)]
pub(crate) struct Events {
    events: Vec<idemq::Event>,
}

/// A job's run ledger.
#[derive(Serialize, ToSchema)]
pub(crate) struct Runs {
    runs: Vec<idemq::Run>,
}

/// A job's checkpoints.
#[derive(Serialize, ToSchema)]
pub(crate) struct Checkpoints {
    /// Stored values by step name.
    checkpoints: std::collections::BTreeMap<String, Value>,
}

/// The answer of a purge.
#[derive(Serialize, ToSchema)]
pub(crate) struct Purged {
    /// `false` for an unknown or active job.
    purged: bool,
}

/// The answer of a promote.
#[derive(Serialize, ToSchema)]
pub(crate) struct Promoted {
    /// `false` when the job is not scheduled.
    promoted: bool,
}

/// `?wait_ms=` of `GET /v1/jobs/{id}`.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct WaitQuery {
    /// Hold the request up to this many milliseconds (≤ 60,000) until the job is terminal (empty: no wait).
    #[serde(default, deserialize_with = "query_number")]
    #[param(value_type = Option<WaitMsQuery>)]
    wait_ms: Option<u64>,
}

/// The filters of `GET /v1/jobs`.
#[derive(Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct ListQuery {
    /// `scheduled`, `ready`, `active`, `completed`, `dead` or `cancelled` (empty: any).
    #[param(value_type = Option<StateFilter>)]
    state: Option<String>,
    /// The queue.
    queue: Option<String>,
    /// The job type.
    #[serde(rename = "type")]
    job_type: Option<String>,
    /// A tag.
    tag: Option<String>,
    /// Page size, 1–1000 (100 when omitted or empty).
    #[serde(default, deserialize_with = "query_number")]
    #[param(value_type = Option<PageLimitQuery>)]
    limit: Option<u32>,
    /// The `next_cursor` of the previous page (empty: the first page).
    #[param(value_type = Option<CursorFilter>)]
    cursor: Option<String>,
}

/// A state in a query: a job state, or empty for any.
pub(crate) struct StateFilter;

impl utoipa::PartialSchema for StateFilter {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .enum_values(Some(
                std::iter::once("").chain(JobState::ALL.iter().map(|s| s.as_str())),
            ))
            .into()
    }
}

impl ToSchema for StateFilter {}

/// A cursor in a query: a page's `next_cursor`, or empty for the first page.
pub(crate) struct CursorFilter;

impl utoipa::PartialSchema for CursorFilter {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let pattern = idemq::store::CURSOR_PATTERN;
        let body = &pattern[1..pattern.len() - 1];
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(format!("^(|{body})$")))
            .into()
    }
}

impl ToSchema for CursorFilter {}

/// A number in a query, or empty for omitted.
fn empty_or(
    number: utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
    description: &str,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    utoipa::openapi::schema::AnyOfBuilder::new()
        .item(number)
        .item(
            utoipa::openapi::ObjectBuilder::new()
                .schema_type(utoipa::openapi::schema::Type::String)
                .enum_values(Some([""])),
        )
        .description(Some(description))
        .into()
}

/// A page size in a query: 1–1000, or empty for the default.
pub(crate) struct PageLimitQuery;

impl utoipa::PartialSchema for PageLimitQuery {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        empty_or(
            utoipa::openapi::Ref::from_schema_name(idemq::openapi::PageLimit::name()).into(),
            "A page size, or empty for the default",
        )
    }
}

impl ToSchema for PageLimitQuery {}

/// A `wait_ms` in a query: 0–60,000, or empty for no wait.
pub(crate) struct WaitMsQuery;

impl utoipa::PartialSchema for WaitMsQuery {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        empty_or(
            utoipa::openapi::Ref::from_schema_name(WaitMs::name()).into(),
            "Milliseconds to wait, or empty for no wait",
        )
    }
}

impl ToSchema for WaitMsQuery {}

/// An empty query value (`?state=`, as an HTML form sends it) means omitted.
fn given(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.is_empty())
}

fn parse_state(field: &str, s: Option<&str>) -> ApiResult<Option<JobState>> {
    s.map(|s| {
        JobState::parse(s).ok_or_else(|| {
            Problem::validation(
                field,
                "must be scheduled, ready, active, completed, dead or cancelled",
            )
        })
    })
    .transpose()
}

/// One job; with `wait_ms`, once it is terminal or the wait ran out.
///
/// A job that is not terminal yet is read again after 50 ms, then after
/// pauses that double up to 1 s. Only such a wait takes one of the
/// server's long-poll permits; when all are held it is refused with `503`.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}",
    operation_id = "getJob",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id"), WaitQuery),
    responses(
        (status = 200, description = "The job", body = idemq::Job),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "wait_ms over 60,000", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = UNAVAILABLE_WAIT, body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn get_job(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Query(q): Query<WaitQuery>,
) -> ApiResult<axum::Json<idemq::Job>> {
    let wait = q.wait_ms.unwrap_or(0);
    if wait > MAX_WAIT_MS {
        return Err(Problem::validation("wait_ms", "must be at most 60000"));
    }
    let until = Instant::now() + Duration::from_millis(wait);
    let job = read_job(&s, &id).await?;
    if wait == 0 || job.state.is_terminal() {
        return Ok(axum::Json(job));
    }
    // Only a read that has to wait takes a permit: the first look wrote
    // nothing, so refusing now leaves nothing to undo. The wait's looks
    // back off to one a second (`Queue::wait`).
    let _permit = s.long_polls.try_hold()?;
    let left = until.saturating_duration_since(Instant::now());
    Ok(axum::Json(s.queue().wait(&id, left).await?))
}

/// The job, or `404` (also for a job purged while a read waited on it).
async fn read_job(s: &ApiState, id: &str) -> ApiResult<idemq::Job> {
    s.queue()
        .get(id)
        .await?
        .ok_or_else(|| Problem::not_found(format_args!("job {id}")))
}

/// The fixed paths beside `/v1/jobs/{id}` (each `POST`), which a job id
/// may also be: each serves that job's `GET` too ([`get_job_named`]).
pub(crate) const FIXED_NAMES: [&str; 4] = ["batch", "explain", "bulk", "complete"];

/// `GET /v1/jobs/{id}` of the job whose id is `id`, for the fixed path
/// `/v1/jobs/<id>` (`batch`, `explain`, `bulk`, `complete`): the router
/// matches such a path to the fixed route, not to `/v1/jobs/{id}`. The
/// paths below a job id (`/v1/jobs/batch/events`, …) need nothing: no fixed
/// route has segments after these names.
pub(crate) fn get_job_named(id: &'static str) -> MethodRouter<ApiState> {
    get(move |state, query| get_job(state, Path(id.to_owned()), query))
}

/// A page of jobs, newest first.
///
/// At most `limit` jobs, and at most 16 MiB of JSON unless its one job is
/// longer: a page ends before the job that would take it past the bound,
/// and its `next_cursor` starts the next page with that job.
#[utoipa::path(
    get,
    path = "/v1/jobs",
    operation_id = "listJobs",
    tag = "jobs",
    params(ListQuery),
    responses(
        (status = 200, description = "A page of jobs: at most `limit`, and at most 16 MiB of JSON unless its one job is longer", body = idemq::JobPage),
        (status = 422, description = "Unknown state, limit out of 1–1000, or a foreign cursor", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn list(
    State(s): State<ApiState>,
    Query(q): Query<ListQuery>,
) -> ApiResult<axum::Json<idemq::JobPage>> {
    let filter = JobList {
        state: parse_state("state", given(q.state).as_deref())?,
        queue: given(q.queue),
        job_type: given(q.job_type),
        tag: given(q.tag),
        limit: q.limit.unwrap_or(DEFAULT_LIST_LIMIT),
        cursor: given(q.cursor),
    };
    Ok(axum::Json(
        s.queue().list_within(filter, MAX_PAGE_BYTES).await?,
    ))
}

/// 404 unless the job exists (for the sub-resources of a job).
async fn must_exist(s: &ApiState, id: &str) -> ApiResult<()> {
    match s.queue().get(id).await? {
        Some(_) => Ok(()),
        None => Err(Problem::not_found(format_args!("job {id}"))),
    }
}

/// A job's events, oldest first.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/events",
    operation_id = "listJobEvents",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "The events", body = Events),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn events(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<Events>> {
    let events = s.queue().events(&id).await?;
    if events.is_empty() {
        must_exist(&s, &id).await?;
    }
    Ok(axum::Json(Events { events }))
}

/// A job's run ledger.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/runs",
    operation_id = "listJobRuns",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "The runs", body = Runs),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn runs(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<Runs>> {
    let runs = s.queue().runs(&id).await?;
    if runs.is_empty() {
        must_exist(&s, &id).await?;
    }
    Ok(axum::Json(Runs { runs }))
}

/// A job's checkpoints.
#[utoipa::path(
    get,
    path = "/v1/jobs/{id}/checkpoints",
    operation_id = "listJobCheckpoints",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "The checkpoints by name", body = Checkpoints),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn checkpoints(
    State(s): State<ApiState>,
    Path(id): Path<String>,
) -> ApiResult<axum::Json<Checkpoints>> {
    let checkpoints = s.queue().checkpoints(&id).await?;
    if checkpoints.is_empty() {
        must_exist(&s, &id).await?;
    }
    Ok(axum::Json(Checkpoints { checkpoints }))
}

/// Cancels a job (an active one at its next heartbeat).
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/cancel",
    operation_id = "cancelJob",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses(
        (status = 200, description = "Whether the job was cancelled (or flagged), and its state", body = idemq::CancelOutcome),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn cancel(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    _: NoBody,
) -> ApiResult<axum::Json<idemq::CancelOutcome>> {
    Ok(axum::Json(s.queue().cancel(&id).await?))
}

/// Deletes a job that is not active.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/purge",
    operation_id = "purgeJob",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses((status = 200, description = "`false` for an unknown or active job", body = Purged))
)]
pub(crate) async fn purge(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    _: NoBody,
) -> ApiResult<axum::Json<Purged>> {
    let purged = s.queue().purge(&id).await?;
    Ok(axum::Json(Purged { purged }))
}

/// Makes a scheduled job due now.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/promote",
    operation_id = "promoteJob",
    tag = "jobs",
    params(("id" = String, Path, description = "The job id")),
    responses((status = 200, description = "`false` when the job is not scheduled", body = Promoted))
)]
pub(crate) async fn promote(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    _: NoBody,
) -> ApiResult<axum::Json<Promoted>> {
    let promoted = s.queue().promote(&id).await?;
    Ok(axum::Json(Promoted { promoted }))
}

/// The optional body of `POST /v1/jobs/{id}/redrive`.
#[derive(Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedriveBody {
    /// A new attempt budget (1–1000); the job keeps its own otherwise.
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<idemq::openapi::MaxAttempts>)]
    max_attempts: Option<i64>,
    /// A new deadline; a passed one is cleared otherwise.
    #[serde(default)]
    deadline: Option<DateTime<Utc>>,
    /// When to run; now when omitted.
    #[serde(default)]
    run_at: Option<DateTime<Utc>>,
    /// Drop the stored checkpoints.
    #[serde(default, deserialize_with = "idemq::wire::null_as_default")]
    #[schema(value_type = Option<bool>)]
    reset_checkpoints: bool,
}

/// Puts a dead job back to ready (same id).
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/redrive",
    operation_id = "redriveJob",
    tag = "jobs",
    params(
        ("id" = String, Path, description = "The dead job's id"),
        ("Idempotency-Key" = Option<idemq::openapi::IdempotencyKeyHeader>, Header, description = "Makes the redrive idempotent (scope `idemq.redrive`, 24 h)"),
    ),
    request_body(content = Option<RedriveBody>, description = "Optional overrides"),
    responses(
        (status = 200, description = "accepted, or replayed for a repeated key", body = idemq::EnqueueResult),
        (status = 404, description = "No such job", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "`not-dead`, or `idempotency-conflict` (the key redrove another job)", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn redrive(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    headers: HeaderMap,
    OptionalJson(body): OptionalJson<RedriveBody>,
) -> ApiResult<axum::Json<idemq::EnqueueResult>> {
    let options = RedriveOptions {
        idempotency_key: idempotency_key(&headers)?,
        max_attempts: body.max_attempts,
        deadline: body.deadline,
        run_at: body.run_at,
        reset_checkpoints: body.reset_checkpoints,
    };
    Ok(axum::Json(s.queue().redrive(&id, options).await?))
}

/// A bulk action.
#[derive(Clone, Copy, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub(crate) enum BulkAction {
    /// Cancel each job.
    Cancel,
    /// Purge each job.
    Purge,
    /// Redrive each (dead) job.
    Redrive,
}

/// Which jobs a bulk action touches.
#[derive(Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BulkFilter {
    /// The derived state.
    #[serde(default)]
    #[schema(value_type = Option<JobState>)]
    state: Option<String>,
    /// The queue.
    #[serde(default)]
    queue: Option<String>,
    /// The job type.
    #[serde(default, rename = "type")]
    job_type: Option<String>,
    /// A tag.
    #[serde(default)]
    tag: Option<String>,
    /// Only jobs created strictly before this instant.
    #[serde(default)]
    before: Option<DateTime<Utc>>,
}

/// The body of `POST /v1/jobs/bulk`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct BulkBody {
    /// What to do to each matching job.
    action: BulkAction,
    /// Which jobs (every job when omitted).
    #[serde(default, deserialize_with = "idemq::wire::opt_object")]
    #[schema(value_type = Option<BulkFilter>)]
    filter: Option<BulkFilter>,
    /// At most this many jobs (1–10,000; 1,000 when omitted).
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<BulkLimit>)]
    limit: Option<u32>,
}

/// The answer of a bulk action.
#[derive(Serialize, ToSchema)]
pub(crate) struct BulkDone {
    /// Jobs that matched the filter (at most `limit`).
    matched: u64,
    /// Jobs the action changed.
    done: u64,
}

/// Applies an operator action to every job matching a filter, newest first.
/// Not atomic: each job is one call of its own, as the single-job endpoint
/// would make it.
#[utoipa::path(
    post,
    path = "/v1/jobs/bulk",
    operation_id = "bulkJobAction",
    tag = "jobs",
    request_body = BulkBody,
    responses(
        (status = 200, description = "How many jobs matched and how many were changed", body = BulkDone),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn bulk(
    State(s): State<ApiState>,
    Json(body): Json<BulkBody>,
) -> ApiResult<axum::Json<BulkDone>> {
    let limit = body.limit.unwrap_or(BULK_DEFAULT);
    if !(1..=BULK_MAX).contains(&limit) {
        return Err(Problem::validation("limit", "must be 1–10000"));
    }
    let f = body.filter.unwrap_or_default();
    let mut filter = JobList {
        state: parse_state("filter.state", f.state.as_deref())?,
        queue: f.queue,
        job_type: f.job_type,
        tag: f.tag,
        limit: 1000,
        cursor: None,
    };
    // Collect first, act after: acting while paging would move jobs between
    // the pages of a state filter.
    let mut ids = Vec::new();
    'pages: loop {
        let page = s
            .queue()
            .list_within(filter.clone(), MAX_PAGE_BYTES)
            .await?;
        for job in page.jobs {
            if f.before.is_none_or(|before| job.created_at < before) {
                ids.push(job.id);
                if ids.len() >= limit as usize {
                    break 'pages;
                }
            }
        }
        match page.next_cursor {
            Some(c) => filter.cursor = Some(c),
            None => break,
        }
    }
    let mut done = 0u64;
    for id in &ids {
        let changed = match body.action {
            BulkAction::Cancel => s.queue().cancel(id).await.map(|o| o.cancelled),
            BulkAction::Purge => s.queue().purge(id).await,
            BulkAction::Redrive => s
                .queue()
                .redrive(id, RedriveOptions::default())
                .await
                .map(|r| r.outcome == idemq::Outcome::Accepted),
        };
        match changed {
            Ok(true) => done += 1,
            Ok(false) => {}
            // The job changed state or vanished since it was listed.
            Err(idemq::Error::NotDead { .. } | idemq::Error::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(axum::Json(BulkDone {
        matched: ids.len() as u64,
        done,
    }))
}
