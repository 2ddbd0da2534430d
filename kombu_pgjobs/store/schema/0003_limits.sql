-- pgjobs schema, version 3: fleet-wide concurrency limits and rates.
--
-- A message may carry limits (the x-pgjobs-limits header, copied to pgjobs_job.limits when it
-- is published): concurrency caps, each a key with a limit ("at most N running with this key
-- across the fleet"), and start rates ("at most N starts per window with this key"). The claim
-- admits a limited message only when every cap has a free slot and every rate has room:
--
--   * a slot is a row of pgjobs_slot, (limit_key, slot) with slot < limit; the primary key makes
--     two holders of one slot impossible, whatever the isolation level or the number of racing
--     claims. A slot is held while its job is running under the claim that took it with a live
--     lease; a slot whose holder is gone (acked, requeued, lease lapsed) is free. Rows are not
--     deleted on release but emptied (job_id NULL) and taken again by an update: no indexed
--     column changes, so takes and releases are HOT updates and the table does not bloat under
--     churn (free rows unused for an hour are pruned by the keeper);
--   * a message that finds a key full is parked (state 'waiting', waiting_on = the key): it
--     leaves the claim's index, burns no attempt, and no longer stands in front of other keys'
--     messages. When the full key is its first one, the claim parks every due ready row of the
--     queue with that first key too (up to 1,000 per claim): a flood of one key is set aside in
--     a few claims instead of being met a prefetch window at a time. Releasing a slot wakes as
--     many parked messages of its key as slots it freed;
--   * every slot change of a key happens under a transaction-scoped advisory lock on that key.
--     Claims only try that lock (pg_try_advisory_xact_lock: a claim never waits, a busy key is
--     skipped this round); releases wait for it. So a release always sees a message parked by
--     a claim that raced it, and wakes it: no lost wake-up.

ALTER TABLE {schema}.pgjobs_job
    ADD COLUMN limits jsonb,                           -- the message's limits (NULL: none)
    ADD COLUMN limit_key text,                         -- its first concurrency key (floods park)
    ADD COLUMN waiting_on text;                        -- the full key a waiting row is parked on
ALTER TABLE {schema}.pgjobs_job DROP CONSTRAINT pgjobs_job_state_check;
ALTER TABLE {schema}.pgjobs_job ADD CONSTRAINT pgjobs_job_state_check
    CHECK (state IN ('ready', 'running', 'waiting'));
COMMENT ON COLUMN {schema}.pgjobs_job.limits IS
    'Limits from the x-pgjobs-limits header: concurrency caps (key, limit, when_busy) and '
    'rates (key, limit, per seconds); NULL when the message has none.';
COMMENT ON COLUMN {schema}.pgjobs_job.waiting_on IS
    'State waiting: the concurrency key that was full when the claim met this row.';
COMMENT ON COLUMN {schema}.pgjobs_job.limit_key IS
    'The first concurrency key of limits: when a claim finds it full, every due ready row of '
    'the queue with this first key is parked at once (a flood of one key, bounded per claim).';
-- Parking a flood: the ready rows of one queue whose first key is full.
CREATE INDEX pgjobs_job_limit_key_idx ON {schema}.pgjobs_job (limit_key, queue)
    WHERE state = 'ready' AND limit_key IS NOT NULL;
-- Wake-up order of a key's parked rows: the claim's own order.
CREATE INDEX pgjobs_job_waiting_idx ON {schema}.pgjobs_job
    (waiting_on, priority DESC, run_at, id) WHERE state = 'waiting';

-- One row per slot ever taken; a row is held while its job runs under the claim that took it.
CREATE TABLE {schema}.pgjobs_slot (
    limit_key  text NOT NULL,                          -- the concurrency key
    slot       integer NOT NULL,                       -- 0 .. limit-1
    cap        integer NOT NULL,                       -- the limit the holder was admitted under
    job_id     bigint,                                 -- the holder (NULL: free)
    claim      integer,                                -- the holder's claim number (fence)
    taken_at   timestamptz NOT NULL DEFAULT now(),     -- last taken
    PRIMARY KEY (limit_key, slot)
) WITH (
    fillfactor = 50,                                   -- room for HOT updates on the same page
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
COMMENT ON TABLE {schema}.pgjobs_slot IS
    'Concurrency slots: one row per place under a key; held while job_id runs under claim.';

-- Starts per key and fixed window, for rate limits.
CREATE TABLE {schema}.pgjobs_rate (
    limit_key    text NOT NULL,                        -- the rate key (e.g. tenant:acme)
    window_start timestamptz NOT NULL,                 -- start of the fixed window
    starts       integer NOT NULL,                     -- claims admitted in the window
    PRIMARY KEY (limit_key, window_start)
);
COMMENT ON TABLE {schema}.pgjobs_rate IS 'Admitted starts per rate key and window.';

-- Admit one limited row into a claim, or hold it back, in the claim's transaction. Called by
-- the claim statement for each candidate with limits, in claim order (the row is locked by the
-- claim). All caps are checked before any slot is taken, so a refusal never leaves a slot
-- behind. Returns the verdict and the key that decided it:
--   ok       every cap had a free slot (now taken for p_id/p_claim) and every rate had room:
--            the claim takes the row;
--   parked   a key was full: the row is now 'waiting' on it, uncounted. When the key is the
--            row's first key, the due ready rows of the queue with that first key are parked
--            too (up to 1,000; rows that took a slot in this claim excepted);
--   refused  a key was full and its when_busy is 'fail': the row moved to the dead letters
--            (reason refused, code PGJ-302) and was counted;
--   later    a rate is spent: the row's run_at moved to the rate's next window, uncounted;
--   busy     another transaction is changing a key right now: the row stays ready.
-- Only limited rows pay for any of this: a claim without them never calls the function.
CREATE TYPE {schema}.pgjobs_verdict AS (
    verdict text,                                      -- ok | parked | refused | later | busy
    on_key  text                                       -- the key that decided it
);
CREATE FUNCTION {schema}.pgjobs_admit_v1(p_id bigint, p_claim integer, p_queue text,
                                         p_limits jsonb, p_channel text, p_worker text)
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

-- Release the slots taken by these (job id, claim) pairs under these keys (one array element
-- per pair and key: settled, requeued or lapsed jobs; a later claim of the same job keeps its own
-- slots) and wake, per key, as many parked rows as slots were freed. With p_wait it waits for
-- each key's lock, in key order (two releases never deadlock); without, it only tries them and
-- leaves alone the pairs with a busy key (a claim that settles acks must never wait for a key's
-- lock while it may hold others). Either way the statements below run after the locks are held,
-- so they see whatever a claim that held them committed, including rows it parked: no lost
-- wake-up. Returns the pairs released (the caller may settle those rows).
CREATE FUNCTION {schema}.pgjobs_release_v1(p_ids bigint[], p_claims integer[], p_keys text[],
                                           p_channel text, p_wait boolean)
RETURNS TABLE (id bigint, claim integer)
LANGUAGE plpgsql AS $$
DECLARE
    lock_class integer := hashtext(p_channel || '.limit');
    k text;
    busy text[] := '{{}}';
BEGIN
    IF p_ids IS NULL OR cardinality(p_ids) = 0 THEN
        RETURN;
    END IF;
    FOR k IN SELECT DISTINCT key FROM unnest(p_keys) AS key WHERE key IS NOT NULL
              ORDER BY key LOOP
        IF p_wait THEN
            PERFORM pg_advisory_xact_lock(lock_class, hashtext(k));
        ELSIF NOT pg_try_advisory_xact_lock(lock_class, hashtext(k)) THEN
            busy := busy || k;
        END IF;
    END LOOP;
    RETURN QUERY
    WITH given AS (
        SELECT r.id, r.claim, r.key FROM unnest(p_ids, p_claims, p_keys) AS r(id, claim, key)
    ), pairs AS (
        SELECT g.id, g.claim, bool_or(g.key = ANY(busy)) AS blocked
          FROM given AS g GROUP BY g.id, g.claim
    ), gone AS (
        UPDATE {schema}.pgjobs_slot AS sl
           SET job_id = NULL, claim = NULL
          FROM given AS g
          JOIN pairs AS p ON p.id = g.id AND p.claim = g.claim AND NOT p.blocked
         WHERE sl.limit_key = g.key AND sl.job_id = g.id AND sl.claim = g.claim
        RETURNING sl.limit_key
    ), freed AS (
        SELECT gone.limit_key, count(*) AS n FROM gone GROUP BY gone.limit_key
    ), picked AS (
        SELECT w.id
          FROM freed
         CROSS JOIN LATERAL (
                SELECT j.id FROM {schema}.pgjobs_job AS j
                 WHERE j.state = 'waiting' AND j.waiting_on = freed.limit_key
                 ORDER BY j.priority DESC, j.run_at, j.id
                 LIMIT freed.n
                   FOR UPDATE SKIP LOCKED) AS w
    ), back AS (
        UPDATE {schema}.pgjobs_job AS j
           SET state = 'ready', waiting_on = NULL
          FROM picked
         WHERE j.id = picked.id
        RETURNING j.queue
    ), notified AS (
        SELECT count(*) AS n
          FROM (SELECT pg_notify(p_channel, back.queue) FROM back GROUP BY back.queue) AS q
    )
    SELECT pairs.id, pairs.claim FROM pairs, notified WHERE NOT pairs.blocked;
END
$$;

-- Release every slot of these settled jobs, waiting for the keys' locks: the keys come from each
-- job's limits. For the statements that settle rows they hold (requeue, dead-lettering).
-- Returns the number of pairs released.
CREATE FUNCTION {schema}.pgjobs_release_jobs_v1(p_ids bigint[], p_claims integer[],
                                                p_limits jsonb[], p_channel text)
RETURNS bigint
LANGUAGE sql AS $$
    SELECT count(*)
      FROM (SELECT array_agg(r.id) AS ids, array_agg(r.claim) AS claims,
                   array_agg(e.value ->> 'key') AS keys
              FROM unnest(p_ids, p_claims, p_limits) AS r(id, claim, limits)
             CROSS JOIN LATERAL jsonb_array_elements(r.limits -> 'concurrency') AS e) AS x
     CROSS JOIN LATERAL {schema}.pgjobs_release_v1(x.ids, x.claims, x.keys, p_channel, true)
$$;
