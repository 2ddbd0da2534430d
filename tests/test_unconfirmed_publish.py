"""confirm_publish=False: a publish returns once sent; PostgreSQL confirms it later.

What is promised, each read back from the database: every message is queued once and in order;
a process sees its own publishes; a statement PostgreSQL refuses is raised at the next publish
(and only that message is lost); a broken connection's unconfirmed messages are sent again; a
process that exits normally, without closing anything, loses nothing.
"""

from __future__ import annotations

import base64
import json
import logging
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.errors import PublishFailed

from .conftest import ROOT, wait_for

QUEUE = "unconfirmed"


@pytest.fixture
def connect(url: str, schema: str) -> Iterator[Callable[..., kombu.Connection]]:
    opened: list[kombu.Connection] = []

    def make(**options: Any) -> kombu.Connection:
        conn = kombu.Connection(url, transport_options={
            "schema": schema, "confirm_publish": False, **options})
        opened.append(conn)
        return conn

    yield make
    for conn in opened:
        conn.release()


def _bodies(db: psycopg.Connection[Any], schema: str) -> list[int]:
    rows = db.execute(f'SELECT message FROM "{schema}".pgjobs_job ORDER BY id').fetchall()
    return [int(base64.b64decode(m["body"])) for (m,) in rows]


def _publish(producer: kombu.Producer, i: int) -> None:
    producer.publish(json.dumps(i), routing_key=QUEUE, serializer="raw", retry=False)


def test_unconfirmed_publishes_are_queued_once_in_order_and_seen_by_their_process(
        connect: Callable[..., kombu.Connection], db: psycopg.Connection[Any],
        schema: str) -> None:
    with connect() as conn:
        queue = kombu.Queue(QUEUE, channel=conn)
        queue.declare()
        producer = conn.Producer()
        for i in range(300):
            _publish(producer, i)
        # The size is read on the publish connection after its publishes are confirmed.
        assert queue.queue_declare(passive=True).message_count == 300
        got = [queue.get(no_ack=True).body for _ in range(300)]
    assert [int(b) for b in got] == list(range(300))
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone() == (0,)


@pytest.mark.exclusive  # timing bound: a publish must return within 0.25 s
def test_a_refused_statement_is_raised_at_the_next_publish_and_loses_only_its_message(
        connect: Callable[..., kombu.Connection], db: psycopg.Connection[Any],
        schema: str) -> None:
    with connect(connect_options={"options": "-c lock_timeout=300"}) as conn:
        producer = conn.Producer()
        _publish(producer, 0)
        conn.default_channel.backend.confirm_publishes()
        with psycopg.connect(db.info.dsn) as locker:
            locker.execute(f'LOCK TABLE "{schema}".pgjobs_job IN ACCESS EXCLUSIVE MODE')
            t0 = time.monotonic()
            _publish(producer, 1)  # its INSERT waits for the lock, then times out
            assert time.monotonic() - t0 < 0.25, "an unconfirmed publish waited for its commit"
            time.sleep(0.6)
        # Other statements on the publish connection still run; the failure waits for the
        # next publish.
        size = kombu.Queue(QUEUE, channel=conn).queue_declare(passive=True).message_count
        assert size == 1
        with pytest.raises(PublishFailed) as failed:
            _publish(producer, 2)  # not sent: the caller is told to publish it again
        assert failed.value.code == "PGJ-107"
        assert "lock timeout" in str(failed.value)
        _publish(producer, 3)
        conn.default_channel.backend.confirm_publishes()
    assert _bodies(db, schema) == [0, 3]


def test_a_broken_connection_sends_its_unconfirmed_publishes_again(
        connect: Callable[..., kombu.Connection], db: psycopg.Connection[Any], schema: str,
        caplog: pytest.LogCaptureFixture) -> None:
    with connect() as conn:
        producer = conn.Producer()
        _publish(producer, 0)
        backend = conn.default_channel.backend
        backend.confirm_publishes()
        with psycopg.connect(db.info.dsn) as locker:
            locker.execute(f'LOCK TABLE "{schema}".pgjobs_job IN ACCESS EXCLUSIVE MODE')
            for i in range(1, 6):
                _publish(producer, i)  # sent; the first INSERT waits for the lock
            blocked = wait_for(lambda: db.execute(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE %s", [f'%"{schema}".pgjobs_job%']).fetchall(),
                timeout=10, what="the publish waiting for the lock")
            db.execute("SELECT pg_terminate_backend(%s)", [blocked[0][0]])
        caplog.set_level(logging.WARNING, logger="kombu_pgjobs")
        wait_for(lambda: not db.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                        [blocked[0][0]]).fetchone(),
                 timeout=10, what="the publish connection gone")
        for i in range(6, 8):
            # the first call finds the connection broken; kombu's own retry publishes again
            producer.publish(json.dumps(i), routing_key=QUEUE, serializer="raw", retry=True,
                             retry_policy={"max_retries": 2, "interval_start": 0})
        backend.confirm_publishes()
    assert sorted(_bodies(db, schema)) == list(range(8))
    # 1-5, and 6 and 7 too when the break was found only after they were sent
    assert re.search(r"pgjobs\.publish\.resent .* count=[5-7]\b", caplog.text), caplog.text


def test_a_process_that_exits_without_closing_loses_nothing(
        url: str, db: psycopg.Connection[Any], schema: str) -> None:
    script = (
        "import kombu, sys\n"
        f"c = kombu.Connection({url!r}, transport_options={{'schema': {schema!r}, "
        "'confirm_publish': False})\n"
        "p = c.Producer()\n"
        "for i in range(500):\n"
        f"    p.publish(str(i), routing_key={QUEUE!r}, serializer='raw', retry=False)\n"
        "sys.exit(0)\n")
    release_all()
    subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True, timeout=120)
    assert _bodies(db, schema) == list(range(500))
