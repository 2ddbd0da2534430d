-- pgjobs schema, version 17: a publish wakes one waiting consumer, and none when no consumer
-- waits (issue 11, item 7).
--
-- Until version 16 every publishing statement sent a NOTIFY on the schema's channel: every
-- idle consumer woke and claimed (one got the message; six idle consumers cost 8.2
-- transactions per message), and a transaction that notifies holds a database-wide lock from
-- its pre-commit to the end of its commit, so concurrent publishers committed one at a time,
-- even when every consumer was busy and nobody listened for the news.
--
-- Now a consumer that LISTENs registers itself here when a claim finds its queues drained,
-- and the insert trigger wakes at most one registered consumer per message published
-- (oldest registration first), deleting its registration: a consumer that is not registered
-- is busy (its last claim took all it asked for) and claims again by itself. A publish that
-- finds nobody registered sends no NOTIFY at all.
--
-- The race between a publisher that reads the registrations and a consumer that registers is
-- closed with a per-queue advisory lock (class hashtext('pgjobs.wake'), key
-- hashtext('<schema>.<queue>')): the trigger holds it shared from before it reads the
-- registrations to its commit; a claim that registers tries it exclusively (never waiting)
-- in the same statement and reports whether it got it. Got it: every publisher that could
-- have missed the registration has committed, so one more drained claim proves the queue
-- empty and the consumer may sleep. Not got: a publish is in flight; the consumer looks again
-- shortly. Publishers only ever wait on a consumer's claim statement, never the reverse.
--
-- A registration's consumer holds a session advisory lock on its waiter id while it lives
-- (it is dropped with its connection): the trigger skips (and deletes) registrations whose
-- lock is free, so a killed worker's registration never swallows a wake-up.
--
-- Two cases fall back to the schema's channel (below), which every consumer of the queue
-- hears: a publish in a transaction that is not READ COMMITTED (its one snapshot may miss a
-- registration, and deleting one that another publisher deleted would fail the publish), and
-- registrations left that another open transaction holds locked (a publisher that may yet
-- roll back, and take its wake-up with it).
--
-- Other wake-ups (a requeue, a rescued lease, a resumed queue, a released limit) still
-- NOTIFY the schema's channel, which every consuming connection keeps LISTENing on.

CREATE UNLOGGED TABLE IF NOT EXISTS {schema}.pgjobs_waiter (
    queue   text NOT NULL,                        -- the queue the consumer waits on
    waiter  bigint NOT NULL,                      -- the consumer's wake id: it LISTENs on
                                                  -- 'pgjobs.w.<waiter>' and holds the
                                                  -- session advisory lock <waiter>
    since   timestamptz NOT NULL DEFAULT now(),   -- registered at (the oldest is woken first)
    PRIMARY KEY (queue, waiter)
);
COMMENT ON TABLE {schema}.pgjobs_waiter IS
    'Consumers waiting for a queue (unlogged: registrations are renewed by live consumers).';

CREATE OR REPLACE FUNCTION {schema}.pgjobs_wake_v1() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    q record;
    next_waiter bigint;
    woken integer;
BEGIN
    FOR q IN SELECT queue, count(*) AS n FROM new_rows GROUP BY queue ORDER BY queue LOOP
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            -- One snapshot for the whole transaction: it may not see a registration made
            -- since, and deleting one another publisher deleted meanwhile would fail the
            -- publish. Every consumer of the queue hears the schema's channel instead.
            PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue);
            CONTINUE;
        END IF;
        -- Held to the commit; waits only for a consumer's claim that is registering now.
        PERFORM pg_advisory_xact_lock_shared(hashtext('pgjobs.wake'),
                                             hashtext(TG_TABLE_SCHEMA || '.' || q.queue));
        -- Every consumer busy (the common case under load): one probe, nothing to wake.
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_waiter AS r
                                   WHERE r.queue = q.queue);
        woken := 0;
        LOOP
            -- One registration at a time (a FOR loop would lock the ten it fetches): a fresh
            -- snapshot per statement sees a registration committed before the lock was
            -- granted; concurrent publishers wake different consumers (SKIP LOCKED).
            SELECT r.waiter INTO next_waiter FROM {schema}.pgjobs_waiter AS r
             WHERE r.queue = q.queue
             ORDER BY r.since, r.waiter
             LIMIT 1
               FOR UPDATE SKIP LOCKED;
            EXIT WHEN NOT FOUND;
            DELETE FROM {schema}.pgjobs_waiter AS r
             WHERE r.queue = q.queue AND r.waiter = next_waiter;
            -- Its consumer holds the lock while it lives: a free lock is a dead registration.
            IF NOT pg_try_advisory_xact_lock_shared(next_waiter) THEN
                PERFORM pg_notify('pgjobs.w.' || next_waiter, q.queue);
                woken := woken + 1;
                EXIT WHEN woken >= q.n;
            END IF;
        END LOOP;
        IF woken < q.n AND EXISTS (SELECT 1 FROM {schema}.pgjobs_waiter AS r
                                    WHERE r.queue = q.queue) THEN
            -- Registrations another open transaction holds (a publisher that may yet roll
            -- back, and take its wake-up with it): every consumer of the queue hears this.
            PERFORM pg_notify('pgjobs.' || TG_TABLE_SCHEMA, q.queue);
        END IF;
    END LOOP;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS pgjobs_job_notify_v1 ON {schema}.pgjobs_job;
DROP TRIGGER IF EXISTS pgjobs_job_wake_v1 ON {schema}.pgjobs_job;
CREATE TRIGGER pgjobs_job_wake_v1 AFTER INSERT ON {schema}.pgjobs_job
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pgjobs_wake_v1();
DROP FUNCTION IF EXISTS {schema}.pgjobs_notify_v1();
