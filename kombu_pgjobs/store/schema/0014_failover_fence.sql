-- pgjobs schema, version 14: claim numbers stay fenced across a failover (issue 18).
--
-- A claim is fenced on (id, claim): a worker can settle a run only with the claim number the
-- claim gave it. After a failover to a standby that lacked the primary's last commits (an
-- asynchronous standby, or a restore from backup), a claim the old primary made can be gone
-- while its worker still holds the number: the new primary would hand the same number out
-- again, and the old holder's ack would settle the new run. A promotion (or a restore) starts
-- a new WAL timeline. pgjobs_fence_epoch_v1, run on every new pgjobs connection, sees the new
-- timeline before the first claim on it and moves every claim number (live rows, dead letters,
-- slots) up by p_step: every number handed out afterwards is above any the old primary gave.
-- Holders of earlier numbers then miss their fence (PGJ-201) and their messages come back when
-- the leases lapse: a message that was running at the failover may run twice; none is settled
-- by the wrong run.

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_epoch (
    id         boolean PRIMARY KEY DEFAULT true CHECK (id),  -- one row
    timeline   integer NOT NULL,                   -- the WAL timeline claims are fenced for
    fenced_at  timestamptz NOT NULL DEFAULT now(),  -- when claim numbers last moved up
    fences     integer NOT NULL DEFAULT 0           -- how many timeline changes were fenced
);
COMMENT ON TABLE {schema}.pgjobs_epoch IS
    'The WAL timeline claim numbers are fenced for; a new one (a promotion, a restore) moves '
    'every claim number up before the first claim on it.';

CREATE OR REPLACE FUNCTION {schema}.pgjobs_timeline_v1() RETURNS integer
LANGUAGE sql VOLATILE AS $$
    -- the timeline WAL is written on now: the first 8 hex digits of the current WAL file name
    SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::integer
$$;

INSERT INTO {schema}.pgjobs_epoch (timeline)
SELECT {schema}.pgjobs_timeline_v1() WHERE NOT pg_is_in_recovery()
ON CONFLICT (id) DO NOTHING;

-- Returns the number of rows whose claim moved (0: the timeline was known, nothing to do).
-- The common case is one primary-key read. A change is applied once, under a transaction-scoped
-- advisory lock: connections racing after a promotion wait, then find it done.
CREATE OR REPLACE FUNCTION {schema}.pgjobs_fence_epoch_v1(p_step integer) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    tl integer;
    known integer;
    moved bigint := 0;
    n bigint;
BEGIN
    IF pg_is_in_recovery() THEN  -- a standby: nothing is claimed here
        RETURN 0;
    END IF;
    tl := {schema}.pgjobs_timeline_v1();
    SELECT timeline INTO known FROM {schema}.pgjobs_epoch;
    IF known = tl THEN
        RETURN 0;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('pgjobs.epoch'), hashtext('{schema}'));
    SELECT timeline INTO known FROM {schema}.pgjobs_epoch FOR UPDATE;
    IF known = tl THEN
        RETURN 0;
    END IF;
    IF known IS NULL THEN  -- installed on a standby, first seen on a primary: nothing to fence
        INSERT INTO {schema}.pgjobs_epoch (timeline) VALUES (tl) ON CONFLICT (id) DO NOTHING;
        RETURN 0;
    END IF;
    UPDATE {schema}.pgjobs_job SET claim = claim + p_step;
    GET DIAGNOSTICS n = ROW_COUNT;
    moved := moved + n;
    UPDATE {schema}.pgjobs_dead_letter SET claim = claim + p_step;
    GET DIAGNOSTICS n = ROW_COUNT;
    moved := moved + n;
    UPDATE {schema}.pgjobs_slot SET claim = claim + p_step WHERE claim IS NOT NULL;
    UPDATE {schema}.pgjobs_epoch
       SET timeline = tl, fenced_at = now(), fences = fences + 1;
    RETURN moved;
END
$$;
