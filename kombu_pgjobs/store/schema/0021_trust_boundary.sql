-- pgjobs schema, version 21: the trust boundary (issue 28). No database role outside the app's
-- can run, read, replay or stall its tasks through LISTEN, NOTIFY or advisory locks, which
-- PostgreSQL grants to every role that can connect.
--
-- 1. A notification carries no content and no authority. Since version 18 a hand-off's NOTIFY
--    carried the claimed message whole, and the consumer delivered whatever a notification on
--    its channel said: any role could LISTEN on a consumer's channel (its wake id is visible in
--    pg_locks) and read every handed message, or NOTIFY a made-up message and have it run.
--    Now the payload names ids only (E'\x1e' || id || ' ' || claim || ':' || queue) and the
--    trigger records the hand-off in pgjobs_handoff (id, claim, the consumer's wake id). The
--    consumer delivers only what its take returns (sql/waiter.sql, waiter_take): a DELETE of
--    that record, fenced on id, claim number and its own wake id, joined to the row still
--    running under that claim and held by its worker. That needs the app's grants on both
--    tables; a forged or altered notification matches no record, a replayed one finds it gone.
--    The record lives in an unlogged table: the take writes no WAL and no second version of
--    the job row, and a crash that loses the records loses only hand-offs whose consumers'
--    sessions died with it (their leases lapse, as a lost notification's do). The message no
--    longer travels in the payload, so the 7,000-byte ceiling on hand-offs goes.
-- 2. Nothing a publish or a claim waits on or tries can be taken by an outsider. Every
--    advisory lock of the publish and claim paths (the wake barrier, concurrency and rate
--    keys, tenant queue caps, the failover fence) becomes a row lock on pgjobs_lock (or on
--    pgjobs_epoch's row): locking a row needs the UPDATE grant on its table, which no outsider
--    has. Keys share 1,024 rows per class by hash (two keys in one row serialise, nothing
--    more); every wait is bounded by lock_timeout (10 s when the session has none), and a
--    lock_timeout surfaces as PGJ-108. What remains advisory is each consumer's session lock
--    on its own wake id: a liveness signal, only ever tried, never waited on.
-- 3. The wake trigger, the guarded publish (idempotency keys, tenant caps) and the failover
--    fence run as the schema's owner (SECURITY DEFINER, search_path pinned, EXECUTE revoked
--    from PUBLIC): a publisher needs no grant on the registrations or the claim columns for a
--    publish to wake (and hand off to) a consumer, no read of other messages to check a key or
--    a cap, and the first connection after a promotion may be a publisher's.

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_lock (
    class   text NOT NULL,      -- what the row serialises: wake, limit, rate, queued
    bucket  integer NOT NULL,   -- hashtext(key) & 1023: the keys that share the row
    PRIMARY KEY (class, bucket)
);
COMMENT ON TABLE {schema}.pgjobs_lock IS
    'Rows locked (never updated) by publishes and claims instead of advisory locks: locking '
    'a row needs the UPDATE grant on this table, which a role outside the app lacks.';
COMMENT ON COLUMN {schema}.pgjobs_lock.class IS
    'What the row serialises: wake (registration vs publish of a queue), limit (a concurrency '
    'key''s slots), rate (a rate key''s window), queued (a tenant''s queue cap).';
COMMENT ON COLUMN {schema}.pgjobs_lock.bucket IS
    'hashtext(key) & 1023: every key of the class that hashes here shares this row.';
INSERT INTO {schema}.pgjobs_lock (class, bucket)
SELECT c, b FROM unnest(ARRAY['wake', 'limit', 'rate', 'queued']) AS c,
                 generate_series(0, 1023) AS b
ON CONFLICT DO NOTHING;

CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.pgjobs_handoff (
    job_id  bigint PRIMARY KEY,                   -- the message handed off (a message is handed
                                                  -- off at most once: by its own insert)
    claim   integer NOT NULL,                     -- the claim the publish took for the consumer
    waiter  bigint NOT NULL,                      -- that consumer's wake id
    since   timestamptz NOT NULL DEFAULT now()    -- handed at (the keeper drops old records)
);
COMMENT ON TABLE {schema}.pgjobs_handoff IS
    'Hand-offs not yet taken: the consumer named by waiter deletes its record to read the '
    'message (unlogged: lost in a crash with the sessions it names).';
COMMENT ON COLUMN {schema}.pgjobs_handoff.job_id IS 'The pgjobs_job row handed off.';
COMMENT ON COLUMN {schema}.pgjobs_handoff.claim IS 'The claim number the publish took for it.';
COMMENT ON COLUMN {schema}.pgjobs_handoff.waiter IS
    'Wake id of the consumer it was handed to: only that consumer''s take matches.';
COMMENT ON COLUMN {schema}.pgjobs_handoff.since IS
    'When it was handed off; records older than 10 minutes are never taken and go.';

-- Lock the rows of keys p_keys of class p_class exclusively, in bucket order (so two callers
-- that wait never deadlock). p_mode 'try': never waiting, returns whether every row was got;
-- 'wait': waits for each, bounded by the session's lock_timeout, or by 10 s when it has none
-- (restored after). The hot paths (the wake trigger's shared lock, the admission's tries, the
-- claim's barrier) write the one statement out: a call of this function cost a publish
-- 0.25 ms.
CREATE OR REPLACE FUNCTION {schema}.pgjobs_lock_v1(p_class text, p_keys text[], p_mode text)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    b integer;
    saved text := current_setting('lock_timeout');
    waits boolean := p_mode <> 'try';
BEGIN
    IF waits AND saved = '0' THEN
        PERFORM set_config('lock_timeout', '10s', true);
    END IF;
    FOR b IN SELECT DISTINCT hashtext(k) & 1023 FROM unnest(p_keys) AS k
              WHERE k IS NOT NULL ORDER BY 1 LOOP
        IF waits THEN
            PERFORM 1 FROM {schema}.pgjobs_lock AS l
             WHERE l.class = p_class AND l.bucket = b FOR UPDATE;
        ELSE
            PERFORM 1 FROM {schema}.pgjobs_lock AS l
             WHERE l.class = p_class AND l.bucket = b FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN false;
            END IF;
        END IF;
    END LOOP;
    IF waits AND saved = '0' THEN
        PERFORM set_config('lock_timeout', saved, true);
    END IF;
    RETURN true;
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_lock_v1(text, text[], text) FROM PUBLIC;

-- The functions below are those of versions 3, 7, 14 and 20 with their advisory locks
-- replaced by row locks of pgjobs_lock; besides, the admission admits a key given twice in one
-- row's limits once (a row written by hand, not through a publish, made every claim of its
-- queue fail), and the guarded publish and the fence run as the owner.

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

CREATE OR REPLACE FUNCTION {schema}.pgjobs_release_v1(p_ids bigint[], p_claims integer[], p_keys text[],
                                           p_channel text, p_wait boolean)
RETURNS TABLE (id bigint, claim integer)
LANGUAGE plpgsql AS $$
DECLARE
    k text;
    busy text[] := '{{}}';
BEGIN
    IF p_ids IS NULL OR cardinality(p_ids) = 0 THEN
        RETURN;
    END IF;
    IF p_wait THEN  -- every key's row, in bucket order (two releases never deadlock)
        PERFORM {schema}.pgjobs_lock_v1('limit', p_keys, 'wait');
    ELSE
        FOR k IN SELECT DISTINCT key FROM unnest(p_keys) AS key WHERE key IS NOT NULL
                  ORDER BY key LOOP
            PERFORM 1 FROM {schema}.pgjobs_lock AS l
             WHERE l.class = 'limit' AND l.bucket = hashtext(k) & 1023
               FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                busy := busy || k;
            END IF;
        END LOOP;
    END IF;
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

CREATE OR REPLACE FUNCTION {schema}.pgjobs_publish_guarded_v1(
    p_queue text[], p_priority smallint[], p_run_at timestamptz[], p_ttl_ms float8[],
    p_max_attempts integer[], p_task text[], p_limits text[], p_message json[],
    p_tenant text[], p_key text[], p_max_queued integer[], p_task_id text[],
    p_channel text, p_async boolean)
RETURNS TABLE (n bigint, id bigint, holder_id bigint, holder_task_id text)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    cap record;
    live bigint;
    wanted bigint;
    todo bigint[];
    got bigint[];
    got_ids bigint[];
    held bigint[];
    held_ids bigint[];
    held_tasks text[];
    round integer := 0;
BEGIN
    IF p_async THEN  -- durable_publish=False: this transaction commits asynchronously
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    -- Every capped tenant's row first, in bucket order (two publishes never deadlock), each
    -- wait bounded by lock_timeout.
    PERFORM {schema}.pgjobs_lock_v1('queued', ARRAY(
        SELECT DISTINCT m.tenant FROM unnest(p_tenant, p_max_queued) AS m(tenant, max_queued)
         WHERE m.tenant IS NOT NULL AND m.max_queued IS NOT NULL), 'wait');
    FOR cap IN
        SELECT m.tenant, min(m.max_queued) AS max_queued
          FROM unnest(p_tenant, p_max_queued) AS m(tenant, max_queued)
         WHERE m.tenant IS NOT NULL AND m.max_queued IS NOT NULL
         GROUP BY m.tenant
         ORDER BY m.tenant
    LOOP
        SELECT count(*) INTO live
          FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                 WHERE j.tenant = cap.tenant
                 LIMIT cap.max_queued + 1) AS s;
        SELECT count(DISTINCT CASE WHEN m.key IS NULL THEN 'n' || m.n
                                   ELSE 'k' || jsonb_build_array(m.task, m.key)::text END)
          INTO wanted
          FROM unnest(p_tenant, p_task, p_key) WITH ORDINALITY AS m(tenant, task, key, n)
         WHERE m.tenant = cap.tenant
           AND NOT (m.key IS NOT NULL AND EXISTS (
                    SELECT 1 FROM {schema}.pgjobs_job AS j
                     WHERE coalesce(j.task, '') = coalesce(m.task, '')
                       AND coalesce(j.tenant, '') = m.tenant
                       AND j.idempotency_key = m.key));
        IF live + wanted > cap.max_queued THEN
            RAISE EXCEPTION 'tenant % has % live messages; % more would exceed its queue cap of %',
                cap.tenant, live, wanted, cap.max_queued
                USING ERRCODE = 'PJ506';
        END IF;
    END LOOP;

    -- A message published again under its own task id (Celery's retry, while the message it
    -- retries still runs and holds the key) takes the key over: the key stays held
    -- throughout, and the retry is not mistaken for a duplicate of itself.
    UPDATE {schema}.pgjobs_job AS h
       SET idempotency_key = NULL
      FROM unnest(p_task, p_tenant, p_key, p_task_id) AS m(task, tenant, key, task_id)
     WHERE m.key IS NOT NULL AND m.task_id IS NOT NULL
       AND coalesce(h.task, '') = coalesce(m.task, '')
       AND coalesce(h.tenant, '') = coalesce(m.tenant, '')
       AND h.idempotency_key = m.key
       AND h.message -> 'headers' ->> 'id' = m.task_id;

    todo := ARRAY(SELECT generate_series(1, coalesce(cardinality(p_queue), 0))::bigint);
    WHILE cardinality(todo) > 0 AND round < 3 LOOP
        round := round + 1;
        WITH m AS (
            SELECT u.*
              FROM unnest(p_queue, p_priority, p_run_at, p_ttl_ms, p_max_attempts, p_task,
                          p_limits, p_message, p_tenant, p_key) WITH ORDINALITY
                   AS u(queue, priority, run_at, ttl_ms, max_attempts, task, limits, message,
                        tenant, key, n)
             WHERE u.n = ANY(todo)
        ), ins AS (
            INSERT INTO {schema}.pgjobs_job AS j
                   (queue, priority, run_at, delayed, expires_at, max_attempts, task, limits,
                    limit_key, message, tenant, idempotency_key)
            SELECT m.queue, m.priority, coalesce(m.run_at, now()),
                   coalesce(m.run_at > now(), false),
                   now() + make_interval(secs => coalesce(m.ttl_ms, q.message_ttl_ms) / 1000.0),
                   m.max_attempts, m.task, m.limits::jsonb,
                   m.limits::jsonb -> 'concurrency' -> 0 ->> 'key', m.message, m.tenant, m.key
              FROM m
              LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = m.queue
             ORDER BY m.n
            ON CONFLICT (coalesce(task, ''), coalesce(tenant, ''), idempotency_key)
               WHERE idempotency_key IS NOT NULL DO NOTHING
            RETURNING j.id, coalesce(j.task, '') AS task, coalesce(j.tenant, '') AS tenant,
                      j.idempotency_key AS key
        )
        SELECT coalesce(array_agg(x.n ORDER BY x.n), '{{}}'),
               coalesce(array_agg(x.id ORDER BY x.n), '{{}}')
          INTO got, got_ids
          FROM (SELECT DISTINCT ON (i.id) m.n, i.id
                  FROM ins AS i
                  JOIN m ON coalesce(m.task, '') = i.task AND coalesce(m.tenant, '') = i.tenant
                        AND m.key = i.key
                 ORDER BY i.id, m.n) AS x;
        RETURN QUERY SELECT g.n, g.id, NULL::bigint, NULL::text
                       FROM unnest(got, got_ids) AS g(n, id);
        -- The rest of this round's keyed messages: their holders, read once, afresh. One
        -- whose holder is gone (acked meanwhile: the key is free) goes round again.
        SELECT coalesce(array_agg(m.n ORDER BY m.n) FILTER (WHERE h.id IS NOT NULL), '{{}}'),
               coalesce(array_agg(h.id ORDER BY m.n) FILTER (WHERE h.id IS NOT NULL), '{{}}'),
               coalesce(array_agg(h.message -> 'headers' ->> 'id' ORDER BY m.n)
                        FILTER (WHERE h.id IS NOT NULL), '{{}}'),
               coalesce(array_agg(m.n ORDER BY m.n) FILTER (WHERE h.id IS NULL), '{{}}')
          INTO held, held_ids, held_tasks, todo
          FROM unnest(p_task, p_tenant, p_key) WITH ORDINALITY AS m(task, tenant, key, n)
          LEFT JOIN {schema}.pgjobs_job AS h
            ON coalesce(h.task, '') = coalesce(m.task, '')
           AND coalesce(h.tenant, '') = coalesce(m.tenant, '')
           AND h.idempotency_key = m.key
         WHERE m.n = ANY(todo) AND m.key IS NOT NULL AND m.n <> ALL(got);
        RETURN QUERY SELECT x.n, NULL::bigint, x.id, x.task
                       FROM unnest(held, held_ids, held_tasks) AS x(n, id, task);
    END LOOP;
    -- Still unsettled after three rounds (a key taken and freed again each time): answered
    -- with neither an id nor a holder; the caller reports it as not published.
    RETURN QUERY SELECT t.n, NULL::bigint, NULL::bigint, NULL::text FROM unnest(todo) AS t(n);
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_publish_guarded_v1(text[], smallint[], timestamptz[],
    float8[], integer[], text[], text[], json[], text[], text[], integer[], text[], text, boolean)
    FROM PUBLIC;

CREATE OR REPLACE FUNCTION {schema}.pgjobs_fence_epoch_v1(p_step integer) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    tl integer;
    known integer;
    moved bigint := 0;
    n bigint;
BEGIN
    IF pg_is_in_recovery() THEN  -- a standby: nothing is claimed here
        RETURN 0;
    END IF;
    tl := {schema}.pgjobs_timeline_v1();
    SELECT timeline INTO known FROM {schema}.pgjobs_epoch;
    IF known = tl THEN
        RETURN 0;
    END IF;
    SELECT timeline INTO known FROM {schema}.pgjobs_epoch FOR UPDATE;
    IF known = tl THEN
        RETURN 0;
    END IF;
    IF known IS NULL THEN  -- installed on a standby, first seen on a primary: nothing to fence
        INSERT INTO {schema}.pgjobs_epoch (timeline) VALUES (tl) ON CONFLICT (id) DO NOTHING;
        RETURN 0;
    END IF;
    UPDATE {schema}.pgjobs_job SET claim = claim + p_step;
    GET DIAGNOSTICS n = ROW_COUNT;
    moved := moved + n;
    UPDATE {schema}.pgjobs_dead_letter SET claim = claim + p_step;
    GET DIAGNOSTICS n = ROW_COUNT;
    moved := moved + n;
    UPDATE {schema}.pgjobs_slot SET claim = claim + p_step WHERE claim IS NOT NULL;
    UPDATE {schema}.pgjobs_epoch
       SET timeline = tl, fenced_at = now(), fences = fences + 1;
    RETURN moved;
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_fence_epoch_v1(integer) FROM PUBLIC;


-- The wake trigger of version 18, with: the barrier a row lock (pgjobs_lock, class wake,
-- shared; a claim that registers tries it exclusively); the hand-off's payload ids only, its
-- claim recorded for the consumer's wake id (pgjobs_handoff), no size ceiling; run as the
-- owner.
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
                IF NOT paused THEN
                    -- The claim statement's claim, of the best row this statement inserted
                    -- that it would take at once and that no other consumer was handed,
                    -- marked for the consumer it is handed to.
                    UPDATE {schema}.pgjobs_job AS j
                       SET state = 'running',
                           claim = j.claim + 1,
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

DROP TRIGGER IF EXISTS pgjobs_job_wake_v2 ON {schema}.pgjobs_job;
DROP TRIGGER IF EXISTS pgjobs_job_wake_v3 ON {schema}.pgjobs_job;
CREATE TRIGGER pgjobs_job_wake_v3 AFTER INSERT ON {schema}.pgjobs_job
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pgjobs_wake_v3();
DROP FUNCTION IF EXISTS {schema}.pgjobs_wake_v2();
