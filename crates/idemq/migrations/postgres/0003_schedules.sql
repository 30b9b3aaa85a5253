-- idemq schema for PostgreSQL, version 3: schedules (SPEC 8).
--
-- When a cron expression fires is computed by the client library (croner
-- and the IANA zone rules); the database keeps each schedule's definition,
-- the last tick fired and the next fire instant, and decides the races
-- between schedulers with conditional updates.

CREATE TABLE idemq.schedules (
    name          text        PRIMARY KEY,
    cron          text,                        -- six fields, seconds first
    every_ms      bigint,                      -- or a fixed interval
    timezone      text        NOT NULL,        -- IANA zone of the cron expression
    job           jsonb       NOT NULL,        -- the EnqueueRequest template
    paused        boolean     NOT NULL DEFAULT false,
    created_at    timestamptz NOT NULL,        -- also the anchor of an interval
    updated_at    timestamptz NOT NULL,
    last_fired_at timestamptz,                 -- the last tick fired
    next_fire_at  timestamptz,                 -- NULL while paused
    CHECK ((cron IS NULL) <> (every_ms IS NULL))
);

-- Due schedules, earliest first.
CREATE INDEX schedules_due ON idemq.schedules (next_fire_at) WHERE next_fire_at IS NOT NULL;

-- The first interval tick strictly after p_now: anchor + k * every, k >= 1,
-- with the anchor truncated to the second (as crate::schedule::every_next).
-- STABLE, not IMMUTABLE: date_trunc on timestamptz is (whatever the unit).
CREATE FUNCTION idemq.schedule_every_next(p_anchor timestamptz, p_every_ms bigint,
                                          p_now timestamptz)
RETURNS timestamptz LANGUAGE sql STABLE AS $$
    SELECT a + idemq.ms(p_every_ms) * (CASE WHEN p_now < a THEN 1
        ELSE floor(extract(epoch FROM p_now - a) * 1000 / p_every_ms)::bigint + 1 END)
    FROM (SELECT date_trunc('second', p_anchor) AS a) anchor
$$;

-- Creates or replaces a definition; true when it was created. A schedule
-- whose timing is unchanged and that was not paused keeps its next fire, so
-- a process declaring its schedules at every start neither skips nor
-- repeats a tick; any other change computes the next fire afresh (an
-- interval from its creation, a cron expression from p_at: p_cron_next).
CREATE FUNCTION idemq.schedule_put(p_name text, p_cron text, p_every_ms bigint, p_timezone text,
                                   p_job jsonb, p_paused boolean, p_at timestamptz,
                                   p_cron_next timestamptz)
RETURNS boolean LANGUAGE sql AS $$
    INSERT INTO idemq.schedules AS s (name, cron, every_ms, timezone, job, paused,
                                      created_at, updated_at, last_fired_at, next_fire_at)
    VALUES (p_name, p_cron, p_every_ms, p_timezone, p_job, p_paused, p_at, p_at, NULL,
            CASE WHEN p_paused THEN NULL
                 WHEN p_every_ms IS NOT NULL THEN idemq.schedule_every_next(p_at, p_every_ms, p_at)
                 ELSE p_cron_next END)
    ON CONFLICT (name) DO UPDATE SET
        cron = excluded.cron, every_ms = excluded.every_ms, timezone = excluded.timezone,
        job = excluded.job, paused = excluded.paused, updated_at = excluded.updated_at,
        next_fire_at = CASE
            WHEN excluded.paused THEN NULL
            WHEN s.next_fire_at IS NOT NULL
                 AND s.cron IS NOT DISTINCT FROM excluded.cron
                 AND s.every_ms IS NOT DISTINCT FROM excluded.every_ms
                 AND s.timezone = excluded.timezone THEN s.next_fire_at
            WHEN excluded.every_ms IS NOT NULL
                THEN idemq.schedule_every_next(s.created_at, excluded.every_ms, p_at)
            ELSE p_cron_next END
    RETURNING xmax = 0
$$;

-- Records a fired tick (p_fired NULL: none was due) and the next fire, if
-- the schedule still has the timing the caller computed them with and is
-- not paused. last_fired_at only moves forward; ticks of one timing only
-- move forward, so next_fire_at never moves back either.
CREATE FUNCTION idemq.schedule_mark_fired(p_name text, p_cron text, p_every_ms bigint,
                                          p_timezone text, p_fired timestamptz,
                                          p_next timestamptz)
RETURNS boolean LANGUAGE sql AS $$
    WITH marked AS (
        UPDATE idemq.schedules
        SET last_fired_at = coalesce(p_fired, last_fired_at),
            next_fire_at = CASE WHEN p_next IS NULL THEN NULL
                                ELSE greatest(next_fire_at, p_next) END
        WHERE name = p_name AND next_fire_at IS NOT NULL
          AND cron IS NOT DISTINCT FROM p_cron AND every_ms IS NOT DISTINCT FROM p_every_ms
          AND timezone = p_timezone
          AND (p_fired IS NULL OR last_fired_at IS NULL OR last_fired_at <= p_fired)
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM marked)
$$;
