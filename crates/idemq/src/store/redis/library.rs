//! The server-side code: a Redis Functions library named after a digest of
//! its own source, so binaries of different versions can share one server
//! (each calls its own functions), and a version key per installation
//! (key prefix) that says which library its data was last migrated for.

use std::sync::LazyLock;

use sha2::{Digest, Sha256};

use crate::error::Error;
use crate::fingerprint::hex;
use crate::request::defaults;

/// The data layout this binary reads and writes (`<prefix>layout`). 2: no
/// index of every job (`jobs`) and no waiting count in `cnt:<queue>`;
/// `idemq migrate` drops both from an installation of layout 1 (the
/// library's `upgrade`), and a store refuses an older layout until then.
/// 3: waiting jobs whose concurrency key is held may be parked out of
/// their lanes (layout.rs); nothing to convert, but a library of layout 2
/// would neither see parked jobs nor put them back, so it must not run on
/// such an installation.
pub const LAYOUT: i64 = 3;

/// The revision of the library (`lua/`): raised by one at every change of
/// its code (a unit test pins the library's version digest to it). An
/// installation records the revision it was migrated for
/// (`<prefix>revision`), and a binary refuses to migrate an installation,
/// or to run on one, recorded for a higher revision: an older `idemq
/// serve` or `idemq migrate` started during a rolling upgrade would
/// otherwise record its own library again and the newer processes would
/// then refuse the installation. An installation recorded before revisions
/// existed has none, and is migrated as before.
pub const FUNCTIONS_REVISION: i64 = 3;

/// The Lua sources, in the order they are joined: each file uses the
/// locals of the files before it.
const SOURCES: [&str; 6] = [
    include_str!("lua/common.lua"),
    include_str!("lua/enqueue.lua"),
    include_str!("lua/exec.lua"),
    include_str!("lua/admin.lua"),
    include_str!("lua/query.lua"),
    include_str!("lua/schedule.lua"),
];

/// This binary's library.
pub struct Library {
    /// The first 16 hex digits of the SHA-256 of the code.
    pub version: String,
    /// What `FUNCTION LOAD` takes.
    pub source: String,
}

impl Library {
    /// The server-side name of function `op` of this version.
    pub fn function(&self, op: &str) -> String {
        format!("idemq_{}_{op}", self.version)
    }

    /// The library's name on the server.
    pub fn name(&self) -> String {
        format!("idemq_{}", self.version)
    }
}

/// The library of this binary.
pub static LIBRARY: LazyLock<Library> = LazyLock::new(|| {
    // The retention defaults are the library's constants, written from the
    // Rust ones so the two cannot drift.
    let mut body = format!(
        "local KEEP_DEAD_MS = {}\nlocal KEEP_COMPLETED_MS = {}\n",
        defaults::KEEP_DEAD_MS,
        defaults::KEEP_COMPLETED_MS
    );
    for source in SOURCES {
        body.push_str(source);
        body.push('\n');
    }
    let version = hex(&Sha256::digest(body.as_bytes())[..8]);
    let source = format!("#!lua name=idemq_{version}\nlocal VERSION = '{version}'\n{body}");
    Library { version, source }
});

/// What to tell the operator of an installation this binary cannot use.
pub fn not_current(prefix: &str, why: &str) -> Error {
    Error::Backend {
        message: format!(
            "the idemq data under the key prefix {prefix:?} {why}: run `idemq migrate` with this \
             binary's version"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_a_digest_of_the_code_and_names_every_function() {
        assert_eq!(LIBRARY.version.len(), 16);
        assert!(
            LIBRARY
                .source
                .starts_with(&format!("#!lua name=idemq_{}\n", LIBRARY.version))
        );
        assert_eq!(
            LIBRARY.function("enqueue"),
            format!("idemq_{}_enqueue", LIBRARY.version)
        );
    }

    #[test]
    fn the_functions_revision_follows_the_library() {
        assert_eq!(
            (FUNCTIONS_REVISION, LIBRARY.version.as_str()),
            (3, "548f5f375cd66a21"),
            "the Lua library changed: raise FUNCTIONS_REVISION by one and pin the new version here"
        );
    }
}
