"""A consumer's marks of queues to claim (``ConsumerLoop.dirty``) name queues it consumes, and
only those, in a schema other processes publish to and notify on.

Names of other queues arrive all the time: the schema's channel names every queue a requeue,
a resume or a passed-on wake-up touches; the consumer's own wake channel names queues it was
registered on and has stopped consuming; a claim marks its queues to claim again, and their
consumer may be cancelled meanwhile (the reply queue of each ``celery inspect`` a web process
runs). Kept, such a name was never claimed nor cleared: the set grew for the life of the
process, and a non-empty set woke the idle consumer every second (``wait_budget``).

Everything runs for real: an in-process kombu connection whose ConsumerLoop is read, real
publishes from another connection, NOTIFYs sent as any role can send them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.broker import waiting
from kombu_pgjobs.broker.consumer import ConsumerLoop

FOREIGN = 150  # queues of other processes, published to while the consumer drains
TEMPORARY = 12  # queues this connection consumes for a moment (reply queues)


def _drain(conn: kombu.Connection, until: Any, timeout: float, what: str) -> None:
    """Turn the consumer's loop (at least once) until ``until()``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.drain_events(timeout=0.1)
        except TimeoutError:
            pass
        if until():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _turn(conn: kombu.Connection) -> None:
    """A few turns of the loop: what was sent meanwhile is read and acted on."""
    for _ in range(3):
        _drain(conn, lambda: True, 1, "")


def _only_consumed(loop: ConsumerLoop) -> None:
    consumed = set(loop.consumed())
    assert loop.dirty <= consumed, f"marked but not consumed: {sorted(loop.dirty - consumed)}"


@pytest.fixture
def consumer(url: str, schema: str) -> Iterator[tuple[kombu.Connection, list[Any]]]:
    got: list[Any] = []
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        channel = conn.channel()
        mine = kombu.Queue("mine", channel=channel)
        mine.declare()
        kombu.Consumer(channel, queues=[mine],
                       callbacks=[lambda body, message: (got.append(body), message.ack())]
                       ).consume()
        yield conn, got


def test_the_dirty_set_holds_consumed_queues_only(
        consumer: tuple[kombu.Connection, list[Any]], url: str, schema: str,
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # what the wake-up bookkeeping keeps of dropped registrations: 1 s here, not 60
    monkeypatch.setattr(waiting, "DROPPED_FOR", 1.0)
    conn, got = consumer
    loop = conn.transport.consumer
    assert isinstance(loop, ConsumerLoop)
    _drain(conn, lambda: loop.listening and loop.waits.waiter is not None, 10, "LISTEN")

    with kombu.Connection(url, transport_options={"schema": schema}) as pub:
        producer = pub.Producer()
        # Queues this connection consumes for a moment, one message each, then cancels (as
        # `celery inspect` does with its reply queue): every one was claimed, registered and
        # marked to claim again before its consumer went.
        for i in range(TEMPORARY):
            channel = conn.channel()
            queue = kombu.Queue(f"reply{i}", channel=channel)
            queue.declare()
            temp = kombu.Consumer(channel, queues=[queue],
                                  callbacks=[lambda body, message: (got.append(body),
                                                                    message.ack())])
            temp.consume()
            producer.publish({"reply": i}, routing_key=f"reply{i}")
            _drain(conn, lambda i=i: {"reply": i} in got, 10, f"reply{i}")
            temp.cancel()
            channel.close()
            _turn(conn)  # the loop after the cancel
            _only_consumed(loop)

        # Meanwhile other processes publish to their queues and wake their consumers: real
        # publishes, and NOTIFYs on the schema's channel and on this consumer's own channel
        # (the queues it stopped consuming, and names it never heard of).
        stop = threading.Event()
        sent = {"publishes": 0, "notifies": 0}

        def others() -> None:
            with kombu.Connection(url, transport_options={"schema": schema}) as other, \
                    psycopg.connect(dsn, autocommit=True) as db:
                p = other.Producer()
                for i in range(FOREIGN):
                    if stop.is_set():
                        return
                    name = f"foreign{i}"
                    p.publish({"f": i}, routing_key=name, declare=[kombu.Queue(name)])
                    sent["publishes"] += 1
                    for channel, queue in ((f"pgjobs.{schema}", name),
                                           (loop.waits.channel, name),
                                           (loop.waits.channel, f"reply{i % TEMPORARY}")):
                        db.execute("SELECT pg_notify(%s, %s)", (channel, queue))
                        sent["notifies"] += 1

        thread = threading.Thread(target=others, daemon=True)
        thread.start()
        try:
            mine = 0
            while thread.is_alive():  # the consumer drains its own queue all along
                producer.publish({"mine": mine}, routing_key="mine")
                _drain(conn, lambda m=mine: {"mine": m} in got, 10, f"mine {mine}")
                _only_consumed(loop)
                mine += 1
        finally:
            stop.set()
            thread.join(30)
        assert sent == {"publishes": FOREIGN, "notifies": 3 * FOREIGN}
        _turn(conn)  # what was sent last is read now
        _only_consumed(loop)
        assert loop.dirty <= {"mine"}

        # its own queue is still consumed, at once, and each message once
        for i in range(20):
            producer.publish({"last": i}, routing_key="mine")
        _drain(conn, lambda: sum("last" in g for g in got) >= 20, 10, "the last 20")
        _only_consumed(loop)
    assert sorted(g["last"] for g in got if "last" in g) == list(range(20))
    assert sorted(g["mine"] for g in got if "mine" in g) == list(range(mine))
    assert sorted(g["reply"] for g in got if "reply" in g) == list(range(TEMPORARY))
    assert not any("f" in g for g in got), "a foreign queue's message was delivered here"

    # idle, with nothing of its own to claim, it sleeps until its next poll: a name it no
    # longer consumes would wake it every second
    _drain(conn, lambda: not loop.dirty and loop.backend.oldest_ack_age() is None, 10,
           "the loop idle")
    assert loop.wait_budget(time.monotonic()) > 1.5

    # nor does the wake-up bookkeeping keep the queues it stopped consuming: the drops (one
    # a reply queue) go after DROPPED_FOR, and wake-up counts of queues no longer consumed
    time.sleep(1.5)
    _turn(conn)
    assert not loop.waits.dropped, sorted(loop.waits.dropped)
    assert set(loop.waits._wakes) <= set(loop.consumed()) | set(loop.waits.state), \
        sorted(loop.waits._wakes)
