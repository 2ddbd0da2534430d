-- pgjobs schema, version 10: webhook endpoints and the ledger of delivery attempts (issue 15).
--
-- An endpoint is a URL and the secret its deliveries are signed with. The secret lives in this
-- row only: a delivery message names the endpoint by id, and the worker reads the secret when
-- it signs. Nothing else (messages, results, dead letters, the ledger, logs, CLI output) holds
-- it.
--
-- The ledger has one row per HTTP attempt, written before the worker decides whether to retry
-- (a worker that dies mid-request writes none: an attempt it abandoned counts toward nothing).

CREATE TABLE {schema}.pgjobs_webhook_endpoint (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    url text NOT NULL,
    secret text NOT NULL,
    description text,
    enabled boolean NOT NULL DEFAULT true,
    disable_after integer CHECK (disable_after >= 1),  -- NULL: pgjobs_webhook_disable_after
    consecutive_failures integer NOT NULL DEFAULT 0,
    disabled_at timestamptz,
    disabled_reason text,                              -- 'failures' or 'operator'
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON COLUMN {schema}.pgjobs_webhook_endpoint.secret IS
    'HMAC-SHA256 signing key; never copied anywhere else (messages carry the endpoint id).';

CREATE TABLE {schema}.pgjobs_webhook_attempt (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    endpoint_id bigint NOT NULL
        REFERENCES {schema}.pgjobs_webhook_endpoint (id) ON DELETE CASCADE,
    event_id text NOT NULL,
    event_type text NOT NULL,
    task_id text,
    attempt integer NOT NULL,                          -- 1 for the first POST of the event
    started_at timestamptz NOT NULL,
    finished_at timestamptz NOT NULL,
    status integer,                                    -- HTTP status; NULL: no response
    latency_ms double precision NOT NULL,
    outcome text NOT NULL CHECK (outcome IN ('delivered', 'retrying', 'failed')),
    error text,
    response_excerpt text,
    location text,
    retry_after double precision,                      -- seconds the response asked for
    next_attempt_at timestamptz                        -- outcome 'retrying': due time
);

-- `pgjobs webhooks attempts ID`: an endpoint's attempts, newest first.
CREATE INDEX pgjobs_webhook_attempt_endpoint_idx
    ON {schema}.pgjobs_webhook_attempt (endpoint_id, id);
-- An event's attempts (receiver support: "what happened to evt_...").
CREATE INDEX pgjobs_webhook_attempt_event_idx
    ON {schema}.pgjobs_webhook_attempt (event_id);
-- Retention: `pgjobs prune --webhook-attempts-older-than`, oldest first.
CREATE INDEX pgjobs_webhook_attempt_finished_idx
    ON {schema}.pgjobs_webhook_attempt (finished_at);
