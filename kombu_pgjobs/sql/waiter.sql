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
-- A consumer takes the messages publishes handed it (0021_trust_boundary.sql): each named by a
-- wake-up's ids, read only if the row is still running under that claim, held by this
-- consumer's worker and marked for one of its own wake ids; the mark is cleared, so a replayed
-- wake-up finds nothing, and a forged or altered one never matched. Returns (id, claim, queue,
-- message) of the rows taken. Read by primary key. Its own commit need not be flushed
-- (synchronous_commit off for this transaction): the claim it reads was durable when the
-- publish committed, and a mark that a crash brings back names a wake id that died with the
-- server's sessions.
WITH quick AS (
    SELECT set_config('synchronous_commit', 'off', true) AS off
)
UPDATE {schema}.pgjobs_job AS j
   SET handed_to = NULL
  FROM quick
 WHERE j.id = ANY (%(ids)s::bigint[])
   AND (j.id, j.claim, j.handed_to) IN (
        SELECT * FROM unnest(%(ids)s::bigint[], %(claims)s::int[], %(waiters)s::bigint[]))
   AND j.state = 'running' AND j.worker = %(worker)s
   AND quick.off IS NOT NULL
RETURNING j.id, j.claim, j.queue, j.message::text;
