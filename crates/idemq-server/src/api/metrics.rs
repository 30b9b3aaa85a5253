//! The server's Prometheus metrics, on a recorder of the router's own (no
//! global recorder: an application embedding the router keeps its own, and
//! several servers in one process stay apart). Every count and latency is
//! read from the queue's own counters ([`idemq::Queue::stats`]) at scrape
//! time, so they include what this process's built-in worker, maintenance
//! and schedule ticks did, not only its HTTP handlers; the queue depths are
//! read from the store.

use std::fmt::Write as _;

use idemq::{LATENCY_BOUNDS_SECONDS, Latency, QueueInfo};
use metrics::{counter, describe_counter, describe_gauge, gauge};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle, PrometheusRecorder};

/// The latency histograms: name, help text, and which reading.
const HISTOGRAMS: [(&str, &str); 2] = [
    (
        "idemq_enqueue_duration_seconds",
        "Time to answer an enqueue request (for each item of a batch, the batch's call)",
    ),
    (
        "idemq_claim_duration_seconds",
        "Time of one claim round trip (long-poll waiting excluded)",
    ),
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
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let metrics = Self { recorder, handle };
        metrics.record(|| {
            describe_counter!(
                "idemq_enqueue_total",
                "Enqueue requests answered (single, batch items and schedule ticks), by \
                 outcome (accepted, replayed, coalesced, replaced, non_replaceable, conflict, \
                 invalid, error)"
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
                "Attempts that sent their job back to run (failed, snoozed, expired lease, timed out)"
            );
            describe_counter!(
                "idemq_dead_total",
                "Jobs sent to the dead letters (failed, expired lease, timed out, past their deadline)"
            );
            describe_counter!(
                "idemq_lease_expiries_total",
                "Expired leases this process recorded (maintenance's reaper and claims)"
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
        });
        metrics
    }

    /// Runs `f` with this recorder as the current one.
    fn record<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder, f)
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
            for (outcome, n) in stats.enqueues.by_outcome() {
                counter!("idemq_enqueue_total", "outcome" => outcome).absolute(n);
            }
            counter!("idemq_idempotency_conflicts_total").absolute(stats.enqueues.conflict);
            counter!("idemq_claims_total").absolute(stats.claims);
            counter!("idemq_completions_total").absolute(stats.completions);
            counter!("idemq_retries_total").absolute(stats.retries);
            counter!("idemq_dead_total").absolute(stats.dead);
            counter!("idemq_lease_expiries_total").absolute(stats.lease_expiries);
            counter!("idemq_purges_total", "reason" => "operator").absolute(stats.purges);
            counter!("idemq_purges_total", "reason" => "retention")
                .absolute(stats.retention_deletes);
        });
        self.handle.run_upkeep();
        let mut text = self.handle.render();
        queue_depths(&mut text, queues);
        for ((name, help), latency) in HISTOGRAMS
            .iter()
            .zip([stats.enqueue_latency, stats.claim_latency])
        {
            histogram(&mut text, name, help, &latency);
        }
        text
    }
}

/// Appends `idemq_queue_depth` for exactly the queues the store reports
/// now. Written here rather than kept in the recorder: a gauge of the
/// recorder would keep a queue that is gone (its jobs deleted) at its last
/// value for ever, and grow with every queue name ever seen.
fn queue_depths(out: &mut String, queues: &[QueueInfo]) {
    if queues.is_empty() {
        return;
    }
    if !out.is_empty() && !out.ends_with("\n\n") {
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "# HELP idemq_queue_depth Jobs per queue and state at scrape time"
    );
    let _ = writeln!(out, "# TYPE idemq_queue_depth gauge");
    for q in queues {
        let c = &q.counts;
        let name = label(&q.name);
        for (state, n) in [
            ("scheduled", c.scheduled),
            ("ready", c.ready),
            ("active", c.active),
            ("completed", c.completed),
            ("dead", c.dead),
            ("cancelled", c.cancelled),
        ] {
            let _ = writeln!(
                out,
                "idemq_queue_depth{{queue=\"{name}\",state=\"{state}\"}} {n}"
            );
        }
    }
}

/// A label value in the Prometheus text format: `\`, `"` and line feeds
/// escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Appends one histogram in the Prometheus text format: cumulative buckets,
/// `+Inf`, the sum in seconds and the count.
fn histogram(out: &mut String, name: &str, help: &str, latency: &Latency) {
    if !out.is_empty() && !out.ends_with("\n\n") {
        out.push('\n');
    }
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} histogram");
    let mut below = 0;
    for (bound, n) in LATENCY_BOUNDS_SECONDS.iter().zip(latency.buckets) {
        below += n;
        let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {below}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", latency.count);
    let _ = writeln!(out, "{name}_sum {}", latency.sum.as_secs_f64());
    let _ = writeln!(out, "{name}_count {}", latency.count);
}
