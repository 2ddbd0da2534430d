-- name: scheduled_list :many
-- `celery inspect scheduled` on pgjobs (celery_ext): the delayed (ETA) messages of the queues a
-- worker consumes, soonest first, at most %(limit)s, through pgjobs_job_delayed_idx. Returns
-- (id, queue, priority, run_at, headers, delivery_info).
SELECT j.id, j.queue, j.priority, j.run_at, j.message -> 'headers',
       j.message -> 'properties' -> 'delivery_info'
  FROM {schema}.pgjobs_job AS j
 WHERE j.queue = ANY(%(queues)s::text[]) AND j.state = 'ready' AND j.delayed
   AND j.run_at > now()
 ORDER BY j.run_at, j.id
 LIMIT %(limit)s;
