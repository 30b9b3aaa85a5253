//! The OpenAPI 3.1 document. Every schema in it is the schema of a type the
//! server reads or writes: the request and response types of `idemq` (feature
//! `openapi`) and of this crate derive `utoipa::ToSchema` next to their serde
//! attributes, and their bounds are the validators' constants (the named
//! schemas of `idemq::openapi`, and [`WaitMs`] and [`BulkLimit`] here).
//! `tests/openapi.rs` pins the output.

use std::borrow::Cow;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{RefOr, schema::Schema};
use utoipa::{Modify, OpenApi, PartialSchema, ToSchema};

/// The `wait_ms` of a long poll (claim, `GET /v1/jobs/{id}`).
pub(crate) struct WaitMs;

impl PartialSchema for WaitMs {
    fn schema() -> RefOr<Schema> {
        idemq::openapi::integer(
            0,
            super::jobs::MAX_WAIT_MS as i64,
            "Milliseconds to hold the request, from 0 to 60 s",
        )
        .into()
    }
}

impl ToSchema for WaitMs {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("WaitMs")
    }
}

/// The `limit` of a bulk action.
pub(crate) struct BulkLimit;

impl PartialSchema for BulkLimit {
    fn schema() -> RefOr<Schema> {
        idemq::openapi::integer(
            1,
            super::jobs::BULK_MAX.into(),
            "Jobs one bulk action touches at most",
        )
        .into()
    }
}

impl ToSchema for BulkLimit {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("BulkLimit")
    }
}

/// Adds the bearer token scheme.
struct BearerToken;

impl Modify for BearerToken {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "token",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// Documents the `GET` of the fixed paths `/v1/jobs/{batch,explain,bulk,
/// complete}`, which the router matches before `/v1/jobs/{id}` and which
/// therefore answer the job of that id themselves: the operation of
/// `/v1/jobs/{id}`, without its `id` parameter.
struct FixedNameJobs;

impl Modify for FixedNameJobs {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let Some(get) = openapi
            .paths
            .paths
            .get("/v1/jobs/{id}")
            .and_then(|item| item.get.clone())
        else {
            return;
        };
        for name in super::jobs::FIXED_NAMES {
            let Some(item) = openapi.paths.paths.get_mut(&format!("/v1/jobs/{name}")) else {
                continue;
            };
            let mut op = get.clone();
            op.operation_id = Some(format!("get_job_named_{name}"));
            op.summary = Some(format!("The job whose id is `{name}`"));
            if let Some(params) = op.parameters.as_mut() {
                params.retain(|p| !matches!(p, RefOr::T(p) if p.name == "id"));
            }
            item.get = Some(op);
        }
    }
}

/// Adds to every operation the problem responses every route can answer:
/// the token and Host checks (401, 403), another method on the path (405),
/// a body the server cannot read or accept (400, 413, 422), a path or query
/// that names nothing valid (400, 404, 422), and the backend (500, 503).
/// An operation's own description of one of these is kept.
struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
        let problem = |text: &str| {
            ResponseBuilder::new().description(text).content(
                "application/problem+json",
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            )
        };
        for (path, item) in openapi.paths.paths.iter_mut() {
            let ops = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
            ];
            for op in ops.into_iter().flatten() {
                let has_body = op.request_body.is_some();
                let has_params = op.parameters.as_ref().is_some_and(|p| !p.is_empty());
                let mut add = |code: &str, text: &str| {
                    op.responses
                        .responses
                        .entry(code.to_owned())
                        .or_insert_with(|| problem(text).build().into());
                };
                if path != "/healthz" {
                    add(
                        "401",
                        "`unauthorized`: the server has a token and the request did not present it",
                    );
                }
                add(
                    "403",
                    "`forbidden-host`: the server has no token and the Host is not a loopback or allowed name",
                );
                add(
                    "405",
                    "`method-not-allowed`: another method on this path (the `Allow` header lists those served)",
                );
                if has_body {
                    add(
                        "400",
                        "`bad-request`: the body is not JSON, not sent as application/json, or a member is unknown or of the wrong type",
                    );
                    add(
                        "413",
                        "`payload-too-large`: the body or a payload is over its limit",
                    );
                    add(
                        "422",
                        "`validation`: a member breaks a bound (members `field`, `reason`)",
                    );
                }
                if has_params {
                    add(
                        "400",
                        "`bad-request`: a path or query parameter cannot be read",
                    );
                    add("404", "`not-found`");
                    add(
                        "422",
                        "`validation`: a parameter breaks a bound (members `field`, `reason`)",
                    );
                }
                add(
                    "500",
                    "`internal`: an unexpected failure, logged by the server",
                );
                // Every 503 carries `Retry-After`, an operation's own too.
                let retry_after = utoipa::openapi::HeaderBuilder::new()
                    .schema(Some(
                        utoipa::openapi::ObjectBuilder::new()
                            .schema_type(utoipa::openapi::schema::Type::Integer),
                    ))
                    .description(Some("Seconds to wait before retrying"))
                    .build();
                let unavailable = op
                    .responses
                    .responses
                    .entry("503".to_owned())
                    .or_insert_with(|| {
                        problem(
                            "`unavailable`: the backend is down or busy; retry after `Retry-After` seconds",
                        )
                        .build()
                        .into()
                    });
                if let RefOr::T(response) = unavailable {
                    response
                        .headers
                        .entry("Retry-After".to_owned())
                        .or_insert(RefOr::T(retry_after));
                }
            }
        }
    }
}

/// The whole API.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "idemq HTTP API",
        version = "1",
        description = "A durable job queue whose promise is: each piece of work is accepted once. \
            Every error is an RFC 9457 problem document. With a token configured, every request \
            but GET /healthz needs `Authorization: Bearer <token>`."
    ),
    modifiers(&BearerToken, &FixedNameJobs, &CommonResponses),
    // The schemas of path and query parameters (bodies register their own).
    components(schemas(
        WaitMs,
        super::jobs::StateFilter,
        super::jobs::CursorFilter,
        super::jobs::PageLimitQuery,
        super::jobs::WaitMsQuery,
        idemq::openapi::PageLimit,
        idemq::openapi::QueueName,
        idemq::openapi::IdempotencyKeyHeader,
        idemq::openapi::ScheduleName,
        idemq::openapi::CheckpointName,
    )),
    security(("token" = [])),
    paths(
        super::enqueue::enqueue,
        super::enqueue::batch,
        super::enqueue::explain,
        super::jobs::get_job,
        super::jobs::list,
        super::jobs::events,
        super::jobs::runs,
        super::jobs::checkpoints,
        super::jobs::cancel,
        super::jobs::purge,
        super::jobs::promote,
        super::jobs::redrive,
        super::jobs::bulk,
        super::keys::dedupe_cancel,
        super::keys::dedupe_lookup,
        super::keys::idempotency_lookup,
        super::keys::idempotency_release,
        super::keys::queues,
        super::keys::pause,
        super::keys::resume,
        super::worker::claim,
        super::worker::complete_many,
        super::worker::heartbeat,
        super::worker::complete,
        super::worker::fail,
        super::worker::release,
        super::worker::checkpoint,
        super::schedules::list,
        super::schedules::put,
        super::schedules::delete,
        super::ops::healthz,
        super::ops::metrics,
        super::ops::openapi,
        super::problem::page,
    ),
    tags(
        (name = "enqueue", description = "Enqueue, batch and explain"),
        (name = "jobs", description = "Job queries and operator actions"),
        (name = "bindings", description = "Idempotency and dedupe bindings"),
        (name = "queues", description = "Queues"),
        (name = "worker", description = "The worker protocol"),
        (name = "schedules", description = "Repeatable jobs"),
        (name = "operations", description = "Health, metrics, this document, problem pages"),
    )
)]
struct ApiDoc;

/// The OpenAPI document as pretty JSON.
pub(crate) fn openapi_json() -> String {
    ApiDoc::openapi()
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

#[cfg(test)]
mod tests {
    use idemq::request::bounds;
    use serde_json::Value;

    fn doc() -> Value {
        serde_json::from_str(&super::openapi_json()).expect("json")
    }

    /// The document names every problem type the server answers with, and
    /// each type's status.
    #[test]
    fn every_problem_type_is_named() {
        let doc = doc();
        let problem = &doc["components"]["schemas"]["Problem"]["properties"];
        let listed: Vec<&str> = problem["type"]["enum"]
            .as_array()
            .expect("Problem.type is an enum")
            .iter()
            .map(|t| t.as_str().expect("a string"))
            .collect();
        let types: Vec<String> = crate::api::problem::TYPES
            .iter()
            .map(|t| format!("/problems/{}", t.0))
            .collect();
        assert_eq!(
            listed, types,
            "Problem.type lists the types of problem.rs, in order"
        );
        let statuses: Vec<u64> = problem["status"]["enum"]
            .as_array()
            .expect("Problem.status is an enum")
            .iter()
            .map(|s| s.as_u64().expect("a number"))
            .collect();
        let want: Vec<u64> = crate::api::problem::TYPES
            .iter()
            .map(|t| t.1.into())
            .collect();
        assert_eq!(statuses, want);
    }

    /// The bounds the document states are the library's constants, reached
    /// through the members that use them.
    #[test]
    fn stated_bounds_are_the_library_bounds() {
        let doc = doc();
        let schemas = &doc["components"]["schemas"];
        // A member's schema, through its `$ref` (alone or in a nullable `oneOf`).
        let member = |schema: &str, member: &str| -> &Value {
            let mut s = &schemas[schema]["properties"][member];
            if let Some(alts) = s["oneOf"].as_array() {
                s = alts
                    .iter()
                    .find(|a| a["type"] != "null")
                    .expect("a non-null branch");
            }
            match s["$ref"].as_str() {
                Some(r) => &schemas[r.rsplit('/').next().expect("a name")],
                None => s,
            }
        };
        let n = |v: usize| v as i64;
        let cases: &[(&str, &str, &str, i64)] = &[
            (
                "EnqueueRequest",
                "type",
                "maxLength",
                n(bounds::MAX_TYPE_BYTES),
            ),
            (
                "EnqueueRequest",
                "queue",
                "maxLength",
                n(bounds::MAX_QUEUE_BYTES),
            ),
            (
                "EnqueueRequest",
                "job_id",
                "maxLength",
                n(bounds::MAX_JOB_ID_BYTES),
            ),
            (
                "EnqueueRequest",
                "max_attempts",
                "maximum",
                bounds::MAX_ATTEMPTS,
            ),
            (
                "EnqueueRequest",
                "timeout_ms",
                "maximum",
                bounds::MAX_TIMEOUT_MS,
            ),
            (
                "EnqueueRequest",
                "delay_ms",
                "maximum",
                bounds::MAX_DURATION_MS,
            ),
            (
                "EnqueueRequest",
                "concurrency_key",
                "maxLength",
                n(bounds::MAX_KEY_BYTES),
            ),
            ("Idempotency", "key", "maxLength", n(bounds::MAX_KEY_BYTES)),
            (
                "Idempotency",
                "ttl_ms",
                "minimum",
                bounds::MIN_IDEMPOTENCY_TTL_MS,
            ),
            (
                "DedupeOptions",
                "max_wait_ms",
                "maximum",
                bounds::THIRTY_DAYS_MS,
            ),
            (
                "ClaimBody",
                "worker",
                "maxLength",
                n(bounds::MAX_WORKER_BYTES),
            ),
            (
                "ClaimBody",
                "limit",
                "maximum",
                i64::from(bounds::MAX_CLAIM_LIMIT),
            ),
            ("ClaimBody", "lease_ms", "minimum", bounds::MIN_LEASE_MS),
            (
                "ClaimBody",
                "wait_ms",
                "maximum",
                super::super::jobs::MAX_WAIT_MS as i64,
            ),
            (
                "ClaimBody",
                "complete",
                "maxItems",
                n(idemq::MAX_BATCH_ITEMS),
            ),
            (
                "CompleteManyBody",
                "jobs",
                "maxItems",
                n(idemq::MAX_BATCH_ITEMS),
            ),
            (
                "ClaimBody",
                "queues",
                "maxItems",
                n(super::super::bounded::MAX_CLAIM_NAMES),
            ),
            (
                "ClaimBody",
                "types",
                "maxItems",
                n(super::super::bounded::MAX_CLAIM_NAMES),
            ),
            ("KeyBody", "scope", "maxLength", n(bounds::MAX_SCOPE_BYTES)),
            ("FailBody", "snooze_ms", "maximum", bounds::MAX_DURATION_MS),
            (
                "ScheduleDefinition",
                "every_ms",
                "minimum",
                idemq::schedule::MIN_EVERY_MS,
            ),
        ];
        for (schema, name, key, want) in cases {
            let got = member(schema, name)[key]
                .as_i64()
                .unwrap_or_else(|| panic!("{schema}.{name} states no {key}"));
            assert_eq!(got, *want, "{schema}.{name} {key}");
        }
        // Each name a claim lists, through its `allOf`.
        for (name, want) in [
            ("queues", bounds::MAX_QUEUE_BYTES),
            ("types", bounds::MAX_TYPE_BYTES),
        ] {
            let got = member("ClaimBody", name)["items"]["allOf"]
                .as_array()
                .and_then(|all| all.iter().find_map(|s| s["maxLength"].as_u64()));
            assert_eq!(got, Some(want as u64), "ClaimBody.{name} items maxLength");
        }
    }

    /// Every body that refuses unknown members says so.
    #[test]
    fn closed_bodies_refuse_unknown_members() {
        let doc = doc();
        for name in [
            "EnqueueRequest",
            "Idempotency",
            "DedupeOptions",
            "ClaimBody",
            "FailBody",
            "ScheduleDefinition",
            "KeyBody",
            "BulkBody",
            "RedriveBody",
        ] {
            assert_eq!(
                doc["components"]["schemas"][name]["additionalProperties"], false,
                "{name}"
            );
        }
    }
}
