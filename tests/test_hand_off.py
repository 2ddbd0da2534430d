"""A publish that wakes an idle consumer claims its message for it (0018_hand_off.sql).

The trigger is driven by real publishes through kombu; the registrations are made either by a
hand-written waiter (a connection holding its wake id's lock and LISTENing on its channel, to
read exactly what the trigger sends) or by real kombu consumers.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.broker import outbox
from kombu_pgjobs.broker.waiting import handed_ids
from kombu_pgjobs.store.core import QueueCore, job_from_message

from .conftest import broker_url, wait_for
from .test_wake_one import Drainer, _producer, _waiters
from .wirecount import WireCounter

QUEUE = "ho"


@contextmanager
def _waiter(dsn: str, schema: str, *, lease_ttl: float | None = 30.0,
            worker: str = "hand:1") -> Iterator[tuple[psycopg.Connection[Any], int]]:
    """A registration as a consumer makes it: the wake id's lock held, its channel LISTENed."""
    waiter = random.randrange(2**32, 2**62)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", [waiter])
        conn.execute(f'LISTEN "pgjobs.w.{waiter}"')
        conn.execute(f'INSERT INTO "{schema}".pgjobs_waiter (queue, waiter, worker, lease_ttl) '
                     "VALUES (%s, %s, %s, %s)", [QUEUE, waiter, worker, lease_ttl])
        yield conn, waiter


def _row(db: psycopg.Connection[Any], schema: str) -> tuple[Any, ...]:
    return db.execute(
        f"SELECT id, state, claim, attempts, worker, "
        f"       extract(epoch FROM lease_expires_at - created_at)::float8 "
        f'  FROM "{schema}".pgjobs_job WHERE queue = %s', [QUEUE]).fetchone()


def test_a_publish_hands_its_message_to_the_consumer_it_wakes(
        url: str, dsn: str, schema: str, db: psycopg.Connection[Any]) -> None:
    producer = _producer(url, schema, QUEUE)
    try:
        with _waiter(dsn, schema) as (conn, waiter):
            producer.SimpleQueue(QUEUE).put({"n": 1})
            (note,) = list(conn.notifies(timeout=5, stop_after=1))
        row = handed_ids(note.payload, waiter)
        assert row is not None and row.queue == QUEUE
        # ids only (0021_trust_boundary.sql): the message never travels in a notification
        assert note.payload == f"\x1e{row.id} {row.claim}:{QUEUE}"
        job_id, state, claim, attempts, worker, lease = _row(db, schema)
        # Claimed in the publish's own transaction: the lease starts at the row's creation.
        assert (row.id, row.claim) == (job_id, claim) == (job_id, 1)
        assert (state, attempts, worker, lease) == ("running", 1, "hand:1", 30.0)
        record = db.execute(f'SELECT job_id, claim, waiter FROM "{schema}".pgjobs_handoff'
                            ).fetchall()
        assert record == [(row.id, row.claim, waiter)]
        assert _waiters(db, schema, QUEUE) == 0  # the registration went with the hand-off
        # The consumer's fenced take reads the message once: a replay reads nothing.
        core = QueueCore(schema, lease_ttl=30, max_attempts=3, worker="hand:1")
        stored = db.execute(f'SELECT message::text FROM "{schema}".pgjobs_job').fetchone()[0]
        (taken,) = core.take_handed(db, [row])
        assert (taken.id, taken.claim, taken.queue, taken.message) == (
            row.id, row.claim, QUEUE, stored)
        assert core.take_handed(db, [row]) == []
    finally:
        producer.release()


@pytest.mark.parametrize("case", ["countdown", "limits", "paused", "wake_only"])
def test_messages_a_claim_would_not_take_at_once_only_wake_the_consumer(
        case: str, url: str, dsn: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """Not due, under a limit, on a paused queue, or a consumer that wants wake-ups only: the
    wake-up names the queue and the row stays ready for the consumer's claim."""
    producer = _producer(url, schema, QUEUE)
    try:
        if case == "paused":
            db.execute(f'UPDATE "{schema}".pgjobs_queue SET paused = true WHERE name = %s',
                       [QUEUE])
        body: Any = {"n": 1}
        with _waiter(dsn, schema, lease_ttl=None if case == "wake_only" else 30.0) as (
                conn, _):
            p = producer.Producer()
            if case == "countdown":
                p.publish(body, routing_key=QUEUE, headers={"eta": "2999-01-01T00:00:00"})
            elif case == "limits":
                p.publish(body, routing_key=QUEUE, headers={
                    "x-pgjobs-limits": {"concurrency": [{"key": "k:1", "limit": 1}]}})
            else:
                p.publish(body, routing_key=QUEUE)
            notes = list(conn.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in notes] == [QUEUE]
        _, state, claim, attempts, worker, _ = _row(db, schema)
        assert (state, claim, attempts, worker) == ("ready", 0, 0, None)
    finally:
        producer.release()


def test_a_consumer_takes_a_handed_message_without_claiming_and_acks_it(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """A real consumer: the message it runs was claimed by the publish (its lease starts at
    the row's creation), and its ack (fenced on that claim) deletes the row."""
    held = threading.Event()
    release = threading.Event()
    consumer = Drainer(url, schema, [QUEUE], "pgjt-hand")

    def on(body: Any, message: Any) -> None:
        consumer.got.append((body, message.delivery_tag))
        held.set()
        release.wait(10)
        message.ack()

    consumer._on = on
    producer = _producer(url, schema, QUEUE)
    try:
        consumer.start()
        wait_for(lambda: _waiters(db, schema, QUEUE) == 1, 10, what="registered")
        producer.SimpleQueue(QUEUE).put({"n": 7})
        assert held.wait(10)
        job_id, state, claim, attempts, worker, lease = _row(db, schema)
        assert (state, claim, attempts, lease) == ("running", 1, 1, 30.0)
        assert worker == consumer.conn.transport.backend.worker
        assert consumer.got == [({"n": 7}, f"{job_id}.1")]
        release.set()
        wait_for(lambda: _row(db, schema) is None, 10, what="the ack")
        wait_for(lambda: _waiters(db, schema, QUEUE) == 1, 10, what="registered again")
    finally:
        release.set()
        consumer.stop_event.set()
        consumer.join(10)
        producer.release()
    assert consumer.error is None


def test_a_message_handed_to_a_full_window_goes_back_unstarted(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """C1 (prefetch 1) waits on queues A and B, C2 on B only, registered after C1. A message
    to A fills C1's window; one to B is then handed to C1 (the oldest registration), which
    cannot take it: it goes back uncounted and C2 runs it, on its first counted attempt."""
    a, b = f"{QUEUE}-a", f"{QUEUE}-b"
    first = Drainer(url, schema, [a, b], "pgjt-hand-full")
    first.prefetch = 1
    first._on = lambda body, message: first.got.append((body, message.delivery_tag))  # no ack
    second = Drainer(url, schema, [b], "pgjt-hand-other")
    second._on = lambda body, message: second.got.append((body, message.delivery_tag))
    producer = kombu.Connection(url, transport_options={"schema": schema})
    try:
        for q in (a, b):
            kombu.Queue(q, channel=producer.default_channel).declare()
        first.start()
        wait_for(lambda: _waiters(db, schema, a) + _waiters(db, schema, b) == 2, 10,
                 what="C1 registered on both")
        second.start()
        wait_for(lambda: _waiters(db, schema, b) == 2, 10, what="C2 registered")
        producer.SimpleQueue(a).put({"to": "a"})
        wait_for(lambda: first.got, 10, what="C1 took A's message")
        producer.SimpleQueue(b).put({"to": "b"})
        wait_for(lambda: second.got, 10, what="C2 got the message C1 handed back")
        assert [body for body, _ in first.got] == [{"to": "a"}]
        row = db.execute(f'SELECT claim, attempts, state, run_at = created_at '
                         f'FROM "{schema}".pgjobs_job WHERE queue = %s', [b]).fetchone()
        assert row == (2, 1, "running", True), \
            "handed back uncounted and in its place, then claimed by C2"
    finally:
        for d in (first, second):
            d.stop_event.set()
        for d in (first, second):
            d.join(10)
        producer.release()
    assert first.error is None and second.error is None


@pytest.mark.parametrize("waiting", [True, False])
def test_a_publish_that_hands_off_commits_durably_even_when_asynchronous(
        waiting: bool, url: str, dsn: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """A claim is durable: an asynchronous transaction (durable_publish=False's setting) that
    hands a message off is flushed at its commit (synchronous_commit=local); one that only
    inserts stays asynchronous. One transaction set as a publish of durable_publish=False
    sets its own (pgjobs.hand_off: the statement is its whole transaction)."""
    _producer(url, schema, QUEUE).release()  # the schema and the queue
    with _waiter(dsn, schema, lease_ttl=30.0 if waiting else None) as (conn, _):
        with psycopg.connect(dsn, autocommit=True) as app:
            cur = app.execute(
                "SELECT set_config('synchronous_commit', 'off', true), "
                "       set_config('pgjobs.hand_off', 'on', true); "
                f'INSERT INTO "{schema}".pgjobs_job (queue, message) '
                f"VALUES ('{QUEUE}', '{{\"n\": 1}}'); "
                "SELECT current_setting('synchronous_commit')")
            cur.nextset()  # the INSERT's
            cur.nextset()  # the last SELECT's
            setting = cur.fetchone()[0]
        (note,) = list(conn.notifies(timeout=5, stop_after=1))
    assert (handed_ids(note.payload, 1) is not None) == waiting
    assert setting == ("local" if waiting else "off")


def test_a_publish_inside_a_longer_transaction_only_wakes(
        url: str, dsn: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """An outbox publish in the app's transaction: the lease would start at the transaction's
    start and the commit may come any time later, so the consumer is only woken."""
    producer = _producer(url, schema, QUEUE)
    try:
        with _waiter(dsn, schema) as (conn, _):
            with psycopg.connect(dsn) as app, app.transaction():
                app.execute("SELECT 1")
                with outbox.transaction(app, schema=schema):
                    producer.Producer().publish({"n": 1}, routing_key=QUEUE)
            notes = list(conn.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in notes] == [QUEUE]
        assert _row(db, schema)[1:4] == ("ready", 0, 0)
    finally:
        producer.release()


def test_a_reconnected_consumer_drops_the_registrations_of_its_half_dead_session(
        dsn: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """The network between a consumer and PostgreSQL is cut while the consumer waits; the
    server has not noticed, so the old session still holds its wake id's lock and its
    registration looks alive. The consumer reconnects and must drop that registration: else
    the next publish hands its message to the dead session, where it waits out its lease."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    with WireCounter(info.get("host") or "127.0.0.1", int(info.get("port") or 5432)) as proxy:
        url = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{proxy.port}/"
               f"{info.get('dbname', 'test')}")
        consumer = Drainer(url, schema, [QUEUE], "pgjt-hand-cut", lease_ttl=60.0)
        producer = _producer(broker_url(), schema, QUEUE)
        try:
            consumer.start()
            wait_for(lambda: _waiters(db, schema, QUEUE) == 1, 10, what="registered")
            (old,) = db.execute(f'SELECT waiter FROM "{schema}".pgjobs_waiter').fetchone()
            proxy.strand()
            wait_for(lambda: db.execute(
                f'SELECT count(*) FROM "{schema}".pgjobs_waiter WHERE waiter <> %s',
                [old]).fetchone()[0] == 1, 15, what="registered again on a new session")
            assert db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' "
                              "AND ((classid::bigint << 32) | objid::bigint) = %s",
                              [old]).fetchone()[0] == 1, "the old session lives on"
            assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_waiter WHERE waiter = %s',
                              [old]).fetchone()[0] == 0
            producer.SimpleQueue(QUEUE).put({"n": 1})
            wait_for(lambda: consumer.got, 5, what="the message, on the live session")
        finally:
            consumer.stop_event.set()
            consumer.join(10)
            producer.release()
    assert consumer.error is None


@pytest.mark.parametrize("block", [False, True])
def test_a_publish_hands_off_only_as_its_own_transaction(
        block: bool, url: str, dsn: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """On an autocommit connection a publish is its own transaction, unless a transaction
    block is open on it (psycopg's ``transaction()``): then it only wakes."""
    _producer(url, schema, QUEUE).release()  # the schema and the queue
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    job = job_from_message(QUEUE, {"body": "b", "headers": {}, "properties": {},
                                   "content-type": "application/json",
                                   "content-encoding": "utf-8"})
    with _waiter(dsn, schema) as (conn, _), psycopg.connect(dsn, autocommit=True) as app:
        if block:
            with app.transaction():
                core.publish(app, job)
        else:
            core.publish(app, job)
        (note,) = list(conn.notifies(timeout=5, stop_after=1))
    assert (handed_ids(note.payload, 1) is None) == block


_HOLDER = """
import sys, time, kombu
url, schema = sys.argv[1], sys.argv[2]
conn = kombu.Connection(url, transport_options={"schema": schema, "lease_ttl": 2.0,
                                                "idle_poll_interval": 3600.0,
                                                "application_name": "pgjt-hand-killed"})
ch = conn.channel()
kombu.Consumer(ch, queues=[kombu.Queue("ho", channel=ch)],
               callbacks=[lambda b, m: time.sleep(3600)]).consume()  # runs it, never acks
while True:
    try:
        conn.drain_events(timeout=1)
    except TimeoutError:
        pass
"""


@pytest.mark.exclusive  # timing bound: back within the lease, a keeper tick and a claim
def test_a_handed_message_of_a_killed_worker_comes_back_within_its_lease(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """A real process is handed a message (claimed in the publish) and SIGKILLed while it
    runs it: the message comes back when the lease lapses and another consumer completes
    it, once; the dead holder's claim number is fenced off."""
    producer = _producer(url, schema, QUEUE)
    doomed = subprocess.Popen([sys.executable, "-c", _HOLDER, url, schema],
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_for(lambda: _waiters(db, schema, QUEUE) == 1, 20, what="the holder registered")
        producer.SimpleQueue(QUEUE).put({"n": 1})
        wait_for(lambda: _row(db, schema)[1] == "running", 10, what="the hand-off")
        job_id, _, claim, attempts, worker, lease = _row(db, schema)
        assert (claim, attempts, lease, f":{doomed.pid}:" in worker) == (1, 1, 2.0, True)
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.wait(10)
        killed_at = time.monotonic()
        live = Drainer(url, schema, [QUEUE], "pgjt-hand-live", lease_ttl=2.0)
        live._on = lambda body, message: (live.got.append((body, message.delivery_tag)),
                                          message.ack())
        live.start()
        try:
            wait_for(lambda: live.got, 15, interval=0.05, what="the message, back")
            # the lease (2 s), two of the live keeper's ticks (lease/3 each), 2 s of slack
            assert time.monotonic() - killed_at < 2.0 + 2 * 2.0 / 3 + 2.0, "within its lease"
            wait_for(lambda: _row(db, schema) is None, 10, what="the ack")
        finally:
            live.stop_event.set()
            live.join(10)
        assert live.error is None
        assert live.got == [({"n": 1}, f"{job_id}.2")], "once, under the next claim number"
        dead = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0]
        assert dead == 0
    finally:
        if doomed.poll() is None:
            doomed.kill()
        producer.release()
