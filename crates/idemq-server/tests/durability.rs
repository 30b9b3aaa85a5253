//! What the server shows of its store's durability: `/healthz` names it,
//! `/metrics` has the `idemq_durability_relaxed` gauge, and the dashboard's
//! overview carries a warning banner (and `/dashboard/stats.json` the word)
//! when acknowledged jobs may be lost. Full on SQLite; relaxed on a Redis
//! server of the test's own whose settings are not durable, opened with
//! `?durability=relaxed`. A missing `redis-server` fails the test, never
//! skips it.

use idemq::{Durability, Queue};
use idemq_server::{ServerOptions, serve};
use serde_json::Value;

/// A redis-server of one test, without the durable settings
/// (`appendfsync everysec`); it ends with the test process.
struct Redis {
    url: String,
}

impl Redis {
    fn start() -> Self {
        Self {
            url: idemq_testkit::redis_own_server_with(&["--appendfsync", "everysec"]),
        }
    }

    fn url(&self, query: &str) -> String {
        format!("{}{query}", self.url)
    }
}

/// A server on `queue`, stopped when the sender drops.
async fn start(queue: Queue) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(
        listener,
        queue,
        ServerOptions::default(),
        async move {
            let _ = rx.await;
        },
    ));
    (base, tx)
}

/// What the three surfaces show.
struct Shown {
    health: Value,
    metrics: String,
    overview: String,
    stats: Value,
}

async fn shown(base: &str) -> Shown {
    let http = reqwest::Client::new();
    let get = |path: &str| {
        let request = http.get(format!("{base}{path}"));
        async move {
            let r = request.send().await.expect("request");
            assert_eq!(r.status(), 200, "GET {}", r.url());
            r.text().await.expect("body")
        }
    };
    let health = get("/healthz").await;
    let stats = get("/dashboard/stats.json").await;
    Shown {
        health: serde_json::from_str(&health).expect("healthz JSON"),
        metrics: get("/metrics").await,
        overview: get("/").await,
        stats: serde_json::from_str(&stats).expect("stats JSON"),
    }
}

#[tokio::test]
async fn full_durability_shows_no_warning() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("d.db").display());
    let queue = Queue::connect(&url).await.expect("open");
    assert_eq!(queue.durability(), Durability::Full);
    let (base, _stop) = start(queue).await;
    let s = shown(&base).await;
    assert_eq!(s.health["ok"], true);
    assert_eq!(s.health["backend"], "sqlite");
    assert_eq!(s.health["durability"], "full");
    assert!(
        s.metrics.contains("\nidemq_durability_relaxed 0\n"),
        "{}",
        s.metrics
    );
    assert!(s.metrics.contains("# HELP idemq_durability_relaxed"));
    assert!(!s.overview.contains("durability-warning"), "{}", s.overview);
    assert_eq!(s.stats["durability"], "full");
}

#[tokio::test]
async fn relaxed_redis_durability_is_shown_on_health_metrics_and_dashboard() {
    let redis = Redis::start();
    idemq::store::redis::migrate(&redis.url("?durability=relaxed"))
        .await
        .expect("migrate");
    // The check refuses this server; the URL's opt-in opens it relaxed.
    let err = Queue::connect(&redis.url(""))
        .await
        .expect_err("appendfsync everysec is refused");
    assert!(err.to_string().contains("appendfsync"), "{err}");
    let queue = Queue::connect(&redis.url("?durability=relaxed"))
        .await
        .expect("relaxed");
    let durability = queue.durability();
    assert!(durability.is_relaxed(), "{durability:?}");
    assert!(
        durability
            .reason()
            .is_some_and(|r| r.contains("durability=relaxed")),
        "{durability:?}"
    );
    let (base, _stop) = start(queue).await;
    let s = shown(&base).await;
    assert_eq!(s.health["ok"], true);
    assert_eq!(s.health["backend"], "redis");
    assert_eq!(s.health["durability"], "relaxed");
    assert!(
        s.metrics.contains("\nidemq_durability_relaxed 1\n"),
        "{}",
        s.metrics
    );
    assert!(
        s.overview
            .contains(r#"id="durability-warning" role="alert""#),
        "{}",
        s.overview
    );
    assert!(s.overview.contains("acknowledged jobs may be lost"));
    assert!(s.overview.contains("?durability=relaxed"));
    assert_eq!(s.stats["durability"], "relaxed");
}
