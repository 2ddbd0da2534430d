-- Durable steps (celery_ext.steps, schema 23): pgjobs_step and pgjobs_event.
--
-- Every write a run makes is fenced as an ack is: on the job row it holds, by id and claim
-- number, still running and not cancelled. The job row is read FOR SHARE, so a rescue, a
-- re-claim or a cancel (which update it) waits for the write's commit, or the write, coming
-- second, sees the row changed and writes nothing. Each statement returns the fence's verdict:
-- 'held', 'lost' (not running under this claim: its lease lapsed and was rescued, or it was
-- settled elsewhere) or 'cancelled' (an operator cancelled the running message).

-- name: step_load :many
-- A run's first step reads what earlier runs of its task id stored, in one round trip, and
-- settles what came due meanwhile: a sleep whose time has come is done; a wait whose event
-- exists is done with the latest such event's data. Returns the fence's verdict on every row,
-- then the steps in the order they were first recorded (one row of NULLs when there are none).
WITH fence AS MATERIALIZED (
    SELECT j.id, j.claim, j.cancelled_at IS NOT NULL AS cancelled
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = %(job_id)s::bigint AND j.claim = %(claim)s::int AND j.state = 'running'
       FOR SHARE
), held AS MATERIALIZED (
    SELECT f.id, f.claim FROM fence AS f WHERE NOT f.cancelled
), slept AS (
    UPDATE {schema}.pgjobs_step AS s
       SET state = 'done', attempts = s.attempts + 1, finished_at = now(), updated_at = now(),
           job_id = h.id, claim = h.claim
      FROM held AS h
     WHERE s.task_id = %(task_id)s::text AND s.state = 'sleeping' AND s.due_at <= now()
    RETURNING s.name, s.state, s.result::text AS result
), heard AS (
    UPDATE {schema}.pgjobs_step AS s
       SET state = 'done', result = ev.data, attempts = s.attempts + 1, finished_at = now(),
           updated_at = now(), job_id = h.id, claim = h.claim
      FROM held AS h, {schema}.pgjobs_step AS w
     CROSS JOIN LATERAL (
           -- the latest event of the wait's name and key
           SELECT e.data FROM {schema}.pgjobs_event AS e
            WHERE e.name = w.event AND e.key = w.event_key
            ORDER BY e.id DESC
            LIMIT 1) AS ev
     WHERE w.task_id = %(task_id)s::text AND w.state = 'waiting'
       AND s.task_id = w.task_id AND s.name = w.name
    RETURNING s.name, s.state, s.result::text AS result
), changed AS (
    -- what this statement settled (the SELECT below reads the rows as they were before it)
    SELECT c.name, c.state, c.result FROM slept AS c
    UNION ALL
    SELECT c.name, c.state, c.result FROM heard AS c
)
SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM fence) THEN 'lost'
            WHEN (SELECT f.cancelled FROM fence AS f) THEN 'cancelled'
            ELSE 'held' END AS fence,
       s.name, s.kind, coalesce(c.state, s.state) AS state,
       CASE WHEN c.name IS NOT NULL THEN c.result ELSE s.result::text END AS result,
       s.event, s.event_key, s.due_at <= now() AS due
  FROM (SELECT 1) AS one
  LEFT JOIN {schema}.pgjobs_step AS s ON s.task_id = %(task_id)s::text
  LEFT JOIN changed AS c ON c.name = s.name
 ORDER BY s.seq;

-- name: step_save :one
-- Record a step's outcome: 'done' with its result (JSON text), or 'failed' with its error
-- (a run step's exception, a wait's timeout), fenced. A done step is never overwritten (its
-- name is the replay key): a second writer gets the stored result back ('stored'). Returns
-- (verdict, the stored result when the step was done already).
WITH fence AS MATERIALIZED (
    SELECT j.id, j.claim, j.cancelled_at IS NOT NULL AS cancelled
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = %(job_id)s::bigint AND j.claim = %(claim)s::int AND j.state = 'running'
       FOR SHARE
), saved AS (
    INSERT INTO {schema}.pgjobs_step AS s
           (task_id, name, kind, state, attempts, result, error, event, event_key, job_id,
            claim, started_at, finished_at, updated_at)
    SELECT %(task_id)s::text, %(name)s::text, %(kind)s::text, %(state)s::text, 1,
           %(result)s::json, %(error)s::jsonb, %(event)s::text, %(event_key)s::text, f.id,
           f.claim, now() - make_interval(secs => %(took)s::float8), now(), now()
      FROM fence AS f
     WHERE NOT f.cancelled
    ON CONFLICT (task_id, name) DO UPDATE
       SET state = excluded.state, attempts = s.attempts + 1, result = excluded.result,
           error = excluded.error, job_id = excluded.job_id, claim = excluded.claim,
           -- a wait started when it first parked
           started_at = CASE WHEN s.kind = 'run' THEN excluded.started_at
                             ELSE coalesce(s.started_at, excluded.started_at) END,
           finished_at = excluded.finished_at, updated_at = now()
     WHERE s.state <> 'done'
    RETURNING 1
)
SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM fence) THEN 'lost'
            WHEN (SELECT f.cancelled FROM fence AS f) THEN 'cancelled'
            WHEN EXISTS (SELECT 1 FROM saved) THEN 'saved'
            ELSE 'stored' END,
       (SELECT s.result::text FROM {schema}.pgjobs_step AS s
         WHERE s.task_id = %(task_id)s::text AND s.name = %(name)s::text
           AND s.state = 'done');

-- name: step_wait :one
-- A wait's first look: when an event of its name and key exists (emitted before the wait
-- began), the step is done with the latest one's data, fenced; otherwise nothing is written and
-- the run suspends. Returns (verdict, heard, the data as JSON text).
WITH fence AS MATERIALIZED (
    SELECT j.id, j.claim, j.cancelled_at IS NOT NULL AS cancelled
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = %(job_id)s::bigint AND j.claim = %(claim)s::int AND j.state = 'running'
       FOR SHARE
), ev AS MATERIALIZED (
    SELECT e.data FROM {schema}.pgjobs_event AS e
     WHERE e.name = %(event)s::text AND e.key = %(event_key)s::text
     ORDER BY e.id DESC
     LIMIT 1
), saved AS (
    INSERT INTO {schema}.pgjobs_step AS s
           (task_id, name, kind, state, attempts, result, event, event_key, job_id, claim,
            started_at, finished_at, updated_at)
    SELECT %(task_id)s::text, %(name)s::text, 'event', 'done', 1, ev.data, %(event)s::text,
           %(event_key)s::text, f.id, f.claim, now(), now(), now()
      FROM fence AS f, ev
     WHERE NOT f.cancelled
    ON CONFLICT (task_id, name) DO UPDATE
       SET state = 'done', attempts = s.attempts + 1, result = excluded.result, error = NULL,
           job_id = excluded.job_id, claim = excluded.claim, finished_at = now(),
           updated_at = now()
     WHERE s.state <> 'done'
    RETURNING 1
)
SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM fence) THEN 'lost'
            WHEN (SELECT f.cancelled FROM fence AS f) THEN 'cancelled'
            ELSE 'held' END,
       EXISTS (SELECT 1 FROM ev), (SELECT ev.data::text FROM ev), (SELECT count(*) FROM saved);

-- name: step_event_lock :one
-- Before a waiter parks: its event's lock row (class 'event', bucket of name and key), tried
-- exclusively, never waited on. An emit's trigger holds it shared to its commit: 0 means an
-- emit of this bucket is in flight (the park then wakes again in a second); 1 that none is, and
-- none can start until this transaction ends, so the park's next statement, with a snapshot
-- taken after this lock, sees every event committed before it.
SELECT count(*)
  FROM (SELECT 1 FROM {schema}.pgjobs_lock AS l
         WHERE l.class = 'event'
           AND l.bucket = hashtext(%(event)s::text || '.' || %(event_key)s::text) & 1023
           FOR UPDATE SKIP LOCKED) AS got;

-- name: step_park :one
-- Hand a suspended run's message back parked, fenced on the delivery (id, claim, running):
-- the step row records what it sleeps or waits for (a sleep keeps its first due time and a
-- wait its deadline across runs; a timed-out wait run again starts a new one), and the job row
-- goes back to ready, uncounted (attempts - 1), its lease and holder cleared, due at the wake
-- time: out of the claim index (delayed) until then. A wait whose event exists already is due
-- at once; %(sure)s false (an emit of its bucket was in flight) makes it due in a second, to
-- look again. Slots of limited messages are released and their parked rows woken (as a
-- requeue does); the queue's idle consumers are notified, so they learn the new due time. A
-- cancelled message is not parked (the caller dead-letters it). Returns (verdict: parked,
-- lost, cancelled or refused (its step was done already: nothing changed), seconds until it
-- is due, slots released, notified).
WITH held AS MATERIALIZED (
    SELECT j.id, j.claim, j.queue, j.limits, j.limit_key IS NOT NULL AS limited,
           j.cancelled_at IS NOT NULL AS cancelled
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = %(job_id)s::bigint AND j.claim = %(claim)s::int AND j.state = 'running'
       FOR UPDATE
), step AS MATERIALIZED (
    INSERT INTO {schema}.pgjobs_step AS s
           (task_id, name, kind, state, event, event_key, due_at, job_id, claim, started_at,
            updated_at)
    SELECT %(task_id)s::text, %(name)s::text, %(kind)s::text,
           CASE WHEN %(kind)s::text = 'sleep' THEN 'sleeping' ELSE 'waiting' END,
           %(event)s::text, %(event_key)s::text,
           now() + make_interval(secs => %(seconds)s::float8), h.id, h.claim, now(), now()
      FROM held AS h
     WHERE NOT h.cancelled
    ON CONFLICT (task_id, name) DO UPDATE
       SET state = excluded.state, job_id = excluded.job_id, claim = excluded.claim,
           due_at = CASE WHEN s.state = 'failed' THEN excluded.due_at ELSE s.due_at END,
           started_at = CASE WHEN s.state = 'failed' THEN excluded.started_at
                             ELSE s.started_at END,
           updated_at = now()
     WHERE s.kind = excluded.kind AND s.state <> 'done'
    RETURNING s.due_at
), wake AS MATERIALIZED (
    SELECT CASE WHEN NOT %(sure)s::boolean THEN now() + interval '1 second'
                WHEN %(kind)s::text = 'event' AND EXISTS (
                     SELECT 1 FROM {schema}.pgjobs_event AS e
                      WHERE e.name = %(event)s::text AND e.key = %(event_key)s::text)
                THEN now()
                -- a wait without a timeout: parked for a century, woken by its event
                ELSE coalesce(st.due_at, now() + interval '100 years') END AS at
      FROM step AS st
), parked AS (
    UPDATE {schema}.pgjobs_job AS j
       SET state = 'ready',
           attempts = greatest(j.attempts - 1, 0),
           lease_expires_at = NULL,
           worker = NULL,
           run_at = w.at,
           delayed = w.at > now()
      FROM held AS h, wake AS w
     WHERE j.id = h.id
    RETURNING j.queue, j.run_at
), released AS (
    SELECT {schema}.pgjobs_release_jobs_v1(array_agg(h.id), array_agg(h.claim),
                                           array_agg(h.limits), %(channel)s::text) AS n
      FROM held AS h
     WHERE h.limited AND EXISTS (SELECT 1 FROM parked)
    HAVING count(*) > 0
)
SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM held) THEN 'lost'
            WHEN (SELECT h.cancelled FROM held AS h) THEN 'cancelled'
            WHEN NOT EXISTS (SELECT 1 FROM parked) THEN 'refused'
            ELSE 'parked' END,
       (SELECT extract(epoch FROM p.run_at - now())::float8 FROM parked AS p),
       (SELECT count(*) FROM released),
       (SELECT count(pg_notify(%(channel)s::text, p.queue)) FROM parked AS p);

-- name: step_emit :exec
-- An event (celery_ext.steps.emit): one row; the trigger pgjobs_event_wake_v1 wakes the
-- parked waiters of its name and key in the same statement (and transaction: an emit inside
-- the app's transaction wakes nobody if it rolls back).
INSERT INTO {schema}.pgjobs_event (name, key, data)
VALUES (%(event)s::text, %(event_key)s::text, %(data)s::json);

-- name: step_list :many
-- A task's steps for operators (`pgjobs steps`, the dashboard), in the order first recorded:
-- never a result itself, its size.
SELECT s.name, s.kind, s.state, s.attempts, s.started_at, s.finished_at,
       octet_length(s.result::text) AS result_bytes, s.error, s.event, s.event_key, s.due_at,
       s.job_id, s.claim, s.updated_at
  FROM {schema}.pgjobs_step AS s
 WHERE s.task_id = %(task_id)s::text
 ORDER BY s.seq;

-- name: step_message :many
-- Where a task's message is, found from the ids its steps were written by: live rows (place
-- 'job', their state as `pgjobs ls` says it) and dead letters (the message's own id, or a
-- celery_ext failure record naming it in error.job_id).
WITH ids AS (
    SELECT DISTINCT s.job_id FROM {schema}.pgjobs_step AS s WHERE s.task_id = %(task_id)s::text
)
SELECT 'job' AS place, j.id,
       CASE WHEN j.state IN ('running', 'waiting') THEN j.state
            WHEN j.run_at > now() THEN 'delayed'
            ELSE 'ready' END AS state,
       j.queue, j.run_at AS at
  FROM {schema}.pgjobs_job AS j
 WHERE j.id IN (SELECT job_id FROM ids)
UNION ALL
SELECT 'dead', d.id, 'dead', d.queue, d.died_at
  FROM {schema}.pgjobs_dead_letter AS d
 WHERE d.id IN (SELECT job_id FROM ids)
UNION ALL
SELECT 'dead', d.id, 'dead', d.queue, d.died_at
  FROM {schema}.pgjobs_dead_letter AS d
 WHERE d.error ? 'job_id' AND (d.error ->> 'job_id') IN (SELECT job_id::text FROM ids)
   AND d.id NOT IN (SELECT job_id FROM ids);

-- name: step_locate :many
-- `pgjobs requeue --from-step`: each id's place ('job' or 'dead'), state and Celery task id,
-- its row locked for the rest of the transaction (a claim skips it meanwhile). A message whose
-- stored JSON Postgres cannot read with ->> (a \u0000 or lone surrogate escape) has no task id.
WITH live AS (
    SELECT j.id, 'job' AS place,
           CASE WHEN j.state IN ('running', 'waiting') THEN j.state
                WHEN j.run_at > now() THEN 'delayed'
                ELSE 'ready' END AS state,
           CASE WHEN strpos(j.message::text, '\u0000') + strpos(j.message::text, '\ud')
                     + strpos(j.message::text, '\uD') = 0
                THEN j.message -> 'headers' ->> 'id' END AS task_id
      FROM {schema}.pgjobs_job AS j
     WHERE j.id = ANY(%(ids)s::bigint[])
       FOR UPDATE
), dead AS (
    SELECT d.id, 'dead' AS place, 'dead' AS state,
           CASE WHEN strpos(d.message::text, '\u0000') + strpos(d.message::text, '\ud')
                     + strpos(d.message::text, '\uD') = 0
                THEN d.message -> 'headers' ->> 'id' END AS task_id
      FROM {schema}.pgjobs_dead_letter AS d
     WHERE d.id = ANY(%(ids)s::bigint[])
       FOR UPDATE
)
SELECT id, place, state, task_id FROM live
UNION ALL
SELECT id, place, state, task_id FROM dead;

-- name: step_drop :many
-- Drop step %(name)s of a task and every step recorded after it (by seq): the next run runs
-- them again, and replays the ones before. Returns the names dropped.
WITH target AS (
    SELECT s.seq FROM {schema}.pgjobs_step AS s
     WHERE s.task_id = %(task_id)s::text AND s.name = %(name)s::text
), dropped AS (
    DELETE FROM {schema}.pgjobs_step AS s
     USING target AS t
     WHERE s.task_id = %(task_id)s::text AND s.seq >= t.seq
    RETURNING s.name, s.seq
)
SELECT d.name FROM dropped AS d ORDER BY d.seq;

-- name: step_prune :one
-- Retention, one batch: up to %(limit)s step rows not written since %(cutoff)s, read in
-- (updated_at, task_id, name) order after the previous batch's last, and of their tasks those
-- whose message is gone have every step deleted. Gone: no step of the task written since the
-- cutoff, none written by a message still in the job table or kept as a dead letter (its own
-- id, or a celery_ext failure record's error.job_id), and no delayed message of the task id (a
-- retry waiting for its countdown). Returns (rows read, rows deleted, the last key read).
WITH scanned AS MATERIALIZED (
    SELECT s.updated_at, s.task_id, s.name
      FROM {schema}.pgjobs_step AS s
     WHERE s.updated_at < %(cutoff)s::timestamptz
       AND (s.updated_at, s.task_id, s.name)
           > (%(after_at)s::timestamptz, %(after_task)s::text, %(after_name)s::text)
     ORDER BY s.updated_at, s.task_id, s.name
     LIMIT %(limit)s
), gone AS (
    SELECT t.task_id
      FROM (SELECT DISTINCT c.task_id FROM scanned AS c) AS t
     WHERE NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                        WHERE s.task_id = t.task_id AND s.updated_at >= %(cutoff)s::timestamptz)
       AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                         JOIN {schema}.pgjobs_job AS j ON j.id = s.job_id
                        WHERE s.task_id = t.task_id)
       AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                         JOIN {schema}.pgjobs_dead_letter AS d ON d.id = s.job_id
                        WHERE s.task_id = t.task_id)
       AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                         JOIN {schema}.pgjobs_dead_letter AS d
                           ON d.error ? 'job_id' AND (d.error ->> 'job_id') = s.job_id::text
                        WHERE s.task_id = t.task_id)
       AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_job AS j
                        WHERE j.state = 'ready' AND j.delayed
                          AND (j.message -> 'headers' ->> 'id') IS NOT NULL
                          AND (j.message -> 'headers' ->> 'id') = t.task_id)
), deleted AS (
    DELETE FROM {schema}.pgjobs_step AS s
     USING gone AS g
     WHERE s.task_id = g.task_id
    RETURNING 1
), last AS (
    SELECT c.updated_at, c.task_id, c.name FROM scanned AS c
     ORDER BY c.updated_at DESC, c.task_id DESC, c.name DESC
     LIMIT 1
)
SELECT (SELECT count(*) FROM scanned), (SELECT count(*) FROM deleted),
       (SELECT l.updated_at FROM last AS l), (SELECT l.task_id FROM last AS l),
       (SELECT l.name FROM last AS l);

-- name: step_prune_count :one
-- Exactly what step_prune would delete now: the step rows of gone tasks (same test).
SELECT count(*)
  FROM {schema}.pgjobs_step AS r
 WHERE r.task_id IN (
        SELECT t.task_id
          FROM (SELECT DISTINCT c.task_id FROM {schema}.pgjobs_step AS c
                 WHERE c.updated_at < %(cutoff)s::timestamptz) AS t
         WHERE NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                            WHERE s.task_id = t.task_id
                              AND s.updated_at >= %(cutoff)s::timestamptz)
           AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                             JOIN {schema}.pgjobs_job AS j ON j.id = s.job_id
                            WHERE s.task_id = t.task_id)
           AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                             JOIN {schema}.pgjobs_dead_letter AS d ON d.id = s.job_id
                            WHERE s.task_id = t.task_id)
           AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                             JOIN {schema}.pgjobs_dead_letter AS d
                               ON d.error ? 'job_id' AND (d.error ->> 'job_id') = s.job_id::text
                            WHERE s.task_id = t.task_id)
           AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_job AS j
                            WHERE j.state = 'ready' AND j.delayed
                              AND (j.message -> 'headers' ->> 'id') IS NOT NULL
                              AND (j.message -> 'headers' ->> 'id') = t.task_id));

-- name: event_prune :one
-- Retention, one batch: up to %(limit)s events emitted before %(cutoff)s, oldest first, but
-- none a parked waiter of its name and key has still to read (no row lock: an operator may
-- delete events, not lock them; a concurrent prune deletes a row once). Returns the number
-- deleted.
WITH gone AS (
    DELETE FROM {schema}.pgjobs_event AS e
     WHERE e.id IN (SELECT o.id
                      FROM {schema}.pgjobs_event AS o
                     WHERE o.emitted_at < %(cutoff)s::timestamptz
                       AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                                        WHERE s.state = 'waiting' AND s.event = o.name
                                          AND s.event_key = o.key)
                     ORDER BY o.emitted_at
                     LIMIT %(limit)s)
    RETURNING 1
)
SELECT count(*) FROM gone;

-- name: event_prune_count :one
-- Exactly what event_prune would delete now.
SELECT count(*)
  FROM {schema}.pgjobs_event AS o
 WHERE o.emitted_at < %(cutoff)s::timestamptz
   AND NOT EXISTS (SELECT 1 FROM {schema}.pgjobs_step AS s
                    WHERE s.state = 'waiting' AND s.event = o.name AND s.event_key = o.key);

-- name: step_suspended :many
-- Messages parked by a step, by queue and reason ('sleep', 'event'): a sleeping or waiting
-- step whose message is still parked under the claim that parked it (metrics, the dashboard).
SELECT j.queue, s.kind AS reason, count(*) AS n
  FROM {schema}.pgjobs_step AS s
  JOIN {schema}.pgjobs_job AS j ON j.id = s.job_id AND j.claim = s.claim
 WHERE s.state IN ('sleeping', 'waiting') AND j.state = 'ready'
 GROUP BY j.queue, s.kind
 ORDER BY j.queue, s.kind;
