//! Enqueue, explain and redrive on PostgreSQL: the prepared requests travel
//! as one JSON array to `idemq.enqueue`, which answers one row per item.

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;
use sqlx::{PgConnection, Row};

use super::db::{self, Db};
use super::db_err;
use crate::error::{ConflictSource, Error, IdempotencyConflict, Result};
use crate::fingerprint::{Fingerprint, hex};
use crate::job::{EnqueueResult, JobState, NonReplaceableReason, Outcome};
use crate::request::{DedupeMode, PreparedEnqueue, PreparedKey, RetryPolicy};
use crate::store::{Explain, ExplainConflict, ExplainDedupe, ExplainIdempotency, JobRedrive};

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
        })
        .collect();
    serde_json::to_string(&wire).map_err(|e| Error::Backend {
        message: e.to_string(),
    })
}

fn reason(s: Option<&str>) -> NonReplaceableReason {
    match s {
        Some("incompatible_mode") => NonReplaceableReason::IncompatibleMode,
        Some("window_elapsed") => NonReplaceableReason::WindowElapsed,
        _ => NonReplaceableReason::NotPending,
    }
}

/// Turns an error object returned by a function into the typed error.
fn item_error(err: &Value, key: Option<&PreparedKey>) -> Error {
    let s = |k: &str| {
        err.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    match err.get("kind").and_then(Value::as_str) {
        Some("conflict") => {
            let by_key = s("source") == "idempotency_key";
            let key = key.filter(|_| by_key);
            let fields = err
                .get("fields")
                .and_then(Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|f| f.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            Error::EnqueueIdempotencyConflict(Box::new(IdempotencyConflict {
                job_id: s("job_id"),
                source: if by_key {
                    ConflictSource::IdempotencyKey
                } else {
                    ConflictSource::JobId
                },
                scope: key.map(|k| k.scope.clone()),
                key_preview: key.map(|k| k.preview.clone()),
                key_digest: key.map(PreparedKey::digest),
                fields,
            }))
        }
        Some("validation") => Error::validation(s("field"), s("reason")),
        Some("not_found") => Error::job_not_found(&s("job_id")),
        other => Error::Backend {
            message: format!("unexpected error object {other:?}"),
        },
    }
}

fn outcome(name: &str, why: Option<&str>) -> Outcome {
    match name {
        "accepted" => Outcome::Accepted,
        "replayed" => Outcome::Replayed,
        "coalesced" => Outcome::Coalesced,
        "replaced" => Outcome::Replaced,
        _ => Outcome::NonReplaceable {
            reason: reason(why),
        },
    }
}

/// Enqueues on a connection (the caller's transaction or a pooled one):
/// requests without keys by one prepared statement, any other call by
/// `idemq.enqueue`.
pub(super) async fn enqueue(
    conn: &mut PgConnection,
    items: &[PreparedEnqueue],
) -> Result<Vec<Result<EnqueueResult>>> {
    if items.is_empty() {
        return Ok(Vec::new());
    }
    if items.iter().all(is_plain) {
        return enqueue_plain(conn, items).await;
    }
    let rows =
        sqlx::query("SELECT idx, job_id, outcome, reason, error FROM idemq.enqueue($1::jsonb)")
            .bind(items_json(items)?)
            .persistent(db::prepared())
            .fetch_all(&mut *conn)
            .await
            .map_err(db_err)?;
    let mut out: Vec<Result<EnqueueResult>> = Vec::with_capacity(items.len());
    for (row, item) in rows.iter().zip(items) {
        let error: Option<Value> = row.try_get("error").map_err(db_err)?;
        out.push(match error {
            Some(e) => Err(item_error(&e, item.idempotency.as_ref())),
            None => {
                let name: String = row.try_get("outcome").map_err(db_err)?;
                let why: Option<String> = row.try_get("reason").map_err(db_err)?;
                Ok(EnqueueResult {
                    job_id: row.try_get("job_id").map_err(db_err)?,
                    outcome: outcome(&name, why.as_deref()),
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

/// A request the clock alone decides: no idempotency key, explicit id or
/// dedupe key, so it always creates a job unless its deadline is refused.
fn is_plain(p: &PreparedEnqueue) -> bool {
    p.idempotency.is_none() && p.job_id.is_none() && p.dedupe.is_none()
}

/// Inserts requests without keys in one statement from typed arrays: the
/// clock of record read once, each deadline checked against it (a refused
/// item writes nothing and the others stand), the jobs inserted in request
/// order (their `accepted` events are derived from them), and each queue
/// given a wake-up. The same checks as `idemq.enqueue_one`'s, in one plan
/// the session keeps.
const PLAIN: &str = "
WITH clock AS MATERIALIZED (SELECT idemq.now() AS now),
items AS (
    SELECT (x.ord - 1)::integer AS i, x.*, c.now,
           CASE WHEN x.run_at IS NOT NULL THEN idemq.us(x.run_at)
                ELSE c.now + idemq.ms(coalesce(x.delay_ms, 0)) END AS due
    FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int2[], $6::int8[],
                $7::int8[], $8::int4[], $9::text[], $10::int8[], $11::int8[], $12::text[],
                $13::text[], $14::int8[], $15::bytea[])
         WITH ORDINALITY AS x(id, type, queue, payload, priority, run_at, delay_ms,
                              max_attempts, retry, timeout_ms, deadline, concurrency_key,
                              tags, keep_ms, fingerprint, ord)
    CROSS JOIN clock c
),
checked AS MATERIALIZED (
    SELECT t.*, CASE
        WHEN t.deadline IS NULL THEN NULL
        WHEN idemq.us(t.deadline) <= t.now THEN 'deadline'
        WHEN t.due >= idemq.us(t.deadline) THEN
            CASE WHEN t.delay_ms IS NULL THEN 'run_at' ELSE 'delay_ms' END
        END AS refused
    FROM items t
),
inserted AS (
    INSERT INTO idemq.jobs (id, type, queue, state, payload, priority, run_at, max_attempts,
        retry, timeout_ms, deadline, concurrency_key, tags, keep_ms, fingerprint, created_at,
        updated_at, first_run_at)
    SELECT c.id, c.type, c.queue, 'waiting', c.payload::jsonb, c.priority, c.due,
        c.max_attempts, c.retry::jsonb, c.timeout_ms, idemq.us(c.deadline), c.concurrency_key,
        CASE WHEN c.tags IS NULL THEN '{}'::text[]
             ELSE ARRAY(SELECT jsonb_array_elements_text(c.tags::jsonb)) END,
        c.keep_ms, c.fingerprint, c.now, c.now, nullif(c.due, c.now)
    FROM checked c WHERE c.refused IS NULL ORDER BY c.i
    RETURNING queue
)
SELECT c.i, c.id, c.refused,
       (SELECT bool_or(idemq.wake(q.queue)) FROM (SELECT DISTINCT queue FROM inserted) q) AS woke
FROM checked c ORDER BY c.i";

async fn enqueue_plain(
    conn: &mut PgConnection,
    items: &[PreparedEnqueue],
) -> Result<Vec<Result<EnqueueResult>>> {
    let n = items.len();
    let mut ids = Vec::with_capacity(n);
    let mut types = Vec::with_capacity(n);
    let mut queues = Vec::with_capacity(n);
    let mut payloads = Vec::with_capacity(n);
    let mut priorities = Vec::with_capacity(n);
    let mut run_ats = Vec::with_capacity(n);
    let mut delays = Vec::with_capacity(n);
    let mut max_attempts = Vec::with_capacity(n);
    let mut retries = Vec::with_capacity(n);
    let mut timeouts = Vec::with_capacity(n);
    let mut deadlines = Vec::with_capacity(n);
    let mut concurrency = Vec::with_capacity(n);
    let mut tags = Vec::with_capacity(n);
    let mut keeps = Vec::with_capacity(n);
    let mut fingerprints = Vec::with_capacity(n);
    let json = |e: serde_json::Error| Error::Backend {
        message: e.to_string(),
    };
    for p in items {
        ids.push(uuid::Uuid::now_v7().to_string());
        types.push(p.job_type.as_str());
        queues.push(p.queue.as_str());
        payloads.push(p.payload.as_str());
        priorities.push(p.priority);
        run_ats.push(p.run_at);
        delays.push(p.delay_ms);
        max_attempts.push(p.max_attempts);
        retries.push(serde_json::to_string(&p.retry).map_err(json)?);
        timeouts.push(p.timeout_ms);
        deadlines.push(p.deadline);
        concurrency.push(p.concurrency_key.as_deref());
        tags.push(if p.tags.is_empty() {
            None
        } else {
            Some(serde_json::to_string(&p.tags).map_err(json)?)
        });
        keeps.push(p.keep_ms);
        fingerprints.push(p.fingerprint.packed());
    }
    let rows = sqlx::query(PLAIN)
        .bind(&ids)
        .bind(&types)
        .bind(&queues)
        .bind(&payloads)
        .bind(&priorities)
        .bind(&run_ats)
        .bind(&delays)
        .bind(&max_attempts)
        .bind(&retries)
        .bind(&timeouts)
        .bind(&deadlines)
        .bind(&concurrency)
        .bind(&tags)
        .bind(&keeps)
        .bind(&fingerprints)
        .persistent(db::prepared())
        .fetch_all(&mut *conn)
        .await
        .map_err(db_err)?;
    if rows.len() != n {
        return Err(Error::Backend {
            message: "the enqueue statement returned too few rows".into(),
        });
    }
    rows.iter()
        .map(|row| {
            let refused: Option<String> = row.try_get("refused").map_err(db_err)?;
            Ok(match refused.as_deref() {
                None => Ok(EnqueueResult {
                    job_id: row.try_get("id").map_err(db_err)?,
                    outcome: Outcome::Accepted,
                }),
                Some("deadline") => Err(Error::validation("deadline", "must be in the future")),
                Some(field) => Err(Error::validation(field, "must be before the deadline")),
            })
        })
        .collect()
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
    let mut results = enqueue(conn, std::slice::from_ref(p)).await?;
    let mut out = Explain {
        outcome: String::new(),
        reason: None,
        job_id: None,
        conflict: None,
        idempotency,
        dedupe,
    };
    match results.pop() {
        Some(Ok(r)) => {
            out.outcome = r.outcome.as_str().into();
            out.reason = r.outcome.reason().map(|x| x.as_str().into());
            out.job_id = match r.outcome {
                Outcome::Accepted => p.job_id.clone(),
                _ => Some(r.job_id),
            };
        }
        Some(Err(Error::EnqueueIdempotencyConflict(c))) => {
            out.outcome = "conflict".into();
            out.conflict = Some(ExplainConflict {
                job_id: c.job_id,
                fields: c.fields,
            });
        }
        Some(Err(e)) => return Err(e),
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
    row.map(|r| -> Result<_, sqlx::Error> {
        let mode: String = r.try_get("mode")?;
        Ok(ExplainDedupe {
            job_id: r.try_get("job_id")?,
            mode: DedupeMode::parse(&mode).unwrap_or(DedupeMode::Pending),
            window_until: r.try_get("window_until")?,
        })
    })
    .transpose()
    .map_err(db_err)
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
    let json = serde_json::to_string(&wire).map_err(|e| Error::Backend {
        message: e.to_string(),
    })?;
    let row = sqlx::query("SELECT outcome, job_id, error FROM idemq.redrive($1::jsonb)")
        .bind(json)
        .fetch_one(pool)
        .await
        .map_err(db_err)?;
    let error: Option<Value> = row.try_get("error").map_err(db_err)?;
    if let Some(e) = error {
        return Err(match e.get("kind").and_then(Value::as_str) {
            Some("not_found") => Error::job_not_found(&p.job_id),
            Some("not_dead") => Error::NotDead {
                job_id: p.job_id.clone(),
                state: e
                    .get("state")
                    .and_then(Value::as_str)
                    .and_then(JobState::parse)
                    .unwrap_or(JobState::Dead),
            },
            _ => item_error(&e, p.key.as_ref()),
        });
    }
    let name: String = row.try_get("outcome").map_err(db_err)?;
    Ok(EnqueueResult {
        job_id: row.try_get("job_id").map_err(db_err)?,
        outcome: outcome(&name, None),
    })
}
