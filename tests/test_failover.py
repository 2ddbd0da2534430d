"""Failover to a promoted standby: multi-host URLs, real streaming replication, real workers.

Two private servers (tests/pgserver.py): a primary and a hot standby made by pg_basebackup,
replicating synchronously (a commit returns once the standby has flushed it). Workers get the
libpq multi-host URL ``pgjobs://postgres@primary,standby/postgres``; every pgjobs connection
takes the first host that accepts writes, so when the primary dies and the standby is promoted
their next reconnect lands there, with no restart.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import kombu
import psycopg
import pytest

import kombu_pgjobs
from kombu_pgjobs.errors import DatabaseUnavailable
from kombu_pgjobs.ops.cli.main import main as cli
from tests.conftest import wait_for
from tests.pgserver import PrivateServer, _free_port, require_bindir

# exclusive (tests/conftest.py): two private clusters, pg_basebackup, ALTER SYSTEM, a promotion
pytestmark = [pytest.mark.e2e, pytest.mark.exclusive]


@pytest.fixture
def pair() -> Iterator[tuple[PrivateServer, PrivateServer]]:
    bindir = require_bindir()
    primary = PrivateServer(bindir)
    standby = None
    try:
        standby = PrivateServer(bindir, standby_of=primary)
        primary.replicate_synchronously()
        yield primary, standby
    finally:
        for s in (standby, primary):
            if s is not None:
                s.stop()


def _hosts(*servers: PrivateServer | int) -> str:
    return ",".join(f"127.0.0.1:{s if isinstance(s, int) else s.port}" for s in servers)


def _count(dsn: str, query: str) -> Any:
    for _ in range(100):
        try:
            with psycopg.connect(dsn, autocommit=True, connect_timeout=3) as db:
                row = db.execute(query).fetchone()
                return row[0] if row else None
        except psycopg.OperationalError:
            time.sleep(0.2)
    raise AssertionError(f"no writable server at {dsn}")


def test_multi_host_url_skips_a_down_host_and_a_read_only_one(pair, schema):
    primary, standby = pair
    down = _free_port()  # nothing listens there
    url = f"pgjobs://postgres@{_hosts(down, standby, primary)}/postgres"
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("multi")
        q.put({"n": 1})
        got = q.get(timeout=10)
        assert got.payload == {"n": 1}
        got.ack()
        q.put({"n": 2})
        q.close()
    # the row is on the primary (the standby, first in line, is read-only and was skipped)
    with psycopg.connect(primary.dsn, autocommit=True) as db:
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone() == (1,)
    assert cli(["queues", "--dsn", url, "--schema", schema, "--json"]) == 0
    # a list with no writable host is a coded connection error, not a hang
    with pytest.raises(DatabaseUnavailable, match="session is read-only"):
        with kombu.Connection(f"pgjobs://postgres@{_hosts(down, standby)}/postgres",
                              transport_options={"schema": schema}) as conn:
            conn.connect()


@pytest.mark.slow
def test_failover_to_a_promoted_standby_loses_nothing(pair, schema, start_worker):
    """Two workers draining 3,000 acks_late tasks; the primary is stopped (immediate) and the
    standby promoted mid-run. Every task completes (0 lost); a task runs twice only if it was
    running at the failover (bounded by what the workers held); the workers carry on unaided."""
    primary, standby = pair
    hosts = _hosts(primary, standby)
    url = f"pgjobs://postgres@{hosts}/postgres"
    dsn = f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"
    with psycopg.connect(primary.dsn, autocommit=True) as db:
        db.execute(f'CREATE SCHEMA "{schema}"')
        db.execute(f'CREATE TABLE "{schema}".pgjobs_test_run (label text, pid int, '
                   "started timestamptz, finished timestamptz)")
        db.execute(f'CREATE TABLE "{schema}".pgjobs_test_start (label text, pid int, '
                   "at timestamptz DEFAULT clock_timestamp())")
    n, concurrency, prefetch = 3000, 4, 4
    env = {"PGJOBS_TEST_DSN": dsn, "PGJOBS_TEST_BROKER": url, "PGJOBS_TEST_SCHEMA": schema,
           "PGJOBS_TEST_LEASE_TTL": "10", "PGJOBS_TEST_PREFETCH": str(prefetch),
           "PGJOBS_TEST_RECORD_ATTEMPTS": "240"}
    from celery import Celery

    app = Celery("failover", broker=url)
    app.conf.broker_transport_options = {"schema": schema}
    with kombu.Connection(url, transport_options={"schema": schema}) as conn, \
            kombu_pgjobs.batch():
        producer = app.amqp.Producer(conn, auto_declare=True)
        for i in range(n):
            app.send_task("sleep_record", args=(f"t{i}", 0.004), producer=producer)
    workers = [start_worker(name=f"w{i}", concurrency=concurrency, env=env) for i in (1, 2)]
    started = f'SELECT count(*) FROM "{schema}".pgjobs_test_start'
    wait_for(lambda: _count(primary.dsn, started) >= n // 4, 60, what="a quarter to start")
    before = _count(primary.dsn, f'SELECT count(DISTINCT label) FROM "{schema}".pgjobs_test_run')
    primary.halt()
    standby.promote()
    wait_for(lambda: _count(dsn, f'SELECT count(DISTINCT label) FROM "{schema}".'
                                 "pgjobs_test_run") == n, 180, interval=1.0,
             what=f"all {n} tasks to complete after the failover")
    starts = _count(dsn, started)
    twice = _count(dsn, f'SELECT count(*) FROM (SELECT label FROM "{schema}".pgjobs_test_start '
                        "GROUP BY label HAVING count(*) > 1) t")
    held = len(workers) * concurrency * (1 + prefetch)
    print(f"\nfailover: {n} tasks, {before} done before it, {starts} starts, "
          f"{twice} tasks started twice (bound: {held} held by the workers)")
    assert twice <= held, f"{twice} duplicates: more than the {held} the workers could hold"
    wait_for(lambda: _count(dsn, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 0, 60,
             what="the job table to empty on the new primary")
    # still consuming, on the new primary, unaided
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        producer = app.amqp.Producer(conn, auto_declare=True)
        for i in range(20):
            app.send_task("record", args=(f"after{i}",), producer=producer)
    wait_for(lambda: _count(dsn, f'SELECT count(*) FROM "{schema}".pgjobs_test_run '
                                 "WHERE label LIKE 'after%'") == 20, 60,
             what="tasks published after the failover to run")
    for w in workers:
        assert w.proc.poll() is None, w.output()[-3000:]
        assert "Unrecoverable error" not in w.output(), w.output()[-3000:]


def _claim_one(dsn: str, schema: str, queue: str) -> tuple[int, int]:
    from kombu_pgjobs.store.core import QueueCore

    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="fence-test:1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        claimed = core.claim(conn, [queue], 1).claimed
    assert len(claimed) == 1
    return claimed[0].id, claimed[0].claim


def _ack(dsn: str, schema: str, pair: tuple[int, int]) -> set[int]:
    from kombu_pgjobs.store.core import QueueCore

    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="fence-test:1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return core.ack(conn, [pair])


def test_a_claim_lost_in_an_asynchronous_failover_is_never_handed_out_again(pair, schema):
    """Asynchronous replication: the primary claims a message the standby never receives, then
    dies; the standby is promoted. Without the fence the new primary hands out the same claim
    number again, and the first holder's ack settles the second run. With it, the new run gets
    a number above every old one: the stale ack misses and the new holder's ack lands."""
    primary, standby = pair
    with psycopg.connect(primary.dsn, autocommit=True) as db:  # back to asynchronous
        db.execute("ALTER SYSTEM RESET synchronous_standby_names")
        db.execute("SELECT pg_reload_conf()")
    url = f"pgjobs://postgres@{_hosts(primary, standby)}/postgres"
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        conn.SimpleQueue("fenced").put({"n": 1})
    def replayed() -> bool:
        with psycopg.connect(standby.dsn, autocommit=True) as db:
            try:
                return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0]
            except psycopg.errors.UndefinedTable:
                return False

    wait_for(replayed, 30, what="the standby to have the message")
    standby.halt()  # the standby misses what follows
    stale = _claim_one(primary.dsn, schema, "fenced")
    primary.halt()
    standby.start()
    standby.promote()
    # the first pgjobs connection to the new primary (here: a publish's) fences the claims
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        conn.SimpleQueue("other").put({"n": 2})
    fresh = _claim_one(standby.dsn, schema, "fenced")
    assert fresh[0] == stale[0] and fresh[1] > stale[1], (stale, fresh)
    assert _ack(standby.dsn, schema, stale) == set(), "a stale holder settled the new run"
    assert _ack(standby.dsn, schema, fresh) == {fresh[0]}
    assert _count(standby.dsn, f'SELECT fences FROM "{schema}".pgjobs_epoch') == 1
