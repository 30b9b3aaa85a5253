//! The dedupe decision table of docs/dedupe.md, as pure functions over a binding and
//! its keyed job. The SQLite backend calls them inside its transaction; the
//! conformance suite pins every cell on every backend.

use crate::job::NonReplaceableReason;
use crate::request::DedupeMode;

/// Where the keyed job stands, as far as dedupe cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyedJob {
    /// The record is gone (purged or deleted by retention).
    Missing,
    /// Scheduled or ready. `started` is true when an attempt ever started
    /// (it waits for a retry); `due` when `run_at <= now`.
    Waiting {
        /// An attempt already started.
        started: bool,
        /// The job is due.
        due: bool,
    },
    /// Claimed by a worker.
    Active,
    /// Completed or dead.
    Finished,
    /// Cancelled.
    Cancelled,
}

impl KeyedJob {
    /// Scheduled, ready or active.
    pub fn is_pending(self) -> bool {
        matches!(self, Self::Waiting { .. } | Self::Active)
    }
}

/// A stored dedupe binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// The job holding the key.
    pub job_id: String,
    /// The mode the binding was created with.
    pub mode: DedupeMode,
    /// Its window, if any.
    pub ttl_ms: Option<i64>,
    /// Its cap from first acceptance, if any.
    pub max_wait_ms: Option<i64>,
    /// First acceptance (µs).
    pub accepted_at: i64,
    /// End of the window (µs); `None` for the modes that live while the job is pending.
    pub window_until: Option<i64>,
}

/// What a request meeting a live binding does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Dropped; `rearm` when the binding is a debounce window pushed out again.
    Coalesce {
        /// Re-arm the debounce window.
        rearm: bool,
    },
    /// The replace lands on the keyed job.
    Replace,
    /// The replace cannot land.
    NonReplaceable(NonReplaceableReason),
}

impl Binding {
    /// Liveness (docs/dedupe.md): no-ttl modes while the job is pending, ttl modes
    /// while `now < window_until` (debounce's `max_wait` is folded into
    /// `window_until` when the window is armed).
    pub fn is_live(&self, job: KeyedJob, now: i64) -> bool {
        match self.window_until {
            None => job.is_pending(),
            Some(until) => now < until && job != KeyedJob::Cancelled,
        }
    }

    /// The decision for a request of `mode` meeting this live binding.
    pub fn decide(&self, job: KeyedJob, mode: DedupeMode) -> Decision {
        match (self.mode, mode) {
            (DedupeMode::Replace, DedupeMode::Replace) => match job {
                KeyedJob::Waiting {
                    started: false,
                    due: false,
                } => Decision::Replace,
                KeyedJob::Waiting {
                    started: false,
                    due: true,
                } => Decision::NonReplaceable(NonReplaceableReason::WindowElapsed),
                _ => Decision::NonReplaceable(NonReplaceableReason::NotPending),
            },
            (DedupeMode::Replace, _) => Decision::Coalesce { rearm: false },
            (_, DedupeMode::Replace) => {
                Decision::NonReplaceable(NonReplaceableReason::IncompatibleMode)
            }
            (bound, _) => Decision::Coalesce {
                rearm: bound == DedupeMode::Debounce,
            },
        }
    }

    /// The window a debounce binding gets when (re-)armed at `now`.
    pub fn debounce_window(
        ttl_ms: i64,
        max_wait_ms: Option<i64>,
        accepted_at: i64,
        now: i64,
    ) -> i64 {
        let until = now + ttl_ms * 1000;
        max_wait_ms.map_or(until, |w| until.min(accepted_at + w * 1000))
    }

    /// The window a new binding of `mode` gets at acceptance `now` for a job due at `run_at`.
    pub fn initial_window(
        mode: DedupeMode,
        ttl_ms: Option<i64>,
        max_wait_ms: Option<i64>,
        now: i64,
        run_at: i64,
    ) -> Option<i64> {
        let ttl = ttl_ms?;
        Some(match mode {
            DedupeMode::Debounce => Self::debounce_window(ttl, max_wait_ms, now, now),
            // A replace window cannot end before its job is due.
            DedupeMode::Replace => (now + ttl * 1000).max(run_at),
            DedupeMode::Pending | DedupeMode::Throttle => now + ttl * 1000,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding(mode: DedupeMode, window_until: Option<i64>) -> Binding {
        Binding {
            job_id: "j".into(),
            mode,
            ttl_ms: window_until.map(|_| 1000),
            max_wait_ms: None,
            accepted_at: 0,
            window_until,
        }
    }

    #[test]
    fn pending_binding_lives_with_its_job() {
        let b = binding(DedupeMode::Pending, None);
        assert!(b.is_live(KeyedJob::Active, 10));
        assert!(b.is_live(
            KeyedJob::Waiting {
                started: true,
                due: true
            },
            10
        ));
        assert!(!b.is_live(KeyedJob::Finished, 10));
        assert!(!b.is_live(KeyedJob::Missing, 10));
    }

    #[test]
    fn window_binding_lives_until_its_end() {
        let b = binding(DedupeMode::Throttle, Some(100));
        assert!(b.is_live(KeyedJob::Finished, 99));
        assert!(!b.is_live(KeyedJob::Finished, 100));
    }

    #[test]
    fn replace_meets_other_modes() {
        let b = binding(DedupeMode::Debounce, Some(100));
        let w = KeyedJob::Waiting {
            started: false,
            due: false,
        };
        assert_eq!(
            b.decide(w, DedupeMode::Replace),
            Decision::NonReplaceable(NonReplaceableReason::IncompatibleMode)
        );
        assert_eq!(
            b.decide(w, DedupeMode::Pending),
            Decision::Coalesce { rearm: true }
        );
        let r = binding(DedupeMode::Replace, None);
        assert_eq!(
            r.decide(w, DedupeMode::Throttle),
            Decision::Coalesce { rearm: false }
        );
        assert_eq!(r.decide(w, DedupeMode::Replace), Decision::Replace);
    }

    #[test]
    fn debounce_window_is_capped_by_max_wait() {
        assert_eq!(Binding::debounce_window(10, Some(15), 0, 10_000), 15_000);
        assert_eq!(Binding::debounce_window(10, None, 0, 10_000), 20_000);
    }
}
