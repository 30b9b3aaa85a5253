//! What this process did through its queues: counters every surface of one
//! process shares (the HTTP handlers, the built-in worker, maintenance),
//! because they all act through [`Queue`](crate::Queue) methods, which count.
//! The server exposes them at `/metrics` (docs/http-api.md, "Operations").

use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one queue and its clones.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    claims: AtomicU64,
    completions: AtomicU64,
    retries: AtomicU64,
    dead: AtomicU64,
    lease_expiries: AtomicU64,
    purges: AtomicU64,
    retention_deletes: AtomicU64,
}

/// A reading of the counters ([`Queue::stats`](crate::Queue::stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Jobs handed out by claims.
    pub claims: u64,
    /// Attempts completed.
    pub completions: u64,
    /// Failed attempts scheduled for a retry or snoozed.
    pub retries: u64,
    /// Failed attempts that sent their job to the dead letters.
    pub dead: u64,
    /// Expired leases the reaper recorded.
    pub lease_expiries: u64,
    /// Jobs an operator purged.
    pub purges: u64,
    /// Terminal jobs the retention sweep deleted.
    pub retention_deletes: u64,
}

impl Counters {
    pub(crate) fn add(&self, which: Counter, n: u64) {
        let c = match which {
            Counter::Claims => &self.claims,
            Counter::Completions => &self.completions,
            Counter::Retries => &self.retries,
            Counter::Dead => &self.dead,
            Counter::LeaseExpiries => &self.lease_expiries,
            Counter::Purges => &self.purges,
            Counter::RetentionDeletes => &self.retention_deletes,
        };
        c.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn read(&self) -> Stats {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Stats {
            claims: r(&self.claims),
            completions: r(&self.completions),
            retries: r(&self.retries),
            dead: r(&self.dead),
            lease_expiries: r(&self.lease_expiries),
            purges: r(&self.purges),
            retention_deletes: r(&self.retention_deletes),
        }
    }
}

/// One counter.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Counter {
    Claims,
    Completions,
    Retries,
    Dead,
    LeaseExpiries,
    Purges,
    RetentionDeletes,
}
