"""Durable steps, the database side: the statements of ``sql/steps.sql`` and what reads them.

celery_ext's :mod:`celery_ext.steps` is the API a task uses (``steps.of(self).run(...)``);
this module holds what it asks of the database, and what operators use: ``pgjobs steps
TASK_ID``, ``pgjobs requeue --from-step``, the retention of ``pgjobs prune`` and the count of
suspended messages. It knows nothing of Celery: a run is a :class:`Delivery` (the job row it
holds, by id and claim number, and the task id its steps are keyed by).

Every write of a run is fenced on its delivery (sql/steps.sql): a run that no longer holds its
message gets ``lost`` or ``cancelled`` back and writes nothing.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

import psycopg

from ..errors import InvalidArgument, InvalidStep, MigrationError, StateConflict, StepNotFound
from .sql import queries

__all__ = ["MAX_SECONDS", "MAX_TEXT", "Delivery", "Stored", "check_name", "emit", "event_key",
           "load", "park", "prune", "requeue_from_step", "save", "seconds", "steps_for_page",
           "steps_of", "suspended", "to_json", "wait"]

#: names, events and keys: at most this many characters
MAX_TEXT = 200
#: the longest sleep or timeout: a century
MAX_SECONDS = 100 * 365.25 * 86400
#: characters a name or key may not hold: C0 and C1 controls, DEL
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: the schema version the step tables came with
VERSION = 23


class Executor(Protocol):
    """A psycopg connection, or the app's connection inside an outbox block."""

    def execute(self, query: Any, params: Any = None, *,
                prepare: bool | None = None) -> Any: ...  # pragma: no cover

    def transaction(self) -> Any: ...  # pragma: no cover


@dataclass(frozen=True, slots=True)
class Delivery:
    """A run: the job row it holds (``id``, ``claim``) and the Celery task id of its message."""

    job_id: int
    claim: int
    task_id: str


@dataclass(frozen=True, slots=True)
class Stored:
    """A step as an earlier run left it (and as the load settled it)."""

    name: str
    kind: str          # run | sleep | event
    state: str         # done | failed | sleeping | waiting
    result: str | None  # JSON text (done)
    event: str | None
    event_key: str | None
    due: bool          # sleeping or waiting: its due time or deadline has passed


# -- checks ------------------------------------------------------------------------------------
def check_name(value: Any, what: str = "step name") -> str:
    """A step or event name: a non-empty string of at most 200 characters, no control
    characters, encodable (no lone surrogate)."""
    if not isinstance(value, str) or not value or len(value) > MAX_TEXT \
            or _CONTROL.search(value):
        raise InvalidStep(f"the {what} must be a non-empty string of at most {MAX_TEXT} "
                          f"characters without control characters, got {value!r:.80}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidStep(f"the {what} holds a lone surrogate: {value!r:.80}") from None
    return value


def event_key(key: Any) -> str:
    """An event's key as stored: a string (at most 200 characters, no control characters), a
    whole number as its decimal text, None as ``''``."""
    if key is None:
        return ""
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    if isinstance(key, str) and (key == "" or check_name(key, "event key")):
        return key
    raise InvalidStep(f"an event key must be a string or a whole number, got {key!r:.80}")


def seconds(value: Any, what: str) -> float:
    """A duration (a timedelta, or seconds as a number) as seconds, in 0 to 100 years."""
    if isinstance(value, timedelta):
        n = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        raise InvalidStep(f"{what} must be a timedelta or a number of seconds, got {value!r:.80}")
    if not math.isfinite(n) or not 0 <= n <= MAX_SECONDS:
        raise InvalidStep(f"{what} must be between 0 seconds and 100 years, got {value!r:.80}")
    return n


def to_json(value: Any, what: str, limit: int) -> str:
    """``value`` as the JSON text stored (and given back on every replay), or InvalidStep."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
        size = len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError) as exc:
        raise InvalidStep(f"{what} is not JSON ({type(exc).__name__}: {str(exc)[:200]}): "
                          "return strings, numbers, booleans, None, lists and dicts with "
                          "string keys (store large or binary data elsewhere and return its "
                          "key)") from None
    if size > limit:
        raise InvalidStep(f"{what} is {size:,} bytes as JSON, more than max_message_bytes "
                          f"({limit:,}): store it elsewhere and return its key")
    return text


# -- a run's statements ------------------------------------------------------------------------
def _params(d: Delivery, **extra: Any) -> dict[str, Any]:
    return {"job_id": d.job_id, "claim": d.claim, "task_id": d.task_id, **extra}


def load(conn: Executor, schema: str, d: Delivery) -> tuple[str, dict[str, Stored]]:
    """(fence verdict, the task's stored steps by name), settling due sleeps and heard waits."""
    rows = conn.execute(queries(schema)["step_load"], _params(d)).fetchall()
    verdict = rows[0][0] if rows else "lost"
    stored = {r[1]: Stored(r[1], r[2], r[3], r[4], r[5], r[6], bool(r[7]))
              for r in rows if r[1] is not None}
    return verdict, stored


def save(conn: Executor, schema: str, d: Delivery, name: str, *, kind: str, state: str,
         result: str | None = None, error: dict[str, Any] | None = None, took: float = 0.0,
         event: str | None = None, key: str | None = None) -> tuple[str, str | None]:
    """Record a step's outcome (fenced). (verdict: saved, stored (done already: its result is
    returned), lost or cancelled; the stored result)."""
    row = conn.execute(queries(schema)["step_save"], _params(
        d, name=name, kind=kind, state=state, result=result,
        error=None if error is None else json.dumps(error), took=max(0.0, float(took)),
        event=event, event_key=key)).fetchone()
    assert row is not None
    return str(row[0]), row[1]


def wait(conn: Executor, schema: str, d: Delivery, name: str, event: str,
         key: str) -> tuple[str, bool, str | None]:
    """A wait's first look for its event (fenced): (verdict, heard, the data's JSON text)."""
    row = conn.execute(queries(schema)["step_wait"], _params(
        d, name=name, event=event, event_key=key)).fetchone()
    assert row is not None
    return str(row[0]), bool(row[1]), row[2]


def park(conn: Executor, schema: str, d: Delivery, name: str, *, kind: str,
         seconds: float | None, event: str | None = None,
         key: str | None = None) -> tuple[str, float | None]:
    """Hand a suspended run's message back parked (the caller holds its delivery, fenced).
    A wait first tries its event's lock row and reads the events after getting it, in one
    transaction (sql/steps.sql: step_event_lock). (verdict: parked, lost, cancelled or
    refused; seconds until it is due)."""
    q = queries(schema)
    params = _params(d, name=name, kind=kind, seconds=seconds, event=event, event_key=key,
                     channel=f"pgjobs.{schema}", sure=True)
    with conn.transaction():
        if kind == "event":
            got = conn.execute(q["step_event_lock"], params).fetchone()
            params["sure"] = bool(got and got[0])
        row = conn.execute(q["step_park"], params).fetchone()
    assert row is not None
    return str(row[0]), (None if row[1] is None else float(row[1]))


def emit(conn: Executor, schema: str, event: str, key: str, data: str) -> None:
    """Insert an event (JSON text ``data``); its trigger wakes the parked waiters."""
    conn.execute(queries(schema)["step_emit"], {"event": event, "event_key": key, "data": data})


# -- operators ---------------------------------------------------------------------------------
def _require(conn: psycopg.Connection[Any], schema: str) -> None:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                       (f'"{schema}".pgjobs_step',)).fetchone()
    if not row or not row[0]:
        raise MigrationError(f"schema {schema!r} has no step tables (version {VERSION}): run "
                             "`pgjobs migrate`")


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def steps_of(conn: psycopg.Connection[Any], schema: str, task_id: str) -> dict[str, Any]:
    """A task's steps (name, kind, state, attempts, started/finished, result size, error, what
    it sleeps or waits for) and where its message is: ``pgjobs steps TASK_ID``."""
    if not isinstance(task_id, str) or not task_id or len(task_id) > 255 \
            or _CONTROL.search(task_id):
        raise InvalidArgument(f"not a Celery task id: {task_id!r:.80}")
    _require(conn, schema)
    q = queries(schema)
    cur = conn.execute(q["step_list"], {"task_id": task_id})
    names = [c.name for c in cur.description or ()]
    steps = [{k: _iso(v) for k, v in zip(names, r, strict=True)} for r in cur.fetchall()]
    cur = conn.execute(q["step_message"], {"task_id": task_id})
    names = [c.name for c in cur.description or ()]
    messages = [{k: _iso(v) for k, v in zip(names, r, strict=True)} for r in cur.fetchall()]
    suspended_on = next(({"kind": s["kind"], "state": s["state"], "name": s["name"],
                          "event": s["event"], "key": s["event_key"], "due_at": s["due_at"]}
                         for s in steps if s["state"] in ("sleeping", "waiting")), None)
    return {"task_id": task_id, "steps": steps, "messages": messages,
            "suspended": suspended_on}


def steps_for_page(conn: psycopg.Connection[Any], schema: str,
                   task_id: Any) -> list[dict[str, Any]]:
    """A message's steps for the dashboard's message page (none for a message without a task
    id, or on a schema before version 23): ``step_list``'s rows."""
    if not isinstance(task_id, str) or not task_id:
        return []
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                       (f'"{schema}".pgjobs_step',)).fetchone()
    if not row or not row[0]:
        return []
    cur = conn.execute(queries(schema)["step_list"], {"task_id": task_id})
    names = [c.name for c in cur.description or ()]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def requeue_from_step(conn: psycopg.Connection[Any], schema: str, ids: Sequence[Any],
                      name: str) -> dict[str, Any]:
    """``pgjobs requeue ID... --from-step NAME``: in one transaction, drop step NAME of each
    message's task and every step recorded after it, then requeue the messages (a dead letter
    back to ready, a parked or delayed message due now; see ``Admin.requeue``). A running
    message is refused (StateConflict, PGJ-406) and a task without that step is StepNotFound
    (PGJ-907): nothing changes then."""
    from .admin import Admin, parse_ids  # the admin module imports this one (prune)

    check_name(name)
    wanted = parse_ids(ids)
    _require(conn, schema)
    admin = Admin(conn, schema)
    q = queries(schema)
    with conn.transaction():
        rows = conn.execute(q["step_locate"], {"ids": wanted}).fetchall()
        found: dict[int, tuple[str, str, str | None]] = {}
        for job_id, place, state, task_id in rows:
            if int(job_id) not in found or place == "job":
                found[int(job_id)] = (place, state, task_id)
        missing = [i for i in wanted if i not in found]
        if missing:
            raise StepNotFound(f"no message or dead letter with id "
                               f"{', '.join(map(str, missing))}")
        running = [i for i in wanted if found[i][1] == "running"]
        if running:
            raise StateConflict(
                f"message {', '.join(map(str, running))} is running: its steps cannot be "
                "dropped under it; wait for it to finish or suspend, or cancel it")
        dropped: dict[int, list[str]] = {}
        for i in wanted:
            task_id = found[i][2]
            if not task_id:
                raise StepNotFound(f"message {i} has no Celery task id that can be read: its "
                                   "steps cannot be found")
            names = [r[0] for r in conn.execute(
                q["step_drop"], {"task_id": task_id, "name": name}).fetchall()]
            if not names:
                raise StepNotFound(f"the task of message {i} ({task_id}) has no step "
                                   f"{name!r}: see `pgjobs steps {task_id}`")
            dropped[i] = names
        result = admin.requeue(wanted)
    result["dropped"] = {str(i): n for i, n in dropped.items()}
    return result


def prune(conn: psycopg.Connection[Any], schema: str, cutoff: datetime, *, limit: int,
          batch: int, dry_run: bool = False) -> dict[str, Any]:
    """Retention of steps and events, in bounded batches (each its own transaction): the steps
    of tasks whose message is gone and that were not written since ``cutoff``; events emitted
    before ``cutoff`` that no parked waiter has still to read. At most ``limit`` of each are
    deleted (a task's steps all or none). ``dry_run`` counts exactly."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                       (f'"{schema}".pgjobs_step',)).fetchone()
    if not row or not row[0]:  # a schema before version 23: nothing to prune
        return {"steps": {"matched": 0, "deleted": 0, "remaining": 0},
                "events": {"matched": 0, "deleted": 0, "remaining": 0}}
    q = queries(schema)
    steps_matched = int(conn.execute(q["step_prune_count"], {"cutoff": cutoff}).fetchone()[0])
    events_matched = int(conn.execute(q["event_prune_count"], {"cutoff": cutoff}).fetchone()[0])
    steps_deleted = events_deleted = 0
    if not dry_run:
        after: tuple[Any, str, str] = ("-infinity", "", "")
        while steps_deleted < limit:
            # a batch reads at most what the limit has room for; a gone task's steps go
            # together, so a batch may delete more rows than it read: past the limit it is
            # undone and read again smaller, down to one row (whose task then does not fit)
            room = limit - steps_deleted
            scan = min(batch, room)
            while True:
                undone = False
                with conn.transaction():
                    read, deleted, at, task, step = conn.execute(q["step_prune"], {
                        "cutoff": cutoff, "limit": scan, "after_at": after[0],
                        "after_task": after[1], "after_name": after[2]}).fetchone()
                    if int(deleted) > room:
                        undone = True
                        raise psycopg.Rollback
                if not undone or scan == 1:
                    break
                scan = max(1, scan // 2)
            if undone:
                break
            steps_deleted += int(deleted)
            if int(read) < scan:
                break
            after = (at, task, step)
        while events_deleted < limit:
            with conn.transaction():
                n = int(conn.execute(q["event_prune"], {
                    "cutoff": cutoff, "limit": min(batch, limit - events_deleted)}).fetchone()[0])
            events_deleted += n
            if n == 0:
                break
    return {"steps": {"matched": steps_matched, "deleted": steps_deleted,
                      "remaining": max(0, steps_matched - steps_deleted)},
            "events": {"matched": events_matched, "deleted": events_deleted,
                       "remaining": max(0, events_matched - events_deleted)}}


def suspended(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, str, int]]:
    """Messages parked by a step: (queue, reason ``sleep`` or ``event``, count)."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                       (f'"{schema}".pgjobs_step',)).fetchone()
    if not row or not row[0]:
        return []
    return [(str(r[0]), str(r[1]), int(r[2]))
            for r in conn.execute(queries(schema)["step_suspended"]).fetchall()]
