"""Idempotency keys (issue 12, item 4): one live message per task, tenant and key.

Real Postgres, counts read back from the job table. The race runs 8 separate processes that
publish the same 100 keys at once through Celery's ``apply_async``.
"""

from __future__ import annotations

import multiprocessing
import uuid
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery

import celery_ext
import kombu_pgjobs
from kombu_pgjobs.errors import InvalidIdempotencyKey
from kombu_pgjobs.store.core import take_publish_outcome

from .conftest import DSN

TASK = "idem.work"


@pytest.fixture(autouse=True)
def _no_shared_tasks_left() -> Any:
    """Forget the shared tasks declared here, so other tests' apps stay clean."""
    from celery import _state

    saved = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(saved)


def _app(schema: str, url: str, **options: Any) -> tuple[Celery, Any]:
    """A celery_ext app with one keyed, tenanted task (``idem.work``)."""
    app = Celery(f"i{uuid.uuid4().hex[:6]}", broker=url)
    celery_ext.install(app)
    app.conf.update(broker_transport_options={"schema": schema, **options},
                    task_ignore_result=True)

    @app.task(name=TASK, tenant=lambda i, org="acme": org,
              idempotency_key=lambda i, org="acme": f"k{i}", shared=False)
    def work(i: int, org: str = "acme") -> None:
        pass

    return app, work


def _rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, str, str, str]]:
    """(task id, tenant, key, state) of every live row, by key."""
    return db.execute(
        f"SELECT message -> 'headers' ->> 'id', tenant, idempotency_key, "
        f"CASE WHEN delayed THEN 'delayed' ELSE state END "
        f'FROM "{schema}".pgjobs_job ORDER BY idempotency_key, id').fetchall()


def _publisher(schema: str, url: str, barrier: Any, out: Any) -> None:
    """One of the racing processes: publish keys k0..k99 once the others are ready."""
    app, work = _app(schema, url)
    with app.connection_for_write() as conn:
        conn.ensure_connection()
        barrier.wait(timeout=60)
        got = [(i, work.apply_async((i,), connection=conn).id) for i in range(100)]
    out.put(got)


# ---------------------------------------------------------------- the race

def test_eight_processes_racing_on_the_same_keys_insert_each_once(db, schema, url) -> None:
    app, work = _app(schema, url)
    with app.connection_for_write() as conn:  # the schema, migrated once before the race
        conn.ensure_connection()
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_publisher, args=(schema, url, barrier, out)) for _ in range(8)]
    for p in procs:
        p.start()
    answers = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    rows = _rows(db, schema)
    assert len(rows) == 100, "exactly one live row per key"
    holder = {key: task_id for task_id, _, key, _ in rows}
    assert len(set(holder.values())) == 100
    for got in answers:  # every caller was given the holder's task id
        assert {f"k{i}": tid for i, tid in got} == holder

    # Once the holders are acked the keys are free again.
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("celery")
        for _ in range(100):
            q.get(timeout=10).ack()
        q.close()
    assert _rows(db, schema) == []
    again = {i: work.apply_async((i,)).id for i in range(100)}
    rows = _rows(db, schema)
    assert len(rows) == 100
    assert {key: tid for tid, _, key, _ in rows} == {f"k{i}": again[i] for i in range(100)}
    assert not set(again.values()) & set(holder.values())


# ---------------------------------------------------------------- one process

def test_duplicate_returns_the_holder_and_tenant_and_task_scope_the_key(db, schema, url) -> None:
    app, work = _app(schema, url)

    @app.task(name="idem.other", tenant=lambda i, org="acme": org,
              idempotency_key=lambda i, org="acme": f"k{i}", shared=False)
    def other(i: int, org: str = "acme") -> None:
        pass

    first = work.delay(1)
    assert work.delay(1).id == first.id
    assert work.apply_async((1,)).id == first.id
    beta = work.delay(1, org="beta")  # another tenant: its own key space
    assert beta.id != first.id
    assert other.delay(1).id not in (first.id, beta.id)  # another task: its own key space
    explicit = work.apply_async((2,), idempotency_key="manual")  # a key per call wins
    assert work.apply_async((3,), idempotency_key="manual").id == explicit.id
    rows = _rows(db, schema)
    assert sorted((r[1], r[2]) for r in rows) == [
        ("acme", "k1"), ("acme", "k1"), ("acme", "manual"), ("beta", "k1")]


def test_eta_messages_hold_their_key(db, schema, url) -> None:
    _a, work = _app(schema, url)
    first = work.apply_async((7,), countdown=3600)
    assert work.apply_async((7,), countdown=60).id == first.id
    assert work.apply_async((7,)).id == first.id  # due now or later: the same key
    assert _rows(db, schema) == [(first.id, "acme", "k7", "delayed")]


def test_confirm_publish_false_still_answers_a_keyed_publish(db, schema, url) -> None:
    app, work = _app(schema, url, confirm_publish=False)
    plain = app.send_task("idem.plain")  # unconfirmed, then confirmed before the keyed one
    first = work.delay(1)
    assert work.delay(1).id == first.id
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 2
    assert plain.id != first.id


def test_batch_answers_each_duplicate_in_one_statement(db, schema, url) -> None:
    app, work = _app(schema, url)
    held = work.delay(1)
    with kombu_pgjobs.batch() as b:
        ids = [work.delay(i).id for i in (1, 2, 2, 3)]
        app.send_task("idem.plain")  # no key: inserted
        assert _rows(db, schema) == [(held.id, "acme", "k1", "ready")]
    assert b.inserted == 3
    assert b.duplicates == {ids[0]: held.id, ids[2]: ids[1]}
    rows = _rows(db, schema)
    assert [(r[0], r[2]) for r in rows if r[2]] == [(held.id, "k1"), (ids[1], "k2"),
                                                    (ids[3], "k3")]
    assert len(rows) == 4


def test_a_retry_under_the_same_task_id_takes_the_key_over(db, schema, url) -> None:
    """Celery's retry publishes the message again under its task id while the message it
    retries still runs (and holds the key): it is inserted, and the key moves to it."""
    headers = {"id": "task-1", "task": TASK, "x-pgjobs-tenant": "acme",
               "x-pgjobs-idempotency-key": "k1"}
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("q")
        q.put({"n": 1}, headers=headers)
        running = q.get(timeout=5)  # claimed, not acked: it holds k1
        q.put({"n": 2}, headers=headers)  # the retry
        assert take_publish_outcome("task-1").inserted
        q.put({"n": 3}, headers={**headers, "id": "task-2"})  # someone else: a duplicate
        outcome = take_publish_outcome("task-2")
        assert outcome is not None and outcome.duplicate
        retry_id = db.execute(f'SELECT max(id) FROM "{schema}".pgjobs_job').fetchone()[0]
        assert outcome.holder_job_id == retry_id and outcome.holder_task_id == "task-1"
        running.ack()
        q.close()
    assert db.execute(f'SELECT id, idempotency_key FROM "{schema}".pgjobs_job').fetchall() == [
        (retry_id, "k1")]


@pytest.mark.parametrize("key", ["", "x" * 201, "a\nb", 42, None])
def test_bad_keys_are_refused_and_nothing_is_written(db, schema, url, key) -> None:
    app, work = _app(schema, url)

    @app.task(name="idem.bad", idempotency_key=lambda: key if key is not None else 1 / 0,
              shared=False)
    def bad() -> None:
        pass

    with pytest.raises(InvalidIdempotencyKey) as err:
        bad.delay()
    assert err.value.code == "PGJ-505"
    if key is not None:
        with pytest.raises(InvalidIdempotencyKey):
            work.apply_async((1,), idempotency_key=key)
        with kombu.Connection(url, transport_options={"schema": schema}) as conn, \
                pytest.raises(InvalidIdempotencyKey):
            conn.SimpleQueue("q").put({}, headers={"x-pgjobs-idempotency-key": key})
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0
    else:  # refused before the transport was even reached
        assert db.execute("SELECT to_regclass(%s)", (f'"{schema}".pgjobs_job',)).fetchone() \
            == (None,)


def test_a_fixed_key_is_refused_at_the_decorator(url) -> None:
    app = celery_ext.install(Celery("fixed", broker=url))
    with pytest.raises(InvalidIdempotencyKey):
        @app.task(name="idem.fixed", idempotency_key="always-the-same", shared=False)
        def fixed() -> None:
            pass


def test_migrated_rows_keep_their_tenant(dsn, schema) -> None:
    """Rows published before version 7 get their tenant column from their header."""
    from kombu_pgjobs.store.schema import migrate, migrations

    with psycopg.connect(DSN, autocommit=True) as conn:
        assert migrations()[-1].version >= 7
        migrate(conn, schema)
        conn.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, message) VALUES '
                     """('q', '{"headers": {"x-pgjobs-tenant": "old"}}')""")
        conn.execute(f'UPDATE "{schema}".pgjobs_job SET tenant = NULL')
        text = next(m.text for m in migrations() if m.version == 7)
        update = text[text.index("UPDATE {schema}.pgjobs_job"):]
        update = update[:update.index(";") + 1].replace("{schema}", f'"{schema}"')
        conn.execute(update)
        assert conn.execute(f'SELECT tenant FROM "{schema}".pgjobs_job').fetchone() == ("old",)


def test_a_dead_message_frees_its_key_and_is_not_revived_beside_a_holder(db, schema,
                                                                         url) -> None:
    from kombu_pgjobs.store.admin import Admin

    _a, work = _app(schema, url)
    first = work.delay(1)
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("celery")
        q.get(timeout=5).reject()  # dead: the key is free
        q.close()
    second = work.delay(1)
    assert second.id != first.id
    with psycopg.connect(DSN, autocommit=True) as conn:
        admin = Admin(conn, schema)
        dead_id = db.execute(f'SELECT id FROM "{schema}".pgjobs_dead_letter').fetchone()[0]
        assert admin.dead_requeue([dead_id])["skipped"] == [dead_id]  # k1 is held
        db.execute(f'DELETE FROM "{schema}".pgjobs_job')  # the holder is gone
        assert admin.dead_requeue([dead_id])["requeued"][0]["id"] == dead_id
    assert _rows(db, schema) == [(first.id, "acme", "k1", "ready")]
    assert work.delay(1).id == first.id  # the revived message holds its key again
