-- idemq schema for PostgreSQL, version 9: `id` is the primary key.
--
-- Every job row had two unique index entries, its `seq` key and its `id`,
-- and every update that is not HOT (a claim, a completion: `state` is in the
-- partial indexes' predicates) wrote both again. Nothing finds a job by its
-- `seq`: the lists walk it in order and the counts take a boundary near its
-- top. So `id`, what every call names a job by, is now the key, and `seq`
-- (acceptance order, drawn from idemq.history as before) is indexed only
-- where a list reads it: the states other than `completed` in
-- jobs_state_seq (version 8), completed jobs in jobs_done_seq below. A list
-- of every state merges the states' branches; the counts' boundary is read
-- from the sequence itself (functions.sql).
--
-- Measured before this migration with the same indexes applied by hand to
-- each fresh benchmark database: a drain (W3) wrote one index entry fewer
-- per enqueued row and per claimed row version and ran 0.30-0.39x ->
-- 0.39-0.45x of the raw two-step loop (docs/benchmarks.md).
--
-- The key's index replaces the unique index on `id`: building it and
-- jobs_done_seq reads the table once, under an exclusive lock (about as
-- long as building two indexes of the table; the rows are not rewritten).
ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_pkey;
ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_id_key;
ALTER TABLE idemq.jobs ADD CONSTRAINT jobs_pkey PRIMARY KEY (id);
CREATE INDEX jobs_done_seq ON idemq.jobs (seq) WHERE state = 'completed';
-- A row whose state is none of the five (only a row changed behind idemq's
-- back, past the CHECK constraint) must still be listed, so that reading it
-- fails with an error naming it instead of hiding it: this index holds only
-- such rows, and is empty in every healthy database.
CREATE INDEX jobs_odd_state ON idemq.jobs (seq)
    WHERE state NOT IN ('waiting', 'active', 'completed', 'dead', 'cancelled');
