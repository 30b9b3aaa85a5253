//! `idemq serve` and `idemq demo`, run as a user would run them.

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use support::{Background, Db, eventually, stderr};

/// Starts `idemq serve` on a free port and returns it with its address.
fn serve(db: &Db, extra: &[&str]) -> (Background, String) {
    let mut args = vec!["serve", "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let mut bg = db.spawn(&args);
    let stdout = bg.child.as_mut().unwrap().stdout.take().expect("stdout");
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .expect("first line");
    let url = line
        .trim()
        .strip_prefix("dashboard: http://")
        .unwrap_or_else(|| panic!("no dashboard line: {line:?}"));
    (bg, url.trim_end_matches('/').to_owned())
}

fn get(addr: &str, path: &str) -> String {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out
}

#[test]
fn serve_refuses_a_public_address_without_a_token() {
    let db = Db::new();
    let out = db.run(&["serve", "--listen", "0.0.0.0:0"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(
        err.contains("without a token") && err.contains("IDEMQ_TOKEN"),
        "{err}"
    );
    assert!(err.contains("127.0.0.1"), "{err}");
    assert!(!db.path("cli.db").exists(), "nothing was created");
}

#[test]
fn serve_answers_healthz_and_stops_on_sigterm() {
    let db = Db::new();
    let (bg, addr) = serve(&db, &[]);
    let health = get(&addr, "/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    let out = bg.stop();
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn serve_with_a_token_may_listen_on_every_address() {
    let db = Db::new();
    let mut bg = db
        .command(&["serve", "--listen", "0.0.0.0:0"])
        .env("IDEMQ_TOKEN", "s3cret")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map(|c| Background { child: Some(c) })
        .expect("spawn");
    let stdout = bg.child.as_mut().unwrap().stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    assert!(line.starts_with("dashboard: http://0.0.0.0:"), "{line}");
    let out = bg.stop();
    assert!(
        !stderr(&out).contains("s3cret"),
        "the token is never printed"
    );
}

#[test]
fn serve_with_exec_runs_jobs() {
    let db = Db::new();
    let id = db.enqueue(&["--type", "t", "--payload", "7"]);
    let (bg, _) = serve(&db, &["--exec", "cat", "--poll-ms", "50"]);
    eventually(30, "the embedded worker ran the job", || {
        db.state(&id) == "completed"
    });
    assert_eq!(db.job(&id)["result"], 7);
    assert!(bg.stop().status.success());
}

#[test]
fn demo_runs_to_completion_and_leaves_its_jobs() {
    let db = Db::new();
    let out = db.run(&["demo", "--burst", "6"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = support::stdout(&out);
    for word in [
        "replayed",
        "conflict",
        "payload",
        "coalesced ×5",
        "dead",
        "redriven",
        "SCENARIO",
        "idemq serve --database",
    ] {
        assert!(text.contains(word), "{word} missing from:\n{text}");
    }
    let jobs = db.json(&["jobs", "list", "--queue", "demo"]);
    let jobs = jobs["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 4, "{jobs:?}");
    assert!(jobs.iter().all(|j| j["state"] == "completed"), "{jobs:?}");

    let again = db.json(&["demo", "--burst", "3"]);
    let scenarios = again["scenarios"].as_array().expect("scenarios");
    assert_eq!(scenarios.len(), 5);
    assert_eq!(scenarios[0]["outcomes"], "accepted, replayed");
    assert_eq!(scenarios[4]["state"], "completed");
    assert_eq!(
        db.json(&["jobs", "list", "--queue", "demo"])["jobs"]
            .as_array()
            .map(Vec::len),
        Some(8)
    );
}

#[test]
fn serve_passes_the_token_to_every_request_but_healthz() {
    let db = Db::new();
    let mut bg = db
        .command(&["serve", "--listen", "127.0.0.1:0"])
        .env("IDEMQ_TOKEN", "s3cret")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map(|c| Background { child: Some(c) })
        .expect("spawn");
    let stdout = bg.child.as_mut().unwrap().stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr = line
        .trim()
        .trim_start_matches("dashboard: http://")
        .trim_end_matches('/')
        .to_owned();
    assert!(get(&addr, "/healthz").starts_with("HTTP/1.1 200"));
    let refused = get(&addr, "/v1/queues");
    assert!(refused.starts_with("HTTP/1.1 401"), "{refused}");
    let mut s = TcpStream::connect(&addr).unwrap();
    write!(
        s,
        "GET /v1/queues HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer s3cret\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut allowed = String::new();
    s.read_to_string(&mut allowed).unwrap();
    assert!(allowed.starts_with("HTTP/1.1 200"), "{allowed}");
    assert!(bg.stop().status.success());
}

/// Sends `POST /v1/jobs` with a payload of `n` bytes of JSON; the status line.
fn enqueue_payload(addr: &str, n: usize) -> String {
    // `"…"` is the payload: a JSON string of n - 2 characters and its quotes.
    let body = format!("{{\"type\":\"big\",\"payload\":\"{}\"}}", "x".repeat(n - 2));
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "POST /v1/jobs HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).expect("response");
    out.lines().next().unwrap_or_default().to_owned()
}

#[test]
fn serve_takes_payloads_up_to_its_payload_limit() {
    let db = Db::new();
    let mib = 1024 * 1024;
    // The default: 1 MiB.
    let (bg, addr) = serve(&db, &[]);
    assert!(enqueue_payload(&addr, mib).contains(" 201 "));
    assert!(enqueue_payload(&addr, mib + 1).contains(" 413 "));
    bg.stop();
    let (bg, addr) = serve(&db, &["--payload-limit", "2097152"]);
    assert!(enqueue_payload(&addr, 2 * mib).contains(" 201 "));
    let over = enqueue_payload(&addr, 2 * mib + 1);
    assert!(over.contains(" 413 "), "{over}");
    bg.stop();
}

#[test]
fn serve_refuses_a_payload_limit_out_of_bounds() {
    let db = Db::new();
    for bad in ["1023", "16777217", "-1", "1MiB"] {
        let out = db.run(&["serve", &format!("--payload-limit={bad}")]);
        assert_eq!(out.status.code(), Some(2), "{bad}");
        let err = stderr(&out);
        assert!(err.contains("--payload-limit"), "{bad}: {err}");
        assert!(!db.path("cli.db").exists(), "nothing was created");
    }
}
