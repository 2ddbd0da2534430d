"""create_app: the dashboard as one Starlette app, every page module's routes behind the
read gate. It stands above the page modules (pages, oncall, schedules, webhooks,
actions), which stand on :mod:`.app` (the Dashboard and its helpers)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ...errors import (
    DashboardLoginThrottled,
    DashboardSignInRequired,
    DatabaseUnavailable,
    PgJobsError,
)
from ...options import TransportOptions, validate_schema_name
from ...shardmap import DEFAULT as SHARD_DEFAULT
from ...shardmap import parse as parse_shard_map
from ...shardmap import shard_label
from ...store.database import conninfo_from_url
from ...url import parse as parse_url
from .app import (
    COUNT_BOUND,
    HERE,
    STATEMENT_TIMEOUT,
    Dashboard,
    HostCheck,
    SecurityHeaders,
    gated,
    log,
    status_of,
    wants_json,
)
from .security import Guard

__all__ = ["create_app"]


def create_app(dsn: str, *, schema: str = "pgjobs", write: bool = False,
               token: str | None = None, read_token: str | None = None,
               allowed_hosts: Sequence[str] | None = None, secure_cookies: bool | None = None,
               secret: bytes | None = None, pool_size: int = 4,
               count_bound: int = COUNT_BOUND, debug: bool = False,
               shards: Any = None) -> Starlette:
    """The dashboard for the pgjobs ``schema`` of the database at ``dsn`` (a pgjobs:// or
    postgresql:// URL). Read-only unless ``write`` is true, which needs ``token`` (the write
    token): the operator signs in with it, or scripts send it as a bearer token.
    ``read_token``: every page needs it (or the write token); without it, whoever reaches the
    app reads every page. Tokens: at least 16 printable characters, not guessable
    (:func:`.security.check_token`; ``PGJ-431``/``PGJ-436``).
    ``allowed_hosts``: the ``Host`` names answered (others: 400, ``PGJ-437``); None answers
    any (the host app decides). ``secure_cookies``: True sets Secure on every cookie; None
    when the request came over HTTPS (as the server sees it: trust a proxy's
    ``X-Forwarded-Proto`` in the server, e.g. uvicorn's ``proxy_headers``).
    ``count_bound``: the overview's counts are exact up to this many per queue and state.
    ``secret`` keys the sign-in form's CSRF token (default: derived from the tokens, so every
    process given the same tokens agrees). Sessions live in this process (see
    :mod:`.security`). ``shards``: the transport's shard map (a mapping or its JSON, as
    ``pgjobs --shards``): the tasks and workers pages then span every database it names (the
    map's URLs take ``dsn``'s user and password where they give none, as the transport does);
    the other pages show the database of ``dsn``."""
    from . import actions, oncall, pages, schedules, webhooks

    validate_schema_name(schema)
    guard = Guard.make(write=write, token=token, read_token=read_token, secret=secret)
    conninfo = conninfo_from_url(dsn, TransportOptions(
        schema=schema, statement_timeout=STATEMENT_TIMEOUT,
        application_name=f"pgjobs-dashboard:{schema}"))  # what pg_stat_activity shows
    # Every statement a page runs is a bounded read in an index's order, and two planner
    # habits fought that on a big table (bench/dashboard.py, 1M rows): JIT, because a bounded
    # count's estimated cost passes jit_above_cost (compiling took 1 s for a statement that
    # runs in 50 ms); and bitmap scans, which read every delayed row of a queue and sort them
    # to count the first 1,001 (280 ms for the overview instead of 30)
    startup = conninfo_to_dict(conninfo).get("options") or ""
    conninfo = make_conninfo(
        conninfo, options=f"{startup} -c jit=off -c enable_bitmapscan=off".strip())
    dash = Dashboard(conninfo=conninfo, schema=schema, guard=guard, pool_size=pool_size,
                     count_bound=count_bound, secure_cookies=secure_cookies, broker_url=dsn)
    shardmap = parse_shard_map(shards)
    if shardmap is not None:
        options = TransportOptions(schema=schema, statement_timeout=STATEMENT_TIMEOUT,
                                   application_name=f"pgjobs-dashboard:{schema}")
        base = parse_url(dsn)
        dash.shards = [(SHARD_DEFAULT, dash)]
        seen = {conninfo}
        for shard_url in shardmap.urls:
            other = conninfo_from_url(shard_url, options, user=base.user, password=base.password)
            other = make_conninfo(
                other, options=f"{conninfo_to_dict(other).get('options') or ''} -c jit=off "
                               "-c enable_bitmapscan=off".strip())
            if other in seen:
                continue
            seen.add(other)
            dash.shards.append((shard_label(shard_url), Dashboard(
                conninfo=other, schema=schema, guard=guard, pool_size=pool_size,
                count_bound=count_bound, secure_cookies=secure_cookies)))

    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, PgJobsError)
        status = status_of(exc)
        if isinstance(exc, DashboardSignInRequired) and request.method in ("GET", "HEAD") \
                and not wants_json(request):
            root = request.scope.get("root_path", "").rstrip("/")
            path = request.url.path
            here = path[len(root):] if root and path.startswith(root) else path
            if request.url.query:
                here += f"?{request.url.query}"
            return RedirectResponse(dash.url(request, "/login", next=here), status_code=303)
        headers = {}
        if isinstance(exc, DashboardLoginThrottled):
            headers["retry-after"] = str(math.ceil(getattr(exc, "retry_after", 1.0)))
        if wants_json(request):
            return JSONResponse({"error": {"code": exc.code, "message": exc.message}},
                                status_code=status, headers=headers)
        response = dash.render(request, "error.html", {"error": exc, "status": status},
                               status)
        response.headers.update(headers)
        return response

    async def on_db_error(request: Request, exc: Exception) -> Response:
        log.warning("pgjobs.dashboard.db_error %s", type(exc).__name__,
                    extra={"action": "dashboard"})
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        error = DatabaseUnavailable(f"database error: {message}")
        if wants_json(request):
            return JSONResponse({"error": {"code": None, "message": error.message}}, 503)
        return dash.render(request, "error.html", {"error": error, "status": 503}, 503)

    routes: list[BaseRoute] = [*pages.routes(dash), *oncall.routes(dash), *schedules.routes(dash),
                               *webhooks.routes(dash), *actions.routes(dash)]
    for route in routes:  # every page and action, but signing in, is behind the read gate
        if isinstance(route, Route) and route.path not in ("/login", "/logout"):
            route.app = gated(dash, route.app)
    routes.append(Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"))
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        dash.close()

    app = Starlette(debug=debug, routes=routes,
                    exception_handlers={PgJobsError: on_error, psycopg.Error: on_db_error},
                    lifespan=lifespan)
    app.state.dashboard = dash
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=list(allowed_hosts))
    app.add_middleware(SecurityHeaders)  # the outermost: a refused Host gets them too
    return app
