//! Property tests of request parsing, validation and fingerprinting (docs/http-api.md and docs/idempotency.md).
//!
//! - Arbitrary JSON bodies — the API's field names with random value types,
//!   unknown fields, U+0000, huge strings, nesting up to and beyond
//!   serde_json's recursion limit, out-of-range numbers and instants — are
//!   parsed as an `EnqueueRequest` and prepared: never a panic, and every
//!   refusal is a serde error (parse) or a typed `Validation` /
//!   `PayloadTooLarge` (prepare).
//! - The fingerprint ignores member order and whitespace, and the documented
//!   equivalences (`null` ≡ omitted, `delay: 0` ≡ omitted, defaults spelled
//!   out); changing one fingerprinted field changes exactly that field's
//!   digest, and changing a field outside the fingerprint changes none.

use chrono::{DateTime, TimeZone, Utc};
use idemq::fingerprint::KeyHasher;
use idemq::request::{DedupeOptions, IdempotencyOptions};
use idemq::{EnqueueRequest, Error, RetryPolicy};
use proptest::prelude::*;
use serde_json::{Map, Number, Value, json};

const LIMIT: usize = 1024 * 1024;

fn cases(default: u32) -> ProptestConfig {
    let n = std::env::var("IDEMQ_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases: n,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ------------------------------------------------------------------ arbitrary JSON

fn arb_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[A-Za-z0-9._:~-]{0,12}",
        2 => any::<String>(),
        1 => "[a-z]{0,4}\u{0}[a-z]{0,4}",
        1 => Just(String::new()),
        1 => (0usize..3).prop_map(|i| ["x".repeat(129), "y".repeat(256), "é".repeat(200)][i].clone()),
        // Instants: valid, out of range, malformed, with offsets and excess precision.
        2 => prop::sample::select(vec![
            "2030-01-01T00:00:00Z",
            "2030-01-01T00:00:00.123456789+02:00",
            "1970-01-01T00:00:00Z",
            "0000-01-01T00:00:00Z",
            "-0001-12-31T23:59:59Z",
            "+262142-12-31T23:59:59Z",
            "+262143-12-31T23:59:59Z",
            "+999999-01-01T00:00:00Z",
            "9999-12-31T23:59:60Z",
            "2030-02-30T00:00:00Z",
            "2030-01-01",
            "not a time",
        ])
        .prop_map(str::to_owned),
    ]
}

fn arb_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => (-5i64..2000).prop_map(Value::from),
        2 => prop::sample::select(vec![
            i64::MIN, i64::MAX, -1, 0, 1, 999, 1000, 1001, 32_767, 32_768, -32_769,
            86_400_000, 86_400_001, 2_592_000_000, 2_592_000_001,
            3_162_240_000_000, 3_162_240_000_001, 9_007_199_254_740_993,
        ])
        .prop_map(Value::from),
        1 => Just(Value::from(u64::MAX)),
        2 => prop::sample::select(vec![0.5, -0.0, 1.0, 1e308, -1e308, 1e-300, 2.5e15, 1000.5])
            .prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
    ]
}

fn arb_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        3 => arb_number(),
        3 => arb_string().prop_map(Value::String),
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    arb_leaf().prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec((arb_string(), inner), 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const FIELDS: [&str; 16] = [
    "type",
    "payload",
    "queue",
    "job_id",
    "priority",
    "run_at",
    "delay_ms",
    "max_attempts",
    "retry",
    "timeout_ms",
    "deadline",
    "concurrency_key",
    "tags",
    "keep_ms",
    "idempotency",
    "dedupe",
];

/// A value shaped somewhat like what the field expects, or anything at all.
fn field_value(field: &'static str) -> BoxedStrategy<Value> {
    let plausible: BoxedStrategy<Value> = match field {
        "idempotency" => prop::collection::vec(
            (
                prop::sample::select(vec!["key", "scope", "ttl_ms", "extra"]),
                arb_leaf(),
            ),
            0..4,
        )
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()))
        .boxed(),
        "dedupe" => prop_oneof![
            arb_string().prop_map(Value::String),
            prop::collection::vec(
                (
                    prop::sample::select(vec![
                        "key",
                        "ttl_ms",
                        "extend",
                        "replace",
                        "max_wait_ms",
                        "mode"
                    ]),
                    arb_leaf(),
                ),
                0..5,
            )
            .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
        ]
        .boxed(),
        "retry" => prop::collection::vec(
            (
                prop::sample::select(vec![
                    "kind",
                    "initial_ms",
                    "factor",
                    "max_ms",
                    "jitter",
                    "delay_ms",
                    "other",
                ]),
                prop_oneof![
                    prop::sample::select(vec!["exponential", "fixed", "none", "linear"])
                        .prop_map(|s| Value::String(s.into())),
                    arb_leaf(),
                ],
            ),
            0..5,
        )
        .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()))
        .boxed(),
        "tags" => prop::collection::vec(arb_leaf(), 0..20)
            .prop_map(Value::Array)
            .boxed(),
        _ => arb_leaf().boxed(),
    };
    prop_oneof![3 => plausible, 1 => arb_json()].boxed()
}

fn arb_body() -> impl Strategy<Value = Value> {
    let members = prop::collection::vec(
        prop_oneof![
            8 => prop::sample::select(FIELDS.to_vec()).prop_flat_map(|f| (Just(f.to_owned()), field_value(f))),
            1 => (arb_string(), arb_json()),
        ],
        0..10,
    );
    (members, prop::bool::weighted(0.8)).prop_map(|(m, with_type)| {
        let mut o: Map<String, Value> = m.into_iter().collect();
        if with_type && !o.contains_key("type") {
            o.insert("type".into(), json!("t"));
        }
        Value::Object(o)
    })
}

/// Parses and prepares a body: panics are failures, refusals must be typed.
fn parse_and_prepare(text: &str, limit: usize) -> Result<(), TestCaseError> {
    let Ok(req) = serde_json::from_str::<EnqueueRequest>(text) else {
        return Ok(()); // a serde error: refused at the parse step
    };
    match req.prepare(&KeyHasher::plain(), limit) {
        Ok(p) => {
            prop_assert_eq!(p.fingerprint.fields().len(), 13);
            prop_assert!(p.payload.len() <= limit);
        }
        Err(Error::Validation { field, reason }) => {
            prop_assert!(!field.is_empty() && !reason.is_empty());
        }
        Err(Error::PayloadTooLarge { field, limit: l }) => {
            prop_assert_eq!(field, "payload");
            prop_assert_eq!(l, limit);
        }
        Err(other) => prop_assert!(false, "untyped refusal: {other:?}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(cases(2000))]

    #[test]
    fn arbitrary_bodies_never_panic_and_refusals_are_typed(
        body in arb_body(),
        limit in prop_oneof![Just(LIMIT), 1usize..256],
    ) {
        parse_and_prepare(&body.to_string(), limit)?;
    }

    #[test]
    fn arbitrary_text_never_panics(text in prop_oneof![
        any::<String>(),
        arb_body().prop_map(|b| b.to_string()).prop_flat_map(|s| {
            let n = s.len();
            (Just(s), 0..=n, any::<char>())
        }).prop_map(|(mut s, i, c)| {
            // One char inserted at a char boundary: mostly broken JSON.
            let mut i = i;
            while !s.is_char_boundary(i) { i -= 1; }
            s.insert(i, c);
            s
        }),
    ]) {
        parse_and_prepare(&text, LIMIT)?;
    }

    #[test]
    fn deep_nesting_around_the_recursion_limit(
        depth in prop_oneof![1usize..140, Just(127), Just(128), Just(129), 200usize..5000],
        arrays in any::<bool>(),
        field in prop::sample::select(vec!["payload", "retry", "idempotency", "dedupe", "tags", "queue"]),
    ) {
        let (open, close) = if arrays { ("[", "]") } else { ("{\"a\":", "}") };
        let nested = format!("{}1{}", open.repeat(depth), close.repeat(depth));
        parse_and_prepare(&format!("{{\"type\":\"t\",\"{field}\":{nested}}}"), LIMIT)?;
    }
}

proptest! {
    #![proptest_config(cases(16))]

    #[test]
    fn huge_strings_are_refused_as_too_large_or_by_bound(
        field in prop::sample::select(vec!["payload", "type", "queue", "job_id", "concurrency_key"]),
        nul in any::<bool>(),
    ) {
        let mut s = "x".repeat(LIMIT + 10);
        if nul {
            s.push('\u{0}');
        }
        let body = json!({ "type": "t", field: s }).to_string();
        let req: EnqueueRequest = serde_json::from_str(&body).expect("parses");
        let err = req.prepare(&KeyHasher::plain(), LIMIT).expect_err("refused");
        match field {
            "payload" if nul => prop_assert!(matches!(err, Error::Validation { .. }), "{err:?}"),
            "payload" => prop_assert!(matches!(err, Error::PayloadTooLarge { .. }), "{err:?}"),
            _ => prop_assert!(matches!(&err, Error::Validation { field: f, .. } if f == field), "{err:?}"),
        }
    }
}

// ------------------------------------------------------------------ fingerprints

fn at(secs: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_893_456_000 + secs, 0)
        .single()
        .expect("instant")
}

/// A payload with no U+0000 and small nesting.
fn arb_payload() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
        "[^\u{0}]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[^\u{0}]{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arb_retry() -> impl Strategy<Value = Option<RetryPolicy>> {
    prop_oneof![
        Just(None),
        (1i64..100_000).prop_map(|d| Some(RetryPolicy::Fixed { delay_ms: d })),
        Just(Some(RetryPolicy::None)),
        (1i64..10_000, 1u8..5, 1i64..100_000, any::<bool>()).prop_map(|(i, f, m, j)| Some(
            RetryPolicy::Exponential {
                initial_ms: i,
                factor: f64::from(f),
                max_ms: m,
                jitter: j,
            }
        )),
    ]
}

/// A valid request (every bound respected), with a deadline after every run_at.
fn arb_request() -> impl Strategy<Value = EnqueueRequest> {
    (
        (
            prop::sample::select(vec!["t", "invoice.capture", "a:b-c.1"]),
            arb_payload(),
            prop::option::of(prop::sample::select(vec!["default", "billing"])),
            prop::option::of(prop::sample::select(vec!["id~1", "job-2"])),
            prop::option::of(-5i64..5),
            prop_oneof![
                Just((None, None)),
                (0i64..100_000).prop_map(|d| (None, Some(d))),
                (0i64..86_400).prop_map(|s| (Some(at(s)), None)),
            ],
            prop::option::of(Just(at(10 * 86_400))),
        ),
        (
            prop::option::of(1i64..=1000),
            arb_retry(),
            prop::option::of(1i64..=86_400_000),
            prop::option::of(prop::sample::select(vec!["ck", "account-7"])),
            prop::collection::vec(prop::sample::select(vec!["a", "b", "c"]), 0..5),
            prop::option::of(0i64..1_000_000),
            prop::option::of((
                prop::sample::select(vec!["key-1", "capture:inv_42"]),
                prop::option::of(prop::sample::select(vec!["default", "other"])),
                prop::option::of(1000i64..86_400_000),
            )),
            prop::option::of(prop::sample::select(vec!["d1", "d2"])),
        ),
    )
        .prop_map(
            |(
                (ty, payload, queue, job_id, priority, (run_at, delay), deadline),
                (max_attempts, retry, timeout, ck, tags, keep, idem, dedupe),
            )| EnqueueRequest {
                job_type: ty.into(),
                payload,
                queue: queue.map(Into::into),
                job_id: job_id.map(Into::into),
                priority,
                run_at,
                delay_ms: delay,
                max_attempts,
                retry,
                timeout_ms: timeout,
                deadline,
                concurrency_key: ck.map(Into::into),
                tags: tags.into_iter().map(Into::into).collect(),
                keep_ms: keep,
                idempotency: idem.map(|(key, scope, ttl)| IdempotencyOptions {
                    key: key.into(),
                    scope: scope.map(Into::into),
                    ttl_ms: ttl,
                }),
                dedupe: dedupe.map(DedupeOptions::key),
            },
        )
}

/// Tiny deterministic generator for the layout choices of [`write_json`].
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn ws(&mut self) -> &'static str {
        [" ", "", "\n", "\t ", "\r\n  ", ""][(self.next() % 6) as usize]
    }
}

/// Writes `v` with members in a shuffled order, random whitespace, strings
/// possibly fully escaped, and payload integers possibly as `n.0`.
fn write_json(v: &Value, rng: &mut Rng, out: &mut String, in_payload: bool) {
    out.push_str(rng.ws());
    match v {
        Value::Object(o) => {
            let mut members: Vec<(&String, &Value)> = o.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, (rng.next() % (i as u64 + 1)) as usize);
            }
            out.push('{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(rng.ws());
                out.push_str(&Value::String(k.clone()).to_string());
                out.push_str(rng.ws());
                out.push(':');
                write_json(v, rng, out, in_payload || k.as_str() == "payload");
            }
            out.push_str(rng.ws());
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(v, rng, out, in_payload);
            }
            out.push_str(rng.ws());
            out.push(']');
        }
        Value::String(s) => {
            // Escape every character sometimes: the same string, other bytes.
            if rng.next().is_multiple_of(3) {
                out.push('"');
                for u in s.encode_utf16() {
                    out.push_str(&format!("\\u{u:04x}"));
                }
                out.push('"');
            } else {
                out.push_str(&v.to_string());
            }
        }
        Value::Number(n) if in_payload && n.is_i64() && rng.next().is_multiple_of(3) => {
            // The same number written as a float (1 and 1.0, 100 and 1e2).
            let i = n.as_i64().unwrap_or_default();
            if i.unsigned_abs() < (1 << 53) {
                out.push_str(&format!("{i}.0"));
            } else {
                out.push_str(&i.to_string());
            }
        }
        other => out.push_str(&other.to_string()),
    }
    out.push_str(rng.ws());
}

/// Equivalent spellings of a request body (docs/idempotency.md, the fingerprint).
fn equivalent_body(body: &Value, rng: &mut Rng) -> Value {
    let mut b = body.clone();
    let o = b.as_object_mut().expect("object");
    let defaults: [(&str, Value); 4] = [
        ("queue", json!("default")),
        ("max_attempts", json!(10)),
        ("timeout_ms", json!(1_800_000)),
        (
            "retry",
            json!({"kind": "exponential", "initial_ms": 1000, "factor": 2.0, "max_ms": 3_600_000, "jitter": true}),
        ),
    ];
    for (k, v) in defaults {
        if o.get(k).is_none_or(Value::is_null) && rng.next().is_multiple_of(2) {
            o.insert(k.into(), v);
        }
    }
    // null ≡ omitted, delay 0 ≡ omitted.
    for k in [
        "job_id",
        "run_at",
        "deadline",
        "concurrency_key",
        "keep_ms",
        "priority",
    ] {
        if !o.contains_key(k) && rng.next().is_multiple_of(3) {
            o.insert(k.into(), Value::Null);
        }
    }
    if o.get("run_at").is_none_or(Value::is_null)
        && o.get("delay_ms").is_none_or(Value::is_null)
        && rng.next().is_multiple_of(2)
    {
        o.insert("delay_ms".into(), json!(0));
    }
    // Tags are a set.
    if let Some(Value::Array(tags)) = o.get_mut("tags")
        && let Some(first) = tags.first().cloned()
    {
        tags.reverse();
        tags.push(first);
    }
    b
}

/// The request fields whose digests differ.
fn changed(a: &EnqueueRequest, b: &EnqueueRequest) -> Result<Vec<String>, TestCaseError> {
    let h = KeyHasher::plain();
    let pa = a.prepare(&h, LIMIT);
    let pb = b.prepare(&h, LIMIT);
    prop_assert!(pa.is_ok(), "{:?}", pa);
    prop_assert!(pb.is_ok(), "{:?}", pb);
    let (fa, fb) = (
        pa.unwrap().fingerprint.fields(),
        pb.unwrap().fingerprint.fields(),
    );
    prop_assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    Ok(fa
        .iter()
        .filter(|(k, v)| fb.get(*k) != Some(v))
        .map(|(k, _)| k.clone())
        .collect())
}

#[derive(Clone, Copy, Debug)]
enum Change {
    Type,
    Payload,
    Queue,
    JobId,
    RunAt,
    Delay,
    MaxAttempts,
    Retry,
    Timeout,
    Deadline,
    ConcurrencyKey,
    Tags,
    KeyTtl,
    // Outside the fingerprint.
    Priority,
    Keep,
    Dedupe,
    KeyScope,
}

const CHANGES: [Change; 17] = [
    Change::Type,
    Change::Payload,
    Change::Queue,
    Change::JobId,
    Change::RunAt,
    Change::Delay,
    Change::MaxAttempts,
    Change::Retry,
    Change::Timeout,
    Change::Deadline,
    Change::ConcurrencyKey,
    Change::Tags,
    Change::KeyTtl,
    Change::Priority,
    Change::Keep,
    Change::Dedupe,
    Change::KeyScope,
];

/// Applies one change; returns the field whose digest must change (`None`
/// for a field outside the fingerprint), or `Err` when the change does not
/// apply to this request.
fn apply(r: &mut EnqueueRequest, c: Change) -> Result<Option<&'static str>, ()> {
    Ok(match c {
        Change::Type => {
            r.job_type.push('x');
            Some("type")
        }
        Change::Payload => {
            r.payload = json!([r.payload.take()]);
            Some("payload")
        }
        Change::Queue => {
            let q = r.queue.as_deref().unwrap_or("default");
            r.queue = Some(if q == "billing" { "other" } else { "billing" }.into());
            Some("queue")
        }
        Change::JobId => {
            r.job_id = Some(format!("{}a", r.job_id.as_deref().unwrap_or("id")));
            Some("job_id")
        }
        Change::RunAt => {
            if r.delay_ms.is_some_and(|d| d != 0) {
                return Err(());
            }
            r.delay_ms = None; // 0 ≡ omitted
            r.run_at = Some(match r.run_at {
                Some(t) => t - chrono::Duration::seconds(1),
                None => at(5),
            });
            Some("run_at")
        }
        Change::Delay => {
            if r.run_at.is_some() {
                return Err(());
            }
            r.delay_ms = Some(r.delay_ms.unwrap_or(0) + 1);
            Some("delay_ms")
        }
        Change::MaxAttempts => {
            let n = r.max_attempts.unwrap_or(10);
            r.max_attempts = Some(if n == 1000 { 999 } else { n + 1 });
            Some("max_attempts")
        }
        Change::Retry => {
            let new = RetryPolicy::Fixed { delay_ms: 123_457 };
            r.retry = Some(if r.retry.as_ref() == Some(&new) {
                RetryPolicy::Fixed { delay_ms: 1 }
            } else {
                new
            });
            Some("retry")
        }
        Change::Timeout => {
            let t = r.timeout_ms.unwrap_or(1_800_000);
            r.timeout_ms = Some(if t == 86_400_000 { t - 1 } else { t + 1 });
            Some("timeout_ms")
        }
        Change::Deadline => {
            r.deadline = Some(match r.deadline {
                Some(d) => d + chrono::Duration::seconds(1),
                None => at(20 * 86_400),
            });
            Some("deadline")
        }
        Change::ConcurrencyKey => {
            r.concurrency_key = Some(format!("{}k", r.concurrency_key.as_deref().unwrap_or("")));
            Some("concurrency_key")
        }
        Change::Tags => {
            r.tags.push("zz".into());
            Some("tags")
        }
        Change::KeyTtl => {
            let Some(o) = r.idempotency.as_mut() else {
                return Err(());
            };
            o.ttl_ms = Some(o.ttl_ms.unwrap_or(86_400_000) + 1000);
            Some("idempotency.ttl_ms")
        }
        Change::Priority => {
            r.priority = Some(r.priority.unwrap_or(0) + 1);
            None
        }
        Change::Keep => {
            r.keep_ms = Some(r.keep_ms.unwrap_or(0) + 1);
            None
        }
        Change::Dedupe => {
            r.dedupe = match r.dedupe.take() {
                Some(_) => None,
                None => Some(DedupeOptions::key("d9")),
            };
            None
        }
        Change::KeyScope => {
            let Some(o) = r.idempotency.as_mut() else {
                return Err(());
            };
            o.scope = Some(format!("{}x", o.scope.as_deref().unwrap_or("default")));
            o.key.push('x');
            None
        }
    })
}

proptest! {
    #![proptest_config(cases(1000))]

    #[test]
    fn member_order_whitespace_and_equivalent_spellings_keep_the_fingerprint(
        req in arb_request(),
        seed in 1u64..,
    ) {
        let body = serde_json::to_value(&req).expect("serializes");
        let mut rng = Rng(seed);
        let mut text = String::new();
        write_json(&equivalent_body(&body, &mut rng), &mut rng, &mut text, false);
        let again: EnqueueRequest = serde_json::from_str(&text)
            .map_err(|e| TestCaseError::fail(format!("{e}: {text}")))?;
        prop_assert_eq!(changed(&req, &again)?, Vec::<String>::new(), "{}", text);
    }

    #[test]
    fn changing_one_field_changes_exactly_its_digest(
        req in arb_request(),
        change in prop::sample::select(CHANGES.to_vec()),
    ) {
        // Make the change applicable: run_at and delay are exclusive, and
        // the key's fields need a key.
        let mut req = req;
        match change {
            Change::RunAt => req.delay_ms = None,
            Change::Delay => req.run_at = None,
            Change::KeyTtl | Change::KeyScope if req.idempotency.is_none() => {
                req.idempotency = Some(IdempotencyOptions::new("k"));
            }
            _ => {}
        }
        let mut other = req.clone();
        let Ok(field) = apply(&mut other, change) else {
            return Err(TestCaseError::fail("the change does not apply"));
        };
        let expected: Vec<String> = field.into_iter().map(str::to_owned).collect();
        prop_assert_eq!(changed(&req, &other)?, expected);
    }
}
