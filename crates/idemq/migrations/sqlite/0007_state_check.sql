-- idemq schema for SQLite, version 7: the job table's check of `state`
-- written as comparisons.
--
-- `CHECK (state IN ('waiting', 'active', 'completed', 'dead', 'cancelled'))`
-- is evaluated at every insert and every update of a job. SQLite codes an
-- `IN` list of more than two values as a temporary b-tree built afresh at
-- each execution of a statement, and a claim, a completion and an enqueue
-- are each one execution per job: the check cost more than the rest of a
-- one-row update (docs/benchmarks.md, "SQLite"). The same check as a chain
-- of `=` is a few comparisons. A table's checks cannot be altered in
-- place, so the table is rebuilt (SQLite's procedure for other table
-- changes): a new table with the same columns in the same order, every row
-- copied with its `seq`, the old table dropped, the new one renamed, and
-- the indexes made again. It runs in the migration's one transaction.

CREATE TABLE idemq_jobs_v7 (
    seq              INTEGER PRIMARY KEY,          -- acceptance order
    id               TEXT    NOT NULL UNIQUE,
    type             TEXT    NOT NULL,
    queue            TEXT    NOT NULL,
    state            TEXT    NOT NULL
                     CHECK (state = 'waiting' OR state = 'active' OR state = 'completed'
                            OR state = 'dead' OR state = 'cancelled'),
    payload          TEXT    NOT NULL,
    result           TEXT,
    priority         INTEGER NOT NULL DEFAULT 0,
    run_at           INTEGER NOT NULL,
    attempt          INTEGER NOT NULL DEFAULT 0,
    attempts_used    INTEGER NOT NULL DEFAULT 0,
    max_attempts     INTEGER NOT NULL,
    retry            TEXT    NOT NULL,
    timeout_ms       INTEGER NOT NULL,
    deadline         INTEGER,
    concurrency_key  TEXT,
    tags             TEXT    NOT NULL DEFAULT '[]',
    keep_ms          INTEGER,
    fingerprint      TEXT    NOT NULL,
    idem_scope       TEXT,
    idem_key_hash    BLOB,
    idem_key_preview TEXT,
    dedupe_key       TEXT,
    dedupe_mode      TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    purge_after      INTEGER,
    last_error       TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    lease_token      TEXT,
    lease_expires_at INTEGER,
    lease_ms         INTEGER,
    worker           TEXT,
    started_at       INTEGER,
    first_run_at     INTEGER,
    claim_seq        INTEGER,
    done_seq         INTEGER
);

INSERT INTO idemq_jobs_v7 (seq, id, type, queue, state, payload, result, priority, run_at,
    attempt, attempts_used, max_attempts, retry, timeout_ms, deadline, concurrency_key, tags,
    keep_ms, fingerprint, idem_scope, idem_key_hash, idem_key_preview, dedupe_key, dedupe_mode,
    created_at, updated_at, finished_at, purge_after, last_error, cancel_requested,
    lease_token, lease_expires_at, lease_ms, worker, started_at, first_run_at, claim_seq,
    done_seq)
SELECT seq, id, type, queue, state, payload, result, priority, run_at,
    attempt, attempts_used, max_attempts, retry, timeout_ms, deadline, concurrency_key, tags,
    keep_ms, fingerprint, idem_scope, idem_key_hash, idem_key_preview, dedupe_key, dedupe_mode,
    created_at, updated_at, finished_at, purge_after, last_error, cancel_requested,
    lease_token, lease_expires_at, lease_ms, worker, started_at, first_run_at, claim_seq,
    done_seq
FROM idemq_jobs ORDER BY seq;

DROP TABLE idemq_jobs;
ALTER TABLE idemq_jobs_v7 RENAME TO idemq_jobs;

-- The indexes of versions 1-6, as they were.
CREATE INDEX idemq_jobs_claim ON idemq_jobs (priority DESC, run_at, seq) WHERE state = 'waiting';
CREATE INDEX idemq_jobs_lease ON idemq_jobs (lease_expires_at) WHERE state = 'active';
CREATE UNIQUE INDEX idemq_jobs_active_key ON idemq_jobs (concurrency_key)
    WHERE state = 'active' AND concurrency_key IS NOT NULL;
CREATE INDEX idemq_jobs_purge ON idemq_jobs (purge_after) WHERE purge_after IS NOT NULL;
CREATE INDEX idemq_jobs_dedupe ON idemq_jobs (type, dedupe_key) WHERE dedupe_key IS NOT NULL;
