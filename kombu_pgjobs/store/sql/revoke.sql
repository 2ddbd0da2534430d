-- name: revoke_delete :many
-- Celery's revoke broadcast (and `pgjobs cancel --task-id`): delete the delayed rows of these
-- Celery task ids (the `id` header), through pgjobs_job_delayed_task_id_idx (version 19),
-- counted 'revoked'; with %(keep)s, the ids are kept in pgjobs_revoked that long (version 16).
-- Returns (id, queue).
WITH gone AS (
    DELETE FROM {schema}.pgjobs_job AS j
     WHERE (j.message -> 'headers' ->> 'id') = ANY(%(task_ids)s::text[])
       AND j.state = 'ready' AND j.delayed
    RETURNING j.id, j.queue
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, 'revoked', date_trunc('minute', now()), %(worker)s, count(*)
      FROM gone GROUP BY queue
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
), kept AS (
    -- %(keep)s seconds (NULL: not kept: `pgjobs cancel --task-id`), for starting workers
    INSERT INTO {schema}.pgjobs_revoked AS r (task_id, expires_at)
    SELECT t, now() + make_interval(secs => %(keep)s::float8)
      FROM unnest(%(task_ids)s::text[]) AS t
     WHERE %(keep)s::float8 IS NOT NULL
    ON CONFLICT (task_id) DO UPDATE SET revoked_at = now(), expires_at = excluded.expires_at
), forgotten AS (
    DELETE FROM {schema}.pgjobs_revoked WHERE expires_at < now()
)
SELECT id, queue FROM gone;

-- name: revoke_list :many
-- The revokes a starting worker loads (celery_ext): unexpired, newest first, at most %(n)s,
-- with the seconds each has left.
SELECT task_id, extract(epoch FROM expires_at - now())::float8 AS left_seconds
  FROM {schema}.pgjobs_revoked
 WHERE expires_at > now()
 ORDER BY revoked_at DESC
 LIMIT %(n)s;

-- name: revoke_find :many
-- `pgjobs cancel --task-id`: the live rows of these Celery task ids. Delayed rows through
-- pgjobs_job_delayed_task_id_idx; the others (due, running, waiting: few, and claimed soon) by
-- a scan of the rows that are not delayed. A message whose text holds a \u0000 or a lone
-- surrogate escape (written by a release that did not refuse them at publish, or by hand)
-- cannot be read with ->> (PostgreSQL text holds neither): it is skipped, never an error
-- that fails the whole cancel (the dead-letter and listing statements do the same, admin.sql).
-- Returns (id, task_id).
SELECT j.id, j.message -> 'headers' ->> 'id'
  FROM {schema}.pgjobs_job AS j
 WHERE (j.message -> 'headers' ->> 'id') = ANY(%(task_ids)s::text[])
   AND j.state = 'ready' AND j.delayed
UNION
SELECT x.id, x.task_id
  FROM (SELECT j.id,
               CASE WHEN strpos(j.message::text, '\u0000') + strpos(j.message::text, '\ud')
                         + strpos(j.message::text, '\uD') = 0
                    THEN j.message -> 'headers' ->> 'id' END AS task_id
          FROM {schema}.pgjobs_job AS j
         WHERE NOT (j.state = 'ready' AND j.delayed)) AS x
 WHERE x.task_id = ANY(%(task_ids)s::text[]);
