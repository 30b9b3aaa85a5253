//! `Queue`: the producer and operator API, and the store-level execution
//! primitives a worker uses.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Value, json};

use crate::clock::{Clock, SystemClock};
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, KeyHasher, canonical_json};
use crate::job::{
    CancelOutcome, ClaimedJob, EnqueueResult, Event, FailOutcome, Heartbeat, Job, JobState,
    LeaseToken, QueueInfo, Run,
};
use crate::request::{
    EnqueueRequest, PreparedEnqueue, bounds, defaults, encode_json, micros, prepare_key,
};
use crate::stats::{Counter, Counters, Stats};
use crate::store::*;
use crate::worker::IntoEnqueueRequest;

/// Most items in one `enqueue_many`.
pub const MAX_BATCH_ITEMS: usize = 1000;
/// Largest total payload of one `enqueue_many` (16 MiB).
pub const MAX_BATCH_BYTES: usize = 16 * 1024 * 1024;
/// Retention of redrive keys (24 h).
const REDRIVE_KEY_TTL_MS: i64 = 24 * 3600 * 1000;

/// Settings of a [`Queue`] that are not part of the database URL.
#[derive(Clone)]
pub struct QueueOptions {
    /// Installation secret for HMAC-SHA-256 key hashing. The default reads
    /// `IDEMQ_KEY_SECRET` from the environment (unset or empty: no secret);
    /// set it to pass a secret explicitly, or `None` for none. Every process
    /// of one installation must hash keys alike: [`Queue::connect_with`]
    /// refuses a process whose hashing differs from the one the store
    /// recorded ([`Error::KeySecretMismatch`]).
    pub key_secret: Option<Vec<u8>>,
    /// Largest accepted payload, result or checkpoint value in bytes (1 MiB).
    pub payload_limit: usize,
    /// The clock of record of the embedded backend (the system clock by default).
    pub clock: Arc<dyn Clock>,
}

/// The secret `IDEMQ_KEY_SECRET` holds (unset or empty: none).
pub fn key_secret_from_env() -> Option<Vec<u8>> {
    std::env::var_os("IDEMQ_KEY_SECRET")
        .filter(|s| !s.is_empty())
        .map(|s| s.into_encoded_bytes())
}

impl Default for QueueOptions {
    /// The default payload limit, the system clock, and the secret of
    /// `IDEMQ_KEY_SECRET`.
    fn default() -> Self {
        Self {
            key_secret: key_secret_from_env(),
            payload_limit: defaults::PAYLOAD_LIMIT,
            clock: Arc::new(SystemClock),
        }
    }
}

impl std::fmt::Debug for QueueOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueueOptions")
            .field("keyed", &self.key_secret.is_some())
            .field("payload_limit", &self.payload_limit)
            .finish()
    }
}

/// Options of [`Queue::enqueue_many`].
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchOptions {
    /// All-or-nothing: any failing item fails the call and nothing is written.
    pub atomic: bool,
}

/// Options of [`Queue::redrive`].
#[derive(Clone, Debug, Default)]
pub struct RedriveOptions {
    /// Makes the redrive itself idempotent (scope `idemq.redrive`, 24 h).
    pub idempotency_key: Option<String>,
    /// A new attempt budget (1–1000); the job keeps its own otherwise.
    pub max_attempts: Option<i64>,
    /// A new deadline; a passed one is cleared otherwise.
    pub deadline: Option<DateTime<Utc>>,
    /// When to run; now when omitted.
    pub run_at: Option<DateTime<Utc>>,
    /// Drop the stored checkpoints.
    pub reset_checkpoints: bool,
}

/// Options of [`Queue::claim`].
#[derive(Clone, Debug)]
pub struct ClaimOptions {
    /// Queues to claim from; empty for every queue.
    pub queues: Vec<String>,
    /// Job types to claim; `None` for any.
    pub types: Option<Vec<String>>,
    /// The worker's name (1–128 bytes).
    pub worker: String,
    /// At most this many jobs (1–1000).
    pub limit: u32,
    /// The lease (100 ms – 1 h).
    pub lease: Duration,
}

impl ClaimOptions {
    /// Checks every bound ([`bounds::MAX_CLAIM_LIMIT`], the lease range, the
    /// worker name) without touching the store.
    pub fn validate(&self) -> Result<()> {
        if !(1..=bounds::MAX_CLAIM_LIMIT).contains(&self.limit) {
            return Err(Error::validation(
                "limit",
                format!("must be 1–{}", bounds::MAX_CLAIM_LIMIT),
            ));
        }
        if !(bounds::MIN_LEASE_MS..=bounds::MAX_LEASE_MS).contains(&ms(self.lease)) {
            return Err(Error::validation(
                "lease_ms",
                format!(
                    "must be from {} to {} ms",
                    bounds::MIN_LEASE_MS,
                    bounds::MAX_LEASE_MS
                ),
            ));
        }
        crate::request::check_worker_name("worker", &self.worker)?;
        let names = self.queues.iter().chain(self.types.iter().flatten());
        if names.into_iter().any(|n| nul(n)) {
            return Err(Error::validation(
                "queues",
                "queue and type names must not contain U+0000",
            ));
        }
        Ok(())
    }
}

impl Default for ClaimOptions {
    fn default() -> Self {
        Self {
            queues: Vec::new(),
            types: None,
            worker: "worker".into(),
            limit: 1,
            lease: Duration::from_secs(30),
        }
    }
}

/// How a failed attempt ends ([`Queue::fail`]).
#[derive(Clone, Debug, Default)]
pub struct FailOptions {
    /// The error text (kept truncated to 8 KiB).
    pub error: String,
    /// A permanent failure sends the job to the dead letters at once.
    pub permanent: bool,
    /// Overrides the backoff for this retry.
    pub retry_after: Option<Duration>,
    /// Reschedules after this delay without consuming the attempt.
    pub snooze: Option<Duration>,
}

/// One successful attempt to record ([`Queue::complete_many`]).
#[derive(Clone, Debug)]
pub struct Completion {
    /// The job.
    pub job_id: String,
    /// The lease of the attempt.
    pub lease_token: LeaseToken,
    /// An optional JSON result (≤ the payload limit).
    pub result: Option<Value>,
}

/// A job queue on one backend. Cheap to clone; share it freely.
#[derive(Clone)]
pub struct Queue {
    store: Arc<dyn Store>,
    hasher: KeyHasher,
    payload_limit: usize,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("store", &self.store).finish()
    }
}

/// True for text no record can hold: U+0000 is refused wherever text is
/// stored, so an id or a name holding it matches nothing, on every backend.
fn nul(s: &str) -> bool {
    s.contains('\0')
}

/// How a check value hashes keys, in words for an error message.
fn describe_hashing(check: &str) -> String {
    match check.strip_prefix("hmac-sha256:") {
        Some(tag) => format!("with a secret (HMAC-SHA-256, check {tag})"),
        None if check == "sha256" => "without a secret (plain SHA-256)".to_owned(),
        None => format!("in a way this version does not know ({check})"),
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The first pause of [`Queue::wait`], and the longest.
const FIRST_LOOK: Duration = Duration::from_millis(50);
const LAST_LOOK: Duration = Duration::from_secs(1);

/// The pause of [`Queue::wait`] after `pause`: twice it, up to [`LAST_LOOK`].
fn next_look(pause: Duration) -> Duration {
    (pause * 2).min(LAST_LOOK)
}

impl Queue {
    /// Connects to the backend the URL names: `sqlite://path/to/file.db`
    /// (created if missing), `sqlite::memory:`, `postgres://…` (whose
    /// schema `idemq migrate` installs) or, with the cargo feature `redis`,
    /// `redis://…` / `redis+unix://…` (whose functions `idemq migrate`
    /// loads).
    pub async fn connect(url: &str) -> Result<Self> {
        Self::connect_with(url, QueueOptions::default()).await
    }

    /// Installs or upgrades the schema of the database the URL names and
    /// returns the migration versions applied. Safe to run from several
    /// processes at once. (SQLite databases are also migrated when opened.)
    /// Records no key check: the first process that connects does.
    pub async fn migrate(url: &str) -> Result<Vec<i64>> {
        Location::parse(url)?.migrate().await
    }

    /// How the schema of the database the URL names stands against this
    /// binary's: what `idemq migrate` would apply. Changes nothing.
    pub async fn migration_status(url: &str) -> Result<crate::store::MigrationStatus> {
        Location::parse(url)?.migration_status().await
    }

    /// [`connect`](Self::connect) with options. Refuses, with
    /// [`Error::KeySecretMismatch`], a process whose key hashing differs
    /// from the one the store recorded when the installation's first
    /// process connected.
    pub async fn connect_with(url: &str, options: QueueOptions) -> Result<Self> {
        let store = Self::open_store(url, &options).await?;
        Self::open(store, options).await
    }

    /// Opens the store a URL names (no key check).
    async fn open_store(url: &str, options: &QueueOptions) -> Result<Arc<dyn Store>> {
        Location::parse(url)?.open(options.clock.clone()).await
    }

    /// A queue over an already opened store, after the key check of
    /// [`connect_with`](Self::connect_with).
    pub async fn open(store: Arc<dyn Store>, options: QueueOptions) -> Result<Self> {
        let queue = Self::from_store(store, options);
        queue.check_key_hashing().await?;
        Ok(queue)
    }

    /// Records this queue's key hashing as the installation's when none is
    /// recorded, and refuses it when another one is.
    async fn check_key_hashing(&self) -> Result<()> {
        let mine = self.hasher.check_value();
        let stored = self
            .store
            .installation_key_check(KeyCheck {
                value: mine.clone(),
            })
            .await?;
        if stored == mine {
            return Ok(());
        }
        Err(Error::KeySecretMismatch {
            process: describe_hashing(&mine),
            stored: describe_hashing(&stored),
        })
    }

    /// Makes the hashing of `options` (its secret, by default
    /// `IDEMQ_KEY_SECRET`) the installation's, so processes using it may
    /// connect and others are refused. A deliberate operator action with a
    /// cost: every live idempotency binding made with the old hashing stops
    /// matching, so a repeat of one of those keys before it expires is
    /// accepted as new work. Returns the previous check and that count.
    pub async fn replace_key_secret(url: &str, options: QueueOptions) -> Result<KeyCheckChange> {
        let store = Self::open_store(url, &options).await?;
        let queue = Self::from_store(store, options);
        queue
            .store
            .installation_key_check_replace(KeyCheck {
                value: queue.hasher.check_value(),
            })
            .await
    }

    /// A queue over an already opened store, without the key check of
    /// [`open`](Self::open) (internal plumbing and tests; prefer `open`).
    pub fn from_store(store: Arc<dyn Store>, options: QueueOptions) -> Self {
        let hasher = match options.key_secret {
            Some(s) => KeyHasher::with_secret(s),
            None => KeyHasher::plain(),
        };
        Self {
            store,
            hasher,
            payload_limit: options.payload_limit,
            counters: Arc::default(),
        }
    }

    /// Counts completions recorded outside the queue's own calls (in a
    /// caller's transaction that is known to have committed).
    pub(crate) fn count_completions(&self, n: u64) {
        self.counters.add(Counter::Completions, n);
    }

    /// What this queue and its clones did in this process: claims,
    /// completions, retries, dead letters, reaped leases, purges and
    /// retention deletes, whichever surface (API, worker, maintenance) acted.
    pub fn stats(&self) -> Stats {
        self.counters.read()
    }

    /// The store underneath (internal plumbing; see [`crate::store`]).
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// `sqlite`, `postgres`, …
    pub fn backend(&self) -> &'static str {
        self.store.backend()
    }

    /// Whether the store runs with the settings under which nothing
    /// acknowledged is lost ([`Durability::Full`](crate::Durability)), or
    /// was opened with them unchecked (Redis `?durability=relaxed`).
    pub fn durability(&self) -> crate::Durability {
        self.store.durability()
    }

    /// Whether the backend has a capability beyond the operations every
    /// backend has (docs/storage.md lists which backend has which).
    pub fn supports(&self, capability: crate::store::Capability) -> bool {
        self.store.supports(capability)
    }

    pub(crate) fn prepare(&self, req: &EnqueueRequest) -> Result<PreparedEnqueue> {
        req.prepare(&self.hasher, self.payload_limit)
    }

    /// Enqueues and returns the job id (new, original or keyed). Takes an
    /// [`EnqueueRequest`] or a typed [`Job`](crate::worker::Job), whose
    /// definition sets its queue, options and keys; to override some of
    /// them for one enqueue, pass
    /// `EnqueueRequest::from_job(&job)?` with the setters chained.
    pub async fn enqueue(&self, req: impl IntoEnqueueRequest) -> Result<String> {
        Ok(self.enqueue_with_result(req).await?.job_id)
    }

    /// Enqueues (a request or a typed job) and says what happened.
    pub async fn enqueue_with_result(&self, req: impl IntoEnqueueRequest) -> Result<EnqueueResult> {
        let started = std::time::Instant::now();
        let answer = async {
            let item = self.prepare(&req.into_request()?)?;
            self.enqueue_one(item).await
        }
        .await;
        self.counters.enqueue(&answer, started.elapsed());
        answer
    }

    /// Enqueues one prepared request.
    async fn enqueue_one(&self, item: PreparedEnqueue) -> Result<EnqueueResult> {
        let mut results = self
            .store
            .job_enqueue(JobEnqueue {
                items: vec![item],
                atomic: false,
                dry_run: false,
            })
            .await?;
        results.pop().unwrap_or_else(|| {
            Err(Error::Backend {
                message: "no result".into(),
            })
        })
    }

    /// Enqueues up to 1,000 requests (16 MiB) in one transaction, decided in
    /// order; one result per request. Without `atomic`, a failing item is
    /// reported for that item and the others stand.
    pub async fn enqueue_many(
        &self,
        reqs: Vec<EnqueueRequest>,
        options: BatchOptions,
    ) -> Result<Vec<Result<EnqueueResult>>> {
        let started = std::time::Instant::now();
        let answer = self.enqueue_batch(reqs, options).await;
        let took = started.elapsed();
        match &answer {
            Ok(each) => {
                for item in each {
                    self.counters.enqueue(item, took);
                }
            }
            // An all-or-nothing batch refused for one item: that item.
            Err(e @ Error::BatchItem { .. }) => self.counters.enqueue_refused(e),
            // The call was refused or failed as a whole: no request was
            // answered on its own.
            Err(_) => {}
        }
        answer
    }

    async fn enqueue_batch(
        &self,
        reqs: Vec<EnqueueRequest>,
        options: BatchOptions,
    ) -> Result<Vec<Result<EnqueueResult>>> {
        if reqs.len() > MAX_BATCH_ITEMS {
            return Err(Error::validation("jobs", "at most 1000 items per batch"));
        }
        let mut slots: Vec<Option<Error>> = Vec::with_capacity(reqs.len());
        let mut items = Vec::with_capacity(reqs.len());
        let mut bytes = 0usize;
        for (index, req) in reqs.iter().enumerate() {
            match self.prepare(req) {
                Ok(p) => {
                    bytes += p.payload.len();
                    items.push(p);
                    slots.push(None);
                }
                Err(error) if options.atomic => {
                    // The failing item is the first in request order: an
                    // earlier item may fail in the store (a conflict, a
                    // passed deadline), so decide those without writing.
                    if !items.is_empty() {
                        self.store
                            .job_enqueue(JobEnqueue {
                                items,
                                atomic: true,
                                dry_run: true,
                            })
                            .await?;
                    }
                    return Err(Error::BatchItem {
                        index,
                        error: Box::new(error),
                    });
                }
                Err(e) => slots.push(Some(e)),
            }
        }
        if bytes > MAX_BATCH_BYTES {
            return Err(Error::PayloadTooLarge {
                field: "jobs".into(),
                limit: MAX_BATCH_BYTES,
            });
        }
        let stored = self
            .store
            .job_enqueue(JobEnqueue {
                items,
                atomic: options.atomic,
                dry_run: false,
            })
            .await;
        let mut stored = match stored {
            Err(Error::BatchItem { index, error }) => {
                // Map the index among stored items back to the request's.
                let real = slots
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.is_none())
                    .nth(index);
                return Err(Error::BatchItem {
                    index: real.map_or(index, |(i, _)| i),
                    error,
                });
            }
            other => other?.into_iter(),
        };
        Ok(slots
            .into_iter()
            .map(|slot| match slot {
                Some(e) => Err(e),
                None => stored.next().unwrap_or_else(|| {
                    Err(Error::Backend {
                        message: "missing result".into(),
                    })
                }),
            })
            .collect())
    }

    /// A dry run: what an enqueue would do now and why. Writes nothing, ever.
    pub async fn explain(&self, req: impl IntoEnqueueRequest) -> Result<Explain> {
        let item = self.prepare(&req.into_request()?)?;
        self.store.job_explain(JobExplain { item }).await
    }

    /// One job, or `None`.
    pub async fn get(&self, job_id: &str) -> Result<Option<Job>> {
        if nul(job_id) {
            return Ok(None);
        }
        self.store
            .job_get(JobRef {
                job_id: job_id.into(),
            })
            .await
    }

    /// Waits up to `timeout` for a job to turn terminal and returns it as it
    /// is then (`NotFound` for an unknown id). It reads the job again after
    /// 50 ms, then after twice the last pause, up to a second: a job that
    /// ends soon is seen soon, and one that runs long costs a read a second.
    pub async fn wait(&self, job_id: &str, timeout: Duration) -> Result<Job> {
        let until = tokio::time::Instant::now() + timeout;
        let mut pause = FIRST_LOOK;
        loop {
            let job = self
                .get(job_id)
                .await?
                .ok_or_else(|| Error::job_not_found(job_id))?;
            let now = tokio::time::Instant::now();
            if job.state.is_terminal() || now >= until {
                return Ok(job);
            }
            tokio::time::sleep(pause.min(until - now)).await;
            pause = next_look(pause);
        }
    }

    /// A page of jobs, newest first.
    pub async fn list(&self, filter: JobList) -> Result<JobPage> {
        self.list_pages(filter, None).await
    }

    /// A page of jobs, newest first, whose JSON (as [`JobPage`] serializes,
    /// compact) is at most `max_bytes` long, unless its first job alone is
    /// longer: it always holds one job when one matches. The page ends
    /// before the first job that would take it past the bound, and its
    /// `next_cursor` starts the next page with that job, so paging still
    /// visits every job once. Jobs past the bound are not decoded.
    pub async fn list_within(&self, filter: JobList, max_bytes: usize) -> Result<JobPage> {
        self.list_pages(filter, Some(max_bytes)).await
    }

    async fn list_pages(&self, filter: JobList, max_bytes: Option<usize>) -> Result<JobPage> {
        if !(1..=bounds::MAX_PAGE_LIMIT).contains(&filter.limit) {
            return Err(Error::validation(
                "limit",
                format!("must be 1–{}", bounds::MAX_PAGE_LIMIT),
            ));
        }
        // A cursor is what a previous page returned; anything else is refused
        // rather than silently restarting from the first page.
        let before_seq = match filter.cursor.as_deref() {
            None => None,
            Some(c) => Some(
                c.parse::<i64>()
                    .ok()
                    .filter(|seq| crate::store::is_cursor(c) && *seq >= 0)
                    .ok_or_else(|| {
                        Error::validation("cursor", "is not a cursor returned by a previous page")
                    })?,
            ),
        };
        for (field, v) in [
            ("queue", &filter.queue),
            ("type", &filter.job_type),
            ("tag", &filter.tag),
        ] {
            if v.as_deref().is_some_and(nul) {
                return Err(Error::validation(field, "must not contain U+0000"));
            }
        }
        let mut listing = JobListing::new(filter, before_seq);
        listing.max_bytes = max_bytes;
        self.store.job_list(listing).await
    }

    /// A job's events, oldest first.
    pub async fn events(&self, job_id: &str) -> Result<Vec<Event>> {
        if nul(job_id) {
            return Ok(Vec::new());
        }
        self.store
            .job_events(JobRef {
                job_id: job_id.into(),
            })
            .await
    }

    /// A job's run ledger.
    pub async fn runs(&self, job_id: &str) -> Result<Vec<Run>> {
        if nul(job_id) {
            return Ok(Vec::new());
        }
        self.store
            .job_runs(JobRef {
                job_id: job_id.into(),
            })
            .await
    }

    /// A job's checkpoints.
    pub async fn checkpoints(&self, job_id: &str) -> Result<BTreeMap<String, Value>> {
        if nul(job_id) {
            return Ok(BTreeMap::new());
        }
        self.store
            .checkpoint_list(JobRef {
                job_id: job_id.into(),
            })
            .await
    }

    /// Cancels a job: waiting jobs at once, active ones at their next heartbeat.
    pub async fn cancel(&self, job_id: &str) -> Result<CancelOutcome> {
        if nul(job_id) {
            return Err(Error::job_not_found(job_id));
        }
        self.store
            .job_cancel(JobRef {
                job_id: job_id.into(),
            })
            .await
    }

    /// Cancels every pending job of `job_type` with dedupe key `key` and
    /// releases the binding; `false` when there was none.
    pub async fn cancel_by_key(&self, job_type: &str, key: &str) -> Result<bool> {
        if nul(job_type) || nul(key) {
            return Ok(false);
        }
        self.store
            .job_cancel_by_key(JobCancelByKey {
                job_type: job_type.into(),
                key: key.into(),
            })
            .await
    }

    /// Deletes a job that is not active; `false` for an unknown or active job.
    pub async fn purge(&self, job_id: &str) -> Result<bool> {
        if nul(job_id) {
            return Ok(false);
        }
        let purged = self
            .store
            .job_purge(JobRef {
                job_id: job_id.into(),
            })
            .await?;
        if purged {
            self.counters.add(Counter::Purges, 1);
        }
        Ok(purged)
    }

    /// Makes a scheduled job due now; `false` when it is not scheduled.
    pub async fn promote(&self, job_id: &str) -> Result<bool> {
        if nul(job_id) {
            return Err(Error::job_not_found(job_id));
        }
        self.store
            .job_promote(JobRef {
                job_id: job_id.into(),
            })
            .await
    }

    /// Pauses a queue: enqueue still accepts, claims skip it.
    pub async fn pause(&self, queue: &str) -> Result<bool> {
        self.set_paused(queue, true).await
    }

    /// Resumes a paused queue.
    pub async fn resume(&self, queue: &str) -> Result<bool> {
        self.set_paused(queue, false).await
    }

    async fn set_paused(&self, queue: &str, paused: bool) -> Result<bool> {
        crate::request::check_queue_name("queue", queue)?;
        self.store
            .queue_pause(QueuePause {
                queue: queue.into(),
                paused,
            })
            .await
    }

    /// Queues with counts by state.
    pub async fn queues(&self) -> Result<Vec<QueueInfo>> {
        self.store.queue_list().await
    }

    /// Puts a dead job back to ready (same id, `max_attempts` more attempts).
    pub async fn redrive(&self, job_id: &str, options: RedriveOptions) -> Result<EnqueueResult> {
        if nul(job_id) {
            return Err(Error::job_not_found(job_id));
        }
        if let Some(n) = options.max_attempts {
            crate::request::check_max_attempts("max_attempts", n)?;
        }
        let overrides = json!({
            "job_id": job_id,
            "max_attempts": options.max_attempts,
            "deadline": options.deadline.map(micros),
            "run_at": options.run_at.map(micros),
            "reset_checkpoints": options.reset_checkpoints,
        });
        let fingerprint = Fingerprint::from_fields(
            overrides
                .as_object()
                .into_iter()
                .flatten()
                .map(|(k, v)| (k.clone(), canonical_json(v)))
                .collect(),
        );
        let key = match &options.idempotency_key {
            Some(k) => Some(prepare_key(
                "idempotency",
                k,
                "idemq.redrive",
                REDRIVE_KEY_TTL_MS,
                &self.hasher,
            )?),
            None => None,
        };
        self.store
            .job_redrive(JobRedrive {
                job_id: job_id.into(),
                key,
                fingerprint,
                max_attempts: options.max_attempts.map(|n| n as i32),
                deadline: options.deadline.map(micros),
                run_at: options.run_at.map(micros),
                reset_checkpoints: options.reset_checkpoints,
            })
            .await
    }

    fn binding_ref(&self, scope: &str, key: &str) -> Result<BindingRef> {
        crate::request::check_scope("scope", scope)?;
        let k = prepare_key("idempotency", key, scope, 0, &self.hasher)?;
        Ok(BindingRef {
            scope: k.scope,
            hash: k.hash,
        })
    }

    /// Which job a live idempotency key is bound to.
    pub async fn lookup_key(&self, scope: &str, key: &str) -> Result<Option<BindingInfo>> {
        self.store
            .binding_lookup(self.binding_ref(scope, key)?)
            .await
    }

    /// Releases a live idempotency binding (an operator action).
    pub async fn release_key(&self, scope: &str, key: &str) -> Result<bool> {
        self.store
            .binding_release(self.binding_ref(scope, key)?)
            .await
    }

    /// The live dedupe binding of a key (`None` also for a type or key that
    /// no request could have bound, such as one holding U+0000).
    pub async fn dedupe_lookup(&self, job_type: &str, key: &str) -> Result<Option<ExplainDedupe>> {
        let bindable = crate::request::check_job_type("type", job_type).is_ok()
            && crate::request::check_dedupe_key("key", key).is_ok();
        if !bindable {
            return Ok(None);
        }
        self.store
            .dedupe_lookup(DedupeRef {
                job_type: job_type.into(),
                key: key.into(),
            })
            .await
    }

    /// Claims up to `limit` due jobs under a lease.
    pub async fn claim(&self, options: ClaimOptions) -> Result<Vec<ClaimedJob>> {
        options.validate()?;
        let started = std::time::Instant::now();
        let jobs = self.store.job_claim(Self::claim_params(options)).await;
        self.counters.claim(started.elapsed());
        let jobs = self.recorded(jobs?);
        self.counters.add(Counter::Claims, jobs.len() as u64);
        Ok(jobs)
    }

    /// Records `completed` (as [`complete_many`](Self::complete_many)), then
    /// claims as [`claim`](Self::claim) would (a `limit` of 0 claims
    /// nothing), in one round trip and one transaction where the backend
    /// allows: the call a worker makes when it has finished some jobs and
    /// has slots free. An `Err` recorded nothing; otherwise the per-item
    /// completion results, and the claim's own result (a claim can fail
    /// after the completions were recorded).
    pub async fn complete_and_claim(
        &self,
        completed: Vec<Completion>,
        options: ClaimOptions,
    ) -> Result<(Vec<Result<()>>, Result<Vec<ClaimedJob>>)> {
        if options.limit == 0 {
            // Every other bound still holds.
            ClaimOptions {
                limit: 1,
                ..options.clone()
            }
            .validate()?;
        } else {
            options.validate()?;
        }
        let (slots, sent) = self.completions(completed)?;
        let claims = options.limit > 0;
        let started = std::time::Instant::now();
        let answer = self
            .store
            .job_complete_and_claim(JobCompleteMany { items: sent }, Self::claim_params(options))
            .await;
        if claims {
            self.counters.claim(started.elapsed());
        }
        let (stored, claimed) = answer?;
        let results = self.completion_results(slots, stored);
        let claimed = claimed.map(|c| self.recorded(c));
        if let Ok(jobs) = &claimed {
            self.counters.add(Counter::Claims, jobs.len() as u64);
        }
        Ok((results, claimed))
    }

    /// Counts what a store's call recorded beside its answer.
    fn recorded<T>(&self, r: Recording<T>) -> T {
        self.count(r.recorded);
        r.answer
    }

    fn count(&self, recorded: Recorded) {
        let Recorded {
            lease_expiries,
            retries,
            dead,
        } = recorded;
        self.counters.add(Counter::LeaseExpiries, lease_expiries);
        self.counters.add(Counter::Retries, retries);
        self.counters.add(Counter::Dead, dead);
    }

    fn claim_params(options: ClaimOptions) -> JobClaim {
        JobClaim {
            lease_ms: ms(options.lease),
            queues: options.queues,
            types: options.types,
            worker: options.worker,
            limit: options.limit,
        }
    }

    /// A lease no claim could have minted is a lost one.
    pub(crate) fn lease_text(job_id: &str, token: &LeaseToken) -> Result<()> {
        if nul(job_id) || nul(token.as_str()) {
            return Err(Error::LeaseLost {
                job_id: job_id.replace('\0', "\u{fffd}"),
            });
        }
        Ok(())
    }

    pub(crate) fn lease(job_id: &str, token: &LeaseToken) -> LeaseRef {
        LeaseRef {
            job_id: job_id.into(),
            lease_token: token.as_str().into(),
        }
    }

    /// Renews a lease and reports whether the job was cancelled meanwhile.
    pub async fn heartbeat(&self, job_id: &str, lease_token: &LeaseToken) -> Result<Heartbeat> {
        Self::lease_text(job_id, lease_token)?;
        let beat = self
            .store
            .lease_heartbeat(Self::lease(job_id, lease_token))
            .await?;
        self.recorded(beat)
    }

    /// Renews many leases in one call (on PostgreSQL one round trip and one
    /// transaction; elsewhere one call each, side by side): one result per
    /// item, in order, each what [`heartbeat`](Self::heartbeat) would answer
    /// for it. A lost lease is that item's `LeaseLost`; the others stand. At
    /// most 1,000 items per call.
    pub async fn heartbeat_many<'a>(
        &self,
        leases: impl IntoIterator<Item = (&'a str, &'a LeaseToken)>,
    ) -> Result<Vec<Result<Heartbeat>>> {
        let leases: Vec<(&str, &LeaseToken)> = leases.into_iter().collect();
        at_most_a_batch(leases.len())?;
        // A lease no claim could have minted fails alone, unsent.
        let mut slots: Vec<Option<Error>> = Vec::with_capacity(leases.len());
        let mut sent = Vec::with_capacity(leases.len());
        for (job_id, token) in leases {
            match Self::lease_text(job_id, token) {
                Ok(()) => {
                    sent.push(Self::lease(job_id, token));
                    slots.push(None);
                }
                Err(e) => slots.push(Some(e)),
            }
        }
        let stored = if sent.is_empty() {
            Vec::new()
        } else {
            let beats = self
                .store
                .lease_heartbeat_many(LeaseHeartbeatMany { items: sent })
                .await?;
            self.recorded(beats)
        };
        Ok(answers(slots, stored, "heartbeats"))
    }

    /// Completes an attempt, with an optional JSON result (≤ the payload limit).
    pub async fn complete(
        &self,
        job_id: &str,
        lease_token: &LeaseToken,
        result: Option<Value>,
    ) -> Result<()> {
        Self::lease_text(job_id, lease_token)?;
        let result = result
            .map(|v| encode_json("result", &v, self.payload_limit))
            .transpose()?;
        self.store
            .job_complete(JobComplete {
                lease: Self::lease(job_id, lease_token),
                result,
            })
            .await?;
        self.counters.add(Counter::Completions, 1);
        Ok(())
    }

    /// Completes many attempts in one round trip and one transaction: one
    /// result per item, in order. An item whose lease is lost fails alone
    /// (`LeaseLost`, nothing written for it); an `Err` of the whole call
    /// recorded nothing. A result over the payload limit fails the call.
    pub async fn complete_many(&self, items: Vec<Completion>) -> Result<Vec<Result<()>>> {
        let (slots, sent) = self.completions(items)?;
        let stored = if sent.is_empty() {
            Vec::new()
        } else {
            self.store
                .job_complete_many(JobCompleteMany { items: sent })
                .await?
        };
        Ok(self.completion_results(slots, stored))
    }

    /// The completions to send, and per item the error of one that fails
    /// alone before it is sent (a lease no claim could have minted).
    fn completions(
        &self,
        items: Vec<Completion>,
    ) -> Result<(Vec<Option<Error>>, Vec<JobComplete>)> {
        at_most_a_batch(items.len())?;
        let mut slots: Vec<Option<Error>> = Vec::with_capacity(items.len());
        let mut sent = Vec::with_capacity(items.len());
        for c in items {
            if let Err(e) = Self::lease_text(&c.job_id, &c.lease_token) {
                slots.push(Some(e));
                continue;
            }
            sent.push(JobComplete {
                lease: Self::lease(&c.job_id, &c.lease_token),
                result: c
                    .result
                    .map(|v| encode_json("result", &v, self.payload_limit))
                    .transpose()?,
            });
            slots.push(None);
        }
        Ok((slots, sent))
    }

    /// One result per item, in order: the early failures and the store's answers.
    fn completion_results(
        &self,
        slots: Vec<Option<Error>>,
        stored: Vec<Result<()>>,
    ) -> Vec<Result<()>> {
        let results = answers(slots, stored, "completions");
        let done = results.iter().filter(|r| r.is_ok()).count();
        self.counters.add(Counter::Completions, done as u64);
        results
    }

    /// Fails an attempt: a retry by policy, a snooze, or the dead letters.
    pub async fn fail(
        &self,
        job_id: &str,
        lease_token: &LeaseToken,
        options: FailOptions,
    ) -> Result<FailOutcome> {
        let max = bounds::MAX_DURATION_MS;
        let retry_after_ms = options.retry_after.map(ms);
        let snooze_ms = options.snooze.map(ms);
        for (field, v) in [("retry_after_ms", retry_after_ms), ("snooze_ms", snooze_ms)] {
            if v.is_some_and(|v| v > max) {
                return Err(Error::validation(field, "must be at most 100 years"));
            }
        }
        Self::lease_text(job_id, lease_token)?;
        let outcome = self
            .store
            .job_fail(JobFail {
                lease: Self::lease(job_id, lease_token),
                // A worker's error text is kept, never refused: U+0000 (which
                // no backend stores alike) becomes U+FFFD.
                error: options.error.replace('\0', "\u{fffd}"),
                retryable: !options.permanent,
                retry_after_ms,
                snooze_ms,
            })
            .await?;
        let mut ended = Recorded::default();
        ended.ended(outcome.state);
        self.count(ended);
        Ok(outcome)
    }

    /// Gives a lease back: the job is ready at once and the attempt is not
    /// counted. Returns the state the release left the job in: `Ready`, or
    /// `Cancelled` when a cancel had been requested.
    pub async fn release(&self, job_id: &str, lease_token: &LeaseToken) -> Result<JobState> {
        Self::lease_text(job_id, lease_token)?;
        self.store
            .job_release(Self::lease(job_id, lease_token))
            .await
    }

    /// Stores a step result under the job; the first stored value wins (`false` then).
    pub async fn checkpoint_put(
        &self,
        job_id: &str,
        lease_token: &LeaseToken,
        name: &str,
        value: &Value,
    ) -> Result<bool> {
        crate::request::check_checkpoint_name("name", name)?;
        let value = encode_json("value", value, self.payload_limit)?;
        Self::lease_text(job_id, lease_token)?;
        self.store
            .checkpoint_put(CheckpointPut {
                lease: Self::lease(job_id, lease_token),
                name: name.into(),
                value,
            })
            .await
    }

    /// A stored step result.
    pub async fn checkpoint_get(&self, job_id: &str, name: &str) -> Result<Option<Value>> {
        if nul(job_id) || nul(name) {
            return Ok(None);
        }
        self.store
            .checkpoint_get(CheckpointGet {
                job_id: job_id.into(),
                name: name.into(),
            })
            .await
    }

    /// Maintenance: removes expired bindings (at most `limit`).
    pub async fn sweep_bindings(&self, limit: u32) -> Result<u64> {
        self.store.binding_sweep(Sweep { limit }).await
    }

    /// Maintenance: checks that the server still has the settings
    /// [`durability`](Self::durability) rests on (Redis; the other backends
    /// have nothing to check). A strict Redis store whose server lost them
    /// refuses writes (`Unavailable`) and reports relaxed durability until a
    /// check finds them again; the `Err` names the setting and how to set it
    /// back.
    pub async fn check_durability(&self) -> Result<()> {
        self.store.durability_check().await
    }

    /// Maintenance: records expired leases (at most `limit`).
    pub async fn reap_leases(&self, limit: u32) -> Result<u64> {
        let reaped = self.store.lease_reap(Sweep { limit }).await?;
        self.count(reaped);
        Ok(reaped.lease_expiries)
    }

    /// Maintenance: deletes terminal jobs past retention (at most `limit`).
    pub async fn sweep_retention(&self, limit: u32) -> Result<u64> {
        let n = self.store.job_retention_sweep(Sweep { limit }).await?;
        self.counters.add(Counter::RetentionDeletes, n);
        Ok(n)
    }

    /// Creates or replaces the schedule `name` (1–128 bytes of
    /// `[A-Za-z0-9._:-]`); true when it was created. The definition is
    /// validated in full first and nothing is written for a refused one: the
    /// cron expression (six fields, seconds first, and some instant to come),
    /// the time zone, the interval, and the job template by every bound of an
    /// enqueue (a template may not carry an idempotency key, `job_id`,
    /// `run_at` or `deadline`; errors name `job.<field>`).
    ///
    /// Replacing a schedule with the same timing keeps its next fire, so a
    /// process may declare its schedules at every start; a new timing, or a
    /// resume, fires next at the first tick after now (an interval stays
    /// anchored at the schedule's creation). See docs/schedules.md.
    pub async fn schedule_set(
        &self,
        name: &str,
        definition: crate::schedule::ScheduleDefinition,
    ) -> Result<bool> {
        let checked =
            crate::schedule::check_definition(name, &definition, &self.hasher, self.payload_limit)?;
        let now = self.store.now().await?;
        let cron_next = match &checked.cron {
            Some(spec) => Some(
                spec.next_after(now)
                    .ok_or_else(|| Error::validation("cron", "matches no instant to come"))?,
            ),
            None => None,
        };
        self.store
            .schedule_put(SchedulePut {
                name: name.into(),
                cron: definition.cron,
                every_ms: definition.every_ms,
                timezone: checked.timezone,
                job: checked.job,
                paused: definition.paused,
                at: micros(now),
                cron_next: cron_next.map(micros),
            })
            .await
    }

    /// Deletes the schedule `name`; false when there was none. Jobs it
    /// already enqueued are not touched.
    pub async fn schedule_delete(&self, name: &str) -> Result<bool> {
        crate::schedule::check_name(name)?;
        self.store
            .schedule_delete(ScheduleRef { name: name.into() })
            .await
    }

    /// Every schedule, by name, with its next fire. Fails when a stored
    /// schedule cannot be read (a template written by a newer idemq, say),
    /// with the error that names it; [`schedule_list`](Self::schedule_list)
    /// lists the others and says which cannot be read.
    pub async fn schedules(&self) -> Result<Vec<crate::schedule::Schedule>> {
        let list = self.store.schedule_list().await?;
        match list.unreadable.into_iter().next() {
            Some(bad) => Err(Error::Backend { message: bad.error }),
            None => Ok(list.schedules),
        }
    }

    /// Every schedule, by name, with its next fire; a schedule whose stored
    /// row cannot be read (a template written by a newer idemq, say) is
    /// listed in `unreadable`, by name and why, and the others are listed
    /// as usual.
    pub async fn schedule_list(&self) -> Result<crate::schedule::ScheduleList> {
        self.store.schedule_list().await
    }

    /// Maintenance: fires the schedules that are due (at most `limit`,
    /// 1–1000) and returns how many ticks this call fired.
    ///
    /// Fires the due schedules (docs/schedules.md). A tick fires when it is
    /// at most its misfire grace late (min(60 s, the period)); of the older
    /// ticks missed while the schedule was due (every process was down, or
    /// the passes ran late) only the latest fires, once, before the on-time
    /// one. A tick enqueues the template with the idempotency key
    /// `schedule:<name>:<tick>` in the reserved scope `idemq.schedule`, so
    /// any number of processes running this at once fire each tick exactly
    /// once; a tick another process fired (a replay, or a conflict because
    /// the template changed in between) is not counted and fails nothing.
    /// A tick whose template can no longer be enqueued (over the payload
    /// limit, refused by validation) is recorded on the schedule as its
    /// `last_error` and passed. A schedule that cannot fire because the
    /// backend failed stays due for the next pass; the others still fire,
    /// and the first such error is returned. So is a due schedule whose
    /// stored row this binary cannot read (a template written by a newer
    /// idemq, say): it is left as it is, for a process that can read it.
    pub async fn fire_schedules(&self, limit: u32) -> Result<u64> {
        if !(1..=1000).contains(&limit) {
            return Err(Error::validation("limit", "must be 1–1000"));
        }
        let due = self.store.schedule_due(ScheduleDue { limit }).await?;
        let mut fired = 0;
        // A schedule this binary cannot read is left for one that can; the
        // others fire, and the call reports it.
        let mut first_error = due.unreadable.into_iter().next();
        for schedule in &due.schedules {
            match self.fire_schedule(schedule, due.now).await {
                Ok(n) => fired += n,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(fired),
        }
    }

    /// Fires one due schedule's ticks; how many this call enqueued.
    async fn fire_schedule(
        &self,
        schedule: &crate::schedule::Schedule,
        now: DateTime<Utc>,
    ) -> Result<u64> {
        let spec = schedule.spec()?;
        let ticks = crate::schedule::ticks_to_fire(&spec, schedule, now);
        let mut fired = 0;
        let mut error = None;
        for &tick in &ticks {
            match self.fire_tick(schedule, tick).await {
                Ok(true) => fired += 1,
                Ok(false) => {}
                // The backend failed: the schedule stays due, nothing is marked.
                Err(e) if e.is_retryable() || matches!(e, Error::Backend { .. }) => return Err(e),
                // This template cannot be enqueued, now or at any retry:
                // record why and move past the tick.
                Err(e) => {
                    tracing::warn!(schedule = %schedule.name, tick = %tick, error = %e,
                        "a schedule tick could not be enqueued; passed");
                    error = Some(format!(
                        "the tick {} could not be enqueued: {e}",
                        tick.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                    ));
                }
            }
        }
        self.store
            .schedule_mark_fired(ScheduleMarkFired {
                name: schedule.name.clone(),
                cron: schedule.cron.clone(),
                every_ms: schedule.every_ms,
                timezone: schedule.timezone.clone(),
                fired_at: ticks.last().copied().map(micros),
                next_fire_at: spec.next_after(now).map(micros),
                error,
            })
            .await?;
        Ok(fired)
    }

    /// Enqueues one tick; true when this call enqueued it.
    async fn fire_tick(
        &self,
        schedule: &crate::schedule::Schedule,
        tick: DateTime<Utc>,
    ) -> Result<bool> {
        let started = std::time::Instant::now();
        let result = async {
            let item =
                crate::schedule::tick_request(schedule, tick, &self.hasher, self.payload_limit)?;
            self.enqueue_one(item).await
        }
        .await;
        self.counters.enqueue(&result, started.elapsed());
        match result {
            Ok(r) => Ok(r.outcome != crate::Outcome::Replayed),
            // Another scheduler fired this tick with the template as it
            // was before (or after) a change: the tick is fired.
            Err(Error::EnqueueIdempotencyConflict(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The largest accepted payload, result or checkpoint value in bytes
    /// (servers size their request body limit from it).
    pub fn payload_limit(&self) -> usize {
        self.payload_limit
    }
}

/// Refuses a call of more leases or completions than one call takes.
fn at_most_a_batch(items: usize) -> Result<()> {
    if items > MAX_BATCH_ITEMS {
        return Err(Error::validation(
            "items",
            format!("at most {MAX_BATCH_ITEMS} items per call"),
        ));
    }
    Ok(())
}

/// One result per item of a batch call, in order: the error of an item
/// refused before it was sent, or the store's answer for the next one sent.
fn answers<T>(slots: Vec<Option<Error>>, stored: Vec<Result<T>>, what: &str) -> Vec<Result<T>> {
    let mut stored = stored.into_iter();
    slots
        .into_iter()
        .map(|slot| match slot {
            Some(e) => Err(e),
            None => stored.next().unwrap_or_else(|| {
                Err(Error::Backend {
                    message: format!("the store answered fewer {what} than it was sent"),
                })
            }),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_backs_off_to_one_look_a_second() {
        let mut pause = FIRST_LOOK;
        let mut pauses = vec![pause];
        for _ in 0..6 {
            pause = next_look(pause);
            pauses.push(pause);
        }
        let ms: Vec<u128> = pauses.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [50, 100, 200, 400, 800, 1000, 1000]);
    }
}
