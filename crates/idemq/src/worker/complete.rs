//! The completer: records the successful attempts of a worker many per round
//! trip. Supervisors hand their completions to one task, which takes
//! whatever has queued up (at most 1,000) and records it with one
//! `complete_many`, so under load one commit serves many jobs, and an idle
//! worker still records each completion at once (a batch of one).

use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use crate::error::{Error, Result};
use crate::queue::{Completion, Queue};

/// Most completions in one call.
const MAX_BATCH: usize = 1000;

type Request = (Completion, oneshot::Sender<Result<()>>);

/// The handle supervisors send completions through.
#[derive(Clone)]
pub(super) struct Completer {
    tx: mpsc::UnboundedSender<Request>,
}

impl Completer {
    /// Starts the completer task; it ends when every handle is dropped and
    /// the queued completions are recorded.
    pub(super) fn start(queue: Queue) -> (Self, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx }, tokio::spawn(run(queue, rx)))
    }

    /// Records one completion with whatever else is queued; `None` when the
    /// completer is gone (the caller records the completion itself).
    pub(super) async fn complete(
        &self,
        job_id: &str,
        lease_token: &str,
        result: Option<Value>,
    ) -> Option<Result<()>> {
        let (reply, answer) = oneshot::channel();
        let completion = Completion {
            job_id: job_id.to_owned(),
            lease_token: lease_token.to_owned(),
            result,
        };
        self.tx.send((completion, reply)).ok()?;
        answer.await.ok()
    }
}

async fn run(queue: Queue, mut rx: mpsc::UnboundedReceiver<Request>) {
    let mut batch: Vec<Request> = Vec::new();
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        let (items, replies): (Vec<Completion>, Vec<_>) = batch.drain(..).unzip();
        match queue.complete_many(items).await {
            Ok(results) => {
                for (reply, result) in replies.into_iter().zip(results) {
                    let _ = reply.send(result);
                }
            }
            // Nothing was recorded: each supervisor retries on its own.
            Err(e) => {
                let (retryable, message) = (e.is_retryable(), e.to_string());
                for reply in replies {
                    let message = message.clone();
                    let _ = reply.send(Err(if retryable {
                        Error::Unavailable { message }
                    } else {
                        Error::Backend { message }
                    }));
                }
            }
        }
    }
}
