-- pgjobs schema, version 15: listing parked (waiting) messages pages by index (issue 19).
--
-- `pgjobs ls --state waiting` and the dashboard's /messages?state=waiting read waiting rows in
-- id order. The parking index orders them by key and claim order, so a page read and sorted
-- every parked row (a 100,000-message flood: close to a second). Keyed by id, a page is one
-- range scan from the cursor. Only a message that is parked has an entry: the claim, the ack
-- and the publish of every other message pay nothing for it.

CREATE INDEX IF NOT EXISTS pgjobs_job_waiting_id_idx ON {schema}.pgjobs_job (id)
    WHERE state = 'waiting';
