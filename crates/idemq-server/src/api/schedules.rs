//! Schedules: list, create or replace, delete.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idemq::{Schedule, ScheduleDefinition, UnreadableSchedule};
use serde::Serialize;
use serde_json::json;
use utoipa::ToSchema;

use super::ApiState;
use super::extract::{Json, NoBody, Path};
use super::problem::{ApiResult, Problem};

/// Every schedule.
#[derive(Serialize, ToSchema)]
pub(crate) struct Schedules {
    /// The schedules, by name.
    schedules: Vec<Schedule>,
    /// The schedules whose stored row this server cannot read (a template
    /// written by a newer idemq, say), by name, each with why; empty when
    /// every row reads. They are left as they are: they do not fire on this
    /// server, and setting one anew replaces its row.
    unreadable: Vec<UnreadableSchedule>,
}

/// The answer of a delete.
#[derive(Serialize, ToSchema)]
pub(crate) struct Deleted {
    /// Whether a schedule was deleted.
    deleted: bool,
}

/// Every schedule, by name, with its next fire.
///
/// A schedule whose stored row this server cannot read (a template written
/// by a newer idemq, say) is listed in `unreadable`, with its name and why;
/// the others are listed in `schedules` as usual.
#[utoipa::path(
    get,
    path = "/v1/schedules",
    operation_id = "listSchedules",
    tag = "schedules",
    responses((status = 200, description = "Every schedule; those whose stored row cannot be read in `unreadable`", body = Schedules))
)]
pub(crate) async fn list(State(s): State<ApiState>) -> ApiResult<axum::Json<Schedules>> {
    let list = s.queue().schedule_list().await?;
    for bad in &list.unreadable {
        tracing::warn!(schedule = ?bad.name, error = %bad.error, "a stored schedule cannot be read");
    }
    Ok(axum::Json(Schedules {
        schedules: list.schedules,
        unreadable: list.unreadable,
    }))
}

/// Creates or replaces a schedule.
#[utoipa::path(
    put,
    path = "/v1/schedules/{name}",
    operation_id = "putSchedule",
    tag = "schedules",
    params(("name" = idemq::openapi::ScheduleName, Path, description = "The schedule's name")),
    request_body = ScheduleDefinition,
    responses(
        (status = 201, description = "Created; the schedule", body = Schedule),
        (status = 200, description = "Replaced; the schedule", body = Schedule),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation (errors in the template name `job.<field>`)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn put(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    Json(definition): Json<ScheduleDefinition>,
) -> ApiResult<Response> {
    let created = s.queue().schedule_set(&name, definition).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    // Another schedule that cannot be read does not fail the answer.
    let schedule = s
        .queue()
        .schedule_list()
        .await?
        .schedules
        .into_iter()
        .find(|sch| sch.name == name);
    let body = match schedule {
        Some(schedule) => json!(schedule),
        // Deleted by someone else in between: say what this call did.
        None => json!({ "name": name }),
    };
    Ok((status, axum::Json(body)).into_response())
}

/// Deletes a schedule (jobs it already enqueued are not touched).
#[utoipa::path(
    delete,
    path = "/v1/schedules/{name}",
    operation_id = "deleteSchedule",
    tag = "schedules",
    params(("name" = idemq::openapi::ScheduleName, Path, description = "The schedule's name")),
    responses(
        (status = 200, description = "Whether a schedule was deleted", body = Deleted),
        (status = 422, description = "Invalid name", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn delete(
    State(s): State<ApiState>,
    Path(name): Path<String>,
    _: NoBody,
) -> ApiResult<axum::Json<Deleted>> {
    let deleted = s.queue().schedule_delete(&name).await?;
    Ok(axum::Json(Deleted { deleted }))
}
