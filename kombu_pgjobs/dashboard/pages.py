"""The pages (GET): overview, messages, one message, dead letters, limits, workers.

Each page is one call, or a few, into :class:`~kombu_pgjobs.admin.Admin` — the statements the
CLI runs, paged by index with keyset cursors (``?after=ID``) — rendered by a template.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ..admin import STATES, Admin
from .actions import BULK_BATCH
from .app import Dashboard, safe_next

__all__ = ["chart", "routes"]

#: minutes of settle counters the overview's chart shows
CHART_MINUTES = 30
#: rows per page of every listing
PAGE = 50
#: characters of a message body shown on its page
BODY_PREVIEW = 4000
#: settle outcomes drawn as "went wrong" in the chart (the rest: done)
BAD_OUTCOMES = ("dead", "failed", "rejected", "expired")


def _arg(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value or None


def chart(series: dict[str, list[int]], minutes: int = CHART_MINUTES,
          height: int = 28) -> dict[str, Any]:
    """One queue's settles per minute as SVG bars: good (acked, ...) under bad (dead, failed,
    rejected, expired), scaled to the busiest minute."""
    good = [0] * minutes
    bad = [0] * minutes
    for outcome, values in series.items():
        into = bad if outcome in BAD_OUTCOMES else good
        for i, n in enumerate(values[-minutes:]):
            into[i] += n
    top = max((g + b for g, b in zip(good, bad, strict=True)), default=0) or 1
    bars = []
    for i, (g, b) in enumerate(zip(good, bad, strict=True)):
        gh = round(g * height / top)
        bh = round(b * height / top)
        bars.append({"x": i * 4, "good_y": height - gh, "good_h": gh,
                     "bad_y": height - gh - bh, "bad_h": bh,
                     "title": f"{minutes - 1 - i} min ago: {g} done, {b} failed"})
    return {"width": minutes * 4, "height": height, "bars": bars, "peak": top,
            "total": sum(good) + sum(bad)}


def routes(dash: Dashboard) -> list[BaseRoute]:
    async def overview(request: Request) -> Response:
        def read(admin: Admin) -> dict[str, Any]:
            return {"queues": admin.queues(minutes=5, bound=dash.count_bound),
                    "series": admin.throughput(minutes=CHART_MINUTES),
                    "workers": admin.workers(leases=0)}

        data = await dash.run(read)
        for q in data["queues"]:
            q["chart"] = chart(data["series"].get(q["queue"], {}))
        return dash.render(request, "overview.html",
                           {**data, "minutes": CHART_MINUTES, "bound": dash.count_bound})

    async def tenants(request: Request) -> Response:
        after = _arg(request, "after")
        page = await dash.run(lambda admin: admin.tenants(after=after, limit=PAGE,
                                                          bound=dash.count_bound))
        return dash.render(request, "tenants.html", {"page": page, "bound": dash.count_bound})

    async def messages(request: Request) -> Response:
        filters = {k: _arg(request, k) for k in ("queue", "state", "task", "tenant")}
        after = _arg(request, "after")
        state = filters["state"]
        page = await dash.run(lambda admin: admin.ls(
            states=[state] if state else None, queue=filters["queue"], task=filters["task"],
            tenant=filters["tenant"], after=after, limit=PAGE))
        return dash.render(request, "messages.html",
                           {"page": page, "filters": filters, "states": STATES})

    async def message(request: Request) -> Response:
        ident = request.path_params["id"]
        found = await dash.run(lambda admin: admin.show(ident, body=True))
        return _message_page(request, found)

    async def dead_letter(request: Request) -> Response:
        ident = request.path_params["id"]
        found = await dash.run(lambda admin: admin.dead_show(ident, body=True))
        return _message_page(request, found)

    def _message_page(request: Request, found: dict[str, Any]) -> Response:
        body = found.get("body")
        preview = dash.templates.filters["pretty"](body) if body is not None else None
        cut = preview is not None and len(preview) > BODY_PREVIEW
        error = found.get("last_error")
        trace = error.get("traceback") if isinstance(error, dict) else None
        if trace is not None:  # shown on its own, as text
            error = {k: v for k, v in error.items() if k != "traceback"}
        return dash.render(request, "message.html", {
            "m": found, "preview": preview[:BODY_PREVIEW] if preview else None, "cut": cut,
            "error": error, "traceback": trace})

    async def dead(request: Request) -> Response:
        filters = {k: _arg(request, k) for k in ("queue", "task", "reason", "tenant")}
        after = _arg(request, "after")
        page = await dash.run(lambda admin: admin.dead_ls(
            queue=filters["queue"], task=filters["task"], reason=filters["reason"],
            tenant=filters["tenant"], after=after, limit=PAGE))
        return dash.render(request, "dead.html", {"page": page, "filters": filters,
                                                  "batch": BULK_BATCH})

    async def limits(request: Request) -> Response:
        key = _arg(request, "key")
        data = await dash.run(lambda admin: admin.limits(prefix=key, limit=100,
                                                          bound=dash.count_bound))
        return dash.render(request, "limits.html",
                           {**data, "key": key, "bound": dash.count_bound})

    async def workers(request: Request) -> Response:
        rows = await dash.run(lambda admin: admin.workers(leases=20))
        return dash.render(request, "workers.html", {"workers": rows})

    async def login(request: Request) -> Response:
        return dash.render(request, "login.html", {
            "failed": False, "next": safe_next(request.query_params.get("next"))})

    return [
        Route("/", overview, name="overview"),
        Route("/messages", messages, name="messages"),
        Route("/messages/{id}", message, name="message"),
        Route("/dead", dead, name="dead"),
        Route("/dead/{id}", dead_letter, name="dead_letter"),
        Route("/limits", limits, name="limits"),
        Route("/workers", workers, name="workers"),
        Route("/tenants", tenants, name="tenants"),
        Route("/login", login, name="login"),
    ]
