"""The ``pgjobs`` commands of the task history (issue 34; :mod:`kombu_pgjobs.store.history`).

* ``pgjobs history [--task NAME] [--outcome OUTCOME] [--tenant T] [--worker W]
  [--since DURATION] [--limit N] [--before TIME] [--json]``: settled deliveries, newest first;
* ``pgjobs stats [--since DURATION] [--json]``: per task, the settles by outcome, the failure
  ratio and the runtime p50/p95/max over the window (default the last hour), busiest first.

Registered by :func:`register` from :mod:`kombu_pgjobs.ops.cli.main`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...errors import InvalidArgument, MigrationError
from ...store import history
from ...store.admin import Admin, parse_duration
from ...store.schema import current_version

__all__ = ["HISTORY_VERSION", "register"]

Opener = Callable[[argparse.Namespace], AbstractContextManager[Admin]]

#: the schema version that made pgjobs_history
HISTORY_VERSION = 25
#: the most rows one ``pgjobs history`` lists
MAX_LIMIT = 10_000


def _ts(value: Any) -> str:
    return "-" if value is None else str(value).replace("T", " ")[:23]


def _secs(value: Any) -> str:
    return "-" if value is None else f"{float(value):.3f}s"


def _table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    cells = [[h for h, _ in columns]] + [["-" if r.get(k) is None else str(r[k])
                                          for _, k in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def _check(admin: Admin) -> None:
    if current_version(admin.conn, admin.schema) < HISTORY_VERSION:
        raise MigrationError(f"the task history needs schema version {HISTORY_VERSION}: "
                             "run `pgjobs migrate`")


def _render_history(result: dict[str, Any]) -> str:
    if not result["items"]:
        return "no history"
    rows = [{**r, "settled_at": _ts(r["settled_at"]), "runtime": _secs(r["runtime"]),
             "delivery": f"{r['job_id']}.{r['claim']}"} for r in result["items"]]
    text = _table(rows, [("SETTLED", "settled_at"), ("TASK", "task"), ("OUTCOME", "outcome"),
                         ("RUNTIME", "runtime"), ("ATTEMPTS", "attempts"), ("QUEUE", "queue"),
                         ("TENANT", "tenant"), ("WORKER", "worker"), ("DELIVERY", "delivery")])
    if result.get("next"):
        text += f"\nmore: --before {result['next']}"
    return text


def _render_stats(result: dict[str, Any]) -> str:
    if not result["tasks"]:
        return f"nothing settled in the last {result['seconds']:g}s"
    rows = [{**r, "task": r["task"] or "(no task)",
             "failure_ratio": "-" if r["failure_ratio"] is None
             else f"{100 * r['failure_ratio']:.1f}%",
             "runtime_p50": _secs(r["runtime_p50"]), "runtime_p95": _secs(r["runtime_p95"]),
             "runtime_max": _secs(r["runtime_max"])} for r in result["tasks"]]
    return _table(rows, [("TASK", "task"), ("SETTLED", "settled"), ("COMPLETED", "completed"),
                         ("FAILED", "failed"), ("DROPPED", "dropped"),
                         ("CANCELLED", "cancelled"), ("REQUEUED", "requeued"),
                         ("FAILURES", "failure_ratio"), ("P50", "runtime_p50"),
                         ("P95", "runtime_p95"), ("MAX", "runtime_max")])


def register(sub: Any, common: argparse.ArgumentParser, add: Callable[..., Any],
             opener: Opener) -> None:
    """Add ``history`` and ``stats``. ``add`` is the CLI's subcommand maker, ``opener`` its
    Admin."""

    def cmd_history(args: argparse.Namespace) -> dict[str, Any]:
        """Settled deliveries, newest first: task, outcome, runtime, attempts, queue, tenant,
        worker."""
        if not 1 <= args.limit <= MAX_LIMIT:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_LIMIT}, got {args.limit}")
        with opener(args) as admin:
            _check(admin)
            since = admin.cutoff(parse_duration(args.since)) if args.since else None
            before = admin.time_arg(args.before)
            items = history.list_history(
                admin.conn, admin.schema, task=args.task, outcome=args.outcome,
                tenant=args.tenant, worker=args.worker, since=since, before=before,
                limit=args.limit)
        more = len(items) == args.limit
        return {"items": items,
                "next": items[-1]["settled_at"].isoformat() if more and items else None}

    def cmd_stats(args: argparse.Namespace) -> dict[str, Any]:
        """Per task over the window: settles by outcome, failure ratio, runtime p50/p95/max."""
        seconds = parse_duration(args.since)
        with opener(args) as admin:
            _check(admin)
            tasks = history.stats(admin.conn, admin.schema, seconds=seconds)
        return {"seconds": seconds, "tasks": tasks}

    p = add(sub, "history", cmd_history, _render_history, common)
    p.add_argument("--task", metavar="NAME", help="only this Celery task")
    p.add_argument("--outcome", choices=history.OUTCOMES, help="only this outcome")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument("--worker", help="only this worker (node:pid:incarnation)")
    p.add_argument("--since", metavar="DURATION",
                   help="only settles within this long ago (30s, 15m, 2h, 7d)")
    p.add_argument("--before", metavar="TIME",
                   help="only settles before this time (ISO 8601, or a duration ago): the "
                        "next page's cursor")
    p.add_argument("--limit", type=int, default=50,
                   help=f"rows (default 50, at most {MAX_LIMIT})")

    p = add(sub, "stats", cmd_stats, _render_stats, common)
    p.add_argument("--since", metavar="DURATION", default="1h",
                   help="the window (default 1h; at most a year)")
