//! The database each workload runs on: a fresh one every time, so no
//! workload inherits another's rows, dead tuples or WAL (on Redis: a fresh
//! key prefix on the named server, so no workload inherits another's keys).

use std::path::PathBuf;

use idemq::store::Location;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{Context as _, Result, bail};
use sqlx::Connection as _;

/// The backend named by `--database`.
#[derive(Clone, Debug)]
pub(crate) enum Backend {
    /// A PostgreSQL server; the URL's own database is only used to create and
    /// drop the bench databases.
    Postgres { admin_url: String },
    /// SQLite: fresh files are made in this directory (the one of the
    /// `--database` file, so the bench measures that file system).
    Sqlite { dir: PathBuf },
    /// A Redis server: each workload gets a key prefix of its own on it,
    /// deleted afterwards.
    Redis(super::raw_redis::Server),
}

/// A fresh, migrated database.
pub(crate) enum Fresh {
    Postgres {
        url: String,
        name: String,
        admin_url: String,
    },
    Sqlite {
        url: String,
        path: PathBuf,
        _dir: tempfile::TempDir,
    },
    /// An installation under a key prefix of its own.
    Redis {
        url: String,
        /// The driver's URL (idemq's parameters taken out).
        driver: String,
        prefix: String,
    },
}

static NEXT: AtomicUsize = AtomicUsize::new(0);

impl Backend {
    /// Reads `--database`; on Redis, also reads the server's persistence
    /// settings and refuses a server that could lose acknowledged writes
    /// unless the URL says `?durability=relaxed` (as idemq's store does).
    pub(crate) async fn connect(url: &str) -> Result<Self> {
        Ok(match idemq::store::Location::parse(url)? {
            Location::Redis(url) => Self::Redis(super::raw_redis::Server::connect(&url).await?),
            _ => Self::parse(url)?,
        })
    }

    fn parse(url: &str) -> Result<Self> {
        Ok(match idemq::store::Location::parse(url)? {
            Location::Postgres(url) => Self::Postgres { admin_url: url },
            Location::SqliteMemory => Self::Sqlite {
                dir: std::env::temp_dir(),
            },
            Location::SqliteFile(path) => Self::Sqlite {
                dir: match path.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                    _ => PathBuf::from("."),
                },
            },
            other => bail!("idemq bench does not run on {} yet", other.backend()),
        })
    }

    /// `sqlite`, `postgres` or `redis`.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Self::Postgres { .. } => "postgres",
            Self::Sqlite { .. } => "sqlite",
            Self::Redis(_) => "redis",
        }
    }

    /// What the run's header says about the server beside its name (on
    /// Redis: its version and persistence settings).
    pub(crate) fn settings(&self) -> Option<&str> {
        match self {
            Self::Redis(server) => Some(server.settings()),
            _ => None,
        }
    }

    /// Makes a fresh database with the idemq schema installed.
    pub(crate) async fn fresh(&self) -> Result<Fresh> {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        match self {
            Self::Postgres { admin_url } => {
                let name = format!("idemq_bench_{}_{n}", std::process::id());
                let mut admin = sqlx::PgConnection::connect(admin_url)
                    .await
                    .context("cannot connect to PostgreSQL")?;
                // The name is ours: letters, digits and underscores.
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
                    .execute(&mut admin)
                    .await
                    .with_context(|| format!("cannot create database {name}"))?;
                admin.close().await.ok();
                let url = with_database(admin_url, &name);
                let fresh = Fresh::Postgres {
                    url: url.clone(),
                    name,
                    admin_url: admin_url.clone(),
                };
                if let Err(e) = idemq::Queue::migrate(&url).await {
                    fresh.dispose().await.ok();
                    return Err(e).context("cannot migrate the bench database");
                }
                Ok(fresh)
            }
            Self::Sqlite { dir } => {
                // The folder a user names for the bench file need not exist
                // yet, as a database file named to `serve` need not.
                std::fs::create_dir_all(dir)
                    .with_context(|| format!("cannot create the directory {}", dir.display()))?;
                let tmp = tempfile::Builder::new()
                    .prefix("idemq-bench-")
                    .tempdir_in(dir)
                    .with_context(|| format!("cannot make a directory in {}", dir.display()))?;
                let path = tmp.path().join("bench.db");
                let url = format!("sqlite://{}", path.display());
                // Opening creates and migrates the file.
                idemq::Queue::connect(&url).await?;
                Ok(Fresh::Sqlite {
                    url,
                    path,
                    _dir: tmp,
                })
            }
            Self::Redis(server) => {
                // Redis prefixes take no underscore: hyphens, dots and colons.
                let prefix = format!("idemq-bench-{}-{n}:", std::process::id());
                let fresh = Fresh::Redis {
                    url: server.url_with_prefix(&prefix),
                    driver: server.driver().to_owned(),
                    prefix,
                };
                if let Err(e) = idemq::Queue::migrate(fresh.url()).await {
                    fresh.dispose().await.ok();
                    return Err(e).context("cannot migrate the bench installation");
                }
                Ok(fresh)
            }
        }
    }

    /// Runs `f` on a fresh database and drops the database afterwards,
    /// whether `f` succeeded or not.
    pub(crate) async fn with_fresh<T>(
        &self,
        f: impl AsyncFnOnce(&Fresh) -> Result<T>,
    ) -> Result<T> {
        let db = self.fresh().await?;
        let out = f(&db).await;
        let dropped = db.dispose().await;
        let out = out?;
        dropped?;
        Ok(out)
    }
}

impl Fresh {
    /// The URL idemq connects to.
    pub(crate) fn url(&self) -> &str {
        match self {
            Self::Postgres { url, .. } | Self::Sqlite { url, .. } | Self::Redis { url, .. } => url,
        }
    }

    /// `sqlite`, `postgres` or `redis`.
    pub(crate) fn backend(&self) -> &'static str {
        match self {
            Self::Postgres { .. } => "postgres",
            Self::Sqlite { .. } => "sqlite",
            Self::Redis { .. } => "redis",
        }
    }

    /// Drops the database (the SQLite directory goes with the value; on
    /// Redis, every key under the prefix is unlinked).
    pub(crate) async fn dispose(self) -> Result<()> {
        if let Self::Redis { driver, prefix, .. } = &self {
            let mut conn = super::raw_redis::connect(driver).await?;
            super::raw_redis::unlink_prefixed(&mut conn, prefix)
                .await
                .with_context(|| format!("cannot delete the keys under {prefix}"))?;
            return Ok(());
        }
        if let Self::Postgres {
            name, admin_url, ..
        } = self
        {
            let mut admin = sqlx::PgConnection::connect(&admin_url).await?;
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut admin)
            .await
            .with_context(|| format!("cannot drop database {name}"))?;
            admin.close().await.ok();
        }
        Ok(())
    }
}

/// `url` with its database path replaced by `name` (query parameters kept).
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let start = base.find("://").map_or(0, |i| i + 3);
    let end = base[start..].find('/').map_or(base.len(), |i| start + i);
    match query {
        Some(q) => format!("{}/{name}?{q}", &base[..end]),
        None => format!("{}/{name}", &base[..end]),
    }
}

#[cfg(test)]
mod tests {
    use super::with_database;

    #[test]
    fn replaces_the_database_of_a_url() {
        assert_eq!(
            with_database("postgres://postgres@127.0.0.1:5432/postgres", "b"),
            "postgres://postgres@127.0.0.1:5432/b"
        );
        assert_eq!(
            with_database("postgres://u:p@h/db?sslmode=disable", "b"),
            "postgres://u:p@h/b?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h:1", "b"), "postgres://h:1/b");
    }
}
