//! The canonical fingerprint of an enqueue request and the hashing, preview
//! and digest of idempotency keys (docs/idempotency.md). Pure functions, pinned by golden
//! vectors in the tests below: any drift fails the build.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::request::{PreparedEnqueue, RetryPolicy, defaults};

/// Writes `v` in the canonical form of RFC 8785 (JCS): object members sorted
/// by their UTF-16 code units, no whitespace, strings escaped minimally and
/// numbers in ECMAScript form — except that integers are written as their
/// exact decimal text, so integers outside ±2^53 (which JCS would round
/// through a double) keep every digit. For every value JCS represents
/// exactly, the output is byte-for-byte JCS.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_canonical(v, &mut out);
    out
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                out.push_str(&i.to_string());
            } else if let Some(u) = n.as_u64() {
                out.push_str(&u.to_string());
            } else {
                // serde_json keeps each number's text: an integer beyond 64
                // bits is written with every digit, anything else in
                // ECMAScript form (a number beyond a double's range, which
                // a request cannot carry, as its text).
                let text = n.to_string();
                if is_integer_text(&text) {
                    out.push_str(&text);
                } else if let Some(f) = n.as_f64() {
                    let mut buf = ryu_js::Buffer::new();
                    out.push_str(buf.format_finite(f));
                } else {
                    out.push_str(&text);
                }
            }
        }
        Value::String(s) => write_string(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, item) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Value::Object(o) => {
            let mut members: Vec<(Vec<u16>, &String, &Value)> = o
                .iter()
                .map(|(k, v)| (k.encode_utf16().collect(), k, v))
                .collect();
            members.sort_by(|a, b| a.0.cmp(&b.0));
            out.push('{');
            for (i, (_, k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(k, out);
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
    }
}

/// Whether a JSON number's text is an integer: digits, after an optional
/// minus sign, with no fraction or exponent.
pub(crate) fn is_integer_text(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{08}' => out.push_str("\\b"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\u{0c}' => out.push_str("\\f"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// One digest per fingerprinted field, so a conflict can name the fields.
/// Field names are the API's dotted paths. Stored and sent as a JSON object
/// of field name → the first 16 bytes of the field's digest in hex
/// ([`Fingerprint::to_json`]); a request's is held as the thirteen digests
/// themselves, so taking one allocates nothing per field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    repr: Repr,
}

/// The two shapes of a fingerprint. A map whose names are all among
/// [`FIELDS`] with lowercase 32-digit hex values is always held as
/// `Digests`, so equal contents are equal values.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Repr {
    /// The digest of each of [`FIELDS`] by its place, `None` where absent.
    Digests([Option<[u8; 16]>; FIELDS.len()]),
    /// Any other map: a redrive's canonical overrides, or a stored value of
    /// another shape.
    Map(BTreeMap<String, String>),
}

impl Default for Fingerprint {
    fn default() -> Self {
        Self {
            repr: Repr::Digests([None; FIELDS.len()]),
        }
    }
}

impl Serialize for Fingerprint {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        match &self.repr {
            Repr::Map(m) => m.serialize(s),
            Repr::Digests(d) => {
                let present = d.iter().filter(|x| x.is_some()).count();
                let mut map = s.serialize_map(Some(present))?;
                for (name, digest) in FIELDS.iter().zip(d) {
                    if let Some(digest) = digest {
                        let mut text = [0u8; 32];
                        map.serialize_entry(name, hex16(digest, &mut text))?;
                    }
                }
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Fingerprint {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        BTreeMap::<String, String>::deserialize(d).map(Self::from_fields)
    }
}

/// The field that only an idempotency binding carries (not a job record).
pub const KEY_TTL_FIELD: &str = "idempotency.ttl_ms";

/// The fingerprinted fields, in the order of their names.
pub const FIELDS: [&str; 13] = [
    "concurrency_key",
    "deadline",
    "delay_ms",
    KEY_TTL_FIELD,
    "job_id",
    "max_attempts",
    "payload",
    "queue",
    "retry",
    "run_at",
    "tags",
    "timeout_ms",
    "type",
];

fn field_digest(name: &str, canonical: &str) -> [u8; 16] {
    let mut h = Sha256::new();
    h.update(b"idemq.fp.v1\0");
    h.update(name.as_bytes());
    h.update([0u8]);
    h.update(canonical.as_bytes());
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize()[..16]);
    out
}

/// The place of each field in [`FIELDS`].
const CONCURRENCY_KEY: usize = 0;
const DEADLINE: usize = 1;
const DELAY_MS: usize = 2;
const KEY_TTL: usize = 3;
const JOB_ID: usize = 4;
const MAX_ATTEMPTS: usize = 5;
const PAYLOAD: usize = 6;
const QUEUE: usize = 7;
const RETRY: usize = 8;
const RUN_AT: usize = 9;
const TAGS: usize = 10;
const TIMEOUT_MS: usize = 11;
const TYPE: usize = 12;

/// Digests every request of a process would otherwise compute again: each
/// field's `null` (most requests leave most fields out), no tags, and the
/// default retry policy.
struct Common {
    nulls: [[u8; 16]; FIELDS.len()],
    no_tags: [u8; 16],
    default_retry: [u8; 16],
    /// The digest of each field's usual value where it has one (the
    /// defaults of [`crate::request::defaults`], no tags), by its place.
    usual: [Option<[u8; 16]>; FIELDS.len()],
}

static COMMON: LazyLock<Common> = LazyLock::new(|| {
    let mut canonical = String::new();
    write_retry(&RetryPolicy::default(), &mut canonical);
    let default_retry = field_digest(FIELDS[RETRY], &canonical);
    let no_tags = field_digest(FIELDS[TAGS], "[]");
    let mut usual = [None; FIELDS.len()];
    usual[MAX_ATTEMPTS] = Some(field_digest(
        FIELDS[MAX_ATTEMPTS],
        &defaults::MAX_ATTEMPTS.to_string(),
    ));
    let mut queue = String::new();
    write_string(defaults::QUEUE, &mut queue);
    usual[QUEUE] = Some(field_digest(FIELDS[QUEUE], &queue));
    usual[RETRY] = Some(default_retry);
    usual[TAGS] = Some(no_tags);
    usual[TIMEOUT_MS] = Some(field_digest(
        FIELDS[TIMEOUT_MS],
        &defaults::TIMEOUT_MS.to_string(),
    ));
    Common {
        nulls: FIELDS.map(|name| field_digest(name, "null")),
        no_tags,
        default_retry,
        usual,
    }
});

/// The first byte of the compact form ([`Fingerprint::compact`]).
const COMPACT_TAG: u8 = 1;

fn write_retry(retry: &RetryPolicy, out: &mut String) {
    let value = serde_json::to_value(retry).unwrap_or(Value::Null);
    write_canonical(&value, out);
}

/// Writes the canonical form of each field into one reused buffer and keeps
/// its digest, by the field's place in [`FIELDS`].
struct Digests {
    buf: String,
    digests: [Option<[u8; 16]>; FIELDS.len()],
}

impl Digests {
    fn field(&mut self, at: usize, write: impl FnOnce(&mut String)) {
        self.buf.clear();
        write(&mut self.buf);
        self.digests[at] = Some(field_digest(FIELDS[at], &self.buf));
    }

    /// Keeps a digest computed once (see [`Common`]).
    fn known(&mut self, at: usize, digest: [u8; 16]) {
        self.digests[at] = Some(digest);
    }

    fn null(&mut self, at: usize) {
        self.known(at, COMMON.nulls[at]);
    }

    fn int(&mut self, at: usize, v: Option<i64>) {
        match v {
            Some(n) => self.field(at, |out| {
                use std::fmt::Write;
                let _ = write!(out, "{n}");
            }),
            None => self.null(at),
        }
    }

    fn str(&mut self, at: usize, v: Option<&str>) {
        match v {
            Some(s) => self.field(at, |out| write_string(s, out)),
            None => self.null(at),
        }
    }
}

impl Fingerprint {
    /// The fingerprint of a prepared request (defaults already resolved;
    /// `payload` is the request's JSON value before serialization).
    pub fn of(p: &PreparedEnqueue, payload: &Value) -> Self {
        let mut d = Digests {
            buf: String::with_capacity(64),
            digests: [None; FIELDS.len()],
        };
        d.str(CONCURRENCY_KEY, p.concurrency_key.as_deref());
        d.int(DEADLINE, p.deadline);
        d.int(DELAY_MS, p.delay_ms);
        d.int(KEY_TTL, p.idempotency.as_ref().map(|k| k.ttl_ms));
        d.str(JOB_ID, p.job_id.as_deref());
        d.int(MAX_ATTEMPTS, Some(i64::from(p.max_attempts)));
        d.field(PAYLOAD, |out| write_canonical(payload, out));
        d.str(QUEUE, Some(&p.queue));
        if p.retry == RetryPolicy::default() {
            d.known(RETRY, COMMON.default_retry);
        } else {
            d.field(RETRY, |out| write_retry(&p.retry, out));
        }
        d.int(RUN_AT, p.run_at);
        // Tags are sorted and distinct: their canonical array is their list.
        if p.tags.is_empty() {
            d.known(TAGS, COMMON.no_tags);
        } else {
            d.field(TAGS, |out| {
                out.push('[');
                for (i, t) in p.tags.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_string(t, out);
                }
                out.push(']');
            });
        }
        d.int(TIMEOUT_MS, Some(p.timeout_ms));
        d.str(TYPE, Some(&p.job_type));
        Self {
            repr: Repr::Digests(d.digests),
        }
    }

    /// A fingerprint of any fields (a redrive's overrides, a stored value):
    /// field name → its value as stored.
    pub fn from_fields(fields: BTreeMap<String, String>) -> Self {
        let mut digests = [None; FIELDS.len()];
        for (name, value) in &fields {
            let at = FIELDS.iter().position(|f| f == name);
            let digest = value
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
                .then(|| unhex16(value))
                .flatten();
            match (at, digest) {
                (Some(at), Some(digest)) => digests[at] = Some(digest),
                _ => {
                    return Self {
                        repr: Repr::Map(fields),
                    };
                }
            }
        }
        Self {
            repr: Repr::Digests(digests),
        }
    }

    /// Field name → value (a digest in hex), in the order of the names.
    pub fn fields(&self) -> BTreeMap<String, String> {
        match &self.repr {
            Repr::Map(m) => m.clone(),
            Repr::Digests(d) => FIELDS
                .iter()
                .zip(d)
                .filter_map(|(name, digest)| digest.map(|h| ((*name).to_owned(), hex(&h))))
                .collect(),
        }
    }

    /// The sorted names of the fields whose digests differ. With
    /// `against_job` (a request naming an existing job id), the key retention
    /// is not compared (a job record has none), nor the `job_id` field: the id
    /// matched, whether or not the job was accepted under an explicit one.
    pub fn diff(&self, other: &Fingerprint, against_job: bool) -> Vec<String> {
        let skipped = |n: &str| against_job && (n == KEY_TTL_FIELD || n == "job_id");
        if let (Repr::Digests(a), Repr::Digests(b)) = (&self.repr, &other.repr) {
            return FIELDS
                .iter()
                .zip(a.iter().zip(b))
                .filter(|(name, (x, y))| x != y && !skipped(name))
                .map(|(name, _)| (*name).to_owned())
                .collect();
        }
        let (a, b) = (self.fields(), other.fields());
        let mut names: Vec<&String> = a.keys().chain(b.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .filter(|n| !skipped(n) && a.get(*n) != b.get(*n))
            .cloned()
            .collect()
    }

    /// The fixed packed form: the 16-byte digests of the thirteen fields in
    /// the order of their names, zeros for a field that is missing (which no
    /// digest equals). The Redis backend stores it; so did PostgreSQL job
    /// rows before schema version 10 ([`Fingerprint::compact`]).
    pub fn packed(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(FIELDS.len() * 16);
        for digest in self.by_place() {
            out.extend_from_slice(&digest.unwrap_or_default());
        }
        out
    }

    /// The digest of each of [`FIELDS`] by its place, `None` where a field
    /// is missing or is not a digest (a map's other values).
    fn by_place(&self) -> [Option<[u8; 16]>; FIELDS.len()] {
        match &self.repr {
            Repr::Digests(d) => *d,
            Repr::Map(m) => FIELDS.map(|name| m.get(name).and_then(|h| unhex16(h))),
        }
    }

    /// The compact form a PostgreSQL job row stores (schema version 10):
    /// the byte 1, then two bits per field of [`FIELDS`] in a big-endian
    /// `u32` (field `i` in bits `2i` and `2i + 1`): 0 absent, 1 the digest
    /// of `null`, 2 the digest of the field's usual value (the default
    /// queue, attempt budget, retry policy and timeout, no tags), 3 a digest
    /// that follows; then the digests that follow, in the order of the
    /// fields. A request that sets only its queue, type and payload takes 53
    /// bytes instead of the 208 of [`Fingerprint::packed`]. The length of
    /// the compact form is 5 plus a multiple of 16, never a multiple of 16,
    /// so a reader tells the two forms apart (`idemq.fp_unpack`).
    pub fn compact(&self) -> Vec<u8> {
        let mut bits: u32 = 0;
        let mut out = Vec::with_capacity(5 + 3 * 16);
        out.push(COMPACT_TAG);
        out.extend_from_slice(&[0; 4]);
        for (at, digest) in self.by_place().iter().enumerate() {
            let code = match digest {
                None => 0,
                Some(d) if *d == COMMON.nulls[at] => 1,
                Some(d) if COMMON.usual[at] == Some(*d) => 2,
                Some(d) => {
                    out.extend_from_slice(d);
                    3
                }
            };
            bits |= code << (2 * at);
        }
        out[1..5].copy_from_slice(&bits.to_be_bytes());
        out
    }

    /// Serialized for storage.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses a stored fingerprint (an unreadable one compares unequal to everything).
    pub fn from_json(s: &str) -> Self {
        serde_json::from_str(s).unwrap_or_default()
    }
}

/// Hashes idempotency keys: SHA-256 of `len(scope) as u32 BE ‖ scope ‖ key`,
/// or HMAC-SHA-256 over the same input with the installation secret
/// (`IDEMQ_KEY_SECRET`), which stops a digest of a guessable key from being
/// reversed by trying candidates.
#[derive(Clone, Default)]
pub struct KeyHasher {
    secret: Option<Vec<u8>>,
}

impl std::fmt::Debug for KeyHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyHasher")
            .field("keyed", &self.secret.is_some())
            .finish()
    }
}

impl KeyHasher {
    /// Plain SHA-256.
    pub fn plain() -> Self {
        Self { secret: None }
    }

    /// HMAC-SHA-256 with `secret`.
    pub fn with_secret(secret: impl Into<Vec<u8>>) -> Self {
        Self {
            secret: Some(secret.into()),
        }
    }

    /// The stored hash of `key` in `scope`.
    pub fn hash(&self, scope: &str, key: &str) -> [u8; 32] {
        let len = u32::try_from(scope.len()).unwrap_or(u32::MAX).to_be_bytes();
        let mut out = [0u8; 32];
        match &self.secret {
            None => {
                let mut h = Sha256::new();
                h.update(len);
                h.update(scope.as_bytes());
                h.update(key.as_bytes());
                out.copy_from_slice(&h.finalize());
            }
            Some(secret) => {
                // HMAC accepts keys of any length, so this cannot fail.
                let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(secret)
                    .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
                m.update(&len);
                m.update(scope.as_bytes());
                m.update(key.as_bytes());
                out.copy_from_slice(&m.finalize().into_bytes());
            }
        }
        out
    }

    /// The check value the store records for this hashing
    /// (docs/idempotency.md, "One key secret per installation"): `sha256`
    /// without a secret, else `hmac-sha256:` and 16 hex digits of
    /// HMAC-SHA-256(secret, a fixed label). It tells hashings apart without
    /// revealing the secret.
    pub fn check_value(&self) -> String {
        match &self.secret {
            None => "sha256".to_owned(),
            Some(secret) => {
                let mut m = <Hmac<Sha256> as KeyInit>::new_from_slice(secret)
                    .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
                m.update(b"idemq key check v1");
                let tag = m.finalize().into_bytes();
                let hex: String = tag[..8].iter().map(|b| format!("{b:02x}")).collect();
                format!("hmac-sha256:{hex}")
            }
        }
    }
}

/// The first min(8, ⌊n/2⌋) characters of an n-character key, then `…`.
pub fn key_preview(key: &str) -> String {
    let n = key.chars().count();
    let mut p: String = key.chars().take(8.min(n / 2)).collect();
    p.push('…');
    p
}

/// The first 16 hex characters of a stored key hash.
pub fn key_digest(hash: &[u8; 32]) -> String {
    hex(&hash[..8])
}

/// Lower-case hex.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(DIGITS[usize::from(b >> 4)]));
        s.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// A 16-byte digest in lower-case hex, written into `out`.
fn hex16<'a>(digest: &[u8; 16], out: &'a mut [u8; 32]) -> &'a str {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in digest.iter().enumerate() {
        out[2 * i] = DIGITS[usize::from(b >> 4)];
        out[2 * i + 1] = DIGITS[usize::from(b & 0x0f)];
    }
    // Every byte written is an ASCII digit or letter.
    std::str::from_utf8(out).unwrap_or_default()
}

/// The value of one lowercase or uppercase hex digit.
fn hex_digit(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    }
}

/// The 16 bytes of a 32-digit hex digest, or `None` for anything else.
fn unhex16(h: &str) -> Option<[u8; 16]> {
    let h = h.as_bytes();
    if h.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = (hex_digit(h[2 * i])? << 4) | hex_digit(h[2 * i + 1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    //! Golden vectors: fixed input, fixed output, computed independently of
    //! this code. A change here changes every stored binding: it needs a new
    //! fingerprint version, never an edit of these values.

    use serde_json::json;

    use super::*;
    use crate::request::EnqueueRequest;

    #[test]
    fn rfc8785_sample_is_canonical() {
        let input = r#"{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],
            "string":"\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
            "literals":[null,true,false]}"#;
        let v: Value = serde_json::from_str(input).unwrap();
        assert_eq!(
            canonical_json(&v),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    #[test]
    fn members_sort_by_utf16_code_units() {
        let input = "{\"\\u20ac\":\"Euro\",\"\\r\":\"CR\",\"\\ufb33\":\"Hebrew\",\"1\":\"One\",\
                     \"\\ud83d\\ude00\":\"Smiley\",\"\\u0080\":\"Control\",\"\\u00f6\":\"Latin\"}";
        let v: Value = serde_json::from_str(input).unwrap();
        let order: Vec<&str> = ["\r", "1", "\u{80}", "ö", "€", "😀", "\u{fb33}"].to_vec();
        let expected = format!(
            "{{{}}}",
            order
                .iter()
                .zip(["CR", "One", "Control", "Latin", "Euro", "Smiley", "Hebrew"])
                .map(|(k, v)| format!("{}:\"{v}\"", canonical_json(&Value::String((*k).into()))))
                .collect::<Vec<_>>()
                .join(",")
        );
        assert_eq!(canonical_json(&v), expected);
    }

    #[test]
    fn big_integers_keep_every_digit() {
        let v: Value = serde_json::from_str(
            "[9007199254740993,-9007199254740993,18446744073709551615,1.0,-0.0]",
        )
        .unwrap();
        assert_eq!(
            canonical_json(&v),
            "[9007199254740993,-9007199254740993,18446744073709551615,1,0]"
        );
        // Beyond 64 bits too: the parser keeps the text, and two integers
        // a double cannot tell apart keep different fingerprints.
        let v: Value = serde_json::from_str(
            "[18446744073709551616,18446744073709551617,-99999999999999999999999,1e2,10.50,1E-7]",
        )
        .unwrap();
        assert_eq!(
            canonical_json(&v),
            "[18446744073709551616,18446744073709551617,-99999999999999999999999,100,10.5,1e-7]"
        );
    }

    #[test]
    fn key_hash_golden_vectors() {
        let plain = KeyHasher::plain();
        assert_eq!(
            hex(&plain.hash("default", "capture:inv_42")),
            "84577f4cb46ca0ab0f7fe149730cae2df7936f8c6142374c36164ca5f6ab6efe"
        );
        assert_eq!(
            hex(&plain.hash("invoice-capture", "capture:inv_42")),
            "ea48dda51fcaaf72cef14f73b8e17804dfb7487f9f332313ffccbc2723c1082c"
        );
        let keyed = KeyHasher::with_secret(b"installation-secret".to_vec());
        assert_eq!(
            hex(&keyed.hash("default", "capture:inv_42")),
            "fcacf68aa3d82b0a51dc9207e1b2e558eee1265f6c27010f0a17681e7bf15b17"
        );
        assert_eq!(
            key_digest(&plain.hash("default", "capture:inv_42")),
            "84577f4cb46ca0ab"
        );
    }

    #[test]
    fn key_previews() {
        assert_eq!(key_preview("capture:inv_42"), "capture…");
        assert_eq!(key_preview("a-much-longer-key-than-eight"), "a-much-l…");
        assert_eq!(key_preview("ab"), "a…");
        assert_eq!(key_preview("a"), "…");
        assert_eq!(key_preview("äöüßäöüß"), "äöüß…", "characters, not bytes");
    }

    #[test]
    fn fingerprint_golden_vector() {
        let req = EnqueueRequest::new("invoice.capture")
            .queue("billing")
            .payload(json!({"invoice_id": "inv_42", "amount": 1250}))
            .tag("eu")
            .tag("billing")
            .tag("eu")
            .idempotency_key("capture:inv_42");
        let p = req.prepare(&KeyHasher::plain(), 1 << 20).unwrap();
        let expected = [
            ("concurrency_key", "6ad993538865560589613cd63a6ea90f"),
            ("deadline", "5d557b1ca5415e649f0a129bf5230ce2"),
            ("delay_ms", "bd27747bc9f8be4e92f1c3a594e4e633"),
            ("idempotency.ttl_ms", "b907e9fa28b9efdb309e0b5c9d4c4ddc"),
            ("job_id", "07b82cd0889f4887df0eb046f91eaa8a"),
            ("max_attempts", "c925066ab28cafb7f70c9ecba97db174"),
            ("payload", "9dc54b2a09bd7e0d72b123beac4b1745"),
            ("queue", "7732cd47b8c9e0d12e27df3f3286eabb"),
            ("retry", "4d4220e2dc66a9341de032364db4fb04"),
            ("run_at", "19b3a6c8b44d66c4eda01912f7c0e980"),
            ("tags", "1a8de48e711e5b43794edec3e625ae58"),
            ("timeout_ms", "977a4f506b2f576d503668f0f1a81942"),
            ("type", "ccdb65ec22500ff238f9841d1c1b912a"),
        ];
        let fields = p.fingerprint.fields();
        let got: Vec<(&str, &str)> = fields
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert_eq!(got, expected.to_vec());
        // The packed form is the same digests in the order of FIELDS, which
        // is the order of the names (what `idemq.fp_pack` writes).
        let names: Vec<&str> = expected.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, FIELDS.to_vec());
        let packed: String = expected.iter().map(|(_, h)| *h).collect();
        assert_eq!(hex(&p.fingerprint.packed()), packed);
    }

    /// The digests kept from the first request are the ones a request
    /// computes: no tags, each field's `null`, and a policy other than the
    /// default, which is computed every time.
    #[test]
    fn kept_digests_are_the_computed_ones() {
        let p = EnqueueRequest::new("t")
            .retry(RetryPolicy::Fixed { delay_ms: 2500 })
            .prepare(&KeyHasher::plain(), 1 << 20)
            .unwrap();
        let f = p.fingerprint.fields();
        let digest = |name: &str, canonical: &str| hex(&field_digest(name, canonical));
        assert_eq!(f["tags"], digest("tags", "[]"));
        assert_eq!(
            f["retry"],
            digest("retry", r#"{"delay_ms":2500,"kind":"fixed"}"#)
        );
        for name in [
            "concurrency_key",
            "deadline",
            "delay_ms",
            "job_id",
            "run_at",
        ] {
            assert_eq!(f[name], digest(name, "null"), "{name}");
        }
        let with_default = EnqueueRequest::new("t")
            .prepare(&KeyHasher::plain(), 1 << 20)
            .unwrap();
        assert_eq!(
            with_default.fingerprint.fields()["retry"],
            digest(
                "retry",
                r#"{"factor":2,"initial_ms":1000,"jitter":true,"kind":"exponential","max_ms":3600000}"#
            )
        );
    }

    /// A request's fingerprint, its JSON read back, and the same fields
    /// given as a map are one value; a map of other fields (a redrive's)
    /// stays a map and compares field by field with a request's.
    #[test]
    fn every_shape_of_the_same_fields_is_one_value() {
        let p = EnqueueRequest::new("t")
            .idempotency_key("k")
            .prepare(&KeyHasher::plain(), 1 << 20)
            .unwrap();
        let fp = p.fingerprint;
        let json = fp.to_json();
        assert_eq!(Fingerprint::from_json(&json), fp);
        assert_eq!(Fingerprint::from_fields(fp.fields()), fp);
        let as_map: BTreeMap<String, String> = serde_json::from_str(&json).unwrap();
        assert_eq!(as_map, fp.fields());
        assert_eq!(as_map.len(), FIELDS.len());
        // Fewer fields: absent ones pack as zeros and differ.
        let mut fewer = fp.fields();
        fewer.remove("payload");
        let fewer = Fingerprint::from_fields(fewer);
        assert_eq!(fewer.diff(&fp, false), ["payload"]);
        assert_eq!(
            &fewer.packed()[16 * PAYLOAD..16 * (PAYLOAD + 1)],
            &[0u8; 16]
        );
        // Another shape: kept as given, serialized as given.
        let mut other = fp.fields();
        other.insert("reset_checkpoints".into(), "true".into());
        other.insert("queue".into(), "\"q\"".into());
        let other = Fingerprint::from_fields(other.clone());
        assert_eq!(other.fields().len(), FIELDS.len() + 1);
        assert_eq!(other.diff(&fp, false), ["queue", "reset_checkpoints"]);
        assert_eq!(Fingerprint::from_json(&other.to_json()), other);
        assert_ne!(other, fp);
        // Uppercase hex is another value, as it always compared.
        let mut upper = fp.fields();
        let t = upper["type"].to_ascii_uppercase();
        upper.insert("type".into(), t);
        assert_eq!(Fingerprint::from_fields(upper).diff(&fp, false), ["type"]);
        assert_eq!(Fingerprint::from_json("not json"), Fingerprint::default());
        assert_eq!(Fingerprint::default().fields().len(), 0);
    }

    #[test]
    fn diff_against_a_job_skips_key_retention_and_id() {
        let a = EnqueueRequest::new("t").job_id("x").idempotency_key("k");
        let b = EnqueueRequest::new("t").payload(json!(1));
        let h = KeyHasher::plain();
        let (pa, pb) = (
            a.prepare(&h, 1 << 20).unwrap(),
            b.prepare(&h, 1 << 20).unwrap(),
        );
        assert_eq!(
            pa.fingerprint.diff(&pb.fingerprint, false),
            ["idempotency.ttl_ms", "job_id", "payload"]
        );
        assert_eq!(pa.fingerprint.diff(&pb.fingerprint, true), ["payload"]);
    }

    #[test]
    fn compact_form_keeps_only_the_unusual_digests() {
        let h = KeyHasher::plain();
        // Queue, attempts, retry, timeout and tags at their defaults, the
        // rest left out: only the type and the payload follow the bits.
        let usual = EnqueueRequest::new("t")
            .payload(json!({"a": 1}))
            .prepare(&h, 1 << 20)
            .unwrap()
            .fingerprint;
        let c = usual.compact();
        assert_eq!(c.len(), 5 + 2 * 16);
        assert_eq!(c[0], COMPACT_TAG);
        let bits = u32::from_be_bytes([c[1], c[2], c[3], c[4]]);
        let code = |at: usize| (bits >> (2 * at)) & 3;
        assert_eq!(
            code(KEY_TTL),
            1,
            "a keyless request fingerprints its ttl as null"
        );
        for at in [CONCURRENCY_KEY, DEADLINE, DELAY_MS, JOB_ID, RUN_AT] {
            assert_eq!(code(at), 1, "{} is null", FIELDS[at]);
        }
        for at in [MAX_ATTEMPTS, QUEUE, RETRY, TAGS, TIMEOUT_MS] {
            assert_eq!(code(at), 2, "{} is usual", FIELDS[at]);
        }
        let digests = usual.fields();
        assert_eq!(hex(&c[5..21]), digests["payload"]);
        assert_eq!(hex(&c[21..37]), digests["type"]);
        // Every field set to something else: thirteen digests follow.
        let all = EnqueueRequest::new("t")
            .queue("q")
            .payload(json!([1]))
            .job_id("j")
            .idempotency_key("k")
            .max_attempts(2)
            .timeout(std::time::Duration::from_secs(1))
            .tag("x")
            .concurrency_key("c")
            .delay(std::time::Duration::from_secs(1))
            .deadline(chrono::DateTime::from_timestamp(4_000_000_000, 0).unwrap())
            .retry(RetryPolicy::None)
            .prepare(&h, 1 << 20)
            .unwrap()
            .fingerprint;
        let c = all.compact();
        assert_eq!(c.len() % 16, 5);
        let bits = u32::from_be_bytes([c[1], c[2], c[3], c[4]]);
        let explicit = (0..FIELDS.len())
            .filter(|at| (bits >> (2 * at)) & 3 == 3)
            .count();
        assert_eq!(c.len(), 5 + 16 * explicit);
        assert!(explicit >= 11, "{explicit} digests follow");
        // A field that is absent (a redrive's map, say) is code 0.
        assert_eq!(Fingerprint::default().compact(), [COMPACT_TAG, 0, 0, 0, 0]);
        assert_ne!(usual.compact(), all.compact());
    }
}
