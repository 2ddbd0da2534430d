-- pgjobs schema, version 19: the claim can no longer read the task-id index.
--
-- pgjobs_job_task_id_idx (version 11) had the predicate of pgjobs_job_delayed_idx, so it
-- could serve the claim's read of the due delayed rows, with no index condition: a whole
-- scan of every delayed row. The planner chose it for a claim planned while the table was
-- small (the claim connection keeps that plan; see backend.CLAIM_SESSION), and a worker would
-- have read every delayed row on every claim once they came. The same index, whose predicate
-- also asks for the task id (which Celery's revoke and `pgjobs cancel --task-id` look up with
-- `= ANY(...)`, so they still use it), is out of the claim's reach.

CREATE INDEX IF NOT EXISTS pgjobs_job_delayed_task_id_idx ON {schema}.pgjobs_job
    ((message -> 'headers' ->> 'id'))
    WHERE state = 'ready' AND delayed AND (message -> 'headers' ->> 'id') IS NOT NULL;
DROP INDEX IF EXISTS {schema}.pgjobs_job_task_id_idx;
