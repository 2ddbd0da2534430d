"""The leader scheduler's pages and actions: ``/schedules`` (the leader and every entry),
``/schedules/<name>`` (an entry and its recent fires), and POST ``.../pause`` and
``.../resume``.

Everything is read and written through :class:`~kombu_pgjobs.scheduling.ScheduleStore`, as
``pgjobs schedule ls|history|pause|resume`` do; the next due time is the CLI's own
(:func:`kombu_pgjobs.schedule_cli._next_due`, with :mod:`kombu_pgjobs.recurrence`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..admin import Admin
from ..schedule_cli import SCHEDULER_VERSION, _next_due
from ..scheduling import ScheduleStore
from .actions import action
from .app import Dashboard

__all__ = ["routes"]

#: fires shown on an entry's page
HISTORY = 50


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
        entries = [(e, _next_due(e)) for e in data["entries"]]
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
            **data, "due": _next_due(data["e"]), "limit": HISTORY})

    def pause(paused: bool) -> Any:
        def perform(admin: Admin, p: Mapping[str, str]) -> dict[str, Any]:
            store(admin).pause(admin.conn, p["name"], paused)
            return {"name": p["name"], "paused": paused}

        return perform

    def back(p: Mapping[str, str]) -> str:
        return "/schedules"

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
        Route("/schedules/{name:path}", entry, name="schedule"),
    ]
