"""The on-call pages (issue 34, item 4): ``/tasks`` (every task's rate, failure ratio and
runtime percentiles over a window, sortable, with a sparkline), ``/tasks/<name>`` (a task's
recent completions and failures, each failure linked to its dead letter), ``/history`` (the
history searched by task, outcome, tenant, worker and time, and the live messages and dead
letters by args/kwargs containment, bounded) and ``/workers`` (each worker's node, queues,
leases and throughput).

Their statements are the dashboard's own (``tasks.sql``), each bounded whatever the history
holds: the tasks page reads the per-minute rollups and at most :data:`TAIL` rows of the
minutes not rolled up yet; the lists read an index in its order and stop after a page, or
after :data:`SCAN` candidates (the page says so); the args search decodes at most
:data:`ARGS_SCAN` live messages and as many dead letters, the newest, and says so.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime, timezone
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ...errors import DashboardSearchRefused, InvalidArgument
from ...store import history
from ...store.admin import Admin
from ...store.history import OUTCOMES, SORTS, TAIL
from .app import Dashboard
from .queries import dicts, queries

__all__ = ["ARGS_SCAN", "SCAN", "TAIL", "WINDOWS", "contains", "decode_args", "routes",
           "sparkline"]

#: the tasks page's windows: name -> (minutes, sparkline points)
WINDOWS = {"5m": (5, 5), "1h": (60, 60), "24h": (1440, 48)}
# SORTS (the columns the tasks page sorts by) and TAIL (most history rows not rolled up yet it
# reads) are the store's: kombu_pgjobs.store.history
#: most tasks on the tasks page
TASKS = 500
#: rows per page of a task's history and of the history search
PAGE = 50
#: most history rows the search reads (the newest of its time range and task) to find a page
SCAN = 100_000
#: most live messages, and most dead letters, the args search decodes (the newest)
ARGS_SCAN = 5_000
#: a body longer than this (base64 characters) is not decoded by the args search
BODY_MAX = 64 * 1024
#: the args search reads at most this many characters of bodies in all, newest first (of the
#: live messages, and as many of the dead letters): past it, bodies are not sent or searched
BODY_BUDGET = 16 * 1024 * 1024
#: the sparkline's size (pixels)
SPARK_W, SPARK_H = 120, 22


def _arg(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value or None


def sparkline(values: list[int], width: int = SPARK_W,
              height: int = SPARK_H) -> dict[str, Any]:
    """Settles per bucket as an SVG polyline (oldest first), scaled to the busiest bucket."""
    values = [int(v) for v in values or []]
    top = max(values, default=0) or 1
    n = len(values)
    step = width / max(n - 1, 1)
    points = " ".join(f"{round(i * step, 1)},{round(height - 1 - v * (height - 2) / top, 1)}"
                      for i, v in enumerate(values))
    return {"points": points, "width": width, "height": height, "peak": max(values, default=0),
            "total": sum(values)}


def _cursor(request: Request) -> tuple[datetime | None, int | None]:
    """A list's cursor (``before`` a settle time, ``before_id`` a job id): the last row of the
    page before."""
    raw, raw_id = _arg(request, "before"), _arg(request, "before_id")
    if raw is None:
        return None, None
    try:
        when = datetime.fromisoformat(raw.replace(" ", "+"))
    except ValueError:
        raise InvalidArgument(f"cursor {raw[:40]!r} is not a time") from None
    if raw_id is not None and not raw_id.isdigit():
        raise InvalidArgument(f"cursor id {raw_id[:40]!r} is not a number")
    return when, int(raw_id) if raw_id is not None else 2**62


def _outcome(request: Request) -> str | None:
    outcome = _arg(request, "outcome")
    if outcome is not None and outcome not in OUTCOMES:
        raise InvalidArgument(f"unknown outcome {outcome[:40]!r}: one of {', '.join(OUTCOMES)}")
    return outcome


def tasks(admin: Admin, *, window: str = "1h", sort: str = "rate", descending: bool = True,
          limit: int = TASKS, tail: int = TAIL) -> list[dict[str, Any]]:
    """The tasks page's rows (the store's ``history_tasks``, shared with ``pgjobs stats``)."""
    if window not in WINDOWS:
        raise InvalidArgument(f"unknown window {window[:20]!r}: one of {', '.join(WINDOWS)}")
    if sort not in SORTS:
        raise InvalidArgument(f"cannot sort by {sort[:20]!r}: one of {', '.join(SORTS)}")
    minutes, points = WINDOWS[window]
    return history.tasks(admin.conn, admin.schema, minutes=minutes, points=points, sort=sort,
                         descending=descending, limit=limit, tail=tail)


def _series(row: dict[str, Any], points: int) -> list[int]:
    """A task row's sparkline, every bucket (the statement lists those with settles)."""
    series = [0] * points
    for i, n in zip(row["spark_at"] or [], row["spark_n"] or [], strict=True):
        if 0 <= i < points:
            series[i] += int(n)
    return series


def merge_tasks(found: list[tuple[str | None, list[dict[str, Any]]]], *, minutes: int,
                points: int, sort: str, descending: bool, limit: int) -> list[dict[str, Any]]:
    """The tasks page over a shard map: each task's rows of every database summed (counts,
    sparkline), its failure ratio recomputed, its runtime percentiles weighted by each
    database's settles (as the rollups' minutes are), its max the max; sorted as the
    statement sorts (NULLs last, then by task)."""
    merged: dict[str, dict[str, Any]] = {}
    for label, rows in found:
        for r in rows:
            m = merged.setdefault(r["task"], {
                "task": r["task"], "completed": 0, "failed": 0, "dropped": 0, "cancelled": 0,
                "requeued": 0, "settled": 0, "runtime_max": None, "series": [0] * points,
                "w50": 0.0, "n50": 0, "w95": 0.0, "n95": 0, "shards": []})
            for k in ("completed", "failed", "dropped", "cancelled", "requeued", "settled"):
                m[k] += int(r[k])
            m["shards"].append(label)
            for q in ("50", "95"):
                if r[f"runtime_p{q}"] is not None:
                    m[f"w{q}"] += r[f"runtime_p{q}"] * int(r["settled"])
                    m[f"n{q}"] += int(r["settled"])
            if r["runtime_max"] is not None:
                m["runtime_max"] = max(m["runtime_max"] or 0.0, r["runtime_max"])
            m["series"] = [a + b for a, b in zip(m["series"], _series(r, points), strict=True)]
    out = []
    for m in merged.values():
        counted = m["settled"] - m["requeued"]
        m["rate"] = m["settled"] / minutes
        m["failure_ratio"] = m["failed"] / counted if counted else None
        m["runtime_p50"] = m["w50"] / m["n50"] if m["n50"] else None
        m["runtime_p95"] = m["w95"] / m["n95"] if m["n95"] else None
        m["spark"] = sparkline(m["series"])
        out.append(m)
    key = {"rate": "settled", "failure": "failure_ratio", "p50": "runtime_p50",
           "p95": "runtime_p95", "max": "runtime_max"}.get(sort)
    out.sort(key=lambda m: m["task"], reverse=sort == "task" and descending)
    if key is not None:  # stable: ties stay in task order; NULLs last either way
        present = [m for m in out if m[key] is not None]
        present.sort(key=lambda m: m[key], reverse=descending)
        out = present + [m for m in out if m[key] is None]
    return out[:limit]


def _json_value(text: str | None, kind: type, name: str) -> Any:
    if text is None:
        return None
    shape, example = ("array", "[42]") if kind is list else ("object", '{"order_id": 42}')
    try:
        value = json.loads(text)
    except ValueError:
        raise DashboardSearchRefused(
            f"{name} {text[:60]!r} is not JSON: give a JSON {shape}, such as {example}; "
            "nothing was searched") from None
    if not isinstance(value, kind):
        raise DashboardSearchRefused(
            f"{name} must be a JSON {shape} (containment: every element given is in the "
            f"message's {name}), such as {example}; nothing was searched")
    return value


def contains(have: Any, want: Any) -> bool:
    """JSON containment as Postgres' ``jsonb @>``: an object contains the keys given (each
    value contained), an array every element given (in any order), a scalar equals."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            k in have and contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        if not isinstance(have, list):
            return False
        return all(any(contains(h, w) for h in have) for w in want)
    if isinstance(want, bool) or isinstance(have, bool):
        return type(want) is type(have) and want == have
    return bool(have == want)


def decode_args(row: dict[str, Any]) -> tuple[Any, Any] | None:
    """A candidate's (args, kwargs), from its kombu body: base64 (or plain) JSON, Celery's
    protocol 2 (``[args, kwargs, embed]``) or 1 (``{"args": ..., "kwargs": ...}``); None for
    a body that is none of these (not searched)."""
    body = row.get("body")
    if body is None or "json" not in str(row.get("content_type") or ""):
        return None
    try:
        raw: bytes | str = base64.b64decode(body, validate=False) \
            if row.get("body_encoding") == "base64" else body
        value = json.loads(raw)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None
    if isinstance(value, list) and len(value) >= 2:
        return value[0], value[1]
    if isinstance(value, dict) and ("args" in value or "kwargs" in value):
        return value.get("args"), value.get("kwargs")
    return None


def args_search(admin: Admin, *, args: Any, kwargs: Any, task: str | None,
                scan: int = ARGS_SCAN) -> dict[str, Any]:
    """The live messages and dead letters whose args contain ``args`` and kwargs ``kwargs``,
    among the ``scan`` newest of each (of ``task``)."""
    rows = dicts(admin.conn, queries(admin.schema)["dashboard_args_candidates"], {
        "task": task, "scan": int(scan), "body_max": BODY_MAX, "budget": BODY_BUDGET})
    found, skipped, big, over = [], 0, 0, 0
    seen = {"message": rows[0]["live_read"] if rows else 0,
            "dead": rows[0]["dead_read"] if rows else 0}
    for r in rows:
        if r["too_big"]:
            big += 1
            continue
        if r["over_budget"]:
            over += 1
            continue
        decoded = decode_args(r)
        if decoded is None:
            skipped += 1
            continue
        a, k = decoded
        if (args is None or contains(a, args)) and (kwargs is None or contains(k, kwargs)):
            r["args"], r["kwargs"] = a, k
            found.append(r)
    found.sort(key=lambda r: r["at"] or datetime.min.replace(tzinfo=timezone.utc),
               reverse=True)
    return {"items": found, "messages": seen["message"], "dead": seen["dead"],
            "cut": seen["message"] >= scan or seen["dead"] >= scan, "skipped": skipped,
            "too_big": big, "over_budget": over, "scan": scan}


def beyond(admin: Admin, params: dict[str, Any]) -> bool:
    """Whether a filtered list that came out short stopped at its bound (:data:`SCAN`
    candidates) rather than at the end of the history (``dashboard_history_beyond``)."""
    row = admin.conn.execute(queries(admin.schema)["dashboard_history_beyond"],
                             params).fetchone()
    return bool(row and row[0])


#: the remote-control mailbox Celery declares for each worker: ``<node name>.celery.pidbox``
PIDBOX = ".celery.pidbox"


def node_of(worker: str | None, queues: list[str] | None = None) -> tuple[str, str]:
    """A worker identity ``host:pid:incarnation`` (or ``host:pid``) as (node, process): the
    node is Celery's node name (``w1@host``) when the worker consumes its remote-control
    mailbox (``w1@host.celery.pidbox``), else the host; the process is ``pid:incarnation``."""
    host, process = worker or "-", ""
    if worker:
        parts = worker.rsplit(":", 2)
        if len(parts) == 3 and parts[1].isdigit():
            host, process = parts[0], f"{parts[1]}:{parts[2]}"
        elif len(parts) >= 2 and parts[-1].isdigit():
            host, process = worker.rsplit(":", 1)
    for q in queues or ():
        if q.endswith(PIDBOX) and len(q) > len(PIDBOX):
            return q[:-len(PIDBOX)], process
    return host, process


#: how long the workers page waits for the workers' answers to ``stats`` (remote control)
INSPECT_TIMEOUT = 1.0


def broker_url(dsn: str) -> str:
    """The dashboard's database as a kombu broker URL (``pgjobs://``)."""
    scheme, sep, rest = dsn.partition("://")
    return dsn if scheme.startswith("pgjobs") or not sep else f"pgjobs://{rest}"


def inspect_pools(url: str, schema: str, *, expect: int,
                  timeout: float = INSPECT_TIMEOUT) -> dict[str, dict[str, Any]]:
    """Ask every worker for its pool, as ``celery inspect stats`` does (Celery's remote
    control: a broadcast on the ``celery`` mailbox, answers on a reply queue of its own):
    {node name: {"pool", "concurrency"}}. Waits at most ``timeout`` seconds, less once
    ``expect`` workers answered."""
    from kombu import Connection
    from kombu.pidbox import Mailbox

    mailbox = Mailbox("celery", type="fanout", accept=["json"], serializer="json")
    with Connection(url, transport_options={"schema": schema}) as conn:
        replies = mailbox(conn)._broadcast("stats", {}, None, reply=True, timeout=timeout,
                                           limit=expect or None)
    out: dict[str, dict[str, Any]] = {}
    for reply in replies or []:
        for node, stats in (reply or {}).items():
            pool = (stats or {}).get("pool") or {}
            impl = str(pool.get("implementation") or "")
            out[node] = {"pool": impl.rsplit(".", 1)[-1].split(":", 1)[0] or None,
                         "implementation": impl or None,
                         "concurrency": pool.get("max-concurrency")}
    return out


def routes(dash: Dashboard) -> list[BaseRoute]:
    async def task_list(request: Request) -> Response:
        window = _arg(request, "window") or "1h"
        sort = _arg(request, "sort") or "rate"
        order = _arg(request, "dir") or ("asc" if sort == "task" else "desc")
        if order not in ("asc", "desc"):
            raise InvalidArgument(f"dir must be asc or desc, not {order[:10]!r}")

        def read(admin: Admin) -> list[dict[str, Any]]:
            dash.need(admin, 25, "the tasks page")
            return tasks(admin, window=window, sort=sort, descending=order == "desc")

        found = await dash.each(read)
        minutes, points = WINDOWS[window]
        cut = [label or "" for label, rows in found
               if rows and rows[0]["tail_rows"] >= TAIL]
        rolled = min((rows[0]["rolled_upto"] for _, rows in found if rows), default=None)
        if len(found) == 1:
            rows = found[0][1]
            for r in rows:
                r["spark"] = sparkline(_series(r, points))
        else:  # every database of the shard map: one row per task, sorted here
            rows = merge_tasks(found, minutes=minutes, points=points, sort=sort,
                               descending=order == "desc", limit=TASKS)
        return dash.render(request, "tasks.html", {
            "rows": rows, "window": window, "windows": WINDOWS, "sort": sort, "dir": order,
            "sorts": SORTS, "tail_cut": bool(cut), "tail": TAIL, "rolled": rolled,
            "minutes": minutes, "limit": TASKS,
            "shards": [label for label, _ in found] if len(found) > 1 else []})

    async def task_page(request: Request) -> Response:
        name = request.path_params["name"]
        outcome = _outcome(request)
        before, before_id = _cursor(request)

        def read(admin: Admin) -> dict[str, Any]:
            dash.need(admin, 25, "the task page")
            params = {"task": name, "outcome": outcome, "before": before,
                      "before_id": before_id, "n": PAGE + 1, "scan": SCAN,
                      "since": None, "until": None}
            items = dicts(admin.conn, queries(admin.schema)["dashboard_task_history"], params)
            summary = [r for r in tasks(admin, window="1h") if r["task"] == name]
            return {"items": items, "summary": summary[0] if summary else None,
                    "cut": len(items) <= PAGE and beyond(admin, params)}

        data = await dash.run(read)
        items = data["items"]
        more = len(items) > PAGE
        items = items[:PAGE]
        nxt = ({"before": items[-1]["settled_at"].isoformat(),
                "before_id": items[-1]["job_id"]} if more else None)
        return dash.render(request, "task.html", {
            "name": name, "items": items, "next": nxt, "outcome": outcome,
            "scan_cut": data["cut"], "scan": SCAN,
            "outcomes": OUTCOMES, "s": data["summary"],
            "dead_ids": [r["dead_id"] for r in items if r["dead_id"] is not None]})

    async def history_search(request: Request) -> Response:
        filters = {k: _arg(request, k) for k in ("task", "outcome", "tenant", "worker",
                                                  "since", "until", "args", "kwargs")}
        _outcome(request)
        raw_scan = _arg(request, "scan")
        if raw_scan is not None and not raw_scan.isdigit():
            raise DashboardSearchRefused(f"scan {raw_scan[:20]!r} is not a whole number")
        scan = int(raw_scan) if raw_scan is not None else ARGS_SCAN
        if not 1 <= scan <= ARGS_SCAN:
            raise DashboardSearchRefused(
                f"an args search reads at most the newest {ARGS_SCAN:,} live messages and "
                f"{ARGS_SCAN:,} dead letters, not {scan:,}: narrow it by task, or search "
                "older rows with SQL; nothing was searched")
        args = _json_value(filters["args"], list, "args")
        kwargs = _json_value(filters["kwargs"], dict, "kwargs")
        before, before_id = _cursor(request)

        def read(admin: Admin) -> dict[str, Any]:
            since, until = admin.time_arg(filters["since"]), admin.time_arg(filters["until"])
            out: dict[str, Any] = {"found": None, "items": []}
            if args is not None or kwargs is not None:
                out["found"] = args_search(admin, args=args, kwargs=kwargs,
                                           task=filters["task"], scan=scan)
                return out
            dash.need(admin, 25, "the history")
            params = {"task": filters["task"], "outcome": filters["outcome"],
                      "tenant": filters["tenant"], "worker": filters["worker"], "since": since,
                      "until": until, "before": before, "before_id": before_id,
                      "scan": SCAN, "n": PAGE + 1}
            out["items"] = dicts(admin.conn, queries(admin.schema)["dashboard_history_search"],
                                 params)
            out["cut"] = len(out["items"]) <= PAGE and beyond(admin, params)
            return out

        data = await dash.run(read)
        items = data["items"]
        more = len(items) > PAGE
        items = items[:PAGE]
        kept = {k: v for k, v in filters.items() if v}
        nxt = ({**kept, "before": items[-1]["settled_at"].isoformat(),
                "before_id": items[-1]["job_id"]} if more else None)
        return dash.render(request, "history.html", {
            "filters": filters, "items": items, "next": nxt, "outcomes": OUTCOMES,
            "found": data["found"], "scan_cut": bool(data.get("cut")), "scan": SCAN,
            "args_scan": ARGS_SCAN, "page": PAGE})

    async def workers(request: Request) -> Response:
        minutes = 5

        def read(admin: Admin) -> dict[str, Any]:
            rows = admin.workers(leases=20)
            settles = dicts(admin.conn, queries(admin.schema)["dashboard_worker_throughput"],
                            {"minutes": minutes})
            return {"rows": rows, "settles": settles}

        found = await dash.each(read)
        inspect = request.query_params.get("inspect") == "1"
        pools: dict[str, dict[str, Any]] = {}
        asked: str | None = None
        if inspect:  # the workers' own answer (remote control): pool and concurrency
            alive = {q[:-len(PIDBOX)] for _, data in found for w in data["rows"] if w["alive"]
                     for q in (w["queues"] or []) if q.endswith(PIDBOX)}
            try:
                pools = await run_in_threadpool(
                    inspect_pools, broker_url(dash.broker_url), dash.schema,
                    expect=len(alive))
                asked = (f"{len(pools)} of {len(alive)} workers answered"
                         if alive else f"{len(pools)} workers answered")
            except Exception as exc:  # a read-only role cannot publish; the broker is down
                asked = f"the workers could not be asked: {type(exc).__name__}: " \
                        f"{str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        rows = []
        for label, data in found:  # every database of a shard map: a worker settles on each
            per: dict[str, dict[str, int]] = {}
            for s in data["settles"]:
                per.setdefault(s["worker"], {})[s["outcome"]] = int(s["n"])
            for w in data["rows"]:
                w["shard"] = label
                w["node"], w["process"] = node_of(w["worker"], w.get("queues"))
                mine = per.get(w["worker"], {})
                w["settled"] = sum(mine.values())
                w["rate"] = round(w["settled"] / minutes, 2)
                w["failed"] = mine.get("failed", 0) + mine.get("dead", 0)
                told = pools.get(w["node"]) or {}
                w["pool"], w["concurrency"] = told.get("pool"), told.get("concurrency")
                w["pool_impl"] = told.get("implementation")
                rows.append(w)
        return dash.render(request, "workers.html", {
            "workers": rows, "minutes": minutes, "sharded": len(found) > 1,
            "inspect": inspect, "asked": asked, "timeout": INSPECT_TIMEOUT})

    return [
        Route("/tasks", task_list, name="tasks"),
        Route("/tasks/{name:path}", task_page, name="task"),
        Route("/history", history_search, name="history"),
        Route("/workers", workers, name="workers"),
    ]
