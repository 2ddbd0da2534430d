-- pgjobs schema, version 8: the transactional outbox (issue 13).
--
-- An app whose broker is not this database (Redis, RabbitMQ, another Postgres) publishes inside
-- its own transaction by staging each message here, in that transaction
-- (celery_ext.transaction / kombu_pgjobs.outbox): a staged row exists exactly when the app's
-- transaction commits. `pgjobs relay` publishes committed rows to the real broker, in order per
-- transaction, at least once, and marks them published; `pgjobs prune` deletes published rows
-- after a retention window. Relays claim rows with a fenced lease, as workers claim jobs: the
-- claim number only grows, and marking a row published is fenced on it.
--
-- An app whose broker is this same database needs none of it: its messages go straight into
-- pgjobs_job in the app's transaction.

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_outbox (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    txid             bigint NOT NULL DEFAULT txid_current(),  -- the staging transaction
    exchange         text NOT NULL,              -- exchange name ('' : the default exchange)
    routing_key      text NOT NULL,
    body             bytea NOT NULL,             -- serialized (and compressed) as kombu sends it
    content_type     text NOT NULL,
    content_encoding text NOT NULL,
    headers          jsonb NOT NULL,             -- unchanged (tenant, idempotency key, ...)
    properties       jsonb NOT NULL,             -- the rest of Producer.publish's arguments
    declare          jsonb NOT NULL DEFAULT '[]',  -- queues/exchanges to declare first
    staged_at        timestamptz NOT NULL DEFAULT now(),
    claim            integer NOT NULL DEFAULT 0,   -- fence: bumped by every relay claim
    lease_owner      text,                         -- host:pid of the relay holding the lease
    lease_expires_at timestamptz,                  -- NULL: never claimed
    attempts         integer NOT NULL DEFAULT 0,   -- failed publish attempts
    last_error       text,
    published_at     timestamptz                   -- NULL: not published yet
);
COMMENT ON TABLE {schema}.pgjobs_outbox IS
    'Messages staged in the app''s transaction for a broker elsewhere; pgjobs relay publishes them.';

-- The relay's claim: unpublished rows in id order (staging order within a transaction).
CREATE INDEX IF NOT EXISTS pgjobs_outbox_pending_idx ON {schema}.pgjobs_outbox (id)
    WHERE published_at IS NULL;
-- Per-transaction order: is an earlier row of this transaction still unpublished?
CREATE INDEX IF NOT EXISTS pgjobs_outbox_txid_idx ON {schema}.pgjobs_outbox (txid, id)
    WHERE published_at IS NULL;
-- pgjobs prune: published rows past the retention window.
CREATE INDEX IF NOT EXISTS pgjobs_outbox_published_idx ON {schema}.pgjobs_outbox (published_at)
    WHERE published_at IS NOT NULL;
