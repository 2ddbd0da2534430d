-- pgjobs schema, version 16: revokes kept in Postgres (issue 16, item 3).
--
-- Celery keeps revoked task ids in each worker's memory: a worker that was down when
-- `celery control revoke ID` was broadcast, or a fleet restarted at once, forgets them, and a
-- revoked task that was already due then runs. pgjobs sees the broadcast when it is published:
-- it deletes the delayed rows of those ids (version 11) and now also records the ids here, for
-- as long as Celery keeps a revoke (three hours). celery_ext loads them into a starting
-- worker's revoked set, so a revoked message still in the queue is discarded (and acked: gone
-- from Postgres) by whichever worker claims it, however many restarts later.

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_revoked (
    task_id     text PRIMARY KEY,                  -- the Celery task id revoked
    revoked_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL               -- forgotten after this (as Celery does)
);
COMMENT ON TABLE {schema}.pgjobs_revoked IS
    'Celery task ids revoked by a broadcast, loaded by starting workers (celery_ext).';
CREATE INDEX IF NOT EXISTS pgjobs_revoked_expires_idx ON {schema}.pgjobs_revoked (expires_at);
