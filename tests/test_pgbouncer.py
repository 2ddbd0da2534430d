"""pgjobs behind PgBouncer in transaction pooling: poll-only mode, really run.

Each test starts a private PgBouncer (tests/pgbouncer.py) with ``pool_mode = transaction`` and
one server connection, so every client shares it: a session setting left by one client is seen
by the next, which is what made ``durable_publish=False`` and the keeper's vacuum timeout leak.
Nothing about LISTEN works through transaction pooling, so every client here runs with
``use_listen_notify=False``. Outcomes are read back from the database, not from logs.

With the DEFAULT options (prepared statements, LISTEN) a client behind the bouncer gets
:class:`PoolerUnsupported` (PGJ-112), naming the option to set, from whichever statement first
meets a server connection whose prepared statements are not its own: a publish raises it at
the caller, a consumer's claim raises it out of ``drain_events`` and out of Celery's event loop,
and a worker stops with it instead of reconnecting in a loop. The tests bring that moment about
on purpose (another client's statements prepared on the one server connection, or ``DEALLOCATE
ALL``): with many clients and servers it comes by itself, sooner or later.

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
from kombu.asynchronous import Hub

from kombu_pgjobs.errors import PoolerUnsupported
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.store.core import QueueCore, _Watchdog, job_from_message
from kombu_pgjobs.store.schema import migrate

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


# -- default options behind a transaction pooler: PGJ-112, at once, never retried -----------
def _prepare_elsewhere(bouncer: PgBouncer, count: int = 64) -> None:
    """Another client of the bouncer leaves prepared statements on its (one) server
    connection, named as psycopg names its own (``_pg3_0``, ``_pg3_1``...): what a transaction
    pooler's server connections carry when its clients prepare statements. A name already
    there (a pgjobs client's own) is left as it is."""
    with psycopg.connect(bouncer.dsn(), autocommit=True, prepare_threshold=None) as other:
        for i in range(count):
            try:
                other.execute(f'PREPARE "_pg3_{i}" AS SELECT {i}')
            except psycopg.errors.DuplicatePreparedStatement:
                pass


def _forget_prepared(bouncer: PgBouncer) -> None:
    """The server connection forgets every prepared statement (as a client's statements find
    a server connection other than the one that prepared them)."""
    with psycopg.connect(bouncer.dsn(), autocommit=True, prepare_threshold=None) as other:
        other.execute("DEALLOCATE ALL")


def _assert_pgj_112(exc: BaseException) -> None:
    assert type(exc) is PoolerUnsupported, repr(exc)  # itself: not kombu's OperationalError
    assert exc.code == "PGJ-112"
    text = str(exc)
    assert text.startswith("[PGJ-112]") and "use_listen_notify=False" in text, text
    assert isinstance(exc.__cause__, (psycopg.errors.DuplicatePreparedStatement,
                                      psycopg.errors.InvalidSqlStatementName))


def test_default_options_apply_async_raises_pgj_112(
        bouncer: PgBouncer, db: psycopg.Connection[Any], schema: str) -> None:
    """A prepared statement of the same name is on the server connection already: the
    publisher's first statement fails, and apply_async raises PGJ-112 at once (Celery's
    publish retry does not retry a configuration error)."""
    _prepare_elsewhere(bouncer)
    app = Celery("publisher", broker=bouncer.url())
    app.conf.broker_transport_options = {"schema": schema}  # the defaults: LISTEN, prepared

    @app.task(name="record")
    def record(label: str) -> None:  # pragma: no cover - never runs
        pass

    for _ in range(2):  # and again: no connection state hides it the second time
        with pytest.raises(PoolerUnsupported) as info:
            record.apply_async(args=["x"], retry_policy={"max_retries": 5})
        _assert_pgj_112(info.value)
        assert isinstance(info.value.__cause__, psycopg.errors.DuplicatePreparedStatement)
    app.close()


def test_default_options_publish_raises_pgj_112_when_the_server_forgets(
        bouncer: PgBouncer, db: psycopg.Connection[Any], schema: str) -> None:
    """A publisher whose statements were prepared on one server connection, sent to one that
    does not have them: PGJ-112, and the message was not written."""
    with kombu.Connection(bouncer.url(), transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("defaults")
        q.put({"i": 0})  # the first client of the server connection: this works
        _forget_prepared(bouncer)
        with pytest.raises(PoolerUnsupported) as info:
            q.put({"i": 1})
        _assert_pgj_112(info.value)
        assert isinstance(info.value.__cause__, psycopg.errors.InvalidSqlStatementName)
        q.close()
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 1


def test_default_options_unconfirmed_publish_raises_pgj_112_not_publish_failed(
        bouncer: PgBouncer, db: psycopg.Connection[Any], schema: str) -> None:
    """confirm_publish=False sends its INSERTs as its own prepared statement: when the server
    connection does not hold it, the next publish (or the confirm) raises PGJ-112 — not
    PGJ-107 PublishFailed, as if the messages were at fault — and nothing was written."""
    options = {"schema": schema, "confirm_publish": False}
    with kombu.Connection(bouncer.url(), transport_options=options) as conn:
        q = conn.SimpleQueue("unconfirmed")
        q.put({"i": 0})
        conn.default_channel.backend.confirm_publishes()  # the first one lands
        _forget_prepared(bouncer)
        with pytest.raises(PoolerUnsupported) as info:
            for i in range(1, 4):  # sent unconfirmed: raised at the next publish or confirm
                q.put({"i": i})
            conn.default_channel.backend.confirm_publishes()
        _assert_pgj_112(info.value)
        q.close()
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job') == 1


def test_default_options_keeper_pgj_112_stops_the_consumer(
        bouncer: PgBouncer, db: psycopg.Connection[Any], schema: str) -> None:
    """The keeper's renewal fails behind the pooler: it logs PGJ-219 and stops, and the
    consumer raises PGJ-112 at its next turn — a worker never runs on while the leases of its
    tasks cannot be renewed."""
    options = {"schema": schema, "lease_ttl": 1.5}
    with kombu.Connection(bouncer.url(), transport_options=options) as conn:
        q = conn.SimpleQueue("kept")
        q.put({"i": 0})
        backend = conn.default_channel.backend
        try:  # the keeper ticks as the consumer starts: its first statement may collide
            q.get(timeout=10)
        except PoolerUnsupported:
            pass
        _forget_prepared(bouncer)
        wait_for(lambda: backend.unsupported is not None, 10, what="the keeper to stop")
        _assert_pgj_112(backend.unsupported)
        for _ in range(2):  # raised at every turn
            with pytest.raises(PoolerUnsupported):
                q.get(timeout=2)
        q.close()


def test_default_options_consumer_raises_pgj_112(
        bouncer: PgBouncer, db: psycopg.Connection[Any], schema: str) -> None:
    """The claim connection's first prepared claim meets another client's statement of the
    same name: drain_events raises PGJ-112 (not an empty queue, not a reconnect loop), and
    so does every drain after it; nothing was claimed."""
    with kombu.Connection(bouncer.url(), transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("defaults")
        q.put({"i": 0})  # the publish connection and the schema: these work
        _prepare_elsewhere(bouncer)
        for _ in range(2):
            with pytest.raises(PoolerUnsupported) as info:
                q.get(timeout=5)
            _assert_pgj_112(info.value)
        q.close()
    assert db.execute(f'SELECT state, attempts FROM "{schema}".pgjobs_job').fetchall() == [
        ("ready", 0)]


def test_default_options_event_loop_raises_pgj_112(
        bouncer: PgBouncer, db: psycopg.Connection[Any], schema: str, url: str) -> None:
    """In Celery's event loop (the kombu Hub) claims go out and are read later, by the loop:
    a claim whose prepared statement the server forgot raises PGJ-112 out of the loop (a
    timer's error the Hub would only log: the loop's self-pipe raises it again)."""
    got: list[Any] = []
    conn = kombu.Connection(bouncer.url(), transport_options={
        "schema": schema, "idle_poll_interval": 1})
    channel = conn.channel()
    channel.basic_qos(prefetch_size=0, prefetch_count=8)
    queue = kombu.Queue("looped", channel=channel)
    queue.declare()
    kombu.Consumer(channel, queues=[queue],
                   callbacks=[lambda body, message: (got.append(body), message.ack())]).consume()
    # published straight to the database: the bouncer's publish connection is not the point
    direct = kombu.Connection(url, transport_options={"schema": schema})
    producer = direct.Producer()
    producer.publish({"i": 0}, routing_key="looped")
    hub = Hub()
    transport = conn.transport
    transport.register_with_event_loop(conn.connection, hub)
    try:
        loop = hub.create_loop()
        deadline = time.monotonic() + 20
        raised: BaseException | None = None
        while not got and raised is None and time.monotonic() < deadline:
            try:  # the keeper, which ticks as the consumer starts, may collide first
                next(loop)
            except PoolerUnsupported as exc:
                raised = exc
        if raised is None:
            assert got == [{"i": 0}]
            # the same claims again, now on a server connection that forgot them
            _forget_prepared(bouncer)
            for i in range(1, 4):
                producer.publish({"i": i}, routing_key="looped")
        deadline = time.monotonic() + 20
        while raised is None and time.monotonic() < deadline:
            try:
                next(loop)
            except PoolerUnsupported as exc:
                raised = exc
        assert raised is not None, f"the loop went on: {got}"
        _assert_pgj_112(raised)
        with pytest.raises(PoolerUnsupported):  # and at every turn after it
            transport.consumer.on_hub_event()
    finally:
        transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
        conn.release()
        direct.release()
    assert got in ([], [{"i": 0}])  # nothing after the error


def test_default_options_worker_stops_with_pgj_112(
        bouncer: PgBouncer, start_worker: Any, schema: str) -> None:
    """A `celery worker` with the default options behind the bouncer: it logs PGJ-112 with the
    option to set and exits, instead of reconnecting over it forever."""
    _prepare_elsewhere(bouncer)
    worker = start_worker(app="tests.apps.recorder", pool="threads", concurrency=2,
                          env={"PGJOBS_TEST_BROKER": bouncer.url()}, ready=False)
    try:
        code = worker.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    out = worker.output()
    assert code not in (None, 0), out[-4000:]
    assert "Unrecoverable error: PoolerUnsupported('[PGJ-112]" in out, out[-4000:]
    assert "use_listen_notify=False" in out, out[-4000:]
    assert "Trying again" not in out and "Cannot connect" not in out, out[-4000:]
    assert " ready." not in out, out[-4000:]
