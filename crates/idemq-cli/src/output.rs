//! Printing for people and for scripts (`--json`).

use idemq::Error;
use serde::Serialize;
use serde_json::json;

/// Prints `value` as one JSON line, or the text `human` builds.
pub fn line<T: Serialize>(json: bool, value: &T, human: impl FnOnce() -> String) {
    if json {
        println!("{}", serde_json::to_string(value).unwrap_or_default());
    } else {
        println!("{}", human());
    }
}

/// Prints an error with what to do next. Never holds a raw key: the library's
/// errors carry only key previews and digests.
pub fn error(json: bool, e: &Error) {
    if json {
        let body = match e {
            Error::Validation { field, reason } => {
                json!({"error": "validation", "field": field, "reason": reason})
            }
            Error::EnqueueIdempotencyConflict(c) => {
                json!({"error": "idempotency-conflict", "conflict": c})
            }
            other => json!({"error": kind(other), "detail": other.to_string()}),
        };
        eprintln!("{body}");
        return;
    }
    eprintln!("error: {e}");
    let hint = match e {
        Error::Validation { .. } | Error::PayloadTooLarge { .. } => {
            "nothing was written; fix the request and run the command again".to_owned()
        }
        Error::EnqueueIdempotencyConflict(c) => format!(
            "the key{} is bound to job {} with other fields ({}); nothing was written. \
             Send the original request again, or use a new key for new work.",
            c.key_preview
                .as_ref()
                .map(|p| format!(" {p} (digest {})", c.key_digest.as_deref().unwrap_or("")))
                .unwrap_or_default(),
            c.job_id,
            c.fields.join(", ")
        ),
        Error::Unavailable { .. } => {
            "the database is busy or down; retrying with the same idempotency key is safe"
                .to_owned()
        }
        _ => return,
    };
    eprintln!("hint: {hint}");
}

/// Reports a refusal of the command line itself (a flag's value, flags
/// that cannot go together): `usage` with the message in `detail` under
/// `--json`, as every other error of the tool.
pub fn usage_error(json: bool, message: &str) {
    if json {
        eprintln!("{}", json!({"error": "usage", "detail": message}));
    } else {
        eprintln!("error: {message}");
    }
}

/// The error's name in `--json` (the problem types of the HTTP API where
/// it has one).
fn kind(e: &Error) -> &'static str {
    match e {
        Error::Validation { .. } => "validation",
        Error::EnqueueIdempotencyConflict(_) => "idempotency-conflict",
        Error::PayloadTooLarge { .. } => "payload-too-large",
        Error::LeaseLost { .. } => "lease-lost",
        Error::NotDead { .. } => "not-dead",
        Error::NotFound { .. } => "not-found",
        // The failing item's own error names the batch's.
        Error::BatchItem { error, .. } => kind(error),
        Error::Unavailable { .. } => "unavailable",
        Error::KeySecretMismatch { .. } => "key-secret-mismatch",
        Error::Backend { .. } => "internal",
        // `Error` is non-exhaustive: a variant added later.
        _ => "internal",
    }
}
