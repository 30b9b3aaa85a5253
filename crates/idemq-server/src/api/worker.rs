//! The worker protocol: claim (with long-poll), heartbeat, complete, fail,
//! release and checkpoints, so workers in any language can run jobs.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use axum::extract::State;
use idemq::{ClaimOptions, FailOptions};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::{Notify, OnceCell};
use utoipa::ToSchema;

use super::ApiState;
use super::bounded::{self, ClaimQueues, ClaimTypes};
use super::extract::{Json, OptionalJson, Path};
use super::jobs::MAX_WAIT_MS;
use super::long_poll::UNAVAILABLE_WAIT;
use super::problem::{ApiResult, Problem};
use super::schema::WaitMs;
use idemq::openapi::{ClaimLimit, DurationMs, JsonValue, LeaseMs, WorkerName};

/// How often a long-polling claim looks again without a wake-up: wake-ups
/// can be lost, and a scheduled job turning due sends none.
const POLL_INTERVAL: Duration = Duration::from_millis(500);

/// One wake-up source for every long-polling claim of the server (the
/// embedded store's own signal, or one `LISTEN` connection on PostgreSQL,
/// not one per waiting request, opened on first use), passed on to the
/// waiting claims without a herd.
///
/// Claims wait in groups, one per filter (the same queues and types). A
/// wake-up starts one waiting claim of each group, not all of them: work
/// one claim finds is work its group's other claims would only find gone.
/// A claim that comes back with jobs starts the next claim of its group,
/// as there may be more, so a burst of work still reaches as many claims as
/// it needs, one after the other. A claim that finds none ends the chain.
/// Work a wake-up does not bring (a scheduled job turning due, a wake-up
/// lost) is found by each claim's own look every [`POLL_INTERVAL`].
#[derive(Default)]
pub(crate) struct WakeHub {
    /// Set once the wake-ups are passed on (a task forwards them).
    forwarding: OnceCell<()>,
    groups: Arc<Mutex<HashMap<ClaimFilter, Weak<Notify>>>>,
}

/// What a waiting claim asks for: its queues (every queue when empty) and
/// its types (every type when `None`), each sorted and without repeats.
type ClaimFilter = (Vec<String>, Option<Vec<String>>);

impl WakeHub {
    /// The signal of the group of claims asking what `options` asks for,
    /// or `None` when the backend cannot give wake-ups now (the claim then
    /// only polls).
    async fn join(&self, queue: &idemq::Queue, options: &ClaimOptions) -> Option<Arc<Notify>> {
        self.forwarding
            .get_or_try_init(|| async {
                let mut wakeups = queue.store().wakeups().await?;
                let groups = Arc::downgrade(&self.groups);
                // Forwards until the server (and with it the hub) is gone.
                tokio::spawn(async move {
                    loop {
                        let woke = wakeups.wait(Duration::from_secs(1)).await;
                        let Some(groups) = groups.upgrade() else {
                            break;
                        };
                        if woke {
                            // One commit can wake twice (an embedded
                            // store's signal wakes and leaves a permit):
                            // wake-ups already there are the same news.
                            for _ in 0..8 {
                                if !wakeups.wait(Duration::ZERO).await {
                                    break;
                                }
                            }
                            Self::wake_each(&groups);
                        }
                    }
                });
                Ok::<_, idemq::Error>(())
            })
            .await
            .inspect_err(|e| tracing::warn!(error = %e, "no wake-ups for long-polling claims"))
            .ok()?;
        let sorted = |names: &[String]| {
            let mut names = names.to_vec();
            names.sort();
            names.dedup();
            names
        };
        let filter = (
            sorted(&options.queues),
            options.types.as_deref().map(sorted),
        );
        let mut groups = self.groups.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(signal) = groups.get(&filter).and_then(Weak::upgrade) {
            return Some(signal);
        }
        groups.retain(|_, signal| signal.strong_count() > 0);
        let signal = Arc::new(Notify::new());
        groups.insert(filter, Arc::downgrade(&signal));
        Some(signal)
    }

    /// Starts one waiting claim of each group (or the next to wait).
    fn wake_each(groups: &Mutex<HashMap<ClaimFilter, Weak<Notify>>>) {
        let mut groups = groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.retain(|_, signal| match signal.upgrade() {
            Some(signal) => {
                signal.notify_one();
                true
            }
            None => false,
        });
    }
}

/// The worker name of a claim that gives none.
const DEFAULT_WORKER: &str = "http";
/// Jobs per claim when `limit` is omitted.
const DEFAULT_LIMIT: u32 = 1;
/// The lease when `lease_ms` is omitted (30 s).
const DEFAULT_LEASE_MS: u64 = 30_000;

/// The body of `POST /v1/claim`. Every member is optional; `null` means omitted.
#[derive(Deserialize, ToSchema, Default)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClaimBody {
    /// Queues to claim from (every queue when empty, `null` or omitted; at
    /// most 1,000 names of at most 64 bytes).
    #[serde(default, deserialize_with = "bounded::claim_queues")]
    #[schema(value_type = Option<ClaimQueues>)]
    queues: Option<Vec<String>>,
    /// The worker's name (1–128 characters), kept in the run ledger; `http` when omitted.
    #[serde(default)]
    #[schema(value_type = Option<WorkerName>)]
    worker: Option<String>,
    /// At most this many jobs (1–1000; 1 when omitted).
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<ClaimLimit>)]
    limit: Option<u32>,
    /// The lease in milliseconds (100 – 3,600,000; 30,000 when omitted).
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<LeaseMs>)]
    lease_ms: Option<u64>,
    /// Job types to claim (`null`: any type; at most 1,000 names of at
    /// most 128 bytes).
    #[serde(default, deserialize_with = "bounded::claim_types")]
    #[schema(value_type = Option<ClaimTypes>)]
    types: Option<Vec<String>>,
    /// Hold the request up to this many milliseconds (≤ 60,000) until work arrives.
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<WaitMs>)]
    wait_ms: Option<u64>,
    /// Attempts to complete first, in the same round trip (≤ 1,000); their
    /// results come back as `completed`.
    #[serde(default, deserialize_with = "bounded::opt_completions")]
    #[schema(value_type = Option<Completions>)]
    complete: Option<Vec<CompleteItem>>,
}

/// A list of completions (≤ [`idemq::MAX_BATCH_ITEMS`]).
pub(crate) struct Completions;

impl utoipa::PartialSchema for Completions {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ArrayBuilder::new()
            .items(utoipa::openapi::Ref::from_schema_name("CompleteItem"))
            .max_items(Some(idemq::MAX_BATCH_ITEMS))
            .description(Some("Attempts to complete"))
            .into()
    }
}

impl ToSchema for Completions {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        schemas.push((
            "CompleteItem".into(),
            <CompleteItem as utoipa::PartialSchema>::schema(),
        ));
    }
}

/// One attempt to complete (`POST /v1/jobs/complete`, claim's `complete`).
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompleteItem {
    /// The job.
    id: String,
    /// The token the claim minted.
    #[schema(value_type = String)]
    lease_token: idemq::LeaseToken,
    /// Any JSON result (≤ the payload limit), stored with the job.
    #[serde(default)]
    #[schema(value_type = Option<JsonValue>)]
    result: Option<Value>,
}

/// The body of `POST /v1/jobs/complete`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompleteManyBody {
    /// The attempts to complete (≤ 1,000), decided in one commit.
    #[serde(deserialize_with = "bounded::completions")]
    #[schema(value_type = Completions)]
    jobs: Vec<CompleteItem>,
}

/// One completion's result.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub(crate) enum CompletionItem {
    /// `{"state": "completed"}`.
    Completed(StateAnswer),
    /// The item's error (`lease-lost` for a stale token).
    Error {
        /// The problem document.
        error: Problem,
    },
}

/// The answer of `POST /v1/jobs/complete`.
#[derive(Serialize, ToSchema)]
#[schema(as = CompletionResults)]
pub(crate) struct CompletionResults {
    /// One per item, in request order.
    results: Vec<CompletionItem>,
}

/// The answer of a claim.
#[derive(Serialize, ToSchema)]
pub(crate) struct Claimed {
    /// The claimed jobs (maybe none).
    jobs: Vec<idemq::ClaimedJob>,
    /// With a `complete` member only: one result per completion, in order.
    #[serde(skip_serializing_if = "Option::is_none")]
    completed: Option<Vec<CompletionItem>>,
}

/// A job's state after a worker call.
#[derive(Serialize, ToSchema)]
#[schema(as = JobStateAnswer)]
pub(crate) struct StateAnswer {
    state: idemq::JobState,
}

/// The completions a body names (within the batch bound, which the body's
/// parser applied: [`bounded::completions`]).
fn completions(items: Vec<CompleteItem>) -> Vec<idemq::Completion> {
    items
        .into_iter()
        .map(|c| idemq::Completion {
            job_id: c.id,
            lease_token: c.lease_token,
            result: c.result,
        })
        .collect()
}

/// One answer per completion, in order (`{"state": "completed"}` or
/// `{"error": problem}`).
fn completion_answers(results: Vec<idemq::Result<()>>) -> Vec<CompletionItem> {
    results
        .into_iter()
        .map(|r| match r {
            Ok(()) => CompletionItem::Completed(StateAnswer {
                state: idemq::JobState::Completed,
            }),
            Err(e) => CompletionItem::Error {
                error: Problem::from(e),
            },
        })
        .collect()
}

/// Completes many attempts in one round trip and one commit; a stale lease
/// fails only its own item (`lease-lost`).
#[utoipa::path(
    post,
    path = "/v1/jobs/complete",
    operation_id = "completeJobs",
    tag = "worker",
    request_body = CompleteManyBody,
    responses(
        (status = 200, description = "One result per item, in request order", body = CompletionResults),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "A result is over the payload limit", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation (also: over 1,000 items)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn complete_many(
    State(s): State<ApiState>,
    Json(body): Json<CompleteManyBody>,
) -> ApiResult<axum::Json<CompletionResults>> {
    let results = s.queue().complete_many(completions(body.jobs)).await?;
    Ok(axum::Json(CompletionResults {
        results: completion_answers(results),
    }))
}

/// Claims up to `limit` due jobs under a lease, waiting up to `wait_ms` for
/// work to arrive.
///
/// A claim with `wait_ms` above 0 takes one of the server's long-poll
/// permits before it does anything; when all are held it is refused with
/// `503` and records nothing, its `complete` items included.
#[utoipa::path(
    post,
    path = "/v1/claim",
    operation_id = "claimJobs",
    tag = "worker",
    request_body(content = Option<ClaimBody>, description = "Every member is optional; so is the body"),
    responses(
        (status = 200, description = "The claimed jobs (maybe none)", body = Claimed),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation (also: over 1,000 `complete` items, `queues` or `types`, or a name over its length)", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = UNAVAILABLE_WAIT, body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn claim(
    State(s): State<ApiState>,
    OptionalJson(body): OptionalJson<ClaimBody>,
) -> ApiResult<axum::Json<Claimed>> {
    let wait_ms = body.wait_ms.unwrap_or(0);
    if wait_ms > MAX_WAIT_MS {
        return Err(Problem::validation(
            "wait_ms",
            &format!("must be at most {MAX_WAIT_MS}"),
        ));
    }
    let options = ClaimOptions {
        queues: body.queues.unwrap_or_default(),
        types: body.types,
        worker: body.worker.unwrap_or_else(|| DEFAULT_WORKER.to_owned()),
        limit: body.limit.unwrap_or(DEFAULT_LIMIT),
        lease: Duration::from_millis(body.lease_ms.unwrap_or(DEFAULT_LEASE_MS)),
    };
    options.validate()?;
    // A claim that asks to wait holds a long-poll permit from its first
    // look, and is refused before it does anything when none is free: its
    // completions are not recorded (the same request sent again records
    // them), and no job is leased to a request that is refused.
    let _permit = if wait_ms > 0 {
        Some(s.long_polls.try_hold()?)
    } else {
        None
    };
    // Completions first, in the same transaction as the first claim (one
    // round trip, one commit): a worker acknowledges what it finished while
    // it asks for more, and the jobs it frees may be the ones it claims next.
    let mut done = body.complete.map(completions);
    let mut completed: Option<Vec<CompletionItem>> = None;
    let until = Instant::now() + Duration::from_millis(wait_ms);
    let notify = if wait_ms > 0 {
        s.wakeups.join(s.queue(), &options).await
    } else {
        None
    };
    loop {
        // Listen before looking, so work committed between the claim and
        // the wait still wakes this request.
        let mut notified = std::pin::pin!(notify.as_deref().map(Notify::notified));
        if let Some(n) = notified.as_mut().as_pin_mut() {
            n.enable();
        }
        let (answers, claimed) =
            claim_once(s.queue().clone(), done.take(), options.clone()).await?;
        if let Some(results) = answers {
            completed = Some(completion_answers(results));
        }
        let jobs = match claimed {
            Ok(jobs) => jobs,
            // This request's completions are recorded: their answers go
            // back (with no jobs; the worker claims again) rather than
            // behind an error that would hide them.
            Err(e) if completed.is_some() => {
                tracing::warn!(
                    error = %e,
                    "a claim failed after its request's completions were recorded; \
                     answering them with no jobs"
                );
                return Ok(axum::Json(Claimed {
                    jobs: Vec::new(),
                    completed,
                }));
            }
            Err(e) => return Err(e.into()),
        };
        if !jobs.is_empty() {
            // There may be more: the next claim of this group looks
            // (`WakeHub`). A wake-up this claim got meanwhile, unused, is
            // passed on as it is dropped.
            if let Some(n) = &notify {
                n.notify_one();
            }
            return Ok(axum::Json(Claimed { jobs, completed }));
        }
        let now = Instant::now();
        if now >= until {
            return Ok(axum::Json(Claimed { jobs, completed }));
        }
        let nap = (until - now).min(POLL_INTERVAL);
        match notified.as_mut().as_pin_mut() {
            Some(n) => {
                let _ = tokio::time::timeout(nap, n).await;
            }
            None => tokio::time::sleep(nap).await,
        }
    }
}

/// The answers of the completions a claim carried (`None` when it carried
/// none), and the claim's own.
type ClaimAnswer = (
    Option<Vec<idemq::Result<()>>>,
    idemq::Result<Vec<idemq::ClaimedJob>>,
);

/// One claim, with the completions it carries, run in a task of its own. A
/// request dropped before the claim answered (its client went away, and
/// the server stops a request whose connection closed) would otherwise
/// leave the jobs the claim committed leased to no one until their lease
/// expired, each losing an attempt; the task releases them at once instead
/// (a release does not count the attempt).
async fn claim_once(
    queue: idemq::Queue,
    done: Option<Vec<idemq::Completion>>,
    options: ClaimOptions,
) -> idemq::Result<ClaimAnswer> {
    let (tx, rx) = tokio::sync::oneshot::channel::<idemq::Result<ClaimAnswer>>();
    tokio::spawn(async move {
        let answer = match done {
            Some(items) => queue
                .complete_and_claim(items, options)
                .await
                .map(|(results, claimed)| (Some(results), claimed)),
            None => Ok((None, queue.claim(options).await)),
        };
        if let Err(Ok((_, Ok(jobs)))) = tx.send(answer) {
            for job in jobs {
                if let Err(e) = queue.release(&job.id, &job.lease_token).await {
                    tracing::warn!(
                        job = %job.id,
                        error = %e,
                        "releasing a job claimed for a request that went away failed; \
                         its lease expires instead"
                    );
                }
            }
        }
    });
    rx.await.map_err(|_| idemq::Error::Backend {
        message: "a claim's task ended without an answer".into(),
    })?
}

/// A lease presented by a worker.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct LeaseBody {
    /// The token the claim minted.
    #[schema(value_type = String)]
    lease_token: idemq::LeaseToken,
}

/// The body of `complete`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CompleteBody {
    /// The token the claim minted.
    #[schema(value_type = String)]
    lease_token: idemq::LeaseToken,
    /// Any JSON result (≤ the payload limit), stored with the job.
    #[serde(default)]
    #[schema(value_type = Option<JsonValue>)]
    result: Option<Value>,
}

/// The body of `fail`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct FailBody {
    /// The token the claim minted.
    #[schema(value_type = String)]
    lease_token: idemq::LeaseToken,
    /// What went wrong (kept truncated to 8 KiB).
    #[serde(default)]
    error: Option<String>,
    /// `false`: a permanent failure, the job goes dead at once (`true` when omitted).
    #[serde(default)]
    retryable: Option<bool>,
    /// Overrides the backoff for this retry.
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<DurationMs>)]
    retry_after_ms: Option<u64>,
    /// Reschedules after this delay without consuming the attempt.
    #[serde(default, deserialize_with = "idemq::wire::opt_int")]
    #[schema(value_type = Option<DurationMs>)]
    snooze_ms: Option<u64>,
}

/// The body of `PUT /v1/jobs/{id}/checkpoints/{name}`.
#[derive(Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub(crate) struct CheckpointBody {
    /// The token the claim minted.
    #[schema(value_type = String)]
    lease_token: idemq::LeaseToken,
    /// Any JSON value (≤ the payload limit).
    #[schema(value_type = JsonValue)]
    value: Value,
}

/// The answer of a checkpoint write.
#[derive(Serialize, ToSchema)]
pub(crate) struct Stored {
    /// `false`: a value was already stored under that name; it is kept.
    stored: bool,
}

/// A worker call's result as an answer.
fn lease<T>(r: idemq::Result<T>) -> ApiResult<T> {
    r.map_err(Problem::from)
}

const LEASE_LOST: &str = "A stale or unknown lease token (`lease-lost`)";

/// Renews a lease; says whether the job was cancelled meanwhile.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/heartbeat",
    operation_id = "heartbeatJob",
    tag = "worker",
    params(("id" = String, Path, description = "The job id")),
    request_body = LeaseBody,
    responses(
        (status = 200, description = "The renewed lease", body = idemq::Heartbeat),
        (status = 409, description = LEASE_LOST, body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn heartbeat(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Json(body): Json<LeaseBody>,
) -> ApiResult<axum::Json<idemq::Heartbeat>> {
    let r = s.queue().heartbeat(&id, &body.lease_token).await;
    lease(r).map(axum::Json)
}

/// Completes an attempt.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/complete",
    operation_id = "completeJob",
    tag = "worker",
    params(("id" = String, Path, description = "The job id")),
    request_body = CompleteBody,
    responses(
        (status = 200, description = "The job is completed", body = StateAnswer),
        (status = 409, description = LEASE_LOST, body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The result is over the payload limit", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn complete(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Json(body): Json<CompleteBody>,
) -> ApiResult<axum::Json<StateAnswer>> {
    let r = s
        .queue()
        .complete(&id, &body.lease_token, body.result)
        .await;
    lease(r)?;
    Ok(axum::Json(StateAnswer {
        state: idemq::JobState::Completed,
    }))
}

/// Fails an attempt: a retry, a snooze, or the dead letters.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/fail",
    operation_id = "failJob",
    tag = "worker",
    params(("id" = String, Path, description = "The job id")),
    request_body = FailBody,
    responses(
        (status = 200, description = "scheduled (with next_run_at), dead or cancelled", body = idemq::FailOutcome),
        (status = 409, description = LEASE_LOST, body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn fail(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Json(body): Json<FailBody>,
) -> ApiResult<axum::Json<idemq::FailOutcome>> {
    let options = FailOptions {
        error: body.error.unwrap_or_default(),
        permanent: !body.retryable.unwrap_or(true),
        retry_after: body.retry_after_ms.map(Duration::from_millis),
        snooze: body.snooze_ms.map(Duration::from_millis),
    };
    let outcome = lease(s.queue().fail(&id, &body.lease_token, options).await)?;
    Ok(axum::Json(outcome))
}

/// Gives a lease back: the job is ready at once, the attempt not counted.
#[utoipa::path(
    post,
    path = "/v1/jobs/{id}/release",
    operation_id = "releaseJob",
    tag = "worker",
    params(("id" = String, Path, description = "The job id")),
    request_body = LeaseBody,
    responses(
        (status = 200, description = "The job's state: ready (cancelled when a cancel was requested)", body = StateAnswer),
        (status = 409, description = LEASE_LOST, body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn release(
    State(s): State<ApiState>,
    Path(id): Path<String>,
    Json(body): Json<LeaseBody>,
) -> ApiResult<axum::Json<StateAnswer>> {
    // A job whose cancel was requested turns cancelled, not ready; the
    // store says which, in the release's own transaction.
    let state = lease(s.queue().release(&id, &body.lease_token).await)?;
    Ok(axum::Json(StateAnswer { state }))
}

/// Stores a step result under the job; the first stored value wins.
#[utoipa::path(
    put,
    path = "/v1/jobs/{id}/checkpoints/{name}",
    operation_id = "putCheckpoint",
    tag = "worker",
    params(
        ("id" = String, Path, description = "The job id"),
        ("name" = idemq::openapi::CheckpointName, Path, description = "The step name"),
    ),
    request_body = CheckpointBody,
    responses(
        (status = 200, description = "Whether this value was stored", body = Stored),
        (status = 409, description = LEASE_LOST, body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "The value is over the payload limit", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn checkpoint(
    State(s): State<ApiState>,
    Path((id, name)): Path<(String, String)>,
    Json(body): Json<CheckpointBody>,
) -> ApiResult<axum::Json<Stored>> {
    let r = s
        .queue()
        .checkpoint_put(&id, &body.lease_token, &name, &body.value)
        .await;
    let stored = lease(r)?;
    Ok(axum::Json(Stored { stored }))
}
