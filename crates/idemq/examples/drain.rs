//! A worker with a typed handler drains a batch of jobs and checks that
//! every job completed exactly once.
//!
//! ```sh
//! cargo run --release --example drain -- sqlite://drain.db 10000
//! cargo run --release --example drain -- postgres://postgres@127.0.0.1/idemq 10000
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemq::worker::{HandlerContext, Job, JobError, JobOptions, Worker};
use idemq::{BatchOptions, EnqueueRequest, JobState, Queue};
use serde::{Deserialize, Serialize};

/// A typed job: its payload type names its job type, its queue and the
/// options every resize gets.
#[derive(Serialize, Deserialize)]
struct Resize {
    image: u64,
    width: u32,
}

impl Job for Resize {
    const TYPE: &'static str = "image.resize";
    const QUEUE: Option<&'static str> = Some("images");
    fn options(&self) -> JobOptions {
        JobOptions::default()
            .max_attempts(3)
            .timeout(Duration::from_secs(60))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "sqlite://drain.db".into());
    let n: u64 = args.next().map_or(Ok(10_000), |s| s.parse())?;
    if url.starts_with("postgres") {
        Queue::migrate(&url).await?;
    }
    let queue = Queue::connect(&url).await?;

    let start = Instant::now();
    let mut ids = Vec::with_capacity(n as usize);
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let reqs = chunk
            .iter()
            .map(|&i| {
                EnqueueRequest::from_job(&Resize {
                    image: i,
                    width: 320,
                })
            })
            .collect::<idemq::Result<Vec<_>>>()?;
        for r in queue
            .enqueue_many(reqs, BatchOptions { atomic: true })
            .await?
        {
            ids.push(r?.job_id);
        }
    }
    println!("enqueued {n} jobs in {:.2?}", start.elapsed());

    let runs = Arc::new(AtomicU64::new(0));
    let counted = runs.clone();
    let worker = Worker::new(queue.clone())
        .concurrency(64)
        .poll_interval(Duration::from_millis(100))
        .job(move |_ctx: HandlerContext, job: Resize| {
            counted.fetch_add(1, Ordering::Relaxed);
            async move { Ok::<_, JobError>(job.width * 2) }
        });
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    let start = Instant::now();
    // Once every handler has run, shutdown records the last completions
    // before `run` returns, so the time is up to the last one recorded.
    // (The queue counts are no stop signal: on a large table they are
    // estimates.)
    while runs.load(Ordering::Relaxed) < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = tx.send(());
    let report = handle.await??;
    let elapsed = start.elapsed();

    let mut wrong = 0;
    for id in &ids {
        let job = queue.get(id).await?.ok_or("a job vanished")?;
        if job.state != JobState::Completed || job.attempt != 1 || job.queue != "images" {
            wrong += 1;
        }
    }
    println!(
        "drained {n} jobs in {elapsed:.2?} ({:.0} jobs/s); handler runs {}, completed {}, not completed once: {wrong}",
        n as f64 / elapsed.as_secs_f64(),
        runs.load(Ordering::Relaxed),
        report.completed
    );
    if wrong > 0 || runs.load(Ordering::Relaxed) != n {
        return Err("not every job completed exactly once".into());
    }
    Ok(())
}
