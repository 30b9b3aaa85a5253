//! `idemq worker --exec CMD`: a worker in a process of its own that runs a
//! shell command per job (see [`crate::exec`]).

use clap::Args;
use idemq::Queue;
use serde_json::json;

use crate::CliError;
use crate::exec::{ExecOptions, shell_worker};
use crate::output;

/// Flags of `idemq worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// The command run by `sh -c` for each job: the payload JSON on stdin;
    /// IDEMQ_JOB_ID, IDEMQ_JOB_TYPE, IDEMQ_JOB_QUEUE, IDEMQ_ATTEMPT,
    /// IDEMQ_MAX_ATTEMPTS (and IDEMQ_DEADLINE) in the environment. Exit 0
    /// completes the job (JSON on stdout is its result), 75 asks for a retry,
    /// any other exit fails the attempt (retried by the job's policy).
    #[arg(long, value_name = "CMD")]
    exec: String,
    #[command(flatten)]
    options: ExecOptions,
    /// Do not run the maintenance loop in this process (leases, schedules,
    /// bindings, retention); some other process (e.g. `idemq serve`) must.
    #[arg(long)]
    no_maintenance: bool,
}

/// Runs `idemq worker` until SIGINT or SIGTERM.
pub async fn run(queue: Queue, args: WorkerArgs, json: bool) -> Result<(), CliError> {
    // The runtime's warnings (claims backing off, heartbeats failing, a
    // claim refused for good) go to stderr, as `serve`'s do.
    crate::serve::init_tracing();
    if args.exec.trim().is_empty() {
        return Err(CliError::Usage("--exec needs a command".into()));
    }
    let o = &args.options;
    let worker = shell_worker(queue, &args.exec, o).maintenance(!args.no_maintenance);
    let types = if o.types.is_empty() {
        "every type".to_owned()
    } else {
        o.types.join(",")
    };
    let queues = if o.queues.is_empty() {
        "every queue".to_owned()
    } else {
        o.queues.join(",")
    };
    // Progress goes to stderr so stdout stays for the final report.
    eprintln!(
        "worker: running `{}` for {types} on {queues} (concurrency {}); Ctrl-C or SIGTERM stops it",
        args.exec, o.concurrency
    );
    let report = worker.run(idemq::worker::shutdown_signal()).await?;
    let value = json!({
        "completed": report.completed,
        "failed": report.failed,
        "released": report.released,
        "lost": report.lost,
    });
    output::line(json, &value, || {
        format!(
            "worker stopped: {} completed, {} failed, {} released, {} lost",
            report.completed, report.failed, report.released, report.lost
        )
    });
    Ok(())
}
