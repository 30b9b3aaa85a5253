//! Enqueue inside your own PostgreSQL transaction: the order row and the job
//! that confirms it commit together, or neither does.
//!
//! ```sh
//! idemq migrate --database postgres://postgres@127.0.0.1/app
//! cargo run --example transactional -- postgres://postgres@127.0.0.1/app
//! ```

use idemq::sqlx::{self, Executor};
use idemq::{EnqueueRequest, Outcome, Queue};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("usage: transactional postgres://user@host/db (run `idemq migrate` on it first)");
        std::process::exit(2);
    };
    let queue = Queue::connect(&url).await?;
    let pool = sqlx::PgPool::connect(&url).await?;
    pool.execute("CREATE TABLE IF NOT EXISTS example_orders (id text PRIMARY KEY)")
        .await?;
    let order = format!("ord_{}", std::process::id());

    // Committed: the order and its job both exist.
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO example_orders (id) VALUES ($1)")
        .bind(&order)
        .execute(&mut *tx)
        .await?;
    let confirm = EnqueueRequest::new("order.confirm")
        .payload(json!({ "order": order }))
        .idempotency_key(format!("confirm:{order}"));
    let r = queue.enqueue_in(&mut tx, confirm.clone()).await?;
    tx.commit().await?;
    println!("committed: order {order}, job {} ({})", r.job_id, r.outcome);

    // Rolled back: neither the order nor the job exists.
    let rolled = format!("{order}_b");
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO example_orders (id) VALUES ($1)")
        .bind(&rolled)
        .execute(&mut *tx)
        .await?;
    let gone = queue
        .enqueue_in(
            &mut tx,
            EnqueueRequest::new("order.confirm").payload(json!({ "order": rolled })),
        )
        .await?;
    tx.rollback().await?;
    println!(
        "rolled back: job {} exists: {}",
        gone.job_id,
        queue.get(&gone.job_id).await?.is_some()
    );

    // A retried request replays the committed job.
    let again = queue.enqueue_with_result(confirm).await?;
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (r.job_id.as_str(), Outcome::Replayed)
    );
    println!("retried: {} {}", again.outcome, again.job_id);
    Ok(())
}
