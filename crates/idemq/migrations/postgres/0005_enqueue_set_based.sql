-- idemq schema for PostgreSQL, version 5: set-based enqueue of batches that
-- carry no keys.
--
-- Items without an idempotency key, an explicit job id or a dedupe key are
-- decided by the clock alone (a deadline in the future, run_at before it),
-- so a batch made only of such items is inserted with one statement for the
-- jobs and one for their events instead of one call per item. Any other
-- batch takes the per-item path unchanged. Acceptance order is request order.

CREATE OR REPLACE FUNCTION idemq.enqueue(p_items jsonb)
RETURNS TABLE (idx integer, job_id text, outcome text, reason text, error jsonb)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now  timestamptz := idemq.now();
    v_lock bigint;
    v_item jsonb;
    v_idx  bigint;
    v_queue text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM jsonb_array_elements(p_items) it
                   WHERE it ? 'idem' OR it ? 'job_id' OR it ? 'dedupe') THEN
        RETURN QUERY
        WITH items AS (
            SELECT (e.ordinality - 1)::integer AS i, e.value AS it,
                   idemq.resolve_run_at(e.value, v_now, v_now, NULL) AS run_at
            FROM jsonb_array_elements(p_items) WITH ORDINALITY AS e
        ), checked AS (
            SELECT i, it, run_at, idemq.check_clock(it, run_at, v_now) AS err FROM items
        ), inserted AS (
            INSERT INTO idemq.jobs (id, type, queue, state, payload, priority, run_at,
                max_attempts, retry, timeout_ms, deadline, concurrency_key, tags, keep_ms,
                fingerprint, created_at, updated_at)
            SELECT c.it ->> 'new_id', c.it ->> 'type', c.it ->> 'queue', 'waiting',
                c.it -> 'payload', (c.it ->> 'priority')::smallint, c.run_at,
                (c.it ->> 'max_attempts')::int, c.it -> 'retry', (c.it ->> 'timeout_ms')::bigint,
                idemq.us((c.it ->> 'deadline')::bigint), c.it ->> 'concurrency_key',
                ARRAY(SELECT jsonb_array_elements_text(c.it -> 'tags')),
                (c.it ->> 'keep_ms')::bigint, c.it -> 'fingerprint', v_now, v_now
            FROM checked c WHERE c.err IS NULL ORDER BY c.i
            RETURNING id, queue, run_at
        ), events AS (
            INSERT INTO idemq.events (job_id, kind, at, data)
            SELECT n.id, 'accepted', v_now, jsonb_build_object('queue', n.queue, 'run_at', n.run_at)
            FROM inserted n
        )
        SELECT c.i,
               CASE WHEN c.err IS NULL THEN c.it ->> 'new_id' END,
               CASE WHEN c.err IS NULL THEN 'accepted' END,
               NULL::text,
               c.err
        FROM checked c ORDER BY c.i;
        FOR v_queue IN
            SELECT DISTINCT it ->> 'queue' FROM jsonb_array_elements(p_items) it
            WHERE idemq.check_clock(it, idemq.resolve_run_at(it, v_now, v_now, NULL), v_now) IS NULL
        LOOP
            PERFORM idemq.wake(v_queue);
        END LOOP;
        RETURN;
    END IF;

    -- Every key of the batch is locked first, in a canonical order, so two
    -- batches cannot deadlock; items are then decided in request order, each
    -- seeing the effects of the earlier ones.
    FOR v_lock IN
        SELECT DISTINCT l FROM (
            SELECT hashtextextended('idemq.key:' || (it -> 'idem' ->> 'scope') || ':'
                                    || (it -> 'idem' ->> 'hash'), 0) AS l
            FROM jsonb_array_elements(p_items) it WHERE it ? 'idem'
            UNION ALL
            SELECT hashtextextended('idemq.job:' || (it ->> 'job_id'), 0)
            FROM jsonb_array_elements(p_items) it WHERE it ? 'job_id'
            UNION ALL
            SELECT hashtextextended('idemq.dedupe:' || (it ->> 'type') || ':'
                                    || (it -> 'dedupe' ->> 'key'), 0)
            FROM jsonb_array_elements(p_items) it WHERE it ? 'dedupe') s
        ORDER BY l
    LOOP
        PERFORM pg_advisory_xact_lock(v_lock);
    END LOOP;
    FOR v_item, v_idx IN SELECT e.value, e.ordinality FROM jsonb_array_elements(p_items)
                         WITH ORDINALITY AS e
    LOOP
        RETURN QUERY SELECT (v_idx - 1)::integer, r.job_id, r.outcome, r.reason, r.error
                     FROM idemq.enqueue_one(v_item, v_now) r;
    END LOOP;
END
$$;
