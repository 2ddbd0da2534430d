"""A publish wakes one waiting consumer, and none when nobody waits (0017_wake_one.sql).

Consumers are real kombu connections (one claim connection each) draining in threads or in a
subprocess; every consumer's safety poll is set to an hour, so a publish that no consumer
heard would sit in the table for the whole test and fail it.
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

from .conftest import wait_for

QUEUE = "wk"
NO_SAFETY_POLL = {"idle_poll_interval": 3600.0}


def _waiters(db: psycopg.Connection[Any], schema: str, queue: str = QUEUE) -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_waiter WHERE queue = %s',
                      [queue]).fetchone()[0]


class Drainer(threading.Thread):
    """One kombu connection consuming ``queues`` until stopped; records (body, time)."""

    def __init__(self, url: str, schema: str, queues: list[str], name: str,
                 **options: Any) -> None:
        super().__init__(daemon=True, name=name)
        self.conn = kombu.Connection(url, transport_options={
            "schema": schema, "application_name": name, **NO_SAFETY_POLL, **options})
        self.queues = queues
        self.got: list[tuple[Any, float]] = []
        self.stop_event = threading.Event()
        self.error: BaseException | None = None
        self.consumer: kombu.Consumer | None = None
        self.prefetch: int | None = None

    def _on(self, body: Any, message: Any) -> None:
        self.got.append((body, time.monotonic()))
        message.ack()

    def run(self) -> None:
        try:
            with self.conn.channel() as channel:
                self.consumer = kombu.Consumer(
                    channel, queues=[kombu.Queue(q, channel=channel) for q in self.queues],
                    callbacks=[self._on], prefetch_count=self.prefetch)
                self.consumer.consume()
                while not self.stop_event.is_set():
                    try:
                        self.conn.drain_events(timeout=0.2)
                    except TimeoutError:
                        pass
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.conn.release()


@contextmanager
def _drainers(url: str, schema: str, n: int, queues: list[str] | None = None
              ) -> Iterator[list[Drainer]]:
    started = [Drainer(url, schema, queues or [QUEUE], f"pgjt-wake-{i}") for i in range(n)]
    for d in started:
        d.start()
    try:
        yield started
    finally:
        for d in started:
            d.stop_event.set()
        for d in started:
            d.join(10)
    assert all(d.error is None for d in started), [d.error for d in started]


def _producer(url: str, schema: str, queue: str = QUEUE) -> kombu.Connection:
    conn = kombu.Connection(url, transport_options={"schema": schema})
    kombu.Queue(queue, channel=conn.default_channel).declare()
    return conn


def test_a_publish_wakes_one_registered_consumer_and_nobody_when_none_waits(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    producer = _producer(url, schema)
    try:
        # Nobody waits: the publish notifies no channel at all.
        db.execute(f'LISTEN "pgjobs.{schema}"')
        producer.SimpleQueue(QUEUE).put({"n": 0})
        time.sleep(0.2)
        assert list(db.notifies(timeout=0.3, stop_after=1)) == []
        db.execute("UNLISTEN *")

        with _drainers(url, schema, 4) as drainers:
            wait_for(lambda: sum(len(d.got) for d in drainers) == 1, 10, what="the first")
            wait_for(lambda: _waiters(db, schema) == 4, 10, what="four registrations")
            # In a transaction of our own: the trigger's deletions are visible to it.
            with psycopg.connect(db.info.dsn) as app, app.transaction():
                with outbox.transaction(app, schema=schema):
                    producer.Producer().publish({"n": 1}, routing_key=QUEUE)
                assert _waiters(app, schema) == 3, "one consumer woken, not all"
            wait_for(lambda: sum(len(d.got) for d in drainers) == 2, 10, what="the second")
            # A batch of three wakes three consumers.
            wait_for(lambda: _waiters(db, schema) == 4, 10, what="re-registered")
            with psycopg.connect(db.info.dsn) as app, app.transaction():
                with outbox.transaction(app, schema=schema):
                    p = producer.Producer()
                    for i in range(3):
                        p.publish({"n": 2 + i}, routing_key=QUEUE)
                assert _waiters(app, schema) == 1
            wait_for(lambda: sum(len(d.got) for d in drainers) == 5, 10, what="all five")
        bodies = sorted(b["n"] for d in drainers for b, _ in d.got)
        assert bodies == [0, 1, 2, 3, 4]
    finally:
        producer.release()


@pytest.mark.exclusive  # timing bound: every message within 1 s of its commit
def test_no_publish_is_missed_while_consumers_go_idle_and_publishers_commit_late(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """Publishers race consumers registering: plain publishes at random gaps, and publishes
    inside transactions that commit up to 30 ms later (their trigger ran before a consumer
    registered). Every message is delivered once, each within a second of its commit."""
    rounds, publishers = 60, 4
    committed: dict[int, float] = {}
    lock = threading.Lock()
    producer = _producer(url, schema)
    producer.release()

    def publish(worker: int) -> None:
        rnd = random.Random(worker)
        conn = kombu.Connection(url, transport_options={"schema": schema})
        try:
            p = conn.Producer()
            with psycopg.connect(db.info.dsn) as app:
                for r in range(rounds):
                    n = worker * 1000 + r
                    time.sleep(rnd.uniform(0.0, 0.04))
                    if r % 2:
                        with app.transaction():
                            with outbox.transaction(app, schema=schema):
                                p.publish({"n": n}, routing_key=QUEUE)
                            time.sleep(rnd.uniform(0.0, 0.03))
                    else:
                        p.publish({"n": n}, routing_key=QUEUE)
                    with lock:
                        committed[n] = time.monotonic()
        finally:
            conn.release()

    with _drainers(url, schema, 4) as drainers:
        wait_for(lambda: _waiters(db, schema) == 4, 10, what="four registrations")
        threads = [threading.Thread(target=publish, args=(w,)) for w in range(publishers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wait_for(lambda: sum(len(d.got) for d in drainers) >= rounds * publishers, 20,
                 what="every message")
        time.sleep(0.3)  # a duplicate would arrive now
    got = [(b["n"], t) for d in drainers for b, t in d.got]
    assert sorted(n for n, _ in got) == sorted(committed), "each message exactly once"
    late = max(t - committed[n] for n, t in got)
    assert late < 1.0, f"a message waited {late:.2f} s after its commit"
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0


def test_a_publish_racing_the_only_consumers_registration_is_not_missed(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """Each round, a publish wakes the only consumer (deleting its registration) and a second
    publish, inside a transaction, looks for a registration right after and commits 20 ms
    later: it finds none (the consumer is claiming the first message, and registers again
    as that claim commits) and notifies nobody. The consumer must not sleep on the queue
    before it has seen the second message commit; a missed one would wait for the hour-long
    safety poll."""
    producer = _producer(url, schema)
    try:
        p = producer.Producer()
        with _drainers(url, schema, 1) as (d,), psycopg.connect(db.info.dsn) as app:
            wait_for(lambda: _waiters(db, schema) == 1, 10, what="registered")
            for r in range(0, 200, 2):
                p.publish({"n": r}, routing_key=QUEUE)
                with app.transaction():
                    with outbox.transaction(app, schema=schema):
                        p.publish({"n": r + 1}, routing_key=QUEUE)
                    time.sleep(0.02)
                wait_for(lambda r=r: len(d.got) == r + 2, 2, interval=0.001,
                         what=f"messages {r} and {r + 1}")
    finally:
        producer.release()


_CONSUMER = """
import sys, kombu
url, schema = sys.argv[1], sys.argv[2]
conn = kombu.Connection(url, transport_options={"schema": schema, "idle_poll_interval": 3600.0,
                                                "application_name": "pgjt-wake-doomed"})
ch = conn.channel()
kombu.Consumer(ch, queues=[kombu.Queue("wk", channel=ch)], callbacks=[lambda b, m: m.ack()]
               ).consume()
while True:
    try:
        conn.drain_events(timeout=1)
    except TimeoutError:
        pass
"""


def test_a_killed_consumers_registration_never_swallows_a_wake_up(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    producer = _producer(url, schema)
    doomed = subprocess.Popen([sys.executable, "-c", _CONSUMER, url, schema],
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        wait_for(lambda: _waiters(db, schema) == 1, 20, what="the doomed consumer registered")
        time.sleep(0.05)  # the live consumer registers later: the doomed one is woken first
        with _drainers(url, schema, 1) as (live,):
            wait_for(lambda: _waiters(db, schema) == 2, 10, what="both registered")
            os.kill(doomed.pid, signal.SIGKILL)
            doomed.wait(10)
            wait_for(lambda: db.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
                "'pgjt-wake-doomed'").fetchone()[0] == 0, 10, what="its backend gone")
            producer.Producer().publish({"n": 1}, routing_key=QUEUE)
            wait_for(lambda: len(live.got) == 1, 2, interval=0.01,
                     what="the live consumer woken")
    finally:
        if doomed.poll() is None:
            doomed.kill()
        producer.release()


def test_a_cancelled_consumer_drops_its_registration(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    producer = _producer(url, schema)
    kombu.Queue("wk2", channel=producer.default_channel).declare()
    try:
        with _drainers(url, schema, 1, [QUEUE, "wk2"]) as (d,):
            wait_for(lambda: _waiters(db, schema) == 1 and _waiters(db, schema, "wk2") == 1,
                     10, what="registered on both queues")
            assert d.consumer is not None
            d.consumer.cancel_by_queue("wk2")
            producer.SimpleQueue(QUEUE).put({"n": 1})  # the loop runs, and tidies
            wait_for(lambda: len(d.got) == 1, 10, what="the message")
            wait_for(lambda: _waiters(db, schema, "wk2") == 0, 10, what="wk2 dropped")
            # (the message was handed off with the registration: the next claim re-registers)
            wait_for(lambda: _waiters(db, schema) == 1, 10, what=f"{QUEUE} registered again")
            assert _waiters(db, schema, "wk2") == 0
    finally:
        producer.release()


# -- the trigger under concurrent, rolled-back and REPEATABLE READ publishers (SQL level) ---

def _fake_waiters(dsn: str, db: psycopg.Connection[Any], schema: str,
                  n: int) -> list[psycopg.Connection[Any]]:
    """``n`` live registrations on QUEUE, oldest first: each a session holding its wake id's
    lock and LISTENing on its own channel and on the schema's."""
    held = []
    for i in range(n):
        waiter = 2**40 + i
        conn = psycopg.connect(dsn, autocommit=True)
        conn.execute("SELECT pg_advisory_lock(%s::bigint)", [waiter])
        conn.execute(f'LISTEN "pgjobs.w.{waiter}"')
        conn.execute(f'LISTEN "pgjobs.{schema}"')
        db.execute(f'INSERT INTO "{schema}".pgjobs_waiter (queue, waiter, since) '
                   "VALUES (%s, %s, now() + %s * interval '1 ms')", [QUEUE, waiter, i])
        held.append(conn)
    return held


def _heard(conn: psycopg.Connection[Any]) -> list[str]:
    return [n.channel.rsplit(".", 1)[0] if n.channel.startswith("pgjobs.w.") else "schema"
            for n in conn.notifies(timeout=0.5, stop_after=4)]


def _insert(schema: str) -> str:
    return f'INSERT INTO "{schema}".pgjobs_job (queue, message) VALUES (%s, %s)'


def test_an_open_publisher_holds_only_the_registration_it_wakes(dsn, db, schema):
    """Two overlapping publishers wake two consumers (a FOR loop over the registrations
    locked a batch of them, and the second publisher woke nobody)."""
    from kombu_pgjobs.store.schema import migrate

    migrate(db, schema)
    held = _fake_waiters(dsn, db, schema, 3)
    try:
        with psycopg.connect(dsn) as first, psycopg.connect(dsn, autocommit=True) as second:
            first.execute(_insert(schema), [QUEUE, "{}"])  # open: holds what it woke
            second.execute(_insert(schema), [QUEUE, "{}"])
            first.commit()
        heard = [_heard(conn) for conn in held]
        assert heard == [["pgjobs.w"], ["pgjobs.w"], []]
        assert _waiters(db, schema) == 1
    finally:
        for conn in held:
            conn.close()


def test_a_publisher_that_rolls_back_does_not_take_a_committed_ones_wake_up(dsn, db, schema):
    from kombu_pgjobs.store.schema import migrate

    migrate(db, schema)
    held = _fake_waiters(dsn, db, schema, 1)
    try:
        with psycopg.connect(dsn) as doomed, psycopg.connect(dsn, autocommit=True) as good:
            doomed.execute(_insert(schema), [QUEUE, "{}"])  # holds the only registration
            good.execute(_insert(schema), [QUEUE, "{}"])  # commits
            doomed.rollback()
        # the committed publish could not wake the held registration: it told every
        # consumer of the queue on the schema's channel instead
        assert _heard(held[0]) == ["schema"]
        assert _waiters(db, schema) == 1
    finally:
        held[0].close()


def test_a_repeatable_read_publish_never_fails_and_tells_every_consumer(dsn, db, schema):
    from kombu_pgjobs.store.schema import migrate

    migrate(db, schema)
    held = _fake_waiters(dsn, db, schema, 1)
    try:
        with psycopg.connect(dsn) as app:
            app.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            app.execute("SELECT 1")  # the app's snapshot predates the next publish's wake
            db.execute(_insert(schema), [QUEUE, "{}"])  # wakes (deletes) the registration
            assert _heard(held[0]) == ["pgjobs.w"]
            db.execute(f'INSERT INTO "{schema}".pgjobs_waiter (queue, waiter) VALUES (%s, %s)',
                       [QUEUE, 2**40])  # registered again, after the app's snapshot
            app.execute(_insert(schema), [QUEUE, "{}"])  # failed with a serialization error
            app.commit()
        assert _heard(held[0]) == ["schema"]
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 2
    finally:
        held[0].close()


def test_a_consumer_whose_window_is_closed_passes_its_wake_up_on(url, db, schema):
    """C1 (prefetch 4) holds 3 unacked messages, below its refill mark: woken first (its
    registration is the oldest), it does not claim, and must hand the wake-up to C2. (C1 takes
    no hand-offs: one would fill its free slot, as RabbitMQ would; test_hand_off.py.)"""
    first = Drainer(url, schema, [QUEUE], "pgjt-wake-full", hand_off=False)
    first._on = lambda body, message: first.got.append((body, time.monotonic()))  # no ack
    first.prefetch = 4
    with _producer(url, schema) as producer:
        first.start()
        try:
            wait_for(lambda: _waiters(db, schema) == 1, 10, what="C1 registered")
            for i in range(3):
                producer.SimpleQueue(QUEUE).put({"m": i})
                wait_for(lambda i=i: len(first.got) == i + 1, 5, what=f"C1 took {i}")
                wait_for(lambda: _waiters(db, schema) == 1, 5, what="C1 registered again")
            with _drainers(url, schema, 1) as (second,):
                wait_for(lambda: _waiters(db, schema) == 2, 10, what="C2 registered")
                producer.SimpleQueue(QUEUE).put({"m": 3})
                wait_for(lambda: second.got, 5, what="C2 got the message C1 could not take")
            assert [b for b, _ in second.got] == [{"m": 3}] and len(first.got) == 3
        finally:
            first.stop_event.set()
            first.join(10)
