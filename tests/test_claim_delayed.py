"""Delayed (ETA) rows stay out of the claim's index path (schema version 6), against a real
Postgres: they become claimable the moment they are due, in the claim's order, and rows not yet
due cost a claim nothing however many there are.

A row published with run_at in the future is flagged ``delayed``: it is in
``pgjobs_job_delayed_idx`` (queue, run_at), not in the claim index. The claim reads the due
flagged rows from the former and merges them with the latter; the keeper clears the flag of due
rows of the queues it consumes.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql

from kombu_pgjobs.store.core import NewJob, QueueCore
from kombu_pgjobs.store.schema import migrate

from .conftest import wait_for


def _core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30.0, max_attempts=5)


def _job(body: str, priority: int = 0, run_at: datetime | None = None,
         queue: str = "q") -> NewJob:
    message = json.dumps({"body": body, "headers": {}, "properties": {}})
    return NewJob(queue, priority, run_at, None, None, "t", message)


def _in(seconds: float) -> datetime:
    return datetime.now(timezone.utc) + timedelta(seconds=seconds)


def _bodies(claimed: Any) -> list[str]:
    return [json.loads(c.message)["body"] for c in claimed]


def _flags(db: psycopg.Connection[Any], schema: str) -> dict[str, bool]:
    return dict(db.execute(f"SELECT message::json ->> 'body', delayed "
                           f'FROM "{schema}".pgjobs_job').fetchall())


def _make_due(db: psycopg.Connection[Any], schema: str, seconds_ago: dict[str, float]) -> None:
    """Time passes for these rows: their run_at moves into the past, their flag stays (what a
    claim meets between a row falling due and the keeper's next tick)."""
    for body, ago in seconds_ago.items():
        db.execute(f'UPDATE "{schema}".pgjobs_job '
                   "SET run_at = now() - make_interval(secs => %s) "
                   "WHERE message::json ->> 'body' = %s", (ago, body))


def test_future_rows_are_flagged_when_published(db, schema):
    core = _core(db, schema)
    core.publish_many(db, [_job("now"), _job("later", run_at=_in(3600)),
                           _job("past", run_at=_in(-60))])
    core.publish(db, _job("single", run_at=_in(3600)))
    assert _flags(db, schema) == {"now": False, "later": True, "past": False, "single": True}


def test_a_writer_that_does_not_flag_gets_its_row_flagged(db, schema):
    """A process of the previous release (or an operator's INSERT) does not know the column:
    the trigger flags its future rows, so the claim's next-due time still sees them."""
    core = _core(db, schema)
    db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, run_at, message) '
               """VALUES ('q', now() + interval '2 seconds', '{"body": "old"}'),"""
               """       ('q', now(), '{"body": "due"}')""")
    assert _flags(db, schema) == {"old": True, "due": False}
    got = core.claim(db, ["q"], 5)
    assert _bodies(got.claimed) == ["due"]
    assert got.drained and got.due_in is not None and 0.5 < got.due_in <= 2.0


def test_delayed_rows_are_claimable_when_due_without_the_keeper(db, schema):
    core = _core(db, schema)
    core.publish(db, _job("eta", run_at=_in(1.0)))
    first = core.claim(db, ["q"], 4)
    assert first.claimed == [] and first.drained
    assert first.due_in is not None and 0.2 < first.due_in <= 1.0, first.due_in
    time.sleep(first.due_in)
    got = wait_for(lambda: core.claim(db, ["q"], 4).claimed, 5, interval=0.05,
                   what="the delayed row once due")
    assert _bodies(got) == ["eta"], "due: claimed straight from the delayed index"


@pytest.mark.parametrize("window", [1, 3, 20])
def test_due_flagged_and_unflagged_rows_are_claimed_in_one_order(db, schema, window):
    """Invariant 2 across both index paths: priority, then due time, then insertion."""
    core = _core(db, schema)
    spec = [  # body, priority, seconds ago it fell due (flagged rows), or None: published due
        ("a", 0, None), ("b", 5, 30.0), ("c", 5, None), ("d", 9, 10.0), ("e", 0, 50.0),
        ("f", 9, None), ("g", 5, 40.0), ("h", 0, None), ("i", 5, None), ("j", 9, 60.0),
    ]
    core.publish_many(db, [_job(b, p, None if ago is None else _in(3600))
                           for b, p, ago in spec])
    _make_due(db, schema, {b: ago for b, _, ago in spec if ago is not None})
    rows = db.execute(f"SELECT message::json ->> 'body', delayed FROM \"{schema}\".pgjobs_job "
                      "ORDER BY priority DESC, run_at, id").fetchall()
    expected = [r[0] for r in rows]
    assert sum(1 for r in rows if r[1]) == 5, "five due rows are still flagged"
    claimed: list[str] = []
    for _ in range(20):
        got = core.claim(db, ["q"], window).claimed
        if not got:
            break
        claimed += _bodies(got)
    assert claimed == expected


def test_keeper_moves_due_rows_of_consumed_queues_into_the_claim_index(db, schema):
    core = _core(db, schema)
    core.publish_many(db, [_job("due", run_at=_in(3600)), _job("later", run_at=_in(3600)),
                           _job("other", run_at=_in(3600), queue="q2")])
    _make_due(db, schema, {"due": 5.0, "other": 5.0})
    outcomes = core.maintain(db, consumed=["q"], grace=30)
    assert all(o[0] != "promoted" for o in outcomes), "upkeep, nothing to log per row"
    assert _flags(db, schema) == {"due": False, "later": True, "other": True}, \
        "only due rows, only of the queues this process consumes"
    assert _bodies(core.claim(db, ["q", "q2"], 5).claimed) == ["due", "other"]


def test_claimed_requeued_and_rescued_rows_are_not_flagged(db, schema):
    core = _core(db, schema)
    core.publish(db, _job("x", run_at=_in(3600)))
    _make_due(db, schema, {"x": 1.0})
    (x,) = core.claim(db, ["q"], 1).claimed
    assert _flags(db, schema) == {"x": False}
    core.requeue(db, [(x.id, x.claim)], uncount=True)
    assert _flags(db, schema) == {"x": False}
    assert _bodies(core.claim(db, ["q"], 1).claimed) == ["x"]


def test_a_rate_deferral_flags_the_row(db, schema):
    core = _core(db, schema)
    rate = {"rate": [{"key": "tenant:t", "limit": 1, "per": 3600}]}
    jobs = []
    for body in ("r0", "r1"):
        message = json.dumps({"body": body, "headers": {"x-pgjobs-limits": rate},
                              "properties": {}})
        jobs.append(NewJob("q", 0, None, None, None, "t", message, json.dumps(rate)))
    core.publish_many(db, jobs)
    got = core.claim(db, ["q"], 2)
    assert _bodies(got.claimed) == ["r0"] and [h.verdict for h in got.held_back] == ["later"]
    assert _flags(db, schema) == {"r0": False, "r1": True}
    again = core.claim(db, ["q"], 2)
    assert again.drained and again.due_in is not None and again.due_in > 0


# -- what delayed rows cost a claim: buffers read, not wall-clock time -------------------

def _claim_buffers(db: psycopg.Connection[Any], core: QueueCore, n: int) -> int:
    """Shared buffers the claim statement touches (hit or read), as the transport runs it (a
    generic plan), its effects rolled back."""
    query, params = core.claim_statement(["q"], n)
    db.execute("SET plan_cache_mode = force_generic_plan")
    try:
        with db.transaction(force_rollback=True):
            plan = db.execute(sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query,
                              params).fetchone()[0][0]
    finally:
        db.execute("RESET plan_cache_mode")
    top = plan["Plan"]
    return int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])


def test_twenty_thousand_delayed_rows_cost_a_claim_nothing(db, schema):
    # Before version 6: 145 buffers for a claim of 4 behind 20,000 delayed rows of a higher
    # priority (30 without them), and 538 for an idle claim's next-due time.
    core = _core(db, schema)
    core.publish_many(db, [_job(f"d{i}", 9, _in(3600)) for i in range(20_000)])
    core.publish_many(db, [_job(f"r{i}") for i in range(10)])
    db.execute(f'VACUUM ANALYZE "{schema}".pgjobs_job')
    behind = _claim_buffers(db, core, 4)
    db.execute(f'DELETE FROM "{schema}".pgjobs_job WHERE run_at <= now()')
    db.execute(f'VACUUM ANALYZE "{schema}".pgjobs_job')
    idle = _claim_buffers(db, core, 4)
    db.execute(f'TRUNCATE "{schema}".pgjobs_job')
    core.publish_many(db, [_job(f"r{i}") for i in range(10)])
    db.execute(f'VACUUM ANALYZE "{schema}".pgjobs_job')
    alone = _claim_buffers(db, core, 4)
    assert behind <= alone + 40, f"claim of 4: {behind} buffers behind 20,000 delayed rows, " \
                                 f"{alone} without them"
    assert idle <= 40, f"an idle claim read {idle} buffers with 20,000 delayed rows"
    got = core.claim(db, ["q"], 4)
    assert len(got.claimed) == 4, "the cost test rolled back: the rows are still there"
