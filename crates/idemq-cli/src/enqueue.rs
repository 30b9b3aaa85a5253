//! `idemq enqueue`: every field of an enqueue request as a flag.

use std::io::Read;
use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::Args;
use idemq::{DedupeOptions, EnqueueRequest, IdempotencyOptions, Queue, RetryPolicy};
use serde_json::Value;

use crate::CliError;
use crate::output;

/// Flags of `idemq enqueue`.
#[derive(Args, Debug)]
pub struct EnqueueArgs {
    /// The job type, e.g. invoice.capture.
    #[arg(long = "type", value_name = "TYPE")]
    job_type: String,
    /// The payload as JSON (default null).
    #[arg(long, conflicts_with = "payload_file")]
    payload: Option<String>,
    /// Read the payload JSON from a file (`-` for stdin).
    #[arg(long, value_name = "PATH")]
    payload_file: Option<String>,
    /// The queue (default `default`).
    #[arg(long)]
    queue: Option<String>,
    /// An explicit job id.
    #[arg(long)]
    job_id: Option<String>,
    /// Higher runs first among due jobs.
    #[arg(long, allow_negative_numbers = true)]
    priority: Option<i64>,
    /// Due at this RFC 3339 instant.
    #[arg(long, value_name = "RFC3339", conflicts_with = "delay")]
    run_at: Option<DateTime<Utc>>,
    /// Due after this delay, e.g. 30s, 5m, 1h.
    #[arg(long, value_parser = humantime::parse_duration)]
    delay: Option<Duration>,
    /// Attempt budget (1–1000, default 10).
    #[arg(long)]
    max_attempts: Option<i64>,
    /// Backoff: none, fixed:DURATION, exponential[:INITIAL[:FACTOR[:MAX]]], or the API's JSON.
    #[arg(long)]
    retry: Option<String>,
    /// Turn off jitter of exponential backoff.
    #[arg(long)]
    no_jitter: bool,
    /// Execution timeout of one attempt (default 30m).
    #[arg(long, value_parser = humantime::parse_duration)]
    timeout: Option<Duration>,
    /// The job must not start or go on after this RFC 3339 instant.
    #[arg(long, value_name = "RFC3339")]
    deadline: Option<DateTime<Utc>>,
    /// At most one active job per key.
    #[arg(long)]
    concurrency_key: Option<String>,
    /// A label for operators (repeatable).
    #[arg(long = "tag")]
    tags: Vec<String>,
    /// Keep the record this long after it turns terminal.
    #[arg(long, value_parser = humantime::parse_duration)]
    keep: Option<Duration>,
    /// The idempotency key. Prefer --idempotency-key-file to keep keys out of shell history.
    #[arg(long, conflicts_with = "idempotency_key_file")]
    idempotency_key: Option<String>,
    /// Read the idempotency key from a file (`-` for stdin); one trailing newline is dropped.
    #[arg(long, value_name = "PATH")]
    idempotency_key_file: Option<String>,
    /// The key's scope (default `default`).
    #[arg(long)]
    scope: Option<String>,
    /// How long the key stays bound (1s–30d, default 24h).
    #[arg(long, value_parser = humantime::parse_duration)]
    key_ttl: Option<Duration>,
    /// The dedupe key (scoped to the job type).
    #[arg(long)]
    dedupe_key: Option<String>,
    /// Dedupe window: throttle, or debounce with --dedupe-extend.
    #[arg(long, value_parser = humantime::parse_duration)]
    dedupe_ttl: Option<Duration>,
    /// Debounce: every dropped enqueue pushes the window out.
    #[arg(long)]
    dedupe_extend: bool,
    /// Replace: the latest request wins while the keyed job waits.
    #[arg(long)]
    dedupe_replace: bool,
    /// Cap on the debounce/replace window from first acceptance.
    #[arg(long, value_parser = humantime::parse_duration)]
    dedupe_max_wait: Option<Duration>,
    /// Say what an enqueue would do now, and why; writes nothing.
    #[arg(long)]
    explain: bool,
}

fn read_source(path: &str) -> Result<String, CliError> {
    let mut s = String::new();
    if path == "-" {
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Usage(format!("cannot read stdin: {e}")))?;
    } else {
        s = std::fs::read_to_string(path)
            .map_err(|e| CliError::Usage(format!("cannot read {path}: {e}")))?;
    }
    Ok(s)
}

/// The key of `--idempotency-key`, or read from `--idempotency-key-file`
/// (`-` for stdin) with one trailing newline dropped.
pub(crate) fn read_key(
    key: Option<String>,
    file: Option<&str>,
) -> Result<Option<String>, CliError> {
    Ok(match (key, file) {
        (Some(k), _) => Some(k),
        (None, Some(f)) => {
            let mut k = read_source(f)?;
            if k.ends_with('\n') {
                k.pop();
                if k.ends_with('\r') {
                    k.pop();
                }
            }
            Some(k)
        }
        (None, None) => None,
    })
}

pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Parses the `--retry` shorthand.
fn parse_retry(s: &str, jitter: bool) -> Result<RetryPolicy, CliError> {
    let bad = |why: String| CliError::Usage(format!("--retry {s}: {why}"));
    if s.trim_start().starts_with('{') {
        return serde_json::from_str(s).map_err(|e| bad(e.to_string()));
    }
    let mut parts = s.split(':');
    let dur = |p: Option<&str>, default: i64| -> Result<i64, CliError> {
        match p {
            None | Some("") => Ok(default),
            Some(p) => humantime::parse_duration(p)
                .map(ms)
                .map_err(|e| bad(e.to_string())),
        }
    };
    match parts.next() {
        Some("none") => Ok(RetryPolicy::None),
        Some("fixed") => Ok(RetryPolicy::Fixed {
            delay_ms: dur(parts.next(), 0)?,
        }),
        Some("exponential") => {
            let initial_ms = dur(parts.next(), idemq::request::defaults::RETRY_INITIAL_MS)?;
            let factor = match parts.next() {
                None | Some("") => idemq::request::defaults::RETRY_FACTOR,
                Some(f) => f
                    .parse()
                    .map_err(|_| bad(format!("factor {f} is not a number")))?,
            };
            let max_ms = dur(parts.next(), idemq::request::defaults::RETRY_MAX_MS)?;
            Ok(RetryPolicy::Exponential {
                initial_ms,
                factor,
                max_ms,
                jitter,
            })
        }
        _ => Err(bad(
            "expected none, fixed:DURATION or exponential[:INITIAL[:FACTOR[:MAX]]]".into(),
        )),
    }
}

impl EnqueueArgs {
    /// Refuses `-` (stdin) for more than one option: the first to read
    /// would take all of stdin and leave the others empty. Checked before
    /// anything is read or opened.
    pub(crate) fn check_stdin(&self) -> Result<(), CliError> {
        let readers: Vec<&str> = [
            ("--payload-file", &self.payload_file),
            ("--idempotency-key-file", &self.idempotency_key_file),
        ]
        .into_iter()
        .filter(|(_, path)| path.as_deref() == Some("-"))
        .map(|(flag, _)| flag)
        .collect();
        if let [first, second, ..] = readers.as_slice() {
            return Err(CliError::Usage(format!(
                "{first} - and {second} - both read stdin, which can feed only one of them: \
                 give the other a file path"
            )));
        }
        Ok(())
    }

    fn request(self) -> Result<EnqueueRequest, CliError> {
        let payload_text = match (&self.payload, &self.payload_file) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(f)) => Some(read_source(f)?),
            (None, None) => None,
        };
        let payload: Value = match payload_text {
            Some(t) => serde_json::from_str(&t)
                .map_err(|e| CliError::Usage(format!("the payload is not valid JSON: {e}")))?,
            None => Value::Null,
        };
        let key = read_key(self.idempotency_key, self.idempotency_key_file.as_deref())?;
        if key.is_none() && (self.scope.is_some() || self.key_ttl.is_some()) {
            return Err(CliError::Usage(
                "--scope and --key-ttl need an idempotency key".into(),
            ));
        }
        let dedupe_flags = self.dedupe_ttl.is_some()
            || self.dedupe_extend
            || self.dedupe_replace
            || self.dedupe_max_wait.is_some();
        if self.dedupe_key.is_none() && dedupe_flags {
            return Err(CliError::Usage(
                "the --dedupe-* flags need --dedupe-key".into(),
            ));
        }
        let retry = self
            .retry
            .as_deref()
            .map(|r| parse_retry(r, !self.no_jitter))
            .transpose()?;
        Ok(EnqueueRequest {
            job_type: self.job_type,
            payload,
            queue: self.queue,
            job_id: self.job_id,
            priority: self.priority,
            run_at: self.run_at,
            delay_ms: self.delay.map(ms),
            max_attempts: self.max_attempts,
            retry,
            timeout_ms: self.timeout.map(ms),
            deadline: self.deadline,
            concurrency_key: self.concurrency_key,
            tags: self.tags,
            keep_ms: self.keep.map(ms),
            idempotency: key.map(|key| IdempotencyOptions {
                key,
                scope: self.scope,
                ttl_ms: self.key_ttl.map(ms),
            }),
            dedupe: self.dedupe_key.map(|key| DedupeOptions {
                key,
                ttl_ms: self.dedupe_ttl.map(ms),
                extend: self.dedupe_extend,
                replace: self.dedupe_replace,
                max_wait_ms: self.dedupe_max_wait.map(ms),
            }),
        })
    }
}

/// Runs `idemq enqueue`.
pub async fn run(queue: &Queue, args: EnqueueArgs, json: bool) -> Result<(), CliError> {
    let explain = args.explain;
    let req = args.request()?;
    if explain {
        let e = queue.explain(req).await?;
        output::line(json, &e, || {
            let mut lines = vec![match (&e.reason, &e.job_id) {
                (Some(r), Some(id)) => format!("would be: {} ({r}) -> job {id}", e.outcome),
                (None, Some(id)) => format!("would be: {} -> job {id}", e.outcome),
                _ => format!("would be: {}", e.outcome),
            }];
            if let Some(c) = &e.conflict {
                lines.push(format!(
                    "  conflicts with job {} on: {}",
                    c.job_id,
                    c.fields.join(", ")
                ));
            }
            if let Some(i) = &e.idempotency {
                lines.push(format!(
                    "  key bound to job {} until {}",
                    i.job_id,
                    i.expires_at.to_rfc3339()
                ));
            }
            if let Some(d) = &e.dedupe {
                let until = d.window_until.map_or_else(
                    || "while it is pending".into(),
                    |w| format!("until {}", w.to_rfc3339()),
                );
                lines.push(format!(
                    "  dedupe key held by job {} ({}) {until}",
                    d.job_id,
                    d.mode.as_str()
                ));
            }
            lines.push("  (nothing was written)".into());
            lines.join("\n")
        });
        return Ok(());
    }
    let r = queue.enqueue_with_result(req).await?;
    output::line(json, &r, || format!("{} {}", r.outcome, r.job_id));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_shorthands() {
        assert_eq!(parse_retry("none", true).unwrap(), RetryPolicy::None);
        assert_eq!(
            parse_retry("fixed:5s", true).unwrap(),
            RetryPolicy::Fixed { delay_ms: 5000 }
        );
        assert_eq!(
            parse_retry("exponential:2s:3:1m", false).unwrap(),
            RetryPolicy::Exponential {
                initial_ms: 2000,
                factor: 3.0,
                max_ms: 60_000,
                jitter: false
            }
        );
        assert_eq!(
            parse_retry(r#"{"kind":"fixed","delay_ms":7}"#, true).unwrap(),
            RetryPolicy::Fixed { delay_ms: 7 }
        );
        assert!(parse_retry("sometimes", true).is_err());
    }
}
