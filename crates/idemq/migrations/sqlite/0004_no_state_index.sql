-- idemq schema for SQLite, version 4: no index on (state, queue).
-- Every job insert and update wrote a page of it, and no hot path reads it:
-- the claim and the reaper have their own partial indexes, and listing
-- filters as it walks the rowid.
DROP INDEX idemq_jobs_state;
