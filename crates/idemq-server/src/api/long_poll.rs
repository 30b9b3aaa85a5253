//! The bound on long-polls held at once.
//!
//! A long-poll (a claim or a job read with `wait_ms`) looks at the store
//! again and again while it waits: a claim at each wake-up and at least
//! every 500 ms (a write transaction on SQLite), a job read on the pace of
//! `Queue::wait` (backing off to a read a second). Without a bound, a few hundred of them hold the
//! database's connections for everyone. So a request that asks to wait
//! takes a permit first, and one that finds them all held is answered
//! `503 unavailable` with `Retry-After` at once; a request that does not
//! wait takes none and is never refused by this bound.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::problem::{Problem, unavailable};

/// The `503` of an operation that may wait, in the OpenAPI document.
pub(crate) const UNAVAILABLE_WAIT: &str = "`unavailable`: the backend is down or busy, or the \
     request asked to wait while the server holds its most long-polls at once (nothing was \
     done); retry after `Retry-After` seconds";

/// The `Retry-After` of a wait refused because the bound is full (seconds):
/// a wait ends as soon as its work arrives, so permits turn over fast.
const RETRY_AFTER_SECS: u64 = 1;

/// The permits of the long-polls of one server.
pub(crate) struct LongPolls {
    permits: Arc<Semaphore>,
    max: usize,
}

/// A wait's permit, given back when the request ends (answered, or dropped
/// because its client went away).
pub(crate) type Permit = OwnedSemaphorePermit;

impl LongPolls {
    /// At most `max` waits at once (0: none).
    pub(crate) fn new(max: usize) -> Self {
        let max = max.min(Semaphore::MAX_PERMITS);
        Self {
            permits: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A permit to wait, or the `503` to answer when every permit is held.
    /// It never waits for one: a request queued behind the waits would
    /// only hold its connection longer.
    pub(crate) fn try_hold(&self) -> Result<Permit, Problem> {
        self.permits.clone().try_acquire_owned().map_err(|_| {
            unavailable(
                &format!(
                    "the server holds its most long-polls at once ({}); retry after \
                     Retry-After seconds, or ask without wait_ms",
                    self.max
                ),
                RETRY_AFTER_SECS,
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_refuses_once_full_and_frees_on_drop() {
        let polls = LongPolls::new(2);
        let a = polls.try_hold().expect("first");
        let _b = polls.try_hold().expect("second");
        let refused = polls.try_hold().expect_err("full");
        assert_eq!(refused.status().as_u16(), 503);
        drop(a);
        assert!(
            polls.try_hold().is_ok(),
            "a permit given back is taken again"
        );
        assert!(LongPolls::new(0).try_hold().is_err());
    }
}
