//! The HTTP API over real HTTP: each case starts `idemq_server::serve` on
//! 127.0.0.1:0 over a fresh database and runs once per backend (a SQLite
//! file, a PostgreSQL database cloned from the migrated template, and a key
//! prefix of its own on the test process's durable redis-server).

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
mod limits;
mod metrics;
mod ops;
mod overview;
mod wakeups;
mod worker;
