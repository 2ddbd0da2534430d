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

-- name: retention_turn :one
-- The automatic retention sweep's turn (version 24): taken when the last sweep began at least
-- %(interval)s seconds ago. Two keepers that try at once serialise on the row's lock; the
-- second re-reads the row after the first commits and finds it no longer due (no row). Needs
-- the UPDATE grant on pgjobs_retention, which no role outside the app has. Returns now().
UPDATE {schema}.pgjobs_retention
   SET swept_at = now(), swept_by = %(who)s
 WHERE id = 1 AND swept_at <= now() - make_interval(secs => %(interval)s::float8)
RETURNING swept_at;

-- name: retention_now :one
-- The database's clock, read once per sweep: every kind's cutoff is now() less its window.
SELECT now();

-- name: retention_schedule_fires :one
-- Retention: one batch of at most %(limit)s scheduler fires recorded before %(cutoff)s, oldest
-- first (pgjobs_schedule_fire_fired_idx). Returns the number deleted.
WITH old AS (
    SELECT id FROM {schema}.pgjobs_schedule_fire
     WHERE fired_at < %(cutoff)s
     ORDER BY fired_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {schema}.pgjobs_schedule_fire AS f USING old WHERE f.id = old.id
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: retention_revokes :one
-- Retention: one batch of at most %(limit)s revokes past their own expiry (they are kept for
-- workers that start while the revoked task could still arrive; pgjobs_revoked_expires_idx).
-- Returns the number deleted.
WITH old AS (
    SELECT task_id FROM {schema}.pgjobs_revoked
     WHERE expires_at < now()
     ORDER BY expires_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {schema}.pgjobs_revoked AS r USING old WHERE r.task_id = old.task_id
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: retention_audit :one
-- Retention: one batch of at most %(limit)s audit rows recorded before %(cutoff)s, oldest first
-- (pgjobs_audit_at_idx). Not locked first: the worker may delete audit rows, never update them
-- (FOR UPDATE would need that), and nothing but the one sweep at a time deletes them (inserts
-- lock no old row). Returns the number deleted.
WITH old AS (
    SELECT id FROM {schema}.pgjobs_audit
     WHERE at < %(cutoff)s
     ORDER BY at
     LIMIT %(limit)s
), gone AS (
    DELETE FROM {schema}.pgjobs_audit AS a USING old WHERE a.id = old.id
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: retention_count :one
-- Exactly what the sweep's own statements would delete now (`pgjobs prune --dry-run`):
-- scheduler fires before %(fires_cutoff)s, expired revokes, audit rows before
-- %(audit_cutoff)s (a NULL cutoff: that kind is kept, 0).
SELECT (SELECT count(*) FROM {schema}.pgjobs_schedule_fire
         WHERE fired_at < %(fires_cutoff)s::timestamptz),
       (SELECT count(*) FROM {schema}.pgjobs_revoked WHERE expires_at < now()),
       (SELECT count(*) FROM {schema}.pgjobs_audit WHERE at < %(audit_cutoff)s::timestamptz);
