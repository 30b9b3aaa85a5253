//! Listing jobs: the filter a caller gives and the page it gets back.

use serde::Serialize;

use crate::job::{Job, JobState};

/// Which jobs [`Queue::list`](crate::Queue::list) returns: every filter set
/// must match.
#[derive(Clone, Debug, Default)]
pub struct JobList {
    /// Derived state.
    pub state: Option<JobState>,
    /// Queue.
    pub queue: Option<String>,
    /// Job type.
    pub job_type: Option<String>,
    /// Tag.
    pub tag: Option<String>,
    /// Page size (1–1000).
    pub limit: u32,
    /// Opaque cursor from the previous page.
    pub cursor: Option<String>,
}

/// One page of jobs, newest first.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobPage {
    /// The jobs.
    pub jobs: Vec<Job>,
    /// The cursor of the next page, if there is one.
    pub next_cursor: Option<String>,
}
