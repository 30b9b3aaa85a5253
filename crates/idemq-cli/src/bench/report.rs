//! Result rows: one JSON object per line (`--json`) or a table, and the
//! peak resident memory of each workload.

use serde::Serialize;

use super::Sizes;
use super::target::Backend;

/// One workload's figure beside its limit.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Row {
    pub workload: &'static str,
    pub backend: &'static str,
    pub producers: usize,
    pub ops: usize,
    pub ops_per_sec: f64,
    /// What the figure is compared with.
    pub limit: String,
    pub limit_ops_per_sec: Option<f64>,
    /// `ops_per_sec / limit_ops_per_sec` (W6: the raw commit latency over
    /// idemq's p50, so higher is better everywhere).
    pub ratio: Option<f64>,
    /// The target, as text (`>= 0.8x`, `p50 <= 5 ms`).
    pub target: Option<String>,
    pub met: Option<bool>,
    /// Peak resident memory of the process during the workload (VmHWM).
    pub peak_rss_kib: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p50_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub p99_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit_p50_ms: Option<f64>,
    /// The correctness check after the workload.
    pub check: String,
}

impl Row {
    /// A throughput row; the target is a minimum ratio.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rate(
        workload: &'static str,
        backend: &Backend,
        producers: usize,
        ops: usize,
        ops_per_sec: f64,
        limit: String,
        limit_ops_per_sec: f64,
        min_ratio: Option<f64>,
    ) -> Self {
        let ratio = ops_per_sec / limit_ops_per_sec.max(1e-9);
        Self {
            workload,
            backend: backend.name(),
            producers,
            ops,
            ops_per_sec,
            limit,
            limit_ops_per_sec: Some(limit_ops_per_sec),
            ratio: Some(ratio),
            target: min_ratio.map(|m| format!(">= {m}x")),
            met: min_ratio.map(|m| ratio >= m),
            peak_rss_kib: None,
            p50_ms: None,
            p99_ms: None,
            limit_p50_ms: None,
            check: "ok".into(),
        }
    }
}

/// Prints rows as they come, and the table at the end.
pub(crate) struct Printer {
    json: bool,
}

impl Printer {
    pub(crate) fn new(json: bool) -> Self {
        Self { json }
    }

    pub(crate) fn header(&self, backend: &Backend, sizes: &Sizes) {
        if !self.json {
            eprintln!(
                "idemq bench on {} ({} cores; every workload on a fresh database; {sizes:?})",
                backend.name(),
                std::thread::available_parallelism().map_or(0, |n| n.get()),
            );
            if let Some(settings) = backend.settings() {
                eprintln!("server: {settings}");
            }
        }
    }

    pub(crate) fn row(&self, row: &Row) {
        if self.json {
            println!("{}", serde_json::to_string(row).unwrap_or_default());
        }
    }

    pub(crate) fn table(&self, rows: &[Row]) {
        if self.json {
            return;
        }
        println!(
            "{:<5} {:<8} {:>4} {:>7} {:>11}  {:<28} {:>11} {:>7}  {:<12} {:>4} {:>9}  check",
            "work",
            "backend",
            "prod",
            "ops",
            "ops/s",
            "limit",
            "limit/s",
            "ratio",
            "target",
            "met",
            "peak MiB"
        );
        for r in rows {
            let (figure, limit_figure) = match (r.p50_ms, r.limit_p50_ms) {
                (Some(p50), Some(l)) => (
                    format!("p50 {p50:.2}ms p99 {:.2}ms", r.p99_ms.unwrap_or(0.0)),
                    format!("p50 {l:.2}ms"),
                ),
                _ => (
                    format!("{:.0}", r.ops_per_sec),
                    r.limit_ops_per_sec
                        .map_or("-".into(), |l| format!("{l:.0}")),
                ),
            };
            println!(
                "{:<5} {:<8} {:>4} {:>7} {:>11}  {:<28} {:>11} {:>7}  {:<12} {:>4} {:>9}  {}",
                r.workload,
                r.backend,
                r.producers,
                r.ops,
                figure,
                r.limit,
                limit_figure,
                r.ratio.map_or("-".into(), ratio_text),
                r.target.as_deref().unwrap_or("-"),
                r.met.map_or("-", |m| if m { "yes" } else { "NO" }),
                r.peak_rss_kib
                    .map_or("-".into(), |k| format!("{:.1}", k as f64 / 1024.0)),
                r.check
            );
        }
    }
}

/// A ratio as the table prints it: cut to two decimals, never rounded up,
/// so a ratio just under its target (0.799 against 0.8) never reads as the
/// target itself beside a "NO". `--json` keeps the whole value.
fn ratio_text(ratio: f64) -> String {
    // The small term keeps a ratio stored a hair under its two-decimal
    // value (0.29 is 0.28999… in binary) at that value.
    format!("{:.2}x", (ratio * 100.0 + 1e-9).floor() / 100.0)
}

/// Resets the process's peak resident memory (VmHWM) so the next reading
/// is the peak of one workload. Linux only; elsewhere a no-op.
pub(crate) fn reset_peak_memory() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// VmHWM from /proc/self/status, in KiB.
pub(crate) fn peak_memory_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::ratio_text;

    #[test]
    fn ratios_are_cut_never_rounded_up() {
        assert_eq!(ratio_text(0.7985), "0.79x");
        assert_eq!(ratio_text(0.79999), "0.79x");
        assert_eq!(ratio_text(0.8), "0.80x");
        assert_eq!(ratio_text(0.29), "0.29x");
        assert_eq!(ratio_text(1.0), "1.00x");
        assert_eq!(ratio_text(2.557), "2.55x");
        assert_eq!(ratio_text(0.0), "0.00x");
    }
}
