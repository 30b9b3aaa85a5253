//! The maintenance loop (docs/operating.md): reaps expired leases, fires due schedules,
//! removes expired bindings, deletes terminal jobs past their retention. Every pass is
//! bounded in rows, and every step is safe to run on many processes at once
//! (each row is taken by one pass; the others skip it).

use std::time::Duration;

use tokio::sync::watch;

use crate::error::Result;
use crate::queue::Queue;

/// What one maintenance pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Expired leases recorded.
    pub leases_reaped: u64,
    /// Schedule ticks fired.
    pub ticks_fired: u64,
    /// Expired or dead bindings removed.
    pub bindings_removed: u64,
    /// Terminal jobs deleted after their retention.
    pub jobs_deleted: u64,
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

    /// One bounded pass.
    pub async fn pass(&self) -> Result<PassReport> {
        Ok(PassReport {
            leases_reaped: self.queue.reap_leases(self.batch).await?,
            ticks_fired: self.queue.fire_schedules(self.batch.min(1000)).await?,
            bindings_removed: self.queue.sweep_bindings(self.batch).await?,
            jobs_deleted: self.queue.sweep_retention(self.batch).await?,
        })
    }

    /// Runs passes until `stop` turns true. A failed pass (the backend down)
    /// is retried at the next tick.
    pub async fn run_until(self, mut stop: watch::Receiver<bool>) {
        loop {
            if *stop.borrow() {
                return;
            }
            // A step that filled its batch has more to do: the next pass runs
            // at once, so sweeping keeps up with any rate of work while each
            // pass stays bounded in rows.
            if let Ok(r) = self.pass().await
                && r.is_full(self.batch)
            {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                _ = stop.changed() => {}
                () = tokio::time::sleep(self.every) => {}
            }
        }
    }
}
