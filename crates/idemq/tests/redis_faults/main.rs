//! Fault tests on Redis with real processes: each test starts its own
//! `redis-server` in a temporary directory with the durable settings
//! (`appendonly yes`, `appendfsync always`, `no-appendfsync-on-rewrite
//! no`, `maxmemory-policy noeviction`, asserted with `CONFIG GET` on the
//! running server), and kills it, a
//! worker process or the connections, then counts what survived.
//!
//! - `crash`: redis-server SIGKILLed during 8 producers' keyed enqueues
//!   and restarted on the same files.
//! - `connection_drop`: every client connection killed (`CLIENT KILL TYPE
//!   normal`) again and again under producers and a worker.
//! - `failure_modes`: the failures Redis queues are known for, one case
//!   each.
//!
//! A worker process SIGKILLed mid-drain is `drain_kill`, on every backend.
//!
//! A missing `redis-server` fails every test, never skips it.
//!
//! Run: `cargo test -p idemq --features redis --test redis_faults -- --nocapture`.
#![cfg(feature = "redis")]

mod connection_drop;
mod crash;
mod failure_modes;
mod server;

use std::time::Duration;

use idemq::Queue;
use idemq::worker::{HandlerContext, JobError, Worker};
use serde_json::Value;

const CHILD_URL: &str = "IDEMQ_REDIS_FAULT_CHILD_URL";
const CHILD_NAME: &str = "IDEMQ_REDIS_FAULT_CHILD_NAME";

/// The lease of the workers the tests kill: short, so their jobs come back
/// within seconds.
const CHILD_LEASE: Duration = Duration::from_secs(1);
/// How many jobs a child worker runs at once.
const CHILD_CONCURRENCY: usize = 16;

/// A job that outlives any kill.
async fn stuck_work(_ctx: HandlerContext, _p: Value) -> Result<(), JobError> {
    tokio::time::sleep(Duration::from_secs(600)).await;
    Ok(())
}

/// Not a test of its own: the entry point of the worker process the tests
/// start (this test binary, run again with `CHILD_URL` set) and SIGKILL.
/// Ignored, so a normal run neither runs nor counts it.
#[test]
#[ignore = "the entry point of a child process the other tests start"]
fn redis_fault_child_worker_process() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        return;
    };
    let name = std::env::var(CHILD_NAME).expect("worker name");
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let queue = Queue::connect(&url).await.expect("child connects");
        Worker::new(queue)
            .name(name)
            .lease(CHILD_LEASE)
            .poll_interval(Duration::from_millis(100))
            .concurrency(CHILD_CONCURRENCY)
            .maintenance(false)
            .handle("stuck.work", stuck_work)
            .run(std::future::pending::<()>())
            .await
            .expect("child worker");
    });
}

/// Starts a worker process named `name` on `url`.
fn spawn_child(url: &str, name: &str) -> std::process::Child {
    std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "redis_fault_child_worker_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_URL, url)
        .env(CHILD_NAME, name)
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start the worker process")
}
