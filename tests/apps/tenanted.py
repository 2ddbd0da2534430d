"""A celery_ext app whose tasks declare tenants, for end-to-end tests of the tenant context.

Every body records what :func:`celery_ext.current_tenant` returned, with the argument it was
given, in ``{schema}.pgjobs_test_tenant``; tests read the rows back from Postgres. For labels
starting with ``leak-`` the ``task_prerun`` and ``task_postrun`` signals record it too: they run
in the same pool child, thread or greenlet as the body but outside it, so a tenant left behind
by an earlier body (or not cleared after this one) shows up there.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery, signals
from celery.exceptions import Reject

import celery_ext
from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()

app = Celery("tenanted", broker=common.broker())
celery_ext.install(app)
app.conf.update(settings())


def _record(label: str, task: str, arg: Any, phase: str = "body") -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_tenant (label, task, arg, seen, phase, pid) '
            "VALUES (%s, %s, %s, %s, %s, %s)",
            (label, task, arg, celery_ext.current_tenant(), phase, os.getpid()))


def _org(*args: Any, **kwargs: Any) -> str:
    return kwargs["org"]


@app.task(name="record", tenant=_org)
def record(label: str, *, org: str) -> None:
    _record(label, "record", org)


@app.task(name="record_none", tenant="none")
def record_none(label: str, org: str | None = None) -> None:
    _record(label, "record_none", org)


@app.task(name="undeclared")
def undeclared(label: str) -> None:
    _record(label, "undeclared", None)


@app.task(name="fails", tenant=_org)
def fails(label: str, *, org: str) -> None:
    _record(label, "fails", org)
    raise ValueError("this task fails on purpose")


@app.task(name="retries", tenant=_org, bind=True, max_retries=3)
def retries(self: Any, label: str, *, org: str) -> None:
    _record(label, "retries", org)
    if self.request.retries == 0:
        raise self.retry(countdown=0)


@app.task(name="rejects", tenant=_org)
def rejects(label: str, *, org: str) -> None:
    _record(label, "rejects", org)
    raise Reject("rejected on purpose", requeue=False)


@app.task(name="nested", tenant=_org)
def nested(label: str, *, org: str, child_org: str) -> None:
    """Publishes from inside a body: each child must carry its own declared tenant."""
    _record(label, "nested", org)
    record.delay(f"{label}/record", org=child_org)
    undeclared.delay(f"{label}/undeclared")
    record_none.delay(f"{label}/none", org)
    # held for an hour, so the test reads what their messages carry from pgjobs_job
    undeclared.apply_async((f"{label}/later",), countdown=3600)
    record.apply_async((f"{label}/later",), {"org": child_org}, countdown=3600)


def _label(args: Any, kwargs: Any) -> str | None:
    label = (args or [None])[0]
    return label if isinstance(label, str) and label.startswith("leak-") else None


@signals.task_prerun.connect
def _before(sender: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    label = _label(args, kwargs)
    if label is not None:
        _record(label, sender.name, None, "prerun")


@signals.task_postrun.connect
def _after(sender: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    label = _label(args, kwargs)
    if label is not None:
        _record(label, sender.name, None, "postrun")
