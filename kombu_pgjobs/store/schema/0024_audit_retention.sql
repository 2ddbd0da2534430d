-- pgjobs schema, version 24: the audit log and the automatic retention sweep (issue 34).
--
-- pgjobs_audit: one row per write an operator made through the pgjobs CLI or the dashboard
-- (who, what, the exact filter or ids, how many rows, when). The dashboard writes it in the
-- action's own transaction; the CLI right after its command (a bulk command runs in batches,
-- each its own transaction). The automatic sweep deletes rows past their window.
--
-- pgjobs_retention: one row, the sweep's turn. A keeper takes the turn with one conditional
-- UPDATE of this row (swept_at older than the interval): the update's row lock serialises two
-- keepers, and only the first of them finds the row still due. Locking or updating the row
-- needs the UPDATE grant on this table, which no role outside the app has (never an advisory
-- lock, see 0021_trust_boundary.sql). Everything here is idempotent.

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_audit (
    id       bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),   -- when (the database's clock)
    origin   text NOT NULL CHECK (origin IN ('cli', 'dashboard')),
    actor    text NOT NULL,     -- cli: the OS user; dashboard: 'session' or 'bearer'
    host     text,              -- cli: the host name; dashboard: the client's address
    action   text NOT NULL,     -- 'dead requeue', 'purge', 'schedule pause', ...
    target   jsonb NOT NULL DEFAULT jsonb_build_object(),  -- the exact filter or ids given
    rows     bigint             -- how many rows the write changed (NULL: not known)
);
COMMENT ON TABLE {schema}.pgjobs_audit IS
    'Writes by operators through the pgjobs CLI and the dashboard: who, what, how many, when.';
-- Retention: rows older than the window, oldest first.
CREATE INDEX IF NOT EXISTS pgjobs_audit_at_idx ON {schema}.pgjobs_audit (at);

CREATE TABLE IF NOT EXISTS {schema}.pgjobs_retention (
    id        integer PRIMARY KEY CHECK (id = 1),
    swept_at  timestamptz NOT NULL DEFAULT '-infinity',  -- the last sweep's start
    swept_by  text                                       -- the process that ran it
);
COMMENT ON TABLE {schema}.pgjobs_retention IS
    'The automatic retention sweep''s turn: one row, taken by a conditional UPDATE.';
INSERT INTO {schema}.pgjobs_retention (id) VALUES (1) ON CONFLICT DO NOTHING;
