//! Operator commands: cancel, cancel-by-key, purge, promote, pause, resume,
//! dead list|redrive, schedules list|set|delete.

mod support;

use serde_json::json;
use support::{Db, eventually, stderr, stdout};

#[test]
fn cancel_a_waiting_job_then_again_then_an_unknown_one() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t", "--delay", "1h"]);
    let r = db.json(&["cancel", &id]);
    assert_eq!(r["changed"], true);
    assert_eq!(r["state"], "cancelled");
    assert_eq!(db.state(&id), "cancelled");
    let again = db.run(&["cancel", &id]);
    assert!(again.status.success());
    assert!(
        stdout(&again).contains("already cancelled"),
        "{}",
        stdout(&again)
    );
    assert_eq!(db.run(&["cancel", "no-such-job"]).status.code(), Some(4));
}

#[test]
fn cancel_by_key_cancels_the_keyed_job_and_frees_the_key() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "sync", "--dedupe-key", "acct-1", "--delay", "1h"]);
    let r = db.json(&["cancel-by-key", "--type", "sync", "--key", "acct-1"]);
    assert_eq!(r["changed"], true);
    assert_eq!(db.state(&id), "cancelled");
    let fresh = db.json(&["enqueue", "--type", "sync", "--dedupe-key", "acct-1"]);
    assert_eq!(fresh["outcome"], "accepted");
    let none = db.json(&["cancel-by-key", "--type", "sync", "--key", "acct-2"]);
    assert_eq!(none["changed"], false);
}

#[test]
fn purge_deletes_a_finished_job_and_says_why_it_will_not_purge() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t"]);
    db.json(&["cancel", &id]);
    let r = db.json(&["purge", &id]);
    assert_eq!(r["changed"], true);
    assert_eq!(db.run(&["jobs", "show", &id]).status.code(), Some(4));
    assert_eq!(db.run(&["purge", &id]).status.code(), Some(4));
}

#[test]
fn promote_makes_a_scheduled_job_due() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t", "--delay", "1h"]);
    assert_eq!(db.state(&id), "scheduled");
    assert_eq!(db.json(&["promote", &id])["changed"], true);
    assert_eq!(db.state(&id), "ready");
    let again = db.json(&["promote", &id]);
    assert_eq!(
        (again["changed"].clone(), again["state"].clone()),
        (json!(false), json!("ready"))
    );
    assert_eq!(db.run(&["promote", "nope"]).status.code(), Some(4));
}

#[test]
fn pause_stops_claims_and_resume_restarts_them() {
    let db = Db::new();
    let r = db.json(&["pause", "mail"]);
    assert_eq!(
        (r["paused"].clone(), r["changed"].clone()),
        (json!(true), json!(true))
    );
    let id = db.enqueue(&["--type", "t", "--queue", "mail"]);
    let w = db.spawn(&["worker", "--exec", "exit 0", "--poll-ms", "50"]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(db.state(&id), "ready", "a paused queue is not claimed");
    let again = db.run(&["pause", "mail"]);
    assert!(
        stdout(&again).contains("already paused"),
        "{}",
        stdout(&again)
    );
    assert_eq!(db.json(&["resume", "mail"])["changed"], true);
    eventually(30, "the job ran after resume", || {
        db.state(&id) == "completed"
    });
    assert!(w.stop().status.success());
    assert_eq!(db.json(&["resume", "mail"])["changed"], false);
    assert_eq!(db.run(&["pause", "bad queue"]).status.code(), Some(2));
}

/// Runs a failing worker until every listed job is dead.
fn kill_jobs(db: &Db, ids: &[&str]) {
    let w = db.spawn(&[
        "worker",
        "--exec",
        "echo boom >&2; exit 1",
        "--poll-ms",
        "50",
    ]);
    eventually(30, "the jobs are dead", || {
        ids.iter().all(|id| db.state(id) == "dead")
    });
    assert!(w.stop().status.success());
}

#[test]
fn dead_list_and_redrive_one_idempotently() {
    let db = Db::new();
    let a = db.enqueue(&[
        "--type",
        "mail.send",
        "--queue",
        "mail",
        "--max-attempts",
        "1",
    ]);
    let b = db.enqueue(&["--type", "report", "--max-attempts", "1"]);
    kill_jobs(&db, &[&a, &b]);
    let list = db.json(&["dead", "list"]);
    assert_eq!(list["jobs"].as_array().map(Vec::len), Some(2));
    let mail = db.json(&["dead", "list", "--queue", "mail"]);
    assert_eq!(mail["jobs"][0]["id"], a.as_str());
    assert_eq!(mail["jobs"].as_array().map(Vec::len), Some(1));
    let by_type = db.json(&["dead", "list", "--type", "report", "--limit", "5"]);
    assert_eq!(by_type["jobs"][0]["id"], b.as_str());
    let text = stdout(&db.run(&["dead", "list"]));
    assert!(
        text.contains("boom") && text.contains("mail.send"),
        "{text}"
    );

    let key = db.path("redrive.key");
    std::fs::write(&key, "redrive-1\n").unwrap();
    let key = key.to_str().unwrap();
    let r = db.json(&[
        "dead",
        "redrive",
        &a,
        "--idempotency-key-file",
        key,
        "--max-attempts",
        "2",
    ]);
    assert_eq!(r["job_id"], a.as_str());
    assert_eq!(r["outcome"], "accepted");
    let job = db.job(&a);
    assert_eq!(
        (job["state"].clone(), job["max_attempts"].clone()),
        (json!("ready"), json!(2))
    );
    let again = db.json(&[
        "dead",
        "redrive",
        &a,
        "--idempotency-key-file",
        key,
        "--max-attempts",
        "2",
    ]);
    assert_eq!(again["outcome"], "replayed");
    let not_dead = db.run(&["dead", "redrive", &a]);
    assert_eq!(not_dead.status.code(), Some(1), "{}", stderr(&not_dead));
    assert!(
        stderr(&not_dead).contains("not dead"),
        "{}",
        stderr(&not_dead)
    );
    assert_eq!(
        db.run(&["dead", "redrive"]).status.code(),
        Some(2),
        "an id or --all"
    );
}

#[test]
fn dead_redrive_all_of_one_queue() {
    let db = Db::new();
    let mail: Vec<String> = (0..3)
        .map(|_| db.enqueue(&["--type", "t", "--queue", "mail", "--max-attempts", "1"]))
        .collect();
    let other = db.enqueue(&["--type", "t", "--queue", "other", "--max-attempts", "1"]);
    let mut all: Vec<&str> = mail.iter().map(String::as_str).collect();
    all.push(&other);
    kill_jobs(&db, &all);
    let r = db.json(&["dead", "redrive", "--all", "--queue", "mail"]);
    assert_eq!(r["redriven"], 3);
    for id in &mail {
        assert_eq!(db.state(id), "ready");
    }
    assert_eq!(db.state(&other), "dead");
    let text = stdout(&db.run(&["dead", "redrive", "--all"]));
    assert!(text.contains("redrove 1 dead job"), "{text}");
    assert_eq!(db.state(&other), "ready");
}

#[test]
fn schedules_list_shows_an_unreadable_row_apart() {
    let db = Db::new();
    for name in ["good", "broken"] {
        db.json(&["schedules", "set", name, "--every", "1h", "--type", "t"]);
    }
    // A template this version cannot decode (a member a newer idemq knows).
    let conn = rusqlite::Connection::open(db.path("cli.db")).expect("open");
    conn.execute(
        "UPDATE idemq_schedules SET job = ?2 WHERE name = ?1",
        ["broken", r#"{"type": "t", "from_a_newer_idemq": 1}"#],
    )
    .expect("corrupt");
    drop(conn);

    let list = db.json(&["schedules", "list"]);
    let names: Vec<&str> = list["schedules"]
        .as_array()
        .expect("schedules")
        .iter()
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(names, ["good"], "{list}");
    assert_eq!(list["unreadable"][0]["name"], "broken", "{list}");
    let why = list["unreadable"][0]["error"].as_str().expect("error");
    assert!(why.contains("from_a_newer_idemq"), "{why}");

    let out = db.run(&["schedules", "list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let broken = text
        .lines()
        .find(|l| l.starts_with("broken"))
        .unwrap_or_else(|| panic!("no line of the broken schedule: {text}"));
    assert!(broken.contains("unreadable: "), "{text}");
    assert!(text.contains("good"), "{text}");

    // Setting another schedule still answers with its next fire.
    let r = db.json(&["schedules", "set", "good", "--every", "2h", "--type", "t"]);
    assert!(r["next_fire_at"].is_string(), "{r}");
}

#[test]
fn schedules_set_list_replace_delete() {
    let db = Db::new();
    let r = db.json(&[
        "schedules",
        "set",
        "nightly",
        "--cron",
        "0 0 3 * * *",
        "--timezone",
        "Europe/Paris",
        "--type",
        "report.build",
        "--payload",
        r#"{"kind":"daily"}"#,
        "--queue",
        "reports",
    ]);
    assert_eq!(r["created"], true);
    assert!(r["next_fire_at"].is_string());
    let r = db.json(&[
        "schedules",
        "set",
        "tick",
        "--every",
        "1h",
        "--type",
        "t",
        "--paused",
    ]);
    assert_eq!(r["created"], true);
    let list = db.json(&["schedules", "list"]);
    let all = list["schedules"].as_array().expect("schedules");
    assert_eq!(all.len(), 2);
    let nightly = all
        .iter()
        .find(|s| s["name"] == "nightly")
        .expect("nightly");
    assert_eq!(nightly["timezone"], "Europe/Paris");
    assert_eq!(nightly["job"]["payload"], json!({"kind": "daily"}));
    assert_eq!(nightly["job"]["queue"], "reports");
    let tick = all.iter().find(|s| s["name"] == "tick").expect("tick");
    assert_eq!(
        (tick["every_ms"].clone(), tick["paused"].clone()),
        (json!(3_600_000), json!(true))
    );
    let text = stdout(&db.run(&["schedules", "list"]));
    assert!(
        text.contains("nightly") && text.contains("every 1h"),
        "{text}"
    );

    let replaced = db.json(&["schedules", "set", "tick", "--every", "2h", "--type", "t"]);
    assert_eq!(replaced["created"], false);
    let bad = db.run(&["schedules", "set", "x", "--cron", "not cron", "--type", "t"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));
    let neither = db.run(&["schedules", "set", "x", "--type", "t"]);
    assert_eq!(neither.status.code(), Some(2));

    assert_eq!(db.json(&["schedules", "delete", "tick"])["deleted"], true);
    assert_eq!(
        db.run(&["schedules", "delete", "tick"]).status.code(),
        Some(4)
    );
    assert_eq!(
        db.json(&["schedules", "list"])["schedules"]
            .as_array()
            .map(Vec::len),
        Some(1)
    );
}
