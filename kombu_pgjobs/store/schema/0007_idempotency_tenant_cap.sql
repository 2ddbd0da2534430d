-- pgjobs schema, version 7: idempotency keys and the tenant queue cap (issue 12).
--
-- A message may carry the tenant it acts for (x-pgjobs-tenant) and an idempotency key
-- (x-pgjobs-idempotency-key). Both are stored as columns so that
--
-- * a live message (every row of pgjobs_job is live: ready, delayed, waiting or running; an
--   acked row is deleted, a dead one moves to pgjobs_dead_letter) holds its (task, tenant,
--   key): a unique index over the rows that have a key refuses a second one, whatever process
--   publishes it. The index is partial: a message without a key costs it nothing.
-- * the live messages of a tenant are counted from a partial index on tenant (rows without a
--   tenant are not in it), a count bounded by the cap + 1, never a scan of the table.
--
-- Messages with a key or a cap are published by pgjobs_publish_guarded_v1 (one statement, one
-- round trip, a batch in one call); messages without either keep the plain INSERT.

ALTER TABLE {schema}.pgjobs_job
    ADD COLUMN tenant text,                            -- x-pgjobs-tenant (NULL: no tenant)
    ADD COLUMN idempotency_key text;                   -- x-pgjobs-idempotency-key (NULL: none)
COMMENT ON COLUMN {schema}.pgjobs_job.tenant IS
    'The tenant the message acts for (x-pgjobs-tenant): caps, rate, CLI filters.';
COMMENT ON COLUMN {schema}.pgjobs_job.idempotency_key IS
    'x-pgjobs-idempotency-key: while this row lives no other row of its task and tenant has it.';

-- Rows published before this version carry their tenant in the header only.
UPDATE {schema}.pgjobs_job
   SET tenant = message -> 'headers' ->> 'x-pgjobs-tenant'
 WHERE json_typeof(message -> 'headers' -> 'x-pgjobs-tenant') = 'string';

-- One live message per (task, tenant, key). coalesce: a NULL task or tenant is a value here
-- (two keyed messages without a tenant are duplicates), on any PostgreSQL version.
CREATE UNIQUE INDEX pgjobs_job_idempotency_idx ON {schema}.pgjobs_job
    (coalesce(task, ''), coalesce(tenant, ''), idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- The live messages of a tenant: the queue cap's bounded count and `pgjobs ls --tenant`.
CREATE INDEX pgjobs_job_tenant_idx ON {schema}.pgjobs_job (tenant)
    WHERE tenant IS NOT NULL;

-- Publish messages that carry an idempotency key or a tenant queue cap, in one statement.
--
-- Caps first: for each tenant of the call that has a cap (p_max_queued; the smallest given
-- wins), in tenant order (two calls lock their tenants in one order: no deadlock), a
-- transaction-scoped advisory lock on the tenant, then the count of its live rows (a fresh
-- snapshot: it sees what an earlier holder of the lock committed). If the messages of this
-- call that would insert a row (a key already held inserts nothing; a key given twice counts
-- once) would bring the tenant above its cap, the call raises SQLSTATE PJ506 and nothing is
-- written. Two publishers at the edge take the lock in turn, so they cannot both get in.
-- Publishers that give no cap take no lock and are not counted against (the cap is the app's
-- setting, carried by each message).
--
-- A keyed message whose key is held by a message of the same Celery task id (a retry
-- published from the body of the message it retries) takes the key over from it.
--
-- Then the insert: ON CONFLICT DO NOTHING on the key's unique index. A message whose key is
-- held (by a live row, or by an earlier message of this same call) inserts nothing; the holder
-- is read in a later statement of this function (a fresh snapshot: a holder another process
-- committed while this insert waited on it is seen). A holder gone in between (acked just
-- then) frees the key: that message is tried again (up to three rounds).
--
-- Returns one row per message that has a key: (n, id, holder_id, holder_task_id). n is its
-- 1-based position in the arrays; id the row inserted, or NULL with the holder's row id and
-- Celery task id (the stored message's headers.id). Messages without a key are all inserted
-- and return nothing.
CREATE FUNCTION {schema}.pgjobs_publish_guarded_v1(
    p_queue text[], p_priority smallint[], p_run_at timestamptz[], p_ttl_ms float8[],
    p_max_attempts integer[], p_task text[], p_limits text[], p_message json[],
    p_tenant text[], p_key text[], p_max_queued integer[], p_task_id text[],
    p_channel text, p_async boolean)
RETURNS TABLE (n bigint, id bigint, holder_id bigint, holder_task_id text)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    lock_class integer := hashtext(p_channel || '.queued');
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
    FOR cap IN
        SELECT m.tenant, min(m.max_queued) AS max_queued
          FROM unnest(p_tenant, p_max_queued) AS m(tenant, max_queued)
         WHERE m.tenant IS NOT NULL AND m.max_queued IS NOT NULL
         GROUP BY m.tenant
         ORDER BY m.tenant
    LOOP
        PERFORM pg_advisory_xact_lock(lock_class, hashtext(cap.tenant));
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
