//! The Redis store on a redis-server of the test's own, started in a
//! temporary directory with the durable settings (the machine's shared
//! Redis keeps nothing on disk). A missing `redis-server` fails the test,
//! never skips it.
#![cfg(feature = "redis")]

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use idemq::store::redis::{RedisOptions, RedisStore};
use idemq::store::{Store, Sweep};
use idemq::{
    ClaimOptions, DedupeOptions, EnqueueRequest, Error, FailOptions, JobList, JobState, Outcome,
    Queue, QueueOptions, RedriveOptions, RetryPolicy,
};
use serde_json::json;

/// A redis-server of one test (the test kit's durable settings, then the
/// test's own); it ends with the test process.
struct Server {
    url: String,
}

impl Server {
    fn start(settings: &[&str]) -> Self {
        Self {
            url: idemq_testkit::redis_own_server_with(settings),
        }
    }

    fn url(&self, query: &str) -> String {
        format!("{}{query}", self.url)
    }
}

fn epoch() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
        .single()
        .expect("date")
}

/// A migrated installation on its own server, its clock frozen at [`epoch`].
struct Env {
    server: Server,
    store: RedisStore,
    queue: Queue,
    at: std::sync::Mutex<DateTime<Utc>>,
}

impl Env {
    async fn new() -> Self {
        let server = Server::start(&[]);
        let url = server.url("");
        idemq::store::redis::migrate(&url).await.expect("migrate");
        let store = RedisStore::connect(&url, RedisOptions { test_clock: true })
            .await
            .expect("connect");
        store.set_test_clock(Some(epoch())).await.expect("clock");
        let queue = Queue::from_store(Arc::new(store.clone()), QueueOptions::default());
        Self {
            server,
            store,
            queue,
            at: std::sync::Mutex::new(epoch()),
        }
    }

    async fn advance_ms(&self, ms: i64) {
        let next = {
            let mut at = self.at.lock().expect("clock");
            *at += chrono::Duration::milliseconds(ms);
            *at
        };
        self.store.set_test_clock(Some(next)).await.expect("clock");
    }

    async fn claim(&self, limit: u32) -> Vec<idemq::ClaimedJob> {
        self.queue
            .claim(ClaimOptions {
                limit,
                worker: "w-1".into(),
                ..ClaimOptions::default()
            })
            .await
            .expect("claim")
    }

    async fn kinds(&self, id: &str) -> Vec<String> {
        let events = self.queue.events(id).await.expect("events");
        events.into_iter().map(|e| e.kind).collect()
    }
}

#[tokio::test]
async fn migrate_records_the_version_and_connect_refuses_other_versions() {
    let server = Server::start(&[]);
    let url = server.url("?prefix=app1:");
    let err = RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect_err("not migrated");
    assert!(err.to_string().contains("idemq migrate"), "{err}");
    assert_eq!(
        idemq::store::redis::migrate(&url).await.expect("migrate"),
        vec![idemq::store::redis::LAYOUT]
    );
    assert!(
        idemq::store::redis::migrate(&url)
            .await
            .expect("again")
            .is_empty()
    );
    let status = idemq::store::redis::migration_status(&url)
        .await
        .expect("status");
    assert!(status.is_current(), "{status:?}");
    RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect("connect");
    // Another prefix on the same server is another installation.
    let other = server.url("?prefix=app2:");
    assert!(
        RedisStore::connect(&other, RedisOptions::default())
            .await
            .is_err()
    );

    // An installation migrated by another version of the functions.
    let client = redis::Client::open(url.split('?').next().expect("url")).expect("client");
    let mut conn = client
        .get_multiplexed_async_connection()
        .await
        .expect("conn");
    let _: () = redis::cmd("SET")
        .arg("app1:version")
        .arg("0000000000000000")
        .query_async(&mut conn)
        .await
        .expect("set");
    let err = RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect_err("other version");
    assert!(err.to_string().contains("idemq migrate"), "{err}");
    assert!(err.to_string().contains("0000000000000000"), "{err}");
    assert!(
        !idemq::store::redis::migration_status(&url)
            .await
            .expect("status")
            .is_current()
    );
    idemq::store::redis::migrate(&url)
        .await
        .expect("migrate again");
    RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect("connect after migrate");

    // A layout newer than this binary's is refused, naming the idemq that
    // recorded it.
    let recorded: String = redis::cmd("GET")
        .arg("app1:idemq")
        .query_async(&mut conn)
        .await
        .expect("get");
    assert_eq!(recorded, env!("CARGO_PKG_VERSION"));
    let _: () = redis::pipe()
        .set("app1:layout", idemq::store::redis::LAYOUT + 1)
        .set("app1:idemq", "9.9.9")
        .query_async(&mut conn)
        .await
        .expect("set");
    for err in [
        RedisStore::connect(&url, RedisOptions::default())
            .await
            .expect_err("newer layout"),
        idemq::store::redis::migrate(&url)
            .await
            .expect_err("newer layout"),
    ] {
        assert!(err.to_string().contains("run idemq 9.9.9"), "{err}");
    }
}

/// Runs one Redis command on the installation at `url`, outside idemq.
async fn raw(url: &str, args: &[&str]) -> redis::Value {
    idemq_testkit::redis_command(url, args)
        .await
        .expect("raw command")
}

/// An installation of layout 1 (an index of every job, `P jobs`, and a
/// waiting count per queue in `P cnt:<queue>`) is refused until `idemq
/// migrate` converts it, and reads the same afterwards.
#[tokio::test]
async fn an_installation_of_layout_1_is_refused_until_migrate_converts_it() {
    let server = Server::start(&[]);
    let url = server.url("?prefix=old:");
    idemq::store::redis::migrate(&url).await.expect("migrate");
    let queue = Queue::connect(&url).await.expect("connect");
    let mut ids = Vec::new();
    for (i, q) in ["a", "b", "a"].into_iter().enumerate() {
        ids.push(
            queue
                .enqueue(EnqueueRequest::new("t").queue(q).payload(json!(i)))
                .await
                .expect("enqueue"),
        );
    }
    drop(queue);
    // What layout 1 kept besides: every job in `jobs`, the waiting counts.
    for (seq, id) in ids.iter().enumerate() {
        raw(&url, &["ZADD", "old:jobs", &(seq + 1).to_string(), id]).await;
    }
    raw(&url, &["HSET", "old:cnt:a", "waiting", "2"]).await;
    raw(&url, &["HSET", "old:cnt:b", "waiting", "1"]).await;
    raw(&url, &["SET", "old:layout", "1"]).await;

    let err = RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect_err("layout 1");
    assert!(err.to_string().contains("older layout"), "{err}");
    assert!(err.to_string().contains("idemq migrate"), "{err}");
    assert!(
        !idemq::store::redis::migration_status(&url)
            .await
            .expect("status")
            .is_current()
    );
    assert_eq!(
        idemq::store::redis::migrate(&url).await.expect("upgrade"),
        vec![idemq::store::redis::LAYOUT]
    );
    assert_eq!(
        raw(&url, &["EXISTS", "old:jobs"]).await,
        redis::Value::Int(0)
    );
    assert_eq!(
        raw(&url, &["HEXISTS", "old:cnt:a", "waiting"]).await,
        redis::Value::Int(0)
    );
    let queue = Queue::connect(&url).await.expect("connect after migrate");
    let queues = queue.queues().await.expect("queues");
    let ready: Vec<(String, u64)> = queues
        .iter()
        .map(|q| (q.name.clone(), q.counts.ready))
        .collect();
    assert_eq!(ready, vec![("a".to_owned(), 2), ("b".to_owned(), 1)]);
    let page = queue
        .list(JobList {
            limit: 10,
            ..JobList::default()
        })
        .await
        .expect("list");
    assert_eq!(
        page.jobs.iter().map(|j| j.id.clone()).collect::<Vec<_>>(),
        ids.iter().rev().cloned().collect::<Vec<_>>()
    );
}

/// An installation of layout 2 (no parked jobs: a claim left a job whose
/// concurrency key was held in its lane) is refused until `idemq migrate`
/// records layout 3, which converts nothing; its jobs then run on as they
/// were: the keyed request replays, the counts hold, the key's active job
/// completes and its waiting jobs are claimed one at a time in acceptance
/// order, every job completed once.
#[tokio::test]
async fn an_installation_of_layout_2_runs_after_migrate() {
    async fn claim(queue: &Queue, queues: &[&str], limit: u32) -> Vec<idemq::ClaimedJob> {
        queue
            .claim(ClaimOptions {
                queues: queues.iter().map(|q| (*q).to_owned()).collect(),
                limit,
                worker: "w-1".into(),
                ..ClaimOptions::default()
            })
            .await
            .expect("claim")
    }
    fn ids(claimed: &[idemq::ClaimedJob]) -> Vec<String> {
        claimed.iter().map(|c| c.id.clone()).collect()
    }
    let server = Server::start(&[]);
    let url = server.url("?prefix=old:");
    // Every key of the installation but its layout, with its content.
    let snapshot = || async {
        let strings =
            |v: redis::Value| -> Vec<String> { redis::from_redis_value(v).expect("read") };
        let keys = strings(raw(&url, &["KEYS", "old:*"]).await);
        let mut values = Vec::new();
        for key in keys.into_iter().filter(|k| k != "old:layout") {
            let kind: String =
                redis::from_redis_value(raw(&url, &["TYPE", &key]).await).expect("type");
            let content = match kind.as_str() {
                "string" => strings(raw(&url, &["GET", &key]).await),
                "hash" => {
                    let fields: std::collections::BTreeMap<String, String> =
                        redis::from_redis_value(raw(&url, &["HGETALL", &key]).await).expect("hash");
                    fields
                        .into_iter()
                        .map(|(f, v)| format!("{f}={v}"))
                        .collect()
                }
                "set" => {
                    let mut members = strings(raw(&url, &["SMEMBERS", &key]).await);
                    members.sort();
                    members
                }
                "zset" => strings(raw(&url, &["ZRANGE", &key, "0", "-1", "WITHSCORES"]).await),
                "list" => strings(raw(&url, &["LRANGE", &key, "0", "-1"]).await),
                other => panic!("{key} is a {other}"),
            };
            values.push((key, kind, content));
        }
        values.sort();
        values
    };
    let connect = || async {
        let store = RedisStore::connect(&url, RedisOptions { test_clock: true }).await?;
        Ok::<_, Error>(Queue::from_store(Arc::new(store), QueueOptions::default()))
    };

    // Jobs a layout-2 installation held, written by this binary: each
    // claim takes the first due job of its queues and stops, so none meets
    // a job whose key is held, and none is parked (a layout-2 claim that
    // passed one left it in its lane, as here).
    idemq::store::redis::migrate(&url).await.expect("migrate");
    let clock = RedisStore::connect(&url, RedisOptions { test_clock: true })
        .await
        .expect("connect");
    clock.set_test_clock(Some(epoch())).await.expect("clock");
    drop(clock);
    let queue = connect().await.expect("connect");
    let enqueue = |req: EnqueueRequest| {
        let queue = &queue;
        async move { queue.enqueue(req).await.expect("enqueue") }
    };
    let keyed = || {
        EnqueueRequest::new("t")
            .queue("b")
            .payload(json!("keyed"))
            .idempotency_key("order-1")
    };
    let done = enqueue(EnqueueRequest::new("t").queue("a").payload(json!("done"))).await;
    let a1 = enqueue(EnqueueRequest::new("t").queue("a").payload(json!("a1"))).await;
    let key = |n: &str, t: &str| {
        EnqueueRequest::new(t)
            .queue("k")
            .payload(json!(n))
            .concurrency_key("tenant")
    };
    let k1 = enqueue(key("k1", "t")).await;
    let k2 = enqueue(key("k2", "t")).await;
    let b1 = enqueue(EnqueueRequest::new("t").queue("b").payload(json!("b1"))).await;
    // Another lane (type) of the same key.
    let k3 = enqueue(key("k3", "u")).await;
    let bound = queue.enqueue_with_result(keyed()).await.expect("keyed");
    assert_eq!(bound.outcome, Outcome::Accepted);
    let k4 = enqueue(key("k4", "t")).await;
    let a2 = enqueue(EnqueueRequest::new("t").queue("a").payload(json!("a2"))).await;
    let later = enqueue(
        EnqueueRequest::new("t")
            .queue("b")
            .payload(json!("later"))
            .delay(Duration::from_secs(3600)),
    )
    .await;
    let first = claim(&queue, &["a"], 1).await;
    assert_eq!(ids(&first), vec![done.clone()]);
    queue
        .complete(&done, &first[0].lease_token, Some(json!({"ok": "done"})))
        .await
        .expect("complete");
    let active = claim(&queue, &["k"], 1).await;
    assert_eq!(ids(&active), vec![k1.clone()]);
    drop(queue);
    let before = snapshot().await;
    let keys: Vec<&str> = before.iter().map(|(k, _, _)| k.as_str()).collect();
    assert!(
        !keys
            .iter()
            .any(|k| k.starts_with("old:ckw") || *k == "old:ckp"),
        "{keys:?}"
    );
    let all = [
        &done,
        &a1,
        &k1,
        &k2,
        &b1,
        &k3,
        &bound.job_id,
        &k4,
        &a2,
        &later,
    ];
    for id in all {
        assert_eq!(
            raw(&url, &["HEXISTS", &format!("old:job:{id}"), "parked"]).await,
            redis::Value::Int(0)
        );
    }
    assert_eq!(
        raw(&url, &["GET", "old:ck:tenant"]).await,
        redis::Value::BulkString(k1.clone().into_bytes())
    );
    raw(&url, &["SET", "old:layout", "2"]).await;

    // Refused, named as not current, until migrate; which converts nothing.
    let err = RedisStore::connect(&url, RedisOptions { test_clock: true })
        .await
        .expect_err("layout 2");
    assert!(err.to_string().contains("older layout"), "{err}");
    assert!(err.to_string().contains("idemq migrate"), "{err}");
    let status = idemq::store::redis::migration_status(&url)
        .await
        .expect("status");
    assert!(!status.is_current(), "{status:?}");
    assert_eq!(
        (
            status.current,
            status.latest,
            status.pending.clone(),
            status.functions_current
        ),
        (
            2,
            idemq::store::redis::LAYOUT,
            vec![idemq::store::redis::LAYOUT],
            true
        )
    );
    assert_eq!(
        idemq::store::redis::migrate(&url).await.expect("upgrade"),
        vec![idemq::store::redis::LAYOUT]
    );
    assert!(
        idemq::store::redis::migration_status(&url)
            .await
            .expect("status")
            .is_current()
    );
    assert_eq!(
        raw(&url, &["GET", "old:layout"]).await,
        redis::Value::BulkString(idemq::store::redis::LAYOUT.to_string().into_bytes())
    );
    let after = snapshot().await;
    let changed: Vec<&str> = before
        .iter()
        .chain(&after)
        .filter(|kv| !before.contains(kv) || !after.contains(kv))
        .map(|(k, _, _)| k.as_str())
        .collect();
    assert!(
        changed.is_empty(),
        "migrate from layout 2 changed {changed:?}"
    );

    let queue = connect().await.expect("connect after migrate");
    let again = queue.enqueue_with_result(keyed()).await.expect("replay");
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (bound.job_id.as_str(), Outcome::Replayed)
    );
    let counts = |scheduled, ready, active, completed| idemq::StateCounts {
        scheduled,
        ready,
        active,
        completed,
        ..idemq::StateCounts::default()
    };
    let by_queue = |queues: Vec<idemq::QueueInfo>| {
        queues
            .into_iter()
            .map(|q| (q.name, q.counts))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        by_queue(queue.queues().await.expect("queues")),
        vec![
            ("a".to_owned(), counts(0, 2, 0, 1)),
            ("b".to_owned(), counts(1, 2, 0, 0)),
            ("k".to_owned(), counts(0, 3, 1, 0)),
        ]
    );

    // The key's active job completes; its waiting jobs then run one at a
    // time, in acceptance order across the key's two lanes.
    queue
        .complete(&k1, &active[0].lease_token, None)
        .await
        .expect("complete the active job");
    let (mut order, mut parked) = (Vec::new(), Vec::new());
    loop {
        let claimed = claim(&queue, &[], 10).await;
        if claimed.is_empty() {
            break;
        }
        let keyed_now: Vec<String> = claimed
            .iter()
            .filter(|c| [&k2, &k3, &k4].contains(&&c.id))
            .map(|c| c.id.clone())
            .collect();
        assert!(keyed_now.len() <= 1, "{keyed_now:?}");
        order.push(ids(&claimed));
        // The key's jobs this claim passed are parked now (layout 3).
        parked.push(raw(&url, &["SISMEMBER", "old:ckp", "tenant"]).await);
        for c in claimed {
            queue
                .complete(&c.id, &c.lease_token, None)
                .await
                .expect("complete");
        }
    }
    assert_eq!(
        order,
        vec![
            vec![
                a1.clone(),
                k2.clone(),
                b1.clone(),
                bound.job_id.clone(),
                a2.clone()
            ],
            vec![k3.clone()],
            vec![k4.clone()],
        ]
    );
    assert_eq!(
        parked,
        [1, 1, 0].map(redis::Value::Int).to_vec(),
        "the key's parked jobs after each claim"
    );
    // The scheduled job when due.
    let clock = RedisStore::connect(&url, RedisOptions { test_clock: true })
        .await
        .expect("connect");
    clock
        .set_test_clock(Some(epoch() + chrono::Duration::hours(1)))
        .await
        .expect("clock");
    let due = claim(&queue, &[], 10).await;
    assert_eq!(ids(&due), vec![later.clone()]);
    queue
        .complete(&later, &due[0].lease_token, None)
        .await
        .expect("complete");
    assert!(claim(&queue, &[], 10).await.is_empty());

    for id in all {
        let job = queue.get(id).await.expect("get").expect("job");
        assert_eq!((job.state, job.attempt), (JobState::Completed, 1), "{id}");
        let kinds: Vec<String> = queue
            .events(id)
            .await
            .expect("events")
            .into_iter()
            .map(|e| e.kind)
            .collect();
        assert_eq!(kinds, vec!["accepted", "claimed", "completed"], "{id}");
    }
    assert_eq!(
        queue.get(&done).await.expect("get").expect("job").result,
        Some(json!({"ok": "done"}))
    );
    assert_eq!(
        by_queue(queue.queues().await.expect("queues")),
        vec![
            ("a".to_owned(), counts(0, 0, 0, 3)),
            ("b".to_owned(), counts(0, 0, 0, 3)),
            ("k".to_owned(), counts(0, 0, 0, 4)),
        ]
    );
    // Nothing of the key is left held or parked.
    let left: Vec<String> =
        redis::from_redis_value(raw(&url, &["KEYS", "old:ck*"]).await).expect("keys");
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn refuses_a_server_without_durable_settings_unless_relaxed() {
    let server = Server::start(&["--appendfsync", "everysec"]);
    let url = server.url("");
    // Migrating is refused as connecting is, and writes nothing.
    let err = idemq::store::redis::migrate(&url)
        .await
        .expect_err("migrate on everysec");
    assert!(err.to_string().contains("appendfsync"), "{err}");
    let keys = idemq_testkit::redis_command(&url, &["DBSIZE"])
        .await
        .expect("DBSIZE");
    assert_eq!(keys, redis::Value::Int(0));
    idemq::store::redis::migrate(&server.url("?durability=relaxed"))
        .await
        .expect("migrate relaxed");
    let err = RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect_err("everysec");
    assert!(matches!(err, Error::Validation { .. }), "{err:?}");
    assert!(err.to_string().contains("appendfsync"), "{err}");
    let store = RedisStore::connect(&server.url("?durability=relaxed"), RedisOptions::default())
        .await
        .expect("relaxed");
    assert!(store.durability_relaxed());

    let server = Server::start(&["--appendonly", "no", "--maxmemory-policy", "allkeys-lru"]);
    let url = server.url("");
    idemq::store::redis::migrate(&server.url("?durability=relaxed"))
        .await
        .expect("migrate relaxed");
    let err = RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect_err("no aof");
    assert!(err.to_string().contains("appendonly"), "{err}");
}

#[tokio::test]
async fn a_durable_server_is_not_relaxed() {
    let env = Env::new().await;
    assert!(!env.store.durability_relaxed());
    assert_eq!(env.store.backend(), "redis");
}

#[tokio::test]
async fn microsecond_timestamps_round_trip_exactly() {
    let env = Env::new().await;
    let at = Utc
        .with_ymd_and_hms(2026, 12, 1, 12, 34, 56)
        .single()
        .expect("date")
        + chrono::Duration::microseconds(522_261);
    env.store.set_test_clock(Some(at)).await.expect("clock");
    assert_eq!(env.store.now().await.expect("now"), at);
    let run_at = at + chrono::Duration::microseconds(1_000_001);
    let id = env
        .queue
        .enqueue(EnqueueRequest::new("t").run_at(run_at))
        .await
        .expect("enqueue");
    let job = env.queue.get(&id).await.expect("get").expect("job");
    assert_eq!(job.run_at, run_at);
    assert_eq!(job.created_at, at);
    assert_eq!(job.state, JobState::Scheduled);
    let events = env.queue.events(&id).await.expect("events");
    assert_eq!(events[0].data["run_at"], json!(run_at));
    env.store.set_test_clock(Some(run_at)).await.expect("clock");
    let claimed = env.claim(1).await;
    assert_eq!(claimed.len(), 1);
    assert_eq!(
        claimed[0].lease_expires_at,
        run_at + chrono::Duration::seconds(30)
    );
}

#[tokio::test]
async fn enqueue_replays_and_conflicts() {
    let env = Env::new().await;
    let req = || {
        EnqueueRequest::new("invoice.capture")
            .payload(json!({"n": 1}))
            .idempotency_key("k-1")
    };
    let first = env.queue.enqueue_with_result(req()).await.expect("first");
    assert_eq!(first.outcome, Outcome::Accepted);
    let again = env.queue.enqueue_with_result(req()).await.expect("again");
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (first.job_id.as_str(), Outcome::Replayed)
    );
    let err = env
        .queue
        .enqueue(req().payload(json!({"n": 2})))
        .await
        .expect_err("conflict");
    let c = err.conflict().expect("a conflict");
    assert_eq!(c.job_id, first.job_id);
    assert_eq!(c.fields, vec!["payload".to_owned()]);
    assert_eq!(c.key_preview.as_deref(), Some("k…"));
    assert_eq!(
        env.queue
            .list(JobList {
                limit: 10,
                ..JobList::default()
            })
            .await
            .expect("list")
            .jobs
            .len(),
        1
    );
    assert_eq!(env.kinds(&first.job_id).await, vec!["accepted"]);

    // An explicit id: a replay without a key, a conflict on other fields.
    let by_id = || EnqueueRequest::new("t").job_id("order-7");
    assert_eq!(
        env.queue
            .enqueue_with_result(by_id())
            .await
            .expect("new")
            .outcome,
        Outcome::Accepted
    );
    assert_eq!(
        env.queue
            .enqueue_with_result(by_id())
            .await
            .expect("replay")
            .outcome,
        Outcome::Replayed
    );
    let err = env
        .queue
        .enqueue(by_id().max_attempts(3))
        .await
        .expect_err("conflict");
    assert_eq!(
        err.conflict().expect("conflict").fields,
        vec!["max_attempts".to_owned()]
    );

    // Explain writes nothing and says who holds the key.
    let explain = env
        .queue
        .explain(req().payload(json!({"n": 3})))
        .await
        .expect("explain");
    assert_eq!(explain.outcome, "conflict");
    assert_eq!(explain.idempotency.expect("binding").job_id, first.job_id);
    let explain = env
        .queue
        .explain(EnqueueRequest::new("t").idempotency_key("fresh"))
        .await
        .expect("explain");
    assert_eq!(explain.outcome, "accepted");
    assert!(
        env.queue
            .lookup_key("default", "fresh")
            .await
            .expect("lookup")
            .is_none()
    );
    let b = env
        .queue
        .lookup_key("default", "k-1")
        .await
        .expect("lookup")
        .expect("bound");
    assert_eq!(b.job_id, first.job_id);

    // After the window the key owns a new job; expired bindings are swept.
    env.advance_ms(24 * 3600 * 1000).await;
    let later = env
        .queue
        .enqueue_with_result(req().payload(json!({"n": 9})))
        .await
        .expect("later");
    assert_eq!(later.outcome, Outcome::Accepted);
    assert_ne!(later.job_id, first.job_id);
}

#[tokio::test]
async fn an_atomic_batch_writes_nothing_when_an_item_fails() {
    let env = Env::new().await;
    env.queue
        .enqueue(EnqueueRequest::new("t").idempotency_key("a"))
        .await
        .expect("seed");
    let items = vec![
        EnqueueRequest::new("t").idempotency_key("b"),
        EnqueueRequest::new("t")
            .payload(json!(1))
            .idempotency_key("a"),
    ];
    let err = env
        .queue
        .enqueue_many(items.clone(), idemq::BatchOptions { atomic: true })
        .await
        .expect_err("atomic");
    assert!(matches!(err, Error::BatchItem { index: 1, .. }), "{err:?}");
    assert!(
        env.queue
            .lookup_key("default", "b")
            .await
            .expect("lookup")
            .is_none()
    );
    let results = env
        .queue
        .enqueue_many(items, idemq::BatchOptions { atomic: false })
        .await
        .expect("batch");
    assert!(results[0].is_ok() && results[1].is_err());
    // Items see the earlier items of their batch.
    let results = env
        .queue
        .enqueue_many(
            vec![
                EnqueueRequest::new("t").idempotency_key("c"),
                EnqueueRequest::new("t").idempotency_key("c"),
            ],
            idemq::BatchOptions { atomic: false },
        )
        .await
        .expect("batch");
    let second = results[1].as_ref().expect("replayed");
    assert_eq!(second.outcome, Outcome::Replayed);
    assert_eq!(
        &second.job_id,
        &results[0].as_ref().expect("accepted").job_id
    );
}

#[tokio::test]
async fn claim_orders_by_priority_then_run_at_then_acceptance_and_completes() {
    let env = Env::new().await;
    let low = env
        .queue
        .enqueue(EnqueueRequest::new("t").priority(-1))
        .await
        .expect("low");
    let a = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("a");
    let b = env
        .queue
        .enqueue(EnqueueRequest::new("u").queue("other"))
        .await
        .expect("b");
    let high = env
        .queue
        .enqueue(EnqueueRequest::new("t").priority(5))
        .await
        .expect("high");
    let later = env
        .queue
        .enqueue(
            EnqueueRequest::new("t")
                .priority(9)
                .delay(Duration::from_secs(10)),
        )
        .await
        .expect("later");
    let claimed: Vec<String> = env.claim(10).await.into_iter().map(|j| j.id).collect();
    assert_eq!(
        claimed,
        vec![high.clone(), a.clone(), b.clone(), low.clone()]
    );
    let job = env.queue.get(&later).await.expect("get").expect("job");
    assert_eq!(job.state, JobState::Scheduled);
    let queues = env.queue.queues().await.expect("queues");
    let default = queues
        .iter()
        .find(|q| q.name == "default")
        .expect("default");
    assert_eq!((default.counts.active, default.counts.scheduled), (3, 1));

    env.queue
        .complete(
            &a,
            &idemq::LeaseToken::new(lease(&env, &a).await),
            Some(json!({"ok": true})),
        )
        .await
        .expect_err("stale token");
    env.queue.pause("default").await.expect("pause");
    env.advance_ms(10_000).await;
    assert!(env.claim(1).await.is_empty(), "a paused queue is skipped");
    env.queue.resume("default").await.expect("resume");
    let c = env.claim(1).await.remove(0);
    assert_eq!(c.id, later);
    env.queue
        .complete(&c.id, &c.lease_token, Some(json!({"ok": true})))
        .await
        .expect("complete");
    let job = env.queue.get(&later).await.expect("get").expect("job");
    assert_eq!(job.state, JobState::Completed);
    assert_eq!(job.result, Some(json!({"ok": true})));
    assert_eq!(
        env.kinds(&later).await,
        vec!["accepted", "claimed", "completed"]
    );
    let runs = env.queue.runs(&later).await.expect("runs");
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].outcome.as_deref(), Some("completed"));
    let err = env
        .queue
        .complete(&c.id, &c.lease_token, None)
        .await
        .expect_err("twice");
    assert!(matches!(err, Error::LeaseLost { .. }));
}

/// A token that is not the job's.
async fn lease(_env: &Env, _id: &str) -> String {
    "0123456789abcdef0123456789abcdef".into()
}

#[tokio::test]
async fn concurrency_keys_exclude_each_other() {
    let env = Env::new().await;
    let a = env
        .queue
        .enqueue(EnqueueRequest::new("t").concurrency_key("acct"))
        .await
        .expect("a");
    let b = env
        .queue
        .enqueue(EnqueueRequest::new("t").concurrency_key("acct"))
        .await
        .expect("b");
    let got = env.claim(5).await;
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].id, a);
    assert!(env.claim(5).await.is_empty());
    env.queue
        .complete(&a, &got[0].lease_token, None)
        .await
        .expect("complete");
    assert_eq!(env.claim(5).await[0].id, b);
}

#[tokio::test]
async fn failures_retry_by_policy_then_die_and_redrive_brings_them_back() {
    let env = Env::new().await;
    let id = env
        .queue
        .enqueue(
            EnqueueRequest::new("t")
                .max_attempts(2)
                .retry(RetryPolicy::Fixed { delay_ms: 1000 }),
        )
        .await
        .expect("enqueue");
    let c = env.claim(1).await.remove(0);
    let out = env
        .queue
        .fail(
            &id,
            &c.lease_token,
            FailOptions {
                error: "boom".into(),
                ..FailOptions::default()
            },
        )
        .await
        .expect("fail");
    assert_eq!(out.state, JobState::Scheduled);
    assert_eq!(
        out.next_run_at,
        Some(epoch() + chrono::Duration::seconds(1))
    );
    assert!(env.claim(1).await.is_empty());
    env.advance_ms(1000).await;
    let c = env.claim(1).await.remove(0);
    assert_eq!(c.attempt, 2);
    let out = env
        .queue
        .fail(
            &id,
            &c.lease_token,
            FailOptions {
                error: "again".into(),
                ..FailOptions::default()
            },
        )
        .await
        .expect("fail");
    assert_eq!(out.state, JobState::Dead);
    let job = env.queue.get(&id).await.expect("get").expect("job");
    assert_eq!(
        (job.state, job.attempts_used, job.last_error.as_deref()),
        (JobState::Dead, 2, Some("again"))
    );
    assert_eq!(
        env.kinds(&id).await,
        vec!["accepted", "claimed", "retry_scheduled", "claimed", "dead"]
    );
    let runs = env.queue.runs(&id).await.expect("runs");
    assert_eq!(
        runs.iter()
            .map(|r| r.outcome.clone().unwrap_or_default())
            .collect::<Vec<_>>(),
        vec!["failed", "failed"]
    );

    let r = env
        .queue
        .redrive(
            &id,
            RedriveOptions {
                idempotency_key: Some("r-1".into()),
                ..RedriveOptions::default()
            },
        )
        .await
        .expect("redrive");
    assert_eq!(r.outcome, Outcome::Accepted);
    let again = env
        .queue
        .redrive(
            &id,
            RedriveOptions {
                idempotency_key: Some("r-1".into()),
                ..RedriveOptions::default()
            },
        )
        .await
        .expect("replay");
    assert_eq!(again.outcome, Outcome::Replayed);
    let job = env.queue.get(&id).await.expect("get").expect("job");
    assert_eq!((job.state, job.attempts_used), (JobState::Ready, 0));
    let c = env.claim(1).await.remove(0);
    assert_eq!(c.attempt, 3);
    // A permanent failure dies at once; a snooze does not consume the attempt.
    let out = env
        .queue
        .fail(
            &id,
            &c.lease_token,
            FailOptions {
                snooze: Some(Duration::from_secs(5)),
                ..FailOptions::default()
            },
        )
        .await
        .expect("snooze");
    assert_eq!(out.state, JobState::Scheduled);
    env.advance_ms(5000).await;
    let c = env.claim(1).await.remove(0);
    let out = env
        .queue
        .fail(
            &id,
            &c.lease_token,
            FailOptions {
                error: "bad".into(),
                permanent: true,
                ..FailOptions::default()
            },
        )
        .await
        .expect("permanent");
    assert_eq!(out.state, JobState::Dead);
    assert_eq!(
        env.queue
            .get(&id)
            .await
            .expect("get")
            .expect("job")
            .attempts_used,
        1
    );
}

#[tokio::test]
async fn expired_leases_are_reaped_and_heartbeats_renew() {
    let env = Env::new().await;
    let id = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("enqueue");
    let c = env.claim(1).await.remove(0);
    env.advance_ms(20_000).await;
    let hb = env
        .queue
        .heartbeat(&id, &c.lease_token)
        .await
        .expect("heartbeat");
    assert_eq!(hb.lease_expires_at, epoch() + chrono::Duration::seconds(50));
    env.advance_ms(30_000).await;
    assert_eq!(env.queue.reap_leases(100).await.expect("reap"), 1);
    let job = env.queue.get(&id).await.expect("get").expect("job");
    assert_eq!((job.state, job.attempts_used), (JobState::Ready, 1));
    assert!(env.kinds(&id).await.contains(&"lease_expired".to_owned()));
    assert!(matches!(
        env.queue.heartbeat(&id, &c.lease_token).await,
        Err(Error::LeaseLost { .. })
    ));
    let c = env.claim(1).await.remove(0);
    assert_eq!(c.attempt, 2);
    env.queue
        .release(&id, &c.lease_token)
        .await
        .expect("release");
    let job = env.queue.get(&id).await.expect("get").expect("job");
    assert_eq!((job.state, job.attempts_used), (JobState::Ready, 1));
}

#[tokio::test]
async fn dedupe_coalesces_replaces_and_cancel_by_key_releases() {
    let env = Env::new().await;
    let pending = || EnqueueRequest::new("sync").dedupe(DedupeOptions::key("acct-1"));
    let a = env.queue.enqueue_with_result(pending()).await.expect("a");
    let b = env.queue.enqueue_with_result(pending()).await.expect("b");
    assert_eq!(
        (b.job_id.as_str(), b.outcome),
        (a.job_id.as_str(), Outcome::Coalesced)
    );
    assert!(
        env.queue
            .cancel_by_key("sync", "acct-1")
            .await
            .expect("cancel")
    );
    assert_eq!(
        env.queue
            .get(&a.job_id)
            .await
            .expect("get")
            .expect("job")
            .state,
        JobState::Cancelled
    );
    let c = env.queue.enqueue_with_result(pending()).await.expect("c");
    assert_eq!(c.outcome, Outcome::Accepted);

    let replace = |n: i64| {
        EnqueueRequest::new("mail")
            .payload(json!(n))
            .delay(Duration::from_secs(60))
            .dedupe(DedupeOptions::key("u-1").replace())
    };
    let first = env
        .queue
        .enqueue_with_result(replace(1))
        .await
        .expect("first");
    let second = env
        .queue
        .enqueue_with_result(replace(2))
        .await
        .expect("second");
    assert_eq!(
        (second.job_id.as_str(), second.outcome),
        (first.job_id.as_str(), Outcome::Replaced)
    );
    let job = env
        .queue
        .get(&first.job_id)
        .await
        .expect("get")
        .expect("job");
    assert_eq!(job.payload, json!(2));
    assert!(job.dedupe.expect("dedupe").holds_binding);
    let other = env
        .queue
        .enqueue_with_result(EnqueueRequest::new("mail").dedupe(DedupeOptions::key("u-1")))
        .await
        .expect("coalesced");
    assert_eq!(other.outcome, Outcome::Coalesced);
    let live = env
        .queue
        .dedupe_lookup("mail", "u-1")
        .await
        .expect("lookup")
        .expect("live");
    assert_eq!(live.job_id, first.job_id);

    let throttle =
        || EnqueueRequest::new("t").dedupe(DedupeOptions::key("x").ttl(Duration::from_secs(10)));
    let t1 = env.queue.enqueue_with_result(throttle()).await.expect("t1");
    let c = env.claim(10).await;
    for j in &c {
        env.queue
            .complete(&j.id, &j.lease_token, None)
            .await
            .expect("complete");
    }
    assert_eq!(
        env.queue
            .enqueue_with_result(throttle())
            .await
            .expect("t2")
            .outcome,
        Outcome::Coalesced
    );
    env.advance_ms(10_000).await;
    let t3 = env.queue.enqueue_with_result(throttle()).await.expect("t3");
    assert_eq!(t3.outcome, Outcome::Accepted);
    assert_ne!(t3.job_id, t1.job_id);
}

#[tokio::test]
async fn purge_retention_listing_and_checkpoints() {
    let env = Env::new().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        ids.push(
            env.queue
                .enqueue({
                    let mut r = EnqueueRequest::new("t").payload(json!(i));
                    r.tags = vec!["x".into()];
                    r
                })
                .await
                .expect("enqueue"),
        );
    }
    let page = env
        .queue
        .list(JobList {
            limit: 2,
            ..JobList::default()
        })
        .await
        .expect("page 1");
    assert_eq!(
        page.jobs.iter().map(|j| j.id.clone()).collect::<Vec<_>>(),
        vec![ids[4].clone(), ids[3].clone()]
    );
    let page = env
        .queue
        .list(JobList {
            limit: 10,
            cursor: page.next_cursor,
            ..JobList::default()
        })
        .await
        .expect("page 2");
    assert_eq!(page.jobs.len(), 3);
    assert!(page.next_cursor.is_none());
    let tagged = env
        .queue
        .list(JobList {
            limit: 10,
            tag: Some("x".into()),
            state: Some(JobState::Ready),
            ..JobList::default()
        })
        .await
        .expect("tagged");
    assert_eq!(tagged.jobs.len(), 5);

    let c = env.claim(1).await.remove(0);
    assert!(
        env.queue
            .checkpoint_put(&c.id, &c.lease_token, "step", &json!({"v": 1}))
            .await
            .expect("put")
    );
    assert!(
        !env.queue
            .checkpoint_put(&c.id, &c.lease_token, "step", &json!({"v": 2}))
            .await
            .expect("again")
    );
    assert_eq!(
        env.queue.checkpoint_get(&c.id, "step").await.expect("get"),
        Some(json!({"v": 1}))
    );
    assert!(!env.queue.purge(&c.id).await.expect("active"));
    env.queue
        .complete(&c.id, &c.lease_token, None)
        .await
        .expect("complete");
    assert!(env.queue.purge(&ids[4]).await.expect("purge"));
    assert!(env.queue.get(&ids[4]).await.expect("get").is_none());
    assert_eq!(env.queue.sweep_retention(100).await.expect("sweep"), 0);
    env.advance_ms(24 * 3600 * 1000).await;
    assert_eq!(env.queue.sweep_retention(100).await.expect("sweep"), 1);
    assert!(env.queue.get(&c.id).await.expect("get").is_none());
    let queues = env.queue.queues().await.expect("queues");
    assert_eq!(queues[0].counts.ready, 3);
    assert_eq!(
        env.store
            .binding_sweep(Sweep { limit: 100 })
            .await
            .expect("sweep"),
        0
    );
}

/// A listing of every job merges the queues' own indexes: newest first
/// across queues, page after page.
#[tokio::test]
async fn a_listing_of_every_job_merges_the_queues_newest_first() {
    let env = Env::new().await;
    let mut ids = Vec::new();
    for (i, q) in ["a", "b", "c", "a", "a", "c", "b"].into_iter().enumerate() {
        ids.push(
            env.queue
                .enqueue(EnqueueRequest::new("t").queue(q).payload(json!(i)))
                .await
                .expect("enqueue"),
        );
    }
    let mut seen = Vec::new();
    let mut cursor = None;
    loop {
        let page = env
            .queue
            .list(JobList {
                limit: 2,
                cursor: cursor.take(),
                ..JobList::default()
            })
            .await
            .expect("page");
        assert!(page.jobs.len() <= 2);
        seen.extend(page.jobs.iter().map(|j| j.id.clone()));
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, ids.iter().rev().cloned().collect::<Vec<_>>());
}

#[tokio::test]
async fn wakeups_arrive_on_enqueue() {
    let env = Env::new().await;
    let mut wakeups = env.store.wakeups().await.expect("wakeups");
    // The subscription is made in the background; the first wake-up says so.
    assert!(wakeups.wait(Duration::from_secs(5)).await);
    env.queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("enqueue");
    assert!(wakeups.wait(Duration::from_secs(5)).await);
    drop(env.server);
}

#[tokio::test]
async fn purge_frees_the_key_of_a_job_that_never_ran() {
    let env = Env::new().await;
    let req = || EnqueueRequest::new("t").idempotency_key("k");
    let first = env.queue.enqueue(req()).await.expect("first");
    assert!(env.queue.purge(&first).await.expect("purge"));
    let again = env.queue.enqueue_with_result(req()).await.expect("again");
    assert_eq!(again.outcome, Outcome::Accepted);
    assert_ne!(again.job_id, first);
}

#[tokio::test]
async fn a_released_binding_no_longer_holds_its_job_past_retention() {
    let env = Env::new().await;
    let id = env
        .queue
        .enqueue(EnqueueRequest::new("t").idempotency(
            idemq::IdempotencyOptions::new("k").ttl(Duration::from_secs(7 * 24 * 3600)),
        ))
        .await
        .expect("enqueue");
    let c = env.claim(1).await.remove(0);
    env.queue
        .complete(&id, &c.lease_token, None)
        .await
        .expect("complete");
    env.advance_ms(24 * 3600 * 1000 + 1).await;
    assert_eq!(env.queue.sweep_retention(100).await.expect("sweep"), 0);
    assert!(
        env.queue
            .release_key("default", "k")
            .await
            .expect("release")
    );
    assert_eq!(env.queue.sweep_retention(100).await.expect("sweep"), 1);
    assert!(env.queue.get(&id).await.expect("get").is_none());
}

/// Sets `field` of job `id`'s hash behind the store's back (the default
/// prefix), as a hand edit or a row of another version would leave it.
async fn corrupt(env: &Env, id: &str, field: &str, value: &str) {
    raw(
        &env.server.url(""),
        &["HSET", &format!("idemq:job:{id}"), field, value],
    )
    .await;
}

/// The message of a `Backend` error; anything else fails the test.
#[track_caller]
fn backend_message<T: std::fmt::Debug>(r: idemq::Result<T>) -> String {
    match r {
        Err(Error::Backend { message }) => message,
        other => panic!("expected a Backend error, got {other:?}"),
    }
}

/// Asserts `id` waits untouched: ready, never started, only accepted.
async fn assert_untouched(env: &Env, id: &str) {
    let job = env.queue.get(id).await.expect("get").expect("job");
    assert_eq!(job.state, JobState::Ready, "{id}");
    assert_eq!((job.attempt, job.attempts_used), (0, 0), "{id}");
    assert_eq!(env.kinds(id).await, vec!["accepted"], "{id}");
}

/// Two jobs of type `t`, in order, the second's `field` then set to
/// `value` by hand: (the good one, the bad one).
async fn good_then_bad(
    env: &Env,
    good: EnqueueRequest,
    field: &str,
    value: &str,
) -> (String, String) {
    let good = env.queue.enqueue(good).await.expect("good");
    let bad = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("bad");
    corrupt(env, &bad, field, value).await;
    (good, bad)
}

/// Claim options of worker `w-1` for `limit` jobs.
fn up_to(limit: u32) -> ClaimOptions {
    ClaimOptions {
        limit,
        worker: "w-1".into(),
        ..ClaimOptions::default()
    }
}

/// A claim whose second candidate's row does not read fails as a whole
/// and leases nothing (Redis cannot take back a function's writes, so the
/// function checks every row it will write before its first write), as
/// PostgreSQL and SQLite roll the claim back: the first candidate still
/// waits, never started, and no lease of it can expire into a lost attempt.
#[tokio::test]
async fn a_claim_that_meets_an_unreadable_row_leases_nothing() {
    let env = Env::new().await;
    let (good, bad) = good_then_bad(
        &env,
        EnqueueRequest::new("t").max_attempts(1),
        "attempt",
        "x",
    )
    .await;
    let message = backend_message(env.queue.claim(up_to(2)).await);
    assert!(message.contains("(job.attempt)"), "{message}");
    assert!(message.contains(&bad), "{message}");
    assert!(message.contains("\"x\""), "{message}");
    assert_untouched(&env, &good).await;
    let queues = env.queue.queues().await.expect("queues");
    assert_eq!(queues[0].counts.active, 0);
    // Long after any lease would have expired, nothing was lost.
    env.advance_ms(3_600_000).await;
    env.queue.reap_leases(100).await.expect("reap");
    assert_untouched(&env, &good).await;
    // The row mended, both are claimed, in order.
    corrupt(&env, &bad, "attempt", "0").await;
    let claimed: Vec<String> = env.claim(2).await.into_iter().map(|j| j.id).collect();
    assert_eq!(claimed, vec![good, bad]);
}

/// A claim whose candidate's payload does not decode fails before it
/// leases anything: the store decodes a claimed job's payload after the
/// call, when nothing could be taken back.
#[tokio::test]
async fn a_claim_that_meets_an_undecodable_payload_leases_nothing() {
    let env = Env::new().await;
    let (good, _bad) =
        good_then_bad(&env, EnqueueRequest::new("t"), "payload", "{\"half\": ").await;
    let message = backend_message(env.queue.claim(up_to(2)).await);
    assert!(message.contains("(job.payload)"), "{message}");
    assert_untouched(&env, &good).await;
}

/// Completions sent with a claim that meets an unreadable row are not
/// recorded either: the whole call failed, so the worker's retried
/// completion is accepted, not told its lease is lost.
#[tokio::test]
async fn a_complete_and_claim_that_meets_an_unreadable_row_records_no_completion() {
    let env = Env::new().await;
    let done = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("done");
    let running = env.claim(1).await.remove(0);
    assert_eq!(running.id, done);
    let (good, _bad) = good_then_bad(&env, EnqueueRequest::new("t"), "attempt", "x").await;
    let completion = || idemq::Completion {
        job_id: done.clone(),
        lease_token: running.lease_token.clone(),
        result: Some(json!({"ok": true})),
    };
    let message = backend_message(
        env.queue
            .complete_and_claim(vec![completion()], up_to(2))
            .await,
    );
    assert!(message.contains("(job.attempt)"), "{message}");
    let job = env.queue.get(&done).await.expect("get").expect("job");
    assert_eq!(job.state, JobState::Active);
    assert_eq!(job.result, None);
    assert_eq!(env.kinds(&done).await, vec!["accepted", "claimed"]);
    assert_untouched(&env, &good).await;
    // The retried completion alone lands.
    let (completed, claimed) = env
        .queue
        .complete_and_claim(vec![completion()], up_to(0))
        .await
        .expect("completion alone");
    assert!(completed.iter().all(Result::is_ok), "{completed:?}");
    assert!(claimed.expect("no claim").is_empty());
    let job = env.queue.get(&done).await.expect("get").expect("job");
    assert_eq!(job.state, JobState::Completed);
}

/// Reaping expired leases checks every row it will record before the
/// first: an unreadable one among them fails the pass and costs no other
/// job its attempt.
#[tokio::test]
async fn a_reap_that_meets_an_unreadable_row_records_nothing() {
    let env = Env::new().await;
    let first = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("first");
    assert_eq!(env.claim(1).await[0].id, first);
    env.advance_ms(1).await;
    let second = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("second");
    assert_eq!(env.claim(1).await[0].id, second);
    corrupt(&env, &second, "max_attempts", "many").await;
    env.advance_ms(3_600_000).await;
    let message = backend_message(env.queue.reap_leases(100).await);
    assert!(message.contains("(job.max_attempts)"), "{message}");
    let job = env.queue.get(&first).await.expect("get").expect("job");
    assert_eq!((job.state, job.attempts_used), (JobState::Active, 0));
    assert_eq!(env.kinds(&first).await, vec!["accepted", "claimed"]);
    // The row mended, both leases are recorded.
    corrupt(&env, &second, "max_attempts", "1").await;
    assert_eq!(env.queue.reap_leases(100).await.expect("reap"), 2);
    let job = env.queue.get(&first).await.expect("get").expect("job");
    assert_eq!((job.state, job.attempts_used), (JobState::Ready, 1));
    let job = env.queue.get(&second).await.expect("get").expect("job");
    assert_eq!((job.state, job.attempts_used), (JobState::Dead, 1));
}

/// The keys of the installation matching `pattern` (after the default
/// prefix), sorted.
async fn keys(env: &Env, pattern: &str) -> Vec<String> {
    let mut found: Vec<String> = redis::from_redis_value(
        raw(&env.server.url(""), &["KEYS", &format!("idemq:{pattern}")]).await,
    )
    .expect("keys");
    found.sort();
    found
}

/// A job of type `t` with key `k`, kept an hour.
fn keyed_k() -> EnqueueRequest {
    EnqueueRequest::new("t")
        .idempotency(idemq::IdempotencyOptions::new("k").ttl(Duration::from_secs(3600)))
}

/// The id of a job of `keyed_k()` that ran and completed.
async fn ran_keyed(env: &Env) -> String {
    let id = env.queue.enqueue(keyed_k()).await.expect("first");
    let c = env.claim(1).await.remove(0);
    env.queue
        .complete(&id, &c.lease_token, None)
        .await
        .expect("complete");
    id
}

/// A job that ran keeps its idempotency bindings after a purge, until
/// their ttl; the list of them (`jk:<id>`) goes with the job, so a key
/// that expires and is taken by another job before the sweep leaves no
/// list of a job that is gone.
#[tokio::test]
async fn a_purged_job_leaves_no_list_of_its_keys() {
    let env = Env::new().await;
    let req = keyed_k;
    let first = ran_keyed(&env).await;
    assert!(env.queue.purge(&first).await.expect("purge"));
    assert_eq!(
        keys(&env, &format!("jk:{first}")).await,
        Vec::<String>::new()
    );
    // The key still replays the purged job until it expires.
    let again = env.queue.enqueue_with_result(req()).await.expect("again");
    assert_eq!(
        (again.job_id.as_str(), again.outcome),
        (first.as_str(), Outcome::Replayed)
    );
    env.advance_ms(3_600_001).await;
    let second = env.queue.enqueue_with_result(req()).await.expect("second");
    assert_eq!(second.outcome, Outcome::Accepted);
    env.queue.sweep_bindings(100).await.expect("sweep");
    assert_eq!(
        keys(&env, "jk:*").await,
        vec![format!("idemq:jk:{}", second.job_id)]
    );
}

/// A key taken by another job after it expired leaves the list of the job
/// it was bound to: the list names exactly the job's own bindings, and is
/// gone once it names none.
#[tokio::test]
async fn a_reused_key_leaves_the_list_of_the_job_it_was_bound_to() {
    let env = Env::new().await;
    let req = keyed_k;
    let first = ran_keyed(&env).await;
    env.advance_ms(3_600_001).await;
    let second = env.queue.enqueue(req()).await.expect("second");
    assert_ne!(second, first);
    assert!(env.queue.get(&first).await.expect("get").is_some());
    assert_eq!(keys(&env, "jk:*").await, vec![format!("idemq:jk:{second}")]);
    // A redrive key that expired and was taken by another redrive likewise.
    let mut dead = Vec::new();
    for _ in 0..2 {
        let id = env
            .queue
            .enqueue(EnqueueRequest::new("d").queue("d").max_attempts(1))
            .await
            .expect("enqueue");
        let c = env
            .queue
            .claim(ClaimOptions {
                limit: 1,
                queues: vec!["d".into()],
                worker: "w-1".into(),
                ..ClaimOptions::default()
            })
            .await
            .expect("claim")
            .remove(0);
        assert_eq!(c.id, id);
        env.queue
            .fail(
                &id,
                &c.lease_token,
                FailOptions {
                    error: "boom".into(),
                    permanent: true,
                    ..FailOptions::default()
                },
            )
            .await
            .expect("fail");
        dead.push(id);
    }
    let keyed = || RedriveOptions {
        idempotency_key: Some("r".into()),
        ..RedriveOptions::default()
    };
    env.queue.redrive(&dead[0], keyed()).await.expect("redrive");
    env.advance_ms(24 * 3_600_000 + 1).await;
    let again = env.queue.redrive(&dead[1], keyed()).await.expect("redrive");
    assert_eq!(again.outcome, Outcome::Accepted);
    assert!(env.queue.get(&dead[0]).await.expect("get").is_some());
    let mut lists = vec![
        format!("idemq:jk:{}", dead[1]),
        format!("idemq:jk:{second}"),
    ];
    lists.sort();
    assert_eq!(keys(&env, "jk:*").await, lists);
}

/// `no-appendfsync-on-rewrite yes` lets Redis skip the fsync while a
/// `BGSAVE` or an AOF rewrite runs, even with `appendfsync always`: such a
/// server is refused like one on `appendfsync everysec`, unless relaxed.
#[tokio::test]
async fn refuses_a_server_that_skips_fsync_during_rewrites_unless_relaxed() {
    let server = Server::start(&["--no-appendfsync-on-rewrite", "yes"]);
    let url = server.url("");
    let err = idemq::store::redis::migrate(&url)
        .await
        .expect_err("migrate on no-appendfsync-on-rewrite yes");
    assert!(
        err.to_string().contains("no-appendfsync-on-rewrite yes"),
        "{err}"
    );
    assert_eq!(raw(&url, &["DBSIZE"]).await, redis::Value::Int(0));
    idemq::store::redis::migrate(&server.url("?durability=relaxed"))
        .await
        .expect("migrate relaxed");
    let err = RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect_err("strict");
    assert!(matches!(err, Error::Validation { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("set `no-appendfsync-on-rewrite no`"),
        "{err}"
    );
    let store = RedisStore::connect(&server.url("?durability=relaxed"), RedisOptions::default())
        .await
        .expect("relaxed");
    assert!(store.durability().is_relaxed());
}

/// A strict store reads its server's durable settings again at every
/// maintenance pass: switched to `appendfsync everysec` under it, the
/// store refuses writes (`Unavailable`, naming the setting and how to set
/// it back) and reports relaxed durability after one pass, while reads go
/// on; set back, the next pass lifts both. A relaxed store goes on.
#[tokio::test]
async fn a_strict_store_refuses_writes_once_a_pass_finds_its_settings_changed() {
    use idemq::worker::Maintenance;
    use idemq::worker::maintenance::Step;

    let env = Env::new().await;
    let url = env.server.url("");
    let id = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("enqueue");
    let relaxed = Queue::connect(&env.server.url("?durability=relaxed"))
        .await
        .expect("relaxed");
    let maintenance = Maintenance::new(env.queue.clone());
    let report = maintenance.pass().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);

    raw(&url, &["CONFIG", "SET", "appendfsync", "everysec"]).await;
    // Nothing tells the store until a pass looks.
    assert_eq!(env.queue.durability(), idemq::Durability::Full);
    let report = maintenance.pass().await;
    let first = report.errors.first().expect("the check fails");
    assert_eq!(first.step, Step::CheckDurability);
    for e in &report.errors {
        assert!(matches!(e.error, Error::Unavailable { .. }), "{e:?}");
    }
    let message = first.error.to_string();
    assert!(message.contains("appendfsync everysec"), "{message}");
    assert!(
        message.contains("CONFIG SET appendfsync always"),
        "{message}"
    );
    let reason = env.queue.durability().reason().map(str::to_owned);
    assert!(
        reason.as_deref().is_some_and(|r| r.contains("appendfsync")),
        "{reason:?}"
    );
    let err = env
        .queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect_err("refused");
    assert!(err.is_retryable(), "{err:?}");
    assert!(err.to_string().contains("appendfsync everysec"), "{err}");
    let err = env
        .queue
        .claim(ClaimOptions {
            limit: 1,
            worker: "w-1".into(),
            ..ClaimOptions::default()
        })
        .await
        .expect_err("refused");
    assert!(matches!(err, Error::Unavailable { .. }), "{err:?}");
    assert!(env.queue.get(&id).await.expect("reads go on").is_some());
    // A relaxed store never checks: it goes on, and says it is relaxed.
    relaxed
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("relaxed enqueue");
    let report = Maintenance::new(relaxed.clone()).pass().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert!(relaxed.durability().is_relaxed());

    raw(&url, &["CONFIG", "SET", "appendfsync", "always"]).await;
    let report = maintenance.pass().await;
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(env.queue.durability(), idemq::Durability::Full);
    env.queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("writes again");
}

/// An installation records the revision of the library it was migrated
/// for; a binary whose library is older refuses to migrate it (an older
/// `idemq serve` restarting in a rolling upgrade) or to run on it, naming
/// the idemq to run, and records nothing, so the newer processes keep it.
/// An installation recorded before revisions is migrated as before.
#[tokio::test]
async fn an_older_binary_neither_records_its_functions_over_newer_ones_nor_runs_on_them() {
    let server = Server::start(&[]);
    let url = server.url("?prefix=roll:");
    idemq::store::redis::migrate(&url).await.expect("migrate");
    let get = |key: &'static str| {
        let url = url.clone();
        async move {
            let v: Option<String> =
                redis::from_redis_value(raw(&url, &["GET", &format!("roll:{key}")]).await)
                    .expect("GET");
            v
        }
    };
    assert_eq!(
        get("revision").await,
        Some(idemq::store::redis::FUNCTIONS_REVISION.to_string())
    );
    let ours = get("version").await.expect("version");
    // A newer idemq migrated since: a higher revision, its own library.
    let newer = (idemq::store::redis::FUNCTIONS_REVISION + 1).to_string();
    for (key, value) in [
        ("roll:revision", newer.as_str()),
        ("roll:version", "ffffffffffffffff"),
        ("roll:idemq", "9.9.9"),
    ] {
        raw(&url, &["SET", key, value]).await;
    }
    for err in [
        idemq::store::redis::migrate(&url)
            .await
            .expect_err("older migrate"),
        RedisStore::connect(&url, RedisOptions::default())
            .await
            .expect_err("older connect"),
    ] {
        let text = err.to_string();
        assert!(text.contains("revision of the idemq functions"), "{text}");
        assert!(text.contains("run idemq 9.9.9"), "{text}");
    }
    assert_eq!(get("version").await.as_deref(), Some("ffffffffffffffff"));
    assert_eq!(get("revision").await, Some(newer));
    // Recorded before revisions: this binary's library is recorded again.
    raw(&url, &["DEL", "roll:revision"]).await;
    idemq::store::redis::migrate(&url).await.expect("migrate");
    assert_eq!(get("version").await, Some(ours));
    RedisStore::connect(&url, RedisOptions::default())
        .await
        .expect("connect");
}

/// Every key of the server and every function library loaded on it.
async fn everything(url: &str) -> (redis::Value, redis::Value) {
    (
        raw(url, &["KEYS", "*"]).await,
        raw(url, &["FUNCTION", "LIST"]).await,
    )
}

/// Redis Cluster is not supported: a server in cluster mode (here a
/// one-node cluster serving every slot) is refused by connect and by
/// `idemq migrate`, strict or relaxed, with a `Validation` error on
/// `database` that says so and what to run instead, and nothing is
/// written on it.
#[tokio::test]
async fn a_server_in_cluster_mode_is_refused_and_nothing_is_written() {
    let server = Server::start(&[
        "--cluster-enabled",
        "yes",
        // In the server's own directory (`--dir`).
        "--cluster-config-file",
        "nodes.conf",
    ]);
    let url = server.url("");
    raw(&url, &["CLUSTER", "ADDSLOTSRANGE", "0", "16383"]).await;
    // Serving: the node counts its cluster up (a moment after the slots).
    for _ in 0..200 {
        let info: String =
            redis::from_redis_value(raw(&url, &["CLUSTER", "INFO"]).await).expect("info");
        if info.contains("cluster_state:ok") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    raw(&url, &["SET", "probe", "1"]).await;
    raw(&url, &["DEL", "probe"]).await;
    let before = everything(&url).await;
    assert_eq!(
        before,
        (redis::Value::Array(vec![]), redis::Value::Array(vec![]))
    );
    for url in [
        server.url(""),
        server.url("?durability=relaxed&prefix=app1:"),
    ] {
        let migrate = idemq::store::redis::migrate(&url)
            .await
            .expect_err("migrate on a cluster");
        let connect = RedisStore::connect(&url, RedisOptions::default())
            .await
            .expect_err("connect to a cluster");
        let status = idemq::store::redis::migration_status(&url)
            .await
            .expect_err("status of a cluster");
        for err in [migrate, connect, status] {
            assert!(
                matches!(&err, Error::Validation { field, .. } if field == "database"),
                "{err:?}"
            );
            let text = err.to_string();
            assert!(text.contains("Redis Cluster is not supported"), "{text}");
            assert!(text.contains("standalone Redis primary"), "{text}");
        }
        assert_eq!(everything(&url).await, before);
    }
}

/// A key prefix ends in its only colon, so no installation's prefix starts
/// another's: `a:job:` (whose `a:job:layout` would be the job `layout` of
/// the installation under `a:`) is refused by migrate and connect, writing
/// nothing, and the refusal says how to move an installation stored under
/// it. Installations under `a:` and `ab:` keep apart.
#[tokio::test]
async fn a_prefix_that_could_start_another_is_refused_and_says_what_to_do() {
    let server = Server::start(&[]);
    for prefix in ["a:job:", "a", "app:prod:"] {
        let url = server.url(&format!("?prefix={prefix}"));
        for err in [
            idemq::store::redis::migrate(&url)
                .await
                .expect_err("migrate"),
            RedisStore::connect(&url, RedisOptions::default())
                .await
                .expect_err("connect"),
        ] {
            assert!(
                matches!(&err, Error::Validation { field, .. } if field == "database"),
                "{err:?}"
            );
            let text = err.to_string();
            assert!(text.contains("no other colon"), "{text}");
            assert!(text.contains("renamed"), "{text}");
            assert!(text.contains("Key prefixes"), "{text}");
        }
        assert_eq!(raw(&url, &["DBSIZE"]).await, redis::Value::Int(0));
    }
    let a = server.url("?prefix=a:");
    let ab = server.url("?prefix=ab:");
    idemq::store::redis::migrate(&a).await.expect("migrate a:");
    let keys = |pattern: &'static str| {
        let url = a.clone();
        async move {
            let mut k: Vec<String> =
                redis::from_redis_value(raw(&url, &["KEYS", pattern]).await).expect("keys");
            k.sort();
            k
        }
    };
    let of_a = keys("*").await;
    idemq::store::redis::migrate(&ab)
        .await
        .expect("migrate ab:");
    let queue = Queue::connect(&ab).await.expect("connect ab:");
    queue
        .enqueue(EnqueueRequest::new("t"))
        .await
        .expect("enqueue");
    assert_eq!(keys("a:*").await, of_a);
    let queue = Queue::connect(&a).await.expect("connect a:");
    assert!(
        queue
            .list(JobList {
                limit: 10,
                ..JobList::default()
            })
            .await
            .expect("list")
            .jobs
            .is_empty()
    );
}

/// `idemq migrate` leaves the libraries it did not load: another
/// installation on the server may be migrated for one, and the older
/// processes of a rolling upgrade call theirs until they stop.
#[tokio::test]
async fn migrate_deletes_no_other_function_library() {
    let server = Server::start(&[]);
    let url = server.url("");
    raw(
        &url,
        &[
            "FUNCTION",
            "LOAD",
            "#!lua name=idemq_0000000000000000\n\
             redis.register_function('idemq_0000000000000000_now', function() return 1 end)",
        ],
    )
    .await;
    idemq::store::redis::migrate(&url).await.expect("migrate");
    let listed = format!(
        "{:?}",
        raw(&url, &["FUNCTION", "LIST", "LIBRARYNAME", "idemq_*"]).await
    );
    assert!(listed.contains("idemq_0000000000000000"), "{listed}");
    assert_eq!(
        raw(&url, &["FCALL", "idemq_0000000000000000_now", "0"]).await,
        redis::Value::Int(1)
    );
}

/// A listing's reply is bounded where it is built: the library's
/// `job_list` stops before the bound's bytes of a job's stored fields
/// (unless the page's first job alone holds more), so listing large jobs
/// never builds a reply of `limit` of them in the server's memory, and
/// the cursor it answers then starts the next page at the job left out.
#[tokio::test]
async fn a_listing_reply_is_bounded_where_it_is_built() {
    let server = Server::start(&[]);
    let url = server.url("?prefix=big:");
    idemq::store::redis::migrate(&url).await.expect("migrate");
    let queue = Queue::connect(&url).await.expect("connect");
    const JOBS: usize = 12;
    const PAD: usize = 300_000;
    let mut ids = std::collections::BTreeSet::new();
    for i in 0..JOBS {
        let job = queue
            .enqueue(EnqueueRequest::new("big").payload(json!({"i": i, "pad": "x".repeat(PAD)})))
            .await
            .expect("enqueue");
        ids.insert(job);
    }
    let version = match raw(&url, &["GET", "big:version"]).await {
        redis::Value::BulkString(v) => String::from_utf8(v).expect("utf-8"),
        v => panic!("version: {v:?}"),
    };
    let function = format!("idemq_{version}_job_list");
    // ARGV: prefix, test clock, state, due, queue, type, tag, cursor,
    // limit, bound.
    let list = |cursor: String, bound: &'static str| {
        let (url, function) = (url.clone(), function.clone());
        async move {
            let reply = raw(
                &url,
                &[
                    "FCALL", &function, "0", "big:", "0", "", "", "", "", "", &cursor, "1000",
                    bound,
                ],
            )
            .await;
            let redis::Value::Array(items) = reply else {
                panic!("reply: {reply:?}")
            };
            let text = |v: &redis::Value| match v {
                redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                v => panic!("{v:?}"),
            };
            let next = text(&items[1]);
            let mut bytes = 0;
            let mut page = Vec::new();
            for job in &items[2..] {
                let redis::Value::Array(pairs) = job else {
                    panic!("{job:?}")
                };
                let pairs: Vec<String> = pairs.iter().map(text).collect();
                bytes += pairs.iter().map(String::len).sum::<usize>();
                let id = pairs.chunks(2).find(|p| p[0] == "id").expect("id")[1].clone();
                page.push(id);
            }
            (page, next, bytes)
        }
    };
    // Without a bound, every job at once.
    let (all, next, bytes) = list(String::new(), "").await;
    assert_eq!(all.len(), JOBS);
    assert!(next.is_empty());
    assert!(bytes > JOBS * PAD);
    // A bound of 1 MB: three jobs of about 300 KB a page, never more bytes
    // than the bound, and every job once over the pages.
    let mut seen = Vec::new();
    let mut cursor = String::new();
    loop {
        let (page, next, bytes) = list(cursor, "1000000").await;
        assert_eq!(page.len(), 3, "{page:?}");
        assert!(bytes <= 1_000_000, "{bytes}");
        seen.extend(page);
        if next.is_empty() {
            break;
        }
        cursor = next;
        assert!(seen.len() <= JOBS, "the pages end");
    }
    assert_eq!(seen, all, "each job once, in the same order");
    // A bound below one job: one job a page, not none.
    let (page, next, _) = list(String::new(), "1000").await;
    assert_eq!(page.len(), 1);
    assert_eq!(page[0], all[0]);
    assert!(!next.is_empty());
    assert_eq!(
        seen.iter()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        ids
    );
}
