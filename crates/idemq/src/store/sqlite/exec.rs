//! Execution primitives on SQLite: claim, heartbeat, complete, fail, release,
//! checkpoints and the reaping of expired leases. Every call after the claim
//! is fenced by the lease token: a stale token changes nothing and is told
//! `LeaseLost`.

use rusqlite::params;
use serde_json::json;

use super::decode::{Cols, all, one};
use super::enqueue::keep_us;
use super::{Cx, ts};
use crate::error::{Error, Result};
use crate::job::{ClaimedJob, FailOutcome, Heartbeat, JobState, LeaseToken};
use crate::request::RetryPolicy;
use crate::retry::next_delay_ms;
use crate::store::{CheckpointPut, JobClaim, JobComplete, JobFail, LeaseRef, Recorded, Recording};

/// Longest error text kept in the run ledger.
const MAX_ERROR_BYTES: usize = 8 * 1024;

/// The attempt a valid lease refers to.
pub(super) struct Active {
    id: String,
    attempt: i32,
    attempts_used: i32,
    max_attempts: i32,
    retry: RetryPolicy,
    deadline: Option<i64>,
    cancel_requested: bool,
    keep_ms: Option<i64>,
    started_at: i64,
    timeout_ms: i64,
    lease_ms: i64,
    worker: String,
    /// The number of the attempt's derived `claimed` event.
    claim_seq: Option<i64>,
}

/// The columns [`active_row`] decodes.
macro_rules! active_cols {
    () => {
        "id, attempt, attempts_used, max_attempts, retry, deadline,
         cancel_requested, keep_ms, started_at, timeout_ms, lease_ms, worker, claim_seq"
    };
}

/// An active job's row. A claim sets its start, lease length and worker,
/// so any of them missing is a broken row, not a reason to guess.
fn active_row(r: &rusqlite::Row) -> Result<Active> {
    let mut c = Cols::new(r, "idemq_jobs", "active job");
    let id: String = c.get("id")?;
    c.named(format!("job {id}"));
    let started_at: i64 = c.get("started_at")?;
    c.instant("started_at", started_at)?;
    let deadline: Option<i64> = c.get("deadline")?;
    if let Some(us) = deadline {
        c.instant("deadline", us)?;
    }
    Ok(Active {
        attempt: c.get("attempt")?,
        attempts_used: c.get("attempts_used")?,
        max_attempts: c.get("max_attempts")?,
        retry: c.json("retry", "retry policy")?,
        deadline,
        cancel_requested: c.get("cancel_requested")?,
        keep_ms: c.get("keep_ms")?,
        started_at,
        timeout_ms: c.get("timeout_ms")?,
        lease_ms: c.get("lease_ms")?,
        worker: c.get("worker")?,
        claim_seq: c.get("claim_seq")?,
        id,
    })
}

fn load_active(cx: &Cx, lease: &LeaseRef) -> Result<Option<Active>> {
    let sql = concat!(
        "SELECT ",
        active_cols!(),
        " FROM idemq_jobs WHERE id = ?1 AND state = 'active' AND lease_token = ?2"
    );
    one(
        cx.db.prepare_cached(sql)?,
        [&lease.job_id, &lease.lease_token],
        active_row,
    )
}

fn lease_lost(lease: &LeaseRef) -> Error {
    Error::LeaseLost {
        job_id: lease.job_id.clone(),
    }
}

/// How an attempt ends.
pub(super) enum End<'a> {
    Completed(Option<&'a str>),
    Failed {
        error: &'a str,
        retryable: bool,
        retry_after_ms: Option<i64>,
    },
    Snoozed(i64),
    Released,
    LeaseExpired,
    TimedOut,
    DeadlinePassed,
}

enum Next {
    Completed,
    Waiting {
        at: i64,
        event: Option<&'static str>,
    },
    Dead(&'static str),
    Cancelled,
}

fn truncate(s: &str) -> String {
    let mut end = s.len().min(MAX_ERROR_BYTES);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

fn decide_next(cx: &Cx, a: &Active, end: &End, used: i32) -> Next {
    let now = cx.now;
    let past_deadline = |at: i64| a.deadline.is_some_and(|d| at >= d);
    let retry_at = |delay_ms: i64| {
        let at = now + delay_ms * 1000;
        if past_deadline(at) {
            Next::Dead("deadline")
        } else {
            Next::Waiting {
                at,
                event: Some("retry_scheduled"),
            }
        }
    };
    match *end {
        End::Completed(_) => Next::Completed,
        _ if a.cancel_requested => Next::Cancelled,
        End::Released => Next::Waiting {
            at: now,
            event: Some("released"),
        },
        End::Snoozed(ms) => retry_at(ms),
        End::DeadlinePassed => Next::Dead("deadline"),
        End::Failed {
            retryable: false, ..
        } => Next::Dead("permanent"),
        _ if used >= a.max_attempts => Next::Dead("attempts_exhausted"),
        // An expired lease is claimable again at once (its attempt is consumed).
        End::LeaseExpired if past_deadline(now) => Next::Dead("deadline"),
        End::LeaseExpired => Next::Waiting {
            at: now,
            event: None,
        },
        End::Failed { retry_after_ms, .. } => {
            match next_delay_ms(&a.retry, used, rand::random::<f64>()) {
                None => Next::Dead("no_retry"),
                Some(delay) => retry_at(retry_after_ms.unwrap_or(delay).max(0)),
            }
        }
        End::TimedOut => match next_delay_ms(&a.retry, used, rand::random::<f64>()) {
            None => Next::Dead("no_retry"),
            Some(delay) => retry_at(delay),
        },
    }
}

/// Ends the attempt `a` and moves the job by the state machine
/// (docs/state-machine.md). Shared by every way an attempt can end.
pub(super) fn end_attempt(cx: &Cx, a: &Active, end: End) -> Result<FailOutcome> {
    let now = cx.now;
    let consumed = !matches!(end, End::Released | End::Snoozed(_));
    let used = a.attempts_used + i32::from(consumed);
    let (outcome, error) = match &end {
        End::Completed(_) => ("completed", None),
        End::Failed { error, .. } => ("failed", Some(truncate(error))),
        End::Snoozed(_) => ("snoozed", None),
        End::Released => ("released", None),
        End::LeaseExpired => ("lease_expired", Some("lease expired".to_owned())),
        End::TimedOut => (
            "failed",
            Some(format!("timed out after {} ms", a.timeout_ms)),
        ),
        End::DeadlinePassed => ("failed", Some("deadline passed".to_owned())),
    };
    let cancelling = a.cancel_requested && !matches!(end, End::Completed(_));
    let outcome = if cancelling { "cancelled" } else { outcome };
    // A completed attempt stays derived from the job row (job_runs,
    // job_events); an attempt that ends otherwise is written out now, its
    // `claimed` event under the number the claim drew.
    if !matches!(end, End::Completed(_)) {
        let worker = a.worker.as_str();
        cx.db
            .prepare_cached(
                "INSERT OR REPLACE INTO idemq_runs
                   (job_id, attempt, worker, started_at, finished_at, outcome, error)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            )?
            .execute(params![
                a.id,
                a.attempt,
                worker,
                a.started_at,
                now,
                outcome,
                error
            ])?;
        let seq = match a.claim_seq {
            Some(seq) => seq,
            None => cx.next_seq()?,
        };
        cx.event_at(
            seq,
            &a.id,
            "claimed",
            a.started_at,
            json!({ "attempt": a.attempt, "worker": worker }),
        )?;
    }
    if matches!(end, End::LeaseExpired) {
        cx.event(&a.id, "lease_expired", json!({ "attempt": a.attempt }))?;
    }
    let next = decide_next(cx, a, &end, used);
    let clear = "lease_token = NULL, lease_expires_at = NULL, lease_ms = NULL, worker = NULL,
                 started_at = NULL, claim_seq = NULL, updated_at = ?2, attempts_used = ?3";
    Ok(match next {
        Next::Completed => {
            let result = match end {
                End::Completed(r) => r,
                _ => None,
            };
            // The worker, start and claim number stay: the run and the
            // `claimed` and `completed` events are derived from them.
            let purge = now + keep_us(a.keep_ms, "completed");
            cx.db
                .prepare_cached(
                    "UPDATE idemq_jobs SET state = 'completed', result = ?4, finished_at = ?2,
                       purge_after = ?5, lease_token = NULL, lease_expires_at = NULL,
                       lease_ms = NULL, updated_at = ?2, attempts_used = ?3, done_seq = ?6
                     WHERE id = ?1",
                )?
                .execute(params![a.id, now, used, result, purge, cx.next_seq()?])?;
            FailOutcome {
                state: JobState::Completed,
                next_run_at: None,
            }
        }
        Next::Waiting { at, event } => {
            let sql = format!(
                "UPDATE idemq_jobs SET state = 'waiting', run_at = ?4,
                   last_error = coalesce(?5, last_error), {clear} WHERE id = ?1"
            );
            cx.db
                .prepare_cached(&sql)?
                .execute(params![a.id, now, used, at, error])?;
            if let Some(kind) = event {
                let snoozed = matches!(end, End::Snoozed(_));
                cx.event(
                    &a.id,
                    kind,
                    json!({ "run_at": ts(at)?, "snoozed": snoozed }),
                )?;
            }
            FailOutcome {
                // The derived state, like every read (SPEC 2): a zero delay is ready.
                state: if at <= now {
                    JobState::Ready
                } else {
                    JobState::Scheduled
                },
                next_run_at: Some(ts(at)?),
            }
        }
        Next::Dead(reason) => {
            finish(
                cx,
                &a.id,
                "dead",
                used,
                error.as_deref().or(Some(reason)),
                a.keep_ms,
            )?;
            cx.event(
                &a.id,
                "dead",
                json!({ "reason": reason, "attempt": a.attempt }),
            )?;
            FailOutcome {
                state: JobState::Dead,
                next_run_at: None,
            }
        }
        Next::Cancelled => {
            finish(cx, &a.id, "cancelled", used, error.as_deref(), a.keep_ms)?;
            super::admin::release_dedupe(cx, &a.id)?;
            cx.event(&a.id, "cancelled", json!({ "attempt": a.attempt }))?;
            FailOutcome {
                state: JobState::Cancelled,
                next_run_at: None,
            }
        }
    })
}

/// Moves a job to a terminal state other than completed.
pub(super) fn finish(
    cx: &Cx,
    id: &str,
    state: &str,
    attempts_used: i32,
    error: Option<&str>,
    keep_ms: Option<i64>,
) -> Result<()> {
    cx.db
        .prepare_cached(
            "UPDATE idemq_jobs SET state = ?2, finished_at = ?3, purge_after = ?4,
               attempts_used = ?5, last_error = coalesce(?6, last_error), updated_at = ?3,
               lease_token = NULL, lease_expires_at = NULL, lease_ms = NULL, worker = NULL,
               started_at = NULL, claim_seq = NULL
             WHERE id = ?1",
        )?
        .execute(params![
            id,
            state,
            cx.now,
            cx.now + keep_us(keep_ms, state),
            attempts_used,
            error
        ])?;
    Ok(())
}

/// Records every expired lease (at most `limit`): how many, and where they
/// sent their jobs.
pub(super) fn reap(cx: &Cx, limit: u32) -> Result<Recorded> {
    let sql = concat!(
        "SELECT ",
        active_cols!(),
        " FROM idemq_jobs
         WHERE state = 'active' AND lease_expires_at <= ?1 ORDER BY lease_expires_at LIMIT ?2"
    );
    let expired: Vec<Active> = all(
        cx.db.prepare_cached(sql)?,
        params![cx.now, limit],
        active_row,
    )?;
    let mut recorded = Recorded::default();
    for a in &expired {
        recorded.expired(end_attempt(cx, a, End::LeaseExpired)?.state);
    }
    Ok(recorded)
}

/// Jobs taken per candidate query; the loop goes on while pages are full,
/// for at most [`CLAIM_ROUNDS`] pages.
const CLAIM_PAGE: u32 = 256;
/// Most candidate queries of one claim, as on PostgreSQL. Jobs past their
/// deadline, which a claim ends without counting them, are ended this many
/// pages at a time: a backlog of them is ended by the claims that follow,
/// never all in one transaction holding the only write lock.
const CLAIM_ROUNDS: u32 = 8;

/// The due jobs in claim order, with what a claim answers of each (read
/// here, so a claimed job is not read again; `attempt + 1` is the number
/// the claim's update gives the attempt).
const CANDIDATES: &str = "SELECT seq, id, concurrency_key, deadline, type, queue, payload,
       attempt + 1, max_attempts, timeout_ms, tags
     FROM idemq_jobs j
     WHERE state = 'waiting' AND run_at <= ?1
       AND (?2 IS NULL OR queue IN (SELECT value FROM json_each(?2)))
       AND (?3 IS NULL OR type IN (SELECT value FROM json_each(?3)))
       AND queue NOT IN (SELECT name FROM idemq_queues WHERE paused = 1)
       AND (concurrency_key IS NULL OR NOT EXISTS (
             SELECT 1 FROM idemq_jobs a
             WHERE a.state = 'active' AND a.concurrency_key = j.concurrency_key))
     ORDER BY priority DESC, run_at, seq LIMIT ?4";

/// A candidate the claim acts on, in the order the query found them.
enum Found {
    /// Past its deadline: it dies, never started.
    Expired(String),
    /// Claimed: its `seq`, and the job as the claim answers it.
    Due(i64, ClaimedJob),
}

/// The jobs claimed (with what the claim recorded beside: the expired
/// leases it reaped first, the jobs it ended past their deadline), and
/// whether the claim stopped at its bound of
/// [`CLAIM_ROUNDS`] with slots left, having ended jobs past their deadline:
/// due jobs may wait behind the ones it left, so its caller wakes the
/// workers once it committed (each such claim ends jobs, so the wake-ups
/// stop), as on PostgreSQL.
pub(super) fn claim(cx: &Cx, p: &JobClaim) -> Result<(Recording<Vec<ClaimedJob>>, bool)> {
    let mut recorded = reap(cx, 1000)?;
    // JSON arrays of strings for `json_each`; a list of strings always serializes.
    let queues = (!p.queues.is_empty()).then(|| json!(p.queues).to_string());
    let types = p.types.as_ref().map(|t| json!(t).to_string());
    let expires = cx.now + p.lease_ms * 1000;
    let mut claimed = Vec::new();
    let mut taken_keys = std::collections::HashSet::new();
    let mut rounds = 0;
    let mut ended = false;
    let mut bounded = false;
    while (claimed.len() as u32) < p.limit {
        rounds += 1;
        // The page is read only as far as the claim takes from it.
        let mut found = Vec::new();
        let mut read = 0u32;
        let mut taking = claimed.len() as u32;
        {
            let mut stmt = cx.db.prepare_cached(CANDIDATES)?;
            let mut rows = stmt.query(params![cx.now, queues, types, CLAIM_PAGE])?;
            while taking < p.limit {
                let Some(r) = rows.next()? else { break };
                read += 1;
                let seq: i64 = r.get(0)?;
                let id: String = r.get(1)?;
                let key: Option<String> = r.get(2)?;
                let deadline: Option<i64> = r.get(3)?;
                if deadline.is_some_and(|d| d <= cx.now) {
                    found.push(Found::Expired(id));
                    continue;
                }
                if let Some(k) = key
                    && !taken_keys.insert(k)
                {
                    continue;
                }
                found.push(Found::Due(seq, candidate(r, id, expires)?));
                taking += 1;
            }
        }
        let full = read == CLAIM_PAGE;
        let progressed = !found.is_empty();
        for f in found {
            match f {
                Found::Expired(id) => {
                    // Past its deadline: never started.
                    let (used, keep): (i32, Option<i64>) = cx.db.query_row(
                        "SELECT attempts_used, keep_ms FROM idemq_jobs WHERE id = ?1",
                        [&id],
                        |r| Ok((r.get(0)?, r.get(1)?)),
                    )?;
                    finish(cx, &id, "dead", used, Some("deadline"), keep)?;
                    cx.event(&id, "dead", json!({ "reason": "deadline" }))?;
                    recorded.ended(JobState::Dead);
                    ended = true;
                }
                Found::Due(seq, job) => claimed.push(claim_one(cx, seq, job, expires, p)?),
            }
        }
        if !full || !progressed || rounds == CLAIM_ROUNDS {
            bounded = full && progressed && rounds == CLAIM_ROUNDS;
            break;
        }
    }
    let wake = bounded && ended && (claimed.len() as u32) < p.limit;
    Ok((Recording::new(claimed, recorded), wake))
}

/// A candidate row as its claim answers it, under a new lease ending at
/// `expires`.
fn candidate(r: &rusqlite::Row, id: String, expires: i64) -> Result<ClaimedJob> {
    let c = Cols::new(r, "idemq_jobs", format!("job {id}"));
    Ok(ClaimedJob {
        job_type: c.at(4, "type")?,
        queue: c.at(5, "queue")?,
        payload: c.json_at(6, "payload", "payload")?,
        attempt: c.at(7, "attempt")?,
        max_attempts: c.at(8, "max_attempts")?,
        lease_token: LeaseToken::new(lease_token()),
        lease_expires_at: ts(expires)?,
        timeout_ms: c.at(9, "timeout_ms")?,
        deadline: c.opt_time_at(3, "deadline")?,
        tags: c.json_at(10, "tags", "tag list")?,
        id,
    })
}

/// A new lease token: 128 bits of the thread's CSPRNG (`rand`'s
/// `ThreadRng`: ChaCha12, seeded and reseeded from the operating system),
/// written as the 32 hex digits of a version-4 UUID as `Uuid::new_v4`
/// writes them, without a system call per token.
fn lease_token() -> String {
    let mut hex = [0u8; uuid::fmt::Simple::LENGTH];
    uuid::Builder::from_random_bytes(rand::random())
        .into_uuid()
        .simple()
        .encode_lower(&mut hex)
        .to_owned()
}

/// Leases the candidate `job` (row `seq`) by its claim.
fn claim_one(cx: &Cx, seq: i64, job: ClaimedJob, expires: i64, p: &JobClaim) -> Result<ClaimedJob> {
    // The update only: the candidate query read what the claim answers.
    // SQLite runs `UPDATE … RETURNING` through an ephemeral table per
    // statement, which cost a claim more than its update (perf of a drain).
    let changed = cx
        .db
        .prepare_cached(
            "UPDATE idemq_jobs SET state = 'active', attempt = attempt + 1, lease_token = ?2,
               lease_expires_at = ?3, lease_ms = ?4, worker = ?5, started_at = ?6, updated_at = ?6,
               claim_seq = ?7
             WHERE seq = ?1",
        )?
        .execute(params![
            seq,
            job.lease_token.as_str(),
            expires,
            p.lease_ms,
            p.worker,
            cx.now,
            cx.next_seq()?
        ])?;
    if changed != 1 {
        return Err(Error::job_not_found(&job.id));
    }
    // The attempt's run and `claimed` event are derived from the row until
    // the attempt ends other than completed (end_attempt).
    Ok(job)
}

/// Renews the lease, and says whether the job went back to waiting (an
/// attempt that ran past its timeout, ended here, is retried): the store
/// then wakes the claims.
/// A heartbeat, and whether it sent the job back to wait (its attempt
/// ended past its timeout).
pub(super) fn heartbeat(cx: &Cx, lease: &LeaseRef) -> Result<(Recording<Result<Heartbeat>>, bool)> {
    let Some(a) = load_active(cx, lease)? else {
        return Ok((Recording::only(Err(lease_lost(lease))), false));
    };
    // The server enforces the timeout and the deadline for workers it cannot
    // interrupt: a heartbeat past either records the attempt so.
    let ends = if cx.now >= a.started_at + a.timeout_ms * 1000 {
        Some(End::TimedOut)
    } else if a.deadline.is_some_and(|d| cx.now >= d) {
        Some(End::DeadlinePassed)
    } else {
        None
    };
    if let Some(end) = ends {
        let next = end_attempt(cx, &a, end)?;
        let mut recorded = Recorded::default();
        recorded.ended(next.state);
        let lost = Recording::new(Err(lease_lost(lease)), recorded);
        return Ok((lost, !next.state.is_terminal()));
    }
    let expires = cx.now + a.lease_ms * 1000;
    cx.db
        .prepare_cached("UPDATE idemq_jobs SET lease_expires_at = ?2 WHERE id = ?1")?
        .execute(params![a.id, expires])?;
    Ok((
        Recording::only(Ok(Heartbeat {
            lease_expires_at: ts(expires)?,
            cancel_requested: a.cancel_requested,
        })),
        false,
    ))
}

/// A completion of the current lease in one statement: the row moves as
/// [`end_attempt`] moves it on `End::Completed` (the attempt consumed, its
/// worker, start and claim number kept, the completion numbered
/// `done_seq`), without reading the attempt first. A row whose
/// `attempts_used` or `keep_ms` is not an integer (a broken row) is left
/// to the full path, which decodes it strictly.
const COMPLETE_LEASED: &str = "UPDATE idemq_jobs SET state = 'completed', result = ?3,
       finished_at = ?4, purge_after = ?4 + coalesce(keep_ms, ?5) * 1000,
       lease_token = NULL, lease_expires_at = NULL, lease_ms = NULL, updated_at = ?4,
       attempts_used = attempts_used + 1, done_seq = ?6
     WHERE id = ?1 AND state = 'active' AND lease_token = ?2
       AND typeof(attempts_used) = 'integer' AND typeof(keep_ms) IN ('integer', 'null')";

pub(super) fn complete(cx: &Cx, p: &JobComplete) -> Result<Result<()>> {
    let done = cx.next_seq_if(|seq| {
        let changed = cx.db.prepare_cached(COMPLETE_LEASED)?.execute(params![
            p.lease.job_id,
            p.lease.lease_token,
            p.result,
            cx.now,
            crate::request::defaults::KEEP_COMPLETED_MS,
            seq
        ])?;
        Ok(changed == 1)
    })?;
    if done {
        return Ok(Ok(()));
    }
    // Not the current lease (or a broken row): the full path answers.
    let Some(a) = load_active(cx, &p.lease)? else {
        return Ok(Err(lease_lost(&p.lease)));
    };
    end_attempt(cx, &a, End::Completed(p.result.as_deref()))?;
    Ok(Ok(()))
}

pub(super) fn fail(cx: &Cx, p: &JobFail) -> Result<Result<FailOutcome>> {
    let Some(a) = load_active(cx, &p.lease)? else {
        return Ok(Err(lease_lost(&p.lease)));
    };
    let end = match p.snooze_ms {
        Some(ms) => End::Snoozed(ms),
        None => End::Failed {
            error: &p.error,
            retryable: p.retryable,
            retry_after_ms: p.retry_after_ms,
        },
    };
    Ok(Ok(end_attempt(cx, &a, end)?))
}

pub(super) fn release(cx: &Cx, lease: &LeaseRef) -> Result<Result<JobState>> {
    let Some(a) = load_active(cx, lease)? else {
        return Ok(Err(lease_lost(lease)));
    };
    Ok(Ok(end_attempt(cx, &a, End::Released)?.state))
}

pub(super) fn checkpoint_put(cx: &Cx, p: &CheckpointPut) -> Result<Result<bool>> {
    if load_active(cx, &p.lease)?.is_none() {
        return Ok(Err(lease_lost(&p.lease)));
    }
    let stored = cx
        .db
        .prepare_cached(
            "INSERT OR IGNORE INTO idemq_checkpoints (job_id, name, value, created_at)
             VALUES (?1, ?2, ?3, ?4)",
        )?
        .execute(params![p.lease.job_id, p.name, p.value, cx.now])?
        == 1;
    if stored {
        cx.event(&p.lease.job_id, "checkpointed", json!({ "name": p.name }))?;
    }
    Ok(Ok(stored))
}
