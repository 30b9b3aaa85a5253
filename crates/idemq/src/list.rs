//! Listing jobs: the filter a caller gives and the page it gets back.

use serde::Serialize;

use crate::error::{Error, Result};
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

/// The bytes of a page's JSON (as [`JobPage`] serializes, compact) besides
/// its jobs and the commas between them, with the longest cursor:
/// `{"jobs":[` … `],"next_cursor":"<19 digits>"}`.
pub(crate) const PAGE_ENVELOPE_BYTES: usize = r#"{"jobs":[],"next_cursor":""}"#.len() + 19;

/// The bytes of `job`'s JSON as a page holds it (compact).
pub(crate) fn encoded_len(job: &Job) -> Result<usize> {
    /// Counts what is written and keeps nothing.
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Count(0);
    serde_json::to_writer(&mut n, job).map_err(|e| Error::Backend {
        message: format!("job {} cannot be written as JSON: {e}", job.id),
    })?;
    Ok(n.0)
}

/// A page being filled by a store from the jobs it reads newest first,
/// within the listing's bounds: at most `limit` jobs and, with a byte
/// bound, at most that many bytes of the page's JSON, except that a page
/// always holds its first job. The page ends before the first job that
/// does not fit, and its cursor is the sequence number of the last job it
/// holds, so the next page starts with the job left out.
#[derive(Debug)]
pub(crate) struct PageFill {
    limit: usize,
    max_bytes: Option<usize>,
    bytes: usize,
    jobs: Vec<Job>,
    last: Option<i64>,
    more: bool,
}

#[cfg_attr(
    not(any(feature = "sqlite", feature = "postgres", feature = "redis")),
    allow(dead_code)
)]
impl PageFill {
    pub(crate) fn new(limit: u32, max_bytes: Option<usize>) -> Self {
        Self {
            limit: limit as usize,
            max_bytes,
            bytes: PAGE_ENVELOPE_BYTES,
            jobs: Vec::new(),
            last: None,
            more: false,
        }
    }

    /// Whether the page is complete: a job read now belongs to the next page.
    pub(crate) fn is_full(&self) -> bool {
        self.more || self.jobs.len() >= self.limit
    }

    /// Offers the next job read (`seq` its sequence number): `false` when
    /// the page is complete and the job belongs to the next page.
    pub(crate) fn offer(&mut self, seq: i64, job: Job) -> Result<bool> {
        if self.is_full() {
            self.more = true;
            return Ok(false);
        }
        if let Some(max) = self.max_bytes {
            let size = encoded_len(&job)? + usize::from(!self.jobs.is_empty());
            if !self.jobs.is_empty() && self.bytes + size > max {
                self.more = true;
                return Ok(false);
            }
            self.bytes += size;
        }
        self.jobs.push(job);
        self.last = Some(seq);
        Ok(true)
    }

    /// The page; `more`: the store saw a job past the ones offered.
    pub(crate) fn finish(self, more: bool) -> JobPage {
        JobPage {
            next_cursor: if self.more || more {
                self.last.map(|s| s.to_string())
            } else {
                None
            },
            jobs: self.jobs,
        }
    }

    /// The page, with the cursor the store computed when no job was left
    /// out here (`cursor`), else the last job's.
    #[cfg(feature = "redis")]
    pub(crate) fn finish_with(self, cursor: Option<String>) -> JobPage {
        if self.more {
            return self.finish(true);
        }
        JobPage {
            jobs: self.jobs,
            next_cursor: cursor,
        }
    }
}
