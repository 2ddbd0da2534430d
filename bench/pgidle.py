"""What an idle worker costs Postgres: statements per minute, for Postgres-based brokers.

Statements, by the first method that works here (the one used is reported with the figure):

* ``pg_stat_statements``, when the server preloads it: the delta of ``sum(calls)`` for the
  broker's database over the window (the extension is created in that database if missing;
  the measuring query itself is excluded by its text). Exact; counts BEGIN/COMMIT too.
* otherwise TCP writes: ``ss -ti`` reports ``data_segs_out`` per socket, i.e. how many
  data-carrying segments the worker's processes sent on their connections to the Postgres
  port. libpq sends each statement (with its parameters) in one write, and each BEGIN or
  COMMIT in another, so on loopback this is the statement count, as Postgres would see it,
  for clients that don't pipeline (pipelined statements share a segment). Checked against
  pg_stat_statements on a scratch server (see README). Sampling ``pg_stat_activity`` instead
  was tried and rejected: it undercounts bursts (BEGIN; SELECT; COMMIT within a few ms)
  by ~3x.

Alongside, always: ``xact_commit + xact_rollback`` of the broker's database from
``pg_stat_database``, and the number of connections the idle worker holds. The transaction
count includes autovacuum's visits to that database (a few transactions about once a
minute), so it is an upper bound on the worker's own transactions; and backends publish it
up to 10 s late (PG 15 ``PGSTAT_IDLE_INTERVAL``), so the caller lets the worker idle that
long before the window opens. All reads come from a connection to the admin database, so
the measurement adds nothing to the broker's counters.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psycopg

from bench.brokers import PG_ADMIN_DSN, pg_dsn

SS_EVERY_S = 0.25
_PGSS_QUERY = (
    "SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_statements s "
    "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = %s "
    "AND s.query NOT LIKE '%%pg_stat_statements%%'"
)
_PID = re.compile(r"pid=(\d+)")
_SEGS = re.compile(r"\bdata_segs_out:(\d+)")


def _xacts(conn: psycopg.Connection[Any], database: str) -> int:
    row = conn.execute(
        "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", (database,)
    ).fetchone()
    return int(row[0]) if row else 0


def pgss_available() -> bool:
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute("SELECT current_setting('shared_preload_libraries')").fetchone()
    return bool(row) and "pg_stat_statements" in str(row[0])


def proc_stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the fields after it) of every process ``/proc/<pid>/stat`` lets us
    read: state, ppid, pgrp, ... (``man 5 proc``; field 1 here is the ppid)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        yield int(entry), name, stat[stat.rindex(")") + 2:].split()


def group_pids(pgid: int) -> set[int]:
    """Processes of the worker's process group (main process and prefork children)."""
    return {pid for pid, _, fields in proc_stats() if len(fields) > 2 and int(fields[2]) == pgid}


def tcp_writes(pids: set[int], port: int) -> dict[str, int]:
    """``data_segs_out`` of each established socket of ``pids`` to ``port``, by local address."""
    out = subprocess.run(
        ["ss", "-H", "-t", "-i", "-n", "-p", "state", "established", f"dport = :{port}"],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    counters: dict[str, int] = {}
    local: str | None = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):  # socket line: Recv-Q Send-Q Local Peer Process
            cols = line.split()
            owner = {int(p) for p in _PID.findall(line)}
            local = cols[2] if len(cols) >= 4 and owner & pids else None
        elif local is not None and (m := _SEGS.search(line)):
            counters[local] = int(m.group(1))
            local = None
    return counters


def measure_idle(database: str, port: int, worker_pgid: int, window: float) -> dict[str, Any]:
    """Watch an idle worker for ``window`` seconds; figures are scaled to one minute."""
    use_pgss = pgss_available()
    use_ss = shutil.which("ss") is not None
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    pgss_conn: psycopg.Connection[Any] | None = None
    with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
        if use_pgss:
            pgss_conn = psycopg.connect(pg_dsn(database), autocommit=True, connect_timeout=5)
            pgss_conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        try:
            pgss0 = pgss_conn.execute(_PGSS_QUERY, (database,)).fetchone() if pgss_conn else None
            xact0 = _xacts(conn, database)
            t0 = time.monotonic()
            conns = 0
            while True:
                if use_ss:
                    now = tcp_writes(group_pids(worker_pgid), port)
                    for sock, segs in now.items():
                        # A connection opened inside the window counts from zero.
                        first.setdefault(sock, 0 if last else segs)
                    last.update(now)
                    conns = max(conns, len(now))
                else:
                    conns = max(conns, _backends(conn, database))
                if time.monotonic() - t0 >= window:
                    break
                time.sleep(SS_EVERY_S)
            elapsed = time.monotonic() - t0
            xact1 = _xacts(conn, database)
            pgss1 = pgss_conn.execute(_PGSS_QUERY, (database,)).fetchone() if pgss_conn else None
        finally:
            if pgss_conn is not None:
                pgss_conn.close()
    per_min = 60.0 / elapsed
    result: dict[str, Any] = {
        "xacts_per_min": (xact1 - xact0) * per_min,
        "connections": conns,
        "window_s": elapsed,
    }
    if use_ss:
        result["tcp_writes_per_min"] = sum(last[s] - first[s] for s in last) * per_min
    if pgss0 is not None and pgss1 is not None:
        result["statements_per_min"] = (int(pgss1[0]) - int(pgss0[0])) * per_min
        result["method"] = "pg_stat_statements"
    elif use_ss:
        result["statements_per_min"] = result["tcp_writes_per_min"]
        result["method"] = "TCP writes to Postgres (ss data_segs_out)"
    else:
        result["method"] = "none (no pg_stat_statements, no ss): transactions only"
    return result


def _backends(conn: psycopg.Connection[Any], database: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = %s AND backend_type = 'client backend'",
        (database,),
    ).fetchone()
    return int(row[0]) if row else 0
