-- name: leader_elect :one
-- Take or renew the lease of election %(name)s, in one statement. The holder renews its own
-- lease (same term); anyone takes over a lapsed lease with term + 1. Returns the lease as it
-- now is (leading = this holder has it), the seconds it has left on the database clock, the
-- database time, and the schedule's definition version (entries and their last change):
-- renewal doubles as the poll for dynamic entries, so an idle scheduler runs one statement
-- per round.
WITH up AS (
    INSERT INTO {schema}.pgjobs_leader AS l
           (name, holder, term, elected_at, renewed_at, expires_at)
    VALUES (%(name)s, %(holder)s, 1, clock_timestamp(), clock_timestamp(),
            clock_timestamp() + make_interval(secs => %(ttl)s))
    ON CONFLICT (name) DO UPDATE
       SET holder = excluded.holder,
           term = CASE WHEN l.holder = excluded.holder THEN l.term ELSE l.term + 1 END,
           elected_at = CASE WHEN l.holder = excluded.holder THEN l.elected_at
                             ELSE excluded.elected_at END,
           renewed_at = excluded.renewed_at,
           expires_at = excluded.expires_at
     WHERE l.holder = excluded.holder OR l.expires_at <= clock_timestamp()
    RETURNING l.holder, l.term, l.expires_at
), lease AS (
    -- the row as this statement left it: ours, or (not taken) the current holder's
    SELECT holder, term, expires_at, true AS leading FROM up
    UNION ALL
    SELECT holder, term, expires_at, false FROM {schema}.pgjobs_leader
     WHERE name = %(name)s AND NOT EXISTS (SELECT FROM up)
)
SELECT lease.holder, lease.term, lease.leading,
       extract(epoch FROM lease.expires_at - clock_timestamp())::float8 AS remaining,
       clock_timestamp() AS db_now,
       v.n, v.changed
  FROM lease,
       (SELECT count(*) AS n, max(updated_at) AS changed FROM {schema}.pgjobs_schedule) AS v;

-- name: leader_resign :exec
-- Give the lease up at once (a clean shutdown): a follower takes over at its next round.
UPDATE {schema}.pgjobs_leader
   SET expires_at = clock_timestamp()
 WHERE name = %(name)s AND holder = %(holder)s AND term = %(term)s;

-- name: leader_get :one
-- The current lease of election %(name)s (operators).
SELECT holder, term, elected_at, expires_at, expires_at > clock_timestamp() AS live
  FROM {schema}.pgjobs_leader WHERE name = %(name)s;

-- name: schedule_sync_static :exec
-- The leader writes the app's beat_schedule (fenced on its term): new entries are added, a
-- changed definition is updated (a new schedule or time zone restarts its grid from now, with
-- no catch-up), entries gone from the configuration are removed. A dynamic entry of the same
-- name is left alone. Pause state and watermarks are kept.
WITH lead AS (
    SELECT 1 FROM {schema}.pgjobs_leader
     WHERE name = %(leader)s AND term = %(term)s AND holder = %(holder)s
       AND expires_at > clock_timestamp()
       FOR SHARE
), given AS (
    SELECT * FROM unnest(%(names)s::text[], %(tasks)s::text[], %(schedules)s::text[],
                         %(timezones)s::text[], %(args)s::jsonb[], %(kwargs)s::jsonb[],
                         %(options)s::jsonb[], %(catch_ups)s::text[], %(caps)s::int[])
           AS g(name, task, schedule, timezone, args, kwargs, options, catch_up, catch_up_max)
     WHERE EXISTS (SELECT FROM lead)
), gone AS (
    DELETE FROM {schema}.pgjobs_schedule AS s
     WHERE s.source = 'static' AND EXISTS (SELECT FROM lead)
       AND s.name <> ALL (%(names)s::text[])
)
INSERT INTO {schema}.pgjobs_schedule AS s
       (name, source, task, schedule, timezone, args, kwargs, options, catch_up, catch_up_max)
SELECT name, 'static', task, schedule, timezone, args, kwargs, options, catch_up, catch_up_max
  FROM given
    ON CONFLICT (name) DO UPDATE
   SET task = excluded.task, schedule = excluded.schedule, timezone = excluded.timezone,
       args = excluded.args, kwargs = excluded.kwargs, options = excluded.options,
       catch_up = excluded.catch_up, catch_up_max = excluded.catch_up_max,
       updated_at = clock_timestamp(),
       anchor = CASE WHEN (s.schedule, s.timezone) IS DISTINCT FROM
                          (excluded.schedule, excluded.timezone)
                     THEN now() ELSE s.anchor END,
       last_occurrence = CASE WHEN (s.schedule, s.timezone) IS DISTINCT FROM
                                   (excluded.schedule, excluded.timezone)
                              THEN NULL ELSE s.last_occurrence END
 WHERE s.source = 'static'
   AND (s.task, s.schedule, s.timezone, s.args, s.kwargs, s.options, s.catch_up,
        s.catch_up_max)
       IS DISTINCT FROM
       (excluded.task, excluded.schedule, excluded.timezone, excluded.args, excluded.kwargs,
        excluded.options, excluded.catch_up, excluded.catch_up_max);

-- name: schedule_load :many
-- Every entry, for the leader (after an election or a definition change) and the CLI.
SELECT name, source, task, schedule, timezone, args, kwargs, options, catch_up,
       catch_up_max, paused, anchor, last_occurrence, last_fired_at, fires, updated_at
  FROM {schema}.pgjobs_schedule
 ORDER BY name;

-- name: schedule_fence :one
-- The fence of one fire, used as the first CTE of the statement that fires (see
-- celery_ext.scheduler): yields a row only while this process leads — its term and holder
-- are current and the lease unexpired on the database clock; the leader row is locked FOR
-- SHARE, so a takeover waits for this statement — and the entry is as the leader loaded it
-- (not paused, removed or redefined) with its watermark behind %(watermark)s. Moves the
-- watermark.
UPDATE {schema}.pgjobs_schedule AS s
   SET last_occurrence = %(watermark)s, last_fired_at = clock_timestamp(), fires = s.fires + 1
  FROM (SELECT term FROM {schema}.pgjobs_leader
         WHERE name = %(leader)s AND term = %(term)s AND holder = %(holder)s
           AND expires_at > clock_timestamp()
           FOR SHARE) AS l
 WHERE s.name = %(entry)s AND NOT s.paused AND s.updated_at = %(defined_at)s
   AND coalesce(s.last_occurrence, s.anchor) < %(watermark)s
RETURNING s.name, l.term;

-- name: schedule_record_fire :one
-- The last part of the statement that fires when the broker is not pgjobs: one history row
-- for the fence's row (the message is published after this commits).
INSERT INTO {schema}.pgjobs_schedule_fire (entry, occurrence, term, holder, job_id, missed)
SELECT fence.name, %(occurrence)s, fence.term, %(holder)s, NULL, %(missed)s
  FROM fence
RETURNING id, job_id;

-- name: schedule_record_fire_job :one
-- The last part of the statement that fires on the pgjobs broker: one history row for the
-- fence's row and the message row the same statement inserted (CTE job; none when a
-- guarded message's idempotency key was held: the occurrence is recorded, job_id NULL).
INSERT INTO {schema}.pgjobs_schedule_fire (entry, occurrence, term, holder, job_id, missed)
SELECT fence.name, %(occurrence)s, fence.term, %(holder)s, job.id, %(missed)s
  FROM fence LEFT JOIN job ON true
RETURNING id, job_id;

-- name: schedule_add :one
-- A dynamic entry (pgjobs schedule add). With %(replace)s an existing dynamic entry is
-- redefined (its grid restarts from now); a static one is never replaced from the CLI.
INSERT INTO {schema}.pgjobs_schedule AS s
       (name, source, task, schedule, timezone, args, kwargs, options, catch_up, catch_up_max,
        paused)
VALUES (%(name)s, 'dynamic', %(task)s, %(schedule)s, %(timezone)s, %(args)s, %(kwargs)s,
        %(options)s, %(catch_up)s, %(catch_up_max)s, %(paused)s)
    ON CONFLICT (name) DO UPDATE
   SET task = excluded.task, schedule = excluded.schedule, timezone = excluded.timezone,
       args = excluded.args, kwargs = excluded.kwargs, options = excluded.options,
       catch_up = excluded.catch_up, catch_up_max = excluded.catch_up_max,
       paused = excluded.paused, anchor = now(), last_occurrence = NULL,
       updated_at = clock_timestamp()
 WHERE %(replace)s AND s.source = 'dynamic'
RETURNING name, (xmax = 0) AS created;

-- name: schedule_pause :one
-- Pause or resume an entry. Resuming moves the watermark to now: occurrences while paused are
-- not missed ones, so no catch-up fires them.
UPDATE {schema}.pgjobs_schedule
   SET paused = %(paused)s, updated_at = clock_timestamp(),
       last_occurrence = CASE WHEN paused AND NOT %(paused)s
                              THEN greatest(now(), last_occurrence) ELSE last_occurrence END
 WHERE name = %(name)s
RETURNING name, paused;

-- name: schedule_remove :one
-- Remove an entry (its history stays). A static entry comes back at the next election while
-- it is still in the app's beat_schedule.
DELETE FROM {schema}.pgjobs_schedule WHERE name = %(name)s RETURNING name, source;

-- name: schedule_history :many
-- Recent fires of one entry, newest first (served by the (entry, occurrence) unique index).
SELECT id, entry, occurrence, fired_at, term, holder, job_id, missed
  FROM {schema}.pgjobs_schedule_fire
 WHERE entry = %(name)s
 ORDER BY occurrence DESC
 LIMIT %(n)s;

-- name: schedule_prune_history :one
-- The leader's hourly retention of the fire history: fires older than %(days)s days, at most
-- %(n)s per call (pgjobs_schedule_fire_fired_idx finds them). Returns the number deleted.
WITH old AS (
    SELECT id FROM {schema}.pgjobs_schedule_fire
     WHERE fired_at < now() - make_interval(days => %(days)s)
     ORDER BY fired_at
     LIMIT %(n)s
), gone AS (
    DELETE FROM {schema}.pgjobs_schedule_fire AS f USING old WHERE f.id = old.id
    RETURNING 1
)
SELECT count(*) FROM gone;
