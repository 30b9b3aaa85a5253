-- idemq schema for SQLite, version 5: a schedule records why its latest
-- tick could not be enqueued (its template over the payload limit, say)
-- instead of failing that tick at every pass; the next tick that fires
-- clears it.
ALTER TABLE idemq_schedules ADD COLUMN last_error TEXT;
ALTER TABLE idemq_schedules ADD COLUMN last_error_at INTEGER;
