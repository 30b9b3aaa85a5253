//! Read-only queries on SQLite: jobs, their events, runs and checkpoints,
//! bindings and queue counts. States are derived from the clock on every read.

use std::collections::BTreeMap;

use rusqlite::params;
use serde_json::Value;

use super::decode::{Cols, all, one};
use super::enqueue::{keyed_job, load_binding};
use super::{Cx, ts};
use crate::error::Result;
use crate::fingerprint::key_digest;
use crate::job::{Event, Job, JobDedupe, JobIdempotency, JobState, QueueInfo, Run, Undecodable};
use crate::list::PageFill;
use crate::request::DedupeMode;
use crate::store::{
    BindingInfo, BindingRef, CheckpointGet, DedupeRef, ExplainDedupe, JobListing, JobPage,
};

const JOB_COLS: &str = "seq, id, type, queue, state, payload, result, priority, run_at, attempt,
    attempts_used, max_attempts, retry, timeout_ms, deadline, concurrency_key, tags, keep_ms,
    created_at, updated_at, finished_at, last_error, cancel_requested, lease_expires_at,
    idem_scope, idem_key_hash, idem_key_preview, dedupe_key, dedupe_mode";

struct Row {
    seq: i64,
    job: Job,
    idem: Option<(String, [u8; 32], String)>,
    dedupe: Option<(String, DedupeMode)>,
}

/// The row name of job `id` in errors.
fn job_named(id: &str) -> String {
    format!("job {id}")
}

/// A stored idempotency key hash: SHA-256, 32 bytes. Never shown.
fn key_hash(c: &Cols, col: &str, hash: &[u8]) -> Result<[u8; 32]> {
    <[u8; 32]>::try_from(hash).map_err(|_| {
        c.bad(
            col,
            Undecodable::described(format!("a key hash of {} bytes, not 32", hash.len())),
        )
    })
}

fn job_row(r: &rusqlite::Row, now: i64) -> Result<Row> {
    let mut c = Cols::new(r, "idemq_jobs", "job");
    let id: String = c.get("id")?;
    c.named(job_named(&id));
    let run_at: i64 = c.get("run_at")?;
    // A job accepted with an idempotency key stores its scope, hash and
    // preview together; a part without the others is a broken row.
    let idem = match (
        c.get::<Option<String>>("idem_scope")?,
        c.get::<Option<Vec<u8>>>("idem_key_hash")?,
    ) {
        (Some(scope), Some(hash)) => Some((
            scope,
            key_hash(&c, "idem_key_hash", &hash)?,
            c.get::<String>("idem_key_preview")?,
        )),
        (None, None) => None,
        (Some(_), None) => return Err(c.bad("idem_key_hash", Undecodable::null("key hash"))),
        (None, Some(_)) => return Err(c.bad("idem_scope", Undecodable::null("key scope"))),
    };
    let dedupe = match c.get::<Option<String>>("dedupe_key")? {
        Some(k) => Some((k, c.decode("dedupe_mode", DedupeMode::from_stored)?)),
        None => None,
    };
    Ok(Row {
        seq: c.get("seq")?,
        job: Job {
            job_type: c.get("type")?,
            queue: c.get("queue")?,
            state: c.state("state", run_at, now)?,
            payload: c.json("payload", "payload")?,
            result: c.opt_json("result", "result")?,
            priority: c.get("priority")?,
            run_at: c.instant("run_at", run_at)?,
            attempt: c.get("attempt")?,
            attempts_used: c.get("attempts_used")?,
            max_attempts: c.get("max_attempts")?,
            retry: c.json("retry", "retry policy")?,
            timeout_ms: c.get("timeout_ms")?,
            deadline: c.opt_time("deadline")?,
            concurrency_key: c.get("concurrency_key")?,
            tags: c.json("tags", "tag list")?,
            keep_ms: c.get("keep_ms")?,
            created_at: c.time("created_at")?,
            updated_at: c.time("updated_at")?,
            finished_at: c.opt_time("finished_at")?,
            last_error: c.get("last_error")?,
            cancel_requested: c.get("cancel_requested")?,
            lease_expires_at: c.opt_time("lease_expires_at")?,
            idempotency: None,
            dedupe: None,
            id,
        },
        idem,
        dedupe,
    })
}

/// Fills in the key details a row only references.
fn finish_row(cx: &Cx, row: Row) -> Result<Job> {
    let mut job = row.job;
    if let Some((scope, hash, preview)) = row.idem {
        let expires_at = one(
            cx.db.prepare_cached(
                "SELECT expires_at FROM idemq_idempotency
                 WHERE scope = ?1 AND key_hash = ?2 AND job_id = ?3 AND expires_at > ?4",
            )?,
            params![scope, &hash[..], job.id, cx.now],
            |r| {
                let what = format!("idempotency binding of job {}", job.id);
                Cols::new(r, "idemq_idempotency", what).time("expires_at")
            },
        )?;
        job.idempotency = Some(JobIdempotency {
            scope,
            key_preview: preview,
            key_digest: key_digest(&hash),
            expires_at,
        });
    }
    if let Some((key, own)) = row.dedupe {
        let holding = match load_binding(cx, &job.job_type, &key)? {
            Some(b) if b.job_id == job.id && b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => {
                Some(b)
            }
            _ => None,
        };
        job.dedupe = Some(JobDedupe {
            key,
            mode: holding.as_ref().map_or(own, |b| b.mode),
            window_until: holding
                .as_ref()
                .and_then(|b| b.window_until)
                .map(ts)
                .transpose()?,
            holds_binding: holding.is_some(),
        });
    }
    Ok(job)
}

pub(super) fn job_get(cx: &Cx, id: &str) -> Result<Option<Job>> {
    let sql = format!("SELECT {JOB_COLS} FROM idemq_jobs WHERE id = ?1");
    let row = one(cx.db.prepare_cached(&sql)?, [id], |r| job_row(r, cx.now))?;
    row.map(|r| finish_row(cx, r)).transpose()
}

pub(super) fn job_list(cx: &Cx, p: &JobListing) -> Result<JobPage> {
    let (stored, due) = (p.stored_state, p.due);
    let (cursor, limit) = (p.before_seq, p.limit);
    let sql = format!(
        "SELECT {JOB_COLS} FROM idemq_jobs j
         WHERE (?1 IS NULL OR state = ?1)
           AND (?2 IS NULL OR (?2 = 1) = (run_at <= ?3))
           AND (?4 IS NULL OR queue = ?4)
           AND (?5 IS NULL OR type = ?5)
           AND (?6 IS NULL OR EXISTS (SELECT 1 FROM json_each(j.tags) WHERE value = ?6))
           AND (?7 IS NULL OR seq < ?7)
         ORDER BY seq DESC LIMIT ?8"
    );
    let mut stmt = cx.db.prepare_cached(&sql)?;
    let mut rows = stmt.query(params![
        stored,
        due,
        cx.now,
        p.queue,
        p.job_type,
        p.tag,
        cursor,
        limit + 1
    ])?;
    // Read one row at a time: a page that reaches its byte bound stops
    // reading (and decoding) there.
    let mut page = PageFill::new(limit, p.max_bytes);
    let mut more = false;
    while let Some(r) = rows.next()? {
        if page.is_full() {
            more = true;
            break;
        }
        let row = job_row(r, cx.now)?;
        if !page.offer(row.seq, finish_row(cx, row)?)? {
            break;
        }
    }
    Ok(page.finish(more))
}

/// A job's history, oldest first: the stored events and the routine ones
/// derived from the job row. `accepted` is derived from the row (under the
/// job's own number) unless it is stored (jobs accepted before the history
/// was derived); `claimed` for the current attempt while it runs or once it
/// completed (`claim_seq`), `completed` once it did (`done_seq`). An attempt
/// that ends otherwise writes its `claimed` event out under the same number,
/// so the order never depends on which events are stored.
pub(super) fn job_events(cx: &Cx, id: &str) -> Result<Vec<Event>> {
    let mut events: Vec<Event> = all(
        cx.db.prepare_cached(
            "SELECT seq, kind, at, data FROM idemq_events WHERE job_id = ?1 ORDER BY seq",
        )?,
        [id],
        |r| {
            let mut c = Cols::new(r, "idemq_events", format!("event of job {id}"));
            let seq: i64 = c.get("seq")?;
            c.named(format!("event {seq} of job {id}"));
            Ok(Event {
                seq,
                kind: c.decode("kind", |k| Event::kind_from_stored(k.to_owned()))?,
                at: c.time("at")?,
                data: c.json("data", "event data")?,
            })
        },
    )?;
    let derived = one(
        cx.db.prepare_cached(
            "SELECT seq, queue, created_at, first_run_at, idem_scope, idem_key_hash,
                    idem_key_preview, dedupe_key, dedupe_mode, claim_seq, started_at, attempt,
                    worker, done_seq, finished_at
             FROM idemq_jobs WHERE id = ?1",
        )?,
        [id],
        |r| {
            let c = Cols::new(r, "idemq_jobs", job_named(id));
            // Jobs accepted before `first_run_at` was stored were due at acceptance.
            let run_at = match c.opt_time("first_run_at")? {
                Some(at) => at,
                None => c.time("created_at")?,
            };
            let mut accepted = serde_json::json!({
                "queue": c.get::<String>("queue")?,
                "run_at": run_at,
            });
            if let Some(scope) = c.get::<Option<String>>("idem_scope")? {
                let hash: Vec<u8> = c.get("idem_key_hash")?;
                let digest = key_digest(&key_hash(&c, "idem_key_hash", &hash)?);
                accepted["idempotency"] = serde_json::json!({
                    "scope": scope,
                    "key_preview": c.get::<String>("idem_key_preview")?,
                    "key_digest": digest,
                });
            }
            if let Some(key) = c.get::<Option<String>>("dedupe_key")? {
                let mode = c.decode("dedupe_mode", DedupeMode::from_stored)?;
                accepted["dedupe"] = serde_json::json!({ "key": key, "mode": mode.as_str() });
            }
            let attempt: i32 = c.get("attempt")?;
            let mut out = vec![Event {
                seq: c.get("seq")?,
                kind: "accepted".into(),
                at: c.time("created_at")?,
                data: accepted,
            }];
            if let (Some(seq), Some(at)) = (c.get("claim_seq")?, c.opt_time("started_at")?) {
                out.push(Event {
                    seq,
                    kind: "claimed".into(),
                    at,
                    data: serde_json::json!({
                        "attempt": attempt,
                        "worker": c.get::<Option<String>>("worker")?,
                    }),
                });
            }
            if let (Some(seq), Some(at)) = (c.get("done_seq")?, c.opt_time("finished_at")?) {
                out.push(Event {
                    seq,
                    kind: "completed".into(),
                    at,
                    data: serde_json::json!({ "attempt": attempt }),
                });
            }
            Ok(out)
        },
    )?
    // No job row (purged): only the stored events are left.
    .unwrap_or_default();
    let stored_accepted = events.iter().any(|e| e.kind == "accepted");
    events.extend(
        derived
            .into_iter()
            .filter(|e| !(stored_accepted && e.kind == "accepted")),
    );
    events.sort_by_key(|e| e.seq);
    Ok(events)
}

/// A job's run ledger: the attempts written out (each ended other than
/// completed) and the current attempt, derived from the job row while it
/// runs and once it completed.
pub(super) fn job_runs(cx: &Cx, id: &str) -> Result<Vec<Run>> {
    // The current attempt is read from the job row, whose worker may be
    // unset; the union's columns take their names from the first select.
    let mut runs: Vec<Run> = all(
        cx.db.prepare_cached(
            "SELECT attempt, worker, started_at, finished_at, outcome, error
             FROM idemq_runs WHERE job_id = ?1
             UNION ALL
             SELECT attempt, coalesce(worker, ''), started_at,
                    CASE WHEN state = 'completed' THEN finished_at END,
                    CASE WHEN state = 'completed' THEN 'completed' END, NULL
             FROM idemq_jobs
             WHERE id = ?1 AND claim_seq IS NOT NULL AND started_at IS NOT NULL",
        )?,
        [id],
        |r| {
            let mut c = Cols::new(r, "idemq_runs", format!("run of job {id}"));
            let attempt: i32 = c.get("attempt")?;
            c.named(format!("run {attempt} of job {id}"));
            Ok(Run {
                attempt,
                worker: c.get("worker")?,
                started_at: c.time("started_at")?,
                finished_at: c.opt_time("finished_at")?,
                outcome: Run::outcome_from_stored(c.get("outcome")?)
                    .map_err(|e| c.bad("outcome", e))?,
                error: c.get("error")?,
            })
        },
    )?;
    runs.sort_by_key(|r| r.attempt);
    Ok(runs)
}

/// A checkpoint's value.
fn checkpoint_value(r: &rusqlite::Row, job_id: &str, name: &str) -> Result<Value> {
    let row = format!("checkpoint {name:?} of job {job_id}");
    Cols::new(r, "idemq_checkpoints", row).json("value", "checkpoint value")
}

pub(super) fn checkpoint_list(cx: &Cx, id: &str) -> Result<BTreeMap<String, Value>> {
    Ok(all(
        cx.db
            .prepare_cached("SELECT name, value FROM idemq_checkpoints WHERE job_id = ?1")?,
        [id],
        |r| {
            let name: String = Cols::new(r, "idemq_checkpoints", "checkpoint").get("name")?;
            let value = checkpoint_value(r, id, &name)?;
            Ok((name, value))
        },
    )?
    .into_iter()
    .collect())
}

pub(super) fn checkpoint_get(cx: &Cx, p: &CheckpointGet) -> Result<Option<Value>> {
    one(
        cx.db.prepare_cached(
            "SELECT value FROM idemq_checkpoints WHERE job_id = ?1 AND name = ?2",
        )?,
        [&p.job_id, &p.name],
        |r| checkpoint_value(r, &p.job_id, &p.name),
    )
}

pub(super) fn binding_lookup(cx: &Cx, p: &BindingRef) -> Result<Option<BindingInfo>> {
    one(
        cx.db.prepare_cached(
            "SELECT job_id, key_preview, expires_at FROM idemq_idempotency
             WHERE scope = ?1 AND key_hash = ?2 AND expires_at > ?3",
        )?,
        params![p.scope, &p.hash[..], cx.now],
        |r| {
            let mut c = Cols::new(r, "idemq_idempotency", "idempotency binding");
            let job_id: String = c.get("job_id")?;
            c.named(format!("idempotency binding of job {job_id}"));
            Ok(BindingInfo {
                key_preview: c.get("key_preview")?,
                key_digest: key_digest(&p.hash),
                expires_at: c.time("expires_at")?,
                job_id,
            })
        },
    )
}

pub(super) fn dedupe_lookup(cx: &Cx, p: &DedupeRef) -> Result<Option<ExplainDedupe>> {
    Ok(match load_binding(cx, &p.job_type, &p.key)? {
        Some(b) if b.is_live(keyed_job(cx, &b.job_id)?, cx.now) => Some(ExplainDedupe {
            job_id: b.job_id,
            mode: b.mode,
            window_until: b.window_until.map(ts).transpose()?,
        }),
        _ => None,
    })
}

/// Terminal jobs are counted exactly while the jobs' numbers span at most
/// this many (docs/decisions.md, "Counts of terminal jobs are estimates on
/// a large table"): about 0.1 s of reading at the most.
const EXACT_SPAN: i64 = 131_072;
/// The jobs numbered after a multiple of this, less one, are counted
/// exactly (between this many and twice as many numbers), the older ones
/// estimated: the boundary moves once every this many numbers, so
/// successive counts differ by what changed, not by where the sample fell.
const RECENT: i64 = 16_384;
/// Numbers read in each window of the sample of the older jobs.
const WINDOW: i64 = 256;
/// At least this many windows in the sample (at most twice as many).
const WINDOWS: i64 = 64;

pub(super) fn queue_list(cx: &Cx) -> Result<Vec<QueueInfo>> {
    queue_counts(cx, EXACT_SPAN)
}

/// The condition of the jobs in a terminal state.
macro_rules! terminal {
    () => {
        "state IN ('completed', 'dead', 'cancelled')"
    };
}

/// One count of jobs: queue, state (derived), how many.
type Count = (String, JobState, i64);

/// Counts every queue's jobs by state. The live states are counted exactly
/// through the partial indexes that hold them (the waiting jobs through
/// the claim order, the active ones through their leases). The terminal
/// states are counted exactly while the table's numbers span at most
/// `exact_span`; beyond that, the jobs after a boundary exactly and the
/// older ones from fixed windows of numbers, scaled to the numbers before
/// the boundary (so gaps left by purged jobs and by events, which share
/// the numbering, are counted as they are sampled), and marked estimated.
fn queue_counts(cx: &Cx, exact_span: i64) -> Result<Vec<QueueInfo>> {
    let decode = |r: &rusqlite::Row<'_>, due: Option<bool>| -> Result<Count> {
        let mut c = Cols::new(r, "idemq_jobs", "jobs");
        let queue: String = c.get("queue")?;
        c.named(format!("jobs of queue {queue}"));
        let state = c.decode("state", |s| JobState::from_stored(s, due.unwrap_or(false)))?;
        Ok((queue, state, c.get("n")?))
    };
    let mut counts: Vec<Count> = all(
        cx.db.prepare_cached(
            "SELECT queue, state, run_at <= ?1 AS due, count(*) AS n
             FROM idemq_jobs WHERE state = 'waiting' GROUP BY 1, 3",
        )?,
        [cx.now],
        |r| {
            let due: bool = Cols::new(r, "idemq_jobs", "jobs").get("due")?;
            decode(r, Some(due))
        },
    )?;
    counts.extend(all(
        cx.db.prepare_cached(
            "SELECT queue, state, count(*) AS n
             FROM idemq_jobs WHERE state = 'active' GROUP BY 1",
        )?,
        [],
        |r| decode(r, None),
    )?);
    let (first, last): (Option<i64>, Option<i64>) = cx
        .db
        .prepare_cached("SELECT min(seq), max(seq) FROM idemq_jobs")?
        .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let estimated = match (first, last) {
        (Some(first), Some(last)) if last - first >= exact_span => {
            let bound = (last / RECENT - 1) * RECENT;
            counts.extend(all(
                cx.db.prepare_cached(concat!(
                    "SELECT queue, state, count(*) AS n FROM idemq_jobs
                     WHERE seq > ?1 AND ",
                    terminal!(),
                    " GROUP BY 1, 2"
                ))?,
                [bound],
                |r| decode(r, None),
            )?);
            let windows = Sample::of(first, bound);
            let sampled: Vec<Count> = all(
                cx.db.prepare_cached(concat!(
                    "WITH RECURSIVE w(lo) AS (
                         SELECT ?1 UNION ALL SELECT lo + ?2 FROM w WHERE lo + ?2 <= ?3)
                     SELECT j.queue, j.state, count(*) AS n
                     FROM w JOIN idemq_jobs j
                       ON j.seq >= w.lo AND j.seq < w.lo + ?4 AND j.seq <= ?3
                     WHERE j.",
                    terminal!(),
                    " GROUP BY 1, 2"
                ))?,
                [windows.start, windows.stride, bound, WINDOW],
                |r| decode(r, None),
            )?;
            let scale = windows.scale(first, bound);
            counts.extend(
                sampled
                    .into_iter()
                    .map(|(q, s, n)| (q, s, (n as f64 * scale).round() as i64)),
            );
            true
        }
        _ => {
            counts.extend(all(
                cx.db.prepare_cached(concat!(
                    "SELECT queue, state, count(*) AS n FROM idemq_jobs WHERE ",
                    terminal!(),
                    " GROUP BY 1, 2"
                ))?,
                [],
                |r| decode(r, None),
            )?);
            false
        }
    };
    let paused: Vec<(String, bool)> = cx
        .db
        .prepare_cached("SELECT name, paused FROM idemq_queues")?
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?
        .collect::<rusqlite::Result<_>>()?;
    let mut out: BTreeMap<String, QueueInfo> = BTreeMap::new();
    let blank = |name: &str| QueueInfo {
        name: name.to_owned(),
        paused: false,
        counts: Default::default(),
        estimated: Vec::new(),
    };
    for (name, is_paused) in paused {
        out.entry(name.clone())
            .or_insert_with(|| blank(&name))
            .paused = is_paused;
    }
    for (name, state, n) in counts {
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

/// The windows of numbers sampled before a boundary: `WINDOW` numbers at
/// every multiple of `stride` (a power of two, the same multiples from one
/// count to the next while the span keeps its size).
#[derive(Debug, PartialEq)]
struct Sample {
    start: i64,
    stride: i64,
}

impl Sample {
    /// The windows over `first..=bound`.
    fn of(first: i64, bound: i64) -> Self {
        let span = (bound - first + 1).max(1);
        // A span of at most 2^62 numbers (history numbers are i64).
        let stride = ((span + WINDOWS - 1) / WINDOWS).max(WINDOW) as u64;
        let stride = stride.next_power_of_two() as i64;
        let start = first.div_euclid(stride) * stride;
        Self { start, stride }
    }

    /// Numbers of `first..=bound` per number the windows read of it.
    fn scale(&self, first: i64, bound: i64) -> f64 {
        let mut read = 0;
        let mut lo = self.start;
        while lo <= bound {
            let from = lo.max(first);
            let to = (lo + WINDOW - 1).min(bound);
            read += (to - from + 1).max(0);
            lo += self.stride;
        }
        if read == 0 {
            return 0.0;
        }
        (bound - first + 1) as f64 / read as f64
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::sync::Arc;

    use super::super::{Cx, SqliteStore, lock};
    use super::*;
    use crate::clock::SystemClock;

    /// `rows` jobs numbered 3, 6, 9, … (two numbers in three left to events
    /// and purged jobs): queue `q0` or `q1` by turns, every tenth dead,
    /// every hundredth cancelled, the rest completed; then 7 ready jobs and
    /// 2 active ones after them.
    fn fill(conn: &rusqlite::Connection, rows: i64) {
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?1)
             INSERT INTO idemq_jobs (seq, id, type, queue, state, payload, run_at,
                 max_attempts, retry, timeout_ms, fingerprint, created_at, updated_at)
             SELECT 3 * i, 'j' || i, 't', 'q' || (i % 2),
                 CASE WHEN i % 100 = 0 THEN 'cancelled' WHEN i % 10 = 0 THEN 'dead'
                      ELSE 'completed' END,
                 'null', 0, 1, '{}', 1000, '{}', 0, 0
             FROM n",
            [rows],
        )
        .expect("fill");
        conn.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 9)
             INSERT INTO idemq_jobs (seq, id, type, queue, state, payload, run_at,
                 max_attempts, retry, timeout_ms, fingerprint, created_at, updated_at,
                 lease_expires_at)
             SELECT 3 * ?1 + i, 'live' || i, 't', 'q0',
                 CASE WHEN i <= 7 THEN 'waiting' ELSE 'active' END,
                 'null', 0, 1, '{}', 1000, '{}', 0, 0, 1
             FROM n",
            [rows],
        )
        .expect("live jobs");
    }

    fn counts(conn: &rusqlite::Connection, exact_span: i64) -> Vec<QueueInfo> {
        let cx = Cx {
            db: conn,
            now: 1,
            drawn: Cell::new(None),
        };
        queue_counts(&cx, exact_span).expect("counts")
    }

    /// Within `tolerance` (a fraction) of `want`.
    fn near(got: u64, want: u64, tolerance: f64) -> bool {
        (got as f64 - want as f64).abs() <= want as f64 * tolerance
    }

    #[test]
    fn terminal_counts_of_a_large_table_are_sampled_and_marked() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store =
            SqliteStore::open(Some(&dir.path().join("q.db")), Arc::new(SystemClock)).expect("open");
        let conn = lock(&store.inner.writer);
        let rows = 100_000;
        fill(&conn, rows);
        // Exact below the span: every count as stored.
        let exact = counts(&conn, i64::MAX);
        let q0 = &exact[0].counts;
        assert_eq!((q0.ready, q0.active, q0.scheduled), (7, 2, 0));
        assert_eq!(q0.completed + exact[1].counts.completed, 90_000);
        assert_eq!(q0.dead + exact[1].counts.dead, 9_000);
        assert_eq!(q0.cancelled + exact[1].counts.cancelled, 1_000);
        assert!(exact.iter().all(|q| q.estimated.is_empty()));
        // Sampled above it: the live states still exact, the terminal ones
        // close to the truth and marked.
        let sampled = counts(&conn, 131_072);
        assert_eq!(sampled.len(), 2);
        let (s0, e0) = (&sampled[0].counts, &exact[0].counts);
        assert_eq!((s0.ready, s0.active, s0.scheduled), (7, 2, 0));
        for (q, e) in sampled.iter().zip(&exact) {
            assert_eq!(
                q.estimated,
                vec![JobState::Completed, JobState::Dead, JobState::Cancelled]
            );
            assert!(
                near(q.counts.completed, e.counts.completed, 0.03),
                "{q:?} against {e:?}"
            );
            assert!(
                near(q.counts.dead, e.counts.dead, 0.10),
                "{q:?} against {e:?}"
            );
        }
        assert_ne!(
            (s0.completed, s0.dead),
            (e0.completed, e0.dead),
            "an estimate that equals the exact count by construction would test nothing"
        );
    }

    #[test]
    fn a_sample_reads_fixed_windows_of_the_span() {
        let s = Sample::of(3, 262_144);
        assert_eq!(
            s,
            Sample {
                start: 0,
                stride: 4_096
            }
        );
        // 64 windows of 256, the first missing the numbers before 3, and
        // one more holding the boundary alone.
        assert!((s.scale(3, 262_144) - 262_142.0 / (64.0 * 256.0 - 3.0 + 1.0)).abs() < 1e-9);
        // The same windows while the span keeps its size.
        assert_eq!(Sample::of(1_000, 262_144).stride, 4_096);
        // A small span reads every number.
        let small = Sample::of(1, 100);
        assert_eq!(small.stride, 256);
        assert!((small.scale(1, 100) - 1.0).abs() < 1e-9);
    }
}
