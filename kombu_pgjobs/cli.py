"""The ``pgjobs`` operator CLI.

The database comes from ``--dsn`` or, failing that, ``PGJOBS_DSN``, ``CELERY_BROKER_URL`` or
``BROKER_URL`` (pgjobs:// or postgresql:// URLs). Every command takes ``--json``. Bad input exits
with status 2 and prints the error's stable code; a database problem exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from .admin import DEFAULT_BATCH, DEFAULT_BULK_LIMIT, DEFAULT_PAGE, STATES, Admin
from .database import connect, conninfo_from_url
from .errors import ConfigurationError, PgJobsError
from .options import TransportOptions
from .schema import current_version, latest_version, migrate

__all__ = ["build_parser", "main"]

Command = Callable[[argparse.Namespace], Any]


def _dsn(args: argparse.Namespace) -> str:
    url = args.dsn or os.environ.get("PGJOBS_DSN") or os.environ.get("CELERY_BROKER_URL") \
        or os.environ.get("BROKER_URL")
    if not url:
        raise ConfigurationError(
            "no database given: pass --dsn pgjobs://user@host/db or set PGJOBS_DSN")
    return conninfo_from_url(url, TransportOptions(schema=args.schema))


@contextmanager
def _admin(args: argparse.Namespace) -> Iterator[Admin]:
    # Unprepared: operator statements run rarely and with optional filters, where a custom plan
    # per call beats the generic plan the transport's hot statements use.
    with connect(_dsn(args), prepare=False) as conn:
        admin = Admin(conn, args.schema)
        admin.check_schema()
        yield admin


# -- rendering -----------------------------------------------------------------------------
def _age(seconds: Any) -> str:
    """Seconds as an operator reads them: 42s, 5m12s, 3h05m, 2d04h."""
    if seconds is None:
        return "-"
    s = float(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 60:
        return f"{sign}{s:.1f}s" if s < 10 else f"{sign}{s:.0f}s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{sign}{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{sign}{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def _ts(value: Any) -> str:
    return "-" if value is None else str(value).replace("T", " ")[:19]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value)) or "-"
    return str(value)


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """Left-aligned columns sized to their content; long cells are cut at 60 characters."""
    head = [title for title, _ in columns]
    body = [[_cell(r.get(key))[:60] for _, key in columns] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
              for line in body]
    return "\n".join(lines)


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


# -- commands ------------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace) -> dict[str, Any]:
    """Install or upgrade the schema (idempotent; safe to run from many hosts at once)."""
    with connect(_dsn(args)) as conn:
        before = current_version(conn, args.schema)
        applied = migrate(conn, args.schema)
        return {"schema": args.schema, "from_version": before,
                "to_version": latest_version(), "applied": applied}


def _render_migrate(result: dict[str, Any]) -> str:
    if result["applied"]:
        return (f"schema {result['schema']}: migrated {result['from_version']} -> "
                f"{result['to_version']} (applied {', '.join(map(str, result['applied']))})")
    return f"schema {result['schema']}: up to date at version {result['to_version']}"


def cmd_queues(args: argparse.Namespace) -> dict[str, Any]:
    """Per queue: ready, delayed, running, dead, paused, oldest ready age, recent throughput."""
    with _admin(args) as admin:
        return {"minutes": args.minutes, "queues": admin.queues(args.queue, minutes=args.minutes)}


def _render_queues(result: dict[str, Any]) -> str:
    rows = []
    for q in result["queues"]:
        rows.append({**q, "oldest": _age(q["oldest_ready_age"]),
                     "settled": " ".join(f"{k}={v}" for k, v in sorted(q["settled"].items()))})
    if not rows:
        return "no queues"
    return _table(rows, [("QUEUE", "queue"), ("READY", "ready"), ("DELAYED", "delayed"),
                         ("RUNNING", "running"), ("WAITING", "waiting"), ("DEAD", "dead"),
                         ("PAUSED", "paused"),
                         ("OLDEST READY", "oldest"), ("ACKED/MIN", "acked_per_minute"),
                         (f"SETTLED (last {result['minutes']}m)", "settled")])


def _states(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [s.strip() for v in values for s in v.split(",") if s.strip()]


def cmd_ls(args: argparse.Namespace) -> dict[str, Any]:
    """List messages (live, or dead with --state dead), oldest id first, a page at a time."""
    with _admin(args) as admin:
        return admin.ls(states=_states(args.state), queue=args.queue, task=args.task,
                        tenant=args.tenant, created_after=args.created_after,
                        created_before=args.created_before, after=args.after,
                        limit=args.limit)


def _render_page(result: dict[str, Any], columns: list[tuple[str, str]]) -> str:
    if not result["items"]:
        return "no messages"
    text = _table(result["items"], columns)
    if result["next"]:
        text += f"\n-- more: add --after {result['next']}"
    return text


def _render_ls(result: dict[str, Any]) -> str:
    for r in result["items"]:
        r["when"] = _ts(r["died_at"] if r["state"] == "dead" else r["run_at"])
        r["holder"] = r["worker"] or r.get("reason") or (
            f"on {r['waiting_on']}" if r.get("waiting_on") else None)
        if r.get("cancelled_at"):
            r["state"] += " (cancelled)"
    return _render_page(result, [
        ("ID", "id"), ("QUEUE", "queue"), ("STATE", "state"), ("TASK", "task"),
        ("ATTEMPTS", "attempts"), ("PRI", "priority"), ("DUE/DIED", "when"),
        ("WORKER/REASON", "holder"), ("TENANT", "tenant"), ("TASK ID", "task_id")])


def cmd_show(args: argparse.Namespace) -> dict[str, Any]:
    """One message or dead letter: headers, arguments, attempts, lease holder, last error."""
    with _admin(args) as admin:
        return admin.show(args.id, body=args.body)


def _render_show(r: dict[str, Any]) -> str:
    lines = [f"id:           {r['id']}", f"queue:        {r['queue']}",
             f"state:        {r['state']}" + (" (cancelled)" if r.get("cancelled_at") else ""),
             f"task:         {r['task']}  [{r['task_id']}]",
             f"args:         {r['args']}", f"kwargs:       {r['kwargs']}",
             f"attempts:     {r['attempts']} of {r['max_attempts'] or 'the transport default'}"
             f" (claims: {r['claim']}, Celery retries: {r['retries']})",
             f"priority:     {r['priority']}", f"created:      {_ts(r['created_at'])}"]
    if r["state"] == "dead":
        lines += [f"died:         {_ts(r['died_at'])}", f"reason:       {r['reason']}"]
    else:
        lines.append(f"due:          {_ts(r['run_at'])}")
    if r["state"] == "running":
        lines.append(f"lease holder: {r['worker']} (lease ends in {_age(r['lease_remaining'])})")
    if r["state"] == "waiting":
        cap = next((c["limit"] for c in (r.get("limits") or {}).get("concurrency", [])
                    if c["key"] == r["waiting_on"]), "?")
        lines.append(f"waiting:      concurrency key {r['waiting_on']} is full "
                     f"({r['waiting_on_held']} of {cap} running; `pgjobs limits` shows them)")
    if r.get("limits"):
        lines.append(f"limits:       {_pretty(r['limits'])}")
    if r.get("tenant"):
        lines.append(f"tenant:       {r['tenant']}")
    if r.get("last_error"):
        err = dict(r["last_error"])
        tb = err.pop("traceback", None)
        lines.append(f"last error:   {_pretty(err)}")
        if tb:
            lines.append("traceback:\n" + str(tb).rstrip())
    lines.append(f"headers:      {_pretty(r['headers'])}")
    if "body" in r:
        lines.append(f"body:         {_pretty(r['body'])}")
    return "\n".join(lines)


def cmd_dead_ls(args: argparse.Namespace) -> dict[str, Any]:
    """List dead letters, oldest id first, a page at a time."""
    with _admin(args) as admin:
        return admin.dead_ls(queue=args.queue, task=args.task, reason=args.reason,
                             tenant=args.tenant, after=args.after, limit=args.limit)


def _render_dead_ls(result: dict[str, Any]) -> str:
    for r in result["items"]:
        r["died"] = _ts(r["died_at"])
        r["error"] = ": ".join(x for x in (r["error_type"], r["error_message"]) if x) or None
    return _render_page(result, [
        ("ID", "id"), ("QUEUE", "queue"), ("TASK", "task"), ("REASON", "reason"),
        ("RULE", "rule"), ("ATTEMPTS", "attempts"), ("DIED", "died"), ("ERROR", "error")])


def cmd_dead_show(args: argparse.Namespace) -> dict[str, Any]:
    """One dead letter: why it died, its error and traceback, headers and arguments."""
    with _admin(args) as admin:
        return admin.dead_show(args.id, body=args.body)


def cmd_dead_requeue(args: argparse.Namespace) -> dict[str, Any]:
    """Put dead letters back to ready (attempts reset, same id if free) and wake consumers."""
    if args.all == bool(args.ids):
        raise ConfigurationError("give dead-letter ids, or --all --queue QUEUE (not both)")
    with _admin(args) as admin:
        return admin.dead_requeue(args.ids or None, queue=args.queue, reason=args.reason,
                                  limit=args.limit)


def _render_requeued(result: dict[str, Any]) -> str:
    parts = []
    moved = result.get("requeued", [])
    if moved:
        ids = ", ".join(str(r["id"]) if r["id"] == r["new_id"] else f"{r['id']}->{r['new_id']}"
                        for r in moved)
        parts.append(f"requeued {len(moved)}: {ids}")
    if result.get("made_due"):
        parts.append(f"made due now: {', '.join(map(str, result['made_due']))}")
    if result.get("unchanged"):
        parts.append(f"already ready: {', '.join(map(str, result['unchanged']))}")
    if result.get("skipped"):
        parts.append(f"skipped (locked by a concurrent command): "
                     f"{', '.join(map(str, result['skipped']))}")
    if result.get("remaining"):
        parts.append(f"{result['remaining']} remaining: run again")
    return "\n".join(parts) or "nothing to requeue"


def cmd_dead_purge(args: argparse.Namespace) -> dict[str, Any]:
    """Delete dead letters by id, or by age/queue/reason in bounded batches (--dry-run counts)."""
    with _admin(args) as admin:
        return admin.dead_purge(args.ids or None, queue=args.queue, reason=args.reason,
                                older_than=args.older_than, limit=args.limit,
                                batch=args.batch, dry_run=args.dry_run)


def _render_dead_purge(r: dict[str, Any]) -> str:
    if r["dry_run"]:
        return f"would purge {r['matched']} dead letters (dry run)"
    text = f"purged {r['purged']} of {r['matched']} dead letters"
    return text + (f"; {r['remaining']} remaining: run again" if r["remaining"] else "")


def cmd_requeue(args: argparse.Namespace) -> dict[str, Any]:
    """Run messages now: dead letters go back to ready, delayed messages become due."""
    with _admin(args) as admin:
        return admin.requeue(args.ids)


def cmd_cancel(args: argparse.Namespace) -> dict[str, Any]:
    """Cancel messages: ready/delayed ones are deleted, running ones marked so they never return.

    A running message's holder may still finish and ack it; a requeue or a lapsed lease deletes
    it instead of bringing it back."""
    with _admin(args) as admin:
        return admin.cancel(args.ids)


def _render_cancel(r: dict[str, Any]) -> str:
    parts = []
    if r["cancelled"]:
        parts.append(f"cancelled (deleted): {', '.join(map(str, r['cancelled']))}")
    if r["marked"]:
        parts.append(f"running, marked cancelled (will not run again): "
                     f"{', '.join(map(str, r['marked']))}")
    return "\n".join(parts)


def cmd_purge(args: argparse.Namespace) -> dict[str, Any]:
    """Delete a queue's ready and delayed messages (bounded by --limit); running ones finish."""
    with _admin(args) as admin:
        return admin.purge(args.queue, limit=args.limit)


def _render_purge(r: dict[str, Any]) -> str:
    text = f"queue {r['queue']}: purged {r['purged']}"
    if r["remaining"]:
        text += f"; {r['remaining']} remaining: run again"
    if r["running"]:
        text += f"; {r['running']} running (left to finish)"
    return text


def cmd_pause(args: argparse.Namespace) -> dict[str, Any]:
    """Pause a queue: no claims until resumed; running messages finish."""
    with _admin(args) as admin:
        return admin.pause(args.queue, paused=True, create=args.create)


def cmd_resume(args: argparse.Namespace) -> dict[str, Any]:
    """Resume a paused queue and wake its idle consumers."""
    with _admin(args) as admin:
        return admin.pause(args.queue, paused=False)


def _render_pause(r: dict[str, Any]) -> str:
    return f"queue {r['queue']}: {'paused' if r['paused'] else 'resumed'}"


def cmd_limits(args: argparse.Namespace) -> dict[str, Any]:
    """Concurrency keys: slots held, cap, holders, messages waiting; and rate windows."""
    with _admin(args) as admin:
        return admin.limits(prefix=args.key, limit=args.limit)


def _render_limits(result: dict[str, Any]) -> str:
    if not result["keys"] and not result["rates"]:
        return "no limits in use"
    parts = []
    if result["keys"]:
        rows = [{**k, "holders": " ".join(map(str, k["holders"][:8])) +
                 (" ..." if len(k["holders"]) > 8 else ""),
                 "oldest": _age(k["oldest_waiting_age"])} for k in result["keys"]]
        parts.append(_table(rows, [("KEY", "key"), ("HELD", "held"), ("CAP", "cap"),
                                   ("WAITING", "waiting"), ("OLDEST WAITING", "oldest"),
                                   ("HELD BY", "holders")]))
    if result["rates"]:
        parts.append(_table([{**r, "window": _ts(r["window_start"])} for r in result["rates"]],
                            [("RATE KEY", "key"), ("WINDOW START", "window"),
                             ("STARTS", "starts")]))
    return "\n\n".join(parts)


def cmd_workers(args: argparse.Namespace) -> dict[str, Any]:
    """Live consumers, the leases they hold, and processes gone with leases still held."""
    with _admin(args) as admin:
        return {"workers": admin.workers(leases=args.leases)}


def _render_workers(result: dict[str, Any]) -> str:
    rows = result["workers"]
    if not rows:
        return "no workers"
    for w in rows:
        w["seen"] = _age(w["last_seen_age"]) + " ago" if w["last_seen_age"] is not None \
            else "gone"
        w["expiry"] = _age(w["next_expiry"])
    text = _table(rows, [("WORKER", "worker"), ("ALIVE", "alive"), ("QUEUES", "queues"),
                         ("RUNNING", "running"), ("NEXT LEASE END", "expiry"),
                         ("LAST SEEN", "seen")])
    held = [(w["worker"], lease) for w in rows for lease in w["leases"]]
    if held:
        text += "\n\n" + _table(
            [{"worker": who, **lease, "ends": _age(lease["lease_remaining"])}
             for who, lease in held],
            [("WORKER", "worker"), ("ID", "id"), ("QUEUE", "queue"), ("TASK", "task"),
             ("ATTEMPTS", "attempts"), ("LEASE ENDS IN", "ends"), ("CANCELLED", "cancelled")])
    return text


def cmd_metrics(args: argparse.Namespace) -> Any:
    """Prometheus metrics (text exposition); --serve PORT serves them over HTTP."""
    from .metrics import MetricsSource, collect, make_server, render

    if args.serve is None:
        with _admin(args) as admin:
            metrics = collect(admin)
        if args.json:
            return {"metrics": [{"name": m.name, "type": m.kind, "help": m.help,
                                 "samples": [{"labels": lb, "value": v} for lb, v in m.samples]}
                                for m in metrics]}
        return render(metrics)
    source = MetricsSource(_dsn(args), args.schema)
    source.metrics()  # fail now, with the error's code, rather than on the first scrape
    server = make_server(source.text, args.serve, args.bind)
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/metrics"
    print(json.dumps({"serving": url}) if args.json else f"pgjobs: serving metrics on {url}",
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        source.close()
    return None


def cmd_prune(args: argparse.Namespace) -> dict[str, Any]:
    """Retention: delete old dead letters and roll old counter buckets up, in bounded batches."""
    with _admin(args) as admin:
        return admin.prune(args.older_than, counters_older_than=args.counters_older_than,
                           dry_run=args.dry_run, limit=args.limit, batch=args.batch)


def _render_prune(r: dict[str, Any]) -> str:
    d, c = r["dead_letters"], r["counter_buckets"]
    if r["dry_run"]:
        return (f"would delete {d['matched']} dead letters (died before {_ts(d['cutoff'])}) and "
                f"roll up {c['matched']} counter buckets (before {_ts(c['cutoff'])}) (dry run)")
    text = (f"deleted {d['deleted']} dead letters, rolled up {c['folded']} counter buckets")
    if d["remaining"] or c["remaining"]:
        text += f"; remaining {d['remaining']} dead letters, {c['remaining']} buckets: run again"
    return text


def _render_text(result: Any) -> str:
    return str(result)


# -- parser --------------------------------------------------------------------------------
def _add(sub: Any, name: str, func: Command, render: Callable[[Any], str],
         common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[common], help=(func.__doc__ or "").splitlines()[0],
                       description=func.__doc__)
    p.set_defaults(func=func, render=render)
    return p


def _page_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--after", metavar="ID", help="the page after this id (from the last page)")
    p.add_argument("--limit", type=int, default=DEFAULT_PAGE,
                   help=f"rows per page (default {DEFAULT_PAGE}, at most 1000)")


def _bulk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, default=DEFAULT_BULK_LIMIT,
                   help=f"most rows changed by this call (default {DEFAULT_BULK_LIMIT}); the "
                        "result says how many remain")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgjobs", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help="pgjobs:// or postgresql:// URL (default: $PGJOBS_DSN)")
    common.add_argument("--schema", default=os.environ.get("PGJOBS_SCHEMA", "pgjobs"),
                        help="pgjobs schema (default: pgjobs or $PGJOBS_SCHEMA)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add(sub, "migrate", cmd_migrate, _render_migrate, common)

    p = _add(sub, "queues", cmd_queues, _render_queues, common)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--minutes", type=int, default=5,
                   help="throughput window in minutes (default 5)")

    p = _add(sub, "ls", cmd_ls, _render_ls, common)
    p.add_argument("--queue")
    p.add_argument("--state", action="append",
                   help=f"{', '.join(STATES)} (repeat or comma-separate; default: live ones)")
    p.add_argument("--task", help="Celery task name")
    p.add_argument("--tenant", help="the x-pgjobs-tenant header")
    p.add_argument("--created-after", metavar="TIME",
                   help="ISO 8601 time, or a duration ago (2h, 7d)")
    p.add_argument("--created-before", metavar="TIME")
    _page_args(p)

    p = _add(sub, "show", cmd_show, _render_show, common)
    p.add_argument("id")
    p.add_argument("--body", action="store_true",
                   help="decode the JSON body too (arguments as sent, unmasked)")

    p = _add(sub, "limits", cmd_limits, _render_limits, common)
    p.add_argument("--key", help="only keys starting with this (e.g. key:sync_account:)")
    p.add_argument("--limit", type=int, default=DEFAULT_PAGE,
                   help=f"most keys listed (default {DEFAULT_PAGE}, at most 1000)")

    dead = sub.add_parser("dead", help="dead letters: ls, show, requeue, purge")
    dsub = dead.add_subparsers(dest="dead_command", required=True, metavar="COMMAND")
    p = _add(dsub, "ls", cmd_dead_ls, _render_dead_ls, common)
    p.add_argument("--queue")
    p.add_argument("--task")
    p.add_argument("--reason", help="e.g. rejected, failed, lease_expired_final_attempt")
    p.add_argument("--tenant")
    _page_args(p)
    p = _add(dsub, "show", cmd_dead_show, _render_show, common)
    p.add_argument("id")
    p.add_argument("--body", action="store_true")
    p = _add(dsub, "requeue", cmd_dead_requeue, _render_requeued, common)
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true", help="every dead letter of --queue")
    p.add_argument("--queue")
    p.add_argument("--reason", help="with --all: only dead letters with this reason")
    _bulk_args(p)
    p = _add(dsub, "purge", cmd_dead_purge, _render_dead_purge, common)
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--older-than", metavar="DURATION", help="died more than this ago (7d)")
    p.add_argument("--queue")
    p.add_argument("--reason")
    p.add_argument("--dry-run", action="store_true", help="count only")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per transaction")
    _bulk_args(p)

    p = _add(sub, "requeue", cmd_requeue, _render_requeued, common)
    p.add_argument("ids", nargs="+", metavar="ID")
    p = _add(sub, "cancel", cmd_cancel, _render_cancel, common)
    p.add_argument("ids", nargs="+", metavar="ID")
    p = _add(sub, "purge", cmd_purge, _render_purge, common)
    p.add_argument("queue")
    _bulk_args(p)
    p = _add(sub, "pause", cmd_pause, _render_pause, common)
    p.add_argument("queue")
    p.add_argument("--create", action="store_true",
                   help="pause a queue that does not exist yet (ahead of a deploy)")
    p = _add(sub, "resume", cmd_resume, _render_pause, common)
    p.add_argument("queue")

    p = _add(sub, "workers", cmd_workers, _render_workers, common)
    p.add_argument("--leases", type=int, default=20, help="leases listed per worker")

    p = _add(sub, "metrics", cmd_metrics, _render_text, common)
    p.add_argument("--serve", type=int, metavar="PORT",
                   help="serve /metrics over HTTP on this port (0: any free port)")
    p.add_argument("--bind", default="127.0.0.1", help="address to serve on (127.0.0.1)")

    p = _add(sub, "prune", cmd_prune, _render_prune, common)
    p.add_argument("--older-than", required=True, metavar="DURATION",
                   help="delete dead letters that died more than this ago (7d, 12h)")
    p.add_argument("--counters-older-than", metavar="DURATION",
                   help="roll up counter buckets older than this (default: --older-than)")
    p.add_argument("--dry-run", action="store_true", help="print the exact counts only")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per transaction")
    p.add_argument("--limit", type=int, default=100_000, help="most rows per table per call")
    return parser


def _exit_code(exc: PgJobsError) -> int:
    return 2 if isinstance(exc, ConfigurationError) or exc.code.startswith("PGJ-4") else 3


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # usage errors: argparse printed them; exit 2 like bad input
        return int(exc.code or 0) if not isinstance(exc.code, str) else 2
    as_json = getattr(args, "json", False)
    try:
        result = args.func(args)
    except PgJobsError as exc:
        payload = {"error": {"code": exc.code, "message": exc.message}}
        if as_json:
            print(json.dumps(payload))
        else:
            print(f"pgjobs: error [{exc.code}] {exc.message}", file=sys.stderr)
        return _exit_code(exc)
    except psycopg.Error as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if as_json:
            print(json.dumps({"error": {"code": None, "sqlstate": exc.sqlstate,
                                        "message": f"database error: {message}"}}))
        else:
            print(f"pgjobs: database error: {message}", file=sys.stderr)
        return 3
    if result is None:
        return 0
    if as_json:
        print(json.dumps(result, default=str))
    elif isinstance(result, str):
        sys.stdout.write(result)
    else:
        print(args.render(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
