"""What an idle worker costs Postgres: statements per minute, for Postgres-based brokers.

Method, chosen at run time and reported with the figure:

* ``pg_stat_statements`` when the server preloads it: the delta of ``sum(calls)`` for the
  broker's database over the window (the extension is created in that database if missing;
  the measuring query itself is excluded by its text). Exact.
* otherwise ``pg_stat_activity`` sampling: the worker runs with ``PGAPPNAME`` set, and every
  ``SAMPLE_S`` the orchestrator reads ``(pid, query_start)`` of that application's backends.
  Each new ``query_start`` is one statement. Exact while each connection sends fewer than
  one statement per sample period (true of an idle worker); a lower bound above that.

Alongside, always: ``xact_commit + xact_rollback`` of the broker's database from
``pg_stat_database`` (transactions, not statements, and any autovacuum work on that database
is included) and the number of connections the idle worker holds. All reads come from a
connection to the admin database, so the measurement adds nothing to the broker's counters.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from bench.brokers import PG_ADMIN_DSN, pg_dsn

SAMPLE_S = 0.02
_PGSS_QUERY = (
    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements s "
    "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s "
    "AND s.query NOT LIKE '%%pg_stat_statements%%'"
)


def _xacts(conn: psycopg.Connection[Any], database: str) -> int:
    row = conn.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (database,)
    ).fetchone()
    return int(row[0]) if row else 0


def pgss_available() -> bool:
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT current_setting('shared_preload_libraries')").fetchone()
    return bool(row) and "pg_stat_statements" in str(row[0])


def measure_idle(database: str, app_name: str, window: float) -> dict[str, Any]:
    """Watch an idle worker for ``window`` seconds; figures are scaled to one minute."""
    use_pgss = pgss_available()
    pgss_conn: psycopg.Connection[Any] | None = None
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
        if use_pgss:
            pgss_conn = psycopg.connect(pg_dsn(database), autocommit=True, connect_timeout=5)
            pgss_conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        try:
            seen: set[tuple[int, Any]] = set()
            conns = 0
            pgss0 = pgss_conn.execute(_PGSS_QUERY, (database,)).fetchone() if pgss_conn else None
            xact0 = _xacts(conn, database)
            t0 = time.monotonic()
            baseline: set[tuple[int, Any]] | None = None
            while True:
                rows = conn.execute(
                    "SELECT pid, query_start FROM pg_stat_activity WHERE application_name = %s",
                    (app_name,),
                ).fetchall()
                current = {(int(pid), qs) for pid, qs in rows}
                conns = max(conns, len(current))
                if baseline is None:
                    baseline = current  # statements that started before the window
                seen |= current
                if time.monotonic() - t0 >= window:
                    break
                time.sleep(SAMPLE_S)
            elapsed = time.monotonic() - t0
            xact1 = _xacts(conn, database)
            pgss1 = pgss_conn.execute(_PGSS_QUERY, (database,)).fetchone() if pgss_conn else None
        finally:
            if pgss_conn is not None:
                pgss_conn.close()
    per_min = 60.0 / elapsed
    sampled = len(seen - (baseline or set()))
    if pgss0 is not None and pgss1 is not None:
        statements = (int(pgss1[0]) - int(pgss0[0])) * per_min
        method = "pg_stat_statements"
    else:
        statements = sampled * per_min
        method = f"pg_stat_activity sampling every {SAMPLE_S * 1000:.0f} ms"
    return {
        "statements_per_min": statements,
        "xacts_per_min": (xact1 - xact0) * per_min,
        "connections": conns,
        "window_s": elapsed,
        "method": method,
    }
