//! A typed job whose handler writes its effect and completes its job in one
//! transaction of its own database: the order row and the completion commit
//! together, so a crash between them leaves neither, and the retry writes
//! the row once. Checks that every order exists exactly once.
//!
//! ```sh
//! cargo run --example in_transaction -- sqlite://orders.db
//! cargo run --example in_transaction -- postgres://postgres@127.0.0.1/app
//! ```

use std::sync::Arc;
use std::time::Duration;

use idemq::rusqlite::{self, TransactionBehavior};
use idemq::sqlx::{self, Executor};
use idemq::worker::{HandlerContext, Job, JobError, JobOptions, Worker};
use idemq::{IdempotencyOptions, JobState, Outcome, Queue};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// One order to place. The definition keys it by order id, so a repeated
/// request for the same order is a replay.
#[derive(Serialize, Deserialize)]
struct PlaceOrder {
    order: String,
    cents: i64,
}

impl Job for PlaceOrder {
    const TYPE: &'static str = "order.place";
    const QUEUE: Option<&'static str> = Some("orders");
    fn options(&self) -> JobOptions {
        JobOptions::default().max_attempts(5)
    }
    fn idempotency(&self) -> Option<IdempotencyOptions> {
        Some(IdempotencyOptions::new(format!("place:{}", self.order)))
    }
}

/// The application's own database, where the orders go.
enum App {
    Pg(sqlx::PgPool),
    Sqlite(Queue),
}

impl App {
    async fn place(&self, ctx: &HandlerContext, o: &PlaceOrder) -> Result<(), JobError> {
        let result = json!({ "placed": o.order });
        match self {
            App::Pg(pool) => {
                let mut tx = pool.begin().await?;
                sqlx::query("INSERT INTO example_placed (id, cents) VALUES ($1, $2)")
                    .bind(&o.order)
                    .bind(o.cents)
                    .execute(&mut *tx)
                    .await?;
                // Last, just before the commit: a lost lease fails here and
                // the transaction rolls back with the order row.
                ctx.complete_in(&mut tx, &result).await?;
                tx.commit().await?;
            }
            App::Sqlite(queue) => {
                let mut conn = queue.sqlite_connection()?;
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                tx.execute(
                    "INSERT INTO example_placed (id, cents) VALUES (?1, ?2)",
                    rusqlite::params![o.order, o.cents],
                )?;
                ctx.complete_in_sqlite(&tx, &result)?;
                tx.commit()?;
            }
        }
        Ok(())
    }

    async fn placed(&self) -> Result<i64, Box<dyn std::error::Error>> {
        let sql = "SELECT count(*) FROM example_placed";
        Ok(match self {
            App::Pg(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
            App::Sqlite(queue) => queue
                .sqlite_connection()?
                .query_row(sql, [], |r| r.get(0))?,
        })
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "sqlite://orders.db".into());
    if url.starts_with("postgres") {
        Queue::migrate(&url).await?;
    }
    let queue = Queue::connect(&url).await?;
    let create = "CREATE TABLE example_placed (id text PRIMARY KEY, cents bigint NOT NULL)";
    let app = Arc::new(if url.starts_with("postgres") {
        let pool = sqlx::PgPool::connect(&url).await?;
        pool.execute("DROP TABLE IF EXISTS example_placed").await?;
        pool.execute(create).await?;
        App::Pg(pool)
    } else {
        let conn = queue.sqlite_connection()?;
        conn.execute_batch(&format!("DROP TABLE IF EXISTS example_placed; {create}"))?;
        App::Sqlite(queue.clone())
    });

    // A run of its own: the order ids are new each time.
    let run = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let n = 200;
    let mut ids = Vec::new();
    for i in 0..n {
        let order = PlaceOrder {
            order: format!("{run}-{i}"),
            cents: 100 + i,
        };
        ids.push(queue.enqueue(order).await?);
        // A double click: the same order again is a replay of the same job.
        let again = queue
            .enqueue_with_result(PlaceOrder {
                order: format!("{run}-{i}"),
                cents: 100 + i,
            })
            .await?;
        assert_eq!(again.outcome, Outcome::Replayed);
    }

    let handler_app = app.clone();
    let worker = Worker::new(queue.clone())
        .queues(["orders"])
        .concurrency(8)
        .poll_interval(Duration::from_millis(100))
        .job(move |ctx: HandlerContext, order: PlaceOrder| {
            let app = handler_app.clone();
            async move {
                app.place(&ctx, &order).await?;
                Ok::<_, JobError>(())
            }
        });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(worker.run(async move {
        let _ = stopped.await;
    }));
    let started = std::time::Instant::now();
    loop {
        let mut done = 0;
        for id in &ids {
            if queue
                .get(id)
                .await?
                .is_some_and(|j| j.state == JobState::Completed)
            {
                done += 1;
            }
        }
        if done == ids.len() {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            return Err(format!("only {done} of {n} orders completed in 60 s").into());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = stop.send(());
    let report = running.await??;
    let placed = app.placed().await?;
    println!(
        "{} orders placed, {} jobs completed in their handlers' transactions, {} lost",
        placed, report.completed, report.lost
    );
    if placed != n || report.completed != n as u64 || report.lost != 0 {
        return Err("every order must be placed exactly once".into());
    }
    Ok(())
}
