-- idemq schema for PostgreSQL, version 8: lists and sweeps whose cost does
-- not grow with the tables (docs/scaling.md, "Big tables").
--
-- A list is newest first (seq descending) under a LIMIT. Walking the primary
-- key and filtering stops early only when the filter matches often; a rare
-- state or tag walked the whole table. The states but `completed` share one
-- partial index that returns their rows in seq order: the completed jobs are
-- most of the table, and walking the primary key finds them at once. It
-- carries the queue and run_at, so the counts of the live states
-- (idemq.queue_counts) read the index, not the table. A GIN index finds the
-- few rows of a rare tag. Queue and type get no index of their own: one
-- over every row costs each claim and each completion an entry more (about
-- an eighth of their server time each).
CREATE INDEX jobs_state_seq ON idemq.jobs (state, seq) INCLUDE (queue, run_at)
    WHERE state <> 'completed';
CREATE INDEX jobs_tags ON idemq.jobs USING gin (tags) WHERE tags <> '{}';

-- The binding sweep looked at every dedupe binding at every pass to find
-- the few that ended. Those with a window end at it; those without end with
-- their job, and are only the bindings of pending jobs.
CREATE INDEX dedupe_window ON idemq.dedupe (window_until) WHERE window_until IS NOT NULL;
CREATE INDEX dedupe_pending ON idemq.dedupe (job_id) WHERE window_until IS NULL;
