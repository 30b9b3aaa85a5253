//! Listing jobs: the filter a caller gives and the page it gets back.

use serde::Serialize;

use crate::job::{Job, JobState};

/// `job_list` filters.
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

impl JobList {
    /// The filter on the stored state: `scheduled` and `ready` are one stored
    /// state (`waiting`), split by whether `run_at` is due.
    pub fn stored_state(&self) -> (Option<&'static str>, Option<bool>) {
        match self.state {
            None => (None, None),
            Some(JobState::Scheduled) => (Some("waiting"), Some(false)),
            Some(JobState::Ready) => (Some("waiting"), Some(true)),
            Some(s) => (Some(s.as_str()), None),
        }
    }

    /// The acceptance sequence number the cursor stands for (`Queue::list`
    /// refuses a cursor that is not a previous page's).
    pub fn seq_cursor(&self) -> Option<i64> {
        self.cursor.as_deref().and_then(|c| c.parse().ok())
    }
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
