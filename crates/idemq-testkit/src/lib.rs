//! The test kit of idemq: what the conformance suite (`crates/idemq/tests/conformance/`),
//! the HTTP API tests (`crates/idemq-server/tests/api/`) and the other
//! integration tests share. Not published; only test builds depend on it.
//!
//! - [`for_each_backend!`] holds **the one list of backends** every case runs
//!   on; adding a backend is one name there (and its fresh database in
//!   [`Harness::for_backend`]).
//! - [`instantiate!`] makes one test per case and backend, named
//!   `<module>::<backend>::<case>`, and skips a case on a backend that lacks a
//!   capability the case names (asked of the store through [`Supports`]).
//! - [`Harness`] is a queue on a fresh database with a movable clock of record;
//!   [`pg_database`] and [`pg_url`] give tests of their own a PostgreSQL
//!   database cloned from the migrated template; [`redis_url`] gives them a
//!   fresh key prefix on the test process's durable redis-server.
//!
//! A conformance module lists its cases once:
//!
//! ```
//! use idemq_testkit::Harness;
//!
//! idemq_testkit::instantiate!(
//!     replay_returns_original,
//!     caller_transactions_commit_with_the_callers_work [needs CallerTransactions],
//! );
//!
//! async fn replay_returns_original(h: Harness) {
//!     let _ = h.queue;
//! }
//!
//! async fn caller_transactions_commit_with_the_callers_work(h: Harness) {
//!     let _ = h.queue;
//! }
//! # fn main() {}
//! ```

mod backends;
mod harness;
pub mod ledger;
mod postgres;
mod redis;
mod through;

pub use backends::Supports;
pub use harness::{Harness, epoch};
pub use postgres::{PgDatabase, drop_pg_database, pg_admin_url, pg_database, pg_url};
pub use redis::{
    redis_command, redis_contents, redis_dir, redis_own_server, redis_own_server_with, redis_url,
};
pub use through::{Call, Tap, Through};
