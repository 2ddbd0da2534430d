"""A plain Celery app for end-to-end tests: nothing here imports kombu_pgjobs.

Each task records its execution in a table (``{schema}.pgjobs_test_run``) so tests count
executions from the database, not from the worker's logs.
"""

from __future__ import annotations

import os
import time

import psycopg
from celery import Celery

DSN = os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = os.environ.get("PGJOBS_TEST_SCHEMA", "pgjobs_e2e")
BROKER = os.environ.get("PGJOBS_TEST_BROKER", "pgjobs://postgres@127.0.0.1:5432/test")

app = Celery("recorder", broker=BROKER)
app.conf.update(
    broker_transport_options={
        "schema": SCHEMA,
        "lease_ttl": float(os.environ.get("PGJOBS_TEST_LEASE_TTL", "30")),
        "application_name": os.environ.get("PGJOBS_TEST_APPNAME", "pgjobs"),
    },
    task_acks_late=os.environ.get("PGJOBS_TEST_ACKS_LATE", "1") == "1",
    worker_prefetch_multiplier=int(os.environ.get("PGJOBS_TEST_PREFETCH", "4")),
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_conn: psycopg.Connection | None = None


def _db() -> psycopg.Connection:
    global _conn
    if _conn is None or _conn.closed:
        _conn = psycopg.connect(DSN, autocommit=True)
    return _conn


def _record(label: str, started: float) -> None:
    _db().execute(
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
    _db().execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
        (label, os.getpid()))
    time.sleep(seconds)
    _record(label, started)
