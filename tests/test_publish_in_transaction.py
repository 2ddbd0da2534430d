"""The queue core publishes inside a transaction the caller holds (the outbox builds on this):
the row, and the NOTIFY that wakes consumers, exist only if the caller commits."""

from __future__ import annotations

import kombu
import psycopg

from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate


def _message(channel, body: str) -> dict:
    msg = channel.prepare_message(body, content_type="application/json",
                                  content_encoding="utf-8")
    msg["properties"]["delivery_info"] = {"exchange": "", "routing_key": "outbox"}
    msg["properties"]["delivery_tag"] = "x"
    return msg


def test_rollback_leaves_nothing_commit_publishes_and_wakes(dsn, schema, url):
    with psycopg.connect(dsn, autocommit=True) as admin:
        migrate(admin, schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=20)
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        got: list = []
        queue = kombu.Queue("outbox", routing_key="outbox")
        with conn.Consumer(queue, callbacks=[lambda body, m: (got.append(body), m.ack())],
                           accept=["json"]):
            try:  # first drain: the consumer claims nothing and goes idle on LISTEN
                conn.drain_events(timeout=0.2)
            except TimeoutError:
                pass
            with psycopg.connect(dsn) as app_conn:  # the app's own connection
                with app_conn.transaction(force_rollback=True):
                    core.publish(app_conn, job_from_message("outbox", _message(
                        conn.default_channel, '{"n": 1}')))
                with app_conn.transaction():
                    core.publish(app_conn, job_from_message("outbox", _message(
                        conn.default_channel, '{"n": 2}')))
                    try:  # not committed yet: nothing to deliver
                        conn.drain_events(timeout=0.3)
                    except TimeoutError:
                        pass
                    assert got == []
            conn.drain_events(timeout=5)  # woken by the NOTIFY sent at commit
            assert got == [{"n": 2}]
