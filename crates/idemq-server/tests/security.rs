//! Security properties of the server (docs/idempotency.md and README.md):
//!
//! - with a token, every route of the OpenAPI document and every dashboard
//!   page answers `401` (or a redirect to `/login` for a browser) without it,
//!   except `GET /healthz`;
//! - body, payload and key limits are enforced (`413`, `422`);
//! - a raw idempotency key sent to every route that takes one never appears
//!   in a response (body or header), the job's events, the dashboard, the
//!   server's log output or the database (SQLite files, `pg_dump`, every key
//!   and value of a Redis installation and the server's append-only files);
//! - every SQL statement of `crates/idemq/src/store/` binds its values (a
//!   source scan: `format!` only splices constant fragments).

#[allow(dead_code)]
#[path = "api/harness.rs"]
mod harness;

use std::io::Write;
use std::sync::{Mutex, OnceLock};

use harness::{Answer, Backend, Server};
use reqwest::Method;
use serde_json::{Value, json};

// ---------------------------------------------------------------------------
// Log capture: every tracing event of the process, at every level.

static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs the capturing subscriber once (TRACE for every target: the
/// server, tower-http's request spans, axum, hyper, sqlx).
fn capture_logs() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(|| LogWriter)
            .init();
    });
}

fn logs() -> String {
    String::from_utf8_lossy(&LOG.lock().unwrap_or_else(|e| e.into_inner())).into_owned()
}

// ---------------------------------------------------------------------------
// 1. The token guards every route.

const TOKEN: &str = "tok-3f9a1c7e-security";

/// One request without following redirects.
async fn raw(
    client: &reqwest::Client,
    base: &str,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
) -> (u16, Option<String>, String) {
    let mut req = client.request(method.clone(), format!("{base}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if method == Method::POST || method == Method::PUT {
        req = req.header("content-type", "application/json").body("{}");
    }
    let resp = req.send().await.expect("request");
    let status = resp.status().as_u16();
    let location = resp
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    (status, location, resp.text().await.unwrap_or_default())
}

/// Every (method, path) of the OpenAPI document, with `{params}` filled in.
fn openapi_routes(doc: &Value) -> Vec<(Method, String)> {
    let mut out = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        let concrete: String = {
            let mut s = String::new();
            let mut in_param = false;
            for c in path.chars() {
                match c {
                    '{' => in_param = true,
                    '}' => {
                        in_param = false;
                        s.push_str("x1");
                    }
                    _ if in_param => {}
                    _ => s.push(c),
                }
            }
            s
        };
        for method in ["get", "post", "put", "delete", "patch"] {
            if item.get(method).is_some() {
                let m = Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
                out.push((m, concrete.clone()));
            }
        }
    }
    out
}

/// The dashboard's routes (not in the OpenAPI document).
fn dashboard_routes() -> Vec<(Method, String)> {
    let mut out: Vec<(Method, String)> = [
        "/",
        "/jobs",
        "/jobs/x1",
        "/dead",
        "/schedules",
        "/bindings",
        "/dashboard/stats.json",
        "/no/such/route",
    ]
    .iter()
    .map(|p| (Method::GET, (*p).to_owned()))
    .collect();
    for p in [
        "/bindings/lookup",
        "/logout",
        "/dashboard/actions/jobs/x1/cancel",
        "/dashboard/actions/jobs/x1/purge",
        "/dashboard/actions/queues/q1/pause",
    ] {
        out.push((Method::POST, p.to_owned()));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_needs_the_token() {
    let s = Server::start_with(Backend::Sqlite, Some(TOKEN)).await;
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let doc = s.get("/openapi.json").await.ok(200).clone();
    let mut routes = openapi_routes(&doc);
    assert!(
        routes.len() >= 30,
        "the OpenAPI document lists {} operations",
        routes.len()
    );
    assert!(routes.contains(&(Method::GET, "/healthz".to_owned())));
    routes.extend(dashboard_routes());
    let wrong_cookie = format!("idemq_token={TOKEN}x");
    let wrong_bearer = format!("Bearer {TOKEN}x");
    let short_bearer = format!("Bearer {}", &TOKEN[..TOKEN.len() - 1]);
    let mut checked = 0;
    for (method, path) in &routes {
        if *method == Method::GET && path == "/healthz" {
            let (st, _, body) = raw(&client, &s.base, Method::GET, path, &[]).await;
            assert_eq!(st, 200, "GET /healthz is open: {body}");
            continue;
        }
        for creds in [
            vec![],
            vec![("authorization", wrong_bearer.as_str())],
            vec![("authorization", short_bearer.as_str())],
            vec![("authorization", "Basic dXNlcjpwYXNz")],
            vec![("cookie", wrong_cookie.as_str())],
        ] {
            let (st, loc, body) = raw(&client, &s.base, method.clone(), path, &creds).await;
            assert_eq!(st, 401, "{method} {path} with {creds:?}: {st} {body}");
            assert!(body.contains("/problems/unauthorized"), "{body}");
            assert!(!body.contains(TOKEN), "{body}");
            assert!(loc.is_none());
            checked += 1;
            // A browser navigation is redirected to the login form instead.
            if *method == Method::GET {
                let mut h = creds.clone();
                h.push(("accept", "text/html,application/xhtml+xml,*/*;q=0.8"));
                let (st, loc, body) = raw(&client, &s.base, method.clone(), path, &h).await;
                assert!(
                    (300..400).contains(&st) && loc.as_deref() == Some("/login"),
                    "GET {path} as a browser: {st} {loc:?} {body}"
                );
                checked += 1;
            }
        }
    }
    // Nothing was written by any of those requests.
    assert_eq!(s.job_count().await, 0);
    let queues = s.queue.queues().await.expect("queues");
    assert!(queues.iter().all(|q| !q.paused), "{queues:?}");
    // The same walk with the token is let through (so the 401s above are
    // about the token, not about the route).
    let bearer = format!("Bearer {TOKEN}");
    let cookie = format!("idemq_token={TOKEN}");
    for (method, path) in &routes {
        for creds in [
            [("authorization", bearer.as_str())],
            [("cookie", cookie.as_str())],
        ] {
            let (st, _, body) = raw(&client, &s.base, method.clone(), path, &creds).await;
            assert_ne!(st, 401, "{method} {path} with the token: {body}");
        }
    }
    println!(
        "auth: {} routes ({} from OpenAPI), {checked} unauthenticated requests refused",
        routes.len(),
        openapi_routes(&doc).len()
    );
    s.stop().await;
}

/// The dashboard's cookie goes with a same-site page's requests too
/// (another port of this host, a sibling subdomain): an API write it alone
/// authorizes must come from this server's own pages. The bearer token is
/// what API clients send, and no page can send it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_authorized_by_the_cookie_alone_must_come_from_this_origin() {
    let s = Server::start_with(Backend::Sqlite, Some(TOKEN)).await;
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");
    let id = s
        .queue
        .enqueue(idemq::EnqueueRequest::new("t"))
        .await
        .expect("enqueue");
    let purge = format!("/v1/jobs/{id}/purge");
    let cookie = format!("idemq_token={TOKEN}");
    let bearer = format!("Bearer {TOKEN}");
    let host = s.base.trim_start_matches("http://").to_owned();
    let own_origin = format!("http://{host}");
    for page in [
        vec![("sec-fetch-site", "same-site")],
        vec![("sec-fetch-site", "cross-site")],
        vec![("origin", "http://127.0.0.1:1")],
    ] {
        let mut headers = vec![("cookie", cookie.as_str())];
        headers.extend(page.iter().copied());
        let (st, _, body) = raw(&client, &s.base, Method::POST, &purge, &headers).await;
        assert_eq!(st, 403, "{page:?}: {body}");
        assert!(body.contains("forbidden-host"), "{body}");
        assert!(s.queue.get(&id).await.expect("get").is_some(), "{page:?}");
        // Reads stay open to the cookie.
        let (st, _, body) = raw(
            &client,
            &s.base,
            Method::GET,
            &format!("/v1/jobs/{id}"),
            &headers,
        )
        .await;
        assert_eq!(st, 200, "{page:?}: {body}");
    }
    // From this server's own pages, the cookie is enough.
    let (st, _, body) = raw(
        &client,
        &s.base,
        Method::POST,
        "/v1/queues/q/pause",
        &[
            ("cookie", cookie.as_str()),
            ("sec-fetch-site", "same-origin"),
            ("origin", own_origin.as_str()),
        ],
    )
    .await;
    assert_eq!(st, 200, "{body}");
    // The bearer token, with whatever browser headers.
    let (st, _, body) = raw(
        &client,
        &s.base,
        Method::POST,
        &purge,
        &[
            ("authorization", bearer.as_str()),
            ("cookie", cookie.as_str()),
            ("sec-fetch-site", "cross-site"),
        ],
    )
    .await;
    assert_eq!(st, 200, "{body}");
    assert!(s.queue.get(&id).await.expect("get").is_none());
    s.stop().await;
}

// ---------------------------------------------------------------------------
// 2. Limits.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_payload_and_key_limits() {
    let s = Server::start(Backend::Sqlite).await;
    let limit = s.queue.payload_limit();
    // A payload one byte over the limit inside a body under the body limit.
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "x", "payload": "p".repeat(limit - 1)}),
        )
        .await;
    assert_eq!(a.problem(413, "payload-too-large")["field"], "payload");
    // The same payload in explain and in a batch item.
    let a = s
        .post(
            "/v1/jobs/explain",
            json!({"type": "x", "payload": "p".repeat(limit - 1)}),
        )
        .await;
    a.problem(413, "payload-too-large");
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "x", "payload": "p".repeat(limit - 1)}], "atomic": true}),
        )
        .await;
    assert_eq!(
        a.status.as_u16(),
        413,
        "{}",
        &a.text[..a.text.len().min(300)]
    );
    // A body over payload limit + 64 KiB is refused before it is read, on
    // every route that takes a body (not only enqueue).
    let huge = format!(
        "{{\"type\":\"x\",\"payload\":\"{}\"}}",
        "h".repeat(limit + 64 * 1024)
    );
    for path in [
        "/v1/jobs",
        "/v1/jobs/explain",
        "/v1/idempotency/lookup",
        "/v1/jobs/x1/complete",
    ] {
        // Over a raw socket: the server answers before it reads the body and
        // may close the connection while a client is still sending it.
        let (status, text) = s.post_whole(path, &huge).await;
        assert_eq!(status, 413, "{path}: {}", &text[..text.len().min(300)]);
        assert!(
            text.contains("/problems/payload-too-large"),
            "{path}: {text}"
        );
    }
    // A streamed (chunked) body without Content-Length is cut at the limit too.
    let (status, _) = s.post_chunked("/v1/jobs", limit + 64 * 1024 + 4096).await;
    assert_eq!(status, 413, "a chunked body over the limit");
    // Batches: more than 1,000 items, or more than 16 MiB + 64 KiB.
    let items: Vec<Value> = (0..1001).map(|_| json!({"type": "x"})).collect();
    let a = s
        .post("/v1/jobs/batch", json!({"jobs": items, "atomic": false}))
        .await;
    a.problem(413, "payload-too-large");
    // A declared length over the batch limit is refused before the body.
    // Claim (with its `complete` member) and many completions carry many
    // results: they have the batch limit.
    for path in ["/v1/jobs/batch", "/v1/claim", "/v1/jobs/complete"] {
        let status = declared_post(&s.base, path, 16 * 1024 * 1024 + 64 * 1024 + 1).await;
        assert_eq!(status, 413, "{path}: a body over 16 MiB + 64 KiB");
    }
    let status = declared_post(&s.base, "/v1/jobs", limit + 64 * 1024 + 1).await;
    assert_eq!(status, 413, "a body over the payload limit + 64 KiB");
    // Keys: 255 bytes pass, 256 do not (body, header, scope, dedupe, lookup, release).
    let k255 = "k".repeat(255);
    let k256 = "k".repeat(256);
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "x", "idempotency": {"key": k255}}),
        )
        .await;
    a.ok(201);
    let cases: Vec<KeyCase> = vec![
        (
            "/v1/jobs",
            json!({"type": "x", "idempotency": {"key": k256}}),
            vec![],
            "idempotency.key",
        ),
        (
            "/v1/jobs",
            json!({"type": "x"}),
            vec![("idempotency-key", k256.as_str())],
            "idempotency.key",
        ),
        (
            "/v1/jobs/explain",
            json!({"type": "x", "idempotency": {"key": k256}}),
            vec![],
            "idempotency.key",
        ),
        (
            "/v1/jobs",
            json!({"type": "x", "idempotency": {"key": "k", "scope": "s".repeat(65)}}),
            vec![],
            "idempotency.scope",
        ),
        (
            "/v1/jobs",
            json!({"type": "x", "idempotency": {"key": "k", "scope": "idemq.x"}}),
            vec![],
            "idempotency.scope",
        ),
        (
            "/v1/jobs",
            json!({"type": "x", "dedupe": {"key": k256}}),
            vec![],
            "dedupe.key",
        ),
        (
            "/v1/jobs",
            json!({"type": "x", "concurrency_key": k256}),
            vec![],
            "concurrency_key",
        ),
        (
            "/v1/jobs",
            json!({"type": "x", "tags": ["t".repeat(65)]}),
            vec![],
            "tags",
        ),
        (
            "/v1/jobs",
            json!({"type": "x", "tags": (0..17).map(|i| format!("t{i}")).collect::<Vec<_>>()}),
            vec![],
            "tags",
        ),
        (
            "/v1/idempotency/lookup",
            json!({"key": k256}),
            vec![],
            "idempotency.key",
        ),
        (
            "/v1/idempotency/release",
            json!({"key": k256}),
            vec![],
            "idempotency.key",
        ),
    ];
    for (path, body, headers, field) in cases {
        let a = s.post_with(path, body.clone(), &headers).await;
        let p = a.problem(422, "validation");
        assert!(
            p["field"].as_str().is_some_and(|f| f.starts_with(field)
                || f.eq_ignore_ascii_case("idempotency-key")
                || f == "key"),
            "{path} {body}: field {} (expected {field})",
            p["field"]
        );
        assert!(!a.text.contains(&k256), "the oversized key is not echoed");
    }
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "x", "idempotency": {"key": k256}}], "atomic": true}),
        )
        .await;
    assert_eq!(a.problem(422, "validation")["index"], 0);
    // Only the one 255-byte-key job was written.
    assert_eq!(s.job_count().await, 1);
    s.stop().await;
}

/// Declares a body of `n` bytes, sends only its start and returns the status.
async fn declared_post(base: &str, path: &str, n: usize) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = base.strip_prefix("http://").expect("http");
    let mut sock = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {n}\r\nConnection: close\r\n\r\n{{\"jobs\": ["
    );
    sock.write_all(head.as_bytes()).await.expect("head");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        sock.read_to_end(&mut out),
    )
    .await;
    harness::status_of(&String::from_utf8_lossy(&out))
}

/// A limit case: path, body, extra headers, the field named in the 422.
type KeyCase<'a> = (&'a str, Value, Vec<(&'a str, &'a str)>, &'a str);

// ---------------------------------------------------------------------------
// 3. The raw key never leaves the request.

/// Everything the test saw, to be searched for the raw keys.
#[derive(Default)]
struct Seen {
    texts: Vec<(String, String)>,
}

impl Seen {
    fn record(&mut self, what: &str, a: &Answer) {
        let mut headers = String::new();
        for (k, v) in &a.headers {
            headers.push_str(&format!("{k}: {}\n", String::from_utf8_lossy(v.as_bytes())));
        }
        self.texts.push((format!("{what} (headers)"), headers));
        self.texts.push((what.to_owned(), a.text.clone()));
    }
}

/// A unique key: an 8-character prefix (the preview shows at most that)
/// and a secret tail that must never be seen.
fn secret_key(tag: &str) -> (String, String) {
    let tail = format!("{tag}{}", uuid::Uuid::new_v4().simple());
    (format!("pfx:{tag:<4.4}{tail}"), tail)
}

/// The forms a leaked tail could take: raw, hex (PostgreSQL's bytea), and
/// upper-case hex.
fn forms(tail: &str) -> Vec<String> {
    let hex: String = tail.bytes().map(|b| format!("{b:02x}")).collect();
    vec![tail.to_owned(), hex.clone(), hex.to_uppercase()]
}

fn assert_absent(tails: &[String], what: &str, haystack: &[u8]) {
    for tail in tails {
        for form in forms(tail) {
            let found = haystack.windows(form.len()).any(|w| w == form.as_bytes());
            assert!(!found, "a raw idempotency key ({form}) leaked into {what}");
        }
    }
}

/// A unique key with `sep` (quotes, backslashes) before its secret tail,
/// within the 8 characters a preview shows.
fn escaped_key(tag: &str, sep: &str) -> (String, String) {
    let tail = format!("{tag}{}", uuid::Uuid::new_v4().simple());
    (format!("k{sep}{tail}"), tail)
}

/// Sends a key with quotes or backslashes everywhere a malformed request
/// could echo it; every answer is a refusal, recorded for the scan.
async fn escaped_key_never_echoed(s: &Server, seen: &mut Seen, k: &str) {
    let bodies = [
        // The bare-string form (only `dedupe` takes one).
        json!({"type": "sec.e", "idempotency": k}),
        // The key given to members of other types.
        json!({"type": "sec.e", "idempotency": {"key": "sec-e", "ttl_ms": k}}),
        json!({"type": "sec.e", "idempotency": {"key": k, "ttl_ms": k}}),
        json!({"type": "sec.e", "priority": k, "retry": {"kind": "fixed", "delay_ms": k}}),
        json!({"type": "sec.e", "retry": {"kind": k}}),
        json!({"type": "sec.e", "retry": k}),
    ];
    for body in &bodies {
        for path in ["/v1/jobs", "/v1/jobs/explain"] {
            let a = s.post(path, body.clone()).await;
            seen.record(&format!("{path} (escaped key)"), &a);
            a.problem(400, "bad-request");
        }
        let a = s
            .post("/v1/jobs/batch", json!({"jobs": [body.clone()]}))
            .await;
        seen.record("batch item (escaped key)", &a);
        assert_eq!(
            a.ok(200)["results"][0]["error"]["type"],
            "/problems/bad-request"
        );
        let a = s
            .post(
                "/v1/jobs/batch",
                json!({"jobs": [{"type": "sec.e"}, body.clone()], "atomic": true}),
            )
            .await;
        seen.record("atomic batch item (escaped key)", &a);
        assert_eq!(a.problem(400, "bad-request")["index"], 1);
    }
    // The header, as a structured-field string (`\"` and `\\` escaped) and
    // as a bare token, beside a malformed body and a body key that differs.
    let sf = format!("\"{}\"", k.replace('\\', "\\\\").replace('"', "\\\""));
    for header in [sf.as_str(), k] {
        for body in [
            json!({"type": "sec.e", "idempotency": {"ttl_ms": "soon"}}),
            json!({"type": "sec.e", "idempotency": 7}),
            json!({"type": "sec.e", "idempotency": {"key": "other"}}),
        ] {
            for path in ["/v1/jobs", "/v1/jobs/explain"] {
                let a = s
                    .post_with(path, body.clone(), &[("idempotency-key", header)])
                    .await;
                seen.record("header (escaped key)", &a);
                assert!(matches!(a.status.as_u16(), 400 | 422), "{path}: {}", a.text);
            }
        }
    }
    // The header with a good body takes the key whole.
    let a = s
        .post_with(
            "/v1/jobs",
            json!({"type": "sec.e"}),
            &[("idempotency-key", sf.as_str())],
        )
        .await;
    seen.record("enqueue (escaped header key)", &a);
    let id = a.ok(201)["job_id"].clone();
    let a = s.post("/v1/idempotency/lookup", json!({"key": k})).await;
    seen.record("lookup (escaped key)", &a);
    assert_eq!(a.ok(200)["job_id"], id);
    let a = s
        .post("/v1/idempotency/lookup", json!({"key": k, "scope": 5}))
        .await;
    seen.record("lookup (escaped key, bad scope)", &a);
    a.problem(400, "bad-request");
}

/// Sends a key as a JSON number (and with a fraction) where a string key
/// belongs; the digits are never echoed.
async fn numeric_key_never_echoed(s: &Server, seen: &mut Seen, n: u128) {
    let float: Value = serde_json::from_str(&format!("{n}.5")).expect("a number");
    for key in [json!(n), float] {
        let bodies = [
            json!({"type": "sec.n", "idempotency": {"key": key}}),
            json!({"type": "sec.n", "idempotency": key}),
            json!({"type": "sec.n", "dedupe": {"key": key}}),
        ];
        for body in &bodies {
            for path in ["/v1/jobs", "/v1/jobs/explain"] {
                let a = s.post(path, body.clone()).await;
                seen.record(&format!("{path} (numeric key)"), &a);
                a.problem(400, "bad-request");
            }
            let a = s
                .post(
                    "/v1/jobs/batch",
                    json!({"jobs": [body.clone(), {"type": "sec.n"}], "atomic": true}),
                )
                .await;
            seen.record("atomic batch item (numeric key)", &a);
            assert_eq!(a.problem(400, "bad-request")["index"], 0);
            let a = s
                .post("/v1/jobs/batch", json!({"jobs": [body.clone()]}))
                .await;
            seen.record("batch item (numeric key)", &a);
            assert_eq!(
                a.ok(200)["results"][0]["error"]["type"],
                "/problems/bad-request"
            );
        }
        for path in ["/v1/idempotency/lookup", "/v1/idempotency/release"] {
            let a = s.post(path, json!({"scope": "sec", "key": key})).await;
            seen.record(&format!("{path} (numeric key)"), &a);
            a.problem(400, "bad-request");
        }
    }
}

async fn raw_key_never_leaks(b: Backend) {
    capture_logs();
    let s = Server::start(b).await;
    let (k_body, t_body) = secret_key("body");
    let (k_head, t_head) = secret_key("head");
    let (k_batch, t_batch) = secret_key("btch");
    let (k_atomic, t_atomic) = secret_key("atom");
    let (k_redrive, t_redrive) = secret_key("redr");
    let (k_dash, t_dash) = secret_key("dash");
    let mut tails = vec![
        t_body.clone(),
        t_head.clone(),
        t_batch.clone(),
        t_atomic.clone(),
        t_redrive.clone(),
        t_dash.clone(),
    ];
    let mut seen = Seen::default();
    let before_log = logs().len();

    // Enqueue with the key in the body: accepted, replayed, conflict, explain.
    let req = json!({"type": "sec.t", "payload": {"n": 1}, "idempotency": {"key": k_body, "scope": "sec"}});
    let a = s.post("/v1/jobs", req.clone()).await;
    seen.record("enqueue (body key)", &a);
    let id_body = a.ok(201)["job_id"].as_str().expect("id").to_owned();
    let a = s.post("/v1/jobs", req.clone()).await;
    seen.record("replay (body key)", &a);
    assert_eq!(a.ok(200)["outcome"], "replayed");
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "sec.t", "payload": {"n": 2}, "idempotency": {"key": k_body, "scope": "sec"}}),
        )
        .await;
    seen.record("conflict (body key)", &a);
    a.problem(409, "idempotency-conflict");
    for body in [
        req.clone(),
        json!({"type": "sec.t", "payload": {"n": 2}, "idempotency": {"key": k_body, "scope": "sec"}}),
    ] {
        let a = s.post("/v1/jobs/explain", body).await;
        seen.record("explain (body key)", &a);
        a.ok(200);
    }
    // A wrongly typed field next to the key (a parser message) and a
    // validation error of another field.
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "sec.t", "idempotency": {"key": k_body, "ttl_ms": "soon"}}),
        )
        .await;
    seen.record("bad request (body key)", &a);
    a.problem(400, "bad-request");
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "sec.t", "max_attempts": 0, "idempotency": {"key": k_body}}),
        )
        .await;
    seen.record("validation (body key)", &a);
    a.problem(422, "validation");
    let a = s
        .post(
            "/v1/jobs",
            json!({"type": "sec.t", "idempotency": {"key": format!("{k_body}-other")}}),
        )
        .await;
    seen.record("other key", &a);
    a.ok(201);

    // Keys holding a quote or a backslash, which a parser message writes
    // escaped (`\"`, `\\`), and keys sent as numbers, which it writes in
    // backticks: no part of them is echoed, in the body's bare-string form,
    // as the value of a member of another type, in a batch item (plain and
    // atomic), beside the header, or in a lookup.
    for (n, sep) in ["\"", "\\", "\\\"", "\"\\", "\\\\\""]
        .into_iter()
        .enumerate()
    {
        let (k, tail) = escaped_key(&format!("esc{n}"), sep);
        tails.push(tail);
        escaped_key_never_echoed(&s, &mut seen, &k).await;
    }
    let number = 100_000_000_000_000 + uuid::Uuid::new_v4().as_u128() % 800_000_000_000_000;
    tails.push(number.to_string());
    numeric_key_never_echoed(&s, &mut seen, number).await;

    // The header, as a structured-field string and as a bare token.
    let quoted = format!("\"{k_head}\"");
    let a = s
        .post_with(
            "/v1/jobs",
            json!({"type": "sec.h", "payload": 1}),
            &[("idempotency-key", quoted.as_str())],
        )
        .await;
    seen.record("enqueue (header key)", &a);
    let id_head = a.ok(201)["job_id"].as_str().expect("id").to_owned();
    for (payload, status) in [(1, 200), (2, 409)] {
        let a = s
            .post_with(
                "/v1/jobs",
                json!({"type": "sec.h", "payload": payload}),
                &[("idempotency-key", k_head.as_str())],
            )
            .await;
        seen.record("replay/conflict (header key)", &a);
        assert_eq!(a.status.as_u16(), status, "{}", a.text);
        let a = s
            .post_with(
                "/v1/jobs/explain",
                json!({"type": "sec.h", "payload": payload}),
                &[("idempotency-key", k_head.as_str())],
            )
            .await;
        seen.record("explain (header key)", &a);
        a.ok(200);
    }
    // Header and body disagree; the header on a batch is refused.
    let a = s
        .post_with(
            "/v1/jobs",
            json!({"type": "sec.h", "idempotency": {"key": "different"}}),
            &[("idempotency-key", k_head.as_str())],
        )
        .await;
    seen.record("header vs body", &a);
    a.problem(422, "validation");
    let a = s
        .post_with(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "sec.h"}]}),
            &[("idempotency-key", k_head.as_str())],
        )
        .await;
    seen.record("batch with header", &a);
    a.problem(422, "validation");

    // Batches: non-atomic (accepted, replayed, conflict in one call) and atomic.
    let item = json!({"type": "sec.b", "payload": 1, "idempotency": {"key": k_batch}});
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [item, item, {"type": "sec.b", "payload": 2, "idempotency": {"key": k_batch}}]}),
        )
        .await;
    seen.record("batch", &a);
    let results = a.ok(200)["results"].clone();
    assert_eq!(results[0]["outcome"], "accepted", "{results}");
    assert!(results[2]["error"].is_object(), "{results}");
    let id_batch = results[0]["job_id"].as_str().expect("id").to_owned();
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "sec.a", "idempotency": {"key": k_atomic}}, {"type": "sec.b", "payload": 3, "idempotency": {"key": k_batch}}], "atomic": true}),
        )
        .await;
    seen.record("atomic batch conflict", &a);
    a.problem(409, "idempotency-conflict");
    let a = s
        .post(
            "/v1/jobs/batch",
            json!({"jobs": [{"type": "sec.a", "idempotency": {"key": k_atomic}}], "atomic": true}),
        )
        .await;
    seen.record("atomic batch", &a);
    let id_atomic = a.ok(200)["results"][0]["job_id"]
        .as_str()
        .expect("id")
        .to_owned();

    // Redrive with a key: a dead job, redriven twice with the same key.
    s.post(
        "/v1/jobs",
        json!({"type": "sec.d", "queue": "secdead", "max_attempts": 1}),
    )
    .await
    .ok(201);
    let claim = s
        .post("/v1/claim", json!({"worker": "w", "queues": ["secdead"]}))
        .await;
    let job = claim.ok(200)["jobs"][0].clone();
    let dead_id = job["id"].as_str().expect("claimed").to_owned();
    s.post(
        &format!("/v1/jobs/{dead_id}/fail"),
        json!({"lease_token": job["lease_token"], "error": "boom", "retryable": false}),
    )
    .await
    .ok(200);
    for expected in ["accepted", "replayed"] {
        let a = s
            .post_with(
                &format!("/v1/jobs/{dead_id}/redrive"),
                json!({}),
                &[("idempotency-key", k_redrive.as_str())],
            )
            .await;
        seen.record("redrive", &a);
        assert_eq!(a.ok(200)["outcome"], expected);
    }

    // Lookup and release, and lookups that find nothing.
    for (scope, key) in [
        ("sec", k_body.as_str()),
        ("default", k_head.as_str()),
        ("default", k_batch.as_str()),
        ("default", k_atomic.as_str()),
        ("idemq.redrive", k_redrive.as_str()),
        ("nope", k_body.as_str()),
    ] {
        let a = s
            .post(
                "/v1/idempotency/lookup",
                json!({"scope": scope, "key": key}),
            )
            .await;
        seen.record("lookup", &a);
        assert!(matches!(a.status.as_u16(), 200 | 404), "{}", a.text);
    }
    // A job for the dashboard lookup form, then the form and its answer.
    s.post(
        "/v1/jobs",
        json!({"type": "sec.f", "idempotency": {"key": k_dash}}),
    )
    .await
    .ok(201);
    let form = format!("kind=idempotency&scope=default&key={k_dash}");
    let a = s
        .send(
            Method::POST,
            "/bindings/lookup",
            Some(form.into_bytes()),
            &[("content-type", "application/x-www-form-urlencoded")],
        )
        .await;
    seen.record("dashboard lookup", &a);
    assert_eq!(a.status.as_u16(), 200, "{}", a.text);
    let a = s
        .post(
            "/v1/idempotency/release",
            json!({"scope": "sec", "key": k_body}),
        )
        .await;
    seen.record("release", &a);
    assert_eq!(a.ok(200)["released"], true);
    let a = s
        .post(
            "/v1/idempotency/release",
            json!({"scope": "sec", "key": k_body}),
        )
        .await;
    seen.record("release again", &a);
    assert_eq!(a.ok(200)["released"], false);

    // Everything that describes those jobs: API, events, dashboard, metrics.
    let ids = [&id_body, &id_head, &id_batch, &id_atomic, &dead_id];
    for id in ids {
        for path in [
            format!("/v1/jobs/{id}"),
            format!("/v1/jobs/{id}/events"),
            format!("/v1/jobs/{id}/runs"),
            format!("/jobs/{id}"),
        ] {
            let a = s.get(&path).await;
            assert_eq!(a.status.as_u16(), 200, "{path}: {}", a.text);
            seen.record(&path, &a);
        }
    }
    // The job shows the preview and digest only.
    let job = s.get(&format!("/v1/jobs/{id_head}")).await;
    let idem = &job.body["idempotency"];
    assert_eq!(idem["key_preview"], format!("{}…", &k_head[..8]));
    assert_eq!(idem["key_digest"].as_str().map(str::len), Some(16));
    // The release left an event.
    let events = s.get(&format!("/v1/jobs/{id_body}/events")).await;
    assert!(events.text.contains("binding_released"), "{}", events.text);
    for path in [
        "/",
        "/jobs",
        "/jobs?state=ready",
        "/bindings",
        "/dead",
        "/v1/jobs?limit=1000",
        "/v1/queues",
        "/metrics",
        "/dashboard/stats.json",
    ] {
        let a = s.get(path).await;
        assert_eq!(a.status.as_u16(), 200, "{path}: {}", a.text);
        seen.record(path, &a);
    }
    // The bindings page lists the live bindings (so it was really searched).
    let bindings = seen
        .texts
        .iter()
        .find(|(w, _)| w == "/bindings")
        .map(|(_, t)| t.clone())
        .expect("bindings page");
    assert!(bindings.contains(&k_head[..8]), "the preview is listed");

    for (what, text) in &seen.texts {
        assert_absent(&tails, what, text.as_bytes());
    }

    // The server's log output: it logged (the capture works) and no key.
    let log = logs();
    let ours = &log[before_log.min(log.len())..];
    // tower-http's request spans and events (DEBUG) name every request.
    assert!(
        ours.contains("finished processing request") && ours.contains("/v1/idempotency/lookup"),
        "the server's request log is captured"
    );
    assert!(!ours.is_empty());
    assert_absent(&tails, "the log output", log.as_bytes());

    // The database at rest.
    match b {
        Backend::Sqlite => {
            let file = s.db_file.clone().expect("db file");
            let dir = file.parent().expect("dir").to_owned();
            let mut scanned = 0;
            let mut scan = |label: &str| {
                for entry in std::fs::read_dir(&dir).expect("dir") {
                    let path = entry.expect("entry").path();
                    let bytes = std::fs::read(&path).expect("read");
                    scanned += bytes.len();
                    assert_absent(&tails, &format!("{} ({label})", path.display()), &bytes);
                }
            };
            scan("running");
            // The preview is stored (so the scan reads the real data).
            let wal = std::fs::read(file.with_extension("db-wal")).unwrap_or_default();
            let main = std::fs::read(&file).expect("db");
            let preview = format!("{}…", &k_head[..8]);
            assert!(
                [&wal, &main]
                    .iter()
                    .any(|b| b.windows(preview.len()).any(|w| w == preview.as_bytes())),
                "the key preview is in the database files"
            );
            println!("sqlite: {scanned} bytes of database files scanned");
            s.stop().await;
        }
        Backend::Postgres => {
            let db = s.pg_db.clone().expect("pg db");
            let out = std::process::Command::new("pg_dump")
                .args(["--data-only", "--inserts", &idemq_testkit::pg_url(&db)])
                .output()
                .expect("pg_dump (install postgresql-client)");
            assert!(
                out.status.success(),
                "pg_dump: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let preview = format!("{}…", &k_head[..8]);
            let dump = String::from_utf8_lossy(&out.stdout);
            assert!(dump.contains(&preview), "the dump holds the bindings");
            assert_absent(&tails, "pg_dump", &out.stdout);
            // Nor the statement statistics / activity views of the server.
            let stats = std::process::Command::new("psql")
                .args([
                    &idemq_testkit::pg_url(&db),
                    "-qtAc",
                    "SELECT coalesce(string_agg(query, E'\\n'), '') FROM pg_stat_activity",
                ])
                .output()
                .expect("psql");
            assert_absent(&tails, "pg_stat_activity", &stats.stdout);
            println!("postgres: {} bytes of pg_dump scanned", out.stdout.len());
            s.stop().await;
        }
        Backend::Redis => {
            let url = s.redis_url.clone().expect("redis url");
            let prefix = idemq::store::redis::RedisUrl::parse(&url)
                .expect("redis url")
                .prefix;
            let contents = idemq_testkit::redis_contents(&url, &prefix)
                .await
                .expect("read the installation");
            let preview = format!("{}…", &k_head[..8]);
            assert!(
                contents.contains(&preview),
                "the installation holds the bindings"
            );
            assert_absent(&tails, "the Redis installation", contents.as_bytes());
            // The append-only files of the server the test kit started.
            let mut scanned = 0;
            if let Some(dir) = idemq_testkit::redis_dir() {
                let mut paths = vec![dir.to_path_buf()];
                while let Some(path) = paths.pop() {
                    if path.is_dir() {
                        let entries = std::fs::read_dir(&path).expect("dir");
                        paths.extend(entries.map(|e| e.expect("entry").path()));
                    } else if let Ok(bytes) = std::fs::read(&path) {
                        scanned += bytes.len();
                        assert_absent(&tails, &path.display().to_string(), &bytes);
                    }
                }
            }
            println!(
                "redis: {} bytes of keys and values and {scanned} bytes of server files scanned",
                contents.len()
            );
            s.stop().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_key_never_leaks_sqlite() {
    raw_key_never_leaks(Backend::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_key_never_leaks_postgres() {
    raw_key_never_leaks(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raw_key_never_leaks_redis() {
    raw_key_never_leaks(Backend::Redis).await;
}

// ---------------------------------------------------------------------------
// 4. Every SQL statement binds its values.

/// Interpolations allowed in SQL built with `format!`: constant column lists
/// (and a list's filters) and one constant `SET` fragment, each checked to be
/// a string literal.
const CONSTANT_FRAGMENTS: &[&str] = &[
    "JOB_SELECT",
    "JOB_COLS",
    "ACTIVE_COLS",
    "COLUMNS",
    "LIST_FILTERS",
    "clear",
];

/// The string literal starting at `s` (`"…"` or `r#"…"#`): its content and
/// the rest of the source after it.
fn literal(s: &str) -> Option<(&str, &str)> {
    let s = s.trim_start();
    if let Some(rest) = s.strip_prefix('"') {
        let mut escaped = false;
        for (i, c) in rest.char_indices() {
            match c {
                '\\' if !escaped => escaped = true,
                '"' if !escaped => return Some((&rest[..i], &rest[i + 1..])),
                _ => escaped = false,
            }
        }
        return None;
    }
    let rest = s.strip_prefix('r')?;
    let hashes = rest.chars().take_while(|c| *c == '#').count();
    let rest = rest[hashes..].strip_prefix('"')?;
    let close = format!("\"{}", "#".repeat(hashes));
    let end = rest.find(&close)?;
    Some((&rest[..end], &rest[end + close.len()..]))
}

/// True when a literal reads like SQL.
fn is_sql(text: &str) -> bool {
    text.split(|c: char| !c.is_ascii_alphabetic()).any(|w| {
        matches!(
            w,
            "SELECT" | "INSERT" | "UPDATE" | "DELETE" | "WHERE" | "FROM" | "VALUES" | "SET"
        )
    })
}

/// The `{…}` interpolations of a format string (`{{` escapes skipped).
fn interpolations(fmt: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '{' {
            if chars.peek() == Some(&'{') {
                chars.next();
                continue;
            }
            let mut name = String::new();
            for c in chars.by_ref() {
                if c == '}' {
                    break;
                }
                name.push(c);
            }
            out.push(name);
        } else if c == '}' && chars.peek() == Some(&'}') {
            chars.next();
        }
    }
    out
}

/// Problems of one source file: SQL built from anything but constants.
fn sql_violations(file: &str, src: &str) -> Vec<String> {
    let mut bad = Vec::new();
    let line_of = |pos: usize| src[..pos].lines().count();
    // format!(…) whose format string is SQL.
    for (pos, _) in src.match_indices("format!(") {
        let Some((fmt, after)) = literal(&src[pos + "format!(".len()..]) else {
            continue;
        };
        if !is_sql(fmt) {
            continue;
        }
        let line = line_of(pos);
        if !after.trim_start().starts_with(')') {
            bad.push(format!(
                "{file}:{line}: format! builds SQL with arguments (bind them instead)"
            ));
        }
        for name in interpolations(fmt) {
            let ident = name.split(':').next().unwrap_or("");
            if !CONSTANT_FRAGMENTS.contains(&ident) {
                bad.push(format!(
                    "{file}:{line}: format! splices `{{{name}}}` into SQL (bind it instead)"
                ));
                continue;
            }
            // The fragment is a string literal in this file.
            let as_const = format!("const {ident}: &str =");
            let as_let = format!("let {ident} =");
            let defined = [as_const, as_let].iter().any(|d| {
                src.match_indices(d.as_str())
                    .any(|(p, _)| literal(&src[p + d.len()..]).is_some())
            });
            if !defined {
                bad.push(format!(
                    "{file}:{line}: `{ident}` is not a string literal in this file"
                ));
            }
        }
    }
    // push_str / write! into SQL text: only literals, never a runtime value.
    for needle in ["push_str(", "write!(", "writeln!("] {
        for (pos, _) in src.match_indices(needle) {
            let line = line_of(pos);
            let stmt: String = src[pos..].chars().take_while(|c| *c != ';').collect();
            let mut receiver: Vec<char> = src[..pos]
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '.')
                .collect();
            receiver.reverse();
            let receiver: String = receiver.into_iter().collect();
            let sqlish = is_sql(&stmt) || receiver.to_lowercase().contains("sql");
            if sqlish {
                let arg = &src[pos + needle.len()..];
                let literal_only = needle == "push_str("
                    && literal(arg).is_some_and(|(_, after)| after.trim_start().starts_with(')'));
                if !literal_only {
                    bad.push(format!(
                        "{file}:{line}: {needle}…) builds SQL from a runtime value"
                    ));
                }
            }
        }
    }
    // Text handed to the driver as "safe" or "raw" comes from a checked
    // `format!`, a literal or a constant compiled in (an embedded
    // migration), never from another source.
    let constant = |arg: &str| {
        let name: String = arg
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || *c == '_')
            .collect();
        !name.is_empty() && arg[name.len()..].starts_with(')')
    };
    for needle in ["AssertSqlSafe(", "raw_sql("] {
        for (pos, _) in src.match_indices(needle) {
            let arg = src[pos + needle.len()..].trim_start();
            let ok = literal(arg).is_some()
                || constant(arg)
                || arg.starts_with("sql)")
                || arg.starts_with("*sql)")
                || arg.starts_with("sqlx::AssertSqlSafe(");
            if !ok {
                bad.push(format!(
                    "{file}:{}: {needle}…) of an unchecked value",
                    line_of(pos)
                ));
            }
        }
    }
    bad
}

fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn sql_statements_bind_their_values() {
    let store = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../idemq/src/store");
    let mut files = Vec::new();
    rust_files(&store, &mut files);
    files.sort();
    assert!(files.len() >= 10, "the store sources: {files:?}");
    let mut bad = Vec::new();
    let mut sql_formats = 0;
    for file in &files {
        let src = std::fs::read_to_string(file).expect("read");
        sql_formats += src
            .match_indices("format!(")
            .filter(|(p, _)| literal(&src[p + 8..]).is_some_and(|(fmt, _)| is_sql(fmt)))
            .count();
        bad.extend(sql_violations(&file.display().to_string(), &src));
    }
    assert!(
        bad.is_empty(),
        "SQL with spliced values:\n{}",
        bad.join("\n")
    );
    assert!(
        sql_formats >= 5,
        "the scan found the constant-fragment cases"
    );
    println!(
        "sql: {} files, {sql_formats} format! statements with constant fragments only",
        files.len()
    );
}

#[test]
fn sql_check_catches_interpolation() {
    let cases = [
        r#"let sql = format!("SELECT * FROM t WHERE id = '{id}'");"#,
        r#"let sql = format!("DELETE FROM t WHERE id = '{}'", id);"#,
        r#"let sql = format!("UPDATE t SET a = {JOB_COLS} WHERE b = {}", x);"#,
        r#"const JOB_COLS: &str = "a"; let sql = format!("SELECT {JOB_COLS}, {name} FROM t");"#,
        r#"let mut sql = String::from("SELECT * FROM t WHERE q = "); sql.push_str(&q);"#,
        r#"let mut sql = String::new(); write!(sql, "SELECT {}", col);"#,
        r#"sqlx::query(sqlx::AssertSqlSafe(user_text))"#,
        r#"let sql = format!("SELECT {COLUMNS} FROM t");"#,
    ];
    for case in cases {
        assert!(
            !sql_violations("case", case).is_empty(),
            "not caught: {case}"
        );
    }
    let fine = [
        r#"const JOB_COLS: &str = "a, b"; let sql = format!("SELECT {JOB_COLS} FROM t WHERE id = ?1");"#,
        r#"let clear = "x = NULL"; let sql = format!("UPDATE t SET {clear} WHERE id = $1");"#,
        r#"let m = format!("cannot open {}: {e}", p.display());"#,
        r#"sqlx::query(sqlx::AssertSqlSafe(sql)).bind(id)"#,
    ];
    for case in fine {
        let v = sql_violations("case", case);
        assert!(v.is_empty(), "{case}: {v:?}");
    }
}
