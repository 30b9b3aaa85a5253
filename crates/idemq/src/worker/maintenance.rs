//! The maintenance loop (docs/operating.md): checks the store's durable settings again,
//! reaps expired leases, fires due schedules, removes expired bindings, deletes terminal
//! jobs past their retention. Every pass is
//! bounded in rows, and every step is safe to run on many processes at once
//! (each row is taken by one pass; the others skip it).

use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::queue::Queue;

/// A step of a maintenance pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// Checking that the server still has the settings the store's
    /// durability rests on (Redis; a strict store refuses writes while
    /// they are off).
    CheckDurability,
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
    /// Every step, in the order of a pass.
    pub const ALL: [Step; 5] = [
        Self::CheckDurability,
        Self::ReapLeases,
        Self::FireSchedules,
        Self::SweepBindings,
        Self::SweepRetention,
    ];

    /// Its name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::CheckDurability => "check_durability",
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
        for step in Step::ALL {
            let n = match self.run_step(step).await {
                Ok(n) => n,
                Err(error) => {
                    report.errors.push(StepError { step, error });
                    0
                }
            };
            *match step {
                // A check counts nothing; what it found is its error.
                Step::CheckDurability => continue,
                Step::ReapLeases => &mut report.leases_reaped,
                Step::FireSchedules => &mut report.ticks_fired,
                Step::SweepBindings => &mut report.bindings_removed,
                Step::SweepRetention => &mut report.jobs_deleted,
            } = n;
        }
        report
    }

    /// Runs the steps until `stop` turns true, or until its sender is
    /// dropped (nothing could stop the loop after that: a dropped
    /// `Worker::run`, say).
    ///
    /// Each step runs in a loop of its own, every [`every`](Self::every) and
    /// at once again while it fills its batch, so a step that waits never
    /// holds up another: a schedule's tick waiting for a lock that an
    /// application's open transaction holds (its dedupe key, on PostgreSQL)
    /// leaves expired leases reaped and bindings swept on time. A failed
    /// step is logged (`tracing`, a warning when it starts failing, at debug
    /// level while it keeps failing, at info level when it recovers) and
    /// runs again after `every`.
    pub async fn run_until(self, stop: watch::Receiver<bool>) {
        let steps = Step::ALL.map(|step| self.step_loop(step, stop.clone()));
        futures_util::future::join_all(steps).await;
    }

    /// The most rows one call of `step` takes (a schedule step fires at
    /// most 1,000 ticks a call).
    fn limit(&self, step: Step) -> u32 {
        match step {
            Step::FireSchedules => self.batch.min(1000),
            _ => self.batch,
        }
    }

    /// Runs one step once.
    async fn run_step(&self, step: Step) -> Result<u64> {
        let limit = self.limit(step);
        match step {
            Step::CheckDurability => self.queue.check_durability().await.map(|()| 0),
            Step::ReapLeases => self.queue.reap_leases(limit).await,
            Step::FireSchedules => self.queue.fire_schedules(limit).await,
            Step::SweepBindings => self.queue.sweep_bindings(limit).await,
            Step::SweepRetention => self.queue.sweep_retention(limit).await,
        }
    }

    /// The loop of one step, until `stop`.
    async fn step_loop(&self, step: Step, mut stop: watch::Receiver<bool>) {
        let mut failing = false;
        loop {
            if *stop.borrow() || stop.has_changed().is_err() {
                return;
            }
            let mut full = false;
            match self.run_step(step).await {
                Ok(n) => {
                    if failing {
                        tracing::info!(step = step.name(), "maintenance step recovered");
                    }
                    failing = false;
                    full = n >= u64::from(self.limit(step));
                }
                Err(error) if failing => {
                    tracing::debug!(step = step.name(), %error, "maintenance step still failing");
                }
                Err(error) => {
                    failing = true;
                    tracing::warn!(step = step.name(), %error, "maintenance step failed; it runs again at the next pass");
                }
            }
            // A step that filled its batch has more to do: it runs again at
            // once, so sweeping keeps up with any rate of work while each
            // call stays bounded in rows.
            if full {
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
