//! Enqueue, explain and redrive on PostgreSQL: the prepared requests travel
//! as one JSON array to `idemq.enqueue`, which answers one row per item.

use std::sync::atomic::{AtomicBool, Ordering};

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use super::db::{self, Db};
use super::db_err;
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, hex};
use crate::job::{EnqueueResult, JobState, Outcome, Undecodable};
use crate::request::{DedupeMode, PreparedEnqueue, PreparedKey, RetryPolicy};
use crate::store::{Explain, ExplainDedupe, ExplainIdempotency, JobRedrive};

#[derive(Serialize)]
struct Key<'a> {
    scope: &'a str,
    hash: String,
    preview: &'a str,
    ttl_ms: i64,
}

impl<'a> Key<'a> {
    fn of(k: &'a PreparedKey) -> Self {
        Self {
            scope: &k.scope,
            hash: hex(&k.hash),
            preview: &k.preview,
            ttl_ms: k.ttl_ms,
        }
    }
}

#[derive(Serialize)]
struct Dedupe<'a> {
    key: &'a str,
    mode: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    ttl_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_wait_ms: Option<i64>,
}

/// One prepared request as `idemq.enqueue_one` reads it: absent options are
/// absent keys.
#[derive(Serialize)]
struct Item<'a> {
    #[serde(rename = "type")]
    job_type: &'a str,
    payload: &'a RawValue,
    queue: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    job_id: Option<&'a str>,
    new_id: String,
    priority: i16,
    #[serde(skip_serializing_if = "Option::is_none")]
    run_at: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delay_ms: Option<i64>,
    max_attempts: i32,
    retry: &'a RetryPolicy,
    timeout_ms: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    concurrency_key: Option<&'a str>,
    tags: &'a [String],
    #[serde(skip_serializing_if = "Option::is_none")]
    keep_ms: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    idem: Option<Key<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dedupe: Option<Dedupe<'a>>,
    fingerprint: &'a Fingerprint,
    /// The compact form the job row stores, in hex (`idemq.fp_pack` of
    /// `fingerprint`, which the function would otherwise compute).
    fp: String,
}

fn items_json(items: &[PreparedEnqueue]) -> Result<String> {
    let raws: Vec<Box<RawValue>> = items
        .iter()
        .map(|p| RawValue::from_string(p.payload.clone()))
        .collect::<Result<_, _>>()
        .map_err(|e| Error::Backend {
            message: format!("payload is not JSON: {e}"),
        })?;
    let wire: Vec<Item> = items
        .iter()
        .zip(&raws)
        .map(|(p, raw)| Item {
            job_type: &p.job_type,
            payload: raw,
            queue: &p.queue,
            job_id: p.job_id.as_deref(),
            new_id: uuid::Uuid::now_v7().to_string(),
            priority: p.priority,
            run_at: p.run_at,
            delay_ms: p.delay_ms,
            max_attempts: p.max_attempts,
            retry: &p.retry,
            timeout_ms: p.timeout_ms,
            deadline: p.deadline,
            concurrency_key: p.concurrency_key.as_deref(),
            tags: &p.tags,
            keep_ms: p.keep_ms,
            idem: p.idempotency.as_ref().map(Key::of),
            dedupe: p.dedupe.as_ref().map(|d| Dedupe {
                key: &d.key,
                mode: d.mode.as_str(),
                ttl_ms: d.ttl_ms,
                max_wait_ms: d.max_wait_ms,
            }),
            fingerprint: &p.fingerprint,
            fp: hex(&p.fingerprint.compact()),
        })
        .collect();
    to_json(&wire)
}

/// Turns an error object returned by `function` into the typed error. An
/// object this version cannot read (an unknown kind, a member missing) is a
/// `Backend` error, never a conflict or validation with blank members.
fn item_error(function: &str, err: &Value, key: Option<&PreparedKey>) -> Error {
    let bad = |e: Undecodable| {
        e.at(
            format!("answer of {function}"),
            &format!("{function}.error"),
        )
    };
    let s = |k: &str| -> Result<String> {
        err.get(k)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| bad(Undecodable::invalid(&format!("no string {k:?} in"), err)))
    };
    let decoded = match err.get("kind").and_then(Value::as_str) {
        Some("conflict") => (|| {
            let source = s("source")?;
            let by_key = match source.as_str() {
                "idempotency_key" => true,
                "job_id" => false,
                _ => return Err(bad(Undecodable::unknown("conflict source", &source))),
            };
            let key = key.filter(|_| by_key);
            let fields = err
                .get("fields")
                .and_then(Value::as_array)
                .and_then(|a| {
                    a.iter()
                        .map(|f| f.as_str().map(str::to_owned))
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| bad(Undecodable::invalid("no list of fields in", err)))?;
            Ok(Error::idempotency_conflict(s("job_id")?, key, fields))
        })(),
        Some("validation") => s("field").and_then(|f| Ok(Error::validation(f, s("reason")?))),
        Some("not_found") => s("job_id").map(|id| Error::job_not_found(&id)),
        _ => Err(bad(Undecodable::invalid("an unknown error object", err))),
    };
    decoded.unwrap_or_else(|e| e)
}

/// Decodes the outcome (and reason) `function` answered with for `job_id`.
fn outcome(function: &str, job_id: &str, name: &str, why: Option<&str>) -> Result<Outcome> {
    Outcome::from_stored(name, why).map_err(|e| {
        e.at(
            format!("answer of {function} for job {job_id}"),
            &format!("{function}.outcome, {function}.reason"),
        )
    })
}

/// Enqueues on a connection (the caller's transaction or a pooled one):
/// requests without keys by one prepared statement, any other call by
/// `idemq.enqueue`.
pub(super) async fn enqueue(
    conn: &mut PgConnection,
    items: &[PreparedEnqueue],
    repeating: &Repeating,
) -> Result<Vec<Result<EnqueueResult>>> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    if items.iter().all(is_plain) {
        return enqueue_plain(conn, items).await;
    }
    let rows = match items {
        [
            item @ PreparedEnqueue {
                idempotency: Some(key),
                job_id: None,
                dedupe: None,
                ..
            },
        ] => return Ok(vec![only_keyed(conn, item, key, repeating, None).await?]),
        [
            item @ PreparedEnqueue {
                idempotency: Some(key),
                ..
            },
        ] => keyed_one(conn, item, key).await?,
        _ => decided(conn, items).await?,
    };
    answers(&rows, items)
}

/// The answers of `idemq.enqueue` (or a statement shaped like its answer),
/// one row per item of `items`.
fn answers(rows: &[PgRow], items: &[PreparedEnqueue]) -> Result<Vec<Result<EnqueueResult>>> {
    let mut out: Vec<Result<EnqueueResult>> = Vec::with_capacity(items.len());
    for (row, item) in rows.iter().zip(items) {
        let error: Option<Value> = row.try_get("error").map_err(db_err)?;
        out.push(match error {
            Some(e) => Err(item_error("idemq.enqueue", &e, item.idempotency.as_ref())),
            None => {
                let name: String = row.try_get("outcome").map_err(db_err)?;
                let why: Option<String> = row.try_get("reason").map_err(db_err)?;
                let job_id: String = row.try_get("job_id").map_err(db_err)?;
                Ok(EnqueueResult {
                    outcome: outcome("idemq.enqueue", &job_id, &name, why.as_deref())?,
                    job_id,
                })
            }
        });
    }
    if out.len() != items.len() {
        return Err(Error::Backend {
            message: "idemq.enqueue returned too few rows".into(),
        });
    }
    Ok(out)
}

/// Every request of `items` decided by `idemq.enqueue`.
async fn decided(conn: &mut PgConnection, items: &[PreparedEnqueue]) -> Result<Vec<PgRow>> {
    sqlx::query("SELECT idx, job_id, outcome, reason, error FROM idemq.enqueue($1::jsonb)")
        .bind(items_json(items)?)
        .persistent(db::prepared())
        .fetch_all(&mut *conn)
        .await
        .map_err(db_err)
}

/// One request with an idempotency key and an explicit job id or a dedupe
/// key. A repeat (a live binding of the key whose compact fingerprint is
/// the request's, compared as bytes as in `only_keyed`) is answered by a
/// plain read of the binding, as `idemq.enqueue` would answer it, without
/// entering PL/pgSQL: the request's document travels as text and becomes
/// `jsonb` only in the branch that calls `idemq.enqueue`, which a found
/// binding filters out before it runs (a one-time filter), so a replay
/// does not enter the function, and once the session runs the statement's
/// generic plan (from its sixth execution on a connection) does not parse
/// the document either: the custom plans before it fold the cast into a
/// constant, which parses it. Anything else (a new key, a
/// conflict, a binding without the compact form, a binding of a
/// transaction still running) is decided by `idemq.enqueue`, with the
/// key's lock, in the same statement.
async fn keyed_one(
    conn: &mut PgConnection,
    item: &PreparedEnqueue,
    key: &PreparedKey,
) -> Result<Vec<PgRow>> {
    sqlx::query(
        "WITH n AS MATERIALIZED (SELECT idemq.now() AS now),
         hit AS MATERIALIZED (
             SELECT i.job_id FROM idemq.idempotency i, n
             WHERE i.scope = $1 AND i.key_hash = $2 AND i.expires_at > n.now
               AND i.fp = $3)
         SELECT 0 AS idx, h.job_id, 'replayed'::text AS outcome, NULL::text AS reason,
                NULL::jsonb AS error
         FROM hit h
         UNION ALL
         SELECT e.idx, e.job_id, e.outcome, e.reason, e.error
         FROM idemq.enqueue($4::text::jsonb) e
         WHERE NOT EXISTS (SELECT 1 FROM hit)",
    )
    .bind(&key.scope)
    .bind(&key.hash[..])
    .bind(&item.fingerprint.compact()[..])
    .bind(items_json(std::slice::from_ref(item))?)
    .persistent(db::prepared())
    .fetch_all(&mut *conn)
    .await
    .map_err(db_err)
}

/// Whether the last request a store's `only_keyed` answered found its key
/// bound (a replay). Only a choice of statements rides on it, never an
/// answer: both ways decide every request alike.
#[derive(Debug, Default)]
pub(crate) struct Repeating(AtomicBool);

impl Repeating {
    pub(super) fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, repeating: bool) {
        self.0.store(repeating, Ordering::Relaxed);
    }
}

/// The idempotency key of a request whose only key it is (no explicit id,
/// no dedupe key): the commonest keyed call, which `only_keyed` answers.
pub(super) fn only_key(p: &PreparedEnqueue) -> Option<&PreparedKey> {
    match p {
        PreparedEnqueue {
            idempotency: Some(key),
            job_id: None,
            dedupe: None,
            ..
        } => Some(key),
        _ => None,
    }
}

/// A request whose only key is its idempotency key (no explicit id, no
/// dedupe key), the commonest keyed call, by plain statements, in one
/// round trip when the key is new or repeated:
///
/// - `KEYED_NEW` reads the key's live binding and, if it has none, binds
///   the key and inserts the job in the same statement. A binding whose
///   compact fingerprint is the request's (compared as bytes; neither the
///   request's document nor its JSON fingerprint is decoded) answers a
///   replay, and the statement then writes nothing.
/// - While repeats come in (the last request answered was a replay), a
///   plain read of the binding goes first: a replay is then one index
///   probe, where `KEYED_NEW` also sets up its two inserts (about twice
///   the server's time of the read alone). A key the read finds free goes
///   on to `KEYED_NEW`. The read is `known` when the caller made it
///   already (outside a transaction, concurrent replays share one: see
///   group.rs).
///
/// `idemq.enqueue` decides the rest: a binding with another fingerprint
/// (it names the differing fields), one without the compact form (written
/// before schema version 13, or by a redrive), a key bound by a
/// transaction that committed after the statement began, or a request the
/// clock refuses.
pub(super) async fn only_keyed(
    conn: &mut PgConnection,
    item: &PreparedEnqueue,
    key: &PreparedKey,
    repeating: &Repeating,
    known: Option<Bound>,
) -> Result<Result<EnqueueResult>> {
    let fingerprint = item.fingerprint.compact();
    let read = match known {
        Some(found) => Some(found),
        // After a replay, a plain read first.
        None if repeating.get() => Some(bound(conn, &key.scope, &key.hash, &fingerprint).await?),
        None => None,
    };
    // A binding the read found decides.
    let statement = match read {
        None => true,
        Some(Bound::Same(job_id)) => return Ok(Ok(replayed(job_id))),
        Some(Bound::Other) => false,
        Some(Bound::Free) => {
            repeating.set(false);
            true
        }
    };
    if statement {
        match keyed_new(conn, item, key, &fingerprint).await? {
            Keyed::Accepted(job_id) => {
                return Ok(Ok(EnqueueResult {
                    job_id,
                    outcome: Outcome::Accepted,
                }));
            }
            Keyed::Replayed(job_id) => {
                repeating.set(true);
                return Ok(Ok(replayed(job_id)));
            }
            Keyed::Undecided => {}
        }
    }
    let items = std::slice::from_ref(item);
    let rows = decided(conn, items).await?;
    answers(&rows, items)?.pop().ok_or_else(|| Error::Backend {
        message: "idemq.enqueue returned no row".into(),
    })
}

pub(super) fn replayed(job_id: String) -> EnqueueResult {
    EnqueueResult {
        job_id,
        outcome: Outcome::Replayed,
    }
}

/// What a read of a key's live binding found.
#[derive(Debug)]
pub(super) enum Bound {
    /// A binding with the request's compact fingerprint: its job.
    Same(String),
    /// A binding with another fingerprint, or none in compact form.
    Other,
    /// No live binding.
    Free,
}

/// Reads the live binding of the key `hash` of `scope`, comparing its
/// compact fingerprint with `fingerprint`.
pub(super) async fn bound(
    conn: &mut PgConnection,
    scope: &str,
    hash: &[u8],
    fingerprint: &[u8],
) -> Result<Bound> {
    let found = sqlx::query(
        "SELECT i.job_id, i.fp = $3 AS same
         FROM idemq.idempotency i
         WHERE i.scope = $1 AND i.key_hash = $2 AND i.expires_at > idemq.now()",
    )
    .bind(scope)
    .bind(hash)
    .bind(fingerprint)
    .persistent(db::prepared())
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_err)?;
    found.as_ref().map_or(Ok(Bound::Free), bound_of)
}

/// The binding a row of a read found (its `job_id`, and whether its
/// compact fingerprint is the request's as `same`).
pub(super) fn bound_of(row: &PgRow) -> Result<Bound> {
    Ok(
        match row.try_get::<Option<bool>, _>("same").map_err(db_err)? {
            Some(true) => Bound::Same(row.try_get("job_id").map_err(db_err)?),
            _ => Bound::Other,
        },
    )
}

/// When a request is due: at `run_at` (µs since the epoch), else `delay_ms`
/// (or nothing) after `now`, the clock of record.
#[rustfmt::skip]
macro_rules! due {
    ($run_at:literal, $delay_ms:literal, $now:literal) => {
        concat!("CASE WHEN ", $run_at, " IS NOT NULL THEN idemq.us(", $run_at, ")
                ELSE ", $now, " + idemq.ms(coalesce(", $delay_ms, ", 0)) END")
    };
}

/// The field for which the clock of record refuses a request, or NULL:
/// `deadline` (µs) already passed at `now`, or `run_at` (or `delay_ms`, if
/// that set when it is due) not before the deadline; the checks of
/// `idemq.enqueue_one`.
#[rustfmt::skip]
macro_rules! refused {
    ($deadline:literal, $delay_ms:literal, $due:literal, $now:literal) => {
        concat!("CASE
        WHEN ", $deadline, " IS NULL THEN NULL
        WHEN idemq.us(", $deadline, ") <= ", $now, " THEN 'deadline'
        WHEN ", $due, " >= idemq.us(", $deadline, ") THEN
            CASE WHEN ", $delay_ms, " IS NULL THEN 'run_at' ELSE 'delay_ms' END
        END")
    };
}

/// A request whose only key is its idempotency key, in one statement:
/// it reads the key's live binding (answered as it is, and nothing is
/// written, when there is one), and otherwise takes the key's lock (as
/// `idemq.enqueue` does), reads the clock of record once it holds the
/// lock, binds the key and inserts the job, with no PL/pgSQL (whose
/// statements and helpers cost a keyed enqueue three times a keyless one).
/// The key's binding is inserted first, and the job only if it went in:
/// the primary key of `idemq.idempotency` decides a race with a binding
/// committed after the statement's snapshot (or still being written,
/// which the insert waits for), and an expired binding is replaced as
/// `idemq.bind_key` replaces it. A key bound meanwhile writes nothing and
/// answers `NULL`: `idemq.enqueue` then decides the request (a replay or a
/// conflict), reading the binding afresh. So does a request the clock
/// would refuse (its deadline passed, or due after it): the key is decided
/// before the clock (SPEC 5), and a binding committed while this statement
/// waited for the key's lock makes it a replay, not a refusal.
const KEYED_NEW: &str = concat!(
    "
WITH probe AS MATERIALIZED (
    SELECT i.job_id, i.fp = $15::bytea AS same
    FROM idemq.idempotency i
    WHERE i.scope = $16::text AND i.key_hash = $18::bytea AND i.expires_at > idemq.now()
),
lk AS MATERIALIZED (
    SELECT pg_advisory_xact_lock(hashtextextended('idemq.key:' || $16::text || ':' || $17::text, 0))
    WHERE NOT EXISTS (SELECT 1 FROM probe)
),
t AS MATERIALIZED (
    SELECT c.now, c.due, ",
    refused!("$11::int8", "$7::int8", "c.due", "c.now"),
    " AS refused
    FROM (SELECT n.now, ",
    due!("$6::int8", "$7::int8", "n.now"),
    " AS due
          FROM (SELECT idemq.now() AS now FROM lk) n) c
),
bound AS (
    INSERT INTO idemq.idempotency AS i
        (scope, key_hash, key_preview, job_id, fingerprint, fp, created_at, expires_at)
    SELECT $16::text, $18::bytea, $19::text, $1::text, $20::text::jsonb, $15::bytea, t.now,
           t.now + idemq.ms($21::int8)
    FROM t WHERE t.refused IS NULL
    ON CONFLICT (scope, key_hash) DO UPDATE
        SET key_preview = excluded.key_preview, job_id = excluded.job_id,
            fingerprint = excluded.fingerprint, fp = excluded.fp,
            created_at = excluded.created_at, expires_at = excluded.expires_at
        WHERE i.expires_at <= excluded.created_at
    RETURNING 1
),
job AS (
    INSERT INTO idemq.jobs (id, type, queue, state, payload, priority, run_at, max_attempts,
        retry, timeout_ms, deadline, concurrency_key, tags, keep_ms, fingerprint, idem_scope,
        idem_key_hash, idem_key_preview, created_at, updated_at, first_run_at)
    SELECT $1::text, $2::text, $3::text, 'waiting', $4::text::jsonb, $5::int2, t.due,
        $8::int4, $9::text::jsonb, $10::int8, idemq.us($11::int8), $12::text, $13::text[],
        $14::int8, $15::bytea, $16::text, $18::bytea, $19::text, t.now, t.now,
        nullif(t.due, t.now)
    FROM t WHERE EXISTS (SELECT 1 FROM bound)
    RETURNING idemq.wake(queue) AS woke
)
SELECT 'accepted'::text AS outcome, NULL::text AS job_id, NULL::bool AS same FROM job
UNION ALL
SELECT NULL, NULL, NULL FROM t WHERE NOT EXISTS (SELECT 1 FROM bound)
UNION ALL
SELECT 'found', p.job_id, p.same FROM probe p"
);

/// What `KEYED_NEW` answered.
enum Keyed {
    /// The key was bound to a new job, with this id.
    Accepted(String),
    /// The key's live binding has the request's fingerprint: its job.
    Replayed(String),
    /// Nothing written: for `idemq.enqueue` to decide (a binding with
    /// another fingerprint or none in compact form, a key bound meanwhile,
    /// a request the clock refuses).
    Undecided,
}

/// Sends `KEYED_NEW`.
async fn keyed_new(
    conn: &mut PgConnection,
    item: &PreparedEnqueue,
    key: &PreparedKey,
    fingerprint: &[u8],
) -> Result<Keyed> {
    let id = uuid::Uuid::now_v7().to_string();
    let row = sqlx::query(KEYED_NEW)
        .bind(&id)
        .bind(&item.job_type)
        .bind(&item.queue)
        .bind(&item.payload)
        .bind(item.priority)
        .bind(item.run_at)
        .bind(item.delay_ms)
        .bind(item.max_attempts)
        .bind(stored_retry(&item.retry)?)
        .bind(item.timeout_ms)
        .bind(item.deadline)
        .bind(item.concurrency_key.as_deref())
        .bind(&item.tags)
        .bind(item.keep_ms)
        .bind(fingerprint)
        .bind(&key.scope)
        .bind(hex(&key.hash))
        .bind(&key.hash[..])
        .bind(&key.preview)
        .bind(to_json(&item.fingerprint)?)
        .bind(key.ttl_ms)
        .persistent(db::prepared())
        .fetch_one(&mut *conn)
        .await
        .map_err(db_err)?;
    let outcome: Option<String> = row.try_get("outcome").map_err(db_err)?;
    match outcome.as_deref() {
        None => Ok(Keyed::Undecided),
        Some("accepted") => Ok(Keyed::Accepted(id)),
        Some("found") => match row.try_get::<Option<bool>, _>("same").map_err(db_err)? {
            Some(true) => Ok(Keyed::Replayed(row.try_get("job_id").map_err(db_err)?)),
            _ => Ok(Keyed::Undecided),
        },
        Some(other) => Err(Error::Backend {
            message: format!("a keyed enqueue answered {other:?}"),
        }),
    }
}

/// Why a statement has no answer.
pub(super) enum GroupFailure {
    /// It was not sent, or the server refused it: its transaction rolled
    /// back and nothing of it was written, so each request may be sent
    /// again on its own.
    Refused(Error),
    /// Anything else (a lost connection, an answer not understood): it may
    /// have committed.
    Unknown(Error),
}

impl GroupFailure {
    /// A driver error: a refusal when the server answered the statement
    /// with an error of severity `ERROR`, which aborts its transaction (an
    /// error once the commit is made is a `PANIC`). A `FATAL` one ends the
    /// connection, and may come after the commit (a backend terminated
    /// between its commit and its answer): its fate is unknown, as a lost
    /// connection's.
    fn of(e: sqlx::Error) -> Self {
        let refused = match &e {
            sqlx::Error::Database(d) => d
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some_and(|p| matches!(p.severity(), sqlx::postgres::PgSeverity::Error)),
            _ => false,
        };
        if refused {
            Self::Refused(db_err(e))
        } else {
            Self::Unknown(db_err(e))
        }
    }

    pub(super) fn into_error(self) -> Error {
        match self {
            Self::Refused(e) | Self::Unknown(e) => e,
        }
    }
}

/// A request the clock alone decides: no idempotency key, explicit id or
/// dedupe key, so it always creates a job unless its deadline is refused.
pub(super) fn is_plain(p: &PreparedEnqueue) -> bool {
    p.idempotency.is_none() && p.job_id.is_none() && p.dedupe.is_none()
}

/// Inserts requests without keys in one statement: the clock of record
/// read once, each deadline checked against it (a refused item writes
/// nothing and the others stand), the jobs inserted in request order (their
/// `accepted` events are derived from them), and each queue given a
/// wake-up. The same checks as `idemq.enqueue_one`'s, in one plan the
/// session keeps. `$source` yields the items as rows `x` (a batch from
/// typed arrays, one request from scalar parameters), their retry policy
/// already `jsonb`; `$ctes` are what the source reads besides its parameters.
///
/// The answer's first row carries the wake-ups (`woke`); each further row is
/// a refused item: its 1-based place (`ord`) and the field that refused it.
/// Requests without a deadline cannot be refused, so they take the
/// `unchecked` form, which inserts every item without materialising the
/// checks (about a tenth of the statement's time on the server), and wakes
/// the queues named by `$queues` (an expression over the parameters).
macro_rules! plain_statement {
    (checked $ctes:expr, $source:expr) => {
        concat!(
            plain_statement!(@items $ctes, $source),
            "
checked AS MATERIALIZED (
    SELECT t.*, ",
            refused!("t.deadline", "t.delay_ms", "t.due", "t.now"),
            " AS refused
    FROM items t
),
inserted AS (",
            plain_statement!(@insert "checked c WHERE c.refused IS NULL"),
            "
    RETURNING queue
)
SELECT NULL::bigint AS ord, NULL::text AS refused,
       (SELECT bool_or(idemq.wake(q.queue)) FROM (SELECT DISTINCT queue FROM inserted) q) AS woke
UNION ALL
SELECT c.ord, c.refused, NULL FROM checked c WHERE c.refused IS NOT NULL"
        )
    };
    (unchecked $ctes:expr, $source:expr, $queues:literal) => {
        concat!(
            plain_statement!(@items $ctes, $source),
            "
inserted AS (",
            plain_statement!(@insert "items c"),
            "
)
SELECT NULL::bigint AS ord, NULL::text AS refused, ",
            $queues,
            " AS woke"
        )
    };
    (@items $ctes:expr, $source:expr) => {
        concat!(
            "WITH clock AS MATERIALIZED (SELECT idemq.now() AS now),",
            $ctes,
            "
items AS (
    SELECT x.*, c.now, ",
            due!("x.run_at", "x.delay_ms", "c.now"),
            " AS due
    FROM ",
            $source,
            " CROSS JOIN clock c
),"
        )
    };
    (@insert $from:literal) => {
        concat!(
            "
    INSERT INTO idemq.jobs (id, type, queue, state, payload, priority, run_at, max_attempts,
        retry, timeout_ms, deadline, concurrency_key, tags, keep_ms, fingerprint, created_at,
        updated_at, first_run_at)
    SELECT c.id, c.type, c.queue, 'waiting', c.payload::jsonb, c.priority, c.due,
        c.max_attempts, c.retry, c.timeout_ms, idemq.us(c.deadline), c.concurrency_key,
        CASE WHEN c.tags IS NULL THEN '{}'::text[]
             ELSE ARRAY(SELECT jsonb_array_elements_text(c.tags::jsonb)) END,
        c.keep_ms, c.fingerprint, c.now, c.now, nullif(c.due, c.now)
    FROM ",
            $from,
            " ORDER BY c.ord"
        )
    };
}

/// The retry policies of a batch: the batch's distinct policies other than
/// the default (`$16`, each parsed once: parsing one per job cost a tenth
/// of the insert).
macro_rules! batch_retries {
    () => {
        "
retries AS MATERIALIZED (
    SELECT array_agg(r.policy::jsonb ORDER BY r.n) AS policies
    FROM unnest($16::text[]) WITH ORDINALITY AS r(policy, n)
),"
    };
}

/// A batch's items from typed arrays, one element per request; each item's
/// retry policy by its 1-based place among the batch's (`$9`; NULL, which
/// selects NULL, for the default policy).
macro_rules! batch_source {
    () => {
        "(SELECT u.id, u.type, u.queue, u.payload, u.priority, u.run_at, u.delay_ms,
             u.max_attempts, (SELECT r.policies FROM retries r)[u.retry] AS retry,
             u.timeout_ms, u.deadline, u.concurrency_key, u.tags, u.keep_ms, u.fingerprint,
             u.ord
      FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int2[], $6::int8[],
                  $7::int8[], $8::int4[], $9::int4[], $10::int8[], $11::int8[], $12::text[],
                  $13::text[], $14::int8[], $15::bytea[])
           WITH ORDINALITY AS u(id, type, queue, payload, priority, run_at, delay_ms,
                                max_attempts, retry, timeout_ms, deadline, concurrency_key,
                                tags, keep_ms, fingerprint, ord)) x"
    };
}

/// One request (the common call) from scalar parameters, without
/// unnesting arrays.
macro_rules! one_source {
    () => {
        "(SELECT $1::text AS id, $2::text AS type, $3::text AS queue, $4::text AS payload,
             $5::int2 AS priority, $6::int8 AS run_at, $7::int8 AS delay_ms,
             $8::int4 AS max_attempts, $9::text::jsonb AS retry, $10::int8 AS timeout_ms,
             $11::int8 AS deadline, $12::text AS concurrency_key, $13::text AS tags,
             $14::int8 AS keep_ms, $15::bytea AS fingerprint, 1::bigint AS ord) x"
    };
}

/// A batch with a deadline among its items.
const PLAIN_BATCH: &str = plain_statement!(checked batch_retries!(), batch_source!());
/// A batch without deadlines: every item is inserted.
const PLAIN_BATCH_UNCHECKED: &str = plain_statement!(
    unchecked batch_retries!(),
    batch_source!(),
    "(SELECT bool_or(idemq.wake(q.queue)) FROM (SELECT DISTINCT queue FROM unnest($3::text[]) AS queue) q)"
);
/// One request with a deadline.
const PLAIN_ONE: &str = plain_statement!(checked "", one_source!());
/// One request without a deadline, the commonest call: the same insert
/// as the other forms, written as a plain `INSERT … SELECT` over the clock
/// read once, with the wake-up in its `RETURNING` (one row, so one call).
/// A prepared statement's plan is set up again at every execution; this
/// plan has no common table expressions to set up and scan, which cost the
/// server about a tenth of a single enqueue (`perf`: executor start-up).
/// Its parameters are those of `one_source!`, but for `$13`, the tags, an
/// array here (no JSON to parse, no subquery to set up); `$11`, the
/// deadline, is NULL in this form and not read.
const PLAIN_ONE_UNCHECKED: &str = concat!(
    "
INSERT INTO idemq.jobs (id, type, queue, state, payload, priority, run_at, max_attempts,
    retry, timeout_ms, deadline, concurrency_key, tags, keep_ms, fingerprint, created_at,
    updated_at, first_run_at)
SELECT $1::text, $2::text, $3::text, 'waiting', $4::text::jsonb, $5::int2, t.due, $8::int4,
    $9::text::jsonb, $10::int8, NULL, $12::text, $13::text[], $14::int8, $15::bytea, t.now,
    t.now, nullif(t.due, t.now)
FROM (SELECT c.now, ",
    due!("$6::int8", "$7::int8", "c.now"),
    " AS due
      FROM (SELECT idemq.now() AS now) c) t
RETURNING NULL::bigint AS ord, NULL::text AS refused, idemq.wake(queue) AS woke"
);

/// The columns of one request as the plain statements bind them.
struct PlainItem<'a> {
    id: String,
    p: &'a PreparedEnqueue,
}

/// Serializes what a statement binds as JSON text.
fn to_json<T: Serialize + ?Sized>(v: &T) -> Result<String> {
    serde_json::to_string(v).map_err(|e| Error::Backend {
        message: e.to_string(),
    })
}

impl<'a> PlainItem<'a> {
    fn of(p: &'a PreparedEnqueue) -> Self {
        Self {
            id: uuid::Uuid::now_v7().to_string(),
            p,
        }
    }
}

/// The tags as the statements that take them as JSON text read them: NULL
/// for none (the single form without a deadline binds them as an array).
fn tags_json(tags: &[String]) -> Result<Option<String>> {
    if tags.is_empty() {
        Ok(None)
    } else {
        to_json(tags).map(Some)
    }
}

/// The retry policy a job row stores: NULL for the default one (schema
/// version 10, 0010_slim_row.sql), the policy's JSON otherwise.
fn stored_retry(retry: &RetryPolicy) -> Result<Option<String>> {
    if *retry == RetryPolicy::default() {
        Ok(None)
    } else {
        to_json(retry).map(Some)
    }
}

/// The distinct retry policies of a batch other than the default one,
/// each serialized once, and each item's 1-based place among them (NULL,
/// which stores NULL, for the default policy).
fn distinct_retries(items: &[PlainItem]) -> Result<(Vec<String>, Vec<Option<i32>>)> {
    let mut seen: Vec<&RetryPolicy> = Vec::new();
    let mut texts = Vec::new();
    let mut places = Vec::with_capacity(items.len());
    for item in items {
        if item.p.retry == RetryPolicy::default() {
            places.push(None);
            continue;
        }
        let at = match seen.iter().position(|r| **r == item.p.retry) {
            Some(at) => at,
            None => {
                seen.push(&item.p.retry);
                texts.push(to_json(&item.p.retry)?);
                seen.len() - 1
            }
        };
        places.push(Some(i32::try_from(at + 1).map_err(|_| Error::Backend {
            message: "too many retry policies in one batch".into(),
        })?));
    }
    Ok((texts, places))
}

async fn enqueue_plain(
    conn: &mut PgConnection,
    items: &[PreparedEnqueue],
) -> Result<Vec<Result<EnqueueResult>>> {
    send_plain(conn, items)
        .await
        .map_err(GroupFailure::into_error)
}

/// The plain statement for `items` (all plain: of one caller, or of
/// several sent together, group.rs), and its answers.
pub(super) async fn send_plain(
    conn: &mut PgConnection,
    items: &[PreparedEnqueue],
) -> std::result::Result<Vec<Result<EnqueueResult>>, GroupFailure> {
    let plain: Vec<PlainItem> = items.iter().map(PlainItem::of).collect();
    let (retries, retry_places) = match plain.as_slice() {
        [_] => (Vec::new(), Vec::new()),
        many => distinct_retries(many).map_err(GroupFailure::Refused)?,
    };
    let rows = plain_query(&plain, &retries, &retry_places)
        .map_err(GroupFailure::Refused)?
        .persistent(db::prepared())
        .fetch_all(&mut *conn)
        .await
        .map_err(GroupFailure::of)?;
    plain_answers(plain, &rows).map_err(GroupFailure::Unknown)
}

/// The plain statement of `plain`'s requests, its parameters bound.
fn plain_query<'q>(
    plain: &'q [PlainItem],
    retries: &'q [String],
    retry_places: &'q [Option<i32>],
) -> Result<sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>> {
    let checked = plain.iter().any(|i| i.p.deadline.is_some());
    Ok(match plain {
        [one] => {
            let query = sqlx::query(if checked {
                PLAIN_ONE
            } else {
                PLAIN_ONE_UNCHECKED
            })
            .bind(&one.id)
            .bind(&one.p.job_type)
            .bind(&one.p.queue)
            .bind(&one.p.payload)
            .bind(one.p.priority)
            .bind(one.p.run_at)
            .bind(one.p.delay_ms)
            .bind(one.p.max_attempts)
            .bind(stored_retry(&one.p.retry)?)
            .bind(one.p.timeout_ms)
            .bind(one.p.deadline)
            .bind(one.p.concurrency_key.as_deref());
            // The checked form reads the tags as one JSON text (the batch's
            // shape), the unchecked one as an array.
            let query = if checked {
                query.bind(tags_json(&one.p.tags)?)
            } else {
                query.bind(&one.p.tags)
            };
            query.bind(one.p.keep_ms).bind(one.p.fingerprint.compact())
        }
        many => sqlx::query(if checked {
            PLAIN_BATCH
        } else {
            PLAIN_BATCH_UNCHECKED
        })
        .bind(many.iter().map(|i| i.id.as_str()).collect::<Vec<_>>())
        .bind(
            many.iter()
                .map(|i| i.p.job_type.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(many.iter().map(|i| i.p.queue.as_str()).collect::<Vec<_>>())
        .bind(
            many.iter()
                .map(|i| i.p.payload.as_str())
                .collect::<Vec<_>>(),
        )
        .bind(many.iter().map(|i| i.p.priority).collect::<Vec<_>>())
        .bind(many.iter().map(|i| i.p.run_at).collect::<Vec<_>>())
        .bind(many.iter().map(|i| i.p.delay_ms).collect::<Vec<_>>())
        .bind(many.iter().map(|i| i.p.max_attempts).collect::<Vec<_>>())
        .bind(retry_places)
        .bind(many.iter().map(|i| i.p.timeout_ms).collect::<Vec<_>>())
        .bind(many.iter().map(|i| i.p.deadline).collect::<Vec<_>>())
        .bind(
            many.iter()
                .map(|i| i.p.concurrency_key.as_deref())
                .collect::<Vec<_>>(),
        )
        .bind(
            many.iter()
                .map(|i| tags_json(&i.p.tags))
                .collect::<Result<Vec<_>>>()?,
        )
        .bind(many.iter().map(|i| i.p.keep_ms).collect::<Vec<_>>())
        .bind(
            many.iter()
                .map(|i| i.p.fingerprint.compact())
                .collect::<Vec<_>>(),
        )
        .bind(retries),
    })
}

/// The answers of the plain statement: every item accepted but those its
/// rows refuse.
fn plain_answers(plain: Vec<PlainItem>, rows: &[PgRow]) -> Result<Vec<Result<EnqueueResult>>> {
    // The first row carries the wake-ups; each further row is a refused
    // item (its 1-based place and why), so an accepted batch answers in one
    // row instead of one per job.
    let mut out: Vec<Result<EnqueueResult>> = Vec::with_capacity(plain.len());
    out.extend(plain.into_iter().map(|item| {
        Ok(EnqueueResult {
            job_id: item.id,
            outcome: Outcome::Accepted,
        })
    }));
    if rows.is_empty() {
        return Err(Error::Backend {
            message: "the enqueue statement returned no rows".into(),
        });
    }
    for row in &rows[1..] {
        let ord: i64 = row.try_get("ord").map_err(db_err)?;
        let refused: String = row.try_get("refused").map_err(db_err)?;
        let slot = usize::try_from(ord - 1)
            .ok()
            .and_then(|i| out.get_mut(i))
            .ok_or_else(|| Error::Backend {
                message: format!("the enqueue statement refused an unknown item {ord}"),
            })?;
        *slot = Err(refusal(&refused));
    }
    Ok(out)
}

/// A request the clock of record refused: its deadline has passed
/// (`deadline`), or it is due no sooner than its deadline (`run_at` or
/// `delay_ms`, the field that set when it is due).
fn refusal(field: &str) -> Error {
    match field {
        "deadline" => Error::validation("deadline", "must be in the future"),
        field => Error::validation(field, "must be before the deadline"),
    }
}

/// The real enqueue path inside a transaction the caller rolls back.
pub(super) async fn explain(conn: &mut PgConnection, p: &PreparedEnqueue) -> Result<Explain> {
    let idempotency = match &p.idempotency {
        None => None,
        Some(k) => sqlx::query(
            "SELECT job_id, expires_at FROM idemq.idempotency
             WHERE scope = $1 AND key_hash = $2 AND expires_at > idemq.now()",
        )
        .bind(&k.scope)
        .bind(&k.hash[..])
        .persistent(db::prepared())
        .fetch_optional(&mut *conn)
        .await
        .map_err(db_err)?
        .map(|r| -> Result<_, sqlx::Error> {
            Ok(ExplainIdempotency {
                job_id: r.try_get("job_id")?,
                expires_at: r.try_get("expires_at")?,
            })
        })
        .transpose()
        .map_err(db_err)?,
    };
    let dedupe = match &p.dedupe {
        None => None,
        Some(d) => dedupe_holder(conn, &p.job_type, &d.key).await?,
    };
    let mut results = enqueue(conn, std::slice::from_ref(p), &Repeating::default()).await?;
    let mut out = Explain {
        outcome: String::new(),
        reason: None,
        job_id: None,
        conflict: None,
        idempotency,
        dedupe,
    };
    match results.pop() {
        Some(decision) => out.record(decision, p.job_id.clone())?,
        None => {
            return Err(Error::Backend {
                message: "no explain result".into(),
            });
        }
    }
    Ok(out)
}

/// The live dedupe binding of a key.
pub(super) async fn dedupe_holder(
    conn: &mut PgConnection,
    job_type: &str,
    key: &str,
) -> Result<Option<ExplainDedupe>> {
    let row = sqlx::query(
        "SELECT d.job_id, d.mode, d.window_until FROM idemq.dedupe d
         LEFT JOIN idemq.jobs j ON j.id = d.job_id
         WHERE d.type = $1 AND d.key = $2 AND idemq.binding_live(d.window_until, j.state, idemq.now())",
    )
    .bind(job_type)
    .bind(key)
    .persistent(db::prepared())
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_err)?;
    row.map(|r| -> Result<_> {
        let job_id: String = r.try_get("job_id").map_err(db_err)?;
        let mode: String = r.try_get("mode").map_err(db_err)?;
        Ok(ExplainDedupe {
            mode: DedupeMode::from_stored(&mode).map_err(|e| {
                e.at(
                    format!("dedupe binding of job {job_id}"),
                    "idemq.dedupe.mode",
                )
            })?,
            window_until: r.try_get("window_until").map_err(db_err)?,
            job_id,
        })
    })
    .transpose()
}

#[derive(Serialize)]
struct RedriveWire<'a> {
    job_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    key: Option<Key<'a>>,
    fingerprint: &'a Fingerprint,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_attempts: Option<i32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline: Option<i64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    run_at: Option<i64>,
    reset_checkpoints: bool,
}

pub(super) async fn redrive(pool: Db<'_>, p: &JobRedrive) -> Result<EnqueueResult> {
    let wire = RedriveWire {
        job_id: &p.job_id,
        key: p.key.as_ref().map(Key::of),
        fingerprint: &p.fingerprint,
        max_attempts: p.max_attempts,
        deadline: p.deadline,
        run_at: p.run_at,
        reset_checkpoints: p.reset_checkpoints,
    };
    let json = to_json(&wire)?;
    let row = sqlx::query("SELECT outcome, job_id, error FROM idemq.redrive($1::jsonb)")
        .bind(json)
        .fetch_one(pool)
        .await
        .map_err(db_err)?;
    let error: Option<Value> = row.try_get("error").map_err(db_err)?;
    if let Some(e) = error {
        return Err(match e.get("kind").and_then(Value::as_str) {
            Some("not_found") => Error::job_not_found(&p.job_id),
            Some("not_dead") => {
                let state = e.get("state").and_then(Value::as_str).unwrap_or_default();
                match JobState::from_derived(state) {
                    Ok(state) => Error::NotDead {
                        job_id: p.job_id.clone(),
                        state,
                    },
                    Err(u) => u.at(format!("job {}", p.job_id), "idemq.jobs.state"),
                }
            }
            _ => item_error("idemq.redrive", &e, p.key.as_ref()),
        });
    }
    let name: String = row.try_get("outcome").map_err(db_err)?;
    let job_id: String = row.try_get("job_id").map_err(db_err)?;
    Ok(EnqueueResult {
        outcome: outcome("idemq.redrive", &job_id, &name, None)?,
        job_id,
    })
}
