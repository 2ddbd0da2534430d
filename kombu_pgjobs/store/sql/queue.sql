-- name: queue_declare :exec
-- Declare (or re-declare, refreshing its arguments and last use) a queue.
INSERT INTO {schema}.pgjobs_queue AS q
       (name, expires_ms, message_ttl_ms, max_priority, auto_delete)
VALUES (%(name)s, %(expires_ms)s, %(message_ttl_ms)s, %(max_priority)s, %(auto_delete)s)
ON CONFLICT (name) DO UPDATE
   SET expires_ms = excluded.expires_ms,
       message_ttl_ms = excluded.message_ttl_ms,
       max_priority = excluded.max_priority,
       auto_delete = excluded.auto_delete,
       last_used_at = now();

-- name: queue_exists :one
SELECT EXISTS (SELECT 1 FROM {schema}.pgjobs_queue WHERE name = %(name)s)
    OR EXISTS (SELECT 1 FROM {schema}.pgjobs_job WHERE queue = %(name)s);

-- name: queue_delete :exec
-- Delete a queue with its bindings and messages.
WITH b AS (DELETE FROM {schema}.pgjobs_binding WHERE queue = %(name)s),
     j AS (DELETE FROM {schema}.pgjobs_job WHERE queue = %(name)s)
DELETE FROM {schema}.pgjobs_queue WHERE name = %(name)s;

