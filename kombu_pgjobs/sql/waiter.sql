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
