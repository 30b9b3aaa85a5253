//! The HTTP API over real HTTP: each case starts `idemq_server::serve` on
//! 127.0.0.1:0 over a fresh database and runs once per backend (a SQLite
//! file, and a PostgreSQL database cloned from the migrated template).

mod harness;

/// Instantiates every listed case once per backend of the test kit's one
/// list, as `<module>::<backend>::<case>`; each case takes a
/// [`harness::Backend`] (cases fail, never skip, when a server is down).
macro_rules! instantiate {
    ($($cases:tt)*) => {
        idemq_testkit::instantiate! {
            using |backend| crate::harness::Backend::named(backend);
            $($cases)*
        }
    };
}

mod auth;
mod contract;
mod enqueue;
mod jobs;
mod keys;
mod metrics;
mod ops;
mod worker;
