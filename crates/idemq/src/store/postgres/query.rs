//! Read-only queries on PostgreSQL. States are derived from the clock of
//! record on every read, in the same statement.

use std::collections::BTreeMap;

use serde_json::Value;
use sqlx::Row;
use sqlx::postgres::PgRow;

use super::db::{Db, Lent};
use super::db_err;
use super::enqueue::dedupe_holder;
use crate::error::Result;
use crate::fingerprint::key_digest;
use crate::job::{Event, Job, JobDedupe, JobIdempotency, JobState, QueueInfo, Run, Undecodable};
use crate::list::PageFill;
use crate::request::DedupeMode;
use crate::request::RetryPolicy;
use crate::store::{BindingInfo, BindingRef, DedupeRef, ExplainDedupe, JobListing, JobPage};

/// A job with its derived state and key details, as of `idemq.now()`.
const JOB_SELECT: &str = "
    SELECT j.seq, j.id, j.type, j.queue, j.payload, j.result, j.priority, j.run_at, j.attempt,
           j.attempts_used, j.max_attempts, j.retry, j.timeout_ms, j.deadline, j.concurrency_key,
           j.tags, j.keep_ms, j.created_at, j.updated_at, j.finished_at, j.last_error,
           j.cancel_requested, j.lease_expires_at, j.idem_scope, j.idem_key_hash,
           j.idem_key_preview, j.dedupe_key, j.dedupe_mode,
           j.state, j.run_at <= n.now AS due,
           b.expires_at AS idem_expires_at,
           d.mode AS held_mode, d.window_until AS held_window,
           (d.job_id IS NOT NULL AND idemq.binding_live(d.window_until, j.state, n.now)) AS holds
    FROM idemq.jobs j
    CROSS JOIN (SELECT idemq.now() AS now) n
    LEFT JOIN idemq.idempotency b ON b.scope = j.idem_scope AND b.key_hash = j.idem_key_hash
                                  AND b.job_id = j.id AND b.expires_at > n.now
    LEFT JOIN idemq.dedupe d ON d.type = j.type AND d.key = j.dedupe_key AND d.job_id = j.id";

/// A column of a row; the driver's error (a NULL or another type where a
/// value must be) names the column.
fn get<'r, T>(r: &'r PgRow, col: &str) -> Result<T>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    r.try_get(col).map_err(db_err)
}

/// A stored idempotency key hash: SHA-256, 32 bytes. Never shown.
fn key_hash(id: &str, hash: &[u8]) -> Result<[u8; 32]> {
    <[u8; 32]>::try_from(hash).map_err(|_| {
        Undecodable::described(format!("a key hash of {} bytes, not 32", hash.len()))
            .at(format!("job {id}"), "idemq.jobs.idem_key_hash")
    })
}

fn job_from(r: &PgRow) -> Result<Job> {
    let id: String = get(r, "id")?;
    let bad = |col: &str, e: Undecodable| e.at(format!("job {id}"), &format!("idemq.jobs.{col}"));
    let stored: String = get(r, "state")?;
    let state = JobState::from_stored(&stored, get(r, "due")?).map_err(|e| bad("state", e))?;
    // A job accepted with an idempotency key stores its scope, hash and
    // preview together; a part without the others is a broken row.
    let idempotency = match (
        get::<Option<String>>(r, "idem_scope")?,
        get::<Option<Vec<u8>>>(r, "idem_key_hash")?,
    ) {
        (Some(scope), Some(hash)) => Some(JobIdempotency {
            scope,
            key_preview: get::<Option<String>>(r, "idem_key_preview")?
                .ok_or_else(|| bad("idem_key_preview", Undecodable::null("key preview")))?,
            key_digest: key_digest(&key_hash(&id, &hash)?),
            expires_at: get(r, "idem_expires_at")?,
        }),
        (None, None) => None,
        (Some(_), None) => return Err(bad("idem_key_hash", Undecodable::null("key hash"))),
        (None, Some(_)) => return Err(bad("idem_scope", Undecodable::null("key scope"))),
    };
    let dedupe = match get::<Option<String>>(r, "dedupe_key")? {
        Some(key) => {
            let holds: bool = get(r, "holds")?;
            // The live binding's mode while the job holds it, else the job's own.
            let (col, mode): (&str, Option<String>) = if holds {
                ("idemq.dedupe.mode", get(r, "held_mode")?)
            } else {
                ("idemq.jobs.dedupe_mode", get(r, "dedupe_mode")?)
            };
            let mode = match mode {
                Some(m) => DedupeMode::from_stored(&m),
                None => Err(Undecodable::null("dedupe mode")),
            }
            .map_err(|e| e.at(format!("job {id}"), col))?;
            Some(JobDedupe {
                key,
                mode,
                window_until: if holds { get(r, "held_window")? } else { None },
                holds_binding: holds,
            })
        }
        None => None,
    };
    // NULL is the default policy (schema version 10, 0010_slim_row.sql).
    let retry = match get::<Option<Value>>(r, "retry")? {
        None => RetryPolicy::default(),
        Some(retry) => serde_json::from_value(retry.clone()).map_err(|e| {
            bad(
                "retry",
                Undecodable::unreadable("retry policy", &retry.to_string(), e),
            )
        })?,
    };
    Ok(Job {
        job_type: get(r, "type")?,
        queue: get(r, "queue")?,
        state,
        payload: get(r, "payload")?,
        result: get(r, "result")?,
        priority: get(r, "priority")?,
        run_at: get(r, "run_at")?,
        attempt: get(r, "attempt")?,
        attempts_used: get(r, "attempts_used")?,
        max_attempts: get(r, "max_attempts")?,
        retry,
        timeout_ms: get(r, "timeout_ms")?,
        deadline: get(r, "deadline")?,
        concurrency_key: get(r, "concurrency_key")?,
        tags: get(r, "tags")?,
        keep_ms: get(r, "keep_ms")?,
        created_at: get(r, "created_at")?,
        updated_at: get(r, "updated_at")?,
        finished_at: get(r, "finished_at")?,
        last_error: get(r, "last_error")?,
        cancel_requested: get(r, "cancel_requested")?,
        lease_expires_at: get(r, "lease_expires_at")?,
        idempotency,
        dedupe,
        id,
    })
}

pub(super) async fn job_get(pool: Db<'_>, id: &str) -> Result<Option<Job>> {
    let sql = format!("{JOB_SELECT} WHERE j.id = $1");
    let row = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(id)
        .fetch_optional(pool)
        .await
        .map_err(db_err)?;
    row.as_ref().map(job_from).transpose()
}

/// The filters of a list besides its state ($3 queue, $4 type, $5 tag, $6
/// the cursor). The tag is matched with `@>` (what the tags index answers)
/// on a non-empty array (its predicate).
const LIST_FILTERS: &str = "($3::text IS NULL OR j.queue = $3)
           AND ($4::text IS NULL OR j.type = $4)
           AND ($5::text IS NULL OR (j.tags @> ARRAY[$5] AND j.tags <> '{}'))
           AND ($6::bigint IS NULL OR j.seq < $6)";

pub(super) async fn job_list(pool: Db<'_>, p: &JobListing) -> Result<JobPage> {
    let (stored, due) = (p.stored_state, p.due);
    let (cursor, limit) = (p.before_seq, p.limit);
    // Sent unprepared, so it is planned with its values: a filter left out
    // (`$n IS NULL`) folds away, and the planner sees which index returns
    // the page in order (0008_big_tables.sql). A prepared statement's one
    // plan for every combination walked the whole table for a rare state
    // or tag.
    let sql = if stored.is_some() {
        format!(
            "{JOB_SELECT}
             WHERE j.state = $1
               AND ($2::boolean IS NULL OR $2 = (j.run_at <= n.now))
               AND {LIST_FILTERS}
             ORDER BY j.seq DESC LIMIT $7"
        )
    } else {
        // Every state ($1 and $2 are NULL). No index holds every job's
        // `seq` (0009_id_key.sql), but each stored state's jobs come in
        // `seq` order from one (completed: jobs_done_seq; waiting, dead and
        // cancelled: jobs_state_seq) or are few (active: jobs_lease holds
        // them, sorted here; 0012_active_by_lease.sql), so the newest of
        // each state merge under the limit. The last branch finds a row of no known state (changed
        // behind idemq's back, from the always-empty jobs_odd_state), whose
        // reading then fails, naming it.
        format!(
            "WITH page AS MATERIALIZED (
                 SELECT b.id FROM (
                     (SELECT j.id, j.seq FROM idemq.jobs j
                      WHERE j.state = 'completed' AND {LIST_FILTERS}
                      ORDER BY j.seq DESC LIMIT $7)
                     UNION ALL
                     (SELECT j.id, j.seq FROM idemq.jobs j
                      WHERE j.state = 'waiting' AND {LIST_FILTERS}
                      ORDER BY j.seq DESC LIMIT $7)
                     UNION ALL
                     (SELECT j.id, j.seq FROM idemq.jobs j
                      WHERE j.state = 'active' AND {LIST_FILTERS}
                      ORDER BY j.seq DESC LIMIT $7)
                     UNION ALL
                     (SELECT j.id, j.seq FROM idemq.jobs j
                      WHERE j.state = 'dead' AND {LIST_FILTERS}
                      ORDER BY j.seq DESC LIMIT $7)
                     UNION ALL
                     (SELECT j.id, j.seq FROM idemq.jobs j
                      WHERE j.state = 'cancelled' AND {LIST_FILTERS}
                      ORDER BY j.seq DESC LIMIT $7)
                     UNION ALL
                     (SELECT j.id, j.seq FROM idemq.jobs j
                      WHERE j.state NOT IN ('waiting', 'active', 'completed', 'dead', 'cancelled')
                        AND {LIST_FILTERS}
                      ORDER BY j.seq DESC LIMIT $7)) b
                 WHERE $1::text IS NULL AND $2::boolean IS NULL
                 ORDER BY b.seq DESC LIMIT $7)
             {JOB_SELECT}
             WHERE j.id IN (SELECT page.id FROM page)
             ORDER BY j.seq DESC"
        )
    };
    let query = sqlx::query(sqlx::AssertSqlSafe(sql))
        .persistent(false)
        .bind(stored)
        .bind(due)
        .bind(&p.queue)
        .bind(&p.job_type)
        .bind(&p.tag)
        .bind(cursor)
        .bind(i64::from(limit) + 1);
    // Rows are taken as they arrive: those past a page's byte bound are
    // neither decoded nor held (the reply itself is bounded by `limit`).
    let mut page = PageFill::new(limit, p.max_bytes);
    let mut more = false;
    pool.each_row(query, |r| {
        if page.is_full() {
            more = true;
            return Ok(false);
        }
        let seq = r.try_get::<i64, _>("seq").map_err(db_err)?;
        page.offer(seq, job_from(r)?)
    })
    .await?;
    Ok(page.finish(more))
}

pub(super) async fn job_events(pool: Db<'_>, id: &str) -> Result<Vec<Event>> {
    let rows = sqlx::query("SELECT seq, kind, at, data FROM idemq.job_events($1)")
        .bind(id)
        .fetch_all(pool)
        .await
        .map_err(db_err)?;
    rows.iter()
        .map(|r| {
            let seq: i64 = get(r, "seq")?;
            Ok(Event {
                kind: Event::kind_from_stored(get(r, "kind")?)
                    .map_err(|e| e.at(format!("event {seq} of job {id}"), "idemq.events.kind"))?,
                at: get(r, "at")?,
                data: get(r, "data")?,
                seq,
            })
        })
        .collect()
}

pub(super) async fn job_runs(pool: Db<'_>, id: &str) -> Result<Vec<Run>> {
    let rows = sqlx::query(
        "SELECT attempt, worker, started_at, finished_at, outcome, error FROM idemq.job_runs($1)",
    )
    .bind(id)
    .fetch_all(pool)
    .await
    .map_err(db_err)?;
    rows.iter()
        .map(|r| {
            let attempt: i32 = get(r, "attempt")?;
            Ok(Run {
                worker: get(r, "worker")?,
                started_at: get(r, "started_at")?,
                finished_at: get(r, "finished_at")?,
                outcome: Run::outcome_from_stored(get(r, "outcome")?).map_err(|e| {
                    e.at(format!("run {attempt} of job {id}"), "idemq.runs.outcome")
                })?,
                error: get(r, "error")?,
                attempt,
            })
        })
        .collect()
}

pub(super) async fn checkpoint_list(pool: Db<'_>, id: &str) -> Result<BTreeMap<String, Value>> {
    let rows = sqlx::query("SELECT name, value FROM idemq.checkpoints WHERE job_id = $1")
        .bind(id)
        .fetch_all(pool)
        .await
        .map_err(db_err)?;
    rows.iter()
        .map(|r| Ok((r.try_get("name")?, r.try_get("value")?)))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(db_err)
}

pub(super) async fn binding_lookup(pool: Db<'_>, p: &BindingRef) -> Result<Option<BindingInfo>> {
    let row = sqlx::query(
        "SELECT job_id, key_preview, expires_at FROM idemq.idempotency
         WHERE scope = $1 AND key_hash = $2 AND expires_at > idemq.now()",
    )
    .bind(&p.scope)
    .bind(&p.hash[..])
    .fetch_optional(pool)
    .await
    .map_err(db_err)?;
    row.map(|r| -> Result<_, sqlx::Error> {
        Ok(BindingInfo {
            job_id: r.try_get("job_id")?,
            key_preview: r.try_get("key_preview")?,
            key_digest: key_digest(&p.hash),
            expires_at: r.try_get("expires_at")?,
        })
    })
    .transpose()
    .map_err(db_err)
}

pub(super) async fn dedupe_lookup(db: Db<'_>, p: &DedupeRef) -> Result<Option<ExplainDedupe>> {
    db.bounded(async {
        // Behind PgBouncer the lookup needs a transaction to keep its server connection.
        if db.net.bouncer {
            let mut tx = Box::pin(db.pool.begin()).await.map_err(db_err)?;
            let out = dedupe_holder(&mut tx, &p.job_type, &p.key).await;
            tx.commit().await.map_err(db_err)?;
            out
        } else {
            let mut conn = Lent::of(db).await.map_err(db_err)?;
            let out = dedupe_holder(&mut conn, &p.job_type, &p.key).await;
            conn.keep_if(out.is_ok());
            out
        }
    })
    .await
}

/// Up to this many heap pages, every count is exact (a scan of the table
/// costs tens of milliseconds).
const EXACT_PAGES: i64 = 8192;
/// About this many pages are sampled for the estimated counts.
const SAMPLE_PAGES: i64 = 2000;

pub(super) async fn queue_list(pool: Db<'_>) -> Result<Vec<QueueInfo>> {
    let counts = sqlx::query("SELECT queue, state, n, estimated FROM idemq.queue_counts($1, $2)")
        .bind(EXACT_PAGES)
        .bind(SAMPLE_PAGES)
        .fetch_all(pool)
        .await
        .map_err(db_err)?;
    let paused = sqlx::query("SELECT name, paused FROM idemq.queues")
        .fetch_all(pool)
        .await
        .map_err(db_err)?;
    let mut out: BTreeMap<String, QueueInfo> = BTreeMap::new();
    let blank = |name: &str| QueueInfo {
        name: name.to_owned(),
        paused: false,
        counts: Default::default(),
        estimated: Vec::new(),
    };
    for r in &paused {
        let name: String = r.try_get("name").map_err(db_err)?;
        out.entry(name.clone())
            .or_insert_with(|| blank(&name))
            .paused = r.try_get("paused").map_err(db_err)?;
    }
    let mut estimated = false;
    for r in &counts {
        // A row without a queue: the terminal counts are estimates.
        let Some(name) = r.try_get::<Option<String>, _>("queue").map_err(db_err)? else {
            estimated |= r.try_get::<bool, _>("estimated").map_err(db_err)?;
            continue;
        };
        let s: String = r.try_get("state").map_err(db_err)?;
        let n: i64 = r.try_get("n").map_err(db_err)?;
        let state = JobState::from_derived(&s)
            .map_err(|e| e.at(format!("jobs of queue {name}"), "idemq.queue_counts.state"))?;
        out.entry(name.clone())
            .or_insert_with(|| blank(&name))
            .counts
            .add(state, n.max(0) as u64);
    }
    if estimated {
        for q in out.values_mut() {
            q.estimated = vec![JobState::Completed, JobState::Dead, JobState::Cancelled];
        }
    }
    Ok(out.into_values().collect())
}
