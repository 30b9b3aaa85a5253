//! Schedules: list, create or replace, delete.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use idemq::ScheduleDefinition;
use serde_json::{Value, json};

use super::ApiState;
use super::extract::{Json, Path};
use super::problem::ApiResult;
use super::schema::{DeletedDoc, ProblemDoc, ScheduleDefinitionDoc, ScheduleDoc, SchedulesDoc};

/// Every schedule, by name, with its next fire.
#[utoipa::path(
    get,
    path = "/v1/schedules",
    operation_id = "listSchedules",
    tag = "schedules",
    responses((status = 200, description = "Every schedule", body = SchedulesDoc))
)]
pub(crate) async fn list(State(s): State<ApiState>) -> ApiResult<axum::Json<Value>> {
    let schedules = s.queue().schedules().await?;
    Ok(axum::Json(json!({ "schedules": schedules })))
}

/// Creates or replaces a schedule.
#[utoipa::path(
    put,
    path = "/v1/schedules/{name}",
    operation_id = "putSchedule",
    tag = "schedules",
    params(("name" = String, Path, description = "The schedule's name (1–128 bytes of [A-Za-z0-9._:-])", min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._:-]+$")),
    request_body = ScheduleDefinitionDoc,
    responses(
        (status = 201, description = "Created; the schedule", body = ScheduleDoc),
        (status = 200, description = "Replaced; the schedule", body = ScheduleDoc),
        (status = 400, description = "Malformed body", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 422, description = "Validation (errors in the template name `job.<field>`)", body = ProblemDoc, content_type = "application/problem+json"),
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
    let schedule = s
        .queue()
        .schedules()
        .await?
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
    params(("name" = String, Path, description = "The schedule's name", min_length = 1, max_length = 128, pattern = r"^[A-Za-z0-9._:-]+$")),
    responses(
        (status = 200, description = "Whether a schedule was deleted", body = DeletedDoc),
        (status = 422, description = "Invalid name", body = ProblemDoc, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn delete(
    State(s): State<ApiState>,
    Path(name): Path<String>,
) -> ApiResult<axum::Json<Value>> {
    let deleted = s.queue().schedule_delete(&name).await?;
    Ok(axum::Json(json!({ "deleted": deleted })))
}
