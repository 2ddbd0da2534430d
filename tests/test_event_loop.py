"""The transport inside kombu's event loop (the Hub Celery's asynloop runs): claims are sent
and read later, so the loop never waits on Postgres for them."""

from __future__ import annotations

import time
from typing import Any

import kombu
import psycopg
from kombu.asynchronous import Hub


def _rows(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, int, int]]:
    return db.execute(f'SELECT state, claim, attempts FROM "{schema}".pgjobs_job '
                      'ORDER BY id').fetchall()


def _consumer(url: str, schema: str, got: list[Any], *, ack: bool) -> tuple[Any, ...]:
    conn = kombu.Connection(url, transport_options={"schema": schema})
    channel = conn.channel()
    channel.basic_qos(prefetch_size=0, prefetch_count=8)
    queue = kombu.Queue("loop", channel=channel)
    queue.declare()

    def on_message(body: Any, message: Any) -> None:
        got.append(body)
        if ack:
            message.ack()

    consumer = kombu.Consumer(channel, queues=[queue], callbacks=[on_message])
    consumer.consume()
    return conn, channel


def test_claims_are_sent_from_the_loop_and_delivered_when_their_result_comes_in(url, schema,
                                                                                 db):
    got: list[Any] = []
    conn, _ = _consumer(url, schema, got, ack=True)
    with conn.Producer() as producer:
        for i in range(30):
            producer.publish({"i": i}, routing_key="loop")
    hub = Hub()
    transport = conn.transport
    try:
        transport.register_with_event_loop(conn.connection, hub)
        transport._on_hub_event()
        # The claim went out and the loop got its turn back before any row came in.
        assert transport._inflight is not None and got == []
        loop = hub.create_loop()
        deadline = time.monotonic() + 20
        while len(got) < 30 and time.monotonic() < deadline:
            next(loop)
        assert sorted(b["i"] for b in got) == list(range(30)), "each message exactly once"
        deadline = time.monotonic() + 10
        while _rows(db, schema) and time.monotonic() < deadline:
            next(loop)
        assert _rows(db, schema) == [], "every ack was flushed"
    finally:
        transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
        conn.release()


def test_a_channel_closed_with_its_claim_in_flight_hands_the_rows_back(url, schema, db):
    got: list[Any] = []
    conn, channel = _consumer(url, schema, got, ack=False)
    with conn.Producer() as producer:
        for i in range(5):
            producer.publish({"i": i}, routing_key="loop")
    hub = Hub()
    transport = conn.transport
    try:
        transport.register_with_event_loop(conn.connection, hub)
        transport._on_hub_event()
        assert transport._inflight is not None
        channel.close()
        assert got == [], "nothing is delivered to a closed channel"
        assert transport._inflight is None
        # Claimed (claim 1) and handed back: ready again, no attempt counted.
        assert _rows(db, schema) == [("ready", 1, 0)] * 5
    finally:
        transport.unregister_from_event_loop(conn.connection, hub)
        hub.close()
        conn.release()
