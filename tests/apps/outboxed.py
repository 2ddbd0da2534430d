"""A celery_ext app for the transactional outbox tests (tests/test_outbox.py,
tests/test_outbox_relay.py).

The broker is whatever PGJOBS_TEST_BROKER says (pgjobs:// in the same database, or Redis /
RabbitMQ behind the relay); PGJOBS_TEST_QUEUE names the queue (a fresh one per test on a shared
broker); PGJOBS_TEST_RESULT, when set, is a result backend (chords). Every body records its
label in ``{schema}.pgjobs_test_run``, so tests count executions from the database.
"""

from __future__ import annotations

import os
import time

from celery import Celery

import celery_ext
from tests.apps import common
from tests.apps.common import execute, settings

SCHEMA = common.schema()
BROKER = common.broker()
RESULT = os.environ.get("PGJOBS_TEST_RESULT") or None

app = Celery("outboxed", broker=BROKER, backend=RESULT)
celery_ext.install(app)
conf = settings(task_default_queue=os.environ.get("PGJOBS_TEST_QUEUE", "celery"),
                task_ignore_result=RESULT is None, pgjobs_outbox_schema=SCHEMA)
if not BROKER.startswith("pgjobs"):
    conf["broker_transport_options"] = {}
app.conf.update(conf)
if os.environ.get("PGJOBS_TEST_RELAY") == "1":  # the worker relays the outbox itself
    app.conf.update(pgjobs_outbox_dsn=common.dsn(), pgjobs_outbox_relay_lease_ttl=5)
    app.steps["worker"].add(celery_ext.OutboxRelay)


def _record(label: str) -> None:
    execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
            "VALUES (%s, %s, to_timestamp(%s), clock_timestamp())",
            (label, os.getpid(), time.time()))


@app.task(name="record")
def record(label: str) -> str:
    _record(label)
    return label


@app.task(name="collect")
def collect(labels: list[str], label: str) -> None:
    _record(f"{label}:{','.join(sorted(labels))}")


@app.task(name="keyed", tenant=lambda label, org: org,
          idempotency_key=lambda label, org: f"key-{label}")
def keyed(label: str, *, org: str) -> None:
    _record(f"keyed-{label}")
