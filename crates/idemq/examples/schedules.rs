//! Cron and interval schedules: every tick is enqueued once, however many
//! processes run the scheduler.
//!
//! ```sh
//! cargo run --example schedules
//! ```

use std::time::Duration;

use idemq::schedule::ScheduleDefinition;
use idemq::worker::{HandlerContext, JobError, Maintenance, Worker};
use idemq::{EnqueueRequest, Queue};
use serde_json::{Value, json};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("idemq-schedules-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let url = format!("sqlite://{}", dir.join("schedules.db").display());
    let queue = Queue::connect(&url).await?;

    // Every second (cron has a seconds field), in a named time zone.
    let report = EnqueueRequest::new("report.build").payload(json!({ "kind": "heartbeat" }));
    queue
        .schedule_set(
            "heartbeat",
            ScheduleDefinition::cron("* * * * * *", report).timezone("Europe/Berlin"),
        )
        .await?;
    // Every two seconds, anchored at creation.
    let sweep = EnqueueRequest::new("cache.sweep");
    queue
        .schedule_set(
            "sweep",
            ScheduleDefinition::every(Duration::from_secs(2), sweep),
        )
        .await?;
    for s in queue.schedules().await? {
        println!("schedule {}: next fire at {:?}", s.name, s.next_fire_at);
    }

    // Three scheduler processes would fire each tick once; here, three loops.
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut schedulers = Vec::new();
    for _ in 0..3 {
        let m = Maintenance::new(Queue::connect(&url).await?).every(Duration::from_millis(200));
        schedulers.push(tokio::spawn(m.run_until(stopped.clone())));
    }
    let worker = Worker::new(queue.clone())
        .maintenance(false)
        .poll_interval(Duration::from_millis(100))
        .handle(
            "report.build",
            |ctx: HandlerContext, _p: Value| async move {
                println!("  report.build  {}", ctx.job_id());
                Ok::<_, JobError>(())
            },
        )
        .handle("cache.sweep", |ctx: HandlerContext, _p: Value| async move {
            println!("  cache.sweep   {}", ctx.job_id());
            Ok::<_, JobError>(())
        });
    let run = tokio::spawn(worker.run(tokio::time::sleep(Duration::from_secs(5))));
    let report = run.await??;
    let _ = stop.send(true);
    for s in schedulers {
        s.await?;
    }
    println!(
        "ran {} scheduled jobs in 5 s with three schedulers",
        report.completed
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
