-- name: bulk_promote :one
-- `pgjobs bulk promote`: one batch of delayed messages (ready, run_at in the future) of a
-- selection (%(queue)s, %(task)s, %(tenant)s; NULL: any) made due now, soonest first, at most
-- %(limit)s, skipping rows another command holds. As `pgjobs requeue` of one (admin_job_make_due),
-- the stored message's Celery `eta` header is cleared. NOTIFY once per queue touched. Returns
-- (rows changed, queues woken).
WITH picked AS (
    SELECT j.id
      FROM {schema}.pgjobs_job AS j
     WHERE j.state = 'ready' AND j.run_at > now()
       AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
       AND (%(task)s::text IS NULL OR j.task = %(task)s)
       AND (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s)
     ORDER BY j.run_at, j.id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), done AS (
    UPDATE {schema}.pgjobs_job AS j
       SET run_at = now(),
           delayed = false,
           message = {schema}.pgjobs_without_eta_v1(j.message)
      FROM picked
     WHERE j.id = picked.id
    RETURNING j.queue
), woken AS (
    SELECT pg_notify(%(channel)s, queue) FROM (SELECT DISTINCT queue FROM done) AS q
)
SELECT (SELECT count(*) FROM done) AS affected, (SELECT count(*) FROM woken) AS queues;

-- name: bulk_remove :one
-- `pgjobs bulk remove`: one batch of live messages that no worker holds (states %(states)s of
-- ready = due, delayed, waiting) of a selection (as bulk_promote) deleted, oldest first, at
-- most %(limit)s, counted 'cancelled'. Running messages are never removed (cancel them by id).
WITH picked AS (
    SELECT j.id
      FROM {schema}.pgjobs_job AS j
     WHERE j.state IN ('ready', 'waiting')
       AND CASE WHEN j.state = 'waiting' THEN 'waiting'
                WHEN j.run_at > now() THEN 'delayed' ELSE 'ready' END = ANY(%(states)s::text[])
       AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
       AND (%(task)s::text IS NULL OR j.task = %(task)s)
       AND (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s)
     ORDER BY j.id
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {schema}.pgjobs_job AS j USING picked WHERE j.id = picked.id
    RETURNING j.queue
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, 'cancelled', date_trunc('minute', now()), %(shard)s, count(*)
      FROM gone GROUP BY queue
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
)
SELECT count(*) FROM gone;

-- name: bulk_count :one
-- What a bounded bulk command leaves for the next call: the live messages of the selection in
-- %(states)s (ready = due, delayed, waiting).
SELECT count(*)
  FROM {schema}.pgjobs_job AS j
 WHERE j.state IN ('ready', 'waiting')
   AND CASE WHEN j.state = 'waiting' THEN 'waiting'
            WHEN j.run_at > now() THEN 'delayed' ELSE 'ready' END = ANY(%(states)s::text[])
   AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
   AND (%(task)s::text IS NULL OR j.task = %(task)s)
   AND (%(tenant)s::text IS NULL OR j.tenant = %(tenant)s);
