"""A Celery app with celery_ext and a result backend, for the Celery parity e2e tests (issue 16).

Results go to Celery's database backend in the test's schema (so ``result.get()`` can raise
``TaskRevokedError``). ``celery_ext.on_settled`` is received into ``{schema}.pgjobs_test_settled``
so tests count notifications from the database. Environment as tests/apps/recorder.py.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject

import celery_ext
from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("parity", broker=common.broker())
celery_ext.install(app)
app.conf.update(settings(
    task_acks_late=True,
    task_ignore_result=False,
    result_backend="db+" + common.dsn().replace("postgresql://", "postgresql+psycopg://", 1),
    database_table_schemas={"task": SCHEMA, "group": SCHEMA},
    result_extended=False,
))


def _record(label: str, started: float) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, to_timestamp(%s), clock_timestamp())",
            (label, os.getpid(), started))


@app.task(name="parity.record", shared=False)
def record(label: str) -> None:
    _record(label, time.time())


@app.task(name="parity.sleep", shared=False)
def sleep(label: str, seconds: float) -> None:
    started = time.time()
    time.sleep(seconds)
    _record(label, started)


@app.task(name="parity.fail", shared=False, dead_letter=False)
def fail(label: str) -> None:
    raise ValueError(f"boom {label}")


@app.task(name="parity.reject", shared=False)
def reject(label: str) -> None:
    raise Reject(f"{label}: the invoice is for a closed account", requeue=False)


@app.task(name="parity.lose_lease", shared=False, bind=True)
def lose_lease(self: Any, label: str) -> None:
    """Its lease is lost while it runs: another claim of its row (as a rescue and a re-delivery
    would make) moves the fence, so this run's ack misses."""
    execute(f'UPDATE "{SCHEMA}".pgjobs_job SET claim = claim + 1, '
            "cancelled_at = now() WHERE message -> 'headers' ->> 'id' = %s", (self.request.id,))
    _record(label, time.time())


@celery_ext.on_settled.connect
def _settled(sender: Any = None, outcome: str = "", task_id: str = "", attempts: int = 0,
             tenant: str | None = None, **_: Any) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_settled (task, outcome, task_id, attempts) '
            "VALUES (%s, %s, %s, %s)", (sender, outcome, task_id, attempts))
