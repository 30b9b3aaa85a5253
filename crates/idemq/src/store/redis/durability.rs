//! The server settings under which nothing acknowledged is lost: checked
//! when a store connects (and before `idemq migrate` writes), and again at
//! every maintenance pass, since `CONFIG SET`, a restart with another
//! configuration file or a failover to a differently configured replica
//! can change them under a running store. A strict store whose server no
//! longer has them refuses every write (`Unavailable`, naming the setting
//! and how to set it back) and reports relaxed durability until a pass
//! finds them again; a relaxed store (`?durability=relaxed`) never checks.

use std::collections::HashMap;
use std::sync::RwLock;

use ::redis::aio::ConnectionManager;

use crate::error::{Error, Result};

/// The settings, each with the value it must have: `appendonly yes` (else
/// nothing is written until the next snapshot), `appendfsync always` (else
/// Redis replies before the write is on disk), `no-appendfsync-on-rewrite
/// no` (else Redis skips the fsync while a `BGSAVE` or AOF rewrite child
/// runs, even with `appendfsync always`) and `maxmemory-policy noeviction`
/// (else keys are deleted under memory pressure).
pub const DURABLE: [(&str, &str); 4] = [
    ("appendonly", "yes"),
    ("appendfsync", "always"),
    ("no-appendfsync-on-rewrite", "no"),
    ("maxmemory-policy", "noeviction"),
];

/// The settings as the messages list them.
const LIST: &str = "appendonly yes, appendfsync always, no-appendfsync-on-rewrite no, \
                    maxmemory-policy noeviction";

/// A setting the server does not have as [`DURABLE`] says.
struct Off {
    name: &'static str,
    wanted: &'static str,
    got: String,
}

/// The first setting that is off, in one `CONFIG GET`; the driver's error
/// when the settings cannot be read.
async fn read(
    conn: &mut ConnectionManager,
) -> std::result::Result<Option<Off>, ::redis::RedisError> {
    let mut cmd = ::redis::cmd("CONFIG");
    cmd.arg("GET");
    for (name, _) in DURABLE {
        cmd.arg(name);
    }
    let got: HashMap<String, String> = cmd.query_async(conn).await?;
    Ok(DURABLE.into_iter().find_map(|(name, wanted)| {
        let got = got.get(name).map(String::as_str).unwrap_or("(unset)");
        (!got.eq_ignore_ascii_case(wanted)).then(|| Off {
            name,
            wanted,
            got: got.to_owned(),
        })
    }))
}

/// Refuses a server whose settings could lose acknowledged writes, naming
/// the setting to change (`Validation` on `database`).
pub(super) async fn check(conn: &mut ConnectionManager) -> Result<()> {
    match read(conn).await {
        Ok(None) => Ok(()),
        Ok(Some(off)) => Err(Error::validation(
            "database",
            format!(
                "the Redis server runs with {} {}, which can lose acknowledged jobs: set `{} {}` \
                 ({LIST}), or add ?durability=relaxed to the URL to accept the loss",
                off.name, off.got, off.name, off.wanted
            ),
        )),
        Err(e) => Err(Error::validation(
            "database",
            format!(
                "cannot read the Redis settings {LIST} to check durability ({e}); add \
                 ?durability=relaxed to the URL to run without the check"
            ),
        )),
    }
}

/// A strict store's view of its server's settings since it connected.
#[derive(Debug, Default)]
pub(super) struct Watch {
    /// Why writes are refused: the last check found a setting off, or
    /// could not read them. `None` while the settings hold.
    drift: RwLock<Option<String>>,
}

impl Watch {
    /// Why writes are refused now, if they are.
    pub(super) fn drift(&self) -> Option<String> {
        self.drift.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, drift: Option<String>) {
        *self.drift.write().unwrap_or_else(|p| p.into_inner()) = drift;
    }

    /// The refusal of a write while the settings are off.
    pub(super) fn refusal(&self) -> Option<Error> {
        self.drift().map(|message| Error::Unavailable { message })
    }

    /// Reads the settings again: clears a refusal when they hold, sets one
    /// (and returns it) when they do not or cannot be read (`CONFIG`
    /// refused). A server that is down, loading or busy leaves the last
    /// finding as it was (no write gets through it either).
    pub(super) async fn recheck(&self, conn: &mut ConnectionManager) -> Result<()> {
        let drift = match read(conn).await {
            Ok(None) => None,
            Ok(Some(off)) => {
                // The command that sets it back, written out of the message
                // (whose words would otherwise read as SQL to a lint).
                let fix = ["CONFIG", "SET", off.name, off.wanted].join(" ");
                Some(format!(
                    "the Redis server now runs with {} {}, which can lose acknowledged jobs: \
                     idemq refuses writes until it is set back (`{fix}`, and in the server's \
                     configuration file: {LIST}), or until the store is opened with \
                     ?durability=relaxed to accept the loss",
                    off.name, off.got
                ))
            }
            Err(e) => {
                let why = e.to_string();
                let error = super::redis_err(e);
                if error.is_retryable() {
                    return Err(error);
                }
                Some(format!(
                    "cannot read the Redis settings {LIST} to check durability ({why}): idemq \
                     refuses writes until it can, or until the store is opened with \
                     ?durability=relaxed"
                ))
            }
        };
        self.set(drift.clone());
        match drift {
            None => Ok(()),
            // The maintenance loop logs it, once when it starts failing.
            Some(message) => Err(Error::Unavailable { message }),
        }
    }
}
