//! What the fault tests share: retrying while a server is down or coming
//! back, reading a whole installation back, and a job's ledger (its events
//! and runs) with the check that it completed exactly once and repeated only
//! attempts recorded as cut short.

use std::time::{Duration, Instant};

use idemq::{Error, Job, JobList, Queue};

/// Runs `op` until it answers something other than `Unavailable` (Redis
/// down, loading its AOF, or the connection being re-established), for at
/// most 20 s.
pub async fn retry<T, F, Fut>(mut op: F) -> idemq::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = idemq::Result<T>>,
{
    let start = Instant::now();
    loop {
        match op().await {
            Err(Error::Unavailable { .. }) if start.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// Every job of the installation, newest first.
pub async fn all_jobs(queue: &Queue) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut cursor = None;
    loop {
        let page = retry(|| {
            queue.list(JobList {
                limit: 1000,
                cursor: cursor.clone(),
                ..JobList::default()
            })
        })
        .await
        .expect("list");
        jobs.extend(page.jobs);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return jobs,
        }
    }
}

/// (completed, active) jobs over every queue.
pub async fn counts(queue: &Queue) -> (u64, u64) {
    retry(|| queue.queues())
        .await
        .expect("queues")
        .iter()
        .fold((0, 0), |(c, a), q| {
            (c + q.counts.completed, a + q.counts.active)
        })
}

/// Waits until at least `n` jobs are completed.
pub async fn wait_completed(queue: &Queue, n: u64, within: Duration) {
    let start = Instant::now();
    loop {
        let (done, _) = counts(queue).await;
        if done >= n {
            return;
        }
        assert!(
            start.elapsed() < within,
            "only {done} of {n} jobs completed after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one job's events and run ledger say.
#[derive(Debug, Default)]
pub struct Ledger {
    /// `completed` events.
    pub completed_events: usize,
    /// `lease_expired` events.
    pub lease_expired_events: usize,
    /// Runs that completed.
    pub completed_runs: usize,
    /// Runs with no outcome yet.
    pub unfinished_runs: usize,
    /// Workers of the `lease_expired` runs, in order.
    pub expired_by: Vec<String>,
    /// Outcomes of the other runs (neither completed nor lease_expired).
    pub other_runs: Vec<String>,
    /// Every run of the job.
    pub runs: usize,
}

impl Ledger {
    /// Reads a job's events and runs.
    pub async fn of(queue: &Queue, job_id: &str) -> Self {
        let mut l = Self::default();
        for e in retry(|| queue.events(job_id)).await.expect("events") {
            match e.kind.as_str() {
                "completed" => l.completed_events += 1,
                "lease_expired" => l.lease_expired_events += 1,
                _ => {}
            }
        }
        let runs = retry(|| queue.runs(job_id)).await.expect("runs");
        l.runs = runs.len();
        for r in runs {
            match r.outcome.as_deref() {
                Some("completed") => l.completed_runs += 1,
                Some("lease_expired") => l.expired_by.push(r.worker),
                Some(other) => l.other_runs.push(other.to_owned()),
                None => l.unfinished_runs += 1,
            }
        }
        l
    }

    /// Completed exactly once, every other attempt recorded as cut short
    /// by an expired lease: what "repeats only with recorded attempts" means.
    pub fn problems(&self, job: &Job) -> Option<String> {
        let ok = self.completed_events == 1
            && self.completed_runs == 1
            && self.unfinished_runs == 0
            && self.other_runs.is_empty()
            && self.lease_expired_events == self.expired_by.len()
            && usize::try_from(job.attempt).ok() == Some(self.runs);
        (!ok).then(|| format!("{} (attempt {}): {self:?}", job.id, job.attempt))
    }
}
