//! `idemq worker --exec CMD`, end to end: real processes sharing one SQLite file.

mod support;

use serde_json::json;
use support::{Db, alive, eventually};

const FAST: &[&str] = &["--poll-ms", "50", "--grace", "5s"];

fn worker(db: &Db, cmd: &str, extra: &[&str]) -> support::Background {
    let mut args = vec!["worker", "--exec", cmd];
    args.extend_from_slice(FAST);
    args.extend_from_slice(extra);
    db.spawn(&args)
}

#[test]
fn exit_0_completes_with_stdout_as_result_payload_on_stdin_and_env_set() {
    let db = Db::new();
    let ids: Vec<String> = (0..3)
        .map(|i| {
            db.enqueue(&[
                "--type",
                "report.build",
                "--queue",
                "reports",
                "--max-attempts",
                "4",
                "--payload",
                &format!(r#"{{"n":{i},"name":"r\u00e9sum\u00e9"}}"#),
            ])
        })
        .collect();
    let w = worker(
        &db,
        r#"cat > "$IDEMQ_DIR/$IDEMQ_JOB_ID.payload"
echo "$IDEMQ_JOB_ID $IDEMQ_JOB_TYPE $IDEMQ_JOB_QUEUE $IDEMQ_ATTEMPT $IDEMQ_MAX_ATTEMPTS" > "$IDEMQ_DIR/$IDEMQ_JOB_ID.env"
echo '{"done": true}'"#,
        &["--concurrency", "2"],
    );
    eventually(30, "every job completed", || {
        ids.iter().all(|id| db.state(id) == "completed")
    });
    let out = w.stop();
    assert!(out.status.success(), "{}", support::stderr(&out));
    assert!(
        support::stdout(&out).contains("3 completed"),
        "{}",
        support::stdout(&out)
    );
    for (i, id) in ids.iter().enumerate() {
        let job = db.job(id);
        assert_eq!(job["result"], json!({"done": true}));
        let payload = std::fs::read_to_string(db.path(&format!("{id}.payload"))).expect("payload");
        let payload: serde_json::Value = serde_json::from_str(&payload).expect("JSON on stdin");
        assert_eq!(payload, json!({"n": i, "name": "résumé"}));
        let env = std::fs::read_to_string(db.path(&format!("{id}.env"))).expect("env");
        assert_eq!(env.trim(), format!("{id} report.build reports 1 4"));
    }
}

#[test]
fn exit_75_schedules_a_retry_with_the_output_as_error() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t", "--retry", "fixed:1h", "--max-attempts", "3"]);
    let w = worker(&db, "echo trying; echo 'busy, later' >&2; exit 75", &[]);
    eventually(30, "the retry is scheduled", || {
        db.job(&id)["attempts_used"] == 1
    });
    assert!(w.stop().status.success());
    let job = db.job(&id);
    assert_eq!(job["state"], "scheduled");
    let error = job["last_error"].as_str().expect("last_error");
    assert!(error.contains("exit status 75"), "{error}");
    assert!(
        error.contains("trying") && error.contains("busy, later"),
        "{error}"
    );
}

#[test]
fn other_exit_fails_with_the_tail_of_the_output() {
    let db = Db::new();
    let short = db.enqueue(&["--type", "a", "--max-attempts", "1"]);
    let long = db.enqueue(&["--type", "b", "--max-attempts", "1"]);
    let w = worker(
        &db,
        r#"if [ "$IDEMQ_JOB_TYPE" = a ]; then echo 'disk full' >&2; exit 3; fi
i=0; while [ $i -lt 2000 ]; do echo "line $i of noise"; i=$((i+1)); done; echo THE-END; exit 1"#,
        &[],
    );
    eventually(30, "both jobs dead", || {
        db.state(&short) == "dead" && db.state(&long) == "dead"
    });
    assert!(w.stop().status.success());
    let error = db.job(&short)["last_error"].as_str().unwrap().to_owned();
    assert!(error.starts_with("exit status 3"), "{error}");
    assert!(error.contains("disk full"), "{error}");
    let error = db.job(&long)["last_error"].as_str().unwrap().to_owned();
    assert!(error.starts_with("exit status 1"), "{}", &error[..80]);
    assert!(error.trim_end().ends_with("THE-END"), "the tail is kept");
    assert!(error.len() <= 8 * 1024, "{}", error.len());
    assert!(!error.contains("line 0 of noise"), "only the tail is kept");
}

#[test]
fn types_and_queues_limit_what_is_claimed() {
    let db = Db::new();
    let mine = db.enqueue(&["--type", "a", "--queue", "q1"]);
    let other_type = db.enqueue(&["--type", "b", "--queue", "q1"]);
    let other_queue = db.enqueue(&["--type", "a", "--queue", "q2"]);
    let w = worker(
        &db,
        "cat > /dev/null; exit 0",
        &["--types", "a,c", "--queues", "q1"],
    );
    eventually(30, "the matching job completed", || {
        db.state(&mine) == "completed"
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(w.stop().status.success());
    assert_eq!(db.state(&other_type), "ready");
    assert_eq!(db.state(&other_queue), "ready");
}

#[test]
fn timeout_kills_the_command_and_what_it_started() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "slow", "--timeout", "1s", "--max-attempts", "1"]);
    let w = worker(
        &db,
        r#"echo $$ > "$IDEMQ_DIR/sh.pid"; sleep 60 & echo $! > "$IDEMQ_DIR/bg.pid"; wait"#,
        &[],
    );
    eventually(30, "the job is dead after its timeout", || {
        db.state(&id) == "dead"
    });
    let error = db.job(&id)["last_error"].as_str().unwrap().to_owned();
    assert!(error.contains("timed out"), "{error}");
    let (sh, bg) = (pid(&db, "sh.pid").unwrap(), pid(&db, "bg.pid").unwrap());
    eventually(10, "the command and its child are gone", || {
        !alive(sh) && !alive(bg)
    });
    assert!(w.stop().status.success());
}

/// The process id a command wrote to `file`, once written.
fn pid(db: &Db, file: &str) -> Option<u32> {
    std::fs::read_to_string(db.path(file))
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[test]
fn a_worker_killed_by_sigkill_takes_its_commands_with_it() {
    let db = Db::new();
    db.enqueue(&["--type", "slow"]);
    let mut w = worker(
        &db,
        r#"echo $$ > "$IDEMQ_DIR/sh.pid"; sleep 60 & echo $! > "$IDEMQ_DIR/bg.pid"; wait"#,
        &[],
    );
    eventually(30, "the command started a child", || {
        pid(&db, "sh.pid").is_some() && pid(&db, "bg.pid").is_some()
    });
    let (sh, bg) = (pid(&db, "sh.pid").unwrap(), pid(&db, "bg.pid").unwrap());
    assert!(alive(sh) && alive(bg));
    // Nothing in the worker runs after a SIGKILL: only its commands' guards
    // can end them.
    let mut worker = w.child.take().expect("worker");
    worker.kill().expect("SIGKILL the worker");
    worker.wait().expect("reap the worker");
    eventually(5, "the command and its child are gone", || {
        !alive(sh) && !alive(bg)
    });
}

/// The guard of `worker`'s commands: its child running `idemq exec-guard`.
fn guard_of(worker: u32) -> u32 {
    let mut found = None;
    for entry in std::fs::read_dir("/proc").expect("/proc") {
        let name = entry.expect("entry").file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if parent == Some(worker) && cmdline.split(|b| *b == 0).any(|a| a == b"exec-guard") {
            assert!(found.is_none(), "one guard per worker");
            found = Some(pid);
        }
    }
    found.expect("the worker's guard")
}

#[test]
fn a_command_killed_by_a_signal_fails_naming_it() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t", "--max-attempts", "1"]);
    let w = worker(&db, "echo going; kill -TERM $$; sleep 5", &[]);
    eventually(30, "the job is dead", || db.state(&id) == "dead");
    assert!(w.stop().status.success());
    let error = db.job(&id)["last_error"].as_str().unwrap().to_owned();
    assert!(error.starts_with("killed by signal 15"), "{error}");
    assert!(error.contains("going"), "{error}");
}

/// SIGTERM lets a running command finish within the grace period. A
/// service manager's stop (systemd's, a container's) sends it to every
/// process of the unit, the guard included: the guard outlives it, stays
/// there while the command finishes, and ends with the worker.
#[test]
fn sigterm_lets_a_running_command_finish_within_the_grace_period() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t"]);
    let w = worker(
        &db,
        r#"touch "$IDEMQ_DIR/started"; sleep 1; echo '"finished"'"#,
        &[],
    );
    eventually(30, "the command started", || db.path("started").exists());
    let guard = guard_of(w.pid());
    support::terminate(guard);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(alive(guard), "the guard outlives SIGTERM");
    let out = w.stop();
    assert!(out.status.success(), "{}", support::stderr(&out));
    assert!(
        !support::stderr(&out).contains("guard"),
        "{}",
        support::stderr(&out)
    );
    let job = db.job(&id);
    assert_eq!(job["state"], "completed");
    assert_eq!(job["result"], "finished");
    eventually(5, "the guard ended with its worker", || !alive(guard));
}

#[test]
fn sigterm_past_the_grace_period_releases_the_job() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t"]);
    let w = db.spawn(&[
        "worker",
        "--exec",
        r#"touch "$IDEMQ_DIR/started"; sleep 60"#,
        "--poll-ms",
        "50",
        "--grace",
        "200ms",
    ]);
    eventually(30, "the command started", || db.path("started").exists());
    let out = w.stop();
    assert!(out.status.success(), "{}", support::stderr(&out));
    assert!(
        support::stdout(&out).contains("1 released"),
        "{}",
        support::stdout(&out)
    );
    let job = db.job(&id);
    assert_eq!(job["state"], "ready");
    assert_eq!(job["attempts_used"], 0);
}
