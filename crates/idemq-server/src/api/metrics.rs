//! The server's Prometheus metrics, counted by the handlers on a recorder of
//! the router's own (no global recorder: an application embedding the router
//! keeps its own, and several servers in one process stay apart).

use std::time::Duration;

use idemq::QueueInfo;
use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

/// Histogram buckets in seconds, from 1 ms to 10 s.
const BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The recorder and what renders it.
pub(crate) struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Metrics {
    /// A fresh recorder with every metric described.
    pub(crate) fn new() -> Self {
        let builder = PrometheusBuilder::new()
            .set_buckets(BUCKETS)
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        let metrics = Self { recorder, handle };
        metrics.record(|| {
            describe_counter!(
                "idemq_enqueue_total",
                "Enqueue requests answered, by outcome (accepted, replayed, coalesced, \
                 replaced, non_replaceable, conflict)"
            );
            describe_counter!(
                "idemq_idempotency_conflicts_total",
                "Enqueues refused with an idempotency conflict"
            );
            describe_counter!("idemq_claims_total", "Jobs handed out by claims");
            describe_counter!("idemq_completions_total", "Attempts completed");
            describe_counter!(
                "idemq_retries_total",
                "Failed attempts scheduled for a retry or snoozed"
            );
            describe_counter!(
                "idemq_dead_total",
                "Failed attempts that sent their job to the dead letters"
            );
            describe_counter!(
                "idemq_lease_expiries_total",
                "Worker calls refused because the lease had expired or was taken over"
            );
            describe_gauge!(
                "idemq_queue_depth",
                "Jobs per queue and state at scrape time"
            );
            describe_histogram!(
                "idemq_enqueue_duration_seconds",
                Unit::Seconds,
                "Time to answer an enqueue (one backend round trip)"
            );
            describe_histogram!(
                "idemq_claim_duration_seconds",
                Unit::Seconds,
                "Time of one claim round trip (long-poll waiting excluded)"
            );
        });
        metrics
    }

    /// Runs `f` with this recorder as the current one.
    fn record<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder, f)
    }

    /// One enqueue answered with `outcome` after `took`.
    pub(crate) fn enqueue(&self, outcome: &'static str, took: Option<Duration>) {
        self.record(|| {
            counter!("idemq_enqueue_total", "outcome" => outcome).increment(1);
            if outcome == "conflict" {
                counter!("idemq_idempotency_conflicts_total").increment(1);
            }
            if let Some(took) = took {
                histogram!("idemq_enqueue_duration_seconds").record(took.as_secs_f64());
            }
        });
    }

    /// One claim round trip that handed out `jobs` jobs.
    pub(crate) fn claim(&self, jobs: usize, took: Duration) {
        self.record(|| {
            counter!("idemq_claims_total").increment(jobs as u64);
            histogram!("idemq_claim_duration_seconds").record(took.as_secs_f64());
        });
    }

    /// One completed attempt.
    pub(crate) fn completion(&self) {
        self.record(|| counter!("idemq_completions_total").increment(1));
    }

    /// One failed attempt that ended in `state`.
    pub(crate) fn failure(&self, state: idemq::JobState) {
        self.record(|| match state {
            idemq::JobState::Scheduled | idemq::JobState::Ready => {
                counter!("idemq_retries_total").increment(1)
            }
            idemq::JobState::Dead => counter!("idemq_dead_total").increment(1),
            _ => {}
        });
    }

    /// One worker call refused with `lease-lost`.
    pub(crate) fn lease_expiry(&self) {
        self.record(|| counter!("idemq_lease_expiries_total").increment(1));
    }

    /// The text exposition, with the queue depths of `queues`.
    pub(crate) fn render(&self, queues: &[QueueInfo]) -> String {
        self.record(|| {
            for q in queues {
                let c = &q.counts;
                for (state, n) in [
                    ("scheduled", c.scheduled),
                    ("ready", c.ready),
                    ("active", c.active),
                    ("completed", c.completed),
                    ("dead", c.dead),
                    ("cancelled", c.cancelled),
                ] {
                    gauge!("idemq_queue_depth", "queue" => q.name.clone(), "state" => state)
                        .set(n as f64);
                }
            }
        });
        self.handle.run_upkeep();
        self.handle.render()
    }
}
