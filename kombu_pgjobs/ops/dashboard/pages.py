"""The pages (GET): overview, messages, one message, dead letters, limits, tenants, audit (the
on-call pages, tasks, history and workers, are :mod:`.oncall`'s).

Each page is one call, or a few, into :class:`~kombu_pgjobs.store.admin.Admin` — the statements the
CLI runs, paged by index with keyset cursors (``?after=ID``) — rendered by a template. The
overview pages over queues by name (``?after=QUEUE``, :data:`QUEUE_PAGE` a page) with its own
statement (:mod:`.queries`), Celery's internal queues hidden unless ``?internal=1``.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from ...errors import NotFound
from ...store import audit
from ...store.admin import STATES, Admin
from .actions import BULK_BATCH
from .app import Dashboard, safe_next
from .queries import counter_series, queue_page

__all__ = ["chart", "routes"]

#: minutes of settle counters the overview's chart shows
CHART_MINUTES = 30
#: minutes the overview's "completed per minute" is averaged over
RATE_MINUTES = 5
#: rows per page of every listing
PAGE = 50
#: queues per page of the overview (each one costs a few bounded index reads)
QUEUE_PAGE = 50
#: characters of a message's body, headers or properties (pretty-printed), an error or a
#: traceback shown on its page: the rest is cut, and the part is a download away
#: (``/messages/<id>/raw/<part>``), so a 20 MiB header makes a page of a few hundred KiB
PART_PREVIEW = 64 * 1024
#: characters of the arguments (Celery's argsrepr/kwargsrepr headers) shown
ARGS_PREVIEW = 2000
#: the parts of a message that can be downloaded whole
PARTS = ("body", "headers", "properties")
#: settle outcomes drawn as "went wrong" in the chart (the rest: done)
BAD_OUTCOMES = ("failed", "dropped", "refused", "expired")


class Cut(str):
    """Text for a page, cut at a limit: ``cut`` says how much was left out."""

    cut: int = 0
    whole: int = 0


def _cut(text: Any, limit: int) -> Cut | None:
    """``text`` (a string, or anything shown as one) of at most ``limit`` characters."""
    if text is None:
        return None
    text = text if isinstance(text, str) else str(text)
    out = Cut(text[:limit])
    out.whole = len(text)
    out.cut = max(0, len(text) - limit)
    return out


def query_arg(request: Request, name: str) -> str | None:
    value = request.query_params.get(name, "").strip()
    return value or None


def chart(series: dict[str, list[int]], minutes: int = CHART_MINUTES,
          height: int = 28) -> dict[str, Any]:
    """One queue's settles per minute as SVG bars: good (completed, requeued, ...) under bad
    (failed, dropped, refused, expired), scaled to the busiest minute."""
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
        after = query_arg(request, "after")
        show_internal = request.query_params.get("internal") == "1"

        def read(admin: Admin) -> dict[str, Any]:
            page = queue_page(admin, after=after, limit=QUEUE_PAGE, bound=dash.count_bound,
                              show_internal=show_internal)
            series = counter_series(admin, [q["queue"] for q in page["items"]], CHART_MINUTES)
            return {"page": page, "series": series, "workers": admin.workers(leases=0)}

        data = await dash.run(read)
        queues = data["page"]["items"]
        for q in queues:
            mine = data["series"].get(q["queue"], {})
            q["chart"] = chart(mine)
            completed = sum(mine.get("completed", [])[-RATE_MINUTES:])
            q["completed_per_minute"] = round(completed / RATE_MINUTES, 3)
        return dash.render(request, "overview.html", {
            "queues": queues, "next": data["page"]["next"], "after": after,
            "internal": show_internal, "workers": data["workers"], "minutes": CHART_MINUTES,
            "rate_minutes": RATE_MINUTES, "bound": dash.count_bound, "per_page": QUEUE_PAGE})

    async def tenants(request: Request) -> Response:
        after = query_arg(request, "after")
        page = await dash.run(lambda admin: admin.tenants(after=after, limit=PAGE,
                                                          bound=dash.count_bound))
        return dash.render(request, "tenants.html", {"page": page, "bound": dash.count_bound})

    async def messages(request: Request) -> Response:
        filters = {k: query_arg(request, k) for k in ("queue", "state", "task", "tenant")}
        after = query_arg(request, "after")
        state = filters["state"]
        page = await dash.run(lambda admin: admin.ls(
            states=[state] if state else None, queue=filters["queue"], task=filters["task"],
            tenant=filters["tenant"], after=after, limit=PAGE))
        return dash.render(request, "messages.html",
                           {"page": page, "filters": filters, "states": STATES})

    async def message(request: Request) -> Response:
        ident = request.path_params["id"]
        found = await dash.run(lambda admin: _with_steps(admin, admin.show(ident, body=True)))
        return _message_page(request, found)

    async def dead_letter(request: Request) -> Response:
        ident = request.path_params["id"]
        found = await dash.run(lambda admin: _with_steps(admin,
                                                         admin.dead_show(ident, body=True)))
        return _message_page(request, found)

    def _with_steps(admin: Any, found: dict[str, Any]) -> dict[str, Any]:
        """The message and its durable steps (celery_ext.steps, issue 32), if any."""
        from ...store.steps import steps_for_page

        found["steps"] = steps_for_page(admin.conn, admin.schema, found.get("task_id"))
        return found

    def _message_page(request: Request, found: dict[str, Any]) -> Response:
        pretty = dash.templates.filters["pretty"]
        parts = {}
        for part in PARTS:
            value = found.get(part)
            parts[part] = _cut(pretty(value), PART_PREVIEW) if value is not None else None
        error = found.get("last_error")
        trace = error.get("traceback") if isinstance(error, dict) else None
        if trace is not None:  # shown on its own, as text
            error = {k: v for k, v in error.items() if k != "traceback"}
        return dash.render(request, "message.html", {
            "m": found, "parts": parts, "limit": PART_PREVIEW,
            "args": _cut(found.get("args"), ARGS_PREVIEW),
            "kwargs": _cut(found.get("kwargs"), ARGS_PREVIEW),
            "error": _cut(pretty(error), PART_PREVIEW) if error else None,
            "traceback": _cut(trace, PART_PREVIEW) if trace is not None else None,
            "base": "/dead/" if found.get("state") == "dead" else "/messages/"})

    def raw(dead_letters: bool) -> Any:
        async def download(request: Request) -> Response:
            """One part of a message, whole, as a JSON file: what its page cuts."""
            ident, part = request.path_params["id"], request.path_params["part"]
            if part not in PARTS:
                raise NotFound(f"a message has no part {part[:40]!r}: {', '.join(PARTS)}")
            found = await dash.run(lambda admin: (admin.dead_show if dead_letters
                                                  else admin.show)(ident, body=True))
            text = json.dumps(found.get(part), indent=2, sort_keys=True, default=str,
                              ensure_ascii=False)
            name = f"pgjobs-{'dead-letter' if dead_letters else 'message'}-{found['id']}-{part}"
            return Response(text.encode("utf-8"), media_type="application/json",
                            headers={"content-disposition": f'attachment; filename="{name}.json"'})

        return download

    async def dead(request: Request) -> Response:
        filters = {k: query_arg(request, k) for k in ("queue", "task", "reason", "tenant")}
        after = query_arg(request, "after")
        page = await dash.run(lambda admin: admin.dead_ls(
            queue=filters["queue"], task=filters["task"], reason=filters["reason"],
            tenant=filters["tenant"], after=after, limit=PAGE))
        return dash.render(request, "dead.html", {"page": page, "filters": filters,
                                                  "batch": BULK_BATCH})

    async def limits(request: Request) -> Response:
        key = query_arg(request, "key")
        data = await dash.run(lambda admin: admin.limits(prefix=key, limit=100,
                                                          bound=dash.count_bound))
        return dash.render(request, "limits.html",
                           {**data, "key": key, "bound": dash.count_bound})

    async def audit_log(request: Request) -> Response:
        """Who changed what, newest first (``?before=ID``: the next page)."""
        raw = query_arg(request, "before")
        if raw is not None and not raw.isdigit():
            raise NotFound(f"no audit page before {raw[:40]!r}")
        before = int(raw) if raw is not None else None

        def read(admin: Admin) -> list[dict[str, Any]]:
            dash.need(admin, audit.AUDIT_VERSION, "the audit log")
            return audit.ls(admin.conn, admin.schema, limit=PAGE, before=before)

        rows = await dash.run(read)
        for r in rows:
            r["target_text"] = json.dumps(r["target"], sort_keys=True, separators=(", ", ": "))
        more = rows[-1]["id"] if len(rows) == PAGE else None
        return dash.render(request, "audit.html", {"rows": rows, "more": more})

    async def login(request: Request) -> Response:
        return dash.render(request, "login.html", {
            "failed": False, "next": safe_next(request.query_params.get("next"))})

    return [
        Route("/", overview, name="overview"),
        Route("/messages", messages, name="messages"),
        Route("/messages/{id}", message, name="message"),
        Route("/messages/{id}/raw/{part}", raw(False), name="message_raw"),
        Route("/dead", dead, name="dead"),
        Route("/dead/{id}", dead_letter, name="dead_letter"),
        Route("/dead/{id}/raw/{part}", raw(True), name="dead_letter_raw"),
        Route("/limits", limits, name="limits"),
        Route("/tenants", tenants, name="tenants"),
        Route("/audit", audit_log, name="audit"),
        Route("/login", login, name="login"),
    ]
