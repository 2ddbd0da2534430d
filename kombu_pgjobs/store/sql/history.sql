-- History and its rollups (0025_history.sql): what ran, how long, how it ended. The settles
-- write pgjobs_history themselves (job.sql); these statements amend, roll up, read and prune it.

-- name: job_outcome :one
-- How a delivery ended, told by its worker (celery_ext) where the transport cannot know it:
-- 'failed' (a final failure, kept as a dead letter copy), 'dropped' (one with
-- dead_letter=False) or 'requeued' (a Celery retry: the same task's next message follows).
-- While the row is still held under %(claim)s (acks_late) the word is noted on the row, and
-- its ack counts and records it instead of 'completed'. Once acked (Celery's early ack settled
-- it when it started) the history row that ack wrote is amended and the one settle moves from
-- 'completed' to the word in the counters (the ack's bucket and shard) and in the rollup. With
-- neither (history off, or no ack at all) and %(fallback)s, the word is counted now, the
-- ack's 'completed' standing. (An ack committing while this runs deletes the row under it and
-- writes a history row this snapshot cannot see: the caller runs it again, with %(fallback)s,
-- in a new snapshot.) The history row is looked for among the settles of task %(task)s within
-- %(elapsed)s seconds (how long the run has gone; NULL: a day) and ten minutes more (clocks),
-- through pgjobs_history_task_idx. %(runtime)s (seconds, NULL: unknown) replaces an early
-- ack's runtime. Returns how many of the held row and the history row took the word (0 or 1).
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
     WHERE %(fallback)s::bool
       AND NOT EXISTS (SELECT 1 FROM held) AND NOT EXISTS (SELECT 1 FROM amended)
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
-- watermark (at most a day back) to that minute, an hour of them at most (a keeper back from
-- a long stall catches up an hour a turn, each turn well inside the keeper's bound of half a
-- lease): per task and minute, the count of each outcome and the runtime p50/p95/max. A
-- minute is rolled up once it has been closed for a minute (a settle's statement commits
-- within it). Returns (minutes rolled up to, rows written, whether closed minutes remain),
-- or no row when it was not this keeper's turn.
WITH target AS MATERIALIZED (
    SELECT date_trunc('minute', now() - interval '1 minute') AS upto
), old AS MATERIALIZED (
    SELECT greatest(r.upto, t.upto - interval '1 day') AS since, t.upto AS target
      FROM {schema}.pgjobs_rollup AS r, target AS t
     WHERE r.id = 1 AND r.upto < t.upto
       FOR UPDATE OF r
), turn AS (
    UPDATE {schema}.pgjobs_rollup AS r
       SET upto = least(o.target, o.since + interval '1 hour'), rolled_by = %(who)s
      FROM old AS o
     WHERE r.id = 1
    RETURNING o.since, r.upto, r.upto < o.target AS behind
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
SELECT t.upto, (SELECT count(*) FROM rolled), t.behind FROM turn AS t;

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

-- name: history_tasks :many
-- The dashboard's tasks page and `pgjobs stats`: per task over the window of the last
-- %(minutes)s minutes (the current one included, so a window is whole minutes: rolled-up
-- minutes and the tail agree exactly), the settles by outcome, the rate (settles per minute),
-- the failure ratio (failed / settled without the requeued), the runtime p50/p95 (the minutes'
-- percentiles weighted by their settles: a rollup cannot merge them exactly) and max, and a
-- sparkline of %(points)s buckets of settles (spark_at: the buckets with settles, 0 the oldest;
-- spark_n: their settles). One pass over the minutes (per task and bucket), then one over its
-- groups. Bounded whatever pgjobs_history holds: the rollups (at most 1,440 rows per task a
-- day, through pgjobs_task_minute_minute_idx) cover the minutes before the watermark
-- (pgjobs_rollup.upto); the minutes since are read from pgjobs_history, at most its %(tail)s
-- newest rows (tail_rows says how many were read: equal to %(tail)s, the tail was cut).
-- Sorted by %(sort)s (task, rate, failure, p50, p95, max), %(descending)s, then by task; at
-- most %(limit)s tasks.
WITH bounds AS MATERIALIZED (
    SELECT date_trunc('minute', now()) - make_interval(mins => %(minutes)s::int - 1) AS start,
           r.upto
      FROM {schema}.pgjobs_rollup AS r
     WHERE r.id = 1
), tail AS MATERIALIZED (
    -- (the bounds as scalar subqueries: index conditions, where a join would filter every row)
    SELECT h.task, h.settled_at, h.outcome, h.runtime
      FROM {schema}.pgjobs_history AS h
     WHERE h.settled_at >= (SELECT greatest(b.upto, b.start) FROM bounds AS b)
     ORDER BY h.settled_at DESC
     LIMIT %(tail)s
), minutes AS (
    -- counts as int4 (a minute's fit) and runtimes as float8: the sums below then run on
    -- int8 and float8 accumulators, not numeric ones (a third of the 24-hour page's time)
    SELECT m.task, m.minute, m.completed::int AS completed, m.failed::int AS failed,
           m.dropped::int AS dropped, m.cancelled::int AS cancelled,
           m.requeued::int AS requeued,
           (m.completed + m.failed + m.dropped + m.cancelled + m.requeued)::int AS settled,
           m.runtime_p50::float8 AS runtime_p50, m.runtime_p95::float8 AS runtime_p95,
           m.runtime_max::float8 AS runtime_max
      FROM {schema}.pgjobs_task_minute AS m
     WHERE m.minute >= (SELECT b.start FROM bounds AS b)
       AND m.minute < (SELECT b.upto FROM bounds AS b)
    UNION ALL
    SELECT coalesce(t.task, ''), date_trunc('minute', t.settled_at),
           (count(*) FILTER (WHERE t.outcome = 'completed'))::int,
           (count(*) FILTER (WHERE t.outcome = 'failed'))::int,
           (count(*) FILTER (WHERE t.outcome = 'dropped'))::int,
           (count(*) FILTER (WHERE t.outcome = 'cancelled'))::int,
           (count(*) FILTER (WHERE t.outcome = 'requeued'))::int,
           count(*)::int,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY t.runtime),
           percentile_cont(0.95) WITHIN GROUP (ORDER BY t.runtime),
           max(t.runtime)::float8
      FROM tail AS t
     GROUP BY 1, 2
), per AS (
    -- one pass over the minutes: per task and sparkline bucket
    SELECT mi.task,
           least(%(points)s::int - 1,
                 (date_part('epoch', mi.minute - b.start) / 60)::int
                     / ((%(minutes)s::int + %(points)s::int - 1) / %(points)s::int)) AS i,
           sum(mi.completed) AS completed, sum(mi.failed) AS failed,
           sum(mi.dropped) AS dropped, sum(mi.cancelled) AS cancelled,
           sum(mi.requeued) AS requeued, sum(mi.settled) AS settled,
           sum(mi.runtime_p50 * mi.settled) AS w50,
           sum(mi.settled) FILTER (WHERE mi.runtime_p50 IS NOT NULL) AS n50,
           sum(mi.runtime_p95 * mi.settled) AS w95,
           sum(mi.settled) FILTER (WHERE mi.runtime_p95 IS NOT NULL) AS n95,
           max(mi.runtime_max) AS runtime_max
      FROM minutes AS mi, bounds AS b
     GROUP BY 1, 2
), totals AS (
    SELECT task, sum(completed)::bigint AS completed, sum(failed)::bigint AS failed,
           sum(dropped)::bigint AS dropped, sum(cancelled)::bigint AS cancelled,
           sum(requeued)::bigint AS requeued, sum(settled)::bigint AS settled,
           (sum(failed)::float8 / nullif(sum(settled) - sum(requeued), 0))::float8
               AS failure_ratio,
           (sum(w50) / nullif(sum(n50), 0))::float8 AS runtime_p50,
           (sum(w95) / nullif(sum(n95), 0))::float8 AS runtime_p95,
           max(runtime_max)::float8 AS runtime_max,
           -- the sparkline: the buckets with settles (the page fills the others with 0)
           array_agg(i ORDER BY i) AS spark_at,
           array_agg(settled::bigint ORDER BY i) AS spark_n
      FROM per
     GROUP BY task
), ranked AS (
    SELECT t.*, t.settled::float8 / %(minutes)s::int AS rate,
           CASE %(sort)s WHEN 'rate' THEN t.settled::float8
                         WHEN 'failure' THEN t.failure_ratio
                         WHEN 'p50' THEN t.runtime_p50
                         WHEN 'p95' THEN t.runtime_p95
                         WHEN 'max' THEN t.runtime_max END AS sort_key
      FROM totals AS t
)
SELECT r.task, r.completed, r.failed, r.dropped, r.cancelled, r.requeued, r.settled, r.rate,
       r.failure_ratio, r.runtime_p50, r.runtime_p95, r.runtime_max,
       r.spark_at, r.spark_n,
       (SELECT count(*) FROM tail)::int AS tail_rows,
       (SELECT b.upto FROM bounds AS b) AS rolled_upto
  FROM ranked AS r
 ORDER BY CASE WHEN %(descending)s::bool THEN r.sort_key END DESC NULLS LAST,
          CASE WHEN NOT %(descending)s::bool THEN r.sort_key END ASC NULLS LAST,
          CASE WHEN %(sort)s = 'task' AND %(descending)s::bool THEN r.task END DESC,
          r.task
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
