//! RFC 9457 problem documents: every error the API answers, and the short
//! page each problem `type` links to.
//!
//! No problem ever holds a raw idempotency key: library errors carry only a
//! preview and a digest, and the messages of malformed bodies are scrubbed of
//! the values they quote (see [`Problem::bad_request`]).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use serde_json::{Map, Value, json};

/// Every problem type of the API: (name, status, title, what it means).
pub(crate) const TYPES: &[(&str, u16, &str, &str)] = &[
    (
        "bad-request",
        400,
        "Bad request",
        "The body is not JSON, not a JSON object, or a field has the wrong type. \
         Fix the request; retrying it as is cannot succeed.",
    ),
    (
        "validation",
        422,
        "Validation failed",
        "The request breaks a bound of the enqueue request or of the call. Members \
         `field` (a dotted path) and `reason` say which. Nothing was written.",
    ),
    (
        "idempotency-conflict",
        409,
        "Idempotency conflict",
        "The idempotency key (or explicit job id) is bound to a job accepted with other \
         fields. Members: `job_id`, `source`, `scope`, `key_preview`, `key_digest`, \
         `fields`. Nothing was written and neither request won: use a new key for new work.",
    ),
    (
        "lease-lost",
        409,
        "Lease lost",
        "The lease token is stale or unknown: the job was claimed again, or this attempt \
         was recorded as expired or timed out. Stop working on the job.",
    ),
    (
        "not-dead",
        409,
        "Job is not dead",
        "Only dead jobs can be redriven, and this request is not a replay of an \
         earlier redrive.",
    ),
    (
        "not-found",
        404,
        "Not found",
        "The job, binding, schedule or route does not exist.",
    ),
    (
        "unauthorized",
        401,
        "Unauthorized",
        "This server needs a token: send `Authorization: Bearer <token>`.",
    ),
    (
        "forbidden-host",
        403,
        "Forbidden host",
        "This server has no token, so it answers only requests whose `Host` header is a \
         loopback name (`127.0.0.1`, `[::1]`, `localhost`) or a host given with \
         `--allowed-host` (`IDEMQ_ALLOWED_HOSTS`). This keeps a web page from reaching an \
         open local server through DNS rebinding.",
    ),
    (
        "method-not-allowed",
        405,
        "Method not allowed",
        "The path exists but does not serve this method; the `Allow` header lists the \
         methods it serves.",
    ),
    (
        "payload-too-large",
        413,
        "Payload too large",
        "The payload (member `field`) is over the payload limit, or the body is over the \
         body limit. Nothing was written.",
    ),
    (
        "unavailable",
        503,
        "Service unavailable",
        "The backend is down or busy, or the request asked to wait (`wait_ms`) while the \
         server holds its most long-polls at once, in which case nothing was done. Retry \
         after the `Retry-After` header's seconds; retrying an enqueue with the same \
         idempotency key is always safe.",
    ),
    (
        "internal",
        500,
        "Internal error",
        "Something unexpected failed. The server logged it.",
    ),
];

/// An RFC 9457 problem document.
#[derive(Debug)]
pub(crate) struct Problem {
    name: &'static str,
    status: StatusCode,
    detail: String,
    extra: Map<String, Value>,
    retry_after: Option<u64>,
}

/// What every fallible handler returns.
pub(crate) type ApiResult<T> = Result<T, Problem>;

fn lookup(name: &str) -> Option<&'static (&'static str, u16, &'static str, &'static str)> {
    TYPES.iter().find(|t| t.0 == name)
}

impl Problem {
    /// A problem of a known type (`name` must be in [`TYPES`]).
    pub(crate) fn new(name: &'static str, detail: impl Into<String>) -> Self {
        let status = lookup(name).map_or(500, |t| t.1);
        Self {
            name,
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            detail: detail.into(),
            extra: Map::new(),
            retry_after: None,
        }
    }

    /// Adds an extension member.
    pub(crate) fn with(mut self, member: &str, value: impl Into<Value>) -> Self {
        self.extra.insert(member.to_owned(), value.into());
        self
    }

    /// The HTTP status.
    #[cfg(test)]
    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    /// `bad-request` for a body or query that cannot be read. Parser messages
    /// quote the offending value (`invalid type: string "…"`), which may be a
    /// raw idempotency key, so every quoted run is replaced by `"…"`.
    pub(crate) fn bad_request(message: impl std::fmt::Display) -> Self {
        Self::new("bad-request", scrub(&message.to_string()))
    }

    /// `validation` on `field`.
    pub(crate) fn validation(field: &str, reason: &str) -> Self {
        Self::new("validation", format!("invalid {field}: {reason}"))
            .with("field", field)
            .with("reason", reason)
    }

    /// `not-found` for `what`.
    pub(crate) fn not_found(what: impl std::fmt::Display) -> Self {
        Self::new("not-found", format!("{what} not found"))
    }

    /// The problem as a JSON object (for the items of a batch).
    pub(crate) fn to_json(&self) -> Value {
        let title = lookup(self.name).map_or("Error", |t| t.2);
        let mut doc = Map::new();
        doc.insert("type".into(), json!(format!("/problems/{}", self.name)));
        doc.insert("title".into(), json!(title));
        doc.insert("status".into(), json!(self.status.as_u16()));
        doc.insert("detail".into(), json!(self.detail));
        for (k, v) in &self.extra {
            doc.insert(k.clone(), v.clone());
        }
        Value::Object(doc)
    }
}

impl serde::Serialize for Problem {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl utoipa::PartialSchema for Problem {
    /// The document's members: the four of RFC 9457 (`type` one of
    /// [`TYPES`]) and the extension members some types add.
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
        let text = |d: &str| {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .description(Some(d))
        };
        let nullable_text = |d: &str| {
            ObjectBuilder::new()
                .schema_type(utoipa::openapi::schema::SchemaType::from_iter([
                    Type::String,
                    Type::Null,
                ]))
                .description(Some(d))
        };
        let names: Vec<&str> = TYPES.iter().map(|t| t.0).collect();
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .description(Some("An RFC 9457 problem document (`application/problem+json`)."))
            .property(
                "type",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some(names.iter().map(|n| format!("/problems/{n}"))))
                    .description(Some(format!("`/problems/<name>`: {}.", names.join(", ")))),
            )
            .required("type")
            .property("title", text("A short summary of the type."))
            .required("title")
            .property(
                "status",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .enum_values(Some(TYPES.iter().map(|t| t.1)))
                    .description(Some("The HTTP status.")),
            )
            .required("status")
            .property("detail", text("What happened (never a raw idempotency key)."))
            .required("detail")
            .property(
                "field",
                text("`validation`: the dotted path of the member; `payload-too-large`: the too large member."),
            )
            .property("reason", text("`validation`: the bound broken."))
            .property(
                "limit",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .description(Some("`payload-too-large`: the limit, in bytes or items.")),
            )
            .property("job_id", text("`idempotency-conflict`, `lease-lost`, `not-dead`: the job."))
            .property("state", text("`not-dead`: the job's state."))
            .property(
                "source",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .enum_values(Some([
                        idemq::ConflictSource::IdempotencyKey.as_str(),
                        idemq::ConflictSource::JobId.as_str(),
                    ]))
                    .description(Some("`idempotency-conflict`: where the conflict was found.")),
            )
            .property("scope", nullable_text("`idempotency-conflict`: the key's scope (null for `job_id`)."))
            .property("key_preview", nullable_text("`idempotency-conflict`: the key's preview (null for `job_id`)."))
            .property(
                "key_digest",
                nullable_text("`idempotency-conflict`: 16 hex digits of the key hash (null for `job_id`)."),
            )
            .property(
                "fields",
                ArrayBuilder::new()
                    .items(ObjectBuilder::new().schema_type(Type::String))
                    .description(Some("`idempotency-conflict`: the differing members, sorted dotted paths.")),
            )
            .property(
                "index",
                ObjectBuilder::new()
                    .schema_type(Type::Integer)
                    .minimum(Some(0))
                    .description(Some("Atomic batches: the index of the first failing item.")),
            )
            .property(
                "ok",
                ObjectBuilder::new()
                    .schema_type(Type::Boolean)
                    .description(Some("`/healthz` when unavailable: false.")),
            )
            .property("backend", text("`/healthz` when unavailable: the backend."))
            .into()
    }
}

impl utoipa::ToSchema for Problem {}

/// The words serde writes before a value it quotes in backticks
/// (`invalid type: integer `4711`, expected a string`, `unknown variant `x``).
/// Member names (`unknown field `x``, the server's `invalid member `a.b``)
/// follow other words and stay readable.
const BACKTICK_VALUES: &[&str] = &[
    "boolean ",
    "integer ",
    "floating point ",
    "character ",
    "unknown variant ",
];

/// Replaces with `…` the content of every double-quoted run of `s` and of
/// every backtick-quoted value serde echoes (see [`BACKTICK_VALUES`]).
///
/// serde writes a string value with Rust's escapes (`\"`, `\\`), so a
/// quoted run ends only at a quote that no backslash escapes; an
/// unterminated run is blanked to the end.
fn scrub(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        out.push(c);
        let close = match c {
            '"' => '"',
            '`' if BACKTICK_VALUES
                .iter()
                .any(|w| out[..out.len() - 1].ends_with(w)) =>
            {
                '`'
            }
            _ => continue,
        };
        out.push('…');
        let mut closed = false;
        while let Some(c) = chars.next() {
            if c == close {
                closed = true;
                break;
            }
            if c == '\\' && close == '"' {
                // The escaped character, whatever it is.
                chars.next();
            }
        }
        if closed {
            out.push(close);
        }
    }
    out
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(problem = self.name, detail = %self.detail, "request failed");
        }
        let body = serde_json::to_vec(&self.to_json()).unwrap_or_default();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"idemq\""),
            );
        }
        response
    }
}

impl From<idemq::Error> for Problem {
    fn from(e: idemq::Error) -> Self {
        use idemq::Error as E;
        match e {
            E::Validation { field, reason } => Problem::validation(&field, &reason),
            E::EnqueueIdempotencyConflict(c) => {
                let detail = format!(
                    "the {} is bound to job {} accepted with other fields: {}",
                    match c.source {
                        idemq::ConflictSource::IdempotencyKey => "idempotency key",
                        idemq::ConflictSource::JobId => "job id",
                    },
                    c.job_id,
                    c.fields.join(", ")
                );
                Problem::new("idempotency-conflict", detail)
                    .with("job_id", c.job_id.clone())
                    .with("source", c.source.as_str())
                    .with("scope", c.scope.clone())
                    .with("key_preview", c.key_preview.clone())
                    .with("key_digest", c.key_digest.clone())
                    .with("fields", c.fields.clone())
            }
            E::PayloadTooLarge { field, limit } => Problem::new(
                "payload-too-large",
                format!("{field} is larger than the limit of {limit} bytes"),
            )
            .with("field", field)
            .with("limit", limit),
            E::LeaseLost { job_id } => Problem::new(
                "lease-lost",
                format!("the lease on job {job_id} is stale or unknown"),
            )
            .with("job_id", job_id),
            E::NotDead { job_id, state } => Problem::new(
                "not-dead",
                format!("job {job_id} is not dead (it is {state})"),
            )
            .with("job_id", job_id)
            .with("state", state.as_str()),
            E::NotFound { what } => Problem::not_found(what),
            E::BatchItem { index, error } => Problem::from(*error).with("index", index),
            E::Unavailable { message } => {
                tracing::warn!(%message, "backend unavailable");
                let mut p = Problem::new(
                    "unavailable",
                    "the backend is down or busy; retry with the same idempotency key",
                );
                p.retry_after = Some(1);
                p
            }
            other => {
                tracing::error!(error = %other, "backend error");
                Problem::new(
                    "internal",
                    "an internal error occurred; the server logged it",
                )
            }
        }
    }
}

/// `unavailable` with a `Retry-After` of `secs` seconds.
pub(crate) fn unavailable(detail: &str, secs: u64) -> Problem {
    let mut p = Problem::new("unavailable", detail);
    p.retry_after = Some(secs);
    p
}

/// `GET /problems/{name}`: a short page on one problem type.
#[utoipa::path(
    get,
    path = "/problems/{name}",
    operation_id = "getProblemType",
    tag = "operations",
    params(("name" = String, Path, description = "A problem name, e.g. `validation`")),
    responses(
        (status = 200, description = "A short HTML page on the problem type", content_type = "text/html", body = String),
        (status = 404, description = "No such problem type", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn page(
    super::extract::Path(name): super::extract::Path<String>,
) -> ApiResult<Html<String>> {
    let (name, status, title, text) =
        lookup(&name).ok_or_else(|| Problem::not_found("problem type"))?;
    Ok(Html(format!(
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{title} — idemq</title></head>\n<body><h1>{title}</h1>\n\
         <p><code>type: /problems/{name}</code>, HTTP status {status}.</p>\n\
         <p>{}</p>\n<p>Every idemq error is an RFC 9457 problem document \
         (<code>application/problem+json</code>) with <code>type</code>, \
         <code>title</code>, <code>status</code> and <code>detail</code>.</p>\n\
         </body></html>\n",
        html_escape(text)
    )))
}

fn html_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '`' => {}
            c => out.push(c),
        }
    }
    out
}

/// Turns the router's bare 405 (a known path, another method) into a
/// `method-not-allowed` problem, keeping its `Allow` header.
pub(crate) async fn method_not_allowed(response: Response) -> Response {
    if response.status() != StatusCode::METHOD_NOT_ALLOWED {
        return response;
    }
    let allow = response.headers().get(header::ALLOW).cloned();
    let detail = "this path does not serve this method; the Allow header lists those it serves";
    let mut problem = Problem::new("method-not-allowed", detail).into_response();
    if let Some(allow) = allow {
        problem.headers_mut().insert(header::ALLOW, allow);
    }
    problem
}

/// The 404 of every unknown route.
pub(crate) async fn no_route() -> Problem {
    Problem::not_found("route")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrub_removes_quoted_values() {
        assert_eq!(
            scrub("invalid type: string \"secret-key\", expected a map at line 1"),
            "invalid type: string \"…\", expected a map at line 1"
        );
        assert_eq!(scrub("unterminated \"abc"), "unterminated \"…");
    }

    #[test]
    fn scrub_honours_escapes() {
        // serde's `string "ord\"er-SECRET"` (the key `ord"er-SECRET`).
        let key = "ord\"er-SECRET";
        let message = format!("invalid type: string {key:?}, expected an object at line 1");
        assert_eq!(
            scrub(&message),
            "invalid type: string \"…\", expected an object at line 1"
        );
        for key in [
            "a\\SECRET",
            "a\\\"SECRET",
            "a\"\\SECRET",
            "a\\",
            "\"",
            "a\nSECRET",
        ] {
            let message = format!("x {key:?} y {:?} z", "b");
            let scrubbed = scrub(&message);
            assert_eq!(scrubbed, "x \"…\" y \"…\" z", "{message}");
        }
        assert_eq!(scrub("open \"a\\\"SECRET"), "open \"…");
    }

    #[test]
    fn scrub_blanks_echoed_values_in_backticks() {
        for (message, scrubbed) in [
            (
                "invalid member `idempotency.key`: invalid type: integer `4711`, expected a string",
                "invalid member `idempotency.key`: invalid type: integer `…`, expected a string",
            ),
            (
                "invalid type: floating point `47.5`, expected a string",
                "invalid type: floating point `…`, expected a string",
            ),
            (
                "invalid type: boolean `true`, expected a string",
                "invalid type: boolean `…`, expected a string",
            ),
            (
                "invalid value: character `x`, expected a digit",
                "invalid value: character `…`, expected a digit",
            ),
            (
                "unknown variant `SECRET`, expected one of `cancel`, `purge`, `redrive`",
                "unknown variant `…`, expected one of `cancel`, `purge`, `redrive`",
            ),
            (
                "unknown member `dedupe.mode`",
                "unknown member `dedupe.mode`",
            ),
            (
                "unknown field `colour`, expected `type` or `payload`",
                "unknown field `colour`, expected `type` or `payload`",
            ),
            (
                "expected `,` or `}` at line 1 column 9",
                "expected `,` or `}` at line 1 column 9",
            ),
            ("integer `12", "integer `…"),
        ] {
            assert_eq!(scrub(message), scrubbed);
        }
    }

    #[test]
    fn every_type_has_its_status() {
        for (name, status, ..) in TYPES {
            assert_eq!(Problem::new(name, "x").status().as_u16(), *status);
        }
    }
}
