//! The maintenance loop (docs/operating.md): reaps expired leases, fires due schedules,
//! removes expired bindings, deletes terminal jobs past their retention. Every pass is
//! bounded in rows, and every step is safe to run on many processes at once
//! (each row is taken by one pass; the others skip it).

use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::queue::Queue;

/// A step of a maintenance pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Recording expired leases.
    ReapLeases,
    /// Firing due schedules.
    FireSchedules,
    /// Removing expired or dead bindings.
    SweepBindings,
    /// Deleting terminal jobs past their retention.
    SweepRetention,
}

impl Step {
    /// Its name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::ReapLeases => "reap_leases",
            Self::FireSchedules => "fire_schedules",
            Self::SweepBindings => "sweep_bindings",
            Self::SweepRetention => "sweep_retention",
        }
    }
}

/// A step that failed in a pass (the others still ran; it runs again at the
/// next pass).
#[derive(Debug)]
pub struct StepError {
    /// Which step.
    pub step: Step,
    /// Why.
    pub error: Error,
}

/// What one maintenance pass did.
#[derive(Debug, Default)]
pub struct PassReport {
    /// Expired leases recorded.
    pub leases_reaped: u64,
    /// Schedule ticks fired.
    pub ticks_fired: u64,
    /// Expired or dead bindings removed.
    pub bindings_removed: u64,
    /// Terminal jobs deleted after their retention.
    pub jobs_deleted: u64,
    /// The steps that failed, each on its own.
    pub errors: Vec<StepError>,
}

impl PassReport {
    /// True when some step reached the row bound of the pass.
    pub fn is_full(&self, batch: u32) -> bool {
        let batch = u64::from(batch);
        [
            self.leases_reaped,
            self.ticks_fired,
            self.bindings_removed,
            self.jobs_deleted,
        ]
        .iter()
        .any(|&n| n >= batch)
    }
}

/// The maintenance loop of one process.
#[derive(Clone, Debug)]
pub struct Maintenance {
    queue: Queue,
    every: Duration,
    batch: u32,
}

impl Maintenance {
    /// A pass every second (so an expired lease is claimable again within a
    /// second), at most 1,000 rows per step.
    pub fn new(queue: Queue) -> Self {
        Self {
            queue,
            every: Duration::from_secs(1),
            batch: 1000,
        }
    }

    /// How often a pass runs.
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// At most this many rows per step of a pass.
    pub fn batch(mut self, rows: u32) -> Self {
        self.batch = rows.max(1);
        self
    }

    /// One bounded pass. Every step runs on its own: a step that fails (the
    /// backend down, a schedule that cannot fire) is reported in
    /// [`PassReport::errors`] and never keeps the other steps from running.
    pub async fn pass(&self) -> PassReport {
        let mut report = PassReport::default();
        let mut step = |step: Step, outcome: Result<u64>| match outcome {
            Ok(n) => n,
            Err(error) => {
                report.errors.push(StepError { step, error });
                0
            }
        };
        let reaped = step(Step::ReapLeases, self.queue.reap_leases(self.batch).await);
        let fired = step(
            Step::FireSchedules,
            self.queue.fire_schedules(self.batch.min(1000)).await,
        );
        let removed = step(
            Step::SweepBindings,
            self.queue.sweep_bindings(self.batch).await,
        );
        let deleted = step(
            Step::SweepRetention,
            self.queue.sweep_retention(self.batch).await,
        );
        report.leases_reaped = reaped;
        report.ticks_fired = fired;
        report.bindings_removed = removed;
        report.jobs_deleted = deleted;
        report
    }

    /// Runs passes until `stop` turns true, or until its sender is dropped
    /// (nothing could stop the loop after that: a dropped `Worker::run`, say).
    /// A failed step is logged (`tracing`, a warning when a step starts
    /// failing, at debug level while it keeps failing) and runs again at the
    /// next pass.
    pub async fn run_until(self, mut stop: watch::Receiver<bool>) {
        let mut failing: Vec<Step> = Vec::new();
        loop {
            if *stop.borrow() || stop.has_changed().is_err() {
                return;
            }
            let r = self.pass().await;
            let now_failing: Vec<Step> = r.errors.iter().map(|e| e.step).collect();
            for e in &r.errors {
                if failing.contains(&e.step) {
                    tracing::debug!(step = e.step.name(), error = %e.error, "maintenance step still failing");
                } else {
                    tracing::warn!(step = e.step.name(), error = %e.error, "maintenance step failed; it runs again at the next pass");
                }
            }
            for s in failing.iter().filter(|s| !now_failing.contains(s)) {
                tracing::info!(step = s.name(), "maintenance step recovered");
            }
            failing = now_failing;
            // A step that filled its batch has more to do: the next pass runs
            // at once, so sweeping keeps up with any rate of work while each
            // pass stays bounded in rows.
            if r.is_full(self.batch) {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                changed = stop.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                () = tokio::time::sleep(self.every) => {}
            }
        }
    }
}
