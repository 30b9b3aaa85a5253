//! Migrations of the `idemq` schema, embedded in the binary: numbered,
//! forward-only migrations for tables and data (never changed once
//! published), then `functions.sql`, the current definition of every
//! function, applied again whenever its digest differs from the one the
//! database records. Safe to run from several processes at once: a session
//! advisory lock serializes them, and each migration commits with its
//! version row (the functions with the last one, or on their own).

use sha2::{Digest, Sha256};
use sqlx::{Connection, PgPool};

use super::db_err;
use crate::error::{Error, Result};
use crate::store::{IDEMQ_VERSION, MigrationStatus, newer_schema};

/// (version, name, SQL), in order.
pub const MIGRATIONS: &[(i64, &str, &str)] = &[
    (
        1,
        "tables",
        include_str!("../../../migrations/postgres/0001_tables.sql"),
    ),
    (
        2,
        "functions",
        include_str!("../../../migrations/postgres/0002_functions.sql"),
    ),
    (
        3,
        "schedules",
        include_str!("../../../migrations/postgres/0003_schedules.sql"),
    ),
    (
        4,
        "complete_many",
        include_str!("../../../migrations/postgres/0004_complete_many.sql"),
    ),
    (
        5,
        "installation",
        include_str!("../../../migrations/postgres/0005_installation.sql"),
    ),
    (
        6,
        "derived_history",
        include_str!("../../../migrations/postgres/0006_derived_history.sql"),
    ),
    (
        7,
        "schedule_errors_session_clock",
        include_str!("../../../migrations/postgres/0007_schedule_errors_session_clock.sql"),
    ),
    (
        8,
        "big_tables",
        include_str!("../../../migrations/postgres/0008_big_tables.sql"),
    ),
    (
        9,
        "id_key",
        include_str!("../../../migrations/postgres/0009_id_key.sql"),
    ),
    (
        10,
        "slim_row",
        include_str!("../../../migrations/postgres/0010_slim_row.sql"),
    ),
    (
        11,
        "id_collation",
        include_str!("../../../migrations/postgres/0011_id_collation.sql"),
    ),
    (
        12,
        "active_by_lease",
        include_str!("../../../migrations/postgres/0012_active_by_lease.sql"),
    ),
    (
        13,
        "binding_fp",
        include_str!("../../../migrations/postgres/0013_binding_fp.sql"),
    ),
    (
        14,
        "state_domain",
        include_str!("../../../migrations/postgres/0014_state_domain.sql"),
    ),
];

/// Every function of the schema, as this binary defines them.
pub const FUNCTIONS: &str = include_str!("../../../migrations/postgres/functions.sql");

/// The revision of [`FUNCTIONS`]: raised by one at every change of
/// `functions.sql` (a unit test pins the file's digest to it). The database
/// records the revision it has, and a binary refuses to install older
/// functions over newer ones: an older `idemq serve` or `idemq migrate`
/// started during a rolling upgrade would otherwise swap every process's
/// functions for its own.
pub const FUNCTIONS_REVISION: i64 = 4;

/// The digest recorded for [`FUNCTIONS`] once applied.
fn functions_digest() -> String {
    Sha256::digest(FUNCTIONS.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The lock every migrating process takes (an arbitrary constant: "idemq" in ASCII).
const MIGRATION_LOCK: i64 = 0x69_64_65_6d_71;

/// The schema version this binary expects.
pub fn latest() -> i64 {
    MIGRATIONS.last().map_or(0, |m| m.0)
}

/// One connection to the database a URL names, for schema work. idemq's
/// own parameters are taken off the URL; through PgBouncer the statements
/// are not prepared.
async fn schema_pool(url: &str) -> Result<PgPool> {
    let (url, net) = super::db::split_url(url).map_err(|e| Error::validation("database", e))?;
    let mut connect: sqlx::postgres::PgConnectOptions = url
        .parse()
        .map_err(|e| Error::validation("database", format!("bad PostgreSQL URL: {e}")))?;
    if net.bouncer {
        connect = connect.statement_cache_capacity(0).extra_float_digits(None);
    }
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_with(connect)
        .await
        .map_err(|e| Error::Unavailable {
            message: format!("cannot connect to PostgreSQL: {e}"),
        })
}

/// [`migrate`] on the database a URL names.
pub async fn migrate_url(url: &str) -> Result<Vec<i64>> {
    let pool = schema_pool(url).await?;
    let applied = migrate(&pool).await;
    pool.close().await;
    applied
}

/// [`status`] of the database a URL names.
pub async fn status_url(url: &str) -> Result<MigrationStatus> {
    let pool = schema_pool(url).await?;
    let status = status(&pool).await;
    pool.close().await;
    status
}

/// Applies every pending migration; returns the versions applied.
pub async fn migrate(pool: &PgPool) -> Result<Vec<i64>> {
    let mut conn = pool.acquire().await.map_err(db_err)?;
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *conn)
        .await
        .map_err(db_err)?;
    let result = apply(&mut conn).await;
    let unlock = sqlx::query("SELECT pg_advisory_unlock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *conn)
        .await;
    let applied = result?;
    unlock.map_err(db_err)?;
    Ok(applied)
}

/// The tables `idemq migrate` keeps its records in, made (or brought
/// forward) before any migration: which versions were applied, by which
/// idemq, and the digest of the functions installed.
pub const BOOKKEEPING: &str = "
    CREATE SCHEMA IF NOT EXISTS idemq;
    CREATE TABLE IF NOT EXISTS idemq.schema_migrations (
        version bigint PRIMARY KEY, name text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now());
    ALTER TABLE idemq.schema_migrations ADD COLUMN IF NOT EXISTS idemq_version text;
    CREATE TABLE IF NOT EXISTS idemq.schema_functions (
        one boolean PRIMARY KEY DEFAULT true CHECK (one), digest text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT now());
    ALTER TABLE idemq.schema_functions ADD COLUMN IF NOT EXISTS revision bigint;
    ALTER TABLE idemq.schema_functions ADD COLUMN IF NOT EXISTS idemq_version text";

async fn apply(conn: &mut sqlx::PgConnection) -> Result<Vec<i64>> {
    sqlx::raw_sql(BOOKKEEPING)
        .execute(&mut *conn)
        .await
        .map_err(db_err)?;
    let current = current_version(conn).await?;
    if current > latest() {
        return Err(newer(conn, current).await);
    }
    let recorded = functions_recorded(&mut *conn).await?;
    if let Some(newer) = newer_functions(recorded.as_ref()) {
        return Err(newer);
    }
    let pending: Vec<_> = MIGRATIONS.iter().filter(|m| m.0 > current).collect();
    let mut applied = Vec::new();
    for (i, &&(version, name, sql)) in pending.iter().enumerate() {
        let mut tx = conn.begin().await.map_err(db_err)?;
        sqlx::raw_sql(sql)
            .execute(&mut *tx)
            .await
            .map_err(|e| Error::Backend {
                message: format!("migration {version} ({name}) failed: {e}"),
            })?;
        sqlx::query(
            "INSERT INTO idemq.schema_migrations (version, name, idemq_version)
             VALUES ($1, $2, $3)",
        )
        .bind(version)
        .bind(name)
        .bind(IDEMQ_VERSION)
        .execute(&mut *tx)
        .await
        .map_err(db_err)?;
        // The functions go with the last migration: no moment where the
        // tables are new and the functions old.
        if i + 1 == pending.len() {
            apply_functions(&mut tx).await?;
        }
        tx.commit().await.map_err(db_err)?;
        applied.push(version);
    }
    if pending.is_empty() && recorded.map(|r| r.digest) != Some(functions_digest()) {
        let mut tx = conn.begin().await.map_err(db_err)?;
        apply_functions(&mut tx).await?;
        tx.commit().await.map_err(db_err)?;
    }
    Ok(applied)
}

async fn apply_functions(tx: &mut sqlx::PgConnection) -> Result<()> {
    sqlx::raw_sql(FUNCTIONS)
        .execute(&mut *tx)
        .await
        .map_err(|e| Error::Backend {
            message: format!("installing the functions (functions.sql) failed: {e}"),
        })?;
    sqlx::query(
        "INSERT INTO idemq.schema_functions (digest, revision, idemq_version) VALUES ($1, $2, $3)
         ON CONFLICT (one) DO UPDATE SET digest = excluded.digest, revision = excluded.revision,
             idemq_version = excluded.idemq_version, applied_at = now()",
    )
    .bind(functions_digest())
    .bind(FUNCTIONS_REVISION)
    .bind(IDEMQ_VERSION)
    .execute(&mut *tx)
    .await
    .map_err(db_err)?;
    Ok(())
}

async fn current_version(conn: &mut sqlx::PgConnection) -> Result<i64> {
    sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM idemq.schema_migrations")
        .fetch_one(&mut *conn)
        .await
        .map_err(db_err)
}

/// What the database records of the functions it has.
struct RecordedFunctions {
    digest: String,
    /// NULL when written by an idemq older than revisions.
    revision: Option<i64>,
    idemq_version: Option<String>,
}

/// The refusal of functions newer than this binary's, if they are.
fn newer_functions(recorded: Option<&RecordedFunctions>) -> Option<Error> {
    let r = recorded?;
    let revision = r.revision?;
    (revision > FUNCTIONS_REVISION).then(|| {
        newer_schema(
            "the revision of the idemq functions",
            revision,
            FUNCTIONS_REVISION,
            r.idemq_version.as_deref(),
        )
    })
}

/// What the database records of its functions, if anything. The columns
/// are read by name from the row, so a database recorded before they
/// existed answers none.
async fn functions_recorded(conn: &mut sqlx::PgConnection) -> Result<Option<RecordedFunctions>> {
    let recorded: bool =
        sqlx::query_scalar("SELECT to_regclass('idemq.schema_functions') IS NOT NULL")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await
            .map_err(db_err)?;
    if !recorded {
        return Ok(None);
    }
    let row: Option<(String, Option<i64>, Option<String>)> = sqlx::query_as(
        "SELECT f.digest, (to_jsonb(f) ->> 'revision')::bigint, to_jsonb(f) ->> 'idemq_version'
         FROM idemq.schema_functions f",
    )
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_err)?;
    Ok(
        row.map(|(digest, revision, idemq_version)| RecordedFunctions {
            digest,
            revision,
            idemq_version,
        }),
    )
}

/// How far the database's schema is from this binary's, changing nothing.
///
/// Its statements are unprepared and share one read-only transaction, so it
/// also works through a transaction-pooling PgBouncer.
pub async fn status(pool: &PgPool) -> Result<MigrationStatus> {
    let mut tx = pool.begin().await.map_err(db_err)?;
    let installed: bool =
        sqlx::query_scalar("SELECT to_regclass('idemq.schema_migrations') IS NOT NULL")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_err)?;
    let current: i64 = if installed {
        sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM idemq.schema_migrations")
            .persistent(false)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_err)?
    } else {
        0
    };
    // Which idemq wrote a newer schema (the column is read by name from the
    // row, so a database without it answers none).
    let written_by: Option<String> = if current > latest() {
        sqlx::query_scalar(
            "SELECT to_jsonb(m) ->> 'idemq_version' FROM idemq.schema_migrations m
             ORDER BY version DESC LIMIT 1",
        )
        .persistent(false)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_err)?
        .flatten()
    } else {
        None
    };
    let functions = functions_recorded(&mut tx).await?;
    tx.rollback().await.map_err(db_err)?;
    Ok(MigrationStatus {
        current,
        latest: latest(),
        pending: MIGRATIONS
            .iter()
            .map(|m| m.0)
            .filter(|v| *v > current)
            .collect(),
        functions_current: functions.map(|f| f.digest) == Some(functions_digest()),
        written_by,
    })
}

/// The refusal of a schema newer than this binary's, naming the idemq
/// that wrote it when the database recorded one (the column is read by
/// name from the row, so a database without it answers none).
async fn newer(conn: &mut sqlx::PgConnection, current: i64) -> Error {
    let written_by: Option<String> = sqlx::query_scalar(
        "SELECT to_jsonb(m) ->> 'idemq_version' FROM idemq.schema_migrations m
         ORDER BY version DESC LIMIT 1",
    )
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await
    .ok()
    .flatten()
    .flatten();
    newer_schema("the idemq schema", current, latest(), written_by.as_deref())
}

/// Refuses to run on a database without this binary's schema and
/// functions, saying what to do.
pub(crate) async fn check(pool: &PgPool) -> Result<()> {
    let s = status(pool).await?;
    if s.current > s.latest {
        let mut conn = pool.acquire().await.map_err(db_err)?;
        return Err(newer(&mut conn, s.current).await);
    }
    if !s.functions_current {
        let mut conn = pool.acquire().await.map_err(db_err)?;
        if let Some(newer) = newer_functions(functions_recorded(&mut conn).await?.as_ref()) {
            return Err(newer);
        }
    }
    if s.current < s.latest || !s.functions_current {
        return Err(Error::Backend {
            message: "the idemq schema is missing or out of date in this database: \
                      run `idemq migrate --database <url>` first"
                .into(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `functions.sql` and its revision change together: a database records
    /// the revision, and a binary refuses to replace newer functions with
    /// its own. A change of the file without a new revision fails here.
    #[test]
    fn the_functions_revision_follows_functions_sql() {
        assert_eq!(
            (FUNCTIONS_REVISION, functions_digest().as_str()),
            (
                4,
                "349f543e6efbd845aaa36012b30f47cb678a888991a451f175c4efdabc3b9193"
            ),
            "functions.sql changed: raise FUNCTIONS_REVISION by one and pin the new digest here"
        );
    }
}
