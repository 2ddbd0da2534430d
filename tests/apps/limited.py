"""A celery_ext app with fleet-wide limits, for end-to-end tests of keyed concurrency.

Every task records its span in ``{schema}.pgjobs_test_span`` (start on entry, end on exit, both
from the database clock), so tests read overlaps and run counts back from Postgres.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_ext
from tests.apps import common
from tests.apps.common import db, settings

SCHEMA = common.schema()

app = Celery("limited", broker=common.broker())
celery_ext.install(app)
app.conf.update(settings())


def _span(label: str, key: str, seconds: float) -> None:
    conn = db()
    row = conn.execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_span (label, key, pid, started) '
        "VALUES (%s, %s, %s, clock_timestamp()) RETURNING id", (label, key, os.getpid()),
    ).fetchone()
    time.sleep(seconds)
    conn.execute(f'UPDATE "{SCHEMA}".pgjobs_test_span SET finished = clock_timestamp() '
                 "WHERE id = %s", (row[0],))


@app.task(name="keyed", concurrency_key=lambda label, key, seconds: key,
          concurrency_per_key=int(os.environ.get("PGJOBS_TEST_PER_KEY", "2")))
def keyed(label: str, key: str, seconds: float) -> None:
    _span(label, key, seconds)


@app.task(name="capped", concurrency=3)
def capped(label: str, seconds: float) -> None:
    _span(label, "capped", seconds)


@app.task(name="refusing", concurrency_key=lambda label, key, seconds: key,
          when_busy="fail")
def refusing(label: str, key: str, seconds: float) -> None:
    _span(label, key, seconds)
