"""The leader scheduler's pages and actions: ``/schedules`` (the leader and every entry),
``/schedules/<name>`` (an entry and its recent fires), and POST ``.../pause``, ``.../resume``
and ``.../run`` (run now: the entry's task published once, at once, with the statement the
scheduler's fire inserts its message with; the entry's schedule is not touched).

Everything is read and written through :class:`~kombu_pgjobs.store.scheduling.ScheduleStore`, as
``pgjobs schedule ls|history|pause|resume`` do; the next due time is the CLI's own
(:func:`kombu_pgjobs.ops.cli.schedule._next_due`, with :mod:`kombu_pgjobs.recurrence`).
"""

from __future__ import annotations

import base64
import json
import socket
import uuid
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from psycopg import sql
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ...store.admin import Admin
from ...store.core import QueueCore, job_from_message
from ...store.scheduling import SCHEDULER_VERSION, EntryRow, ScheduleStore, next_due
from .actions import Done, action
from .app import Dashboard

#: headers a "run now" message carries: the entry's name, and that it was run by hand (the
#: scheduler's own fires carry pgjobs_schedule_entry and an occurrence instead)
RUN_NOW_ENTRY = "pgjobs_schedule_entry"
RUN_NOW_HEADER = "pgjobs_run_now"

__all__ = ["routes"]

#: fires shown on an entry's page
HISTORY = 50


def celery_message(entry: EntryRow, *, task_id: str | None = None) -> tuple[str, dict[str, Any]]:
    """The entry's task as Celery's protocol 2 message (a JSON body), the queue it goes to:
    the entry's ``queue`` option, else its ``routing_key``, else Celery's default ``celery``
    (the app's ``task_routes`` are not known here: give the entry a queue to route it)."""
    options = entry.options or {}
    task_id = task_id or str(uuid.uuid4())
    queue = options.get("queue") or options.get("routing_key") or "celery"
    if not isinstance(queue, str):  # a kombu Queue given in code: its name
        queue = str(getattr(queue, "name", queue))
    headers: dict[str, Any] = {
        "lang": "py", "task": entry.task, "id": task_id, "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0,
        "timelimit": [None, None], "root_id": task_id, "parent_id": None,
        "argsrepr": repr(tuple(entry.args)), "kwargsrepr": repr(entry.kwargs),
        "origin": f"pgjobs-dashboard@{socket.gethostname()}", "ignore_result": False,
        "celery_beat_task": True, RUN_NOW_ENTRY: entry.name, RUN_NOW_HEADER: True,
        **{k: v for k, v in (options.get("headers") or {}).items()}}
    body = json.dumps([list(entry.args), dict(entry.kwargs),
                       {"callbacks": None, "errbacks": None, "chain": None, "chord": None}])
    priority = options.get("priority")
    message = {
        "body": base64.b64encode(body.encode("utf-8")).decode("ascii"),
        "content-encoding": "utf-8", "content-type": "application/json", "headers": headers,
        "properties": {"correlation_id": task_id, "reply_to": None,
                       "body_encoding": "base64", "priority": priority or 0,
                       "delivery_info": {"exchange": "", "routing_key": queue},
                       "delivery_mode": 2, "delivery_tag": str(uuid.uuid4())}}
    return queue, message


def run_now(admin: Admin, entry: EntryRow) -> dict[str, Any]:
    """Publish ``entry``'s task once now, with the statement a fire inserts its message with
    (:meth:`~kombu_pgjobs.core.QueueCore.insert_from`, ``job_insert``): one message, its id
    returned. The entry's watermark, fires and history are not touched."""
    queue, message = celery_message(entry)
    job = job_from_message(queue, message)
    core = QueueCore(admin.schema, lease_ttl=60.0, max_attempts=1, worker="pgjobs-dashboard")
    insert, params = core.insert_from("one", job)
    row = admin.conn.execute(sql.Composed([sql.SQL("WITH one AS (SELECT 1)\n"), insert]),
                             params).fetchone()
    job_id = int(row[0]) if row is not None and row[0] is not None else None
    return {"name": entry.name, "task": entry.task, "queue": queue,
            "task_id": message["headers"]["id"], "published": [job_id] if job_id else []}


def _ran(result: Any, p: Mapping[str, str]) -> Done:
    ids = [int(i) for i in result.get("published", [])]
    if not ids:
        return Done(f"Entry {result['name']}: nothing was published (its idempotency key is "
                    "held by a live message)")
    return Done(f"Published {result['task']} once to queue {result['queue']} "
                f"(task id {result['task_id']})", ids, "/messages/")


def routes(dash: Dashboard) -> list[BaseRoute]:
    def store(admin: Admin) -> ScheduleStore:
        dash.need(admin, SCHEDULER_VERSION, "schedule pages")
        return ScheduleStore(admin.schema)

    async def listing(request: Request) -> Response:
        def read(admin: Admin) -> dict[str, Any]:
            s = store(admin)
            return {"leader": s.leader(admin.conn), "entries": s.load(admin.conn)}

        data = await dash.run(read)
        now = datetime.now(timezone.utc)
        entries = [(e, next_due(e)) for e in data["entries"]]
        return dash.render(request, "schedules.html",
                           {"leader": data["leader"], "entries": entries, "now": now})

    async def entry(request: Request) -> Response:
        name = request.path_params["name"]

        def read(admin: Admin) -> dict[str, Any]:
            s = store(admin)
            found = s.get(admin.conn, name)
            return {"e": found, "fires": s.history(admin.conn, name, HISTORY)}

        data = await dash.run(read)
        return dash.render(request, "schedule.html", {
            **data, "due": next_due(data["e"]), "limit": HISTORY})

    def pause(paused: bool) -> Any:
        def perform(admin: Admin, p: Mapping[str, str]) -> dict[str, Any]:
            store(admin).pause(admin.conn, p["name"], paused)
            return {"name": p["name"], "paused": paused}

        return perform

    def back(p: Mapping[str, str]) -> str:
        return "/schedules"

    def to_entry(p: Mapping[str, str]) -> str:
        return f"/schedules/{quote(p['name'], safe='')}"

    def run(admin: Admin, p: Mapping[str, str]) -> dict[str, Any]:
        entry = store(admin).get(admin.conn, p["name"])
        return run_now(admin, entry)

    post = ["POST"]
    return [
        Route("/schedules", listing, name="schedules"),
        Route("/schedules/{name:path}/pause", action(
            dash, lambda p: f"Pause schedule entry {p['name']}: it does not fire until resumed",
            pause(True), back), methods=post),
        Route("/schedules/{name:path}/resume", action(
            dash, lambda p: f"Resume schedule entry {p['name']} from now (occurrences while "
                            "paused are not caught up)",
            pause(False), back), methods=post),
        Route("/schedules/{name:path}/run", action(
            dash, lambda p: f"Run schedule entry {p['name']} once now (one message of its "
                            "task, outside its schedule: its next occurrence still fires)",
            run, to_entry, report=_ran), methods=post),
        Route("/schedules/{name:path}", entry, name="schedule"),
    ]
