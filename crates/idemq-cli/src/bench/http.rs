//! The HTTP workloads: W1h, single enqueues through `idemq serve`'s API
//! from 8 keep-alive connections, beside the library's W1 x8 in alternating
//! slices; W3h, a drain by HTTP workers that claim 50 jobs at a time and
//! carry their completions on the next claim, beside the library's W3 from
//! the same run. The server is the one `idemq serve` runs, in this process;
//! the load generator is a minimal HTTP/1.1 client (a few microseconds per
//! request), so it is not what the figure measures.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use idemq::{EnqueueRequest, Queue};
use idemq_server::ServerOptions;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::Mutex;

use super::enqueue::{NOOP, row, total_jobs};
use super::report::{Row, reset_peak_memory};
use super::target::Backend;
use super::worker::fill_paused;
use super::{ROUNDS, bar, drive, rate, slices};

/// Connections of W1h (as the library's W1 x8 has producers).
const PRODUCERS: usize = 8;
/// HTTP workers of W3h, and the jobs each claims per call.
const WORKERS: usize = 8;
const CLAIM_LIMIT: usize = 50;

/// `idemq serve`'s router on an ephemeral loopback port, until dropped.
struct Server {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Server {
    async fn start(queue: Queue) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(idemq_server::serve(
            listener,
            queue,
            ServerOptions::default(),
            async move {
                let _ = stopped.await;
            },
        ));
        Ok(Self {
            addr,
            stop: Some(stop),
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// One keep-alive HTTP/1.1 connection that posts JSON and reads answers
/// framed by `Content-Length` (what the server sends for JSON).
struct Conn {
    stream: BufReader<TcpStream>,
    head: String,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream: BufReader::new(stream),
            head: format!("Host: {addr}\r\nContent-Type: application/json\r\n"),
        })
    }

    /// Posts `body` to `path`; the status and the body of the answer. The
    /// request goes out in one write (one segment for a small body), as a
    /// client that buffers its request sends it.
    async fn post(&mut self, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>)> {
        let mut request = format!(
            "POST {path} HTTP/1.1\r\n{}Content-Length: {}\r\n\r\n",
            self.head,
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(body);
        self.stream.get_mut().write_all(&request).await?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("not an HTTP status line: {line:?}"))?;
        let mut length = None;
        loop {
            line.clear();
            if self.stream.read_line(&mut line).await? == 0 {
                bail!("the server closed the connection mid-answer");
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = Some(value.trim().parse::<usize>()?);
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    bail!("the answer is not framed by Content-Length ({header})");
                }
            }
        }
        let mut answer = vec![0; length.context("an answer without Content-Length")?];
        self.stream.read_exact(&mut answer).await?;
        Ok((status, answer))
    }
}

/// W1h: `POST /v1/jobs` from 8 connections vs the library's W1 x8.
pub(crate) async fn enqueue(backend: &Backend, ops: usize) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let queue = Queue::connect(db.url()).await?;
            let server = Server::start(queue.clone()).await?;
            let mut conns = Vec::with_capacity(PRODUCERS);
            for _ in 0..PRODUCERS {
                conns.push(Mutex::new(Conn::open(server.addr).await?));
            }
            let conns = Arc::new(conns);
            let (lib_bar, http_bar) = (bar("W1 x8", ops), bar("W1h x8", ops));
            let (mut lib_time, mut http_time) = (Duration::ZERO, Duration::ZERO);
            reset_peak_memory();
            for slice in slices(ops, ROUNDS) {
                // The library half enqueues the ids past `ops`, so the two
                // halves never share a payload.
                let shifted = slice.start + ops..slice.end + ops;
                let q = queue.clone();
                lib_time += drive(PRODUCERS, shifted, &lib_bar, move |i| {
                    let q = q.clone();
                    async move {
                        q.enqueue(EnqueueRequest::new(NOOP).payload(json!({ "i": i })))
                            .await?;
                        Ok(())
                    }
                })
                .await?;
                let c = conns.clone();
                http_time += drive(PRODUCERS, slice, &http_bar, move |i| {
                    let c = c.clone();
                    async move {
                        let body = format!(r#"{{"type":"{NOOP}","payload":{{"i":{i}}}}}"#);
                        let (status, answer) = c[i % PRODUCERS]
                            .lock()
                            .await
                            .post("/v1/jobs", body.as_bytes())
                            .await?;
                        ensure!(
                            status == 201,
                            "POST /v1/jobs answered {status}: {}",
                            String::from_utf8_lossy(&answer)
                        );
                        Ok(())
                    }
                })
                .await?;
            }
            lib_bar.finish_and_clear();
            http_bar.finish_and_clear();
            let jobs = total_jobs(&queue).await?;
            let check = if jobs == 2 * ops as u64 {
                Ok(())
            } else {
                Err(format!("{jobs} jobs, expected {}", 2 * ops))
            };
            Ok(row(
                "W1h",
                backend,
                PRODUCERS,
                ops,
                rate(ops, http_time),
                "library W1 x8".into(),
                rate(ops, lib_time),
                check,
            ))
        })
        .await
}

/// What the HTTP workers of W3h share.
struct Drain {
    runs: Vec<AtomicU32>,
    completed: AtomicUsize,
}

/// One HTTP worker: claims up to [`CLAIM_LIMIT`] jobs, "runs" them, and
/// sends their completions with its next claim, until every job is
/// recorded.
async fn http_worker(addr: SocketAddr, name: String, drain: Arc<Drain>, n: usize) -> Result<()> {
    let mut conn = Conn::open(addr).await?;
    let mut done: Vec<Value> = Vec::new();
    loop {
        let body = json!({
            "worker": name,
            "limit": CLAIM_LIMIT,
            "complete": done,
        });
        let (status, answer) = conn.post("/v1/claim", body.to_string().as_bytes()).await?;
        ensure!(
            status == 200,
            "POST /v1/claim answered {status}: {}",
            String::from_utf8_lossy(&answer)
        );
        let answer: Value = serde_json::from_slice(&answer)?;
        record(&drain, &answer["completed"])?;
        let jobs = answer["jobs"].as_array().cloned().unwrap_or_default();
        done = jobs
            .iter()
            .map(|j| {
                let i = j["payload"]["i"].as_u64().unwrap_or(u64::MAX) as usize;
                if let Some(c) = drain.runs.get(i) {
                    c.fetch_add(1, Ordering::Relaxed);
                }
                json!({ "id": j["id"], "lease_token": j["lease_token"] })
            })
            .collect();
        if done.is_empty() {
            if drain.completed.load(Ordering::Relaxed) >= n {
                return Ok(());
            }
            // The other workers hold the last jobs: look again shortly.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

/// Counts the completions a claim's answer recorded; any refused one is an error.
fn record(drain: &Drain, completed: &Value) -> Result<()> {
    let Some(items) = completed.as_array() else {
        return Ok(());
    };
    for item in items {
        ensure!(
            item["state"] == "completed",
            "a completion was refused: {item}"
        );
    }
    drain.completed.fetch_add(items.len(), Ordering::Relaxed);
    Ok(())
}

/// W3h: `n` no-op jobs drained by [`WORKERS`] HTTP workers vs the
/// library's W3 rate `library_rate` from the same run.
pub(crate) async fn drain(backend: &Backend, n: usize, library_rate: f64) -> Result<Row> {
    backend
        .with_fresh(async |db| {
            let queue = Queue::connect(db.url()).await?;
            let server = Server::start(queue.clone()).await?;
            fill_paused(&queue, 0..n).await?;
            let drain = Arc::new(Drain {
                runs: (0..n).map(|_| AtomicU32::new(0)).collect(),
                completed: AtomicUsize::new(0),
            });
            reset_peak_memory();
            let start = Instant::now();
            queue.resume("default").await?;
            let mut workers = tokio::task::JoinSet::new();
            for k in 0..WORKERS {
                workers.spawn(http_worker(
                    server.addr,
                    format!("bench-http-{k}"),
                    drain.clone(),
                    n,
                ));
            }
            while let Some(w) = workers.join_next().await {
                w.context("an HTTP worker failed")??;
            }
            let elapsed = start.elapsed();
            let completed: u64 = queue
                .queues()
                .await?
                .iter()
                .map(|q| q.counts.completed)
                .sum();
            let not_once = drain
                .runs
                .iter()
                .filter(|c| c.load(Ordering::Relaxed) != 1)
                .count();
            let check = if completed != n as u64 || not_once > 0 {
                Err(format!(
                    "{completed} completed, {not_once} jobs not run exactly once"
                ))
            } else {
                Ok(())
            };
            Ok(row(
                "W3h",
                backend,
                WORKERS,
                n,
                rate(n, elapsed),
                "library W3".into(),
                library_rate,
                check,
            ))
        })
        .await
}
