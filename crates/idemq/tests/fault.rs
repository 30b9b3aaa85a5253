//! Fault tests with real processes: a worker process killed with SIGKILL in
//! the middle of a job, on SQLite and on PostgreSQL. Real time, real leases.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use idemq::worker::{HandlerContext, JobError, Worker};
use idemq::{EnqueueRequest, JobState, Queue};
use serde_json::Value;

const CHILD_ENV: &str = "IDEMQ_FAULT_CHILD_DATABASE";

/// Not a test of its own: the entry point of the worker process the tests
/// below start (this test binary, run again with `CHILD_ENV` set) and kill.
/// Ignored, so a normal run neither runs nor counts it; the child is
/// started with `--ignored`.
#[test]
#[ignore = "the entry point of a child process the other tests start"]
fn fault_child_worker_process() {
    let Ok(url) = std::env::var(CHILD_ENV) else {
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    rt.block_on(async move {
        let queue = Queue::connect(&url).await.expect("child connects");
        Worker::new(queue)
            .name("doomed-worker")
            .lease(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(100))
            .maintenance(false)
            .handle("slow", |_ctx: HandlerContext, _p: Value| async move {
                // Mid-job forever: the parent kills this process.
                tokio::time::sleep(Duration::from_secs(600)).await;
                Ok::<_, JobError>(())
            })
            .run(std::future::pending::<()>())
            .await
            .expect("child worker");
    });
}

fn spawn_child(url: &str) -> Child {
    Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "fault_child_worker_process",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, url)
        .spawn()
        .expect("start the worker process")
}

async fn wait_for(queue: &Queue, id: &str, state: JobState, within: Duration) {
    let start = Instant::now();
    loop {
        let job = queue.get(id).await.expect("get").expect("job");
        if job.state == state {
            return;
        }
        assert!(
            start.elapsed() < within,
            "job {id} is {} not {state} after {within:?}",
            job.state
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn sigkill_mid_job(url: &str) {
    let queue = Queue::connect(url).await.expect("connect");
    let id = queue
        .enqueue(EnqueueRequest::new("slow").max_attempts(3))
        .await
        .expect("enqueue");
    let mut child = spawn_child(url);
    wait_for(&queue, &id, JobState::Active, Duration::from_secs(60)).await;
    child.kill().expect("SIGKILL the worker");
    child.wait().expect("reap the worker");

    // Another worker takes over once the dead one's lease expires.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let survivor = Worker::new(queue.clone())
        .name("survivor")
        .lease(Duration::from_secs(5))
        .poll_interval(Duration::from_millis(100))
        .handle("slow", |_ctx: HandlerContext, _p: Value| async move {
            Ok::<_, JobError>("done")
        });
    let handle = tokio::spawn(survivor.run(async move {
        let _ = rx.await;
    }));
    wait_for(&queue, &id, JobState::Completed, Duration::from_secs(30)).await;
    let _ = tx.send(());
    let report = handle.await.expect("join").expect("survivor");
    assert_eq!(report.completed, 1);

    let job = queue.get(&id).await.unwrap().unwrap();
    assert_eq!((job.attempt, job.attempts_used), (2, 2));
    let runs = queue.runs(&id).await.unwrap();
    let seen: Vec<(i32, &str, Option<&str>)> = runs
        .iter()
        .map(|r| (r.attempt, r.worker.as_str(), r.outcome.as_deref()))
        .collect();
    assert_eq!(
        seen,
        vec![
            (1, "doomed-worker", Some("lease_expired")),
            (2, "survivor", Some("completed"))
        ]
    );
    let kinds: Vec<String> = queue
        .events(&id)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.kind)
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| *k == "completed").count(),
        1,
        "completed once in state"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_worker_killed_mid_job_is_rerun_by_another() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("fault.db").display());
    sigkill_mid_job(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_worker_killed_mid_job_is_rerun_by_another() {
    let (url, db) = idemq_testkit::pg_database();
    sigkill_mid_job(&url).await;
    idemq_testkit::drop_pg_database(&db);
}
