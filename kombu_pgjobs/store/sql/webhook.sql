-- name: webhook_endpoint_add :one
-- A new endpoint, enabled, no failures. Returns its id.
INSERT INTO {schema}.pgjobs_webhook_endpoint (url, secret, description, disable_after)
VALUES (%(url)s, %(secret)s, %(description)s, %(disable_after)s)
RETURNING id;

-- name: webhook_endpoint_exists :one
-- Does the endpoint exist (send() refuses an unknown id before publishing)?
SELECT EXISTS (SELECT 1 FROM {schema}.pgjobs_webhook_endpoint WHERE id = %(id)s);

-- name: webhook_endpoint_for_delivery :one
-- What the delivery task needs, secret included: the only statement that reads the secret.
SELECT url, secret, enabled
  FROM {schema}.pgjobs_webhook_endpoint
 WHERE id = %(id)s;

-- name: webhook_endpoint_ls :many
-- Endpoints for operators, in id order after %(after)s, never the secret, with their last
-- attempt (time and status) from the ledger (one index probe per endpoint).
SELECT e.id, e.url, e.description, e.enabled, e.consecutive_failures, e.disable_after,
       e.disabled_at, e.disabled_reason, e.created_at, e.updated_at,
       last.finished_at AS last_attempt_at, last.status AS last_status,
       last.outcome AS last_outcome
  FROM {schema}.pgjobs_webhook_endpoint AS e
  LEFT JOIN LATERAL (
      SELECT a.finished_at, a.status, a.outcome
        FROM {schema}.pgjobs_webhook_attempt AS a
       WHERE a.endpoint_id = e.id
       ORDER BY a.id DESC
       LIMIT 1) AS last ON true
 WHERE e.id > %(after)s AND (%(id)s::bigint IS NULL OR e.id = %(id)s)
 ORDER BY e.id
 LIMIT %(limit)s;

-- name: webhook_endpoint_set_enabled :one
-- An operator's enable or disable. Enabling clears the failure count and the reason (the
-- endpoint starts afresh); disabling records the operator as the reason. Returns the row's
-- new state (no row: no such endpoint).
UPDATE {schema}.pgjobs_webhook_endpoint
   SET enabled = %(enabled)s,
       consecutive_failures = CASE WHEN %(enabled)s THEN 0 ELSE consecutive_failures END,
       disabled_at = CASE WHEN %(enabled)s THEN NULL
                          WHEN enabled THEN now() ELSE disabled_at END,
       disabled_reason = CASE WHEN %(enabled)s THEN NULL
                              WHEN enabled THEN 'operator' ELSE disabled_reason END,
       updated_at = now()
 WHERE id = %(id)s
RETURNING id, enabled, disabled_reason;

-- name: webhook_endpoint_set_secret :one
-- Replace an endpoint's signing secret (rotation); the next attempt signs with the new one.
UPDATE {schema}.pgjobs_webhook_endpoint
   SET secret = %(secret)s, updated_at = now()
 WHERE id = %(id)s
RETURNING id;

-- name: webhook_attempt_record :one
-- One attempt into the ledger and its effect on the endpoint, in one statement (so the ledger
-- row and the failure count cannot disagree). %(effect)s:
--   'reset'  a 2xx: the consecutive failed deliveries go back to 0 (written only if not 0);
--   'count'  the delivery failed for good: +1, and the endpoint is disabled (reason
--            'failures') when that reaches its disable_after (else %(disable_after)s);
--   'none'   an attempt that will be retried: the ledger row only.
-- Times are the database's: finished now, started %(latency_ms)s earlier, the next attempt
-- %(delay)s seconds from now (NULL: none).
WITH attempt AS (
    INSERT INTO {schema}.pgjobs_webhook_attempt (
        endpoint_id, event_id, event_type, task_id, attempt, started_at, finished_at, status,
        latency_ms, outcome, error, response_excerpt, location, retry_after, next_attempt_at)
    VALUES (%(endpoint_id)s, %(event_id)s, %(event_type)s, %(task_id)s, %(attempt)s,
            clock_timestamp() - make_interval(secs => %(latency_ms)s::float8 / 1000),
            clock_timestamp(), %(status)s, %(latency_ms)s, %(outcome)s, %(error)s,
            %(excerpt)s, %(location)s, %(retry_after)s,
            clock_timestamp() + make_interval(secs => %(delay)s::float8))
    RETURNING id, next_attempt_at
), endpoint AS (
    -- the failure count after this attempt, and whether it disables the endpoint now (trips:
    -- only an enabled endpoint; an operator's enable is the only way back)
    UPDATE {schema}.pgjobs_webhook_endpoint AS e
       SET consecutive_failures = c.failures,
           enabled = e.enabled AND NOT c.trips,
           disabled_at = CASE WHEN c.trips THEN now() ELSE e.disabled_at END,
           disabled_reason = CASE WHEN c.trips THEN 'failures' ELSE e.disabled_reason END,
           updated_at = now()
      FROM (SELECT id,
                   CASE WHEN %(effect)s = 'reset' THEN 0
                        ELSE consecutive_failures + 1 END AS failures,
                   enabled AND %(effect)s = 'count' AND consecutive_failures + 1
                       >= coalesce(disable_after, %(disable_after)s) AS trips
              FROM {schema}.pgjobs_webhook_endpoint
             WHERE id = %(endpoint_id)s) AS c
     WHERE e.id = c.id
       AND (%(effect)s = 'count' OR (%(effect)s = 'reset' AND e.consecutive_failures <> 0))
    RETURNING e.consecutive_failures, e.enabled, c.trips
)
SELECT a.id, a.next_attempt_at, e.consecutive_failures, e.enabled, coalesce(e.trips, false)
  FROM attempt AS a
  LEFT JOIN endpoint AS e ON true;

-- name: webhook_attempt_ls :many
-- An endpoint's attempts, newest first, a page at a time: ids below %(before)s (keyset; 0 is
-- "from the newest"). Served by pgjobs_webhook_attempt_endpoint_idx.
SELECT id, endpoint_id, event_id, event_type, task_id, attempt, started_at, finished_at,
       status, latency_ms, outcome, error, response_excerpt, location, retry_after,
       next_attempt_at
  FROM {schema}.pgjobs_webhook_attempt
 WHERE endpoint_id = %(endpoint_id)s AND (%(before)s = 0 OR id < %(before)s)
 ORDER BY id DESC
 LIMIT %(limit)s;

-- name: webhook_attempt_prune_count :one
-- Ledger rows a prune would delete: attempts finished before %(cutoff)s.
SELECT count(*) FROM {schema}.pgjobs_webhook_attempt WHERE finished_at < %(cutoff)s;

-- name: webhook_attempt_prune :one
-- Delete one batch of at most %(limit)s attempts finished before %(cutoff)s, oldest first
-- (pgjobs_webhook_attempt_finished_idx); returns how many. SKIP LOCKED: never waits.
WITH doomed AS (
    SELECT id FROM {schema}.pgjobs_webhook_attempt
     WHERE finished_at < %(cutoff)s
     ORDER BY finished_at
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {schema}.pgjobs_webhook_attempt AS a USING doomed AS d
     WHERE a.id = d.id
    RETURNING 1
)
SELECT count(*) FROM gone;
