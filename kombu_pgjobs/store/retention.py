"""The automatic retention sweep (issue 34): what ``pgjobs prune`` does, run by the workers
themselves, so that dead letters, counters, the outbox, the webhook ledger, the scheduler's
history, expired revokes, durable steps and events, the audit log and the task history (with
its per-minute rollups) stay bounded without a cron job.

**Who sweeps.** Every worker's keeper asks for the turn once per ``retention_interval``
(first one interval after it started) with one statement, ``retention_turn``: a conditional
``UPDATE`` of the one row of ``pgjobs_retention`` that succeeds only when the last sweep began
at least an interval ago. Two keepers asking at once serialise on that row's lock and the
second finds it no longer due, so across the fleet a sweep begins at most once per interval.
Taking the turn needs the ``UPDATE`` grant on the table, which no role outside the app has
(never an advisory lock: see docs/security.md). A sweep stops after half an interval (what is
left waits for the next one), so two sweeps never overlap.

**How.** The sweep runs in a thread of its own with a connection of its own: the keeper's
renewals never wait for it. Each kind is deleted in batches of ``retention_batch`` rows, each
its own short transaction (``FOR UPDATE SKIP LOCKED``: a row someone holds is left for the
next sweep, nothing waits), at most ``retention_limit`` rows per kind per sweep. A window of 0
keeps that kind for ever.

**Idle cost.** One statement per interval per worker process (the turn); the sweep itself
about one statement per kind when there is nothing to delete, on one process.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any

import psycopg

from ..events import log_event
from ..options import TransportOptions, validate_schema_name
from .core import bounded
from .sql import queries

__all__ = ["KINDS", "RETENTION_VERSION", "on_tick", "plan", "sweep", "take_turn", "windows"]

log = logging.getLogger("kombu_pgjobs.retention")

#: the schema version that made pgjobs_retention
RETENTION_VERSION = 24
#: what the sweep removes, in the order it removes them, and the option of each one's window
#: (revokes have no window: each expires by itself, when the worker that recorded it said)
KINDS: dict[str, str | None] = {
    "dead_letters": "retention_dead_letters",
    "counters": "retention_counters",
    "outbox": "retention_outbox",
    "webhook_attempts": "retention_webhook_attempts",
    "schedule_history": "retention_schedule_history",
    "revokes": None,
    "steps": "retention_steps",
    "audit": "retention_audit",
    "history": "retention_history",
}


def windows(options: TransportOptions) -> dict[str, float | None]:
    """Each kind's window in seconds (0: kept for ever; None: revokes, their own expiry)."""
    return {kind: (float(getattr(options, name)) if name else None)
            for kind, name in KINDS.items()}


def take_turn(conn: psycopg.Connection[Any], schema: str, interval: float,
              who: str, *, timeout: float | None = None) -> bool:
    """Whether this process sweeps now: one statement (see the module's docstring).
    ``timeout``: seconds after which it is cancelled (QueryCanceled): no turn taken."""
    with bounded(conn, timeout):
        row = conn.execute(queries(validate_schema_name(schema))["retention_turn"],
                           {"interval": float(interval), "who": who}).fetchone()
    return row is not None


def _cutoff(now: datetime, window: float | None) -> datetime | None:
    return None if not window else now - timedelta(seconds=window)


def _drain(run: Callable[[int], int], *, batch: int, limit: int,
           more: Callable[[], bool]) -> int:
    """Run one batch statement after another (each returns how many it deleted, at most the
    size it was given) until one deletes fewer than asked, ``limit`` rows are done, or
    ``more()`` says stop."""
    done = 0
    while done < limit and more():
        size = min(batch, limit - done)
        n = run(size)
        done += n
        if n < size:
            break
    return done


def sweep(conn: psycopg.Connection[Any], schema: str, options: TransportOptions, *,
          deadline: float | None = None,
          stop: threading.Event | None = None) -> dict[str, int]:
    """Delete what is past its window, every kind, in bounded batches; rows deleted per kind.
    ``deadline`` (monotonic) and ``stop`` end it early (the rest waits for the next sweep)."""
    from .steps import prune as prune_steps

    q = queries(validate_schema_name(schema))
    batch, limit = options.retention_batch, options.retention_limit
    win = windows(options)
    now = conn.execute(q["retention_now"]).fetchone()[0]  # one clock for every cutoff

    def more() -> bool:
        return (deadline is None or time.monotonic() < deadline) and not (
            stop is not None and stop.is_set())

    def one(name: str, params: Mapping[str, Any]) -> Callable[[int], int]:
        def run(size: int) -> int:
            row = conn.execute(q[name], {**params, "limit": size}).fetchone()
            return int(row[0]) if row else 0
        return run

    done: dict[str, int] = {}
    for kind in KINDS:
        cutoff = _cutoff(now, win[kind])
        if (kind != "revokes" and cutoff is None) or not more():
            done[kind] = 0
            continue
        if kind == "dead_letters":
            run = one("admin_dead_purge", {"ids": None, "queue": None, "reason": None,
                                           "cutoff": cutoff})
        elif kind == "counters":
            run = one("admin_counter_fold", {"cutoff": cutoff})
        elif kind == "outbox":
            run = one("outbox_prune", {"older": win[kind]})
        elif kind == "webhook_attempts":
            run = one("webhook_attempt_prune", {"cutoff": cutoff})
        elif kind == "schedule_history":
            run = one("retention_schedule_fires", {"cutoff": cutoff})
        elif kind == "revokes":
            run = one("retention_revokes", {})
        elif kind == "audit":
            run = one("retention_audit", {"cutoff": cutoff})
        elif kind == "history":
            run = one("retention_history", {"cutoff": cutoff})
        else:  # steps and events: steps.prune's own batches (it counts first)
            assert cutoff is not None
            got = prune_steps(conn, schema, cutoff, limit=limit, batch=batch)
            done["steps"] = int(got["steps"]["deleted"]) + int(got["events"]["deleted"])
            continue
        done[kind] = _drain(run, batch=batch, limit=limit, more=more)
    return done


def plan(conn: psycopg.Connection[Any], schema: str,
         options: TransportOptions) -> dict[str, Any]:
    """What the next sweep would remove, exactly, per kind, with the windows of ``options``
    (``pgjobs prune --dry-run``). A sweep removes at most ``retention_limit`` rows per kind;
    the rest the next one."""
    from .steps import prune as prune_steps

    q = queries(validate_schema_name(schema))
    win = windows(options)
    now = conn.execute(q["retention_now"]).fetchone()[0]
    cut = {kind: _cutoff(now, w) for kind, w in win.items()}
    dead, counters = conn.execute(q["admin_prune_count"], {  # -infinity: kept, none match
        "cutoff": cut["dead_letters"] or "-infinity",
        "counters_cutoff": cut["counters"] or "-infinity"}).fetchone()
    outbox = conn.execute(q["outbox_prunable"], {"older": win["outbox"]}).fetchone()[0] \
        if win["outbox"] else 0
    attempts = conn.execute(q["webhook_attempt_prune_count"], {
        "cutoff": cut["webhook_attempts"]}).fetchone()[0] if cut["webhook_attempts"] else 0
    fires, revokes, audit = conn.execute(q["retention_count"], {
        "fires_cutoff": cut["schedule_history"], "audit_cutoff": cut["audit"]}).fetchone()
    history = conn.execute(q["retention_history_count"], {
        "cutoff": cut["history"]}).fetchone()[0] if cut["history"] else 0
    steps = 0
    if cut["steps"] is not None:
        got = prune_steps(conn, schema, cut["steps"], limit=1, batch=1, dry_run=True)
        steps = int(got["steps"]["matched"]) + int(got["events"]["matched"])
    matched = {"dead_letters": dead, "counters": counters, "outbox": outbox,
               "webhook_attempts": attempts, "schedule_history": fires, "revokes": revokes,
               "steps": steps, "audit": audit, "history": history}
    return {"enabled": options.retention, "interval": options.retention_interval,
            "limit": options.retention_limit,
            "kinds": {kind: {"window": win[kind], "matched": int(matched[kind] or 0)}
                      for kind in KINDS}}


class _Sweeper:
    """One keeper's clock and its sweep thread."""

    def __init__(self, options: TransportOptions) -> None:
        self.options = options
        self.due = time.monotonic() + options.retention_interval  # one interval after start
        self.thread: threading.Thread | None = None
        self.off = False
        self.who = f"{socket.gethostname()}:{os.getpid()}"

    def tick(self, keeper: Any, conn: psycopg.Connection[Any], *,
             timeout: float | None = None) -> None:
        now = time.monotonic()
        if self.off or now < self.due or (self.thread is not None and self.thread.is_alive()):
            return
        self.due = now + self.options.retention_interval
        try:
            won = take_turn(conn, self.options.schema, self.options.retention_interval,
                            self.who, timeout=timeout)
        except (psycopg.errors.UndefinedTable, psycopg.errors.InsufficientPrivilege) as exc:
            # a schema before version 24 (auto_migrate off), or roles not applied again
            # after the migration: no sweep from this process, said once
            self.off = True
            log_event("pgjobs.retention.failed", error=str(exc).splitlines()[0])
            return
        if won:
            self.thread = threading.Thread(target=self.run, args=(keeper,), daemon=True,
                                           name="pgjobs-retention")
            self.thread.start()

    def run(self, keeper: Any) -> None:
        started = time.monotonic()
        try:
            conn = keeper.backend.connect()
            try:
                done = sweep(conn, self.options.schema, self.options,
                             deadline=started + self.options.retention_interval / 2,
                             stop=keeper.stop_event)
            finally:
                conn.close()
        except Exception as exc:  # a database error: the next turn tries again
            log_event("pgjobs.retention.failed", error=str(exc).splitlines()[0] if str(exc)
                      else type(exc).__name__)
            return
        log_event("pgjobs.retention.swept", logging.INFO,
                  seconds=round(time.monotonic() - started, 3), **done)


_sweepers: weakref.WeakKeyDictionary[Any, _Sweeper] = weakref.WeakKeyDictionary()


def on_tick(keeper: Any, conn: psycopg.Connection[Any], *,
            timeout: float | None = None) -> None:
    """The keeper's call, once per tick: the sweep's turn when due (see the module).
    ``timeout``: the keeper's bound on the turn's statement (half a lease; cancelled, it
    raises and no turn is taken: the next interval again); the sweep runs on its own thread
    and connection, under its own deadline."""
    options: TransportOptions = keeper.backend.options
    if not options.retention:
        return
    sweeper = _sweepers.get(keeper)
    if sweeper is None:
        _sweepers[keeper] = _Sweeper(options)  # the first tick starts the clock
        return
    sweeper.tick(keeper, conn, timeout=timeout)
