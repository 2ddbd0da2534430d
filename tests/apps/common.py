"""What the test apps share: where the test database and schema are, and one connection per
process to record what tasks did. Imports neither kombu_pgjobs nor celery_ext."""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

_conn: psycopg.Connection | None = None


# Read when an app module is imported (tests re-import it with another environment).
def dsn() -> str:
    return os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def schema() -> str:
    return os.environ.get("PGJOBS_TEST_SCHEMA", "pgjobs_e2e")


def broker() -> str:
    return os.environ.get("PGJOBS_TEST_BROKER", "pgjobs://postgres@127.0.0.1:5432/test")


def settings(**extra: Any) -> dict[str, Any]:
    """Celery settings every test app uses (the broker options come from the environment)."""
    return {
        "broker_transport_options": {
            "schema": schema(),
            "lease_ttl": float(os.environ.get("PGJOBS_TEST_LEASE_TTL", "30")),
            "application_name": os.environ.get("PGJOBS_TEST_APPNAME", "pgjobs"),
        },
        "worker_prefetch_multiplier": int(os.environ.get("PGJOBS_TEST_PREFETCH", "4")),
        "task_ignore_result": True,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        **extra,
    }


def db() -> psycopg.Connection:
    """This process's connection to the test database (autocommit)."""
    global _conn
    if _conn is None or _conn.closed or _conn.broken:
        _conn = psycopg.connect(dsn(), autocommit=True)
    return _conn


def execute(query: str, params: Any = None) -> None:
    """Run a recording statement; once more on a new connection if the server dropped this
    one (fault tests terminate backends and restart the server under running tasks)."""
    attempts = int(os.environ.get("PGJOBS_TEST_RECORD_ATTEMPTS", "20"))
    for attempt in range(attempts):
        try:
            db().execute(query, params)
            return
        except psycopg.OperationalError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.25)
