"""``pgjobs schedule ls|add|pause|resume|remove|history``: the leader scheduler's entries.

Celery-free: it reads and writes the scheduler's tables (:mod:`kombu_pgjobs.store.scheduling`). An
entry added here is validated here, with the same parser the scheduler uses
(:mod:`kombu_pgjobs.recurrence`), so a bad crontab, time zone, interval or catch-up policy is
refused with its code before anything is written; the leader picks the entry up at its next
renewal (within a third of the lease TTL), without a restart.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import psycopg

from ...errors import InvalidScheduleEntry, MigrationError
from ...options import validate_queue_name
from ...recurrence import DEFAULT_CATCH_UP_MAX
from ...store.scheduling import (
    SCHEDULER_VERSION,
    EntryDef,
    ScheduleStore,
    next_due,
    validate_entry,
)
from ..common import add_command, open_admin, table_text, ts_text

__all__ = ["add_schedule_commands"]


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[tuple[psycopg.Connection[Any], ScheduleStore]]:
    with open_admin(args) as admin:
        version = admin.check_schema()
        if version < SCHEDULER_VERSION:
            raise MigrationError(f"schema {args.schema!r} is at version {version}; the "
                                 f"scheduler needs {SCHEDULER_VERSION}: run `pgjobs migrate`")
        yield admin.conn, ScheduleStore(args.schema)


def cmd_schedule_ls(args: argparse.Namespace) -> dict[str, Any]:
    """Scheduled entries (schedule, next due, last fire) and the leader with its term."""
    with _store(args) as (conn, store):
        entries = store.load(conn)
        leader = store.leader(conn)
    now = datetime.now(timezone.utc)
    rows = []
    for e in entries:
        due = next_due(e)
        rows.append({
            "name": e.name, "source": e.source, "task": e.task, "schedule": e.schedule,
            "timezone": e.timezone, "catch_up": e.catch_up, "paused": e.paused,
            "next_due": due, "next_due_in": (due - now).total_seconds() if due else None,
            "last_occurrence": e.last_occurrence, "last_fired_at": e.last_fired_at,
            "fires": e.fires, "args": e.args, "kwargs": e.kwargs, "options": e.options})
    return {"leader": leader, "entries": rows}


def _render_ls(result: dict[str, Any]) -> str:
    lead = result["leader"]
    head = "leader: none yet" if lead is None else (
        f"leader: {lead['holder']} term {lead['term']} "
        f"({'live' if lead['live'] else 'lapsed'}, lease until {ts_text(lead['expires_at'])})")
    rows = [{**r, "next_due": ts_text(r["next_due"]) if r["next_due"] else None,
             "last_fired_at": ts_text(r["last_fired_at"]) if r["last_fired_at"] else None}
            for r in result["entries"]]
    return head + "\n" + table_text(rows, [
        ("ENTRY", "name"), ("TASK", "task"), ("SCHEDULE", "schedule"), ("TZ", "timezone"),
        ("NEXT DUE", "next_due"), ("LAST FIRE", "last_fired_at"), ("FIRES", "fires"),
        ("CATCH-UP", "catch_up"), ("PAUSED", "paused"), ("SOURCE", "source")])


def _json_arg(what: str, text: str | None, kind: type, default: Any) -> Any:
    if text is None:
        return default
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise InvalidScheduleEntry(f"--{what} is not JSON: {exc}") from None
    if not isinstance(value, kind):
        raise InvalidScheduleEntry(f"--{what} must be a JSON {kind.__name__}")
    return value


def cmd_schedule_add(args: argparse.Namespace) -> dict[str, Any]:
    """Add a dynamic entry (validated here; the leader picks it up without a restart)."""
    options = _json_arg("options", args.options, dict, {})
    if args.queue is not None:
        options["queue"] = validate_queue_name(args.queue)
    if args.priority is not None:
        if not 0 <= args.priority <= 9:
            raise InvalidScheduleEntry(f"--priority must be 0-9, got {args.priority}")
        options["priority"] = args.priority
    entry = validate_entry(EntryDef(
        name=args.name, task=args.task, schedule=args.schedule, timezone=args.timezone,
        args=_json_arg("args", args.args, list, []),
        kwargs=_json_arg("kwargs", args.kwargs, dict, {}), options=options,
        catch_up=args.catch_up, catch_up_max=args.catch_up_max))
    with _store(args) as (conn, store):
        created = store.add(conn, entry, paused=args.paused, replace=args.replace)
    return {"name": entry.name, "created": created, "replaced": not created}


def _render_add(r: dict[str, Any]) -> str:
    return f"{'added' if r['created'] else 'replaced'} {r['name']}"


def cmd_schedule_pause(args: argparse.Namespace) -> dict[str, Any]:
    """Pause an entry: it does not fire until resumed."""
    with _store(args) as (conn, store):
        store.pause(conn, args.name, True)
    return {"name": args.name, "paused": True}


def cmd_schedule_resume(args: argparse.Namespace) -> dict[str, Any]:
    """Resume an entry from now (occurrences while paused are not caught up)."""
    with _store(args) as (conn, store):
        store.pause(conn, args.name, False)
    return {"name": args.name, "paused": False}


def _render_pause(r: dict[str, Any]) -> str:
    return f"{r['name']}: {'paused' if r['paused'] else 'resumed'}"


def cmd_schedule_remove(args: argparse.Namespace) -> dict[str, Any]:
    """Remove an entry (its history stays; a static one returns while it is configured)."""
    with _store(args) as (conn, store):
        source = store.remove(conn, args.name)
    return {"name": args.name, "removed": True, "source": source}


def _render_remove(r: dict[str, Any]) -> str:
    note = " (static: it comes back at the next election while beat_schedule has it)" \
        if r["source"] == "static" else ""
    return f"removed {r['name']}{note}"


def cmd_schedule_history(args: argparse.Namespace) -> dict[str, Any]:
    """Recent fires of an entry, newest first."""
    with _store(args) as (conn, store):
        store.get(conn, args.name)
        fires = store.history(conn, args.name, args.limit)
    return {"name": args.name, "fires": fires}


def _render_history(r: dict[str, Any]) -> str:
    rows = [{**f, "occurrence": ts_text(f["occurrence"]), "fired_at": ts_text(f["fired_at"])}
            for f in r["fires"]]
    return table_text(rows, [("OCCURRENCE", "occurrence"), ("FIRED AT", "fired_at"),
                         ("TERM", "term"), ("HOLDER", "holder"), ("JOB", "job_id"),
                         ("MISSED", "missed")])


def add_schedule_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``pgjobs schedule ...`` on the CLI's subparsers."""
    sched = sub.add_parser("schedule", parents=[common],
                           help="leader scheduler entries: ls, add, pause, resume, remove, "
                                "history")
    ssub = sched.add_subparsers(dest="schedule_command", required=True, metavar="COMMAND")
    add_command(ssub, "ls", cmd_schedule_ls, _render_ls, common)
    p = add_command(ssub, "add", cmd_schedule_add, _render_add, common)
    p.add_argument("name", help="entry name")
    p.add_argument("task", help="Celery task name")
    p.add_argument("schedule", help="'every 30s' (s, m, h, d) or crontab text "
                                    "'minute hour day-of-month month day-of-week'")
    p.add_argument("--timezone", help="IANA time zone of a crontab (default: the app's)")
    p.add_argument("--args", help="positional arguments, a JSON list")
    p.add_argument("--kwargs", help="keyword arguments, a JSON object")
    p.add_argument("--options", help="apply_async options, a JSON object")
    p.add_argument("--queue", help="queue to send to")
    p.add_argument("--priority", type=int, help="message priority 0-9")
    p.add_argument("--catch-up", default="skip", help="skip (default), once or all")
    p.add_argument("--catch-up-max", type=int, default=DEFAULT_CATCH_UP_MAX,
                   help=f"most occurrences 'all' fires after downtime ({DEFAULT_CATCH_UP_MAX})")
    p.add_argument("--paused", action="store_true", help="add it paused")
    p.add_argument("--replace", action="store_true",
                   help="redefine an existing dynamic entry of this name")
    for name, func in (("pause", cmd_schedule_pause), ("resume", cmd_schedule_resume)):
        p = add_command(ssub, name, func, _render_pause, common)
        p.add_argument("name")
    p = add_command(ssub, "remove", cmd_schedule_remove, _render_remove, common)
    p.add_argument("name")
    p = add_command(ssub, "history", cmd_schedule_history, _render_history, common)
    p.add_argument("name")
    p.add_argument("--limit", type=int, default=20, help="fires listed (default 20)")
