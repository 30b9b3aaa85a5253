//! One key secret per installation, through the binary: `serve`, `worker`
//! and every other command refuse a process whose `IDEMQ_KEY_SECRET` hashes
//! keys differently from the installation, and `key-secret reset` changes
//! it deliberately, saying what it cost. On a SQLite file and on PostgreSQL.

use std::process::{Command, Output};

fn idemq(database: &str, secret: Option<&str>, args: &[&str]) -> Output {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut c = Command::new(env!("CARGO_BIN_EXE_idemq"));
    c.args(args)
        .env("IDEMQ_DATABASE_URL", database)
        .env("IDEMQ_DIR", dir.path())
        .env_remove("IDEMQ_TOKEN")
        .env_remove("IDEMQ_LISTEN")
        .env_remove("IDEMQ_KEY_SECRET");
    if let Some(s) = secret {
        c.env("IDEMQ_KEY_SECRET", s);
    }
    c.output().expect("run idemq")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[track_caller]
fn refused(o: &Output) {
    assert_eq!(o.status.code(), Some(1), "{}", text(o));
    let t = text(o);
    assert!(t.contains("IDEMQ_KEY_SECRET"), "{t}");
    assert!(!t.contains("secret-a") && !t.contains("secret-b"), "{t}");
}

/// [`refused`], run with `--json`: the error has a name of its own.
#[track_caller]
fn refused_json(o: &Output) {
    refused(o);
    let e: serde_json::Value = serde_json::from_slice(&o.stderr).expect("JSON error");
    assert_eq!(e["error"], "key-secret-mismatch", "{e}");
    assert!(
        e["detail"]
            .as_str()
            .is_some_and(|d| d.contains("IDEMQ_KEY_SECRET")),
        "{e}"
    );
}

fn scenario(database: &str) {
    let enqueue = [
        "--json",
        "enqueue",
        "--type",
        "t",
        "--idempotency-key",
        "k-1",
    ];
    let first = idemq(database, Some("secret-a"), &enqueue);
    assert!(first.status.success(), "{}", text(&first));
    // Another secret, or none: refused at connect by serve, worker and enqueue.
    for secret in [Some("secret-b"), None] {
        refused(&idemq(
            database,
            secret,
            &["serve", "--listen", "127.0.0.1:0"],
        ));
        refused(&idemq(database, secret, &["worker", "--exec", "true"]));
        refused_json(&idemq(database, secret, &enqueue));
    }
    let check = idemq(database, Some("secret-a"), &["key-secret", "check"]);
    assert!(check.status.success(), "{}", text(&check));
    refused(&idemq(database, Some("secret-b"), &["key-secret", "check"]));
    refused_json(&idemq(
        database,
        Some("secret-b"),
        &["--json", "key-secret", "check"],
    ));
    // Reset needs --yes and says what it costs first: processes already
    // running are checked only at connect, so they keep the old hashing.
    let no = idemq(database, Some("secret-b"), &["key-secret", "reset"]);
    assert_eq!(no.status.code(), Some(2), "{}", text(&no));
    let t = text(&no);
    assert!(t.contains("--yes"), "{t}");
    assert!(
        t.contains("Processes already running keep hashing keys with the old secret")
            && t.contains("stop them first, or restart them all at once")
            && t.contains("refused at connect"),
        "{t}"
    );
    assert!(!t.contains("refused until restarted"), "{t}");
    refused(&idemq(database, Some("secret-b"), &enqueue));
    let yes = idemq(
        database,
        Some("secret-b"),
        &["--json", "key-secret", "reset", "--yes"],
    );
    assert!(yes.status.success(), "{}", text(&yes));
    let v: serde_json::Value = serde_json::from_slice(&yes.stdout).expect("json");
    assert_eq!(v["orphaned_bindings"], 1);
    // The new secret connects (and, as told, accepts the orphaned key anew);
    // the old one is refused.
    let again = idemq(database, Some("secret-b"), &enqueue);
    assert!(again.status.success(), "{}", text(&again));
    let v: serde_json::Value = serde_json::from_slice(&again.stdout).expect("json");
    assert_eq!(v["outcome"], "accepted");
    refused(&idemq(database, Some("secret-a"), &enqueue));
}

#[test]
fn key_secret_is_checked_on_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    scenario(&format!("sqlite://{}", dir.path().join("k.db").display()));
}

#[test]
fn key_secret_is_checked_on_postgres() {
    let db = idemq_testkit::PgDatabase::new();
    let url = db.url.clone();
    scenario(&url);
}
