-- idemq schema for PostgreSQL, version 12: a claim writes one index entry
-- fewer.
--
-- A claimed job's row version was entered in three indexes: the primary
-- key, jobs_lease (the lease reaper's) and jobs_state_seq (the lists and
-- counts of every state but `completed`). The active jobs are few (at
-- most the running slots of the workers), and jobs_lease already holds
-- every one of them, so their lists and counts read jobs_lease now and
-- jobs_state_seq leaves them out: a list of active jobs sorts the active
-- ones by acceptance, the counts of active jobs read their rows.
--
-- Measured before this migration, with the change applied by hand to
-- each fresh database: leaving the active jobs out of jobs_state_seq and
-- the completed ones out of jobs_purge (not done here: the retention
-- sweep needs the completed jobs by purge time) drained 60,000 jobs (the
-- `drain` example) at 34,327-36,132 jobs/s against 30,131-34,053, four
-- alternating runs each; one entry of the two is about half of that.
--
-- The new index is built before the old one is dropped, under a lock that
-- holds writes of jobs back while it builds (as long as building an index
-- of the live states; the completed jobs are not in it).
CREATE INDEX jobs_state_seq_v12 ON idemq.jobs (state, seq) INCLUDE (queue, run_at)
    WHERE state <> 'completed' AND state <> 'active';
DROP INDEX idemq.jobs_state_seq;
ALTER INDEX idemq.jobs_state_seq_v12 RENAME TO jobs_state_seq;
