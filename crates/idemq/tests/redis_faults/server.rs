//! A redis-server of one test, in a temporary directory with the durable
//! settings, that the test can SIGKILL and start again on the same files;
//! and what the tests share: retrying while Redis is down, reading a whole
//! queue back, and a job's ledger.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemq::{Error, Job, JobList, Queue};

/// The settings under which nothing acknowledged is lost (SPEC 10).
const DURABLE: &[(&str, &str)] = &[
    ("appendonly", "yes"),
    ("appendfsync", "always"),
    ("maxmemory-policy", "noeviction"),
];

/// A redis-server on a unix socket in a directory of its own; killed when
/// dropped.
pub struct RedisServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl RedisServer {
    /// Starts one with the durable settings (`--save ""`: the AOF alone
    /// keeps the data). Panics, failing the test, when `redis-server`
    /// cannot be started: these tests never skip.
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut server = Self { child: None, dir };
        server.spawn();
        server
    }

    fn socket(&self) -> PathBuf {
        self.dir.path().join("r.sock")
    }

    /// `redis+unix://…` of this server.
    pub fn url(&self) -> String {
        format!("redis+unix://{}", self.socket().display())
    }

    fn spawn(&mut self) {
        // A SIGKILLed server leaves its socket file behind: remove it, so
        // its reappearance says the new process listens.
        let _ = std::fs::remove_file(self.socket());
        let mut cmd = Command::new("redis-server");
        cmd.arg("--port")
            .arg("0")
            .arg("--unixsocket")
            .arg(self.socket())
            .arg("--dir")
            .arg(self.dir.path())
            .args(["--save", ""]);
        for (name, value) in DURABLE {
            cmd.arg(format!("--{name}")).arg(value);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start redis-server (install it: apt-get install redis-server); the \
                     Redis fault tests fail without it: {e}"
                )
            });
        self.child = Some(child);
        let start = Instant::now();
        while !self.socket().exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not open {}",
                self.socket().display()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// SIGKILL: no shutdown, no final fsync; what survives is what
    /// `appendfsync always` wrote before each reply.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL redis-server");
            child.wait().expect("reap redis-server");
        }
    }

    /// Starts the server again on the same directory (it reloads the AOF).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart a killed server only");
        self.spawn();
    }

    /// A command on a connection of its own (not the store's), retried
    /// for up to 10 s while a restarted server loads its AOF.
    pub async fn command(&self, args: &[&str]) -> redis::Value {
        let start = Instant::now();
        loop {
            match self.try_command(args).await {
                Ok(v) => return v,
                Err(_) if start.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => panic!("{args:?} on the side connection: {e}"),
            }
        }
    }

    async fn try_command(&self, args: &[&str]) -> redis::RedisResult<redis::Value> {
        let client = redis::Client::open(self.url())?;
        let mut conn = client.get_multiplexed_async_connection().await?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query_async(&mut conn).await
    }

    /// Asserts the durable settings are in force on the running server:
    /// a SIGKILL proves crash survival only with them.
    pub async fn assert_durable(&self) {
        for (name, wanted) in DURABLE {
            let got = self.command(&["CONFIG", "GET", name]).await;
            let got: Vec<String> = redis::from_redis_value(got).expect("CONFIG GET reply");
            assert_eq!(
                got,
                vec![(*name).to_owned(), (*wanted).to_owned()],
                "CONFIG GET {name}"
            );
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Migrates the server's installation and opens a queue on it through
/// the one URL reader (`Queue::connect`).
pub async fn queue(server: &RedisServer) -> Queue {
    idemq::store::redis::migrate(&server.url())
        .await
        .expect("migrate");
    Queue::connect(&server.url()).await.expect("connect")
}

/// Runs `op` until it answers something other than `Unavailable` (Redis
/// down, loading its AOF, or the connection being re-established), for at
/// most 20 s.
pub async fn retry<T, F, Fut>(mut op: F) -> idemq::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = idemq::Result<T>>,
{
    let start = Instant::now();
    loop {
        match op().await {
            Err(Error::Unavailable { .. }) if start.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// Every job of the installation, newest first.
pub async fn all_jobs(queue: &Queue) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut cursor = None;
    loop {
        let page = retry(|| {
            queue.list(JobList {
                limit: 1000,
                cursor: cursor.clone(),
                ..JobList::default()
            })
        })
        .await
        .expect("list");
        jobs.extend(page.jobs);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return jobs,
        }
    }
}

/// (completed, active) jobs over every queue.
pub async fn counts(queue: &Queue) -> (u64, u64) {
    retry(|| queue.queues())
        .await
        .expect("queues")
        .iter()
        .fold((0, 0), |(c, a), q| {
            (c + q.counts.completed, a + q.counts.active)
        })
}

/// Waits until at least `n` jobs are completed.
pub async fn wait_completed(queue: &Queue, n: u64, within: Duration) {
    let start = Instant::now();
    loop {
        let (done, _) = counts(queue).await;
        if done >= n {
            return;
        }
        assert!(
            start.elapsed() < within,
            "only {done} of {n} jobs completed after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What one job's events and run ledger say.
#[derive(Debug, Default)]
pub struct Ledger {
    pub completed_events: usize,
    pub lease_expired_events: usize,
    pub completed_runs: usize,
    /// Runs with no outcome yet.
    pub unfinished_runs: usize,
    /// Workers of the `lease_expired` runs, in order.
    pub expired_by: Vec<String>,
    /// Outcomes of the other runs (neither completed nor lease_expired).
    pub other_runs: Vec<String>,
    pub runs: usize,
}

impl Ledger {
    /// Reads a job's events and runs.
    pub async fn of(queue: &Queue, job_id: &str) -> Self {
        let mut l = Self::default();
        for e in retry(|| queue.events(job_id)).await.expect("events") {
            match e.kind.as_str() {
                "completed" => l.completed_events += 1,
                "lease_expired" => l.lease_expired_events += 1,
                _ => {}
            }
        }
        let runs = retry(|| queue.runs(job_id)).await.expect("runs");
        l.runs = runs.len();
        for r in runs {
            match r.outcome.as_deref() {
                Some("completed") => l.completed_runs += 1,
                Some("lease_expired") => l.expired_by.push(r.worker),
                Some(other) => l.other_runs.push(other.to_owned()),
                None => l.unfinished_runs += 1,
            }
        }
        l
    }

    /// Completed exactly once, every other attempt recorded as cut short
    /// by an expired lease: what "repeats only with recorded attempts" means.
    pub fn problems(&self, job: &Job) -> Option<String> {
        let ok = self.completed_events == 1
            && self.completed_runs == 1
            && self.unfinished_runs == 0
            && self.other_runs.is_empty()
            && self.lease_expired_events == self.expired_by.len()
            && usize::try_from(job.attempt).ok() == Some(self.runs);
        (!ok).then(|| format!("{} (attempt {}): {self:?}", job.id, job.attempt))
    }
}
