//! Where a store lives: the one place a database URL is read.
//!
//! The library ([`Queue::connect`](crate::Queue::connect),
//! [`Queue::migrate`](crate::Queue::migrate)), the CLI (`serve`, `migrate`,
//! `worker`) and the benchmark all name a database by URL and all go through
//! [`Location::parse`], so a URL means the same thing everywhere and a new
//! backend is one more variant here.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::clock::Clock;
use crate::error::{Error, Result};

use super::{MigrationStatus, Store};

/// What to tell a user who named no database this version can open.
const URL_FORMS: &str =
    "use sqlite://path/to/file.db, sqlite::memory:, postgres://… or redis://host:port";

/// A database named by a URL.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Location {
    /// `sqlite::memory:`: a database that lives as long as its store.
    SqliteMemory,
    /// `sqlite://path/to/file.db` (or `sqlite:path`): a file, created and
    /// migrated when opened.
    SqliteFile(PathBuf),
    /// `postgres://…` or `postgresql://…`, with the driver's parameters and
    /// idemq's own (`pgbouncer`, `call_timeout_ms`, `enqueue_statements`,
    /// `read_statements`; docs/storage.md). Its schema is installed by
    /// [`Location::migrate`].
    Postgres(String),
    /// `redis://host:port[/db]` or `redis+unix:///path.sock`, with
    /// `?prefix=` and `?durability=relaxed` (docs/storage.md). Its functions
    /// are loaded by [`Location::migrate`].
    Redis(String),
}

impl std::fmt::Debug for Location {
    /// Never prints a PostgreSQL URL: it may hold a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::SqliteMemory => f.write_str("SqliteMemory"),
            Self::SqliteFile(p) => f.debug_tuple("SqliteFile").field(p).finish(),
            Self::Postgres(_) => f.write_str("Postgres(…)"),
            Self::Redis(_) => f.write_str("Redis(…)"),
        }
    }
}

impl Location {
    /// Reads a database URL. Refuses, naming the forms it takes, a URL of no
    /// backend this version has, and a SQLite URL with query parameters
    /// (they would silently become part of the file name).
    pub fn parse(url: &str) -> Result<Self> {
        if url == "sqlite::memory:" {
            return Ok(Self::SqliteMemory);
        }
        if let Some(rest) = url.strip_prefix("sqlite:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() || path.contains('?') {
                return Err(Error::validation(
                    "database",
                    "use sqlite://path/to/file.db or sqlite::memory: (no query parameters)",
                ));
            }
            return Ok(Self::SqliteFile(PathBuf::from(path)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Self::Postgres(url.to_owned()));
        }
        if url.starts_with("redis://") || url.starts_with("redis+unix://") {
            return Ok(Self::Redis(url.to_owned()));
        }
        Err(Error::validation(
            "database",
            format!("unknown database URL: {URL_FORMS}"),
        ))
    }

    /// `sqlite`, `postgres` or `redis`: the name [`Store::backend`] reports.
    pub fn backend(&self) -> &'static str {
        match self {
            Self::SqliteMemory | Self::SqliteFile(_) => "sqlite",
            Self::Postgres(_) => "postgres",
            Self::Redis(_) => "redis",
        }
    }

    /// The file of a SQLite database (`None` for other backends and for
    /// `sqlite::memory:`).
    pub fn sqlite_file(&self) -> Option<&Path> {
        match self {
            Self::SqliteFile(p) => Some(p),
            _ => None,
        }
    }

    /// Opens the store. A SQLite file is created if missing and migrated; a
    /// PostgreSQL database must have a current schema
    /// ([`migrate`](Self::migrate) installs it). `clock` is the clock of
    /// record of an embedded store; a server's store keeps its own.
    #[cfg_attr(not(feature = "sqlite"), allow(unused_variables))]
    pub async fn open(&self, clock: Arc<dyn Clock>) -> Result<Arc<dyn Store>> {
        Ok(match self {
            #[cfg(feature = "sqlite")]
            Self::SqliteMemory => Arc::new(super::sqlite::SqliteStore::open(None, clock)?),
            #[cfg(feature = "sqlite")]
            Self::SqliteFile(path) => {
                let path = path.clone();
                let store =
                    blocking(move || super::sqlite::SqliteStore::open(Some(&path), clock)).await?;
                Arc::new(store)
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(url) => Arc::new(
                super::postgres::PgStore::connect(url, super::postgres::PgOptions::default())
                    .await?,
            ),
            #[cfg(feature = "redis")]
            Self::Redis(url) => Arc::new(
                super::redis::RedisStore::connect(url, super::redis::RedisOptions::default())
                    .await?,
            ),
            #[allow(unreachable_patterns)]
            _ => return Err(self.not_built()),
        })
    }

    /// Installs or upgrades the schema and returns the migration versions
    /// applied. Safe to run from several processes at once. A SQLite file is
    /// migrated by opening it (created if missing); `sqlite::memory:` has
    /// nothing to keep.
    pub async fn migrate(&self) -> Result<Vec<i64>> {
        match self {
            #[cfg(feature = "sqlite")]
            Self::SqliteMemory => Ok(Vec::new()),
            #[cfg(feature = "sqlite")]
            Self::SqliteFile(path) => {
                let path = path.clone();
                blocking(move || super::sqlite::migrate_file(&path)).await
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(url) => super::postgres::migrate_url(url).await,
            #[cfg(feature = "redis")]
            Self::Redis(url) => super::redis::migrate(url).await,
            #[allow(unreachable_patterns)]
            _ => Err(self.not_built()),
        }
    }

    /// How the schema stands against this binary's: what
    /// [`migrate`](Self::migrate) would apply. Changes nothing (a missing
    /// SQLite file is version 0).
    pub async fn migration_status(&self) -> Result<MigrationStatus> {
        match self {
            Self::SqliteMemory => Err(Error::validation(
                "database",
                "sqlite::memory: has no schema to check: name a database file \
                 (sqlite://path/to/file.db) or postgres://…",
            )),
            #[cfg(feature = "sqlite")]
            Self::SqliteFile(path) => {
                let path = path.clone();
                blocking(move || super::sqlite::migration_status(&path)).await
            }
            #[cfg(feature = "postgres")]
            Self::Postgres(url) => super::postgres::migration_status_url(url).await,
            #[cfg(feature = "redis")]
            Self::Redis(url) => super::redis::migration_status(url).await,
            #[allow(unreachable_patterns)]
            _ => Err(self.not_built()),
        }
    }

    /// The error for a backend this build left out.
    #[cfg_attr(
        all(feature = "sqlite", feature = "postgres", feature = "redis"),
        allow(dead_code)
    )]
    fn not_built(&self) -> Error {
        let backend = self.backend();
        Error::validation(
            "database",
            format!(
                "this build of idemq has no {backend} backend: build it with the cargo \
                 feature `{backend}`"
            ),
        )
    }
}

/// Runs file work off the async threads.
#[cfg(feature = "sqlite")]
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Backend {
            message: format!("a storage task ended abnormally: {e}"),
        })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_form_names_its_backend() {
        assert_eq!(
            Location::parse("sqlite::memory:").unwrap(),
            Location::SqliteMemory
        );
        assert_eq!(
            Location::parse("sqlite://data/idemq.db").unwrap(),
            Location::SqliteFile(PathBuf::from("data/idemq.db"))
        );
        assert_eq!(
            Location::parse("sqlite:///tmp/x.db").unwrap(),
            Location::SqliteFile(PathBuf::from("/tmp/x.db"))
        );
        assert_eq!(
            Location::parse("sqlite:idemq.db").unwrap(),
            Location::SqliteFile(PathBuf::from("idemq.db"))
        );
        for url in [
            "postgres://u@h/db",
            "postgresql://h:5432/db?sslmode=disable",
        ] {
            let l = Location::parse(url).unwrap();
            assert_eq!(l, Location::Postgres(url.to_owned()));
            assert_eq!(l.backend(), "postgres");
        }
    }

    #[test]
    fn bad_urls_are_refused_with_the_forms_taken() {
        for url in [
            "",
            "mysql://h/db",
            "sqlite://",
            "sqlite:",
            "sqlite://x.db?mode=ro",
        ] {
            match Location::parse(url) {
                Err(Error::Validation { field, reason }) => {
                    assert_eq!(field, "database", "{url}");
                    assert!(
                        reason.contains("sqlite://path/to/file.db"),
                        "{url}: {reason}"
                    );
                }
                other => panic!("{url}: {other:?}"),
            }
        }
    }

    #[test]
    fn redis_urls_name_redis() {
        for url in [
            "redis://127.0.0.1:6379/2?prefix=a:",
            "redis+unix:///tmp/r.sock",
        ] {
            let l = Location::parse(url).unwrap();
            assert_eq!(l, Location::Redis(url.to_owned()));
            assert_eq!(l.backend(), "redis");
        }
    }

    #[test]
    fn debug_hides_a_password() {
        for url in ["postgres://u:secret@h/db", "redis://:secret@h:6379"] {
            let l = Location::parse(url).unwrap();
            assert!(!format!("{l:?}").contains("secret"));
        }
    }
}
