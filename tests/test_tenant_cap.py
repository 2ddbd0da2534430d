"""The tenant queue cap at publish (issue 12, item 5): ``pgjobs_tenant_max_queued = N``.

Real Postgres, counts read back from the job table; the edge race runs 8 separate processes.
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
from kombu_pgjobs.errors import InvalidLimit, TenantQueueFull


@pytest.fixture(autouse=True)
def _no_shared_tasks_left() -> Any:
    from celery import _state

    saved = set(_state._on_app_finalizers)
    yield
    _state._on_app_finalizers.intersection_update(saved)


def _app(schema: str, url: str, cap: Any = 3, **options: Any) -> tuple[Celery, Any, Any]:
    app = Celery(f"c{uuid.uuid4().hex[:6]}", broker=url)
    app.conf.update(broker_transport_options={"schema": schema, **options},
                    task_ignore_result=True, pgjobs_tenant_max_queued=cap)
    celery_ext.install(app)

    @app.task(name="cap.work", tenant=lambda i, org: org, shared=False)
    def work(i: int, org: str) -> None:
        pass

    @app.task(name="cap.keyed", tenant=lambda i, org: org,
              idempotency_key=lambda i, org: f"k{i}", shared=False)
    def keyed(i: int, org: str) -> None:
        pass

    return app, work, keyed


def _live(db: psycopg.Connection[Any], schema: str) -> dict[str | None, int]:
    return dict(db.execute(f'SELECT tenant, count(*) FROM "{schema}".pgjobs_job '
                           "GROUP BY tenant").fetchall())


def test_the_publish_past_the_cap_is_refused_and_other_tenants_are_not(db, schema, url) -> None:
    app, work, keyed = _app(schema, url, cap=3)
    for i in range(3):
        work.delay(i, "t1")
    with pytest.raises(TenantQueueFull) as err:
        work.delay(3, "t1")
    assert err.value.code == "PGJ-506"
    with pytest.raises(TenantQueueFull):
        work.apply_async((4, "t1"), countdown=600)  # delayed messages count too
    for i in range(3):
        work.delay(i, "t2")
    for _ in range(5):
        app.send_task("cap.untenanted")  # no tenant: nothing to cap
    assert _live(db, schema) == {"t1": 3, "t2": 3, None: 5}
    # A key already held is answered with its holder, not refused: it adds nothing.
    held = keyed.delay(1, "t3")
    keyed.delay(2, "t3")
    work.delay(0, "t3")
    assert keyed.delay(1, "t3").id == held.id
    with pytest.raises(TenantQueueFull):
        keyed.delay(3, "t3")
    assert _live(db, schema)["t3"] == 3

    # A message that runs and is acked makes room for one more.
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("celery")
        while True:
            m = q.get(timeout=5)
            if m.headers.get("x-pgjobs-tenant") == "t1":
                m.ack()
                break
            m.requeue()
        q.close()
    work.delay(5, "t1")
    with pytest.raises(TenantQueueFull):
        work.delay(6, "t1")
    assert _live(db, schema)["t1"] == 3


def test_a_batch_past_the_cap_writes_nothing(db, schema, url) -> None:
    app, work, _ = _app(schema, url, cap=3)
    work.delay(0, "t1")
    with pytest.raises(TenantQueueFull), kombu_pgjobs.batch():
        for i in range(3):
            work.delay(i, "t1")
        app.send_task("cap.untenanted")
    assert _live(db, schema) == {"t1": 1}
    with kombu_pgjobs.batch() as b:
        for i in range(2):
            work.delay(i, "t1")
        for i in range(3):
            work.delay(i, "t2")
    assert b.inserted == 5
    assert _live(db, schema) == {"t1": 3, "t2": 3}


def test_confirm_publish_false_refuses_at_the_publish_all_the_same(db, schema, url) -> None:
    _a, work, _ = _app(schema, url, cap=1, confirm_publish=False)
    work.delay(0, "t1")
    with pytest.raises(TenantQueueFull):
        work.delay(1, "t1")
    assert _live(db, schema) == {"t1": 1}


@pytest.mark.parametrize("cap", [0, -1, 1.5, "3", True, float("nan")])
def test_bad_setting_is_refused(url, cap) -> None:
    with pytest.raises(InvalidLimit):
        _app("unused", url, cap=cap)


def _racer(schema: str, url: str, barrier: Any, out: Any) -> None:
    app, work, _ = _app(schema, url, cap=10)
    ok = refused = 0
    with app.connection_for_write() as conn:
        conn.ensure_connection()
        barrier.wait(timeout=60)
        for i in range(5):
            try:
                work.apply_async((i, "edge"), connection=conn)
                ok += 1
            except TenantQueueFull:
                refused += 1
    out.put((ok, refused))


def test_racing_publishers_at_the_edge_never_exceed_the_cap(db, schema, url) -> None:
    _a, work, _ = _app(schema, url, cap=10)
    work.delay(0, "edge")  # the schema, migrated before the race; 9 places left
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(schema, url, barrier, out)) for _ in range(8)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(ok for ok, _ in results) == 9
    assert sum(refused for _, refused in results) == 31
    assert _live(db, schema) == {"edge": 10}


def test_dead_requeue_by_tenant_replays_that_tenant_only(db, schema, url, capsys) -> None:
    """`pgjobs dead requeue --all --tenant T`: tenant-scoped replay across queues, bounded."""
    import json

    from kombu_pgjobs.ops.cli.main import main as cli

    _a, work, _ = _app(schema, url, cap=100)
    for org in ("t1", "t1", "t2"):
        work.delay(0, org)
    work.apply_async((0, "t1"), queue="other")
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        for name in ("celery", "other"):
            q = conn.SimpleQueue(name)
            while True:
                try:
                    q.get(timeout=1).reject()
                except q.Empty:
                    break
            q.close()
    assert _live(db, schema) == {}

    def run(*argv: str) -> tuple[int, Any]:
        capsys.readouterr()
        code = cli([*argv, "--dsn", url, "--schema", schema, "--json"])
        return code, json.loads(capsys.readouterr().out)

    code, out = run("dead", "requeue", "--all", "--tenant", "t1", "--limit", "2")
    assert code == 0 and len(out["requeued"]) == 2 and out["remaining"] == 1
    code, out = run("dead", "requeue", "--all", "--tenant", "t1")
    assert code == 0 and len(out["requeued"]) == 1 and out["remaining"] == 0
    assert _live(db, schema) == {"t1": 3}, "revived rows get their tenant column back"
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone() == (1,)
    code, out = run("dead", "requeue", "--all")
    assert code == 2 and out["error"]["code"] == "PGJ-404"
