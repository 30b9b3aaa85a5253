//! `idemq schedules list|set|delete`: cron and interval schedules. They
//! fire in the maintenance loop of `idemq serve` and of workers.

use std::time::Duration;

use clap::{ArgGroup, Subcommand};
use idemq::{EnqueueRequest, Queue, ScheduleDefinition};
use serde_json::{Value, json};

use crate::CliError;
use crate::enqueue::ms;
use crate::output;

/// `idemq schedules …`
#[derive(Subcommand, Debug)]
pub enum SchedulesCommand {
    /// List every schedule with its next fire.
    List,
    /// Create or replace a schedule.
    #[command(group(ArgGroup::new("timing").required(true).args(["cron", "every"])))]
    Set {
        /// The schedule's name: 1–128 bytes of [A-Za-z0-9._:-].
        name: String,
        /// A cron expression of six fields, seconds first: "0 */5 * * * *".
        #[arg(long)]
        cron: Option<String>,
        /// The IANA time zone of --cron (default UTC).
        #[arg(long, requires = "cron")]
        timezone: Option<String>,
        /// A fixed interval (≥ 1s), anchored at the schedule's creation: 30s, 5m, 1h.
        #[arg(long, value_parser = humantime::parse_duration)]
        every: Option<Duration>,
        /// The job type each tick enqueues.
        #[arg(long = "type", value_name = "TYPE")]
        job_type: String,
        /// The payload as JSON (default null).
        #[arg(long)]
        payload: Option<String>,
        /// The queue (default `default`).
        #[arg(long)]
        queue: Option<String>,
        /// Create it paused: it does not fire until set again without --paused.
        #[arg(long)]
        paused: bool,
    },
    /// Delete a schedule (jobs it already enqueued are not touched).
    Delete {
        /// The schedule's name.
        name: String,
    },
}

/// Runs `idemq schedules …`.
pub async fn run(queue: &Queue, cmd: SchedulesCommand, json: bool) -> Result<(), CliError> {
    match cmd {
        SchedulesCommand::List => {
            let list = queue.schedule_list().await?;
            let (all, unreadable) = (&list.schedules, &list.unreadable);
            output::line(
                json,
                &json!({"schedules": all, "unreadable": unreadable}),
                || {
                    let mut out = vec![format!(
                        "{:<24}  {:<28}  {:<24}  {:<7}  NEXT_FIRE",
                        "NAME", "TIMING", "TYPE", "PAUSED"
                    )];
                    for s in all {
                        let timing = match (&s.cron, s.every_ms) {
                            (Some(c), _) => format!("cron {c} {}", s.timezone),
                            (None, Some(e)) => format!(
                                "every {}",
                                humantime::format_duration(Duration::from_millis(
                                    u64::try_from(e).unwrap_or(0)
                                ))
                            ),
                            (None, None) => String::new(),
                        };
                        out.push(format!(
                            "{:<24}  {:<28}  {:<24}  {:<7}  {}",
                            s.name,
                            timing,
                            s.job.job_type,
                            if s.paused { "yes" } else { "no" },
                            s.next_fire_at
                                .map(|t| t.to_rfc3339())
                                .unwrap_or_else(|| "-".into())
                        ));
                    }
                    for u in unreadable {
                        out.push(format!(
                            "{:<24}  unreadable: {}",
                            u.name.as_deref().unwrap_or("-"),
                            u.error
                        ));
                    }
                    if all.is_empty() && unreadable.is_empty() {
                        out.push("(no schedules)".into());
                    }
                    out.join("\n")
                },
            );
        }
        SchedulesCommand::Set {
            name,
            cron,
            timezone,
            every,
            job_type,
            payload,
            queue: q,
            paused,
        } => {
            let payload: Value = match payload {
                Some(p) => serde_json::from_str(&p)
                    .map_err(|e| CliError::Usage(format!("the payload is not valid JSON: {e}")))?,
                None => Value::Null,
            };
            let mut job = EnqueueRequest::new(job_type).payload(payload);
            job.queue = q;
            let definition = ScheduleDefinition {
                cron,
                every_ms: every.map(ms),
                timezone,
                job,
                paused,
            };
            let created = queue.schedule_set(&name, definition).await?;
            let next = queue
                .schedule_list()
                .await?
                .schedules
                .into_iter()
                .find(|s| s.name == name)
                .and_then(|s| s.next_fire_at);
            let value = json!({"name": name, "created": created, "next_fire_at": next});
            output::line(json, &value, || {
                let verb = if created { "created" } else { "replaced" };
                let when = match (paused, next) {
                    (true, _) => "paused".to_owned(),
                    (false, Some(t)) => format!("next fire {}", t.to_rfc3339()),
                    (false, None) => "no fire to come".to_owned(),
                };
                format!(
                    "{verb} schedule {name} ({when}); it fires in the maintenance loop of `idemq serve` or a worker"
                )
            });
        }
        SchedulesCommand::Delete { name } => {
            let deleted = queue.schedule_delete(&name).await?;
            if !deleted {
                return Err(idemq::Error::NotFound {
                    what: format!("schedule {name}"),
                }
                .into());
            }
            output::line(json, &json!({"name": name, "deleted": true}), || {
                format!("deleted schedule {name}")
            });
        }
    }
    Ok(())
}
