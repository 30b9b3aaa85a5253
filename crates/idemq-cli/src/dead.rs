//! `idemq dead list|redrive`: the dead letters.

use clap::Subcommand;
use idemq::RedriveOptions;
use idemq::{JobList, JobState, Queue};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::CliError;
use crate::enqueue::read_key;
use crate::output;

/// `idemq dead …`
#[derive(Subcommand, Debug)]
pub enum DeadCommand {
    /// List dead jobs, newest first, with their last error.
    List {
        /// Only this queue.
        #[arg(long)]
        queue: Option<String>,
        /// Only this job type.
        #[arg(long = "type")]
        job_type: Option<String>,
        /// Page size (1–1000).
        #[arg(long, default_value_t = 50)]
        limit: u32,
        /// The cursor printed by the previous page.
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Put dead jobs back to ready (same id, `max_attempts` more attempts).
    Redrive {
        /// The dead job to redrive.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<String>,
        /// Redrive every dead job (of --queue, if given).
        #[arg(long)]
        all: bool,
        /// With --all: only this queue.
        #[arg(long, requires = "all")]
        queue: Option<String>,
        /// A key that makes the redrive request itself idempotent (24 h).
        #[arg(long, conflicts_with_all = ["idempotency_key_file", "all"])]
        idempotency_key: Option<String>,
        /// Read that key from a file (`-` for stdin); one trailing newline is dropped.
        #[arg(long, value_name = "PATH", conflicts_with = "all")]
        idempotency_key_file: Option<String>,
        /// Attempts granted by the redrive (1–1000; default the job's own budget).
        #[arg(long)]
        max_attempts: Option<i64>,
        /// Forget the job's checkpoints, so every step runs again.
        #[arg(long)]
        reset_checkpoints: bool,
    },
}

/// Runs `idemq dead …`.
pub async fn run(queue: &Queue, cmd: DeadCommand, json: bool) -> Result<(), CliError> {
    match cmd {
        DeadCommand::List {
            queue: q,
            job_type,
            limit,
            cursor,
        } => {
            let page = queue
                .list(JobList {
                    state: Some(JobState::Dead),
                    queue: q,
                    job_type,
                    tag: None,
                    limit,
                    cursor,
                })
                .await?;
            output::line(json, &page, || {
                let mut out = vec![format!(
                    "{:<36}  {:<24}  {:<12}  {:>7}  {:<25}  LAST_ERROR",
                    "ID", "TYPE", "QUEUE", "ATTEMPT", "DIED_AT"
                )];
                for j in &page.jobs {
                    let error = one_line(j.last_error.as_deref().unwrap_or(""));
                    out.push(format!(
                        "{:<36}  {:<24}  {:<12}  {:>7}  {:<25}  {}",
                        j.id,
                        j.job_type,
                        j.queue,
                        format!("{}/{}", j.attempts_used, j.max_attempts),
                        j.finished_at.map(|f| f.to_rfc3339()).unwrap_or_default(),
                        truncate(&error, 80)
                    ));
                }
                if page.jobs.is_empty() {
                    out.push("(no dead jobs)".into());
                }
                if let Some(c) = &page.next_cursor {
                    out.push(format!("more: --cursor {c}"));
                }
                out.join("\n")
            });
            Ok(())
        }
        DeadCommand::Redrive {
            id,
            all,
            queue: q,
            idempotency_key,
            idempotency_key_file,
            max_attempts,
            reset_checkpoints,
        } => {
            if all {
                return redrive_all(queue, q, max_attempts, reset_checkpoints, json).await;
            }
            let id = id.ok_or_else(|| CliError::Usage("name a job id, or pass --all".into()))?;
            let key = read_key(idempotency_key, idempotency_key_file.as_deref())?;
            let r = queue
                .redrive(
                    &id,
                    RedriveOptions {
                        idempotency_key: key,
                        max_attempts,
                        reset_checkpoints,
                        ..RedriveOptions::default()
                    },
                )
                .await?;
            output::line(json, &r, || match r.outcome {
                idemq::Outcome::Replayed => format!(
                    "replayed {}: this redrive request was already made; nothing changed",
                    r.job_id
                ),
                _ => format!("redriven {}: it is ready again", r.job_id),
            });
            Ok(())
        }
    }
}

/// An error on one line: its first line and, when it has more, its last
/// (an `--exec` worker's error is a status line and the output's tail).
fn one_line(error: &str) -> String {
    let mut lines = error.lines().map(str::trim).filter(|l| !l.is_empty());
    match (lines.next(), lines.next_back()) {
        (Some(first), Some(last)) => format!("{first} … {last}"),
        (Some(first), None) => first.to_owned(),
        _ => String::new(),
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let cut: String = s.chars().take(max.saturating_sub(1)).collect();
        format!("{cut}…")
    }
}

async fn redrive_all(
    queue: &Queue,
    q: Option<String>,
    max_attempts: Option<i64>,
    reset_checkpoints: bool,
    json: bool,
) -> Result<(), CliError> {
    // Collect first: redriven jobs leave the dead state under the cursor.
    let mut ids = Vec::new();
    let mut cursor = None;
    loop {
        let page = queue
            .list(JobList {
                state: Some(JobState::Dead),
                queue: q.clone(),
                job_type: None,
                tag: None,
                limit: 1000,
                cursor,
            })
            .await?;
        ids.extend(page.jobs.into_iter().map(|j| j.id));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(ids.len() as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} redriven {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let (mut redriven, mut skipped) = (0u64, Vec::new());
    for id in &ids {
        let options = RedriveOptions {
            max_attempts,
            reset_checkpoints,
            ..RedriveOptions::default()
        };
        match queue.redrive(id, options).await {
            Ok(_) => redriven += 1,
            // Someone else redrove or purged it meanwhile.
            Err(idemq::Error::NotDead { .. } | idemq::Error::NotFound { .. }) => {
                skipped.push(id.clone());
            }
            Err(e) => {
                bar.abandon();
                return Err(e.into());
            }
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let value = json!({"redriven": redriven, "skipped": skipped, "queue": q});
    output::line(json, &value, || {
        let scope = q
            .as_deref()
            .map(|q| format!(" of queue {q}"))
            .unwrap_or_default();
        let mut s = format!("redrove {redriven} dead job(s){scope}");
        if !skipped.is_empty() {
            s.push_str(&format!(
                "; {} were no longer dead and were skipped",
                skipped.len()
            ));
        }
        s
    });
    Ok(())
}
