//! The installation row: the check value of the key hashing in use.

use rusqlite::OptionalExtension;

use super::Cx;
use crate::error::Result;
use crate::store::KeyCheckChange;

/// Records `value` unless a check is recorded, and returns the recorded one.
pub(super) fn key_check(cx: &Cx, value: &str) -> Result<String> {
    cx.db
        .prepare_cached(
            "INSERT INTO idemq_installation (id, key_check, created_at, updated_at)
             VALUES (1, ?1, ?2, ?2) ON CONFLICT (id) DO NOTHING",
        )?
        .execute(rusqlite::params![value, cx.now])?;
    Ok(cx
        .db
        .prepare_cached("SELECT key_check FROM idemq_installation WHERE id = 1")?
        .query_row([], |r| r.get(0))?)
}

/// Replaces the recorded check; returns the previous one and the live
/// bindings it made.
pub(super) fn key_check_replace(cx: &Cx, value: &str) -> Result<KeyCheckChange> {
    let previous: Option<String> = cx
        .db
        .prepare_cached("SELECT key_check FROM idemq_installation WHERE id = 1")?
        .query_row([], |r| r.get(0))
        .optional()?;
    cx.db
        .prepare_cached(
            "INSERT INTO idemq_installation (id, key_check, created_at, updated_at)
             VALUES (1, ?1, ?2, ?2)
             ON CONFLICT (id) DO UPDATE SET key_check = excluded.key_check,
                 updated_at = excluded.updated_at",
        )?
        .execute(rusqlite::params![value, cx.now])?;
    let live_bindings = if previous.as_deref() == Some(value) {
        0
    } else {
        let n: i64 = cx
            .db
            .prepare_cached("SELECT count(*) FROM idemq_idempotency WHERE expires_at > ?1")?
            .query_row([cx.now], |r| r.get(0))?;
        u64::try_from(n).unwrap_or(0)
    };
    Ok(KeyCheckChange {
        previous,
        live_bindings,
    })
}
