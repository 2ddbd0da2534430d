-- pgjobs schema, version 4: vacuum never truncates the hot tables.

-- Truncating a table's empty tail takes an ACCESS EXCLUSIVE lock, which stalls every claim and
-- publish while it is held; a queue table grows back at once. Vacuum keeps the pages.
ALTER TABLE {schema}.pgjobs_job SET (vacuum_truncate = false);
ALTER TABLE {schema}.pgjobs_slot SET (vacuum_truncate = false);
