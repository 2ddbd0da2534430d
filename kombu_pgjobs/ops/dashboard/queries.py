"""The dashboard's own statements: the overview's page of queues (``overview.sql``), and the
on-call pages' (``tasks.sql``: the tasks page, a task's page, the history search, the workers'
throughput).

Read and composed as :mod:`kombu_pgjobs.store.sql` does its files: each statement under a
``-- name: <name>`` header, comment lines not sent, ``{schema}`` the quoted schema identifier
(:mod:`psycopg.sql`, never string formatting), composed once per schema.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

import psycopg
from psycopg import sql

from ...store.admin import Admin

__all__ = ["counter_series", "dicts", "internal", "queries", "queue_page"]

_HEADER = re.compile(r"^-- name: (\w+)(?: :\w+)?\s*$", re.MULTILINE)
#: the files of the dashboard's own statements: the overview's, and the on-call pages'
#: (tasks, a task, the history search, workers' throughput: issue 34)
FILES = ("overview.sql", "tasks.sql")


def internal(queue: str) -> bool:
    """A queue Celery makes for itself (``*.pidbox``, ``*.reply.celery.pidbox``,
    ``celeryev.*``), not one of the app's: what overview.sql's LIKE patterns say."""
    return queue.endswith(".pidbox") or queue.startswith("celeryev.")


@cache
def _raw() -> dict[str, str]:
    found: dict[str, str] = {}
    for file in FILES:
        text = resources.files(__package__).joinpath(file).read_text("utf-8")
        parts = _HEADER.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise RuntimeError(f"statement {name} is named twice ({file})")
            lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
            found[name] = "\n".join(lines).strip().rstrip(";")
    return found


@cache
def queries(schema: str) -> dict[str, sql.Composed]:
    ident = sql.Identifier(schema)
    return {name: sql.SQL(text).format(schema=ident)  # type: ignore[arg-type]
            for name, text in _raw().items()}


def dicts(conn: psycopg.Connection[Any], query: sql.Composed,
           params: dict[str, Any]) -> list[dict[str, Any]]:
    cur = conn.execute(query, params)
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def queue_page(admin: Admin, *, after: str | None, limit: int, bound: int,
               show_internal: bool) -> dict[str, Any]:
    """One page of the overview: ``limit`` queues after ``after`` in name order, counted as
    ``Admin.queues(bound=...)`` counts; ``next`` is the cursor of the next page."""
    rows = dicts(admin.conn, queries(admin.schema)["dashboard_queue_page"], {
        "after": after or "", "n": int(limit) + 1, "bound": int(bound),
        "internal": bool(show_internal)})
    more = len(rows) > limit
    rows = rows[:limit]
    return {"items": rows, "next": rows[-1]["queue"] if more else None}


def counter_series(admin: Admin, queues: list[str],
                   minutes: int) -> dict[str, dict[str, list[int]]]:
    """Settles per minute of ``queues`` over the last ``minutes`` (as
    ``Admin.throughput``): {queue: {outcome: [n, ...]}}, oldest minute first."""
    out: dict[str, dict[str, list[int]]] = {}
    if not queues:
        return out
    for r in dicts(admin.conn, queries(admin.schema)["dashboard_counter_series"],
                    {"queues": queues, "minutes": int(minutes)}):
        series = out.setdefault(r["queue"], {}).setdefault(r["outcome"], [0] * minutes)
        if 0 <= r["ago"] < minutes:
            series[minutes - 1 - r["ago"]] += int(r["n"])
    return out
