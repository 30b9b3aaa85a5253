-- idemq schema for PostgreSQL, version 7.
--
-- A schedule records why its latest tick could not be enqueued (its
-- template over the payload limit, say) instead of failing that tick at
-- every pass; the next tick that fires clears it.
ALTER TABLE idemq.schedules
    ADD COLUMN last_error    text,
    ADD COLUMN last_error_at timestamptz;

-- The test clock is per session: a session that sets idemq.test_clock to a
-- clock's id reads that clock; every other session reads clock_timestamp().
-- The old one-row table froze the clock for every session of the database.
DROP TABLE idemq.test_clock;
CREATE TABLE idemq.test_clocks (
    id text        PRIMARY KEY,
    at timestamptz NOT NULL
);
