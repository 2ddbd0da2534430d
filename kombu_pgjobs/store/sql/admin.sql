-- name: admin_queue_known :one
-- Is this a queue an operator may name? Declared, holding messages, or holding dead letters.
-- Commands that name a queue refuse an unknown one (a typo must not pause a queue nobody uses).
SELECT EXISTS (SELECT 1 FROM {schema}.pgjobs_queue WHERE name = %(queue)s)
    OR EXISTS (SELECT 1 FROM {schema}.pgjobs_job WHERE queue = %(queue)s)
    OR EXISTS (SELECT 1 FROM {schema}.pgjobs_dead_letter WHERE queue = %(queue)s);

-- name: admin_queue_stats :many
-- Per queue: ready (due now), delayed (waiting for their ETA), running (leased), waiting
-- (parked by a full concurrency key), dead letters,
-- paused, the age in seconds of the oldest ready message, and the settle counters of the last
-- %(minutes)s minute buckets (the current, partial minute included) as {outcome: n}.
-- %(queue)s NULL: every queue. Reads only; takes no row locks.
WITH names AS (
    SELECT name FROM {schema}.pgjobs_queue
    UNION SELECT queue FROM {schema}.pgjobs_job
    UNION SELECT queue FROM {schema}.pgjobs_dead_letter
), jobs AS (
    SELECT queue,
           count(*) FILTER (WHERE state = 'ready' AND run_at <= now()) AS ready,
           count(*) FILTER (WHERE state = 'ready' AND run_at > now()) AS delayed,
           count(*) FILTER (WHERE state = 'running') AS running,
           count(*) FILTER (WHERE state = 'waiting') AS waiting,
           extract(epoch FROM now() - min(run_at) FILTER (
               WHERE state = 'ready' AND run_at <= now()))::float8 AS oldest_ready_age
      FROM {schema}.pgjobs_job
     GROUP BY queue
), dead AS (
    SELECT queue, count(*) AS dead FROM {schema}.pgjobs_dead_letter GROUP BY queue
), recent AS (
    SELECT queue, jsonb_object_agg(outcome, n) AS settled
      FROM (SELECT queue, outcome, sum(n)::bigint AS n
              FROM {schema}.pgjobs_counter
             WHERE bucket >= date_trunc('minute', now())
                             - make_interval(mins => %(minutes)s::int - 1)
             GROUP BY queue, outcome) AS c
     GROUP BY queue
)
SELECT n.name AS queue,
       coalesce(j.ready, 0) AS ready,
       coalesce(j.delayed, 0) AS delayed,
       coalesce(j.running, 0) AS running,
       coalesce(j.waiting, 0) AS waiting,
       coalesce(d.dead, 0) AS dead,
       coalesce(q.paused, false) AS paused,
       j.oldest_ready_age,
       coalesce(r.settled, '{{}}'::jsonb) AS settled
  FROM names AS n
  LEFT JOIN jobs AS j ON j.queue = n.name
  LEFT JOIN dead AS d ON d.queue = n.name
  LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = n.name
  LEFT JOIN recent AS r ON r.queue = n.name
 WHERE %(queue)s::text IS NULL OR n.name = %(queue)s
 ORDER BY n.name;

-- name: admin_ls :many
-- One page of messages, live and dead, in id order after %(after)s (keyset pagination: the
-- caller passes the last id it saw). Live rows get a derived state: ready, delayed, running or
-- waiting (parked by a full concurrency key).
-- Every filter is optional (NULL); %(states)s lists the states wanted. Each branch stops at
-- %(limit)s rows, so a page costs at most two index range scans whatever the table size.
-- Header fields are read with json operators only from a message whose text holds no \u0000
-- and no \uD800-\uDFFF escape: Postgres refuses to parse a whole json document that holds
-- either (NUL cannot be text; a lone surrogate is invalid), which made one such message break
-- every listing. Such a row returns its text as raw_message instead (NULL for every other
-- row, so nothing more is sent) and Admin reads its headers in Python. The guard costs about
-- what the parse does, so it runs for the rows of the page only. %(tenant)s reads the live
-- rows' tenant column (pgjobs_job_tenant_id_idx: one range scan from the cursor) but the dead
-- letters' headers, for every row it scans: there %(careful)s is false first (folded away by
-- the planner), and only if that statement fails on such a message does Admin run it again
-- with %(careful)s true, where such rows pass the SQL filter and Admin applies the filter to
-- them.
(SELECT j.id, j.queue,
        CASE WHEN j.state IN ('running', 'waiting') THEN j.state
             WHEN j.run_at > now() THEN 'delayed'
             ELSE 'ready' END AS state,
        j.task, j.priority, j.attempts, j.max_attempts, j.claim, j.run_at, j.created_at,
        j.worker, j.lease_expires_at, j.cancelled_at,
        NULL::text AS reason, NULL::timestamptz AS died_at,
        CASE WHEN jg.plain THEN j.message -> 'headers' ->> 'id' END AS task_id,
        j.tenant,
        j.waiting_on,
        CASE WHEN NOT jg.plain THEN j.message::text END AS raw_message
   FROM {schema}.pgjobs_job AS j
   CROSS JOIN LATERAL (SELECT strpos(j.message::text, '\u0000') + strpos(j.message::text, '\ud')
                            + strpos(j.message::text, '\uD') = 0 AS plain) AS jg
  WHERE j.id > %(after)s
    -- %(any_live)s false (only dead letters wanted): a constant the planner folds, so this
    -- branch reads nothing instead of every live row to find none
    AND %(any_live)s::bool
    AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
    AND (%(task)s::text IS NULL OR j.task = %(task)s)
    AND (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s)
    AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s)
    AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s)
    -- %(every_live)s: every live state wanted, no filter (a constant the planner folds away:
    -- its row estimate stays honest, so a tenant's page is an ordered index scan that stops
    -- at %(limit)s rows, not a read and sort of all the tenant's rows)
    -- %(one_state)s: only running or only waiting rows wanted, said plainly, so the planner
    -- reads them from their partial indexes (pgjobs_job_waiting_id_idx: in id order)
    AND (%(one_state)s::text IS NULL OR j.state = %(one_state)s)
    AND (%(every_live)s::bool
         OR CASE WHEN j.state IN ('running', 'waiting') THEN j.state
                 WHEN j.run_at > now() THEN 'delayed'
                 ELSE 'ready' END = ANY(%(states)s::text[]))
  ORDER BY j.id
  LIMIT %(limit)s)
UNION ALL
(SELECT d.id, d.queue, 'dead', d.task, d.priority, d.attempts, d.max_attempts, d.claim,
        NULL, d.created_at, NULL, NULL, NULL, d.reason, d.died_at,
        CASE WHEN dg.plain THEN d.message -> 'headers' ->> 'id' END,
        CASE WHEN dg.plain THEN d.message -> 'headers' ->> 'x-pgjobs-tenant' END,
        NULL,
        CASE WHEN NOT dg.plain THEN d.message::text END
   FROM {schema}.pgjobs_dead_letter AS d
   CROSS JOIN LATERAL (SELECT strpos(d.message::text, '\u0000') + strpos(d.message::text, '\ud')
                            + strpos(d.message::text, '\uD') = 0 AS plain) AS dg
  WHERE 'dead' = ANY(%(states)s::text[])
    AND d.id > %(after)s
    AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
    AND (%(task)s::text IS NULL OR d.task = %(task)s)
    AND (%(tenant)s::text IS NULL
         OR CASE WHEN %(careful)s::bool AND NOT dg.plain
                 THEN true
                 ELSE d.message -> 'headers' ->> 'x-pgjobs-tenant' = %(tenant)s END)
    AND (%(created_after)s::timestamptz IS NULL OR d.created_at >= %(created_after)s)
    AND (%(created_before)s::timestamptz IS NULL OR d.created_at < %(created_before)s)
  ORDER BY d.id
  LIMIT %(limit)s)
ORDER BY id
LIMIT %(limit)s;

-- name: admin_dead_ls :many
-- One page of dead letters in id order after %(after)s, with why they died. Filters optional.
-- A message holding \u0000 or a \uD800-\uDFFF escape is read in Python (raw_message), and
-- %(careful)s is used, as in admin_ls.
SELECT d.id, d.queue, d.task, d.priority, d.claim, d.attempts, d.max_attempts, d.reason,
       d.error ->> 'type' AS error_type, d.error ->> 'message' AS error_message,
       d.error ->> 'rule' AS rule, d.created_at, d.died_at,
       CASE WHEN dg.plain THEN d.message -> 'headers' ->> 'id' END AS task_id,
       CASE WHEN dg.plain THEN d.message -> 'headers' ->> 'x-pgjobs-tenant' END AS tenant,
       CASE WHEN NOT dg.plain THEN d.message::text END AS raw_message
  FROM {schema}.pgjobs_dead_letter AS d
  CROSS JOIN LATERAL (SELECT strpos(d.message::text, '\u0000') + strpos(d.message::text, '\ud')
                            + strpos(d.message::text, '\uD') = 0 AS plain) AS dg
 WHERE d.id > %(after)s
   AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
   AND (%(task)s::text IS NULL OR d.task = %(task)s)
   AND (%(reason)s::text IS NULL OR d.reason = %(reason)s)
   AND (%(tenant)s::text IS NULL
        OR CASE WHEN %(careful)s::bool AND NOT dg.plain
                THEN true
                ELSE d.message -> 'headers' ->> 'x-pgjobs-tenant' = %(tenant)s END)
 ORDER BY d.id
 LIMIT %(limit)s;

-- name: admin_job_get :one
-- One live message with everything an operator needs to judge it (the kombu message as text).
SELECT j.id, j.queue,
       CASE WHEN j.state IN ('running', 'waiting') THEN j.state
            WHEN j.run_at > now() THEN 'delayed'
            ELSE 'ready' END AS state,
       j.task, j.priority, j.run_at, j.expires_at, j.claim, j.attempts, j.max_attempts,
       j.worker, j.lease_expires_at,
       extract(epoch FROM j.lease_expires_at - now())::float8 AS lease_remaining,
       j.cancelled_at, j.created_at, j.limits, j.waiting_on,
       (SELECT count(*) FROM {schema}.pgjobs_slot AS sl
          JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id AND h.claim = sl.claim
         WHERE sl.limit_key = j.waiting_on AND h.state = 'running') AS waiting_on_held,
       j.message::text AS message
  FROM {schema}.pgjobs_job AS j
 WHERE j.id = %(id)s;

-- name: admin_dead_get :one
-- One dead letter with its reason and error.
SELECT d.id, d.queue, 'dead' AS state, d.task, d.priority, d.claim, d.attempts, d.max_attempts,
       d.reason, d.error, d.created_at, d.died_at, d.message::text AS message
  FROM {schema}.pgjobs_dead_letter AS d
 WHERE d.id = %(id)s;

-- name: admin_locate :many
-- Where each id lives: ('job', ready|delayed|running|waiting) or ('dead', 'dead'). Absent ids are not
-- returned, so the caller can name them in a NotFound error before changing anything.
SELECT j.id, 'job' AS place,
       CASE WHEN j.state IN ('running', 'waiting') THEN j.state
            WHEN j.run_at > now() THEN 'delayed'
            ELSE 'ready' END AS state
  FROM {schema}.pgjobs_job AS j
 WHERE j.id = ANY(%(ids)s::bigint[])
UNION ALL
SELECT d.id, 'dead', 'dead'
  FROM {schema}.pgjobs_dead_letter AS d
 WHERE d.id = ANY(%(ids)s::bigint[]);

-- name: admin_dead_requeue :many
-- Move dead letters back to ready, at most %(limit)s, oldest id first: by id (%(ids)s) or by
-- queue (%(queue)s), task (%(task)s) and/or tenant (%(tenant)s), optionally %(reason)s.
-- Attempts restart at 0;
-- the claim number (the fence) is kept, so no holder of an earlier claim can settle the
-- revived row. The row keeps its id
-- unless a live row already has it (then it gets a fresh one from the job id sequence,
-- %(job_table)s). Locked rows (another requeue in flight) are skipped, and so are rows whose
-- idempotency key a live message holds (they stay dead). The revived row gets its tenant and
-- key back from its headers. NOTIFY wakes the queue's idle consumers. Returns (old id, new id,
-- queue).
WITH picked AS (
    SELECT d.*,
           CASE WHEN EXISTS (SELECT 1 FROM {schema}.pgjobs_job AS j WHERE j.id = d.id)
                THEN nextval(pg_get_serial_sequence(%(job_table)s, 'id'))
                ELSE d.id END AS new_id
      FROM {schema}.pgjobs_dead_letter AS d
     WHERE (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
       AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
       AND (%(reason)s::text IS NULL OR d.reason = %(reason)s)
       AND (%(task)s::text IS NULL OR d.task = %(task)s)
       -- %(tenant)s: tenant-scoped replay. A message Postgres cannot parse (a \u0000 or lone
       -- surrogate escape: see admin_ls) is never matched by it: requeue that one by id.
       AND CASE WHEN %(tenant)s::text IS NULL THEN true
                WHEN strpos(d.message::text, '\u0000') + strpos(d.message::text, '\ud')
                     + strpos(d.message::text, '\uD') > 0 THEN false
                ELSE d.message -> 'headers' ->> 'x-pgjobs-tenant' = %(tenant)s END
       -- its idempotency key held by a live message: it stays dead (a second live message
       -- with the key is what the key forbids). Read only from messages that have a key (a
       -- message with a NUL escape cannot be read with ->>: see revived).
       AND CASE WHEN strpos(d.message::text, '"x-pgjobs-idempotency-key"') = 0 THEN true
                ELSE NOT EXISTS (
                    SELECT 1 FROM {schema}.pgjobs_job AS k
                     WHERE k.idempotency_key =
                           d.message -> 'headers' ->> 'x-pgjobs-idempotency-key'
                       AND coalesce(k.task, '') = coalesce(d.task, '')
                       AND coalesce(k.tenant, '') =
                           coalesce(d.message -> 'headers' ->> 'x-pgjobs-tenant', ''))
           END
     ORDER BY d.id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), removed AS (
    DELETE FROM {schema}.pgjobs_dead_letter AS d USING picked WHERE d.id = picked.id
), revived AS (
    INSERT INTO {schema}.pgjobs_job
           (id, queue, state, priority, run_at, claim, attempts, max_attempts, task,
            limits, limit_key, created_at, message, tenant, idempotency_key)
    OVERRIDING SYSTEM VALUE
    SELECT new_id, queue, 'ready', priority, now(), claim, 0, max_attempts, task,
           -- limits, tenant and key travel in the message's headers (validated when it was
           -- first published)
           (h.doc -> 'headers' -> 'x-pgjobs-limits')::jsonb,
           h.doc -> 'headers' -> 'x-pgjobs-limits' -> 'concurrency' -> 0 ->> 'key',
           created_at, message, h.doc -> 'headers' ->> 'x-pgjobs-tenant',
           h.doc -> 'headers' ->> 'x-pgjobs-idempotency-key'
      FROM picked
      -- Postgres cannot parse a json document holding \u0000 or a lone surrogate escape: such
      -- a message (a header with a NUL) is read with those escapes replaced by \ufffd. Only
      -- its limits are read that way; the message itself is moved unchanged.
     CROSS JOIN LATERAL (
           SELECT CASE WHEN strpos(message::text, '\u0000') + strpos(message::text, '\ud')
                            + strpos(message::text, '\uD') = 0
                       THEN message
                       ELSE regexp_replace(message::text,
                                '\\u0000'
                                '|\\u[dD][89abAB][0-9a-fA-F]{{2}}(?!\\u[dD][c-fC-F][0-9a-fA-F]{{2}})'
                                '|(?<!\\u[dD][89abAB][0-9a-fA-F]{{2}})\\u[dD][c-fC-F][0-9a-fA-F]{{2}}',
                                '\ufffd', 'g')::json END AS doc) AS h
    RETURNING id
)
SELECT p.id, p.new_id, p.queue, pg_notify(%(channel)s, p.queue) IS NULL AS notified
  FROM picked AS p;

-- name: admin_dead_count :one
-- Dead letters matching a selection (what a bounded bulk command leaves for the next call);
-- %(tenant)s as in admin_dead_requeue.
SELECT count(*)
  FROM {schema}.pgjobs_dead_letter AS d
 WHERE (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
   AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
   AND (%(reason)s::text IS NULL OR d.reason = %(reason)s)
   AND (%(task)s::text IS NULL OR d.task = %(task)s)
   AND (%(cutoff)s::timestamptz IS NULL OR d.died_at < %(cutoff)s)
   AND CASE WHEN %(tenant)s::text IS NULL THEN true
            WHEN strpos(d.message::text, '\u0000') + strpos(d.message::text, '\ud')
                 + strpos(d.message::text, '\uD') > 0 THEN false
            ELSE d.message -> 'headers' ->> 'x-pgjobs-tenant' = %(tenant)s END;

-- name: admin_dead_purge :one
-- Delete one bounded batch of dead letters (by id, queue, reason and/or died before %(cutoff)s),
-- oldest first. Claims never touch this table, so a purge cannot hold up a claim. Returns the
-- number deleted.
WITH gone AS (
    DELETE FROM {schema}.pgjobs_dead_letter
     WHERE id IN (SELECT d.id
                    FROM {schema}.pgjobs_dead_letter AS d
                   WHERE (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
                     AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
                     AND (%(reason)s::text IS NULL OR d.reason = %(reason)s)
                     AND (%(cutoff)s::timestamptz IS NULL OR d.died_at < %(cutoff)s)
                   ORDER BY d.died_at
                   LIMIT %(limit)s
                     FOR UPDATE SKIP LOCKED)
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: admin_job_make_due :many
-- `pgjobs requeue` of a delayed message: make it due now (it keeps its id, claim and attempts)
-- and wake the queue's consumers. Celery reads the ETA from the message, not from run_at, and
-- would hold the task in memory until then: the stored message's `eta` header is cleared too
-- (version 11). Returns (id, queue).
UPDATE {schema}.pgjobs_job AS j
   SET run_at = now(),
       delayed = false,
       message = {schema}.pgjobs_without_eta_v1(j.message)
 WHERE j.id = ANY(%(ids)s::bigint[]) AND j.state = 'ready' AND j.run_at > now()
RETURNING j.id, j.queue, pg_notify(%(channel)s, j.queue) IS NULL AS notified;

-- name: admin_cancel :many
-- Cancel live messages. A ready, delayed or waiting one moves to the dead letters with reason
-- 'cancelled' (kept: `pgjobs dead requeue` brings it back; counted 'cancelled'). A running one
-- is marked (cancelled_at): its holder learns it at its next renewal and ends the run (celery_ext
-- terminates or flags it), and its settle — ack, reject, requeue, or a lapsed lease — moves it
-- to the dead letters as 'cancelled' instead of bringing it back. A wake-up on the schema's
-- channel (E'\x1d' || 'cancel', ids only none) makes every consumer's keeper renew now rather
-- than at its next tick: it names nothing, the renewal reads what is cancelled. Returns
-- (outcome, id, queue).
WITH target AS (
    SELECT j.id, j.state
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = ANY(%(ids)s::bigint[])
       FOR UPDATE
), deleted AS (
    DELETE FROM {schema}.pgjobs_job AS j
     USING target
     WHERE j.id = target.id AND target.state IN ('ready', 'waiting')
    RETURNING j.*
), dead AS (
    INSERT INTO {schema}.pgjobs_dead_letter
           (id, queue, priority, task, claim, attempts, max_attempts, reason, error,
            created_at, message, run_at, expires_at, worker)
    SELECT id, queue, priority, task, claim, attempts, max_attempts, 'cancelled',
           jsonb_build_object('type', 'Cancelled',
                              'message', 'cancelled by an operator while queued'),
           created_at, message, run_at, expires_at, worker
      FROM deleted
), marked AS (
    UPDATE {schema}.pgjobs_job AS j
       SET cancelled_at = coalesce(j.cancelled_at, now())
      FROM target
     WHERE j.id = target.id AND target.state = 'running'
    RETURNING j.id, j.queue
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, 'cancelled', date_trunc('minute', now()), %(shard)s, count(*)
      FROM deleted GROUP BY queue
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT 'cancelled' AS outcome, id, queue FROM deleted
UNION ALL
SELECT 'marked', id, queue FROM marked
UNION ALL
SELECT 'notified', NULL, NULL
 WHERE EXISTS (SELECT 1 FROM marked) AND pg_notify(%(channel)s, E'\x1dcancel') IS NULL;

-- name: admin_purge :one
-- Delete one bounded batch of a queue's ready, delayed and waiting messages (counted 'purged'). Running
-- messages are left to finish. Rows locked by a concurrent claim are skipped, so a purge never
-- waits on, or holds up, a claim. Returns the number deleted.
WITH gone AS (
    DELETE FROM {schema}.pgjobs_job
     WHERE id IN (SELECT j.id
                    FROM {schema}.pgjobs_job AS j
                   WHERE j.queue = %(queue)s AND j.state IN ('ready', 'waiting')
                   ORDER BY j.id
                   LIMIT %(limit)s
                     FOR UPDATE SKIP LOCKED)
    RETURNING queue
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, 'purged', date_trunc('minute', now()), %(shard)s, count(*)
      FROM gone GROUP BY queue
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT count(*) FROM gone;

-- name: admin_queue_remaining :one
-- What a purge left in a queue: (ready, delayed and waiting; running).
SELECT count(*) FILTER (WHERE state IN ('ready', 'waiting')),
       count(*) FILTER (WHERE state = 'running')
  FROM {schema}.pgjobs_job
 WHERE queue = %(queue)s;

-- name: admin_pause :one
-- Pause or resume a queue (the claim skips paused queues). Upserts the queue row, since a queue
-- may hold messages without having been declared. Resuming notifies the queue, so idle
-- consumers claim at once instead of at their next safety poll. Returns (queue, paused).
WITH q AS (
    INSERT INTO {schema}.pgjobs_queue AS q (name, paused)
    VALUES (%(queue)s, %(paused)s)
    ON CONFLICT (name) DO UPDATE SET paused = excluded.paused
    RETURNING q.name, q.paused
)
SELECT name, paused, CASE WHEN NOT paused THEN pg_notify(%(channel)s, name) IS NULL END
  FROM q;

-- name: admin_workers :many
-- Live consumers (pgjobs_consumer, upserted by each worker's keeper tick) joined with the leases
-- each process holds in pgjobs_job. A process that holds leases but has no consumer row is gone
-- (its leases lapse within lease_ttl). At most %(leases)s leases are listed per process; with
-- none wanted (the metrics exporter, the dashboard's overview) no lease is even built.
WITH held AS (
    SELECT worker, count(*) AS running, min(lease_expires_at) AS next_expiry,
           (array_agg(jsonb_build_object(
                'id', id, 'queue', queue, 'task', task, 'claim', claim,
                'attempts', attempts, 'cancelled', cancelled_at IS NOT NULL,
                'lease_remaining', extract(epoch FROM lease_expires_at - now())::float8)
                ORDER BY id) FILTER (WHERE %(leases)s::int > 0))[1:%(leases)s::int] AS leases
      FROM {schema}.pgjobs_job
     WHERE state = 'running'
     GROUP BY worker
)
SELECT coalesce(c.worker, h.worker) AS worker,
       c.worker IS NOT NULL AS alive,
       c.queues, c.held AS reported_held, c.started_at, c.last_seen_at,
       extract(epoch FROM now() - c.last_seen_at)::float8 AS last_seen_age,
       coalesce(h.running, 0) AS running,
       extract(epoch FROM h.next_expiry - now())::float8 AS next_expiry,
       coalesce(h.leases, '{{}}') AS leases
  FROM {schema}.pgjobs_consumer AS c
  FULL JOIN held AS h ON h.worker = c.worker
 ORDER BY 1;

-- name: admin_counter_totals :many
-- Settled messages per queue and outcome since the schema was installed (every bucket, the
-- '-infinity' roll-up included): monotonic, what Prometheus counters need.
SELECT queue, outcome, sum(n)::bigint AS n
  FROM {schema}.pgjobs_counter
 GROUP BY queue, outcome
 ORDER BY queue, outcome;

-- name: admin_tenant_stats :many
-- The %(top)s tenants with the most live messages, by state (ready, delayed, running, waiting),
-- and how many tenants have live messages at all (the same on every row). Read from the
-- tenant index's rows only (messages without a tenant are not read); bounded output, so a
-- metric labelled by tenant cannot grow with the number of tenants.
WITH per AS (
    SELECT tenant,
           count(*) FILTER (WHERE state = 'ready' AND run_at <= now()) AS ready,
           count(*) FILTER (WHERE state = 'ready' AND run_at > now()) AS delayed,
           count(*) FILTER (WHERE state = 'running') AS running,
           count(*) FILTER (WHERE state = 'waiting') AS waiting,
           count(*) AS live
      FROM {schema}.pgjobs_job
     WHERE tenant IS NOT NULL
     GROUP BY tenant
)
SELECT tenant, ready, delayed, running, waiting, live, count(*) OVER () AS tenants
  FROM per
 ORDER BY live DESC, tenant
 LIMIT %(top)s;

-- name: admin_tenants :many
-- Tenants with live messages in name order, a page of %(limit)s after %(after)s, each with its
-- live messages by state, counted up to %(bound)s + 1 (more: "at least"). Bounded whatever the
-- table size: the tenants are found by skipping through pgjobs_job_tenant_id_idx (one index
-- probe per tenant, never a scan of a tenant's rows), and each count reads at most %(bound)s + 1
-- of its entries, in id order.
WITH RECURSIVE names AS (
    (SELECT j.tenant FROM {schema}.pgjobs_job AS j
      WHERE j.tenant IS NOT NULL AND j.tenant > %(after)s
      ORDER BY j.tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT j.tenant FROM {schema}.pgjobs_job AS j
             WHERE j.tenant IS NOT NULL AND j.tenant > n.tenant
             ORDER BY j.tenant LIMIT 1)
      FROM names AS n
     WHERE n.tenant IS NOT NULL
)
SELECT t.tenant, c.ready, c.delayed, c.running, c.waiting, c.live
  FROM (SELECT tenant FROM names WHERE tenant IS NOT NULL LIMIT %(limit)s) AS t
 CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE s.state = 'ready' AND s.run_at <= now()) AS ready,
           count(*) FILTER (WHERE s.state = 'ready' AND s.run_at > now()) AS delayed,
           count(*) FILTER (WHERE s.state = 'running') AS running,
           count(*) FILTER (WHERE s.state = 'waiting') AS waiting,
           count(*) AS live
      FROM (SELECT j.state, j.run_at FROM {schema}.pgjobs_job AS j
             WHERE j.tenant = t.tenant ORDER BY j.id LIMIT %(bound)s + 1) AS s
 ) AS c
 ORDER BY t.tenant;

-- name: admin_cutoff :one
-- now() minus %(seconds)s, on the database's clock (one clock for every age comparison).
SELECT now() - make_interval(secs => %(seconds)s::float8);

-- name: admin_prune_count :one
-- Exactly what a prune would remove: dead letters that died before %(cutoff)s, and counter
-- buckets older than %(counters_cutoff)s that are not yet rolled up.
SELECT (SELECT count(*) FROM {schema}.pgjobs_dead_letter WHERE died_at < %(cutoff)s),
       (SELECT count(*) FROM {schema}.pgjobs_counter
         WHERE bucket < %(counters_cutoff)s AND bucket > '-infinity');

-- name: admin_counter_fold :one
-- Fold one bounded batch of old counter buckets into the roll-up bucket ('-infinity', shard
-- 'rollup') in one statement, so per-queue, per-outcome totals never move backwards. Only old
-- minutes are touched, never the current one that settles write to. Returns rows folded.
WITH old AS (
    DELETE FROM {schema}.pgjobs_counter AS c
     WHERE (c.queue, c.outcome, c.bucket, c.shard) IN (
            SELECT o.queue, o.outcome, o.bucket, o.shard
              FROM {schema}.pgjobs_counter AS o
             WHERE o.bucket < %(cutoff)s AND o.bucket > '-infinity'
             LIMIT %(limit)s
               FOR UPDATE SKIP LOCKED)
    RETURNING c.queue, c.outcome, c.n
), folded AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, outcome, '-infinity', 'rollup', sum(n)
      FROM old GROUP BY queue, outcome
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT count(*) FROM old;

-- name: admin_dead_record :one
-- Record a message that failed for good (celery_ext: exception after its retries were spent)
-- as a dead letter with a fresh id from the job id sequence (%(job_table)s). The message itself
-- is settled by Celery as usual (acked), so the dead letter is a copy: when the live row is
-- still held (%(job_id)s, %(claim)s: acks_late), its exact message, attempts and publish time
-- are copied; otherwise the caller's rebuilt %(message)s is stored. Not counted here: the
-- caller tells the outcome next (job_outcome, sql/history.sql), which the ack then counts and
-- records as 'failed' (or amends an early ack's). Returns the dead letter's id.
WITH src AS (
    SELECT j.queue, j.priority, j.task, j.claim, j.attempts, j.max_attempts, j.created_at,
           j.message
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = %(job_id)s::bigint AND j.claim = %(claim)s::int
), dead AS (
    INSERT INTO {schema}.pgjobs_dead_letter
           (id, queue, priority, task, claim, attempts, max_attempts, reason, error,
            created_at, message)
    SELECT nextval(pg_get_serial_sequence(%(job_table)s, 'id')),
           coalesce(src.queue, %(queue)s::text), coalesce(src.priority, %(priority)s::smallint),
           coalesce(src.task, %(task)s::text), coalesce(src.claim, %(claim)s::int, 0),
           coalesce(src.attempts, %(attempts)s::int),
           coalesce(src.max_attempts, %(max_attempts)s::int),
           %(reason)s::text, %(error)s::jsonb, coalesce(src.created_at, now()),
           coalesce(src.message, %(message)s::json)
      FROM (SELECT) AS one
      LEFT JOIN src ON true
    RETURNING id, queue
)
SELECT id FROM dead;

-- name: admin_limits :many
-- Concurrency keys: slots held (by running messages, their leases lapsed or not: a slot is free
-- once a keeper rescued its holder, as the admission counts it), the cap they were taken
-- under, the ids holding them, and the messages parked on the key with the age of the oldest.
-- %(prefix)s NULL: every key. At most %(limit)s keys, busiest first. %(bound)s (NULL: exact)
-- bounds the parked messages read per key: the keys are found by skipping through the parking
-- index (one probe per key), and each is counted up to %(bound)s + 1 in claim order, the oldest
-- age taken among those (the dashboard, on a flood of one key).
WITH RECURSIVE held AS (
    SELECT sl.limit_key,
           count(*) FILTER (WHERE h.state = 'running') AS held,
           max(sl.cap) AS cap,
           array_agg(sl.job_id ORDER BY sl.slot)
               FILTER (WHERE h.state = 'running') AS holders
      FROM {schema}.pgjobs_slot AS sl
      LEFT JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id AND h.claim = sl.claim
     GROUP BY sl.limit_key
    HAVING count(*) FILTER (WHERE h.state = 'running') > 0
), parked_keys AS (
    (SELECT j.waiting_on FROM {schema}.pgjobs_job AS j
      WHERE j.state = 'waiting' ORDER BY j.waiting_on LIMIT 1)
    UNION ALL
    SELECT (SELECT j.waiting_on FROM {schema}.pgjobs_job AS j
             WHERE j.state = 'waiting' AND j.waiting_on > k.waiting_on
             ORDER BY j.waiting_on LIMIT 1)
      FROM parked_keys AS k
     WHERE k.waiting_on IS NOT NULL
), waiting AS (
    SELECT k.waiting_on AS limit_key, c.waiting, c.oldest_waiting_age
      FROM parked_keys AS k
     CROSS JOIN LATERAL (
        SELECT count(*) AS waiting,
               extract(epoch FROM now() - min(p.created_at))::float8 AS oldest_waiting_age
          FROM (SELECT j.created_at FROM {schema}.pgjobs_job AS j
                 WHERE j.state = 'waiting' AND j.waiting_on = k.waiting_on
                 ORDER BY j.priority DESC, j.run_at, j.id
                 LIMIT %(bound)s::int + 1) AS p
     ) AS c
     WHERE k.waiting_on IS NOT NULL
)
SELECT limit_key AS key, coalesce(h.held, 0) AS held, h.cap,
       coalesce(h.holders, '{{}}') AS holders,
       coalesce(w.waiting, 0) AS waiting, w.oldest_waiting_age
  FROM held AS h
  FULL JOIN waiting AS w USING (limit_key)
 WHERE %(prefix)s::text IS NULL OR starts_with(limit_key, %(prefix)s)
 ORDER BY coalesce(w.waiting, 0) DESC, coalesce(h.held, 0) DESC, limit_key
 LIMIT %(limit)s;

-- name: admin_rates :many
-- Rate keys: starts admitted in the current windows (windows of the last day).
SELECT limit_key AS key, window_start, starts
  FROM {schema}.pgjobs_rate
 WHERE window_start > now() - interval '1 day'
   AND (%(prefix)s::text IS NULL OR starts_with(limit_key, %(prefix)s))
 ORDER BY limit_key, window_start DESC
 LIMIT %(limit)s;

-- name: admin_counter_series :many
-- Settled messages per queue, outcome and minute over the last %(minutes)s minutes (the
-- current, partial minute included; `ago` 0 is the current minute): the dashboard's throughput
-- chart. Reads only that window of buckets (pgjobs_counter_bucket_idx), never the job table.
SELECT queue, outcome,
       (extract(epoch FROM date_trunc('minute', now()) - bucket) / 60)::int AS ago,
       sum(n)::bigint AS n
  FROM {schema}.pgjobs_counter
 WHERE bucket >= date_trunc('minute', now()) - make_interval(mins => %(minutes)s::int - 1)
 GROUP BY queue, outcome, bucket
 ORDER BY queue, outcome, bucket;

-- name: admin_queue_stats_bounded :many
-- admin_queue_stats for a big table (the dashboard's overview): every count is read from an
-- index and stops at %(bound)s + 1 rows (that value means "more than %(bound)s"), so the
-- statement reads a bounded number of index entries per queue whatever the table holds, never
-- the whole table. Queues: the declared ones, those with dead letters, due or delayed rows
-- (skip scans of pgjobs_dead_letter_queue_idx, pgjobs_job_ready_idx and pgjobs_job_delayed_idx:
-- one probe per queue) and running or waiting rows (see held). The oldest ready age is the
-- oldest of each priority level's head in the claim index (a skip scan over the levels
-- present) and of the due rows still flagged delayed (pgjobs_job_delayed_idx). Paused as in admin_queue_stats; Admin adds the
-- settle counters from admin_counter_series.
WITH RECURSIVE due_q(queue) AS (
    (SELECT queue FROM {schema}.pgjobs_job WHERE state = 'ready' AND NOT delayed
      ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM {schema}.pgjobs_job AS j
             WHERE j.state = 'ready' AND NOT j.delayed AND j.queue > d.queue
             ORDER BY j.queue LIMIT 1)
      FROM due_q AS d WHERE d.queue IS NOT NULL
), delayed_q(queue) AS (
    (SELECT queue FROM {schema}.pgjobs_job WHERE state = 'ready' AND delayed
      ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM {schema}.pgjobs_job AS j
             WHERE j.state = 'ready' AND j.delayed AND j.queue > d.queue
             ORDER BY j.queue LIMIT 1)
      FROM delayed_q AS d WHERE d.queue IS NOT NULL
), dead_q(queue) AS (
    (SELECT queue FROM {schema}.pgjobs_dead_letter ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT x.queue FROM {schema}.pgjobs_dead_letter AS x WHERE x.queue > d.queue
             ORDER BY x.queue LIMIT 1)
      FROM dead_q AS d WHERE d.queue IS NOT NULL
), held AS (
    -- running and waiting rows have no index led by queue: one pass over each state's partial
    -- index (a flood parked on one key must not be read once per queue), at most 10 x
    -- %(bound)s running rows (leases: as many as the workers' slots) and %(bound)s + 1 waiting
    -- ones in all; past that the counts are lower bounds (running_more, waiting_more)
    SELECT queue, state, count(*) AS n, sum(count(*)) OVER (PARTITION BY state) AS seen
      FROM ((SELECT queue, state FROM {schema}.pgjobs_job WHERE state = 'running'
              ORDER BY lease_expires_at  -- pgjobs_job_lease_idx's order: never the table
              LIMIT %(bound)s::int * 10)
            UNION ALL
            (SELECT queue, state FROM {schema}.pgjobs_job WHERE state = 'waiting'
              ORDER BY waiting_on, priority DESC, run_at, id  -- pgjobs_job_waiting_idx's
              LIMIT %(bound)s::int + 1)) AS h
     GROUP BY queue, state
), names AS (
    SELECT name FROM {schema}.pgjobs_queue
    UNION SELECT queue FROM due_q WHERE queue IS NOT NULL
    UNION SELECT queue FROM delayed_q WHERE queue IS NOT NULL
    UNION SELECT queue FROM dead_q WHERE queue IS NOT NULL
    UNION SELECT queue FROM held
)
SELECT n.name AS queue,
       least(%(bound)s::int + 1,
             (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                                     WHERE j.queue = n.name AND j.state = 'ready'
                                       AND NOT j.delayed AND j.run_at <= now()
                                     -- the index's order: never a scan of the table
                                     ORDER BY j.priority DESC, j.run_at, j.id
                                     LIMIT %(bound)s::int + 1) AS r)
             + (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                                       WHERE j.queue = n.name AND j.state = 'ready'
                                         AND j.delayed AND j.run_at <= now()
                                       ORDER BY j.run_at
                                       LIMIT %(bound)s::int + 1) AS r)) AS ready,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                               WHERE j.queue = n.name AND j.state = 'ready' AND j.delayed
                                 AND j.run_at > now()
                               ORDER BY j.run_at
                               LIMIT %(bound)s::int + 1) AS r) AS delayed,
       least(%(bound)s::int + 1, coalesce((SELECT h.n FROM held AS h
                                            WHERE h.queue = n.name AND h.state = 'running'), 0)
             ) AS running,
       least(%(bound)s::int + 1, coalesce((SELECT h.n FROM held AS h
                                            WHERE h.queue = n.name AND h.state = 'waiting'), 0)
             ) AS waiting,
       coalesce((SELECT max(h.seen) FROM held AS h WHERE h.state = 'running'), 0)
           >= %(bound)s::int * 10 AS running_more,
       coalesce((SELECT max(h.seen) FROM held AS h WHERE h.state = 'waiting'), 0)
           > %(bound)s::int AS waiting_more,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_dead_letter AS x
                               WHERE x.queue = n.name
                               ORDER BY x.died_at
                               LIMIT %(bound)s::int + 1) AS r) AS dead,
       coalesce(q.paused, false) AS paused,
       extract(epoch FROM now() - least(
           (SELECT min(h.run_at)
              FROM (WITH RECURSIVE levels(p) AS (
                        (SELECT priority FROM {schema}.pgjobs_job
                          WHERE queue = n.name AND state = 'ready' AND NOT delayed
                          ORDER BY priority DESC LIMIT 1)
                        UNION ALL
                        SELECT (SELECT j.priority FROM {schema}.pgjobs_job AS j
                                 WHERE j.queue = n.name AND j.state = 'ready' AND NOT j.delayed
                                   AND j.priority < l.p
                                 ORDER BY j.priority DESC LIMIT 1)
                          FROM levels AS l WHERE l.p IS NOT NULL)
                    SELECT (SELECT j.run_at FROM {schema}.pgjobs_job AS j
                             WHERE j.queue = n.name AND j.state = 'ready' AND NOT j.delayed
                               AND j.priority = l.p AND j.run_at <= now()
                             ORDER BY j.priority DESC, j.run_at LIMIT 1) AS run_at
                      FROM levels AS l WHERE l.p IS NOT NULL) AS h),
           (SELECT min(j.run_at) FROM {schema}.pgjobs_job AS j
             WHERE j.queue = n.name AND j.state = 'ready' AND j.delayed
               AND j.run_at <= now())))::float8 AS oldest_ready_age
  FROM names AS n
  LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = n.name
 ORDER BY n.name;
