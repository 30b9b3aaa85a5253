//! Operator actions: `POST` forms that act through [`idemq::Queue`] and
//! redirect back to the page they came from (post/redirect/get), with a
//! fixed flash code saying what happened.

use axum::Form;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect};
use idemq::RedriveOptions;
use serde::Deserialize;

use super::{PageError, PageResult, check_same_origin, local_back};
use crate::AppState;

/// The fields every action form posts.
#[derive(Deserialize, Default)]
pub(crate) struct ActionForm {
    /// Where to go afterwards (a local path).
    back: Option<String>,
}

fn back_with(back: &str, flash: &str) -> Redirect {
    let sep = if back.contains('?') { '&' } else { '?' };
    Redirect::to(&format!("{back}{sep}flash={flash}"))
}

/// `POST /dashboard/actions/jobs/{id}/{cancel|purge|promote|redrive}`.
pub(crate) async fn job(
    State(state): State<AppState>,
    Path((id, action)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> PageResult {
    check_same_origin(&headers)?;
    let job_page = format!("/jobs/{}", super::html::pct(&id));
    let back = local_back(form.back.as_deref(), &job_page);
    let flash = match action.as_str() {
        "cancel" => {
            let out = state.queue.cancel(&id).await?;
            match (out.cancelled, out.state) {
                (true, idemq::JobState::Active) => "cancel_requested",
                (true, _) => "cancelled",
                (false, _) => "not_cancelled",
            }
        }
        "purge" => {
            if state.queue.purge(&id).await? {
                "purged"
            } else {
                "not_purged"
            }
        }
        "promote" => {
            if state.queue.promote(&id).await? {
                "promoted"
            } else {
                "not_promoted"
            }
        }
        "redrive" => {
            state.queue.redrive(&id, RedriveOptions::default()).await?;
            "redriven"
        }
        other => {
            return Err(PageError::new(
                StatusCode::NOT_FOUND,
                format!("unknown action {other:?}"),
            ));
        }
    };
    tracing::info!(job_id = %id, action = %action, result = flash, "dashboard action");
    Ok(back_with(back, flash).into_response())
}

/// `POST /dashboard/actions/queues/{name}/{pause|resume}`.
pub(crate) async fn queue(
    State(state): State<AppState>,
    Path((name, action)): Path<(String, String)>,
    headers: HeaderMap,
    Form(form): Form<ActionForm>,
) -> PageResult {
    check_same_origin(&headers)?;
    let back = local_back(form.back.as_deref(), "/");
    let flash = match action.as_str() {
        "pause" => {
            state.queue.pause(&name).await?;
            "paused"
        }
        "resume" => {
            state.queue.resume(&name).await?;
            "resumed"
        }
        other => {
            return Err(PageError::new(
                StatusCode::NOT_FOUND,
                format!("unknown action {other:?}"),
            ));
        }
    };
    tracing::info!(queue = %name, action = %action, "dashboard action");
    Ok(back_with(back, flash).into_response())
}
