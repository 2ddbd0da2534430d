"""When a scheduled entry is due: intervals, crontab text, time zones, DST and catch-up.

Pure functions, no database and no Celery: the ``pgjobs schedule add`` command validates an
entry with them, and the scheduler (celery_ext.scheduler) computes occurrences with them, so a
text accepted by one is understood the same way by the other.

Occurrences are instants (aware UTC datetimes):

* ``every N`` seconds: ``anchor + k * N`` for k >= 1. The anchor is stored with the entry, so
  every replica (and every leader after a failover) computes the same grid.
* crontab ``minute hour day-of-month month day-of-week`` in the entry's time zone, as Celery's
  ``crontab`` reads it (day of week 0 or 7 = Sunday, names ``mon``/``jan``; day of month AND day
  of week must both match). Wall times are turned into instants with :mod:`zoneinfo`:

  - **spring forward** (a wall time that does not exist that day): it fires once, at the first
    instant after the gap (02:30 in New York on the change day fires at 03:00 EDT); several
    skipped wall times collapse into that one instant.
  - **fall back** (a wall time that happens twice): an entry with a fixed hour fires once, on
    the first pass; an entry whose hour field is ``*`` follows real time and fires on both passes
    (Vixie cron's rule).
* ``solar EVENT LAT LON``: only checked here (event name, coordinates); celery_ext computes
  its occurrences with Celery's ``solar`` (``ephem``), which kombu_pgjobs does not import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .errors import InvalidCatchUp, InvalidSchedule, UnknownTimezone

__all__ = ["CATCH_UP", "SOLAR_EVENTS", "Cron", "Every", "Occurrences", "Plan", "Recurrence",
           "Solar", "catch_up_plan", "check_catch_up", "parse_schedule", "walk", "zone"]

UTC = timezone.utc
#: catch-up policies after downtime (see :func:`catch_up_plan`)
CATCH_UP = ("skip", "once", "all")
#: cap of ``all`` when the entry does not say
DEFAULT_CATCH_UP_MAX = 100
_MAX_INTERVAL = 366 * 86400.0
_MIN_INTERVAL = 0.001
#: years searched for the next match of a crontab (Feb 29 on a Monday needs 28)
_SEARCH_YEARS = 30

_MONTHS = {m: i for i, m in enumerate(
    "jan feb mar apr may jun jul aug sep oct nov dec".split(), start=1)}
_DAYS = {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())}


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name`` or UnknownTimezone (PGJ-602)."""
    if not isinstance(name, str) or not name or "\x00" in name or len(name) > 64:
        raise UnknownTimezone(f"time zone {name!r} is not an IANA time zone name")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise UnknownTimezone(
            f"unknown time zone {name!r}: use an IANA name such as 'Europe/Paris' or "
            "'UTC'") from None


def check_catch_up(policy: object, cap: object = DEFAULT_CATCH_UP_MAX) -> tuple[str, int]:
    """A valid (policy, cap) or InvalidCatchUp (PGJ-603)."""
    if policy not in CATCH_UP:
        raise InvalidCatchUp(
            f"unknown catch-up policy {policy!r}: use one of {', '.join(CATCH_UP)}")
    if isinstance(cap, bool) or not isinstance(cap, int) or not 1 <= cap <= 10_000:
        raise InvalidCatchUp(f"catch-up cap must be a whole number in 1-10000, got {cap!r}")
    return str(policy), cap


@dataclass(frozen=True, slots=True)
class Every:
    """Every ``seconds``, on the grid of the entry's anchor."""

    seconds: float

    @property
    def text(self) -> str:
        return f"every {self.seconds:g}s"

    def next_after(self, after: datetime, anchor: datetime) -> datetime:
        elapsed = (after - anchor).total_seconds()
        k = max(1, math.floor(elapsed / self.seconds) + 1)
        nxt = anchor + timedelta(seconds=k * self.seconds)
        while nxt <= after:  # float rounding at the boundary
            k += 1
            nxt = anchor + timedelta(seconds=k * self.seconds)
        return nxt

    def count_between(self, after: datetime, until: datetime, anchor: datetime) -> int:
        """Occurrences in (after, until]."""
        if until <= after:
            return 0
        first = self.next_after(after, anchor)
        if first > until:
            return 0
        return int((until - first).total_seconds() // self.seconds) + 1

    def last_at_or_before(self, until: datetime, anchor: datetime) -> datetime | None:
        k = math.floor((until - anchor).total_seconds() / self.seconds)
        return anchor + timedelta(seconds=k * self.seconds) if k >= 1 else None


@dataclass(frozen=True, slots=True)
class Cron:
    """A crontab in a time zone. Fields are the sets of values each one matches."""

    minute: frozenset[int]
    hour: frozenset[int]
    day_of_month: frozenset[int]
    month: frozenset[int]
    day_of_week: frozenset[int]  # 0 = Sunday
    tz: str
    text: str
    #: the hour field is "*": the repeated fall-back hour fires on both passes
    every_hour: bool

    def _wall_times(self, start: datetime) -> Iterator[datetime]:
        """Matching wall times from ``start`` (naive local) on, in order."""
        day = start.date()
        end = day + timedelta(days=366 * _SEARCH_YEARS)
        hours = sorted(self.hour)
        minutes = sorted(self.minute)
        while day <= end:
            if day.month in self.month and day.day in self.day_of_month and \
                    (day.isoweekday() % 7) in self.day_of_week:
                first_day = day == start.date()
                for h in hours:
                    if first_day and h < start.hour:
                        continue
                    for m in minutes:
                        wall = datetime(day.year, day.month, day.day, h, m)
                        if wall >= start:
                            yield wall
            day += timedelta(days=1)

    def instants(self, wall: datetime) -> list[datetime]:
        """The instants (UTC) a matching wall time fires at: one, two on the repeated
        fall-back hour for an every-hour entry, or the end of the gap on spring forward."""
        tz = zone(self.tz)
        first = wall.replace(tzinfo=tz, fold=0)
        second = wall.replace(tzinfo=tz, fold=1)
        u0, u1 = first.astimezone(UTC), second.astimezone(UTC)
        if u0.astimezone(tz).replace(tzinfo=None) != wall:  # does not exist: the gap
            t = min(u0, u1)
            while t.astimezone(tz).replace(tzinfo=None) < wall:
                t += timedelta(minutes=1)
            end = t.replace(second=0, microsecond=0)
            # the first instant whose wall time is past the gap: a whole minute after the jump
            while (end - timedelta(minutes=1)).astimezone(tz).replace(tzinfo=None) > wall:
                end -= timedelta(minutes=1)
            return [end]
        if u0 != u1:  # the repeated hour
            return [u0, u1] if self.every_hour else [u0]
        return [u0]

    def next_after(self, after: datetime, anchor: datetime | None = None) -> datetime:
        tz = zone(self.tz)
        aware = after.astimezone(tz)
        local = aware.replace(tzinfo=None, second=0, microsecond=0)
        if aware.fold == 0 and local.replace(tzinfo=tz, fold=1).utcoffset() != \
                aware.utcoffset():
            # on the first pass of a repeated hour: the second pass of the wall times before
            # this one is still ahead
            local -= timedelta(hours=2)
        # A wall time before ``local`` fires no later than ``after`` (a gap's wall times fire
        # at its end, which is no later than the first wall time after the gap). Instants
        # follow wall order except in the repeated fall-back hour, where a later wall time's
        # first pass comes before an earlier one's second: there, look on to the hour's end.
        best: datetime | None = None
        horizon: datetime | None = None
        for wall in self._wall_times(local):
            if horizon is not None and wall > horizon:
                break
            instants = self.instants(wall)
            for instant in instants:
                if instant > after and (best is None or instant < best):
                    best = instant
            if best is not None and horizon is None:
                repeated = wall.replace(tzinfo=tz, fold=0).utcoffset() != \
                    wall.replace(tzinfo=tz, fold=1).utcoffset()
                if not repeated:
                    return best
                horizon = wall + timedelta(hours=2)  # no zone repeats more than that
        if best is not None:
            return best
        raise InvalidSchedule(f"crontab {self.text!r} never matches a real date")

    def occurrences(self, after: datetime, until: datetime, limit: int) -> list[datetime]:
        return walk(self, after, until, limit)


def walk(rec: Cron | Occurrences, after: datetime, until: datetime,
         limit: int) -> list[datetime]:
    """Up to ``limit`` occurrences of ``rec`` in (after, until], oldest first."""
    found: list[datetime] = []
    t = after
    while len(found) < limit:
        t = rec.next_after(t, after)
        if t > until:
            break
        found.append(t)
    return found


#: solar events, as Celery's ``solar`` schedule names them
SOLAR_EVENTS = ("dawn_astronomical", "dawn_nautical", "dawn_civil", "sunrise", "solar_noon",
                "sunset", "dusk_civil", "dusk_nautical", "dusk_astronomical")


@dataclass(frozen=True, slots=True)
class Solar:
    """``solar EVENT LATITUDE LONGITUDE``: a solar event at a place. Only its definition lives
    here (checked without Celery); celery_ext computes its occurrences with Celery's ``solar``
    (which needs ``ephem``)."""

    event: str
    lat: float
    lon: float

    @property
    def text(self) -> str:
        return f"solar {self.event} {self.lat:g} {self.lon:g}"

    def next_after(self, after: datetime, anchor: datetime | None = None) -> datetime:
        raise InvalidSchedule(f"{self.text}: solar occurrences are computed by "
                              "celery_ext.scheduler (Celery's solar, with ephem installed)")


class Occurrences(Protocol):
    """What catch-up planning needs of a schedule besides intervals and crontabs."""

    text: str

    def next_after(self, after: datetime, anchor: datetime) -> datetime: ...

    def occurrences(self, after: datetime, until: datetime, limit: int) -> list[datetime]: ...


Recurrence = Every | Cron | Occurrences


def parse_solar(text: str) -> Solar:
    """``solar EVENT LATITUDE LONGITUDE`` or InvalidSchedule (PGJ-601)."""
    parts = text.split()
    if len(parts) != 4 or parts[0].lower() != "solar":
        raise InvalidSchedule(f"invalid solar schedule {text!r}: expected 'solar EVENT "
                              "LATITUDE LONGITUDE' (e.g. 'solar sunset 48.85 2.35')")
    event = parts[1].lower()
    if event not in SOLAR_EVENTS:
        raise InvalidSchedule(f"unknown solar event {parts[1]!r}: use one of "
                              f"{', '.join(SOLAR_EVENTS)}")
    try:
        lat, lon = float(parts[2]), float(parts[3])
    except ValueError:
        raise InvalidSchedule(f"solar latitude and longitude must be numbers: {text!r}"
                              ) from None
    if not (math.isfinite(lat) and -90 <= lat <= 90):
        raise InvalidSchedule(f"solar latitude must be in -90..90, got {parts[2]}")
    if not (math.isfinite(lon) and -180 <= lon <= 180):
        raise InvalidSchedule(f"solar longitude must be in -180..180, got {parts[3]}")
    return Solar(event, lat, lon)


def _field(text: str, what: str, low: int, high: int,
           names: dict[str, int] | None = None) -> frozenset[int]:
    """One crontab field: ``*``, ``*/n``, ``a``, ``a-b``, ``a-b/n``, comma-separated."""
    values: set[int] = set()

    def number(tok: str) -> int:
        tok = tok.strip().lower()
        if names and tok[:3] in names and tok.isalpha():
            return names[tok[:3]]
        if not tok.isdigit():
            raise InvalidSchedule(f"crontab {what} field: {tok!r} is not a number")
        n = int(tok)
        top = 7 if what == "day-of-week" else high
        if not low <= n <= top:
            raise InvalidSchedule(f"crontab {what} field: {n} is outside {low}-{top}")
        return n

    for part in text.split(","):
        part = part.strip()
        if not part:
            raise InvalidSchedule(f"crontab {what} field {text!r} has an empty item")
        step = 1
        if "/" in part:
            part, _, raw_step = part.partition("/")
            if not raw_step.isdigit() or int(raw_step) < 1:
                raise InvalidSchedule(f"crontab {what} field: step {raw_step!r} must be a "
                                      "positive whole number")
            step = int(raw_step)
        if part == "*":
            start, stop = low, high
        elif "-" in part:
            a, _, b = part.partition("-")
            start, stop = number(a), number(b)
            if stop < start:
                raise InvalidSchedule(f"crontab {what} field: range {part!r} runs backwards")
        else:
            start = number(part)
            stop = high if step > 1 else start
        values.update(range(start, stop + 1, step))
    if what == "day-of-week" and 7 in values:
        values.discard(7)
        values.add(0)
    return frozenset(values)


_CRON_CHARS = re.compile(r"^[0-9a-zA-Z*/,\- ]+$")


def parse_cron(text: str, tz: str) -> Cron:
    """``minute hour day-of-month month day-of-week`` or InvalidSchedule (PGJ-601)."""
    zone(tz)
    if not isinstance(text, str) or not _CRON_CHARS.match(text):
        raise InvalidSchedule(f"invalid crontab text {text!r}: expected five fields "
                              "'minute hour day-of-month month day-of-week' (e.g. '*/5 * * * *')")
    parts = text.split()
    if len(parts) != 5:
        raise InvalidSchedule(f"invalid crontab text {text!r}: expected five fields "
                              "'minute hour day-of-month month day-of-week', got "
                              f"{len(parts)}")
    cron = Cron(
        _field(parts[0], "minute", 0, 59), _field(parts[1], "hour", 0, 23),
        _field(parts[2], "day-of-month", 1, 31), _field(parts[3], "month", 1, 12, _MONTHS),
        _field(parts[4], "day-of-week", 0, 6, _DAYS), tz, " ".join(parts), parts[1] == "*")
    cron.next_after(datetime(2000, 1, 1, tzinfo=UTC))  # never matches (Feb 30): refused now
    return cron


def cron_from_sets(minute: set[int], hour: set[int], day_of_month: set[int], month: set[int],
                   day_of_week: set[int], tz: str, text: str) -> Cron:
    """A Cron from the value sets another parser (Celery's crontab) already expanded."""
    zone(tz)
    cron = Cron(frozenset(minute), frozenset(hour), frozenset(day_of_month),
                frozenset(month), frozenset(d % 7 for d in day_of_week), tz, text,
                set(hour) == set(range(24)))
    cron.next_after(datetime(2000, 1, 1, tzinfo=UTC))
    return cron


def every(seconds: object) -> Every:
    """An interval of at least a millisecond (issue 28): a finer grid is more occurrences
    than fires (a statement and a publish each) can keep up with, so the entry would fire at
    every tick and fall ever further behind."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not math.isfinite(seconds) or not _MIN_INTERVAL <= seconds <= _MAX_INTERVAL:
        raise InvalidSchedule(f"interval must be a number of seconds in [{_MIN_INTERVAL:g}, "
                              f"{_MAX_INTERVAL:.0f}] (at least a millisecond), got "
                              f"{seconds!r}")
    return Every(float(seconds))


_EVERY = re.compile(r"^every\s+([0-9.eE+-]+)\s*(s|m|h|d)?$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_schedule(text: str, tz: str = "UTC") -> Recurrence | Solar:
    """``every 30s`` / ``every 5m`` / ``every 1.5h``, crontab text (in ``tz``), or
    ``solar EVENT LAT LON`` (a :class:`Solar` definition: celery_ext computes it).

    Raises InvalidSchedule (PGJ-601) or UnknownTimezone (PGJ-602)."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidSchedule("empty schedule: give 'every 30s' or crontab text such as "
                              "'*/5 * * * *'")
    if text.strip().lower().startswith("solar"):
        return parse_solar(text)
    m = _EVERY.match(text.strip().lower())
    if m:
        try:
            value = float(m.group(1))
        except ValueError:
            raise InvalidSchedule(f"invalid interval {text!r}") from None
        return every(value * _UNITS[m.group(2)])
    return parse_cron(text, tz)


@dataclass(frozen=True, slots=True)
class Plan:
    """What to fire now for one entry: each (occurrence, watermark, missed) in order.

    ``occurrence`` is what the message says it is for; the watermark (the latest occurrence
    accounted for) moves to ``watermark``; ``missed`` counts occurrences skipped for it."""

    fires: list[tuple[datetime, datetime, int]]
    #: the next occurrence after what this plan fires
    next_due: datetime
    #: (latest, count) of missed occurrences skipped without a fire now (``skip`` without
    #: ``latest``): the caller may plan from ``latest`` next time instead of walking them
    #: again, and report ``count`` with the next fire
    skipped: tuple[datetime, int] | None = None


def _missed(rec: Recurrence, watermark: datetime, anchor: datetime, until: datetime,
            policy: str, cap: int) -> tuple[int, list[datetime], datetime]:
    """The occurrences in (watermark, until]: how many, the ones ``policy`` fires, the latest.
    Intervals are counted arithmetically (a month down on a 1-second entry costs nothing); a
    crontab is walked, up to 100,000 occurrences."""
    if isinstance(rec, Every):
        n = rec.count_between(watermark, until, anchor)
        last = rec.last_at_or_before(until, anchor)
        assert last is not None  # n >= 1: the caller saw the first one
        first = rec.next_after(watermark, anchor)
        every_ = timedelta(seconds=rec.seconds)
        newest = [last - every_ * i for i in range(min(n, cap) - 1, -1, -1)]
    else:
        window = rec.occurrences(watermark, until, 100_000)
        n, first, last, newest = len(window), window[0], window[-1], window[-cap:]
    chosen = newest if policy == "all" else [first] if policy == "once" else [last]
    return n, chosen, last


def catch_up_plan(rec: Recurrence, watermark: datetime, anchor: datetime, now: datetime, *,
                  policy: str, cap: int, grace: float, latest: bool = True) -> Plan:
    """The fires due at ``now`` for an entry whose last accounted occurrence is ``watermark``.

    An occurrence at most ``grace`` seconds old is on time and fires whatever the policy (up to
    ``cap`` of them). Older ones were missed (the scheduler was down, or had no leader):

    * ``skip``: none of them fires, except the latest when ``latest`` (the default; what
      celery beat does after downtime) and nothing on time fires now; otherwise the first
      on-time fire carries their count;
    * ``once``: one run for all of them, for the first missed occurrence, with the count;
    * ``all``: every one, oldest first, at most ``cap`` (the newest ``cap``; the older are
      counted in the first fire's ``missed``).
    """
    first = rec.next_after(watermark, anchor)
    if first > now:
        return Plan([], first)
    missed_until = now - timedelta(seconds=grace) - timedelta(microseconds=1)
    n_missed, chosen, last_missed = (0, [], watermark)
    if first <= missed_until:
        n_missed, chosen, last_missed = _missed(rec, watermark, anchor, missed_until, policy,
                                                cap)
    on_time: list[datetime] = []
    t = max(watermark, missed_until)
    while len(on_time) < cap:
        t = rec.next_after(t, anchor)
        if t > now:
            break
        on_time.append(t)
    fires: list[tuple[datetime, datetime, int]] = []
    carried = 0  # missed occurrences the first on-time fire reports
    if n_missed and policy == "all":
        fires = [(o, o, n_missed - len(chosen) if i == 0 else 0) for i, o in enumerate(chosen)]
    elif n_missed and policy == "once":
        fires = [(chosen[0], last_missed, n_missed)]
    elif n_missed and latest and not on_time:
        fires = [(last_missed, last_missed, n_missed - 1)]
    else:
        carried = n_missed
    fires += [(o, o, carried if i == 0 else 0) for i, o in enumerate(on_time)]
    last_fired = fires[-1][1] if fires else watermark
    skipped = (last_missed, n_missed) if n_missed and not fires else None
    return Plan(fires, rec.next_after(max(last_fired, now), anchor), skipped)
