//! Lists whose count bound is applied while the body is parsed.
//!
//! A body may be 16 MiB; read whole, a list of 16 MiB of tiny items
//! (`{"jobs": [0,0,0,…]}`) is millions of values, about half a gigabyte,
//! before a check of its length could refuse it. Each list here stops at
//! the first item over its bound (scanned, not kept), and nothing after it
//! is read, so what a body costs stays proportional to what the call takes. The parse then fails with a marker
//! ([`Overflow`]) that [`super::extract`] turns into the call's own
//! problem: `413` for a batch, `422 validation` for the others, with the
//! list's member as `field`.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use idemq::request::bounds::{MAX_QUEUE_BYTES, MAX_TYPE_BYTES};
use serde::de::{self, Deserialize, Deserializer, IgnoredAny, SeqAccess, Visitor};
use serde_json::Value;
use utoipa::openapi::schema::{AllOfBuilder, ArrayBuilder, ObjectBuilder, Schema, Type};
use utoipa::openapi::{Ref, RefOr};
use utoipa::{PartialSchema, ToSchema};

use super::problem::Problem;
use super::worker::CompleteItem;

/// Most queues, and most types, one claim names. The contract gives none;
/// this one is far above any worker's list and keeps a claim's filter (and
/// the statement it becomes) small.
pub(crate) const MAX_CLAIM_NAMES: usize = 1000;

/// A bound broken while a list was parsed: which one, so that the parse
/// error can be answered as the call answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Overflow {
    /// A batch of more than [`idemq::MAX_BATCH_ITEMS`] requests (`413`).
    BatchItems,
    /// More than [`idemq::MAX_BATCH_ITEMS`] completions (`422`).
    Completions,
    /// More than [`MAX_CLAIM_NAMES`] queues or types (`422`).
    ClaimNames,
    /// A queue name over [`MAX_QUEUE_BYTES`] (`422`).
    QueueName,
    /// A type name over [`MAX_TYPE_BYTES`] (`422`).
    TypeName,
}

/// What every [`Overflow`] message starts with. Nothing a client sends can
/// put it first in a parse error's message: serde quotes a value only
/// after words of its own (and a forged one would only earn its own
/// request a bound's answer).
const MARK: &str = "\u{1}idemq-list-bound:";

impl Overflow {
    const ALL: [Overflow; 5] = [
        Self::BatchItems,
        Self::Completions,
        Self::ClaimNames,
        Self::QueueName,
        Self::TypeName,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::BatchItems => "batch-items",
            Self::Completions => "completions",
            Self::ClaimNames => "claim-names",
            Self::QueueName => "queue-name",
            Self::TypeName => "type-name",
        }
    }

    /// The overflow a parse error's message names, if it names one (the
    /// parser adds the position after it).
    pub(crate) fn find(message: &str) -> Option<Self> {
        let rest = message.strip_prefix(MARK)?;
        let name = rest.split('\u{1}').next()?;
        Self::ALL.into_iter().find(|o| o.name() == name)
    }

    /// The problem of this overflow at `field` (the list's member).
    pub(crate) fn problem(self, field: &str) -> Problem {
        let items = idemq::MAX_BATCH_ITEMS;
        match self {
            Self::BatchItems => Problem::new(
                "payload-too-large",
                format!("a batch holds at most {items} items"),
            )
            .with("field", field)
            .with("limit", items),
            Self::Completions => {
                Problem::validation(field, &format!("at most {items} items per call"))
            }
            Self::ClaimNames => {
                Problem::validation(field, &format!("at most {MAX_CLAIM_NAMES} names"))
            }
            Self::QueueName => Problem::validation(
                field,
                &format!("each queue name must be at most {MAX_QUEUE_BYTES} bytes"),
            ),
            Self::TypeName => Problem::validation(
                field,
                &format!("each type must be at most {MAX_TYPE_BYTES} bytes"),
            ),
        }
    }
}

impl fmt::Display for Overflow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{MARK}{}\u{1}", self.name())
    }
}

/// Reads a list of at most `max` items, each checked by `check`; the item
/// after the last one allowed is skipped without being built
/// ([`IgnoredAny`]) and fails the parse with `over`.
struct Bounded<T> {
    max: usize,
    over: Overflow,
    check: fn(&T) -> Result<(), Overflow>,
    item: PhantomData<T>,
}

impl<T> Bounded<T> {
    fn new(max: usize, over: Overflow) -> Self {
        Self::checked(max, over, |_| Ok(()))
    }

    fn checked(max: usize, over: Overflow, check: fn(&T) -> Result<(), Overflow>) -> Self {
        Self {
            max,
            over,
            check,
            item: PhantomData,
        }
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Bounded<T> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // serde's own word for a list, as in the messages before the bound.
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
        let mut items = Vec::new();
        loop {
            if items.len() == self.max {
                return match seq.next_element::<IgnoredAny>()? {
                    Some(IgnoredAny) => Err(de::Error::custom(self.over)),
                    None => Ok(items),
                };
            }
            match seq.next_element::<T>()? {
                Some(item) => {
                    (self.check)(&item).map_err(de::Error::custom)?;
                    items.push(item);
                }
                None => return Ok(items),
            }
        }
    }
}

/// A value that must be a JSON object ([`idemq::wire::object`]).
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        idemq::wire::object(d).map(Object)
    }
}

/// [`Bounded`] for a list that may be `null` (omitted).
struct Nullable<T>(Bounded<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for Nullable<T> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_seq(self.0).map(Some)
    }
}

/// The items of a batch: at most [`idemq::MAX_BATCH_ITEMS`] values (each
/// is read as a request later, on its own), else `413`.
pub(crate) fn batch_items<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Value>, D::Error> {
    d.deserialize_seq(Bounded::new(idemq::MAX_BATCH_ITEMS, Overflow::BatchItems))
}

/// The completions of `POST /v1/jobs/complete`: at most
/// [`idemq::MAX_BATCH_ITEMS`] objects, else `422`.
pub(crate) fn completions<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<CompleteItem>, D::Error> {
    d.deserialize_seq(completion_list()).map(objects)
}

/// A claim's `complete`: [`completions`], or `null`.
pub(crate) fn opt_completions<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<CompleteItem>>, D::Error> {
    d.deserialize_option(Nullable(completion_list()))
        .map(|items| items.map(objects))
}

fn completion_list() -> Bounded<Object<CompleteItem>> {
    Bounded::new(idemq::MAX_BATCH_ITEMS, Overflow::Completions)
}

fn objects<T>(items: Vec<Object<T>>) -> Vec<T> {
    items.into_iter().map(|o| o.0).collect()
}

/// A claim's `queues`: at most [`MAX_CLAIM_NAMES`] names of at most
/// [`MAX_QUEUE_BYTES`], or `null`. Only the length is checked: a name no
/// queue can have (`""`, `"a b"`) matches nothing, as it always did.
pub(crate) fn claim_queues<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<String>>, D::Error> {
    d.deserialize_option(Nullable(Bounded::checked(
        MAX_CLAIM_NAMES,
        Overflow::ClaimNames,
        |name: &String| {
            if name.len() > MAX_QUEUE_BYTES {
                Err(Overflow::QueueName)
            } else {
                Ok(())
            }
        },
    )))
}

/// A claim's `types`: at most [`MAX_CLAIM_NAMES`] names of at most
/// [`MAX_TYPE_BYTES`], or `null`.
pub(crate) fn claim_types<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<Vec<String>>, D::Error> {
    d.deserialize_option(Nullable(Bounded::checked(
        MAX_CLAIM_NAMES,
        Overflow::ClaimNames,
        |name: &String| {
            if name.len() > MAX_TYPE_BYTES {
                Err(Overflow::TypeName)
            } else {
                Ok(())
            }
        },
    )))
}

/// The schema of a claim's list of names: at most [`MAX_CLAIM_NAMES`]
/// [`idemq::openapi::ClaimName`]s of at most `max` characters (the bound
/// is in bytes, as for free text; a name that can match is ASCII).
fn claim_names(max: usize, description: &str) -> RefOr<Schema> {
    ArrayBuilder::new()
        .items(
            AllOfBuilder::new()
                .item(Ref::from_schema_name(idemq::openapi::ClaimName::name()))
                .item(
                    ObjectBuilder::new()
                        .schema_type(Type::String)
                        .max_length(Some(max)),
                ),
        )
        .max_items(Some(MAX_CLAIM_NAMES))
        .description(Some(description))
        .into()
}

/// A claim's `queues` in the OpenAPI document.
pub(crate) struct ClaimQueues;

impl PartialSchema for ClaimQueues {
    fn schema() -> RefOr<Schema> {
        claim_names(
            MAX_QUEUE_BYTES,
            &format!("At most {MAX_CLAIM_NAMES} queues, each at most {MAX_QUEUE_BYTES} bytes"),
        )
    }
}

impl ToSchema for ClaimQueues {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ClaimQueues")
    }
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        claim_name_schema(schemas);
    }
}

/// A claim's `types` in the OpenAPI document.
pub(crate) struct ClaimTypes;

impl PartialSchema for ClaimTypes {
    fn schema() -> RefOr<Schema> {
        claim_names(
            MAX_TYPE_BYTES,
            &format!("At most {MAX_CLAIM_NAMES} job types, each at most {MAX_TYPE_BYTES} bytes"),
        )
    }
}

impl ToSchema for ClaimTypes {
    fn name() -> Cow<'static, str> {
        Cow::Borrowed("ClaimTypes")
    }
    fn schemas(schemas: &mut Vec<(String, RefOr<Schema>)>) {
        claim_name_schema(schemas);
    }
}

/// Registers [`idemq::openapi::ClaimName`], which the lists refer to.
fn claim_name_schema(schemas: &mut Vec<(String, RefOr<Schema>)>) {
    use idemq::openapi::ClaimName;
    schemas.push((ClaimName::name().into(), ClaimName::schema()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        #[serde(default, deserialize_with = "claim_queues")]
        queues: Option<Vec<String>>,
        #[serde(default, deserialize_with = "batch_items")]
        jobs: Vec<Value>,
    }

    fn read(json: &str) -> Result<Body, Option<Overflow>> {
        serde_json::from_str(json).map_err(|e| Overflow::find(&e.to_string()))
    }

    fn zeros(n: usize) -> String {
        vec!["0"; n].join(",")
    }

    #[test]
    fn a_list_at_its_bound_is_read() {
        let body = read(&format!(r#"{{"jobs": [{}]}}"#, zeros(1000))).expect("1,000 items");
        assert_eq!(body.jobs.len(), 1000);
        assert!(read(r#"{"jobs": [], "queues": null}"#).is_ok());
        let names = vec![format!("\"{}\"", "q".repeat(64)); 1000].join(",");
        let body = read(&format!(r#"{{"jobs": [], "queues": [{names}]}}"#)).expect("names");
        assert_eq!(body.queues.map(|q| q.len()), Some(1000));
    }

    #[test]
    fn the_parse_stops_at_the_item_past_the_bound() {
        // What follows the 1,001st item is not JSON: the parse never gets there.
        let json = format!(r#"{{"jobs": [{}, 0, this is never read"#, zeros(1000));
        assert_eq!(read(&json).unwrap_err(), Some(Overflow::BatchItems));
        let names = vec!["\"q\""; 1001].join(",");
        let json = format!(r#"{{"jobs": [], "queues": [{names}"#);
        assert_eq!(read(&json).unwrap_err(), Some(Overflow::ClaimNames));
        let json = format!(r#"{{"queues": ["{}"]}}"#, "q".repeat(65));
        assert_eq!(read(&json).unwrap_err(), Some(Overflow::QueueName));
    }

    #[test]
    fn other_errors_are_not_overflows() {
        assert_eq!(read(r#"{"jobs": 5}"#).unwrap_err(), None);
        assert_eq!(read(r#"{"jobs": [], "queues": [1]}"#).unwrap_err(), None);
        // A client cannot forge the marker: its text is quoted, after words.
        let forged = format!(
            r#"{{"jobs": [], "queues": {:?}}}"#,
            Overflow::BatchItems.to_string()
        );
        assert_eq!(read(&forged).unwrap_err(), None);
    }

    #[test]
    fn every_overflow_is_found_by_its_message() {
        for o in Overflow::ALL {
            let message = format!("{o} at line 1 column 9");
            assert_eq!(Overflow::find(&message), Some(o));
        }
    }
}
