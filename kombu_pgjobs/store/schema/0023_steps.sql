-- pgjobs schema, version 23: durable steps (celery_ext.steps, issue 32).
--
-- A Celery task that calls steps.run / steps.sleep / steps.wait_for_event records each step in
-- pgjobs_step, keyed by the Celery task id (which retries keep) and the step's name: a later run
-- of the same task id (a redelivery after a crash, a retry, a requeue from the dead letters)
-- replays what is stored instead of running it again. Every write is fenced on the job row the
-- writing run holds: its (id, claim), still running, not cancelled (sql/steps.sql).
--
-- A sleep or a wait hands its message back parked: the job row goes back to ready with run_at
-- at the wake time and the delayed flag (0006_delayed.sql), uncounted. An event is a row of
-- pgjobs_event; inserting one wakes the parked waiters of its name and key in the same
-- statement (pgjobs_event_wake_v1, run as the owner: a publisher needs only INSERT here).
--
-- The waiter that parks and the emitter that wakes serialise on a pgjobs_lock row of class
-- 'event' (added below): the emitter's trigger holds it shared to its commit, the park tries it
-- exclusively and reads the events after getting it. So either the park sees the event, or
-- the event's wake sees the parked row; a park that finds an emit in flight wakes again in a
-- second. Everything here is idempotent (IF NOT EXISTS, OR REPLACE, ON CONFLICT).

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_step (
    task_id     text NOT NULL,                  -- the Celery task id (the message's id header)
    name        text NOT NULL,                  -- the step's name: the replay key
    seq         bigint GENERATED ALWAYS AS IDENTITY,  -- order of first record (requeue --from-step)
    kind        text NOT NULL CHECK (kind IN ('run', 'sleep', 'event')),
    state       text NOT NULL CHECK (state IN ('done', 'failed', 'sleeping', 'waiting')),
    attempts    integer NOT NULL DEFAULT 0,     -- bodies of a run step that recorded an outcome
    result      json,                           -- done: the step's result / the event's data
    error       jsonb,                          -- failed: its type, message (and code)
    event       text,                           -- kind event: the event's name
    event_key   text,                           -- kind event: its key ('' for none)
    due_at      timestamptz,                    -- sleeping: wake time; waiting: its deadline
    job_id      bigint NOT NULL,                -- the message (pgjobs_job.id) that wrote it last
    claim       integer NOT NULL,               -- under that claim number
    started_at  timestamptz,
    finished_at timestamptz,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (task_id, name)
);
COMMENT ON TABLE {schema}.pgjobs_step IS
    'Durable steps of Celery tasks (celery_ext.steps), by task id and step name.';

-- An emit wakes the waiters of its name and key: one probe of this index.
CREATE INDEX IF NOT EXISTS pgjobs_step_waiting_idx ON {schema}.pgjobs_step (event, event_key)
    WHERE state = 'waiting';
-- Suspended messages (metrics, the dashboard): the parked rows' ids.
CREATE INDEX IF NOT EXISTS pgjobs_step_suspended_idx ON {schema}.pgjobs_step (job_id)
    WHERE state IN ('sleeping', 'waiting');
-- Retention: steps not written since the cutoff, oldest first.
CREATE INDEX IF NOT EXISTS pgjobs_step_updated_idx ON {schema}.pgjobs_step (updated_at);

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_event (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name        text NOT NULL,                  -- the event's name (payment.confirmed)
    key         text NOT NULL DEFAULT '',       -- whose it is (an order id); '' for none
    data        json,                           -- what a waiter's wait_for_event returns
    emitted_at  timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE {schema}.pgjobs_event IS
    'Events emitted for durable steps (celery_ext.steps.emit); a wait returns the latest of its '
    'name and key.';
-- A wait reads the latest event of its name and key.
CREATE INDEX IF NOT EXISTS pgjobs_event_name_key_idx ON {schema}.pgjobs_event (name, key, id);
-- Retention: events emitted before the cutoff, oldest first.
CREATE INDEX IF NOT EXISTS pgjobs_event_emitted_idx ON {schema}.pgjobs_event (emitted_at);

-- Retention of steps: a dead letter celery_ext records for a failed task has an id of its own
-- and names the message it copies in error.job_id; a task's steps stay while it is there.
-- Built in the migration's transaction: dead-lettering waits for it (claims, publishes and
-- acks never touch this table); only rows with error.job_id are in it.
CREATE INDEX IF NOT EXISTS pgjobs_dead_letter_job_id_idx ON {schema}.pgjobs_dead_letter
    ((error ->> 'job_id')) WHERE error ? 'job_id';

-- The lock rows waiters and emitters serialise on (see the header).
INSERT INTO {schema}.pgjobs_lock (class, bucket)
SELECT 'event', b FROM generate_series(0, 1023) AS b
ON CONFLICT DO NOTHING;

-- Wake the parked waiters of the inserted events (a statement trigger: one pass per INSERT).
-- Each name and key's lock row is taken shared first, in row order, and held to the commit;
-- the UPDATE after it is a new statement with a new snapshot (read committed), so it sees
-- every waiter that parked before the locks were granted. A waiter's job row is woken only
-- while it is still parked under the claim that parked it (state ready, same claim number):
-- run_at now, out of the delayed index, and its queue's consumers notified.
CREATE OR REPLACE FUNCTION {schema}.pgjobs_event_wake_v1() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    saved_timeout text := current_setting('lock_timeout');
    woken_queues bigint;
BEGIN
    IF saved_timeout = '0' THEN
        PERFORM set_config('lock_timeout', '10s', true);
    END IF;
    PERFORM 1 FROM {schema}.pgjobs_lock AS l
     WHERE l.class = 'event'
       AND l.bucket IN (SELECT DISTINCT hashtext(e.name || '.' || e.key) & 1023
                          FROM new_events AS e)
     ORDER BY l.bucket
       FOR KEY SHARE;
    WITH woken AS (
        UPDATE {schema}.pgjobs_job AS j
           SET run_at = now(), delayed = false
          FROM {schema}.pgjobs_step AS s
         WHERE (s.event, s.event_key) IN (SELECT e.name, e.key FROM new_events AS e)
           AND s.state = 'waiting'
           AND j.id = s.job_id AND j.claim = s.claim AND j.state = 'ready'
           AND j.run_at > now()
        RETURNING j.queue
    )
    SELECT count(pg_notify('pgjobs.' || TG_TABLE_SCHEMA, w.queue)) INTO woken_queues
      FROM (SELECT DISTINCT queue FROM woken) AS w;
    IF saved_timeout = '0' THEN
        PERFORM set_config('lock_timeout', saved_timeout, true);
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_event_wake_v1() FROM PUBLIC;

DROP TRIGGER IF EXISTS pgjobs_event_wake_v1 ON {schema}.pgjobs_event;
CREATE TRIGGER pgjobs_event_wake_v1 AFTER INSERT ON {schema}.pgjobs_event
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pgjobs_event_wake_v1();
