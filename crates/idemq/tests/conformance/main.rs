//! The conformance suite: the behaviour of docs/ (http-api, idempotency, dedupe, worker, state-machine), one set of cases run
//! once per backend.
//!
//! Each case is an `async fn(Harness)` in one of the modules below. Each
//! module lists its cases once with `instantiate!`, which makes one test per
//! case and backend, named `<module>::<backend>::<case>`. Time moves through
//! the harness's clock, never by sleeping.

mod support;

/// Instantiates every listed case once per backend.
macro_rules! instantiate {
    ($($case:ident),* $(,)?) => {
        /// The cases on the embedded SQLite backend.
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(crate::support::Harness::sqlite().await).await;
                }
            )*
        }
        /// The cases on PostgreSQL: each on its own database cloned from a
        /// migrated template. They fail, never skip, when PostgreSQL is down.
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::$case(crate::support::Harness::postgres().await).await;
                }
            )*
        }
    };
}

mod batch;
mod dedupe;
mod definitions;
mod execution;
mod idempotency;
mod installation;
mod operations;
mod prefetch;
mod races;
mod schedules;
mod transactions;
mod validation;
mod worker;
