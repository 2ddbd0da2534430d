"""A database's own counters, for benchmarks that count its transactions.

PostgreSQL 15 reports a backend's transaction counts to ``pg_stat_database`` when it exits (and
about once a second while it lives), so a count is exact only once every backend of the
database has disconnected: :func:`settle` waits for that.
"""

from __future__ import annotations

import time

import psycopg

from bench.brokers import PG_ADMIN_DSN


def transactions(database: str) -> int:
    """``xact_commit + xact_rollback`` of ``database``."""
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        row = admin.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database"
                            " WHERE datname = %s", (database,)).fetchone()
    return int(row[0]) if row else 0


def backends(database: str) -> int:
    """Backends connected to ``database`` now."""
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True) as admin:
        row = admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s",
                            (database,)).fetchone()
    return int(row[0]) if row else 0


def settle(database: str, timeout: float) -> int:
    """Wait until no backend is connected to ``database`` (or ``timeout`` s); the backends
    still connected (0: every count is in)."""
    deadline = time.monotonic() + timeout
    while (left := backends(database)) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
    return left
