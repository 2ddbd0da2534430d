"""History: what ran, how long, how it ended (issue 34; schema 25, ``0025_history.sql``).

**Written by the settles themselves.** Every fenced settle — an ack (folded into a claim, or
flushed by the keeper), a requeue, a dead-lettering, a keeper's burial of a lapsed run — inserts
one compact row per delivery into ``pgjobs_history`` in its own statement: task, queue, tenant,
outcome, runtime (claim to settle), attempts, worker and the settle's time. No second round trip
per message. The ``history`` transport option (``False``) writes none.

**Outcomes** are the words of ``celery_ext.on_settled``, ``pgjobs queues`` and the metrics:
``completed``, ``failed``, ``dropped``, ``cancelled``, ``requeued``. An ack means ``completed``
unless the worker said otherwise first (:func:`record_outcome`: celery_ext tells ``failed`` for a
final failure it keeps as a dead letter copy, ``dropped`` for one with ``dead_letter=False``);
with Celery's early ack the ack lands when the run starts, and the word amends its row (and
moves the one settle in the counters) when the run fails.

**Rollups.** Once a minute fleet-wide, a keeper takes the rollup's turn (one conditional UPDATE
of ``pgjobs_rollup``'s one row; never an advisory lock) and writes ``pgjobs_task_minute``: per
task and closed minute, the settles by outcome and the runtime p50/p95/max. A keeper asks for
the turn only in the few minutes after its own process settled something, so an idle fleet
sends nothing for it. ``pgjobs stats`` and the dashboard's tasks page read the rollups (at most
1,440 rows per task a day) plus the minutes not rolled up yet.

**Retention.** The automatic sweep (:mod:`kombu_pgjobs.store.retention`) removes history rows and
rollups older than ``retention_history`` (7 days).
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from ..errors import InvalidArgument
from ..events import log_event
from ..options import validate_schema_name
from .core import bounded
from .sql import queries

__all__ = ["LEGACY_OUTCOMES", "OUTCOMES", "ROLLUP_EVERY", "SORTS", "TAIL", "list_history",
           "on_tick", "outcome_word", "record_outcome", "rollup", "stats", "tasks"]

log = logging.getLogger("kombu_pgjobs.history")

#: the words of a settled delivery, everywhere (history, counters, on_settled, the dashboard)
OUTCOMES = ("completed", "failed", "dropped", "cancelled", "requeued")
#: the counters' words before schema 25, as a worker of an older version may still write them
#: during a rolling upgrade: readers count them under the new words
LEGACY_OUTCOMES = {"acked": "completed", "dead": "failed"}


def outcome_word(word: str) -> str:
    """A counter's outcome in today's words (``acked`` is ``completed``, ``dead``
    ``failed``)."""
    return LEGACY_OUTCOMES.get(word, word)


#: what :func:`tasks` sorts by (the tasks page's columns)
SORTS = ("task", "rate", "failure", "p50", "p95", "max")
#: the most history rows not rolled up yet that :func:`tasks` reads (the rollup is behind by
#: more only when no keeper has settled for minutes; the rows say when it was cut)
TAIL = 200_000

#: seconds between a keeper's asks for the rollup's turn
ROLLUP_EVERY = 60.0
#: a keeper asks only this long after its process last settled something (a minute is rolled
#: up once closed for a minute: two minutes and a margin)
ROLLUP_AFTER_SETTLE = 180.0


def record_outcome(conn: psycopg.Connection[Any], schema: str, *, job: tuple[int, int] | None,
                   outcome: str, queue: str, shard: str, task: str | None = None,
                   elapsed: float | None = None, runtime: float | None = None) -> int:
    """Tell how delivery ``job`` (``(id, claim)``) ended where the transport cannot know it:
    ``failed``, ``dropped`` or ``requeued`` (a Celery retry) (``job_outcome`` in
    sql/history.sql). Returns 1 when the held row or its history row took the word, 0 when
    only the counter did. ``task`` and ``elapsed`` (seconds since the run began) find an early
    ack's history row among that task's recent settles."""
    if outcome not in ("failed", "dropped", "requeued"):
        raise InvalidArgument(f"a worker tells 'failed', 'dropped' or 'requeued', "
                              f"not {outcome!r}")
    job_id, claim = job if job is not None else (None, None)
    params = {"job_id": job_id, "claim": claim, "outcome": outcome, "runtime": runtime,
              "queue": queue, "shard": shard, "task": task, "elapsed": elapsed}
    statement = queries(validate_schema_name(schema))["job_outcome"]
    # Neither the held row nor its history row found: an ack that committed meanwhile may
    # have moved one into the other, out of this snapshot's sight; the second run sees it
    # (or counts the word on its own: history off, or no ack at all).
    for fallback in (False, True):
        row = conn.execute(statement, {**params, "fallback": fallback}).fetchone()
        if row and row[0]:
            return int(row[0])
    return 0


def rollup(conn: psycopg.Connection[Any], schema: str, who: str, *,
           timeout: float | None = None) -> tuple[datetime, int, bool] | None:
    """Take the rollup's turn if it is due and roll up the closed minutes, an hour of them at
    most: ``(up to, rows written, behind)`` — behind when closed minutes remain (a keeper back
    from a long stall: the next turn goes on at once) —, or None when it was not due (another
    keeper took it). ``timeout``: seconds after which the statement is cancelled
    (QueryCanceled): turn and work are one statement, so a cancelled rollup takes no turn and
    the next one does the same minutes."""
    with bounded(conn, timeout):
        row = conn.execute(queries(validate_schema_name(schema))["history_rollup"],
                           {"who": who}).fetchone()
    return None if row is None else (row[0], int(row[1]), bool(row[2]))


def list_history(conn: psycopg.Connection[Any], schema: str, *, task: str | None = None,
                 outcome: str | None = None, tenant: str | None = None,
                 worker: str | None = None, since: datetime | None = None,
                 before: datetime | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """History rows, newest first (``pgjobs history``)."""
    if outcome is not None and outcome not in OUTCOMES:
        raise InvalidArgument(f"unknown outcome {outcome!r}: one of {', '.join(OUTCOMES)}")
    if not 1 <= int(limit) <= 100_000:
        raise InvalidArgument("limit must be between 1 and 100000")
    return conn.cursor(row_factory=dict_row).execute(
        queries(validate_schema_name(schema))["history_list"], {
            "task": task, "outcome": outcome, "tenant": tenant, "worker": worker,
            "since": since, "before": before, "limit": int(limit)}).fetchall()


def tasks(conn: psycopg.Connection[Any], schema: str, *, minutes: int, points: int = 1,
          sort: str = "rate", descending: bool = True, limit: int = 1000,
          tail: int = TAIL) -> list[dict[str, Any]]:
    """Per task over the last ``minutes`` whole minutes (``history_tasks``): settles by
    outcome, rate, failure ratio, runtime p50/p95/max and a sparkline of ``points`` buckets,
    from the rollups plus at most ``tail`` rows not rolled up yet (the dashboard's tasks page,
    ``pgjobs stats``)."""
    if sort not in SORTS:
        raise InvalidArgument(f"cannot sort by {sort[:20]!r}: one of {', '.join(SORTS)}")
    return conn.cursor(row_factory=dict_row).execute(
        queries(validate_schema_name(schema))["history_tasks"], {
            "minutes": int(minutes), "points": int(points), "tail": int(tail), "sort": sort,
            "descending": bool(descending), "limit": int(limit)}).fetchall()


def stats(conn: psycopg.Connection[Any], schema: str, *, seconds: float = 3600.0,
          limit: int = 1000) -> list[dict[str, Any]]:
    """Per task over the last ``seconds`` (rounded up to whole minutes, the current one
    included): settles by outcome, rate, failure ratio, runtime p50/p95/max, busiest first
    (``pgjobs stats``: :func:`tasks` without the sparkline)."""
    if not 0 < float(seconds) <= 366 * 86400:
        raise InvalidArgument("the window must be between 1 second and a year")
    rows = tasks(conn, schema, minutes=math.ceil(float(seconds) / 60), limit=limit)
    return [{k: v for k, v in r.items() if k not in ("spark_at", "spark_n")} for r in rows]


class _Roller:
    def __init__(self) -> None:
        self.next = 0.0
        self.off = False


_rollers: weakref.WeakKeyDictionary[Any, _Roller] = weakref.WeakKeyDictionary()


def on_tick(keeper: Any, conn: psycopg.Connection[Any], *,
            timeout: float | None = None) -> None:
    """The keeper's call, once per tick: the rollup's turn, at most once a minute, and only in
    the minutes after this process settled something. ``timeout``: the keeper's bound on its
    statements (half a lease); a rollup cancelled by it raises (the keeper logs it) and is
    tried again a minute later."""
    backend = keeper.backend
    options: Mapping[str, Any] | Any = backend.options
    if not options.history:
        return
    last = backend.last_settled_at
    now = time.monotonic()
    if last is None or now - last > ROLLUP_AFTER_SETTLE:
        return
    roller = _rollers.get(keeper)
    if roller is None:
        roller = _rollers[keeper] = _Roller()
    if roller.off or now < roller.next:
        return
    roller.next = now + ROLLUP_EVERY
    try:
        done = rollup(conn, options.schema, backend.worker, timeout=timeout)
    except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege) as exc:
        roller.off = True  # a schema before version 25, or roles not applied again: said once
        log_event("pgjobs.history.rollup_failed", error=str(exc).splitlines()[0])
        return
    if done is not None and done[2]:
        roller.next = now  # an hour a turn: the next tick goes on with the next hour
    if done is not None and done[1]:
        log_event("pgjobs.history.rolled_up", logging.DEBUG, upto=done[0].isoformat(),
                  rows=done[1])
