-- pgjobs schema, version 18: a publish hands its message to the consumer it wakes (issue 17,
-- idle latency).
--
-- Since version 17 a publish wakes one registered (idle) consumer per message, which then
-- claims it: a second durable commit (the claim) and a round trip between the publish's commit
-- and the task's start. Now the trigger claims the message for the consumer it wakes, in the
-- publisher's own transaction, and the NOTIFY carries the claimed row: the consumer delivers it
-- without a statement. The claim is the same as the claim statement's (state 'running', claim
-- number + 1, one attempt counted, the registration's worker and lease TTL), it commits
-- together with the message it claims (a claim is never lost while its message survives), and
-- the fence stays on the claim number: the consumer acks, renews and rejects it like any other.
--
-- A registration carries what the claim needs: the consumer's worker name and lease TTL
-- (NULL: a consumer that wants wake-ups only, transport option hand_off=False). A woken
-- consumer gets at most one message per registration (the registration is deleted as before).
--
-- A claim is durable: a publish that hands off and would commit asynchronously
-- (durable_publish=False, synchronous_commit=off) has its commit flushed to the local disk
-- (synchronous_commit=local for this transaction) before the NOTIFY goes out, so a crash can
-- never lose a claim whose holder runs it. (With confirm_publish=False the publisher does not
-- wait for that commit.)
--
-- Only a publish statement that is its whole transaction hands off (an autocommit publish,
-- each message of a pipelined one; the statement says so by setting pgjobs.hand_off = 'on'
-- for its transaction): the lease starts at the transaction's start, and a transaction that
-- goes on (an outbox publish inside the app's transaction) could commit after the lease it
-- gave had lapsed. Its wake-up is a plain one. And only a message the claim
-- statement would take at once, unchanged, is handed off: ready, due, not expired, without
-- limits (a limit is admitted by the claim statement, with its key's lock), on a queue that is
-- not paused, and small enough for a NOTIFY payload (its stored text under 7,000 bytes). Any
-- other message wakes the consumer as before, which claims it.
--
-- The payload of a hand-off (on the consumer's channel 'pgjobs.w.<waiter>'):
--     E'\x1e' || id || ' ' || claim || ' ' || length(queue) || ' ' || queue || message
-- A plain wake-up's payload is the queue's name, as before.

ALTER TABLE {schema}.pgjobs_waiter
    ADD COLUMN IF NOT EXISTS worker text,           -- the consumer's worker name (the lease holder)
    ADD COLUMN IF NOT EXISTS lease_ttl float8;      -- its lease TTL in seconds; NULL: wake only
COMMENT ON COLUMN {schema}.pgjobs_waiter.worker IS
    'Lease holder named on a message handed to this consumer (host:pid).';
COMMENT ON COLUMN {schema}.pgjobs_waiter.lease_ttl IS
    'Lease TTL (seconds) of a message handed to this consumer; NULL: wake it, it claims itself.';

CREATE OR REPLACE FUNCTION {schema}.pgjobs_wake_v2() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    q record;
    w record;
    woken integer;
    paused boolean;
    handed bigint[];
    job_id bigint;
    job_claim integer;
    job_message text;
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
            CONTINUE WHEN pg_try_advisory_xact_lock_shared(w.waiter);
            job_id := NULL;
            -- (a publish that is its own transaction: see the header)
            IF w.lease_ttl IS NOT NULL
               AND current_setting('pgjobs.hand_off', true) = 'on' THEN
                IF paused IS NULL THEN
                    paused := coalesce((SELECT p.paused FROM {schema}.pgjobs_queue AS p
                                         WHERE p.name = q.queue), false);
                END IF;
                IF NOT paused THEN
                    -- The claim statement's claim, of the best row this statement inserted
                    -- that it would take at once and that no other consumer was handed.
                    UPDATE {schema}.pgjobs_job AS j
                       SET state = 'running',
                           claim = j.claim + 1,
                           attempts = j.attempts + 1,
                           lease_expires_at = now() + make_interval(secs => w.lease_ttl),
                           worker = w.worker
                     WHERE j.id = (SELECT n.id FROM new_rows AS n
                                    WHERE n.queue = q.queue AND n.state = 'ready'
                                      AND NOT n.delayed AND n.run_at <= now()
                                      AND (n.expires_at IS NULL OR n.expires_at > now())
                                      AND n.limits IS NULL
                                      AND octet_length(n.message::text) < 7000
                                      AND n.id <> ALL (handed)
                                    ORDER BY n.priority DESC, n.run_at, n.id
                                    LIMIT 1)
                       AND j.state = 'ready'
                    RETURNING j.id, j.claim, j.message::text
                         INTO job_id, job_claim, job_message;
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
                PERFORM pg_notify('pgjobs.w.' || w.waiter,
                                  E'\x1e' || job_id || ' ' || job_claim || ' '
                                  || length(q.queue) || ' ' || q.queue || job_message);
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
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS pgjobs_job_wake_v1 ON {schema}.pgjobs_job;
DROP TRIGGER IF EXISTS pgjobs_job_wake_v2 ON {schema}.pgjobs_job;
CREATE TRIGGER pgjobs_job_wake_v2 AFTER INSERT ON {schema}.pgjobs_job
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pgjobs_wake_v2();
DROP FUNCTION IF EXISTS {schema}.pgjobs_wake_v1();
