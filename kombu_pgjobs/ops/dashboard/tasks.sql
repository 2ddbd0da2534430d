-- The dashboard's on-call pages (issue 34, item 4): the tasks page, a task's page, the history
-- search and the workers' throughput. Loaded by kombu_pgjobs/dashboard/queries.py as
-- overview.sql is ({schema} is the quoted schema, comments are not sent).
--
-- Every statement here is bounded whatever pgjobs_history holds: the tasks page reads the
-- per-minute rollups (pgjobs_task_minute, at most 1,440 rows per task for a day, through
-- pgjobs_task_minute_minute_idx) plus the minutes not rolled up yet, cut at %(tail)s history
-- rows (pgjobs_history_settled_idx, backwards); the lists read an index in its order and stop
-- after a page, or after %(scan)s candidates.

-- name: dashboard_tasks :many
-- The tasks page: per task over the window of the last %(minutes)s minutes (the current one
-- included, so a window is whole minutes: rolled-up minutes and the tail agree exactly), the
-- settles by outcome, the rate (settles per minute), the failure ratio (failed / settled
-- without the requeued, as pgjobs stats), the runtime p50/p95 (the minutes' percentiles
-- weighted by their settles: a rollup cannot merge them exactly) and max, and a sparkline of
-- %(points)s buckets of settles (spark_at: the buckets with settles, 0 the oldest; spark_n:
-- their settles). One pass over the minutes (per task and bucket), then one over its groups. The rollups cover the minutes before the
-- watermark (pgjobs_rollup.upto); the minutes since are read from pgjobs_history, at most its
-- %(tail)s newest rows (tail_rows says how many were read: equal to %(tail)s, the tail was
-- cut). Sorted by %(sort)s (task, rate, failure, p50, p95, max), %(descending)s, then by task;
-- at most %(limit)s tasks.
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

-- name: dashboard_task_history :many
-- A task's page: its settled deliveries, newest first (pgjobs_history_task_idx backwards),
-- before the cursor (%(before)s, %(before_id)s: the last row of the previous page; NULL: now):
-- of its %(scan)s newest, the first %(n)s of one outcome or any (%(outcome)s NULL). Read
-- lazily: it stops at the %(n)s-th match (dashboard_history_beyond tells whether a short page
-- stopped at the bound). Each with the dead letter that kept its failure, if there is one: the
-- transport's keeps the message's id (pgjobs_dead_letter_pkey), celery_ext's copy has its own
-- id and names the job in error ->> 'job_id' (pgjobs_dead_letter_job_id_idx); and whether the
-- message is live again (a requeued dead letter keeps its id).
SELECT h.settled_at, h.job_id, h.claim, h.task, h.queue, h.tenant, h.outcome, h.runtime,
       h.attempts, h.worker, d.id AS dead_id, d.error ->> 'type' AS error_type,
       d.error ->> 'message' AS error_message, d.reason AS dead_reason,
       (SELECT j.state FROM {schema}.pgjobs_job AS j WHERE j.id = h.job_id) AS live_state
  FROM (SELECT c.* FROM (SELECT h.*
                          FROM {schema}.pgjobs_history AS h
                         WHERE h.task = %(task)s
                           AND h.settled_at <= coalesce(%(before)s::timestamptz, 'infinity')
                           AND (%(before)s::timestamptz IS NULL
                                OR h.settled_at < %(before)s::timestamptz
                                OR h.job_id < %(before_id)s::bigint)
                         ORDER BY h.settled_at DESC, h.job_id DESC
                         LIMIT %(scan)s) AS c
         WHERE %(outcome)s::text IS NULL OR c.outcome = %(outcome)s
         LIMIT %(n)s) AS h
  LEFT JOIN LATERAL (
        SELECT x.id, x.error, x.reason FROM (
            (SELECT x1.id, x1.error, x1.reason, 0 AS pref
               FROM {schema}.pgjobs_dead_letter AS x1 WHERE x1.id = h.job_id)
            UNION ALL
            (SELECT x2.id, x2.error, x2.reason, 1
               FROM {schema}.pgjobs_dead_letter AS x2
              WHERE x2.error ? 'job_id' AND x2.error ->> 'job_id' = h.job_id::text
              ORDER BY x2.id DESC LIMIT 1)) AS x
         ORDER BY x.pref LIMIT 1) AS d ON h.outcome IN ('failed', 'dropped', 'cancelled')
 ORDER BY h.settled_at DESC, h.job_id DESC;

-- name: dashboard_history_search :many
-- The history search: of the %(scan)s newest deliveries settled in [%(since)s, %(until)s)
-- (of one task when %(task)s: pgjobs_history_task_idx, else pgjobs_history_settled_idx,
-- backwards) and before the cursor, the first %(n)s of an outcome, a tenant and a worker
-- (NULL: any), each with its dead letter (as dashboard_task_history) and whether its message
-- is live. Read lazily: it stops at the %(n)s-th match (dashboard_history_beyond tells whether
-- a short page stopped at the bound).
SELECT h.settled_at, h.job_id, h.claim, h.task, h.queue, h.tenant, h.outcome, h.runtime,
       h.attempts, h.worker, d.id AS dead_id, d.error ->> 'type' AS error_type,
       d.error ->> 'message' AS error_message, d.reason AS dead_reason,
       (SELECT j.state FROM {schema}.pgjobs_job AS j WHERE j.id = h.job_id) AS live_state
  FROM (SELECT c.* FROM (SELECT h.*
                          FROM {schema}.pgjobs_history AS h
                         WHERE (%(task)s::text IS NULL OR h.task = %(task)s)
                           AND h.settled_at >= coalesce(%(since)s::timestamptz, '-infinity')
                           AND h.settled_at < coalesce(%(until)s::timestamptz, 'infinity')
                           AND h.settled_at <= coalesce(%(before)s::timestamptz, 'infinity')
                           AND (%(before)s::timestamptz IS NULL
                                OR h.settled_at < %(before)s::timestamptz
                                OR h.job_id < %(before_id)s::bigint)
                         ORDER BY h.settled_at DESC, h.job_id DESC
                         LIMIT %(scan)s) AS c
         WHERE (%(outcome)s::text IS NULL OR c.outcome = %(outcome)s)
           AND (%(tenant)s::text IS NULL OR c.tenant = %(tenant)s)
           AND (%(worker)s::text IS NULL OR c.worker = %(worker)s)
         LIMIT %(n)s) AS h
  LEFT JOIN LATERAL (
        SELECT x.id, x.error, x.reason FROM (
            (SELECT x1.id, x1.error, x1.reason, 0 AS pref
               FROM {schema}.pgjobs_dead_letter AS x1 WHERE x1.id = h.job_id)
            UNION ALL
            (SELECT x2.id, x2.error, x2.reason, 1
               FROM {schema}.pgjobs_dead_letter AS x2
              WHERE x2.error ? 'job_id' AND x2.error ->> 'job_id' = h.job_id::text
              ORDER BY x2.id DESC LIMIT 1)) AS x
         ORDER BY x.pref LIMIT 1) AS d ON h.outcome IN ('failed', 'dropped', 'cancelled')
 ORDER BY h.settled_at DESC, h.job_id DESC;

-- name: dashboard_history_beyond :one
-- Whether a filtered page that came out short stopped at its bound: there is a (%(scan)s + 1)th
-- candidate (of the task, in the range, before the cursor), in the order of the index the page
-- read (an index-only read of its settle times when the table is vacuumed).
SELECT EXISTS (
    SELECT 1 FROM {schema}.pgjobs_history AS h
     WHERE (%(task)s::text IS NULL OR h.task = %(task)s)
       AND h.settled_at >= coalesce(%(since)s::timestamptz, '-infinity')
       AND h.settled_at < coalesce(%(until)s::timestamptz, 'infinity')
       AND h.settled_at <= coalesce(%(before)s::timestamptz, 'infinity')
     ORDER BY h.settled_at DESC
    OFFSET %(scan)s
     LIMIT 1);

-- name: dashboard_args_candidates :many
-- The args search's candidates: of the %(scan)s newest live messages (pgjobs_job_pkey
-- backwards) and the %(scan)s newest dead letters (pgjobs_dead_letter_pkey backwards), those of
-- a task (NULL: any; filtered after the bound, so a rare task never walks the table), each
-- with its body when it is at most %(body_max)s characters (longer: too_big, not sent) and the
-- bodies sent so far, newest first, are within %(budget)s characters (past it: over_budget,
-- not sent). Bodies are decoded and matched in Python (base64 kombu bodies; a statement that
-- decoded them would fail on the first that is not JSON).
WITH live AS (
    SELECT j.id, j.queue, j.task, j.tenant, j.state, j.created_at AS at,
           j.message, length(j.message ->> 'body') AS size
      FROM {schema}.pgjobs_job AS j
     ORDER BY j.id DESC
     LIMIT %(scan)s
), dead AS (
    SELECT d.id, d.queue, d.task, d.message -> 'headers' ->> 'x-pgjobs-tenant' AS tenant,
           d.reason, d.died_at AS at, d.message, length(d.message ->> 'body') AS size
      FROM {schema}.pgjobs_dead_letter AS d
     ORDER BY d.id DESC
     LIMIT %(scan)s
), found AS (
    SELECT 'message' AS kind, l.id, l.queue, l.task, l.tenant, l.state, NULL::text AS reason,
           l.at, l.message, l.size,
           sum(CASE WHEN l.size <= %(body_max)s::int THEN l.size ELSE 0 END)
               OVER (ORDER BY l.id DESC) AS sent
      FROM live AS l
     WHERE %(task)s::text IS NULL OR l.task = %(task)s
    UNION ALL
    SELECT 'dead', x.id, x.queue, x.task, x.tenant, 'dead', x.reason, x.at, x.message, x.size,
           sum(CASE WHEN x.size <= %(body_max)s::int THEN x.size ELSE 0 END)
               OVER (ORDER BY x.id DESC)
      FROM dead AS x
     WHERE %(task)s::text IS NULL OR x.task = %(task)s
)
SELECT f.kind, f.id, f.queue, f.task, f.tenant, f.state, f.reason, f.at,
       CASE WHEN f.size <= %(body_max)s::int AND f.sent <= %(budget)s::bigint
            THEN f.message ->> 'body' END AS body,
       coalesce(f.size > %(body_max)s::int, false) AS too_big,
       coalesce(f.size <= %(body_max)s::int AND f.sent > %(budget)s::bigint, false)
           AS over_budget,
       f.message -> 'properties' ->> 'body_encoding' AS body_encoding,
       f.message ->> 'content-type' AS content_type,
       (SELECT count(*) FROM live)::int AS live_read,
       (SELECT count(*) FROM dead)::int AS dead_read
  FROM found AS f;

-- name: dashboard_worker_throughput :many
-- Settles per worker over the last %(minutes)s minutes (the current one included): the
-- counters' rows whose shard is the settling process (pgjobs_counter_bucket_idx).
SELECT c.shard AS worker, c.outcome, sum(c.n)::bigint AS n
  FROM {schema}.pgjobs_counter AS c
 WHERE c.bucket >= date_trunc('minute', now()) - make_interval(mins => %(minutes)s::int - 1)
 GROUP BY 1, 2;
