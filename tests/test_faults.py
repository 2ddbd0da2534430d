"""Real database faults under real workers: terminated backends and a restarted server.

Each test runs on a private server (tests/pgserver.py) so restarting it disturbs nothing else.
Counts come from that server's tables: a start row when a task body begins, a run row when it
ends. "Never twice while its worker lives": no workers are killed here, so every label must
start exactly once.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from kombu import Connection

from tests.conftest import wait_for
from tests.pgserver import PrivateServer

# exclusive (tests/conftest.py): restarts its server and terminates every backend on it (a
# private server, but whole-server faults under workers with timing bounds)
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]


@pytest.fixture
def server(private_server: PrivateServer) -> PrivateServer:
    return private_server


def _tables(server: PrivateServer, schema: str) -> None:
    with psycopg.connect(server.dsn, autocommit=True) as db:
        db.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
        db.execute(f'CREATE TABLE "{schema}".pgjobs_test_run (label text, pid int, '
                   "started timestamptz, finished timestamptz)")
        db.execute(f'CREATE TABLE "{schema}".pgjobs_test_start (label text, pid int, '
                   "at timestamptz DEFAULT clock_timestamp())")


def _count(server: PrivateServer, query: str) -> Any:
    for _ in range(50):
        try:
            with psycopg.connect(server.dsn, autocommit=True, connect_timeout=3) as db:
                row = db.execute(query).fetchone()
                return row[0] if row else None
        except psycopg.OperationalError:
            time.sleep(0.2)
    raise AssertionError("private server unreachable")


def _publish(server: PrivateServer, schema: str, n: int, task: str, args: Any) -> None:
    from celery import Celery

    app = Celery("faults", broker=server.url)
    app.conf.broker_transport_options = {"schema": schema}
    with Connection(server.url, transport_options={"schema": schema}) as conn:
        producer = app.amqp.Producer(conn, auto_declare=True)
        for i in range(n):
            app.send_task(task, args=args(i), producer=producer)


def _worker_env(server: PrivateServer, schema: str, **extra: str) -> dict[str, str]:
    return {"PGJOBS_TEST_DSN": server.dsn, "PGJOBS_TEST_BROKER": server.url,
            "PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_LEASE_TTL": "10", **extra}


def _assert_exactly_once(server: PrivateServer, schema: str, n: int, timeout: float) -> None:
    wait_for(lambda: _count(server, f'SELECT count(DISTINCT label) FROM "{schema}".'
                            "pgjobs_test_run") == n, timeout, interval=1.0,
             what=f"all {n} tasks to complete")
    starts = _count(server, f'SELECT count(*) FROM "{schema}".pgjobs_test_start')
    twice = _count(server, f'SELECT count(*) FROM (SELECT label FROM "{schema}".'
                   "pgjobs_test_start GROUP BY label HAVING count(*) > 1) t")
    assert twice == 0, f"{twice} tasks started twice while their worker lived"
    assert starts == n
    runs = _count(server, f'SELECT count(*) FROM "{schema}".pgjobs_test_run')
    assert runs == n, f"{runs} completions for {n} tasks"
    wait_for(lambda: _count(server, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 0, 30,
             what="the job table to empty (every ack flushed)")


@pytest.mark.slow
def test_terminated_backends_and_restart_strand_nothing_run_nothing_twice(
        server, schema, start_worker):
    """Two threads workers draining 240 one-second acks_late tasks; every backend terminated
    three times 3 s apart, then the server restarted: all 240 complete once, the job table
    empties, and both workers still consume afterwards (no restart of theirs)."""
    _tables(server, schema)
    env = _worker_env(server, schema)
    workers = [start_worker(name=f"w{i}", concurrency=4, env=env) for i in (1, 2)]
    n = 240
    _publish(server, schema, n, "sleep_record", lambda i: (f"t{i}", 1.0))
    wait_for(lambda: _count(server, f'SELECT count(*) FROM "{schema}".pgjobs_test_start') >= 8,
             30, what="tasks to start")
    killed = 0
    for _ in range(3):
        killed += server.terminate_all()
        time.sleep(3)
    assert killed > 0
    server.restart()
    _assert_exactly_once(server, schema, n, timeout=150)
    # Still consuming, unaided.
    _publish(server, schema, 20, "record", lambda i: (f"after{i}",))
    wait_for(lambda: _count(server, f'SELECT count(*) FROM "{schema}".pgjobs_test_run '
                            "WHERE label LIKE 'after%'") == 20, 60,
             what="tasks published after the faults to run")
    for w in workers:
        assert w.proc.poll() is None, w.output()[-3000:]
        out = w.output()
        assert "AttributeError" not in out, out[-3000:]
        assert "Unrecoverable error" not in out, out[-3000:]
        assert "Connection to broker lost" not in out, "Celery restarted its consumer"


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_many_short_tasks_through_faults(server, schema, start_worker, pool):
    """2,000 acks_late tasks on two workers while backends are terminated and the server
    restarts twice: every task completes exactly once, nothing left in the job table."""
    _tables(server, schema)
    env = _worker_env(server, schema)
    workers = [start_worker(name=f"w{i}", pool=pool, concurrency=2, env=env) for i in (1, 2)]
    n = 2000
    _publish(server, schema, n, "sleep_record", lambda i: (f"t{i}", 0.01))
    for fault in ("terminate", "restart", "terminate", "restart"):
        time.sleep(1.5)
        if fault == "terminate":
            server.terminate_all()
        else:
            server.restart()
    _assert_exactly_once(server, schema, n, timeout=180)
    for w in workers:
        assert w.proc.poll() is None, w.output()[-3000:]
        assert "Connection to broker lost" not in w.output(), "Celery restarted its consumer"
