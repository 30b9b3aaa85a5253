//! A value a store cannot decode is a `Backend` error naming its column,
//! never a default. Each case writes a broken row with raw SQL, behind the
//! store's back, and reads it through the public `Queue`.
//!
//! The PostgreSQL cases use a database of their own on the server named by
//! `IDEMQ_TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`);
//! a missing server fails them. The Redis cases write raw values into the
//! hashes and lists of an installation of their own (a key prefix on the
//! test kit's durable redis-server); a missing `redis-server` fails them.

use idemq::{DedupeOptions, EnqueueRequest, Error, JobList, Queue};

/// The first page of every job.
fn page() -> JobList {
    JobList {
        limit: 100,
        ..JobList::default()
    }
}

/// The message of a `Backend` error; anything else fails the test.
fn backend_message<T: std::fmt::Debug>(r: idemq::Result<T>) -> String {
    match r {
        Err(Error::Backend { message }) => message,
        other => panic!("expected a Backend error, got {other:?}"),
    }
}

/// Asserts `r` is a `Backend` error naming `column` and showing `value`.
#[track_caller]
fn assert_names<T: std::fmt::Debug>(r: idemq::Result<T>, column: &str, value: &str) {
    let message = backend_message(r);
    assert!(
        message.contains(&format!("({column})")),
        "{message:?} does not name {column}"
    );
    assert!(
        message.contains(value),
        "{message:?} does not show {value:?}"
    );
}

mod sqlite {
    use super::*;

    struct Db {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        queue: Queue,
    }

    impl Db {
        async fn new() -> Self {
            let dir = tempfile::tempdir().expect("temp dir");
            let path = dir.path().join("strict.db");
            let queue = Queue::connect(&format!("sqlite://{}", path.display()))
                .await
                .expect("open sqlite");
            Self {
                _dir: dir,
                path,
                queue,
            }
        }

        /// Runs `sql` with `id` as `?1` on a connection of its own, past the
        /// schema's CHECK constraints (a broken row is the point).
        fn corrupt(&self, sql: &str, id: &str) {
            let conn = rusqlite::Connection::open(&self.path).expect("open raw");
            conn.busy_timeout(std::time::Duration::from_secs(5))
                .expect("busy timeout");
            conn.execute_batch("PRAGMA ignore_check_constraints = ON")
                .expect("pragma");
            conn.execute(sql, [id]).expect("corrupt");
        }
    }

    #[tokio::test]
    async fn an_unknown_state_is_an_error_naming_the_column() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt("UPDATE idemq_jobs SET state = 'zombie' WHERE id = ?1", &id);
        assert_names(db.queue.get(&id).await, "idemq_jobs.state", "\"zombie\"");
        assert_names(
            db.queue.list(page()).await,
            "idemq_jobs.state",
            "\"zombie\"",
        );
        let message = backend_message(db.queue.get(&id).await);
        assert!(message.contains(&id), "{message:?} does not name the job");
    }

    #[tokio::test]
    async fn a_corrupt_payload_is_an_error_naming_the_column() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(
            "UPDATE idemq_jobs SET payload = '{\"half\": ' WHERE id = ?1",
            &id,
        );
        assert_names(
            db.queue.get(&id).await,
            "idemq_jobs.payload",
            "{\\\"half\\\": ",
        );
    }

    #[tokio::test]
    async fn corrupt_tags_and_retry_are_errors_not_defaults() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt("UPDATE idemq_jobs SET tags = '[1, 2]' WHERE id = ?1", &id);
        assert_names(db.queue.get(&id).await, "idemq_jobs.tags", "[1, 2]");
        db.corrupt(
            "UPDATE idemq_jobs SET tags = '[]', retry = '{\"kind\": \"sometimes\"}' WHERE id = ?1",
            &id,
        );
        assert_names(db.queue.get(&id).await, "idemq_jobs.retry", "sometimes");
    }

    #[tokio::test]
    async fn an_instant_out_of_range_is_an_error_not_the_epoch() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(
            "UPDATE idemq_jobs SET created_at = 9223372036854775807 WHERE id = ?1",
            &id,
        );
        assert_names(
            db.queue.get(&id).await,
            "idemq_jobs.created_at",
            "9223372036854775807",
        );
    }

    #[tokio::test]
    async fn an_unknown_dedupe_mode_is_an_error_not_pending() {
        let db = Db::new().await;
        let id = db
            .queue
            .enqueue(EnqueueRequest::new("t").dedupe(DedupeOptions::key("k")))
            .await
            .unwrap();
        db.corrupt(
            "UPDATE idemq_jobs SET dedupe_mode = 'sometimes' WHERE id = ?1",
            &id,
        );
        assert_names(
            db.queue.get(&id).await,
            "idemq_jobs.dedupe_mode",
            "\"sometimes\"",
        );
        db.corrupt(
            "UPDATE idemq_jobs SET dedupe_mode = 'pending' WHERE id = ?1",
            &id,
        );
        db.corrupt(
            "UPDATE idemq_dedupe SET mode = 'sometimes' WHERE job_id = ?1",
            &id,
        );
        assert_names(
            db.queue.get(&id).await,
            "idemq_dedupe.mode",
            "\"sometimes\"",
        );
    }

    #[tokio::test]
    async fn a_null_where_a_value_must_be_is_an_error() {
        let db = Db::new().await;
        let key = "a-secret-key-of-the-caller";
        let id = db
            .queue
            .enqueue(EnqueueRequest::new("t").idempotency_key(key))
            .await
            .unwrap();
        db.corrupt(
            "UPDATE idemq_jobs SET idem_key_preview = NULL WHERE id = ?1",
            &id,
        );
        let message = backend_message(db.queue.get(&id).await);
        assert!(
            message.contains("(idemq_jobs.idem_key_preview)"),
            "{message:?}"
        );
        assert!(message.contains("NULL"), "{message:?}");
        assert!(!message.contains(key), "{message:?} shows the key");
    }

    #[tokio::test]
    async fn an_unknown_event_kind_and_run_outcome_are_errors() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(
            "INSERT INTO idemq_events (seq, job_id, kind, at, data)
             VALUES (1000000, ?1, 'teleported', 0, '{}')",
            &id,
        );
        assert_names(
            db.queue.events(&id).await,
            "idemq_events.kind",
            "\"teleported\"",
        );
        db.corrupt(
            "INSERT INTO idemq_runs (job_id, attempt, worker, started_at, finished_at, outcome)
             VALUES (?1, 1, 'w', 0, 1, 'vanished')",
            &id,
        );
        assert_names(
            db.queue.runs(&id).await,
            "idemq_runs.outcome",
            "\"vanished\"",
        );
    }
}

mod postgres {
    use super::*;
    use sqlx::Connection;

    fn server_url() -> String {
        std::env::var("IDEMQ_TEST_DATABASE_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
    }

    /// `url` with its database replaced by `name`.
    fn with_database(url: &str, name: &str) -> String {
        let (base, query) = match url.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (url, None),
        };
        let base = &base[..base.rfind('/').expect("a database in the URL")];
        match query {
            Some(q) => format!("{base}/{name}?{q}"),
            None => format!("{base}/{name}"),
        }
    }

    async fn admin(sql: &str) {
        let mut conn = sqlx::PgConnection::connect(&server_url())
            .await
            .expect("connect to PostgreSQL");
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
            .execute(&mut conn)
            .await
            .expect(sql);
    }

    /// A migrated database of this test's own, dropped at the end.
    struct Db {
        name: String,
        url: String,
        queue: Option<Queue>,
    }

    impl Db {
        async fn new() -> Self {
            let name = format!("idemq_t_strict_{}", uuid::Uuid::new_v4().simple());
            admin(&format!("CREATE DATABASE {name}")).await;
            let url = with_database(&server_url(), &name);
            Queue::migrate(&url).await.expect("migrate");
            let queue = Queue::connect(&url).await.expect("connect");
            Self {
                name,
                url,
                queue: Some(queue),
            }
        }

        fn queue(&self) -> &Queue {
            self.queue.as_ref().expect("open")
        }

        /// Runs `sql` with `id` as `$1`, past the schema's check of the
        /// state (a broken row is the point).
        async fn corrupt(&self, sql: &str, id: &str) {
            let mut conn = sqlx::PgConnection::connect(&self.url)
                .await
                .expect("connect raw");
            // The state's check is its domain's (schema version 14).
            sqlx::raw_sql("ALTER DOMAIN idemq.job_state DROP CONSTRAINT IF EXISTS job_state_known")
                .execute(&mut conn)
                .await
                .expect("drop check");
            sqlx::query(sqlx::AssertSqlSafe(sql.to_owned()))
                .bind(id)
                .execute(&mut conn)
                .await
                .expect("corrupt");
        }

        async fn drop(mut self) {
            self.queue.take();
            admin(&format!(
                "DROP DATABASE IF EXISTS {} WITH (FORCE)",
                self.name
            ))
            .await;
        }
    }

    #[tokio::test]
    async fn an_unknown_state_is_an_error_naming_the_column() {
        let db = Db::new().await;
        let id = db.queue().enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt("UPDATE idemq.jobs SET state = 'zombie' WHERE id = $1", &id)
            .await;
        assert_names(db.queue().get(&id).await, "idemq.jobs.state", "\"zombie\"");
        assert_names(
            db.queue().list(page()).await,
            "idemq.jobs.state",
            "\"zombie\"",
        );
        db.drop().await;
    }

    #[tokio::test]
    async fn a_corrupt_retry_policy_is_an_error_not_the_default() {
        let db = Db::new().await;
        let id = db.queue().enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(
            "UPDATE idemq.jobs SET retry = '{\"kind\": \"sometimes\"}' WHERE id = $1",
            &id,
        )
        .await;
        assert_names(db.queue().get(&id).await, "idemq.jobs.retry", "sometimes");
        db.drop().await;
    }

    #[tokio::test]
    async fn an_unknown_run_outcome_and_event_kind_are_errors() {
        let db = Db::new().await;
        let id = db.queue().enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(
            "INSERT INTO idemq.runs (job_id, attempt, worker, started_at, finished_at, outcome)
             VALUES ($1, 1, 'w', now(), now(), 'vanished')",
            &id,
        )
        .await;
        assert_names(
            db.queue().runs(&id).await,
            "idemq.runs.outcome",
            "\"vanished\"",
        );
        db.corrupt(
            "INSERT INTO idemq.events (job_id, kind, at) VALUES ($1, 'teleported', now())",
            &id,
        )
        .await;
        assert_names(
            db.queue().events(&id).await,
            "idemq.events.kind",
            "\"teleported\"",
        );
        db.drop().await;
    }

    #[tokio::test]
    async fn an_unknown_dedupe_mode_is_an_error_not_pending() {
        let db = Db::new().await;
        let id = db
            .queue()
            .enqueue(EnqueueRequest::new("t").dedupe(DedupeOptions::key("k")))
            .await
            .unwrap();
        db.corrupt(
            "UPDATE idemq.dedupe SET mode = 'sometimes' WHERE job_id = $1",
            &id,
        )
        .await;
        assert_names(
            db.queue().get(&id).await,
            "idemq.dedupe.mode",
            "\"sometimes\"",
        );
        db.drop().await;
    }
}

mod redis {
    use super::*;
    use idemq_testkit::{redis_command, redis_url};

    /// A migrated installation under a key prefix of its own.
    struct Db {
        url: String,
        prefix: String,
        queue: Queue,
    }

    impl Db {
        async fn new() -> Self {
            let (url, prefix) = redis_url();
            Queue::migrate(&url).await.expect("migrate");
            let queue = Queue::connect(&url).await.expect("connect");
            Self { url, prefix, queue }
        }

        /// Runs one raw command, with the installation's prefix put before
        /// its second argument (the key).
        async fn raw(&self, args: &[&str]) {
            let key = format!("{}{}", self.prefix, args[1]);
            let mut all = vec![args[0], key.as_str()];
            all.extend_from_slice(&args[2..]);
            redis_command(&self.url, &all).await.expect("raw command");
        }

        /// Sets `field` of job `id`'s hash to `value`, behind the store's back.
        async fn corrupt(&self, id: &str, field: &str, value: &str) {
            self.raw(&["HSET", &format!("job:{id}"), field, value])
                .await;
        }

        /// The one key of the installation matching `pattern` (after the prefix).
        async fn key(&self, pattern: &str) -> String {
            let found = redis_command(&self.url, &["KEYS", &format!("{}{pattern}", self.prefix)])
                .await
                .expect("KEYS");
            let ::redis::Value::Array(keys) = found else {
                panic!("KEYS answered {found:?}");
            };
            let [::redis::Value::BulkString(key)] = keys.as_slice() else {
                panic!("{pattern}: {keys:?}");
            };
            let key = String::from_utf8(key.clone()).expect("UTF-8 key");
            key[self.prefix.len()..].to_owned()
        }
    }

    #[tokio::test]
    async fn an_unknown_state_is_an_error_naming_the_field() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(&id, "state", "zombie").await;
        assert_names(db.queue.get(&id).await, "job.state", "\"zombie\"");
        assert_names(db.queue.list(page()).await, "job.state", "\"zombie\"");
        let message = backend_message(db.queue.get(&id).await);
        assert!(message.contains(&id), "{message:?} does not name the job");
        // `scheduled` and `ready` are derived, never stored.
        db.corrupt(&id, "state", "ready").await;
        assert_names(db.queue.get(&id).await, "job.state", "\"ready\"");
    }

    #[tokio::test]
    async fn an_unknown_dedupe_mode_is_an_error_not_pending() {
        let db = Db::new().await;
        let id = db
            .queue
            .enqueue(EnqueueRequest::new("t").dedupe(DedupeOptions::key("k")))
            .await
            .unwrap();
        db.corrupt(&id, "dedupe_mode", "sometimes").await;
        assert_names(db.queue.get(&id).await, "job.dedupe_mode", "\"sometimes\"");
        assert_names(
            db.queue.events(&id).await,
            "job.dedupe_mode",
            "\"sometimes\"",
        );
        // The job's own mode restored, the binding's broken instead.
        db.corrupt(&id, "dedupe_mode", "pending").await;
        db.raw(&["HSET", "dd:t|k", "mode", "sometimes"]).await;
        assert_names(db.queue.get(&id).await, "dd.mode", "\"sometimes\"");
    }

    #[tokio::test]
    async fn a_corrupt_payload_is_an_error_naming_the_field() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(&id, "payload", "{\"half\": ").await;
        assert_names(db.queue.get(&id).await, "job.payload", "{\\\"half\\\": ");
        assert_names(db.queue.list(page()).await, "job.payload", "half");
        db.corrupt(&id, "payload", "{}").await;
        db.corrupt(&id, "retry", "{\"kind\": \"sometimes\"}").await;
        assert_names(db.queue.get(&id).await, "job.retry", "sometimes");
    }

    #[tokio::test]
    async fn a_non_integer_timestamp_is_an_error_not_the_epoch() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.corrupt(&id, "created_at", "soon").await;
        assert_names(db.queue.get(&id).await, "job.created_at", "\"soon\"");
        assert_names(db.queue.list(page()).await, "job.created_at", "\"soon\"");
        assert_names(db.queue.events(&id).await, "job.created_at", "\"soon\"");
        db.corrupt(&id, "created_at", "9223372036854775807").await;
        assert_names(
            db.queue.get(&id).await,
            "job.created_at",
            "9223372036854775807",
        );
    }

    #[tokio::test]
    async fn a_corrupt_fingerprint_is_an_error_that_shows_no_key_or_payload() {
        let db = Db::new().await;
        let secret = "a-secret-key-of-the-caller";
        let payload = serde_json::json!({ "card": "4111-1111" });
        let req = || {
            EnqueueRequest::new("t")
                .job_id("fixed")
                .payload(payload.clone())
        };
        db.queue.enqueue(req()).await.unwrap();
        // Too short, then the right length but not hex: a conflict check
        // against either is an error, never a conflict on every field.
        for broken in ["abc".to_owned(), "z".repeat(13 * 32)] {
            db.corrupt("fixed", "fingerprint", &broken).await;
            let message = backend_message(
                db.queue
                    .enqueue(req().payload(serde_json::json!({ "card": "other" })))
                    .await,
            );
            assert!(message.contains("(job.fingerprint)"), "{message:?}");
            assert!(message.contains("job fixed"), "{message:?}");
            assert!(!message.contains(&broken), "{message:?} shows the value");
            assert!(!message.contains("4111"), "{message:?} shows the payload");
        }
        // An idempotency binding's fingerprint.
        let id = db
            .queue
            .enqueue(
                EnqueueRequest::new("t")
                    .idempotency_key(secret)
                    .payload(payload.clone()),
            )
            .await
            .unwrap();
        let binding = db.key("idem:*").await;
        db.raw(&["HSET", &binding, "fp", "0123"]).await;
        let message = backend_message(
            db.queue
                .enqueue(EnqueueRequest::new("t").idempotency_key(secret))
                .await,
        );
        assert!(message.contains("(idem.fp)"), "{message:?}");
        assert!(message.contains(&id), "{message:?} does not name the job");
        assert!(!message.contains(secret), "{message:?} shows the key");
        assert!(!message.contains("4111"), "{message:?} shows the payload");
    }

    #[tokio::test]
    async fn an_unknown_event_kind_and_run_outcome_are_errors() {
        let db = Db::new().await;
        let id = db.queue.enqueue(EnqueueRequest::new("t")).await.unwrap();
        db.raw(&["RPUSH", &format!("ev:{id}"), "1000000 0 teleported {}"])
            .await;
        assert_names(db.queue.events(&id).await, "ev.kind", "\"teleported\"");
        db.raw(&[
            "RPUSH",
            &format!("runs:{id}"),
            r#"{"attempt":1,"worker":"w","started_at":0,"finished_at":1,"outcome":"vanished","error":null}"#,
        ])
        .await;
        assert_names(db.queue.runs(&id).await, "runs.outcome", "\"vanished\"");
    }
}
