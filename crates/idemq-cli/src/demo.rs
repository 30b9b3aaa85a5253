//! `idemq demo`: a narrated run of what idemq promises, on the database the
//! command names (the embedded SQLite file by default), with a worker in
//! this process. Its jobs stay in queue `demo` for the dashboard.

use std::collections::BTreeMap;
use std::time::Duration;

use clap::Args;
use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{
    DedupeOptions, EnqueueRequest, IdempotencyOptions, JobState, Outcome, Queue, RetryPolicy,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use crate::CliError;

const QUEUE: &str = "demo";

/// Flags of `idemq demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Requests in the debounce burst.
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u32).range(2..=1000))]
    burst: u32,
}

/// One line of the closing table.
struct Row {
    scenario: &'static str,
    requests: usize,
    outcomes: String,
    job_id: Option<String>,
}

/// Prints narration unless `--json` asked for the summary only.
struct Narrator {
    quiet: bool,
}

impl Narrator {
    fn say(&self, text: impl AsRef<str>) {
        if !self.quiet {
            println!("{}", text.as_ref());
        }
    }
}

/// Counts outcomes as `accepted, replayed ×2`.
fn tally(outcomes: &[Outcome]) -> String {
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for o in outcomes {
        match counts.iter_mut().find(|(k, _)| *k == o.as_str()) {
            Some((_, n)) => *n += 1,
            None => counts.push((o.as_str(), 1)),
        }
    }
    counts
        .iter()
        .map(|(k, n)| {
            if *n == 1 {
                (*k).to_owned()
            } else {
                format!("{k} ×{n}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Waits until job `id` is in one of `states` (at most 30 s).
async fn wait_for(queue: &Queue, id: &str, states: &[JobState]) -> Result<JobState, CliError> {
    let start = tokio::time::Instant::now();
    loop {
        let job = queue
            .get(id)
            .await?
            .ok_or_else(|| idemq::Error::job_not_found(id))?;
        if states.contains(&job.state) {
            return Ok(job.state);
        }
        if start.elapsed() > Duration::from_secs(30) {
            return Err(CliError::Lib(idemq::Error::Backend {
                message: format!(
                    "demo job {id} is still {} after 30 s (is queue {QUEUE} paused?)",
                    job.state
                ),
            }));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn demo_worker(queue: Queue) -> Worker {
    let ok = |_c: HandlerContext, _p: Value| async move { Ok::<_, JobError>(json!({"ok": true})) };
    Worker::new(queue)
        .name(format!("idemq-demo-{}", std::process::id()))
        .queues([QUEUE])
        .poll_interval(Duration::from_millis(100))
        .maintenance(false)
        .handle("demo.order.place", ok)
        .handle("demo.webhook.stripe", ok)
        .handle("demo.search.reindex", ok)
        .handle(
            "demo.email.send",
            |ctx: HandlerContext, _p: Value| async move {
                // The mail server refuses the first two attempts; the job runs
                // out of attempts and goes dead until an operator redrives it.
                if ctx.attempt() <= 2 {
                    return Err(JobError::retryable(format!(
                        "451 4.3.0 mailbox busy (attempt {})",
                        ctx.attempt()
                    )));
                }
                Ok(json!({"sent": true, "attempt": ctx.attempt()}))
            },
        )
}

/// Runs `idemq demo`.
pub async fn run(
    queue: &Queue,
    database: &str,
    args: DemoArgs,
    json: bool,
) -> Result<(), CliError> {
    let n = Narrator { quiet: json };
    let run = format!("{:x}", chrono::Utc::now().timestamp_millis());
    n.say(format!(
        "idemq demo: each piece of work is accepted once\n  database {}  (run {run}; jobs go to queue `{QUEUE}`)\n",
        crate::redact(database)
    ));
    let (stop, stopped) = oneshot::channel::<()>();
    let worker = tokio::spawn(demo_worker(queue.clone()).run(async move {
        let _ = stopped.await;
    }));
    let mut rows = Vec::new();

    // 1. A double-click.
    n.say("1/5  A customer double-clicks \"Place order\": two requests, one idempotency key");
    let order_key = format!("order-submit:cust-17:cart-42:{run}");
    let order = EnqueueRequest::new("demo.order.place")
        .queue(QUEUE)
        .payload(json!({"customer": "cust-17", "cart": "cart-42", "total_cents": 4200}))
        .idempotency_key(&order_key);
    let first = queue.enqueue_with_result(order.clone()).await?;
    n.say(format!(
        "     click 1 -> {:<9} job {}",
        first.outcome.as_str(),
        first.job_id
    ));
    let second = queue.enqueue_with_result(order.clone()).await?;
    n.say(format!(
        "     click 2 -> {:<9} job {}  (the same job; nothing was written)",
        second.outcome.as_str(),
        second.job_id
    ));
    rows.push(Row {
        scenario: "double-click",
        requests: 2,
        outcomes: tally(&[first.outcome, second.outcome]),
        job_id: Some(first.job_id.clone()),
    });

    // 2. The same key with other fields.
    n.say("\n2/5  The same key arrives with another total: a bug, not a repeat");
    let changed =
        order.payload(json!({"customer": "cust-17", "cart": "cart-42", "total_cents": 9900}));
    let conflict = match queue.enqueue_with_result(changed).await {
        Err(idemq::Error::EnqueueIdempotencyConflict(c)) => c,
        Ok(r) => {
            return Err(CliError::Lib(idemq::Error::Backend {
                message: format!("expected an idempotency conflict, got {}", r.outcome),
            }));
        }
        Err(e) => return Err(e.into()),
    };
    n.say(format!(
        "     refused: idempotency conflict with job {} on fields [{}]\n     (nothing was written; the CLI exits 3 and never prints the raw key, only {})",
        conflict.job_id,
        conflict.fields.join(", "),
        conflict.key_preview.as_deref().unwrap_or("a preview")
    ));
    rows.push(Row {
        scenario: "conflict",
        requests: 1,
        outcomes: format!("conflict on {}", conflict.fields.join(", ")),
        job_id: None,
    });

    // 3. A webhook redelivery.
    n.say("\n3/5  A payment provider delivers the same webhook three times");
    let event = format!("evt_{run}");
    let hook = EnqueueRequest::new("demo.webhook.stripe")
        .queue(QUEUE)
        .payload(json!({"event": event, "type": "invoice.paid", "invoice": "in_42"}))
        .idempotency(IdempotencyOptions::new(&event).scope("stripe-webhooks"));
    let mut outcomes = Vec::new();
    let mut hook_job = String::new();
    for i in 1..=3 {
        let r = queue.enqueue_with_result(hook.clone()).await?;
        n.say(format!(
            "     delivery {i} -> {:<9} job {}",
            r.outcome.as_str(),
            r.job_id
        ));
        outcomes.push(r.outcome);
        hook_job = r.job_id;
    }
    rows.push(Row {
        scenario: "webhook redelivery",
        requests: 3,
        outcomes: tally(&outcomes),
        job_id: Some(hook_job.clone()),
    });

    // 4. A debounce burst.
    n.say(format!(
        "\n4/5  A burst of {} \"reindex account 7\" requests, debounced for 2 s",
        args.burst
    ));
    let bar = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(u64::from(args.burst))
    };
    bar.set_style(
        ProgressStyle::with_template("     {bar:30} {pos}/{len} enqueued")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut outcomes = Vec::new();
    let mut jobs = BTreeMap::new();
    for _ in 0..args.burst {
        let r = queue
            .enqueue_with_result(
                EnqueueRequest::new("demo.search.reindex")
                    .queue(QUEUE)
                    .payload(json!({"account": 7}))
                    .dedupe(
                        DedupeOptions::key(format!("acct-7:{run}"))
                            .ttl(Duration::from_secs(2))
                            .extend(),
                    ),
            )
            .await?;
        outcomes.push(r.outcome);
        *jobs.entry(r.job_id).or_insert(0) += 1;
        bar.inc(1);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bar.finish_and_clear();
    let burst_job = jobs.keys().next().cloned().unwrap_or_default();
    n.say(format!(
        "     {} request(s) -> {} job(s): {}",
        args.burst,
        jobs.len(),
        tally(&outcomes)
    ));
    rows.push(Row {
        scenario: "debounce burst",
        requests: args.burst as usize,
        outcomes: tally(&outcomes),
        job_id: Some(burst_job),
    });

    // 5. A dead letter and its redrive.
    n.say("\n5/5  An email whose mail server keeps refusing it: a dead letter, then a redrive");
    let email = queue
        .enqueue(
            EnqueueRequest::new("demo.email.send")
                .queue(QUEUE)
                .payload(json!({"to": "cust-17@example.com", "template": "receipt"}))
                .max_attempts(2)
                .retry(RetryPolicy::Fixed { delay_ms: 200 }),
        )
        .await?;
    let spinner = if json {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    spinner.set_message("the worker is trying to send it…");
    spinner.enable_steady_tick(Duration::from_millis(80));
    wait_for(queue, &email, &[JobState::Dead]).await?;
    spinner.finish_and_clear();
    let dead = queue
        .get(&email)
        .await?
        .ok_or_else(|| idemq::Error::job_not_found(&email))?;
    n.say(format!(
        "     job {} is dead after {} attempts: {}",
        email,
        dead.attempts_used,
        dead.last_error.as_deref().unwrap_or("")
    ));
    let redriven = queue
        .redrive(
            &email,
            idemq::RedriveOptions {
                idempotency_key: Some(format!("redrive:{email}")),
                ..Default::default()
            },
        )
        .await?;
    n.say(format!(
        "     an operator redrives it (idemq dead redrive {}): {}",
        email,
        match redriven.outcome {
            Outcome::Replayed => "already redriven",
            _ => "ready again, same id",
        }
    ));
    wait_for(queue, &email, &[JobState::Completed]).await?;
    let done = queue
        .get(&email)
        .await?
        .ok_or_else(|| idemq::Error::job_not_found(&email))?;
    n.say(format!("     attempt {} -> {}", done.attempt, done.state));
    rows.push(Row {
        scenario: "dead letter",
        requests: 1,
        outcomes: "dead, redriven".into(),
        job_id: Some(email.clone()),
    });

    // Let the worker finish the rest, then stop it.
    for id in rows.iter().filter_map(|r| r.job_id.clone()) {
        wait_for(
            queue,
            &id,
            &[JobState::Completed, JobState::Dead, JobState::Cancelled],
        )
        .await?;
    }
    let _ = stop.send(());
    let _ = worker.await;

    let mut table = Vec::new();
    for r in &rows {
        let state = match &r.job_id {
            Some(id) => queue.get(id).await?.map(|j| j.state.to_string()),
            None => None,
        };
        table.push(json!({
            "scenario": r.scenario,
            "requests": r.requests,
            "jobs": usize::from(r.job_id.is_some()),
            "outcomes": r.outcomes,
            "job_id": r.job_id,
            "state": state,
        }));
    }
    let dashboard = serve_hint(database);
    if json {
        println!(
            "{}",
            json!({"run": run, "queue": QUEUE, "scenarios": table, "dashboard": dashboard})
        );
        return Ok(());
    }
    println!(
        "\n{:<20} {:>8} {:>4}  {:<24} {:<36}  STATE",
        "SCENARIO", "REQUESTS", "JOBS", "OUTCOMES", "JOB"
    );
    for t in &table {
        println!(
            "{:<20} {:>8} {:>4}  {:<24} {:<36}  {}",
            t["scenario"].as_str().unwrap_or(""),
            t["requests"].as_u64().unwrap_or(0),
            t["jobs"].as_u64().unwrap_or(0),
            t["outcomes"].as_str().unwrap_or(""),
            t["job_id"].as_str().unwrap_or("-"),
            t["state"].as_str().unwrap_or("-"),
        );
    }
    println!(
        "\nEvery job, its events and its runs are in the dashboard:\n  {dashboard}\n  then open http://127.0.0.1:8080/ (or: idemq jobs list --queue {QUEUE})"
    );
    Ok(())
}

/// The command that serves the dashboard of `database`.
fn serve_hint(database: &str) -> String {
    if database == "sqlite://idemq.db" {
        "idemq serve".into()
    } else {
        format!("idemq serve --database {}", crate::redact(database))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tally_counts_outcomes_in_order() {
        assert_eq!(
            tally(&[Outcome::Accepted, Outcome::Replayed, Outcome::Replayed]),
            "accepted, replayed ×2"
        );
    }
}
