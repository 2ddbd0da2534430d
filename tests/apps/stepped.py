"""A Celery app with durable steps (celery_ext.steps), for tests/test_steps*.py (issue 32).

Step bodies record every run in ``{schema}.pgjobs_test_start`` (label ``<label>:<step>``, the
process id), so tests count how often each body ran from the database. How long a body blocks
comes from the worker's environment: ``PGJOBS_TEST_STEP_SLEEP="two=30,gap=30"`` (a step's
name, or ``gap``: the pause between steps two and three, outside any step). Completions go to
``{schema}.pgjobs_test_run``; woken sleepers and waiters to ``{schema}.pgjobs_test_woke``.

``doc_app`` is the worked example of docs/steps.md, executed from the page itself (so the test
that runs it runs what the page shows), configured for the test's broker and schema.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from celery import Celery

import celery_ext
from kombu_pgjobs.errors import EventTimeout
from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("stepped", broker=common.broker())
celery_ext.install(app)
app.conf.update(settings(task_acks_late=True))


def _pause(what: str) -> float:
    for part in os.environ.get("PGJOBS_TEST_STEP_SLEEP", "").split(","):
        name, _, seconds = part.partition("=")
        if name == what and seconds:
            return float(seconds)
    return 0.0


def body(label: str, step: str) -> dict[str, Any]:
    """A step's body: recorded when it starts, then blocks as the environment says."""
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
            (f"{label}:{step}", os.getpid()))
    time.sleep(_pause(step))
    return {"step": step, "pid": os.getpid()}


def _done(label: str) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, clock_timestamp(), clock_timestamp())", (label, os.getpid()))


def _woke(label: str, task_id: str, what: Any) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_woke (label, task_id, what) '
            "VALUES (%s, %s, %s)", (label, task_id, json.dumps(what)))


def _flag(name: str) -> bool:
    return common.db().execute(
        f'SELECT count(*) FROM "{SCHEMA}".pgjobs_test_flag WHERE name = %s',
        (name,)).fetchone()[0] > 0


@app.task(bind=True, name="stepped.three")
def three(self: Any, label: str) -> None:
    """Three steps, a pause outside any step between the second and the third."""
    steps = celery_ext.steps.of(self)
    steps.run("one", body, label, "one")
    steps.run("two", body, label, "two")
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
            (f"{label}:gap", os.getpid()))
    time.sleep(_pause("gap"))
    steps.run("three", body, label, "three")
    _done(label)


@app.task(bind=True, name="stepped.flaky")
def flaky(self: Any, label: str) -> None:
    """Three steps; the third raises until the flag ``<label>`` is set."""
    steps = celery_ext.steps.of(self)
    steps.run("one", body, label, "one")
    steps.run("two", body, label, "two")

    def third() -> dict[str, Any]:
        got = body(label, "three")
        if not _flag(label):
            raise RuntimeError(f"{label}: the partner API is down")
        return got

    steps.run("three", third)
    _done(label)


@app.task(bind=True, name="stepped.retried", autoretry_for=(RuntimeError,), max_retries=3,
          default_retry_delay=0)
def retried(self: Any, label: str) -> None:
    """Step two raises on its first run; Celery's autoretry publishes the retry (a new message
    under the same task id), which replays step one."""
    steps = celery_ext.steps.of(self)
    steps.run("one", body, label, "one")

    def second() -> dict[str, Any]:
        got = body(label, "two")
        runs = common.db().execute(
            f'SELECT count(*) FROM "{SCHEMA}".pgjobs_test_start WHERE label = %s',
            (f"{label}:two",)).fetchone()[0]
        if runs < 2:
            raise RuntimeError(f"{label}: try again")
        return got

    steps.run("two", second)
    _done(label)


@app.task(bind=True, name="stepped.nap")
def nap(self: Any, label: str, seconds: float, before: bool = False) -> None:
    """A durable sleep (a step before it when ``before``); records when it woke."""
    steps = celery_ext.steps.of(self)
    if before:
        steps.run("before", body, label, "before")
    steps.sleep("nap", seconds)
    _woke(label, self.request.id, "woke")
    _done(label)


@app.task(bind=True, name="stepped.wait")
def wait(self: Any, label: str, event: str, key: Any, timeout: float | None = None) -> None:
    """Waits for an event; records its data, or the timeout."""
    steps = celery_ext.steps.of(self)
    try:
        data = steps.wait_for_event(event, key=key, timeout=timeout)
    except EventTimeout:
        _woke(label, self.request.id, "timeout")
        return
    _woke(label, self.request.id, data)
    _done(label)


@app.task(name="stepped.record")
def record(label: str) -> None:
    """No steps at all."""
    _done(label)


@app.task(bind=True, name="stepped.unused")
def unused(self: Any, label: str) -> None:
    """Asks for its steps and uses none: must cost nothing."""
    celery_ext.steps.of(self)
    _done(label)


@app.task(bind=True, name="stepped.emitter")
def emitter(self: Any, event: str, key: Any, data: Any) -> None:
    """A task that emits (as the worker role)."""
    celery_ext.steps.emit(event, key=key, data=data, app=self.app)


# -- the worked example of docs/steps.md ---------------------------------------------------------
DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "steps.md"


def doc_example() -> str:
    """The page's first python block that defines ``order_flow``."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOC.read_text("utf-8"), re.M | re.S)
    return next(b for b in blocks if "def order_flow" in b)


_namespace: dict[str, Any] = {"__name__": "shop"}
exec(compile(doc_example(), str(DOC), "exec"), _namespace)
doc_app = _namespace["app"]
doc_app.conf.update(settings(), broker_url=common.broker())
order_flow = _namespace["order_flow"]
