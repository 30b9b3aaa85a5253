//! Reading requests: JSON bodies under a size limit, queries, paths and the
//! `Idempotency-Key` header, with every rejection turned into a problem
//! document (never axum's plain-text rejections, never a 500).

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::problem::Problem;

/// The `Idempotency-Key` request header.
pub(crate) const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// Room for everything in a body besides the payload (64 KiB).
pub(crate) const BODY_OVERHEAD: usize = 64 * 1024;

/// The body limit of `POST /v1/jobs/batch` (16 MiB of payloads plus room for the rest).
pub(crate) const BATCH_BODY_LIMIT: usize = idemq::MAX_BATCH_BYTES + BODY_OVERHEAD;

/// The paths whose body may hold many payloads or results.
pub(crate) const BATCH_PATHS: &[&str] = &["/v1/jobs/batch", "/v1/jobs/complete", "/v1/claim"];

/// A JSON object body, deserialized into `T`.
pub(crate) struct Json<T>(pub(crate) T);

/// A JSON object body that may be empty (then `T::default()`).
pub(crate) struct OptionalJson<T>(pub(crate) T);

/// The body of an operation that takes none: nothing, or an empty JSON
/// object (or `null`) sent as JSON. Anything else is refused before the
/// operation runs: a body of another type or of no type, as every body is,
/// and a member, as an unknown member is.
pub(crate) struct NoBody;

/// What a [`NoBody`] body may hold: no member at all.
#[derive(Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoMembers {}

/// A body checked to be a JSON object, not parsed yet (enqueue merges the
/// `Idempotency-Key` header into it first).
pub(crate) struct RawJson(pub(crate) Bytes);

/// A query string deserialized into `T`.
pub(crate) struct Query<T>(pub(crate) T);

/// Path parameters deserialized into `T`.
pub(crate) struct Path<T>(pub(crate) T);

/// How to send a JSON body, for the `detail` of a refused one.
const SEND_JSON: &str = "the body must be JSON sent with Content-Type: application/json \
     (with curl: --json '{...}', or -H 'Content-Type: application/json' -d '{...}')";

/// Refuses a body whose content type is not JSON. A missing type is refused
/// too: a page on another site can send a body without one and without a
/// CORS preflight, which is exactly what this check keeps out.
fn check_content_type(headers: &HeaderMap, bytes: &[u8]) -> Result<(), Problem> {
    let essence = headers
        .get(header::CONTENT_TYPE)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).to_ascii_lowercase());
    let essence = essence
        .as_deref()
        .map(|v| v.split(';').next().unwrap_or("").trim());
    match essence {
        Some(e) if e == "application/json" || e.ends_with("+json") => Ok(()),
        // Nothing to read, so nothing to declare (an operation that needs
        // a body then refuses it as not an object).
        None if is_blank(bytes) => Ok(()),
        Some(other) => Err(Problem::bad_request(format!(
            "{SEND_JSON}; this request declared Content-Type {other}"
        ))),
        None => Err(Problem::bad_request(format!(
            "{SEND_JSON}; this request declared no Content-Type"
        ))),
    }
}

/// The body limit of a request, as [`limit_declared_length`] decided it.
#[derive(Clone, Copy)]
struct BodyLimit(usize);

/// Reads the whole body (under the route's limit), without looking at its type.
async fn read_bytes<S: Send + Sync>(
    req: Request,
    state: &S,
) -> Result<(HeaderMap, Bytes), Problem> {
    let headers = req.headers().clone();
    let limit = req.extensions().get::<BodyLimit>().copied();
    let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            too_large(limit.map(|l| l.0))
        } else {
            Problem::bad_request("the request body could not be read")
        }
    })?;
    Ok((headers, bytes))
}

/// The `413` of a body over the body limit (`limit` in bytes, when known).
fn too_large(limit: Option<usize>) -> Problem {
    match limit {
        Some(limit) => Problem::new(
            "payload-too-large",
            format!("the request body is over the body limit of {limit} bytes"),
        )
        .with("field", "body")
        .with("limit", limit),
        None => Problem::new(
            "payload-too-large",
            "the request body is over the body limit",
        )
        .with("field", "body"),
    }
}

async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, Problem> {
    let (headers, bytes) = read_bytes(req, state).await?;
    check_content_type(&headers, &bytes)?;
    Ok(bytes)
}

/// Reads an optional body: `None` when it is empty (only whitespace), whatever
/// type it declares (there is nothing to read), else the bytes once their
/// type is checked.
async fn read_optional_body<S: Send + Sync>(
    req: Request,
    state: &S,
) -> Result<Option<Bytes>, Problem> {
    let (headers, bytes) = read_bytes(req, state).await?;
    if is_blank(&bytes) {
        return Ok(None);
    }
    check_content_type(&headers, &bytes)?;
    Ok(Some(bytes))
}

/// The largest declared body an oversized request is read through (for at
/// most [`DRAIN_TIME`]) before its `413`, so that its client gets the
/// answer (larger ones are answered at once and the connection closed).
const DRAIN_LIMIT: u64 = 64 * 1024 * 1024;

/// The longest an oversized request is read before its `413`.
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// True when the body is only whitespace.
fn is_blank(bytes: &[u8]) -> bool {
    bytes.iter().all(u8::is_ascii_whitespace)
}

/// Checks that the body is a JSON object before any parsing: serde would
/// read a struct from an array too.
fn check_object(bytes: &[u8]) -> Result<(), Problem> {
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => Ok(()),
        _ => Err(Problem::bad_request("the body must be a JSON object")),
    }
}

/// Parses a JSON object body into `T` (400 `bad-request` on any failure,
/// naming the member at fault by its dotted path).
pub(crate) fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Problem> {
    check_object(bytes)?;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut de)
        .map_err(|e| body_error(e, || serde_json::from_slice(bytes).ok()))?;
    de.end().map_err(Problem::bad_request)?;
    Ok(value)
}

/// Deserializes an already parsed JSON value into `T` (400 on failure).
pub(crate) fn from_value<T: DeserializeOwned>(value: Value) -> Result<T, Problem> {
    if !value.is_object() {
        return Err(Problem::bad_request("the request must be a JSON object"));
    }
    // The value is consumed: keep the one member an error may need to be
    // read again (see `retry_error`), which is small.
    let retry = value
        .get(RETRY)
        .filter(|r| r.is_object())
        .map(|r| serde_json::json!({ RETRY: r }));
    serde_path_to_error::deserialize(value).map_err(|e| body_error(e, || retry))
}

/// The dotted path's segments of a parse error.
fn segments(path: &serde_path_to_error::Path) -> Vec<String> {
    path.iter()
        .filter_map(|seg| match seg {
            serde_path_to_error::Segment::Map { key } => Some(key.clone()),
            serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
            serde_path_to_error::Segment::Enum { variant } => Some(variant.clone()),
            serde_path_to_error::Segment::Unknown => None,
        })
        .collect()
}

/// The value at a parse error's path in the document it was read from.
fn at<'v>(root: &'v Value, path: &serde_path_to_error::Path) -> Option<&'v Value> {
    path.iter().try_fold(root, |v, seg| match seg {
        serde_path_to_error::Segment::Map { key } => v.get(key),
        serde_path_to_error::Segment::Seq { index } => v.get(index),
        serde_path_to_error::Segment::Enum { variant } => v.get(variant),
        serde_path_to_error::Segment::Unknown => None,
    })
}

/// The member of an enqueue request (and of a schedule's template) that
/// holds the retry policy.
const RETRY: &str = "retry";

/// A parse error as a problem whose `detail` and `field` name the member by
/// its dotted path (`dedupe.mode`), never the parser's internal types.
/// `source` gives the document again, for an error the path cannot follow.
fn body_error<E: std::fmt::Display>(
    e: serde_path_to_error::Error<E>,
    source: impl FnOnce() -> Option<Value>,
) -> Problem {
    let mut path = segments(e.path());
    let mut message = e.inner().to_string();
    // A list over its count bound stops the parse at the item past it: the
    // call's own answer for that bound, naming the list.
    if let Some(overflow) = super::bounded::Overflow::find(&message) {
        return overflow.problem(&path.join("."));
    }
    // The retry policy is read by its `kind` from a buffer (an internally
    // tagged enum), where the path stops: read the object again by its
    // kind to find the member at fault. A bad `kind` is named with the
    // kinds there are (serde speaks of a "variant identifier").
    if named_member(&message).is_none() {
        if path.ends_with(&[RETRY.to_owned(), "kind".to_owned()]) {
            message = RETRY_KINDS.to_owned();
        } else if path.last().is_some_and(|last| last == RETRY)
            && let Some(root) = source()
            && let Some((inner, why)) = at(&root, e.path()).and_then(retry_error)
        {
            path.extend(inner);
            message = why;
        }
    }
    member_problem(path, &message)
}

/// The member serde names itself in two messages: "unknown field `x`,
/// expected …" and "missing field `x`".
fn named_member(message: &str) -> Option<(&'static str, String)> {
    let named = |prefix: &str| {
        let rest = message.strip_prefix(prefix)?;
        Some(rest.split('`').next().unwrap_or("").to_owned())
    };
    if let Some(m) = named("unknown field `") {
        Some(("unknown member", m))
    } else {
        named("missing field `").map(|m| ("missing member", m))
    }
}

/// The `400` of a parse error at `path` (the member's segments) with serde's `message`.
fn member_problem(mut path: Vec<String>, message: &str) -> Problem {
    let what = match named_member(message) {
        Some((what, m)) => {
            if path.last() != Some(&m) {
                path.push(m);
            }
            what
        }
        None => "invalid member",
    };
    let field = path.join(".");
    if field.is_empty() {
        return Problem::bad_request(message);
    }
    let detail = match what {
        "invalid member" => format!("{what} `{field}`: {message}"),
        _ => format!("{what} `{field}`"),
    };
    Problem::bad_request(detail).with("field", field)
}

/// What a retry policy's `kind` may be.
const RETRY_KINDS: &str = "must be `exponential`, `fixed` or `none`";

/// The member at fault in a retry policy that did not parse, and serde's
/// message about it, found by reading the object again, `kind` aside,
/// through the form of its kind that the library reads it with
/// ([`idemq::wire::retry`]). `None` when that finds no fault (the first
/// message then stands).
fn retry_error(retry: &Value) -> Option<(Vec<String>, String)> {
    use idemq::wire::retry::{Exponential, Fixed, NoRetries};
    fn fault<T: DeserializeOwned>(
        retry: &serde_json::Map<String, Value>,
    ) -> Option<(Vec<String>, String)> {
        let mut members = retry.clone();
        members.remove("kind");
        serde_path_to_error::deserialize::<_, T>(Value::Object(members))
            .err()
            .map(|e| (segments(e.path()), e.inner().to_string()))
    }
    let kind = || Some((vec!["kind".to_owned()], RETRY_KINDS.to_owned()));
    let retry = retry.as_object()?;
    match retry.get("kind") {
        // A missing `kind` is named by serde's own message.
        None => None,
        Some(Value::String(k)) => match k.as_str() {
            "exponential" => fault::<Exponential>(retry),
            "fixed" => fault::<Fixed>(retry),
            "none" => fault::<NoRetries>(retry),
            _ => kind(),
        },
        Some(_) => kind(),
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        let bytes = read_body(req, state).await?;
        parse(&bytes).map(Json)
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJson<T> {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        // No body, or `null`: every member omitted.
        let Some(bytes) = read_optional_body(req, state).await? else {
            return Ok(OptionalJson(T::default()));
        };
        if bytes.trim_ascii() == b"null" {
            return Ok(OptionalJson(T::default()));
        }
        parse(&bytes).map(OptionalJson)
    }
}

impl<S: Send + Sync> FromRequest<S> for NoBody {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        let OptionalJson(NoMembers {}) = OptionalJson::from_request(req, state).await?;
        Ok(NoBody)
    }
}

impl<S: Send + Sync> FromRequest<S> for RawJson {
    type Rejection = Problem;

    async fn from_request(req: Request, state: &S) -> Result<Self, Problem> {
        let bytes = read_body(req, state).await?;
        check_object(&bytes)?;
        Ok(RawJson(bytes))
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Query<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Query(q.0))
            .map_err(|e| Problem::bad_request(e.body_text()))
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Problem> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| Path(p.0))
            .map_err(|e| Problem::bad_request(e.body_text()))
    }
}

/// Reads an optional number of a query string (`limit`, `wait_ms`): an
/// empty value (`?limit=`, as an HTML form sends it) means omitted, as for
/// every query member; any other value must parse. Use with
/// `#[serde(default, deserialize_with = …)]`.
pub(crate) fn query_number<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr,
    T::Err: std::fmt::Display,
{
    let text: Option<String> = serde::Deserialize::deserialize(d)?;
    match text.as_deref() {
        None | Some("") => Ok(None),
        Some(text) => text.parse().map(Some).map_err(serde::de::Error::custom),
    }
}

/// The key of an `Idempotency-Key` header, if one was sent. The value may be
/// a structured-field string (`"k"`: the content between the quotes, with
/// `\"` and `\\` escapes) or a bare token (the whole value). The key is
/// never logged and never echoed in an error.
pub(crate) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Problem> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::validation(
            "Idempotency-Key",
            "must be sent at most once",
        ));
    }
    let text = std::str::from_utf8(value.as_bytes())
        .map_err(|_| Problem::validation("Idempotency-Key", "must be UTF-8"))?
        .trim();
    let key = match text.strip_prefix('"') {
        Some(rest) => parse_sf_string(rest).ok_or_else(|| {
            Problem::validation(
                "Idempotency-Key",
                "must be a structured-field string (\"…\") or a bare token",
            )
        })?,
        None => text.to_owned(),
    };
    Ok(Some(key))
}

/// The content of a structured-field string whose opening quote is already
/// consumed (RFC 9651 3.3.3): printable ASCII, `\"` and `\\` escapes, a
/// closing quote that ends the value.
fn parse_sf_string(rest: &str) -> Option<String> {
    let mut out = String::with_capacity(rest.len());
    let mut chars = rest.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next()? {
                c @ ('"' | '\\') => out.push(c),
                _ => return None,
            },
            '"' => return chars.as_str().is_empty().then_some(out),
            ' '..='~' => out.push(c),
            _ => return None,
        }
    }
    None
}

/// Refuses a body whose declared length is over `limit` before reading it
/// (a streamed body is cut by the extractors at the same limit).
pub(crate) async fn limit_declared_length(
    axum::extract::State(limits): axum::extract::State<(usize, usize)>,
    mut req: Request,
    next: Next,
) -> Response {
    let (general, batch) = limits;
    let limit = if BATCH_PATHS.contains(&req.uri().path()) {
        batch
    } else {
        general
    };
    req.extensions_mut().insert(BodyLimit(limit));
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(n) = declared.filter(|&n| n > limit as u64) {
        // Read what the client sends (and drop it, chunk by chunk) before
        // answering, up to a size and a time: a client still writing its
        // body when the connection closes meets a broken pipe instead of
        // this answer, and one that sends nothing is answered soon anyway.
        if n <= DRAIN_LIMIT {
            use futures_util::StreamExt;
            let mut body = req.into_body().into_data_stream();
            let drain = async { while let Some(Ok(_)) = body.next().await {} };
            let _ = tokio::time::timeout(DRAIN_TIME, drain).await;
        }
        return too_large(Some(limit)).into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &'static str) -> Result<Option<String>, Problem> {
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, axum::http::HeaderValue::from_static(v));
        idempotency_key(&h)
    }

    #[test]
    fn header_forms() {
        assert_eq!(key("\"k-1\"").unwrap().as_deref(), Some("k-1"));
        assert_eq!(key("\"a\\\"b\\\\c\"").unwrap().as_deref(), Some("a\"b\\c"));
        assert_eq!(key("bare:token").unwrap().as_deref(), Some("bare:token"));
        assert!(key("\"open").is_err());
        assert!(key("\"a\"b").is_err());
        assert!(key("\"a\\nb\"").is_err());
        assert_eq!(idempotency_key(&HeaderMap::new()).unwrap(), None);
    }

    #[test]
    fn object_check() {
        assert!(check_object(b"  {}").is_ok());
        assert!(check_object(b"[1]").is_err());
        assert!(check_object(b"").is_err());
    }
}
