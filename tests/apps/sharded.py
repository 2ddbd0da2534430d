"""A Celery app whose broker spreads queues over two databases (a shard map from
``PGJOBS_TEST_SHARDS``, JSON). Tasks record what they did in the test database's schema, so
tests count executions from the database. Imports neither kombu_pgjobs nor (unless
``PGJOBS_TEST_CELERY_EXT=1``) celery_ext."""

from __future__ import annotations

import json
import os
import time

from celery import Celery

from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("sharded", broker=common.broker())
if os.environ.get("PGJOBS_TEST_CELERY_EXT") == "1":
    import celery_ext

    celery_ext.install(app)
app.conf.update(settings(task_acks_late=True))
app.conf.broker_transport_options["shards"] = json.loads(
    os.environ.get("PGJOBS_TEST_SHARDS", "{}"))
app.conf.broker_transport_options["event_loop"] = \
    os.environ.get("PGJOBS_TEST_EVENT_LOOP", "1") == "1"


@app.task(name="sharded.record", shared=False)
def record(label: str, seconds: float = 0.0) -> None:
    """Sleeps ``seconds`` on its first start only (a redelivered one runs at once)."""
    started = time.time()
    first = common.db().execute(
        f'SELECT count(*) = 0 FROM "{SCHEMA}".pgjobs_test_start WHERE label = %s',
        (label,)).fetchone()
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
            (label, os.getpid()))
    if seconds and first and first[0]:
        time.sleep(seconds)
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, to_timestamp(%s), clock_timestamp())",
            (label, os.getpid(), started))


@app.task(name="sharded.fail", shared=False)
def fail(label: str) -> None:
    raise ValueError(f"boom {label}")
