//! The HTTP API over real HTTP: each case starts `idemq_server::serve` on
//! 127.0.0.1:0 over a fresh database and runs once per backend (a SQLite
//! file, and a PostgreSQL database cloned from the migrated template).

#[allow(dead_code)]
#[path = "../../../idemq/tests/conformance/support.rs"]
mod support;

mod harness;

/// Instantiates every listed case once per backend, as
/// `<module>::sqlite::<case>` and `<module>::postgres::<case>`.
macro_rules! instantiate {
    ($($case:ident),* $(,)?) => {
        /// The cases on a SQLite file.
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(crate::harness::Backend::Sqlite).await;
                }
            )*
        }
        /// The cases on PostgreSQL (they fail, never skip, when it is down).
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(crate::harness::Backend::Postgres).await;
                }
            )*
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
