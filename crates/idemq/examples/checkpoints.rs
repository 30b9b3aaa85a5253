//! Durable steps: a payment is charged once even when the attempt that
//! charged it fails afterwards.
//!
//! ```sh
//! cargo run --example checkpoints
//! ```
//!
//! The first attempt charges, stores the charge id as the checkpoint
//! `charge`, then fails (say the receipt email bounced). The retry gets the
//! stored charge id back without charging again.
//!
//! One gap remains: a crash *between* the provider accepting the charge and
//! the checkpoint being stored repeats the charge on the next attempt. Close
//! it by passing an idempotency key the provider honours — the job id is a
//! good one, stable across every attempt of the job — as `charge` does below.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{EnqueueRequest, JobState, Queue};
use serde::Deserialize;
use serde_json::json;

/// A stand-in for a payment provider that honours idempotency keys.
#[derive(Clone, Default)]
struct Provider {
    charges: Arc<Mutex<HashMap<String, String>>>,
}

impl Provider {
    /// Charges once per idempotency key; a repeat returns the first charge.
    fn charge(&self, idempotency_key: &str, cents: u64) -> String {
        let mut charges = self.charges.lock().unwrap_or_else(|p| p.into_inner());
        let next = charges.len() + 1;
        charges
            .entry(idempotency_key.to_owned())
            .or_insert_with(|| format!("ch_{next}_{cents}"))
            .clone()
    }
}

#[derive(Deserialize)]
struct Capture {
    invoice: String,
    cents: u64,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let queue = Queue::connect("sqlite::memory:").await?;
    let provider = Provider::default();
    let id = queue
        .enqueue(
            EnqueueRequest::new("invoice.capture")
                .payload(json!({ "invoice": "inv_42", "cents": 1250 }))
                .idempotency_key("capture:inv_42"),
        )
        .await?;

    let p = provider.clone();
    let worker = Worker::new(queue.clone())
        .poll_interval(Duration::from_millis(50))
        .handle(
            "invoice.capture",
            move |ctx: HandlerContext, job: Capture| {
                let p = p.clone();
                async move {
                    let charge: String = ctx
                        .checkpoint("charge", || async {
                            // The job id is the provider's idempotency key.
                            Ok(p.charge(ctx.job_id(), job.cents))
                        })
                        .await?;
                    if ctx.attempt() == 1 {
                        return Err(JobError::retry_after(
                            "the receipt email bounced",
                            Duration::ZERO,
                        ));
                    }
                    Ok(json!({ "invoice": job.invoice, "charge": charge }))
                }
            },
        );
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(worker.run(async move {
        let _ = rx.await;
    }));
    let job = queue.wait(&id, Duration::from_secs(10)).await?;
    let _ = tx.send(());
    handle.await??;

    let charges = provider.charges.lock().map(|c| c.len()).unwrap_or_default();
    println!(
        "job {id}: {} after {} attempts, result {:?}",
        job.state, job.attempt, job.result
    );
    println!("the provider charged {charges} time(s)");
    if job.state != JobState::Completed || charges != 1 {
        return Err("the payment was not charged exactly once".into());
    }
    Ok(())
}
