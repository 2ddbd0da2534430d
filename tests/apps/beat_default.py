"""A pgjobs app with celery_ext and a beat schedule but no ``beat_scheduler`` (issue 33, item 3):
``celery worker -B`` with no scheduler flag must run the leader scheduler. One entry, ``tick``,
every ``PGJOBS_TEST_EVERY`` seconds with catch-up ``all``; each run records the occurrence it
was sent for (``{schema}.pgjobs_test_run.started``)."""

from __future__ import annotations

import os

from celery import Celery

import celery_ext
from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("beat_default", broker=common.broker())
celery_ext.install(app)
app.conf.update(settings(
    pgjobs_scheduler_lease_ttl_seconds=float(os.environ.get("PGJOBS_TEST_SCHED_TTL", "3")),
    beat_schedule={
        "tick": {"task": "beat_default.tick",
                 "schedule": float(os.environ.get("PGJOBS_TEST_EVERY", "1")),
                 "args": ["tick"], "options": {"pgjobs_catch_up": "all"}},
    },
))


@app.task(name="beat_default.tick", bind=True)
def tick(self, label: str) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, %s::timestamptz, clock_timestamp())",
            (label, os.getpid(), self.request.get("pgjobs_schedule_occurrence")))
