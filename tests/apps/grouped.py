"""A celery_ext app with a result backend, for tests/test_group_batch.py: groups and chords
published as one batch. Results go to Celery's database backend in the test's schema (chords
wait with ``celery.chord_unlock``, published with the header). Environment as
tests/apps/recorder.py; ``PGJOBS_TEST_PLAIN=1`` leaves celery_ext out (Celery's own group), and
``PGJOBS_TEST_RESULT`` names another result backend (Redis: chords join natively)."""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_ext
from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("grouped", broker=common.broker())
if os.environ.get("PGJOBS_TEST_PLAIN") != "1":
    celery_ext.install(app)
app.conf.update(settings(
    task_ignore_result=False,
    result_backend=os.environ.get("PGJOBS_TEST_RESULT") or (
        "db+" + common.dsn().replace("postgresql://", "postgresql+psycopg://", 1)),
    database_table_schemas={"task": SCHEMA, "group": SCHEMA},
    result_extended=False,
))


@app.task(name="grouped.record", shared=False)
def record(label: str) -> str:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, to_timestamp(%s), clock_timestamp())",
            (label, os.getpid(), time.time()))
    return label


@app.task(name="grouped.square", shared=False)
def square(x: int) -> int:
    return x * x


@app.task(name="grouped.total", shared=False)
def total(values: list[int], label: str) -> int:
    """A chord's body: records the header's sum under ``label``."""
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, now(), now())", (f"{label}={sum(values)}", os.getpid()))
    return sum(values)
