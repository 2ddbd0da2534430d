"""kombu_pgjobs.batch(): many publishes, one INSERT, all or nothing."""

from __future__ import annotations

import kombu
import pytest

import kombu_pgjobs


def _count(db, schema: str) -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0]


def test_batch_inserts_at_exit_and_keeps_order(url, schema, db):
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("batched")
        with kombu_pgjobs.batch():
            for i in range(500):
                q.put({"i": i})
            assert _count(db, schema) == 0, "held until the block exits"
        assert _count(db, schema) == 500
        got = [q.get(timeout=5) for _ in range(500)]
        assert [m.payload["i"] for m in got] == list(range(500))
        for m in got:
            m.ack()
        q.close()


def test_batch_that_raises_publishes_nothing(url, schema, db):
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("batched")
        with pytest.raises(RuntimeError), kombu_pgjobs.batch():
            q.put({"i": 1})
            raise RuntimeError("abort")
        assert _count(db, schema) == 0
        q.put({"i": 2})
        assert _count(db, schema) == 1
        q.close()
