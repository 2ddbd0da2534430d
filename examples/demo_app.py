"""The demo Celery app: a plain Celery app whose only pgjobs-specific line is the broker URL."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("demo", broker=os.environ.get("PGJOBS_DEMO_URL", "pgjobs://"))
app.conf.task_acks_late = True
app.conf.task_ignore_result = True


@app.task
def add(x: int, y: int) -> int:
    return x + y
