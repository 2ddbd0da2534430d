-- The dashboard overview's own statements: one page of queues, and the settle counters of
-- those queues only. Loaded by kombu_pgjobs/dashboard/queries.py as kombu_pgjobs/sql loads
-- its files ({schema} is the quoted schema, comments are not sent).
--
-- They live here, not in kombu_pgjobs/store/sql/admin.sql beside admin_queue_stats_bounded (whose
-- counts they repeat), because the overview is the only reader that pages over queues. Keep
-- the two in step: tests/test_dashboard_pages.py checks that a page's rows equal
-- Admin.queues(bound=...)'s for the same queues.

-- name: dashboard_queue_page :many
-- One page of the overview: the first %(n)s queue names after %(after)s, with
-- admin_queue_stats_bounded's counts (each read from an index, cut at %(bound)s + 1). Queue
-- names come from the declared queues (the primary key, in name order), the skip scans of the
-- ready, delayed and dead-letter indexes started at %(after)s, and the running and waiting
-- rows (a bounded pass, as in admin_queue_stats_bounded); each source stops after %(n)s names
-- that qualify, so a page reads a bounded number of index entries whatever the number of
-- queues. Unless %(internal)s, Celery's own queues (remote control: *.pidbox and
-- *.reply.celery.pidbox; events: celeryev.*) are skipped.
WITH RECURSIVE due_q(queue) AS (
    (SELECT queue FROM {schema}.pgjobs_job
      WHERE state = 'ready' AND NOT delayed AND queue > %(after)s
      ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM {schema}.pgjobs_job AS j
             WHERE j.state = 'ready' AND NOT j.delayed AND j.queue > d.queue
             ORDER BY j.queue LIMIT 1)
      FROM due_q AS d WHERE d.queue IS NOT NULL
), delayed_q(queue) AS (
    (SELECT queue FROM {schema}.pgjobs_job
      WHERE state = 'ready' AND delayed AND queue > %(after)s
      ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT j.queue FROM {schema}.pgjobs_job AS j
             WHERE j.state = 'ready' AND j.delayed AND j.queue > d.queue
             ORDER BY j.queue LIMIT 1)
      FROM delayed_q AS d WHERE d.queue IS NOT NULL
), dead_q(queue) AS (
    (SELECT queue FROM {schema}.pgjobs_dead_letter WHERE queue > %(after)s
      ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT x.queue FROM {schema}.pgjobs_dead_letter AS x WHERE x.queue > d.queue
             ORDER BY x.queue LIMIT 1)
      FROM dead_q AS d WHERE d.queue IS NOT NULL
), held AS (
    SELECT queue, state, count(*) AS n, sum(count(*)) OVER (PARTITION BY state) AS seen
      FROM ((SELECT queue, state FROM {schema}.pgjobs_job WHERE state = 'running'
              ORDER BY lease_expires_at
              LIMIT %(bound)s::int * 10)
            UNION ALL
            (SELECT queue, state FROM {schema}.pgjobs_job WHERE state = 'waiting'
              ORDER BY waiting_on, priority DESC, run_at, id
              LIMIT %(bound)s::int + 1)) AS h
     GROUP BY queue, state
), names AS (
    (SELECT name FROM {schema}.pgjobs_queue
      WHERE name > %(after)s
        AND (%(internal)s::bool OR NOT (name LIKE '%%.pidbox' OR name LIKE 'celeryev.%%'))
      ORDER BY name LIMIT %(n)s)
    UNION
    (SELECT queue FROM due_q
      WHERE queue IS NOT NULL
        AND (%(internal)s::bool OR NOT (queue LIKE '%%.pidbox' OR queue LIKE 'celeryev.%%'))
      LIMIT %(n)s)
    UNION
    (SELECT queue FROM delayed_q
      WHERE queue IS NOT NULL
        AND (%(internal)s::bool OR NOT (queue LIKE '%%.pidbox' OR queue LIKE 'celeryev.%%'))
      LIMIT %(n)s)
    UNION
    (SELECT queue FROM dead_q
      WHERE queue IS NOT NULL
        AND (%(internal)s::bool OR NOT (queue LIKE '%%.pidbox' OR queue LIKE 'celeryev.%%'))
      LIMIT %(n)s)
    UNION
    (SELECT queue FROM held
      WHERE queue > %(after)s
        AND (%(internal)s::bool OR NOT (queue LIKE '%%.pidbox' OR queue LIKE 'celeryev.%%')))
), page AS (
    SELECT name FROM names ORDER BY name LIMIT %(n)s
)
SELECT n.name AS queue,
       least(%(bound)s::int + 1,
             (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                                     WHERE j.queue = n.name AND j.state = 'ready'
                                       AND NOT j.delayed AND j.run_at <= now()
                                     ORDER BY j.priority DESC, j.run_at, j.id
                                     LIMIT %(bound)s::int + 1) AS r)
             + (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                                       WHERE j.queue = n.name AND j.state = 'ready'
                                         AND j.delayed AND j.run_at <= now()
                                       ORDER BY j.run_at
                                       LIMIT %(bound)s::int + 1) AS r)) AS ready,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_job AS j
                               WHERE j.queue = n.name AND j.state = 'ready' AND j.delayed
                                 AND j.run_at > now()
                               ORDER BY j.run_at
                               LIMIT %(bound)s::int + 1) AS r) AS delayed,
       least(%(bound)s::int + 1, coalesce((SELECT h.n FROM held AS h
                                            WHERE h.queue = n.name AND h.state = 'running'), 0)
             ) AS running,
       least(%(bound)s::int + 1, coalesce((SELECT h.n FROM held AS h
                                            WHERE h.queue = n.name AND h.state = 'waiting'), 0)
             ) AS waiting,
       coalesce((SELECT max(h.seen) FROM held AS h WHERE h.state = 'running'), 0)
           >= %(bound)s::int * 10 AS running_more,
       coalesce((SELECT max(h.seen) FROM held AS h WHERE h.state = 'waiting'), 0)
           > %(bound)s::int AS waiting_more,
       (SELECT count(*) FROM (SELECT 1 FROM {schema}.pgjobs_dead_letter AS x
                               WHERE x.queue = n.name
                               ORDER BY x.died_at
                               LIMIT %(bound)s::int + 1) AS r) AS dead,
       coalesce(q.paused, false) AS paused,
       extract(epoch FROM now() - least(
           (SELECT min(h.run_at)
              FROM (WITH RECURSIVE levels(p) AS (
                        (SELECT priority FROM {schema}.pgjobs_job
                          WHERE queue = n.name AND state = 'ready' AND NOT delayed
                          ORDER BY priority DESC LIMIT 1)
                        UNION ALL
                        SELECT (SELECT j.priority FROM {schema}.pgjobs_job AS j
                                 WHERE j.queue = n.name AND j.state = 'ready' AND NOT j.delayed
                                   AND j.priority < l.p
                                 ORDER BY j.priority DESC LIMIT 1)
                          FROM levels AS l WHERE l.p IS NOT NULL)
                    SELECT (SELECT j.run_at FROM {schema}.pgjobs_job AS j
                             WHERE j.queue = n.name AND j.state = 'ready' AND NOT j.delayed
                               AND j.priority = l.p AND j.run_at <= now()
                             ORDER BY j.priority DESC, j.run_at LIMIT 1) AS run_at
                      FROM levels AS l WHERE l.p IS NOT NULL) AS h),
           (SELECT min(j.run_at) FROM {schema}.pgjobs_job AS j
             WHERE j.queue = n.name AND j.state = 'ready' AND j.delayed
               AND j.run_at <= now())))::float8 AS oldest_ready_age
  FROM page AS n
  LEFT JOIN {schema}.pgjobs_queue AS q ON q.name = n.name
 ORDER BY n.name;

-- name: dashboard_counter_series :many
-- admin_counter_series for the queues of one overview page only (%(queues)s): read through the
-- counters' primary key (queue, outcome, bucket), never every queue's minutes.
SELECT queue, outcome,
       (extract(epoch FROM date_trunc('minute', now()) - bucket) / 60)::int AS ago,
       sum(n)::bigint AS n
  FROM {schema}.pgjobs_counter
 WHERE queue = ANY(%(queues)s::text[])
   AND bucket >= date_trunc('minute', now()) - make_interval(mins => %(minutes)s::int - 1)
 GROUP BY queue, outcome, bucket
 ORDER BY queue, outcome, bucket;
