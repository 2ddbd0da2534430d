"""An idle ``celery worker``'s wake-to-delivery path, counted on the wire (issue 35 item 2).

An idle worker is registered and armed (``kombu_pgjobs.broker.waiting``); a publish hands it its
message (schema 18, 21). From there to the task body the worker's claim connection sends
exactly one statement: the fenced take of the handed message (invariant 17: the notification
names ids, the message is read through a statement fenced on the worker's identity). No claim,
no ack, no probe before it. After the delivery the queue is registered again by exactly two
claims (the one that registers and tries the barrier, the one that proves the queue empty), and
the late ack goes by itself once the task ends. These are counts, never timings: a statement
added to the idle path (a second read, a claim before the take, a round trip to re-arm) fails
here; ``python -m bench.stages`` measures what the path costs.

Statements are read off a proxy between the worker and PostgreSQL, per connection, in the order
the connection sent them (one TCP stream is ordered); the publisher connects directly.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.store.sql import raw_queries

from .conftest import import_app, wait_for
from .wirecount import WireCounter

pytestmark = pytest.mark.e2e


def _key(name: str) -> str:
    """Statement ``name`` as WireCounter keys it (its first characters, before the schema)."""
    return " ".join(raw_queries()[name][:80].split())[:60]


TAKE, CLAIM = _key("waiter_take"), _key("job_claim")  # the claim also carries acks alone


class Sequence(WireCounter):
    """A WireCounter that also keeps, per client connection, the statements in the order they
    were sent."""

    def __init__(self, host: str, port: int) -> None:
        self.sent: list[tuple[int, str]] = []  # (connection, statement key), in order
        self.last = time.monotonic()  # when the last statement went by
        self._order = threading.Lock()
        super().__init__(host, port)

    def _note(self, kind: bytes, body: bytes, names: dict[bytes, str],
              portals: dict[bytes, bytes]) -> None:
        with self._order:  # one connection's relay thread at a time
            before = dict(self.by_text)
            super()._note(kind, body, names, portals)
            grown = [k for k, v in self.by_text.items() if v != before.get(k, 0)]
            if grown:  # ``names`` is one per client connection (wirecount.py)
                self.sent.append((id(names), grown[0]))
                self.last = time.monotonic()

    def since(self, mark: int) -> list[tuple[int, str]]:
        with self._order:
            return list(self.sent[mark:])

    def settle(self, quiet: float = 0.5) -> None:
        """Wait until no statement went by for ``quiet`` seconds (a worker's keeper ticks
        every ten seconds here: a cycle's claims are over long before)."""
        wait_for(lambda: time.monotonic() - self.last >= quiet, 30, 0.05, "a quiet wire")


def _kind(key: str) -> str:
    return {TAKE: "take", CLAIM: "claim"}.get(key, key)


def _armed(db: psycopg.Connection[Any], schema: str) -> bool:
    return bool(db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_waiter '
                           "WHERE queue = 'celery'").fetchone()[0])


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_an_idle_worker_reads_a_handed_message_with_one_statement(
        dsn, db, recorder_tables, url, start_worker, pool):
    schema = recorder_tables
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    with Sequence(info.get("host") or "127.0.0.1", int(info.get("port") or 5432)) as wire:
        proxied = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
                   f"{info.get('dbname', 'test')}")
        start_worker(name=f"idle-{pool}", pool=pool, concurrency=2,
                     env={"PGJOBS_TEST_BROKER": proxied})
        rec = import_app("tests.apps.recorder", schema, url)  # publishes past the proxy
        cycles = []
        for i in range(3):
            wait_for(lambda: _armed(db, schema), 30, 0.05, "the idle worker registered")
            wire.settle()  # the claim that proves the queue empty (it arms it) went by
            mark = len(wire.since(0))
            rec.sleep_record.delay(f"idle{i}", 0.5)
            wait_for(lambda i=i: db.execute(
                f'SELECT count(*) FROM "{schema}".pgjobs_test_run WHERE label = %s',
                (f"idle{i}",)).fetchone()[0], 30, 0.05, f"task idle{i} ran")
            wait_for(lambda: not db.execute(
                f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0], 30, 0.05,
                "its late ack settled")
            wait_for(lambda: _armed(db, schema), 30, 0.05, "the worker registered again")
            wire.settle()
            cycles.append(wire.since(mark))
    runs = db.execute(f'SELECT label, count(*) FROM "{schema}".pgjobs_test_run '
                      "GROUP BY label ORDER BY label").fetchall()
    assert runs == [("idle0", 1), ("idle1", 1), ("idle2", 1)]
    for n, sent in enumerate(cycles):
        takes = [c for c, key in sent if key == TAKE]
        assert len(takes) == 1, f"cycle {n}: one take of the handed message: {sent}"
        claim_conn = takes[0]
        path = [_kind(key) for c, key in sent if c == claim_conn]
        # Wake to delivery: the take, first and alone (no claim, no probe before it). Then the
        # handed queue, and only it, is registered again by two claims (one registers and
        # tries the barrier, one proves the queue empty); nothing else on that connection but
        # the late ack, a claim statement with nothing to claim (the body sleeps 0.5 s).
        assert path[:3] == ["take", "claim", "claim"], f"cycle {n}: {path}"
        assert set(path) == {"take", "claim"}, f"cycle {n}: {path}"
        # the ack goes alone, on the claim connection or (the keeper's grace) another one
        claims = [key for _, key in sent if key == CLAIM]
        assert len(claims) == 3, f"cycle {n}: two claims re-arm, one acks: {sent}"
