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
    worker_soft_shutdown_timeout=float(os.environ.get("PGJOBS_TEST_SOFT_SHUTDOWN", "0")),
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


@app.task(name="parity.steps", shared=False)
def steps(label: str, n: int, seconds: float) -> None:
    """A long task in steps, checking for a cancel between them (celery_ext.checkpoint()):
    records its start, each step, and its end."""
    started = time.time()
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
            (label, os.getpid()))
    for _ in range(n):
        time.sleep(seconds)
        celery_ext.checkpoint()
    _record(label, started)


@app.task(name="parity.fail_kept", shared=False)
def fail_kept(label: str) -> None:
    """Fails for good; kept as a dead letter (dead_letter defaults to True)."""
    raise ValueError(f"kept {label}")


@app.task(name="parity.retry_once", shared=False, bind=True, default_retry_delay=0)
def retry_once(self: Any, label: str) -> None:
    """Retries once (Celery's retry: the same task id's next message), then completes."""
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    _record(label, time.time())


@app.task(name="parity.requeue_once", shared=False)
def requeue_once(label: str) -> None:
    """Requeues its message on its first delivery (Reject(requeue=True)), then completes."""
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
            (label, os.getpid()))
    runs = common.db().execute(f'SELECT count(*) FROM "{SCHEMA}".pgjobs_test_start '
                               "WHERE label = %s", (label,)).fetchone()[0]
    if runs == 1:
        raise Reject("once", requeue=True)
    _record(label, time.time())


@app.task(name="parity.early_fail", shared=False, acks_late=False)
def early_fail(label: str) -> None:
    """Acked when it starts (Celery's early ack), then fails for good."""
    time.sleep(0.5)
    raise ValueError(f"early {label}")
