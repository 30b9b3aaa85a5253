-- idemq schema for SQLite, version 2: schedules (SPEC 8).
-- Times are INTEGER microseconds since the Unix epoch (UTC).

CREATE TABLE idemq_schedules (
    name          TEXT    PRIMARY KEY,
    cron          TEXT,                        -- six fields, seconds first
    every_ms      INTEGER,                     -- or a fixed interval
    timezone      TEXT    NOT NULL,            -- IANA zone of the cron expression
    job           TEXT    NOT NULL,            -- the EnqueueRequest template, as JSON
    paused        INTEGER NOT NULL DEFAULT 0,
    created_at    INTEGER NOT NULL,            -- also the anchor of an interval
    updated_at    INTEGER NOT NULL,
    last_fired_at INTEGER,                     -- the last tick fired
    next_fire_at  INTEGER,                     -- NULL while paused
    CHECK ((cron IS NULL) <> (every_ms IS NULL))
) WITHOUT ROWID;

-- Due schedules, earliest first.
CREATE INDEX idemq_schedules_due ON idemq_schedules (next_fire_at)
    WHERE next_fire_at IS NOT NULL;
