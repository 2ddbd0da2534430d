"""Operator operations on one pgjobs schema: what the ``pgjobs`` CLI, the metrics exporter and
celery_ext call to look at queues and to pause, requeue, cancel, purge and prune.

Every statement lives in ``sql/admin.sql``. Operations that change rows validate what they were
given first (unknown ids, states or queues raise an error with a stable code, and nothing is
changed), and bulk operations work in bounded batches, each its own short transaction, so an
operator command never holds locks a claim would wait on. Results are plain JSON-ready dicts:
the CLI prints them as tables or, with ``--json``, as they are.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from datetime import date, datetime, timezone
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..errors import (
    BulkRefused,
    InvalidArgument,
    MigrationError,
    NotFound,
    StateConflict,
    UnknownQueue,
    UnknownState,
    UsageError,
)
from ..options import validate_queue_name, validate_schema_name
from .history import outcome_word, record_outcome
from .schema import current_version
from .sql import queries

__all__ = [
    "DEFAULT_BULK_LIMIT",
    "LAST_ERROR_HEADER",
    "LIVE_STATES",
    "MAX_BULK_LIMIT",
    "STATES",
    "TENANT_HEADER",
    "Admin",
    "decode_message",
    "parse_duration",
    "record_dead_letter",
]

#: every state an operator can filter on: four live ones (ready and delayed derived from the
#: due time) and dead
STATES = ("ready", "delayed", "running", "waiting", "dead")
LIVE_STATES = ("ready", "delayed", "running", "waiting")
#: the header a tenant-aware publisher sets; `pgjobs ls --tenant` filters on it
TENANT_HEADER = "x-pgjobs-tenant"
#: the header celery_ext puts on a retry: the error that caused it, shown by `pgjobs show`
LAST_ERROR_HEADER = "x-pgjobs-last-error"
#: schema version the operator statements need (counters, consumers, cancellation)
MIN_SCHEMA_VERSION = 2
DEFAULT_BULK_LIMIT = 1000
MAX_BULK_LIMIT = 100_000
DEFAULT_PAGE = 50
MAX_PAGE = 1000
DEFAULT_BATCH = 1000

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
#: the longest duration an operator may give: a century. Ages are subtracted from now() in
#: Postgres, whose timestamps end in 4713 BC; without a bound ``999999999d`` became a
#: database error (an interval or timestamp out of range) instead of this code.
MAX_DURATION_DAYS = 36500
MAX_DURATION = MAX_DURATION_DAYS * 86400.0
#: the most leases `pgjobs workers` lists per process
MAX_LEASES = 1000


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``1d12h``, ``90m``, ``30s`` or a bare number of seconds -> seconds,
    at most :data:`MAX_DURATION`."""
    raw = str(text).strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", raw):
        seconds = float(raw)
    else:
        parts = _DURATION_PART.findall(raw)
        if not parts or "".join(n + u for n, u in parts) != raw:
            raise InvalidArgument(
                f"duration {text!r} is invalid: use e.g. 7d, 12h, 1d12h, 90m, 30s")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not seconds <= MAX_DURATION:  # also NaN and inf, from digits enough to overflow
        raise InvalidArgument(
            f"duration {text!r} is out of range: at most {MAX_DURATION_DAYS}d")
    return seconds


def _is_duration(text: str) -> bool:
    raw = str(text).strip().lower()
    return bool(re.fullmatch(r"(?:\d+(?:\.\d+)?[smhdw]?)+", raw)) and bool(raw)


def _field(value: Any) -> Any:
    """A header value as Postgres's ``->>`` gives it: a string as is, anything else as its
    JSON text."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"))


def _read_raw(row: dict[str, Any], tenant: str | None) -> bool:
    """Fill ``task_id`` and ``tenant`` of a listed row from its ``raw_message`` (set only for a
    message Postgres cannot parse, see admin_ls) and apply the ``tenant`` filter the SQL left
    to us. False: the row does not match the filter."""
    raw = row.pop("raw_message", None)
    if raw is None:
        return True
    try:
        message = json.loads(raw)
    except ValueError:
        message = None
    headers = message.get("headers") if isinstance(message, dict) else None
    headers = headers if isinstance(headers, dict) else {}
    row["task_id"] = _field(headers.get("id"))
    row["tenant"] = _field(headers.get(TENANT_HEADER))
    return tenant is None or row["tenant"] == tenant


def _page(rows: list[dict[str, Any]], limit: int, tenant: str | None) -> dict[str, Any]:
    """One keyset page from ``limit + 1`` fetched rows. The cursor is the last row fetched
    for the page, kept or not: a row dropped by the tenant filter in Python makes the page
    shorter, never makes the next page skip a row."""
    more = len(rows) > limit
    rows = rows[:limit]
    last = rows[-1]["id"] if rows else None
    kept = [r for r in rows if _read_raw(r, tenant)]
    return {"items": kept, "next": str(last) if more and last is not None else None}


def _printable(value: Any) -> Any:
    """Values Postgres's jsonb refuses, made storable: NUL and lone surrogates become their
    visible escapes (``\\u0000``), in keys and values, and NaN or infinity its name. An error
    recorded for an operator must never be lost because of one character of it."""
    if isinstance(value, str):
        if "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value):
            return "".join(f"\\u{ord(c):04x}" if c == "\x00" or "\ud800" <= c <= "\udfff"
                           else c for c in value)
        return value
    if isinstance(value, Mapping):
        return {_printable(str(k)): _printable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_printable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN or Infinity
    return value


def _iso(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return value


def _row(cursor: psycopg.Cursor[Any], row: Sequence[Any]) -> dict[str, Any]:
    names = [d.name for d in cursor.description or ()]
    return {k: _iso(v) for k, v in zip(names, row, strict=True)}


def parse_ids(ids: Iterable[Any]) -> list[int]:
    out: list[int] = []
    for raw in ids:
        try:
            value = int(str(raw))
        except ValueError:
            raise InvalidArgument(f"message id {raw!r} is not a number") from None
        if value <= 0 or value >= 2**63:
            raise InvalidArgument(f"message id {raw!r} is out of range")
        if value not in out:
            out.append(value)
    if not out:
        raise InvalidArgument("give at least one message id")
    return out


def bulk_limit(limit: int | None) -> int:
    value = DEFAULT_BULK_LIMIT if limit is None else int(limit)
    if not 1 <= value <= MAX_BULK_LIMIT:
        raise BulkRefused(f"--limit must be between 1 and {MAX_BULK_LIMIT}, got {limit}")
    return value


def decode_message(text: str | Mapping[str, Any], *, body: bool = False) -> dict[str, Any]:
    """The parts of a stored kombu message an operator reads: headers, properties, and the
    task's arguments. Only JSON bodies are decoded (never pickle: looking must not execute);
    by default arguments come from Celery's ``argsrepr``/``kwargsrepr`` headers, which an app
    may have masked, and the raw body is decoded only when asked (``body=True``)."""
    message: dict[str, Any] = json.loads(text) if isinstance(text, str) else dict(text)
    headers = dict(message.get("headers") or {})
    props = dict(message.get("properties") or {})
    out: dict[str, Any] = {
        "headers": headers,
        "properties": props,
        "content_type": message.get("content-type"),
        "args": headers.get("argsrepr"),
        "kwargs": headers.get("kwargsrepr"),
    }
    if body:
        raw = message.get("body")
        data: Any = raw
        try:
            if props.get("body_encoding") == "base64" and isinstance(raw, str):
                data = base64.b64decode(raw)
            if message.get("content-type") == "application/json":
                if isinstance(data, bytes):
                    data = data.decode(message.get("content-encoding") or "utf-8")
                decoded = json.loads(data) if isinstance(data, str) else data
                if isinstance(decoded, list) and len(decoded) == 3:  # Celery protocol 2
                    out["body"] = {"args": decoded[0], "kwargs": decoded[1],
                                   "embed": decoded[2]}
                else:
                    out["body"] = decoded
            else:
                size = len(data) if isinstance(data, (bytes, str)) else None
                out["body"] = {"undecoded": message.get("content-type"), "size": size}
        except (ValueError, UnicodeDecodeError) as exc:
            out["body"] = {"undecoded": f"body could not be decoded: {exc}"}
    return out


def record_dead_letter(conn: psycopg.Connection[Any], schema: str, *, queue: str,
                       task: str | None, message: Mapping[str, Any] | str, reason: str,
                       error: Mapping[str, Any] | None, job: tuple[int, int] | None = None,
                       priority: int = 0, attempts: int = 0, max_attempts: int | None = None,
                       shard: str = "", elapsed: float | None = None) -> int:
    """Record a message that failed for good as a dead letter; return its (fresh) id.

    celery_ext calls this from the worker when a task fails for good: Celery settles the
    message itself (an ack), so the dead letter is a copy under a new id from the job id
    sequence, never a second row with the live id (which the transport's own dead-lettering
    would collide with). ``job`` is the delivery's ``(id, claim)``: when the row is still held
    its exact message and attempt count are copied; otherwise ``message`` (rebuilt by the
    caller) is stored. The outcome ``failed`` is told next (:func:`history.record_outcome
    <kombu_pgjobs.store.history.record_outcome>`): the held row's ack counts and records it, or an
    early ack's history row is amended.
    """
    validate_schema_name(schema)
    validate_queue_name(queue)
    text = message if isinstance(message, str) else json.dumps(message, default=str)
    job_id, claim = job if job is not None else (None, None)
    with conn.pipeline():  # the copy and the outcome in one round trip
        cur = conn.execute(queries(schema)["admin_dead_record"], {
            "job_table": f'"{schema}".pgjobs_job', "job_id": job_id, "claim": claim,
            "queue": queue, "priority": priority, "task": task, "attempts": attempts,
            "max_attempts": max_attempts, "reason": reason,
            "error": Jsonb(_printable(error)) if error is not None else None, "message": text,
        })
        record_outcome(conn, schema, job=job, outcome="failed", queue=queue, task=task,
                       elapsed=elapsed,
                       shard=shard or f"celery_ext:{socket.gethostname()}:{os.getpid()}")
        row = cur.fetchone()
    assert row is not None
    return int(row[0])


class Admin:
    """Operator statements on one schema, over one connection (autocommit)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str) -> None:
        self.conn = conn
        self.schema = validate_schema_name(schema)
        self.q = queries(schema)
        self.channel = f"pgjobs.{schema}"
        self.job_table = f'"{schema}".pgjobs_job'
        #: counter shard of operator settles (cancel, purge): one per CLI process
        self.shard = f"pgjobs-cli:{socket.gethostname()}:{os.getpid()}"

    # -- helpers ------------------------------------------------------------------------
    def check_schema(self) -> int:
        """Refuse to run on a schema that is missing or too old, with what to do about it."""
        version = current_version(self.conn, self.schema)
        if version == 0:
            raise MigrationError(
                f"schema {self.schema!r} is not installed in this database: check --schema, "
                "or run `pgjobs migrate`")
        if version < MIN_SCHEMA_VERSION:
            raise MigrationError(
                f"schema {self.schema!r} is at version {version}; operator commands need "
                f"{MIN_SCHEMA_VERSION}: run `pgjobs migrate`")
        return version

    def _one(self, name: str, params: Mapping[str, Any]) -> Any:
        row = self.conn.execute(self.q[name], params).fetchone()
        return row[0] if row else None

    def _dicts(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        cur = self.conn.execute(self.q[name], params)
        return [_row(cur, r) for r in cur.fetchall()]

    def _listing(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A page of admin_ls or admin_dead_ls. The tenant filter parses every message it
        scans; one Postgres cannot parse (a NUL or a lone surrogate in it) fails the statement,
        and only then is it run again carefully (see admin_ls): the common case pays nothing
        for the rare one."""
        try:
            return self._dicts(name, {**params, "careful": False})
        except (psycopg.errors.UntranslatableCharacter,
                psycopg.errors.InvalidTextRepresentation):
            if params.get("tenant") is None:
                raise
            return self._dicts(name, {**params, "careful": True})

    def require_queue(self, queue: str) -> str:
        validate_queue_name(queue)
        if not self._one("admin_queue_known", {"queue": queue}):
            raise UnknownQueue(
                f"queue {queue!r} is unknown: it is not declared and holds no messages or "
                "dead letters (see `pgjobs queues`)")
        return queue

    def cutoff(self, seconds: float) -> datetime:
        """now() - seconds on the database's clock."""
        return self._one("admin_cutoff", {"seconds": float(seconds)})

    def time_arg(self, text: str | None) -> datetime | None:
        """An ISO 8601 timestamp, or a duration meaning that long ago (``2h``)."""
        if text is None:
            return None
        if _is_duration(text):
            return self.cutoff(parse_duration(text))  # out of range: PGJ-405, not "a time"
        try:
            value = datetime.fromisoformat(str(text).replace("Z", "+00:00"))
        except ValueError:
            raise InvalidArgument(
                f"time {text!r} is invalid: use ISO 8601 (2024-05-01T12:00:00Z) or a "
                "duration ago (2h, 7d)") from None
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)

    def _locate(self, ids: list[int], *, prefer: str = "job") -> dict[int, tuple[str, str]]:
        """id -> (place, state) for every id, or NotFound naming the missing ones. An id both
        live and dead (a dead letter whose id a live row took) resolves to ``prefer``."""
        rows = self.conn.execute(self.q["admin_locate"], {"ids": ids}).fetchall()
        found: dict[int, tuple[str, str]] = {}
        for job_id, place, state in rows:
            if int(job_id) not in found or place == prefer:
                found[int(job_id)] = (place, state)
        missing = [i for i in ids if i not in found]
        if missing:
            raise NotFound(f"no message or dead letter with id {', '.join(map(str, missing))}")
        return found

    # -- looking ------------------------------------------------------------------------
    def queues(self, queue: str | None = None, *, minutes: int = 5,
               bound: int | None = None) -> list[dict[str, Any]]:
        """Per queue counts, exact; with ``bound``, every count of every queue read from an
        index and cut at ``bound + 1`` (meaning "more than bound"): a bounded read on a table
        of any size (the dashboard's overview)."""
        if not 1 <= int(minutes) <= 1440:
            raise InvalidArgument(f"--minutes must be between 1 and 1440, got {minutes}")
        if bound is not None:
            if queue is not None or not 1 <= int(bound) <= MAX_BULK_LIMIT:
                raise InvalidArgument(f"bound must be between 1 and {MAX_BULK_LIMIT} and "
                                      "for every queue")
            rows = self._dicts("admin_queue_stats_bounded", {"bound": int(bound)})
            series = self.throughput(minutes=int(minutes))
            for r in rows:
                r["settled"] = {outcome: sum(ns) for outcome, ns
                                in series.get(r["queue"], {}).items()}
        else:
            if queue is not None:
                self.require_queue(queue)
            rows = self._dicts("admin_queue_stats", {"queue": queue, "minutes": int(minutes)})
        for r in rows:
            settled: dict[str, int] = {}
            for k, v in (r.pop("settled") or {}).items():
                settled[outcome_word(k)] = settled.get(outcome_word(k), 0) + int(v)
            r["settled"] = settled
            r["completed_per_minute"] = round(settled.get("completed", 0) / minutes, 3)
            r["minutes"] = int(minutes)
        return rows

    def ls(self, *, states: Sequence[str] | None = None, queue: str | None = None,
           task: str | None = None, tenant: str | None = None,
           created_after: str | None = None, created_before: str | None = None,
           after: str | int | None = None, limit: int = DEFAULT_PAGE) -> dict[str, Any]:
        wanted = list(states) if states else list(LIVE_STATES)
        bad = [s for s in wanted if s not in STATES]
        if bad:
            raise UnknownState(
                f"unknown state {', '.join(map(repr, bad))}: use {', '.join(STATES)}")
        if not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_PAGE}, got {limit}")
        if queue is not None:
            self.require_queue(queue)
        cursor = 0 if after in (None, "") else parse_ids([after])[0]
        rows = self._listing("admin_ls", {
            "states": wanted, "every_live": set(LIVE_STATES) <= set(wanted),
            "one_state": wanted[0] if wanted in (["running"], ["waiting"]) else None,
            "any_live": bool(set(LIVE_STATES) & set(wanted)),
            "queue": queue, "task": task, "tenant": tenant,
            "created_after": self.time_arg(created_after),
            "created_before": self.time_arg(created_before),
            "after": cursor, "limit": int(limit) + 1})
        return _page(rows, int(limit), tenant)

    def show(self, job_id: str | int, *, body: bool = False) -> dict[str, Any]:
        (ident,) = parse_ids([job_id])
        cur = self.conn.execute(self.q["admin_job_get"], {"id": ident})
        row = cur.fetchone()
        if row is None:
            cur = self.conn.execute(self.q["admin_dead_get"], {"id": ident})
            row = cur.fetchone()
        if row is None:
            raise NotFound(f"no message or dead letter with id {ident}")
        out = _row(cur, row)
        decoded = decode_message(out.pop("message"), body=body)
        out.update(decoded)
        out["task_id"] = decoded["headers"].get("id")
        out["tenant"] = decoded["headers"].get(TENANT_HEADER)
        out["retries"] = decoded["headers"].get("retries")
        if out["state"] == "dead":
            out["last_error"] = out.get("error")
        else:
            out["last_error"] = decoded["headers"].get(LAST_ERROR_HEADER)
        return out

    def dead_ls(self, *, queue: str | None = None, task: str | None = None,
                reason: str | None = None, tenant: str | None = None,
                after: str | int | None = None, limit: int = DEFAULT_PAGE) -> dict[str, Any]:
        if not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_PAGE}, got {limit}")
        if queue is not None:
            self.require_queue(queue)
        cursor = 0 if after in (None, "") else parse_ids([after])[0]
        rows = self._listing("admin_dead_ls", {
            "queue": queue, "task": task, "reason": reason, "tenant": tenant,
            "after": cursor, "limit": int(limit) + 1})
        return _page(rows, int(limit), tenant)

    def dead_show(self, job_id: str | int, *, body: bool = False) -> dict[str, Any]:
        (ident,) = parse_ids([job_id])
        if not self.conn.execute(self.q["admin_dead_get"], {"id": ident}).fetchone():
            raise NotFound(f"no dead letter with id {ident} (`pgjobs show {ident}` looks at "
                           "live messages too)")
        return self.show(ident, body=body)

    def limits(self, *, prefix: str | None = None, limit: int = DEFAULT_PAGE,
               bound: int | None = None) -> dict[str, Any]:
        """Concurrency keys (held slots, cap, holders, parked messages) and rate windows.
        ``bound``: parked messages read per key (``waiting`` is then at most ``bound + 1``:
        "at least"); None counts them all."""
        if not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_PAGE}, got {limit}")
        params = {"prefix": prefix or None, "limit": int(limit),
                  "bound": None if bound is None else int(bound)}
        return {"keys": self._dicts("admin_limits", params),
                "rates": self._dicts("admin_rates", params)}

    def workers(self, *, leases: int = 20) -> list[dict[str, Any]]:
        if not 0 <= int(leases) <= MAX_LEASES:  # 0: counts only (the metrics exporter)
            raise InvalidArgument(f"--leases must be between 0 and {MAX_LEASES}, got {leases}")
        return self._dicts("admin_workers", {"leases": int(leases)})

    def counter_totals(self) -> list[dict[str, Any]]:
        totals: dict[tuple[str, str], int] = {}
        for r in self._dicts("admin_counter_totals", {}):
            key = (r["queue"], outcome_word(r["outcome"]))
            totals[key] = totals.get(key, 0) + int(r["n"])
        return [{"queue": q, "outcome": o, "n": n} for (q, o), n in totals.items()]

    def tenant_stats(self, top: int) -> list[dict[str, Any]]:
        """The ``top`` tenants with the most live messages, by state; each row also says how
        many tenants have live messages (``tenants``)."""
        if not 1 <= int(top) <= MAX_PAGE:
            raise InvalidArgument(f"--tenants must be between 0 and {MAX_PAGE}, got {top}")
        return self._dicts("admin_tenant_stats", {"top": int(top)})

    def tenants(self, *, after: str | None = None, limit: int = DEFAULT_PAGE,
                bound: int = 1000) -> dict[str, Any]:
        """A page of the tenants with live messages, in name order, with their live messages
        by state counted up to ``bound`` (``more``: at least that many). Bounded on any table
        size (see admin_tenants)."""
        if not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_PAGE}, got {limit}")
        rows = self._dicts("admin_tenants", {"after": after or "", "limit": int(limit) + 1,
                                             "bound": int(bound)})
        more = len(rows) > int(limit)
        rows = rows[:int(limit)]
        for r in rows:
            r["more"] = r["live"] > bound
        return {"items": rows, "next": rows[-1]["tenant"] if more else None}

    def throughput(self, *, minutes: int = 30) -> dict[str, dict[str, list[int]]]:
        """Settles per minute over the last ``minutes``: {queue: {outcome: [n, ...]}}, oldest
        minute first, the current (partial) minute last; minutes without settles are 0."""
        if not 1 <= int(minutes) <= 1440:
            raise InvalidArgument(f"minutes must be between 1 and 1440, got {minutes}")
        out: dict[str, dict[str, list[int]]] = {}
        for r in self._dicts("admin_counter_series", {"minutes": int(minutes)}):
            series = out.setdefault(r["queue"], {}).setdefault(outcome_word(r["outcome"]),
                                                              [0] * minutes)
            if 0 <= r["ago"] < minutes:
                series[minutes - 1 - r["ago"]] += int(r["n"])
        return out

    # -- changing -----------------------------------------------------------------------
    def dead_requeue(self, ids: Sequence[Any] | None = None, *, queue: str | None = None,
                     reason: str | None = None, limit: int | None = None,
                     tenant: str | None = None, task: str | None = None) -> dict[str, Any]:
        """Dead letters back to ready: by id (all must be dead letters), or every one of a
        queue, a Celery task and/or a tenant (tenant-scoped replay: its ``x-pgjobs-tenant``
        header), optionally of one ``reason``, at most
        ``limit`` per call (the result says how many remain). A dead letter whose idempotency
        key a live message holds stays dead (by id: reported as skipped)."""
        if ids:
            wanted = parse_ids(ids)
            with self.conn.transaction():
                found = self._locate(wanted, prefer="dead")
                live = [i for i in wanted if found[i][0] != "dead"]
                if live:
                    raise NotFound(
                        f"id {', '.join(map(str, live))} is not a dead letter (it is "
                        f"{found[live[0]][1]}): `pgjobs requeue` handles live messages")
                rows = self._dicts("admin_dead_requeue", {
                    "ids": wanted, "queue": None, "reason": None, "limit": len(wanted),
                    "tenant": None, "task": None, "job_table": self.job_table,
                    "channel": self.channel})
            skipped = sorted(set(wanted) - {r["id"] for r in rows})
            return {"requeued": [{k: r[k] for k in ("id", "new_id", "queue")} for r in rows],
                    "skipped": skipped, "remaining": len(skipped)}
        if queue is None and tenant is None and task is None:
            raise BulkRefused("requeue --all needs --queue, --task or --tenant: bulk requeues "
                              "go one queue, task or tenant at a time")
        if queue is not None:
            self.require_queue(queue)
        bound = bulk_limit(limit)
        rows = self._dicts("admin_dead_requeue", {
            "ids": None, "queue": queue, "reason": reason, "limit": bound, "tenant": tenant,
            "task": task, "job_table": self.job_table, "channel": self.channel})
        remaining = self._one("admin_dead_count", {
            "ids": None, "queue": queue, "reason": reason, "cutoff": None, "tenant": tenant,
            "task": task})
        return {"requeued": [{k: r[k] for k in ("id", "new_id", "queue")} for r in rows],
                "skipped": [], "remaining": int(remaining)}

    def requeue(self, ids: Sequence[Any]) -> dict[str, Any]:
        """Put messages back to run now: a dead letter goes back to ready, a delayed message
        becomes due, a ready one is left as it is. A running message is refused (its holder
        may still finish it): wait, or cancel it."""
        wanted = parse_ids(ids)
        with self.conn.transaction():
            found = self._locate(wanted)
            running = [i for i in wanted if found[i][1] == "running"]
            if running:
                raise StateConflict(
                    f"message {', '.join(map(str, running))} is running: wait for it to finish "
                    "or its lease to lapse, or cancel it with `pgjobs cancel`")
            dead = [i for i in wanted if found[i][0] == "dead"]
            delayed = [i for i in wanted if found[i][1] == "delayed"]
            revived: list[dict[str, Any]] = []
            if dead:
                revived = self._dicts("admin_dead_requeue", {
                    "ids": dead, "queue": None, "reason": None, "limit": len(dead),
                    "tenant": None, "task": None, "job_table": self.job_table,
                    "channel": self.channel})
            due = self._dicts("admin_job_make_due", {"ids": delayed, "channel": self.channel}) \
                if delayed else []
        return {
            "requeued": [{k: r[k] for k in ("id", "new_id", "queue")} for r in revived],
            "made_due": [r["id"] for r in due],
            "unchanged": [i for i in wanted if found[i][1] in ("ready", "waiting")],
        }

    def cancel(self, ids: Sequence[Any], *, task_ids: Sequence[str] = ()) -> dict[str, Any]:
        """Cancel messages by id and/or by Celery task id (``--task-id``: a delayed message
        is found through ``pgjobs_job_delayed_task_id_idx``; see :mod:`kombu_pgjobs.store.revoke`).
        Queued ones go to the dead letters as ``cancelled``; running ones are marked, and their
        holders end the runs (admin_cancel). Returns the ids ``cancelled`` and ``marked``, and
        ``by_task``: the id of each task id given."""
        wanted = parse_ids(ids) if ids else []
        by_task: dict[str, int] = {}
        if task_ids:
            found_ids = self.conn.execute(self.q["revoke_find"], {
                "task_ids": list(task_ids)}).fetchall()
            by_task = {r[1]: int(r[0]) for r in found_ids}
            missing = sorted(set(task_ids) - {r[1] for r in found_ids})
            if missing:
                raise NotFound(f"no live message with Celery task id {', '.join(missing)} "
                               "(already run, or a dead letter: `pgjobs dead ls`)")
            wanted += [int(r[0]) for r in found_ids if int(r[0]) not in wanted]
        if not wanted:
            raise UsageError("name the messages to cancel: IDs, or --task-id ID")
        with self.conn.transaction():
            found = self._locate(wanted)
            dead = [i for i in wanted if found[i][0] == "dead"]
            if dead:
                raise NotFound(
                    f"id {', '.join(map(str, dead))} is a dead letter, not a live message: "
                    "`pgjobs dead purge ID` deletes it")
            rows = self.conn.execute(self.q["admin_cancel"], {
                "ids": wanted, "shard": self.shard, "channel": self.channel}).fetchall()
        return {"cancelled": sorted(r[1] for r in rows if r[0] == "cancelled"),
                "marked": sorted(r[1] for r in rows if r[0] == "marked"),
                "by_task": by_task}

    def purge(self, queue: str, *, limit: int | None = None) -> dict[str, Any]:
        """Delete up to ``limit`` ready, delayed and waiting messages of a queue; running ones
        finish."""
        self.require_queue(queue)
        bound = bulk_limit(limit)
        purged = int(self._one("admin_purge", {
            "queue": queue, "limit": bound, "shard": self.shard}))
        row = self.conn.execute(self.q["admin_queue_remaining"], {"queue": queue}).fetchone()
        ready, running = (int(row[0]), int(row[1])) if row else (0, 0)
        return {"queue": queue, "purged": purged, "remaining": ready, "running": running}

    def pause(self, queue: str, *, paused: bool = True, create: bool = False) -> dict[str, Any]:
        """Pause (or resume) a queue: claims skip it, running messages finish. A queue must be
        known unless ``create`` (pausing ahead of a deploy); resuming wakes its consumers."""
        if create:
            validate_queue_name(queue)
        else:
            self.require_queue(queue)
        row = self.conn.execute(self.q["admin_pause"], {
            "queue": queue, "paused": paused, "channel": self.channel}).fetchone()
        assert row is not None
        return {"queue": row[0], "paused": bool(row[1])}

    def dead_purge(self, ids: Sequence[Any] | None = None, *, queue: str | None = None,
                   reason: str | None = None, older_than: str | None = None,
                   limit: int | None = None, batch: int = DEFAULT_BATCH,
                   dry_run: bool = False) -> dict[str, Any]:
        """Delete dead letters by id, or by age (and queue/reason), in bounded batches."""
        wanted = parse_ids(ids) if ids else None
        if wanted is not None:
            with self.conn.transaction():
                found = self._locate(wanted, prefer="dead")
                live = [i for i in wanted if found[i][0] != "dead"]
                if live:
                    raise NotFound(f"id {', '.join(map(str, live))} is not a dead letter: "
                                   "`pgjobs cancel` removes live messages")
        elif older_than is None and queue is None:
            raise BulkRefused("dead purge needs ids, --older-than or --queue")
        if queue is not None:
            self.require_queue(queue)
        cutoff = self.cutoff(parse_duration(older_than)) if older_than else None
        params = {"ids": wanted, "queue": queue, "reason": reason, "cutoff": cutoff,
                  "tenant": None, "task": None}
        matched = int(self._one("admin_dead_count", params))
        bound = bulk_limit(limit if wanted is None else max(len(wanted), 1))
        deleted = 0
        if not dry_run:
            deleted = self._batches("admin_dead_purge", params, bound, batch)
        return {"matched": matched, "purged": deleted, "dry_run": dry_run,
                "cutoff": _iso(cutoff), "remaining": matched - deleted}

    def _batches(self, name: str, params: Mapping[str, Any], bound: int, batch: int) -> int:
        """Run a bounded DELETE batch by batch (each its own short transaction) until nothing
        matches or ``bound`` rows are done."""
        if not 1 <= int(batch) <= 100_000:
            raise BulkRefused(f"--batch must be between 1 and 100000, got {batch}")
        done = 0
        while done < bound:
            n = int(self._one(name, {**params, "limit": min(int(batch), bound - done)}))
            done += n
            if n == 0:
                break
        return done

    def prune(self, older_than: str, *, counters_older_than: str | None = None,
              dry_run: bool = False, limit: int | None = None,
              batch: int = DEFAULT_BATCH) -> dict[str, Any]:
        """Retention: delete dead letters that died before the cutoff and fold old counter
        buckets into the roll-up, in bounded batches. ``dry_run`` only counts (exactly)."""
        cutoff = self.cutoff(parse_duration(older_than))
        counters_cutoff = self.cutoff(parse_duration(counters_older_than or older_than))
        row = self.conn.execute(self.q["admin_prune_count"], {
            "cutoff": cutoff, "counters_cutoff": counters_cutoff}).fetchone()
        dead_matched, buckets_matched = (int(row[0]), int(row[1])) if row else (0, 0)
        bound = bulk_limit(limit if limit is not None else MAX_BULK_LIMIT)
        dead_deleted = buckets_folded = 0
        if not dry_run:
            dead_deleted = self._batches("admin_dead_purge", {
                "ids": None, "queue": None, "reason": None, "cutoff": cutoff}, bound, batch)
            buckets_folded = self._batches(
                "admin_counter_fold", {"cutoff": counters_cutoff}, bound, batch)
        return {
            "dry_run": dry_run,
            "dead_letters": {"cutoff": _iso(cutoff), "matched": dead_matched,
                             "deleted": dead_deleted, "remaining": dead_matched - dead_deleted},
            "counter_buckets": {"cutoff": _iso(counters_cutoff), "matched": buckets_matched,
                                "folded": buckets_folded,
                                "remaining": buckets_matched - buckets_folded},
        }
