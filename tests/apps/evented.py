"""A plain Celery app (nothing here imports kombu_pgjobs or celery_ext) for the rows of
docs/compatibility.md that Celery itself provides (issue 33): task events and ``celery events``,
event queues that expire, ``celery beat`` with Celery's own scheduler as a publisher, and the
per-worker ``rate_limit``. Environment as tests/apps/recorder.py, plus
``PGJOBS_TEST_EVENT_EXPIRES`` (the event queues' ``x-expires``, seconds) and
``PGJOBS_TEST_EVERY`` (the beat entry's interval, seconds)."""

from __future__ import annotations

import os
import time

from celery import Celery

from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("evented", broker=common.broker())
app.conf.update(settings(
    event_queue_expires=float(os.environ.get("PGJOBS_TEST_EVENT_EXPIRES", "60")),
    beat_schedule={"beat": {"task": "evented.record",
                            "schedule": float(os.environ.get("PGJOBS_TEST_EVERY", "1")),
                            "args": ["beat"]}},
))


def _record(label: str, started: float) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, to_timestamp(%s), clock_timestamp())",
            (label, os.getpid(), started))


@app.task(name="evented.record")
def record(label: str) -> None:
    _record(label, time.time())


@app.task(name="evented.limited", rate_limit="2/s")
def limited(label: str) -> None:
    _record(label, time.time())


@app.task(name="evented.sleep")
def sleep(label: str, seconds: float) -> None:
    started = time.time()
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
            (label, os.getpid()))
    time.sleep(seconds)
    _record(label, started)
