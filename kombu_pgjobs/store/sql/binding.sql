-- name: binding_add :exec
INSERT INTO {schema}.pgjobs_binding (exchange, exchange_type, routing_key, pattern, queue)
VALUES (%(exchange)s, %(exchange_type)s, %(routing_key)s, %(pattern)s, %(queue)s)
ON CONFLICT (exchange, routing_key, queue) DO UPDATE
   SET exchange_type = excluded.exchange_type, pattern = excluded.pattern;

-- name: binding_remove :exec
DELETE FROM {schema}.pgjobs_binding
 WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s AND queue = %(queue)s;

-- name: binding_table :many
-- The routing table of one exchange: (routing_key, pattern, queue) rows plus its type.
SELECT routing_key, pattern, queue, exchange_type
  FROM {schema}.pgjobs_binding WHERE exchange = %(exchange)s;
