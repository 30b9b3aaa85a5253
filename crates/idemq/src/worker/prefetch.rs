//! Claimed jobs waiting in the worker for a free slot, and how many may.
//!
//! A claim costs the database a fixed amount before its first job (planning,
//! the commit) and little per job, so a worker whose slots free up in
//! batches of a few dozen pays that fixed cost often. While a backlog of
//! short jobs lasts, the worker claims beyond its running slots and keeps
//! the extra jobs here: each claim moves more jobs, and the next claim is
//! already in flight while the slots work through this one's.
//!
//! A job waiting here is leased to this worker like a running one (the
//! heartbeat loop renews it, cancellation and a lost lease reach it), and
//! its timeout and deadline count from its claim, as the store counts them.
//! How many may wait follows how long handlers take: the expected wait of
//! the last job in line stays under [`TARGET_WAIT`], so a worker of slow
//! jobs holds none back from other workers. At shutdown the jobs still
//! waiting are released at once (not consumed attempts).

use std::collections::VecDeque;
use std::time::Duration;

use tokio::time::Instant;

use super::handler::Erased;
use crate::job::ClaimedJob;

/// The expected wait, in the worker, of the last job in line.
const TARGET_WAIT: Duration = Duration::from_millis(100);

/// Weight of the newest handler's time in the running average.
const EWMA_WEIGHT: f64 = 0.05;

/// A claimed attempt and what its supervisor needs once a slot is free.
pub(super) struct Queued<C> {
    pub(super) job: ClaimedJob,
    pub(super) handler: Erased,
    pub(super) control: C,
    /// When the claim's answer arrived: timeout and deadline count from it.
    pub(super) claimed: Instant,
}

/// The jobs waiting for a slot, oldest claim first, and the pace of the
/// slots that decides how many may wait.
pub(super) struct Local<C> {
    waiting: VecDeque<Queued<C>>,
    /// The most that may wait (the worker's `prefetch` setting).
    most: usize,
    /// Running average of how long a slot stays busy, in seconds; `None`
    /// until a handler has ended (no prefetch before anything is known).
    busy: Option<f64>,
}

impl<C> Local<C> {
    pub(super) fn new(most: usize) -> Self {
        Self {
            waiting: VecDeque::new(),
            most,
            busy: None,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.waiting.len()
    }

    pub(super) fn push(&mut self, job: Queued<C>) {
        self.waiting.push_back(job);
    }

    pub(super) fn pop(&mut self) -> Option<Queued<C>> {
        self.waiting.pop_front()
    }

    /// Every job still waiting, for release at shutdown.
    pub(super) fn drain(&mut self) -> impl Iterator<Item = Queued<C>> + '_ {
        self.waiting.drain(..)
    }

    /// A slot was busy for `took`.
    pub(super) fn ran(&mut self, took: Duration) {
        let t = took.as_secs_f64();
        self.busy = Some(match self.busy {
            Some(avg) => avg + EWMA_WEIGHT * (t - avg),
            None => t,
        });
    }

    /// How many jobs may wait beside `slots` running ones: as many as the
    /// slots start within [`TARGET_WAIT`] at the current pace, at most the
    /// setting.
    pub(super) fn room(&self, slots: usize) -> usize {
        let Some(busy) = self.busy else { return 0 };
        let per_slot = if busy <= 0.0 {
            f64::INFINITY
        } else {
            TARGET_WAIT.as_secs_f64() / busy
        };
        let n = (per_slot * slots as f64).floor();
        if n >= self.most as f64 {
            self.most
        } else {
            // `n` is finite, non-negative and below `most` here.
            n as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_waits_before_a_handler_has_ended() {
        let local: Local<()> = Local::new(64);
        assert_eq!(local.room(64), 0);
    }

    #[test]
    fn short_handlers_fill_the_setting_and_slow_ones_keep_none() {
        let mut local: Local<()> = Local::new(64);
        local.ran(Duration::from_micros(50));
        assert_eq!(local.room(64), 64);
        let mut slow: Local<()> = Local::new(64);
        slow.ran(Duration::from_secs(2));
        // 64 slots of 2 s start 3.2 jobs in 100 ms.
        assert_eq!(slow.room(64), 3);
        let mut slower: Local<()> = Local::new(64);
        slower.ran(Duration::from_secs(60));
        assert_eq!(slower.room(64), 0);
        let off: Local<()> = Local::new(0);
        assert_eq!(off.room(64), 0);
    }

    #[test]
    fn the_pace_follows_the_handlers_gradually() {
        let mut local: Local<()> = Local::new(1000);
        local.ran(Duration::from_millis(10));
        let fast = local.room(10);
        assert_eq!(fast, 100);
        for _ in 0..10 {
            local.ran(Duration::from_millis(100));
        }
        let slower = local.room(10);
        assert!(slower < fast && slower > 10, "{slower}");
    }
}
