//! The backoff between failed attempts, as a pure function.

use crate::request::RetryPolicy;

/// The delay in milliseconds before the next attempt after `attempts_used`
/// consumed attempts (≥ 1), or `None` when the policy allows no retry.
/// `unit` is a uniform draw from `[0, 1)`, used only with jitter, so the
/// function stays pure and testable.
pub fn next_delay_ms(policy: &RetryPolicy, attempts_used: i32, unit: f64) -> Option<i64> {
    match *policy {
        RetryPolicy::None => None,
        RetryPolicy::Fixed { delay_ms } => Some(delay_ms),
        RetryPolicy::Exponential {
            initial_ms,
            factor,
            max_ms,
            jitter,
        } => {
            let exp = (attempts_used.max(1) - 1).min(1024);
            let raw = initial_ms as f64 * factor.powi(exp);
            let capped = if raw.is_finite() {
                raw.min(max_ms as f64)
            } else {
                max_ms as f64
            };
            let delay = if jitter {
                capped * unit.clamp(0.0, 1.0)
            } else {
                capped
            };
            Some(delay.round() as i64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exponential_without_jitter_doubles_and_caps() {
        let p = RetryPolicy::Exponential {
            initial_ms: 1000,
            factor: 2.0,
            max_ms: 5000,
            jitter: false,
        };
        let got: Vec<_> = (1..=5)
            .map(|n| next_delay_ms(&p, n, 0.5).unwrap())
            .collect();
        assert_eq!(got, vec![1000, 2000, 4000, 5000, 5000]);
    }

    #[test]
    fn full_jitter_stays_within_zero_and_the_cap() {
        let p = RetryPolicy::default();
        for n in 1..40 {
            for u in [0.0, 0.25, 0.999_999] {
                let d = next_delay_ms(&p, n, u).unwrap();
                assert!((0..=3_600_000).contains(&d), "attempt {n}: {d}");
            }
        }
        assert_eq!(next_delay_ms(&p, 1, 0.5), Some(500));
    }

    #[test]
    fn fixed_and_none() {
        assert_eq!(
            next_delay_ms(&RetryPolicy::Fixed { delay_ms: 7 }, 9, 0.1),
            Some(7)
        );
        assert_eq!(next_delay_ms(&RetryPolicy::None, 1, 0.1), None);
    }
}
