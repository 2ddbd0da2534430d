"""A Celery app whose beat runs celery_ext's LeaderScheduler (tests/test_scheduler_e2e.py).

One entry, ``tick``, every ``PGJOBS_TEST_EVERY`` seconds with catch-up ``all``; the lease TTL
comes from ``PGJOBS_TEST_SCHED_TTL``. The task records its run (with the occurrence header it
was sent for) so tests count runs per occurrence from the database.
"""

from __future__ import annotations

import os

from celery import Celery

from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("scheduled", broker=common.broker())
app.conf.update(settings(
    beat_scheduler="celery_ext.scheduler:LeaderScheduler",
    pgjobs_scheduler_lease_ttl_seconds=float(os.environ.get("PGJOBS_TEST_SCHED_TTL", "3")),
    beat_schedule={
        "tick": {"task": "scheduled.tick", "schedule": float(
            os.environ.get("PGJOBS_TEST_EVERY", "1")),
                 "args": ["tick"], "options": {"pgjobs_catch_up": "all"}},
    },
))


@app.task(name="scheduled.tick", bind=True)
def tick(self, label: str) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, %s::timestamptz, clock_timestamp())",
            (label, os.getpid(), self.request.get("pgjobs_schedule_occurrence")))
