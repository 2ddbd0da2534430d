-- name: consumer_forget :exec
-- A consumer process stops cleanly (warm shutdown, a closed backend): its row goes at once, so
-- `pgjobs workers` and the metrics stop listing it (a killed process's row goes when it has been
-- unseen for three keeper ticks).
DELETE FROM {schema}.pgjobs_consumer WHERE worker = %(worker)s;
