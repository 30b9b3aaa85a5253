//! Single enqueues of concurrent callers sent together (docs/storage.md,
//! "Concurrent enqueues share a statement").
//!
//! A store runs at most `enqueue_statements` statements of single keyless
//! enqueues at once. A call that finds them all out waits; when one comes
//! back, the calls waiting by then go to the database together, as one
//! batch insert, each with its own answer: the one it would have had on its
//! own. A commit's flush is most of a single enqueue's time, so concurrent
//! producers share one instead of queueing for their own.

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::enqueue::{self, GroupFailure};
use super::{PgStore, db, db_err};
use crate::error::{Error, Result};
use crate::job::EnqueueResult;
use crate::request::PreparedEnqueue;
use crate::store::JobEnqueue;
use crate::{MAX_BATCH_BYTES, MAX_BATCH_ITEMS};

/// The single enqueues of one store: how many statements are out, and the
/// calls waiting for one to come back.
#[derive(Debug)]
pub(crate) struct Grouper {
    state: Mutex<State>,
    /// Most statements out at once.
    limit: usize,
    /// Calls answered by a statement sent for more than one call.
    grouped: AtomicU64,
}

#[derive(Debug, Default)]
struct State {
    running: usize,
    waiting: VecDeque<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    item: PreparedEnqueue,
    answer: oneshot::Sender<Result<EnqueueResult>>,
}

/// A call's turn: a statement of its own now, or an answer to wait for.
enum Turn {
    Now(Box<PreparedEnqueue>),
    Wait(oneshot::Receiver<Result<EnqueueResult>>),
}

impl Grouper {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            state: Mutex::default(),
            limit: limit.max(1),
            grouped: AtomicU64::new(0),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn grouped(&self) -> u64 {
        self.grouped.load(Ordering::Relaxed)
    }

    /// The calls waiting, in arrival order, up to a batch's bounds; a call
    /// whose caller has gone (its deadline passed) is left out and writes
    /// nothing.
    fn take(state: &mut State) -> Vec<Waiter> {
        let mut group = Vec::new();
        let mut bytes = 0;
        while let Some(next) = state.waiting.front() {
            if next.answer.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            let size = next.item.payload.len();
            if group.len() == MAX_BATCH_ITEMS
                || (!group.is_empty() && bytes + size > MAX_BATCH_BYTES)
            {
                break;
            }
            bytes += size;
            group.extend(state.waiting.pop_front());
        }
        group
    }
}

/// A statement's place, held by the call or the task that sends it;
/// dropped (even with a task that never ran), it hands the place to the
/// calls waiting, or gives it up.
struct Out<S: Borrow<PgStore>>(S);

impl<S: Borrow<PgStore>> Drop for Out<S> {
    fn drop(&mut self) {
        self.0.borrow().hand_on();
    }
}

impl PgStore {
    /// One keyless request of one caller, outside a transaction: in a
    /// statement of its own when one may go out, else with the calls
    /// waiting beside it.
    pub(super) async fn enqueue_single(&self, item: PreparedEnqueue) -> Result<EnqueueResult> {
        let turn = {
            let mut state = self.grouper.state();
            if state.running < self.grouper.limit {
                state.running += 1;
                Turn::Now(Box::new(item))
            } else {
                let (answer, waiting) = oneshot::channel();
                state.waiting.push_back(Waiter { item, answer });
                Turn::Wait(waiting)
            }
        };
        match turn {
            Turn::Now(item) => {
                let _out = Out(self);
                self.alone(*item).await
            }
            Turn::Wait(waiting) => waiting.await.unwrap_or_else(|_| {
                Err(Error::Unavailable {
                    message: "postgres: the statement of this enqueue was abandoned \
                              (the runtime is shutting down)"
                        .into(),
                })
            }),
        }
    }

    /// One request in a statement of its own.
    async fn alone(&self, item: PreparedEnqueue) -> Result<EnqueueResult> {
        let mut out = self
            .enqueue_call(JobEnqueue {
                items: vec![item],
                atomic: false,
                dry_run: false,
            })
            .await?;
        out.pop().unwrap_or_else(|| {
            Err(Error::Backend {
                message: "no result".into(),
            })
        })
    }

    /// A statement came back: the calls waiting go out together in a task
    /// that keeps its place, or the place is given up.
    fn hand_on(&self) {
        let group = {
            let mut state = self.grouper.state();
            let group = Grouper::take(&mut state);
            if group.is_empty() {
                state.running -= 1;
                return;
            }
            group
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            // No runtime to send them: their callers are told (their
            // answers dropped), and the place is given up.
            drop(group);
            self.grouper.state().running -= 1;
            return;
        };
        let out = Out(self.clone());
        runtime.spawn(async move {
            out.0.send_group(group).await;
            drop(out);
        });
    }

    /// Sends the calls of a group in one statement and answers each.
    async fn send_group(&self, group: Vec<Waiter>) {
        let (items, answers): (Vec<_>, Vec<_>) =
            group.into_iter().map(|w| (w.item, w.answer)).unzip();
        if items.len() == 1 {
            if let (Some(item), Some(answer)) =
                (items.into_iter().next(), answers.into_iter().next())
            {
                drop(answer.send(self.alone(item).await));
            }
            return;
        }
        let deadline = self.net.deadline;
        let sent = tokio::time::timeout(deadline, async {
            // No connection within the pool's timeout: every caller is
            // told, as each would have been on its own.
            let mut conn = db::Lent::of(self.db())
                .await
                .map_err(|e| GroupFailure::Unknown(db_err(e)))?;
            let out = enqueue::send_plain(&mut conn, &items).await;
            conn.keep_if(!matches!(out, Err(GroupFailure::Unknown(_))));
            out
        })
        .await
        .unwrap_or_else(|_| Err(GroupFailure::Unknown(db_err(db::timed_out(deadline)))));
        match sent {
            Ok(results) => {
                self.grouper
                    .grouped
                    .fetch_add(items.len() as u64, Ordering::Relaxed);
                for (answer, result) in answers.into_iter().zip(results) {
                    drop(answer.send(result));
                }
            }
            // The server refused the statement (one request's value, say):
            // nothing was written, so each request is sent on its own and
            // gets the answer it would have had.
            Err(GroupFailure::Refused(_)) => {
                for (item, answer) in items.into_iter().zip(answers) {
                    if !answer.is_closed() {
                        drop(answer.send(self.alone(item).await));
                    }
                }
            }
            // It may have committed: each caller gets the error, as a
            // call of its own would.
            Err(GroupFailure::Unknown(e)) => {
                for answer in answers {
                    drop(answer.send(Err(error_copy(&e))));
                }
            }
        }
    }
}

/// The same error for another caller: a statement's errors are
/// `Unavailable` (retryable) or `Backend`.
fn error_copy(e: &Error) -> Error {
    match e {
        Error::Unavailable { message } => Error::Unavailable {
            message: message.clone(),
        },
        Error::Backend { message } => Error::Backend {
            message: message.clone(),
        },
        other => Error::Backend {
            message: other.to_string(),
        },
    }
}
