//! The raw limits of PostgreSQL, measured through sqlx (as idemq talks to
//! it) in scratch tables of the bench database. Each producer holds a
//! connection of its own for the whole measurement: a call through sqlx's
//! pool costs a round trip more (the pool checks every connection given
//! back to it), which is the client's cost, not the database's.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use indicatif::ProgressBar;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Executor, Postgres};

use super::{Limit, drive};

/// `bench_queue` is the table of a minimal queue (a jsonb payload, one
/// partial index for its claims), the shape of the peers' raw anchors: the
/// single-row and multi-row inserts (W1, W2) write it as those anchors do,
/// and W3's claim/complete loop drains it.
const SETUP: &str = "
    CREATE TABLE bench_keys (k text PRIMARY KEY, job text NOT NULL, n integer NOT NULL DEFAULT 1);
    CREATE TABLE bench_queue (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        queue text NOT NULL DEFAULT 'default',
        state smallint NOT NULL DEFAULT 0,
        payload jsonb NOT NULL,
        run_at timestamptz NOT NULL DEFAULT now(),
        locked_by integer);
    CREATE INDEX bench_queue_fetch ON bench_queue (queue, run_at, id) WHERE state = 0";
const TEARDOWN: &str = "DROP TABLE IF EXISTS bench_keys, bench_queue";

/// Loopers of the claim/complete limit: one per core of a small box.
const CLAIMERS: usize = 2;

/// A raw limit being measured on one pool.
pub(crate) struct Raw {
    pool: PgPool,
    limit: Limit,
    latencies: Arc<Mutex<Vec<f64>>>,
}

impl Raw {
    pub(crate) async fn open(url: &str, limit: Limit) -> Result<Self> {
        let connections = match limit {
            Limit::InsertCommit { producers }
            | Limit::OnConflict { producers, .. }
            | Limit::OnConflictNoop { producers, .. }
            | Limit::Upsert { producers, .. } => producers,
            Limit::MultiRow => 1,
            Limit::ClaimComplete => CLAIMERS,
        };
        // One more than the producers hold, for setup and teardown.
        let pool = PgPoolOptions::new()
            .max_connections(connections as u32 + 1)
            .min_connections(connections as u32)
            .connect(url)
            .await?;
        sqlx::raw_sql(SETUP).execute(&pool).await?;
        Ok(Self {
            pool,
            limit,
            latencies: Arc::default(),
        })
    }

    pub(crate) async fn close(self) -> Result<Option<f64>> {
        sqlx::raw_sql(TEARDOWN).execute(&self.pool).await?;
        self.pool.close().await;
        let mut l = lock(&self.latencies);
        Ok((!l.is_empty()).then(|| median(&mut l)))
    }

    /// A connection of its own for each of `n` producers (not timed).
    async fn held(
        &self,
        n: usize,
    ) -> Result<Arc<Vec<tokio::sync::Mutex<PoolConnection<Postgres>>>>> {
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            conns.push(tokio::sync::Mutex::new(self.pool.acquire().await?));
        }
        Ok(Arc::new(conns))
    }

    pub(crate) async fn run(&self, range: Range<usize>, bar: &ProgressBar) -> Result<Duration> {
        let pool = &self.pool;
        match self.limit {
            Limit::InsertCommit { producers } => {
                let (c, l) = (self.held(producers).await?, self.latencies.clone());
                drive(producers, range, bar, move |i| {
                    let (conns, lat) = (c.clone(), l.clone());
                    async move {
                        // Producer `i % producers` makes call `i` (`drive`).
                        let mut conn = conns[i % producers].lock().await;
                        let t = Instant::now();
                        conn.execute(
                            sqlx::query("INSERT INTO bench_queue (payload) VALUES ($1::jsonb)")
                                .bind(format!("{{\"i\":{i}}}")),
                        )
                        .await?;
                        if producers == 1 {
                            lock(&lat).push(t.elapsed().as_secs_f64() * 1e3);
                        }
                        Ok(())
                    }
                })
                .await
            }
            Limit::MultiRow => {
                let start = Instant::now();
                let mut done = range.start;
                while done < range.end {
                    let n = (range.end - done).min(1000);
                    let payloads: Vec<String> =
                        (done..done + n).map(|i| format!("{{\"i\":{i}}}")).collect();
                    sqlx::query(
                        "INSERT INTO bench_queue (payload) SELECT * FROM unnest($1::text[]::jsonb[])",
                    )
                    .bind(&payloads)
                    .execute(pool)
                    .await?;
                    done += n;
                    bar.inc(n as u64);
                }
                Ok(start.elapsed())
            }
            Limit::ClaimComplete => {
                // Filling the table is not timed; claiming it empty is.
                sqlx::query(
                    "INSERT INTO bench_queue (payload)
                     SELECT jsonb_build_object('i', i) FROM generate_series($1, $2) i",
                )
                .bind(range.start as i64)
                .bind(range.end as i64 - 1)
                .execute(pool)
                .await?;
                sqlx::raw_sql("ANALYZE bench_queue").execute(pool).await?;
                let mut tasks = tokio::task::JoinSet::new();
                let mut conns = Vec::with_capacity(CLAIMERS);
                for _ in 0..CLAIMERS {
                    conns.push(pool.acquire().await?);
                }
                let start = Instant::now();
                for mut conn in conns {
                    let bar = bar.clone();
                    tasks.spawn(async move {
                        loop {
                            // Claim (a transaction), then complete (another):
                            // the least an at-least-once queue commits per batch.
                            let ids: Vec<i64> = sqlx::query_scalar(
                                "UPDATE bench_queue SET state = 1, locked_by = 1
                                 WHERE id IN (
                                     SELECT id FROM bench_queue
                                     WHERE queue = 'default' AND state = 0 AND run_at <= now()
                                     ORDER BY run_at, id LIMIT 100
                                     FOR UPDATE SKIP LOCKED)
                                 RETURNING id",
                            )
                            .fetch_all(&mut *conn)
                            .await?;
                            if ids.is_empty() {
                                return Ok::<_, anyhow::Error>(());
                            }
                            sqlx::query(
                                "UPDATE bench_queue SET state = 2, locked_by = NULL
                                 WHERE id = ANY($1)",
                            )
                            .bind(&ids)
                            .execute(&mut *conn)
                            .await?;
                            bar.inc(ids.len() as u64);
                        }
                    });
                }
                while let Some(done) = tasks.join_next().await {
                    done??;
                }
                Ok(start.elapsed())
            }
            Limit::OnConflict { producers, keys }
            | Limit::OnConflictNoop { producers, keys }
            | Limit::Upsert { producers, keys } => {
                if matches!(self.limit, Limit::OnConflictNoop { .. }) {
                    // Every key present before the clock starts.
                    sqlx::query(
                        "INSERT INTO bench_keys (k, job)
                         SELECT 'key-' || i, 'job-' || i FROM generate_series(0, $1 - 1) i
                         ON CONFLICT DO NOTHING",
                    )
                    .bind(keys as i64)
                    .execute(pool)
                    .await?;
                }
                let sql = if matches!(self.limit, Limit::Upsert { .. }) {
                    "INSERT INTO bench_keys (k, job) VALUES ($1, $2)
                     ON CONFLICT (k) DO UPDATE SET n = bench_keys.n + 1"
                } else {
                    "INSERT INTO bench_keys (k, job) VALUES ($1, $2) ON CONFLICT DO NOTHING"
                };
                let c = self.held(producers).await?;
                drive(producers, range, bar, move |i| {
                    let conns = c.clone();
                    async move {
                        let mut conn = conns[i % producers].lock().await;
                        conn.execute(
                            sqlx::query(sql)
                                .bind(format!("key-{}", i % keys))
                                .bind(format!("job-{i}")),
                        )
                        .await?;
                        Ok(())
                    }
                })
                .await
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The median of `v` (sorted in place); 0 for none.
pub(crate) fn median(v: &mut [f64]) -> f64 {
    percentile(v, 0.5)
}

/// The `q` quantile of `v` (sorted in place, nearest rank); 0 for none.
pub(crate) fn percentile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let rank = ((v.len() as f64 * q).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
