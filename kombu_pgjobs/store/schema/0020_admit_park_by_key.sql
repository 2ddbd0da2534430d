-- pgjobs schema, version 20: a claim that parks a full key's flood reads it by primary key.
--
-- pgjobs_admit_v2 (versions 5 and 6) parks the rest of a full key's ready rows in one
-- statement: `UPDATE ... WHERE j.id IN (SELECT ... LIMIT 1000 FOR UPDATE SKIP LOCKED)`. Planned
-- while the table's statistics said it was empty (a VACUUM of the drained table records it so,
-- and the keeper's VACUUM never analyzes), that became a nested loop over the whole job table,
-- the locking subquery run again for every row: one claim of 4 took 1.4 s with 1,000 rows of
-- the full key queued and 7.9 s with 2,000 (35 s with 4,000; with 20,000 every claim hit a 15 s
-- statement timeout, so nothing settled and the keeper never vacuumed again). The rows to park
-- are now collected into an array first and updated by primary key, as the claim's own rows
-- are (sql/job.sql, job_claim); nothing else in the function changes. After: 54 ms with
-- 2,000, 69 ms with 4,000, 160 ms with 20,000 (a claim parks up to 1,000 of them).

CREATE OR REPLACE FUNCTION {schema}.pgjobs_admit_v2(p_id bigint, p_claim integer, p_queue text,
                                                    p_limits jsonb, p_channel text,
                                                    p_worker text, p_candidates bigint[])
RETURNS {schema}.pgjobs_verdict
LANGUAGE plpgsql AS $$
DECLARE
    lock_class integer := hashtext(p_channel || '.limit');
    caps jsonb := coalesce(p_limits -> 'concurrency', '[]'::jsonb);
    rates jsonb := coalesce(p_limits -> 'rate', '[]'::jsonb);
    n_caps integer := jsonb_array_length(caps);
    n_rates integer := jsonb_array_length(rates);
    keys text[] := '{{}}';
    limits integer[] := '{{}}';
    free integer[] := '{{}}';
    windows timestamptz[] := '{{}}';
    taken integer[];
    on_key text;
    e jsonb;
    cap integer;
    s integer;
    per float8;
    ws timestamptz;
    used integer;
BEGIN
    FOR i IN 0 .. n_caps - 1 LOOP
        e := caps -> i;
        on_key := e ->> 'key';
        cap := (e ->> 'limit')::integer;
        IF NOT pg_try_advisory_xact_lock(lock_class, hashtext(on_key)) THEN
            RETURN ROW('busy', on_key)::{schema}.pgjobs_verdict;
        END IF;
        -- Slots of this key still held: by a running holder under the claim that took them
        -- with a live lease, or taken earlier in this very claim (its row is not running yet).
        SELECT array_agg(sl.slot) INTO taken
          FROM {schema}.pgjobs_slot AS sl
          JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id
         WHERE sl.limit_key = on_key
           AND ((h.claim = sl.claim AND h.state = 'running' AND h.lease_expires_at > now())
                OR h.claim = sl.claim - 1);
        IF coalesce(cardinality(taken), 0) >= cap THEN
            IF e ->> 'when_busy' = 'fail' THEN
                WITH refused AS (
                    DELETE FROM {schema}.pgjobs_job WHERE id = p_id RETURNING *
                ), dead AS (
                    INSERT INTO {schema}.pgjobs_dead_letter
                           (id, queue, priority, task, claim, attempts, max_attempts, reason,
                            error, created_at, message)
                    SELECT id, queue, priority, task, claim, attempts, max_attempts, 'refused',
                           jsonb_build_object('code', 'PGJ-302', 'type', 'KeyBusy',
                                              'key', on_key,
                                              'message', 'concurrency key ' || on_key
                                              || ' was full and the task says when_busy=fail'),
                           created_at, message
                      FROM refused
                )
                INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
                SELECT queue, 'refused', date_trunc('minute', now()), p_worker, 1 FROM refused
                ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + 1;
                RETURN ROW('refused', on_key)::{schema}.pgjobs_verdict;
            END IF;
            UPDATE {schema}.pgjobs_job SET state = 'waiting', waiting_on = on_key
             WHERE id = p_id;
            IF i = 0 THEN  -- the rest of this key's flood in the queue
                UPDATE {schema}.pgjobs_job AS j
                   SET state = 'waiting', waiting_on = on_key
                 WHERE j.id = ANY (ARRAY(  -- by primary key only (see the header)
                        SELECT x.id FROM {schema}.pgjobs_job AS x
                         WHERE x.limit_key = on_key AND x.queue = p_queue
                           AND x.state = 'ready' AND x.run_at <= now()
                           -- the claim's own candidates: each gets its own verdict, and the
                           -- claim's UPDATE must find untouched the ones it admits
                           AND x.id <> ALL(coalesce(p_candidates, '{{}}'))
                           -- only rows the key is full for: a row published under a larger
                           -- cap still has room (a cap changed by a deploy)
                           AND (x.limits -> 'concurrency' -> 0 ->> 'limit')::integer
                               <= coalesce(cardinality(taken), 0)
                           AND (x.limits -> 'concurrency' -> 0 ->> 'when_busy')
                               IS DISTINCT FROM 'fail'
                           AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_slot AS sl
                                            WHERE sl.limit_key = on_key AND sl.job_id = x.id
                                              AND sl.claim = x.claim + 1)
                         LIMIT 1000
                           FOR UPDATE SKIP LOCKED));
            END IF;
            RETURN ROW('parked', on_key)::{schema}.pgjobs_verdict;
        END IF;
        s := 0;  -- the lowest free slot number
        WHILE s = ANY(taken) LOOP
            s := s + 1;
        END LOOP;
        keys := keys || on_key;
        limits := limits || cap;
        free := free || s;
    END LOOP;
    FOR i IN 0 .. n_rates - 1 LOOP
        e := rates -> i;
        on_key := e ->> 'key';
        per := (e ->> 'per')::float8;
        IF NOT pg_try_advisory_xact_lock(hashtext(p_channel || '.rate'), hashtext(on_key)) THEN
            RETURN ROW('busy', on_key)::{schema}.pgjobs_verdict;
        END IF;
        ws := to_timestamp(floor(extract(epoch FROM now()) / per) * per);
        SELECT r.starts INTO used FROM {schema}.pgjobs_rate AS r
         WHERE r.limit_key = on_key AND r.window_start = ws;
        IF coalesce(used, 0) >= (e ->> 'limit')::integer THEN
            UPDATE {schema}.pgjobs_job
               SET run_at = ws + make_interval(secs => per), delayed = true
             WHERE id = p_id;
            RETURN ROW('later', on_key)::{schema}.pgjobs_verdict;
        END IF;
        windows := windows || ws;
    END LOOP;
    -- Every cap and rate has room: take the slots, count the starts.
    IF n_caps > 0 THEN
        INSERT INTO {schema}.pgjobs_slot AS sl (limit_key, slot, cap, job_id, claim)
        SELECT k, f, c, p_id, p_claim FROM unnest(keys, free, limits) AS t(k, f, c)
        ON CONFLICT (limit_key, slot) DO UPDATE
           SET cap = excluded.cap, job_id = excluded.job_id, claim = excluded.claim,
               taken_at = now();
    END IF;
    IF n_rates > 0 THEN
        INSERT INTO {schema}.pgjobs_rate AS r (limit_key, window_start, starts)
        SELECT e2 ->> 'key', w, 1
          FROM unnest(windows) WITH ORDINALITY AS t(w, i)
         CROSS JOIN LATERAL (SELECT rates -> (t.i::integer - 1) AS e2) AS x
        ON CONFLICT (limit_key, window_start) DO UPDATE SET starts = r.starts + 1;
    END IF;
    RETURN ROW('ok', NULL)::{schema}.pgjobs_verdict;
END
$$;

