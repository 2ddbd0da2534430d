"""Connection faults at the kombu level: terminated backends (only this test's own, found by
a unique application_name), a stopped server, malformed rows, LISTEN sessions that stop reading.

Each test says which promise of issue 11 it holds: what was handed back, what stayed held,
what reached the database — always read back from the database.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.broker.backend import backend_for
from kombu_pgjobs.broker.consumer import State

from .conftest import ROOT, wait_for


@pytest.fixture
def appname() -> str:
    return f"pgjt-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def connect(url: str, schema: str, appname: str) -> Iterator[Callable[..., kombu.Connection]]:
    made: list[kombu.Connection] = []

    def make(**options: Any) -> kombu.Connection:
        conn = kombu.Connection(url, transport_options={
            "schema": schema, "application_name": appname, **options})
        made.append(conn)
        return conn

    yield make
    for c in made:
        c.release()


def _terminate(db: psycopg.Connection[Any], appname: str) -> int:
    row = db.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                     "WHERE application_name = %s", [appname]).fetchone()
    return int(row[0]) if row else 0


def _unreachable(conninfo: str) -> str:
    """The same conninfo on a port nobody listens on: every new connection fails."""
    params = psycopg.conninfo.conninfo_to_dict(conninfo)
    params["port"] = "1"
    return psycopg.conninfo.make_conninfo(**params)


def _rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, int, int]]:
    return db.execute(f'SELECT state, claim, attempts FROM "{schema}".pgjobs_job '
                      "ORDER BY id").fetchall()


def _consume(conn: kombu.Connection, queue: str, got: list[Any], prefetch: int = 8) -> Any:
    channel = conn.channel()
    channel.basic_qos(prefetch_size=0, prefetch_count=prefetch)
    q = kombu.Queue(queue, channel=channel)
    q.declare()
    consumer = kombu.Consumer(channel, queues=[q], callbacks=[lambda b, m: got.append(m)])
    consumer.consume()
    return channel


def _drain(conn: kombu.Connection, done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        try:
            conn.drain_events(timeout=0.2)
        except TimeoutError:
            pass


def test_terminated_backends_leave_delivered_messages_held_and_their_acks_land(
        connect, db, schema, appname):
    """Item 2: a broken claim connection hands back nothing that was delivered (the messages
    keep their leases and run), the consumer goes on by itself, and the acks settle."""
    conn = connect()
    got: list[Any] = []
    _consume(conn, "rc", got, prefetch=20)
    with conn.Producer() as producer:
        for i in range(6):
            producer.publish({"i": i}, routing_key="rc")
    _drain(conn, lambda: len(got) >= 6, 10)
    assert len(got) == 6
    assert _terminate(db, appname) >= 2  # the claim, publish and keeper connections
    # The consumer notices on its next claim and reconnects; nothing goes back to ready.
    _drain(conn, lambda: conn.transport.consumer.state is State.CONNECTED, 5)
    with conn.Producer() as producer:
        producer.publish({"i": 6}, routing_key="rc")
    _drain(conn, lambda: len(got) >= 7, 10)
    assert sorted(m.payload["i"] for m in got) == list(range(7)), "each message once"
    assert _rows(db, schema) == [("running", 1, 1)] * 7
    for m in got:
        m.ack()
    _drain(conn, lambda: not _rows(db, schema), 10)
    assert _rows(db, schema) == []


def test_ack_after_the_connection_closed_is_fenced_not_an_error(connect, db, schema,
                                                                 caplog):
    """Item 2: a task that finishes after its channel and connection closed still acks
    without raising (AttributeError before): the ack goes to the process backend's fenced
    buffer and is flushed — here it misses, as the close handed the message back."""
    caplog.set_level(logging.WARNING, logger="kombu_pgjobs")
    conn = connect()
    with conn.SimpleQueue("late") as queue:
        queue.put({"x": 1})
        message = queue.get(timeout=5)
    channel = message.channel
    conn.release()
    assert channel.connection is None
    assert _rows(db, schema) == [("ready", 1, 0)], "handed back at close, uncounted"
    message.ack()
    assert channel.backend.flush_pending()
    assert _rows(db, schema) == [("ready", 1, 0)], "the stale ack changed nothing"
    assert any("pgjobs.settle.unowned" in r.getMessage() for r in caplog.records)


def test_hand_back_on_a_dead_publish_connection_is_retried(connect, db, schema, appname):
    """Item 1: closing a channel hands its prefetched messages back on the publish
    connection; when that connection was terminated, the hand-back goes again on a new one."""
    conn = connect()
    got: list[Any] = []
    channel = _consume(conn, "hb", got, prefetch=4)
    with conn.Producer() as producer:
        for i in range(4):
            producer.publish({"i": i}, routing_key="hb")
    _drain(conn, lambda: len(got) >= 4, 10)
    assert _terminate(db, appname) >= 1
    channel.close()
    assert _rows(db, schema) == [("ready", 1, 0)] * 4, "handed back, no attempt counted"
    backend = backend_for(conn.transport.backend.conninfo, conn.transport.options)
    assert backend.held_pairs() == [], "nothing left for the keeper to renew"


def test_malformed_row_is_buried_and_the_rows_claimed_with_it_delivered(connect, db, schema):
    """Item 13: a row whose message is not a kombu message is dead-lettered (malformed),
    and the good rows of the same claim are delivered, not left leased."""
    conn = connect()
    got: list[Any] = []
    _consume(conn, "mf", got)
    with conn.Producer() as producer:
        producer.publish({"i": 0}, routing_key="mf")
    for text in ('"just a string"', "[1, 2]", '{"properties": 7}', "null"):
        db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, message) VALUES (%s, %s)',
                   ["mf", text])
    with conn.Producer() as producer:
        producer.publish({"i": 1}, routing_key="mf")
    _drain(conn, lambda: len(got) >= 2, 10)
    assert sorted(m.payload["i"] for m in got) == [0, 1]
    dead = db.execute(f'SELECT reason, error->>\'code\' FROM "{schema}".pgjobs_dead_letter'
                      ).fetchall()
    assert dead == [("malformed", "PGJ-211")] * 4
    for m in got:
        m.ack()
    _drain(conn, lambda: not _rows(db, schema), 10)
    assert _rows(db, schema) == []


def test_listen_only_while_consuming(connect, schema):
    """Item 6: a connection that only used basic_get, or whose consumers were cancelled,
    does not LISTEN (a session that listens and never reads holds the server's
    notification queue back for every database)."""
    conn = connect()
    with conn.SimpleQueue("ln") as queue:
        queue.put({"x": 1})
        queue.get(timeout=5).ack()
    consumer = conn.transport.consumer

    def listening() -> list[str]:
        with consumer.lock:
            return [r[0] for r in consumer.claim_conn().execute(
                "SELECT pg_listening_channels()").fetchall()]

    assert listening() == [], "basic_get alone never LISTENs"
    got: list[Any] = []
    channel = _consume(conn, "ln", got)
    try:
        conn.drain_events(timeout=0.3)
    except TimeoutError:
        pass
    # the schema's channel and the connection's own wake channel (kombu_pgjobs.broker.waiting)
    assert sorted(listening()) == sorted([f"pgjobs.{schema}", consumer.waits.channel])
    for tag in list(channel._consumers):
        channel.basic_cancel(tag)
    assert listening() == []


def test_buffered_acks_survive_a_failed_flush_and_process_exit(url, schema, db, appname):
    """Item 3: an ack whose flush failed is retried (keeper), and acks still buffered when
    a process exits without closing anything are flushed by the exit hook."""
    script = textwrap.dedent(f"""
        import kombu, psycopg
        url, schema = {url!r}, {schema!r}
        conn = kombu.Connection(url, transport_options={{"schema": schema,
            "application_name": {appname!r}, "ack_flush_interval": 1.0}})
        q = conn.SimpleQueue("ex")
        for i in range(3):
            q.put({{"i": i}})
        msgs = [q.get(timeout=5) for _ in range(3)]
        for m in msgs:
            m.ack()   # buffered; the process exits before any flush
        print("acked", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert "acked" in out.stdout, out.stderr
    assert _rows(db, schema) == [], "the exit hook flushed every buffered ack"


def test_keeper_retries_an_ack_whose_flush_failed(connect, db, schema, appname):
    """Item 3: an ack whose flush failed stays buffered and the keeper's tick settles it once
    the database can be reached again (nobody else flushes here)."""
    conn = connect(lease_ttl=3.0, ack_flush_interval=0.1)
    with conn.SimpleQueue("kr") as queue:
        queue.put({"x": 1})
        message = queue.get(timeout=5)
        backend = message.channel.backend
        good = backend.conninfo
        backend.conninfo = _unreachable(good)
        _terminate(db, appname)  # and every connection of this process is dead
        message.ack()
        assert not backend.flush_pending(), "the flush fails on every connection"
        assert backend.oldest_ack_age() is not None, "the ack is still buffered"
        assert _rows(db, schema) == [("running", 1, 1)]
        backend.conninfo = good
        wait_for(lambda: not _rows(db, schema), 15, what="the keeper to flush the ack")


def test_settle_that_fails_for_good_stops_renewing(connect, db, schema, appname):
    """Item 1: when a hand-back cannot reach the database at all, its leases are no longer
    renewed: they lapse and the rows come back (never stranded behind a renewed lease)."""
    conn = connect(lease_ttl=2.0)
    with conn.SimpleQueue("sf") as queue:
        queue.put({"x": 1})
        message = queue.get(timeout=5)
    backend = message.channel.backend
    pair = (int(message.delivery_tag.split(".")[0]), 1)
    assert pair in backend.held_pairs()
    good = backend.conninfo
    backend.conninfo = _unreachable(good)
    _terminate(db, appname)
    backend.settle([pair], requeue=True, uncount=True)
    assert pair not in backend.held_pairs()
    backend.conninfo = good
    wait_for(lambda: _rows(db, schema) and _rows(db, schema)[0][0] == "ready", 15,
             what="the lapsed lease to be rescued")
    [(stored,)] = db.execute(f'SELECT message FROM "{schema}".pgjobs_job').fetchall()
    assert stored["properties"]["delivery_info"], "the message is intact"


def test_a_claim_that_keeps_failing_backs_off_on_one_connection(connect, db, schema, appname,
                                                               caplog):
    """A claim that fails on a healthy connection (here a trigger that refuses every claim)
    keeps its connection and backs off; the outage is logged once, and its end once."""
    caplog.set_level(logging.INFO, logger="kombu_pgjobs")
    conn = connect()
    got: list[Any] = []
    _consume(conn, "bo", got)
    with conn.Producer() as producer:
        producer.publish({"i": 0}, routing_key="bo")
    db.execute(f"""CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS
                   $$ BEGIN RAISE EXCEPTION 'claims refused by the test'; END $$""")
    db.execute(f'CREATE TRIGGER refuse BEFORE UPDATE ON "{schema}".pgjobs_job '
               f'FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse()')
    _drain(conn, lambda: False, 3.0)
    assert got == []
    connections = db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                             [appname]).fetchone()[0]
    assert connections <= 3, f"{connections} connections: the claim connection was kept"
    assert conn.transport.consumer._backoff >= 1.6, "the backoff grew"
    broken = [r for r in caplog.records if "pgjobs.consumer.broken" in r.getMessage()]
    assert len(broken) == 1, [r.getMessage() for r in broken]
    db.execute(f'DROP TRIGGER refuse ON "{schema}".pgjobs_job')
    _drain(conn, lambda: len(got) >= 1, 10)
    assert [m.payload for m in got] == [{"i": 0}]
    assert any("pgjobs.consumer.reconnected" in r.getMessage() for r in caplog.records)


def test_basic_get_of_a_malformed_row_buries_it(connect, db, schema):
    """Item 13, basic_get: the row is dead-lettered, nothing is left held."""
    conn = connect()
    with conn.SimpleQueue("bg") as queue:
        db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, message) VALUES (%s, %s)',
                   ["bg", '{"properties": {"body_encoding": "base64"}, "body": 5}'])
        channel = queue.channel
        assert channel.basic_get("bg") is None
        assert channel.backend.held_pairs() == []
        queue.put({"ok": 1})
        message = queue.get(timeout=5)
        assert message.payload == {"ok": 1}
        message.ack()
    dead = db.execute(f'SELECT reason FROM "{schema}".pgjobs_dead_letter').fetchall()
    assert dead == [("malformed",)]


def test_a_body_kombu_cannot_decode_is_buried_and_the_rest_delivered(connect, db, schema):
    conn = connect()
    got: list[Any] = []
    _consume(conn, "bd", got)
    for text in ('{"properties": {"body_encoding": "bogus"}, "body": "x"}',
                 '{"properties": {"body_encoding": "base64"}, "body": 5}'):
        db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, message) VALUES (%s, %s)',
                   ["bd", text])
    with conn.Producer() as producer:
        producer.publish({"i": 1}, routing_key="bd")
    _drain(conn, lambda: len(got) >= 1, 10)
    assert [m.payload for m in got] == [{"i": 1}]
    reasons = db.execute(f'SELECT reason FROM "{schema}".pgjobs_dead_letter').fetchall()
    assert reasons == [("malformed",)] * 2
    got[0].ack()
    _drain(conn, lambda: not _rows(db, schema), 10)
    assert _rows(db, schema) == []
