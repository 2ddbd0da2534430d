"""Groups and chords batch by themselves with celery_ext.install(app) (issue 35, item 1).

A plain ``group(...).apply_async()`` of a celery_ext app on pgjobs is one INSERT, committed
when it returns, all or none, with the ids Celery gave it. Everything is read back from the
database (rows, their transaction ids, executions recorded by real ``celery worker``
processes) or counted on the wire; each test also runs Celery's own path (an app without
celery_ext) where the difference shows, so it can fail.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from celery import chord, group
from kombu.exceptions import EncodeError

import kombu_pgjobs
from kombu_pgjobs.errors import MessageError

from .conftest import import_app, wait_for
from .wirecount import WireCounter

pytestmark = pytest.mark.e2e
APP = "tests.apps.grouped"


REDIS_RESULT = "redis://127.0.0.1:6379/3"


def _load(schema: str, url: str, *, plain: bool = False, result: str = "") -> Any:
    mod = import_app(APP, schema, url, PGJOBS_TEST_PLAIN="1" if plain else "0",
                     PGJOBS_TEST_RESULT=result)
    _LOADED.append(mod)
    with mod.app.connection_for_write() as conn:  # migrated, queue declared: not in counts
        conn.ensure_connection(max_retries=3)
        mod.app.amqp.queues[mod.app.conf.task_default_queue](conn.default_channel).declare()
    return mod


_LOADED: list[Any] = []


@pytest.fixture(autouse=True)
def _results_released() -> Any:
    """Chord results subscribed to a Redis result backend are released while the interpreter
    still runs (their __del__ unsubscribes), not at its shutdown."""
    yield
    import gc

    for mod in _LOADED:
        pending = getattr(mod.app.backend, "_pending_results", None)
        if pending is not None:
            pending.concrete.clear()
    _LOADED.clear()
    gc.collect()


def _rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, str, str | None, str]]:
    """(task id, task name, group id, inserting transaction) of every queued message."""
    return db.execute(
        f"SELECT message -> 'headers' ->> 'id', task, message -> 'headers' ->> 'group', "
        f'xmin::text FROM "{schema}".pgjobs_job ORDER BY id').fetchall()


def _runs(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    rows = db.execute(f'SELECT label, count(*) FROM "{schema}".pgjobs_test_run GROUP BY label')
    return dict(rows.fetchall())


def test_group_is_committed_at_return_runs_each_member_once_with_celerys_ids(
        db, recorder_tables, url, start_worker):
    schema = recorder_tables
    # Celery's own path, for contrast: one transaction per member
    plain = _load(schema, url, plain=True)
    group([plain.record.s(f"p{i}") for i in range(5)]).apply_async()
    stock = _rows(db, schema)
    assert len({r[3] for r in stock}) == 5
    mod = _load(schema, url)
    n = 300
    result = group([mod.record.s(f"m{i}") for i in range(n)]).apply_async()
    rows = _rows(db, schema)[len(stock):]  # before any worker: committed at return
    assert len(rows) == n
    assert [r[0] for r in rows] == [r.id for r in result.results], "Celery's ids, in order"
    assert {r[2] for r in rows} == {result.id}
    assert len({r[3] for r in rows}) == 1, "one transaction for the whole group"
    start_worker(app=APP, concurrency=4)
    assert result.get(timeout=120) == [f"m{i}" for i in range(n)]
    expected = {**{f"m{i}": 1 for i in range(n)}, **{f"p{i}": 1 for i in range(5)}}
    wait_for(lambda: len(_runs(db, schema)) == len(expected), 60, what="every member")
    time.sleep(1.0)  # let any duplicate show up
    assert _runs(db, schema) == expected, "every member exactly once"


def test_group_publishes_in_one_statement(dsn, schema):
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    with WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432))) as wire:
        proxied = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
                   f"{info.get('dbname', 'test')}")

        def sent(publish: Any) -> dict[str, int]:
            before, texts = wire.count(), dict(wire.by_text)
            publish()
            during = {k: v - texts.get(k, 0) for k, v in wire.by_text.items()
                      if v - texts.get(k, 0)}
            assert sum(during.values()) == wire.count() - before
            return during

        mod = _load(schema, proxied)
        group([mod.record.s("warm")]).apply_async()  # the producer's queue declared
        during = sent(lambda: group([mod.record.s(f"g{i}") for i in range(200)]).apply_async())
        assert sum(during.values()) == 1, during
        ((text, _),) = during.items()
        assert text.startswith("INSERT INTO") and "pgjobs_job" in text, during

        with mod.app.producer_or_acquire() as producer:  # group.apply_async(producer=...)
            during = sent(lambda: group([mod.record.s(f"p{i}") for i in range(50)]
                                        ).apply_async(producer=producer))
            assert "maybe_declare" not in vars(producer), "the producer is given back as it was"
        assert sum(during.values()) == 1, during

        # a chord: its header and the result backend's chord_unlock, one statement
        during = sent(lambda: chord([mod.square.s(i) for i in range(20)],
                                    mod.total.s("c")).apply_async())
        assert sum(during.values()) == 1, during

        plain = _load(schema, proxied, plain=True)  # Celery's own group: one per message
        group([plain.record.s("warm")]).apply_async()
        during = sent(lambda: group([plain.record.s(f"s{i}") for i in range(20)]).apply_async())
        assert sum(during.values()) == 20, during


def test_a_bad_member_publishes_nothing_of_the_group(db, schema, url):
    mod = _load(schema, url)
    count = f'SELECT count(*) FROM "{schema}".pgjobs_job'
    # refused by the transport (a NUL character cannot be stored), the third of four
    bad = [mod.record.s("a"), mod.record.s("b"), mod.record.s("c\x00"), mod.record.s("d")]
    with pytest.raises(MessageError) as info:
        group(bad).apply_async()
    assert any("nothing of this group" in note for note in getattr(info.value, "__notes__", [
        "nothing of this group"]))
    assert db.execute(count).fetchone()[0] == 0
    # refused by Celery's serializer
    with pytest.raises(EncodeError):
        group([mod.record.s("a"), mod.record.s(object())]).apply_async()
    assert db.execute(count).fetchone()[0] == 0
    # a chord: its header and the chord_unlock the database backend sends before it
    with pytest.raises(EncodeError) as chord_error:
        chord([mod.square.s(1), mod.square.s(object())], mod.total.s("x")).apply_async()
    assert db.execute(count).fetchone()[0] == 0
    notes = getattr(chord_error.value, "__notes__", None)
    assert notes is None or len(notes) == 1, notes
    # in an outer batch that catches the error and goes on: its own message only
    with kombu_pgjobs.batch():
        mod.record.delay("outer")
        with pytest.raises(MessageError):
            group(bad).apply_async()
    labels = [r[0] for r in db.execute(
        f"SELECT message -> 'headers' ->> 'argsrepr' FROM \"{schema}\".pgjobs_job")]
    assert labels == ["('outer',)"]
    # Celery's own group publishes the members before the bad one
    plain = _load(schema, url, plain=True)
    with pytest.raises(MessageError):
        group([plain.record.s("a"), plain.record.s("b"), plain.record.s("c\x00")]).apply_async()
    assert db.execute(count).fetchone()[0] == 3


@pytest.mark.parametrize("backend", ["database", "redis"])
def test_chord_header_and_unlock_in_one_transaction_and_completes(
        db, recorder_tables, url, start_worker, backend):
    """The database backend waits with ``celery.chord_unlock`` (published with the header);
    Redis joins natively (the chord's size is stored before the header's INSERT)."""
    schema = recorder_tables
    result_url = REDIS_RESULT if backend == "redis" else ""
    mod = _load(schema, url, result=result_url)
    result = chord([mod.square.s(i) for i in range(30)], mod.total.s("sum")).apply_async()
    rows = _rows(db, schema)
    unlock = ["celery.chord_unlock"] if backend == "database" else []
    assert sorted({r[1] for r in rows}) == [*unlock, "grouped.square"]
    assert sum(r[1] == "grouped.square" for r in rows) == 30
    assert len({r[3] for r in rows}) == 1, "the chord's messages in one transaction"
    assert {r[0] for r in rows if r[1] == "grouped.square"} == \
        {r.id for r in result.parent.results}
    start_worker(app=APP, concurrency=4, env={"PGJOBS_TEST_RESULT": result_url})
    assert result.get(timeout=120) == sum(i * i for i in range(30))
    assert _runs(db, schema) == {f"sum={sum(i * i for i in range(30))}": 1}


def test_other_brokers_and_eager_mode_are_left_to_celery(schema, url):
    """A group given a producer of another broker runs Celery's own group through the
    wrapper (a bad member leaves the members before it published), and so does eager mode."""
    mod = _load(schema, url)
    memory = mod.app.connection_for_write("memory://")
    with memory as conn, conn.Producer() as producer:  # producer= of another broker
        queue = mod.app.amqp.queues[mod.app.conf.task_default_queue](conn.default_channel)
        queue.declare()
        with pytest.raises(EncodeError):
            group([mod.record.s("a"), mod.record.s(object())]).apply_async(producer=producer)
        assert queue.purge() == 1, "the first member went out at once"
    mod.app.conf.task_always_eager = True
    try:
        assert group([mod.square.s(3)]).apply_async().get() == [9]
    finally:
        mod.app.conf.task_always_eager = False
