"""The transactional outbox with the broker in the app's own database (issue 13, items 1-2):
``with celery_ext.transaction(conn):`` writes the task rows in the app's transaction.

Real Postgres, real `celery worker` processes; executions are counted from the database after
the worker drained everything (a sentinel task published after the others has run and the job
table is empty), never from logs.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import psycopg
import pytest
from celery import chord, group

import celery_ext
from kombu_pgjobs.errors import NotInTransaction, UnsupportedConnection
from kombu_pgjobs.store.schema import migrate

from .conftest import DSN, ROOT, wait_for

pytestmark = pytest.mark.e2e
APP = "tests.apps.outboxed"
REDIS_RESULT = "redis://127.0.0.1:6379/3"


def _env(schema: str, url: str, **extra: str) -> dict[str, str]:
    return {"PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_BROKER": url, "PGJOBS_TEST_DSN": DSN,
            **extra}


_LOADED: list[Any] = []


def _load(schema: str, url: str, **extra: str) -> Any:
    """tests/apps/outboxed.py imported for this test (to publish from this process)."""
    saved = dict(os.environ)
    os.environ.update(_env(schema, url, **extra))
    try:
        sys.modules.pop(APP, None)
        mod = importlib.import_module(APP)
        _LOADED.append(mod)
        return mod
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _runs(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    rows = db.execute(f'SELECT label, count(*) FROM "{schema}".pgjobs_test_run GROUP BY label')
    return dict(rows.fetchall())


@pytest.fixture(autouse=True)
def _results_released() -> Any:
    """Chord results subscribed to the Redis result backend are released while the
    interpreter still runs (their __del__ unsubscribes), not at its shutdown."""
    yield
    import gc

    for mod in _LOADED:
        pending = getattr(mod.app.backend, "_pending_results", None)
        if pending is not None:
            pending.concrete.clear()
    _LOADED.clear()
    gc.collect()


def _drained(db: psycopg.Connection[Any], schema: str, app: Any, sentinel: str) -> dict[str, int]:
    """Publish a sentinel outside any block, wait until it ran and the job table is empty:
    everything published before it that could run has run. The executions by label."""
    app.record.delay(sentinel)
    wait_for(lambda: _runs(db, schema).get(sentinel), 60, what=f"sentinel {sentinel}")
    wait_for(lambda: db.execute(f'SELECT count(*) = 0 FROM "{schema}".pgjobs_job')
             .fetchone()[0], 30, what="an empty job table")
    return _runs(db, schema)


def _jobs(db: psycopg.Connection[Any], schema: str) -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0]


@pytest.fixture
def orders(db: psycopg.Connection[Any], recorder_tables: str) -> str:
    """The app's own table, written in the same transactions as the tasks."""
    schema = recorder_tables
    migrate(db, schema)
    db.execute(f'CREATE TABLE "{schema}".orders (id int PRIMARY KEY)')
    return schema


def test_psycopg_rollback_never_runs_commit_runs_once_chord_once(
        db, orders, url, start_worker):
    schema = orders
    env = _env(schema, url, PGJOBS_TEST_RESULT=REDIS_RESULT)
    mod = _load(schema, url, PGJOBS_TEST_RESULT=REDIS_RESULT)
    start_worker(app=APP, env=env, concurrency=4)
    with psycopg.connect(DSN) as conn:
        with conn.transaction(force_rollback=True):  # rolled back: never existed
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (1)')
            with celery_ext.transaction(conn) as block:
                mod.record.delay("rolled-back")
                mod.app.send_task("record", ("rolled-back-send-task",))
                group(mod.record.s("rolled-back-group"), mod.record.s("rolled-back-group")
                      ).apply_async()
            assert block.written == 4 and block.staged == 0
        with conn.transaction():  # an exception leaves the block; the transaction commits
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (2)')
            with pytest.raises(ZeroDivisionError), celery_ext.transaction(conn):
                mod.record.delay("raised")
                1 / 0  # noqa: B018
        with conn.transaction():  # commits: each runs exactly once
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (3)')
            with celery_ext.transaction(conn):
                mod.record.delay("committed")
                mod.record.apply_async(("committed-apply",), countdown=0)
                mod.app.send_task("record", ("committed-send-task",))
                (mod.record.si("chain-1") | mod.record.si("chain-2")).delay()
                chord([mod.record.s(f"header-{i}") for i in range(3)],
                      mod.collect.s("callback")).delay()
                assert _jobs(db, schema) == 0, "nothing is visible before the commit"
    runs = _drained(db, schema, mod, "sentinel")
    assert not {k for k in runs if k.startswith(("rolled-back", "raised"))}, runs
    for label in ("committed", "committed-apply", "committed-send-task", "chain-1",
                  "header-0", "header-1", "header-2", "callback:header-0,header-1,header-2"):
        assert runs.get(label) == 1, (label, runs)
    wait_for(lambda: _runs(db, schema).get("chain-2"), 30, what="the chain's second step")
    assert _runs(db, schema)["chain-2"] == 1
    ids = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".orders ORDER BY id')]
    assert ids == [2, 3], "the app's own writes commit or roll back as the app decides"


def test_sqlalchemy_session_rollback_never_runs_commit_runs_once(
        db, orders, url, start_worker):
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    schema = orders
    mod = _load(schema, url, PGJOBS_TEST_RESULT=REDIS_RESULT)
    start_worker(app=APP, env=_env(schema, url, PGJOBS_TEST_RESULT=REDIS_RESULT),
                 concurrency=2)
    engine = create_engine(DSN.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session:
            with session.begin():
                session.execute(text(f'INSERT INTO "{schema}".orders VALUES (1)'))
                with celery_ext.transaction(session):
                    mod.record.delay("sa-rolled-back")
                session.rollback()
            with session.begin():
                session.execute(text(f'INSERT INTO "{schema}".orders VALUES (2)'))
                with celery_ext.transaction(session):
                    mod.record.delay("sa-committed")
                    chord([mod.record.s("sa-h1"), mod.record.s("sa-h2")],
                          mod.collect.s("sa-callback")).delay()
        with engine.begin() as sa_conn:  # a Connection works the same way
            with celery_ext.transaction(sa_conn):
                mod.record.delay("sa-connection")
        with pytest.raises(NotInTransaction), Session(engine) as session, \
                celery_ext.transaction(session):
            mod.record.delay("sa-no-transaction")
    finally:
        engine.dispose()
    runs = _drained(db, schema, mod, "sa-sentinel")
    assert "sa-rolled-back" not in runs and "sa-no-transaction" not in runs, runs
    assert runs.get("sa-committed") == 1 and runs.get("sa-connection") == 1, runs
    assert runs.get("sa-h1") == 1 and runs.get("sa-h2") == 1, runs
    wait_for(lambda: _runs(db, schema).get("sa-callback:sa-h1,sa-h2"), 30, what="callback")
    assert _runs(db, schema)["sa-callback:sa-h1,sa-h2"] == 1


def _django() -> Any:
    """Django configured for the test database (psycopg 3 backend), once per process."""
    django = pytest.importorskip("django")
    from django.conf import settings

    if not settings.configured:
        info = psycopg.conninfo.conninfo_to_dict(DSN)
        settings.configure(DATABASES={"default": {
            "ENGINE": "django.db.backends.postgresql", "NAME": info.get("dbname", "test"),
            "USER": info.get("user", "postgres"), "PASSWORD": info.get("password", ""),
            "HOST": info.get("host", "127.0.0.1"), "PORT": info.get("port", "5432")}},
            USE_TZ=True)
        django.setup()
    return django


def test_django_atomic_rollback_never_runs_commit_runs_once_chord_once(
        db, orders, url, start_worker):
    _django()
    from django.db import connection, transaction

    schema = orders
    mod = _load(schema, url, PGJOBS_TEST_RESULT=REDIS_RESULT)
    start_worker(app=APP, env=_env(schema, url, PGJOBS_TEST_RESULT=REDIS_RESULT),
                 concurrency=2)
    try:
        with pytest.raises(RuntimeError), transaction.atomic():
            connection.cursor().execute(f'INSERT INTO "{schema}".orders VALUES (1)')
            with celery_ext.transaction():
                mod.record.delay("dj-rolled-back")
            raise RuntimeError("the view failed after publishing")
        with transaction.atomic():
            connection.cursor().execute(f'INSERT INTO "{schema}".orders VALUES (2)')
            with celery_ext.transaction():
                mod.record.delay("dj-committed")
                chord([mod.record.s("dj-h1"), mod.record.s("dj-h2")],
                      mod.collect.s("dj-callback")).delay()
        with pytest.raises(NotInTransaction), celery_ext.transaction():  # outside atomic()
            mod.record.delay("dj-outside-atomic")
    finally:
        connection.close()
    runs = _drained(db, schema, mod, "dj-sentinel")
    assert not {k for k in runs if k in ("dj-rolled-back", "dj-outside-atomic")}, runs
    assert runs.get("dj-committed") == 1, runs
    assert runs.get("dj-h1") == 1 and runs.get("dj-h2") == 1, runs
    wait_for(lambda: _runs(db, schema).get("dj-callback:dj-h1,dj-h2"), 30, what="callback")
    assert _runs(db, schema)["dj-callback:dj-h1,dj-h2"] == 1
    ids = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".orders ORDER BY id')]
    assert ids == [2]


_KILLED = textwrap.dedent("""
    import os, signal, sys
    import psycopg
    import celery_ext
    from tests.apps import outboxed
    with psycopg.connect(os.environ["PGJOBS_TEST_DSN"]) as conn:
        with conn.transaction():
            with celery_ext.transaction(conn):
                outboxed.record.delay("survives-sigkill")
        # COMMIT has returned: nothing else runs in this process
        os.kill(os.getpid(), signal.SIGKILL)
""")


def test_sigkill_right_after_commit_the_task_still_runs(db, orders, url, start_worker):
    schema = orders
    env = {**os.environ, **_env(schema, url), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _KILLED], env=env, cwd=ROOT, timeout=60,
                          capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert _jobs(db, schema) == 1, "the row committed with the app's transaction"
    mod = _load(schema, url)
    start_worker(app=APP, env=_env(schema, url), concurrency=2)
    runs = _drained(db, schema, mod, "kill-sentinel")
    assert runs.get("survives-sigkill") == 1, runs


def test_no_transaction_is_refused_with_a_code_and_writes_nothing(db, orders, url):
    schema = orders
    mod = _load(schema, url)
    with psycopg.connect(DSN, autocommit=True) as conn:
        with pytest.raises(NotInTransaction) as err, celery_ext.transaction(conn):
            mod.record.delay("autocommit")
        assert err.value.code == "PGJ-510"
    with psycopg.connect(DSN) as conn:
        conn.execute("SELECT 1")
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(NotInTransaction), celery_ext.transaction(conn):  # failed txn
            mod.record.delay("failed-transaction")
        conn.rollback()
        with pytest.raises(NotInTransaction):  # the transaction ended inside the block
            with celery_ext.transaction(conn):
                mod.record.delay("committed-inside")
                conn.commit()
    with pytest.raises(UnsupportedConnection) as unsupported, \
            celery_ext.transaction(object()):
        pass
    assert unsupported.value.code == "PGJ-514"
    # only the message whose transaction the app committed inside the block was written
    labels = [r[0] for r in db.execute(
        f"""SELECT message->'headers'->>'argsrepr' FROM "{schema}".pgjobs_job""")]
    assert labels == ["('committed-inside',)"], labels


def test_blocks_nest_and_are_per_context(db, orders, url):
    """An inner block on another connection wins for its duration; another thread publishing
    meanwhile is not in either block (it commits on its own)."""
    import threading

    schema = orders
    mod = _load(schema, url)
    with psycopg.connect(DSN) as outer, psycopg.connect(DSN) as inner:
        with outer.transaction(), celery_ext.transaction(outer):
            mod.record.delay("outer")
            with inner.transaction(force_rollback=True), celery_ext.transaction(inner):
                mod.record.delay("inner")
                t = threading.Thread(target=lambda: mod.record.delay("other-thread"))
                t.start()
                t.join()
            assert _jobs(db, schema) == 1, "the other thread's task committed at once"
        assert _jobs(db, schema) == 2  # outer + other thread; inner rolled back


def test_an_asyncio_task_started_in_a_block_does_not_publish_in_it_after_it(db, orders, url):
    """asyncio tasks copy the context: one created inside the block sees it while the block
    is open, and publishes on its own once the block has exited."""
    import asyncio

    schema = orders
    mod = _load(schema, url)

    async def main() -> None:
        gate = asyncio.Event()

        async def later() -> None:
            await gate.wait()
            mod.record.delay("after-the-block")  # the block is over: commits on its own

        with psycopg.connect(DSN) as conn:
            with conn.transaction(force_rollback=True), celery_ext.transaction(conn):
                task = asyncio.get_running_loop().create_task(later())
                mod.record.delay("in-the-block")
            gate.set()
            await task
            conn.rollback()  # had it gone on the app's connection, it would be gone now

    asyncio.run(main())
    labels = [r[0] for r in db.execute(
        f"""SELECT message->'headers'->>'argsrepr' FROM "{schema}".pgjobs_job""")]
    assert labels == ["('after-the-block',)"]


def test_app_connections_with_their_own_row_and_cursor_factories(db, orders, url):
    """An app's connection made with row_factory=dict_row or cursor_factory=ClientCursor
    publishes the same (the outbox runs its statements with its own cursor)."""
    from psycopg.rows import dict_row

    schema = orders
    mod = _load(schema, url)
    ids = []
    for kwargs in ({"row_factory": dict_row}, {"cursor_factory": psycopg.ClientCursor}):
        with psycopg.connect(DSN, **kwargs) as conn, conn.transaction(), \
                celery_ext.transaction(conn):
            mod.record.delay("plain")
            # the guarded statement; the second and third are duplicates of the first
            ids.append(mod.keyed.apply_async(("k",), kwargs={"org": "acme"}).id)
            ids.append(mod.keyed.apply_async(("k",), kwargs={"org": "acme"}).id)
    assert len(set(ids)) == 1, "duplicates answer with the holder's task id"
    assert _jobs(db, schema) == 3  # two plain, one keyed


def test_a_schema_migrated_past_0008_without_it_gets_the_outbox_on_connect(db, schema, url):
    """Migration numbers are handed out ahead and merged out of order: a schema at a later
    version that lacks 0008 counts as behind, and the transport's auto-migrate adds it."""
    import kombu

    from kombu_pgjobs.store.schema import current_version, latest_version

    migrate(db, schema)
    db.execute(f'DROP TABLE "{schema}".pgjobs_outbox')
    db.execute(f'DELETE FROM "{schema}".pgjobs_migration WHERE version = 8')
    assert current_version(db, schema) == 7 < latest_version()
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        conn.connect()
    assert current_version(db, schema) == latest_version()
    assert db.execute("SELECT to_regclass(%s) IS NOT NULL",
                      (f'"{schema}".pgjobs_outbox',)).fetchone()[0]
