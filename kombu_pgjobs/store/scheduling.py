"""The scheduler's statements: leader leases with fencing terms, entries, fires, history.

Celery-free, so the ``pgjobs schedule`` CLI and ``celery_ext.scheduler`` share one owner of this
SQL (``sql/schedule.sql``). A fire is ONE statement: the fence (the caller's term is current,
its lease unexpired on the database clock, the entry unchanged and behind the occurrence; it
moves the watermark), the message row (pgjobs broker: the queue core's own ``job_insert``, fed
by the fence) and the history row. Either all of it commits or none of it does.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from ..errors import InvalidScheduleEntry, ScheduleEntryExists, ScheduleEntryNotFound
from ..options import validate_queue_name, validate_schema_name
from ..recurrence import DEFAULT_CATCH_UP_MAX, check_catch_up, parse_schedule, zone
from .core import NewJob, QueueCore, queue_full
from .sql import queries

__all__ = ["SCHEDULER_VERSION", "EntryDef", "EntryRow", "Lease", "ScheduleStore",
           "check_entry_name", "next_due"]

#: the schema version that has the scheduler's tables
SCHEDULER_VERSION = 9

#: the election the scheduler runs (one leader per schema and name)
ELECTION = "scheduler"


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease as one election round left it."""

    holder: str
    term: int
    leading: bool
    #: seconds the lease has left on the database clock
    remaining: float
    db_now: datetime
    #: the definitions' version (count, last change): reload the entries when it moves
    version: tuple[int, datetime | None]


@dataclass(frozen=True, slots=True)
class EntryDef:
    """An entry as configured (beat_schedule) or added (CLI): what the table stores."""

    name: str
    task: str
    schedule: str
    timezone: str | None
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    catch_up: str = "skip"
    catch_up_max: int = DEFAULT_CATCH_UP_MAX


@dataclass(frozen=True, slots=True, kw_only=True)
class EntryRow(EntryDef):
    """An entry as the table holds it: its definition and its state."""

    source: str
    paused: bool
    anchor: datetime
    last_occurrence: datetime | None
    last_fired_at: datetime | None
    fires: int
    updated_at: datetime

    @property
    def watermark(self) -> datetime:
        """The latest occurrence accounted for (the anchor before the first)."""
        return self.last_occurrence or self.anchor


def _control(text: str) -> bool:
    return any(ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in text)


def check_entry_name(name: object) -> str:
    if not isinstance(name, str) or not 1 <= len(name) <= 200 or _control(name):
        raise InvalidScheduleEntry(
            f"entry name {name!r} must be 1-200 characters without control characters")
    return name


def _unstorable(value: Any, depth: int = 0) -> str | None:
    """What in ``value`` PostgreSQL's ``jsonb`` (the entry's columns) cannot hold: a NUL or a
    lone surrogate in a string or key (None: nothing). Checked before the INSERT, so the
    mistake is PGJ-604 naming the field, not the driver's "unsupported Unicode escape"
    (for a static entry: at every election, failing every entry's fires with it)."""
    if depth > 100:
        return "nesting deeper than 100 levels"
    if isinstance(value, str):
        if "\x00" in value:
            return f"a NUL character in {value[:40]!r}"
        if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
            return f"a lone surrogate in {value[:40]!r}"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            why = _unstorable(key, depth + 1) or _unstorable(item, depth + 1)
            if why:
                return why
    elif isinstance(value, (list, tuple)):
        for item in value:
            why = _unstorable(item, depth + 1)
            if why:
                return why
    return None


def _json(name: str, what: str, value: Any, kind: type) -> Any:
    if not isinstance(value, kind):
        raise InvalidScheduleEntry(f"entry {name!r}: {what} must be a JSON {kind.__name__}, "
                                   f"got {type(value).__name__} {value!r:.60}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidScheduleEntry(f"entry {name!r}: {what} are not JSON: {exc}") from None
    why = _unstorable(value)
    if why is not None:
        raise InvalidScheduleEntry(f"entry {name!r}: {what} hold {why}, which PostgreSQL "
                                   "cannot store: leave it out (or encode the data)")
    return value


#: the message priorities a publish accepts (kombu_pgjobs.core: 0-255, above 9 counted as 9)
PRIORITY_RANGE = (0, 255)


def _check_options(name: str, options: dict[str, Any]) -> None:
    """The options a publish would refuse at every fire, refused when the entry is read."""
    if "priority" in options and options["priority"] is not None:
        priority = options["priority"]
        low, high = PRIORITY_RANGE
        if isinstance(priority, bool) or not isinstance(priority, int) or \
                not low <= priority <= high:
            raise InvalidScheduleEntry(
                f"entry {name!r}: priority must be a whole number in {low}-{high}, got "
                f"{priority!r:.40}")
    queue = options.get("queue")
    if queue is not None and not isinstance(queue, str):
        raise InvalidScheduleEntry(f"entry {name!r}: queue must be a queue name, got "
                                   f"{queue!r:.40}")
    if isinstance(queue, str):
        validate_queue_name(queue)
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, dict):
        raise InvalidScheduleEntry(f"entry {name!r}: headers must be a JSON object, got "
                                   f"{type(headers).__name__}")


def validate_entry(entry: EntryDef) -> EntryDef:
    """Every field checked, or a coded error (PGJ-601..604, PGJ-103 for a queue name) naming
    the mistake; used by ``pgjobs schedule add``, by the scheduler at start for the app's
    beat_schedule, and for every stored entry the leader loads. Checked like a publish: what
    would fail every fire (a priority out of range, a task name with control characters, a
    NUL the table cannot hold) fails here, once."""
    name = check_entry_name(entry.name)
    if not isinstance(entry.task, str) or not 1 <= len(entry.task) <= 200 or \
            _control(entry.task):
        raise InvalidScheduleEntry(f"entry {name!r}: task must be a task name (1-200 "
                                   f"characters without control characters), got "
                                   f"{entry.task!r:.80}")
    if entry.timezone is not None:
        zone(entry.timezone)
    parse_schedule(entry.schedule, entry.timezone or "UTC")
    check_catch_up(entry.catch_up, entry.catch_up_max)
    _json(name, "args", entry.args, list)
    _json(name, "kwargs", entry.kwargs, dict)
    if not all(isinstance(k, str) for k in entry.kwargs):
        raise InvalidScheduleEntry(f"entry {name!r}: kwargs keys must be strings (argument "
                                   "names)")
    _json(name, "options", entry.options, dict)
    _check_options(name, entry.options)
    return entry


#: the columns of schedule_load, in order
_COLUMNS = ("name", "source", "task", "schedule", "timezone", "args", "kwargs", "options",
            "catch_up", "catch_up_max", "paused", "anchor", "last_occurrence", "last_fired_at",
            "fires", "updated_at")


def _row(r: Sequence[Any]) -> EntryRow:
    return EntryRow(**dict(zip(_COLUMNS, r, strict=True)))


class ScheduleStore:
    """Statements on the scheduler's tables of one schema."""

    def __init__(self, schema: str, election: str = ELECTION) -> None:
        self.schema = validate_schema_name(schema)
        self.election = election
        self.q = queries(schema)

    # -- leadership ----------------------------------------------------------------------
    def elect(self, conn: psycopg.Connection[Any], holder: str, ttl: float) -> Lease | None:
        """Take or renew the lease (one statement); None when nobody holds one (never: the
        statement inserts the row on first use)."""
        if not (math.isfinite(ttl) and ttl > 0):
            raise InvalidScheduleEntry(f"lease ttl must be a positive number, got {ttl!r}")
        row = conn.execute(self.q["leader_elect"], {
            "name": self.election, "holder": holder, "ttl": ttl}).fetchone()
        if row is None:
            return None
        return Lease(row[0], int(row[1]), bool(row[2]), float(row[3]), row[4],
                     (int(row[5]), row[6]))

    def resign(self, conn: psycopg.Connection[Any], holder: str, term: int) -> None:
        conn.execute(self.q["leader_resign"], {
            "name": self.election, "holder": holder, "term": term})

    def leader(self, conn: psycopg.Connection[Any]) -> dict[str, Any] | None:
        row = conn.execute(self.q["leader_get"], {"name": self.election}).fetchone()
        if row is None:
            return None
        return {"holder": row[0], "term": row[1], "elected_at": row[2], "expires_at": row[3],
                "live": row[4]}

    # -- entries -------------------------------------------------------------------------
    def sync_static(self, conn: psycopg.Connection[Any], holder: str, term: int,
                    entries: Sequence[EntryDef]) -> None:
        """Write the app's beat_schedule as the leader of ``term`` (fenced: a deposed leader
        writes nothing)."""
        conn.execute(self.q["schedule_sync_static"], {
            "leader": self.election, "term": term, "holder": holder,
            "names": [e.name for e in entries], "tasks": [e.task for e in entries],
            "schedules": [e.schedule for e in entries],
            "timezones": [e.timezone for e in entries],
            "args": [Jsonb(e.args) for e in entries],
            "kwargs": [Jsonb(e.kwargs) for e in entries],
            "options": [Jsonb(e.options) for e in entries],
            "catch_ups": [e.catch_up for e in entries],
            "caps": [e.catch_up_max for e in entries],
        })

    def load(self, conn: psycopg.Connection[Any]) -> list[EntryRow]:
        return [_row(r) for r in conn.execute(self.q["schedule_load"]).fetchall()]

    def get(self, conn: psycopg.Connection[Any], name: str) -> EntryRow:
        for entry in self.load(conn):
            if entry.name == name:
                return entry
        raise ScheduleEntryNotFound(f"no schedule entry named {name!r}: see "
                                    "`pgjobs schedule ls`")

    def add(self, conn: psycopg.Connection[Any], entry: EntryDef, *, paused: bool = False,
            replace: bool = False) -> bool:
        """Add (or with ``replace`` redefine) a dynamic entry; True when it was created."""
        validate_entry(entry)
        row = conn.execute(self.q["schedule_add"], {
            "name": entry.name, "task": entry.task, "schedule": entry.schedule,
            "timezone": entry.timezone, "args": Jsonb(entry.args),
            "kwargs": Jsonb(entry.kwargs), "options": Jsonb(entry.options),
            "catch_up": entry.catch_up, "catch_up_max": entry.catch_up_max,
            "paused": paused, "replace": replace}).fetchone()
        if row is None:
            raise ScheduleEntryExists(
                f"a schedule entry named {entry.name!r} exists: remove it first, or pass "
                "--replace (a static entry from the app's beat_schedule cannot be replaced "
                "from the CLI)")
        return bool(row[1])

    def pause(self, conn: psycopg.Connection[Any], name: str, paused: bool) -> None:
        if conn.execute(self.q["schedule_pause"], {
                "name": check_entry_name(name), "paused": paused}).fetchone() is None:
            raise ScheduleEntryNotFound(f"no schedule entry named {name!r}")

    def remove(self, conn: psycopg.Connection[Any], name: str) -> str:
        row = conn.execute(self.q["schedule_remove"],
                           {"name": check_entry_name(name)}).fetchone()
        if row is None:
            raise ScheduleEntryNotFound(f"no schedule entry named {name!r}")
        return str(row[1])

    def history(self, conn: psycopg.Connection[Any], name: str,
                n: int = 20) -> list[dict[str, Any]]:
        if not 1 <= n <= 1000:
            raise InvalidScheduleEntry(f"--limit must be in 1-1000, got {n}")
        rows = conn.execute(self.q["schedule_history"], {
            "name": check_entry_name(name), "n": n}).fetchall()
        keys = ("id", "entry", "occurrence", "fired_at", "term", "holder", "job_id", "missed")
        return [dict(zip(keys, r, strict=True)) for r in rows]

    def prune_history(self, conn: psycopg.Connection[Any], days: int,
                      limit: int = 10_000) -> int:
        """Delete fires older than ``days`` days (at most ``limit``); the number deleted."""
        row = conn.execute(self.q["schedule_prune_history"], {"days": days, "n": limit}
                           ).fetchone()
        return int(row[0]) if row else 0

    # -- fires ---------------------------------------------------------------------------
    def fire(self, conn: psycopg.Connection[Any], *, holder: str, term: int, entry: EntryRow,
             occurrence: datetime, watermark: datetime, missed: int,
             job: NewJob | None = None, core: QueueCore | None = None
             ) -> tuple[int, int | None] | None:
        """Fire one occurrence in ONE statement, fenced on ``term``: returns (fire id, job id)
        or None when the fence refused (not the leader any more, the entry changed or was
        fired). With ``job`` (pgjobs broker) the message row is inserted by the same statement
        with ``core``'s own insert (job id None: its idempotency key was held, the occurrence
        is recorded and nothing queued); without, the caller publishes after this returns. A
        tenant over its queue cap raises TenantQueueFull (PGJ-506): nothing is written."""
        params: dict[str, Any] = {
            "leader": self.election, "term": term, "holder": holder, "entry": entry.name,
            "defined_at": entry.updated_at, "watermark": watermark,
            "occurrence": occurrence, "missed": missed}
        parts = [sql.SQL("WITH fence AS ("), self.q["schedule_fence"], sql.SQL(")")]
        if job is not None:
            if core is None:
                raise ValueError("a job needs the queue core that inserts it")
            insert, job_params = core.insert_from("fence", job)
            params.update(job_params)
            parts += [sql.SQL(", job AS ("), insert, sql.SQL(")\n"),
                      self.q["schedule_record_fire_job"]]
        else:
            parts += [sql.SQL("\n"), self.q["schedule_record_fire"]]
        try:
            row = conn.execute(sql.Composed(parts), params).fetchone()
        except psycopg.Error as exc:
            full = queue_full(exc)
            if full is not None:
                raise full from None
            raise
        return None if row is None else (int(row[0]), row[1])



def next_due(entry: EntryRow) -> datetime | None:
    if entry.paused or (entry.timezone is None and not entry.schedule.startswith("every")):
        return None  # a crontab in the app's time zone: only the scheduler knows it
    try:
        rec = parse_schedule(entry.schedule, entry.timezone or "UTC")
        return rec.next_after(entry.watermark, entry.anchor)
    except Exception:  # (a row written by hand: show it, without a next due)
        return None
