//! A server on a fresh database, and a small HTTP client for it.

use std::time::Duration;

use std::sync::Arc;

use idemq::store::Store;
use idemq::{Queue, QueueOptions};
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, StatusCode};
use serde_json::Value;

/// Which backend a case runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    Redis,
}

impl Backend {
    /// The backend of this name in the test kit's list of backends.
    pub fn named(name: &str) -> Self {
        match name {
            "sqlite" => Self::Sqlite,
            "postgres" => Self::Postgres,
            "redis" => Self::Redis,
            other => panic!("the API tests have no server for backend {other:?}"),
        }
    }
}

/// An answer: status, headers and the body (JSON when it parses, else a string).
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub text: String,
    pub body: Value,
}

impl Answer {
    /// Asserts a problem document of `name` with `status`.
    #[track_caller]
    pub fn problem(&self, status: u16, name: &str) -> &Value {
        assert_eq!(self.status.as_u16(), status, "{}", self.text);
        assert_eq!(
            self.headers
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/problem+json"),
            "{}",
            self.text
        );
        assert_eq!(
            self.body["type"],
            format!("/problems/{name}"),
            "{}",
            self.text
        );
        assert_eq!(self.body["status"], status);
        assert!(self.body["title"].is_string());
        assert!(self.body["detail"].is_string());
        &self.body
    }

    /// Asserts `status` and returns the body.
    #[track_caller]
    pub fn ok(&self, status: u16) -> &Value {
        assert_eq!(self.status.as_u16(), status, "{}", self.text);
        &self.body
    }
}

/// Makes the store a server runs over of the backend's.
type Wrap = Box<dyn FnOnce(Arc<dyn Store>) -> Arc<dyn Store>>;

/// A running server.
pub struct Server {
    pub base: String,
    pub client: reqwest::Client,
    pub queue: Queue,
    token: Option<String>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    pub pg_db: Option<String>,
    pub db_file: Option<std::path::PathBuf>,
    /// The Redis installation's URL.
    pub redis_url: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    /// A server without a token.
    pub async fn start(backend: Backend) -> Self {
        Self::start_with(backend, None).await
    }

    /// A server, with a token if given.
    pub async fn start_with(backend: Backend, token: Option<&str>) -> Self {
        Self::start_with_options(
            backend,
            idemq_server::ServerOptions {
                token: token.map(str::to_owned),
                ..Default::default()
            },
        )
        .await
    }

    /// A server with these options.
    pub async fn start_with_options(
        backend: Backend,
        options: idemq_server::ServerOptions,
    ) -> Self {
        let redis_url = (backend == Backend::Redis).then(|| idemq_testkit::redis_url().0);
        Self::start_on(backend, redis_url, options).await
    }

    /// A server on a Redis installation of the caller's (`url`, not yet
    /// migrated), without a token.
    pub async fn start_on_redis(url: String) -> Self {
        Self::start_on(Backend::Redis, Some(url), Default::default()).await
    }

    /// A server without a token whose queue (the server's and `queue`)
    /// runs over the store `wrap` makes of the backend's.
    pub async fn start_wrapped(
        backend: Backend,
        wrap: impl FnOnce(Arc<dyn Store>) -> Arc<dyn Store> + 'static,
    ) -> Self {
        let redis_url = (backend == Backend::Redis).then(|| idemq_testkit::redis_url().0);
        Self::start_on_wrapped(backend, redis_url, Default::default(), Some(Box::new(wrap))).await
    }

    async fn start_on(
        backend: Backend,
        redis_url: Option<String>,
        options: idemq_server::ServerOptions,
    ) -> Self {
        Self::start_on_wrapped(backend, redis_url, options, None).await
    }

    async fn start_on_wrapped(
        backend: Backend,
        redis_url: Option<String>,
        options: idemq_server::ServerOptions,
        wrap: Option<Wrap>,
    ) -> Self {
        let token = options.token.clone();
        let (queue, pg_db, dir, db_file) = match backend {
            Backend::Sqlite => {
                let dir = tempfile::tempdir().expect("temp dir");
                let path = dir.path().join("idemq.db");
                let queue = Queue::connect(&format!("sqlite://{}", path.display()))
                    .await
                    .expect("open sqlite");
                (queue, None, Some(dir), Some(path))
            }
            Backend::Postgres => {
                let (url, db) = idemq_testkit::pg_database();
                let queue = Queue::connect(&url).await.expect("connect postgres");
                (queue, Some(db), None, None)
            }
            Backend::Redis => {
                let url = redis_url.as_deref().expect("a Redis URL");
                Queue::migrate(url).await.expect("migrate redis");
                let queue = Queue::connect(url).await.expect("connect redis");
                (queue, None, None, None)
            }
        };
        let queue = match wrap {
            Some(wrap) => Queue::from_store(wrap(queue.store().clone()), QueueOptions::default()),
            None => queue,
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(idemq_server::serve(
            listener,
            queue.clone(),
            options,
            async move {
                let _ = rx.await;
            },
        ));
        Self {
            base: format!("http://{addr}"),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(90))
                .build()
                .expect("client"),
            queue,

            token,
            shutdown: Some(tx),
            task: Some(task),
            pg_db,
            db_file,
            redis_url,
            _dir: dir,
        }
    }

    /// Sends a request with optional JSON body and extra headers (the
    /// server's token is added when it has one, unless a header overrides it).
    pub async fn send(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut req = self.client.request(method, format!("{}{path}", self.base));
        let mut map = HeaderMap::new();
        if let Some(token) = &self.token {
            map.insert(
                "authorization",
                HeaderValue::from_str(&format!("Bearer {token}")).expect("header"),
            );
        }
        for (k, v) in headers {
            let name = HeaderName::from_bytes(k.as_bytes()).expect("name");
            if v.is_empty() {
                map.remove(&name);
            } else {
                map.insert(name, HeaderValue::from_str(v).expect("value"));
            }
        }
        if let Some(body) = body {
            map.entry("content-type")
                .or_insert(HeaderValue::from_static("application/json"));
            req = req.body(body);
        }
        let resp = req.headers(map).send().await.expect("request");
        let status = resp.status();
        let headers = resp.headers().clone();
        let text = resp.text().await.expect("body");
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text.clone()));
        Answer {
            status,
            headers,
            text,
            body,
        }
    }

    pub async fn get(&self, path: &str) -> Answer {
        self.send(Method::GET, path, None, &[]).await
    }

    pub async fn post(&self, path: &str, body: Value) -> Answer {
        self.send(Method::POST, path, Some(body.to_string().into_bytes()), &[])
            .await
    }

    pub async fn post_with(&self, path: &str, body: Value, headers: &[(&str, &str)]) -> Answer {
        self.send(
            Method::POST,
            path,
            Some(body.to_string().into_bytes()),
            headers,
        )
        .await
    }

    pub async fn post_raw(&self, path: &str, body: impl Into<Vec<u8>>) -> Answer {
        self.send(Method::POST, path, Some(body.into()), &[]).await
    }

    /// Posts `body` whole with its Content-Length, ignoring a connection the
    /// server closes early, and returns the status and the raw response.
    pub async fn post_whole(&self, path: &str, body: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.base.strip_prefix("http://").expect("http");
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        if sock.write_all(head.as_bytes()).await.is_ok() {
            let _ = sock.write_all(body.as_bytes()).await;
        }
        let mut out = Vec::new();
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            sock.read_to_end(&mut out),
        )
        .await;
        let text = String::from_utf8_lossy(&out).into_owned();
        (status_of(&text), text)
    }

    /// Posts a JSON object of about `n` bytes as a streamed (chunked) body
    /// without a Content-Length, ignoring a connection the server closes
    /// early, and returns the status and the raw response.
    pub async fn post_chunked(&self, path: &str, n: usize) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.base.strip_prefix("http://").expect("http");
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        sock.write_all(head.as_bytes()).await.expect("head");
        let mut body = format!("{{\"type\":\"x\",\"payload\":\"{}", "c".repeat(n)).into_bytes();
        body.extend_from_slice(b"\"}");
        for chunk in body.chunks(64 * 1024) {
            let frame = format!("{:x}\r\n", chunk.len());
            if sock.write_all(frame.as_bytes()).await.is_err()
                || sock.write_all(chunk).await.is_err()
                || sock.write_all(b"\r\n").await.is_err()
            {
                break; // The server answered and closed early.
            }
        }
        let _ = sock.write_all(b"0\r\n\r\n").await;
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out)).await;
        let text = String::from_utf8_lossy(&out).into_owned();
        (status_of(&text), text)
    }

    /// Sends `request` (a whole HTTP/1.1 request, `{addr}` replaced by the
    /// server's address) over a raw socket and returns the status and the
    /// raw response: headers such as `Host` exactly as written.
    pub async fn raw(&self, request: &str) -> (u16, String) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = self.base.strip_prefix("http://").expect("http");
        let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
        sock.write_all(request.replace("{addr}", addr).as_bytes())
            .await
            .expect("write");
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out))
            .await
            .expect("the server answers")
            .expect("read");
        let text = String::from_utf8_lossy(&out).into_owned();
        (status_of(&text), text)
    }

    pub async fn put(&self, path: &str, body: Value) -> Answer {
        self.send(Method::PUT, path, Some(body.to_string().into_bytes()), &[])
            .await
    }

    pub async fn delete(&self, path: &str) -> Answer {
        self.send(Method::DELETE, path, None, &[]).await
    }

    /// Enqueues `body` and returns the job id (201 or 200).
    pub async fn enqueue(&self, body: Value) -> String {
        let a = self.post("/v1/jobs", body).await;
        assert!(a.status.is_success(), "{}", a.text);
        a.body["job_id"].as_str().expect("job_id").to_owned()
    }

    /// Claims one job of every queue and returns (id, lease_token).
    pub async fn claim_one(&self) -> (String, String) {
        let a = self
            .post("/v1/claim", serde_json::json!({"worker": "w-1"}))
            .await;
        let job = &a.ok(200)["jobs"][0];
        (
            job["id"].as_str().expect("a claimed job").to_owned(),
            job["lease_token"].as_str().expect("token").to_owned(),
        )
    }

    /// How many jobs the database holds.
    pub async fn job_count(&self) -> usize {
        self.queue
            .list(idemq::JobList {
                limit: 1000,
                ..Default::default()
            })
            .await
            .expect("list")
            .jobs
            .len()
    }

    /// Another queue over the server's store, with these options (a larger
    /// payload limit than the server's, say).
    pub async fn queue_with(&self, options: QueueOptions) -> Queue {
        let url = if let Some(path) = &self.db_file {
            format!("sqlite://{}", path.display())
        } else if let Some(db) = &self.pg_db {
            idemq_testkit::pg_url(db)
        } else {
            self.redis_url.clone().expect("a Redis URL")
        };
        Queue::connect_with(&url, options).await.expect("connect")
    }

    /// Runs one statement with `args` bound (`?1`… on SQLite, `$1`… on
    /// PostgreSQL) on the server's database, behind the store's back.
    pub async fn raw_sql(&self, sqlite: &str, postgres: &'static str, args: &[&str]) {
        if let Some(path) = &self.db_file {
            let conn = rusqlite::Connection::open(path).expect("open raw");
            conn.busy_timeout(Duration::from_secs(5))
                .expect("busy timeout");
            conn.execute(sqlite, rusqlite::params_from_iter(args))
                .expect(sqlite);
        } else if let Some(db) = &self.pg_db {
            use idemq::sqlx::Connection;
            let mut conn = idemq::sqlx::PgConnection::connect(&idemq_testkit::pg_url(db))
                .await
                .expect("connect raw");
            let mut q = idemq::sqlx::query(postgres);
            for a in args {
                q = q.bind(*a);
            }
            q.execute(&mut conn).await.expect(postgres);
        } else {
            panic!("no SQL database on Redis");
        }
    }

    /// Runs one raw command on the server's Redis installation, with its
    /// key prefix put before the second argument (the key).
    pub async fn raw_redis(&self, args: &[&str]) {
        let url = self.redis_url.as_deref().expect("a Redis URL");
        let prefix = url
            .split_once("prefix=")
            .map_or("", |(_, p)| p.split('&').next().unwrap_or(""));
        let key = format!("{prefix}{}", args[1]);
        let mut all = vec![args[0], key.as_str()];
        all.extend_from_slice(&args[2..]);
        idemq_testkit::redis_command(url, &all)
            .await
            .expect("raw command");
    }

    /// Stops the server and waits for it.
    pub async fn stop(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(db) = self.pg_db.take() {
            idemq_testkit::drop_pg_database(&db);
        }
    }
}

/// The status code of a raw HTTP/1.1 response.
pub fn status_of(text: &str) -> u16 {
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"))
}
