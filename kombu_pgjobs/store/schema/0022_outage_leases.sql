-- pgjobs schema, version 22: outages longer than a lease (issue 29).
--
-- 1. The failover fence is O(1) and fences every restart. Version 14 moved every claim number
--    (live rows, dead letters, slots) up by 2^20 in one statement on a new WAL timeline: past
--    statement_timeout on a large table it was cancelled, retried by the next connection, and
--    the fleet never connected; and it keyed on the timeline only, so a server restored from a
--    storage snapshot (or one that lost committed claims in a crash with synchronous_commit
--    off) was not fenced. Now pgjobs_epoch holds a base and the postmaster start it is valid
--    for. Every claim (the claim statement, the hand-off in the wake trigger) sets
--    claim = greatest(claim, base) + 1, reading the base only while the recorded start is the
--    server's own; on the first claim or connection after any server start (a restart, a
--    promotion, a restore) pgjobs_fence_epoch_v2 moves the base up by 2^16, once, one row
--    written. Every number handed out afterwards is above any handed out before the restart;
--    rows running across it keep their numbers, so their holders' acks and renewals still land
--    (version 14 made every one of them miss). Claim numbers are 32-bit: about 32,000 server
--    starts of room; a single message claimed more than 65,536 times between two starts is
--    fenced by its own number only (it keeps counting up from it).
-- 2. The admission, which named a slot taken earlier in the same claim by "its row's claim + 1",
--    names it by "a claim above its row's" (the claim number is no longer always + 1); and a
--    slot whose holder's lease lapsed stays taken until a keeper rescues the row (its holder
--    may still run it, and may revive the lease after an outage: a cap holds through it).
--
-- The lease changes of this issue (a lapsed lease revived by its holder, rescues and expiries
-- only after a full lease of reachable time) are in the statements (sql/job.sql), not here.

ALTER TABLE {schema}.pgjobs_epoch ADD COLUMN IF NOT EXISTS base integer NOT NULL DEFAULT 0;
ALTER TABLE {schema}.pgjobs_epoch ADD COLUMN IF NOT EXISTS started timestamptz;
COMMENT ON TABLE {schema}.pgjobs_epoch IS
    'The claim-number fence: every claim numbers its row above base; base moves up once per '
    'server start (a restart, a promotion, a restore), so no number is handed out twice.';
COMMENT ON COLUMN {schema}.pgjobs_epoch.base IS
    'Every claim sets claim = greatest(claim, base) + 1.';
COMMENT ON COLUMN {schema}.pgjobs_epoch.started IS
    'The postmaster start (pg_postmaster_start_time()) base is valid for; another one moves '
    'base up before the next claim.';

-- The base starts above every number handed out so far (version 14's fences included): the
-- first fence of this version must clear them all. Its start is this server's: installing is
-- no restart.
UPDATE {schema}.pgjobs_epoch
   SET base = greatest(base,
                       (SELECT coalesce(max(claim), 0) FROM {schema}.pgjobs_job),
                       (SELECT coalesce(max(claim), 0) FROM {schema}.pgjobs_dead_letter)),
       started = pg_postmaster_start_time()
 WHERE started IS NULL;

-- The current base, moved up by 2^16 first when the server started since it was recorded.
-- The common case (called only when the caller's own read found the start changed) is the
-- row update; racing callers wait for the row, then find it done.
CREATE OR REPLACE FUNCTION {schema}.pgjobs_fence_epoch_v2() RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    b integer;
BEGIN
    SELECT e.base INTO b FROM {schema}.pgjobs_epoch AS e
     WHERE e.id AND e.started = pg_postmaster_start_time();
    IF FOUND OR pg_is_in_recovery() THEN  -- a standby: nothing is claimed there
        RETURN b;
    END IF;
    UPDATE {schema}.pgjobs_epoch AS e
       SET base = e.base + 65536, started = pg_postmaster_start_time(),
           timeline = {schema}.pgjobs_timeline_v1(), fenced_at = now(), fences = e.fences + 1
     WHERE e.id AND e.started IS DISTINCT FROM pg_postmaster_start_time()
    RETURNING e.base INTO b;
    IF FOUND THEN
        RETURN b;
    END IF;
    -- another caller fenced meanwhile, or no row yet (installed on a standby)
    INSERT INTO {schema}.pgjobs_epoch (timeline, base, started)
    VALUES ({schema}.pgjobs_timeline_v1(), 0, pg_postmaster_start_time())
    ON CONFLICT (id) DO NOTHING;
    SELECT e.base INTO b FROM {schema}.pgjobs_epoch AS e WHERE e.id;
    RETURN b;
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_fence_epoch_v2() FROM PUBLIC;
DROP FUNCTION IF EXISTS {schema}.pgjobs_fence_epoch_v1(integer);

-- Version 21's admission, with the slot taken earlier in this claim named by a claim above its
-- row's (see 1 and 2 above).
CREATE OR REPLACE FUNCTION {schema}.pgjobs_admit_v2(p_id bigint, p_claim integer, p_queue text,
                                                    p_limits jsonb, p_channel text,
                                                    p_worker text, p_candidates bigint[])
RETURNS {schema}.pgjobs_verdict
LANGUAGE plpgsql AS $$
DECLARE
    caps jsonb := coalesce(p_limits -> 'concurrency', '[]'::jsonb);
    rates jsonb := coalesce(p_limits -> 'rate', '[]'::jsonb);
    n_caps integer := jsonb_array_length(caps);
    n_rates integer := jsonb_array_length(rates);
    keys text[] := '{{}}';
    limits integer[] := '{{}}';
    free integer[] := '{{}}';
    windows timestamptz[] := '{{}}';
    rate_keys text[] := '{{}}';
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
        -- A key given twice (a publish refuses it, PGJ-303; a row written by hand may hold it)
        -- is admitted once: a second slot of one key in one statement failed every claim.
        CONTINUE WHEN on_key = ANY(keys);
        cap := (e ->> 'limit')::integer;
        PERFORM 1 FROM {schema}.pgjobs_lock AS l  -- pgjobs_lock_v1(..., 'try'), written out
         WHERE l.class = 'limit' AND l.bucket = hashtext(on_key) & 1023
           FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            RETURN ROW('busy', on_key)::{schema}.pgjobs_verdict;
        END IF;
        -- Slots of this key still held: by a running holder under the claim that took them
        -- (its lease lapsed or not: a lapsed holder may still run, and its holder may revive
        -- the lease; the slot is free once a keeper rescued the row), or taken earlier in this
        -- very claim (its row is not running yet: the slot names the claim number the row is
        -- about to get, above its current one).
        SELECT array_agg(sl.slot) INTO taken
          FROM {schema}.pgjobs_slot AS sl
          JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id
         WHERE sl.limit_key = on_key
           AND ((h.claim = sl.claim AND h.state = 'running') OR h.claim < sl.claim);
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
                                              AND sl.claim > x.claim)
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
        CONTINUE WHEN on_key = ANY(rate_keys);  -- (as a concurrency key given twice)
        per := (e ->> 'per')::float8;
        PERFORM 1 FROM {schema}.pgjobs_lock AS l
         WHERE l.class = 'rate' AND l.bucket = hashtext(on_key) & 1023
           FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
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
        rate_keys := rate_keys || on_key;
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
        SELECT k, w, 1 FROM unnest(rate_keys, windows) AS t(k, w)
        ON CONFLICT (limit_key, window_start) DO UPDATE SET starts = r.starts + 1;
    END IF;
    RETURN ROW('ok', NULL)::{schema}.pgjobs_verdict;
END
$$;


-- Version 21's wake trigger, with the hand-off's claim numbered above the epoch base.
CREATE OR REPLACE FUNCTION {schema}.pgjobs_wake_v3() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q record;
    w record;
    woken integer;
    paused boolean;
    handed bigint[];
    job_id bigint;
    job_claim integer;
    saved_timeout text;
    epoch_base integer;
BEGIN
    FOR q IN SELECT queue, count(*) AS n FROM new_rows GROUP BY queue ORDER BY queue LOOP
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- One snapshot for the whole transaction: it may not see a registration made
            -- since, and deleting one another publisher deleted meanwhile would fail the
            -- publish. Every consumer of the queue hears the schema's channel instead.
            PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue);
            CONTINUE;
        END IF;
        -- Held to the commit; waits only for a consumer's claim that is registering now,
        -- bounded by lock_timeout (10 s in a session without one). Written out rather than
        -- a call of pgjobs_lock_v1: a PL/pgSQL call here cost 0.25 ms a publish.
        IF saved_timeout IS NULL THEN
            saved_timeout := current_setting('lock_timeout');
            IF saved_timeout = '0' THEN
                PERFORM set_config('lock_timeout', '10s', true);
            END IF;
        END IF;
        PERFORM 1 FROM {schema}.pgjobs_lock AS l
         WHERE l.class = 'wake' AND l.bucket = hashtext(TG_TABLE_SCHEMA || '.' || q.queue) & 1023
           FOR KEY SHARE;
        -- Every consumer busy (the common case under load): one probe, nothing to wake.
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_waiter AS r
                                   WHERE r.queue = q.queue);
        woken := 0;
        handed := ARRAY[]::bigint[];
        paused := NULL;
        LOOP
            -- One registration at a time (a FOR loop would lock the ten it fetches): a fresh
            -- snapshot per statement sees a registration committed before the lock was
            -- granted; concurrent publishers wake different consumers (SKIP LOCKED).
            SELECT r.waiter, r.worker, r.lease_ttl INTO w FROM {schema}.pgjobs_waiter AS r
             WHERE r.queue = q.queue
             ORDER BY r.since, r.waiter
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            DELETE FROM {schema}.pgjobs_waiter AS r
             WHERE r.queue = q.queue AND r.waiter = w.waiter;
            -- Its consumer holds the lock while it lives: a free lock is a dead registration.
            -- (Only tried: an outsider holding a dead consumer's id can make this wake-up go
            -- to nobody; its message then runs when its lease lapses, or a claim takes it.)
            CONTINUE WHEN pg_try_advisory_xact_lock_shared(w.waiter);
            job_id := NULL;
            -- (a publish that is its own transaction: see version 18's header)
            IF w.lease_ttl IS NOT NULL
               AND current_setting('pgjobs.hand_off', true) = 'on' THEN
                IF paused IS NULL THEN
                    paused := coalesce((SELECT p.paused FROM {schema}.pgjobs_queue AS p
                                         WHERE p.name = q.queue), false);
                END IF;
                IF NOT paused AND epoch_base IS NULL THEN
                    -- the claim statement's epoch base (fenced here if the server restarted)
                    epoch_base := coalesce(
                        (SELECT e.base FROM {schema}.pgjobs_epoch AS e
                          WHERE e.id AND e.started = pg_postmaster_start_time()),
                        {schema}.pgjobs_fence_epoch_v2());
                END IF;
                IF NOT paused THEN
                    -- The claim statement's claim, of the best row this statement inserted
                    -- that it would take at once and that no other consumer was handed,
                    -- marked for the consumer it is handed to.
                    UPDATE {schema}.pgjobs_job AS j
                       SET state = 'running',
                           claim = greatest(j.claim, epoch_base) + 1,
                           attempts = j.attempts + 1,
                           lease_expires_at = now() + make_interval(secs => w.lease_ttl),
                           worker = w.worker
                     WHERE j.id = (SELECT n.id FROM new_rows AS n
                                    WHERE n.queue = q.queue AND n.state = 'ready'
                                      AND NOT n.delayed AND n.run_at <= now()
                                      AND (n.expires_at IS NULL OR n.expires_at > now())
                                      AND n.limits IS NULL
                                      AND n.id <> ALL (handed)
                                    ORDER BY n.priority DESC, n.run_at, n.id
                                    LIMIT 1)
                       AND j.state = 'ready'
                    RETURNING j.id, j.claim INTO job_id, job_claim;
                    IF job_id IS NOT NULL
                       AND current_setting('synchronous_commit') = 'off' THEN
                        -- A claim is durable: this transaction's commit is flushed (to the
                        -- local disk at least) before its holder hears of it.
                        PERFORM set_config('synchronous_commit', 'local', true);
                    END IF;
                END IF;
            END IF;
            IF job_id IS NULL THEN
                PERFORM pg_notify('pgjobs.w.' || w.waiter, q.queue);
            ELSE
                handed := handed || job_id;
                INSERT INTO {schema}.pgjobs_handoff (job_id, claim, waiter)
                VALUES (job_id, job_claim, w.waiter)
                ON CONFLICT ON CONSTRAINT pgjobs_handoff_pkey DO UPDATE
                   SET claim = excluded.claim, waiter = excluded.waiter, since = now();
                -- ids only: the consumer reads the message with its fenced take
                PERFORM pg_notify('pgjobs.w.' || w.waiter,
                                  E'\x1e' || job_id || ' ' || job_claim || ':' || q.queue);
            END IF;
            woken := woken + 1;
            EXIT WHEN woken >= q.n;
        END LOOP;
        IF woken < q.n AND EXISTS (SELECT 1 FROM {schema}.pgjobs_waiter AS r
                                    WHERE r.queue = q.queue) THEN
            -- Registrations another open transaction holds (a publisher that may yet roll
            -- back, and take its wake-up with it): every consumer of the queue hears this.
            PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue);
        END IF;
    END LOOP;
    IF saved_timeout = '0' THEN
        PERFORM set_config('lock_timeout', saved_timeout, true);
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_wake_v3() FROM PUBLIC;
