//! Completions waiting to be recorded. A supervisor whose handler succeeded
//! hands its completion here and frees its slot at once; the claim loop
//! records whatever has gathered together with its next claim, in one
//! round trip and one commit (`Queue::complete_and_claim`), so under load
//! one commit serves a batch of completions and a batch of claims. Until it
//! is recorded the attempt keeps its lease: a completion that cannot be
//! recorded before the lease could have expired is dropped (the job runs
//! again, as after any crash between the effect and its record).

use std::sync::Mutex;
use std::time::Duration;

use serde_json::Value;
use tokio::time::Instant;

use crate::queue::Completion;

/// Most completions recorded in one call: the most a call takes.
const MAX_BATCH: usize = crate::queue::MAX_BATCH_ITEMS;

/// One completion and the moment its lease could have run out.
pub(super) struct Entry {
    pub(super) completion: Completion,
    pub(super) give_up: Instant,
}

/// The completions of one worker not yet recorded.
#[derive(Default)]
pub(super) struct Pending {
    entries: Mutex<Vec<Entry>>,
}

impl Pending {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands over the successful end of an attempt claimed with `lease`.
    pub(super) fn push(
        &self,
        job_id: &str,
        lease_token: &crate::LeaseToken,
        result: Option<Value>,
        lease: Duration,
    ) {
        self.lock().push(Entry {
            completion: Completion {
                job_id: job_id.to_owned(),
                lease_token: lease_token.clone(),
                result,
            },
            give_up: Instant::now() + lease,
        });
    }

    pub(super) fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// The oldest completions, at most [`MAX_BATCH`].
    pub(super) fn take(&self) -> Vec<Entry> {
        let mut entries = self.lock();
        let n = entries.len().min(MAX_BATCH);
        entries.drain(..n).collect()
    }

    /// Puts back completions a call could not record, oldest first; returns
    /// how many were dropped because their lease could have run out.
    pub(super) fn put_back(&self, entries: Vec<Entry>) -> u64 {
        let now = Instant::now();
        let (keep, dropped): (Vec<Entry>, Vec<Entry>) =
            entries.into_iter().partition(|e| e.give_up > now);
        let mut all = self.lock();
        let newer = std::mem::replace(&mut *all, keep);
        all.extend(newer);
        dropped.len() as u64
    }
}
