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
import subprocess
import threading
import time
from typing import Any

import kombu
import psycopg
import pytest

from .conftest import wait_for
from .test_cancel_running import APP, _count, _finished, _started

pytestmark = pytest.mark.e2e

POOLS = ["prefork", "threads", "gevent", "eventlet"]
#: seconds past the deadline a worker may take to exit: the hand-back, Celery's pool stop and
#: celery_ext's COLD_GRACE (threads: 3 s for runs that cannot be stopped from outside), with
#: room for a loaded machine
EXIT_BOUND = 10.0
#: the same on gevent and eventlet: celery_ext interrupts the transport's drain in Celery's green
#: loop (which checks its state only between drains of up to 2 s, and runs one more after the
#: flag) and in its remote-control loop (1 s). Measured 0.4-0.5 s past the deadline (before:
#: 4.4-5.0 s, two drains and the remote-control one waited out); celery_ext.cancel.GREEN_GRACE
#: (8 s) bounds it by force
GREEN_EXIT_BOUND = 3.0


def _jobs(db: psycopg.Connection[Any], schema: str) -> dict[str, list[Any]]:
    """task id -> [state, attempts, claim, holder, lease expiry set?] of every live row."""
    return {r[0]: list(r[1:]) for r in db.execute(
        f"SELECT message -> 'headers' ->> 'id', state, attempts, claim, worker, "
        f'lease_expires_at IS NOT NULL FROM "{schema}".pgjobs_job').fetchall()}


def _stop_within(worker: Any, bound: float) -> float:
    """SIGQUIT; the seconds until the worker exited (it must, within ``bound``)."""
    stopped_at = time.monotonic()
    worker.proc.send_signal(signal.SIGQUIT)
    try:
        worker.proc.wait(bound + 10)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker hangs:\n{worker.output()[-4000:]}") from None
    took = time.monotonic() - stopped_at
    output = worker.output()
    for error in ("BlockingSwitchOutError", "blocking functions from the mainloop",
                  "Unrecoverable error", "pgjobs.consumer.broken", "NotImplementedError"):
        assert error not in output, output[-4000:]
    assert took < bound, f"exited {took:.1f}s after SIGQUIT\n{output[-4000:]}"
    return took


def _handed_back(db: psycopg.Connection[Any], schema: str, ids: list[str], output: str) -> None:
    """Read as the worker exits: exactly these rows, each ready, attempts 0, claimed once, no
    holder, no lease (long before the 30 s lease could have lapsed)."""
    jobs = _jobs(db, schema)
    assert jobs == {i: ["ready", 0, 1, None, False] for i in ids}, (jobs, output[-4000:])


def _run_again_once(db: psycopg.Connection[Any], schema: str, start_worker: Any,
                    labels: dict[str, str]) -> None:
    """The next worker claims each cut-off message (claim 2, attempts 1: the cut-off run did
    not count) and runs it exactly once to completion (no other run of it ends: a cut-off run
    that went on would record its end too); one `on_settled` outcome each,
    `completed`, for that second delivery (the hand-back is no outcome); no dead letter."""
    next_worker = start_worker(name="next", app=APP, pool="threads", concurrency=4)
    wait_for(lambda: all(r[0] == "running" and r[2] == 2 for r in _jobs(db, schema).values()),
             30, interval=0.1, what="the next worker to claim the cut-off messages")
    running = _jobs(db, schema)
    assert {k: v[:3] for k, v in running.items()} == {
        i: ["running", 1, 2] for i in labels}, running
    wait_for(lambda: all(_finished(db, schema, label) >= 1 for label in labels.values()), 30,
             what="the next worker to run the cut-off messages to completion")
    wait_for(lambda: not _jobs(db, schema), 10, what="the messages acked")
    time.sleep(1.5)  # nothing runs a third time
    ends = db.execute(f'SELECT label, pid FROM "{schema}".pgjobs_test_run WHERE label = ANY(%s)',
                      (list(labels.values()),)).fetchall()
    assert sorted(label for label, _pid in ends) == sorted(labels.values()), ends
    # every run that ended is the next worker's (threads: its own PID), none the cut-off one
    assert {pid for _label, pid in ends} == {next_worker.proc.pid}, ends
    settled = db.execute(f'SELECT task_id, outcome, attempts FROM "{schema}".pgjobs_test_settled '
                         "WHERE task_id = ANY(%s)", (list(labels),)).fetchall()
    assert sorted(settled) == sorted((i, "completed", 2) for i in labels)
    assert _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter') == 0


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
    took = _stop_within(worker, soft + (GREEN_EXIT_BOUND if pool in ("gevent", "eventlet")
                                        else EXIT_BOUND))
    print(f"{pool} soft={soft:g}: exited {took:.1f}s after SIGQUIT")
    output = worker.output()
    if soft:
        assert took >= soft - 0.5, f"exited {took:.1f}s after SIGQUIT, before the deadline"
        assert _finished(db, schema, "short") == 1, output[-4000:]
    _handed_back(db, schema, [long.id, asleep.id], output)
    assert _finished(db, schema, "long") == 0 and _finished(db, schema, "asleep") == 0
    assert _started(db, schema, "long") == 1
    _run_again_once(db, schema, start_worker, {long.id: "long", asleep.id: "asleep"})


@pytest.mark.parametrize("soft", [2.0, 0.0], ids=["soft", "cold"])
def test_solo_a_shutdown_deadline_hands_the_cut_off_run_and_the_prefetched_back_uncounted(
        db, parity, recorder_tables, schema, start_worker, soft):
    """solo runs its one task in the worker's main thread, where Celery's signal handler runs
    too: the soft shutdown's wait pauses the task itself (Celery's rule on any broker), then the
    run is ended (celery_ext raises `Cancelled` into it; Celery's solo pool had raised
    NotImplementedError there, failing the task: its message acked, gone). Its message and
    the one prefetched behind it are back, ready, uncounted, as the worker exits; the
    prefetched one never started here; the next worker runs both once."""
    long = parity.steps.delay("long", 48, 0.25)  # both queued first: claimed together
    behind = parity.steps.delay("behind", 2, 0.25)
    worker = start_worker(name="cutsolo", app=APP, pool="solo", concurrency=1,
                          env={"PGJOBS_TEST_SOFT_SHUTDOWN": str(soft)})
    wait_for(lambda: _started(db, schema, "long") == 1, 30, what="the task to start")
    wait_for(lambda: _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_job '
                                "WHERE state = 'running'") == 2, 10,
             what="the second message prefetched")
    took = _stop_within(worker, soft + EXIT_BOUND)
    print(f"solo soft={soft:g}: exited {took:.1f}s after SIGQUIT")
    _handed_back(db, schema, [long.id, behind.id], worker.output())
    assert _started(db, schema, "behind") == 0 and _finished(db, schema, "long") == 0
    _run_again_once(db, schema, start_worker, {long.id: "long", behind.id: "behind"})


@pytest.mark.parametrize("pool", ["threads", "gevent", "eventlet"])
def test_a_second_sigquit_during_the_grace_cuts_off_at_once(
        db, parity, recorder_tables, schema, start_worker, pool):
    """Celery's rule: a second SIGQUIT during the soft shutdown's grace (20 s here) cancels the
    runs now. On these pools the worker is gone within the bound of the second signal, long
    before the grace ends, and the cut-off message is back, ready, uncounted."""
    worker = start_worker(name=f"twice{pool}", app=APP, pool=pool, concurrency=4,
                          env={"PGJOBS_TEST_SOFT_SHUTDOWN": "20"})
    long = parity.steps.delay("long", 48, 0.25)
    wait_for(lambda: _started(db, schema, "long") == 1, 30, what="the task to start")
    worker.proc.send_signal(signal.SIGQUIT)
    wait_for(lambda: "Initiating Soft Shutdown" in worker.output(), 10, interval=0.1,
             what="the soft shutdown")
    time.sleep(1.0)
    took = _stop_within(worker, EXIT_BOUND)
    print(f"{pool}: exited {took:.1f}s after the second SIGQUIT")
    _handed_back(db, schema, [long.id], worker.output())
    _run_again_once(db, schema, start_worker, {long.id: "long"})


@pytest.mark.parametrize("sharded", [False, True], ids=["one-database", "shard-map"])
def test_interrupt_makes_a_waiting_drain_return_at_once_and_only_once(
        request, url, schema, sharded):
    """``ConsumerLoop.interrupt`` (celery_ext calls it as a green pool's cold shutdown begins),
    and ``ShardedConsumer.interrupt`` over a shard map: a ``drain_events(timeout=10)`` waiting
    on an empty queue raises TimeoutError (kombu's "nothing delivered") as soon as another
    thread interrupts it; the flag clears, so the next drain waits out its timeout again, and
    a message published later is still delivered."""
    got: list[Any] = []
    options: dict[str, Any] = {"schema": schema}
    if sharded:
        options["shards"] = {"elsewhere": request.getfixturevalue("second_database")}
    conn = kombu.Connection(url, transport_options=options)
    try:
        channel = conn.channel()
        queue = kombu.Queue("interrupted", channel=channel)
        queue.declare()
        kombu.Consumer(channel, queues=[queue],
                       callbacks=[lambda body, message: (got.append(body), message.ack())]
                       ).consume()
        threading.Timer(0.5, conn.transport.consumer.interrupt).start()
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=10)
        assert time.monotonic() - began < 3.0
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            conn.drain_events(timeout=0.5)
        assert time.monotonic() - began >= 0.45  # waited: the interrupt was used up
        kombu.Producer(conn.channel()).publish("after", routing_key="interrupted")
        conn.drain_events(timeout=10)
        assert got == ["after"]
    finally:
        conn.release()
