-- name: waiter_hold :exec
-- A consumer that starts LISTENing takes the session advisory lock on its wake id and keeps it
-- for as long as its connection lives: a publisher skips registrations whose lock is free
-- (0017_wake_one.sql).
SELECT pg_advisory_lock(%(waiter)s::bigint);

-- name: waiter_forget :one
-- A consumer stops waiting on %(queues)s (NULL: on every queue) and, when it stops listening
-- altogether, frees its wake id's lock (%(release)s). Returns the queues whose registrations it
-- deleted (a registration it had and did not delete was taken by a publish, whose wake-up is
-- on its way).
WITH gone AS (
    DELETE FROM {schema}.pgjobs_waiter
     WHERE waiter = %(waiter)s::bigint
       AND (%(queues)s::text[] IS NULL OR queue = ANY (%(queues)s::text[]))
    RETURNING queue
)
SELECT coalesce((SELECT array_agg(queue) FROM gone), '{{}}'::text[]),
       CASE WHEN %(release)s THEN pg_advisory_unlock(%(waiter)s::bigint) END;

-- name: waiter_pass_on :exec
-- A wake-up reached a consumer that no longer consumes these queues: every consumer of them
-- is told instead (the schema's channel), so the message it announced is not left waiting.
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queues)s::text[]) AS q;

-- name: waiter_take :many
-- A consumer takes a message a publish handed it (0021_trust_boundary.sql), named by a
-- wake-up's ids: read only if its hand-off record names that claim and one of this consumer's
-- own wake ids, and the row is still running under that claim, held by this consumer's
-- worker. The record is deleted, so a replayed wake-up finds nothing, and a forged or altered
-- one never matched. Returns (id, claim, queue, message), or nothing. Read by primary key,
-- with scalar parameters: a generic plan is reused (an array form was planned anew on every
-- execution, 0.16 ms, more than its run). The record is unlogged and the commit is not
-- flushed (synchronous_commit off): the claim it reads was durable when the publish
-- committed, and a record that a crash loses names a session that died with the server.
WITH quick AS (
    SELECT set_config('synchronous_commit', 'off', true) AS off
), taken AS (
    DELETE FROM {schema}.pgjobs_handoff AS h
     WHERE h.job_id = %(id)s::bigint AND h.claim = %(claim)s::int
       AND h.waiter = %(waiter)s::bigint
       AND (SELECT off FROM quick) IS NOT NULL
    RETURNING h.job_id, h.claim
)
SELECT j.id, j.claim, j.queue, j.message::text
  FROM taken
  JOIN {schema}.pgjobs_job AS j ON j.id = taken.job_id AND j.claim = taken.claim
 WHERE j.state = 'running' AND j.worker = %(worker)s;
