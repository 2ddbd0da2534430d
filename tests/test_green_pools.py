"""Green pools end to end (issue 16, item 1): ``-P eventlet`` and ``-P gevent`` workers (and
``-P solo``, the compatibility table's other single-threaded pool) run tasks published while they
wait, answer ``inspect ping`` and stop warm within 10 s.

Under eventlet the worker used to run what it claimed at start-up and then never wake: psycopg
waited in C and the self-pipe's green ``os.read`` blocked the loop (kombu_pgjobs/green.py).
Counts come from the table the tasks write to.
"""

from __future__ import annotations

import time

import pytest

from .conftest import wait_for
from .test_celery_e2e import _app, _runs

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("pool", ["eventlet", "gevent", "solo"])
def test_pool_runs_tasks_answers_ping_and_stops_warm(
        pool, db, recorder_tables, url, start_worker):
    schema = recorder_tables
    rec = _app(schema, url)
    worker = start_worker(name=f"green-{pool}", pool=pool,
                          concurrency=1 if pool == "solo" else 20)
    time.sleep(1.0)  # idle first: the bug was a loop that never woke for new work
    with rec.app.connection_for_write() as conn:
        for i in range(200):
            rec.record.apply_async((f"t{i}",), connection=conn)
    wait_for(lambda: sum(_runs(db, schema).values()) >= 200, 60, what="200 executions")
    runs = _runs(db, schema)
    assert len(runs) == 200 and set(runs.values()) == {1}

    replies = rec.app.control.ping(timeout=10.0, limit=1)
    assert any(f"green-{pool}@" in name for reply in replies for name in reply), replies

    rec.sleep_record.delay("last", 1.0)  # running at SIGTERM: a warm stop lets it finish
    wait_for(lambda: db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_test_start').fetchone()[0] == 1, 20,
        what="the last task to start")
    began = time.monotonic()
    assert worker.stop(timeout=10.0) == 0, worker.output()[-3000:]
    assert time.monotonic() - began < 10.0
    assert _runs(db, schema).get("last") == 1, "the running task finished"
    left = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE queue = %s',
                      ("celery",)).fetchone()[0]
    assert left == 0, "every run was acked"
