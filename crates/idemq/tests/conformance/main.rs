//! The conformance suite: the behaviour of docs/ (http-api, idempotency, dedupe, worker, state-machine), one set of cases run
//! once per backend.
//!
//! Each case is an `async fn(Harness)` in one of the modules below. Each
//! module lists its cases once with `idemq_testkit::instantiate!`, which
//! makes one test per case and per backend of the test kit's one list, named
//! `<module>::<backend>::<case>`; a case that needs a capability names it
//! (`case [needs CallerTransactions]`) and is skipped, saying why, on a
//! backend without it. Time moves through the harness's clock, never by
//! sleeping.

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
