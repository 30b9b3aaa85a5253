//! The shell handler of `idemq worker --exec` and `idemq serve --exec`: each
//! attempt runs `sh -c CMD` with the payload on stdin.
//!
//! Exit 0 completes the job (stdout, when it is JSON, becomes the result);
//! exit 75 (`EX_TEMPFAIL`) asks for a retry; any other exit, or death by a
//! signal, is a failure. Both failures follow the job's retry policy (a
//! command cannot send a job to the dead letters at once: give the job
//! `--max-attempts 1` or `--retry none` for that). The last 8 KiB of
//! stdout and stderr become the run's error.

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use idemq::worker::{HandlerContext, JobError, Worker};
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

/// The exit status that asks for a retry (`EX_TEMPFAIL` of sysexits.h).
pub const EXIT_RETRY: i32 = 75;

/// The run ledger keeps errors up to 8 KiB.
const MAX_ERROR_BYTES: usize = 8 * 1024;

/// A result is stored only up to 1 MiB; larger stdout is not a result.
const MAX_RESULT_BYTES: usize = 1024 * 1024;

/// How long the output pipes may stay open after the command exited (a
/// background process it started can hold them).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// How a shell worker claims and runs jobs; shared by `worker` and `serve`.
#[derive(Args, Debug, Clone)]
pub struct ExecOptions {
    /// Only these job types, comma-separated (every type when omitted).
    #[arg(long, value_delimiter = ',', value_name = "TYPES")]
    pub types: Vec<String>,
    /// Only these queues, comma-separated (every queue when omitted).
    #[arg(long, value_delimiter = ',', value_name = "QUEUES")]
    pub queues: Vec<String>,
    /// Jobs run at once.
    #[arg(long, default_value_t = 10)]
    pub concurrency: usize,
    /// The lease of each claim in milliseconds (heartbeats renew it every third).
    #[arg(long, default_value_t = 30_000)]
    pub lease_ms: u64,
    /// How often to look for new work when no wake-up arrives, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    pub poll_ms: u64,
    /// How long running commands may finish after SIGINT/SIGTERM before they
    /// are killed and their jobs released.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub grace: Duration,
}

/// A worker whose handler runs `command` for every job of `options.types`
/// (or of any type).
pub fn shell_worker(queue: idemq::Queue, command: &str, options: &ExecOptions) -> Worker {
    let command: Arc<str> = Arc::from(command);
    let guard = Guard::start().map(Arc::new);
    let handler = move |ctx: HandlerContext, payload: Value| {
        let (command, guard) = (command.clone(), guard.clone());
        async move { run_command(&command, guard.as_deref(), &ctx, &payload).await }
    };
    let mut worker = Worker::new(queue)
        .queues(options.queues.iter().filter(|q| !q.is_empty()).cloned())
        .concurrency(options.concurrency)
        .lease(Duration::from_millis(options.lease_ms))
        .poll_interval(Duration::from_millis(options.poll_ms.max(10)))
        .shutdown_grace(options.grace)
        // A command cannot see a cancel, so it gets no time to clean up
        // after one: its process group is killed at once (docs/cli.md).
        .cancel_grace(Duration::ZERO);
    let types: Vec<&String> = options.types.iter().filter(|t| !t.is_empty()).collect();
    if types.is_empty() {
        worker = worker.handle_any(handler);
    } else {
        for t in types {
            worker = worker.handle(t, handler.clone());
        }
    }
    worker
}

/// The guard of a shell worker's commands: one process per worker, this
/// same binary started as the hidden `idemq exec-guard`, told the process
/// group of every command as it starts and ends. When the worker dies
/// without ending its commands (SIGKILL, the out-of-memory killer), the
/// kernel closes the guard's stdin, and the guard kills every group it
/// still holds at once: no command of a dead worker runs on beside the
/// next attempt of its job once the lease expires.
///
/// The worker kills a group itself whenever it interrupts an attempt; the
/// guard covers only the worker's own death, which nothing in the worker
/// can react to. A command's group is told after it is started, so a
/// worker killed between the two system calls leaves that one running.
pub(crate) struct Guard {
    to_guard: Mutex<Option<std::process::ChildStdin>>,
}

impl Guard {
    /// Starts the guard; `None`, after a warning, if it cannot start.
    fn start() -> Option<Self> {
        // `/proc/self/exe` is this process's own binary even after an
        // upgrade replaced or removed its file; elsewhere the path it was
        // started from.
        let exe = if cfg!(target_os = "linux") {
            std::path::PathBuf::from("/proc/self/exe")
        } else {
            std::env::current_exe().unwrap_or_else(|_| "idemq".into())
        };
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("exec-guard")
            .stdin(Stdio::piped())
            .stdout(Stdio::null());
        // Its own group, as the commands': a Ctrl-C in the terminal reaches
        // only the worker, which lets running commands finish.
        #[cfg(unix)]
        {
            use std::os::unix::process::CommandExt;
            cmd.arg0("idemq").process_group(0);
        }
        match cmd.spawn() {
            Ok(mut child) => Some(Self {
                to_guard: Mutex::new(child.stdin.take()),
            }),
            Err(e) => {
                tracing::warn!(
                    error = %e,
                    "cannot start the guard of the commands (idemq exec-guard): \
                     if this worker is killed with SIGKILL, its running commands keep running"
                );
                None
            }
        }
    }

    /// Tells the guard that the group `group` leads started (`+`) or ended (`-`).
    fn tell(&self, sign: char, group: u32) {
        use std::io::Write;
        let mut to_guard = self.to_guard.lock().unwrap_or_else(|p| p.into_inner());
        let Some(pipe) = to_guard.as_mut() else {
            return;
        };
        // A line of a few bytes: a pipe takes it at once.
        if let Err(e) = writeln!(pipe, "{sign}{group}") {
            tracing::warn!(
                error = %e,
                "the guard of the commands (idemq exec-guard) is gone: \
                 if this worker is killed with SIGKILL, its running commands keep running"
            );
            *to_guard = None;
        }
    }
}

/// `idemq exec-guard`: reads `+GROUP` and `-GROUP` lines from stdin, the
/// process groups of a shell worker's running commands ([`Guard`]); at the
/// end of stdin (the worker ended, or died) kills every group still held.
///
/// SIGTERM, SIGINT and SIGHUP do not end it: a service manager that stops
/// a unit or a container signals every process in it, and the worker then
/// lets its commands finish within its grace period, which the guard must
/// outlive to still cover them. It ends with its worker.
pub fn guard() -> std::process::ExitCode {
    use std::collections::BTreeSet;
    use std::io::BufRead;
    let _outlived = outlive_stop_signals();
    let mut held = BTreeSet::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        match (line.get(..1), line.get(1..).map(str::parse::<u32>)) {
            (Some("+"), Some(Ok(group))) if group > 1 => {
                held.insert(group);
            }
            (Some("-"), Some(Ok(group))) => {
                held.remove(&group);
            }
            _ => eprintln!("idemq exec-guard: ignoring the line {line:?}"),
        }
    }
    for group in held {
        sigkill_group(group);
    }
    std::process::ExitCode::SUCCESS
}

/// Takes SIGTERM, SIGINT and SIGHUP for this process, for as long as what
/// it returns is held: their handlers only record them.
#[cfg(unix)]
fn outlive_stop_signals() -> Option<(tokio::runtime::Runtime, Vec<tokio::signal::unix::Signal>)> {
    use tokio::signal::unix::{SignalKind, signal};
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .ok()?;
    let signals = runtime.block_on(async {
        [
            SignalKind::terminate(),
            SignalKind::interrupt(),
            SignalKind::hangup(),
        ]
        .into_iter()
        .filter_map(|kind| signal(kind).ok())
        .collect()
    });
    Some((runtime, signals))
}

#[cfg(not(unix))]
fn outlive_stop_signals() {}

/// SIGKILL to every process of the group `group` leads.
fn sigkill_group(group: u32) {
    // `kill_on_drop` only reaches the group's leader; the processes it
    // started share the group. (No `unsafe` for kill(2) here: the
    // workspace forbids it.)
    let _ = std::process::Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Kills the command's process group when the attempt is dropped before the
/// command was reaped (timeout, deadline, cancel, lost lease, shutdown),
/// and tells the guard that the group ended.
struct KillGroup<'a> {
    group: Option<u32>,
    guard: Option<&'a Guard>,
}

impl<'a> KillGroup<'a> {
    fn new(group: Option<u32>, guard: Option<&'a Guard>) -> Self {
        if let (Some(group), Some(guard)) = (group, guard) {
            guard.tell('+', group);
        }
        Self { group, guard }
    }

    /// The command was reaped: nothing to kill (and its pid may be reused).
    fn reaped(&mut self) {
        if let (Some(group), Some(guard)) = (self.group.take(), self.guard) {
            guard.tell('-', group);
        }
    }
}

impl Drop for KillGroup<'_> {
    fn drop(&mut self) {
        if let Some(group) = self.group {
            sigkill_group(group);
            if let Some(guard) = self.guard {
                guard.tell('-', group);
            }
        }
    }
}

/// Output of both pipes in arrival order (only the tail is kept) and stdout
/// alone (for the result).
#[derive(Default)]
struct Captured {
    tail: Vec<u8>,
    stdout: Vec<u8>,
    stdout_too_large: bool,
}

impl Captured {
    fn push(&mut self, bytes: &[u8], is_stdout: bool) {
        self.tail.extend_from_slice(bytes);
        if self.tail.len() > 2 * MAX_ERROR_BYTES {
            let cut = self.tail.len() - MAX_ERROR_BYTES;
            self.tail.drain(..cut);
        }
        if is_stdout && !self.stdout_too_large {
            if self.stdout.len() + bytes.len() > MAX_RESULT_BYTES {
                self.stdout_too_large = true;
                self.stdout = Vec::new();
            } else {
                self.stdout.extend_from_slice(bytes);
            }
        }
    }
}

async fn pump(
    mut from: impl AsyncRead + Unpin,
    into: &Mutex<Captured>,
    is_stdout: bool,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 8192];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        into.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(&buf[..n], is_stdout);
    }
}

/// The last `limit` bytes of `bytes` as text, cut at a character boundary.
fn tail_text(bytes: &[u8], limit: usize) -> String {
    let text = String::from_utf8_lossy(bytes);
    if text.len() <= limit {
        return text.into_owned();
    }
    let mut start = text.len() - limit;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}

/// The run's error: why it failed, then as much of the output's tail as
/// fits in 8 KiB.
fn failure_message(why: &str, tail: &[u8]) -> String {
    let head = format!("{why}; output tail:\n");
    let tail = tail_text(tail, MAX_ERROR_BYTES.saturating_sub(head.len()));
    if tail.trim().is_empty() {
        format!("{why} (no output)")
    } else {
        format!("{head}{tail}")
    }
}

async fn run_command(
    command: &str,
    guard: Option<&Guard>,
    ctx: &HandlerContext,
    payload: &Value,
) -> Result<Value, JobError> {
    let mut cmd = tokio::process::Command::new("sh");
    cmd.arg("-c")
        .arg(command)
        .env("IDEMQ_JOB_ID", ctx.job_id())
        .env("IDEMQ_JOB_TYPE", ctx.job_type())
        .env("IDEMQ_JOB_QUEUE", ctx.queue_name())
        .env("IDEMQ_ATTEMPT", ctx.attempt().to_string())
        .env("IDEMQ_MAX_ATTEMPTS", ctx.max_attempts().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(d) = ctx.deadline() {
        cmd.env("IDEMQ_DEADLINE", d.to_rfc3339());
    }
    // Its own process group: a Ctrl-C in the terminal reaches the worker,
    // which lets running commands finish within the grace period, and an
    // interrupted attempt kills the command with everything it started.
    #[cfg(unix)]
    cmd.process_group(0);
    let mut child = cmd
        .spawn()
        .map_err(|e| JobError::retryable(format!("cannot start sh -c: {e}")))?;
    let mut group = KillGroup::new(child.id(), guard);

    let captured = Mutex::new(Captured::default());
    let input = serde_json::to_vec(payload).unwrap_or_else(|_| b"null".to_vec());
    let stdin = child.stdin.take();
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let io = async {
        let write = async {
            if let Some(mut stdin) = stdin {
                // A command that does not read its stdin closes the pipe early.
                let _ = stdin.write_all(&input).await;
                let _ = stdin.shutdown().await;
            }
        };
        let out = async {
            if let Some(s) = stdout {
                let _ = pump(s, &captured, true).await;
            }
        };
        let err = async {
            if let Some(s) = stderr {
                let _ = pump(s, &captured, false).await;
            }
        };
        tokio::join!(write, out, err);
    };
    tokio::pin!(io);
    let mut io_done = false;
    let status = tokio::select! {
        status = child.wait() => status,
        () = &mut io => {
            io_done = true;
            child.wait().await
        }
    };
    if !io_done {
        let _ = tokio::time::timeout(DRAIN_AFTER_EXIT, &mut io).await;
    }
    group.reaped();
    let status = status.map_err(|e| JobError::retryable(format!("cannot wait for sh: {e}")))?;
    let captured = std::mem::take(&mut *captured.lock().unwrap_or_else(|p| p.into_inner()));
    match status.code() {
        Some(0) => {
            let text = String::from_utf8_lossy(&captured.stdout);
            let text = text.trim();
            Ok(if text.is_empty() || captured.stdout_too_large {
                Value::Null
            } else {
                serde_json::from_str(text).unwrap_or(Value::Null)
            })
        }
        Some(EXIT_RETRY) => Err(JobError::retryable(failure_message(
            "exit status 75 (retry requested)",
            &captured.tail,
        ))),
        Some(code) => Err(JobError::retryable(failure_message(
            &format!("exit status {code}"),
            &captured.tail,
        ))),
        None => Err(JobError::retryable(failure_message(
            &signal_text(&status),
            &captured.tail,
        ))),
    }
}

#[cfg(unix)]
fn signal_text(status: &std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(s) => format!("killed by signal {s}"),
        None => "ended without an exit status".into(),
    }
}

#[cfg(not(unix))]
fn signal_text(_status: &std::process::ExitStatus) -> String {
    "ended without an exit status".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_message_keeps_the_tail_within_8_kib() {
        let long = "x".repeat(20_000) + "THE END";
        let m = failure_message("exit status 3", long.as_bytes());
        assert!(m.len() <= MAX_ERROR_BYTES, "{}", m.len());
        assert!(m.starts_with("exit status 3; output tail:\n"));
        assert!(m.ends_with("THE END"));
        assert_eq!(
            failure_message("exit status 3", b""),
            "exit status 3 (no output)"
        );
        let multibyte = "é".repeat(5000);
        assert!(failure_message("x", multibyte.as_bytes()).len() <= MAX_ERROR_BYTES);
    }

    #[test]
    fn captured_tail_and_stdout() {
        let mut c = Captured::default();
        c.push(b"out ", true);
        c.push(b"err ", false);
        c.push(&vec![b'y'; 3 * MAX_ERROR_BYTES], false);
        assert_eq!(c.stdout, b"out ");
        assert!(c.tail.len() <= 2 * MAX_ERROR_BYTES);
    }
}
