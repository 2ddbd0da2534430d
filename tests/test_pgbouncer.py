"""pgjobs behind PgBouncer in transaction pooling: poll-only mode, really run.

Each test starts a private PgBouncer (tests/pgbouncer.py) with ``pool_mode = transaction`` and
one server connection, so every client shares it: a session setting left by one client is seen
by the next, which is what made ``durable_publish=False`` and the keeper's vacuum timeout leak.
Nothing about LISTEN works through transaction pooling, so every client here runs with
``use_listen_notify=False``. Outcomes are read back from the database, not from logs.

When pgbouncer is not installed these tests FAIL under CI=true (.ci/run installs it) and skip
elsewhere with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery

from kombu_pgjobs.core import QueueCore, _Watchdog, job_from_message
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.schema import migrate

from .conftest import wait_for
from .pgbouncer import PgBouncer, find_pgbouncer

# exclusive (tests/conftest.py): a private PgBouncer with a single server connection, and
# cancel/timeout bounds measured through it
pytestmark = pytest.mark.exclusive

PGJOBS = shutil.which("pgjobs", path=str(Path(sys.executable).parent)) or "pgjobs"
#: Session timeouts sent as startup parameters (libpq ``options``) are refused by a stock
#: PgBouncer; where the transport has such options, the documented setting behind a bouncer
#: is 0 (the role's own settings apply).
STARTUP_TIMEOUTS = [name for name in ("lock_timeout", "statement_timeout")
                    if name in TransportOptions.__dataclass_fields__]
POLL_ONLY: dict[str, Any] = {"use_listen_notify": False, "polling_interval": 0.1,
                             **dict.fromkeys(STARTUP_TIMEOUTS, 0)}


@pytest.fixture
def bouncer(dsn: str) -> Iterator[PgBouncer]:
    binary = find_pgbouncer()
    if binary is None:
        if os.environ.get("CI") == "true":
            pytest.fail("pgbouncer is required under CI=true and is not installed "
                        "(apt-get install pgbouncer)")
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer)")
    b = PgBouncer(dsn, binary=binary, pool_size=1).start()
    yield b
    b.close()


@pytest.fixture
def bounced(bouncer: PgBouncer, schema: str) -> Iterator[Callable[..., kombu.Connection]]:
    """kombu connections through the bouncer, poll-only, on this test's schema."""
    opened: list[kombu.Connection] = []

    def make(**options: Any) -> kombu.Connection:
        conn = kombu.Connection(bouncer.url(), transport_options={
            "schema": schema, **POLL_ONLY, **options})
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()


def _count(db: psycopg.Connection[Any], query: str) -> int:
    row = db.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def _defaults(dsn: str) -> dict[str, str]:
    """What a fresh session of the test database shows, straight from the server."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {name: str(conn.execute(f"SHOW {name}").fetchone()[0])  # type: ignore[index]
                for name in ("synchronous_commit", "statement_timeout")}


class Watcher(threading.Thread):
    """Another client of the bouncer: reads the two settings in a loop until stopped, so a
    setting that is on the shared server connection for even one transaction is seen."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(dsn, autocommit=True, prepare_threshold=None)
        self.seen: set[tuple[str, str]] = set()
        self.reads = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for name in ("synchronous_commit", "statement_timeout"):
                row = self.conn.execute(f"SHOW {name}").fetchone()
                assert row is not None
                self.seen.add((name, str(row[0])))
            self.reads += 1

    def stop(self) -> set[tuple[str, str]]:
        self.stopping.set()
        self.join(10)
        self.conn.close()
        return self.seen


# -- per-transaction settings (no bouncer needed to see them) -------------------------------
def test_async_publish_sets_synchronous_commit_for_its_own_transaction_only(
        db: psycopg.Connection[Any], schema: str, dsn: str) -> None:
    migrate(db, schema)
    db.execute(f'INSERT INTO "{schema}".pgjobs_binding (exchange, exchange_type, queue) '
               "VALUES ('fan', 'fanout', 'q1'), ('fan', 'fanout', 'q2')")
    core = QueueCore(schema, lease_ttl=30, max_attempts=3)
    job = job_from_message("q1", {"body": "x", "headers": {}, "properties": {}})
    publishes: list[Callable[[psycopg.Connection[Any]], Any]] = [
        lambda c: core.publish(c, job),
        lambda c: core.publish_many(c, [job, job]),
        lambda c: core.publish_fanout(c, "fan", job),
    ]
    with psycopg.connect(dsn) as conn:  # a transaction per publish, committed by hand
        for publish in publishes:  # durable: nothing changes
            publish(conn)
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
            conn.commit()
        core.commit_async(conn)
        for publish in publishes:
            publish(conn)  # the setting Postgres reads at this transaction's commit
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
            conn.commit()
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
            conn.commit()
        # other statements on the connection stay durable
        conn.execute("SELECT 1")
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 2 * (1 + 2 + 2)


def test_vacuum_timeout_cancels_without_a_session_setting(
        db: psycopg.Connection[Any], schema: str, dsn: str) -> None:
    """The keeper's timeout still cancels a vacuum that runs past it, by a cancel request."""
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=3)
    with psycopg.connect(dsn, autocommit=True) as conn:
        before = conn.execute("SHOW statement_timeout").fetchone()
        core.vacuum(conn, timeout=5)  # quick: finishes, nothing left behind
        assert conn.execute("SHOW statement_timeout").fetchone() == before
        # a statement that runs past the timeout is cancelled (a VACUUM cannot be made slow
        # on demand; the vacuum runs its statements under this same watchdog)
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled), _Watchdog(conn, 0.3):
            conn.execute("SELECT pg_sleep(30)")
        assert time.monotonic() - started < 10
        # and the connection is usable afterwards, with nothing set on it
        assert conn.execute("SHOW statement_timeout").fetchone() == before


# -- through the bouncer --------------------------------------------------------------------
def test_no_setting_leaks_to_other_clients_of_the_bouncer(
        bouncer: PgBouncer, bounced: Callable[..., kombu.Connection],
        db: psycopg.Connection[Any], schema: str, dsn: str) -> None:
    defaults = _defaults(dsn)
    expected = set(defaults.items())
    watcher = Watcher(bouncer.dsn())
    watcher.start()
    try:
        # durable_publish=False, confirmed and unconfirmed
        for confirm in (True, False):
            with bounced(durable_publish=False, confirm_publish=confirm) as conn:
                q = conn.SimpleQueue("leak")
                for i in range(5):
                    q.put({"i": i, "confirm": confirm})
                q.close()
        # the keeper's vacuum with its timeout, over and over, on a bouncer connection
        core = QueueCore(schema, lease_ttl=30, max_attempts=3)
        with psycopg.connect(bouncer.dsn(), autocommit=True, prepare_threshold=None) as kc:
            for _ in range(15):
                core.vacuum(kc, timeout=5)
        # and the real keeper: a consumer that vacuums after every settled message
        vacuums = f"""SELECT coalesce(sum(vacuum_count), 0) FROM pg_stat_user_tables
                      WHERE schemaname = '{schema}' AND relname = 'pgjobs_job'"""
        before = _count(db, vacuums)
        with bounced(durable_publish=False, vacuum_every=1) as conn:
            q = conn.SimpleQueue("leak")
            for _ in range(10):
                q.get(timeout=10).ack()
            wait_for(lambda: _count(db, vacuums) > before, 15, what="a keeper vacuum")
            q.close()
        time.sleep(0.2)
    finally:
        seen = watcher.stop()
    assert watcher.reads > 10
    assert seen == expected, f"another client saw {seen - expected}"
    # every message arrived and was acked, once
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 0
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter') == 0
    # what a client that comes after everyone sees on the (single) server connection
    with psycopg.connect(bouncer.dsn(), autocommit=True, prepare_threshold=None) as other:
        for name, value in defaults.items():
            assert other.execute(f"SHOW {name}").fetchone() == (value,)


def test_the_vacuum_timeout_cancels_through_the_bouncer(bouncer: PgBouncer, dsn: str) -> None:
    """PgBouncer forwards the watchdog's cancel to the server running the statement."""
    defaults = _defaults(dsn)
    with psycopg.connect(bouncer.dsn(), autocommit=True, prepare_threshold=None) as conn:
        started = time.monotonic()
        with pytest.raises(psycopg.errors.QueryCanceled), _Watchdog(conn, 0.3):
            conn.execute("SELECT pg_sleep(30)")
        assert time.monotonic() - started < 10
        assert conn.execute("SHOW statement_timeout").fetchone() == (
            defaults["statement_timeout"],)


def test_kombu_publish_consume_ack_through_the_bouncer(
        bouncer: PgBouncer, bounced: Callable[..., kombu.Connection],
        db: psycopg.Connection[Any], schema: str) -> None:
    n = 60
    carried = bouncer.transactions()
    with bounced() as conn:
        q = conn.SimpleQueue("kq")
        for i in range(n):
            q.put({"i": i})
        got: list[int] = []
        requeued = False
        while len(got) < n:
            msg = q.get(timeout=10)
            if not requeued:  # one goes back and comes again
                msg.requeue()
                requeued = True
                continue
            got.append(msg.payload["i"])
            msg.ack()
        with pytest.raises(q.Empty):
            q.get(timeout=0.5)
        q.close()
    assert sorted(got) == list(range(n))
    wait_for(lambda: _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 0, 10,
             what="every ack flushed")
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter') == 0
    assert bouncer.transactions() - carried >= n  # the traffic went through the bouncer


def test_cli_through_the_bouncer(bouncer: PgBouncer, bounced: Callable[..., kombu.Connection],
                                 schema: str) -> None:
    with bounced() as conn:
        q = conn.SimpleQueue("cliq")
        for i in range(3):
            q.put({"i": i})
        q.close()
    env = {**os.environ, "PGJOBS_DSN": bouncer.url(), "PGJOBS_SCHEMA": schema}
    done = subprocess.run([PGJOBS, "ls", "--json"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    items = json.loads(done.stdout)["items"]
    assert [(m["queue"], m["state"]) for m in items] == [("cliq", "ready")] * 3
    done = subprocess.run([PGJOBS, "queues", "--json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    queues = {r["queue"]: r for r in json.loads(done.stdout)["queues"]}
    assert queues["cliq"]["ready"] == 3


def test_worker_drains_through_the_bouncer_exactly_once(
        bouncer: PgBouncer, recorder_tables: str, start_worker: Any,
        db: psycopg.Connection[Any], schema: str) -> None:
    n = 150
    carried = bouncer.transactions()
    worker = start_worker(app="tests.apps.bounced", pool="threads", concurrency=4,
                          env={"PGJOBS_TEST_BROKER": bouncer.url(),
                               "PGJOBS_TEST_VACUUM_EVERY": "40",
                               "PGJOBS_TEST_ZERO_OPTIONS": ",".join(STARTUP_TIMEOUTS)})
    app = Celery("publisher", broker=bouncer.url())
    app.conf.broker_transport_options = {"schema": schema, **POLL_ONLY}
    with app.connection_for_write() as conn:
        for i in range(n):
            app.send_task("record", args=[f"t{i}"], connection=conn)
    runs = f'SELECT count(*) FROM "{schema}".pgjobs_test_run'
    wait_for(lambda: _count(db, runs) >= n, 60, what=f"{n} tasks run")
    wait_for(lambda: _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 0, 30,
             what="every ack flushed")
    time.sleep(0.5)  # a duplicate would show now
    assert _count(db, runs) == n
    assert _count(db, f'SELECT count(DISTINCT label) FROM "{schema}".pgjobs_test_run') == n
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter') == 0
    assert bouncer.transactions() - carried > n  # publishes, claims and acks went through it
    out = worker.output()
    assert worker.proc.poll() is None, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert worker.stop() == 0
