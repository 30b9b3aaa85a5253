//! `POST /v1/jobs`, `POST /v1/jobs/batch` and `POST /v1/jobs/explain`.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use idemq::{BatchOptions, EnqueueRequest, EnqueueResult, Outcome};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema, Type};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::ApiState;
use super::extract::{Json, RawJson, from_value, idempotency_key, parse};
use super::problem::{ApiResult, Problem};

/// The body of `POST /v1/jobs/batch`. Items are read one by one so that a
/// malformed item is that item's error, not the whole batch's.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct BatchBody {
    /// At most 1,000, counted as they are parsed (else `413`).
    #[serde(deserialize_with = "super::bounded::batch_items")]
    jobs: Vec<Value>,
    #[serde(default, deserialize_with = "idemq::wire::null_as_default")]
    atomic: bool,
}

impl PartialSchema for BatchBody {
    /// Two forms, told apart by `atomic`: an atomic batch refuses the whole
    /// call for one bad item, so its items must be enqueue requests; any
    /// other batch answers each item on its own (a malformed one is that
    /// item's `error`), so its items may be any JSON value.
    fn schema() -> RefOr<Schema> {
        let form = |atomic: ObjectBuilder, items: RefOr<Schema>, description: &str| {
            ObjectBuilder::new()
                .schema_type(Type::Object)
                .property(
                    "jobs",
                    ArrayBuilder::new()
                        .items(items)
                        .max_items(Some(idemq::MAX_BATCH_ITEMS))
                        .description(Some("The requests, decided in order")),
                )
                .required("jobs")
                .property("atomic", atomic)
                .additional_properties(Some(
                    utoipa::openapi::schema::AdditionalProperties::FreeForm(false),
                ))
                .description(Some(description))
        };
        OneOfBuilder::new()
            .item(form(
                ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::SchemaType::from_iter([
                        Type::Boolean,
                        Type::Null,
                    ]))
                    .enum_values(Some([Value::Bool(false), Value::Null])),
                ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::SchemaType::AnyValue)
                    .into(),
                "Each item is decided on its own (any value: a malformed item is its own error)",
            ))
            .item(
                form(
                    ObjectBuilder::new()
                        .schema_type(Type::Boolean)
                        .enum_values(Some([true])),
                    Ref::from_schema_name(EnqueueRequest::name()).into(),
                    "All or nothing",
                )
                .required("atomic"),
            )
            .description(Some("At most 1,000 requests and 16 MiB"))
            .into()
    }
}

impl ToSchema for BatchBody {
    fn name() -> std::borrow::Cow<'static, str> {
        "BatchRequest".into()
    }
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        schemas.push((EnqueueRequest::name().into(), EnqueueRequest::schema()));
        EnqueueRequest::schemas(schemas);
    }
}

/// One item of a batch's answer.
#[derive(Serialize, ToSchema)]
#[serde(untagged)]
pub(crate) enum BatchItem {
    /// The item's result.
    Result(EnqueueResult),
    /// The item's error.
    Error {
        /// The problem document.
        error: Problem,
    },
}

/// A batch's answer.
#[derive(Serialize, ToSchema)]
#[schema(as = BatchResults)]
pub(crate) struct BatchResults {
    /// One per request, in order.
    results: Vec<BatchItem>,
}

/// The request of an enqueue or explain body, with the `Idempotency-Key`
/// header merged in as `idempotency.key` (scope and ttl still come from the
/// body's `idempotency` object). A body key that differs is a validation error.
fn request(headers: &HeaderMap, body: &[u8]) -> ApiResult<EnqueueRequest> {
    let Some(key) = idempotency_key(headers)? else {
        return parse(body);
    };
    let mut value: Value = parse(body)?;
    if let Some(obj) = value.as_object_mut() {
        match obj.get_mut("idempotency") {
            None | Some(Value::Null) => {
                obj.insert("idempotency".into(), json!({ "key": key }));
            }
            Some(Value::Object(idem)) => match idem.get("key") {
                None | Some(Value::Null) => {
                    idem.insert("key".into(), Value::String(key));
                }
                Some(Value::String(k)) if *k == key => {}
                Some(_) => {
                    return Err(Problem::validation(
                        "idempotency.key",
                        "differs from the Idempotency-Key header",
                    ));
                }
            },
            // Not an object: deserialization names the wrong type.
            Some(_) => {}
        }
    }
    from_value(value)
}

/// The answer of an enqueue: 201 for a new job, 200 otherwise.
fn enqueued(result: &EnqueueResult) -> Response {
    let status = if result.outcome == Outcome::Accepted {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    (status, axum::Json(result)).into_response()
}

/// Enqueues one job.
#[utoipa::path(
    post,
    path = "/v1/jobs",
    operation_id = "enqueueJob",
    tag = "enqueue",
    request_body = EnqueueRequest,
    params(("Idempotency-Key" = Option<idemq::openapi::IdempotencyKeyHeader>, Header,
        description = "The same as `idempotency.key`: a structured-field string (`\"k\"`) or a bare token")),
    responses(
        (status = 201, description = "A new job was accepted", body = EnqueueResult),
        (status = 200, description = "replayed, coalesced, replaced or non_replaceable", body = EnqueueResult),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Idempotency conflict", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Payload or body too large", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn enqueue(
    State(s): State<ApiState>,
    headers: HeaderMap,
    RawJson(body): RawJson,
) -> ApiResult<Response> {
    let req = request(&headers, &body)?;
    drop(body);
    let result = s.queue().enqueue_with_result(req).await?;
    Ok(enqueued(&result))
}

/// Enqueues up to 1,000 jobs, decided in order.
#[utoipa::path(
    post,
    path = "/v1/jobs/batch",
    operation_id = "enqueueBatch",
    tag = "enqueue",
    request_body = BatchBody,
    responses(
        (status = 200, description = "One result or error per item, in request order", body = BatchResults),
        (status = 400, description = "Malformed body (or, atomic, a malformed item: member `index`)", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Atomic: the first failing item's conflict, member `index`", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Over 1,000 items or 16 MiB", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "The Idempotency-Key header was sent, or (atomic) the first failing item's validation, member `index`", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn batch(
    State(s): State<ApiState>,
    headers: HeaderMap,
    Json(body): Json<BatchBody>,
) -> ApiResult<Response> {
    if headers.contains_key(super::extract::IDEMPOTENCY_KEY) {
        return Err(Problem::validation(
            "Idempotency-Key",
            "is refused on a batch: put an idempotency key on each item",
        ));
    }
    let parsed: Vec<Result<EnqueueRequest, Problem>> =
        body.jobs.into_iter().map(from_value).collect();
    if body.atomic {
        return atomic(&s, parsed).await;
    }
    let mut reqs = Vec::with_capacity(parsed.len());
    let mut slots = Vec::with_capacity(parsed.len());
    for item in parsed {
        match item {
            Ok(req) => {
                reqs.push(req);
                slots.push(None);
            }
            Err(p) => slots.push(Some(p)),
        }
    }
    let mut stored = if reqs.is_empty() {
        Vec::new()
    } else {
        s.queue()
            .enqueue_many(reqs, BatchOptions { atomic: false })
            .await?
    }
    .into_iter();
    let results: Vec<BatchItem> = slots
        .into_iter()
        .map(|slot| {
            let item = match slot {
                Some(p) => Err(p),
                None => match stored.next() {
                    Some(Ok(r)) => Ok(r),
                    Some(Err(e)) => Err(Problem::from(e)),
                    None => Err(Problem::new("internal", "a batch result is missing")),
                },
            };
            match item {
                Ok(r) => BatchItem::Result(r),
                Err(p) => BatchItem::Error { error: p },
            }
        })
        .collect();
    Ok(axum::Json(BatchResults { results }).into_response())
}

/// An all-or-nothing batch: any failing item fails the call with that item's
/// problem and member `index`, and nothing is written.
async fn atomic(s: &ApiState, parsed: Vec<Result<EnqueueRequest, Problem>>) -> ApiResult<Response> {
    let mut reqs = Vec::with_capacity(parsed.len());
    let mut malformed = None;
    for (index, item) in parsed.into_iter().enumerate() {
        match item {
            Ok(req) => reqs.push(req),
            Err(problem) => {
                malformed = Some((index, problem));
                break;
            }
        }
    }
    if let Some((index, problem)) = malformed {
        // An earlier item may still fail (a conflict, a passed deadline, an
        // effect of the items before it). Let the library decide the items
        // before the malformed one, with a request that cannot pass
        // validation in its place: it answers the first failing index and
        // writes nothing (a refused atomic batch never writes).
        reqs.push(EnqueueRequest::new(""));
        let err = match s
            .queue()
            .enqueue_many(reqs, BatchOptions { atomic: true })
            .await
        {
            Err(idemq::Error::BatchItem { index: i, error }) if i != index => {
                idemq::Error::BatchItem { index: i, error }
            }
            // The malformed item is the first to fail: its own problem (its
            // detail and dotted `field`), as a non-atomic batch answers it.
            Err(idemq::Error::BatchItem { .. }) => return Err(problem.with("index", index)),
            Err(e) => e,
            Ok(_) => {
                return Err(Problem::new("internal", "the atomic batch was not refused"));
            }
        };
        return Err(err.into());
    }
    let results: Vec<BatchItem> = s
        .queue()
        .enqueue_many(reqs, BatchOptions { atomic: true })
        .await?
        .into_iter()
        .map(|r| match r {
            Ok(r) => BatchItem::Result(r),
            Err(e) => BatchItem::Error {
                error: Problem::from(e),
            },
        })
        .collect();
    Ok(axum::Json(BatchResults { results }).into_response())
}

/// Says what an enqueue would do now, and why. Writes nothing.
#[utoipa::path(
    post,
    path = "/v1/jobs/explain",
    operation_id = "explainEnqueue",
    tag = "enqueue",
    request_body = EnqueueRequest,
    params(("Idempotency-Key" = Option<idemq::openapi::IdempotencyKeyHeader>, Header, description = "As for enqueue")),
    responses(
        (status = 200, description = "What an enqueue would do", body = idemq::Explain),
        (status = 400, description = "Malformed body", body = Problem, content_type = "application/problem+json"),
        (status = 413, description = "Payload or body too large", body = Problem, content_type = "application/problem+json"),
        (status = 422, description = "Validation (as enqueue would answer)", body = Problem, content_type = "application/problem+json"),
    )
)]
pub(crate) async fn explain(
    State(s): State<ApiState>,
    headers: HeaderMap,
    RawJson(body): RawJson,
) -> ApiResult<Response> {
    let req = request(&headers, &body)?;
    let explain = s.queue().explain(req).await?;
    Ok(axum::Json(explain).into_response())
}
