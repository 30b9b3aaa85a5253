//! The failures Redis queues are known for, one case each, on a real
//! redis-server that the cases SIGKILL and restart: jobs stuck active
//! after a crash, dedupe keys outliving or mis-releasing their job,
//! workers that stop consuming after a Redis restart, delayed jobs late
//! after a reconnect, and a CPU-bound handler losing its lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{ClaimOptions, DedupeOptions, EnqueueRequest, Error, JobState, Outcome, Queue};
use serde_json::{Value, json};

use idemq_testkit::ledger::{Ledger, all_jobs, counts, retry, wait_completed};

use crate::server::{RedisServer, queue};
use crate::spawn_child;

/// A worker in this process whose handlers answer at once; stopped by the
/// returned sender.
fn worker(
    queue: Queue,
    name: &str,
    job_type: &str,
) -> (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<idemq::Result<idemq::worker::WorkerReport>>,
) {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let w = Worker::new(queue)
        .name(name)
        .lease(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(100))
        .concurrency(4)
        .handle(job_type, |ctx: HandlerContext, _p: Value| async move {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok::<_, JobError>(json!({ "by": ctx.job_id() }))
        });
    let handle = tokio::spawn(w.run(async move {
        let _ = rx.await;
    }));
    (tx, handle)
}

async fn state(queue: &Queue, id: &str) -> Option<JobState> {
    retry(|| queue.get(id)).await.expect("get").map(|j| j.state)
}

/// A worker process dies holding three jobs, and Redis dies too: the jobs
/// stay active (nothing moves them by itself), and once their leases
/// expire a live worker's maintenance reaps them and they run again, the
/// lost attempts recorded as `lease_expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_jobs_left_active_by_a_crash_come_back_after_their_lease() {
    let mut server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let mut ids = Vec::new();
    for n in 0..3 {
        ids.push(
            queue
                .enqueue(EnqueueRequest::new("stuck.work").payload(json!(n)))
                .await
                .expect("enqueue"),
        );
    }
    let mut child = spawn_child(&server.url(), "crashed");
    let start = Instant::now();
    while counts(&queue).await.1 < 3 {
        assert!(start.elapsed() < Duration::from_secs(15), "not claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    child.kill().expect("SIGKILL the worker");
    child.wait().expect("reap the worker");
    server.kill9();
    server.restart();
    server.assert_durable().await;
    for id in &ids {
        assert_eq!(state(&queue, id).await, Some(JobState::Active), "{id}");
    }

    let (stop, handle) = worker(queue.clone(), "survivor", "stuck.work");
    wait_completed(&queue, 3, Duration::from_secs(15)).await;
    let _ = stop.send(());
    handle.await.expect("join").expect("survivor");
    for id in &ids {
        let job = retry(|| queue.get(id)).await.expect("get").expect("job");
        let l = Ledger::of(&queue, id).await;
        assert_eq!(l.problems(&job), None);
        assert_eq!(l.expired_by, vec!["crashed".to_owned()], "{id}");
    }
}

/// Dedupe bindings across SIGKILLs of Redis: a pending key survives the
/// crash (no second job), is free once its job completed (it does not
/// outlive the job), and a newer job's key is not freed by the cancel or
/// purge of an older job of the same key (no mis-release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dedupe_keys_neither_outlive_nor_mis_release_their_job() {
    let mut server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let enqueue = |req: EnqueueRequest| {
        let queue = queue.clone();
        async move {
            retry(|| queue.enqueue_with_result(req.clone()))
                .await
                .expect("enqueue")
        }
    };
    let pending = || EnqueueRequest::new("sync").dedupe(DedupeOptions::key("acct-1"));

    let a = enqueue(pending()).await;
    assert_eq!(a.outcome, Outcome::Accepted);
    server.kill9();
    server.restart();
    server.assert_durable().await;
    let again = enqueue(pending()).await;
    assert_eq!(
        (again.outcome, again.job_id.as_str()),
        (Outcome::Coalesced, a.job_id.as_str()),
        "the binding survived the crash"
    );
    let claimed = retry(|| {
        queue.claim(ClaimOptions {
            worker: "w".into(),
            ..ClaimOptions::default()
        })
    })
    .await
    .expect("claim");
    assert_eq!(claimed.len(), 1);
    retry(|| queue.complete(&claimed[0].id, &claimed[0].lease_token, None))
        .await
        .expect("complete");
    server.kill9();
    server.restart();
    server.assert_durable().await;
    let b = enqueue(pending()).await;
    assert_eq!(b.outcome, Outcome::Accepted, "the key outlived its job");
    assert_ne!(b.job_id, a.job_id);

    // A throttle window ends while its job still waits; a newer job takes
    // the key; the old job's cancel and purge leave the new binding alone.
    let throttle = || {
        EnqueueRequest::new("report").dedupe(DedupeOptions::key("day").ttl(Duration::from_secs(1)))
    };
    let old = enqueue(throttle()).await;
    assert_eq!(old.outcome, Outcome::Accepted);
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let new = enqueue(throttle()).await;
    assert_eq!(new.outcome, Outcome::Accepted);
    assert_ne!(new.job_id, old.job_id);
    server.kill9();
    server.restart();
    server.assert_durable().await;
    retry(|| queue.cancel(&old.job_id)).await.expect("cancel");
    assert_eq!(state(&queue, &old.job_id).await, Some(JobState::Cancelled));
    let c = enqueue(throttle()).await;
    assert_eq!(
        (c.outcome, c.job_id.as_str()),
        (Outcome::Coalesced, new.job_id.as_str()),
        "the old job's cancel released the new job's key"
    );
    assert!(retry(|| queue.purge(&old.job_id)).await.expect("purge"));
    let live = retry(|| queue.dedupe_lookup("report", "day"))
        .await
        .expect("lookup")
        .expect("live binding");
    assert_eq!(live.job_id, new.job_id, "the old job's purge moved the key");
    // Its own job's cancel does free it.
    retry(|| queue.cancel(&new.job_id)).await.expect("cancel");
    assert_eq!(enqueue(throttle()).await.outcome, Outcome::Accepted);
}

/// A running `Worker` keeps draining across two SIGKILLs of redis-server,
/// each landing mid-batch: it reconnects by itself, and every job of the
/// three batches completes once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_running_worker_keeps_draining_after_redis_restarts() {
    let mut server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let worker_queue = Queue::connect(&server.url()).await.expect("connect");
    let (stop, handle) = worker(worker_queue, "steady", "restart.work");
    const BATCH: u64 = 60;
    for round in 0..3u64 {
        for n in 0..BATCH {
            let req = EnqueueRequest::new("restart.work")
                .payload(json!(n))
                .idempotency_key(format!("r{round}-{n}"));
            retry(|| queue.enqueue(req.clone())).await.expect("enqueue");
        }
        if round < 2 {
            wait_completed(&queue, BATCH * round + BATCH / 3, Duration::from_secs(20)).await;
            server.kill9();
            tokio::time::sleep(Duration::from_millis(200)).await;
            server.restart();
            server.assert_durable().await;
        }
        wait_completed(&queue, BATCH * (round + 1), Duration::from_secs(20)).await;
    }
    assert!(!handle.is_finished(), "the worker stopped by itself");
    let _ = stop.send(());
    handle.await.expect("join").expect("worker");
    let jobs = all_jobs(&queue).await;
    assert_eq!(jobs.len() as u64, 3 * BATCH);
    let mut bad = Vec::new();
    for job in &jobs {
        bad.extend(Ledger::of(&queue, &job.id).await.problems(job));
    }
    assert!(bad.is_empty(), "{bad:?}");
}

/// Delayed jobs enqueued before a SIGKILL of redis-server run on time
/// after it restarts: not before their `run_at`, and within two seconds
/// after it (the worker polls every 100 ms; a Redis queue that moves
/// delayed jobs only on some later event would be late without bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_delayed_jobs_run_on_time_after_a_restart() {
    let mut server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let worker_queue = Queue::connect(&server.url()).await.expect("connect");
    let (stop, handle) = worker(worker_queue, "punctual", "delayed.work");
    let mut ids = Vec::new();
    for (n, ms) in [1_500u64, 2_000, 2_500, 3_000].into_iter().enumerate() {
        let req = EnqueueRequest::new("delayed.work")
            .payload(json!(n))
            .delay(Duration::from_millis(ms));
        ids.push(queue.enqueue(req).await.expect("enqueue"));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.kill9();
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.restart();
    server.assert_durable().await;
    wait_completed(&queue, 4, Duration::from_secs(15)).await;
    let _ = stop.send(());
    handle.await.expect("join").expect("worker");
    for id in &ids {
        let job = retry(|| queue.get(id)).await.expect("get").expect("job");
        let runs = retry(|| queue.runs(id)).await.expect("runs");
        assert_eq!(runs.len(), 1, "{id}: {runs:?}");
        let late = runs[0].started_at - job.run_at;
        println!("redis_delayed: {id} claimed {late} after its run_at");
        assert!(late >= chrono::Duration::zero(), "{id} ran early: {late}");
        assert!(
            late <= chrono::Duration::seconds(2),
            "{id} ran {late} after its run_at"
        );
    }
}

/// A handler that keeps its thread busy (no await) for 4 s under a 1 s
/// lease, on a worker whose runtime has that one thread: its heartbeats
/// cannot run, the lease expires, another worker's maintenance reaps it
/// and that worker runs the job. The busy handler's completion is refused
/// (`LeaseLost`; counted lost), and the job's result is recorded once,
/// the second worker's. A bare claim that outlives its lease the same way
/// gets `LeaseLost` from `complete`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_cpu_bound_handler_that_outlives_its_lease_cannot_complete() {
    let server = RedisServer::start();
    server.assert_durable().await;
    let queue = queue(&server).await;
    let id = queue
        .enqueue(EnqueueRequest::new("cpu.work"))
        .await
        .expect("enqueue");

    let returned = Arc::new(AtomicBool::new(false));
    let (stop_busy, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let busy = {
        let (url, returned) = (server.url(), returned.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let queue = Queue::connect(&url).await.expect("connect");
                Worker::new(queue)
                    .name("busy")
                    .lease(Duration::from_secs(1))
                    .poll_interval(Duration::from_millis(100))
                    .maintenance(false)
                    .handle("cpu.work", move |_ctx: HandlerContext, _p: Value| {
                        let returned = returned.clone();
                        async move {
                            // CPU-bound work: the thread never yields.
                            std::thread::sleep(Duration::from_secs(4));
                            returned.store(true, Ordering::SeqCst);
                            Ok::<_, JobError>(json!({ "by": "busy" }))
                        }
                    })
                    .run(async move {
                        let _ = stop_rx.await;
                    })
                    .await
            })
        })
    };
    let start = Instant::now();
    while state(&queue, &id).await != Some(JobState::Active) {
        assert!(start.elapsed() < Duration::from_secs(10), "not claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let second = Worker::new(queue.clone())
        .name("second")
        .lease(Duration::from_secs(5))
        .poll_interval(Duration::from_millis(100))
        .handle("cpu.work", |_ctx: HandlerContext, _p: Value| async move {
            Ok::<_, JobError>(json!({ "by": "second" }))
        });
    let second = tokio::spawn(second.run(async move {
        let _ = rx.await;
    }));
    wait_completed(&queue, 1, Duration::from_secs(10)).await;
    let start = Instant::now();
    while !returned.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "busy never returned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Let the busy worker try to record its result.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = stop_busy.send(());
    let busy = busy.join().expect("busy thread").expect("busy worker");
    assert_eq!(busy.completed, 0, "{busy:?}");
    assert_eq!(busy.lost, 1, "{busy:?}");

    let job = queue.get(&id).await.expect("get").expect("job");
    assert_eq!(job.state, JobState::Completed);
    assert_eq!(job.result, Some(json!({ "by": "second" })));
    let l = Ledger::of(&queue, &id).await;
    assert_eq!(l.problems(&job), None);
    assert_eq!(l.expired_by, vec!["busy".to_owned()]);

    // The same with a bare claim: complete after the lease was reaped and
    // the job rerun is LeaseLost, and changes nothing.
    let id2 = queue
        .enqueue(EnqueueRequest::new("cpu.bare"))
        .await
        .expect("enqueue");
    let claimed = queue
        .claim(ClaimOptions {
            worker: "bare".into(),
            lease: Duration::from_secs(1),
            ..ClaimOptions::default()
        })
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    std::thread::sleep(Duration::from_millis(1_200));
    let (stop_bare, rx) = tokio::sync::oneshot::channel::<()>();
    let rerun = Worker::new(queue.clone())
        .name("rerun")
        .poll_interval(Duration::from_millis(100))
        .handle("cpu.bare", |_ctx: HandlerContext, _p: Value| async move {
            Ok::<_, JobError>(json!({ "by": "rerun" }))
        });
    let rerun = tokio::spawn(rerun.run(async move {
        let _ = rx.await;
    }));
    wait_completed(&queue, 2, Duration::from_secs(10)).await;
    let err = queue
        .complete(&id2, &claimed[0].lease_token, Some(json!({ "by": "bare" })))
        .await
        .expect_err("a lost lease");
    assert!(matches!(err, Error::LeaseLost { .. }), "{err:?}");
    let job2 = queue.get(&id2).await.expect("get").expect("job");
    assert_eq!(job2.result, Some(json!({ "by": "rerun" })));
    let l = Ledger::of(&queue, &id2).await;
    assert_eq!(l.problems(&job2), None);
    assert_eq!(l.expired_by, vec!["bare".to_owned()]);

    let _ = tx.send(());
    let _ = stop_bare.send(());
    second.await.expect("join").expect("second");
    rerun.await.expect("join").expect("rerun");
}
