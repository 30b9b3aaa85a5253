-- idemq schema for SQLite, version 6: the routine history is derived from
-- the job row, as on PostgreSQL.
--
-- A drained job used to write six rows (the claim's job update, run and
-- `claimed` event; the completion's job update, run update and `completed`
-- event) and an enqueue two (the job and its `accepted` event); on one
-- writer every page they dirty is written to the WAL at each commit. Now
-- the job row carries what those rows said: `accepted` is derived from the
-- row itself, the current attempt's run and `claimed` event, and its
-- `completed` event, from three columns. An attempt that ends other than
-- completed is written out to idemq_runs and idemq_events as before.
--
-- One counter numbers jobs and events alike, so stored and derived events
-- of a job keep one order: it starts above every number in use.

CREATE TABLE idemq_history (
    one  INTEGER PRIMARY KEY CHECK (one = 1),
    next INTEGER NOT NULL
);
INSERT INTO idemq_history (one, next)
SELECT 1, max(coalesce((SELECT max(seq) FROM idemq_jobs), 0),
              coalesce((SELECT max(seq) FROM idemq_events), 0)) + 1;

-- run_at when the job was accepted, where it differs from created_at.
ALTER TABLE idemq_jobs ADD COLUMN first_run_at INTEGER;
-- The number of the current attempt's `claimed` event while it is derived
-- (the attempt runs, or it completed).
ALTER TABLE idemq_jobs ADD COLUMN claim_seq INTEGER;
-- The number of the derived `completed` event.
ALTER TABLE idemq_jobs ADD COLUMN done_seq INTEGER;

-- Jobs accepted before keep their stored `accepted` event (a job's
-- `accepted` is derived only when none is stored). Running attempts: their
-- run and `claimed` event become derived, under the event's own number.
UPDATE idemq_jobs SET claim_seq = (
    SELECT max(e.seq) FROM idemq_events e
    WHERE e.job_id = idemq_jobs.id AND e.kind = 'claimed')
WHERE state = 'active';
DELETE FROM idemq_events
WHERE kind = 'claimed'
  AND seq IN (SELECT claim_seq FROM idemq_jobs WHERE state = 'active' AND claim_seq IS NOT NULL);
DELETE FROM idemq_runs
WHERE EXISTS (SELECT 1 FROM idemq_jobs j
              WHERE j.id = idemq_runs.job_id AND j.state = 'active'
                AND j.claim_seq IS NOT NULL AND j.attempt = idemq_runs.attempt);
