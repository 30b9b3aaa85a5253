//! The harness every conformance case receives: a queue on a fresh database
//! of one backend, and a handle on that backend's clock of record.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use idemq::store::postgres::{PgOptions, PgStore};
use idemq::store::redis::{RedisOptions, RedisStore};
use idemq::{ClaimOptions, ClaimedJob, EnqueueRequest, JobList, ManualClock, Queue, QueueOptions};

use crate::postgres::{drop_pg_database, pg_database};

/// The instant every case starts at.
pub fn epoch() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0)
        .single()
        .expect("valid date")
}

/// How a case moves the clock of record of its backend.
enum Clock {
    Manual(Arc<ManualClock>),
    /// PostgreSQL's frozen test clock, and the instant it stands at.
    Postgres(PgStore, Mutex<DateTime<Utc>>),
    /// The test clock key of a Redis installation, and the instant it
    /// stands at.
    Redis(RedisStore, Mutex<DateTime<Utc>>),
}

/// A fresh database and the means to move its clock.
pub struct Harness {
    /// The queue under test.
    pub queue: Queue,
    /// The backend's name, as [`for_each_backend!`](crate::for_each_backend) lists it.
    pub backend: &'static str,
    clock: Clock,
    /// The SQLite database file, for cases that inspect the bytes at rest.
    pub db_file: Option<PathBuf>,
    /// The PostgreSQL database's URL.
    pub db_url: Option<String>,
    /// The Redis installation's URL (its key prefix in `?prefix=`).
    pub redis_url: Option<String>,
    /// The key prefix of the Redis installation.
    pub redis_prefix: Option<String>,
    _dir: Option<tempfile::TempDir>,
    drop_db: Option<String>,
}

impl Harness {
    /// A fresh database on the backend of this name, one of those
    /// [`for_each_backend!`](crate::for_each_backend) lists.
    ///
    /// # Panics
    ///
    /// On a name it does not know: a backend added to the list needs its
    /// constructor here too.
    pub async fn for_backend(backend: &str) -> Self {
        match backend {
            "sqlite" => Self::sqlite().await,
            "postgres" => Self::postgres().await,
            "redis" => Self::redis().await,
            other => panic!(
                "no harness for backend {other:?}: add its constructor to Harness::for_backend"
            ),
        }
    }

    /// A new SQLite database file in a temporary directory.
    pub async fn sqlite() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("idemq.db");
        let clock = Arc::new(ManualClock::new(epoch()));
        let options = QueueOptions {
            clock: clock.clone(),
            ..QueueOptions::default()
        };
        // The store is opened without the key check, as on PostgreSQL, so a
        // case sees a fresh installation (no hashing recorded yet).
        let store = idemq::store::sqlite::SqliteStore::open(Some(&path), clock.clone())
            .expect("open sqlite");
        let queue = Queue::from_store(Arc::new(store), options);
        Self {
            queue,
            backend: "sqlite",
            clock: Clock::Manual(clock),
            db_file: Some(path),
            db_url: None,
            redis_url: None,
            redis_prefix: None,
            _dir: Some(dir),
            drop_db: None,
        }
    }

    /// A new PostgreSQL database cloned from the migrated template.
    pub async fn postgres() -> Self {
        let (url, db) = pg_database();
        let store = PgStore::connect(
            &url,
            PgOptions {
                max_connections: 8,
                test_clock: Some(uuid::Uuid::new_v4().simple().to_string()),
                ..PgOptions::default()
            },
        )
        .await
        .expect("connect to the test database");
        store
            .set_test_clock(Some(epoch()))
            .await
            .expect("freeze the clock");
        let queue = Queue::from_store(Arc::new(store.clone()), QueueOptions::default());
        Self {
            queue,
            backend: "postgres",
            clock: Clock::Postgres(store, Mutex::new(epoch())),
            db_file: None,
            db_url: Some(url),
            redis_url: None,
            redis_prefix: None,
            _dir: None,
            drop_db: Some(db),
        }
    }

    /// A new Redis installation: a fresh key prefix on the test process's
    /// durable redis-server ([`redis_url`](crate::redis_url)), migrated, its
    /// clock frozen at [`epoch`].
    pub async fn redis() -> Self {
        let (url, prefix) = crate::redis_url();
        idemq::store::redis::migrate(&url)
            .await
            .expect("migrate the Redis installation");
        let store = redis_store(&url).await;
        store
            .set_test_clock(Some(epoch()))
            .await
            .expect("freeze the clock");
        let queue = Queue::from_store(Arc::new(store.clone()), QueueOptions::default());
        Self {
            queue,
            backend: "redis",
            clock: Clock::Redis(store, Mutex::new(epoch())),
            db_file: None,
            db_url: None,
            redis_url: Some(url),
            redis_prefix: Some(prefix),
            _dir: None,
            drop_db: None,
        }
    }

    /// A second queue on the same database over its own connections (its
    /// own pool on PostgreSQL, its own writer on SQLite), sharing the clock:
    /// for races between clients.
    pub async fn another_queue(&self) -> Queue {
        match &self.clock {
            Clock::Manual(clock) => {
                let path = self.db_file.as_ref().expect("sqlite file");
                let options = QueueOptions {
                    clock: clock.clone(),
                    ..QueueOptions::default()
                };
                Queue::connect_with(&format!("sqlite://{}", path.display()), options)
                    .await
                    .expect("open sqlite again")
            }
            Clock::Postgres(store, _) => {
                let url = self.db_url.as_ref().expect("postgres url");
                let options = PgOptions {
                    max_connections: 4,
                    test_clock: store.test_clock().map(str::to_owned),
                    ..PgOptions::default()
                };
                let store = PgStore::connect(url, options).await.expect("connect again");
                Queue::from_store(Arc::new(store), QueueOptions::default())
            }
            Clock::Redis(..) => {
                let url = self.redis_url.as_ref().expect("redis url");
                Queue::from_store(Arc::new(redis_store(url).await), QueueOptions::default())
            }
        }
    }

    /// Moves the clock of record forward.
    pub fn advance(&self, by: Duration) {
        let step = chrono::Duration::from_std(by).expect("duration");
        let next = |at: &Mutex<DateTime<Utc>>| {
            let mut at = at.lock().expect("clock");
            *at += step;
            *at
        };
        match &self.clock {
            Clock::Manual(c) => c.advance(by),
            Clock::Postgres(store, at) => {
                let (store, next) = (store.clone(), next(at));
                tokio::task::block_in_place(|| {
                    tokio::runtime::Handle::current()
                        .block_on(store.set_test_clock(Some(next)))
                        .expect("move the clock")
                });
            }
            Clock::Redis(store, at) => {
                let (store, next) = (store.clone(), next(at));
                tokio::task::block_in_place(|| {
                    tokio::runtime::Handle::current()
                        .block_on(store.set_test_clock(Some(next)))
                        .expect("move the clock")
                });
            }
        }
    }

    /// Moves the clock of record forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance(Duration::from_millis(ms));
    }

    /// The clock of record.
    pub async fn now(&self) -> DateTime<Utc> {
        self.queue.store().now().await.expect("now")
    }

    /// Every job (up to 1,000), newest first.
    pub async fn jobs(&self) -> Vec<idemq::Job> {
        self.queue
            .list(JobList {
                limit: 1000,
                ..JobList::default()
            })
            .await
            .expect("list")
            .jobs
    }

    /// Another fresh database on the same backend as `other`.
    pub async fn fresh_like(other: &Harness) -> Self {
        Self::for_backend(other.backend).await
    }

    /// (jobs, events) in the whole database.
    pub async fn totals(&self) -> (usize, usize) {
        let jobs = self.jobs().await;
        let mut events = 0;
        for j in &jobs {
            events += self.queue.events(&j.id).await.expect("events").len();
        }
        (jobs.len(), events)
    }

    /// The kinds of a job's events, oldest first.
    pub async fn event_kinds(&self, job_id: &str) -> Vec<String> {
        self.queue
            .events(job_id)
            .await
            .expect("events")
            .into_iter()
            .map(|e| e.kind)
            .collect()
    }

    /// Enqueues and unwraps the job id.
    pub async fn put(&self, req: EnqueueRequest) -> String {
        self.queue.enqueue(req).await.expect("enqueue")
    }

    /// `n` copies of `req` whose deadline has passed, and which no claim has
    /// seen yet: enqueued in batches of 1,000 with a deadline 10 s away,
    /// then the clock of record moved on 15 s.
    pub async fn put_past_deadline(&self, req: EnqueueRequest, n: usize) {
        let deadline = self.now().await + chrono::TimeDelta::seconds(10);
        let mut left = n;
        while left > 0 {
            let batch = left.min(1000);
            let reqs = (0..batch).map(|_| req.clone().deadline(deadline)).collect();
            for r in self
                .queue
                .enqueue_many(reqs, idemq::BatchOptions::default())
                .await
                .expect("batch")
            {
                r.expect("item");
            }
            left -= batch;
        }
        self.advance(Duration::from_secs(15));
    }

    /// Claims up to `limit` jobs from every queue with a 30 s lease.
    pub async fn claim(&self, limit: u32) -> Vec<ClaimedJob> {
        self.claim_with(ClaimOptions {
            limit,
            worker: "w-1".into(),
            ..ClaimOptions::default()
        })
        .await
    }

    /// Claims with options.
    pub async fn claim_with(&self, options: ClaimOptions) -> Vec<ClaimedJob> {
        self.queue.claim(options).await.expect("claim")
    }

    /// Claims exactly one job and returns it.
    pub async fn claim_one(&self) -> ClaimedJob {
        let mut jobs = self.claim(1).await;
        assert_eq!(jobs.len(), 1, "expected one claimable job");
        jobs.remove(0)
    }

    /// The job, which must exist.
    pub async fn job(&self, id: &str) -> idemq::Job {
        self.queue.get(id).await.expect("get").expect("job exists")
    }

    /// A pool of the caller's own on the PostgreSQL database, whose sessions
    /// read the case's test clock like the queue's (a session without it
    /// reads the real clock).
    pub async fn caller_pool(&self) -> sqlx::PgPool {
        let Clock::Postgres(store, _) = &self.clock else {
            panic!("caller_pool is for PostgreSQL cases");
        };
        let url = self.db_url.as_deref().expect("postgres url");
        let options: sqlx::postgres::PgConnectOptions = url.parse().expect("url");
        let options =
            options.options([("idemq.test_clock", store.test_clock().expect("clock id"))]);
        sqlx::PgPool::connect_with(options).await.expect("pool")
    }
}

/// A store on the Redis installation `url` that reads the installation's
/// test clock.
async fn redis_store(url: &str) -> RedisStore {
    RedisStore::connect(url, RedisOptions { test_clock: true })
        .await
        .expect("connect to the Redis installation")
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(db) = self.drop_db.take() {
            // The case's pool may still hold connections: FORCE ends them.
            drop_pg_database(&db);
        }
    }
}
