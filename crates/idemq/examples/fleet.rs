//! The library side of a multi-host run (scripts/multihost runs it on every
//! host): seeds jobs, works them with a `Worker` while logging each handler
//! run, produces keyed requests over the library and over HTTP, and streams
//! enqueues through outages while recording every job id it was given.
//!
//! ```sh
//! fleet seed     URL N                      # migrate, then enqueue N jobs of type net.noop
//! fleet work     URL EFFECTS [SLEEP_MS] [CONCURRENCY] [LEASE_MS]
//! fleet produce  URL HTTP_BASE TOKEN KEYS PARITY OUT
//! fleet stream   URL SECONDS OUT
//! fleet relay    LISTEN TARGET DELAY_MS     # a TCP relay that delays each direction
//! ```
//!
//! `work` runs until SIGINT/SIGTERM and prints its report; `EFFECTS` gets
//! one line per handler run (the job id). `produce` sends every key
//! `net-key-0` … twice, once with the library and once through `POST
//! /v1/jobs` (PARITY 0 or 1 picks which goes first), and writes
//! `key job_id path` lines. `stream` enqueues for SECONDS, retrying while
//! the database is unavailable, and writes every acknowledged job id.
//! `relay` stands in for `tc netem delay` on kernels without netem: every
//! chunk read from either side is written to the other `DELAY_MS` later
//! (tokio's timer rounds that up to the next millisecond).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{BatchOptions, EnqueueRequest, Queue};
use serde_json::{Value, json};

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const TYPE: &str = "net.noop";

#[tokio::main]
async fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| -> Res<&str> {
        args.get(i)
            .map(String::as_str)
            .ok_or_else(|| format!("missing argument {i}; see the example's documentation").into())
    };
    match arg(0)? {
        "seed" => seed(arg(1)?, arg(2)?.parse()?).await,
        "work" => {
            let num = |i: usize, d: u64| args.get(i).map_or(Ok(d), |s| s.parse::<u64>());
            work(arg(1)?, arg(2)?, num(3, 0)?, num(4, 32)?, num(5, 30_000)?).await
        }
        "produce" => {
            produce(
                arg(1)?,
                arg(2)?,
                arg(3)?,
                arg(4)?.parse()?,
                arg(5)?.parse()?,
                arg(6)?,
            )
            .await
        }
        "stream" => stream(arg(1)?, arg(2)?.parse()?, arg(3)?).await,
        "relay" => relay(arg(1)?, arg(2)?, arg(3)?.parse()?).await,
        other => Err(format!("unknown mode {other}").into()),
    }
}

async fn seed(url: &str, n: u64) -> Res<()> {
    Queue::migrate(url).await?;
    let queue = Queue::connect(url).await?;
    let start = Instant::now();
    let mut left = n;
    while left > 0 {
        let batch = left.min(1000);
        let reqs = (0..batch)
            .map(|_| EnqueueRequest::new(TYPE).payload(json!({})))
            .collect();
        for r in queue
            .enqueue_many(reqs, BatchOptions { atomic: true })
            .await?
        {
            r?;
        }
        left -= batch;
    }
    println!("seeded {n} jobs in {:.2?}", start.elapsed());
    Ok(())
}

async fn work(url: &str, effects: &str, sleep_ms: u64, concurrency: u64, lease_ms: u64) -> Res<()> {
    let queue = Queue::connect(url).await?;
    let log = Arc::new(Mutex::new(std::io::BufWriter::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(effects)?,
    )));
    let flusher = log.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let _ = flusher.lock().map(|mut f| f.flush());
        }
    });
    let effect = log.clone();
    let worker = Worker::new(queue)
        .concurrency(usize::try_from(concurrency)?)
        .lease(Duration::from_millis(lease_ms))
        .poll_interval(Duration::from_millis(200))
        .shutdown_grace(Duration::from_secs(5))
        .handle(TYPE, move |ctx: HandlerContext, _payload: Value| {
            let effect = effect.clone();
            async move {
                if let Ok(mut f) = effect.lock() {
                    let _ = writeln!(f, "{}", ctx.job_id());
                }
                if sleep_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(sleep_ms)).await;
                }
                Ok::<_, JobError>(Value::Null)
            }
        });
    let report = worker.run(idemq::worker::shutdown_signal()).await?;
    log.lock().map_err(|_| "effects log poisoned")?.flush()?;
    println!(
        "report completed={} failed={} released={} lost={}",
        report.completed, report.failed, report.released, report.lost
    );
    Ok(())
}

fn request(key: &str) -> EnqueueRequest {
    EnqueueRequest::new(TYPE)
        .payload(json!({ "key": key }))
        .idempotency_key(key)
}

async fn produce(url: &str, http: &str, token: &str, keys: u64, parity: u64, out: &str) -> Res<()> {
    let queue = Queue::connect(url).await?;
    let client = reqwest::Client::new();
    let lines = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = tokio::task::JoinSet::new();
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    for _ in 0..8 {
        let (queue, client, lines, next) =
            (queue.clone(), client.clone(), lines.clone(), next.clone());
        let (http, token) = (format!("{http}/v1/jobs"), token.to_owned());
        tasks.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= keys {
                    return Ok::<_, String>(());
                }
                let key = format!("net-key-{i}");
                let lib_first = (i + parity).is_multiple_of(2);
                for step in 0..2 {
                    let via_lib = (step == 0) == lib_first;
                    let id = if via_lib {
                        queue
                            .enqueue(request(&key))
                            .await
                            .map_err(|e| format!("{key} via the library: {e}"))?
                    } else {
                        let body = json!({
                            "type": TYPE, "payload": { "key": key },
                            "idempotency": { "key": key },
                        });
                        let resp = client
                            .post(&http)
                            .bearer_auth(&token)
                            .json(&body)
                            .send()
                            .await
                            .map_err(|e| format!("{key} over HTTP: {e}"))?;
                        let status = resp.status();
                        let v: Value = resp.json().await.map_err(|e| e.to_string())?;
                        if !status.is_success() {
                            return Err(format!("{key} over HTTP: {status} {v}"));
                        }
                        v["job_id"].as_str().ok_or("no job_id")?.to_owned()
                    };
                    let path = if via_lib { "lib" } else { "http" };
                    lines
                        .lock()
                        .map_err(|_| "poisoned")?
                        .push(format!("{key} {id} {path}"));
                }
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    let lines = lines.lock().map_err(|_| "poisoned")?;
    std::fs::write(out, lines.join("\n") + "\n")?;
    println!("produced {} answers for {keys} keys", lines.len());
    Ok(())
}

async fn stream(url: &str, seconds: u64, out: &str) -> Res<()> {
    let queue = loop {
        match Queue::connect(url).await {
            Ok(q) => break q,
            Err(e) if e.is_retryable() => tokio::time::sleep(Duration::from_millis(200)).await,
            Err(e) => return Err(e.into()),
        }
    };
    let mut file = std::io::BufWriter::new(std::fs::File::create(out)?);
    let until = Instant::now() + Duration::from_secs(seconds);
    let (mut acked, mut refused) = (0u64, 0u64);
    while Instant::now() < until {
        let reqs = (0..10)
            .map(|_| EnqueueRequest::new(TYPE).payload(json!({ "stream": true })))
            .collect();
        match queue
            .enqueue_many(reqs, BatchOptions { atomic: true })
            .await
        {
            Ok(results) => {
                for r in results {
                    writeln!(file, "{}", r?.job_id)?;
                    acked += 1;
                }
                file.flush()?;
            }
            Err(e) if e.is_retryable() => {
                refused += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e.into()),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("streamed: {acked} acknowledged, {refused} calls refused while unavailable");
    Ok(())
}

async fn relay(listen: &str, target: &str, delay_ms: u64) -> Res<()> {
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let delay = Duration::from_millis(delay_ms);
    loop {
        let (client, _) = listener.accept().await?;
        let target = target.to_owned();
        tokio::spawn(async move {
            let Ok(server) = tokio::net::TcpStream::connect(&target).await else {
                return;
            };
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::join!(pump(cr, sw, delay), pump(sr, cw, delay));
        });
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0
                || tx
                    .send((tokio::time::Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
            {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((at, chunk)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
