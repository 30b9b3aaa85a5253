//! `idemq`: the command-line tool. It parses, wires and calls the library;
//! the behaviour lives in the `idemq` crate.

mod bench;
mod dead;
mod demo;
mod enqueue;
mod exec;
mod jobs;
mod key_secret;
mod ops;
mod output;
mod schedules;
mod serve;
mod worker;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use idemq::Queue;

/// A durable background-job queue whose promise is: each piece of work is accepted once.
#[derive(Parser, Debug)]
#[command(name = "idemq", version, about)]
struct Cli {
    /// Database URL: sqlite://path/to/file.db (created if missing), sqlite::memory:,
    /// postgres://user:password@host/db or redis://host:port[/db] (install its schema
    /// or functions with `idemq migrate`).
    #[arg(
        long,
        global = true,
        env = "IDEMQ_DATABASE_URL",
        default_value = "sqlite://idemq.db"
    )]
    database: String,

    /// Print JSON instead of text.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

/// Flags of `idemq migrate`.
#[derive(clap::Args, Debug)]
struct MigrateArgs {
    /// Change nothing: report the migrations that would be applied and whether
    /// the database's functions are this binary's; exit 1 if `idemq migrate` has
    /// anything to do, 5 if the schema is newer than this binary (and which idemq
    /// wrote it).
    #[arg(long)]
    check: bool,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create or upgrade the database schema (with --check: only say what it would do).
    Migrate(MigrateArgs),
    /// Enqueue a job (or, with --explain, say what an enqueue would do).
    Enqueue(Box<enqueue::EnqueueArgs>),
    /// Inspect jobs.
    #[command(subcommand)]
    Jobs(jobs::JobsCommand),
    /// Serve the HTTP API and the dashboard, with maintenance (and, with --exec, a shell worker).
    Serve(Box<serve::ServeArgs>),
    /// Run jobs with a shell command: payload on stdin; exit 0 completes, 75 retries.
    Worker(Box<worker::WorkerArgs>),
    /// Cancel a job: waiting jobs at once, a running one at its next heartbeat.
    Cancel(ops::JobIdArg),
    /// Cancel the pending jobs of a type holding a dedupe key, and release the key.
    CancelByKey(ops::CancelByKeyArgs),
    /// Delete a job that is not active, with its events, runs and checkpoints.
    Purge(ops::JobIdArg),
    /// Make a scheduled job due now.
    Promote(ops::JobIdArg),
    /// Pause a queue: enqueues are accepted, workers skip it.
    Pause(ops::QueueArg),
    /// Resume a paused queue.
    Resume(ops::QueueArg),
    /// Dead letters: list and redrive.
    #[command(subcommand)]
    Dead(dead::DeadCommand),
    /// Cron and interval schedules.
    #[command(subcommand)]
    Schedules(schedules::SchedulesCommand),
    /// A narrated tour: replays, a conflict, a webhook redelivery, a debounce burst, a dead letter.
    Demo(demo::DemoArgs),
    /// Measure idemq against the database's own raw limits (fresh databases).
    Bench(Box<bench::BenchArgs>),
    /// The installation's idempotency key secret (IDEMQ_KEY_SECRET): check or change it.
    #[command(subcommand)]
    KeySecret(key_secret::KeySecretCommand),
    /// Kills a shell worker's running commands if the worker dies (started by the worker).
    #[command(hide = true)]
    ExecGuard,
}

/// Exit codes a script can rely on.
pub(crate) mod exit {
    /// Anything else: the backend, I/O.
    pub const FAILURE: u8 = 1;
    /// The request breaks a bound (nothing was written).
    pub const INVALID: u8 = 2;
    /// The idempotency key is bound to a job with other fields (nothing was written).
    pub const CONFLICT: u8 = 3;
    /// The job does not exist.
    pub const NOT_FOUND: u8 = 4;
    /// `migrate --check`: the schema is newer than this binary knows.
    pub const NEWER_SCHEMA: u8 = 5;
}

fn exit_code(e: &idemq::Error) -> u8 {
    match e {
        idemq::Error::Validation { .. } | idemq::Error::PayloadTooLarge { .. } => exit::INVALID,
        idemq::Error::EnqueueIdempotencyConflict(_) => exit::CONFLICT,
        idemq::Error::NotFound { .. } => exit::NOT_FOUND,
        _ => exit::FAILURE,
    }
}

/// Connects with the secret of `IDEMQ_KEY_SECRET`; a process whose key
/// hashing differs from the installation's is refused here.
async fn connect(url: &str) -> idemq::Result<Queue> {
    Queue::connect(url).await
}

async fn run(cli: Cli) -> Result<(), CliError> {
    if let Command::Migrate(MigrateArgs { check: true }) = cli.command {
        let status = Queue::migration_status(&cli.database).await?;
        let newer = status.newer_schema();
        let value = serde_json::json!({
            "current": status.current, "latest": status.latest, "pending": status.pending,
            "functions_current": status.functions_current, "up_to_date": status.is_current(),
            "newer_schema": newer, "written_by": status.written_by,
            "database": redact(&cli.database),
        });
        output::line(cli.json, &value, || {
            if let Some(newer) = &newer {
                format!("{newer} ({})", redact(&cli.database))
            } else if status.is_current() {
                format!(
                    "schema is up to date: version {} ({})",
                    status.current,
                    redact(&cli.database)
                )
            } else {
                let functions = if status.functions_current {
                    String::new()
                } else {
                    "; the functions differ from this idemq's".to_owned()
                };
                format!(
                    "schema is version {}, this idemq expects {}: pending migrations {:?}{functions} \
                     ({}); run `idemq migrate` to apply them",
                    status.current,
                    status.latest,
                    status.pending,
                    redact(&cli.database)
                )
            }
        });
        if newer.is_some() {
            return Err(CliError::Reported(exit::NEWER_SCHEMA));
        }
        if !status.is_current() {
            return Err(CliError::Reported(exit::FAILURE));
        }
        return Ok(());
    }
    if let Command::Migrate(_) = cli.command {
        let applied = Queue::migrate(&cli.database).await?;
        let value = serde_json::json!({"applied": applied, "database": redact(&cli.database)});
        output::line(cli.json, &value, || match applied.as_slice() {
            [] => format!("schema is up to date ({})", redact(&cli.database)),
            v => format!(
                "applied migrations {v:?}; schema is up to date ({})",
                redact(&cli.database)
            ),
        });
        return Ok(());
    }
    if let Command::Bench(args) = cli.command {
        return bench::run(*args, &cli.database, cli.json).await;
    }
    if let Command::KeySecret(cmd) = cli.command {
        return key_secret::run(&cli.database, cmd, cli.json).await;
    }
    if let Command::Serve(args) = &cli.command {
        // Before connecting: a refused address must not create a database.
        return serve::run(&cli.database, (**args).clone(), cli.json).await;
    }
    if let Command::Enqueue(args) = &cli.command {
        // A usage error: before the database is opened or stdin read.
        args.check_stdin()?;
    }
    let queue = connect(&cli.database).await?;
    match cli.command {
        Command::Migrate(_) | Command::Bench(_) | Command::KeySecret(_) | Command::ExecGuard => {
            Ok(())
        }
        Command::Enqueue(args) => enqueue::run(&queue, *args, cli.json).await,
        Command::Jobs(cmd) => jobs::run(&queue, cmd, cli.json).await,
        Command::Serve(_) => Ok(()),
        Command::Worker(args) => worker::run(queue, *args, cli.json).await,
        Command::Cancel(a) => ops::cancel(&queue, a, cli.json).await,
        Command::CancelByKey(a) => ops::cancel_by_key(&queue, a, cli.json).await,
        Command::Purge(a) => ops::purge(&queue, a, cli.json).await,
        Command::Promote(a) => ops::promote(&queue, a, cli.json).await,
        Command::Pause(a) => ops::pause(&queue, a, true, cli.json).await,
        Command::Resume(a) => ops::pause(&queue, a, false, cli.json).await,
        Command::Dead(cmd) => dead::run(&queue, cmd, cli.json).await,
        Command::Schedules(cmd) => schedules::run(&queue, cmd, cli.json).await,
        Command::Demo(a) => demo::run(&queue, &cli.database, a, cli.json).await,
    }
}

/// The URL without its password, for printing.
fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let userinfo = &url[s + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..s + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// An error of the tool: a library error, or bad command-line input.
#[derive(Debug)]
pub(crate) enum CliError {
    Lib(idemq::Error),
    Usage(String),
    /// Already reported on stdout; exit with this code.
    Reported(u8),
}

impl From<idemq::Error> for CliError {
    fn from(e: idemq::Error) -> Self {
        Self::Lib(e)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::ExecGuard = cli.command {
        // Started by a shell worker: no runtime, no database.
        return exec::guard();
    }
    let json = cli.json;
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(CliError::Usage(msg)) => {
            output::usage_error(json, &msg);
            ExitCode::from(exit::INVALID)
        }
        Err(CliError::Lib(e)) => {
            output::error(json, &e);
            ExitCode::from(exit_code(&e))
        }
        Err(CliError::Reported(code)) => ExitCode::from(code),
    }
}
