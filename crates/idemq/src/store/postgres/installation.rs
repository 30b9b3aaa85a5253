//! The installation row: the check value of the key hashing in use.

use super::db::Db;
use super::db_err;
use crate::error::Result;
use crate::store::KeyCheckChange;

/// Records `value` unless a check is recorded, and returns the recorded one.
/// `DO UPDATE` (a no-op write) rather than `DO NOTHING`, so that `RETURNING`
/// yields the row a concurrent first writer committed.
pub(super) async fn key_check(pool: Db<'_>, value: &str) -> Result<String> {
    sqlx::query_scalar(
        "INSERT INTO idemq.installation (id, key_check, created_at, updated_at)
         VALUES (true, $1, idemq.now(), idemq.now())
         ON CONFLICT (id) DO UPDATE SET key_check = idemq.installation.key_check
         RETURNING key_check",
    )
    .bind(value)
    .fetch_one(pool)
    .await
    .map_err(db_err)
}

/// Replaces the recorded check; returns the previous one and the live
/// bindings it made, in one statement.
pub(super) async fn key_check_replace(pool: Db<'_>, value: &str) -> Result<KeyCheckChange> {
    let (previous, live): (Option<String>, i64) = sqlx::query_as(
        "WITH prev AS (SELECT key_check FROM idemq.installation WHERE id FOR UPDATE),
         up AS (
             INSERT INTO idemq.installation (id, key_check, created_at, updated_at)
             VALUES (true, $1, idemq.now(), idemq.now())
             ON CONFLICT (id) DO UPDATE
                 SET key_check = excluded.key_check, updated_at = excluded.updated_at
             RETURNING 1
         )
         SELECT (SELECT key_check FROM prev),
                (SELECT count(*) FROM idemq.idempotency WHERE expires_at > idemq.now())
                    + 0 * (SELECT count(*) FROM up)",
    )
    .bind(value)
    .fetch_one(pool)
    .await
    .map_err(db_err)?;
    let live_bindings = if previous.as_deref() == Some(value) {
        0
    } else {
        u64::try_from(live).unwrap_or(0)
    };
    Ok(KeyCheckChange {
        previous,
        live_bindings,
    })
}
