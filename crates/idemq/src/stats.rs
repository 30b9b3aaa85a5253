//! What this process did through its queues: counters every surface of one
//! process shares (the HTTP handlers, the built-in worker, maintenance,
//! schedule ticks), because they all act through [`Queue`](crate::Queue)
//! methods, which count. The server exposes them at `/metrics`
//! (docs/http-api.md, "Operations").

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::job::{EnqueueResult, Outcome};

/// Upper bounds, in seconds, of the latency histograms' buckets
/// ([`Latency`]): from 1 ms to 10 s.
pub const LATENCY_BOUNDS_SECONDS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

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
    /// Enqueue requests answered, in the order of [`EnqueueCounts::OUTCOMES`].
    enqueues: [AtomicU64; 8],
    enqueue_latency: Histogram,
    claim_latency: Histogram,
}

/// A latency histogram's live buckets.
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; LATENCY_BOUNDS_SECONDS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    fn observe(&self, took: Duration) {
        let secs = took.as_secs_f64();
        if let Some(i) = LATENCY_BOUNDS_SECONDS.iter().position(|&b| secs <= b) {
            self.buckets[i].fetch_add(1, Ordering::Relaxed);
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn read(&self) -> Latency {
        Latency {
            buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            count: self.count.load(Ordering::Relaxed),
            sum: Duration::from_nanos(self.sum_nanos.load(Ordering::Relaxed)),
        }
    }
}

/// Enqueue requests answered, by outcome: the five outcomes of an
/// [`EnqueueResult`], and the three ways a request is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnqueueCounts {
    /// `accepted`: a new job.
    pub accepted: u64,
    /// `replayed`: the original job, nothing written.
    pub replayed: u64,
    /// `coalesced`: dropped by a live binding.
    pub coalesced: u64,
    /// `replaced`: a replace landed.
    pub replaced: u64,
    /// `non_replaceable`: a replace could not land.
    pub non_replaceable: u64,
    /// `conflict`: refused with an idempotency conflict.
    pub conflict: u64,
    /// `invalid`: refused by validation or a size limit.
    pub invalid: u64,
    /// `error`: the backend failed (nothing is known to be written).
    pub error: u64,
}

impl EnqueueCounts {
    /// The outcome labels, in the order of [`by_outcome`](Self::by_outcome).
    pub const OUTCOMES: [&'static str; 8] = [
        "accepted",
        "replayed",
        "coalesced",
        "replaced",
        "non_replaceable",
        "conflict",
        "invalid",
        "error",
    ];

    /// Each outcome's label with its count.
    pub fn by_outcome(&self) -> [(&'static str, u64); 8] {
        let n = [
            self.accepted,
            self.replayed,
            self.coalesced,
            self.replaced,
            self.non_replaceable,
            self.conflict,
            self.invalid,
            self.error,
        ];
        std::array::from_fn(|i| (Self::OUTCOMES[i], n[i]))
    }
}

/// A reading of a latency histogram: how many observations fell in each
/// bucket of [`LATENCY_BOUNDS_SECONDS`] (not cumulative: `buckets[i]` counts
/// those above the bound before it and at most `LATENCY_BOUNDS_SECONDS[i]`),
/// how many there were in all (those over the last bound included), and
/// their sum.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    /// Observations per bucket.
    pub buckets: [u64; LATENCY_BOUNDS_SECONDS.len()],
    /// Observations in all.
    pub count: u64,
    /// Their sum.
    pub sum: Duration,
}

/// A reading of the counters ([`Queue::stats`](crate::Queue::stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Jobs handed out by claims.
    pub claims: u64,
    /// Attempts completed.
    pub completions: u64,
    /// Attempts that sent their job back to run: failed and scheduled for
    /// a retry, snoozed, expired with attempts left, or ended past their
    /// timeout by a heartbeat.
    pub retries: u64,
    /// Jobs sent to the dead letters: by a failed attempt, an expired
    /// lease, a heartbeat past a timeout or deadline, or a claim meeting
    /// them past their deadline.
    pub dead: u64,
    /// Expired leases recorded, by the reaper or by a claim (which reaps
    /// before it claims).
    pub lease_expiries: u64,
    /// Jobs an operator purged.
    pub purges: u64,
    /// Terminal jobs the retention sweep deleted.
    pub retention_deletes: u64,
    /// Enqueue requests answered (single, batch items and schedule ticks),
    /// by outcome.
    pub enqueues: EnqueueCounts,
    /// Time to answer each enqueued request: a single enqueue's call, or
    /// for each item of a batch the batch's call.
    pub enqueue_latency: Latency,
    /// Time of each claim call (one round trip; a worker's call that only
    /// records completions is not a claim).
    pub claim_latency: Latency,
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
            enqueues: {
                let n: [u64; 8] = std::array::from_fn(|i| r(&self.enqueues[i]));
                EnqueueCounts {
                    accepted: n[0],
                    replayed: n[1],
                    coalesced: n[2],
                    replaced: n[3],
                    non_replaceable: n[4],
                    conflict: n[5],
                    invalid: n[6],
                    error: n[7],
                }
            },
            enqueue_latency: self.enqueue_latency.read(),
            claim_latency: self.claim_latency.read(),
        }
    }

    /// One enqueue request answered with `answer` after `took`.
    pub(crate) fn enqueue(&self, answer: &Result<EnqueueResult>, took: Duration) {
        let slot = match answer {
            Ok(r) => match r.outcome {
                Outcome::Accepted => 0,
                Outcome::Replayed => 1,
                Outcome::Coalesced => 2,
                Outcome::Replaced => 3,
                Outcome::NonReplaceable { .. } => 4,
            },
            Err(e) => {
                self.enqueue_refused(e);
                return;
            }
        };
        self.enqueues[slot].fetch_add(1, Ordering::Relaxed);
        self.enqueue_latency.observe(took);
    }

    /// One enqueue request refused with `error`.
    pub(crate) fn enqueue_refused(&self, error: &Error) {
        let slot = match error {
            Error::EnqueueIdempotencyConflict(_) => 5,
            Error::Validation { .. } | Error::PayloadTooLarge { .. } => 6,
            Error::BatchItem { error, .. } => return self.enqueue_refused(error),
            _ => 7,
        };
        self.enqueues[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// One claim call that took `took`.
    pub(crate) fn claim(&self, took: Duration) {
        self.claim_latency.observe(took);
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
