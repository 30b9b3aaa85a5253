//! A redis-server of one test, in a temporary directory with the durable
//! settings, that the test can SIGKILL and start again on the same files.
//! What the fault tests of every backend share (retrying while a server is
//! down, reading a whole installation back, a job's ledger) is in the test
//! kit (`idemq_testkit::ledger`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemq::Queue;

/// The settings under which nothing acknowledged is lost (SPEC 10).
const DURABLE: &[(&str, &str)] = &[
    ("appendonly", "yes"),
    ("appendfsync", "always"),
    ("no-appendfsync-on-rewrite", "no"),
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
