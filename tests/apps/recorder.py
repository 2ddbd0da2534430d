"""A plain Celery app for end-to-end tests: nothing here imports kombu_pgjobs.

Each task records its execution in a table (``{schema}.pgjobs_test_run``) so tests count
executions from the database, not from the worker's logs.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("recorder", broker=common.broker())
app.conf.update(settings(
    task_acks_late=os.environ.get("PGJOBS_TEST_ACKS_LATE", "1") == "1"))


def _record(label: str, started: float) -> None:
    execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
        "VALUES (%s, %s, to_timestamp(%s), clock_timestamp())",
        (label, os.getpid(), started),
    )


@app.task(name="record")
def record(label: str) -> None:
    _record(label, time.time())


@app.task(name="sleep_record")
def sleep_record(label: str, seconds: float) -> None:
    started = time.time()
    execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
        (label, os.getpid()))
    time.sleep(seconds)
    _record(label, started)
