"""``celery_ext.transaction()``: tasks published inside the app's transaction exist only if it
commits (the transactional outbox).

::

    with psycopg.connect(DSN) as conn, conn.transaction():   # or a SQLAlchemy Session,
        conn.execute("INSERT INTO orders ...")               # or Django's atomic()
        with celery_ext.transaction(conn):
            charge.delay(42)            # apply_async, send_task, chain/group/chord too

Inside the block every Celery publish of this thread (or asyncio task) is written in ``conn``'s
transaction: rollback, or an exception leaving the block, and the messages never existed;
commit, and workers see them (woken by the NOTIFY that commits with them). With a
``pgjobs://`` broker in the same database the rows go straight into the job table; with a
broker elsewhere they are staged in ``pgjobs_outbox`` and ``pgjobs relay`` publishes them
(at least once). Outside the block nothing changes. See docs/outbox.md and
:mod:`kombu_pgjobs.outbox`.

What it takes as ``conn``: a psycopg 3 connection; a SQLAlchemy ``Session`` or
``Connection`` (psycopg 3 driver) in a transaction (``with session.begin():``); nothing inside
Django's ``transaction.atomic()`` (the default database; ``using=`` for another). Anything else
is refused (``UnsupportedConnection``, PGJ-514), as is no argument when Django is missing or
not configured; a connection not in a transaction too (``NotInTransaction``, PGJ-510), nothing
written, and a transaction the app's code ended (or failed) inside the block, when it ends.

The staging schema (broker elsewhere) is ``schema=`` or the app setting
``pgjobs_outbox_schema`` (default ``"pgjobs"``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from celery import bootsteps, current_app
from celery._state import _get_active_apps

from kombu_pgjobs.broker import outbox
from kombu_pgjobs.broker.relay import Relay
from kombu_pgjobs.errors import ConfigurationError, NotInTransaction, UnsupportedConnection
from kombu_pgjobs.events import one_line
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.store.database import conninfo_from_url

__all__ = ["OutboxRelay", "hook_app", "psycopg_connection", "transaction"]

#: the app setting naming the schema of the outbox table in the app's database
SCHEMA_SETTING = "pgjobs_outbox_schema"


def _driver(dbapi: Any, what: str) -> psycopg.Connection[Any]:
    conn = getattr(dbapi, "driver_connection", dbapi)
    if not isinstance(conn, psycopg.Connection):
        raise UnsupportedConnection(
            f"{what} runs on {type(conn).__module__}.{type(conn).__name__}, not psycopg 3: "
            "use the postgresql+psycopg:// dialect (SQLAlchemy) or Django's psycopg 3 backend")
    return conn


def _django(conn: Any) -> psycopg.Connection[Any]:
    if not conn.in_atomic_block:
        raise NotInTransaction(
            "celery_ext.transaction() on Django's connection outside transaction.atomic(): "
            "open the atomic block first, then this one inside it")
    conn.ensure_connection()
    return _driver(conn.connection, f"Django database {conn.alias!r}")


def _django_connection(connections: Any, alias: str) -> Any:
    """Django's connection ``alias``; Django installed but not configured (no
    DJANGO_SETTINGS_MODULE, no ``settings.configure()``, a settings module that does not
    import) or no such alias is UnsupportedConnection: there is no Django connection to
    publish through, which is the same mistake as Django not being installed."""
    from django.core.exceptions import ImproperlyConfigured
    from django.utils.connection import ConnectionDoesNotExist

    try:
        return connections[alias]
    except (ImproperlyConfigured, ImportError) as exc:
        raise UnsupportedConnection(
            "celery_ext.transaction() without a connection uses Django's database, and "
            f"Django is not configured ({one_line(exc, 200)}): set DJANGO_SETTINGS_MODULE or call "
            "settings.configure() first, or pass the app's psycopg connection or SQLAlchemy "
            "Session") from None
    except ConnectionDoesNotExist:
        raise UnsupportedConnection(
            f"celery_ext.transaction(using={alias!r}): Django has no database {alias!r} in "
            "settings.DATABASES") from None


def psycopg_connection(conn: Any = None, *, using: str | None = None) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under ``conn`` (see the module docstring), checked to be in
    the app's transaction as its framework sees it."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if conn is None:
        try:
            from django.db import connections
        except ImportError:
            raise UnsupportedConnection(
                "celery_ext.transaction() without a connection is for Django (inside "
                "transaction.atomic()): pass the app's psycopg connection or SQLAlchemy "
                "Session") from None
        return _django(_django_connection(connections, using or "default"))
    if hasattr(conn, "in_atomic_block") and hasattr(conn, "alias"):  # a Django connection
        return _django(conn)
    kind = type(conn).__module__.split(".")[0]
    if kind == "sqlalchemy" and hasattr(conn, "in_transaction"):
        if not conn.in_transaction():
            raise NotInTransaction(
                f"the SQLAlchemy {type(conn).__name__} is not in a transaction: open one "
                "(`with session.begin():` / `with engine.begin() as conn:`), then this block "
                "inside it")
        sa_conn = conn.connection() if callable(getattr(conn, "connection", None)) else conn
        return _driver(sa_conn.connection, f"SQLAlchemy {type(conn).__name__}")
    raise UnsupportedConnection(
        f"celery_ext.transaction() cannot publish through a {type(conn).__name__}: give it a "
        "psycopg 3 connection, a SQLAlchemy Session or Connection, or nothing inside Django's "
        "atomic()")


class _StagingProducer:
    """The producer Celery publishes with inside a block: ``publish`` goes through
    :func:`kombu_pgjobs.outbox.publish` (the caller's transaction); everything else is the
    pooled producer's."""

    def __init__(self, producer: Any) -> None:
        self._producer = producer

    def publish(self, body: Any, **kwargs: Any) -> Any:
        return outbox.publish(self._producer, body, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._producer, name)


def hook_app(app: Any) -> None:
    """Route ``app``'s task publishes through the open block, if any (idempotent). Every
    Celery publish (``apply_async``, ``send_task``, canvas) goes through
    ``app.amqp.send_task_message``; outside a block the wrapper only calls it."""
    amqp = app.amqp
    if getattr(amqp, "_pgjobs_outbox_hooked", False):
        return
    send = amqp.send_task_message

    @functools.wraps(send)
    def send_task_message(producer: Any, name: str, message: Any, **options: Any) -> Any:
        if outbox.active() is None:
            return send(producer, name, message, **options)
        return send(_StagingProducer(producer), name, message, **options)

    amqp.send_task_message = send_task_message
    amqp._pgjobs_outbox_hooked = True


def _schema(app: Any, schema: str | None) -> str:
    if schema is not None:
        return schema
    conf = app.conf
    given = conf.get(SCHEMA_SETTING)
    if given:
        return str(given)
    return "pgjobs"


@contextmanager
def transaction(conn: Any = None, *, schema: str | None = None, using: str | None = None,
                app: Any = None) -> Iterator[outbox.Block]:
    """Publish this context's Celery tasks in ``conn``'s transaction for the block."""
    psy = psycopg_connection(conn, using=using)
    app = app or current_app._get_current_object()  # the app itself, never its proxy
    for each in {app, *_get_active_apps()}:  # every app of the process publishes through it
        hook_app(each)
    body_done = False
    try:
        with outbox.transaction(psy, schema=_schema(app, schema)) as block:
            yield block
            body_done = True
    except (psycopg.errors.InvalidSavepointSpecification,
            psycopg.errors.InFailedSqlTransaction) as exc:
        if not body_done:
            raise  # the app's own statement in the block: its error, untouched
        raise _ended_inside(exc) from None


def _ended_inside(exc: psycopg.Error) -> NotInTransaction:
    """The block's savepoint could not be released: the app's code ended the transaction
    inside the block (``conn.commit()``, ``COMMIT``, ``ROLLBACK``, a release of or rollback to
    a savepoint opened before the block) and went on, or a statement failed in the block and
    the app caught its error. Either way the block's messages and the app's writes no longer
    commit together: PGJ-510, as docs/outbox.md says, rather than the driver's "savepoint does
    not exist". (A transaction that ended with nothing run after it is refused the same way
    by :func:`kombu_pgjobs.outbox.transaction` itself.)"""
    if isinstance(exc, psycopg.errors.InFailedSqlTransaction):
        return NotInTransaction(
            "a statement failed inside the transaction() block and its error was caught: "
            "the transaction cannot commit (roll it back); let the error leave the block, "
            "or run the statement in a savepoint of its own (conn.transaction())")
    return NotInTransaction(
        "the transaction ended inside the transaction() block (a commit or rollback in it, or "
        "a savepoint opened before it released or rolled back to) and statements ran after "
        "it, outside the block's savepoint: roll back, and end the transaction after the "
        f"block ({one_line(exc, 120)})")


class OutboxRelay(bootsteps.StartStopStep):
    """Opt-in worker bootstep: the worker runs an outbox relay in a thread, so an app whose
    broker is elsewhere needs no separate ``pgjobs relay`` process::

        app.conf.pgjobs_outbox_dsn = "postgresql://app@db/shop"   # the app's database
        app.steps["worker"].add(celery_ext.OutboxRelay)

    It publishes to the app's own broker (``pgjobs_outbox_broker`` to override) from the
    staging schema (``pgjobs_outbox_schema``), ``pgjobs_outbox_relay_batch`` rows at a time
    (default 100) under a ``pgjobs_outbox_relay_lease_ttl`` lease (default 30 s). Every worker
    with the step relays; they share the table as separate ``pgjobs relay`` processes do."""

    label = "pgjobs outbox relay"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        super().__init__(parent, **kwargs)

    def start(self, parent: Any) -> None:
        conf = parent.app.conf
        dsn = conf.get("pgjobs_outbox_dsn")
        if not dsn:
            raise ConfigurationError(
                "celery_ext.OutboxRelay needs app.conf.pgjobs_outbox_dsn: the app's database, "
                "where celery_ext.transaction() stages messages")
        broker = conf.get("pgjobs_outbox_broker") or \
            parent.app.connection_for_write().as_uri(include_password=True)
        relay = Relay(conninfo_from_url(dsn, TransportOptions()), broker,
                      schema=_schema(parent.app, None),
                      batch=conf.get("pgjobs_outbox_relay_batch") or 100,
                      lease_ttl=conf.get("pgjobs_outbox_relay_lease_ttl") or 30.0)
        self._stop.clear()
        self._thread = threading.Thread(target=relay.run, args=(self._stop,),
                                        name="pgjobs-outbox-relay", daemon=True)
        self._thread.start()

    def stop(self, parent: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None
