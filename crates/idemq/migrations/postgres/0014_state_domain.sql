-- idemq schema for PostgreSQL, version 14: the job's state checked by its
-- type, not by a table constraint.
--
-- PostgreSQL prepares a table's CHECK constraints afresh at every
-- execution of a statement that writes the table: it parses each stored
-- expression and plans it again (for `jobs_state_check`, a list of five
-- states kept as an array expression, folded into an array each time).
-- Every enqueue, claim and completion is such an execution. Measured with
-- the constraint dropped from each fresh bench database (seven alternating
-- pairs of `idemq bench --only W1`): single enqueues from one producer ran
-- ahead in six, by about a tenth. A domain's check is planned once and
-- kept (PostgreSQL's type cache), so the same guarantee now lives in the
-- column's type: `state` is `idemq.job_state`, text that must be one of
-- the five states.
--
-- The rows are not rewritten (the domain is made without its check, then
-- the check added, which reads every row once); the indexes whose keys or
-- predicates name `state` are rebuilt, under an exclusive lock: about as
-- long as building those indexes.
CREATE DOMAIN idemq.job_state AS text;
ALTER TABLE idemq.jobs ALTER COLUMN state TYPE idemq.job_state;
ALTER TABLE idemq.jobs DROP CONSTRAINT jobs_state_check;
ALTER DOMAIN idemq.job_state ADD CONSTRAINT job_state_known
    CHECK (VALUE IN ('waiting', 'active', 'completed', 'dead', 'cancelled'));
