//! `idemq key-secret`: check the installation's key hashing, or change it
//! deliberately (docs/idempotency.md, "One key secret per installation").

use clap::{Args, Subcommand};
use idemq::{Queue, QueueOptions};
use serde_json::json;

use crate::{CliError, output};

/// `idemq key-secret …`.
#[derive(Subcommand, Debug)]
pub enum KeySecretCommand {
    /// Connect as every command does: succeeds when this process's
    /// IDEMQ_KEY_SECRET hashes keys as the installation does.
    Check,
    /// Make this process's IDEMQ_KEY_SECRET (or its absence) the
    /// installation's. Live idempotency bindings made with the old secret
    /// stop matching: a repeat of one of those keys before it expires is
    /// accepted as new work. Processes already running keep hashing with the
    /// old secret until restarted (stop them first, or restart them all at
    /// once); a process started with the old secret is refused at connect.
    Reset(ResetArgs),
}

/// Flags of `idemq key-secret reset`.
#[derive(Args, Debug)]
pub struct ResetArgs {
    /// Confirm the change and its cost.
    #[arg(long)]
    yes: bool,
}

/// Runs a `key-secret` command.
pub async fn run(database: &str, cmd: KeySecretCommand, json: bool) -> Result<(), CliError> {
    match cmd {
        KeySecretCommand::Check => {
            Queue::connect(database).await?;
            output::line(json, &json!({"matches": true}), || {
                "this process hashes idempotency keys as the installation does".to_owned()
            });
            Ok(())
        }
        KeySecretCommand::Reset(args) => {
            if !args.yes {
                return Err(CliError::Usage(
                    "changing the installation's key secret orphans every live idempotency \
                     binding made with the old one: a repeat of such a key before it expires \
                     is accepted as new work. Processes already running keep hashing keys \
                     with the old secret until they are restarted, so until then the \
                     installation can accept a repeated key twice: stop them first, or \
                     restart them all at once with the new secret. A process started with \
                     the old secret is refused at connect. Run again with --yes to proceed"
                        .to_owned(),
                ));
            }
            let change = Queue::replace_key_secret(database, QueueOptions::default()).await?;
            let value = json!({
                "previous": change.previous,
                "orphaned_bindings": change.live_bindings,
            });
            output::line(json, &value, || {
                match &change.previous {
                None => "recorded this process's key hashing (the installation had none)".to_owned(),
                Some(_) if change.live_bindings == 0 => {
                    "the installation now uses this process's key hashing; no live binding was orphaned"
                        .to_owned()
                }
                Some(_) => format!(
                    "the installation now uses this process's key hashing; {} live idempotency \
                     binding(s) made with the old one no longer match: a repeat of those keys \
                     before they expire is accepted as new work",
                    change.live_bindings
                ),
            }
            });
            Ok(())
        }
    }
}
