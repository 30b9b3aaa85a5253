//! `idemq serve`: the HTTP API and the dashboard, the maintenance loop
//! beside them, and with `--exec` an embedded shell worker.

use std::net::SocketAddr;

use clap::Args;
use serde_json::json;
use tokio::sync::watch;

use crate::exec::{ExecOptions, shell_worker};
use crate::{CliError, output};

/// Flags of `idemq serve`.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// The address to listen on. A non-loopback address needs a token.
    #[arg(long, env = "IDEMQ_LISTEN", default_value = "127.0.0.1:8080")]
    listen: String,
    /// Every API and dashboard request must present this token
    /// (`Authorization: Bearer <token>`). Prefer the environment variable.
    #[arg(long, env = "IDEMQ_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Without a token, also answer requests whose `Host` is this name
    /// (repeatable; comma-separated in the environment). Loopback names
    /// are always answered; any other `Host` gets 403 forbidden-host.
    #[arg(
        long = "allowed-host",
        env = "IDEMQ_ALLOWED_HOSTS",
        value_delimiter = ',',
        value_name = "HOST"
    )]
    allowed_hosts: Vec<String>,
    /// The largest payload, result or checkpoint value the server takes, in
    /// bytes of JSON (1 KiB – 16 MiB; default 1 MiB). Request bodies may be
    /// that much larger than their payload.
    #[arg(
        long,
        env = "IDEMQ_PAYLOAD_LIMIT",
        value_name = "BYTES",
        value_parser = clap::value_parser!(u64).range(MIN_PAYLOAD_LIMIT..=MAX_PAYLOAD_LIMIT)
    )]
    payload_limit: Option<u64>,
    /// How many long-polls (claims and job reads with `wait_ms`) the server
    /// holds at once; one more that asks to wait gets 503 unavailable with
    /// Retry-After, and requests that do not wait are never refused.
    #[arg(
        long,
        env = "IDEMQ_MAX_LONG_POLLS",
        value_name = "N",
        default_value_t = idemq_server::DEFAULT_MAX_LONG_POLLS as u64,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    max_long_polls: u64,
    /// Also run jobs in this process with a shell command (see `idemq worker --help`).
    #[arg(long, value_name = "CMD")]
    exec: Option<String>,
    #[command(flatten)]
    worker: ExecOptions,
}

/// Bounds of `--payload-limit`: below 1 KiB a payload is hardly of use; a
/// batch's body is bounded at 16 MiB, and a larger payload could never
/// travel in one.
const MIN_PAYLOAD_LIMIT: u64 = 1024;
const MAX_PAYLOAD_LIMIT: u64 = idemq::MAX_BATCH_BYTES as u64;

/// Every address `listen` names, or why it names none.
async fn resolve(listen: &str) -> Result<Vec<SocketAddr>, CliError> {
    if let Ok(a) = listen.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(listen)
        .await
        .map_err(|e| {
            CliError::Usage(format!(
                "--listen {listen}: {e}; use HOST:PORT, e.g. 127.0.0.1:8080"
            ))
        })?
        .collect();
    if addrs.is_empty() {
        return Err(CliError::Usage(format!(
            "--listen {listen} names no address; use HOST:PORT, e.g. 127.0.0.1:8080"
        )));
    }
    Ok(addrs)
}

/// Refuses to expose the API without a token: anyone who can reach a
/// non-loopback address could enqueue, cancel and purge jobs.
fn check_exposure(listen: &str, addrs: &[SocketAddr], token: Option<&str>) -> Result<(), CliError> {
    let exposed = addrs.iter().any(|a| !a.ip().is_loopback());
    if exposed && token.is_none() {
        return Err(CliError::Usage(format!(
            "refusing to listen on {listen} without a token: every client that can reach \
             this address could enqueue, cancel and purge jobs.\n\
             hint: set IDEMQ_TOKEN (or pass --token) so every request must present it, \
             or listen on 127.0.0.1 (the default)"
        )));
    }
    Ok(())
}

/// Logs to stderr, at `RUST_LOG`'s levels (default: info, sqlx's warnings).
pub(crate) fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Runs `idemq serve` until SIGINT or SIGTERM.
pub async fn run(database: &str, args: ServeArgs, json: bool) -> Result<(), CliError> {
    let token = args.token.filter(|t| !t.is_empty());
    let addrs = resolve(&args.listen).await?;
    check_exposure(&args.listen, &addrs, token.as_deref())?;
    if let Some(cmd) = &args.exec
        && cmd.trim().is_empty()
    {
        return Err(CliError::Usage("--exec needs a command".into()));
    }
    init_tracing();

    let applied = idemq::Queue::migrate(database).await?;
    if !applied.is_empty() {
        eprintln!("applied migrations {applied:?}");
    }
    let mut options = idemq::QueueOptions::default();
    if let Some(limit) = args.payload_limit {
        // In range by the flag's parser; a usize holds 16 MiB everywhere.
        options.payload_limit = usize::try_from(limit).unwrap_or(usize::MAX);
    }
    let queue = idemq::Queue::connect_with(database, options).await?;

    let listener = tokio::net::TcpListener::bind(addrs.as_slice())
        .await
        .map_err(|e| {
            CliError::Lib(idemq::Error::Backend {
                message: format!("cannot listen on {}: {e}", args.listen),
            })
        })?;
    let local = listener.local_addr().map_err(|e| {
        CliError::Lib(idemq::Error::Backend {
            message: e.to_string(),
        })
    })?;
    let url = format!("http://{local}/");
    output::line(
        json,
        &json!({"dashboard": url, "listen": local.to_string(), "database": crate::redact(database), "token": token.is_some()}),
        || format!("dashboard: {url}"),
    );
    eprintln!(
        "serving the API and dashboard of {} on {local}{}; Ctrl-C or SIGTERM stops it",
        crate::redact(database),
        if token.is_some() {
            " (requests need the token)"
        } else {
            ""
        }
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let maintenance =
        tokio::spawn(idemq::worker::Maintenance::new(queue.clone()).run_until(stop_rx.clone()));
    let worker = args.exec.as_ref().map(|cmd| {
        eprintln!("worker: running `{cmd}` for each job");
        let w = shell_worker(queue.clone(), cmd, &args.worker).maintenance(false);
        tokio::spawn(w.run(stopped(stop_rx.clone())))
    });
    let mut server = tokio::spawn(idemq_server::serve(
        listener,
        queue,
        idemq_server::ServerOptions {
            token,
            allowed_hosts: args.allowed_hosts.clone(),
            max_long_polls: usize::try_from(args.max_long_polls).unwrap_or(usize::MAX),
        },
        stopped(stop_rx.clone()),
    ));
    let early = tokio::select! {
        () = idemq::worker::shutdown_signal() => None,
        r = &mut server => Some(r),
    };
    eprintln!("stopping");
    let _ = stop_tx.send(true);
    let served = match early {
        Some(r) => r,
        None => server.await,
    };
    if let Some(w) = worker {
        match w.await {
            Ok(Ok(r)) => eprintln!(
                "worker stopped: {} completed, {} failed, {} released",
                r.completed, r.failed, r.released
            ),
            Ok(Err(e)) => eprintln!("worker stopped: {e}"),
            Err(e) => eprintln!("worker stopped: {e}"),
        }
    }
    let _ = maintenance.await;
    match served {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(CliError::Lib(idemq::Error::Backend {
            message: format!("the server stopped: {e}"),
        })),
        Err(e) => Err(CliError::Lib(idemq::Error::Backend {
            message: format!("the server stopped: {e}"),
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_needs_no_token_and_other_addresses_do() {
        let local: Vec<SocketAddr> = vec![
            "127.0.0.1:8080".parse().unwrap(),
            "[::1]:8080".parse().unwrap(),
        ];
        assert!(check_exposure("x", &local, None).is_ok());
        let any: Vec<SocketAddr> = vec!["0.0.0.0:8080".parse().unwrap()];
        assert!(check_exposure("x", &any, None).is_err());
        assert!(check_exposure("x", &any, Some("t")).is_ok());
        let mixed = [local, any].concat();
        assert!(check_exposure("x", &mixed, None).is_err());
    }
}
