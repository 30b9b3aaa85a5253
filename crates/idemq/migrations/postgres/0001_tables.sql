-- idemq schema for PostgreSQL, version 1: tables and indexes.
-- Everything lives in the schema `idemq`. `state` stores 'waiting' for both
-- scheduled and ready: which one a job is in is derived from run_at and the
-- clock of record (idemq.now()) on every read.

CREATE SCHEMA IF NOT EXISTS idemq;

CREATE TABLE idemq.jobs (
    seq              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- acceptance order
    id               text        NOT NULL UNIQUE,
    type             text        NOT NULL,
    queue            text        NOT NULL,
    state            text        NOT NULL
                     CHECK (state IN ('waiting', 'active', 'completed', 'dead', 'cancelled')),
    payload          jsonb       NOT NULL,
    result           jsonb,
    priority         smallint    NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL,
    attempt          integer     NOT NULL DEFAULT 0,
    attempts_used    integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL,
    retry            jsonb       NOT NULL,
    timeout_ms       bigint      NOT NULL,
    deadline         timestamptz,
    concurrency_key  text,
    tags             text[]      NOT NULL DEFAULT '{}',
    keep_ms          bigint,
    fingerprint      jsonb       NOT NULL,
    idem_scope       text,
    idem_key_hash    bytea,
    idem_key_preview text,
    dedupe_key       text,
    dedupe_mode      text,
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    finished_at      timestamptz,
    purge_after      timestamptz,
    last_error       text,
    cancel_requested boolean     NOT NULL DEFAULT false,
    lease_token      text,
    lease_expires_at timestamptz,
    lease_ms         bigint,
    worker           text,
    started_at       timestamptz
);

-- Claim order among due jobs: priority, then run_at, then acceptance.
CREATE INDEX jobs_claim ON idemq.jobs (priority DESC, run_at, seq) WHERE state = 'waiting';
CREATE INDEX jobs_lease ON idemq.jobs (lease_expires_at) WHERE state = 'active';
-- The backstop of concurrency keys: never two active jobs for one key.
CREATE UNIQUE INDEX jobs_active_key ON idemq.jobs (concurrency_key)
    WHERE state = 'active' AND concurrency_key IS NOT NULL;
CREATE INDEX jobs_purge ON idemq.jobs (purge_after) WHERE purge_after IS NOT NULL;
CREATE INDEX jobs_dedupe ON idemq.jobs (type, dedupe_key) WHERE dedupe_key IS NOT NULL;
CREATE INDEX jobs_state ON idemq.jobs (state, queue);

-- (scope, key hash) -> job. The raw key never reaches the database.
CREATE TABLE idemq.idempotency (
    scope       text        NOT NULL,
    key_hash    bytea       NOT NULL,
    key_preview text        NOT NULL,
    job_id      text        NOT NULL,
    fingerprint jsonb       NOT NULL,
    created_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    PRIMARY KEY (scope, key_hash)
);
CREATE INDEX idempotency_job ON idemq.idempotency (job_id);
CREATE INDEX idempotency_expiry ON idemq.idempotency (expires_at);

-- (type, dedupe key) -> job, with the mode and window it was created with.
CREATE TABLE idemq.dedupe (
    type         text        NOT NULL,
    key          text        NOT NULL,
    job_id       text        NOT NULL,
    mode         text        NOT NULL,
    ttl_ms       bigint,
    max_wait_ms  bigint,
    accepted_at  timestamptz NOT NULL,
    window_until timestamptz,
    PRIMARY KEY (type, key)
);
CREATE INDEX dedupe_job ON idemq.dedupe (job_id);

CREATE TABLE idemq.events (
    seq    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id text        NOT NULL,
    kind   text        NOT NULL,
    at     timestamptz NOT NULL,
    data   jsonb       NOT NULL DEFAULT '{}'
);
CREATE INDEX events_job ON idemq.events (job_id, seq);

CREATE TABLE idemq.runs (
    job_id      text        NOT NULL,
    attempt     integer     NOT NULL,
    worker      text        NOT NULL,
    started_at  timestamptz NOT NULL,
    finished_at timestamptz,
    outcome     text,
    error       text,
    PRIMARY KEY (job_id, attempt)
);

CREATE TABLE idemq.checkpoints (
    job_id     text        NOT NULL,
    name       text        NOT NULL,
    value      jsonb       NOT NULL,
    created_at timestamptz NOT NULL,
    PRIMARY KEY (job_id, name)
);

CREATE TABLE idemq.queues (
    name       text        PRIMARY KEY,
    paused     boolean     NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL
);

-- Test-only: a frozen clock of record, so the conformance suite can move
-- time without sleeping and assert exact instants. Production never writes
-- this table; while it is empty the clock is clock_timestamp().
CREATE TABLE idemq.test_clock (
    one boolean     PRIMARY KEY DEFAULT true CHECK (one),
    at  timestamptz NOT NULL
);
