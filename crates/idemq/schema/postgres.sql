-- The idemq schema on PostgreSQL, as migrated: generated, do not edit.

CREATE SCHEMA idemq;

CREATE DOMAIN idemq.job_state AS text
	CONSTRAINT job_state_known CHECK ((VALUE = ANY (ARRAY['waiting'::text, 'active'::text, 'completed'::text, 'dead'::text, 'cancelled'::text])));

CREATE FUNCTION idemq.bind_key(p_idem jsonb, p_job text, p_fp jsonb, p_fpc bytea, p_now timestamp with time zone) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    INSERT INTO idemq.idempotency
        (scope, key_hash, key_preview, job_id, fingerprint, fp, created_at, expires_at)
    SELECT p_idem ->> 'scope', decode(p_idem ->> 'hash', 'hex'), p_idem ->> 'preview', p_job,
           p_fp, p_fpc, p_now, p_now + idemq.ms((p_idem ->> 'ttl_ms')::bigint)
    WHERE p_idem IS NOT NULL
    ON CONFLICT (scope, key_hash) DO UPDATE
        SET key_preview = excluded.key_preview, job_id = excluded.job_id,
            fingerprint = excluded.fingerprint, fp = excluded.fp,
            created_at = excluded.created_at, expires_at = excluded.expires_at;
END
$$;

CREATE FUNCTION idemq.binding_live(p_window timestamp with time zone, p_job_state text, p_now timestamp with time zone) RETURNS boolean
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT CASE WHEN p_window IS NULL THEN coalesce(p_job_state IN ('waiting', 'active'), false)
                ELSE p_now < p_window AND p_job_state IS DISTINCT FROM 'cancelled' END
$$;

CREATE FUNCTION idemq.binding_release(p_scope text, p_hash bytea) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    b     record;
BEGIN
    DELETE FROM idemq.idempotency i
    WHERE i.scope = p_scope AND i.key_hash = p_hash AND i.expires_at > v_now
    RETURNING i.job_id, i.key_preview INTO b;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF EXISTS (SELECT 1 FROM idemq.jobs WHERE id = b.job_id) THEN
        PERFORM idemq.event(b.job_id, 'binding_released', v_now, jsonb_build_object(
            'scope', p_scope, 'key_preview', b.key_preview,
            'key_digest', left(encode(p_hash, 'hex'), 16)));
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION idemq.binding_sweep(p_limit integer) RETURNS bigint
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_now   timestamptz := idemq.now();
    v_ctids tid[];
    n       bigint := 0;
BEGIN
    -- Each batch is locked, then deleted by its ctids (still theirs while
    -- locked). enable_seqscan is off: for a range of expiries the planner
    -- would read the table from its start, past every live binding.
    v_ctids := ARRAY(SELECT ctid FROM idemq.idempotency WHERE expires_at <= v_now
                     LIMIT p_limit FOR UPDATE SKIP LOCKED);
    DELETE FROM idemq.idempotency WHERE ctid = ANY (v_ctids);
    n := n + cardinality(v_ctids);
    v_ctids := ARRAY(SELECT ctid FROM idemq.dedupe WHERE window_until <= v_now
                     LIMIT greatest(p_limit - n, 0) FOR UPDATE SKIP LOCKED);
    DELETE FROM idemq.dedupe WHERE ctid = ANY (v_ctids);
    n := n + cardinality(v_ctids);
    v_ctids := ARRAY(SELECT d.ctid FROM idemq.dedupe d
                     LEFT JOIN idemq.jobs j ON j.id = d.job_id
                     WHERE d.window_until IS NULL AND j.state IS DISTINCT FROM 'waiting'
                       AND j.state IS DISTINCT FROM 'active'
                     LIMIT greatest(p_limit - n, 0) FOR UPDATE OF d SKIP LOCKED);
    DELETE FROM idemq.dedupe WHERE ctid = ANY (v_ctids);
    n := n + cardinality(v_ctids);
    v_ctids := ARRAY(SELECT d.ctid FROM idemq.dedupe d
                     JOIN idemq.jobs j ON j.id = d.job_id
                     WHERE d.window_until > v_now AND j.state = 'cancelled'
                     LIMIT greatest(p_limit - n, 0) FOR UPDATE OF d SKIP LOCKED);
    DELETE FROM idemq.dedupe WHERE ctid = ANY (v_ctids);
    RETURN n + cardinality(v_ctids);
END
$$;

CREATE FUNCTION idemq.cancel(p_id text) RETURNS TABLE(o_found boolean, o_cancelled boolean, o_state text)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    j     idemq.jobs%ROWTYPE;
BEGIN
    SELECT * INTO j FROM idemq.jobs WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT false, false, NULL::text;
        RETURN;
    END IF;
    IF j.state IN ('waiting', 'active') THEN
        PERFORM idemq.cancel_locked(p_id, v_now);
        RETURN QUERY SELECT true, true,
            CASE WHEN j.state = 'waiting' THEN 'cancelled' ELSE 'active' END;
    ELSE
        RETURN QUERY SELECT true, false, j.state::text;
    END IF;
END
$$;

CREATE FUNCTION idemq.cancel_by_key(p_type text, p_key text) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    v_id  text;
    n     integer := 0;
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended('idemq.dedupe:' || p_type || ':' || p_key, 0));
    FOR v_id IN SELECT id FROM idemq.jobs
                WHERE type = p_type AND dedupe_key = p_key AND state IN ('waiting', 'active')
                ORDER BY seq FOR UPDATE
    LOOP
        PERFORM idemq.cancel_locked(v_id, v_now);
        n := n + 1;
    END LOOP;
    IF n > 0 THEN
        DELETE FROM idemq.dedupe x WHERE x.type = p_type AND x.key = p_key;
    END IF;
    RETURN n > 0;
END
$$;

CREATE FUNCTION idemq.cancel_locked(p_id text, p_now timestamp with time zone) RETURNS void
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    j idemq.jobs%ROWTYPE;
BEGIN
    SELECT * INTO j FROM idemq.jobs WHERE id = p_id;
    IF j.state = 'waiting' THEN
        UPDATE idemq.jobs SET state = 'cancelled', finished_at = p_now,
            purge_after = idemq.keep_until(j.keep_ms, 'cancelled', p_now), updated_at = p_now
        WHERE id = p_id;
        DELETE FROM idemq.dedupe x WHERE x.job_id = p_id;
        PERFORM idemq.event(p_id, 'cancelled', p_now);
    ELSIF j.state = 'active' AND NOT j.cancel_requested THEN
        UPDATE idemq.jobs SET cancel_requested = true, updated_at = p_now WHERE id = p_id;
        PERFORM idemq.event(p_id, 'cancel_requested', p_now);
    END IF;
END
$$;

CREATE FUNCTION idemq.check_clock(it jsonb, p_run_at timestamp with time zone, p_now timestamp with time zone) RETURNS jsonb
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE
        WHEN NOT it ? 'deadline' THEN NULL
        WHEN idemq.us((it ->> 'deadline')::bigint) <= p_now THEN
            jsonb_build_object('kind', 'validation', 'field', 'deadline',
                               'reason', 'must be in the future')
        WHEN p_run_at >= idemq.us((it ->> 'deadline')::bigint) THEN
            jsonb_build_object('kind', 'validation',
                               'field', CASE WHEN it ? 'delay_ms' THEN 'delay_ms' ELSE 'run_at' END,
                               'reason', 'must be before the deadline')
        END
$$;

CREATE FUNCTION idemq.checkpoint_put(p_id text, p_token text, p_name text, p_value jsonb) RETURNS TABLE(ok boolean, stored boolean)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    j     idemq.jobs%ROWTYPE;
BEGIN
    j := idemq.lease_job(p_id, p_token);
    IF j.id IS NULL THEN
        RETURN QUERY SELECT false, false;
        RETURN;
    END IF;
    INSERT INTO idemq.checkpoints (job_id, name, value, created_at)
    VALUES (p_id, p_name, p_value, v_now) ON CONFLICT DO NOTHING;
    IF FOUND THEN
        PERFORM idemq.event(p_id, 'checkpointed', v_now, jsonb_build_object('name', p_name));
        RETURN QUERY SELECT true, true;
    ELSE
        RETURN QUERY SELECT true, false;
    END IF;
END
$$;

CREATE FUNCTION idemq.claim(p_queues text[], p_types text[], p_worker text, p_limit integer, p_lease_ms bigint) RETURNS TABLE(id text, type text, queue text, payload jsonb, attempt integer, max_attempts integer, lease_token text, lease_expires_at timestamp with time zone, timeout_ms bigint, deadline timestamp with time zone, tags text[], r_expired integer, r_retries integer, r_dead integer)
    LANGUAGE plpgsql
    SET enable_sort TO 'off'
    SET jit TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_now   timestamptz := idemq.now();
    v_paused text[] := ARRAY(SELECT q.name FROM idemq.queues q WHERE q.paused);
    v_ids   text[] := '{}';
    v_keys  text[] := '{}';
    c       record;
    v_round integer := 0;
    v_found boolean;
    v_slow  boolean;
    v_ended text;
    v_reap  record;
    v_died  integer := 0;
BEGIN
    SELECT * INTO v_reap FROM idemq.reap(1000, v_now);
    -- The claim writes the job rows only: the attempt's run and its
    -- `claimed` event are derived from them until the attempt ends other
    -- than completed (end_attempt).
    -- The common case in one statement: the first p_limit due jobs in claim
    -- order, locked. When none of them has a concurrency key or a passed
    -- deadline, they are the claim; otherwise the loop below decides, row by
    -- row, and sees the rows locked here as its own.
    SELECT coalesce(array_agg(f.id), '{}'),
           coalesce(bool_or(f.concurrency_key IS NOT NULL OR f.deadline <= v_now), false)
    INTO v_ids, v_slow
    FROM (SELECT j.id, j.concurrency_key, j.deadline FROM idemq.jobs j
          WHERE j.state = 'waiting' AND j.run_at <= v_now
            AND (p_queues IS NULL OR j.queue = ANY (p_queues))
            AND (p_types IS NULL OR j.type = ANY (p_types))
            AND NOT (j.queue = ANY (v_paused))
          ORDER BY j.priority DESC, j.run_at, j.seq
          LIMIT p_limit
          FOR UPDATE OF j SKIP LOCKED) f;
    IF v_slow THEN
        v_ids := '{}';
    END IF;
    LOOP
        EXIT WHEN NOT v_slow;
        v_found := false;
        FOR c IN
            SELECT j.id, j.queue, j.concurrency_key, j.deadline FROM idemq.jobs j
            WHERE j.state = 'waiting' AND j.run_at <= v_now
              AND (p_queues IS NULL OR j.queue = ANY (p_queues))
              AND (p_types IS NULL OR j.type = ANY (p_types))
              AND NOT (j.queue = ANY (v_paused))
              AND (j.concurrency_key IS NULL OR NOT EXISTS (
                    SELECT 1 FROM idemq.jobs a
                    WHERE a.state = 'active' AND a.concurrency_key = j.concurrency_key))
              AND NOT (j.id = ANY (v_ids))
            ORDER BY j.priority DESC, j.run_at, j.seq
            LIMIT 256
            FOR UPDATE OF j SKIP LOCKED
        LOOP
            v_found := true;
            EXIT WHEN cardinality(v_ids) >= p_limit;
            IF c.deadline IS NOT NULL AND c.deadline <= v_now THEN
                -- Past its deadline: never started.
                UPDATE idemq.jobs j SET state = 'dead', finished_at = v_now,
                    purge_after = idemq.keep_until(j.keep_ms, 'dead', v_now),
                    last_error = 'deadline', updated_at = v_now
                WHERE j.id = c.id;
                PERFORM idemq.event(c.id, 'dead', v_now, jsonb_build_object('reason', 'deadline'));
                v_ended := c.queue;
                v_died := v_died + 1;
                CONTINUE;
            END IF;
            IF c.concurrency_key IS NOT NULL THEN
                CONTINUE WHEN c.concurrency_key = ANY (v_keys);
                -- Another claimer taking this key right now: skip it.
                CONTINUE WHEN NOT pg_try_advisory_xact_lock(
                    hashtextextended('idemq.ck:' || c.concurrency_key, 0));
                -- Re-check with a fresh snapshot: a claimer may have committed meanwhile.
                CONTINUE WHEN EXISTS (SELECT 1 FROM idemq.jobs a WHERE a.state = 'active'
                                      AND a.concurrency_key = c.concurrency_key);
                v_keys := v_keys || c.concurrency_key;
            END IF;
            v_ids := v_ids || c.id;
        END LOOP;
        v_round := v_round + 1;
        EXIT WHEN NOT v_found OR cardinality(v_ids) >= p_limit OR v_round >= 8;
    END LOOP;
    -- Stopped at its bound with slots left, having ended jobs past their
    -- deadline: due jobs may wait behind the ones left, so the workers are
    -- woken to claim again at once rather than at their next poll. (Each
    -- such claim ends jobs, so the wake-ups stop.)
    IF v_slow AND v_found AND v_round >= 8 AND cardinality(v_ids) < p_limit
       AND v_ended IS NOT NULL THEN
        PERFORM idemq.wake(v_ended);
    END IF;

    RETURN QUERY
    WITH claimed AS (
        UPDATE idemq.jobs j SET state = 'active', attempt = j.attempt + 1,
            lease_token = replace(gen_random_uuid()::text, '-', ''),
            lease_expires_at = v_now + idemq.ms(p_lease_ms), lease_ms = p_lease_ms,
            worker = p_worker, started_at = v_now, updated_at = v_now,
            claim_seq = nextval('idemq.history')
        WHERE j.id = ANY (v_ids)
        RETURNING j.id, j.type, j.queue, j.payload, j.attempt, j.max_attempts, j.lease_token,
                  j.lease_expires_at, j.timeout_ms, j.deadline, j.tags, j.priority, j.run_at,
                  j.seq
    )
    SELECT c4.id, c4.type, c4.queue, c4.payload, c4.attempt, c4.max_attempts, c4.lease_token,
           c4.lease_expires_at, c4.timeout_ms, c4.deadline, c4.tags, NULL::integer,
           NULL::integer, NULL::integer
    FROM claimed c4
    ORDER BY c4.priority DESC, c4.run_at, c4.seq;
    IF v_reap.expired > 0 OR v_died > 0 THEN
        RETURN QUERY SELECT NULL::text, NULL::text, NULL::text, NULL::jsonb, NULL::integer,
            NULL::integer, NULL::text, NULL::timestamptz, NULL::bigint, NULL::timestamptz,
            NULL::text[], v_reap.expired, v_reap.retries, v_reap.dead + v_died;
    END IF;
END
$$;

CREATE FUNCTION idemq.complete_and_claim(p_ids text[], p_tokens text[], p_results jsonb[], p_queues text[], p_types text[], p_worker text, p_limit integer, p_lease_ms bigint) RETURNS TABLE(idx integer, ok boolean, id text, type text, queue text, payload jsonb, attempt integer, max_attempts integer, lease_token text, lease_expires_at timestamp with time zone, timeout_ms bigint, deadline timestamp with time zone, tags text[], r_expired integer, r_retries integer, r_dead integer)
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF cardinality(p_ids) > 0 THEN
        RETURN QUERY SELECT c.idx, c.ok, NULL::text, NULL::text, NULL::text, NULL::jsonb,
                            NULL::integer, NULL::integer, NULL::text, NULL::timestamptz,
                            NULL::bigint, NULL::timestamptz, NULL::text[], NULL::integer,
                            NULL::integer, NULL::integer
                     FROM idemq.complete_many(p_ids, p_tokens, p_results) c;
    END IF;
    IF p_limit > 0 THEN
        RETURN QUERY SELECT NULL::integer, NULL::boolean, c.*
                     FROM idemq.claim(p_queues, p_types, p_worker, p_limit, p_lease_ms) c;
    END IF;
END
$$;

CREATE FUNCTION idemq.complete_many(p_ids text[], p_tokens text[], p_results jsonb[]) RETURNS TABLE(idx integer, ok boolean)
    LANGUAGE plpgsql
    AS $$
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
            lease_ms = NULL, done_seq = nextval('idemq.history'), updated_at = v_now
        FROM firsts f
        WHERE j.id = f.id AND j.state = 'active' AND j.lease_token = f.token
        RETURNING f.i
    )
    SELECT n.i, d.i IS NOT NULL FROM input n LEFT JOIN done d ON d.i = n.i ORDER BY n.i;
END
$$;

CREATE FUNCTION idemq.debounce_window(p_ttl_ms bigint, p_max_wait_ms bigint, p_accepted timestamp with time zone, p_now timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE WHEN p_max_wait_ms IS NULL THEN p_now + idemq.ms(p_ttl_ms)
                ELSE least(p_now + idemq.ms(p_ttl_ms), p_accepted + idemq.ms(p_max_wait_ms)) END
$$;

CREATE FUNCTION idemq.default_retry() RETURNS jsonb
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT '{"kind": "exponential", "initial_ms": 1000, "factor": 2.0, "max_ms": 3600000,
             "jitter": true}'::jsonb
$$;

CREATE FUNCTION idemq.delete_job(p_id text) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    DELETE FROM idemq.events WHERE job_id = p_id;
    DELETE FROM idemq.runs WHERE job_id = p_id;
    DELETE FROM idemq.checkpoints WHERE job_id = p_id;
    DELETE FROM idemq.dedupe WHERE job_id = p_id;
    DELETE FROM idemq.jobs WHERE id = p_id;
END
$$;

CREATE FUNCTION idemq.end_attempt(p_id text, p_kind text, p_error text, p_retryable boolean, p_retry_after_ms bigint, p_snooze_ms bigint, p_result jsonb, p_now timestamp with time zone) RETURNS TABLE(state text, next_run_at timestamp with time zone)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    j         idemq.jobs%ROWTYPE;
    v_used    integer;
    v_outcome text;
    v_error   text;
    v_next    text;
    v_at      timestamptz;
    v_dead    text;
    v_delay   bigint;
    v_base    double precision;
    v_retry   jsonb;
BEGIN
    SELECT * INTO j FROM idemq.jobs WHERE id = p_id;
    v_retry := coalesce(j.retry, idemq.default_retry());
    v_used := j.attempts_used + CASE WHEN p_kind IN ('released', 'snoozed') THEN 0 ELSE 1 END;
    v_outcome := CASE p_kind WHEN 'timed_out' THEN 'failed' WHEN 'deadline' THEN 'failed'
                             ELSE p_kind END;
    v_error := CASE p_kind
        WHEN 'failed' THEN left(p_error, 8192)
        WHEN 'lease_expired' THEN 'lease expired'
        WHEN 'timed_out' THEN format('timed out after %s ms', j.timeout_ms)
        WHEN 'deadline' THEN 'deadline passed'
        END;
    -- left() counts characters; keep at most 8 KiB of bytes.
    WHILE v_error IS NOT NULL AND octet_length(v_error) > 8192 LOOP
        v_error := left(v_error, length(v_error) - 1);
    END LOOP;
    IF j.cancel_requested AND p_kind <> 'completed' THEN
        v_outcome := 'cancelled';
    END IF;
    -- A completed attempt stays derived from the job row (job_runs,
    -- job_events); an attempt that ends otherwise is written out now, its
    -- `claimed` event under the sequence number the claim drew.
    IF p_kind <> 'completed' THEN
        INSERT INTO idemq.runs AS r (job_id, attempt, worker, started_at, finished_at, outcome,
                                     error)
        VALUES (p_id, j.attempt, j.worker, j.started_at, p_now, v_outcome, v_error)
        ON CONFLICT (job_id, attempt) DO UPDATE SET worker = excluded.worker,
            started_at = excluded.started_at, finished_at = excluded.finished_at,
            outcome = excluded.outcome, error = excluded.error;
        INSERT INTO idemq.events (seq, job_id, kind, at, data)
        VALUES (j.claim_seq, p_id, 'claimed', j.started_at,
                jsonb_build_object('attempt', j.attempt, 'worker', j.worker));
    END IF;
    IF p_kind = 'lease_expired' THEN
        PERFORM idemq.event(p_id, 'lease_expired', p_now, jsonb_build_object('attempt', j.attempt));
    END IF;

    IF p_kind = 'completed' THEN
        v_next := 'completed';
    ELSIF j.cancel_requested THEN
        v_next := 'cancelled';
    ELSIF p_kind = 'released' THEN
        v_next := 'waiting'; v_at := p_now;
    ELSIF p_kind = 'snoozed' THEN
        v_next := 'waiting'; v_at := p_now + idemq.ms(p_snooze_ms);
    ELSIF p_kind = 'deadline' THEN
        v_next := 'dead'; v_dead := 'deadline';
    ELSIF p_kind = 'failed' AND NOT p_retryable THEN
        v_next := 'dead'; v_dead := 'permanent';
    ELSIF v_used >= j.max_attempts THEN
        v_next := 'dead'; v_dead := 'attempts_exhausted';
    ELSIF p_kind = 'lease_expired' THEN
        -- Claimable again at once; the attempt is consumed.
        v_next := 'waiting'; v_at := p_now;
        IF j.deadline IS NOT NULL AND p_now >= j.deadline THEN
            v_next := 'dead'; v_dead := 'deadline';
        END IF;
    ELSIF v_retry ->> 'kind' = 'none' THEN
        v_next := 'dead'; v_dead := 'no_retry';
    ELSE
        IF v_retry ->> 'kind' = 'fixed' THEN
            v_delay := (v_retry ->> 'delay_ms')::bigint;
        ELSE
            v_base := least((v_retry ->> 'initial_ms')::double precision
                            * power((v_retry ->> 'factor')::double precision,
                                    least(greatest(v_used, 1) - 1, 1024)),
                            (v_retry ->> 'max_ms')::double precision);
            IF (v_retry ->> 'jitter')::boolean THEN
                v_base := v_base * random();
            END IF;
            v_delay := round(v_base)::bigint;
        END IF;
        IF p_kind = 'failed' AND p_retry_after_ms IS NOT NULL THEN
            v_delay := greatest(p_retry_after_ms, 0);
        END IF;
        v_next := 'waiting'; v_at := p_now + idemq.ms(v_delay);
    END IF;
    IF v_next = 'waiting' AND p_kind <> 'lease_expired' AND p_kind <> 'released'
       AND j.deadline IS NOT NULL AND v_at >= j.deadline THEN
        v_next := 'dead'; v_dead := 'deadline';
    END IF;

    IF v_next = 'completed' THEN
        -- worker and started_at stay: they are the derived run.
        UPDATE idemq.jobs SET state = 'completed', result = p_result, finished_at = p_now,
            purge_after = idemq.keep_until(j.keep_ms, 'completed', p_now), attempts_used = v_used,
            lease_token = NULL, lease_expires_at = NULL, lease_ms = NULL,
            done_seq = nextval('idemq.history'), updated_at = p_now
        WHERE id = p_id;
        RETURN QUERY SELECT 'completed'::text, NULL::timestamptz;
    ELSIF v_next = 'waiting' THEN
        UPDATE idemq.jobs SET state = 'waiting', run_at = v_at, attempts_used = v_used,
            last_error = coalesce(v_error, last_error), lease_token = NULL,
            lease_expires_at = NULL, lease_ms = NULL, worker = NULL, started_at = NULL,
            claim_seq = NULL, updated_at = p_now
        WHERE id = p_id;
        IF p_kind = 'released' THEN
            PERFORM idemq.event(p_id, 'released', p_now,
                jsonb_build_object('run_at', v_at, 'snoozed', false));
        ELSIF p_kind <> 'lease_expired' THEN
            PERFORM idemq.event(p_id, 'retry_scheduled', p_now,
                jsonb_build_object('run_at', v_at, 'snoozed', p_kind = 'snoozed'));
        END IF;
        PERFORM idemq.wake(j.queue);
        -- The derived state, like every read: a zero delay is ready.
        RETURN QUERY SELECT CASE WHEN v_at <= p_now THEN 'ready' ELSE 'scheduled' END, v_at;
    ELSE
        UPDATE idemq.jobs SET state = v_next, finished_at = p_now,
            purge_after = idemq.keep_until(j.keep_ms, v_next, p_now), attempts_used = v_used,
            last_error = coalesce(v_error, CASE WHEN v_next = 'dead' THEN v_dead END, last_error),
            lease_token = NULL, lease_expires_at = NULL, lease_ms = NULL, worker = NULL,
            started_at = NULL, claim_seq = NULL, updated_at = p_now
        WHERE id = p_id;
        IF v_next = 'dead' THEN
            PERFORM idemq.event(p_id, 'dead', p_now,
                jsonb_build_object('reason', v_dead, 'attempt', j.attempt));
        ELSE
            DELETE FROM idemq.dedupe x WHERE x.job_id = p_id;
            PERFORM idemq.event(p_id, 'cancelled', p_now, jsonb_build_object('attempt', j.attempt));
        END IF;
        RETURN QUERY SELECT v_next, NULL::timestamptz;
    END IF;
END
$$;

CREATE FUNCTION idemq.enqueue(p_items jsonb) RETURNS TABLE(idx integer, job_id text, outcome text, reason text, error jsonb)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now  timestamptz := idemq.now();
    v_item jsonb;
    v_idx  bigint;
BEGIN
    -- The common keyed call, the repeat of one request: a live
    -- binding decides it (replay or conflict) whatever else the item says,
    -- and a committed binding is read without taking the key's lock, so a
    -- replay reads one row and writes nothing. A key not bound (or bound by
    -- a transaction still running) takes the locked path below.
    IF jsonb_array_length(p_items) = 1 AND (p_items -> 0) ? 'idem' THEN
        RETURN QUERY SELECT 0, CASE WHEN k.conflict IS NULL THEN k.job_id END,
                            CASE WHEN k.conflict IS NULL THEN 'replayed' END, NULL::text,
                            k.conflict
                     FROM idemq.key_decision(p_items -> 0 -> 'idem', p_items -> 0 -> 'fingerprint',
                                             v_now) k;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    -- Every key of the call is locked first, in a canonical order, so two
    -- calls cannot deadlock; items are then decided in request order, each
    -- seeing the effects of the earlier ones.
    PERFORM pg_advisory_xact_lock(k.l) FROM (
        SELECT DISTINCT v.l FROM jsonb_array_elements(p_items) it
        CROSS JOIN LATERAL (VALUES
            (CASE WHEN it ? 'idem' THEN hashtextextended('idemq.key:'
                || (it -> 'idem' ->> 'scope') || ':' || (it -> 'idem' ->> 'hash'), 0) END),
            (CASE WHEN it ? 'job_id' THEN
                hashtextextended('idemq.job:' || (it ->> 'job_id'), 0) END),
            (CASE WHEN it ? 'dedupe' THEN hashtextextended('idemq.dedupe:'
                || (it ->> 'type') || ':' || (it -> 'dedupe' ->> 'key'), 0) END)) v(l)
        WHERE v.l IS NOT NULL ORDER BY v.l) k;
    FOR v_item, v_idx IN SELECT e.value, e.ordinality FROM jsonb_array_elements(p_items)
                         WITH ORDINALITY AS e
    LOOP
        RETURN QUERY SELECT (v_idx - 1)::integer, r.job_id, r.outcome, r.reason, r.error
                     FROM idemq.enqueue_one(v_item, v_now) r;
    END LOOP;
END
$$;

CREATE FUNCTION idemq.enqueue_one(it jsonb, v_now timestamp with time zone) RETURNS TABLE(job_id text, outcome text, reason text, error jsonb)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_type   text  := it ->> 'type';
    v_idem   jsonb := it -> 'idem';
    v_dd     jsonb := it -> 'dedupe';
    v_fp     jsonb := it -> 'fingerprint';
    -- The compact form the library sends (`fp`), or made from the JSON.
    v_fpc    bytea := coalesce(decode(it ->> 'fp', 'hex'), idemq.fp_pack(v_fp));
    v_fields text[];
    b        record;
    d        record;
    v_state  text;
    v_started boolean;
    v_due    boolean;
    v_run_at timestamptz;
    v_err    jsonb;
    v_id     text;
    v_outcome text;
    v_reason text;
    v_stored jsonb;
    v_queue  text;
BEGIN
    -- 1. A live idempotency binding decides: replay or conflict.
    IF v_idem IS NOT NULL THEN
        SELECT k.job_id, k.conflict INTO b FROM idemq.key_decision(v_idem, v_fp, v_now) k;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN b.conflict IS NULL THEN b.job_id END,
                                CASE WHEN b.conflict IS NULL THEN 'replayed' END,
                                NULL::text, b.conflict;
            RETURN;
        END IF;
    END IF;

    -- 2. An existing record with the explicit id: replay or conflict.
    IF it ? 'job_id' THEN
        SELECT idemq.fp_unpack(j.fingerprint) INTO v_stored
        FROM idemq.jobs j WHERE j.id = it ->> 'job_id';
        IF FOUND THEN
            v_fields := idemq.fp_diff(v_fp, v_stored, true);
            IF cardinality(v_fields) > 0 THEN
                RETURN QUERY SELECT NULL::text, NULL::text, NULL::text,
                    jsonb_build_object('kind', 'conflict', 'job_id', it ->> 'job_id',
                                       'source', 'job_id', 'fields', to_jsonb(v_fields));
                RETURN;
            END IF;
            PERFORM idemq.bind_key(v_idem, it ->> 'job_id', v_fp, v_fpc, v_now);
            RETURN QUERY SELECT it ->> 'job_id', 'replayed'::text, NULL::text, NULL::jsonb;
            RETURN;
        END IF;
    END IF;

    -- 3. A live dedupe binding: coalesce, replace or refuse to replace.
    IF v_dd IS NOT NULL THEN
        SELECT x.job_id, x.mode, x.ttl_ms, x.max_wait_ms, x.accepted_at, x.window_until INTO d
        FROM idemq.dedupe x WHERE x.type = v_type AND x.key = v_dd ->> 'key';
        IF FOUND THEN
            SELECT j.state, j.attempt > 0, j.run_at <= v_now INTO v_state, v_started, v_due
            FROM idemq.jobs j WHERE j.id = d.job_id;
            IF idemq.binding_live(d.window_until, v_state, v_now) THEN
                v_reason := NULL;
                IF d.mode = 'replace' AND v_dd ->> 'mode' = 'replace' THEN
                    IF v_state = 'waiting' AND NOT v_started AND NOT v_due THEN
                        v_run_at := idemq.resolve_run_at(it, v_now, d.accepted_at, d.max_wait_ms);
                        v_err := idemq.check_clock(it, v_run_at, v_now);
                        IF v_err IS NOT NULL THEN
                            RETURN QUERY SELECT NULL::text, NULL::text, NULL::text, v_err;
                            RETURN;
                        END IF;
                        -- Conditional: a claim that got there first wins.
                        UPDATE idemq.jobs j SET
                            payload = it -> 'payload', priority = (it ->> 'priority')::smallint,
                            run_at = v_run_at, max_attempts = (it ->> 'max_attempts')::int,
                            retry = nullif(it -> 'retry', idemq.default_retry()),
                            timeout_ms = (it ->> 'timeout_ms')::bigint,
                            deadline = idemq.us((it ->> 'deadline')::bigint),
                            concurrency_key = it ->> 'concurrency_key',
                            tags = ARRAY(SELECT jsonb_array_elements_text(it -> 'tags')),
                            keep_ms = (it ->> 'keep_ms')::bigint,
                            fingerprint = v_fpc,
                            updated_at = v_now
                        WHERE j.id = d.job_id AND j.state = 'waiting' AND j.attempt = 0
                          AND j.run_at > v_now
                        RETURNING j.queue INTO v_queue;
                        IF FOUND THEN
                            PERFORM idemq.event(d.job_id, 'replaced', v_now,
                                jsonb_build_object('run_at', v_run_at));
                            IF d.ttl_ms IS NOT NULL THEN
                                UPDATE idemq.dedupe x
                                SET window_until = greatest(v_now + idemq.ms(d.ttl_ms), v_run_at)
                                WHERE x.type = v_type AND x.key = v_dd ->> 'key';
                            END IF;
                            -- The job keeps its queue (SPEC 5): wake that one.
                            PERFORM idemq.wake(v_queue);
                            v_outcome := 'replaced';
                        ELSE
                            -- Changed since it was read: say how, from a fresh
                            -- read (a promote made it due; a claim started it).
                            v_outcome := 'non_replaceable';
                            v_reason := coalesce((
                                SELECT CASE WHEN j.state = 'waiting' AND j.attempt = 0
                                            THEN 'window_elapsed' ELSE 'not_pending' END
                                FROM idemq.jobs j WHERE j.id = d.job_id), 'not_pending');
                        END IF;
                    ELSIF v_state = 'waiting' AND NOT v_started THEN
                        v_outcome := 'non_replaceable';
                        v_reason := 'window_elapsed';
                    ELSE
                        v_outcome := 'non_replaceable';
                        v_reason := 'not_pending';
                    END IF;
                ELSIF d.mode = 'replace' THEN
                    v_outcome := 'coalesced';
                ELSIF v_dd ->> 'mode' = 'replace' THEN
                    v_outcome := 'non_replaceable';
                    v_reason := 'incompatible_mode';
                ELSE
                    v_outcome := 'coalesced';
                    IF d.mode = 'debounce' AND d.ttl_ms IS NOT NULL THEN
                        UPDATE idemq.dedupe x
                        SET window_until = idemq.debounce_window(d.ttl_ms, d.max_wait_ms,
                                                                  d.accepted_at, v_now)
                        WHERE x.type = v_type AND x.key = v_dd ->> 'key';
                    END IF;
                END IF;
                PERFORM idemq.bind_key(v_idem, d.job_id, v_fp, v_fpc, v_now);
                RETURN QUERY SELECT d.job_id, v_outcome, v_reason, NULL::jsonb;
                RETURN;
            END IF;
        END IF;
    END IF;

    -- 4. A new job.
    v_run_at := idemq.resolve_run_at(it, v_now, v_now, (v_dd ->> 'max_wait_ms')::bigint);
    v_err := idemq.check_clock(it, v_run_at, v_now);
    IF v_err IS NOT NULL THEN
        RETURN QUERY SELECT NULL::text, NULL::text, NULL::text, v_err;
        RETURN;
    END IF;
    v_id := coalesce(it ->> 'job_id', it ->> 'new_id');
    INSERT INTO idemq.jobs (id, type, queue, state, payload, priority, run_at, max_attempts, retry,
        timeout_ms, deadline, concurrency_key, tags, keep_ms, fingerprint, idem_scope,
        idem_key_hash, idem_key_preview, dedupe_key, dedupe_mode, created_at, updated_at,
        first_run_at)
    VALUES (v_id, v_type, it ->> 'queue', 'waiting', it -> 'payload',
        (it ->> 'priority')::smallint, v_run_at, (it ->> 'max_attempts')::int,
        nullif(it -> 'retry', idemq.default_retry()),
        (it ->> 'timeout_ms')::bigint, idemq.us((it ->> 'deadline')::bigint),
        it ->> 'concurrency_key',
        CASE WHEN jsonb_array_length(it -> 'tags') = 0 THEN '{}'::text[]
             ELSE ARRAY(SELECT jsonb_array_elements_text(it -> 'tags')) END,
        (it ->> 'keep_ms')::bigint, v_fpc,
        v_idem ->> 'scope',
        decode(v_idem ->> 'hash', 'hex'),
        v_idem ->> 'preview', v_dd ->> 'key', v_dd ->> 'mode', v_now, v_now,
        nullif(v_run_at, v_now));
    IF v_idem IS NOT NULL THEN
        PERFORM idemq.bind_key(v_idem, v_id, v_fp, v_fpc, v_now);
    END IF;
    IF v_dd IS NOT NULL THEN
        INSERT INTO idemq.dedupe AS x (type, key, job_id, mode, ttl_ms, max_wait_ms, accepted_at,
                                       window_until)
        VALUES (v_type, v_dd ->> 'key', v_id, v_dd ->> 'mode', (v_dd ->> 'ttl_ms')::bigint,
            (v_dd ->> 'max_wait_ms')::bigint, v_now,
            CASE WHEN v_dd ->> 'ttl_ms' IS NULL THEN NULL
                 WHEN v_dd ->> 'mode' = 'debounce' THEN idemq.debounce_window(
                     (v_dd ->> 'ttl_ms')::bigint, (v_dd ->> 'max_wait_ms')::bigint, v_now, v_now)
                 WHEN v_dd ->> 'mode' = 'replace' THEN
                     greatest(v_now + idemq.ms((v_dd ->> 'ttl_ms')::bigint), v_run_at)
                 ELSE v_now + idemq.ms((v_dd ->> 'ttl_ms')::bigint) END)
        ON CONFLICT (type, key) DO UPDATE SET job_id = excluded.job_id, mode = excluded.mode,
            ttl_ms = excluded.ttl_ms, max_wait_ms = excluded.max_wait_ms,
            accepted_at = excluded.accepted_at, window_until = excluded.window_until;
    END IF;
    PERFORM idemq.wake(it ->> 'queue');
    RETURN QUERY SELECT v_id, 'accepted'::text, NULL::text, NULL::jsonb;
END
$$;

CREATE FUNCTION idemq.event(p_job text, p_kind text, p_at timestamp with time zone, p_data jsonb DEFAULT '{}'::jsonb) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    INSERT INTO idemq.events (job_id, kind, at, data) VALUES (p_job, p_kind, p_at, p_data);
END
$$;

CREATE FUNCTION idemq.finish_attempt(p_id text, p_token text, p_kind text, p_error text, p_retryable boolean, p_retry_after_ms bigint, p_snooze_ms bigint, p_result jsonb) RETURNS TABLE(ok boolean, state text, next_run_at timestamp with time zone)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    j     idemq.jobs%ROWTYPE;
BEGIN
    j := idemq.lease_job(p_id, p_token);
    IF j.id IS NULL THEN
        RETURN QUERY SELECT false, NULL::text, NULL::timestamptz;
        RETURN;
    END IF;
    RETURN QUERY SELECT true, e.state, e.next_run_at
    FROM idemq.end_attempt(p_id, p_kind, p_error, p_retryable, p_retry_after_ms, p_snooze_ms,
                           p_result, v_now) e;
END
$$;

CREATE FUNCTION idemq.fp_common() RETURNS TABLE(at integer, name text, null_digest text, usual text)
    LANGUAGE sql IMMUTABLE
    AS $$
    VALUES (0, 'concurrency_key', '6ad993538865560589613cd63a6ea90f', NULL),
           (1, 'deadline', '5d557b1ca5415e649f0a129bf5230ce2', NULL),
           (2, 'delay_ms', 'bd27747bc9f8be4e92f1c3a594e4e633', NULL),
           (3, 'idempotency.ttl_ms', '7de27f1b7511a1287abf5b6fc927ed9d', NULL),
           (4, 'job_id', '07b82cd0889f4887df0eb046f91eaa8a', NULL),
           (5, 'max_attempts', '285a1f8171a1521087c00abaaa5d42d5',
               'c925066ab28cafb7f70c9ecba97db174'),
           (6, 'payload', 'ed136c365b3976f0f085827c9dca0e8f', NULL),
           (7, 'queue', 'b54cc77bd665e2d0b32046c81b31c4a2', 'f36faa32ba1a3039fd120cd16dc991e4'),
           (8, 'retry', '76e1e5a2c6af622684a9c910cd2456f9', '4d4220e2dc66a9341de032364db4fb04'),
           (9, 'run_at', '19b3a6c8b44d66c4eda01912f7c0e980', NULL),
           (10, 'tags', 'a7797e02e309a3fc1ab0ba8e0ecbccb2', '3ec74168856423b9e8a828cfc32f0105'),
           (11, 'timeout_ms', '060d9d6de7a58a84fa6798265582035c',
                '977a4f506b2f576d503668f0f1a81942'),
           (12, 'type', '830078c9fefbdf29924734a5a06b7e7a', NULL)
$$;

CREATE FUNCTION idemq.fp_diff(a jsonb, b jsonb, p_against_job boolean) RETURNS text[]
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT coalesce(array_agg(k ORDER BY k COLLATE "C"), '{}')
    FROM (SELECT k FROM jsonb_object_keys(a) AS t(k)
          UNION SELECT k FROM jsonb_object_keys(b) AS t(k)) ks
    WHERE (a ->> k) IS DISTINCT FROM (b ->> k)
      AND NOT (p_against_job AND k IN ('idempotency.ttl_ms', 'job_id'))
$$;

CREATE FUNCTION idemq.fp_pack(p_fp jsonb) RETURNS bytea
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT '\x01'::bytea || int4send(sum(f.code << (2 * f.at))::integer)
           || decode(coalesce(string_agg(f.digest, '' ORDER BY f.at) FILTER (WHERE f.code = 3),
                              ''), 'hex')
    FROM (SELECT c.at, p_fp ->> c.name AS digest,
                 CASE WHEN p_fp ->> c.name IS NULL THEN 0
                      WHEN p_fp ->> c.name = c.null_digest THEN 1
                      WHEN p_fp ->> c.name = c.usual THEN 2
                      ELSE 3 END AS code
          FROM idemq.fp_common() c) f
$$;

CREATE FUNCTION idemq.fp_unpack(p bytea) RETURNS jsonb
    LANGUAGE sql IMMUTABLE
    AS $$
    SELECT jsonb_object_agg(f.name, CASE
        WHEN NOT f.compact THEN encode(substring(p FROM 16 * f.at + 1 FOR 16), 'hex')
        WHEN f.code = 0 THEN '00000000000000000000000000000000'
        WHEN f.code = 1 THEN f.null_digest
        WHEN f.code = 2 THEN f.usual
        ELSE encode(substring(p FROM 6 + 16 * (f.following - 1) FOR 16), 'hex') END)
    FROM (SELECT c.*, w.compact, (w.bits >> (2 * c.at)) & 3 AS code,
                 count(*) FILTER (WHERE (w.bits >> (2 * c.at)) & 3 = 3)
                     OVER (ORDER BY c.at)::integer AS following
          FROM idemq.fp_common() c
          CROSS JOIN (SELECT length(p) % 16 = 5 AND get_byte(p, 0) = 1 AS compact,
                             CASE WHEN length(p) % 16 = 5
                                  THEN (get_byte(p, 1)::bigint << 24) | (get_byte(p, 2) << 16)
                                       | (get_byte(p, 3) << 8) | get_byte(p, 4)
                                  ELSE 0 END AS bits) w) f
$$;

CREATE FUNCTION idemq.heartbeat(p_id text, p_token text) RETURNS TABLE(ok boolean, lease_expires_at timestamp with time zone, cancel_requested boolean, ended text)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    j     idemq.jobs%ROWTYPE;
BEGIN
    j := idemq.lease_job(p_id, p_token);
    IF j.id IS NULL THEN
        RETURN QUERY SELECT false, NULL::timestamptz, false, NULL::text;
        RETURN;
    END IF;
    -- Workers the server cannot interrupt: a heartbeat past the timeout or
    -- the deadline records the attempt so.
    IF v_now >= j.started_at + idemq.ms(j.timeout_ms) THEN
        RETURN QUERY SELECT false, NULL::timestamptz, false, e.state
        FROM idemq.end_attempt(p_id, 'timed_out', NULL, true, NULL, NULL, NULL, v_now) e;
        RETURN;
    END IF;
    IF j.deadline IS NOT NULL AND v_now >= j.deadline THEN
        RETURN QUERY SELECT false, NULL::timestamptz, false, e.state
        FROM idemq.end_attempt(p_id, 'deadline', NULL, true, NULL, NULL, NULL, v_now) e;
        RETURN;
    END IF;
    UPDATE idemq.jobs SET lease_expires_at = v_now + idemq.ms(j.lease_ms) WHERE id = p_id;
    RETURN QUERY SELECT true, v_now + idemq.ms(j.lease_ms), j.cancel_requested, NULL::text;
END
$$;

CREATE FUNCTION idemq.heartbeat_many(p_ids text[], p_tokens text[]) RETURNS TABLE(idx integer, ok boolean, busy boolean, lease_expires_at timestamp with time zone, cancel_requested boolean, ended text)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    r record;
    h record;
BEGIN
    FOR r IN SELECT (t.i - 1)::integer AS i, t.id, t.token
             FROM unnest(p_ids, p_tokens) WITH ORDINALITY AS t(id, token, i)
             ORDER BY t.id, t.i
    LOOP
        PERFORM 1 FROM idemq.jobs j WHERE j.id = r.id FOR UPDATE SKIP LOCKED;
        IF NOT FOUND AND EXISTS (SELECT 1 FROM idemq.jobs j WHERE j.id = r.id) THEN
            RETURN QUERY SELECT r.i, false, true, NULL::timestamptz, false, NULL::text;
            CONTINUE;
        END IF;
        SELECT * INTO h FROM idemq.heartbeat(r.id, r.token);
        RETURN QUERY SELECT r.i, h.ok, false, h.lease_expires_at, h.cancel_requested, h.ended;
    END LOOP;
END
$$;

CREATE FUNCTION idemq.job_events(p_id text) RETURNS TABLE(seq bigint, kind text, at timestamp with time zone, data jsonb)
    LANGUAGE sql STABLE
    AS $$
    SELECT e.seq, e.kind, e.at, e.data FROM idemq.events e WHERE e.job_id = p_id
    UNION ALL
    SELECT v.seq, v.kind, v.at, v.data
    FROM idemq.jobs j
    CROSS JOIN LATERAL (VALUES
        (j.seq, 'accepted', j.created_at, jsonb_strip_nulls(jsonb_build_object(
            'queue', j.queue, 'run_at', coalesce(j.first_run_at, j.created_at),
            'idempotency', CASE WHEN j.idem_scope IS NOT NULL THEN jsonb_build_object(
                'scope', j.idem_scope, 'key_preview', j.idem_key_preview,
                'key_digest', left(encode(j.idem_key_hash, 'hex'), 16)) END,
            'dedupe', CASE WHEN j.dedupe_key IS NOT NULL THEN jsonb_build_object(
                'key', j.dedupe_key, 'mode', j.dedupe_mode) END))),
        (j.claim_seq, 'claimed', j.started_at,
            jsonb_build_object('attempt', j.attempt, 'worker', j.worker)),
        (j.done_seq, 'completed', j.finished_at, jsonb_build_object('attempt', j.attempt))
    ) AS v(seq, kind, at, data)
    WHERE j.id = p_id AND v.seq IS NOT NULL
    ORDER BY 1
$$;

CREATE FUNCTION idemq.job_runs(p_id text) RETURNS TABLE(attempt integer, worker text, started_at timestamp with time zone, finished_at timestamp with time zone, outcome text, error text)
    LANGUAGE sql STABLE
    AS $$
    SELECT r.attempt, r.worker, r.started_at, r.finished_at, r.outcome, r.error
    FROM idemq.runs r WHERE r.job_id = p_id
    UNION ALL
    SELECT j.attempt, j.worker, j.started_at,
           CASE WHEN j.state = 'completed' THEN j.finished_at END,
           CASE WHEN j.state = 'completed' THEN 'completed' END, NULL::text
    FROM idemq.jobs j WHERE j.id = p_id AND j.claim_seq IS NOT NULL
    ORDER BY 1
$$;

CREATE FUNCTION idemq.keep_until(p_keep_ms bigint, p_state text, p_now timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT p_now + idemq.ms(coalesce(p_keep_ms,
        CASE WHEN p_state = 'dead' THEN 14 * 86400000 ELSE 86400000 END))
$$;

CREATE FUNCTION idemq.key_decision(p_key jsonb, p_fp jsonb, p_now timestamp with time zone) RETURNS TABLE(job_id text, conflict jsonb)
    LANGUAGE sql STABLE
    AS $$
    SELECT i.job_id,
           CASE WHEN cardinality(d.fields) > 0 THEN jsonb_build_object('kind', 'conflict',
               'job_id', i.job_id, 'source', 'idempotency_key', 'fields', to_jsonb(d.fields)) END
    FROM idemq.idempotency i
    CROSS JOIN LATERAL (SELECT CASE WHEN i.fingerprint = p_fp THEN '{}'::text[]
                                    ELSE idemq.fp_diff(p_fp, i.fingerprint, false) END AS fields) d
    WHERE i.scope = p_key ->> 'scope' AND i.key_hash = decode(p_key ->> 'hash', 'hex')
      AND i.expires_at > p_now
$$;

CREATE SEQUENCE idemq.history
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

CREATE TABLE idemq.jobs (
    seq bigint DEFAULT nextval('idemq.history'::regclass) NOT NULL,
    id text NOT NULL COLLATE pg_catalog."C",
    type text NOT NULL,
    queue text NOT NULL,
    state idemq.job_state NOT NULL,
    payload jsonb NOT NULL,
    result jsonb,
    priority smallint DEFAULT 0 NOT NULL,
    run_at timestamp with time zone NOT NULL,
    attempt integer DEFAULT 0 NOT NULL,
    attempts_used integer DEFAULT 0 NOT NULL,
    max_attempts integer NOT NULL,
    retry jsonb,
    timeout_ms bigint NOT NULL,
    deadline timestamp with time zone,
    concurrency_key text,
    tags text[] DEFAULT '{}'::text[] NOT NULL,
    keep_ms bigint,
    fingerprint bytea NOT NULL,
    idem_scope text,
    idem_key_hash bytea,
    idem_key_preview text,
    dedupe_key text,
    dedupe_mode text,
    created_at timestamp with time zone NOT NULL,
    updated_at timestamp with time zone NOT NULL,
    finished_at timestamp with time zone,
    purge_after timestamp with time zone,
    last_error text,
    cancel_requested boolean DEFAULT false NOT NULL,
    lease_token text,
    lease_expires_at timestamp with time zone,
    lease_ms bigint,
    worker text,
    started_at timestamp with time zone,
    first_run_at timestamp with time zone,
    claim_seq bigint,
    done_seq bigint
);

CREATE FUNCTION idemq.lease_job(p_id text, p_token text) RETURNS idemq.jobs
    LANGUAGE plpgsql
    AS $$
DECLARE
    j idemq.jobs%ROWTYPE;
BEGIN
    SELECT * INTO j FROM idemq.jobs
    WHERE id = p_id AND state = 'active' AND lease_token = p_token
    FOR UPDATE;
    RETURN j;
END
$$;

CREATE FUNCTION idemq.lease_reap(p_limit integer) RETURNS TABLE(expired integer, retries integer, dead integer)
    LANGUAGE sql
    AS $$ SELECT * FROM idemq.reap(p_limit, idemq.now()) $$;

CREATE FUNCTION idemq.ms(p bigint) RETURNS interval
    LANGUAGE sql IMMUTABLE
    AS $$ SELECT p * interval '1 millisecond' $$;

CREATE FUNCTION idemq.now() RETURNS timestamp with time zone
    LANGUAGE sql
    AS $$
    SELECT CASE WHEN coalesce(current_setting('idemq.test_clock', true), '') = ''
                THEN clock_timestamp()
                ELSE coalesce(idemq.test_now(current_setting('idemq.test_clock', true)),
                              clock_timestamp()) END
$$;

CREATE FUNCTION idemq.promote(p_id text) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := idemq.now();
    j     idemq.jobs%ROWTYPE;
BEGIN
    SELECT * INTO j FROM idemq.jobs WHERE id = p_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF j.state <> 'waiting' OR j.run_at <= v_now THEN
        RETURN false;
    END IF;
    UPDATE idemq.jobs SET run_at = v_now, updated_at = v_now WHERE id = p_id;
    PERFORM idemq.event(p_id, 'promoted', v_now);
    PERFORM idemq.wake(j.queue);
    RETURN true;
END
$$;

CREATE FUNCTION idemq.purge(p_id text) RETURNS boolean
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    j idemq.jobs%ROWTYPE;
BEGIN
    SELECT * INTO j FROM idemq.jobs WHERE id = p_id FOR UPDATE;
    IF NOT FOUND OR j.state = 'active' THEN
        RETURN false;
    END IF;
    PERFORM idemq.delete_job(p_id);
    IF j.attempt = 0 THEN
        -- The work never happened, so its keys may own new work.
        DELETE FROM idemq.idempotency WHERE job_id = p_id;
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION idemq.queue_counts(p_exact_pages bigint, p_sample_pages bigint) RETURNS TABLE(queue text, state text, n bigint, estimated boolean)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $_$
#variable_conflict use_column
DECLARE
    v_now   timestamptz := idemq.now();
    v_pages bigint := pg_relation_size('idemq.jobs') / current_setting('block_size')::bigint;
    v_bound bigint;
    v_pct   double precision;
BEGIN
    -- The waiting jobs from jobs_state_seq (it carries queue and run_at);
    -- the active ones, which that index leaves out (version 12), by
    -- jobs_lease: they are few.
    RETURN QUERY
    SELECT c.queue, CASE WHEN c.due THEN 'ready' ELSE 'scheduled' END, c.n, false
    FROM (SELECT j.queue, j.run_at <= v_now AS due, count(*) AS n
          FROM idemq.jobs j WHERE j.state = 'waiting' GROUP BY 1, 2) c
    UNION ALL
    SELECT j.queue, 'active', count(*), false
    FROM idemq.jobs j WHERE j.state = 'active' GROUP BY 1;
    IF v_pages <= p_exact_pages THEN
        RETURN QUERY
        SELECT j.queue, j.state::text, count(*), false
        FROM idemq.jobs j WHERE j.state IN ('completed', 'dead', 'cancelled') GROUP BY 1, 2;
        RETURN;
    END IF;
    -- The sequence's last number, not max(seq): no index holds every job's
    -- seq (the completed jobs' and the others' are in two).
    v_bound := ((SELECT last_value FROM idemq.history) / 16384 - 1) * 16384;
    v_pct := least(100.0, 100.0 * p_sample_pages / v_pages);
    RETURN QUERY SELECT NULL::text, NULL::text, 0::bigint, true;
    -- Planned with the boundary and the fraction written in: a plan made
    -- for any boundary would read the whole table.
    RETURN QUERY EXECUTE format($q$
        SELECT r.queue, r.state::text, sum(r.n)::bigint, true
        FROM (SELECT j.queue, j.state, count(*) AS n
              FROM idemq.jobs j
              WHERE j.seq > %1$s AND j.state = 'completed'
              GROUP BY 1, 2
              UNION ALL
              SELECT j.queue, j.state, count(*) AS n
              FROM idemq.jobs j
              WHERE j.seq > %1$s AND j.state IN ('dead', 'cancelled')
              GROUP BY 1, 2
              UNION ALL
              SELECT j.queue, j.state, round(count(*) * 100.0 / %2$s)::bigint
              FROM idemq.jobs j TABLESAMPLE SYSTEM (%2$s) REPEATABLE (0)
              WHERE j.seq <= %1$s AND j.state IN ('completed', 'dead', 'cancelled')
              GROUP BY 1, 2) r
        GROUP BY 1, 2$q$, v_bound, v_pct);
END
$_$;

CREATE FUNCTION idemq.reap(p_limit integer, p_now timestamp with time zone) RETURNS TABLE(expired integer, retries integer, dead integer)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_id    text;
    v_state text;
    n       integer := 0;
    v_retry integer := 0;
    v_dead  integer := 0;
BEGIN
    FOR v_id IN SELECT id FROM idemq.jobs
                WHERE state = 'active' AND lease_expires_at <= p_now
                ORDER BY lease_expires_at LIMIT p_limit FOR UPDATE SKIP LOCKED
    LOOP
        SELECT e.state INTO v_state
        FROM idemq.end_attempt(v_id, 'lease_expired', NULL, true, NULL, NULL, NULL, p_now) e;
        n := n + 1;
        IF v_state IN ('ready', 'scheduled') THEN
            v_retry := v_retry + 1;
        ELSIF v_state = 'dead' THEN
            v_dead := v_dead + 1;
        END IF;
    END LOOP;
    RETURN QUERY SELECT n, v_retry, v_dead;
END
$$;

CREATE FUNCTION idemq.redrive(p jsonb) RETURNS TABLE(outcome text, job_id text, error jsonb)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_now    timestamptz := idemq.now();
    v_id     text := p ->> 'job_id';
    v_key    jsonb := p -> 'key';
    b        record;
    j        idemq.jobs%ROWTYPE;
    v_run_at timestamptz;
    v_deadline timestamptz := idemq.us((p ->> 'deadline')::bigint);
BEGIN
    IF v_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(hashtextextended(
            'idemq.key:' || (v_key ->> 'scope') || ':' || (v_key ->> 'hash'), 0));
        SELECT k.job_id, k.conflict INTO b
        FROM idemq.key_decision(v_key, p -> 'fingerprint', v_now) k;
        IF FOUND THEN
            RETURN QUERY SELECT CASE WHEN b.conflict IS NULL THEN 'replayed' END, b.job_id,
                                b.conflict;
            RETURN;
        END IF;
    END IF;
    SELECT * INTO j FROM idemq.jobs WHERE id = v_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN QUERY SELECT NULL::text, v_id, jsonb_build_object('kind', 'not_found');
        RETURN;
    END IF;
    IF j.state <> 'dead' THEN
        RETURN QUERY SELECT NULL::text, v_id, jsonb_build_object('kind', 'not_dead', 'state',
            CASE WHEN j.state = 'waiting' AND j.run_at <= v_now THEN 'ready'
                 WHEN j.state = 'waiting' THEN 'scheduled' ELSE j.state END);
        RETURN;
    END IF;
    IF v_deadline IS NOT NULL AND v_deadline <= v_now THEN
        RETURN QUERY SELECT NULL::text, v_id, jsonb_build_object('kind', 'validation',
            'field', 'deadline', 'reason', 'must be in the future');
        RETURN;
    END IF;
    v_run_at := coalesce(idemq.us((p ->> 'run_at')::bigint), v_now);
    IF v_deadline IS NOT NULL AND v_run_at >= v_deadline THEN
        RETURN QUERY SELECT NULL::text, v_id, jsonb_build_object('kind', 'validation',
            'field', 'run_at', 'reason', 'must be before the deadline');
        RETURN;
    END IF;
    -- A passed deadline is cleared unless a new one is given.
    UPDATE idemq.jobs SET state = 'waiting', attempts_used = 0,
        max_attempts = coalesce((p ->> 'max_attempts')::int, max_attempts), run_at = v_run_at,
        deadline = CASE WHEN v_deadline IS NOT NULL THEN v_deadline
                        WHEN deadline > v_now THEN deadline END,
        finished_at = NULL, purge_after = NULL, cancel_requested = false, updated_at = v_now
    WHERE id = v_id;
    -- Redrive does not take dedupe bindings (SPEC 7): a binding without a
    -- window, left behind by the dead job, would come back to life now.
    DELETE FROM idemq.dedupe x WHERE x.job_id = v_id AND x.window_until IS NULL;
    IF (p ->> 'reset_checkpoints')::boolean THEN
        DELETE FROM idemq.checkpoints c WHERE c.job_id = v_id;
    END IF;
    PERFORM idemq.event(v_id, 'redriven', v_now, jsonb_build_object(
        'run_at', v_run_at, 'reset_checkpoints', (p ->> 'reset_checkpoints')::boolean));
    PERFORM idemq.bind_key(v_key, v_id, p -> 'fingerprint', NULL, v_now);
    PERFORM idemq.wake(j.queue);
    RETURN QUERY SELECT 'accepted'::text, v_id, NULL::jsonb;
END
$$;

CREATE FUNCTION idemq.resolve_run_at(it jsonb, p_now timestamp with time zone, p_first timestamp with time zone, p_max_wait_ms bigint) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE
        WHEN it ? 'run_at' THEN
            least(idemq.us((it ->> 'run_at')::bigint), p_first + idemq.ms(p_max_wait_ms))
        ELSE least(p_now + idemq.ms(coalesce((it ->> 'delay_ms')::bigint, 0)),
                   p_first + idemq.ms(p_max_wait_ms)) END
$$;

CREATE FUNCTION idemq.retention_sweep(p_limit integer) RETURNS bigint
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_now   timestamptz := idemq.now();
    v_ids   text[];
    v_ctids tid[];
BEGIN
    -- The rows stay locked until the end, so their ctids stay theirs.
    SELECT array_agg(id), array_agg(ctid) INTO v_ids, v_ctids FROM (
        SELECT j.id, j.ctid FROM idemq.jobs j
        WHERE j.purge_after <= v_now AND j.state IN ('completed', 'dead', 'cancelled')
          AND NOT EXISTS (SELECT 1 FROM idemq.idempotency b
                          WHERE b.job_id = j.id AND b.expires_at > v_now)
          AND NOT EXISTS (SELECT 1 FROM idemq.dedupe d
                          WHERE d.job_id = j.id AND d.window_until > v_now)
        ORDER BY j.purge_after LIMIT p_limit FOR UPDATE OF j SKIP LOCKED) due;
    IF v_ids IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM idemq.events WHERE job_id = ANY (v_ids);
    DELETE FROM idemq.runs WHERE job_id = ANY (v_ids);
    DELETE FROM idemq.checkpoints WHERE job_id = ANY (v_ids);
    DELETE FROM idemq.dedupe WHERE job_id = ANY (v_ids);
    DELETE FROM idemq.jobs WHERE ctid = ANY (v_ctids);
    RETURN cardinality(v_ids);
END
$$;

CREATE FUNCTION idemq.schedule_every_next(p_anchor timestamp with time zone, p_every_ms bigint, p_now timestamp with time zone) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT a + idemq.ms(p_every_ms) * (CASE WHEN p_now < a THEN 1
        ELSE floor(extract(epoch FROM p_now - a) * 1000 / p_every_ms)::bigint + 1 END)
    FROM (SELECT date_trunc('second', p_anchor) AS a) anchor
$$;

CREATE FUNCTION idemq.schedule_mark_fired(p_name text, p_cron text, p_every_ms bigint, p_timezone text, p_fired timestamp with time zone, p_next timestamp with time zone, p_error text) RETURNS boolean
    LANGUAGE sql
    AS $$
    WITH marked AS (
        UPDATE idemq.schedules
        SET last_fired_at = coalesce(p_fired, last_fired_at),
            next_fire_at = CASE WHEN p_next IS NULL THEN NULL
                                ELSE greatest(next_fire_at, p_next) END,
            last_error = CASE WHEN p_error IS NOT NULL THEN p_error
                              WHEN p_fired IS NOT NULL THEN NULL ELSE last_error END,
            last_error_at = CASE WHEN p_error IS NOT NULL THEN idemq.now()
                                 WHEN p_fired IS NOT NULL THEN NULL ELSE last_error_at END
        WHERE name = p_name AND next_fire_at IS NOT NULL
          AND cron IS NOT DISTINCT FROM p_cron AND every_ms IS NOT DISTINCT FROM p_every_ms
          AND timezone = p_timezone
          AND (p_fired IS NULL OR last_fired_at IS NULL OR last_fired_at <= p_fired)
        RETURNING 1
    )
    SELECT EXISTS (SELECT 1 FROM marked)
$$;

CREATE FUNCTION idemq.schedule_put(p_name text, p_cron text, p_every_ms bigint, p_timezone text, p_job jsonb, p_paused boolean, p_at timestamp with time zone, p_cron_next timestamp with time zone) RETURNS boolean
    LANGUAGE sql
    AS $$
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

CREATE FUNCTION idemq.test_now(p_clock text) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT at FROM idemq.test_clocks WHERE id = p_clock
$$;

CREATE FUNCTION idemq.us(p bigint) RETURNS timestamp with time zone
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE WHEN p IS NULL THEN NULL
                ELSE timestamptz '1970-01-01 00:00:00+00' + p * interval '1 microsecond' END
$$;

CREATE FUNCTION idemq.wake(p_queue text) RETURNS boolean
    LANGUAGE sql
    AS $$
    SELECT CASE WHEN pg_try_advisory_xact_lock(hashtextextended('idemq.notify:' || p_queue, 0))
                THEN pg_notify('idemq_jobs', p_queue) IS NOT NULL
                ELSE false END
$$;

CREATE TABLE idemq.checkpoints (
    job_id text NOT NULL COLLATE pg_catalog."C",
    name text NOT NULL,
    value jsonb NOT NULL,
    created_at timestamp with time zone NOT NULL
);

CREATE TABLE idemq.dedupe (
    type text NOT NULL,
    key text NOT NULL,
    job_id text NOT NULL COLLATE pg_catalog."C",
    mode text NOT NULL,
    ttl_ms bigint,
    max_wait_ms bigint,
    accepted_at timestamp with time zone NOT NULL,
    window_until timestamp with time zone
);

CREATE TABLE idemq.events (
    seq bigint DEFAULT nextval('idemq.history'::regclass) NOT NULL,
    job_id text NOT NULL COLLATE pg_catalog."C",
    kind text NOT NULL,
    at timestamp with time zone NOT NULL,
    data jsonb DEFAULT '{}'::jsonb NOT NULL
);

CREATE TABLE idemq.idempotency (
    scope text NOT NULL,
    key_hash bytea NOT NULL,
    key_preview text NOT NULL,
    job_id text NOT NULL COLLATE pg_catalog."C",
    fingerprint jsonb NOT NULL,
    created_at timestamp with time zone NOT NULL,
    expires_at timestamp with time zone NOT NULL,
    fp bytea
);

CREATE TABLE idemq.installation (
    id boolean DEFAULT true NOT NULL,
    key_check text NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    updated_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT installation_id_check CHECK (id)
);

CREATE TABLE idemq.queues (
    name text NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    updated_at timestamp with time zone NOT NULL
);

CREATE TABLE idemq.runs (
    job_id text NOT NULL COLLATE pg_catalog."C",
    attempt integer NOT NULL,
    worker text NOT NULL,
    started_at timestamp with time zone NOT NULL,
    finished_at timestamp with time zone,
    outcome text,
    error text
);

CREATE TABLE idemq.schedules (
    name text NOT NULL,
    cron text,
    every_ms bigint,
    timezone text NOT NULL,
    job jsonb NOT NULL,
    paused boolean DEFAULT false NOT NULL,
    created_at timestamp with time zone NOT NULL,
    updated_at timestamp with time zone NOT NULL,
    last_fired_at timestamp with time zone,
    next_fire_at timestamp with time zone,
    last_error text,
    last_error_at timestamp with time zone,
    CONSTRAINT schedules_check CHECK (((cron IS NULL) <> (every_ms IS NULL)))
);

CREATE TABLE idemq.schema_functions (
    one boolean DEFAULT true NOT NULL,
    digest text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    revision bigint,
    idemq_version text,
    CONSTRAINT schema_functions_one_check CHECK (one)
);

CREATE TABLE idemq.schema_migrations (
    version bigint NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    idemq_version text
);

CREATE TABLE idemq.test_clocks (
    id text NOT NULL,
    at timestamp with time zone NOT NULL
);

ALTER TABLE ONLY idemq.checkpoints
    ADD CONSTRAINT checkpoints_pkey PRIMARY KEY (job_id, name);

ALTER TABLE ONLY idemq.dedupe
    ADD CONSTRAINT dedupe_pkey PRIMARY KEY (type, key);

ALTER TABLE ONLY idemq.events
    ADD CONSTRAINT events_pkey PRIMARY KEY (seq);

ALTER TABLE ONLY idemq.idempotency
    ADD CONSTRAINT idempotency_pkey PRIMARY KEY (scope, key_hash);

ALTER TABLE ONLY idemq.installation
    ADD CONSTRAINT installation_pkey PRIMARY KEY (id);

ALTER TABLE ONLY idemq.jobs
    ADD CONSTRAINT jobs_pkey PRIMARY KEY (id);

ALTER TABLE ONLY idemq.queues
    ADD CONSTRAINT queues_pkey PRIMARY KEY (name);

ALTER TABLE ONLY idemq.runs
    ADD CONSTRAINT runs_pkey PRIMARY KEY (job_id, attempt);

ALTER TABLE ONLY idemq.schedules
    ADD CONSTRAINT schedules_pkey PRIMARY KEY (name);

ALTER TABLE ONLY idemq.schema_functions
    ADD CONSTRAINT schema_functions_pkey PRIMARY KEY (one);

ALTER TABLE ONLY idemq.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);

ALTER TABLE ONLY idemq.test_clocks
    ADD CONSTRAINT test_clocks_pkey PRIMARY KEY (id);

CREATE INDEX dedupe_job ON idemq.dedupe USING btree (job_id);

CREATE INDEX dedupe_pending ON idemq.dedupe USING btree (job_id) WHERE (window_until IS NULL);

CREATE INDEX dedupe_window ON idemq.dedupe USING btree (window_until) WHERE (window_until IS NOT NULL);

CREATE INDEX events_job ON idemq.events USING btree (job_id, seq);

CREATE INDEX idempotency_expiry ON idemq.idempotency USING btree (expires_at);

CREATE INDEX idempotency_job ON idemq.idempotency USING btree (job_id);

CREATE UNIQUE INDEX jobs_active_key ON idemq.jobs USING btree (concurrency_key) WHERE (((state)::text = 'active'::text) AND (concurrency_key IS NOT NULL));

CREATE INDEX jobs_claim ON idemq.jobs USING btree (priority DESC, run_at, seq) WHERE ((state)::text = 'waiting'::text);

CREATE INDEX jobs_dedupe ON idemq.jobs USING btree (type, dedupe_key) WHERE (dedupe_key IS NOT NULL);

CREATE INDEX jobs_done_seq ON idemq.jobs USING btree (seq) WHERE ((state)::text = 'completed'::text);

CREATE INDEX jobs_lease ON idemq.jobs USING btree (lease_expires_at) WHERE ((state)::text = 'active'::text);

CREATE INDEX jobs_odd_state ON idemq.jobs USING btree (seq) WHERE ((state)::text <> ALL (ARRAY['waiting'::text, 'active'::text, 'completed'::text, 'dead'::text, 'cancelled'::text]));

CREATE INDEX jobs_purge ON idemq.jobs USING btree (purge_after) WHERE (purge_after IS NOT NULL);

CREATE INDEX jobs_state_seq ON idemq.jobs USING btree (state, seq) INCLUDE (queue, run_at) WHERE (((state)::text <> 'completed'::text) AND ((state)::text <> 'active'::text));

CREATE INDEX jobs_tags ON idemq.jobs USING gin (tags) WHERE (tags <> '{}'::text[]);

CREATE INDEX schedules_due ON idemq.schedules USING btree (next_fire_at) WHERE (next_fire_at IS NOT NULL);

