//! The server's Prometheus metrics, on a recorder of the router's own (no
//! global recorder: an application embedding the router keeps its own, and
//! several servers in one process stay apart). Enqueue outcomes and the
//! latency histograms are counted by the handlers; claims, completions,
//! retries, dead letters, reaped leases and purges are read from the
//! queue's own counters ([`idemq::Queue::stats`]) at scrape time, so they
//! include what this process's built-in worker and maintenance did.

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
            describe_counter!(
                "idemq_claims_total",
                "Jobs handed out by claims of this process (API and built-in worker)"
            );
            describe_counter!(
                "idemq_completions_total",
                "Attempts this process completed (API and built-in worker)"
            );
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
                "Expired leases this process's maintenance reaped and recorded"
            );
            describe_counter!(
                "idemq_purges_total",
                "Jobs deleted by this process: reason=operator (purge) or reason=retention (the retention sweep)"
            );
            describe_gauge!(
                "idemq_durability_relaxed",
                "1 when the store runs without its durability settings checked (Redis \
                 ?durability=relaxed: acknowledged jobs may be lost), else 0"
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

    /// The time of one claim round trip.
    pub(crate) fn claim(&self, took: Duration) {
        self.record(|| {
            histogram!("idemq_claim_duration_seconds").record(took.as_secs_f64());
        });
    }

    /// The text exposition, with the queue depths of `queues`, the
    /// process's counters `stats`, and whether the store's durability is
    /// `relaxed`.
    pub(crate) fn render(
        &self,
        queues: &[QueueInfo],
        stats: idemq::Stats,
        relaxed: bool,
    ) -> String {
        self.record(|| {
            gauge!("idemq_durability_relaxed").set(if relaxed { 1.0 } else { 0.0 });
            counter!("idemq_claims_total").absolute(stats.claims);
            counter!("idemq_completions_total").absolute(stats.completions);
            counter!("idemq_retries_total").absolute(stats.retries);
            counter!("idemq_dead_total").absolute(stats.dead);
            counter!("idemq_lease_expiries_total").absolute(stats.lease_expiries);
            counter!("idemq_purges_total", "reason" => "operator").absolute(stats.purges);
            counter!("idemq_purges_total", "reason" => "retention")
                .absolute(stats.retention_deletes);
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
