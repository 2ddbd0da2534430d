"""The dashboard's ASGI app: one connection pool, the templates, errors as pages, and the
headers every answer carries.

``create_app(dsn)`` returns a Starlette app that can be served on its own (``pgjobs
dashboard``) or mounted under a prefix in another ASGI app (``Mount("/pgjobs", app=...)``):
every link and cookie path is built from the request's ``root_path``. The connection pool
opens on first use, not on the lifespan event, because a mounted app never receives one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import psycopg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..admin import Admin
from ..cli import _age, _ts
from ..database import TimeoutTranslatingCursor, conninfo_from_url
from ..errors import (
    DashboardCsrfFailed,
    DashboardReadOnly,
    DashboardTokenRequired,
    DashboardUnauthorized,
    DatabaseTimeout,
    DatabaseUnavailable,
    MigrationError,
    NotFound,
    PgJobsError,
    ScheduleEntryNotFound,
    StateConflict,
)
from ..options import TransportOptions, validate_schema_name
from ..schema import current_version
from .security import CSRF_COOKIE, MIN_TOKEN, SESSION_COOKIE, Guard

__all__ = ["Dashboard", "create_app"]

log = logging.getLogger(__name__)
HERE = Path(__file__).resolve().parent
T = TypeVar("T")

#: the overview counts each queue's rows up to this many per state ("1,000+" beyond): a
#: bounded read of the indexes whatever the table holds (Admin.queues(bound=...)); on a busy
#: table an index entry often costs a heap visit too (bench/dashboard.py)
COUNT_BOUND = 1_000
#: a page's statements may not run longer than this (seconds)
STATEMENT_TIMEOUT = 15.0
#: what every answer says about framing, sniffing, referrers and where scripts may come from
SECURITY_HEADERS = [
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """Adds :data:`SECURITY_HEADERS` to every response of the wrapped app."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"],
                                      *(h for h in SECURITY_HEADERS if h[0] not in names)]
            await send(message)

        await self.app(scope, receive, send_with_headers)


@dataclass
class Dashboard:
    """What the routes share: the pool, the schema, the guard and the templates."""

    conninfo: str
    schema: str
    guard: Guard
    pool_size: int = 4
    count_bound: int = COUNT_BOUND
    templates: Environment = field(init=False)
    _pool: ConnectionPool | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _checked: bool = field(default=False, init=False)
    #: the schema version last read by :meth:`need` (a feature's page reads it until the
    #: schema is new enough, then trusts it)
    _version: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        env = Environment(loader=FileSystemLoader(HERE / "templates"),
                          autoescape=select_autoescape(default=True, default_for_string=True))
        env.filters.update(age=_age, ts=_ts, seg=lambda v: quote(str(v), safe=""),
                           pretty=lambda v: json.dumps(v, indent=2, sort_keys=True, default=str,
                                                       ensure_ascii=False))
        self.templates = env

    def pool(self) -> ConnectionPool:
        with self._lock:
            if self._pool is None:
                self._pool = ConnectionPool(
                    self.conninfo, min_size=1, max_size=self.pool_size, open=True,
                    check=ConnectionPool.check_connection, name="pgjobs-dashboard",
                    kwargs={"autocommit": True, "prepare_threshold": None,
                            "cursor_factory": TimeoutTranslatingCursor})
            return self._pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def _run(self, fn: Callable[[Admin], T]) -> T:
        try:
            with self.pool().connection(timeout=10.0) as conn:
                admin = Admin(conn, self.schema)
                if not self._checked:
                    admin.check_schema()
                    self._checked = True
                return fn(admin)
        except PoolTimeout as exc:
            raise DatabaseUnavailable(f"no database connection in time: {exc}") from exc
        except psycopg.OperationalError as exc:
            raise DatabaseUnavailable(f"the database cannot be reached: {exc}") from exc

    def need(self, admin: Admin, version: int, feature: str) -> None:
        """Refuse a feature's page on a schema older than the version that made its tables
        (503, ``PGJ-701``): the other pages keep working."""
        if self._version < version:
            self._version = current_version(admin.conn, admin.schema)
        if self._version < version:
            raise MigrationError(f"schema {admin.schema!r} is at version {self._version}; "
                                 f"{feature} need version {version}: run `pgjobs migrate`")

    async def run(self, fn: Callable[[Admin], T]) -> T:
        """Run ``fn(admin)`` on a pooled connection, off the event loop."""
        return await run_in_threadpool(self._run, fn)

    # -- rendering ----------------------------------------------------------------------
    def url(self, request: Request, path: str, **query: Any) -> str:
        """A link inside the dashboard, under the prefix it is mounted at."""
        root = request.scope.get("root_path", "").rstrip("/")
        params = {k: v for k, v in query.items() if v not in (None, "")}
        return f"{root}{path}" + (f"?{urlencode(params)}" if params else "")

    def render(self, request: Request, name: str, context: dict[str, Any],
               status: int = 200) -> Response:
        nonce = request.cookies.get(CSRF_COOKIE)
        fresh = nonce is None
        if fresh:
            nonce = self.guard.new_nonce()
        assert nonce is not None
        page = self.templates.get_template(name).render(
            request=request, url=lambda path, **q: self.url(request, path, **q),
            csrf=self.guard.csrf_token(nonce), write=self.guard.write,
            signed_in=signed_in(self, request), schema=self.schema, **context)
        response = HTMLResponse(page, status_code=status)
        if fresh:
            set_cookie(request, response, CSRF_COOKIE, nonce, max_age=None)
        return response


def signed_in(dash: Dashboard, request: Request) -> bool:
    return dash.guard.session_ok(request.cookies.get(SESSION_COOKIE)) or \
        dash.guard.bearer_ok(request.headers.get("authorization"))


def set_cookie(request: Request, response: Response, name: str, value: str,
               max_age: int | None) -> None:
    response.set_cookie(name, value, max_age=max_age, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https",
                        path=request.scope.get("root_path", "").rstrip("/") or "/")


def _status(exc: PgJobsError) -> int:
    if isinstance(exc, (DashboardReadOnly, DashboardUnauthorized, DashboardCsrfFailed)):
        return 403
    if isinstance(exc, (NotFound, ScheduleEntryNotFound)):
        return 404
    if isinstance(exc, StateConflict):
        return 409
    if isinstance(exc, (DatabaseUnavailable, DatabaseTimeout, MigrationError)):
        return 503
    return 400


def wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


def create_app(dsn: str, *, schema: str = "pgjobs", write: bool = False,
               token: str | None = None, secret: bytes | None = None, pool_size: int = 4,
               count_bound: int = COUNT_BOUND, debug: bool = False) -> Starlette:
    """The dashboard for the pgjobs ``schema`` of the database at ``dsn`` (a pgjobs:// or
    postgresql:// URL). Read-only unless ``write`` is true, which needs ``token`` (at least
    16 characters): the operator signs in with it, or scripts send it as a bearer token.
    ``count_bound``: the overview's counts are exact up to this many per queue and state.
    ``secret`` signs the session and CSRF cookies (default: derived from the token, so every
    process given the same token agrees)."""
    from . import actions, pages, schedules, webhooks

    validate_schema_name(schema)
    if write and (not token or len(token) < MIN_TOKEN):
        raise DashboardTokenRequired()
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
    dash = Dashboard(conninfo=conninfo, schema=schema,
                     guard=Guard.make(write=write, token=token if write else None,
                                      secret=secret), pool_size=pool_size,
                     count_bound=count_bound)

    async def on_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, PgJobsError)
        status = _status(exc)
        if wants_json(request):
            return JSONResponse({"error": {"code": exc.code, "message": exc.message}},
                                status_code=status)
        return dash.render(request, "error.html", {"error": exc, "status": status}, status)

    async def on_db_error(request: Request, exc: Exception) -> Response:
        log.warning("pgjobs.dashboard.db_error %s", type(exc).__name__,
                    extra={"action": "dashboard"})
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        error = DatabaseUnavailable(f"database error: {message}")
        if wants_json(request):
            return JSONResponse({"error": {"code": None, "message": error.message}}, 503)
        return dash.render(request, "error.html", {"error": error, "status": 503}, 503)

    routes = [*pages.routes(dash), *schedules.routes(dash), *webhooks.routes(dash),
              *actions.routes(dash),
              Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static")]
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        dash.close()

    app = Starlette(debug=debug, routes=routes,
                    exception_handlers={PgJobsError: on_error, psycopg.Error: on_db_error},
                    lifespan=lifespan)
    app.state.dashboard = dash
    app.add_middleware(SecurityHeaders)
    return app
