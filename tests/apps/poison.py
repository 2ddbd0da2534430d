"""A Celery app for the dead-letter, poison-message and retry-classification e2e tests.

It is a plain Celery app: with ``PGJOBS_TEST_CELERY_EXT=1`` it calls ``celery_ext.install(app)``
and the task options below (max_attempts, terminal, retry_after, retryable) take effect; without
it they are unused task attributes, which is exactly what a plain app gets. Nothing else here
imports kombu_pgjobs.

Each task records its start in ``{schema}.pgjobs_test_start`` before it fails (or kills its
process), and its success in ``{schema}.pgjobs_test_run``, so tests count attempts from the
database. Environment (as tests/apps/recorder.py): PGJOBS_TEST_DSN, PGJOBS_TEST_SCHEMA,
PGJOBS_TEST_BROKER, PGJOBS_TEST_LEASE_TTL, PGJOBS_TEST_ACKS_LATE, PGJOBS_TEST_PREFETCH, plus
PGJOBS_TEST_MAX_ATTEMPTS (transport option) and PGJOBS_TEST_REJECT_ON_LOST.
"""

from __future__ import annotations

import os
import time

import psycopg
from celery import Celery
from celery.exceptions import Reject

DSN = os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = os.environ.get("PGJOBS_TEST_SCHEMA", "pgjobs_e2e")
BROKER = os.environ.get("PGJOBS_TEST_BROKER", "pgjobs://postgres@127.0.0.1:5432/test")
EXT = os.environ.get("PGJOBS_TEST_CELERY_EXT") == "1"

app = Celery("poison", broker=BROKER)
if EXT:
    import celery_ext

    celery_ext.install(app)

_transport: dict[str, object] = {
    "schema": SCHEMA,
    "lease_ttl": float(os.environ.get("PGJOBS_TEST_LEASE_TTL", "30")),
}
if os.environ.get("PGJOBS_TEST_MAX_ATTEMPTS"):
    _transport["max_attempts"] = int(os.environ["PGJOBS_TEST_MAX_ATTEMPTS"])

app.conf.update(
    broker_transport_options=_transport,
    task_acks_late=os.environ.get("PGJOBS_TEST_ACKS_LATE", "1") == "1",
    task_reject_on_worker_lost=os.environ.get("PGJOBS_TEST_REJECT_ON_LOST") == "1",
    worker_prefetch_multiplier=int(os.environ.get("PGJOBS_TEST_PREFETCH", "1")),
    task_ignore_result=True,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)

_conn: psycopg.Connection | None = None
_conn_pid = 0


def _db() -> psycopg.Connection:
    """One connection per process (a prefork child must not use its parent's)."""
    global _conn, _conn_pid
    if _conn is None or _conn.closed or _conn_pid != os.getpid():
        _conn = psycopg.connect(DSN, autocommit=True)
        _conn_pid = os.getpid()
    return _conn


def _start(label: str) -> int:
    """Record an attempt; return how many attempts this label has had (this one included)."""
    _db().execute(f'INSERT INTO "{SCHEMA}".pgjobs_test_start (label, pid) VALUES (%s, %s)',
                  (label, os.getpid()))
    row = _db().execute(f'SELECT count(*) FROM "{SCHEMA}".pgjobs_test_start WHERE label = %s',
                        (label,)).fetchone()
    return int(row[0]) if row else 0


def _record(label: str) -> None:
    _db().execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
        "VALUES (%s, %s, clock_timestamp(), clock_timestamp())", (label, os.getpid()))


def _fixed(label: str) -> bool:
    row = _db().execute(f'SELECT count(*) FROM "{SCHEMA}".pgjobs_test_fix WHERE label = %s',
                        (label,)).fetchone()
    return bool(row and row[0])


def task(**options: object) -> object:
    """app.task, unshared: tests import this module afresh for each configuration, and shared
    tasks would register themselves with every later app too."""
    return app.task(shared=False, **options)


class PermanentError(Exception):
    """Bad input: retrying cannot help."""


class TooManyRequests(Exception):
    """An HTTP 429 with a Retry-After."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"429 Too Many Requests, retry after {retry_after}s")
        self.retry_after = retry_after


class Flaky(ConnectionError):
    """A transient network error."""


@task(name="poison.record")
def record(label: str) -> None:
    _record(label)


@task(name="poison.die", max_attempts=3)
def die(label: str) -> None:
    """Kills the process that runs it, every time (a poison message)."""
    _start(label)
    os._exit(13)


@task(name="poison.reject")
def reject(label: str) -> None:
    _start(label)
    raise Reject(f"{label}: refused", requeue=False)


@task(name="poison.fail")
def fail(label: str) -> None:
    _start(label)
    raise ValueError(f"boom {label}")


@task(name="poison.fail_rejecting", acks_on_failure_or_timeout=False)
def fail_rejecting(label: str) -> None:
    """acks_late + acks_on_failure_or_timeout=False: Celery rejects the failure (no requeue)."""
    _start(label)
    raise ValueError(f"boom {label}")


@task(name="poison.fail_until_fixed")
def fail_until_fixed(label: str) -> None:
    _start(label)
    if not _fixed(label):
        raise RuntimeError(f"{label} is not fixed yet")
    _record(label)


@task(name="poison.terminal", autoretry_for=(Exception,), max_retries=5,
          default_retry_delay=0, terminal=(PermanentError,))
def terminal(label: str) -> None:
    _start(label)
    raise PermanentError(f"{label}: bad input")


@task(name="poison.rate_limited", max_retries=3, retry_after=(TooManyRequests,),
          retry_after_max=float(os.environ.get("PGJOBS_TEST_RETRY_AFTER_MAX", "3600")),
          retry_after_jitter=0)
def rate_limited(label: str, seconds: float, times: int) -> None:
    if _start(label) <= times:
        raise TooManyRequests(seconds)
    _record(label)


@task(name="poison.flaky", max_retries=4, retryable=(Flaky,), retry_backoff=1,
          retry_backoff_max=2, retry_jitter=False)
def flaky(label: str, times: int) -> None:
    if _start(label) <= times:
        raise Flaky(f"{label}: connection reset")
    _record(label)


@task(name="poison.exhaust", max_retries=1, retryable=(Flaky,), default_retry_delay=0)
def exhaust(label: str) -> None:
    _start(label)
    raise Flaky(f"{label}: connection reset")


@task(name="poison.unclassified")
def unclassified(label: str) -> None:
    _start(label)
    raise KeyError(label)


@task(name="poison.sleep")
def sleep(label: str, seconds: float) -> None:
    _start(label)
    time.sleep(seconds)
    _record(label)
