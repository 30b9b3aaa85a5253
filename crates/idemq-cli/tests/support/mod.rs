//! Running the `idemq` binary against a database of its own.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A temp directory holding one SQLite database.
pub struct Db {
    pub dir: tempfile::TempDir,
}

impl Db {
    pub fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn url(&self) -> String {
        format!("sqlite://{}", self.path("cli.db").display())
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_idemq"));
        c.args(args)
            .env("IDEMQ_DATABASE_URL", self.url())
            .env("IDEMQ_DIR", self.dir.path())
            .env_remove("IDEMQ_KEY_SECRET")
            .env_remove("IDEMQ_TOKEN")
            .env_remove("IDEMQ_LISTEN");
        c
    }

    pub fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run idemq")
    }

    /// Runs with `--json`, asserts success and parses stdout.
    pub fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.run(&all);
        assert!(
            out.status.success(),
            "idemq {args:?} failed ({:?}): {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("one JSON document")
    }

    /// Enqueues and returns the job id.
    pub fn enqueue(&self, args: &[&str]) -> String {
        let mut all = vec!["enqueue"];
        all.extend_from_slice(args);
        self.json(&all)["job_id"]
            .as_str()
            .expect("job id")
            .to_owned()
    }

    /// The job as `jobs show --json` prints it.
    pub fn job(&self, id: &str) -> Value {
        self.json(&["jobs", "show", id])["job"].clone()
    }

    pub fn state(&self, id: &str) -> String {
        self.job(id)["state"].as_str().unwrap_or("").to_owned()
    }

    /// Starts `idemq ARGS` in the background.
    pub fn spawn(&self, args: &[&str]) -> Background {
        let child = self
            .command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn idemq");
        Background { child: Some(child) }
    }
}

/// A background `idemq` process, stopped with SIGTERM (killed if dropped).
pub struct Background {
    pub child: Option<Child>,
}

impl Background {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("child").id()
    }

    /// Sends SIGTERM and waits for the process to stop (at most 20 s).
    pub fn stop(mut self) -> Output {
        let child = self.child.take().expect("child");
        terminate(child.id());
        let start = Instant::now();
        let mut child = child;
        loop {
            if child.try_wait().expect("try_wait").is_some() {
                break;
            }
            if start.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                panic!("idemq did not stop within 20 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        child.wait_with_output().expect("output")
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn terminate(pid: u32) {
    let status = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// True while process `pid` exists and has not ended (a process that ended
/// but that its parent has not reaped yet, a zombie, has).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command's name, which ends with `)`.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => false,
    }
}

/// Polls `f` every 50 ms until it holds (at most `secs` seconds).
pub fn eventually(secs: u64, what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(secs),
            "not within {secs} s: {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
