-- pgjobs schema, version 1.
-- Every object lives in one schema ({schema}); the migrate runner substitutes it as a quoted
-- identifier. This file runs once, inside the migrate runner's transaction and advisory lock.

-- Queues: declared by kombu (queue_declare) with the arguments RabbitMQ would take.
CREATE TABLE {schema}.pgjobs_queue (
    name            text PRIMARY KEY,                 -- queue name, as kombu declares it
    paused          boolean NOT NULL DEFAULT false,   -- a paused queue's rows are not claimed
    expires_ms      integer,                          -- x-expires: drop the queue when unused this long
    message_ttl_ms  integer,                          -- x-message-ttl: default per-message expiry
    max_priority    smallint,                         -- x-max-priority (informational: 0-9 always work)
    auto_delete     boolean NOT NULL DEFAULT false,   -- kombu auto_delete flag (informational)
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_used_at    timestamptz NOT NULL DEFAULT now() -- touched by declares and consumers' ticks
);
COMMENT ON TABLE {schema}.pgjobs_queue IS 'Declared queues and their RabbitMQ-style arguments.';

-- Bindings: the routing table of every exchange, shared by every process.
CREATE TABLE {schema}.pgjobs_binding (
    exchange        text NOT NULL,                    -- exchange name
    exchange_type   text NOT NULL CHECK (exchange_type IN ('direct', 'topic', 'fanout')),
    routing_key     text NOT NULL DEFAULT '',         -- binding key as declared
    pattern         text NOT NULL DEFAULT '',         -- kombu's compiled match pattern (topic)
    queue           text NOT NULL,                    -- destination queue
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);
CREATE INDEX pgjobs_binding_queue_idx ON {schema}.pgjobs_binding (queue);
COMMENT ON TABLE {schema}.pgjobs_binding IS 'Exchange bindings (direct, topic, fanout).';

-- Jobs: the hot table. Only ready and running messages live here; an ack deletes the row.
CREATE TABLE {schema}.pgjobs_job (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue            text NOT NULL,                   -- destination queue
    state            text NOT NULL DEFAULT 'ready'
                     CHECK (state IN ('ready', 'running')),
    priority         smallint NOT NULL DEFAULT 0,     -- 0-9, higher is claimed first
    run_at           timestamptz NOT NULL DEFAULT now(), -- due time (Celery eta/countdown)
    expires_at       timestamptz,                     -- per-message expiration / x-message-ttl
    claim            integer NOT NULL DEFAULT 0,      -- fence: +1 on every claim, never reset
    attempts         integer NOT NULL DEFAULT 0,      -- deliveries that counted
    max_attempts     integer,                         -- per-message cap (header); NULL: option
    lease_expires_at timestamptz,                     -- set while running; renewed by the holder
    worker           text,                            -- lease holder (host:pid)
    task             text,                            -- Celery task name, for operators
    created_at       timestamptz NOT NULL DEFAULT now(),
    message          json NOT NULL                    -- the kombu message, verbatim
) WITH (
    fillfactor = 80,                                  -- room for new row versions on the page
    autovacuum_vacuum_scale_factor = 0.0,             -- vacuum by row count, not table size:
    autovacuum_vacuum_threshold = 5000,               -- a queue table churns constantly
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);
-- The claim: per queue, highest priority first, then due time, then insertion order.
CREATE INDEX pgjobs_job_ready_idx ON {schema}.pgjobs_job (queue, priority DESC, run_at, id)
    WHERE state = 'ready';
-- Rescue of lapsed leases.
CREATE INDEX pgjobs_job_lease_idx ON {schema}.pgjobs_job (lease_expires_at)
    WHERE state = 'running';
-- Expiry of messages with a TTL.
CREATE INDEX pgjobs_job_expires_idx ON {schema}.pgjobs_job (expires_at)
    WHERE expires_at IS NOT NULL;
COMMENT ON TABLE {schema}.pgjobs_job IS 'Ready and running messages; acked rows are deleted.';

-- Dead letters: everything needed to understand and requeue a message that will not run.
CREATE TABLE {schema}.pgjobs_dead_letter (
    id           bigint PRIMARY KEY,                  -- the job id it had
    queue        text NOT NULL,
    priority     smallint NOT NULL DEFAULT 0,
    task         text,
    claim        integer NOT NULL,
    attempts     integer NOT NULL,
    max_attempts integer,
    reason       text NOT NULL,                       -- rejected | lease_expired_final_attempt | ...
    error        jsonb,                               -- type, message, traceback and rule, if known
    created_at   timestamptz NOT NULL,                -- when the message was first published
    died_at      timestamptz NOT NULL DEFAULT now(),
    message      json NOT NULL
);
CREATE INDEX pgjobs_dead_letter_queue_idx ON {schema}.pgjobs_dead_letter (queue, died_at);
CREATE INDEX pgjobs_dead_letter_died_idx ON {schema}.pgjobs_dead_letter (died_at);
COMMENT ON TABLE {schema}.pgjobs_dead_letter IS 'Messages that will not run again unless requeued.';

-- One NOTIFY per statement and queue (Postgres folds duplicates within a transaction).
CREATE FUNCTION {schema}.pgjobs_notify_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue)
       FROM (SELECT DISTINCT queue FROM new_rows) AS q;
    RETURN NULL;
END
$$;
CREATE TRIGGER pgjobs_job_notify_v1 AFTER INSERT ON {schema}.pgjobs_job
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pgjobs_notify_v1();
