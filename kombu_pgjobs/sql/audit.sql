-- name: audit_record :exec
-- One operator write (version 24): who (origin, actor, host), what (action, target: the exact
-- filter or ids, as JSON), how many rows. In the write's own transaction where the caller has
-- one (the dashboard's actions).
INSERT INTO {schema}.pgjobs_audit (origin, actor, host, action, target, rows)
VALUES (%(origin)s, %(actor)s, %(host)s, %(action)s, %(target)s, %(rows)s);

-- name: audit_ls :many
-- The audit log, newest first, a page of %(n)s rows before the id %(before)s (NULL: from the
-- newest): a backwards range of the primary key.
SELECT id, at, origin, actor, host, action, target, rows
  FROM {schema}.pgjobs_audit
 WHERE %(before)s::bigint IS NULL OR id < %(before)s::bigint
 ORDER BY id DESC
 LIMIT %(n)s;
