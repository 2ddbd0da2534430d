"""A celery_ext app with fleet-wide limits, for end-to-end tests of keyed concurrency.

Every task records its span in ``{schema}.pgjobs_test_span`` (start on entry, end on exit, both
from the database clock), so tests read overlaps and run counts back from Postgres.
"""

from __future__ import annotations

import os
import time

import psycopg
from celery import Celery

import celery_ext

DSN = os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = os.environ.get("PGJOBS_TEST_SCHEMA", "pgjobs_e2e")
BROKER = os.environ.get("PGJOBS_TEST_BROKER", "pgjobs://postgres@127.0.0.1:5432/test")

app = Celery("limited", broker=BROKER)
celery_ext.install(app)
app.conf.update(
    broker_transport_options={
        "schema": SCHEMA,
        "lease_ttl": float(os.environ.get("PGJOBS_TEST_LEASE_TTL", "30")),
    },
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


def _span(label: str, key: str, seconds: float) -> None:
    db = _db()
    row = db.execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_span (label, key, pid, started) '
        "VALUES (%s, %s, %s, clock_timestamp()) RETURNING id", (label, key, os.getpid()),
    ).fetchone()
    time.sleep(seconds)
    db.execute(f'UPDATE "{SCHEMA}".pgjobs_test_span SET finished = clock_timestamp() '
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
