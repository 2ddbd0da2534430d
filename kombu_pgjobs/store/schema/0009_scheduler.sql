-- pgjobs schema, version 9: the leader-elected scheduler (celery_ext.scheduler).

-- Leadership: one row per election (the scheduler's is 'scheduler'). The lease is on the
-- database clock; the term is the fencing token every fire is checked against.
CREATE TABLE IF NOT EXISTS {schema}.pgjobs_leader (
    name        text PRIMARY KEY,                     -- what is led ('scheduler')
    holder      text NOT NULL,                        -- host:pid:nonce of the leading process
    term        bigint NOT NULL,                      -- +1 on every takeover, never reset
    elected_at  timestamptz NOT NULL,                 -- when this term began
    renewed_at  timestamptz NOT NULL,                 -- the holder's last renewal
    expires_at  timestamptz NOT NULL                  -- after it, another process may take over
);
COMMENT ON TABLE {schema}.pgjobs_leader IS 'Leader leases with fencing terms.';

-- Schedule entries: static ones (the app's beat_schedule, written by the leader) and dynamic
-- ones (pgjobs schedule add). Each carries its durable watermark.
CREATE TABLE IF NOT EXISTS {schema}.pgjobs_schedule (
    name            text PRIMARY KEY,                 -- entry name (the beat_schedule key)
    source          text NOT NULL CHECK (source IN ('static', 'dynamic')),
    task            text NOT NULL,                    -- Celery task name
    schedule        text NOT NULL,                    -- 'every 30s' or crontab text
    timezone        text,                             -- crontab time zone; NULL: the app's
    args            jsonb NOT NULL DEFAULT jsonb_build_array(),
    kwargs          jsonb NOT NULL DEFAULT jsonb_build_object(),
    options         jsonb NOT NULL DEFAULT jsonb_build_object(),      -- apply_async options (queue, priority)
    catch_up        text NOT NULL DEFAULT 'skip' CHECK (catch_up IN ('skip', 'once', 'all')),
    catch_up_max    integer NOT NULL DEFAULT 100 CHECK (catch_up_max BETWEEN 1 AND 10000),
    paused          boolean NOT NULL DEFAULT false,   -- a paused entry does not fire
    anchor          timestamptz NOT NULL DEFAULT now(), -- origin of an interval's grid
    last_occurrence timestamptz,                      -- watermark: latest occurrence accounted for
    last_fired_at   timestamptz,                      -- when the last fire committed
    fires           bigint NOT NULL DEFAULT 0,        -- fires committed
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT clock_timestamp() -- definition changed (fences fires)
);
COMMENT ON TABLE {schema}.pgjobs_schedule IS 'Scheduled entries and their watermarks.';

-- One row per fire, written by the statement that fires: the history, and a second guard
-- (one row per entry and occurrence).
CREATE TABLE IF NOT EXISTS {schema}.pgjobs_schedule_fire (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    entry       text NOT NULL,                        -- entry name
    occurrence  timestamptz NOT NULL,                 -- the occurrence the message is for
    fired_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
    term        bigint NOT NULL,                      -- leadership term that fired it
    holder      text NOT NULL,                        -- process that fired it
    job_id      bigint,                               -- the message row (pgjobs broker); NULL otherwise
    missed      integer NOT NULL DEFAULT 0,           -- occurrences skipped before this one
    UNIQUE (entry, occurrence)
);
-- The unique constraint's index serves `pgjobs schedule history ENTRY` (newest first).
CREATE INDEX IF NOT EXISTS pgjobs_schedule_fire_fired_idx
    ON {schema}.pgjobs_schedule_fire (fired_at);
COMMENT ON TABLE {schema}.pgjobs_schedule_fire IS 'Scheduled fires (history).';
