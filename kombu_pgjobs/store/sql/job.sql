-- name: job_insert :exec
-- Publish one message. The queue's x-message-ttl applies unless the message has its own
-- expiration. A message due later is flagged delayed (out of the claim index until due). The
-- insert trigger sends one NOTIFY for the queue.
INSERT INTO {schema}.pgjobs_job
       (queue, priority, run_at, delayed, expires_at, max_attempts, task, limits, limit_key,
        message, tenant)
SELECT %(queue)s, %(priority)s, coalesce(%(run_at)s, now()),
       coalesce(%(run_at)s > now(), false),
       now() + make_interval(secs => coalesce(%(ttl_ms)s, q.message_ttl_ms) / 1000.0),
       %(max_attempts)s, %(task)s, %(limits)s::jsonb,
       %(limits)s::jsonb -> 'concurrency' -> 0 ->> 'key', %(message)s, %(tenant)s
  FROM (SELECT) AS one
  LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = %(queue)s;

-- name: job_insert_many :exec
-- Publish many messages in one statement (the batch path): one row per array element.
-- Text arrays are sent in binary: no per-element quoting of JSON on the client. Ids follow
-- the order of the batch (ORDER BY the ordinality), so FIFO holds within a batch.
INSERT INTO {schema}.pgjobs_job
       (queue, priority, run_at, delayed, expires_at, max_attempts, task, limits, limit_key,
        message, tenant)
SELECT m.queue, m.priority, coalesce(m.run_at, now()), coalesce(m.run_at > now(), false),
       now() + make_interval(secs => coalesce(m.ttl_ms, q.message_ttl_ms) / 1000.0),
       m.max_attempts, m.task, m.limits::jsonb, m.limits::jsonb -> 'concurrency' -> 0 ->> 'key',
       m.message, m.tenant
  FROM unnest(%(queue)b::text[], %(priority)s::smallint[], %(run_at)s::timestamptz[],
              %(ttl_ms)s::float8[], %(max_attempts)s::int[], %(task)b::text[],
              %(limits)b::text[], %(message)b::text[]::json[], %(tenant)b::text[])
       WITH ORDINALITY
       AS m(queue, priority, run_at, ttl_ms, max_attempts, task, limits, message, tenant, n)
  LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = m.queue
 ORDER BY m.n;

-- name: job_insert_fanout :exec
-- Publish one message to every queue bound to a fanout exchange (one row per queue).
INSERT INTO {schema}.pgjobs_job
       (queue, priority, run_at, delayed, expires_at, max_attempts, task, limits, limit_key,
        message, tenant)
SELECT b.queue, %(priority)s, coalesce(%(run_at)s, now()),
       coalesce(%(run_at)s > now(), false),
       now() + make_interval(secs => coalesce(%(ttl_ms)s, q.message_ttl_ms) / 1000.0),
       %(max_attempts)s, %(task)s, %(limits)s::jsonb,
       %(limits)s::jsonb -> 'concurrency' -> 0 ->> 'key', %(message)s, %(tenant)s
  FROM (SELECT DISTINCT queue FROM {schema}.pgjobs_binding WHERE exchange = %(exchange)s) AS b
  LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = b.queue;

-- name: job_insert_guarded :many
-- Publish messages that carry an idempotency key or a tenant queue cap (one or a batch, one
-- statement): see pgjobs_publish_guarded_v1 in 0007_idempotency_tenant_cap.sql. Returns
-- (n, id, holder_id, holder_task_id) per keyed message; raises SQLSTATE PJ506 (nothing
-- written) when a tenant's cap would be exceeded.
SELECT g.n, g.id, g.holder_id, g.holder_task_id
  FROM {schema}.pgjobs_publish_guarded_v1(
           %(queue)b::text[], %(priority)s::smallint[], %(run_at)s::timestamptz[],
           %(ttl_ms)s::float8[], %(max_attempts)s::int[], %(task)b::text[], %(limits)b::text[],
           %(message)b::text[]::json[], %(tenant)b::text[], %(key)b::text[],
           %(max_queued)s::int[], %(task_id)b::text[], %(channel)s, %(async)s) AS g;

-- name: job_claim :many
-- Settle buffered acks and claim up to %(n)s due messages, in one round trip. {limit} is %(n)s
-- written into the text (one prepared statement per window size): a generic plan that knows
-- its LIMIT reads the claim index in order at any depth, and saves planning on every claim.
-- Returns kind 'c' rows (claimed: id, claim, queue, message), kind 'a' rows (acks that hit
-- their fence), kind 'u' rows (acks left held: their key's lock was busy), kind 'h' rows (held
-- back by a limit: id, on_key and, as message, the verdict: parked, refused, later or busy),
-- and, when fewer than %(n)s were claimed, none was held back and the acks' releases woke no
-- parked row, one kind 'n' row whose due_in is the number of seconds until a delayed message
-- of these queues is due (NULL if none).
-- Limits: a candidate with limits is admitted by pgjobs_admit_v2, which takes its slots, or
-- parks it ('waiting'), refuses it into the dead letters (when_busy 'fail') or defers it to its
-- rate's next window itself; none of these counts an attempt. It is given every candidate's
-- id: parking a flood of a full key never touches a candidate (the claim's UPDATE must find
-- the rows it admits unchanged), and parks only rows the key is full for under their own cap
-- (a deploy that changed a cap leaves old and new messages of one key side by side). An acked row that holds slots
-- (limit_key set: the row says so, the caller need not know) has them released first, before
-- any candidate is admitted, so a candidate sees them free. A claim (%(n)s > 0) never waits
-- for a key's lock: the acks of a busy key are left held and returned as 'u' rows, for the
-- caller to settle with %(n)s = 0, which waits.
-- Waiting (0017_wake_one.sql): when the claim drains, the queues in %(register)s are registered
-- as waited on by consumer %(waiter)s (NULL: a consumer that polls), and the wake lock of each
-- queue in %(barrier)s is tried; then one kind 'w' row says whether every try got its lock
-- (id 1: no publish to those queues was in flight, id 0: one was). A registration with
-- %(hand_off)s names this consumer's worker and lease TTL: a publish claims its message for the
-- consumer and the wake-up carries it (0018_hand_off.sql).
WITH given AS (
    -- The fenced acks, read once: which of them hold slots, and under which keys. Read by
    -- primary key only (the id array), and `state IS NOT DISTINCT FROM 'running'` (state is
    -- NOT NULL: the same test as `=`) does not match the lease index's predicate: through that
    -- index the claim's generic plan read every running row, dead entries included, which
    -- pile up between vacuums during a drain (test_claim_wire.py).
    SELECT j.id, j.claim, j.limits -> 'concurrency' AS caps
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = ANY (%(ack_ids)s::bigint[])
       AND (j.id, j.claim) IN (SELECT * FROM unnest(%(ack_ids)s::bigint[], %(ack_claims)s::int[]))
       AND j.state IS NOT DISTINCT FROM 'running'
), released AS (
    SELECT r.id, r.claim
      FROM (SELECT array_agg(g.id) AS ids, array_agg(g.claim) AS claims,
                   array_agg(e.value ->> 'key') AS keys
              FROM given AS g
             CROSS JOIN LATERAL jsonb_array_elements(g.caps) AS e
             WHERE g.caps IS NOT NULL
            HAVING count(*) > 0) AS x
     CROSS JOIN LATERAL {schema}.pgjobs_release_v1(x.ids, x.claims, x.keys, %(channel)s,
                                                   %(n)s = 0) AS r
), settling AS (
    -- The acks to delete now: those holding no slots, and those whose slots were released.
    SELECT id, claim FROM given WHERE caps IS NULL
    UNION ALL
    SELECT id, claim FROM released
), acked AS (
    -- Fenced ack: only the holder of this exact claim, still running, may delete the row
    -- (read by primary key only, as given is).
    DELETE FROM {schema}.pgjobs_job AS j
     WHERE j.id = ANY (ARRAY(SELECT id FROM settling))
       AND (j.id, j.claim) IN (SELECT id, claim FROM settling)
       AND j.state IS NOT DISTINCT FROM 'running'
    RETURNING j.id, j.queue, j.claim, j.task, j.tenant, j.attempts, j.worker, j.claimed_at,
              -- the word the acking process noted for the run (%(hint_ids)s, %(hint_words)s:
              -- a Celery retry is 'requeued'), else the row's (job_outcome), else completed
              coalesce((SELECT h.word
                          FROM unnest(%(hint_ids)s::bigint[], %(hint_words)s::text[])
                               AS h(id, word)
                         WHERE h.id = j.id LIMIT 1),
                       j.outcome, 'completed') AS outcome
), acked_count AS (
    -- The settle counter moves in the statement that settles (one shard per process), under
    -- the run's outcome: completed, unless its worker said failed or dropped (job_outcome).
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, outcome, date_trunc('minute', now()), %(worker)s, count(*)
      FROM acked GROUP BY queue, outcome
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
), acked_history AS (
    -- One history row per ack (0025_history.sql), unless the history option is off.
    INSERT INTO {schema}.pgjobs_history
           (job_id, claim, task, queue, tenant, outcome, runtime, attempts, worker)
    SELECT id, claim, task, queue, tenant, outcome,
           extract(epoch FROM now() - claimed_at), attempts, worker
      FROM acked
     WHERE %(history)s
), epoch AS MATERIALIZED (
    -- The failover fence (0022_outage_leases.sql): claims number their rows above this base,
    -- moved up once per server start by pgjobs_fence_epoch_v2, which is called only when the
    -- recorded start is not this server's (one row read otherwise).
    SELECT coalesce((SELECT e.base FROM {schema}.pgjobs_epoch AS e
                      WHERE e.id AND e.started = pg_postmaster_start_time()),
                    {schema}.pgjobs_fence_epoch_v2()) AS base
), candidates AS (
    -- Per queue (so each queue's index order is used), the best due rows nobody holds: from
    -- the claim index (rows not flagged delayed, read in claim order), and from the delayed
    -- index the flagged rows already due (few: the keeper clears the flag of due rows), merged
    -- in claim order. Rows not yet due are in neither path (see 0006_delayed.sql).
    SELECT c.id, c.queue, c.priority, c.run_at, c.claim, c.limits
      FROM unnest(%(queues)s::text[]) AS wanted(name)
      LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = wanted.name
     CROSS JOIN LATERAL (
            SELECT * FROM (
             SELECT j.id, j.queue, j.priority, j.run_at, j.claim, j.limits
               FROM {schema}.pgjobs_job AS j
              WHERE j.queue = wanted.name
                AND j.state = 'ready' AND NOT j.delayed
                AND j.run_at <= now()
                AND (j.expires_at IS NULL OR j.expires_at > now())
              ORDER BY j.priority DESC, j.run_at, j.id
              LIMIT {limit}
                FOR UPDATE SKIP LOCKED) AS undelayed
            UNION ALL
            SELECT * FROM (
             SELECT j.id, j.queue, j.priority, j.run_at, j.claim, j.limits
               FROM {schema}.pgjobs_job AS j
              WHERE j.queue = wanted.name
                AND j.state = 'ready' AND j.delayed
                AND j.run_at <= now()
                AND (j.expires_at IS NULL OR j.expires_at > now())
              ORDER BY j.priority DESC, j.run_at, j.id
              LIMIT {limit}
                FOR UPDATE SKIP LOCKED) AS due_delayed
           ) AS c
     WHERE q.paused IS NOT TRUE
       AND (SELECT count(*) FROM released) >= 0  -- slots are released before any admission
     ORDER BY c.priority DESC, c.run_at, c.id
     LIMIT {limit}
), admitted AS MATERIALIZED (
    -- In claim order; rows without limits never call the function. A held-back row was
    -- parked, deferred or refused by the function itself (see 0003_limits.sql and
    -- 0005_admit_mixed_caps.sql).
    SELECT c.id, CASE WHEN c.limits IS NOT NULL
                      THEN {schema}.pgjobs_admit_v2(c.id,
                                                    greatest(c.claim, (SELECT base FROM epoch)) + 1,
                                                    c.queue, c.limits,
                                                    %(channel)s, %(worker)s,
                                                    (SELECT array_agg(o.id)
                                                       FROM candidates AS o))
                 END AS v
      FROM candidates AS c
     ORDER BY c.priority DESC, c.run_at, c.id
), claimed AS (
    -- Take the lease: bump the fence, count the attempt, name the holder. The rows are read
    -- by primary key from an array: joined to admitted, a generic plan made while the
    -- table's statistics said it was empty (a VACUUM of the empty table sets them so) read
    -- the whole table per claim, through a nested loop.
    UPDATE {schema}.pgjobs_job AS j
       SET state = 'running',
           delayed = false,
           claim = greatest(j.claim, (SELECT base FROM epoch)) + 1,
           attempts = j.attempts + 1,
           lease_expires_at = now() + make_interval(secs => %(ttl)s),
           worker = %(worker)s,
           claimed_at = now(),
           outcome = NULL
     WHERE j.id = ANY (ARRAY(SELECT a.id FROM admitted AS a
                              WHERE a.v IS NULL OR (a.v).verdict = 'ok'))
    RETURNING j.id, j.claim, j.queue, j.priority, j.run_at, j.message
), drained AS (
    -- Fewer claimed than asked and nothing held back: these queues are empty for now.
    SELECT (SELECT count(*) FROM claimed) < %(n)s
       AND NOT EXISTS (SELECT 1 FROM admitted AS a WHERE (a.v).verdict <> 'ok')
       -- The acks' release woke rows parked on their keys, which this statement's snapshot
       -- cannot see: the queues are not drained (the caller claims again and takes them).
       AND NOT EXISTS (SELECT 1
                         FROM given AS g
                         JOIN released AS r ON r.id = g.id AND r.claim = g.claim
                        CROSS JOIN LATERAL jsonb_array_elements(g.caps) AS e
                         JOIN {schema}.pgjobs_job AS w
                           ON w.state = 'waiting' AND w.waiting_on = e.value ->> 'key')
       AS yes
), waiting AS (
    INSERT INTO {schema}.pgjobs_waiter (queue, waiter, worker, lease_ttl)
    SELECT wanted.name, %(waiter)s::bigint, %(worker)s,
           CASE WHEN %(hand_off)s THEN %(ttl)s::float8 END
      FROM unnest(%(register)s::text[]) AS wanted(name)
     WHERE %(waiter)s::bigint IS NOT NULL AND (SELECT yes FROM drained)
    ON CONFLICT DO NOTHING
)
SELECT 'c' AS kind, id, claim, queue, message::text AS message, NULL::float8 AS due_in,
       NULL::text AS on_key
  FROM (SELECT * FROM claimed ORDER BY priority DESC, run_at, id) AS ordered
UNION ALL
SELECT 'a', id, NULL, queue, NULL, NULL, NULL FROM acked
UNION ALL
SELECT 'u', g.id, g.claim, NULL, NULL, NULL, NULL
  FROM given AS g
 WHERE g.caps IS NOT NULL AND NOT EXISTS (SELECT 1 FROM released AS r WHERE r.id = g.id)
UNION ALL
SELECT 'h', a.id, NULL, NULL, (a.v).verdict, NULL, (a.v).on_key
  FROM admitted AS a WHERE (a.v).verdict <> 'ok'
UNION ALL
SELECT 'n', NULL, NULL, NULL, NULL,
       -- the first entry after now() of each queue in the delayed index
       (SELECT extract(epoch FROM min(d.run_at) - now())::float8
          FROM unnest(%(queues)s::text[]) AS wanted(name)
         CROSS JOIN LATERAL (
                SELECT j.run_at FROM {schema}.pgjobs_job AS j
                 WHERE j.queue = wanted.name AND j.state = 'ready' AND j.delayed
                   AND j.run_at > now()
                 ORDER BY j.run_at
                 LIMIT 1) AS d),
       NULL
 WHERE (SELECT yes FROM drained)
UNION ALL
-- Tried exclusively (never waiting) and held to this commit: a publisher that reads the
-- registrations after this point waits for the commit and sees them. A row lock on
-- pgjobs_lock (0021_trust_boundary.sql): a role outside the app cannot hold it.
SELECT 'w', (count(*) = (SELECT count(DISTINCT hashtext(%(schema_name)s || '.' || b.name) & 1023)
                          FROM unnest(%(barrier)s::text[]) AS b(name)))::int,
       NULL, NULL, NULL, NULL, NULL
  FROM (SELECT 1 FROM {schema}.pgjobs_lock AS l
         WHERE l.class = 'wake'
           AND l.bucket = ANY (ARRAY(SELECT hashtext(%(schema_name)s || '.' || b.name) & 1023
                                       FROM unnest(%(barrier)s::text[]) AS b(name)))
           AND %(waiter)s::bigint IS NOT NULL AND (SELECT yes FROM drained)
           FOR UPDATE SKIP LOCKED) AS got
HAVING %(waiter)s::bigint IS NOT NULL AND cardinality(%(barrier)s::text[]) > 0
   AND (SELECT yes FROM drained);

-- name: job_requeue :many
-- Fenced requeue (basic_reject requeue=True, warm-shutdown restore). When %(uncount)s, the
-- delivery does not count as an attempt (the message never started). A message on its final
-- attempt is dead-lettered instead (reason max_attempts), and a cancelled one too (reason
-- cancelled), so a task that requeues itself forever, or a cancelled one, cannot come back.
-- NOTIFY wakes consumers. Each settled delivery is counted under its outcome (requeued,
-- failed, cancelled) and, with %(history)s, recorded in pgjobs_history, but for an uncounted
-- hand-back (a message that never started: no run to record). Returns (id, outcome).
WITH held AS (
    SELECT j.id, j.claim, j.limits, j.limit_key IS NOT NULL AS limited,
           CASE WHEN j.cancelled_at IS NOT NULL THEN 'cancelled'
                WHEN NOT %(uncount)s
                     AND j.attempts >= coalesce(j.max_attempts, %(max_attempts)s) THEN 'failed'
                ELSE 'requeued' END AS outcome
      FROM {schema}.pgjobs_job AS j
      JOIN unnest(%(ids)s::bigint[], %(claims)s::int[]) AS a(id, claim)
        ON j.id = a.id AND j.claim = a.claim
     WHERE j.state = 'running'
       FOR UPDATE OF j
), back AS (
    UPDATE {schema}.pgjobs_job AS j
       SET state = 'ready',
           attempts = CASE WHEN %(uncount)s THEN greatest(j.attempts - 1, 0) ELSE j.attempts END,
           lease_expires_at = NULL,
           worker = NULL,
           -- a message that never started keeps its place in the claim order
           run_at = CASE WHEN %(uncount)s THEN least(j.run_at, now()) ELSE now() END,
           delayed = false
      FROM held
     WHERE j.id = held.id AND held.outcome = 'requeued'
    RETURNING j.id, j.queue
), removed AS (
    DELETE FROM {schema}.pgjobs_job AS j
     USING held
     WHERE j.id = held.id AND held.outcome <> 'requeued'
    RETURNING j.*, held.outcome AS verdict
), dead AS (
    INSERT INTO {schema}.pgjobs_dead_letter
           (id, queue, priority, task, claim, attempts, max_attempts, reason, error,
            created_at, message, run_at, expires_at, worker)
    SELECT id, queue, priority, task, claim, attempts, max_attempts,
           CASE verdict WHEN 'failed' THEN 'max_attempts' ELSE 'cancelled' END,
           CASE verdict
                WHEN 'failed' THEN jsonb_build_object('type', 'MaxAttemptsExceeded',
                                                    'message', 'requeued on its final attempt')
                ELSE jsonb_build_object('type', 'Cancelled',
                                        'message', 'cancelled while running; its holder '
                                                   || 'requeued it') END,
           created_at, message, run_at, expires_at, worker
      FROM removed
), released AS (
    -- Slots of limited messages are freed (and their parked rows woken) in the same statement.
    SELECT {schema}.pgjobs_release_jobs_v1(array_agg(id), array_agg(claim),
                                           array_agg(limits), %(channel)s) AS n
      FROM held WHERE limited HAVING count(*) > 0
), settled AS (
    SELECT id, queue, 'requeued' AS outcome FROM back
    UNION ALL
    SELECT id, queue, verdict FROM removed
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, outcome, date_trunc('minute', now()), %(worker)s, count(*)
      FROM settled GROUP BY queue, outcome
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
), recorded AS (
    INSERT INTO {schema}.pgjobs_history
           (job_id, claim, task, queue, tenant, outcome, runtime, attempts, worker)
    SELECT j.id, j.claim, j.task, j.queue, j.tenant, h.outcome,
           extract(epoch FROM now() - j.claimed_at), j.attempts, j.worker
      FROM held AS h
      JOIN {schema}.pgjobs_job AS j ON j.id = h.id
     WHERE %(history)s AND NOT (%(uncount)s AND h.outcome = 'requeued')
)
SELECT id, outcome,
       CASE WHEN outcome = 'requeued' THEN pg_notify(%(channel)s, queue) IS NULL END
  FROM settled, (SELECT count(*) FROM released) AS r;

-- name: job_bury :many
-- Fenced dead-lettering (basic_reject requeue=False): the row moves to pgjobs_dead_letter with
-- its reason and error, in one statement; a row an operator cancelled goes with reason
-- 'cancelled' (counted so), whatever the caller's reason; any other counts 'failed'. With
-- %(history)s, each is recorded in pgjobs_history.
WITH dead AS (
    DELETE FROM {schema}.pgjobs_job AS j
     USING unnest(%(ids)s::bigint[], %(claims)s::int[]) AS a(id, claim)
     WHERE j.id = a.id AND j.claim = a.claim AND j.state = 'running'
    RETURNING j.*
), released AS (
    SELECT {schema}.pgjobs_release_jobs_v1(array_agg(id), array_agg(claim),
                                           array_agg(limits), %(channel)s) AS n
      FROM dead WHERE limit_key IS NOT NULL HAVING count(*) > 0
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, CASE WHEN cancelled_at IS NULL THEN 'failed' ELSE 'cancelled' END,
           date_trunc('minute', now()), %(worker)s, count(*)
      FROM dead GROUP BY queue, cancelled_at IS NULL
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
), recorded AS (
    INSERT INTO {schema}.pgjobs_history
           (job_id, claim, task, queue, tenant, outcome, runtime, attempts, worker)
    SELECT id, claim, task, queue, tenant,
           CASE WHEN cancelled_at IS NULL THEN 'failed' ELSE 'cancelled' END,
           extract(epoch FROM now() - claimed_at), attempts, worker
      FROM dead
     WHERE %(history)s
)
INSERT INTO {schema}.pgjobs_dead_letter
       (id, queue, priority, task, claim, attempts, max_attempts, reason, error, created_at,
        message, run_at, expires_at, worker)
SELECT id, queue, priority, task, claim, attempts, max_attempts,
       CASE WHEN cancelled_at IS NULL THEN %(reason)s ELSE 'cancelled' END,
       CASE WHEN cancelled_at IS NULL THEN %(error)s
            ELSE jsonb_build_object('type', 'Cancelled', 'message', 'cancelled while running')
       END,
       created_at, message, run_at, expires_at, worker
  FROM dead, (SELECT count(*) FROM released) AS r
RETURNING id;

-- name: job_renew :many
-- Fenced lease renewal of every message this process holds. A lapsed lease is revived while
-- the row is still running under the holder's claim number: nobody else can hold it (a rescue
-- puts it back to ready, and any later claim numbers it anew), and the holder may only have
-- been unable to reach the database (an outage longer than the lease: docs/delivery.md).
-- Returns (id, cancelled): a message an operator cancelled while it runs (admin_cancel) is
-- still renewed, and its holder ends the run.
UPDATE {schema}.pgjobs_job AS j
   SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
  FROM unnest(%(ids)s::bigint[], %(claims)s::int[]) AS h(id, claim)
 WHERE j.id = h.id AND j.claim = h.claim AND j.state = 'running'
RETURNING j.id, j.cancelled_at IS NOT NULL;

-- name: job_maintain :many
-- The keeper's tick, one round trip for everything periodic:
--  * lapsed leases: a row with attempts left goes back to ready (and wakes its consumers); a
--    row on its final attempt is buried as dead, never handed out again;
--  * expired ready messages (x-message-ttl, per-message expiration) are dropped;
--  * delayed rows of the queues this process consumes that are now due are moved into the
--    claim index (their delayed flag cleared; see 0006_delayed.sql);
--  * queues this process consumes are marked in use (x-expires), and the process is recorded
--    as a live consumer (pgjobs_consumer; rows unseen for 3 ticks are dropped); a consumed
--    queue found undeclared is returned ('queue_missing') for the keeper to declare again;
--  * queues unused past their x-expires (at least %(grace)s seconds, so a live consumer's touch
--    always lands first) are dropped with their bindings and ready messages;
--  * limits: a key with parked rows and no running holder gets one row woken (a safety net:
--    releases wake parked rows themselves); rate windows older than 2 days go;
--    free slot rows untaken for an hour go; without autovacuum, a 'vacuum' row asks the keeper
--    to vacuum the job table. Slots are not
--    released here: a release waits for key locks, which must not happen while this statement
--    holds lapsed rows' locks. A 'release' row says job_release_orphans has work.
-- Each step is bounded by %(limit)s rows. Returns (outcome, id, queue) rows for logging.
-- What judges other processes gone — lapsed leases, consumers unseen, queues unused — waits
-- until they had a full lease (%(ttl)s s) of reachable database time to show they are not:
-- %(fleet)s says this keeper has reached the database for that long without a break, and the
-- server must have run that long (an outage longer than a lease is nobody's lapse; see
-- docs/delivery.md). Until then a tick renews, settles and upkeeps only.
WITH fleet AS MATERIALIZED (
    SELECT %(fleet)s::boolean
           AND pg_postmaster_start_time() < now() - make_interval(secs => %(ttl)s) AS judge
), lapsed AS (
    SELECT j.id, j.limit_key IS NOT NULL AS limited
      FROM {schema}.pgjobs_job AS j
     WHERE j.state = 'running' AND j.lease_expires_at < now()
       AND (SELECT judge FROM fleet)
     ORDER BY j.lease_expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), buried AS (
    -- Final attempt, or cancelled by an operator: it does not come back.
    DELETE FROM {schema}.pgjobs_job AS j
     USING lapsed
     WHERE j.id = lapsed.id
       AND (j.attempts >= coalesce(j.max_attempts, %(max_attempts)s)
            OR j.cancelled_at IS NOT NULL)
    RETURNING j.*
), dead AS (
    INSERT INTO {schema}.pgjobs_dead_letter
           (id, queue, priority, task, claim, attempts, max_attempts, reason, error,
            created_at, message, run_at, expires_at, worker)
    SELECT id, queue, priority, task, claim, attempts, max_attempts,
           CASE WHEN cancelled_at IS NULL THEN 'lease_expired_final_attempt'
                ELSE 'cancelled' END,
           CASE WHEN cancelled_at IS NULL
                THEN jsonb_build_object('type', 'LeaseExpired',
                                        'message', 'lease lapsed on the final attempt (held by '
                                                   || coalesce(worker, '?') || ')')
                ELSE jsonb_build_object('type', 'Cancelled',
                                        'message', 'cancelled while running; its lease lapsed')
           END,
           created_at, message, run_at, expires_at, worker
      FROM buried
    RETURNING id, queue, reason
), recorded AS (
    -- A lapsed run buried is settled: recorded (runtime to the lease's end) with %(history)s.
    INSERT INTO {schema}.pgjobs_history
           (job_id, claim, task, queue, tenant, outcome, runtime, attempts, worker)
    SELECT id, claim, task, queue, tenant,
           CASE WHEN cancelled_at IS NULL THEN 'failed' ELSE 'cancelled' END,
           extract(epoch FROM lease_expires_at - claimed_at), attempts, worker
      FROM buried
     WHERE %(history)s
), requeued AS (
    UPDATE {schema}.pgjobs_job AS j
       SET state = 'ready', lease_expires_at = NULL, worker = NULL, delayed = false
      FROM lapsed
     WHERE j.id = lapsed.id AND j.attempts < coalesce(j.max_attempts, %(max_attempts)s)
       AND j.cancelled_at IS NULL
    RETURNING j.id, j.queue
), stranded AS (
    UPDATE {schema}.pgjobs_job AS j
       SET state = 'ready', waiting_on = NULL
     WHERE j.id IN (
            SELECT DISTINCT ON (w.waiting_on) w.id
              FROM {schema}.pgjobs_job AS w
             WHERE w.state = 'waiting'
               AND NOT EXISTS (
                    SELECT 1
                      FROM {schema}.pgjobs_slot AS sl
                      JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id AND h.claim = sl.claim
                     WHERE sl.limit_key = w.waiting_on AND h.state = 'running')
             ORDER BY w.waiting_on, w.priority DESC, w.run_at, w.id
             LIMIT %(limit)s)
       AND j.state = 'waiting'
    RETURNING j.id, j.queue
), untaken AS (
    -- Hand-offs never taken (their wake-up was lost with the consumer's session; the
    -- message comes back when its lease lapses): the records go after 10 minutes.
    DELETE FROM {schema}.pgjobs_handoff
     WHERE job_id IN (SELECT h.job_id FROM {schema}.pgjobs_handoff AS h
                       WHERE h.since < now() - interval '10 minutes'
                       LIMIT %(limit)s)
), promoted AS (
    -- Delayed rows now due, of the queues this process consumes, move into the claim index
    -- (the claim takes them from the delayed index meanwhile, so this is upkeep, not a wake-up:
    -- no NOTIFY). Rows a claim holds are skipped. Up to ten times the usual batch: until they
    -- move, every claim sorts all due delayed rows (a burst of tasks with one countdown).
    UPDATE {schema}.pgjobs_job AS j
       SET delayed = false
      FROM (SELECT d.id
              FROM unnest(%(consumed)s::text[]) AS q(name)
             CROSS JOIN LATERAL (
                    SELECT x.id FROM {schema}.pgjobs_job AS x
                     WHERE x.queue = q.name AND x.state = 'ready' AND x.delayed
                       AND x.run_at <= now()
                     ORDER BY x.run_at
                     LIMIT 10 * %(limit)s
                       FOR UPDATE SKIP LOCKED) AS d) AS due
     WHERE j.id = due.id
), old_slots AS (
    -- Free slot rows untaken for an hour (a key nobody uses any more), under the key's lock.
    DELETE FROM {schema}.pgjobs_slot AS sl
     WHERE (sl.limit_key, sl.slot) IN (
            SELECT f.limit_key, f.slot FROM {schema}.pgjobs_slot AS f
             WHERE f.job_id IS NULL AND f.taken_at < now() - interval '1 hour'
             LIMIT %(limit)s)
       AND sl.job_id IS NULL
       AND {schema}.pgjobs_lock_v1('limit', ARRAY[sl.limit_key], 'try')
), old_rates AS (
    DELETE FROM {schema}.pgjobs_rate
     WHERE (limit_key, window_start) IN (
            SELECT limit_key, window_start FROM {schema}.pgjobs_rate
             WHERE window_start < now() - interval '2 days' LIMIT %(limit)s)
), expired AS (
    DELETE FROM {schema}.pgjobs_job
     WHERE id IN (SELECT id FROM {schema}.pgjobs_job
                   WHERE expires_at < now() AND state IN ('ready', 'waiting')
                   LIMIT %(limit)s)
    RETURNING id, queue
), touched AS (
    UPDATE {schema}.pgjobs_queue SET last_used_at = now()
     WHERE name = ANY(%(consumed)s::text[]) AND expires_ms IS NOT NULL
    RETURNING name
), gone AS (
    -- Unused past x-expires, counted from the server's start at the earliest (time it was
    -- down is no one's disuse), and consumed by no live consumer (a consumer's row names its
    -- queues: Celery's pidbox queue of a worker that lives is never dropped).
    DELETE FROM {schema}.pgjobs_queue AS q
     WHERE q.expires_ms IS NOT NULL
       AND greatest(q.last_used_at, pg_postmaster_start_time())
           < now() - make_interval(secs => greatest(q.expires_ms / 1000.0, %(grace)s))
       AND NOT q.name = ANY(%(consumed)s::text[])
       AND (SELECT judge FROM fleet)
       AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_consumer AS c
                        WHERE q.name = ANY(c.queues))
    RETURNING q.name
), gone_bindings AS (
    DELETE FROM {schema}.pgjobs_binding WHERE queue IN (SELECT name FROM gone)
), gone_jobs AS (
    DELETE FROM {schema}.pgjobs_job WHERE queue IN (SELECT name FROM gone) AND state = 'ready'
), seen AS (
    INSERT INTO {schema}.pgjobs_consumer AS c (worker, queues, held)
    SELECT %(worker)s, %(consumed)s::text[], %(held)s
     WHERE cardinality(%(consumed)s::text[]) > 0
    ON CONFLICT (worker) DO UPDATE
       SET queues = excluded.queues, held = excluded.held, last_seen_at = now()
), unseen AS (
    DELETE FROM {schema}.pgjobs_consumer
     WHERE greatest(last_seen_at, pg_postmaster_start_time())
           < now() - make_interval(secs => %(grace)s)
       AND worker <> %(worker)s
       AND (SELECT judge FROM fleet)
), missing AS (
    -- Queues this process consumes that are not declared (dropped by an older keeper, or by an
    -- operator): the keeper declares them again, with the bindings this process made.
    SELECT c.name FROM unnest(%(consumed)s::text[]) AS c(name)
     WHERE NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_queue AS q WHERE q.name = c.name)
), settled AS (
    SELECT queue, 'rescued' AS outcome FROM requeued
    UNION ALL SELECT queue, CASE reason WHEN 'cancelled' THEN 'cancelled' ELSE 'failed' END
                FROM dead
    UNION ALL SELECT queue, 'expired' FROM expired
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, outcome, date_trunc('minute', now()), %(worker)s, count(*)
      FROM settled GROUP BY queue, outcome
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT 'requeued' AS outcome, id, queue, pg_notify(%(channel)s, queue) IS NULL AS _
  FROM requeued
UNION ALL
SELECT 'woken', id, queue, pg_notify(%(channel)s, queue) IS NULL FROM stranded
UNION ALL
SELECT 'release', NULL, NULL, false
 WHERE EXISTS (SELECT 1 FROM lapsed WHERE limited)
    OR EXISTS (SELECT 1
                 FROM {schema}.pgjobs_slot AS sl
                 LEFT JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id AND h.claim = sl.claim
                WHERE sl.job_id IS NOT NULL AND (h.id IS NULL OR h.state <> 'running'))
UNION ALL
SELECT 'buried', id, queue, false FROM dead
UNION ALL
SELECT 'expired', id, queue, false FROM expired
UNION ALL
SELECT 'queue_expired', NULL, name, false FROM gone
UNION ALL
SELECT 'queue_missing', NULL, name, false FROM missing
UNION ALL
-- A server running without autovacuum would let a queue table's dead rows pile up without end
-- (every message is inserted, updated and deleted): then the keeper vacuums it itself.
SELECT 'vacuum', NULL, NULL, false
 WHERE current_setting('autovacuum') = 'off'
   AND (SELECT n_dead_tup FROM pg_stat_user_tables
         WHERE relid = '{schema}.pgjobs_job'::regclass) > %(vacuum_after)s;

-- name: job_release_orphans :one
-- Release slots whose holder no longer holds them (a rescued or deleted job, an ack that skipped
-- the release) and wake the rows parked on their keys. Its own transaction: it waits for key
-- locks and holds no other lock meanwhile. Returns the number of pairs released.
SELECT count(*)
  FROM (SELECT array_agg(id) AS ids, array_agg(claim) AS claims, array_agg(key) AS keys
          FROM (SELECT sl.job_id AS id, sl.claim, sl.limit_key AS key
                  FROM {schema}.pgjobs_slot AS sl
                  LEFT JOIN {schema}.pgjobs_job AS h ON h.id = sl.job_id AND h.claim = sl.claim
                 WHERE sl.job_id IS NOT NULL AND (h.id IS NULL OR h.state <> 'running')
                 LIMIT %(limit)s) AS orphaned
        HAVING count(*) > 0) AS o
 CROSS JOIN LATERAL {schema}.pgjobs_release_v1(o.ids, o.claims, o.keys, %(channel)s,
                                               true) AS r;

-- name: job_purge :one
-- Purge a queue's ready messages (running ones finish and are acked as usual).
WITH gone AS (
    DELETE FROM {schema}.pgjobs_job WHERE queue = %(queue)s AND state IN ('ready', 'waiting')
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: job_size :one
-- Deliverable messages in a queue (what kombu and Celery call the queue's size): ready (or
-- waiting for a limit), due and not expired. Delayed (ETA) messages are not counted, as on
-- RabbitMQ where they wait unacked.
SELECT count(*) FROM {schema}.pgjobs_job
 WHERE queue = %(queue)s AND state IN ('ready', 'waiting') AND run_at <= now()
   AND (expires_at IS NULL OR expires_at > now());

-- name: epoch_fence :one
-- On a new connection: a server start this schema has not fenced (a restart, a promoted
-- standby, a restore) moves the claim numbers' base up, once (0022_outage_leases.sql; a claim
-- would do it too). Returns whether this server's start was new to the schema, and the base.
SELECT (SELECT e.started = pg_postmaster_start_time()
          FROM {schema}.pgjobs_epoch AS e WHERE e.id) IS NOT TRUE AS fenced,
       {schema}.pgjobs_fence_epoch_v2() AS base;
