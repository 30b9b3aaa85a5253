-- idemq schema for PostgreSQL, version 4: completing many attempts in one
-- round trip and one commit, the worker's hot path. Each item is fenced by
-- its own lease exactly as finish_attempt fences one (the job is active and
-- holds that lease token, re-checked on the latest row version when another
-- transaction changed it meanwhile); a stale item is reported (ok = false)
-- and changes nothing, and the others stand. Set-based: one update of the
-- jobs, one of their runs, one insert of their events, whatever the batch
-- size. A job named twice is completed once, by its first item.

CREATE FUNCTION idemq.complete_many(p_ids text[], p_tokens text[], p_results jsonb[])
RETURNS TABLE (idx integer, ok boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
BEGIN
    RETURN QUERY
    WITH input AS (
        SELECT (t.i - 1)::integer AS i, t.id, t.token, t.result
        FROM unnest(p_ids, p_tokens, p_results) WITH ORDINALITY AS t(id, token, result, i)
    ), firsts AS (
        SELECT DISTINCT ON (n.id) n.i, n.id, n.token, n.result FROM input n ORDER BY n.id, n.i
    ), done AS (
        UPDATE idemq.jobs j SET state = 'completed', result = f.result, finished_at = v_now,
            purge_after = idemq.keep_until(j.keep_ms, 'completed', v_now),
            attempts_used = j.attempts_used + 1, lease_token = NULL, lease_expires_at = NULL,
            lease_ms = NULL, worker = NULL, started_at = NULL, updated_at = v_now
        FROM firsts f
        WHERE j.id = f.id AND j.state = 'active' AND j.lease_token = f.token
        RETURNING f.i, j.id, j.attempt
    ), runs AS (
        UPDATE idemq.runs r SET finished_at = v_now, outcome = 'completed', error = NULL
        FROM done d WHERE r.job_id = d.id AND r.attempt = d.attempt
    ), events AS (
        INSERT INTO idemq.events (job_id, kind, at, data)
        SELECT d.id, 'completed', v_now, jsonb_build_object('attempt', d.attempt)
        FROM done d ORDER BY d.i
    )
    SELECT n.i, d.i IS NOT NULL FROM input n LEFT JOIN done d ON d.i = n.i ORDER BY n.i;
END
$$;
