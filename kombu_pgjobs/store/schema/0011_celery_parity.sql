-- pgjobs schema, version 11: Celery parity (issue 16) — revokes that reach Postgres, and dead
-- letters that keep when the message was due, when it expired and who held it last.
--
-- A revoked Celery task that waits for its ETA used to run after a worker restart (the revoke
-- lived only in the memory of the workers that were up). Now `celery control revoke ID` (the
-- transport reads the broadcast) and `pgjobs cancel --task-id ID` delete the waiting row. They
-- find it by Celery's task id, the `id` header of the stored message, through this index.
--
-- The index covers delayed rows only (the predicate of pgjobs_job_delayed_idx): those are the
-- messages that wait long enough for a revoke to find them, and a publish without an ETA (the
-- hot path) pays nothing for it (a partial index's expression is computed only for rows its
-- predicate admits; computing it parses the message). A due message is claimed at once and
-- Celery's worker discards it when its id is in the worker's revoked set.

CREATE INDEX IF NOT EXISTS pgjobs_job_task_id_idx ON {schema}.pgjobs_job
    ((message -> 'headers' ->> 'id'))
    WHERE state = 'ready' AND delayed;

ALTER TABLE {schema}.pgjobs_dead_letter
    ADD COLUMN IF NOT EXISTS run_at timestamptz,      -- the job's due time when it died
    ADD COLUMN IF NOT EXISTS expires_at timestamptz,  -- the job's expiry when it died
    ADD COLUMN IF NOT EXISTS worker text;             -- its last lease holder (host:pid)
COMMENT ON COLUMN {schema}.pgjobs_dead_letter.run_at IS
    'The job''s run_at when it was dead-lettered (NULL: not recorded, before version 11).';
COMMENT ON COLUMN {schema}.pgjobs_dead_letter.expires_at IS
    'The job''s expires_at when it was dead-lettered (NULL: none, or not recorded).';
COMMENT ON COLUMN {schema}.pgjobs_dead_letter.worker IS
    'The last holder of the job''s lease (host:pid; NULL: never held, or not recorded).';

-- A promoted message (`pgjobs requeue` of a delayed one, `pgjobs bulk promote`) is due now, but
-- Celery reads the ETA from the message and would hold the task in memory until then: its `eta`
-- header is cleared. Anything that is not a Celery message (no headers object, no eta) is
-- returned unchanged.
CREATE OR REPLACE FUNCTION {schema}.pgjobs_without_eta_v1(message json) RETURNS json
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN json_typeof(message -> 'headers') = 'object'
                     AND (message -> 'headers' ->> 'eta') IS NOT NULL
                THEN jsonb_set(message::jsonb, ARRAY['headers', 'eta'], 'null'::jsonb)::json
                ELSE message END
$$;
