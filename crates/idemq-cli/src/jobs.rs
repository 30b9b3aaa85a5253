//! `idemq jobs list|show`.

use clap::Subcommand;
use idemq::{JobList, JobState, Queue};
use serde_json::json;

use crate::CliError;
use crate::output;

/// `idemq jobs …`
#[derive(Subcommand, Debug)]
pub enum JobsCommand {
    /// List jobs, newest first.
    List {
        /// scheduled, ready, active, completed, dead or cancelled.
        #[arg(long)]
        state: Option<String>,
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this job type.
        #[arg(long = "type")]
        job_type: Option<String>,
        /// Only jobs with this tag.
        #[arg(long)]
        tag: Option<String>,
        /// Page size (1–1000).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// The cursor printed by the previous page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show one job with its events, runs and checkpoints.
    Show {
        /// The job id.
        id: String,
    },
}

/// Runs `idemq jobs …`.
pub async fn run(queue: &Queue, cmd: JobsCommand, json: bool) -> Result<(), CliError> {
    match cmd {
        JobsCommand::List {
            state,
            queue: q,
            job_type,
            tag,
            limit,
            cursor,
        } => {
            let state = match state {
                None => None,
                Some(s) => Some(JobState::parse(&s).ok_or_else(|| {
                    CliError::Usage(format!(
                        "unknown state {s}: use scheduled, ready, active, completed, dead or cancelled"
                    ))
                })?),
            };
            let page = queue
                .list(JobList {
                    state,
                    queue: q,
                    job_type,
                    tag,
                    limit,
                    cursor,
                })
                .await?;
            output::line(json, &page, || {
                let mut out = vec![format!(
                    "{:<36}  {:<9}  {:<24}  {:<12}  {:>7}  RUN_AT",
                    "ID", "STATE", "TYPE", "QUEUE", "ATTEMPT"
                )];
                for j in &page.jobs {
                    out.push(format!(
                        "{:<36}  {:<9}  {:<24}  {:<12}  {:>7}  {}",
                        j.id,
                        j.state.as_str(),
                        j.job_type,
                        j.queue,
                        format!("{}/{}", j.attempt, j.max_attempts),
                        j.run_at.to_rfc3339()
                    ));
                }
                if page.jobs.is_empty() {
                    out.push("(no jobs)".into());
                }
                if let Some(c) = &page.next_cursor {
                    out.push(format!("more: --cursor {c}"));
                }
                out.join("\n")
            });
        }
        JobsCommand::Show { id } => {
            let job = queue
                .get(&id)
                .await?
                .ok_or_else(|| idemq::Error::job_not_found(&id))?;
            let events = queue.events(&id).await?;
            let runs = queue.runs(&id).await?;
            let checkpoints = queue.checkpoints(&id).await?;
            let all =
                json!({"job": job, "events": events, "runs": runs, "checkpoints": checkpoints});
            output::line(json, &all, || {
                let mut out = vec![];
                let field = |k: &str, v: String| format!("{k:>16}: {v}");
                out.push(field("id", job.id.clone()));
                out.push(field("type", job.job_type.clone()));
                out.push(field("queue", job.queue.clone()));
                out.push(field("state", job.state.to_string()));
                out.push(field(
                    "attempt",
                    format!(
                        "{} ({} used of {})",
                        job.attempt, job.attempts_used, job.max_attempts
                    ),
                ));
                out.push(field("priority", job.priority.to_string()));
                out.push(field("run_at", job.run_at.to_rfc3339()));
                out.push(field("created_at", job.created_at.to_rfc3339()));
                if let Some(f) = job.finished_at {
                    out.push(field("finished_at", f.to_rfc3339()));
                }
                if let Some(d) = job.deadline {
                    out.push(field("deadline", d.to_rfc3339()));
                }
                if !job.tags.is_empty() {
                    out.push(field("tags", job.tags.join(", ")));
                }
                if let Some(k) = &job.idempotency {
                    let until = k.expires_at.map_or_else(
                        || "released or expired".into(),
                        |e| format!("bound until {}", e.to_rfc3339()),
                    );
                    out.push(field(
                        "idempotency",
                        format!(
                            "{} in scope {} (digest {}), {until}",
                            k.key_preview, k.scope, k.key_digest
                        ),
                    ));
                }
                if let Some(d) = &job.dedupe {
                    let holds = if d.holds_binding {
                        "holds the key"
                    } else {
                        "no longer holds the key"
                    };
                    out.push(field(
                        "dedupe",
                        format!("{} ({}), {holds}", d.key, d.mode.as_str()),
                    ));
                }
                if let Some(e) = &job.last_error {
                    out.push(field("last_error", e.clone()));
                }
                out.push(field("payload", job.payload.to_string()));
                if let Some(r) = &job.result {
                    out.push(field("result", r.to_string()));
                }
                out.push(String::new());
                out.push("events:".into());
                for e in &events {
                    out.push(format!(
                        "  {}  {:<16} {}",
                        e.at.to_rfc3339(),
                        e.kind,
                        e.data
                    ));
                }
                if !runs.is_empty() {
                    out.push("runs:".into());
                    for r in &runs {
                        out.push(format!(
                            "  #{} by {} at {}: {}{}",
                            r.attempt,
                            r.worker,
                            r.started_at.to_rfc3339(),
                            r.outcome.as_deref().unwrap_or("running"),
                            r.error
                                .as_ref()
                                .map(|e| format!(" ({e})"))
                                .unwrap_or_default()
                        ));
                    }
                }
                if !checkpoints.is_empty() {
                    out.push("checkpoints:".into());
                    for (name, v) in &checkpoints {
                        out.push(format!("  {name} = {v}"));
                    }
                }
                out.join("\n")
            });
        }
    }
    Ok(())
}
