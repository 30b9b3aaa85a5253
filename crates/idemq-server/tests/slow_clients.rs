//! Clients that hold a connection without finishing a request (docs/http-api.md,
//! "Connections"): a head that never ends, a body that stops, a shutdown
//! while such clients and a long-polling claim are connected, and a client
//! that goes away while its claim is running.

use std::time::{Duration, Instant};

use idemq::{Queue, QueueOptions};
use idemq_server::{ServerOptions, Timeouts};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// A server on a fresh SQLite file with `timeouts`; its address, the sender
/// that shuts it down, and its task.
async fn start(
    dir: &tempfile::TempDir,
    timeouts: Timeouts,
) -> (
    String,
    oneshot::Sender<()>,
    tokio::task::JoinHandle<std::io::Result<()>>,
) {
    let url = format!("sqlite://{}", dir.path().join("slow.db").display());
    let queue = Queue::connect_with(&url, QueueOptions::default())
        .await
        .expect("queue");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr").to_string();
    let (tx, rx) = oneshot::channel::<()>();
    let server = tokio::spawn(idemq_server::serve_with(
        listener,
        queue,
        ServerOptions::default(),
        timeouts,
        async move {
            let _ = rx.await;
        },
    ));
    (addr, tx, server)
}

/// Reads until the server closes the connection (or `within` passes) and
/// returns what it sent.
async fn until_closed(conn: &mut TcpStream, within: Duration) -> Option<String> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(within, conn.read_to_end(&mut got)).await;
    match read {
        Ok(_) => Some(String::from_utf8_lossy(&got).into_owned()),
        Err(_) => None,
    }
}

/// A client that sends part of a request head and stops is disconnected
/// once the header read timeout passed, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_never_ends_is_disconnected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let timeouts = Timeouts {
        header_read: Duration::from_millis(500),
        ..Timeouts::default()
    };
    let (addr, stop, server) = start(&dir, timeouts).await;
    let mut conn = TcpStream::connect(&addr).await.expect("connect");
    let sent = Instant::now();
    conn.write_all(b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .expect("write");
    let answer = until_closed(&mut conn, Duration::from_secs(10)).await;
    let waited = sent.elapsed();
    assert!(
        answer.is_some(),
        "the connection is still open 10 s after half a head"
    );
    assert!(
        waited >= Duration::from_millis(400),
        "closed after {waited:?}"
    );
    // The server goes on answering others.
    let health = reqwest::get(format!("http://{addr}/healthz"))
        .await
        .expect("healthz");
    assert_eq!(health.status().as_u16(), 200);
    let _ = stop.send(());
    server.await.expect("task").expect("serve");
}

/// A client that declares a body and stops sending it gets its request
/// ended once the body has been idle for the body timeout, and nothing is
/// written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_ends_its_request() {
    let dir = tempfile::tempdir().expect("tempdir");
    let timeouts = Timeouts {
        body_idle: Duration::from_millis(500),
        ..Timeouts::default()
    };
    let (addr, stop, server) = start(&dir, timeouts).await;
    let mut conn = TcpStream::connect(&addr).await.expect("connect");
    conn.write_all(
        b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
          Content-Length: 200\r\n\r\n{\"type\": \"t\", ",
    )
    .await
    .expect("write");
    let answer = until_closed(&mut conn, Duration::from_secs(10))
        .await
        .expect("the request is still open 10 s after its body stopped");
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    let jobs: serde_json::Value = reqwest::get(format!("http://{addr}/v1/jobs"))
        .await
        .expect("list")
        .json()
        .await
        .expect("json");
    assert_eq!(jobs["jobs"].as_array().map(Vec::len), Some(0), "{jobs}");
    let _ = stop.send(());
    server.await.expect("task").expect("serve");
}

/// Shutdown ends within the drain time whatever the clients do: one that
/// sent half a head (which the header timeout, a minute here, would close
/// only much later) and a claim waiting the longest it may (60 s). Before,
/// the server waited for such connections without a bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_ends_within_the_drain_time() {
    let dir = tempfile::tempdir().expect("tempdir");
    let timeouts = Timeouts {
        drain: Duration::from_millis(500),
        ..Timeouts::default()
    };
    let (addr, stop, server) = start(&dir, timeouts).await;
    let mut half = TcpStream::connect(&addr).await.expect("connect");
    half.write_all(b"GET /v1/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .expect("write");
    let claim = tokio::spawn({
        let addr = addr.clone();
        async move {
            reqwest::Client::new()
                .post(format!("http://{addr}/v1/claim"))
                .json(&serde_json::json!({"worker": "w", "wait_ms": 60_000}))
                .send()
                .await
        }
    });
    // The claim is waiting once the queue has been asked for work.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!claim.is_finished(), "the claim did not wait");
    let stopping = Instant::now();
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the server did not stop within 10 s of its shutdown")
        .expect("task")
        .expect("serve");
    assert!(
        stopping.elapsed() < Duration::from_secs(5),
        "stopped after {:?}",
        stopping.elapsed()
    );
    // Both connections are closed.
    assert!(
        until_closed(&mut half, Duration::from_secs(5))
            .await
            .is_some()
    );
    let _ = tokio::time::timeout(Duration::from_secs(5), claim)
        .await
        .expect("the claim's connection is still open");
}

/// A client that goes away while its claim runs: the claim still commits
/// (here it waits for the SQLite write lock this test holds, and takes it
/// once the client has gone), and the job it took is released at once,
/// its attempt not counted, instead of staying leased to no one until the
/// lease (an hour here) expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_client_went_away_releases_its_jobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (addr, stop, server) = start(&dir, Timeouts::default()).await;
    let http = reqwest::Client::new();
    let job: serde_json::Value = http
        .post(format!("http://{addr}/v1/jobs"))
        .json(&serde_json::json!({"type": "t"}))
        .send()
        .await
        .expect("enqueue")
        .json()
        .await
        .expect("json");
    let id = job["job_id"].as_str().expect("job_id").to_owned();
    // Another process holds the write lock: the claim waits for it.
    let lock = rusqlite::Connection::open(dir.path().join("slow.db")).expect("open");
    lock.execute_batch("BEGIN IMMEDIATE").expect("lock");
    let mut conn = TcpStream::connect(&addr).await.expect("connect");
    let body = r#"{"worker": "gone", "lease_ms": 3600000}"#;
    conn.write_all(
        format!(
            "POST /v1/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .expect("write");
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(conn);
    tokio::time::sleep(Duration::from_millis(300)).await;
    lock.execute_batch("COMMIT").expect("unlock");
    // The claim commits once the lock is free; the job comes back.
    let start = Instant::now();
    let seen: Vec<String> = loop {
        let j: serde_json::Value = http
            .get(format!("http://{addr}/v1/jobs/{id}"))
            .send()
            .await
            .expect("get")
            .json()
            .await
            .expect("json");
        let events: serde_json::Value = http
            .get(format!("http://{addr}/v1/jobs/{id}/events"))
            .send()
            .await
            .expect("events")
            .json()
            .await
            .expect("json");
        let kinds: Vec<String> = events["events"]
            .as_array()
            .map(|e| e.iter().map(|e| e["kind"].to_string()).collect())
            .unwrap_or_default();
        if j["state"] == "ready" && kinds.iter().any(|k| k.contains("released")) {
            assert_eq!(j["attempts_used"], 0, "{j}");
            break kinds;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the job was not released: {j} {kinds:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        seen.iter().any(|k| k.contains("claimed")),
        "the claim did happen: {seen:?}"
    );
    let _ = stop.send(());
    server.await.expect("task").expect("serve");
}
