//! Single enqueues of concurrent callers sent together (docs/storage.md,
//! "Concurrent enqueues share a statement").
//!
//! A store runs at most a few statements of one kind of single call at
//! once: `enqueue_statements` of keyless enqueues, and `read_statements` of
//! the reads that answer a replay of an idempotency key. A call that finds
//! them all out waits; when one comes back, the calls waiting by then go
//! to the database together, each with its own answer: the one it would
//! have had on its own. A commit's flush is most of a single enqueue's
//! time, so concurrent producers share one instead of queueing for their
//! own; a replay commits nothing, and concurrent replays share one round
//! trip and one plan.

use std::borrow::Borrow;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use tokio::sync::oneshot;

use super::enqueue::{self, Bound, GroupFailure};
use super::{PgStore, db, db_err};
use crate::error::{Error, Result};
use crate::job::EnqueueResult;
use crate::request::{PreparedEnqueue, PreparedKey};
use crate::store::JobEnqueue;
use crate::{MAX_BATCH_BYTES, MAX_BATCH_ITEMS};
use sqlx::Row;

/// The calls of one kind of one store: how many statements are out, and
/// the calls waiting for one to come back. `I` is a call's request, `A` its
/// answer.
#[derive(Debug)]
pub(crate) struct Lane<I, A> {
    state: Mutex<State<I, A>>,
    /// Most statements out at once.
    limit: usize,
    /// Calls answered by a statement sent for more than one call.
    grouped: AtomicU64,
}

#[derive(Debug)]
struct State<I, A> {
    running: usize,
    waiting: VecDeque<Waiter<I, A>>,
}

#[derive(Debug)]
pub(crate) struct Waiter<I, A> {
    item: I,
    answer: oneshot::Sender<A>,
}

/// A call's turn: a statement of its own now, or an answer to wait for.
enum Turn<I, A> {
    Now(Box<I>),
    Wait(oneshot::Receiver<A>),
}

/// The single keyless enqueues of a store.
pub(crate) type Grouper = Lane<PreparedEnqueue, Result<EnqueueResult>>;

/// A replay's read of its key's binding: the key and the request's compact
/// fingerprint.
#[derive(Debug)]
pub(crate) struct Read {
    scope: String,
    hash: Vec<u8>,
    fingerprint: Vec<u8>,
}

/// The reads of the replays of a store.
pub(crate) type Reads = Lane<Read, Result<Bound>>;

impl<I, A> Lane<I, A> {
    pub(crate) fn new(limit: usize) -> Self {
        Self {
            state: Mutex::new(State {
                running: 0,
                waiting: VecDeque::new(),
            }),
            limit: limit.max(1),
            grouped: AtomicU64::new(0),
        }
    }

    fn state(&self) -> MutexGuard<'_, State<I, A>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn grouped(&self) -> u64 {
        self.grouped.load(Ordering::Relaxed)
    }

    /// A statement of its own for `item` if one may go out, else a place
    /// among the calls waiting.
    fn enter(&self, item: I) -> Turn<I, A> {
        let mut state = self.state();
        if state.running < self.limit {
            state.running += 1;
            Turn::Now(Box::new(item))
        } else {
            let (answer, waiting) = oneshot::channel();
            state.waiting.push_back(Waiter { item, answer });
            Turn::Wait(waiting)
        }
    }

    /// The calls waiting, in arrival order, while `fits` admits the next
    /// one (given how many the group has; the first always goes), with the
    /// runtime to send them on. A call whose caller has gone (its deadline
    /// passed) is left out and writes nothing. None, and the statement's
    /// place given up, when no call waits or no runtime is left to send
    /// them (their callers are then told: their answers are dropped).
    fn take(
        &self,
        mut fits: impl FnMut(usize, &I) -> bool,
    ) -> Option<(Vec<Waiter<I, A>>, tokio::runtime::Handle)> {
        let mut state = self.state();
        let mut group = Vec::new();
        while let Some(next) = state.waiting.front() {
            if next.answer.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            if !fits(group.len(), &next.item) && !group.is_empty() {
                break;
            }
            group.extend(state.waiting.pop_front());
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if !group.is_empty() => Some((group, runtime)),
            _ => {
                state.running -= 1;
                None
            }
        }
    }

    fn count(&self, calls: usize) {
        self.grouped.fetch_add(calls as u64, Ordering::Relaxed);
    }
}

/// The kinds of single calls a store groups.
#[derive(Clone, Copy)]
enum Kind {
    Enqueue,
    Read,
}

/// A statement's place, held by the call or the task that sends it;
/// dropped (even with a task that never ran), it hands the place to the
/// calls waiting, or gives it up.
struct Out<S: Borrow<PgStore>>(S, Kind);

impl<S: Borrow<PgStore>> Drop for Out<S> {
    fn drop(&mut self) {
        let store = self.0.borrow();
        match self.1 {
            Kind::Enqueue => store.hand_on_enqueues(),
            Kind::Read => store.hand_on_reads(),
        }
    }
}

/// A waiting call's answer when its statement was abandoned.
fn abandoned(what: &str) -> Error {
    Error::Unavailable {
        message: format!(
            "postgres: the statement of this {what} was abandoned \
             (the runtime is shutting down)"
        ),
    }
}

/// Reads the live bindings of several replays' keys, each compared with
/// its request's compact fingerprint; one row per key found, numbered by
/// its place (1-based). The read of `enqueue::bound`, for many keys.
///
/// Each array is read through a subquery, which hides its length from the
/// planner: given the arrays themselves, it estimates a plan per length,
/// always cheaper than the session's generic plan (which assumes ten
/// keys) for the few keys of a group, and so plans the statement afresh at
/// every execution, which costs more than the read.
const READ_BOUND: &str = "
SELECT k.n::int4 AS n, i.job_id, i.fp = k.fp AS same
FROM unnest((SELECT $1::text[]), (SELECT $2::bytea[]), (SELECT $3::bytea[]))
     WITH ORDINALITY AS k(scope, key_hash, fp, n)
JOIN idemq.idempotency i ON i.scope = k.scope AND i.key_hash = k.key_hash
WHERE i.expires_at > idemq.now()";

impl PgStore {
    /// One keyless request of one caller, outside a transaction: in a
    /// statement of its own when one may go out, else with the calls
    /// waiting beside it.
    pub(super) async fn enqueue_single(&self, item: PreparedEnqueue) -> Result<EnqueueResult> {
        match self.grouper.enter(item) {
            Turn::Now(item) => {
                let _out = Out(self, Kind::Enqueue);
                self.alone(*item).await
            }
            Turn::Wait(waiting) => waiting.await.unwrap_or_else(|_| Err(abandoned("enqueue"))),
        }
    }

    /// The live binding of a replay's key, read on its own when a read may
    /// go out, else with the reads waiting beside it.
    pub(super) async fn read_bound(
        &self,
        key: &PreparedKey,
        fingerprint: Vec<u8>,
    ) -> Result<Bound> {
        let read = Read {
            scope: key.scope.clone(),
            hash: key.hash.to_vec(),
            fingerprint,
        };
        match self.reads.enter(read) {
            Turn::Now(read) => {
                let _out = Out(self, Kind::Read);
                let mut conn = db::Lent::of(self.db()).await.map_err(db_err)?;
                let out =
                    enqueue::bound(&mut conn, &read.scope, &read.hash, &read.fingerprint).await;
                conn.keep_if(out.is_ok());
                out
            }
            Turn::Wait(waiting) => waiting
                .await
                .unwrap_or_else(|_| Err(abandoned("enqueue's read"))),
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

    /// A statement of keyless enqueues came back: the calls waiting go out
    /// together (up to a batch's bounds) in a task that keeps its place,
    /// or the place is given up.
    fn hand_on_enqueues(&self) {
        let mut bytes = 0;
        let Some((group, runtime)) = self.grouper.take(|n, item| {
            bytes += item.payload.len();
            n < MAX_BATCH_ITEMS && bytes <= MAX_BATCH_BYTES
        }) else {
            return;
        };
        let out = Out(self.clone(), Kind::Enqueue);
        runtime.spawn(async move {
            out.0.send_group(group).await;
            drop(out);
        });
    }

    /// A read came back: the reads waiting go out together (up to a
    /// batch's count) in a task that keeps its place, or the place is
    /// given up.
    fn hand_on_reads(&self) {
        let Some((group, runtime)) = self.reads.take(|n, _| n < MAX_BATCH_ITEMS) else {
            return;
        };
        let out = Out(self.clone(), Kind::Read);
        runtime.spawn(async move {
            out.0.send_reads(group).await;
            drop(out);
        });
    }

    /// Sends the calls of a group in one statement and answers each.
    async fn send_group(&self, group: Vec<Waiter<PreparedEnqueue, Result<EnqueueResult>>>) {
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
                self.grouper.count(items.len());
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

    /// Reads the bindings of a group of replays in one statement (which
    /// writes nothing) and answers each: its key's binding as a read of its
    /// own would have found it. Any failure is every caller's, as a read of
    /// its own would have failed.
    async fn send_reads(&self, group: Vec<Waiter<Read, Result<Bound>>>) {
        let deadline = self.net.deadline;
        let read = tokio::time::timeout(deadline, async {
            let mut conn = db::Lent::of(self.db()).await.map_err(db_err)?;
            let scopes: Vec<&str> = group.iter().map(|w| w.item.scope.as_str()).collect();
            let hashes: Vec<&[u8]> = group.iter().map(|w| &w.item.hash[..]).collect();
            let fps: Vec<&[u8]> = group.iter().map(|w| &w.item.fingerprint[..]).collect();
            let rows = sqlx::query(READ_BOUND)
                .bind(scopes)
                .bind(hashes)
                .bind(fps)
                .persistent(db::prepared())
                .fetch_all(&mut *conn)
                .await;
            conn.keep(&rows);
            rows.map_err(db_err)
        })
        .await
        .unwrap_or_else(|_| Err(db_err(db::timed_out(deadline))));
        let mut found: Vec<Option<Result<Bound>>> = (0..group.len()).map(|_| None).collect();
        let answers = match read.and_then(|rows| {
            for row in &rows {
                let n: i32 = row.try_get("n").map_err(db_err)?;
                let slot = usize::try_from(n)
                    .ok()
                    .and_then(|n| found.get_mut(n.wrapping_sub(1)))
                    .ok_or_else(|| Error::Backend {
                        message: format!("a read of bindings answered place {n}"),
                    })?;
                *slot = Some(enqueue::bound_of(row));
            }
            Ok(())
        }) {
            Ok(()) => found
                .into_iter()
                .map(|f| f.unwrap_or(Ok(Bound::Free)))
                .collect::<Vec<_>>(),
            Err(e) => group.iter().map(|_| Err(error_copy(&e))).collect(),
        };
        if group.len() > 1 {
            self.reads.count(group.len());
        }
        for (waiter, answer) in group.into_iter().zip(answers) {
            drop(waiter.answer.send(answer));
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
