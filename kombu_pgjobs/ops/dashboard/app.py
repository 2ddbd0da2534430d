"""The dashboard's ASGI app: one connection pool, the templates, errors as pages, the Host
check, the read gate, and the headers every answer carries.

``create_app(dsn)`` returns a Starlette app that can be served on its own (``pgjobs
dashboard``) or mounted under a prefix in another ASGI app (``Mount("/pgjobs", app=...)``):
every link and cookie path is built from the request's ``root_path``. The connection pool
opens on first use, not on the lifespan event, because a mounted app never receives one.

Who may do what is :mod:`.security`'s; here it is applied: every route but the sign-in page
and the static files goes through the read gate (:func:`gated`), and every action through
:func:`.actions._gate`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import psycopg
from jinja2 import Environment, FileSystemLoader, select_autoescape
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...errors import (
    DashboardCsrfFailed,
    DashboardHostRefused,
    DashboardLoginThrottled,
    DashboardReadOnly,
    DashboardSignInRequired,
    DashboardUnauthorized,
    DatabaseTimeout,
    DatabaseUnavailable,
    MigrationError,
    NotFound,
    PgJobsError,
    ScheduleEntryNotFound,
    StateConflict,
)
from ...store.admin import Admin
from ...store.database import TimeoutTranslatingCursor
from ...store.schema import current_version
from ..common import age_text, ts_text
from .security import CSRF_COOKIE, SESSION_COOKIE, Guard, Session

__all__ = ["Dashboard"]

log = logging.getLogger("kombu_pgjobs.dashboard.app")
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


def host_name(header: str) -> str:
    """The name of a ``Host`` header, without its port, lower case: ``[::1]:8787`` ->
    ``[::1]``, ``Dash.Example.:443`` -> ``dash.example``."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        return header[:end + 1] if end > 0 else header
    return header.split(":", 1)[0].rstrip(".")


class HostCheck:
    """Answers 400 (``PGJ-437``) to a request whose ``Host`` is not allowed: a page that a
    rebinding DNS name points at this port names its own host, never one of these. Entries:
    a name or address (``dash.example.com``, ``10.0.0.5``, ``[::1]``), ``*.example.com`` for
    its subdomains, ``*`` for any."""

    def __init__(self, app: ASGIApp, allowed: Sequence[str]) -> None:
        self.app = app
        self.any = "*" in allowed
        self.names = {host_name(a) for a in allowed if not a.startswith("*")}
        self.suffixes = tuple(a[1:].lower() for a in allowed if a.startswith("*."))

    def allows(self, header: str) -> bool:
        name = host_name(header)
        if not name:
            return False
        return self.any or name in self.names or (
            bool(self.suffixes) and name.endswith(self.suffixes))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.any:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope.get("headers", [])
                       if k == b"host"), "")
        if self.allows(header):
            await self.app(scope, receive, send)
            return
        error = DashboardHostRefused(f"this dashboard does not answer to Host {header[:80]!r}: "
                                     "start it with --allowed-host NAME if that is its name")
        log.warning("pgjobs.dashboard.host_refused %s", header[:80],
                    extra={"action": "dashboard"})
        response = JSONResponse({"error": {"code": error.code, "message": error.message}}, 400)
        await response(scope, receive, send)


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
    #: Secure on every cookie (True), or when the request came over HTTPS (None)
    secure_cookies: bool | None = None
    templates: Environment = field(init=False)
    _pool: ConnectionPool | None = field(default=None, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    _checked: bool = field(default=False, init=False)
    #: the schema version last read by :meth:`need` (a feature's page reads it until the
    #: schema is new enough, then trusts it)
    _version: int = field(default=0, init=False)
    #: the database as given (a pgjobs:// or postgresql:// URL): the broker the workers page
    #: asks the workers through (remote control)
    broker_url: str = ""
    #: with a shard map: (label, dashboard of that database) for the default database (this
    #: one) and each database of the map; the pages that span the map read each (:meth:`each`)
    shards: list[tuple[str, Dashboard]] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        env = Environment(loader=FileSystemLoader(HERE / "templates"),
                          autoescape=select_autoescape(default=True, default_for_string=True))
        env.filters.update(age=age_text, ts=ts_text, seg=lambda v: quote(str(v), safe=""),
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
        for _, other in self.shards:
            if other is not self:
                other.close()
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    async def each(self, fn: Callable[[Admin], T]) -> list[tuple[str | None, T]]:
        """``fn(admin)`` on every database of the shard map, the default one first, as
        (label, result); without a map, on this database only (label None)."""
        if not self.shards:
            return [(None, await self.run(fn))]
        return [(label, await other.run(fn)) for label, other in self.shards]

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

    def has(self, admin: Admin, version: int) -> bool:
        """Whether the schema is at ``version`` or later (read again only while it is not)."""
        if self._version < version:
            self._version = current_version(admin.conn, admin.schema)
        return self._version >= version

    def need(self, admin: Admin, version: int, feature: str) -> None:
        """Refuse a feature's page on a schema older than the version that made its tables
        (503, ``PGJ-701``): the other pages keep working."""
        if not self.has(admin, version):
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

    def rotate(self, *, token: str | None = None, read_token: str | None = None) -> None:
        """New tokens for a running dashboard (checked as at start): every session ends, and
        the old tokens open nothing from now on."""
        self.guard.rotate(token=token, read_token=read_token)
        log.warning("pgjobs.dashboard.tokens_rotated: every session ended",
                    extra={"action": "dashboard"})

    def render(self, request: Request, name: str, context: dict[str, Any],
               status: int = 200) -> Response:
        guard = self.guard
        cookie = request.cookies.get(SESSION_COOKIE)
        session = guard.session(cookie)
        nonce = request.cookies.get(CSRF_COOKIE)
        fresh = session is None and not guard.nonce_ok(nonce)
        if fresh:
            nonce = guard.new_nonce()
        csrf = session.csrf if session is not None else guard.login_csrf(nonce or "")
        page = self.templates.get_template(name).render(
            request=request, url=lambda path, **q: self.url(request, path, **q),
            csrf=csrf, write=guard.write, level=session.level if session else None,
            signed_in=session is not None and session.level == "write",
            sign_in=guard.sign_in, read_gate=guard.read_gate, schema=self.schema, **context)
        response = HTMLResponse(page, status_code=status)
        if fresh and nonce is not None:
            set_cookie(self, request, response, CSRF_COOKIE, nonce, max_age=None)
        if cookie is not None and session is None:  # ended, expired, unknown or malformed
            set_cookie(self, request, response, SESSION_COOKIE, "", max_age=0)
        return response


def client_of(request: Request) -> str:
    """The client's address (the proxy's, unless the server trusts its forwarded headers)."""
    return request.client.host if request.client else "unknown"


def access(dash: Dashboard, request: Request) -> tuple[str | None, Session | None]:
    """The level a request may act at (``read``, ``write`` or None) and its session: an
    ``Authorization: Bearer`` token if there is one (a wrong one counts toward the client's
    backoff and is refused, ``PGJ-433``; while the client must wait, ``PGJ-438``), else the
    session its cookie names. Found once per request."""
    found = request.scope.get("pgjobs.access")
    if found is not None:
        return found  # type: ignore[no-any-return]
    guard = dash.guard
    token = guard.bearer(request.headers.get("authorization"))
    if token is not None:
        client = client_of(request)
        throttled(guard, client)
        level = guard.level_of(token)
        if level is None:
            guard.throttle.fail(client)
            log.warning("pgjobs.dashboard.bearer_refused from %s", client,
                        extra={"action": "dashboard", "client": client})
            raise DashboardUnauthorized("the bearer token is wrong: nothing was read or "
                                        "changed")
        guard.throttle.succeed(client)
        result: tuple[str | None, Session | None] = (level, None)
    else:
        session = guard.session(request.cookies.get(SESSION_COOKIE))
        result = (session.level if session else None, session)
    request.scope["pgjobs.access"] = result
    return result


def throttled(guard: Guard, client: str) -> None:
    """Refuse a token try from a client that must still wait (``PGJ-438``)."""
    wait = guard.throttle.wait(client)
    if wait > 0:
        error = DashboardLoginThrottled(
            f"too many wrong tokens from {client}: try again in {math.ceil(wait)} s")
        error.retry_after = wait  # type: ignore[attr-defined]
        raise error


def gated(dash: Dashboard, app: ASGIApp) -> ASGIApp:
    """``app`` behind the read gate: with a read token, a request without a token (a live
    session or a bearer) is refused (``PGJ-439``: a browser is sent to sign in)."""

    async def gate(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and dash.guard.read_gate:
            level, _ = access(dash, Request(scope))
            if level is None:
                raise DashboardSignInRequired()
        await app(scope, receive, send)

    return gate


_NEXT = re.compile(r"^/(?![/\\])[\x21-\x7e]{0,2000}$")


def safe_next(value: str | None) -> str:
    """Where to go after signing in: a path inside the dashboard, never another site."""
    return value if value and _NEXT.match(value) and "\\" not in value else "/"


def set_cookie(dash: Dashboard, request: Request, response: Response, name: str, value: str,
               max_age: int | None) -> None:
    secure = dash.secure_cookies if dash.secure_cookies is not None else \
        request.url.scheme == "https"
    response.set_cookie(name, value, max_age=max_age, httponly=True, samesite="strict",
                        secure=secure,
                        path=request.scope.get("root_path", "").rstrip("/") or "/")


def status_of(exc: PgJobsError) -> int:
    if isinstance(exc, (DashboardReadOnly, DashboardUnauthorized, DashboardCsrfFailed)):
        return 403
    if isinstance(exc, DashboardSignInRequired):
        return 401
    if isinstance(exc, DashboardLoginThrottled):
        return 429
    if isinstance(exc, (NotFound, ScheduleEntryNotFound)):
        return 404
    if isinstance(exc, StateConflict):
        return 409
    if isinstance(exc, (DatabaseUnavailable, DatabaseTimeout, MigrationError)):
        return 503
    return 400


def wants_json(request: Request) -> bool:
    return "application/json" in request.headers.get("accept", "")


