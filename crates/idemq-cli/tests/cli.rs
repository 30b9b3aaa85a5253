//! The `idemq` binary, run as a user would run it.

use std::process::{Command, Output};

use serde_json::Value;

struct Db {
    dir: tempfile::TempDir,
}

impl Db {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.dir.path().join("cli.db").display())
    }

    fn run(&self, args: &[&str]) -> Output {
        Command::new(env!("CARGO_BIN_EXE_idemq"))
            .args(args)
            .env("IDEMQ_DATABASE_URL", self.url())
            .env_remove("IDEMQ_KEY_SECRET")
            .output()
            .expect("run idemq")
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = self.run(&all);
        assert!(
            out.status.success(),
            "idemq {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("one JSON document")
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn enqueue_twice_prints_accepted_then_replayed_with_the_same_id() {
    let db = Db::new();
    let first = db.run(&["enqueue", "--type", "demo", "--idempotency-key", "k1"]);
    let second = db.run(&["enqueue", "--type", "demo", "--idempotency-key", "k1"]);
    assert!(first.status.success() && second.status.success());
    let (a, b) = (stdout(&first), stdout(&second));
    let (oa, ida) = a.trim().split_once(' ').expect("outcome and id");
    let (ob, idb) = b.trim().split_once(' ').expect("outcome and id");
    assert_eq!((oa, ob), ("accepted", "replayed"));
    assert_eq!(ida, idb);
}

#[test]
fn conflict_exits_3_and_never_prints_the_raw_key() {
    let db = Db::new();
    let key = "order-submit:cust-17:cart-99";
    db.json(&[
        "enqueue",
        "--type",
        "demo",
        "--idempotency-key",
        key,
        "--payload",
        "1",
    ]);
    let out = db.run(&[
        "enqueue",
        "--type",
        "demo",
        "--idempotency-key",
        key,
        "--payload",
        "2",
    ]);
    assert_eq!(out.status.code(), Some(3));
    let all = format!("{}{}", stdout(&out), String::from_utf8_lossy(&out.stderr));
    assert!(all.contains("payload"), "{all}");
    assert!(!all.contains(key), "the raw key was printed: {all}");
}

#[test]
fn invalid_request_exits_2_and_writes_nothing() {
    let db = Db::new();
    let out = db.run(&["--json", "enqueue", "--type", "bad type"]);
    assert_eq!(out.status.code(), Some(2));
    let err: Value = serde_json::from_slice(&out.stderr).expect("JSON error");
    assert_eq!(err["field"], "type");
    assert_eq!(
        db.json(&["jobs", "list"])["jobs"].as_array().map(Vec::len),
        Some(0)
    );
}

/// A refusal of the command line itself is JSON under `--json` too
/// (`usage`, the message in `detail`), exit 2, and writes nothing.
#[test]
fn a_usage_error_is_json_under_json() {
    let db = Db::new();
    for args in [
        &["--json", "enqueue", "--type", "t", "--payload", "{bad"][..],
        &["--json", "enqueue", "--type", "t", "--retry", "weird"][..],
        &["--json", "jobs", "list", "--state", "bogus"][..],
    ] {
        let out = db.run(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
        let err: Value = serde_json::from_slice(&out.stderr)
            .unwrap_or_else(|e| panic!("{args:?}: not JSON ({e}): {}", stderr(&out)));
        assert_eq!(err["error"], "usage", "{args:?}: {err}");
        assert!(
            err["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{args:?}: {err}"
        );
    }
    assert_eq!(
        db.json(&["jobs", "list"])["jobs"].as_array().map(Vec::len),
        Some(0)
    );
}

#[test]
fn key_from_stdin_and_explain_writes_nothing() {
    let db = Db::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args([
            "--json",
            "enqueue",
            "--type",
            "demo",
            "--idempotency-key-file",
            "-",
        ])
        .env("IDEMQ_DATABASE_URL", db.url())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(b"secret-key-1\n")
        .expect("write");
    let out = child.wait_with_output().expect("wait");
    let accepted: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(accepted["outcome"], "accepted");
    let explained = db.json(&[
        "enqueue",
        "--type",
        "demo",
        "--idempotency-key",
        "secret-key-1",
        "--explain",
    ]);
    assert_eq!(explained["outcome"], "replayed");
    assert_eq!(explained["job_id"], accepted["job_id"]);
    let fresh = db.json(&[
        "enqueue",
        "--type",
        "demo",
        "--idempotency-key",
        "other",
        "--explain",
    ]);
    assert_eq!(fresh["outcome"], "accepted");
    assert_eq!(
        db.json(&["jobs", "list"])["jobs"].as_array().map(Vec::len),
        Some(1)
    );
}

#[test]
fn jobs_list_and_show() {
    let db = Db::new();
    let r = db.json(&[
        "enqueue",
        "--type",
        "report.build",
        "--queue",
        "reports",
        "--delay",
        "5m",
        "--tag",
        "eu",
        "--retry",
        "fixed:10s",
        "--dedupe-key",
        "acct-1",
        "--payload",
        r#"{"acct":1}"#,
    ]);
    let id = r["job_id"].as_str().expect("id").to_owned();
    let list = db.json(&["jobs", "list", "--state", "scheduled", "--queue", "reports"]);
    assert_eq!(list["jobs"][0]["id"], id.as_str());
    let shown = db.json(&["jobs", "show", &id]);
    assert_eq!(
        shown["job"]["retry"],
        serde_json::json!({"kind": "fixed", "delay_ms": 10000})
    );
    assert_eq!(shown["job"]["dedupe"]["holds_binding"], true);
    assert_eq!(shown["events"][0]["kind"], "accepted");
    let text = stdout(&db.run(&["jobs", "show", &id]));
    assert!(
        text.contains("report.build") && text.contains("scheduled"),
        "{text}"
    );
    let missing = db.run(&["jobs", "show", "nope"]);
    assert_eq!(missing.status.code(), Some(4));
}

#[test]
fn unknown_database_url_says_what_to_use() {
    let out = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["--database", "mysql://x", "jobs", "list"])
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("sqlite://"));
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `migrate --check` changes nothing and exits 1 while `migrate` has
/// something to do, 0 once it has not.
#[test]
fn migrate_check_exits_1_until_migrated_then_0() {
    let db = Db::new();
    let pending = db.run(&["migrate", "--check"]);
    assert_eq!(pending.status.code(), Some(1), "{}", stderr(&pending));
    assert!(
        stdout(&pending).contains("run `idemq migrate`"),
        "{}",
        stdout(&pending)
    );
    assert!(
        !db.dir.path().join("cli.db").exists(),
        "--check created the database"
    );
    let status = db.run(&["--json", "migrate", "--check"]);
    assert_eq!(status.status.code(), Some(1), "{}", stderr(&status));
    let status: Value = serde_json::from_slice(&status.stdout).expect("json");
    assert_eq!(status["up_to_date"], false);
    assert_eq!(status["current"], 0);
    assert!(status["pending"].as_array().is_some_and(|p| !p.is_empty()));
    assert_eq!(status["newer_schema"], Value::Null);

    db.json(&["migrate"]);
    let current = db.run(&["migrate", "--check"]);
    assert_eq!(current.status.code(), Some(0), "{}", stderr(&current));
    assert!(
        stdout(&current).contains("schema is up to date"),
        "{}",
        stdout(&current)
    );
    let status = db.json(&["migrate", "--check"]);
    assert_eq!(status["up_to_date"], true);
    assert_eq!(status["current"], status["latest"]);
    assert_eq!(status["pending"], serde_json::json!([]));
}

/// A schema newer than this binary: `migrate --check` exits 5, not the 1 of
/// "run `idemq migrate`", and names the idemq that wrote it, as `connect`
/// and `migrate` do.
#[test]
fn migrate_check_of_a_newer_schema_exits_5_naming_the_idemq_that_wrote_it() {
    let db = Db::new();
    db.json(&["migrate"]);
    let conn = rusqlite::Connection::open(db.dir.path().join("cli.db")).expect("open");
    conn.execute(
        "INSERT INTO idemq_migrations (version, name, applied_at, idemq_version)
         VALUES (9999, 'from_the_future', 0, '9.9.9')",
        [],
    )
    .expect("insert");
    drop(conn);
    let out = db.run(&["migrate", "--check"]);
    assert_eq!(
        out.status.code(),
        Some(5),
        "{}{}",
        stdout(&out),
        stderr(&out)
    );
    let text = stdout(&out);
    assert!(text.contains("version 9999"), "{text}");
    assert!(
        text.contains("run idemq 9.9.9 (which wrote it) or later"),
        "{text}"
    );
    // The same words as the refusal of every other command.
    let refused = db.run(&["jobs", "list"]);
    assert_eq!(refused.status.code(), Some(1), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("run idemq 9.9.9 (which wrote it) or later"),
        "{}",
        stderr(&refused)
    );

    let out = db.run(&["--json", "migrate", "--check"]);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    let status: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(status["current"], 9999);
    assert_eq!(status["up_to_date"], false);
    assert_eq!(status["written_by"], "9.9.9");
    assert!(
        status["newer_schema"]
            .as_str()
            .is_some_and(|m| m.contains("run idemq 9.9.9")),
        "{status}"
    );
}

/// `-` for both the payload and the key is a usage error (exit 2) saying
/// that stdin feeds only one of them, before stdin is read or the
/// database opened; the payload no longer takes stdin and leaves the key
/// empty.
#[test]
fn stdin_for_both_payload_and_key_is_a_usage_error() {
    let db = Db::new();
    let mut child = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args([
            "enqueue",
            "--type",
            "t",
            "--payload-file",
            "-",
            "--idempotency-key-file",
            "-",
        ])
        .env("IDEMQ_DATABASE_URL", db.url())
        .env_remove("IDEMQ_KEY_SECRET")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    use std::io::Write;
    // The command may exit before reading: a broken pipe is fine.
    let _ = child.stdin.take().expect("stdin").write_all(b"{}");
    let out = child.wait_with_output().expect("wait");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("--payload-file - and --idempotency-key-file - both read stdin")
            && err.contains("only one of them"),
        "{err}"
    );
    assert!(
        !db.dir.path().join("cli.db").exists(),
        "the database was opened"
    );
}

/// The same on PostgreSQL, where the idemq is read from
/// `idemq.schema_migrations`.
#[test]
fn migrate_check_of_a_newer_postgres_schema_exits_5_naming_the_idemq_that_wrote_it() {
    let db = idemq_testkit::PgDatabase::new();
    let url = db.url.clone();
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_idemq"))
            .args(args)
            .env("IDEMQ_DATABASE_URL", &url)
            .env_remove("IDEMQ_KEY_SECRET")
            .output()
            .expect("run idemq")
    };
    let current = run(&["migrate", "--check"]);
    assert_eq!(current.status.code(), Some(0), "{}", stdout(&current));
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            use sqlx::Connection;
            let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect");
            sqlx::query(
                "INSERT INTO idemq.schema_migrations (version, name, idemq_version)
                 VALUES (9999, 'from_the_future', '9.9.9')",
            )
            .execute(&mut conn)
            .await
            .expect("insert");
            conn.close().await.expect("close");
        });
    let out = run(&["--json", "migrate", "--check"]);
    assert_eq!(out.status.code(), Some(5), "{}", stderr(&out));
    let status: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(status["current"], 9999);
    assert_eq!(status["written_by"], "9.9.9");
    assert!(
        status["newer_schema"]
            .as_str()
            .is_some_and(|m| m.contains("run idemq 9.9.9 (which wrote it) or later")),
        "{status}"
    );
}

/// `idemq bench` checks a Redis server with idemq's store's own check
/// before it measures anything: a server with `no-appendfsync-on-rewrite
/// yes` (which skips the fsync while a rewrite runs) is refused, naming
/// the setting and `?durability=relaxed`.
#[test]
fn bench_refuses_a_redis_server_the_store_refuses() {
    let url = idemq_testkit::redis_own_server_with(&["--no-appendfsync-on-rewrite", "yes"]);
    let out = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["bench", "--only", "W1", "--database", &url])
        .env_remove("IDEMQ_DATABASE_URL")
        .env_remove("IDEMQ_KEY_SECRET")
        .output()
        .expect("run idemq");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("no-appendfsync-on-rewrite yes"), "{err}");
    assert!(err.contains("set `no-appendfsync-on-rewrite no`"), "{err}");
    assert!(err.contains("?durability=relaxed"), "{err}");
}
