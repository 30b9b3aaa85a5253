//! idemq behind PgBouncer in transaction pooling, with `?pgbouncer=true`.
//!
//! The test starts Debian's `pgbouncer` (1.18: no prepared statements in
//! transaction pooling) on a free loopback port in front of a fresh
//! database of the test server, with two server connections for many
//! clients, so consecutive transactions of one client land on different
//! server connections. It fails when `pgbouncer` is not installed
//! (scripts/test installs it).
//!
//! Through it: concurrent enqueues and replays, claim, heartbeat, complete,
//! fail, the dashboard's pages, `Queue::enqueue_in` in the caller's
//! transaction; a worker whose wake-ups come from a direct
//! `IDEMQ_WAKEUP_DATABASE_URL` (it polls only once a minute, so only a
//! wake-up can start the job in time), and a wake-up URL that goes through
//! the pooler too, refused at connect time.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use idemq::{ClaimOptions, EnqueueRequest, FailOptions, JobList, Queue};
use serde_json::json;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, Row};

const PGBOUNCER: &str = "/usr/sbin/pgbouncer";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// A PgBouncer of this test, killed on drop.
struct Bouncer {
    child: Child,
    port: u16,
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Bouncer {
    fn start(dir: &Path, db: &str) -> Self {
        assert!(
            Path::new(PGBOUNCER).exists(),
            "{PGBOUNCER} is missing: install Debian's pgbouncer (scripts/test does)"
        );
        let admin = PgConnectOptions::from_str(&idemq_testkit::pg_admin_url()).expect("admin url");
        let port = free_port();
        let user = admin.get_username().to_owned();
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).expect("users");
        let config = format!(
            "[databases]\n\
             {db} = host={host} port={pgport} dbname={db}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = transaction\n\
             default_pool_size = 2\n\
             max_client_conn = 200\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n",
            host = admin.get_host(),
            pgport = admin.get_port(),
            dir = dir.display(),
        );
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(&ini, config).expect("config");
        let mut cmd = Command::new(PGBOUNCER);
        // PgBouncer refuses to run as root: it then runs as `postgres`.
        if is_root() {
            cmd.args(["-u", "postgres"]);
            let _ = Command::new("chmod")
                .args(["-R", "a+rwX"])
                .arg(dir)
                .status();
        }
        let child = cmd
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join("stderr")).expect("stderr"),
            ))
            .spawn()
            .expect("start pgbouncer");
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "pgbouncer did not listen: {} {}",
                std::fs::read_to_string(dir.join("stderr")).unwrap_or_default(),
                std::fs::read_to_string(dir.join("pgbouncer.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { child, port }
    }

    fn url(&self, db: &str) -> String {
        let admin = PgConnectOptions::from_str(&idemq_testkit::pg_admin_url()).expect("admin url");
        format!(
            "postgres://{}@127.0.0.1:{}/{db}",
            admin.get_username(),
            self.port
        )
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_queue_works_through_transaction_pooling() {
    let (direct, db) = idemq_testkit::pg_database();
    let dir = tempfile::tempdir().expect("tempdir");
    let bouncer = Bouncer::start(dir.path(), &db);
    let url = format!("{}?pgbouncer=true", bouncer.url(&db));
    let outcome = tokio::time::timeout(
        Duration::from_secs(120),
        exercise(&url, &direct, &bouncer, &db),
    )
    .await;
    drop(bouncer);
    idemq_testkit::drop_pg_database(&db);
    outcome.expect("the PgBouncer test took over 2 minutes");
}

async fn exercise(url: &str, direct: &str, bouncer: &Bouncer, db: &str) {
    // A sanity check that this PgBouncer really pools transactions: two
    // clients, each running one-statement transactions in turn, are served
    // by a common server connection, which a session pooler never does
    // while both clients are connected. Simple-protocol statements, so
    // nothing here depends on prepared statements.
    let plain = bouncer.url(db);
    let mut a = sqlx::PgConnection::connect(&plain).await.expect("client a");
    let mut b = sqlx::PgConnection::connect(&plain).await.expect("client b");
    let (mut pids_a, mut pids_b) = (Vec::new(), Vec::new());
    for _ in 0..10 {
        for (conn, pids) in [(&mut a, &mut pids_a), (&mut b, &mut pids_b)] {
            let row = sqlx::raw_sql("SELECT pg_backend_pid()")
                .fetch_one(&mut *conn)
                .await
                .expect("backend pid");
            pids.push(row.get::<i32, _>(0));
        }
    }
    assert!(
        pids_a.iter().any(|p| pids_b.contains(p)),
        "the two clients never shared a server connection ({pids_a:?} / {pids_b:?}): \
         the test's PgBouncer is not pooling transactions"
    );
    drop((a, b));

    let queue = Queue::connect(url)
        .await
        .expect("connect through pgbouncer");

    // Concurrent keyed enqueues from 8 tasks, each key twice: one job per key.
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8 {
        let queue = queue.clone();
        tasks.spawn(async move {
            let mut ids = Vec::new();
            for i in 0..40 {
                let key = format!("k{}", (t * 40 + i) % 160);
                let req = EnqueueRequest::new("bouncer.job")
                    .payload(json!({ "key": key }))
                    .idempotency_key(key.clone());
                ids.push((key, queue.enqueue(req).await.expect("enqueue")));
            }
            ids
        });
    }
    let mut by_key = std::collections::HashMap::new();
    while let Some(ids) = tasks.join_next().await {
        for (key, id) in ids.expect("task") {
            let first = by_key.entry(key).or_insert_with(|| id.clone());
            assert_eq!(*first, id, "one key, two jobs");
        }
    }
    assert_eq!(by_key.len(), 160);
    let listed = queue.queues().await.expect("queues");
    let waiting: u64 = listed
        .iter()
        .filter(|q| q.name == "default")
        .map(|q| q.counts.ready)
        .sum();
    assert_eq!(waiting, 160, "{listed:?}");
    // Pages read row by row, in a transaction each, under a byte bound
    // that cuts them short: every job once.
    let (mut seen, mut cursor) = (std::collections::HashSet::new(), None);
    loop {
        let filter = JobList {
            limit: 100,
            cursor: cursor.take(),
            ..JobList::default()
        };
        let page = queue.list_within(filter, 4_000).await.expect("list");
        assert!(!page.jobs.is_empty() && page.jobs.len() < 100);
        for job in page.jobs {
            assert!(seen.insert(job.id), "a job listed twice");
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    assert_eq!(seen.len(), 160);

    // Claim, heartbeat, complete, fail.
    let claim = |limit| ClaimOptions {
        queues: Vec::new(),
        types: Some(vec!["bouncer.job".into()]),
        worker: "bouncer-test".into(),
        limit,
        lease: Duration::from_secs(30),
    };
    let jobs = queue.claim(claim(20)).await.expect("claim");
    assert_eq!(jobs.len(), 20);
    for (i, job) in jobs.iter().enumerate() {
        queue
            .heartbeat(&job.id, &job.lease_token)
            .await
            .expect("heartbeat");
        if i % 2 == 0 {
            queue
                .complete(&job.id, &job.lease_token, Some(json!({ "ok": i })))
                .await
                .expect("complete");
        } else {
            let options = FailOptions {
                error: "boom".into(),
                permanent: true,
                ..FailOptions::default()
            };
            queue
                .fail(&job.id, &job.lease_token, options)
                .await
                .expect("fail");
        }
    }
    let done = queue.get(&jobs[0].id).await.expect("get").expect("job");
    assert_eq!(done.state, idemq::JobState::Completed);
    let dead = queue.get(&jobs[1].id).await.expect("get").expect("job");
    assert_eq!(dead.state, idemq::JobState::Dead);
    assert!(!queue.runs(&jobs[1].id).await.expect("runs").is_empty());

    // The dashboard's pages.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(idemq_server::serve(
        listener,
        queue.clone(),
        idemq_server::ServerOptions::default(),
        async move {
            let _ = stopped.await;
        },
    ));
    let client = reqwest::Client::new();
    for page in [
        "/".to_owned(),
        "/jobs".to_owned(),
        format!("/jobs/{}", jobs[0].id),
        "/dead".to_owned(),
        "/schedules".to_owned(),
        "/bindings".to_owned(),
        "/dashboard/stats.json".to_owned(),
    ] {
        let resp = client
            .get(format!("http://{addr}{page}"))
            .send()
            .await
            .expect("GET");
        assert_eq!(resp.status(), 200, "GET {page}");
    }
    let _ = stop.send(());
    let _ = server.await;

    // enqueue_in on the caller's own pool through PgBouncer: committed and rolled back.
    let own = PgPoolOptions::new()
        .max_connections(2)
        .connect_with(
            PgConnectOptions::from_str(&bouncer.url(db))
                .expect("url")
                .statement_cache_capacity(0),
        )
        .await
        .expect("own pool");
    let mut tx = own.begin().await.expect("begin");
    let kept = queue
        .enqueue_in(
            &mut tx,
            EnqueueRequest::new("bouncer.tx").idempotency_key("tx-1"),
        )
        .await
        .expect("enqueue_in");
    tx.commit().await.expect("commit");
    let mut tx = own.begin().await.expect("begin");
    let gone = queue
        .enqueue_in(
            &mut tx,
            EnqueueRequest::new("bouncer.tx").idempotency_key("tx-2"),
        )
        .await
        .expect("enqueue_in");
    tx.rollback().await.expect("rollback");
    assert!(queue.get(&kept.job_id).await.expect("get").is_some());
    assert!(queue.get(&gone.job_id).await.expect("get").is_none());

    // A worker behind PgBouncer, woken through the direct URL: it polls
    // once a minute, so only a wake-up starts the job within seconds.
    let work = tempfile::tempdir().expect("tempdir");
    let marker = work.path().join("ran");
    let mut worker = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["worker", "--types", "bouncer.wake", "--poll-ms", "60000"])
        .arg("--exec")
        .arg(format!("touch {}", marker.display()))
        .env("IDEMQ_DATABASE_URL", url)
        .env("IDEMQ_WAKEUP_DATABASE_URL", direct)
        .env_remove("IDEMQ_KEY_SECRET")
        .stdout(Stdio::null())
        .stderr(Stdio::from(
            std::fs::File::create(work.path().join("worker.err")).expect("err"),
        ))
        .spawn()
        .expect("idemq worker");
    // Let its first (empty) claim and its LISTEN happen.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let woken = queue
        .enqueue(EnqueueRequest::new("bouncer.wake"))
        .await
        .expect("enqueue");
    let started = Instant::now();
    let mut state = None;
    while started.elapsed() < Duration::from_secs(20) {
        state = queue.get(&woken).await.expect("get").map(|j| j.state);
        if state == Some(idemq::JobState::Completed) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = worker.kill();
    let _ = worker.wait();
    assert_eq!(
        state,
        Some(idemq::JobState::Completed),
        "the worker was not woken: {}",
        std::fs::read_to_string(work.path().join("worker.err")).unwrap_or_default()
    );
    assert!(marker.exists());

    // A wake-up URL through transaction pooling never delivers: refused.
    let out = Command::new(env!("CARGO_BIN_EXE_idemq"))
        .args(["worker", "--exec", "true"])
        .env("IDEMQ_DATABASE_URL", url)
        .env("IDEMQ_WAKEUP_DATABASE_URL", bouncer.url(db))
        .env_remove("IDEMQ_KEY_SECRET")
        .output()
        .expect("idemq worker");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a worker started with a pooled wake-up URL"
    );
    assert!(err.contains("IDEMQ_WAKEUP_DATABASE_URL"), "{err}");
}
