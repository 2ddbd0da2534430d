"""Running work under control (issue 30, items 1 and 2): a cancel stops a running task on each
pool, a queued one never runs, and both read REVOKED; a run whose lease was lost ends.

Real workers of tests/apps/parity.py (celery_ext, a database result backend). Counts come
from the database: starts, completions, dead letters and their reasons, the job table.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

import celery_ext
from kombu_pgjobs.ops.cli.main import main as cli

from .conftest import wait_for

pytestmark = pytest.mark.e2e

APP = "tests.apps.parity"


def _count(db: psycopg.Connection[Any], query: str, *args: Any) -> Any:
    return db.execute(query, args).fetchone()[0]


def _started(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_start WHERE label = %s',
                  label)


def _finished(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return _count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_run WHERE label = %s',
                  label)


def _dead_reason(db: psycopg.Connection[Any], schema: str, task_id: str) -> Any:
    row = db.execute(f'SELECT reason FROM "{schema}".pgjobs_dead_letter '
                     "WHERE message -> 'headers' ->> 'id' = %s", (task_id,)).fetchone()
    return row[0] if row else None


@pytest.mark.parametrize("pool,how", [("prefork", "cli"), ("prefork", "api"),
                                      ("threads", "cli"), ("threads", "api"),
                                      ("gevent", "api")])
def test_a_running_task_cancelled_stops_never_runs_again_and_reads_revoked(
        db, parity, recorder_tables, url, schema, start_worker, pool, how):
    """A 60-step task (0.5 s each) cancelled 1 s after it starts, from `pgjobs cancel
    --task-id` or `celery_ext.cancel`: it stops within a few seconds (prefork: its child
    terminated; gevent: its green thread killed; threads: at its next checkpoint), never
    completes, its result reads REVOKED, its message is a dead letter with reason `cancelled`
    (kept), and it never runs again."""
    start_worker(name=f"c{pool}", app=APP, pool=pool, concurrency=2)
    result = parity.steps.delay("long", 60, 0.5)
    wait_for(lambda: _started(db, schema, "long") == 1, 30, what="the task to start")
    time.sleep(1.0)
    cancelled_at = time.monotonic()
    if how == "cli":
        assert cli(["cancel", "--task-id", result.id, "--dsn", url, "--schema", schema]) == 0
    else:
        assert celery_ext.cancel(result.id, app=parity.app) == {
            "cancelled": [], "stopping": [result.id]}
    wait_for(lambda: _dead_reason(db, schema, result.id) == "cancelled", 15, interval=0.1,
             what="the run to end and its message to be a cancelled dead letter")
    took = time.monotonic() - cancelled_at
    assert took < 8, f"the run ended {took:.1f}s after the cancel"
    # gevent: the killed green thread's ack may land a moment before REVOKED is written
    wait_for(lambda: result.state == "REVOKED", 5, interval=0.1, what="REVOKED")
    assert _count(db, f"SELECT count(*) FROM \"{schema}\".pgjobs_job "
                      "WHERE message -> 'headers' ->> 'id' = %s", result.id) == 0
    time.sleep(2.0)
    assert _finished(db, schema, "long") == 0
    assert _started(db, schema, "long") == 1


def test_a_queued_task_cancelled_never_runs_and_reads_revoked(
        db, parity, recorder_tables, schema, start_worker):
    """Cancelled while queued (a countdown of 5 s): a dead letter with reason `cancelled` at
    once, REVOKED, and the worker never runs it; `pgjobs dead requeue` brings it back."""
    worker = start_worker(name="q1", app=APP, concurrency=2)
    result = parity.record.apply_async(("queued",), countdown=5)
    assert celery_ext.cancel([result.id], app=parity.app) == {
        "cancelled": [result.id], "stopping": []}
    assert _dead_reason(db, schema, result.id) == "cancelled"
    assert result.state == "REVOKED"
    time.sleep(6.0)
    assert _finished(db, schema, "queued") == 0
    assert worker.proc.poll() is None


def _run_pids(db: psycopg.Connection[Any], schema: str, label: str) -> list[int]:
    return [r[0] for r in db.execute(
        f'SELECT pid FROM "{schema}".pgjobs_test_start WHERE label = %s ORDER BY at',
        (label,)).fetchall()]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_run_whose_lease_was_lost_ends_and_the_message_completes_once(
        db, parity, recorder_tables, schema, start_worker, pool):
    """Worker A (lease 3 s) runs a 15 s task in steps and is frozen (SIGSTOP of its main
    process: its keeper cannot renew; a prefork child goes on running). The lease lapses,
    worker B rescues and runs the message. When A thaws, its keeper finds the lease lost and
    ends A's run (prefork: the child terminated; threads: at its next checkpoint), logged as
    PGJ-216: one completion in all, B's, and A's run never finishes."""
    import os
    import signal

    env = {"PGJOBS_TEST_LEASE_TTL": "3"}
    a = start_worker(name="a", app=APP, pool=pool, concurrency=2, env=env)
    result = parity.steps.delay("lost", 30, 0.5)
    wait_for(lambda: _started(db, schema, "lost") == 1, 30, what="A to start the task")
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        start_worker(name="b", app=APP, pool=pool, concurrency=2, env=env)
        wait_for(lambda: _started(db, schema, "lost") == 2, 30, interval=0.2,
                 what="B to run the message after A's lease lapsed")
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    wait_for(lambda: "pgjobs.run.stopped" in a.output(), 10, interval=0.2,
             what="A to end its run")
    assert "why=lost" in a.output() or "'why': 'lost'" in a.output(), a.output()[-2000:]
    wait_for(lambda: _finished(db, schema, "lost") == 1, 40, what="B's run to complete")
    time.sleep(2.0)
    assert _finished(db, schema, "lost") == 1
    first, second = _run_pids(db, schema, "lost")
    finished_by = _count(db, f'SELECT pid FROM "{schema}".pgjobs_test_run WHERE label = %s',
                         "lost")
    assert finished_by == second != first, (first, second, finished_by)
    assert result.get(timeout=10) is None


def test_time_limits_on_prefork_end_the_run_once_and_settle_the_message(
        db, parity, recorder_tables, schema, start_worker):
    """Celery's `time_limit` and `soft_time_limit` on pgjobs (prefork): the hard limit kills
    the child (TimeLimitExceeded), the soft one raises in the body (SoftTimeLimitExceeded);
    each run ends once, its result reads FAILURE, and its message is settled (acked: Celery's
    `acks_on_failure_or_timeout`), never run again. The lease is renewed by the main process
    all along, so a limit longer than `lease_ttl` is fine (issue 30, item 5)."""
    start_worker(name="limits", app=APP, pool="prefork", concurrency=2,
                 env={"PGJOBS_TEST_LEASE_TTL": "3"})
    hard = parity.steps.apply_async(("hard", 40, 0.25), time_limit=5)
    soft = parity.steps.apply_async(("soft", 40, 0.25), soft_time_limit=5)
    for result, error in ((hard, "TimeLimitExceeded"), (soft, "SoftTimeLimitExceeded")):
        with pytest.raises(Exception) as raised:
            result.get(timeout=30)
        assert type(raised.value).__name__ == error
        assert result.state == "FAILURE"
    for label in ("hard", "soft"):
        wait_for(lambda label=label: _count(
            db, f"SELECT count(*) FROM \"{schema}\".pgjobs_job "
                "WHERE message -> 'headers' ->> 'id' IN (%s, %s)", hard.id, soft.id) == 0,
            10, what="both messages settled")
        assert _started(db, schema, label) == 1
        assert _finished(db, schema, label) == 0
    time.sleep(4.0)  # more than a lease: nothing comes back
    assert _started(db, schema, "hard") == 1 and _started(db, schema, "soft") == 1


def _settled(db: psycopg.Connection[Any], schema: str) -> dict[str, list[str]]:
    got: dict[str, list[str]] = {}
    for task_id, outcome in db.execute(
            f'SELECT task_id, outcome FROM "{schema}".pgjobs_test_settled ORDER BY at'):
        got.setdefault(task_id, []).append(outcome)
    return got


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_on_settled_says_one_word_per_outcome_and_never_fires_for_a_retry(
        db, parity, recorder_tables, schema, start_worker, pool):
    """Issue 30, item 4: `completed`, `failed` (a final failure kept as a dead letter, and a
    Reject), `dropped` (dead_letter=False), `cancelled`, `requeued` (then `completed` for its
    next delivery); a retry fires nothing for the retried message (only its last message's
    `completed`); an early-acked failure says `failed` once its run ends."""
    worker = start_worker(name=f"s{pool}", app=APP, pool=pool, concurrency=4)
    done = parity.record.delay("done")
    kept = parity.fail_kept.delay("kept")
    dropped = parity.fail.delay("dropped")
    rejected = parity.reject.delay("rejected")
    retried = parity.retry_once.delay("retried")
    requeued = parity.requeue_once.delay("requeued")
    early = parity.early_fail.delay("early")
    stopped = parity.steps.delay("stopped", 60, 0.25)
    wait_for(lambda: _started(db, schema, "stopped") == 1, 30, what="the long task to start")
    celery_ext.cancel(stopped.id, app=parity.app)
    expected = {done.id: ["completed"], kept.id: ["failed"], dropped.id: ["dropped"],
                rejected.id: ["failed"], retried.id: ["completed"],
                requeued.id: ["requeued", "completed"], early.id: ["failed"],
                stopped.id: ["cancelled"]}
    try:
        wait_for(lambda: _settled(db, schema) == expected, 30, interval=0.25,
                 what="one outcome each")
    except AssertionError:
        names = {v: k for k, v in locals().items() if hasattr(v, "id")}
        raise AssertionError(f"{ {names.get(k, k): v for k, v in _settled(db, schema).items()} }"
                             f"\n{worker.output()[-6000:]}") from None
    time.sleep(1.5)  # nothing more comes
    assert _settled(db, schema) == expected


def test_a_worker_is_listed_by_node_name_and_incarnation_as_it_starts(
        db, parity, recorder_tables, schema, start_worker):
    """Issue 30, item 6: a worker (celery_ext) is in pgjobs_consumer — `pgjobs workers`, the
    dashboard — as soon as it is ready, named by its Celery node name, PID and an incarnation
    id; its leases name it so; the same node started again is another incarnation."""
    consumers = f'SELECT worker FROM "{schema}".pgjobs_consumer'
    names = []
    for _ in range(2):
        worker = start_worker(name="ident", app=APP, concurrency=1)
        ready = time.monotonic()
        wait_for(lambda: db.execute(consumers).fetchall(), 3, interval=0.05,
                 what="the worker's consumer row")
        assert time.monotonic() - ready < 1.5  # not a keeper tick (10 s) later
        (name,), = db.execute(consumers).fetchall()
        node, pid, incarnation = name.rsplit(":", 2)
        assert node.startswith("ident@") and int(pid) == worker.proc.pid, name
        assert len(incarnation) == 8, name
        result = parity.steps.delay("ident", 8, 0.25)
        wait_for(lambda: _started(db, schema, "ident") == len(names) + 1, 20,
                 what="the task to start")
        holder = db.execute(f"SELECT worker FROM \"{schema}\".pgjobs_job "
                            "WHERE message -> 'headers' ->> 'id' = %s", (result.id,)).fetchone()
        assert holder == (name,)
        result.get(timeout=20)
        assert worker.stop() == 0
        names.append(name)
    assert names[0] != names[1]


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_a_cold_shutdown_with_a_deadline_hands_cut_off_runs_back_at_once_uncounted(
        db, parity, recorder_tables, schema, start_worker, pool):
    """Issue 30, item 3: Celery's soft shutdown (`worker_soft_shutdown_timeout` = 2 s, then a
    cold shutdown; SIGQUIT) on each pool: a short task finishes within the deadline and is
    acked; a long one (with checkpoints) and, on threads, one without any (a plain sleep) are
    cut off, their messages back at once — ready, their attempt uncounted — and the worker
    exits within seconds of the deadline, never hanging on a run it cannot stop. (gevent,
    eventlet and solo: tests/test_shutdown_pools.py; docs/compatibility.md says what Celery
    does on its own there.)"""
    import signal

    soft = 2.0
    worker = start_worker(name=f"cold{pool}", app=APP, pool=pool, concurrency=4,
                          env={"PGJOBS_TEST_SOFT_SHUTDOWN": str(soft)})
    parity.steps.delay("short", 4, 0.25)
    long = parity.steps.delay("long", 240, 0.25)
    calls = [long]
    if pool == "threads":
        calls.append(parity.sleep.delay("asleep", 60.0))
    wait_for(lambda: _started(db, schema, "long") == 1 and _started(db, schema, "short") == 1,
             30, what="the tasks to start")
    time.sleep(0.5)
    stopped_at = time.monotonic()
    worker.proc.send_signal(signal.SIGQUIT)
    worker.proc.wait(20)
    took = time.monotonic() - stopped_at
    assert soft <= took < soft + 7.0, f"the worker exited {took:.1f}s after SIGQUIT"
    assert _finished(db, schema, "short") == 1
    rows = dict(db.execute(
        f"SELECT message -> 'headers' ->> 'id', array[state, attempts::text] "
        f'FROM "{schema}".pgjobs_job').fetchall())
    assert rows == {c.id: ["ready", "0"] for c in calls}, (rows, worker.output()[-3000:])
    assert _finished(db, schema, "long") == 0
