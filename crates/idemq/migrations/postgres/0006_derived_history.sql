-- idemq schema for PostgreSQL, version 6: the routine history is derived
-- from the job row.
--
-- A drained job used to write six rows (the claim's job update, run and
-- `claimed` event; the completion's job update, run update and `completed`
-- event) and an enqueue two (the job and its `accepted` event). Now the job
-- row carries what those rows said: `accepted` is derived from the row
-- itself, and the current attempt's run and `claimed` event, and its
-- `completed` event, from three columns. An attempt that ends other than
-- completed is written out to idemq.runs and idemq.events as before (see
-- idemq.end_attempt in functions.sql); idemq.job_events and idemq.job_runs
-- read both.
--
-- One sequence, idemq.history, numbers jobs and events alike, so stored and
-- derived events of a job keep one order.

CREATE SEQUENCE idemq.history AS bigint;
SELECT setval('idemq.history',
              greatest((SELECT max(seq) FROM idemq.events), (SELECT max(seq) FROM idemq.jobs), 0)
              + 1, false);
ALTER TABLE idemq.events ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE idemq.events ALTER COLUMN seq SET DEFAULT nextval('idemq.history');
ALTER TABLE idemq.jobs ALTER COLUMN seq DROP IDENTITY;
ALTER TABLE idemq.jobs ALTER COLUMN seq SET DEFAULT nextval('idemq.history');

ALTER TABLE idemq.jobs
    -- run_at when the job was accepted, where it differs from created_at.
    ADD COLUMN first_run_at timestamptz,
    -- The sequence number of the current attempt's `claimed` event while it
    -- is derived (the attempt runs, or it completed).
    ADD COLUMN claim_seq bigint,
    -- The sequence number of the derived `completed` event.
    ADD COLUMN done_seq bigint;

-- Existing jobs: the stored `accepted` event becomes the derived one, under
-- the same number (the key is dropped meanwhile: numbers move between rows).
ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_pkey;
UPDATE idemq.jobs j
SET seq = e.seq,
    first_run_at = nullif((e.data ->> 'run_at')::timestamptz, j.created_at)
FROM (SELECT DISTINCT ON (job_id) job_id, seq, data FROM idemq.events
      WHERE kind = 'accepted' ORDER BY job_id, seq) e
WHERE e.job_id = j.id;
DELETE FROM idemq.events e USING idemq.jobs j
WHERE e.job_id = j.id AND e.kind = 'accepted' AND e.seq = j.seq;
ALTER TABLE idemq.jobs ADD CONSTRAINT jobs_pkey PRIMARY KEY (seq);

-- Running attempts: their run and `claimed` event become derived.
UPDATE idemq.jobs j SET claim_seq = e.seq
FROM (SELECT job_id, max(seq) AS seq FROM idemq.events WHERE kind = 'claimed'
      GROUP BY job_id) e
WHERE e.job_id = j.id AND j.state = 'active';
DELETE FROM idemq.events e USING idemq.jobs j
WHERE e.job_id = j.id AND j.state = 'active' AND e.kind = 'claimed' AND e.seq = j.claim_seq;
DELETE FROM idemq.runs r USING idemq.jobs j
WHERE r.job_id = j.id AND j.state = 'active' AND j.claim_seq IS NOT NULL
  AND r.attempt = j.attempt;

-- Every job insert and update paid for an index on (state, queue) that no
-- hot path reads: the claim and the reaper have their own partial indexes,
-- and the list query filters as it walks the seq index.
DROP INDEX idemq.jobs_state;

-- A job's fingerprint packed: the 16-byte digests of its thirteen fields in
-- the order of their names (idemq.fp_pack in functions.sql; 208 bytes
-- instead of about 630 in every version of the row).
ALTER TABLE idemq.jobs ALTER COLUMN fingerprint TYPE bytea USING decode(
        coalesce(fingerprint ->> 'concurrency_key', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'deadline', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'delay_ms', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'idempotency.ttl_ms', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'job_id', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'max_attempts', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'payload', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'queue', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'retry', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'run_at', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'tags', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'timeout_ms', '00000000000000000000000000000000')
        || coalesce(fingerprint ->> 'type', '00000000000000000000000000000000'), 'hex');
