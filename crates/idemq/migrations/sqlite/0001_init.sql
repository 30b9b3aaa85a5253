-- idemq schema for SQLite, version 1.
-- Times are INTEGER microseconds since the Unix epoch (UTC).
-- `state` stores 'waiting' for both scheduled and ready: which one a job is in
-- is derived from run_at and the clock of record on every read.

CREATE TABLE idemq_jobs (
    seq              INTEGER PRIMARY KEY,          -- acceptance order
    id               TEXT    NOT NULL UNIQUE,
    type             TEXT    NOT NULL,
    queue            TEXT    NOT NULL,
    state            TEXT    NOT NULL
                     CHECK (state IN ('waiting', 'active', 'completed', 'dead', 'cancelled')),
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
    started_at       INTEGER
);

-- Claim order among due jobs: priority, then run_at, then acceptance.
CREATE INDEX idemq_jobs_claim ON idemq_jobs (priority DESC, run_at, seq) WHERE state = 'waiting';
CREATE INDEX idemq_jobs_lease ON idemq_jobs (lease_expires_at) WHERE state = 'active';
-- The backstop of concurrency keys: never two active jobs for one key.
CREATE UNIQUE INDEX idemq_jobs_active_key ON idemq_jobs (concurrency_key)
    WHERE state = 'active' AND concurrency_key IS NOT NULL;
CREATE INDEX idemq_jobs_purge ON idemq_jobs (purge_after) WHERE purge_after IS NOT NULL;
CREATE INDEX idemq_jobs_dedupe ON idemq_jobs (type, dedupe_key) WHERE dedupe_key IS NOT NULL;
CREATE INDEX idemq_jobs_state ON idemq_jobs (state, queue);

-- (scope, key hash) -> job. The raw key is never stored.
CREATE TABLE idemq_idempotency (
    scope       TEXT    NOT NULL,
    key_hash    BLOB    NOT NULL,
    key_preview TEXT    NOT NULL,
    job_id      TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    created_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    PRIMARY KEY (scope, key_hash)
) WITHOUT ROWID;
CREATE INDEX idemq_idempotency_job ON idemq_idempotency (job_id);
CREATE INDEX idemq_idempotency_expiry ON idemq_idempotency (expires_at);

-- (type, dedupe key) -> job, with the mode and window it was created with.
CREATE TABLE idemq_dedupe (
    type         TEXT    NOT NULL,
    key          TEXT    NOT NULL,
    job_id       TEXT    NOT NULL,
    mode         TEXT    NOT NULL,
    ttl_ms       INTEGER,
    max_wait_ms  INTEGER,
    accepted_at  INTEGER NOT NULL,
    window_until INTEGER,
    PRIMARY KEY (type, key)
) WITHOUT ROWID;
CREATE INDEX idemq_dedupe_job ON idemq_dedupe (job_id);

CREATE TABLE idemq_events (
    seq    INTEGER PRIMARY KEY,
    job_id TEXT    NOT NULL,
    kind   TEXT    NOT NULL,
    at     INTEGER NOT NULL,
    data   TEXT    NOT NULL DEFAULT '{}'
);
CREATE INDEX idemq_events_job ON idemq_events (job_id, seq);

CREATE TABLE idemq_runs (
    job_id      TEXT    NOT NULL,
    attempt     INTEGER NOT NULL,
    worker      TEXT    NOT NULL,
    started_at  INTEGER NOT NULL,
    finished_at INTEGER,
    outcome     TEXT,
    error       TEXT,
    PRIMARY KEY (job_id, attempt)
) WITHOUT ROWID;

CREATE TABLE idemq_checkpoints (
    job_id     TEXT    NOT NULL,
    name       TEXT    NOT NULL,
    value      TEXT    NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (job_id, name)
) WITHOUT ROWID;

CREATE TABLE idemq_queues (
    name       TEXT    PRIMARY KEY,
    paused     INTEGER NOT NULL DEFAULT 0,
    updated_at INTEGER NOT NULL
);
