//! The injectable clock of record for the embedded backend.
//!
//! Every time-dependent decision of the SQLite backend reads one `Clock`, so
//! tests move time (TTL windows, debounce, leases, schedules) without sleeping.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};

/// A source of "now".
pub trait Clock: Send + Sync + std::fmt::Debug {
    /// The current instant.
    fn now(&self) -> DateTime<Utc>;
}

/// The system clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> DateTime<Utc> {
        Utc::now()
    }
}

/// A clock that moves only when told to: for tests and simulations.
#[derive(Debug)]
pub struct ManualClock {
    micros: AtomicI64,
}

impl ManualClock {
    /// A clock standing at `at`.
    pub fn new(at: DateTime<Utc>) -> Self {
        Self {
            micros: AtomicI64::new(at.timestamp_micros()),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let us = i64::try_from(by.as_micros()).unwrap_or(i64::MAX);
        self.micros.fetch_add(us, Ordering::SeqCst);
    }

    /// Sets the clock to `at` (it may move backwards: a test of clock skew).
    pub fn set(&self, at: DateTime<Utc>) {
        self.micros.store(at.timestamp_micros(), Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> DateTime<Utc> {
        let us = self.micros.load(Ordering::SeqCst);
        DateTime::from_timestamp_micros(us).unwrap_or_default()
    }
}
