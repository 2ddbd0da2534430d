-- The dashboard's on-call pages (issue 34, item 4): the tasks page, a task's page, the history
-- search and the workers' throughput. Loaded by kombu_pgjobs/dashboard/queries.py as
-- overview.sql is ({schema} is the quoted schema, comments are not sent).
--
-- Every statement here is bounded whatever pgjobs_history holds: the lists read an index in
-- its order and stop after a page, or after %(scan)s candidates. The tasks page's statement is
-- the store's (history_tasks in kombu_pgjobs/store/sql/history.sql, shared with pgjobs stats).

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
