-- name: outbox_identity :one
-- Which server and database a connection is on, to tell whether an app's connection reaches
-- the broker's database ("same database": the message row goes in the app's transaction).
-- The cluster's system identifier; without the right to read it, the postmaster's start time
-- and port, which two servers do not share either.
SELECT CASE WHEN has_function_privilege('pg_control_system()', 'execute')
            THEN (pg_control_system()).system_identifier::text
            ELSE 'started ' || pg_postmaster_start_time()::text
                 || ' port ' || coalesce(inet_server_port()::text, 'local') END,
       current_database();

-- name: outbox_stage :many
-- Stage messages in the caller's transaction (one statement for one message or many), and
-- queue the NOTIFY that wakes relays: Postgres delivers it when (and only if) that transaction
-- commits. Ids follow the order given, so per-transaction order is staging order.
WITH staged AS (
    INSERT INTO {schema}.pgjobs_outbox
           (exchange, routing_key, body, content_type, content_encoding, headers, properties,
            declare)
    SELECT m.exchange, m.routing_key, m.body, m.content_type, m.content_encoding,
           m.headers::jsonb, m.properties::jsonb, m.declare::jsonb
      FROM unnest(%(exchange)s::text[], %(routing_key)s::text[], %(body)s::bytea[],
                  %(content_type)s::text[], %(content_encoding)s::text[], %(headers)s::text[],
                  %(properties)s::text[], %(declare)s::text[]) WITH ORDINALITY
           AS m(exchange, routing_key, body, content_type, content_encoding, headers,
                properties, declare, n)
     ORDER BY m.n
    RETURNING id
)
SELECT s.id, pg_notify(%(channel)s, '') IS NULL FROM staged AS s;

-- name: outbox_claim :many
-- A relay claims up to {limit} committed, unpublished rows whose lease is free or lapsed,
-- oldest first, under a fenced lease (claim + 1). A row is taken only together with every
-- earlier unpublished row of its transaction, so a transaction's messages are published in
-- order even when several relays share the table (another relay holding an earlier row, or a
-- candidate left out by SKIP LOCKED, holds the rest of that transaction back).
WITH candidate AS MATERIALIZED (
    -- free rows, oldest first; rows another relay is claiming right now are skipped
    SELECT o.id, o.txid
      FROM {schema}.pgjobs_outbox AS o
     WHERE o.published_at IS NULL
       AND (o.lease_expires_at IS NULL OR o.lease_expires_at < now())
     ORDER BY o.id
     LIMIT {limit}
       FOR UPDATE SKIP LOCKED
), ready AS (
    -- no earlier unpublished row of the same transaction is left out of this claim
    SELECT c.id
      FROM candidate AS c
     WHERE NOT EXISTS (
           SELECT 1
             FROM {schema}.pgjobs_outbox AS e
            WHERE e.txid = c.txid AND e.id < c.id AND e.published_at IS NULL
              AND e.id NOT IN (SELECT id FROM candidate))
)
UPDATE {schema}.pgjobs_outbox AS o
   SET claim = o.claim + 1,
       lease_owner = %(owner)s,
       lease_expires_at = now() + make_interval(secs => %(ttl)s)
  FROM ready
 WHERE o.id = ready.id
RETURNING o.id, o.claim, o.exchange, o.routing_key, o.body, o.content_type,
          o.content_encoding, o.headers, o.properties, o.declare;

-- name: outbox_published :many
-- Mark rows published, fenced on the claim that published them: a relay whose lease lapsed
-- (another relay has re-claimed the row) changes nothing. Returns the ids marked.
UPDATE {schema}.pgjobs_outbox AS o
   SET published_at = now(), lease_owner = NULL, lease_expires_at = NULL
  FROM unnest(%(ids)s::bigint[], %(claims)s::int[]) AS m(id, claim)
 WHERE o.id = m.id AND o.claim = m.claim AND o.published_at IS NULL
RETURNING o.id;

-- name: outbox_failed :exec
-- A publish failed: the rows (the failed one and the rest of its transaction, never published
-- out of order) go back after a delay, the error recorded on the failed one. Fenced.
UPDATE {schema}.pgjobs_outbox AS o
   SET lease_owner = NULL,
       lease_expires_at = now() + make_interval(secs => %(delay)s),
       attempts = o.attempts + (o.id = %(failed)s)::int,
       last_error = CASE WHEN o.id = %(failed)s THEN %(error)s ELSE o.last_error END
  FROM unnest(%(ids)s::bigint[], %(claims)s::int[]) AS m(id, claim)
 WHERE o.id = m.id AND o.claim = m.claim AND o.published_at IS NULL;

-- name: outbox_renew :many
-- Extend the lease of rows still being published (fenced); returns the ids still held.
UPDATE {schema}.pgjobs_outbox AS o
   SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
  FROM unnest(%(ids)s::bigint[], %(claims)s::int[]) AS m(id, claim)
 WHERE o.id = m.id AND o.claim = m.claim AND o.published_at IS NULL
RETURNING o.id;

-- name: outbox_prune :one
-- Delete up to %(limit)s rows published more than %(older)s seconds ago (pgjobs prune).
WITH gone AS (
    DELETE FROM {schema}.pgjobs_outbox
     WHERE id IN (SELECT id
                    FROM {schema}.pgjobs_outbox
                   WHERE published_at < now() - make_interval(secs => %(older)s)
                   LIMIT %(limit)s)
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: outbox_prunable :one
-- How many rows published more than %(older)s seconds ago a prune would delete.
SELECT count(*) FROM {schema}.pgjobs_outbox
 WHERE published_at < now() - make_interval(secs => %(older)s);

-- name: outbox_counts :one
-- Unpublished and published rows (the relay's and the CLI's view of the table).
SELECT count(*) FILTER (WHERE published_at IS NULL),
       count(*) FILTER (WHERE published_at IS NOT NULL)
  FROM {schema}.pgjobs_outbox;
