"""The actions (POST): pause, resume and purge a queue; requeue or cancel a message; requeue
or purge dead letters, one or by filter; sign in and out.

Every action goes through the same gate, in this order, and changes nothing when refused:
read-only mode (403, ``PGJ-432``); the write token, as a bearer header or a signed-in session
(403, ``PGJ-433``); with a session, the form's CSRF token (403, ``PGJ-434``). Then a form
without ``confirm=yes`` gets a confirmation page (a script sends ``confirm=yes`` itself; in a
browser the page's script asks ``confirm()`` and adds it), and only then does the action run,
through :class:`~kombu_pgjobs.admin.Admin` like the CLI's command of the same name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from ..admin import DEFAULT_BULK_LIMIT, Admin
from ..errors import (
    DashboardCsrfFailed,
    DashboardReadOnly,
    DashboardUnauthorized,
    InvalidArgument,
)
from .app import Dashboard, set_cookie, wants_json
from .security import CSRF_COOKIE, SESSION_COOKIE, SESSION_SECONDS

__all__ = ["action", "routes"]

log = logging.getLogger(__name__)

#: (what it does, in words) and (what it does, to the database)
Describe = Callable[[Mapping[str, str]], str]
Perform = Callable[[Admin, Mapping[str, str]], Any]


def _opt(params: Mapping[str, str], name: str) -> str | None:
    value = str(params.get(name) or "").strip()
    return value or None


def _limit(params: Mapping[str, str]) -> int:
    raw = _opt(params, "limit")
    if raw is None:
        return DEFAULT_BULK_LIMIT
    if not raw.isdigit():
        raise InvalidArgument(f"limit {raw!r} is not a whole number")
    return int(raw)


def _refuse_unknown(params: Mapping[str, str], keys: tuple[str, ...]) -> dict[str, Any]:
    """A bulk action given a filter it cannot apply is refused, never run on more rows than
    the filter names (a purge by task would have deleted every dead letter of the queue)."""
    given = [k for k in keys if _opt(params, k)]
    if given:
        raise InvalidArgument(
            f"this action cannot be limited by {', '.join(given)}: nothing was done; act on "
            "the rows one by one, or with the CLI's filters")
    return {}


def _bulk(what: str, params: Mapping[str, str], keys: tuple[str, ...]) -> str:
    """A bulk action in words: what, the filters given, and its bound."""
    given = "".join(f", {k} {params[k]}" for k in keys if _opt(params, k))
    return f"{what}{given} (at most {_limit(params)})"


async def _gate(dash: Dashboard, request: Request) -> FormData:
    """Refuse what may not run (see the module's docstring); the form of what may."""
    guard = dash.guard
    if not guard.write:
        raise DashboardReadOnly()
    authorization = request.headers.get("authorization")
    if authorization is not None:
        if not guard.bearer_ok(authorization):
            raise DashboardUnauthorized("the bearer token is wrong: nothing was changed")
        return await request.form()
    if not guard.session_ok(request.cookies.get(SESSION_COOKIE)):
        raise DashboardUnauthorized()
    form = await request.form()
    if not guard.csrf_ok(request.cookies.get(CSRF_COOKIE), _field(form, "csrf")):
        raise DashboardCsrfFailed()
    return form


def _field(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


def action(dash: Dashboard, describe: Describe, perform: Perform,
           back: Callable[[Mapping[str, str]], str]) -> Callable[[Request], Any]:
    """The handler of one action: the gate, the confirmation, then ``perform`` (its result
    as JSON for a script, as a page for a browser, with a link ``back``)."""

    async def handler(request: Request) -> Response:
        form = await _gate(dash, request)
        fields = {k: v for k, v in form.items()
                  if isinstance(v, str) and k not in ("csrf", "confirm")}
        params = {**fields, **{k: str(v) for k, v in request.path_params.items()}}
        what = describe(params)
        if _field(form, "confirm") != "yes":
            return dash.render(request, "confirm.html", {
                "what": what, "action": request.url.path, "fields": fields,
                "back": back(params)})
        result = await dash.run(lambda admin: perform(admin, params))
        log.info("pgjobs.dashboard.action %s", what,
                 extra={"action": "dashboard", "path": request.url.path})
        if wants_json(request):
            return JSONResponse(result)
        return dash.render(request, "result.html",
                           {"what": what, "result": result, "back": back(params)})

    return handler


def routes(dash: Dashboard) -> list[BaseRoute]:
    def act(describe: Describe, perform: Perform, back: Callable[[Mapping[str, str]], str]
            ) -> Callable[[Request], Any]:
        return action(dash, describe, perform, back)

    def to_overview(p: Mapping[str, str]) -> str:
        return "/"

    def to_message(p: Mapping[str, str]) -> str:
        return f"/messages/{p['id']}"

    def to_dead(p: Mapping[str, str]) -> str:
        return "/dead"

    async def login(request: Request) -> Response:
        guard = dash.guard
        if not guard.write:
            raise DashboardReadOnly()
        form = await request.form()
        if not guard.csrf_ok(request.cookies.get(CSRF_COOKIE), _field(form, "csrf")):
            raise DashboardCsrfFailed()
        if not guard.token_ok(_field(form, "token")):
            log.warning("pgjobs.dashboard.login_refused", extra={"action": "dashboard"})
            raise DashboardUnauthorized("the token is wrong: you are not signed in")
        response = RedirectResponse(dash.url(request, "/"), status_code=303)
        set_cookie(request, response, SESSION_COOKIE, guard.session_value(),
                   max_age=SESSION_SECONDS)
        return response

    async def logout(request: Request) -> Response:
        form = await request.form()
        if not dash.guard.csrf_ok(request.cookies.get(CSRF_COOKIE), _field(form, "csrf")):
            raise DashboardCsrfFailed()
        response = RedirectResponse(dash.url(request, "/"), status_code=303)
        set_cookie(request, response, SESSION_COOKIE, "", max_age=0)
        return response

    post = ["POST"]
    return [
        Route("/login", login, methods=post),
        Route("/logout", logout, methods=post),
        Route("/queues/{name:path}/pause", act(
            lambda p: f"Pause queue {p['name']}: claims skip it, running messages finish",
            lambda a, p: a.pause(p["name"]), to_overview), methods=post),
        Route("/queues/{name:path}/resume", act(
            lambda p: f"Resume queue {p['name']}",
            lambda a, p: a.pause(p["name"], paused=False), to_overview), methods=post),
        Route("/queues/{name:path}/purge", act(
            lambda p: f"Purge queue {p['name']}: delete up to {_limit(p)} ready, delayed and "
                      "waiting messages (running ones finish)",
            lambda a, p: a.purge(p["name"], limit=_limit(p)), to_overview), methods=post),
        Route("/messages/{id}/requeue", act(
            lambda p: f"Requeue message {p['id']}: run it now",
            lambda a, p: a.requeue([p["id"]]), to_message), methods=post),
        Route("/messages/{id}/cancel", act(
            lambda p: f"Cancel message {p['id']}: a queued one becomes a dead letter "
                      "(reason cancelled); a running one is stopped by its worker (with "
                      "celery_ext), then becomes one",
            lambda a, p: a.cancel([p["id"]]), to_message), methods=post),
        Route("/dead/requeue", act(
            lambda p: _bulk("Requeue dead letters", p, ("queue", "task", "tenant", "reason")),
            lambda a, p: a.dead_requeue(queue=_opt(p, "queue"), task=_opt(p, "task"),
                                        tenant=_opt(p, "tenant"), reason=_opt(p, "reason"),
                                        limit=_limit(p)),
            to_dead), methods=post),
        Route("/dead/purge", act(
            lambda p: _bulk("Purge dead letters", p, ("queue", "reason", "older_than")),
            lambda a, p: a.dead_purge(queue=_opt(p, "queue"), reason=_opt(p, "reason"),
                                      older_than=_opt(p, "older_than"), limit=_limit(p),
                                      **_refuse_unknown(p, ("task", "tenant"))),
            to_dead), methods=post),
        Route("/dead/{id}/requeue", act(
            lambda p: f"Requeue dead letter {p['id']}: back to ready, attempts from 0",
            lambda a, p: a.dead_requeue([p["id"]]), to_dead), methods=post),
        Route("/dead/{id}/purge", act(
            lambda p: f"Purge dead letter {p['id']}: delete it for good",
            lambda a, p: a.dead_purge([p["id"]]), to_dead), methods=post),
    ]
