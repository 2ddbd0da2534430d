-- pgjobs schema, version 5: a key's messages may disagree on its cap.
--
-- A deploy that changes a cap (concurrency_per_key 1 -> 3) leaves old and new messages of one
-- key side by side. Version 3's admission parked a flood of the key (every due ready row with
-- that first key) as soon as one candidate found the key full under its own cap; the flood
-- could hold a later candidate of the same claim, published under a larger cap, which the
-- same claim then admitted: its UPDATE met a row the function had already changed
-- (TriggeredDataChangeViolation), every claim failed, and the queue stopped.
--
-- pgjobs_admit_v2 fixes both halves:
--   * the flood parks only rows the key is full for (their first cap <= the slots held now),
--     so a changed cap takes effect for the messages published under it;
--   * the flood never touches the claim's own candidates (p_candidates): each candidate gets
--     its own verdict from its own call, and only the claim's UPDATE changes an admitted row.
--     Within one claim the slots held only grow, so a candidate the flood would have parked is
--     parked by its own call too.
-- A new name because the signature changed (p_candidates). pgjobs_admit_v1 stays, as a
-- wrapper with no candidates to spare, so a process of the previous release running against
-- this schema during a rolling deploy gets the cap rule too (its claim statement calls v1).

-- Admit one limited row into a claim, or hold it back: version 3's pgjobs_admit_v1 (see
-- 0003_limits.sql for the verdicts ok, parked, refused, later and busy) with the flood rule
-- above. p_candidates: the ids of every candidate of the calling claim.
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
                 WHERE j.id IN (
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
                           FOR UPDATE SKIP LOCKED);
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
            UPDATE {schema}.pgjobs_job SET run_at = ws + make_interval(secs => per)
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

-- The previous release's claim calls v1: same rule, no candidate list (its flood still skips
-- rows that took a slot in this claim, as before; the cap rule keeps larger-cap rows out).
CREATE OR REPLACE FUNCTION {schema}.pgjobs_admit_v1(p_id bigint, p_claim integer, p_queue text,
                                                    p_limits jsonb, p_channel text,
                                                    p_worker text)
RETURNS {schema}.pgjobs_verdict
LANGUAGE sql AS $$
    SELECT {schema}.pgjobs_admit_v2(p_id, p_claim, p_queue, p_limits, p_channel, p_worker,
                                    '{{}}'::bigint[])
$$;
