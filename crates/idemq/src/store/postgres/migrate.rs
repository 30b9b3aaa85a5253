//! Numbered, forward-only migrations of the `idemq` schema, embedded in the
//! binary. Safe to run from several processes at once: a session advisory
//! lock serializes them, and each migration commits with its version row.

use sqlx::{Connection, PgPool};

use super::db_err;
use crate::error::{Error, Result};

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
];

/// The lock every migrating process takes (an arbitrary constant: "idemq" in ASCII).
const MIGRATION_LOCK: i64 = 0x69_64_65_6d_71;

/// The schema version this binary expects.
pub fn latest() -> i64 {
    MIGRATIONS.last().map_or(0, |m| m.0)
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

async fn apply(conn: &mut sqlx::PgConnection) -> Result<Vec<i64>> {
    sqlx::raw_sql(
        "CREATE SCHEMA IF NOT EXISTS idemq;
         CREATE TABLE IF NOT EXISTS idemq.schema_migrations (
             version bigint PRIMARY KEY, name text NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut *conn)
    .await
    .map_err(db_err)?;
    let current = current_version(conn).await?;
    if current > latest() {
        return Err(newer(current));
    }
    let mut applied = Vec::new();
    for (version, name, sql) in MIGRATIONS.iter().filter(|m| m.0 > current) {
        let mut tx = conn.begin().await.map_err(db_err)?;
        sqlx::raw_sql(*sql)
            .execute(&mut *tx)
            .await
            .map_err(|e| Error::Backend {
                message: format!("migration {version} ({name}) failed: {e}"),
            })?;
        sqlx::query("INSERT INTO idemq.schema_migrations (version, name) VALUES ($1, $2)")
            .bind(version)
            .bind(name)
            .execute(&mut *tx)
            .await
            .map_err(db_err)?;
        tx.commit().await.map_err(db_err)?;
        applied.push(*version);
    }
    Ok(applied)
}

async fn current_version(conn: &mut sqlx::PgConnection) -> Result<i64> {
    sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM idemq.schema_migrations")
        .fetch_one(&mut *conn)
        .await
        .map_err(db_err)
}

fn newer(current: i64) -> Error {
    Error::Backend {
        message: format!(
            "the idemq schema is version {current}, newer than this idemq ({}): upgrade idemq",
            latest()
        ),
    }
}

/// Refuses to run on a database without the current schema, saying what to do.
pub(crate) async fn check(pool: &PgPool) -> Result<()> {
    let installed: bool =
        sqlx::query_scalar("SELECT to_regclass('idemq.schema_migrations') IS NOT NULL")
            .fetch_one(pool)
            .await
            .map_err(db_err)?;
    let version: Option<i64> = if installed {
        sqlx::query_scalar("SELECT coalesce(max(version), 0) FROM idemq.schema_migrations")
            .fetch_one(pool)
            .await
            .map_err(db_err)?
    } else {
        None
    };
    match version {
        Some(v) if v == latest() => Ok(()),
        Some(v) if v > latest() => Err(newer(v)),
        _ => Err(Error::Backend {
            message: "the idemq schema is missing or out of date in this database: \
                      run `idemq migrate --database <url>` first"
                .into(),
        }),
    }
}
