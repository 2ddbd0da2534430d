"""The outbox with the broker elsewhere (issue 13, items 3-4): ``celery_ext.transaction()``
stages messages in ``pgjobs_outbox`` in the app's transaction, and ``pgjobs relay`` processes
publish them to Redis / RabbitMQ at least once, in order per transaction.

Real Postgres, real Redis and RabbitMQ, real relay and worker processes, relays killed with
SIGKILL; counts are read from the database the tasks write to.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import kombu
import psycopg
import pytest

import celery_ext
from kombu_pgjobs.broker.relay import Relay
from kombu_pgjobs.errors import OutboxNotInstalled
from kombu_pgjobs.store.core import IDEMPOTENCY_HEADER, TENANT_HEADER
from kombu_pgjobs.store.schema import migrate

from .conftest import DSN, ROOT, wait_for
from .test_outbox import _env, _load, _runs

pytestmark = pytest.mark.e2e

BROKERS = {
    "redis": "redis://127.0.0.1:6379/5",
    "amqp": "amqp://guest:guest@127.0.0.1:5672//",
}
APP = "tests.apps.outboxed"


def _reachable(url: str) -> None:
    """The broker must be up: under CI=true a missing one fails the test, never skips it."""
    host, port = ("127.0.0.1", 6379) if url.startswith("redis") else ("127.0.0.1", 5672)
    try:
        socket.create_connection((host, port), timeout=3).close()
    except OSError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{url.split(':')[0]} is required under CI=true: {exc}")
        pytest.skip(f"{url} unreachable: {exc}")


@pytest.fixture(params=sorted(BROKERS))
def broker(request: Any, schema: str) -> Any:
    url = BROKERS[request.param]
    _reachable(url)
    queue = f"outbox_{schema}"
    yield url, queue
    with kombu.Connection(url) as conn:  # the test's queue goes with it
        try:
            kombu.Queue(queue, channel=conn.default_channel).delete()
        except Exception:  # never declared (the test failed early)
            pass


@pytest.fixture
def app_db(db: psycopg.Connection[Any], recorder_tables: str) -> str:
    migrate(db, recorder_tables)  # the outbox table (and the rest of the schema) in the app db
    return recorder_tables


def _relay(schema: str, broker: str, log: Path, *, batch: int, lease_ttl: float
           ) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kombu_pgjobs.ops.cli", "relay", "--dsn", DSN, "--schema", schema,
           "--broker", broker, "--batch", str(batch), "--lease-ttl", str(lease_ttl),
           "--poll-interval", "0.2", "--retry-delay", "0.5"]
    with open(log, "ab") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})


def _outbox(db: psycopg.Connection[Any], schema: str) -> tuple[int, int]:
    row = db.execute(f'SELECT count(*) FILTER (WHERE published_at IS NULL), '
                     f'count(*) FILTER (WHERE published_at IS NOT NULL) '
                     f'FROM "{schema}".pgjobs_outbox').fetchone()
    return int(row[0]), int(row[1])


def _held_by(db: psycopg.Connection[Any], schema: str, pid: int) -> int:
    return db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_outbox WHERE published_at IS NULL '
        "AND lease_owner LIKE %s AND lease_expires_at > now()", (f"%:{pid}",)).fetchone()[0]


def _freeze_holding(db: psycopg.Connection[Any], schema: str, relay: subprocess.Popen[bytes],
                    floor: int, timeout: float = 30.0) -> None:
    """Stop ``relay`` (SIGSTOP) at a moment it holds a claimed batch, once ``floor`` rows are
    published. A relay to Redis publishes a batch in milliseconds: frozen, what it holds cannot
    change under the check (sampling it running could miss every batch until none was left)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _outbox(db, schema)[1] >= floor:
            relay.send_signal(signal.SIGSTOP)
            # A statement it sent just before it stopped (marking its batch published) still
            # completes at the server: let it, so the rows checked are the rows it holds.
            time.sleep(0.05)
            if _held_by(db, schema, relay.pid) > 0:
                return
            relay.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError(f"relay {relay.pid} was never caught holding a batch past {floor} "
                         f"published rows ({_outbox(db, schema)} staged/published)")


@pytest.mark.slow
def test_relay_two_relays_one_killed_twice_every_task_runs_at_least_once(
        db, app_db, broker, start_worker, tmp_path):
    schema = app_db
    url, queue = broker
    env = _env(schema, url, PGJOBS_TEST_QUEUE=queue)
    mod = _load(schema, url, PGJOBS_TEST_QUEUE=queue)
    n, per_txn, batch, lease = 2000, 50, 50, 2.0
    with psycopg.connect(DSN) as conn:
        for t in range(n // per_txn):
            with conn.transaction(), celery_ext.transaction(conn) as block:
                for i in range(per_txn):
                    mod.record.delay(f"t{t * per_txn + i}")
            assert block.staged == per_txn
        with conn.transaction(force_rollback=True), celery_ext.transaction(conn):
            for i in range(100):
                mod.record.delay(f"rolled-back-{i}")
    assert _outbox(db, schema) == (n, 0), "staged in the app db, the rolled back ones gone"

    start_worker(app=APP, env=env, concurrency=8)
    log = tmp_path / "relays.log"
    relays = [_relay(schema, url, log, batch=batch, lease_ttl=lease)]
    kills = 0
    try:
        # SIGKILL relay A mid-run while it holds a claimed batch, twice: A, then the A started
        # in its place, each caught (frozen) holding a batch once it publishes at full speed.
        # Only then does B join, and the killed relays' rows must be published by the others
        # within one lease of each kill. (Waiting for that before the second kill, a relay to
        # Redis had published everything else meanwhile, leaving no batch to be killed with.)
        killed: list[tuple[list[int], float]] = []
        for _ in range(2):
            victim = relays[0]
            floor = min(_outbox(db, schema)[1] + 4 * batch, n - 4 * batch)
            _freeze_holding(db, schema, victim, floor)
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            kills += 1
            held = [r[0] for r in db.execute(
                f'SELECT id FROM "{schema}".pgjobs_outbox WHERE published_at IS NULL '
                "AND lease_owner LIKE %s", (f"%:{victim.pid}",))]
            assert held and _outbox(db, schema)[0] > 0, "killed mid-run, holding rows"
            killed.append((held, time.monotonic()))
            relays[0] = _relay(schema, url, log, batch=batch, lease_ttl=lease)  # A again
        relays.append(_relay(schema, url, log, batch=batch, lease_ttl=lease))  # B
        for held, killed_at in killed:
            wait_for(lambda h=held: db.execute(
                f'SELECT count(*) = 0 FROM "{schema}".pgjobs_outbox WHERE id = ANY(%s) '
                "AND published_at IS NULL", (h,)).fetchone()[0], 30, interval=0.05,
                what="the killed relay's rows published by another")
            # within one lease (plus a relay's start-up on a loaded machine)
            assert time.monotonic() - killed_at < lease + 15
        wait_for(lambda: _outbox(db, schema) == (0, n), 60, what="every staged row published")
        wait_for(lambda: len([k for k in _runs(db, schema) if k.startswith("t")]) >= n, 90,
                 what=f"{n} distinct tasks run")
        time.sleep(1.0)  # let late duplicates land
    finally:
        for r in relays:
            if r.poll() is None:
                r.send_signal(signal.SIGTERM)
        for r in relays:
            try:
                r.wait(15)
            except subprocess.TimeoutExpired:
                r.kill()
    runs = _runs(db, schema)
    labels = {k: v for k, v in runs.items() if k.startswith("t")}
    assert set(labels) == {f"t{i}" for i in range(n)}, "every task ran at least once"
    assert not [k for k in runs if k.startswith("rolled-back")], runs
    duplicates = sum(labels.values()) - n
    overtaken = db.execute(  # per-transaction order held across two relays and two kills
        f'SELECT count(*) FROM "{schema}".pgjobs_outbox AS o WHERE EXISTS (SELECT 1 FROM '
        f'"{schema}".pgjobs_outbox AS e WHERE e.txid = o.txid AND e.id < o.id '
        "AND e.published_at > o.published_at)").fetchone()[0]
    assert overtaken == 0
    assert db.execute(f'SELECT count(DISTINCT lease_owner) FROM "{schema}".pgjobs_outbox'
                      ).fetchone()[0] == 0, "marked rows hold no lease"
    assert duplicates <= kills * batch, (duplicates, "bounded by the batch per kill")
    relay_log = log.read_text(errors="replace")
    assert "Traceback" not in relay_log, relay_log[-3000:]
    print(f"relay {url.split(':')[0]}: {n} tasks, {kills} kills, {duplicates} duplicates")


def test_headers_pass_through_staging_unchanged_and_order_per_transaction(
        db, app_db, dsn):
    """Tenant and idempotency headers reach the broker as celery_ext stamped them; a
    transaction's messages are published in the order they were staged."""
    _reachable(BROKERS["redis"])
    schema = app_db
    url = BROKERS["redis"]
    queue = f"outbox_{schema}_h"
    mod = _load(schema, url, PGJOBS_TEST_QUEUE=queue)
    with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
        mod.keyed.apply_async(("a",), kwargs={"org": "acme"})
        for i in range(20):
            mod.record.delay(f"o{i}")
    staged = db.execute(
        f'SELECT headers FROM "{schema}".pgjobs_outbox ORDER BY id LIMIT 1').fetchone()[0]
    assert staged[TENANT_HEADER] == "acme" and staged[IDEMPOTENCY_HEADER] == "key-a"
    relay = Relay(DSN, url, schema=schema, batch=7)
    try:
        while relay.run_once():
            pass
    finally:
        relay.close()
    assert _outbox(db, schema) == (0, 21)
    got: list[Any] = []
    with kombu.Connection(url) as conn:
        q = conn.SimpleQueue(queue)
        try:
            for _ in range(21):
                m = q.get(timeout=5)
                got.append(m)
                m.ack()
        finally:
            q.close()
            kombu.Queue(queue, channel=conn.default_channel).delete()
    first = got[0].headers
    assert {k: first[k] for k in (TENANT_HEADER, IDEMPOTENCY_HEADER, "task")} == {
        TENANT_HEADER: "acme", IDEMPOTENCY_HEADER: "key-a", "task": "keyed"}
    assert {k: v for k, v in first.items()} == staged, "headers unchanged through staging"
    order = [m.headers["argsrepr"] for m in got[1:]]
    assert order == [f"('o{i}',)" for i in range(20)], "published in staging order"


def test_outbox_missing_is_refused_with_a_code_and_the_transaction_survives(
        db, recorder_tables):
    schema = recorder_tables  # the test tables only: no pgjobs schema in this "app database"
    mod = _load(schema, BROKERS["redis"])
    with psycopg.connect(DSN) as conn, conn.transaction():
        conn.execute(f'INSERT INTO "{schema}".pgjobs_test_run (label) VALUES (%s)', ("kept",))
        with pytest.raises(OutboxNotInstalled) as err, celery_ext.transaction(conn):
            mod.record.delay("nowhere")
        assert err.value.code == "PGJ-511"
    assert _runs(db, schema) == {"kept": 1}, "the app's transaction still committed"


def test_staging_needs_no_broker(db, app_db):
    """A broker that is down when the app commits is no reason to lose or refuse the task:
    staging touches only the app's database."""
    schema = app_db
    mod = _load(schema, "redis://127.0.0.1:1/0")  # nothing listens there
    with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
        mod.record.delay("broker-down")
        mod.record.apply_async(("broker-down-later",), countdown=30)
    assert _outbox(db, schema) == (2, 0)


def test_worker_bootstep_relays_the_outbox(db, app_db, start_worker):
    """``app.steps["worker"].add(celery_ext.OutboxRelay)``: the worker publishes what the app
    staged, and runs it; no separate relay process."""
    _reachable(BROKERS["redis"])
    schema = app_db
    url = BROKERS["redis"]
    queue = f"outbox_{schema}_step"
    env = _env(schema, url, PGJOBS_TEST_QUEUE=queue, PGJOBS_TEST_RELAY="1")
    mod = _load(schema, url, PGJOBS_TEST_QUEUE=queue)
    with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
        for i in range(30):
            mod.record.delay(f"step-{i}")
    worker = start_worker(app=APP, env=env, concurrency=4)
    try:
        wait_for(lambda: len([k for k in _runs(db, schema) if k.startswith("step-")]) == 30,
                 60, what="30 tasks relayed by the worker's bootstep and run")
        assert _outbox(db, schema) == (0, 30)
        with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
            mod.record.delay("step-after-start")  # woken by the commit's NOTIFY
        wait_for(lambda: _runs(db, schema).get("step-after-start"), 30, what="a later one")
    finally:
        worker.stop()
        with kombu.Connection(url) as conn:
            kombu.Queue(queue, channel=conn.default_channel).delete()
    assert set(_runs(db, schema).values()) == {1}


def test_relay_reconnects_after_its_backend_is_terminated(db, app_db):
    """A terminated backend is an ordinary event: the relay reconnects by itself and goes on
    publishing (rows it held come back when their lease lapses)."""
    import threading

    _reachable(BROKERS["redis"])
    schema = app_db
    url = BROKERS["redis"]
    queue = f"outbox_{schema}_fault"
    mod = _load(schema, url, PGJOBS_TEST_QUEUE=queue)

    def stage(prefix: str) -> None:
        with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
            for i in range(10):
                mod.record.delay(f"{prefix}-{i}")

    relay = Relay(DSN, url, schema=schema, batch=5, lease_ttl=2, poll_interval=0.2)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    try:
        stage("before")
        wait_for(lambda: _outbox(db, schema) == (0, 10), 20, what="the first 10 published")
        killed = db.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND query LIKE %s", (f'%"{schema}"%',)).fetchone()[0]
        assert killed >= 1, "the relay's backend was found and terminated"
        stage("after")
        wait_for(lambda: _outbox(db, schema) == (0, 20), 30, what="published after the fault")
    finally:
        stop.set()
        thread.join(15)
        with kombu.Connection(url) as conn:
            kombu.Queue(queue, channel=conn.default_channel).delete()
    assert not thread.is_alive()


def test_an_idle_relay_is_woken_by_the_staging_commit(db, app_db):
    """LISTEN/NOTIFY, not the poll: with a 30 s poll interval the row is published within a
    few seconds of the commit."""
    import threading

    _reachable(BROKERS["redis"])
    schema = app_db
    url = BROKERS["redis"]
    queue = f"outbox_{schema}_wake"
    mod = _load(schema, url, PGJOBS_TEST_QUEUE=queue)
    relay = Relay(DSN, url, schema=schema, poll_interval=30)
    stop = threading.Event()
    thread = threading.Thread(target=relay.run, args=(stop,), daemon=True)
    thread.start()
    try:
        time.sleep(1.0)  # the relay found nothing and waits on LISTEN
        with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
            mod.record.delay("wake")
        committed = time.monotonic()
        wait_for(lambda: _outbox(db, schema) == (0, 1), 10, interval=0.02,
                 what="the staged row published after the NOTIFY")
        assert time.monotonic() - committed < 10
    finally:
        stop.set()
        with psycopg.connect(DSN) as conn, conn.transaction():
            conn.execute("SELECT pg_notify(%s, '')", (f"pgjobs_outbox.{schema}",))  # end the wait
        thread.join(15)
        with kombu.Connection(url) as conn:
            kombu.Queue(queue, channel=conn.default_channel).delete()
    assert not thread.is_alive()


OTHER_DB = "pgjobs_test_outbox_other"


@pytest.fixture
def other_db(dsn: str, schema: str) -> Any:
    """A second database on the same server: a pgjobs broker that is *not* the app's."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    with psycopg.connect(dsn, autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                             (OTHER_DB,)).fetchone():
            try:
                admin.execute(f'CREATE DATABASE "{OTHER_DB}"')
            except psycopg.errors.DuplicateDatabase:
                pass  # another run made it meanwhile
    other = psycopg.conninfo.make_conninfo(dsn, dbname=OTHER_DB)
    url = (f"pgjobs://{info.get('user', 'postgres')}@{info.get('host', '127.0.0.1')}:"
           f"{info.get('port', '5432')}/{OTHER_DB}")
    yield other, url
    with psycopg.connect(other, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def test_same_database_is_decided_by_the_server_not_the_url(db, app_db, other_db, url):
    """The app connects through another address (a Unix socket / localhost) than the broker
    URL names: still the same database, rows go straight to pgjobs_job. A pgjobs broker in
    another database of the same server: staged, and the relay moves them there."""
    schema = app_db
    mod = _load(schema, url)  # broker: pgjobs on 127.0.0.1, this database
    other, other_url = other_db
    for app_dsn in (psycopg.conninfo.make_conninfo(DSN, host="localhost"),
                    psycopg.conninfo.make_conninfo(DSN, host="/var/run/postgresql")):
        if "/" in app_dsn and not os.path.exists("/var/run/postgresql"):
            continue
        with psycopg.connect(app_dsn) as conn, conn.transaction(), \
                celery_ext.transaction(conn) as block:
            mod.record.delay("same")
        assert (block.written, block.staged) == (1, 0), app_dsn
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] >= 1
    assert _outbox(db, schema) == (0, 0)

    elsewhere = _load(schema, other_url)  # broker: pgjobs in the other database
    with psycopg.connect(DSN) as conn, conn.transaction(), \
            celery_ext.transaction(conn) as block:
        elsewhere.record.delay("elsewhere")
    assert (block.written, block.staged) == (1, 1)
    relay = Relay(DSN, other_url, schema=schema,
                  transport_options={"schema": schema})
    try:
        assert relay.run_once() == 1
    finally:
        relay.close()
    with psycopg.connect(other) as conn:
        got = conn.execute(f"""SELECT message->'headers'->>'argsrepr' FROM "{schema}".pgjobs_job"""
                           ).fetchall()
    assert got == [("('elsewhere',)",)]


def test_unstageable_and_bypassing_publishes_are_refused_with_codes(db, app_db, other_db):
    """Headers that are not JSON (PGJ-512), and a kombu publish straight to a pgjobs broker on
    another database inside a block (PGJ-513): refused where they are made, nothing written,
    the app's transaction still usable."""
    from kombu_pgjobs.errors import OutboxBypassed, OutboxUnserializable

    schema = app_db
    other, other_url = other_db
    mod = _load(schema, BROKERS["redis"])
    with psycopg.connect(DSN) as conn, conn.transaction():
        with pytest.raises(OutboxUnserializable) as bad, celery_ext.transaction(conn):
            mod.record.apply_async(("x",), headers={"not-json": object()})
        assert bad.value.code == "PGJ-512"
        with kombu.Connection(other_url, transport_options={"schema": schema}) as k:
            with pytest.raises(OutboxBypassed) as bypass, celery_ext.transaction(conn):
                k.Producer().publish({"n": 1}, routing_key="q")
        assert bypass.value.code == "PGJ-513"
        conn.execute(f'INSERT INTO "{schema}".pgjobs_test_run (label) VALUES (%s)', ("ok",))
    assert _outbox(db, schema) == (0, 0)
    assert _runs(db, schema) == {"ok": 1}
    with psycopg.connect(other) as conn:
        assert conn.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0


def test_cli_status_prune_and_bad_relay_arguments(db, app_db, capsys):
    """`pgjobs outbox status`, `pgjobs prune` / `pgjobs outbox prune` delete published rows
    only, and `pgjobs relay` refuses bad numbers with a code (exit 2)."""
    import json

    from kombu_pgjobs.ops.cli.main import main

    schema = app_db
    mod = _load(schema, BROKERS["redis"])
    with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
        for i in range(3):
            mod.record.delay(f"p{i}")
    db.execute(f'UPDATE "{schema}".pgjobs_outbox SET published_at = now() - interval \'2 days\' '
               f'WHERE id IN (SELECT id FROM "{schema}".pgjobs_outbox ORDER BY id LIMIT 2)')
    common = ["--dsn", DSN, "--schema", schema, "--json"]
    assert main(["outbox", "status", *common]) == 0
    assert json.loads(capsys.readouterr().out) == {"schema": schema, "staged": 1,
                                                   "published": 2}
    assert main(["prune", "--older-than", "7d", "--outbox-older-than", "1d", "--dry-run",
                 *common]) == 0
    assert json.loads(capsys.readouterr().out)["outbox"] == {"matched": 2, "deleted": 0}
    assert main(["prune", "--older-than", "7d", "--outbox-older-than", "3d", *common]) == 0
    assert json.loads(capsys.readouterr().out)["outbox"] == {"matched": 0, "deleted": 0}
    assert main(["outbox", "prune", "--older-than", "1d", *common]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == 2
    assert _outbox(db, schema) == (1, 0), "the staged row is never pruned"
    assert main(["relay", "--broker", BROKERS["redis"], "--batch", "0", *common]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-405"


def test_relay_prune_after_deletes_old_published_rows_when_idle(db, app_db, tmp_path):
    schema = app_db
    url = BROKERS["redis"]
    _reachable(url)
    queue = f"outbox_{schema}_prune"
    mod = _load(schema, url, PGJOBS_TEST_QUEUE=queue)
    with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
        for i in range(3):
            mod.record.delay(f"pr{i}")
    db.execute(f'UPDATE "{schema}".pgjobs_outbox SET published_at = now() - interval \'2 hours\' '
               f'WHERE id = (SELECT min(id) FROM "{schema}".pgjobs_outbox)')
    cmd = [sys.executable, "-m", "kombu_pgjobs.ops.cli", "relay", "--dsn", DSN, "--schema", schema,
           "--broker", url, "--poll-interval", "0.2", "--prune-after", "1h"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # the two fresh rows are published and kept; the old published one is pruned
        wait_for(lambda: _outbox(db, schema) == (0, 2), 30, what="publish, then prune")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0, "SIGTERM ends the relay cleanly"
        with kombu.Connection(url) as conn:
            kombu.Queue(queue, channel=conn.default_channel).delete()


def test_a_broker_that_is_down_leaves_the_rows_for_later_in_order(db, app_db, caplog):
    """The relay cannot reach the broker: the rows go back with the error recorded
    (PGJ-515) and are published, in order, once the retry delay passed and a broker answers."""
    _reachable(BROKERS["redis"])
    schema = app_db
    queue = f"outbox_{schema}_down"
    mod = _load(schema, BROKERS["redis"], PGJOBS_TEST_QUEUE=queue)
    with psycopg.connect(DSN) as conn, conn.transaction(), celery_ext.transaction(conn):
        for i in range(5):
            mod.record.delay(f"d{i}")
    down = Relay(DSN, "redis://127.0.0.1:1/0", schema=schema, retry_delay=1.0)
    try:
        assert down.run_once() == 0
    finally:
        down.close()
    rows = db.execute(f'SELECT attempts, last_error IS NOT NULL, lease_owner, '
                      f'lease_expires_at > now() FROM "{schema}".pgjobs_outbox ORDER BY id'
                      ).fetchall()
    assert rows[0] == (1, True, None, True), "the failed row: error kept, back after a delay"
    assert all(r[1:] == (False, None, True) for r in rows[1:]), "the rest wait behind it"
    assert "PGJ-515" in caplog.text
    up = Relay(DSN, BROKERS["redis"], schema=schema)
    try:
        assert up.run_once() == 0, "not before the retry delay"
        time.sleep(1.2)
        assert up.run_once() == 5
    finally:
        up.close()
    got = []
    with kombu.Connection(BROKERS["redis"]) as conn:
        q = conn.SimpleQueue(queue)
        try:
            for _ in range(5):
                m = q.get(timeout=5)
                got.append(m.headers["argsrepr"])
                m.ack()
        finally:
            q.close()
            kombu.Queue(queue, channel=conn.default_channel).delete()
    assert got == [f"('d{i}',)" for i in range(5)]
