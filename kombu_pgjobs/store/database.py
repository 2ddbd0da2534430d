"""Where the database is: broker URL -> libpq conninfo, embedded server, connections.

Drivers errors are translated here and nowhere else: an unreachable server becomes
:class:`~kombu_pgjobs.errors.DatabaseUnavailable`, which the transport lists among kombu's
``connection_errors`` so Celery retries as it does for Redis or RabbitMQ; a statement cancelled
by the ``lock_timeout``/``statement_timeout`` options becomes
:class:`~kombu_pgjobs.errors.DatabaseTimeout`, a channel error (the connection is fine: no
reconnect loop); a prepared statement the server does not have (or has from another client)
becomes :class:`~kombu_pgjobs.errors.PoolerUnsupported`, a configuration error (a transaction
pooler in front, with the default session mode: no retry can clear it).

Every conninfo built here carries, besides what the URL says:

* TLS from kombu's ``ssl`` (``broker_use_ssl``, ``Connection(ssl=...)``, ``?ssl=`` in the URL),
  mapped to libpq's ``sslmode``/``sslrootcert``/``sslcert``/``sslkey`` or refused
  (:class:`~kombu_pgjobs.errors.InvalidSSL`): never silently dropped;
* TCP keepalives (a server that vanished without a FIN is noticed in about a minute, not after
  the kernel's two hours), overridable in ``connect_options``;
* the ``lock_timeout`` and ``statement_timeout`` options as startup parameters (libpq
  ``options=-c ...``): applied when the session starts, so they hold for every statement and a
  ``RESET`` returns to them. PgBouncer refuses unknown startup parameters: set both options to
  0 there (no ``options`` is sent) and set the timeouts on the role instead.
"""

from __future__ import annotations

import logging
import ssl as ssl_module
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import parse_qsl

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..errors import (
    DatabaseTimeout,
    DatabaseUnavailable,
    EmbeddedServerError,
    InvalidOption,
    InvalidSSL,
    InvalidURL,
    PoolerUnsupported,
)
from ..green import cooperate
from ..options import TransportOptions
from ..url import parse as parse_url

__all__ = [
    "DEFAULT_EMBEDDED_DB",
    "KEEPALIVES",
    "PREPARED_STATEMENT_ERRORS",
    "RawTimeoutTranslatingCursor",
    "TimeoutTranslatingCursor",
    "connect",
    "conninfo_from_parts",
    "conninfo_from_url",
    "pooler_error",
    "ssl_parameters",
    "timeout_error",
]

log = logging.getLogger("kombu_pgjobs")

DEFAULT_EMBEDDED_DB = "pgjobs"

#: TCP keepalives on every connection (ignored on Unix sockets): probe after 30 s idle, every
#: 10 s, give up after 3 misses. An idle LISTEN connection then learns of a dead peer within a
#: minute. Any of them can be overridden in connect_options.
KEEPALIVES: dict[str, str] = {"keepalives": "1", "keepalives_idle": "30",
                              "keepalives_interval": "10", "keepalives_count": "3"}

#: libpq's own TLS parameters, accepted as they are in ``ssl`` and in the URL query
LIBPQ_SSL_KEYS = frozenset({
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslpassword", "sslcrl", "sslcrldir",
    "sslsni", "sslcompression", "sslcertmode", "sslnegotiation", "ssl_min_protocol_version",
    "ssl_max_protocol_version",
})
SSL_MODES = frozenset({"disable", "allow", "prefer", "require", "verify-ca", "verify-full"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off", "none"})
#: kombu/Redis (ssl_*) and py-amqp (bare) names of Python ssl settings -> libpq parameters
_FILE_KEYS = {"ca_certs": "sslrootcert", "certfile": "sslcert", "keyfile": "sslkey",
              "password": "sslpassword"}
#: URL parts: in connect_options they are merged when the URL leaves them out
_URL_KEYS = ("user", "password", "dbname")
#: refused in connect_options: the URL's host and port are always used
_HOST_KEYS = ("host", "hostaddr", "port")


def _cert_reqs(value: Any) -> int:
    if isinstance(value, bool):
        raise InvalidSSL(f"ssl cert_reqs must be CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED, "
                         f"got {value!r}")
    if isinstance(value, int):
        if value in (ssl_module.CERT_NONE, ssl_module.CERT_OPTIONAL, ssl_module.CERT_REQUIRED):
            return int(value)
    elif isinstance(value, str):
        name = value.strip().lower().removeprefix("cert_")
        found = {"none": ssl_module.CERT_NONE, "optional": ssl_module.CERT_OPTIONAL,
                 "required": ssl_module.CERT_REQUIRED}.get(name)
        if found is not None:
            return int(found)
    raise InvalidSSL(f"ssl cert_reqs must be CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED, "
                     f"got {value!r}")


def ssl_parameters(ssl: Any) -> dict[str, str]:
    """kombu's ``ssl`` (Celery's ``broker_use_ssl``) as libpq parameters.

    * ``True`` (or ``"true"``, ``"1"``: ``?ssl=true`` in the URL) -> ``sslmode=require``:
      encrypted, as ``ssl=True`` is on Redis and RabbitMQ;
    * a libpq sslmode name (``?ssl=verify-full``) -> that sslmode;
    * a mapping of libpq names (``sslmode``, ``sslrootcert``, ``sslcert``, ``sslkey``, ...),
      or of Python ssl names as kombu's Redis (``ssl_cert_reqs``, ``ssl_ca_certs``,
      ``ssl_certfile``, ``ssl_keyfile``, ``ssl_check_hostname``) and py-amqp (``cert_reqs``,
      ``ca_certs``, ``certfile``, ``keyfile``) take them. ``CERT_NONE`` -> ``require``;
      ``CERT_REQUIRED``/``CERT_OPTIONAL`` (the same for a client in Python) -> ``verify-full``,
      or ``verify-ca`` when ``check_hostname`` is False. A mapping that names no mode verifies,
      as Python's default context does; with no CA file given, against the system's trusted
      roots (``sslrootcert=system``, as Python loads them);
    * ``False``/``None``/empty: nothing (libpq's defaults and connect_options apply).

    Anything else (a ciphers list, an SSLContext, ``server_hostname``) raises
    :class:`InvalidSSL`: a TLS setting pgjobs cannot honour is never dropped silently.
    """
    if ssl is None or ssl is False or (isinstance(ssl, Mapping) and not ssl):
        return {}
    if ssl is True:
        return {"sslmode": "require"}
    if isinstance(ssl, str):
        text = ssl.strip().lower()
        if text in _TRUE:
            return {"sslmode": "require"}
        if text in _FALSE:
            return {}
        if text in SSL_MODES:
            return {"sslmode": text}
        raise InvalidSSL(f"ssl={ssl!r} is not a boolean or a libpq sslmode "
                         f"({', '.join(sorted(SSL_MODES))})")
    if not isinstance(ssl, Mapping):
        raise InvalidSSL(f"ssl must be True, a libpq sslmode or a mapping, got "
                         f"{type(ssl).__name__}: pass file names (ca_certs, certfile, keyfile), "
                         "not an SSLContext")
    out: dict[str, str] = {}
    reqs: int | None = None
    check_hostname: bool | None = None
    for raw_key, value in ssl.items():
        key = str(raw_key)
        if value is None:
            continue
        if key in LIBPQ_SSL_KEYS:
            out[key] = str(value)
            continue
        bare = key.removeprefix("ssl_")
        if bare == "cert_reqs":
            reqs = _cert_reqs(value)
        elif bare == "check_hostname":
            check_hostname = bool(value)
        elif bare in _FILE_KEYS:
            out[_FILE_KEYS[bare]] = str(value)
        else:
            raise InvalidSSL(
                f"ssl setting {key!r} has no libpq equivalent: use sslmode, sslrootcert, "
                "sslcert, sslkey (or cert_reqs, ca_certs, certfile, keyfile)")
    if "sslmode" in out:
        if out["sslmode"] not in SSL_MODES:
            raise InvalidSSL(f"sslmode {out['sslmode']!r} is not one of "
                             f"{', '.join(sorted(SSL_MODES))}")
        if reqs is not None:
            raise InvalidSSL("give either sslmode or cert_reqs in ssl, not both")
        return out
    if reqs == ssl_module.CERT_NONE:
        out["sslmode"] = "require"
    elif check_hostname is False:
        out["sslmode"] = "verify-ca"
    else:
        out["sslmode"] = "verify-full"
        out.setdefault("sslrootcert", "system")
    return out


def _merge(base: dict[str, Any], extra: Mapping[str, Any], what: str) -> None:
    """Add ``extra`` to ``base``; a key both give with different values is refused."""
    for key, value in extra.items():
        if key in base and base[key] is not None and str(base[key]) != str(value):
            # a password (sslpassword, password) is never repeated in an error
            shown = (lambda v: "**") if "password" in key else repr
            raise InvalidSSL(
                f"{what} sets {key}={shown(value)} but connect_options sets "
                f"{key}={shown(base[key])}: give it once")
        base[key] = value


def _timeouts(options: TransportOptions, extra: dict[str, Any]) -> None:
    """lock_timeout/statement_timeout as startup parameters, before the caller's own libpq
    ``options`` (connect_options), if any: the later ``-c`` wins, so a timeout set there
    explicitly is kept. 0 sends nothing: the server's (or role's) setting applies."""
    flags = [f"-c {name}={round(value * 1000)}"
             for name, value in (("lock_timeout", options.lock_timeout),
                                 ("statement_timeout", options.statement_timeout)) if value > 0]
    if flags:
        extra["options"] = " ".join([*flags, *([extra["options"]] if extra.get("options")
                                               else [])])


def conninfo_from_parts(*, host: str | None, port: int | str | None, user: str | None,
                        password: str | None, dbname: str | None,
                        options: TransportOptions, ssl: Any = None) -> str:
    """Build a libpq conninfo; with no host, start or reuse the embedded server.

    ``host`` may list several hosts (``db1,db2``) and ``port`` one port per host (``5432,5433``)
    or one for all: libpq tries them in order and, unless ``connect_options`` names another
    ``target_session_attrs``, takes the first that accepts writes (``read-write``), so a
    reconnect after a failover finds the promoted standby.

    ``ssl`` is kombu's ``Connection.ssl`` (see :func:`ssl_parameters`). ``connect_options``
    may give ``user``, ``password`` or ``dbname`` when the URL leaves them out (a password
    kept out of the URL, say); the same key given differently in both is refused, and so are
    ``host``/``port`` (use the URL) and pgjobs's own settings (see TransportOptions.parse)."""
    dbname = (dbname or "").removeprefix("/") or None  # kombu gives "/" for no path
    if dbname is not None and "/" in dbname:
        raise InvalidURL(f"database name {dbname!r} is invalid: use pgjobs://host/dbname")
    for one in str(port).split(",") if port is not None else ():
        if not one.strip().isdigit() or not 0 < int(one) < 65536:
            raise InvalidURL(f"port {one!r} is out of range 1-65535")
    extra: dict[str, Any] = dict(options.connect_options or {})
    for key in _HOST_KEYS:
        if key in extra:
            raise InvalidOption(f"connect_options[{key!r}] collides with the broker URL: put "
                                "the host and port in the URL (pgjobs://user@host:port/db)")
    given = {"user": user or None, "password": password or None, "dbname": dbname}
    for key in _URL_KEYS:
        if key in extra:
            value = extra.pop(key)
            if given[key] is not None and given[key] != value:
                raise InvalidOption(
                    f"connect_options[{key!r}] differs from the {key} in the broker URL: "
                    "give it once (in the URL, or in connect_options with the URL leaving "
                    "it out)")
            given[key] = value
    tls = ssl_parameters(ssl)
    shown = ({k: "**" if "password" in str(k) else v for k, v in ssl.items()}
             if isinstance(ssl, Mapping) else ssl)
    _merge(extra, tls, f"ssl={shown!r}")
    for key, value in KEEPALIVES.items():
        extra.setdefault(key, value)
    _timeouts(options, extra)
    if not host:
        try:
            from .embedded import ensure_server
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise EmbeddedServerError(
                "pgjobs:// with no host needs the embedded server: "
                "pip install 'kombu-pgjobs[embedded]' (or give a host)") from exc
        try:
            base = ensure_server(given["dbname"] or DEFAULT_EMBEDDED_DB,
                                 data_dir=options.embedded_data_dir)
        except Exception as exc:
            raise EmbeddedServerError(f"embedded PostgreSQL failed to start: {exc}") from exc
        return make_conninfo(base, application_name=options.application_name,
                             connect_timeout=max(1, int(options.connect_timeout)), **extra)
    if "," in host:
        extra.setdefault("target_session_attrs", "read-write")
    return make_conninfo(
        host=host, port=port or 5432, user=given["user"], password=given["password"],
        dbname=given["dbname"] or given["user"] or "postgres",
        application_name=options.application_name,
        connect_timeout=max(1, int(options.connect_timeout)), **extra)


def conninfo_from_url(url: str, options: TransportOptions, *, user: str | None = None,
                      password: str | None = None, ssl: Any = None) -> str:
    """Parse ``pgjobs://user:pass@host:port/db`` (also postgresql://; several hosts:
    ``db1:5432,db2:5432``) into a conninfo. ``user``/``password``/``ssl`` are used where the
    URL gives none (kombu's ``Connection(userid=..., ssl=...)``)."""
    parts = parse_url(url)
    query_ssl = _query_ssl(parts.query)
    if query_ssl is not None and ssl:
        raise InvalidSSL("TLS is given twice, in the URL query and in ssl= (broker_use_ssl): "
                         "give it once")
    return conninfo_from_parts(
        host=parts.host, port=parts.port, user=parts.user or user,
        password=parts.password or password, dbname=parts.dbname, options=options,
        ssl=query_ssl if query_ssl is not None else ssl)


def _query_ssl(query: str) -> Any:
    """TLS in a URL query (``?ssl=true``, ``?sslmode=require&sslrootcert=...``), as the kombu
    URL carries it; any other query parameter is refused."""
    if not query:
        return None
    pairs: Iterable[tuple[str, str]] = parse_qsl(query, keep_blank_values=True)
    tls: dict[str, str] = {}
    flag: str | None = None
    for key, value in pairs:
        if key == "ssl":
            flag = value
        elif key in LIBPQ_SSL_KEYS:
            tls[key] = value
        else:
            raise InvalidURL(f"URL query parameter {key!r} is not supported: put connection "
                             "parameters in the connect_options transport option (only ssl "
                             "and libpq's ssl* parameters are read from the URL)")
    if flag is not None:
        if tls:
            tls.setdefault("sslmode", ssl_parameters(flag).get("sslmode", "prefer"))
            return tls
        return flag
    return tls or None


#: What a server says when its prepared statements are not the connection's: one the connection
#: prepared is missing (26000), or one of the same name is already there (42P05). Through a
#: transaction pooler each statement may run on another server connection, shared with other
#: clients, so psycopg's prepared statements (``_pg3_0``, ``_pg3_1``...) fail this way.
PREPARED_STATEMENT_ERRORS = (psycopg.errors.InvalidSqlStatementName,
                             psycopg.errors.DuplicatePreparedStatement)


class _TranslatesTimeouts:
    """A statement cancelled by lock_timeout (55P03) or statement_timeout (57014) raises
    :class:`DatabaseTimeout`, a channel error with a code, instead of psycopg's
    ``OperationalError``, which kombu would take for a broken connection (and Celery would
    reconnect over, in a loop, while the lock is held). On a connection that prepares its
    statements, a prepared statement the server does not have (or has from another client)
    raises :class:`PoolerUnsupported` (see :func:`pooler_error`)."""

    def execute(self, query: Any, params: Any = None, *, prepare: bool | None = None,
                binary: bool | None = None) -> Any:
        try:
            return super().execute(query, params,  # type: ignore[misc]
                                   prepare=prepare, binary=binary)
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            raise timeout_error(exc) from exc
        except PREPARED_STATEMENT_ERRORS as exc:
            pooler = pooler_error(exc, self.connection)  # type: ignore[attr-defined]
            if pooler is None:
                raise
            raise pooler from exc

    def executemany(self, query: Any, params_seq: Any, *, returning: bool = False) -> None:
        try:
            super().executemany(query, params_seq, returning=returning)  # type: ignore[misc]
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            raise timeout_error(exc) from exc
        except PREPARED_STATEMENT_ERRORS as exc:
            pooler = pooler_error(exc, self.connection)  # type: ignore[attr-defined]
            if pooler is None:
                raise
            raise pooler from exc


class TimeoutTranslatingCursor(_TranslatesTimeouts, psycopg.Cursor[Any]):
    """Every pgjobs connection's cursor: timeouts raise :class:`DatabaseTimeout`, a pooler
    that loses prepared statements :class:`PoolerUnsupported`."""


class RawTimeoutTranslatingCursor(_TranslatesTimeouts, psycopg.RawCursor[Any]):
    """The same for a statement whose placeholders are numbered (``$1``; see
    :func:`kombu_pgjobs.store.sql.positional`)."""


def timeout_error(exc: psycopg.Error) -> DatabaseTimeout:
    """The coded error for a statement cancelled by a timeout (psycopg's LockNotAvailable or
    QueryCanceled): for code that reads results itself (a claim in flight, pipeline mode) and
    so does not go through :class:`TimeoutTranslatingCursor`."""
    which = ("lock_timeout" if isinstance(exc, psycopg.errors.LockNotAvailable)
             else "statement_timeout")
    return DatabaseTimeout(
        f"a statement was cancelled by {which} ({str(exc).strip()}): another session holds "
        f"a lock too long, or the statement ran away; raise the {which!r} transport option "
        "if it was legitimately slow")


def pooler_error(exc: BaseException,
                 conn: psycopg.Connection[Any] | None) -> PoolerUnsupported | None:
    """The coded error for a prepared statement the server does not have, or has from another
    client (:data:`PREPARED_STATEMENT_ERRORS`), on a connection that prepares its statements
    (the transport's default, ``use_listen_notify=True``): a transaction pooler sits in front
    of PostgreSQL. None for any other error, or on a connection that prepares nothing (where
    the error is not the pooler's: it is raised as it is). For :class:`_TranslatesTimeouts`
    and for code that reads results itself (a claim in flight).

    A :class:`~kombu_pgjobs.errors.ConfigurationError`: neither a kombu connection error nor
    a recoverable one, so kombu's ``ensure`` (a publish's retry) and Celery's consumer do not
    reconnect over it in a loop; it is raised at the caller, and a worker stops with it."""
    if not isinstance(exc, PREPARED_STATEMENT_ERRORS):
        return None
    if conn is not None and conn.prepare_threshold is None:
        return None
    return PoolerUnsupported(
        "the server does not hold this connection's prepared statements "
        f"({str(exc).strip()}): a transaction pooler (PgBouncer with pool_mode = "
        "transaction) sits in front of PostgreSQL, and the transport's default mode "
        "(prepared statements, LISTEN) needs a session. Set the transport option "
        "use_listen_notify=False (broker_transport_options; no prepared statements, "
        "polling: docs/operations.md, Behind PgBouncer), or pool in session mode")


def connect(conninfo: str, *, autocommit: bool = True,
            prepare: bool = True) -> psycopg.Connection[Any]:
    """Open a connection; raise DatabaseUnavailable (a kombu connection error) on failure.

    Hot statements are prepared on first use (no parse per call). ``prepare=False`` for
    PgBouncer in transaction pooling, where a prepared statement may not exist on the next
    server.
    """
    # Prepared on first use. The claim writes its LIMIT into the text (sql.with_limit), so
    # its generic plan reads the index in order at any depth; the claim connection forces
    # generic plans (Backend.connect(hot=True)).
    threshold = 0 if prepare else None
    cooperate()  # psycopg's waits yield to eventlet's hub under -P eventlet (green.py)
    try:
        try:
            return psycopg.connect(conninfo, autocommit=autocommit, prepare_threshold=threshold,
                                   cursor_factory=TimeoutTranslatingCursor)
        except psycopg.OperationalError as exc:
            if "unsupported startup parameter: options" not in str(exc):
                raise
        # A pooler (PgBouncer) that refuses startup options: connect without them, so the
        # timeouts are the server's or the role's (ALTER ROLE ... SET lock_timeout = ...).
        params = conninfo_to_dict(conninfo)
        params.pop("options", None)
        global _warned_pooler
        if not _warned_pooler:
            _warned_pooler = True
            log.warning("pgjobs.connect.no_startup_options the server (a pooler such as "
                        "PgBouncer) refuses startup options: lock_timeout and "
                        "statement_timeout come from the role's or server's settings; set "
                        "them there (ALTER ROLE ... SET), or set both options to 0 to say so",
                        extra={"action": "connect"})
        return psycopg.connect(make_conninfo(**params), autocommit=autocommit,
                               prepare_threshold=threshold,
                               cursor_factory=TimeoutTranslatingCursor)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {exc}".strip()) from exc


_warned_pooler = False
