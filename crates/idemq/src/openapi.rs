//! The schemas of the wire vocabulary (feature `openapi`): one named schema
//! per kind of bounded value the request types take, built from the same
//! constants the validators check ([`bounds`], [`crate::schedule`],
//! [`crate::MAX_BATCH_ITEMS`]). The request and response types derive their
//! own schemas (`utoipa::ToSchema`) and point their members at these with
//! `#[schema(value_type = …)]`, so the OpenAPI document the server builds
//! cannot drift from what the library accepts.
//!
//! Bounds are in bytes of UTF-8, as the validators count them. Names are
//! ASCII, so `maxLength` states their bound exactly; for free text (keys,
//! tags, worker and checkpoint names) `maxLength` is the byte bound counted
//! in characters — a value over it is always refused, and the description
//! says that the bound is in bytes (docs/decisions.md).

use std::borrow::Cow;

use utoipa::openapi::schema::{
    AdditionalProperties, AnyOfBuilder, ArrayBuilder, ObjectBuilder, OneOfBuilder, Schema,
    SchemaFormat, Type,
};
use utoipa::openapi::{KnownFormat, RefOr};
use utoipa::{PartialSchema, ToSchema};

use crate::request::bounds;

/// The pattern of names: ASCII letters, digits and `._:-`.
pub const NAME_PATTERN: &str = "^[A-Za-z0-9._:-]+$";
/// The pattern of explicit job ids: a name's characters and `~`.
pub const JOB_ID_PATTERN: &str = "^[A-Za-z0-9._:~-]+$";
/// The pattern of free text: anything but U+0000.
pub const TEXT_PATTERN: &str = "^[^\\u0000]+$";
/// The pattern of an enqueue's idempotency scope: a name not starting with `idemq.`.
pub const ENQUEUE_SCOPE_PATTERN: &str = "^(?!idemq\\.)[A-Za-z0-9._:-]+$";

/// A string of 1–`max` characters matching `pattern`.
pub fn text(max: usize, pattern: &str, description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .min_length(Some(1))
        .max_length(Some(max))
        .pattern(Some(pattern))
        .description(Some(description))
}

/// Free text: 1–`max` bytes of UTF-8 without U+0000, stated as at most
/// `max` characters (every longer value is refused) and in the description.
pub fn free_text(max: usize, description: &str) -> ObjectBuilder {
    text(
        max,
        TEXT_PATTERN,
        &format!(
            "{description}: 1–{max} bytes of UTF-8 (so at most {max} characters), without U+0000"
        ),
    )
}

/// An integer from `min` to `max`.
pub fn integer(min: i64, max: i64, description: &str) -> ObjectBuilder {
    ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Int64)))
        .minimum(Some(min))
        .maximum(Some(max))
        .description(Some(description))
}

/// Declares a named schema: a unit struct whose `ToSchema` is `$build`.
macro_rules! named {
    ($(#[$doc:meta])* $name:ident => $build:expr $(, refs [$($r:ty),*])?) => {
        $(#[$doc])*
        pub struct $name;
        impl PartialSchema for $name {
            fn schema() -> RefOr<Schema> {
                $build.into()
            }
        }
        impl ToSchema for $name {
            fn name() -> Cow<'static, str> {
                Cow::Borrowed(stringify!($name))
            }
            fn schemas(_schemas: &mut Vec<(String, RefOr<Schema>)>) {
                $($(
                    _schemas.push((<$r as ToSchema>::name().into(), <$r as PartialSchema>::schema()));
                    <$r as ToSchema>::schemas(_schemas);
                )*)?
            }
        }
    };
}

named!(
    /// A job type.
    JobType => text(bounds::MAX_TYPE_BYTES, NAME_PATTERN, "A job type")
);
named!(
    /// A queue name.
    QueueName => text(bounds::MAX_QUEUE_BYTES, NAME_PATTERN, "A queue name")
);
named!(
    /// An explicit job id.
    JobId => text(bounds::MAX_JOB_ID_BYTES, JOB_ID_PATTERN, "An explicit job id")
);
named!(
    /// An idempotency key, dedupe key or concurrency key.
    Key => free_text(bounds::MAX_KEY_BYTES, "A key")
);
named!(
    /// The idempotency scope of an enqueue (`idemq.` scopes are reserved).
    EnqueueScope => text(
        bounds::MAX_SCOPE_BYTES,
        ENQUEUE_SCOPE_PATTERN,
        "An idempotency scope (not starting with `idemq.`)"
    )
);
named!(
    /// The idempotency scope a lookup names (the reserved scopes included).
    Scope => text(bounds::MAX_SCOPE_BYTES, NAME_PATTERN, "An idempotency scope")
);
named!(
    /// A tag.
    Tag => free_text(bounds::MAX_TAG_BYTES, "A tag")
);
named!(
    /// The tags of a job. The bound counts distinct tags (repeats are
    /// dropped), which `maxItems` cannot state: the document says it in the
    /// description, so a list the server takes is never invalid to the schema.
    Tags => ArrayBuilder::new()
        .items(Tag::schema_ref())
        .description(Some(format!(
            "Labels, stored sorted and de-duplicated: at most {} distinct tags \
             (repeats are dropped before they are counted)",
            bounds::MAX_TAGS
        )))
    , refs [Tag]
);
named!(
    /// A worker's name.
    WorkerName => free_text(bounds::MAX_WORKER_BYTES, "A worker's name")
);
named!(
    /// A checkpoint's (step's) name.
    CheckpointName => free_text(bounds::MAX_KEY_BYTES, "A step name")
);
named!(
    /// A schedule's name.
    ScheduleName => text(
        crate::schedule::MAX_NAME_BYTES,
        NAME_PATTERN,
        "A schedule name"
    )
);
named!(
    /// A cron expression: six fields, seconds first.
    CronExpression => text(
        crate::schedule::MAX_CRON_BYTES,
        TEXT_PATTERN,
        "A cron expression of six fields, seconds first"
    )
);
named!(
    /// An IANA time zone.
    TimeZone => ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(chrono_tz::TZ_VARIANTS.iter().map(|z| z.name())))
        .description(Some("An IANA time zone name"))
);
named!(
    /// A queue or type a claim names: any text without U+0000 (a name no
    /// job has matches nothing).
    ClaimName => ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(NO_NUL))
        .description(Some("A queue or job type to claim from"))
);
named!(
    /// The `Idempotency-Key` header: a structured-field string (`"k"`,
    /// printable ASCII with `\"` and `\\` escapes) or a bare token, of
    /// 1–[`bounds::MAX_KEY_BYTES`] bytes after the surrounding blanks
    /// are trimmed.
    IdempotencyKeyHeader => ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(idempotency_key_header_pattern()))
        .description(Some(
            "A structured-field string (`\"k\"`: the key is between the quotes) or a bare token (the whole value)",
        ))
);

/// The pattern of [`IdempotencyKeyHeader`].
fn idempotency_key_header_pattern() -> String {
    let max = bounds::MAX_KEY_BYTES;
    format!(
        "^[ \\t]*(?:\"(?:[ !#-\\[\\]-~]|\\\\[\"\\\\]){{1,{max}}}\"|[!#-~](?:[ -~]{{0,{}}}[!-~])?)[ \\t]*$",
        max - 2
    )
}

named!(
    /// A priority.
    Priority => integer(i16::MIN.into(), i16::MAX.into(), "Higher runs first")
);
named!(
    /// An attempt budget.
    MaxAttempts => integer(1, bounds::MAX_ATTEMPTS, "An attempt budget")
);
named!(
    /// A duration that may be zero.
    DurationMs => integer(0, bounds::MAX_DURATION_MS, "Milliseconds, from 0 to 100 years")
);
named!(
    /// A positive duration.
    PositiveMs => integer(1, bounds::MAX_DURATION_MS, "Milliseconds, from 1 to 100 years")
);
named!(
    /// The execution timeout of one attempt.
    TimeoutMs => integer(1, bounds::MAX_TIMEOUT_MS, "Milliseconds, from 1 ms to 24 h")
);
named!(
    /// The retention of an idempotency binding.
    IdempotencyTtlMs => integer(
        bounds::MIN_IDEMPOTENCY_TTL_MS,
        bounds::THIRTY_DAYS_MS,
        "Milliseconds, from 1 s to 30 days"
    )
);
named!(
    /// A dedupe window.
    WindowMs => integer(1, bounds::THIRTY_DAYS_MS, "Milliseconds, from 1 ms to 30 days")
);
named!(
    /// The growth factor of an exponential backoff.
    RetryFactor => ObjectBuilder::new()
        .schema_type(Type::Number)
        .format(Some(SchemaFormat::KnownFormat(KnownFormat::Double)))
        .minimum(Some(bounds::MIN_RETRY_FACTOR))
        .maximum(Some(bounds::MAX_RETRY_FACTOR))
        .description(Some("A growth factor"))
);
named!(
    /// A lease.
    LeaseMs => integer(bounds::MIN_LEASE_MS, bounds::MAX_LEASE_MS, "Milliseconds, from 100 ms to 1 h")
);
named!(
    /// How many jobs one claim hands out.
    ClaimLimit => integer(1, bounds::MAX_CLAIM_LIMIT.into(), "Jobs per claim")
);
named!(
    /// A page size of a list.
    PageLimit => integer(1, bounds::MAX_PAGE_LIMIT.into(), "Jobs per page")
);
named!(
    /// The interval of a schedule.
    EveryMs => integer(
        crate::schedule::MIN_EVERY_MS,
        bounds::MAX_DURATION_MS,
        "Milliseconds, from 1 s to 100 years"
    )
);
named!(
    /// The cursor of a page.
    Cursor => ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(crate::store::CURSOR_PATTERN))
        .description(Some("The `next_cursor` of a previous page"))
);

named!(
    /// Any JSON value without U+0000 in a string or member name (which
    /// PostgreSQL's `jsonb` cannot store; refused on every backend alike).
    JsonValue => AnyOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(utoipa::openapi::schema::SchemaType::Array(
            vec![Type::Null, Type::Boolean, Type::Number],
        )))
        .item(ObjectBuilder::new().schema_type(Type::String).pattern(Some(NO_NUL)))
        .item(ArrayBuilder::new().items(JsonValue::schema_ref()))
        .item(
            ObjectBuilder::new()
                .schema_type(Type::Object)
                .property_names(Some(ObjectBuilder::new().schema_type(Type::String).pattern(Some(NO_NUL))))
                .additional_properties(Some(AdditionalProperties::RefOr(JsonValue::schema_ref()))),
        )
        .description(Some("Any JSON value without U+0000 in a string or member name"))
);

/// Strings without U+0000 (empty ones included).
const NO_NUL: &str = "^[^\\u0000]*$";

named!(
    /// `dedupe`: a key alone (pending mode) or the options.
    Dedupe => OneOfBuilder::new()
        .item(Key::schema_ref())
        .item(crate::DedupeOptions::schema_ref())
        .description(Some("A dedupe key alone (pending mode) or the options"))
    , refs [Key, crate::DedupeOptions]
);

named!(
    /// What an explain found.
    ExplainOutcome => ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(
            OUTCOMES.iter().map(|o| o.as_str()).chain(["conflict"]),
        ))
        .description(Some("The outcome an enqueue would have now, or `conflict`"))
);

named!(
    /// The outcome of an enqueue.
    EnqueueOutcome => ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(OUTCOMES.iter().map(|o| o.as_str())))
        .description(Some("What an enqueue did"))
);

/// Every outcome, for its wire names.
const OUTCOMES: [crate::Outcome; 5] = [
    crate::Outcome::Accepted,
    crate::Outcome::Replayed,
    crate::Outcome::Coalesced,
    crate::Outcome::Replaced,
    crate::Outcome::NonReplaceable {
        reason: crate::NonReplaceableReason::NotPending,
    },
];

named!(
    /// A schedule's job template: an enqueue request without the members a
    /// template may not carry (they are accepted only as `null`).
    ScheduleJob => schedule_job(), refs [crate::EnqueueRequest]
);

fn schedule_job() -> RefOr<Schema> {
    let mut schema = crate::EnqueueRequest::schema();
    if let RefOr::T(Schema::Object(object)) = &mut schema {
        for member in crate::schedule::TEMPLATE_REFUSES {
            object.properties.insert(
                (*member).to_owned(),
                ObjectBuilder::new()
                    .schema_type(Type::Null)
                    .description(Some("Not in a template"))
                    .into(),
            );
        }
        object.description = Some(
            "The job every tick enqueues: an enqueue request without an idempotency key, \
             `job_id`, `run_at` or `deadline`"
                .into(),
        );
    }
    schema
}

impl PartialSchema for crate::EnqueueResult {
    fn schema() -> RefOr<Schema> {
        ObjectBuilder::new()
            .schema_type(Type::Object)
            .property(
                "job_id",
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some("The job the request refers to")),
            )
            .required("job_id")
            .property("outcome", EnqueueOutcome::schema_ref())
            .required("outcome")
            .property("reason", crate::NonReplaceableReason::schema_ref())
            .description(Some(
                "What an enqueue did (`reason` with `non_replaceable` only)",
            ))
            .into()
    }
}

impl ToSchema for crate::EnqueueResult {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("EnqueueResult")
    }
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        schemas.push((EnqueueOutcome::name().into(), EnqueueOutcome::schema()));
        schemas.push((
            crate::NonReplaceableReason::name().into(),
            crate::NonReplaceableReason::schema(),
        ));
    }
}

/// `retry`: the backoff policy. Its schema is the derived one of
/// [`crate::RetryPolicy`] with every variant closed to unknown members, as
/// serde's `deny_unknown_fields` makes it (the derive does not say so for
/// the variants of an enum).
pub struct Retry;

impl PartialSchema for Retry {
    fn schema() -> RefOr<Schema> {
        let mut schema = crate::RetryPolicy::schema();
        if let RefOr::T(Schema::OneOf(one_of)) = &mut schema {
            for variant in &mut one_of.items {
                if let RefOr::T(Schema::Object(object)) = variant {
                    object.additional_properties =
                        Some(Box::new(AdditionalProperties::FreeForm(false)));
                }
            }
        }
        schema
    }
}

impl ToSchema for Retry {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("RetryPolicy")
    }
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        crate::RetryPolicy::schemas(schemas);
    }
}

/// A reference to `T`'s component.
trait SchemaRef {
    fn schema_ref() -> RefOr<Schema>;
}

impl<T: ToSchema> SchemaRef for T {
    fn schema_ref() -> RefOr<Schema> {
        RefOr::Ref(utoipa::openapi::Ref::from_schema_name(T::name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json<T: PartialSchema>() -> serde_json::Value {
        serde_json::to_value(T::schema()).expect("a schema serializes")
    }

    #[test]
    fn bounds_come_from_the_constants() {
        assert_eq!(json::<Key>()["maxLength"], bounds::MAX_KEY_BYTES);
        let tags = json::<Tags>();
        assert!(tags.get("maxItems").is_none(), "repeats are not counted");
        assert!(
            tags["description"]
                .as_str()
                .is_some_and(|d| d.contains(&format!("at most {} distinct", bounds::MAX_TAGS))),
            "{tags}"
        );
        assert_eq!(json::<TimeoutMs>()["maximum"], bounds::MAX_TIMEOUT_MS);
        assert_eq!(json::<Priority>()["minimum"], -32768);
        assert_eq!(
            idempotency_key_header_pattern(),
            r#"^[ \t]*(?:"(?:[ !#-\[\]-~]|\\["\\]){1,255}"|[!#-~](?:[ -~]{0,253}[!-~])?)[ \t]*$"#
        );
        let retry = json::<Retry>();
        let variants = retry["oneOf"].as_array().expect("one schema per kind");
        assert_eq!(variants.len(), 3);
        assert!(variants.iter().all(|v| v["additionalProperties"] == false));
        assert!(
            json::<TimeZone>()["enum"]
                .as_array()
                .is_some_and(|z| z.iter().any(|z| z == "Europe/Berlin"))
        );
    }
}
