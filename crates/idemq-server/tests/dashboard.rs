//! The dashboard in a real browser: a server on a temp SQLite file, seeded
//! with jobs in every state, driven by headless Chromium through
//! ChromeDriver's WebDriver API. Each page is loaded, one operator action is
//! performed by clicking its button, the result is checked on the page and
//! in the library, and a screenshot lands in `target/dashboard-screenshots/`.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`scripts/test` installs
//! them); the test fails, never skips, when they are missing.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use idemq::request::DedupeOptions;
use idemq::{ClaimOptions, EnqueueRequest, FailOptions, JobState, Queue, ScheduleDefinition};
use idemq_server::{ServerOptions, serve};
use serde_json::{Value, json};

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
const RAW_KEY: &str = "capture:inv_42:secret-part-never-shown";

fn require_browser() {
    for (path, pkg) in [(CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")] {
        assert!(
            Path::new(path).exists(),
            "{path} is missing: the dashboard browser test needs Debian's `chromium` and \
             `chromium-driver` packages (run scripts/test as root, or \
             `apt-get update && apt-get install -y chromium chromium-driver`); missing package: {pkg}"
        );
    }
}

fn screenshot_dir() -> PathBuf {
    // CARGO_TARGET_TMPDIR is <target>/tmp: the screenshots sit beside it.
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .parent()
        .expect("target dir")
        .join("dashboard-screenshots");
    std::fs::create_dir_all(&dir).expect("create the screenshot dir");
    dir
}

/// A running server with its queue.
struct Server {
    base: String,
    queue: Queue,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

async fn start(token: Option<&str>) -> Server {
    let dir = tempfile::tempdir().expect("tempdir");
    let url = format!("sqlite://{}", dir.path().join("dash.db").display());
    let queue = Queue::connect(&url).await.expect("open the queue");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let options = ServerOptions {
        token: token.map(str::to_owned),
        ..Default::default()
    };
    tokio::spawn(serve(listener, queue.clone(), options, async move {
        let _ = rx.await;
    }));
    Server {
        base,
        queue,
        stop: Some(tx),
        _dir: dir,
    }
}

/// The jobs the pages are checked against.
struct Seeded {
    completed: String,
    ready_keyed: String,
    scheduled: String,
    dead: String,
    dead_kept: String,
    hostile: String,
}

async fn claim_one(queue: &Queue, ty: &str) -> idemq::ClaimedJob {
    let mut jobs = queue
        .claim(ClaimOptions {
            types: Some(vec![ty.into()]),
            worker: "test-worker-1".into(),
            ..Default::default()
        })
        .await
        .expect("claim");
    jobs.pop().expect("a job to claim")
}

async fn seed(queue: &Queue) -> Seeded {
    // Completed, with a checkpoint, a result and a run.
    let completed = queue
        .enqueue(
            EnqueueRequest::new("invoice.capture")
                .queue("billing")
                .payload(json!({"invoice_id": "inv_41"}))
                .tag("billing"),
        )
        .await
        .unwrap();
    let c = claim_one(queue, "invoice.capture").await;
    assert_eq!(c.id, completed);
    queue
        .checkpoint_put(&c.id, &c.lease_token, "charged", &json!({"charge": "ch_1"}))
        .await
        .unwrap();
    queue
        .complete(&c.id, &c.lease_token, Some(json!({"ok": true})))
        .await
        .unwrap();

    // Ready, under an idempotency key: its page shows preview and digest only.
    let ready_keyed = queue
        .enqueue(
            EnqueueRequest::new("invoice.capture")
                .queue("billing")
                .payload(json!({"invoice_id": "inv_42"}))
                .tag("billing")
                .idempotency_key(RAW_KEY),
        )
        .await
        .unwrap();
    // Ready, under a dedupe key.
    queue
        .enqueue(
            EnqueueRequest::new("email.send")
                .queue("mail")
                .payload(json!({"to": "a@example.com"}))
                .dedupe(DedupeOptions::key("acct-1").ttl(Duration::from_secs(600))),
        )
        .await
        .unwrap();
    let scheduled = queue
        .enqueue(
            EnqueueRequest::new("email.send")
                .queue("mail")
                .delay(Duration::from_secs(3600)),
        )
        .await
        .unwrap();
    let cancelled = queue
        .enqueue(EnqueueRequest::new("email.digest").queue("mail"))
        .await
        .unwrap();
    queue.cancel(&cancelled).await.unwrap();

    // Two dead letters.
    let mut dead = Vec::new();
    for n in 0..2 {
        let id = queue
            .enqueue(
                EnqueueRequest::new("report.build")
                    .queue("reports")
                    .payload(json!({"n": n})),
            )
            .await
            .unwrap();
        let c = claim_one(queue, "report.build").await;
        queue
            .fail(
                &c.id,
                &c.lease_token,
                FailOptions {
                    error: format!("upstream 500 on report {n}"),
                    permanent: true,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        dead.push(id);
    }

    // A job whose payload, tag and error try to become markup.
    let hostile = queue
        .enqueue(
            EnqueueRequest::new("evil.type")
                .queue("default")
                .payload(json!({"html": "<img src=x onerror=\"document.title='pwned'\"><script>document.title='pwned'</script>"}))
                .tag("<b>bold</b>"),
        )
        .await
        .unwrap();

    // Enough jobs for a second page of /jobs.
    for i in 0..55 {
        queue
            .enqueue(
                EnqueueRequest::new("bulk.noop")
                    .queue("bulk")
                    .payload(json!({"i": i})),
            )
            .await
            .unwrap();
    }

    queue
        .schedule_set(
            "nightly-report",
            ScheduleDefinition::cron(
                "0 0 3 * * *",
                EnqueueRequest::new("report.build").queue("reports"),
            ),
        )
        .await
        .unwrap();

    let dead_kept = dead.pop().unwrap();
    Seeded {
        completed,
        ready_keyed,
        scheduled,
        dead: dead.pop().unwrap(),
        dead_kept,
        hostile,
    }
}

/// ChromeDriver with one headless Chromium session.
struct Browser {
    http: reqwest::Client,
    base: String,
    session: String,
    driver: Child,
    _profile: tempfile::TempDir,
    shots: PathBuf,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session makes ChromeDriver quit Chromium; killing only
        // the driver would leave the browser running. Drop cannot await, so
        // this is one plain blocking HTTP request.
        let addr = self.base.trim_start_matches("http://");
        if let Ok(mut conn) = std::net::TcpStream::connect(addr) {
            use std::io::{Read, Write};
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let req = format!(
                "DELETE /session/{} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                self.session
            );
            if conn.write_all(req.as_bytes()).is_ok() {
                let _ = conn.read_to_end(&mut Vec::new());
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Browser {
    async fn launch() -> Browser {
        require_browser();
        let port = free_port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        let base = format!("http://127.0.0.1:{port}");
        let mut ready = false;
        for _ in 0..100 {
            if let Ok(r) = http.get(format!("{base}/status")).send().await
                && let Ok(v) = r.json::<Value>().await
                && v["value"]["ready"] == json!(true)
            {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(ready, "chromedriver did not come up on port {port}");
        let profile = tempfile::tempdir().unwrap();
        let args = vec![
            "--headless".to_string(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-quic".into(),
            "--no-first-run".into(),
            "--disable-background-networking".into(),
            "--disable-component-update".into(),
            "--disable-sync".into(),
            "--disable-dev-shm-usage".into(),
            "--window-size=1280,900".into(),
            format!("--user-data-dir={}", profile.path().display()),
        ];
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {"binary": CHROMIUM, "args": args}
        }}});
        let res: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = res["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("chromedriver refused the session: {res}"))
            .to_owned();
        Browser {
            http,
            base,
            session,
            driver,
            _profile: profile,
            shots: screenshot_dir(),
        }
    }

    async fn try_cmd(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value, String> {
        let url = format!("{}/session/{}{}", self.base, self.session, path);
        let mut req = self.http.request(method, url);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Value = req.send().await.unwrap().json().await.unwrap();
        if let Some(err) = v["value"].get("error") {
            return Err(format!(
                "webdriver {path}: {err}: {}",
                v["value"]["message"]
            ));
        }
        Ok(v["value"].clone())
    }

    async fn cmd(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        self.try_cmd(method, path, body)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The page's text, or `None` while a navigation replaces the document.
    async fn try_body_text(&self) -> Option<String> {
        let el = self
            .try_cmd(
                reqwest::Method::POST,
                "/element",
                Some(json!({"using": "css selector", "value": "body"})),
            )
            .await
            .ok()?;
        let id = el.as_object()?.values().next()?.as_str()?.to_owned();
        self.try_cmd(reqwest::Method::GET, &format!("/element/{id}/text"), None)
            .await
            .ok()?
            .as_str()
            .map(str::to_owned)
    }

    async fn goto(&self, url: &str) {
        self.cmd(reqwest::Method::POST, "/url", Some(json!({"url": url})))
            .await;
    }

    async fn url(&self) -> String {
        self.cmd(reqwest::Method::GET, "/url", None)
            .await
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn title(&self) -> String {
        self.cmd(reqwest::Method::GET, "/title", None)
            .await
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn source(&self) -> String {
        self.cmd(reqwest::Method::GET, "/source", None)
            .await
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn find_all(&self, css: &str) -> Vec<String> {
        let v = self
            .cmd(
                reqwest::Method::POST,
                "/elements",
                Some(json!({"using": "css selector", "value": css})),
            )
            .await;
        v.as_array()
            .unwrap()
            .iter()
            .map(|e| {
                e.as_object()
                    .unwrap()
                    .values()
                    .next()
                    .unwrap()
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    }

    async fn find(&self, css: &str) -> String {
        let all = self.find_all(css).await;
        assert!(
            !all.is_empty(),
            "no element matches {css:?} on {}",
            self.url().await
        );
        all[0].clone()
    }

    async fn text(&self, css: &str) -> String {
        let el = self.find(css).await;
        self.cmd(reqwest::Method::GET, &format!("/element/{el}/text"), None)
            .await
            .as_str()
            .unwrap()
            .to_owned()
    }

    async fn click(&self, css: &str) {
        let el = self.find(css).await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{el}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let el = self.find(css).await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{el}/clear"),
            Some(json!({})),
        )
        .await;
        self.cmd(
            reqwest::Method::POST,
            &format!("/element/{el}/value"),
            Some(json!({"text": text})),
        )
        .await;
    }

    /// Waits up to 10 s for the page text to contain `needle`.
    async fn wait_for_text(&self, needle: &str) {
        for _ in 0..100 {
            if self
                .try_body_text()
                .await
                .is_some_and(|t| t.contains(needle))
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "{needle:?} never appeared on {}:\n{}",
            self.url().await,
            self.text("body").await
        );
    }

    async fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.cmd(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64_decode(b64.as_str().unwrap());
        assert!(png.starts_with(b"\x89PNG"), "a PNG screenshot");
        let path = self.shots.join(name);
        std::fs::write(&path, png).unwrap();
        path
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    };
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut buf, mut bits) = (0u32, 0);
    for c in s.bytes().filter_map(val) {
        buf = (buf << 6) | c;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((buf >> bits) as u8);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_pages_and_actions_in_chromium() {
    require_browser();
    let server = start(None).await;
    let s = seed(&server.queue).await;
    let b = Browser::launch().await;
    let base = &server.base;

    // Overview: counts, queues, ready-by-type, live chart; action: pause a queue.
    b.goto(&format!("{base}/")).await;
    assert_eq!(b.title().await, "Overview · idemq");
    assert_eq!(b.text(r#"[data-total="dead"]"#).await, "2");
    assert!(
        b.text(r#"tr[data-queue="billing"]"#)
            .await
            .contains("running")
    );
    let ready = b.text("#ready-types").await;
    assert!(
        ready.contains("bulk.noop") && ready.contains("email.send"),
        "{ready}"
    );
    // The chart script polls stats.json every 2 s and turns successive
    // samples into rates: a worker-like task completes jobs meanwhile, so
    // the chart must show a non-zero completion rate.
    let ticker = {
        let queue = server.queue.clone();
        tokio::spawn(async move {
            loop {
                queue
                    .enqueue(EnqueueRequest::new("tick.work").queue("ticks"))
                    .await
                    .unwrap();
                let c = claim_one(&queue, "tick.work").await;
                queue.complete(&c.id, &c.lease_token, None).await.unwrap();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let mut rate = String::new();
    for _ in 0..150 {
        rate = b.text("#rate-now").await;
        if rate.contains("completed/s") && !rate.contains(" 0.0 completed/s") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        rate.contains("completed/s") && !rate.contains(" 0.0 completed/s"),
        "the live chart never showed the completions: {rate:?}"
    );
    // One more sample, so the line has a visible run.
    tokio::time::sleep(Duration::from_millis(4100)).await;
    ticker.abort();
    b.screenshot("overview.png").await;
    b.click(r#"tr[data-queue="mail"] button"#).await;
    b.wait_for_text("Queue paused").await;
    assert!(b.url().await.ends_with("/?flash=paused"));
    assert!(b.text(r#"tr[data-queue="mail"]"#).await.contains("paused"));
    let mail = server
        .queue
        .queues()
        .await
        .unwrap()
        .into_iter()
        .find(|q| q.name == "mail")
        .unwrap();
    assert!(mail.paused, "the click paused the queue in the store");
    b.screenshot("overview-paused.png").await;

    // Jobs: filters and paging; action: filter by type through the form.
    b.goto(&format!("{base}/jobs?queue=bulk")).await;
    let first: Vec<String> = b.find_all("tr[data-job]").await;
    assert_eq!(first.len(), 50, "one full page");
    let page_one = b.text("table.jobs").await;
    b.click(r#"a[rel="next"]"#).await;
    b.wait_for_text("First page").await;
    assert_eq!(
        b.find_all("tr[data-job]").await.len(),
        5,
        "the rest on page two"
    );
    assert_ne!(b.text("table.jobs").await, page_one);
    b.goto(&format!("{base}/jobs")).await;
    b.type_into(r#"input[name="type"]"#, "invoice.capture")
        .await;
    b.click(r#".filters button[type="submit"]"#).await;
    b.wait_for_text("2 shown").await;
    assert!(b.url().await.contains("type=invoice.capture"));
    let table = b.text("table.jobs").await;
    assert!(
        table.contains(&s.completed) && table.contains(&s.ready_keyed),
        "{table}"
    );
    assert!(!table.contains("bulk.noop"));
    b.screenshot("jobs.png").await;
    b.goto(&format!("{base}/jobs?tag=billing&state=completed"))
        .await;
    assert_eq!(b.find_all("tr[data-job]").await.len(), 1);

    // A completed job: fields, run, checkpoint, result, events.
    b.goto(&format!("{base}/jobs/{}", s.completed)).await;
    let body = b.text("main").await;
    for want in [
        "charged",
        "ch_1",
        "test-worker-1",
        "completed",
        "accepted",
        "claimed",
    ] {
        assert!(
            body.contains(want),
            "{want:?} missing from the job page:\n{body}"
        );
    }
    b.screenshot("job-completed.png").await;

    // A keyed ready job: preview and digest, never the raw key; action: cancel.
    b.goto(&format!("{base}/jobs/{}", s.ready_keyed)).await;
    let body = b.text("main").await;
    let job = server.queue.get(&s.ready_keyed).await.unwrap().unwrap();
    let k = job.idempotency.as_ref().unwrap();
    assert!(
        body.contains(&k.key_preview) && body.contains(&k.key_digest),
        "{body}"
    );
    assert!(
        !b.source().await.contains(RAW_KEY),
        "the raw idempotency key reached the page"
    );
    b.screenshot("job-ready.png").await;
    b.click(r#"form[action$="/cancel"] button"#).await;
    b.wait_for_text("Job cancelled.").await;
    assert!(b.text(".subtitle").await.contains("cancelled"));
    assert_eq!(
        server
            .queue
            .get(&s.ready_keyed)
            .await
            .unwrap()
            .unwrap()
            .state,
        JobState::Cancelled
    );
    b.screenshot("job-cancelled.png").await;

    // Promote a scheduled job from its page.
    b.goto(&format!("{base}/jobs/{}", s.scheduled)).await;
    b.click(r#"form[action$="/promote"] button"#).await;
    b.wait_for_text("Job promoted").await;
    assert_eq!(
        server.queue.get(&s.scheduled).await.unwrap().unwrap().state,
        JobState::Ready
    );

    // Hostile values stay text: no injected element, no script run.
    b.goto(&format!("{base}/jobs/{}", s.hostile)).await;
    assert_ne!(b.title().await, "pwned");
    assert_eq!(b.find_all("img").await.len(), 0, "an <img> got injected");
    assert_eq!(b.find_all("b").await.len(), 0, "a tag became markup");
    assert_eq!(b.find_all("script").await.len(), 1, "only dashboard.js");
    assert!(
        b.text("pre.json").await.contains("<script>"),
        "the payload is shown as text"
    );

    // Dead letters; action: redrive one.
    b.goto(&format!("{base}/dead")).await;
    assert_eq!(b.find_all("tr[data-job]").await.len(), 2);
    assert!(b.text("table.jobs").await.contains("upstream 500"));
    b.screenshot("dead.png").await;
    b.click(&format!(r#"tr[data-job="{}"] button"#, s.dead))
        .await;
    b.wait_for_text("Job redriven").await;
    let rows = b.find_all("tr[data-job]").await;
    assert_eq!(rows.len(), 1, "the redriven job left the dead letters");
    assert!(b.text("table.jobs").await.contains(&s.dead_kept));
    assert_eq!(
        server.queue.get(&s.dead).await.unwrap().unwrap().state,
        JobState::Ready
    );
    b.screenshot("dead-redriven.png").await;

    // Schedules.
    b.goto(&format!("{base}/schedules")).await;
    let table = b.text("main").await;
    assert!(
        table.contains("nightly-report") && table.contains("0 0 3 * * *"),
        "{table}"
    );
    b.screenshot("schedules.png").await;

    // Bindings; action: look a key up (the key travels in the body only).
    b.goto(&format!("{base}/bindings")).await;
    let body = b.text("main").await;
    assert!(
        body.contains("acct-1"),
        "the live dedupe binding is listed: {body}"
    );
    assert!(
        body.contains(&k.key_digest),
        "the idempotency binding is listed: {body}"
    );
    b.type_into(r#"form input[name="key"][type="password"]"#, RAW_KEY)
        .await;
    b.click(r#"form:has(input[value="idempotency"]) button"#)
        .await;
    b.wait_for_text("is bound to").await;
    assert!(b.text(".lookup-result").await.contains(&s.ready_keyed));
    assert!(
        !b.source().await.contains(RAW_KEY),
        "the raw key was echoed"
    );
    assert!(
        b.url().await.ends_with("/bindings/lookup"),
        "no key in the URL"
    );
    b.screenshot("bindings.png").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_sets_a_strict_httponly_cookie() {
    require_browser();
    let server = start(Some("s3cret-token")).await;
    let http = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let base = &server.base;

    // The login form and its stylesheet are reachable without the token.
    for path in ["/login", "/dashboard/static/dashboard.css"] {
        let res = http.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(
            res.status(),
            200,
            "GET {path} must work without a token: the auth middleware has to let \
             dashboard::PUBLIC_PATHS (see dashboard::is_public) through"
        );
    }
    let page = http.get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 401, "the dashboard itself needs the token");

    let wrong = http
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body("token=nope")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);
    assert!(wrong.headers().get("set-cookie").is_none());

    // A post from another site is refused before the token is looked at.
    let cross = http
        .post(format!("{base}/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .header("origin", "http://evil.example")
        .body("token=s3cret-token")
        .send()
        .await
        .unwrap();
    assert_eq!(cross.status(), 403);

    // In the browser: the form signs in and lands on the overview.
    let b = Browser::launch().await;
    b.goto(&format!("{base}/login")).await;
    assert_eq!(b.title().await, "Sign in · idemq");
    b.type_into(r#"input[name="token"]"#, "wrong").await;
    b.click(r#"form.login button"#).await;
    b.wait_for_text("Wrong token.").await;
    b.type_into(r#"input[name="token"]"#, "s3cret-token").await;
    b.click(r#"form.login button"#).await;
    b.wait_for_text("Throughput").await;
    assert_eq!(b.url().await, format!("{base}/"));
    let cookies = b.cmd(reqwest::Method::GET, "/cookie", None).await;
    let c = cookies
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "idemq_token")
        .unwrap_or_else(|| panic!("no idemq_token cookie: {cookies}"));
    assert_eq!(c["value"], "s3cret-token");
    assert_eq!(c["httpOnly"], true);
    assert_eq!(c["sameSite"], "Strict");
    assert_eq!(c["path"], "/");
    b.screenshot("overview-after-login.png").await;
    b.goto(&format!("{base}/login")).await;
    b.screenshot("login.png").await;
}
