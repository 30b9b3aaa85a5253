//! Operator actions on one job or one queue: `cancel`, `cancel-by-key`,
//! `purge`, `promote`, `pause`, `resume`.
//!
//! Each prints what happened; `changed` (in `--json`) says whether anything
//! changed. An unknown job exits 4; an action that changes nothing (cancel
//! of a finished job, promote of a job that is not scheduled, purge of an
//! active job) exits 0 and says why.

use clap::Args;
use idemq::{JobState, Queue};
use serde_json::json;

use crate::CliError;
use crate::output;

/// A job id.
#[derive(Args, Debug)]
pub struct JobIdArg {
    /// The job id.
    id: String,
}

/// A queue name.
#[derive(Args, Debug)]
pub struct QueueArg {
    /// The queue name.
    queue: String,
}

/// Flags of `idemq cancel-by-key`.
#[derive(Args, Debug)]
pub struct CancelByKeyArgs {
    /// The job type the dedupe key belongs to.
    #[arg(long = "type", value_name = "TYPE")]
    job_type: String,
    /// The dedupe key.
    #[arg(long)]
    key: String,
}

/// `idemq cancel ID`: waiting jobs turn cancelled at once; an active job is
/// flagged and stops at its next heartbeat.
pub async fn cancel(queue: &Queue, a: JobIdArg, json: bool) -> Result<(), CliError> {
    let o = queue.cancel(&a.id).await?;
    let value =
        json!({"job_id": a.id, "changed": o.cancelled, "cancelled": o.cancelled, "state": o.state});
    output::line(json, &value, || match (o.cancelled, o.state) {
        (true, JobState::Active) => format!(
            "cancel requested for {}: it is running and stops at its next heartbeat",
            a.id
        ),
        (true, _) => format!("cancelled {}", a.id),
        (false, s) => format!("{} is already {s}; nothing changed", a.id),
    });
    Ok(())
}

/// `idemq cancel-by-key --type T --key K`.
pub async fn cancel_by_key(queue: &Queue, a: CancelByKeyArgs, json: bool) -> Result<(), CliError> {
    let changed = queue.cancel_by_key(&a.job_type, &a.key).await?;
    let value = json!({"type": a.job_type, "key": a.key, "changed": changed});
    output::line(json, &value, || {
        if changed {
            format!(
                "cancelled the pending {} job(s) with dedupe key {} and released the key",
                a.job_type, a.key
            )
        } else {
            format!(
                "no pending {} job holds dedupe key {}; nothing changed",
                a.job_type, a.key
            )
        }
    });
    Ok(())
}

/// `idemq purge ID`.
pub async fn purge(queue: &Queue, a: JobIdArg, json: bool) -> Result<(), CliError> {
    if queue.purge(&a.id).await? {
        let value = json!({"job_id": a.id, "changed": true});
        output::line(json, &value, || {
            format!("purged {} with its events, runs and checkpoints", a.id)
        });
        return Ok(());
    }
    // Nothing purged: say why.
    let job = queue
        .get(&a.id)
        .await?
        .ok_or_else(|| idemq::Error::job_not_found(&a.id))?;
    let value = json!({"job_id": a.id, "changed": false, "state": job.state});
    output::line(json, &value, || {
        format!(
            "{} is {}; an active job cannot be purged (cancel it first); nothing changed",
            a.id, job.state
        )
    });
    Ok(())
}

/// `idemq promote ID`.
pub async fn promote(queue: &Queue, a: JobIdArg, json: bool) -> Result<(), CliError> {
    let changed = queue.promote(&a.id).await?;
    let state = if changed {
        None
    } else {
        queue.get(&a.id).await?.map(|j| j.state)
    };
    let value = json!({"job_id": a.id, "changed": changed, "state": state});
    output::line(json, &value, || match state {
        None => format!("promoted {}: it is due now", a.id),
        Some(s) => format!("{} is {s}, not scheduled; nothing changed", a.id),
    });
    Ok(())
}

/// `idemq pause QUEUE` / `idemq resume QUEUE`.
pub async fn pause(queue: &Queue, a: QueueArg, paused: bool, json: bool) -> Result<(), CliError> {
    let before = queue
        .queues()
        .await?
        .into_iter()
        .find(|q| q.name == a.queue)
        .is_some_and(|q| q.paused);
    if paused {
        queue.pause(&a.queue).await?;
    } else {
        queue.resume(&a.queue).await?;
    }
    let value = json!({"queue": a.queue, "paused": paused, "changed": before != paused});
    output::line(json, &value, || match (paused, before == paused) {
        (true, false) => format!(
            "paused queue {}: enqueues are still accepted, workers skip it",
            a.queue
        ),
        (true, true) => format!("queue {} was already paused", a.queue),
        (false, false) => format!("resumed queue {}", a.queue),
        (false, true) => format!("queue {} was not paused", a.queue),
    });
    Ok(())
}
