-- pgjobs schema, version 25: what ran, how long, how it ended (issues 30 and 34).
--
-- pgjobs_history: one compact row per settled delivery, written by the settle's own statement
-- (the ack folded into a claim, a requeue, a dead-lettering, a keeper's burial): never a second
-- round trip per message. Kept for retention_history (7 days by default) by the retention
-- sweep; the `history` transport option (False) writes none.
--
-- pgjobs_task_minute: per task and minute, the count of each outcome and the runtime
-- percentiles, rolled up from the history of closed minutes (by the keeper that takes the
-- rollup turn, once a minute fleet-wide), so that the dashboard's tasks page reads at most
-- 1,440 rows per task for a day whatever the volume.
--
-- pgjobs_job.claimed_at: when the current claim was taken (a runtime is settle time minus
-- it). pgjobs_job.outcome: how a run that has not been acked yet ended, when its worker said
-- so before the ack (celery_ext: 'failed' for a final failure kept as a dead letter copy,
-- 'dropped' for one with dead_letter=False): the ack counts and records that word instead of
-- 'completed'.
--
-- The counters' words become the outcomes' (docs/operations.md, "History"): 'acked' is now
-- 'completed' and a dead-lettering is 'failed' (as celery_ext's on_settled says). Rows
-- written under the old words are renamed; readers map the old words too (a worker of the
-- previous version may still write them during a rolling upgrade). Everything is idempotent.

ALTER TABLE {schema}.pgjobs_job ADD COLUMN IF NOT EXISTS claimed_at timestamptz;
ALTER TABLE {schema}.pgjobs_job ADD COLUMN IF NOT EXISTS outcome text
    CHECK (outcome IN ('failed', 'dropped', 'requeued'));
COMMENT ON COLUMN {schema}.pgjobs_job.claimed_at IS
    'When the current claim was taken (NULL: never claimed, or claimed before version 25).';
COMMENT ON COLUMN {schema}.pgjobs_job.outcome IS
    'How the running delivery ended, told by its worker before the ack: failed, dropped or '
    'requeued (a Celery retry) (NULL: the ack means completed).';

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_history (
    settled_at  timestamptz NOT NULL DEFAULT now(),  -- when the settle committed (its statement)
    job_id      bigint NOT NULL,      -- the message's id (pgjobs_job.id; a dead letter keeps it)
    claim       integer NOT NULL,     -- the delivery's claim number
    task        text,                 -- Celery task name (NULL: not a Celery task message)
    queue       text NOT NULL,
    tenant      text,                 -- x-pgjobs-tenant
    outcome     text NOT NULL CHECK (outcome IN ('completed', 'failed', 'dropped', 'cancelled',
                                                 'requeued')),
    runtime     real,                 -- seconds from claim to settle (NULL: not known)
    attempts    integer NOT NULL,     -- deliveries that counted, this one included
    worker      text                  -- the lease holder: node:pid:incarnation
);
COMMENT ON TABLE {schema}.pgjobs_history IS
    'One row per settled delivery: task, queue, tenant, outcome, runtime, attempts, worker.';
-- `pgjobs history` newest first, and retention oldest first.
CREATE INDEX IF NOT EXISTS pgjobs_history_settled_idx ON {schema}.pgjobs_history (settled_at);
-- `pgjobs history --task NAME` and a task's page: that task's newest first.
CREATE INDEX IF NOT EXISTS pgjobs_history_task_idx ON {schema}.pgjobs_history (task, settled_at);
-- (No index on job_id: an early-acked run's failure finds the row its ack wrote through the
-- task index, within the run's time; every index here is paid by every settle.)

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_task_minute (
    task        text NOT NULL,        -- Celery task name ('' for messages without one)
    minute      timestamptz NOT NULL, -- the minute the settles fell in
    completed   bigint NOT NULL DEFAULT 0,
    failed      bigint NOT NULL DEFAULT 0,
    dropped     bigint NOT NULL DEFAULT 0,
    cancelled   bigint NOT NULL DEFAULT 0,
    requeued    bigint NOT NULL DEFAULT 0,
    runtime_p50 real,                 -- seconds, over the settles with a known runtime
    runtime_p95 real,
    runtime_max real,
    PRIMARY KEY (task, minute)
);
COMMENT ON TABLE {schema}.pgjobs_task_minute IS
    'Per task and minute: settles by outcome and runtime p50/p95/max, rolled up from history.';
-- Retention, and the tasks page's "every task over the last day".
CREATE INDEX IF NOT EXISTS pgjobs_task_minute_minute_idx ON {schema}.pgjobs_task_minute (minute);

-- The rollup's turn and watermark: one row. A keeper takes the turn with one conditional
-- UPDATE (the minute before the last closed one is past the watermark), so each minute is
-- rolled up once fleet-wide; never an advisory lock (0021_trust_boundary.sql).
CREATE TABLE IF NOT EXISTS {schema}.pgjobs_rollup (
    id        integer PRIMARY KEY CHECK (id = 1),
    upto      timestamptz NOT NULL DEFAULT date_trunc('minute', now()),  -- minutes before it
                                                                         -- are rolled up
    rolled_by text                                                       -- the last keeper
);
COMMENT ON TABLE {schema}.pgjobs_rollup IS
    'The history rollup''s watermark: minutes before upto are in pgjobs_task_minute.';
INSERT INTO {schema}.pgjobs_rollup (id) VALUES (1) ON CONFLICT DO NOTHING;

-- Version 22's wake trigger, with the hand-off's claim time recorded (claimed_at).
CREATE OR REPLACE FUNCTION {schema}.pgjobs_wake_v3() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q record;
    w record;
    woken integer;
    paused boolean;
    handed bigint[];
    job_id bigint;
    job_claim integer;
    saved_timeout text;
    epoch_base integer;
BEGIN
    FOR q IN SELECT queue, count(*) AS n FROM new_rows GROUP BY queue ORDER BY queue LOOP
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- One snapshot for the whole transaction: it may not see a registration made
            -- since, and deleting one another publisher deleted meanwhile would fail the
            -- publish. Every consumer of the queue hears the schema's channel instead.
            PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue);
            CONTINUE;
        END IF;
        -- Held to the commit; waits only for a consumer's claim that is registering now,
        -- bounded by lock_timeout (10 s in a session without one). Written out rather than
        -- a call of pgjobs_lock_v1: a PL/pgSQL call here cost 0.25 ms a publish.
        IF saved_timeout IS NULL THEN
            saved_timeout := current_setting('lock_timeout');
            IF saved_timeout = '0' THEN
                PERFORM set_config('lock_timeout', '10s', true);
            END IF;
        END IF;
        PERFORM 1 FROM {schema}.pgjobs_lock AS l
         WHERE l.class = 'wake' AND l.bucket = hashtext(TG_TABLE_SCHEMA || '.' || q.queue) & 1023
           FOR KEY SHARE;
        -- Every consumer busy (the common case under load): one probe, nothing to wake.
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_waiter AS r
                                   WHERE r.queue = q.queue);
        woken := 0;
        handed := ARRAY[]::bigint[];
        paused := NULL;
        LOOP
            -- One registration at a time (a FOR loop would lock the ten it fetches): a fresh
            -- snapshot per statement sees a registration committed before the lock was
            -- granted; concurrent publishers wake different consumers (SKIP LOCKED).
            SELECT r.waiter, r.worker, r.lease_ttl INTO w FROM {schema}.pgjobs_waiter AS r
             WHERE r.queue = q.queue
             ORDER BY r.since, r.waiter
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            DELETE FROM {schema}.pgjobs_waiter AS r
             WHERE r.queue = q.queue AND r.waiter = w.waiter;
            -- Its consumer holds the lock while it lives: a free lock is a dead registration.
            -- (Only tried: an outsider holding a dead consumer's id can make this wake-up go
            -- to nobody; its message then runs when its lease lapses, or a claim takes it.)
            CONTINUE WHEN pg_try_advisory_xact_lock_shared(w.waiter);
            job_id := NULL;
            -- (a publish that is its own transaction: see version 18's header)
            IF w.lease_ttl IS NOT NULL
               AND current_setting('pgjobs.hand_off', true) = 'on' THEN
                IF paused IS NULL THEN
                    paused := coalesce((SELECT p.paused FROM {schema}.pgjobs_queue AS p
                                         WHERE p.name = q.queue), false);
                END IF;
                IF NOT paused AND epoch_base IS NULL THEN
                    -- the claim statement's epoch base (fenced here if the server restarted)
                    epoch_base := coalesce(
                        (SELECT e.base FROM {schema}.pgjobs_epoch AS e
                          WHERE e.id AND e.started = pg_postmaster_start_time()),
                        {schema}.pgjobs_fence_epoch_v2());
                END IF;
                IF NOT paused THEN
                    -- The claim statement's claim, of the best row this statement inserted
                    -- that it would take at once and that no other consumer was handed,
                    -- marked for the consumer it is handed to.
                    UPDATE {schema}.pgjobs_job AS j
                       SET state = 'running',
                           claim = greatest(j.claim, epoch_base) + 1,
                           attempts = j.attempts + 1,
                           lease_expires_at = now() + make_interval(secs => w.lease_ttl),
                           worker = w.worker,
                           claimed_at = now()
                     WHERE j.id = (SELECT n.id FROM new_rows AS n
                                    WHERE n.queue = q.queue AND n.state = 'ready'
                                      AND NOT n.delayed AND n.run_at <= now()
                                      AND (n.expires_at IS NULL OR n.expires_at > now())
                                      AND n.limits IS NULL
                                      AND n.id <> ALL (handed)
                                    ORDER BY n.priority DESC, n.run_at, n.id
                                    LIMIT 1)
                       AND j.state = 'ready'
                    RETURNING j.id, j.claim INTO job_id, job_claim;
                    IF job_id IS NOT NULL
                       AND current_setting('synchronous_commit') = 'off' THEN
                        -- A claim is durable: this transaction's commit is flushed (to the
                        -- local disk at least) before its holder hears of it.
                        PERFORM set_config('synchronous_commit', 'local', true);
                    END IF;
                END IF;
            END IF;
            IF job_id IS NULL THEN
                PERFORM pg_notify('pgjobs.w.' || w.waiter, q.queue);
            ELSE
                handed := handed || job_id;
                INSERT INTO {schema}.pgjobs_handoff (job_id, claim, waiter)
                VALUES (job_id, job_claim, w.waiter)
                ON CONFLICT ON CONSTRAINT pgjobs_handoff_pkey DO UPDATE
                   SET claim = excluded.claim, waiter = excluded.waiter, since = now();
                -- ids only: the consumer reads the message with its fenced take
                PERFORM pg_notify('pgjobs.w.' || w.waiter,
                                  E'\x1e' || job_id || ' ' || job_claim || ':' || q.queue);
            END IF;
            woken := woken + 1;
            EXIT WHEN woken >= q.n;
        END LOOP;
        IF woken < q.n AND EXISTS (SELECT 1 FROM {schema}.pgjobs_waiter AS r
                                    WHERE r.queue = q.queue) THEN
            -- Registrations another open transaction holds (a publisher that may yet roll
            -- back, and take its wake-up with it): every consumer of the queue hears this.
            PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue);
        END IF;
    END LOOP;
    IF saved_timeout = '0' THEN
        PERFORM set_config('lock_timeout', saved_timeout, true);
    END IF;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {schema}.pgjobs_wake_v3() FROM PUBLIC;

-- The old words of the counters, renamed (merged into any row of the new word).
INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
SELECT queue, CASE outcome WHEN 'acked' THEN 'completed' ELSE 'failed' END, bucket, shard, n
  FROM {schema}.pgjobs_counter WHERE outcome IN ('acked', 'dead')
ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n;
DELETE FROM {schema}.pgjobs_counter WHERE outcome IN ('acked', 'dead');
