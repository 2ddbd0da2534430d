"""Outages longer than a lease (issue 29): nothing re-run, the control plane intact, a fence
that costs nothing and fences every server start.

The broker is a private server (tests/pgserver.py) that the test stops for longer than the
workers' lease; the tasks record what they did in the shared test database, which stays up, so
a task can finish during the outage and its ack wait in the worker. Counts are read back from
both databases: starts and completions per label, rows left in the job table.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from kombu import Connection

from kombu_pgjobs.store.core import QueueCore
from tests.conftest import import_app, wait_for
from tests.pgserver import PrivateServer

pytestmark = pytest.mark.e2e
#: exclusive (tests/conftest.py): timing bounds of a few seconds around a lease of 6 s
exclusive = pytest.mark.exclusive

LEASE = 6.0  # the workers' lease_ttl: a keeper tick every 2 s


@pytest.fixture
def server(private_server: PrivateServer) -> PrivateServer:
    return private_server


def _one(dsn: str, query: str) -> Any:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as db:
        row = db.execute(query).fetchone()
        return row[0] if row else None


def _publish(url: str, schema: str, calls: list[tuple[str, tuple[Any, ...]]]) -> None:
    from celery import Celery

    app = Celery("outage", broker=url)
    app.conf.broker_transport_options = {"schema": schema}
    with Connection(url, transport_options={"schema": schema}) as conn:
        producer = app.amqp.Producer(conn, auto_declare=True)
        for task, args in calls:
            app.send_task(task, args=args, producer=producer)


def _env(server: PrivateServer, **extra: str) -> dict[str, str]:
    return {"PGJOBS_TEST_BROKER": server.url, "PGJOBS_TEST_LEASE_TTL": str(LEASE),
            "PGJOBS_TEST_PREFETCH": "2", **extra}


def _server_processes(server: PrivateServer) -> list[int]:
    """The private server's postmaster, then every process it forked (its backends, and its
    checkpointer, WAL writer, ...): read from /proc, the postmaster's pid from its lock file."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ')'
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        if int(fields[1]) == postmaster:
            children.append(int(stat.parent.name))
    return [postmaster, *sorted(children)]


@contextlib.contextmanager
def _stalled(server: PrivateServer) -> Iterator[list[int]]:
    """The server stops answering without closing a connection, as on a stalled storage: its
    postmaster is stopped first (SIGSTOP: it forks nothing more), then every process it forked.
    Clients' sockets stay open and their statements wait; a new connection or a cancel request
    is accepted by the kernel and never answered. Every process goes on (SIGCONT) at the end,
    whatever happened in the block."""
    postmaster = _server_processes(server)[0]
    stopped: list[int] = []
    try:
        os.kill(postmaster, signal.SIGSTOP)
        stopped.append(postmaster)
        for pid in _server_processes(server)[1:]:  # listed again: none is forked now
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield stopped
    finally:
        for pid in reversed(stopped):  # the backends first, the postmaster last
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


@contextlib.contextmanager
def _halted(server: PrivateServer) -> Iterator[None]:
    """The server stops at once (``-m immediate``, as a crash) and starts again at the end."""
    server.halt()
    try:
        yield
    finally:
        server.start()


def _stalled_checked(server: PrivateServer) -> Any:
    """:func:`_stalled`, checked to be one: a new connection is accepted, never answered."""

    @contextlib.contextmanager
    def stall() -> Iterator[None]:
        with _stalled(server) as stopped:
            with pytest.raises(psycopg.OperationalError):
                psycopg.connect(server.dsn, connect_timeout=2).close()
            yield
        assert len(stopped) >= 3, stopped  # the postmaster, the workers' backends and more

    return stall()


@pytest.mark.slow
@exclusive
@pytest.mark.parametrize("pool", ["prefork", "threads"])
@pytest.mark.parametrize("fault", ["stopped", "stalled"])
def test_a_server_out_for_longer_than_the_lease_reruns_nothing(
        server, dsn, schema, recorder_tables, start_worker, pool, fault):
    """Two workers (lease 6 s) run 4 tasks of 20 s and 4 of 4 s, with 4 more prefetched; once
    all eight run, the broker's server is out for 9 s (1.5 leases): ``stopped`` (an immediate
    stop, then a start: every connection breaks) or ``stalled`` (its postmaster and every
    process it forked SIGSTOPped, then SIGCONT: no connection breaks, every statement and the
    keepers' cancel requests wait, and when it goes on its clock has moved past every lease).
    The short ones finish during the outage (their acks wait in the workers), the long ones
    after it. Every task starts once and completes once, the acks of those that finished in
    the outage land, and the job table empties: no lease lapsed for time its holder could not
    reach the database."""
    env = _env(server)
    workers = [start_worker(name=f"w{i}", pool=pool, concurrency=4, env=env) for i in (1, 2)]
    calls = [("sleep_record", (f"long{i}", 20.0)) for i in range(4)]
    calls += [("sleep_record", (f"short{i}", 4.0)) for i in range(4)]
    calls += [("sleep_record", (f"queued{i}", 1.0)) for i in range(4)]
    _publish(server.url, schema, calls)
    starts = f'SELECT count(*) FROM "{schema}".pgjobs_test_start'
    wait_for(lambda: _one(dsn, starts) >= 8, 60, what="eight tasks to start")
    with _halted(server) if fault == "stopped" else _stalled_checked(server):
        # the shared database's clock (it stays up; the tasks write their finish time there)
        out_at = _one(dsn, "SELECT clock_timestamp()")
        time.sleep(1.5 * LEASE)
        back_at = _one(dsn, "SELECT clock_timestamp()")
    runs = f'SELECT count(DISTINCT label) FROM "{schema}".pgjobs_test_run'
    wait_for(lambda: _one(dsn, runs) == len(calls), 90, interval=0.5,
             what="every task to complete")
    wait_for(lambda: _one(server.dsn, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 0,
             30, what="the job table to empty (every ack landed)")
    time.sleep(LEASE)  # a second start would come after a lapse: give it the time
    twice = _one(dsn, f'SELECT string_agg(label, \', \') FROM (SELECT label FROM "{schema}".'
                      "pgjobs_test_start GROUP BY label HAVING count(*) > 1) t")
    assert twice is None, f"started a second time: {twice}"
    assert _one(dsn, starts) == len(calls)
    assert _one(dsn, f'SELECT count(*) FROM "{schema}".pgjobs_test_run') == len(calls)
    # Some tasks really finished while the broker's server was out: their acks could only
    # wait in the workers, and the job table emptied, so those buffered acks landed after it.
    in_outage = _one(dsn, f"SELECT string_agg(label, ', ' ORDER BY label) "
                          f'FROM "{schema}".pgjobs_test_run '
                          f"WHERE finished > '{out_at.isoformat()}' "
                          f"AND finished < '{back_at.isoformat()}'")
    finished = in_outage.split(", ") if in_outage else []
    # the short ones, and the prefetched ones the workers started after them (delivered
    # already); never a long one (20 s from before the outage)
    assert any(label.startswith("short") for label in finished), (
        f"no short task finished during the outage: {finished}")
    assert not any(label.startswith("long") for label in finished), finished
    dead = _one(server.dsn, f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter')
    assert dead == 0
    for w in workers:
        assert w.proc.poll() is None, w.output()[-3000:]
        out = w.output()
        assert "pgjobs.lease.rescued" not in out and "PGJ-204" not in out, out[-3000:]


@pytest.mark.slow  # its own server, and bounds of seconds around a 40 s stop: not exclusive
def test_remote_control_answers_from_both_workers_after_a_40s_stop(
        server, schema, recorder_tables, start_worker):
    """Two workers, the broker's server stopped 40 s (many leases, and four times the pidbox
    queues' x-expires): afterwards `inspect ping` answers from both, and no keeper dropped
    the other's live pidbox queue (none had to be declared again)."""
    env = _env(server)
    workers = [start_worker(name=f"w{i}", env=env) for i in (1, 2)]
    app = import_app("tests.apps.recorder", schema, server.url,
                     PGJOBS_TEST_LEASE_TTL=str(LEASE)).app

    def pinged() -> set[str]:
        return {name.split("@")[0] for reply in app.control.ping(timeout=2.0)
                for name in reply}

    wait_for(lambda: pinged() == {"w1", "w2"}, 30, what="both workers to answer before")
    server.halt()
    time.sleep(40)
    server.start()
    wait_for(lambda: pinged() == {"w1", "w2"}, 20, interval=1.0,
             what="both workers to answer after the outage")
    time.sleep(3 * LEASE)  # keepers that judge others gone have had their time
    assert pinged() == {"w1", "w2"}
    app.close()
    for w in workers:
        out = w.output()
        assert "PGJ-205" not in out and "pgjobs.queue.expired" not in out, out[-3000:]
        assert "pgjobs.queue.redeclared" not in out, out[-3000:]


def _claim(dsn: str, schema: str, queue: str) -> tuple[int, int]:
    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="outage-test:1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        claimed = core.claim(conn, [queue], 1).claimed
    assert len(claimed) == 1
    return claimed[0].id, claimed[0].claim


def _settle(dsn: str, schema: str, pair: tuple[int, int], how: str) -> set[int]:
    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="outage-test:1")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return core.ack(conn, [pair]) if how == "ack" else set(core.renew(conn, [pair]))


def test_a_restore_from_a_storage_snapshot_is_fenced(server, schema):
    """A server started from a storage snapshot lost a claim it made after the snapshot: the
    claim number handed out then is never handed out again (the WAL timeline did not change,
    so version 14's fence saw nothing), the stale holder's ack misses, the new one lands."""
    with Connection(server.url, transport_options={"schema": schema}) as conn:
        conn.SimpleQueue("snap").put({"n": 1})
    snapshot = server.snapshot()
    stale = _claim(server.dsn, schema, "snap")
    server.restore(snapshot)  # the claim is gone; the message is ready again
    fresh = _claim(server.dsn, schema, "snap")
    assert fresh[0] == stale[0] and fresh[1] > stale[1], (stale, fresh)
    assert _settle(server.dsn, schema, stale, "ack") == set(), "a stale holder settled"
    assert _settle(server.dsn, schema, fresh, "ack") == {fresh[0]}


def test_the_fence_rewrites_no_row_and_runs_under_a_short_timeout(server, schema):
    """300,000 messages and statement_timeout = 1 s (version 14's fence rewrote every row in
    one statement: cancelled, retried by every connection, the fleet never connected). After a
    restart the first connection and claim succeed under that timeout, no message's claim
    number moved, and the new claim is above every number before; a message running across the
    restart keeps its number: its holder's renewal and ack land."""
    with Connection(server.url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("deep")
        q.put({"n": 0})
        q.put({"n": 1})
    running = _claim(server.dsn, schema, "deep")
    with psycopg.connect(server.dsn, autocommit=True) as db:
        db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, message, claim) '
                   f'SELECT \'deep\', message, (g % 1000) + 1 '
                   f'FROM "{schema}".pgjobs_job, generate_series(1, 300000) AS g '
                   f'WHERE id = {running[0]}')
        db.execute("ALTER SYSTEM SET statement_timeout = '1s'")
    sums = f'SELECT array[sum(claim), max(claim)] FROM "{schema}".pgjobs_job'
    before = _one(server.dsn, sums)
    server.restart()
    started = time.monotonic()
    with Connection(server.url, transport_options={"schema": schema,
                                                   "statement_timeout": 1.0}) as conn:
        conn.SimpleQueue("other").put({"n": 2})
        fresh_msg = conn.SimpleQueue("other").get(timeout=10)
        fresh_msg.ack()
    took = time.monotonic() - started
    assert took < 10, f"connecting after the restart took {took:.1f}s"
    after = _one(server.dsn, sums)
    assert after == before, "the fence rewrote claim numbers"
    assert _one(server.dsn, f'SELECT fences FROM "{schema}".pgjobs_epoch') >= 1
    fresh = _claim(server.dsn, schema, "deep")
    assert fresh[1] > before[1], (fresh, before)
    assert _settle(server.dsn, schema, running, "renew") == {running[0]}
    assert _settle(server.dsn, schema, running, "ack") == {running[0]}


@exclusive  # a lease of 3 s on the shared server: the keeper's tick within seconds
def test_a_consumed_queue_found_dropped_is_declared_again_with_its_bindings(
        url, dsn, schema, recorder_tables, start_worker):
    """A worker's pidbox queue and its binding are dropped under it (an operator, or a keeper
    of an older version that expired it while the worker lived): the worker's keeper declares
    the queue again with the binding it made, and `inspect ping` answers again."""
    w = start_worker(name="w1", env={"PGJOBS_TEST_LEASE_TTL": "3"})
    app = import_app("tests.apps.recorder", schema, url, PGJOBS_TEST_LEASE_TTL="3").app
    wait_for(lambda: app.control.ping(timeout=1.0), 30, what="the worker to answer")
    assert "pgjobs.queue.redeclared" not in w.output()
    with psycopg.connect(dsn, autocommit=True) as db:
        gone = db.execute(f'DELETE FROM "{schema}".pgjobs_queue WHERE name LIKE %s '
                          "RETURNING name", ("w1@%.celery.pidbox",)).fetchall()
        assert len(gone) == 1
        bindings = db.execute(f'DELETE FROM "{schema}".pgjobs_binding WHERE queue = %s',
                              (gone[0][0],)).rowcount
        assert bindings >= 1
        # The keeper ticks about once a second under this lease: it may declare the queue again
        # before a ping could tell the drop, so the drop is read back from the rows, and the
        # redeclare from the worker's own log line and the rows it wrote again.
        wait_for(lambda: "pgjobs.queue.redeclared" in w.output(), 15, interval=0.2,
                 what="the keeper to declare the dropped queue again")
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_queue WHERE name = %s',
                          (gone[0][0],)).fetchone()[0] == 1
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_binding WHERE queue = %s',
                          (gone[0][0],)).fetchone()[0] == bindings
    wait_for(lambda: app.control.ping(timeout=1.0), 15, interval=0.5,
             what="the worker to answer again")
    app.close()


@exclusive  # a lease of 4 s on the shared server: a lapse is a matter of seconds
def test_a_stuck_keeper_statement_is_cancelled_within_half_a_lease(url, dsn, schema, caplog):
    """A kombu consumer (lease 4 s, the default statement_timeout of 60 s and lock_timeout of
    10 s) holds two messages and acks one, whose concurrency key another session keeps locked
    for three leases: the keeper's flush of that ack waits for the key's lock (a claim would
    skip it; the flush waits). The flush is cancelled after half a lease and tried again each
    tick, so neither held message's lease lapses (read from Postgres all along), none is
    rescued, the ack stays buffered and lands once the lock is released. Before, the flush
    waited out lock_timeout (10 s) between two renewals and both leases lapsed."""
    import logging

    caplog.set_level(logging.INFO, logger="kombu_pgjobs")
    lease = 4.0
    limits = {"concurrency": [{"key": "stuck-key", "limit": 1}]}
    conn = Connection(url, transport_options={"schema": schema, "lease_ttl": lease})
    try:
        with conn.SimpleQueue("stuck") as queue:
            queue.put({"n": "limited"}, headers={"x-pgjobs-limits": limits})
            queue.put({"n": "plain"})
            got = {m.payload["n"]: m for m in (queue.get(timeout=5), queue.get(timeout=5))}
            limited, plain = got["limited"], got["plain"]
            ids = {n: int(m.delivery_tag.split(".")[0]) for n, m in got.items()}
            with psycopg.connect(dsn, autocommit=True) as locker, \
                    psycopg.connect(dsn, autocommit=True) as db:
                key = db.execute(
                    f"SELECT limits -> 'concurrency' -> 0 ->> 'key' "
                    f'FROM "{schema}".pgjobs_job WHERE id = %s', (ids["limited"],)
                ).fetchone()[0]
                claims = dict(db.execute(f'SELECT id, claim FROM "{schema}".pgjobs_job'
                                         ).fetchall())
                locker.execute("BEGIN")
                assert locker.execute(
                    f'SELECT 1 FROM "{schema}".pgjobs_lock WHERE class = \'limit\' '
                    "AND bucket = hashtext(%s) & 1023 FOR UPDATE", (key,)).fetchone()
                limited.ack()  # buffered: nobody drains, so the keeper flushes it
                held_for = 3 * lease
                ends = time.monotonic() + held_for
                margins: list[float] = []
                while time.monotonic() < ends:
                    rows = db.execute(
                        f"SELECT id, state, claim, "
                        f"extract(epoch FROM lease_expires_at - clock_timestamp()) "
                        f'FROM "{schema}".pgjobs_job ORDER BY id').fetchall()
                    assert [(r[0], r[1], r[2]) for r in rows] == [
                        (i, "running", claims[i]) for i in sorted(claims)], rows
                    margins.append(min(float(r[3]) for r in rows))
                    assert margins[-1] > 0, (
                        f"a lease lapsed while a keeper statement waited: {rows}")
                    time.sleep(0.1)
                waiting = db.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE %s", (f"%{schema}%",)).fetchone()[0]
                locker.execute("ROLLBACK")
                wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job '
                                            "WHERE id = %s", (ids["limited"],)
                                            ).fetchone()[0] == 0,
                         3 * lease, interval=0.1,
                         what="the buffered ack to land once the lock is released")
                assert db.execute(f'SELECT state, claim, attempts FROM "{schema}".pgjobs_job'
                                  ).fetchall() == [("running", claims[ids["plain"]], 1)]
            plain.ack()
    finally:
        conn.release()
    log = [r.getMessage() for r in caplog.records]
    cancelled = [m for m in log if "pgjobs.ack.flush_failed" in m]
    assert cancelled and all("canceling statement due to user request" in m
                             for m in cancelled), log
    # each flush waits at most half a lease, then ticks renew: at least a try per lease
    assert len(cancelled) >= 2, cancelled
    assert waiting <= 1, "one statement waits for the key's lock at a time"
    assert not any("pgjobs.lease." in m for m in log), log  # neither lost nor rescued
    assert min(margins) > 0.5, f"the closest a lease came to lapsing: {min(margins):.2f}s"


def test_a_tick_the_database_held_up_judges_no_other_holder(url, dsn, schema):
    """A tick whose renewal the database held for longer than a tick's interval (a stall
    under it, a lock) is a break: every other keeper waited as long to renew, so this tick
    rescues nobody's lapsed lease, and judges again only after a full lease of reachable time.
    Shown with a keeper of a real consumer's backend that could judge (a lease of reachable
    time behind it), a lapsed lease of another holder planted, and the consumer's own row
    locked under its renewal for longer than an interval. The same keeper, not held up,
    rescues it (the row can be rescued: the test could fail)."""
    import threading

    from kombu_pgjobs.broker.backend import Keeper

    lease = 6.0
    conn = Connection(url, transport_options={"schema": schema, "lease_ttl": lease})
    try:
        with conn.SimpleQueue("held") as queue:
            queue.put({"n": "mine"})
            queue.put({"n": "theirs"})
            mine = queue.get(timeout=5)
            backend = conn.default_channel.backend
            mine_id = int(mine.delivery_tag.split(".")[0])
            with psycopg.connect(dsn, autocommit=True) as db, \
                    psycopg.connect(dsn, autocommit=True) as locker, \
                    contextlib.ExitStack() as stack:
                # another holder's run whose lease lapsed (its process gone)
                theirs = db.execute(
                    f"UPDATE \"{schema}\".pgjobs_job SET state = 'running', claim = claim + 1, "
                    "attempts = 1, worker = 'gone:1:x', "
                    "lease_expires_at = now() - interval '1 minute' "
                    "WHERE id <> %s RETURNING id, claim", (mine_id,)).fetchone()

                def state() -> tuple[Any, ...]:
                    return db.execute(f'SELECT state, claim FROM "{schema}".pgjobs_job '
                                      "WHERE id = %s", (theirs[0],)).fetchone()

                keeper = Keeper(backend)  # not started: its ticks run here, one at a time
                stack.callback(lambda: keeper._conn is not None and keeper._conn.close())
                interval = backend.options.tick_interval
                keeper.connection()  # opened: a new connection is a break of its own
                keeper.reachable_since = time.monotonic() - 10 * lease
                # its last good tick an interval ago and a little more (it slept between two)
                keeper._last_ok = time.monotonic() - interval - 1.0
                locker.execute("BEGIN")
                locker.execute(f'SELECT 1 FROM "{schema}".pgjobs_job WHERE id = %s FOR UPDATE',
                               (mine_id,))
                # held past two intervals and a second since that tick, for less than the
                # keeper's bound (half a lease)
                release = threading.Timer(interval + 0.7, locker.execute, ("ROLLBACK",))
                release.start()
                started = time.monotonic()
                keeper.tick()  # its renewal waits for the lock, then maintenance
                release.join()
                assert time.monotonic() - started > interval
                assert state() == ("running", theirs[1]), "rescued after a held-up tick"
                assert keeper.reachable_since is not None
                assert keeper.reachable_since >= started + interval
                keeper.tick()  # not a full lease of reachable time since the break
                assert state() == ("running", theirs[1]), "rescued too early after a break"
                # the same keeper with a lease of reachable time and a tick not held up
                keeper.reachable_since = time.monotonic() - 10 * lease
                keeper._last_ok = time.monotonic()
                keeper.tick()
                assert state() == ("ready", theirs[1]), "a lapsed lease the keeper may rescue"
            mine.ack()
    finally:
        conn.release()
