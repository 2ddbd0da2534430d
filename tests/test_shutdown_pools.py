"""Shutdown with a deadline on every pool (issue 30, item 3).

Celery's cold shutdown (SIGQUIT), with its soft shutdown first (``worker_soft_shutdown_timeout``,
Celery 5.5+) or without, on a real ``celery worker`` of tests/apps/parity.py per pool: running
tasks get until the deadline, then are cut off; their messages are back to ready at once (read
from the database as the worker exits, long before the 30 s lease could lapse), their attempt
uncounted, no lease holder; the worker exits within the deadline plus a bound, never hanging on a
run; and the next worker runs each cut-off message exactly once, to its end, as its first counted
attempt.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import psycopg
import pytest

from .conftest import wait_for

pytestmark = pytest.mark.e2e

APP = "tests.apps.parity"
POOLS = ["prefork", "threads", "gevent", "eventlet"]
#: seconds past the deadline a worker may take to exit: the hand-back, Celery's pool stop and
#: (threads) celery_ext's COLD_GRACE for runs that cannot be stopped from outside
EXIT_BOUND = 7.0


def _count(db: psycopg.Connection[Any], query: str, *args: Any) -> Any:
    return db.execute(query, args).fetchone()[0]


def _started(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_start WHERE label = %s',
                  label)


def _finished(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_run WHERE label = %s',
                  label)


def _jobs(db: psycopg.Connection[Any], schema: str) -> dict[str, list[Any]]:
    """task id -> [state, attempts, claim, holder, lease expiry set?] of every live row."""
    return {r[0]: list(r[1:]) for r in db.execute(
        f"SELECT message -> 'headers' ->> 'id', state, attempts, claim, worker, "
        f'lease_expires_at IS NOT NULL FROM "{schema}".pgjobs_job').fetchall()}


@pytest.mark.parametrize("soft", [2.0, 0.0], ids=["soft", "cold"])
@pytest.mark.parametrize("pool", POOLS)
def test_a_shutdown_deadline_hands_cut_off_runs_back_at_once_uncounted_on_every_pool(
        db, parity, recorder_tables, schema, start_worker, pool, soft):
    """SIGQUIT with `worker_soft_shutdown_timeout` = 2 s (soft) or 0 (cold): with a deadline a
    short task (1 s) finishes and is acked; a long one in steps (checkpoints) and a plain sleep
    (none) are cut off: as the worker exits, within the deadline + a bound, both rows are
    ready, attempts 0, no holder, no lease. A second worker then claims each (claim 2, attempts
    1: the cut-off run did not count) and runs it exactly once to completion; one `on_settled`
    outcome each (`completed`); nothing is dead-lettered."""
    worker = start_worker(name=f"cut{pool}", app=APP, pool=pool, concurrency=4,
                          env={"PGJOBS_TEST_SOFT_SHUTDOWN": str(soft)})
    if soft:
        parity.steps.delay("short", 4, 0.25)
    long = parity.steps.delay("long", 48, 0.25)
    asleep = parity.sleep.delay("asleep", 12.0)
    wait_for(lambda: _started(db, schema, "long") == 1
             and (not soft or _started(db, schema, "short") == 1), 30,
             what="the tasks to start")
    wait_for(lambda: _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job '
                                "WHERE state = 'running'") == (3 if soft else 2), 10,
             what="every message claimed")
    time.sleep(0.3)  # the sleep has begun too (it records only its end)
    stopped_at = time.monotonic()
    worker.proc.send_signal(signal.SIGQUIT)
    try:
        worker.proc.wait(soft + EXIT_BOUND + 10)
    except Exception:
        raise AssertionError(f"the worker hangs:\n{worker.output()[-4000:]}") from None
    took = time.monotonic() - stopped_at
    print(f"{pool} soft={soft:g}: exited {took:.1f}s after SIGQUIT")
    jobs = _jobs(db, schema)
    output = worker.output()
    for error in ("BlockingSwitchOutError", "blocking functions from the mainloop",
                  "Unrecoverable error", "pgjobs.consumer.broken"):
        assert error not in output, output[-4000:]
    assert took < soft + EXIT_BOUND, f"exited {took:.1f}s after SIGQUIT\n{output[-4000:]}"
    if soft:
        assert took >= soft - 0.5, f"exited {took:.1f}s after SIGQUIT, before the deadline"
        assert _finished(db, schema, "short") == 1, output[-4000:]
    for result in (long, asleep):
        state, attempts, claim, holder, leased = jobs.get(result.id) or [None] * 5
        assert (state, attempts, holder, leased) == ("ready", 0, None, False), \
            (jobs, output[-4000:])
        assert claim == 1
    assert len(jobs) == 2, jobs
    assert _finished(db, schema, "long") == 0 and _finished(db, schema, "asleep") == 0

    start_worker(name=f"next{pool}", app=APP, pool="threads", concurrency=4)
    wait_for(lambda: all(r[0] == "running" and r[2] == 2 for r in _jobs(db, schema).values()),
             30, interval=0.1, what="the next worker to claim both cut-off messages")
    running = _jobs(db, schema)
    # its claim number 2, its attempts 1: the cut-off run was not counted
    assert {k: v[:3] for k, v in running.items()} == {
        long.id: ["running", 1, 2], asleep.id: ["running", 1, 2]}, running
    wait_for(lambda: _finished(db, schema, "long") == 1 and _finished(db, schema, "asleep") == 1,
             30, what="the next worker to run both cut-off messages to completion")
    wait_for(lambda: not _jobs(db, schema), 10, what="both messages acked")
    time.sleep(1.5)  # nothing runs a third time
    assert _started(db, schema, "long") == 2
    assert _finished(db, schema, "long") == 1 and _finished(db, schema, "asleep") == 1
    # one outcome each, for the second delivery (the hand-back is no outcome)
    settled = db.execute(f'SELECT task_id, outcome, attempts FROM "{schema}".pgjobs_test_settled '
                         "WHERE task_id = ANY(%s)", ([long.id, asleep.id],)).fetchall()
    assert sorted(settled) == sorted([(long.id, "completed", 2), (asleep.id, "completed", 2)])
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter') == 0
