//! The harness every case receives: a queue on a fresh database of one
//! backend, and a handle on that backend's clock of record.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use idemq::{ClaimOptions, ClaimedJob, EnqueueRequest, JobList, ManualClock, Queue, QueueOptions};

/// The instant every case starts at.
pub fn epoch() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
        .single()
        .expect("valid date")
}

/// A fresh database and the means to move its clock.
pub struct Harness {
    /// The queue under test.
    pub queue: Queue,
    /// `sqlite`, `postgres`, …
    pub backend: &'static str,
    clock: Arc<ManualClock>,
    /// The database file, for cases that inspect the bytes at rest.
    pub db_file: Option<PathBuf>,
    _dir: tempfile::TempDir,
}

impl Harness {
    /// A new SQLite database file in a temporary directory.
    pub async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idemq.db");
        let clock = Arc::new(ManualClock::new(epoch()));
        let options = QueueOptions {
            clock: clock.clone(),
            ..QueueOptions::default()
        };
        let url = format!("sqlite://{}", path.display());
        let queue = Queue::connect_with(&url, options)
            .await
            .expect("open sqlite");
        Self {
            queue,
            backend: "sqlite",
            clock,
            db_file: Some(path),
            _dir: dir,
        }
    }

    /// Moves the clock of record forward.
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// Moves the clock of record forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance(Duration::from_millis(ms));
    }

    /// The clock of record.
    pub async fn now(&self) -> DateTime<Utc> {
        self.queue.store().now().await.expect("now")
    }

    /// Every job (up to 1,000), newest first.
    pub async fn jobs(&self) -> Vec<idemq::Job> {
        self.queue
            .list(JobList {
                limit: 1000,
                ..JobList::default()
            })
            .await
            .expect("list")
            .jobs
    }

    /// (jobs, events) in the whole database.
    pub async fn totals(&self) -> (usize, usize) {
        let jobs = self.jobs().await;
        let mut events = 0;
        for j in &jobs {
            events += self.queue.events(&j.id).await.expect("events").len();
        }
        (jobs.len(), events)
    }

    /// The kinds of a job's events, oldest first.
    pub async fn event_kinds(&self, job_id: &str) -> Vec<String> {
        self.queue
            .events(job_id)
            .await
            .expect("events")
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    /// Enqueues and unwraps the job id.
    pub async fn put(&self, req: EnqueueRequest) -> String {
        self.queue.enqueue(req).await.expect("enqueue")
    }

    /// Claims up to `limit` jobs from every queue with a 30 s lease.
    pub async fn claim(&self, limit: u32) -> Vec<ClaimedJob> {
        self.claim_with(ClaimOptions {
            limit,
            worker: "w-1".into(),
            ..ClaimOptions::default()
        })
        .await
    }

    /// Claims with options.
    pub async fn claim_with(&self, options: ClaimOptions) -> Vec<ClaimedJob> {
        self.queue.claim(options).await.expect("claim")
    }

    /// Claims exactly one job and returns it.
    pub async fn claim_one(&self) -> ClaimedJob {
        let mut jobs = self.claim(1).await;
        assert_eq!(jobs.len(), 1, "expected one claimable job");
        jobs.remove(0)
    }

    /// The job, which must exist.
    pub async fn job(&self, id: &str) -> idemq::Job {
        self.queue.get(id).await.expect("get").expect("job exists")
    }
}
