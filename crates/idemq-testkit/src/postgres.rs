//! PostgreSQL databases for tests: one per case, cloned from a migrated
//! template that is built once per schema version, on the server named by
//! `IDEMQ_TEST_DATABASE_URL`. An unreachable server panics with how to start
//! it: a missing PostgreSQL fails the run, never skips it.

use std::sync::OnceLock;

/// The server the PostgreSQL cases run on (its `postgres` database is used
/// to create one database per case).
pub fn pg_admin_url() -> String {
    std::env::var("IDEMQ_TEST_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The URL of database `db` on the server of [`pg_admin_url`] (same host,
/// credentials and query parameters).
pub fn pg_url(db: &str) -> String {
    let admin = pg_admin_url();
    let (main, query) = admin.split_once('?').unwrap_or((admin.as_str(), ""));
    let host_start = main.find("://").map_or(0, |i| i + 3);
    let base = match main[host_start..].find('/') {
        Some(i) => &main[..host_start + i],
        None => main,
    };
    if query.is_empty() {
        format!("{base}/{db}")
    } else {
        format!("{base}/{db}?{query}")
    }
}

/// Runs `f` on a runtime of its own thread: admin work outlives any one test's runtime.
fn on_own_runtime<T: Send + 'static>(f: impl AsyncFnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(f())
    })
    .join()
    .expect("admin thread")
}

async fn admin_exec(sql: String) -> Result<(), String> {
    use sqlx::Connection;
    let url = pg_admin_url();
    let mut conn = sqlx::PgConnection::connect(&url).await.map_err(|e| {
        format!(
            "PostgreSQL is unreachable at {url} ({e}). Start it (e.g. `pg_ctlcluster \
             --skip-systemctl-redirect $(ls /etc/postgresql) main start`) or set \
             IDEMQ_TEST_DATABASE_URL"
        )
    })?;
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    conn.close().await.map_err(|e| e.to_string())
}

/// The migrated template every case's database is cloned from, made once per
/// schema version (its name carries a digest of the migrations).
fn template() -> &'static str {
    static TEMPLATE: OnceLock<String> = OnceLock::new();
    TEMPLATE.get_or_init(|| {
        let mut all = String::from(idemq::store::postgres::BOOKKEEPING);
        for (_, _, sql) in idemq::store::postgres::MIGRATIONS {
            all.push_str(sql);
        }
        all.push_str(idemq::store::postgres::FUNCTIONS);
        let digest = idemq::fingerprint::canonical_json(&serde_json::Value::String(all));
        let name = format!("idemq_tpl_{:016x}", fxhash(&digest));
        let n = name.clone();
        on_own_runtime(async move || -> Result<(), String> {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&pg_admin_url()).await.map_err(|e| {
                format!("PostgreSQL is unreachable at {} ({e}): start it or set IDEMQ_TEST_DATABASE_URL", pg_admin_url())
            })?;
            // One process builds the template; the others wait for it.
            sqlx::query("SELECT pg_advisory_lock(7370)").execute(&mut conn).await.map_err(|e| e.to_string())?;
            let exists: bool = sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
                .bind(&n)
                .fetch_one(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            if !exists {
                let tmp = format!("{n}_build");
                admin_exec(format!("DROP DATABASE IF EXISTS {tmp} WITH (FORCE)")).await?;
                admin_exec(format!("CREATE DATABASE {tmp}")).await?;
                let pool = sqlx::PgPool::connect(&pg_url(&tmp)).await.map_err(|e| e.to_string())?;
                idemq::store::postgres::migrate(&pool).await.map_err(|e| e.to_string())?;
                pool.close().await;
                admin_exec(format!("ALTER DATABASE {tmp} RENAME TO {n}")).await?;
            }
            sqlx::query("SELECT pg_advisory_unlock(7370)").execute(&mut conn).await.map_err(|e| e.to_string())?;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("cannot prepare the PostgreSQL template: {e}"));
        name
    })
}

fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A new PostgreSQL database cloned from the migrated template, on the real
/// clock; returns its URL and name (drop it with [`drop_pg_database`]).
pub fn pg_database() -> (String, String) {
    let template = template();
    let db = format!("idemq_t_{}", uuid::Uuid::new_v4().simple());
    let create = format!("CREATE DATABASE {db} TEMPLATE {template}");
    on_own_runtime(async move || admin_exec(create).await)
        .unwrap_or_else(|e| panic!("cannot create a test database: {e}"));
    (pg_url(&db), db)
}

/// Drops a database made by [`pg_database`].
pub fn drop_pg_database(db: &str) {
    let sql = format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)");
    let _ = on_own_runtime(async move || admin_exec(sql).await);
}

/// A database made by [`pg_database`], dropped with this guard, also when
/// the test fails.
pub struct PgDatabase {
    /// Its URL.
    pub url: String,
    name: String,
}

impl PgDatabase {
    /// A new database, as [`pg_database`] makes it.
    pub fn new() -> Self {
        let (url, name) = pg_database();
        Self { url, name }
    }
}

impl Default for PgDatabase {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        drop_pg_database(&self.name);
    }
}
