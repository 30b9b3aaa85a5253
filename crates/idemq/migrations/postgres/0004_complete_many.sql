-- idemq schema for PostgreSQL, version 4: completing many attempts in one
-- round trip and one commit, the worker's hot path. Each item is fenced by
-- its own lease exactly as finish_attempt fences one; a stale item is
-- reported (ok = false) and changes nothing, and the others stand. Callers
-- pass the items ordered by job id, so two batches lock rows in one order.

CREATE FUNCTION idemq.complete_many(p_ids text[], p_tokens text[], p_results jsonb[])
RETURNS TABLE (idx integer, ok boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    j     idemq.jobs%ROWTYPE;
    i     integer;
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        j := idemq.lease_job(p_ids[i], p_tokens[i]);
        IF j.id IS NULL THEN
            RETURN QUERY SELECT i - 1, false;
        ELSE
            PERFORM idemq.end_attempt(p_ids[i], 'completed', NULL, true, NULL, NULL,
                                      p_results[i], v_now);
            RETURN QUERY SELECT i - 1, true;
        END IF;
    END LOOP;
END
$$;
