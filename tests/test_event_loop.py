"""The transport inside kombu's event loop (the Hub Celery's asynloop runs): claims are sent
and read later, so the loop never waits on Postgres for them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import psycopg
from kombu.asynchronous import Hub


def _rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, int, int]]:
    return db.execute(f'SELECT state, claim, attempts FROM "{schema}".pgjobs_job '
                      'ORDER BY id').fetchall()


def _consume(conn: kombu.Connection, queue_name: str,
             on_message: Callable[[Any, Any], None]) -> Any:
    """A channel with a prefetch window of 8 consuming ``queue_name``."""
    channel = conn.channel()
    channel.basic_qos(prefetch_size=0, prefetch_count=8)
    queue = kombu.Queue(queue_name, channel=channel)
    queue.declare()
    kombu.Consumer(channel, queues=[queue], callbacks=[on_message]).consume()
    return channel


def _collect(got: list[Any], *, ack: bool) -> Callable[[Any, Any], None]:
    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        if ack:
            message.ack()
    return on_message


def _publish(conn: kombu.Connection, **counts: int) -> None:
    with conn.Producer() as producer:
        for queue, n in counts.items():
            for i in range(n):
                producer.publish({"i": i}, routing_key=queue)


@contextmanager
def _hub(conn: kombu.Connection) -> Iterator[tuple[Any, Any]]:
    """The transport registered with a kombu Hub: (transport, the hub's loop)."""
    hub = Hub()
    transport = conn.transport
    transport.register_with_event_loop(conn.connection, hub)
    try:
        yield transport, hub.create_loop()
    finally:
        transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
        conn.release()


def _spin(loop: Iterator[Any], done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        next(loop)


def test_claims_are_sent_from_the_loop_and_delivered_when_their_result_comes_in(url, schema,
                                                                                 db):
    got: list[Any] = []
    conn = kombu.Connection(url, transport_options={"schema": schema})
    _consume(conn, "loop", _collect(got, ack=True))
    _publish(conn, loop=30)
    with _hub(conn) as (transport, loop):
        transport.consumer.on_hub_event()
        # The claim went out and the loop got its turn back before any row came in.
        assert transport.consumer.inflight is not None and got == []
        _spin(loop, lambda: len(got) >= 30, 20)
        assert sorted(b["i"] for b in got) == list(range(30)), "each message exactly once"
        _spin(loop, lambda: not _rows(db, schema), 10)
        assert _rows(db, schema) == [], "every ack was flushed"


def test_a_channel_closed_with_its_claim_in_flight_hands_the_rows_back(url, schema, db):
    got: list[Any] = []
    conn = kombu.Connection(url, transport_options={"schema": schema})
    channel = _consume(conn, "loop", _collect(got, ack=False))
    _publish(conn, loop=5)
    with _hub(conn) as (transport, _):
        transport.consumer.on_hub_event()
        assert transport.consumer.inflight is not None
        channel.close()
        assert got == [], "nothing is delivered to a closed channel"
        assert transport.consumer.inflight is None
        # Claimed (claim 1) and handed back: ready again, no attempt counted.
        assert _rows(db, schema) == [("ready", 1, 0)] * 5


def test_a_busy_channel_does_not_starve_another_on_the_same_connection(url, schema):
    """Celery's worker consumes its task queues and its remote-control queue on two channels of
    one connection; with one claim in flight at a time, they take turns."""
    busy: list[Any] = []
    quiet: list[int] = []

    def on_quiet(body: Any, message: Any) -> None:
        quiet.append(len(busy))  # how much of the busy queue ran before this one
        message.ack()

    conn = kombu.Connection(url, transport_options={"schema": schema})
    _consume(conn, "loop", _collect(busy, ack=True))
    _consume(conn, "other", on_quiet)
    _publish(conn, loop=400, other=1)
    with _hub(conn) as (_, loop):
        _spin(loop, lambda: bool(quiet), 20)
        assert quiet and quiet[0] < 100, f"the other channel waited for {quiet} busy messages"


def test_a_consumer_cancelled_with_its_claim_in_flight_hands_its_rows_back_uncounted(
        url, schema, db):
    """One channel consumes two queues; one consumer is cancelled (`celery control
    cancel_consumer`) while a claim for both is in flight."""
    got: list[Any] = []
    conn = kombu.Connection(url, transport_options={"schema": schema})
    channel = _consume(conn, "loop", _collect(got, ack=False))
    kombu.Queue("other", channel=channel).declare()
    kombu.Consumer(channel, queues=[kombu.Queue("other", channel=channel)],
                   callbacks=[_collect(got, ack=False)], tag_prefix="other-").consume()
    _publish(conn, loop=5)
    with _hub(conn) as (transport, loop):
        transport.consumer.on_hub_event()
        assert transport.consumer.inflight is not None
        loop_tag = next(t for t in channel._consumers if not str(t).startswith("other-"))
        channel.basic_cancel(loop_tag)
        _spin(loop, lambda: transport.consumer.inflight is None, 10)
        assert got == []
        # Claimed (claim 1) and handed back unstarted: ready again, no attempt counted.
        assert _rows(db, schema) == [("ready", 1, 0)] * 5


def test_terminated_backends_under_the_loop_raise_nothing_and_lose_nothing(url, schema, db):
    """The claim, publish and keeper connections terminated while the Hub runs: no exception
    leaves the loop (Celery would restart its consumer), the loop reconnects by itself, and
    every message is delivered once and acked."""
    appname = f"pgjt-loop-{schema[-8:]}"
    got: list[Any] = []
    conn = kombu.Connection(url, transport_options={"schema": schema,
                                                    "application_name": appname})
    _consume(conn, "loop", _collect(got, ack=True))
    _publish(conn, loop=10)
    with _hub(conn) as (transport, loop):
        _spin(loop, lambda: len(got) >= 10, 20)
        killed = db.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                            "WHERE application_name = %s", [appname]).fetchone()[0]
        assert killed >= 2
        _spin(loop, lambda: False, 0.5)  # the loop meets the dead connection
        _publish(conn, loop=10)
        _spin(loop, lambda: len(got) >= 20, 20)
        # (a claim may still be in flight: the one that proves the queue empty)
        _spin(loop, lambda: transport.consumer.state.value == "connected", 5)
        assert len(got) == 20 and transport.consumer.state.value == "connected"
        _spin(loop, lambda: not _rows(db, schema), 10)
        assert _rows(db, schema) == [], "every ack was flushed"
