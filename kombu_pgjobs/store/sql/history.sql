-- History and its rollups (0025_history.sql): what ran, how long, how it ended. The settles
-- write pgjobs_history themselves (job.sql); these statements amend, roll up, read and prune it.

-- name: job_outcome :one
-- How a delivery ended, told by its worker (celery_ext) where the transport cannot know it:
-- 'failed' (a final failure, kept as a dead letter copy), 'dropped' (one with
-- dead_letter=False) or 'requeued' (a Celery retry: the same task's next message follows). While the row is still held under %(claim)s (acks_late) the word is
-- noted on the row, and its ack counts and records it instead of 'completed'. Once acked
-- (Celery's early ack settled it when it started) the history row that ack wrote is amended
-- and the one settle moves from 'completed' to the word in the counters (the ack's bucket and
-- shard) and in the rollup; with no history row either (history off), the word is counted
-- now, the ack's 'completed' standing. The history row is looked for among the settles of task
-- %(task)s within %(elapsed)s seconds (how long the run has gone; NULL: a day) and ten minutes
-- more (clocks), through pgjobs_history_task_idx. %(runtime)s (seconds, NULL: unknown)
-- replaces an early ack's runtime. Returns how many of the three paths applied (0 or 1).
WITH held AS (
    UPDATE {schema}.pgjobs_job AS j
       SET outcome = %(outcome)s
     WHERE j.id = %(job_id)s::bigint AND j.claim = %(claim)s::int AND j.state = 'running'
    RETURNING j.id
), amended AS (
    UPDATE {schema}.pgjobs_history AS h
       SET outcome = %(outcome)s, runtime = coalesce(%(runtime)s::real, h.runtime)
     WHERE h.task = %(task)s::text
       AND h.settled_at >= now() - make_interval(secs => coalesce(%(elapsed)s::float8, 86400)
                                                        + 600)
       AND h.job_id = %(job_id)s::bigint AND h.claim = %(claim)s::int
       AND h.outcome = 'completed'
       AND NOT EXISTS (SELECT 1 FROM held)
    RETURNING h.queue, coalesce(h.task, '') AS task, date_trunc('minute', h.settled_at) AS bucket,
              h.worker
), moved AS (
    UPDATE {schema}.pgjobs_counter AS c
       SET n = c.n - 1
      FROM amended AS a
     WHERE c.queue = a.queue AND c.outcome = 'completed' AND c.bucket = a.bucket
       AND c.shard = a.worker AND c.n > 0
), counted AS (
    INSERT INTO {schema}.pgjobs_counter AS c (queue, outcome, bucket, shard, n)
    SELECT queue, %(outcome)s, bucket, worker, 1 FROM amended
    UNION ALL
    SELECT %(queue)s, %(outcome)s, date_trunc('minute', now()), %(shard)s, 1
     WHERE NOT EXISTS (SELECT 1 FROM held) AND NOT EXISTS (SELECT 1 FROM amended)
    ON CONFLICT (queue, outcome, bucket, shard) DO UPDATE SET n = c.n + excluded.n
), rerolled AS (
    -- a minute already rolled up moves its one settle too
    UPDATE {schema}.pgjobs_task_minute AS m
       SET completed = greatest(m.completed - 1, 0),
           failed = m.failed + (%(outcome)s = 'failed')::int,
           dropped = m.dropped + (%(outcome)s = 'dropped')::int,
           requeued = m.requeued + (%(outcome)s = 'requeued')::int
      FROM amended AS a
     WHERE m.task = a.task AND m.minute = a.bucket
)
SELECT (SELECT count(*) FROM held) + (SELECT count(*) FROM amended);

-- name: history_rollup :one
-- The rollup's turn and work, in one statement (a keeper's, at most once a minute): when the
-- last closed minute but one is past the watermark, take the turn (the one row's lock: a
-- second keeper waits, then finds it taken) and roll up the history of the minutes from the
-- watermark (at most a day back) to that minute: per task and minute, the count of each
-- outcome and the runtime p50/p95/max. A minute is rolled up once it has been closed for a
-- minute (a settle's statement commits within it). Returns (minutes rolled up to, rows
-- written), or no row when it was not this keeper's turn.
WITH target AS MATERIALIZED (
    SELECT date_trunc('minute', now() - interval '1 minute') AS upto
), old AS MATERIALIZED (
    SELECT r.upto AS since
      FROM {schema}.pgjobs_rollup AS r, target AS t
     WHERE r.id = 1 AND r.upto < t.upto
       FOR UPDATE OF r
), turn AS (
    UPDATE {schema}.pgjobs_rollup AS r
       SET upto = t.upto, rolled_by = %(who)s
      FROM target AS t, old AS o
     WHERE r.id = 1
    RETURNING greatest(o.since, t.upto - interval '1 day') AS since, t.upto
), rolled AS (
    INSERT INTO {schema}.pgjobs_task_minute AS m
           (task, minute, completed, failed, dropped, cancelled, requeued,
            runtime_p50, runtime_p95, runtime_max)
    SELECT coalesce(h.task, ''), date_trunc('minute', h.settled_at),
           count(*) FILTER (WHERE h.outcome = 'completed'),
           count(*) FILTER (WHERE h.outcome = 'failed'),
           count(*) FILTER (WHERE h.outcome = 'dropped'),
           count(*) FILTER (WHERE h.outcome = 'cancelled'),
           count(*) FILTER (WHERE h.outcome = 'requeued'),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY h.runtime),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY h.runtime),
           max(h.runtime)
      FROM turn AS t
      JOIN {schema}.pgjobs_history AS h
        ON h.settled_at >= t.since AND h.settled_at < t.upto
     GROUP BY 1, 2
    ON CONFLICT (task, minute) DO UPDATE
       SET completed = excluded.completed, failed = excluded.failed,
           dropped = excluded.dropped, cancelled = excluded.cancelled,
           requeued = excluded.requeued, runtime_p50 = excluded.runtime_p50,
           runtime_p95 = excluded.runtime_p95, runtime_max = excluded.runtime_max
    RETURNING 1
)
SELECT t.upto, (SELECT count(*) FROM rolled) FROM turn AS t;

-- name: history_list :many
-- `pgjobs history`: settled deliveries, newest first, at most %(limit)s, of a task, an
-- outcome, a tenant, a worker (NULL: any), settled since %(since)s and before %(before)s
-- (the page's cursor; NULL: now). Read through pgjobs_history_task_idx with a task, else
-- pgjobs_history_settled_idx, backwards.
SELECT h.settled_at, h.job_id, h.claim, h.task, h.queue, h.tenant, h.outcome, h.runtime,
       h.attempts, h.worker
  FROM {schema}.pgjobs_history AS h
 WHERE (%(task)s::text IS NULL OR h.task = %(task)s)
   AND (%(outcome)s::text IS NULL OR h.outcome = %(outcome)s)
   AND (%(tenant)s::text IS NULL OR h.tenant = %(tenant)s)
   AND (%(worker)s::text IS NULL OR h.worker = %(worker)s)
   AND h.settled_at >= coalesce(%(since)s::timestamptz, '-infinity')
   AND h.settled_at < coalesce(%(before)s::timestamptz, 'infinity')
 ORDER BY h.settled_at DESC, h.job_id DESC
 LIMIT %(limit)s;

-- name: history_stats :many
-- `pgjobs stats`: per task over the last %(seconds)s seconds, the settles by outcome, the
-- failure ratio (failed / settled) and the runtime p50/p95 (the rolled-up minutes' p50/p95
-- weighted by their settles, and the max: a rollup cannot merge percentiles exactly) from
-- pgjobs_task_minute, plus the minutes not rolled up yet read from pgjobs_history (at most
-- two). Busiest first.
WITH mark AS MATERIALIZED (
    SELECT r.upto FROM {schema}.pgjobs_rollup AS r WHERE r.id = 1
), minutes AS (
    SELECT m.task, m.completed, m.failed, m.dropped, m.cancelled, m.requeued,
           m.runtime_p50, m.runtime_p95, m.runtime_max
      FROM {schema}.pgjobs_task_minute AS m, mark
     WHERE m.minute >= now() - make_interval(secs => %(seconds)s) AND m.minute < mark.upto
    UNION ALL
    SELECT coalesce(h.task, ''),
           count(*) FILTER (WHERE h.outcome = 'completed'),
           count(*) FILTER (WHERE h.outcome = 'failed'),
           count(*) FILTER (WHERE h.outcome = 'dropped'),
           count(*) FILTER (WHERE h.outcome = 'cancelled'),
           count(*) FILTER (WHERE h.outcome = 'requeued'),
           percentile_cont(0.5) WITHIN GROUP (ORDER BY h.runtime),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY h.runtime),
           max(h.runtime)
      FROM {schema}.pgjobs_history AS h, mark
     WHERE h.settled_at >= greatest(mark.upto, now() - make_interval(secs => %(seconds)s))
     GROUP BY 1
)
SELECT task, sum(completed)::bigint AS completed, sum(failed)::bigint AS failed,
       sum(dropped)::bigint AS dropped, sum(cancelled)::bigint AS cancelled,
       sum(requeued)::bigint AS requeued,
       sum(completed + failed + dropped + cancelled + requeued)::bigint AS settled,
       (sum(failed) / nullif(sum(completed + failed + dropped + cancelled), 0))::float8
           AS failure_ratio,
       (sum(runtime_p50 * (completed + failed + dropped + cancelled + requeued))
          / nullif(sum((completed + failed + dropped + cancelled + requeued))
                   FILTER (WHERE runtime_p50 IS NOT NULL), 0))::float8 AS runtime_p50,
       (sum(runtime_p95 * (completed + failed + dropped + cancelled + requeued))
          / nullif(sum((completed + failed + dropped + cancelled + requeued))
                   FILTER (WHERE runtime_p95 IS NOT NULL), 0))::float8 AS runtime_p95,
       max(runtime_max)::float8 AS runtime_max
  FROM minutes
 GROUP BY task
 ORDER BY settled DESC, task
 LIMIT %(limit)s;

-- name: retention_history :one
-- The retention sweep: up to %(limit)s history rows settled before %(cutoff)s, oldest first,
-- then the rollups of minutes before it. Returns how many rows went.
WITH old AS (
    DELETE FROM {schema}.pgjobs_history AS h
     WHERE h.ctid = ANY (ARRAY(SELECT o.ctid FROM {schema}.pgjobs_history AS o
                                WHERE o.settled_at < %(cutoff)s
                                ORDER BY o.settled_at
                                LIMIT %(limit)s))
    RETURNING 1
), old_minutes AS (
    DELETE FROM {schema}.pgjobs_task_minute AS m
     WHERE (m.task, m.minute) IN (SELECT o.task, o.minute
                                    FROM {schema}.pgjobs_task_minute AS o
                                   WHERE o.minute < %(cutoff)s
                                   LIMIT %(limit)s)
    RETURNING 1
)
SELECT (SELECT count(*) FROM old) + (SELECT count(*) FROM old_minutes);

-- name: retention_history_count :one
-- `pgjobs prune --dry-run`: the history rows and rollups the next sweep would remove.
SELECT (SELECT count(*) FROM {schema}.pgjobs_history WHERE settled_at < %(cutoff)s)
     + (SELECT count(*) FROM {schema}.pgjobs_task_minute WHERE minute < %(cutoff)s);
