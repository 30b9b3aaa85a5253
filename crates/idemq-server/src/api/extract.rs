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
        // Nothing to read: the operations whose body is optional accept none.
        None if is_blank(bytes) => Ok(()),
        Some(other) => Err(Problem::bad_request(format!(
            "{SEND_JSON}; this request declared Content-Type {other}"
        ))),
        None => Err(Problem::bad_request(format!(
            "{SEND_JSON}; this request declared no Content-Type"
        ))),
    }
}

async fn read_body<S: Send + Sync>(req: Request, state: &S) -> Result<Bytes, Problem> {
    let headers = req.headers().clone();
    let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
        if rejection.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            Problem::new(
                "payload-too-large",
                "the request body is over the body limit",
            )
            .with("field", "body")
        } else {
            Problem::bad_request("the request body could not be read")
        }
    })?;
    check_content_type(&headers, &bytes)?;
    Ok(bytes)
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
    let value = serde_path_to_error::deserialize(&mut de).map_err(body_error)?;
    de.end().map_err(Problem::bad_request)?;
    Ok(value)
}

/// Deserializes an already parsed JSON value into `T` (400 on failure).
pub(crate) fn from_value<T: DeserializeOwned>(value: Value) -> Result<T, Problem> {
    if !value.is_object() {
        return Err(Problem::bad_request("the request must be a JSON object"));
    }
    serde_path_to_error::deserialize(value).map_err(body_error)
}

/// A parse error as a problem whose `detail` and `field` name the member by
/// its dotted path (`dedupe.mode`), never the parser's internal types.
fn body_error<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> Problem {
    let mut path: Vec<String> = e
        .path()
        .iter()
        .filter_map(|seg| match seg {
            serde_path_to_error::Segment::Map { key } => Some(key.clone()),
            serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
            serde_path_to_error::Segment::Enum { variant } => Some(variant.clone()),
            serde_path_to_error::Segment::Unknown => None,
        })
        .collect();
    let message = e.inner().to_string();
    // serde names the member itself in these two messages: "unknown field
    // `x`, expected …" and "missing field `x`".
    let named = |prefix: &str| {
        let rest = message.strip_prefix(prefix)?;
        Some(rest.split('`').next().unwrap_or("").to_owned())
    };
    let (what, member) = if let Some(m) = named("unknown field `") {
        ("unknown member", Some(m))
    } else if let Some(m) = named("missing field `") {
        ("missing member", Some(m))
    } else {
        ("invalid member", None)
    };
    if let Some(m) = member
        && path.last() != Some(&m)
    {
        path.push(m);
    }
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
        let bytes = read_body(req, state).await?;
        // No body, or `null`: every member omitted.
        if is_blank(&bytes) || bytes.trim_ascii() == b"null" {
            return Ok(OptionalJson(T::default()));
        }
        parse(&bytes).map(OptionalJson)
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
    req: Request,
    next: Next,
) -> Response {
    let (general, batch) = limits;
    let limit = if BATCH_PATHS.contains(&req.uri().path()) {
        batch
    } else {
        general
    };
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
        return Problem::new(
            "payload-too-large",
            format!("the request body is over the body limit of {limit} bytes"),
        )
        .with("field", "body")
        .with("limit", limit)
        .into_response();
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
