-- name: waiter_hold :exec
-- A consumer that starts LISTENing takes the session advisory lock on its wake id and keeps it
-- for as long as its connection lives: a publisher skips registrations whose lock is free
-- (0017_wake_one.sql).
SELECT pg_advisory_lock(%(waiter)s::bigint);

-- name: waiter_forget :exec
-- A consumer stops waiting on %(queues)s (NULL: on every queue) and, when it stops listening
-- altogether, frees its wake id's lock (%(release)s).
WITH gone AS (
    DELETE FROM {schema}.pgjobs_waiter
     WHERE waiter = %(waiter)s::bigint
       AND (%(queues)s::text[] IS NULL OR queue = ANY (%(queues)s::text[]))
)
SELECT CASE WHEN %(release)s THEN pg_advisory_unlock(%(waiter)s::bigint) END;

-- name: waiter_pass_on :exec
-- A wake-up reached a consumer that no longer consumes these queues: every consumer of them
-- is told instead (the schema's channel), so the message it announced is not left waiting.
SELECT pg_notify(%(channel)s, q) FROM unnest(%(queues)s::text[]) AS q;
