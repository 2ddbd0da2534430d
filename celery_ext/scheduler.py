"""A leader-elected Celery beat scheduler: run it on every replica, each occurrence fires once.

Features
========
* ``celery -A app beat -S celery_ext.scheduler:LeaderScheduler`` on every replica, or
  ``beat_scheduler = "celery_ext.scheduler:LeaderScheduler"`` with ``celery worker -B`` on every
  worker: one of them leads, the others wait. On a pgjobs broker ``celery_ext.install(app)``
  makes it the default ``beat_scheduler`` (:mod:`celery_ext.beat`): no flag, no setting.
* Entries: ``app.conf.beat_schedule`` (crontab, timedelta or seconds, ``celery.schedules.
  schedule``; args, kwargs, options such as queue and priority) and dynamic entries added with
  ``pgjobs schedule add`` (picked up without a restart). Solar schedules are computed with
  Celery's ``solar`` (``ephem`` installed), as ``solar EVENT LAT LON``.
* Each message carries headers ``pgjobs_schedule_entry``, ``pgjobs_schedule_occurrence``
  (ISO 8601, UTC) and ``pgjobs_schedule_missed``, readable in the task as
  ``self.request.pgjobs_schedule_entry`` etc.
* Entry options (in ``options``): ``pgjobs_catch_up`` (``skip``, ``once``, ``all``),
  ``pgjobs_catch_up_max`` (cap of ``all``), ``pgjobs_catch_up_latest`` (``skip``: fire the
  latest missed occurrence, default True), ``pgjobs_timezone`` (crontab time zone; default
  ``app.conf.timezone``).

Settings
========
``pgjobs_scheduler_lease_ttl_seconds`` (15), ``pgjobs_scheduler_grace_seconds`` (60),
``pgjobs_scheduler_url`` (the database when the broker is not pgjobs),
``pgjobs_scheduler_schema`` (default: the broker's schema option, else ``pgjobs``),
``pgjobs_scheduler_history_days`` (14: the leader deletes older fires once an hour),
``pgjobs_scheduler_outbox`` (False; True: with another broker, stage fires in the outbox).

Design
======
1. Leadership is a lease row (``pgjobs_leader``) on the database clock, taken or renewed in one
   statement every ``ttl / 3`` seconds by a thread on a connection of its own. A takeover
   increments the term (the fencing token). The renewal also returns the entries' version, so
   an idle replica runs one statement per round.
2. The leader computes due occurrences from each entry's durable watermark
   (:mod:`kombu_pgjobs.recurrence`) and fires each in ONE statement
   (:meth:`kombu_pgjobs.store.scheduling.ScheduleStore.fire`): the fence (term and holder current,
   lease unexpired, leader row locked FOR SHARE, entry unchanged and behind) moves the
   watermark, inserts the message row with the queue core's own insert, and records the fire.
   A deposed leader's fire matches no row; a crash before the commit leaves the occurrence to
   the next leader, after it leaves the watermark past it.
3. With another broker the watermark commits first, then the message is published: a crash in
   between loses that occurrence (at most once), never fires it twice. With
   ``pgjobs_scheduler_outbox = True`` the message is staged in the outbox of the scheduler's
   schema in the fire's own transaction instead (exactly once), and ``pgjobs relay`` (or the
   ``OutboxRelay`` worker bootstep) publishes it to the broker.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
from celery import beat, schedules

from kombu_pgjobs.broker.backend import Backend
from kombu_pgjobs.broker.batching import capture
from kombu_pgjobs.broker.transport import Transport as PgJobsTransport
from kombu_pgjobs.errors import (
    ConfigurationError,
    InvalidSchedule,
    InvalidScheduleEntry,
    PgJobsError,
)
from kombu_pgjobs.events import log_event, one_line
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.recurrence import (
    DEFAULT_CATCH_UP_MAX,
    Recurrence,
    Solar,
    catch_up_plan,
    cron_from_sets,
    every,
    parse_cron,
    parse_schedule,
    parse_solar,
    walk,
    zone,
)
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.database import connect, conninfo_from_url
from kombu_pgjobs.store.scheduling import EntryDef, EntryRow, Lease, ScheduleStore, validate_entry
from kombu_pgjobs.store.schema import current_version, latest_version, migrate

from .outbox import transaction as outbox_transaction

__all__ = ["LeaderScheduler"]

log = logging.getLogger("celery_ext.scheduler")
UTC = timezone.utc

#: headers every fired message carries
ENTRY_HEADER = "pgjobs_schedule_entry"
OCCURRENCE_HEADER = "pgjobs_schedule_occurrence"
MISSED_HEADER = "pgjobs_schedule_missed"
#: a fire that failed for its entry's own reason is tried again after this long
ENTRY_RETRY_SECONDS = 10.0


def _setting(conf: Any, name: str, default: float, low: float, high: float) -> float:
    value = conf.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not low <= value <= high:
        raise InvalidScheduleEntry(f"{name} must be a number in {low:g}-{high:g}, "
                                   f"got {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class Settings:
    lease_ttl: float
    grace: float
    url: str | None
    schema: str | None
    history_days: int
    outbox: bool = False

    @classmethod
    def from_conf(cls, conf: Any) -> Settings:
        outbox = conf.get("pgjobs_scheduler_outbox", False)
        if not isinstance(outbox, bool):
            raise InvalidScheduleEntry(
                f"pgjobs_scheduler_outbox must be True or False, got {outbox!r}")
        return cls(
            _setting(conf, "pgjobs_scheduler_lease_ttl_seconds", 15.0, 0.3, 3600.0),
            _setting(conf, "pgjobs_scheduler_grace_seconds", 60.0, 0.0, 86400.0),
            conf.get("pgjobs_scheduler_url"), conf.get("pgjobs_scheduler_schema"),
            int(_setting(conf, "pgjobs_scheduler_history_days", 14, 1, 3650)), outbox)


# -- the app's beat_schedule ---------------------------------------------------------------
def _cron_text(values: set[int], low: int, high: int) -> str:
    return "*" if set(values) == set(range(low, high + 1)) else ",".join(
        str(v) for v in sorted(values))


def _schedule_text(name: str, spec: Any, tz: str) -> str:
    """The entry's schedule as stored text ('every 30s' or crontab), checked."""
    if isinstance(spec, bool):
        raise InvalidSchedule(f"entry {name!r}: schedule {spec!r} is not a schedule")
    if isinstance(spec, (int, float)):
        return every(spec).text
    if isinstance(spec, timedelta):
        return every(spec.total_seconds()).text
    if isinstance(spec, schedules.crontab):
        text = " ".join(str(f) for f in (
            spec._orig_minute, spec._orig_hour, spec._orig_day_of_month,
            spec._orig_month_of_year, spec._orig_day_of_week))
        exact = cron_from_sets(spec.minute, spec.hour, spec.day_of_month, spec.month_of_year,
                               spec.day_of_week, tz, text)
        try:
            mine = parse_cron(text, tz)
            if (mine.minute, mine.hour, mine.day_of_month, mine.month, mine.day_of_week) == (
                    exact.minute, exact.hour, exact.day_of_month, exact.month,
                    exact.day_of_week):
                return mine.text
        except InvalidSchedule:
            pass
        return " ".join((_cron_text(spec.minute, 0, 59), _cron_text(spec.hour, 0, 23),
                         _cron_text(spec.day_of_month, 1, 31),
                         _cron_text(spec.month_of_year, 1, 12),
                         _cron_text(spec.day_of_week, 0, 6)))
    if isinstance(spec, schedules.solar):
        return parse_solar(f"solar {spec.event} {spec.lat} {spec.lon}").text
    if isinstance(spec, schedules.schedule):
        return every(spec.run_every.total_seconds()).text
    raise InvalidSchedule(f"entry {name!r}: schedule {spec!r} is not a crontab, a timedelta "
                          "or a number of seconds")


class CelerySolar:
    """Occurrences of a ``solar EVENT LAT LON`` entry, computed by Celery's ``solar``
    schedule (which needs ``ephem``). Instants are rounded to the second, and each search
    starts a minute after the last occurrence: the same sunset found again from a slightly
    different start (the astronomy is iterative) must not become a second occurrence."""

    def __init__(self, spec: Solar, app: Any) -> None:
        self.text = spec.text
        try:
            self._solar = schedules.solar(spec.event, spec.lat, spec.lon, app=app)
        except Exception as exc:  # ImproperlyConfigured: ephem is not installed
            raise InvalidSchedule(f"{spec.text}: {exc}") from None

    def next_after(self, after: datetime, anchor: datetime | None = None) -> datetime:
        start = after + timedelta(minutes=1)
        self._solar.nowfun = lambda: start
        found = start + self._solar.remaining_estimate(start)
        return (found + timedelta(microseconds=500_000)).replace(microsecond=0)

    def occurrences(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        return walk(self, after, until, limit)


def recurrence(text: str, tz: str, app: Any) -> Recurrence:
    """An entry's schedule, ready to compute: PGJ-601/602 when it is not."""
    rec = parse_schedule(text, tz)
    return CelerySolar(rec, app) if isinstance(rec, Solar) else rec


def _given(name: str, spec: dict[str, Any], key: str, kind: Any, what: str,
           default: Any) -> Any:
    """``spec[key]`` (``default`` when absent or None), of the type Celery's beat takes:
    anything else is refused rather than converted (``list("abc")`` would make the string's
    characters the task's arguments, ``dict(...)`` of a string raises a bare ValueError)."""
    value = spec.get(key)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidScheduleEntry(f"beat_schedule entry {name!r}: {key} must be {what}, got "
                                   f"{type(value).__name__} {value!r:.60}")
    return value


def static_entries(app: Any) -> list[EntryDef]:
    """The app's beat_schedule as entries, each validated: a mistake raises its coded error
    at start (PGJ-601 schedule, 602 time zone, 603 catch-up, 604 the rest)."""
    default_tz = str(app.conf.timezone or "UTC")
    found: list[EntryDef] = []
    configured = dict(app.conf.beat_schedule or {})
    if app.conf.result_expires and not app.backend.supports_autoexpire and \
            "celery.backend_cleanup" not in configured:  # what celery beat installs too
        configured["celery.backend_cleanup"] = {
            "task": "celery.backend_cleanup", "schedule": schedules.crontab("0", "4", "*"),
            "options": {"expires": 12 * 3600}}
    for name, spec in configured.items():
        if not isinstance(spec, dict) or "task" not in spec or "schedule" not in spec:
            raise InvalidScheduleEntry(f"beat_schedule entry {name!r} needs 'task' and "
                                       "'schedule'")
        args = _given(name, spec, "args", (list, tuple), "a list or tuple", [])
        kwargs = _given(name, spec, "kwargs", Mapping, "a dict", {})
        options = _given(name, spec, "options", Mapping, "a dict", {})
        tz = options.get("pgjobs_timezone", default_tz)
        try:
            zone(tz)
            entry = EntryDef(
                name=name, task=spec["task"],
                schedule=_schedule_text(name, spec["schedule"], tz), timezone=tz,
                args=list(args), kwargs=dict(kwargs),
                options=dict(options), catch_up=options.get("pgjobs_catch_up", "skip"),
                catch_up_max=options.get("pgjobs_catch_up_max", DEFAULT_CATCH_UP_MAX))
            found.append(validate_entry(entry))
            recurrence(entry.schedule, tz, app)  # solar: Celery's, with ephem, works here
        except PgJobsError as exc:
            if exc.message.startswith("entry "):
                raise
            raise type(exc)(f"beat_schedule entry {name!r}: {exc.message}") from None
    return found


# -- the database ----------------------------------------------------------------------------
class Database:
    """Where the scheduler's tables are, and the queue core when the broker is pgjobs."""

    def __init__(self, app: Any, settings: Settings) -> None:
        self.backend: Backend | None = None
        kc = app.connection_for_write()
        try:
            transport = kc.transport
            if isinstance(transport, PgJobsTransport):
                self.backend = transport.backend
        finally:
            kc.release()
        if self.backend is not None:
            schema = settings.schema or self.backend.options.schema
            if schema != self.backend.options.schema:
                raise ConfigurationError(
                    "pgjobs_scheduler_schema must be the broker's schema when the broker is "
                    "pgjobs (the fire and its message are one statement)")
            self.core: QueueCore | None = self.backend.core
            self.conninfo = self.backend.conninfo
        else:
            if not settings.url:
                raise ConfigurationError(
                    "LeaderScheduler needs PostgreSQL: the broker is not pgjobs, so set "
                    "pgjobs_scheduler_url = 'postgresql://user@host/db'")
            schema = settings.schema or "pgjobs"
            self.core = None
            self.conninfo = conninfo_from_url(settings.url, TransportOptions(schema=schema))
        self.schema = schema
        self._migrated = False

    def connect(self) -> psycopg.Connection[Any]:
        if self.backend is not None:
            return self.backend.connect()
        conn = connect(self.conninfo)
        if not self._migrated and current_version(conn, self.schema) < latest_version():
            migrate(conn, self.schema)
        self._migrated = True
        return conn


def _close(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass


# -- leadership ------------------------------------------------------------------------------
class Elector:
    """Takes or renews the lease every ``ttl / 3`` seconds on its own connection and thread,
    so a busy fire never delays a renewal. :meth:`current` says leading only until the lease
    this process last saw would lapse (measured from before the statement was sent)."""

    def __init__(self, store: ScheduleStore, db: Database, holder: str, ttl: float) -> None:
        self.store = store
        self.db = db
        self.holder = holder
        self.ttl = ttl
        self.interval = ttl / 3
        self.offset = 0.0  # database clock minus this clock, seconds
        self._lease: Lease | None = None
        self._valid_until = 0.0
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ran = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pgjobs-scheduler-elector",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wait_first_round(self, timeout: float) -> None:
        self._ran.wait(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.round()
            self._ran.set()
            self._stop.wait(self.interval)

    def round(self) -> None:
        lease: Lease | None = None
        sent = wall = 0.0
        try:
            if self._conn is None or self._conn.closed or self._conn.broken:
                self._conn = self.db.connect()
            sent = time.monotonic()  # the lease runs from no earlier than this
            wall = time.time()
            lease = self.store.elect(self._conn, self.holder, self.ttl)
        except (psycopg.Error, PgJobsError) as exc:
            self._drop()
            if self._lease is not None and self._lease.leading:
                log_event("pgjobs.leader.lost", holder=self.holder, term=self._lease.term,
                          error=one_line(exc))
            elif self._lease is not None or not self._ran.is_set():
                log.warning("pgjobs.leader.unreachable %s", one_line(exc))
        back = time.monotonic()
        with self._lock:
            before = self._lease
            self._lease = lease
            if lease is not None:
                self.offset = lease.db_now.timestamp() - (wall + (back - sent) / 2)
                self._valid_until = sent + min(lease.remaining, self.ttl) \
                    if lease.leading else 0.0
        if lease is not None and lease.leading and (
                before is None or not before.leading or before.term != lease.term):
            log_event("pgjobs.leader.elected", logging.INFO, holder=self.holder,
                      term=lease.term)
        elif lease is not None and not lease.leading and before is not None and \
                before.leading:
            log_event("pgjobs.leader.lost", holder=self.holder, term=before.term,
                      leader=lease.holder)

    def current(self) -> Lease | None:
        with self._lock:
            lease = self._lease
            if lease is not None and lease.leading and time.monotonic() >= self._valid_until:
                return replace(lease, leading=False)
            return lease

    def _drop(self) -> None:
        _close(self._conn)
        self._conn = None

    def stop(self) -> None:
        """Stop electing; resign a held lease so a follower takes over at its next round."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        lease = self.current()
        if lease is not None and lease.leading and self._conn is not None:
            try:
                self.store.resign(self._conn, self.holder, lease.term)
            except psycopg.Error:
                pass
        with self._lock:
            self._lease = None
        self._drop()


# -- the scheduler -------------------------------------------------------------------------
@dataclass
class Loaded:
    row: EntryRow
    rec: Recurrence
    #: where plans start: the durable watermark, or past occurrences skipped without a fire
    watermark: datetime
    #: occurrences skipped without a fire since the durable watermark (reported by the next)
    carried: int = 0
    #: monotonic time before which a failed entry is not tried again
    retry_at: float = 0.0


class LeaderScheduler(beat.Scheduler):
    """Celery beat scheduler with a leader elected in PostgreSQL (see the module docstring).

    ``clock``: a function returning the current time (aware): tests pass one to simulate
    downtime without sleeping; by default the database's clock (this clock plus the offset
    measured at each renewal)."""

    def __init__(self, app: Any, *args: Any, clock: Callable[[], datetime] | None = None,
                 **kwargs: Any) -> None:
        self._clock = clock
        self.elector: Elector | None = None
        super().__init__(app, *args, **kwargs)

    # -- setup ---------------------------------------------------------------------------
    def setup_schedule(self) -> None:
        self.settings = Settings.from_conf(self.app.conf)
        self.static = static_entries(self.app)
        self.db = Database(self.app, self.settings)
        self.store = ScheduleStore(self.db.schema)
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._conn: psycopg.Connection[Any] | None = None
        self._entries: dict[str, Loaded] = {}
        self._term: int | None = None
        self._version: tuple[int, datetime | None] | None = None
        self._next_prune = 0.0  # monotonic time of the leader's next history prune
        self.elector = Elector(self.store, self.db, self.holder, self.settings.lease_ttl)
        self.elector.start()
        self.elector.wait_first_round(min(5.0, self.settings.lease_ttl))

    @property
    def schedule(self) -> dict[str, Any]:  # what beat's banner counts
        return {name: e.row for name, e in self._entries.items()}

    @property
    def info(self) -> str:
        if self.elector is None:  # the banner's lazy instance: nothing set up
            return "    . pgjobs leader scheduler (elected in PostgreSQL)"
        lease = self.elector.current()
        role = "leader" if lease and lease.leading else "follower"
        return (f"    . pgjobs leader scheduler: {role}, lease ttl "
                f"{self.settings.lease_ttl:g}s, schema {self.db.schema}, "
                f"{len(self.static)} static entries")

    def now(self) -> datetime:
        if self._clock is not None:
            return self._clock()
        offset = self.elector.offset if self.elector else 0.0
        return datetime.now(UTC) + timedelta(seconds=offset)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self.db.connect()
        return self._conn

    def _load(self, lease: Lease) -> None:
        entries: dict[str, Loaded] = {}
        default_tz = str(self.app.conf.timezone or "UTC")
        for row in self.store.load(self._connection()):
            try:  # a stored entry is checked as `pgjobs schedule add` checks it
                validate_entry(row)
                rec = recurrence(row.schedule, row.timezone or default_tz, self.app)
            except PgJobsError as exc:  # a row written by hand: say so, fire the rest
                log_event("pgjobs.schedule.invalid", logging.ERROR, entry=row.name,
                          error=one_line(exc))
                continue
            entries[row.name] = Loaded(row, rec, row.watermark)
        self._entries = entries
        self._version = lease.version

    # -- the loop ------------------------------------------------------------------------
    def tick(self, *args: Any, **kwargs: Any) -> float:
        assert self.elector is not None
        idle = self.elector.interval
        lease = self.elector.current()
        if lease is None or not lease.leading:
            # _term is kept: leading again in the same term means nobody else led meanwhile
            return idle
        try:
            if lease.term != self._term:
                self.store.sync_static(self._connection(), self.holder, lease.term,
                                       self.static)
                self._load(lease)
                self._term = lease.term
            elif lease.version != self._version:
                self._load(lease)
            if time.monotonic() >= self._next_prune:
                self._next_prune = time.monotonic() + 3600.0
                self.store.prune_history(self._connection(), self.settings.history_days)
            return self._fire_due(lease, idle)
        except Exception as exc:  # the database, the broker, an entry: never kill beat
            log_event("pgjobs.schedule.failed", error=one_line(exc))
            if self._conn is not None and (self._conn.closed or self._conn.broken):
                self._conn = None
            self._term = None  # reload everything next time
            return idle

    def _fire_due(self, lease: Lease, idle: float) -> float:
        now = self.now()
        wake = now + timedelta(seconds=idle)
        for name, entry in list(self._entries.items()):
            if entry.row.paused or time.monotonic() < entry.retry_at:
                continue
            try:
                due = self._fire_entry(lease, entry, now)
            except Exception as exc:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    raise  # the connection: the whole round fails (tick)
                # this entry's mistake (a message it cannot send): the others go on
                entry.retry_at = time.monotonic() + ENTRY_RETRY_SECONDS
                log_event("pgjobs.schedule.failed", entry=name, error=one_line(exc),
                          retry_in=ENTRY_RETRY_SECONDS)
                continue
            if due is None:
                self._term = None  # fenced: reload (or step down) before firing again
                return min(0.25, idle)
            wake = min(wake, due)
        return max(0.0, min((wake - self.now()).total_seconds(), idle))

    def _fire_entry(self, lease: Lease, entry: Loaded, now: datetime) -> datetime | None:
        """Fire what is due for one entry; its next due time, or None when a fire was
        fenced."""
        plan = catch_up_plan(entry.rec, entry.watermark, entry.row.anchor, now,
                             policy=entry.row.catch_up, cap=entry.row.catch_up_max,
                             grace=self.settings.grace,
                             latest=bool(entry.row.options.get("pgjobs_catch_up_latest", True)))
        name = entry.row.name
        if plan.skipped is not None:  # not walked again next tick
            entry.watermark, entry.carried = plan.skipped[0], entry.carried + plan.skipped[1]
            log_event("pgjobs.schedule.missed", entry=name, count=plan.skipped[1],
                      policy=entry.row.catch_up)
        for i, (occurrence, watermark, missed) in enumerate(plan.fires):
            if missed:  # (the carried ones were logged when they were skipped)
                log_event("pgjobs.schedule.missed", entry=name, count=missed,
                          policy=entry.row.catch_up)
            missed += entry.carried if i == 0 else 0
            if not self._fire(lease, entry, occurrence, watermark, missed):
                return None
            entry.watermark, entry.carried = watermark, 0
        return plan.next_due

    def _send(self, row: EntryRow, headers: dict[str, Any]) -> Any:
        options = {k: v for k, v in row.options.items() if not k.startswith("pgjobs_")}
        options["headers"] = {**(options.get("headers") or {}), **headers}
        task = self.app.tasks.get(row.task)
        if task is not None:
            return task.apply_async(row.args, row.kwargs, **options)
        return self.app.send_task(row.task, row.args, row.kwargs, **options)

    def _fire(self, lease: Lease, entry: Loaded, occurrence: datetime, watermark: datetime,
              missed: int) -> bool:
        row = entry.row
        headers = {"celery_beat_task": True, ENTRY_HEADER: row.name,
                   OCCURRENCE_HEADER: occurrence.astimezone(UTC).isoformat(),
                   MISSED_HEADER: missed}
        conn = self._connection()
        fields = {"holder": self.holder, "term": lease.term, "entry": row,
                  "occurrence": occurrence, "watermark": watermark, "missed": missed}
        if self.db.core is not None:
            with capture() as jobs:
                self._send(row, headers)
            if len(jobs) != 1:
                raise InvalidScheduleEntry(
                    f"entry {row.name!r} published {len(jobs)} messages (a fanout exchange?): "
                    "a scheduled entry must route to one queue")
            done = self.store.fire(conn, job=jobs[0], core=self.db.core, **fields)
        elif self.settings.outbox:  # staged in the fire's own transaction: exactly once
            with conn.transaction():
                done = self.store.fire(conn, **fields)
                if done is not None:
                    with outbox_transaction(conn, schema=self.db.schema, app=self.app):
                        self._send(row, headers)
        else:
            done = self.store.fire(conn, **fields)
            if done is not None:
                try:  # after the watermark committed: at most once (docs/scheduler.md)
                    self._send(row, headers)
                except Exception as exc:
                    log_event("pgjobs.schedule.failed", logging.ERROR, entry=row.name,
                              occurrence=occurrence.isoformat(), lost=True,
                              error=one_line(exc))
        if done is None:
            log_event("pgjobs.schedule.fenced", entry=row.name, term=lease.term,
                      occurrence=occurrence.isoformat())
            return False
        log.info("Scheduler: Sending due task %s (%s) for %s", row.name, row.task,
                 occurrence.isoformat())
        return True

    def sync(self) -> None:
        pass

    def close(self) -> None:
        if self.elector is not None:
            self.elector.stop()
        _close(self._conn)
        self._conn = None
        super().close()
