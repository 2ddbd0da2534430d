"""End to end: poison messages, dead letters and their requeue, pause/resume — real `celery
worker` processes on real Postgres (tests/apps/poison.py), counted from the database.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.ops.cli.main import main as cli

from .conftest import DSN, wait_for

pytestmark = pytest.mark.e2e

POISON = "tests.apps.poison"

_ENV_KEYS = ("PGJOBS_TEST_LEASE_TTL", "PGJOBS_TEST_MAX_ATTEMPTS", "PGJOBS_TEST_REJECT_ON_LOST",
             "PGJOBS_TEST_ACKS_LATE", "PGJOBS_TEST_PREFETCH", "PGJOBS_TEST_CELERY_EXT",
             "PGJOBS_TEST_RETRY_AFTER_MAX")


def poison_app(schema: str, url: str, **env: str) -> Any:
    """Import tests/apps/poison.py in this process, configured exactly like the workers (pass
    the same ``env`` to start_worker). The environment is restored afterwards: the app read
    its settings at import, and later workers must not inherit them."""
    saved = dict(os.environ)
    for key in _ENV_KEYS:
        os.environ.pop(key, None)
    os.environ.update({"PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_BROKER": url,
                       "PGJOBS_TEST_DSN": DSN, **env})
    try:
        sys.modules.pop("tests.apps.poison", None)
        return importlib.import_module("tests.apps.poison")
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def poison_tables(db: psycopg.Connection[Any], recorder_tables: str) -> str:
    db.execute(f'CREATE TABLE "{recorder_tables}".pgjobs_test_fix (label text)')
    return recorder_tables


def starts(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_start WHERE label = %s',
                      (label,)).fetchone()[0]


def runs(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    rows = db.execute(f'SELECT label, count(*) FROM "{schema}".pgjobs_test_run GROUP BY label')
    return dict(rows.fetchall())


def dead_rows(db: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    cur = db.execute(
        "SELECT id, queue, task, claim, attempts, max_attempts, reason, error, "
        f"message -> 'headers' ->> 'id' AS task_id FROM \"{schema}\".pgjobs_dead_letter "
        "ORDER BY id")
    names = [d.name for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def dead_for(db: psycopg.Connection[Any], schema: str, task: str) -> list[dict[str, Any]]:
    return [d for d in dead_rows(db, schema) if d["task"] == task]


def wait_or_explain(predicate: Any, timeout: float, what: str, db: psycopg.Connection[Any],
                    schema: str, worker: Any) -> Any:
    """wait_for, and on timeout say what the tables and the worker looked like (a message left
    ready while a live consumer idles is a missed wake-up, not a slow machine)."""
    try:
        return wait_for(predicate, timeout, what=what)
    except AssertionError as exc:
        jobs = db.execute(f'SELECT id, queue, state, claim, attempts, worker, task '
                          f'FROM "{schema}".pgjobs_job ORDER BY id').fetchall()
        consumers = db.execute(f'SELECT worker, queues, held, now() - last_seen_at '
                               f'FROM "{schema}".pgjobs_consumer').fetchall()
        raise AssertionError(f"{exc}\njobs: {jobs}\nconsumers: {consumers}\nworker log:\n"
                             f"{worker.output()[-3000:]}") from None


def run_cli(capsys: Any, schema: str, url: str, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli([*argv, "--dsn", url, "--schema", schema, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def test_worker_killing_task_is_buried_after_exactly_max_attempts_by_lapsed_leases(
        db, poison_tables, url, start_worker, capsys):
    """The lease path of invariant 5: the task os._exit()s its whole worker (threads pool: the
    consumer and its keeper die with it), so nothing settles the message; only its lease
    lapsing brings it back, and the next worker's keeper rescues it — or, on the final attempt
    (max_attempts=3, set per task by celery_ext as a header), buries it. Workers are restarted in
    a loop, as a supervisor would."""
    schema = poison_tables
    env = {"PGJOBS_TEST_LEASE_TTL": "1", "PGJOBS_TEST_CELERY_EXT": "1",
           "PGJOBS_TEST_PREFETCH": "1"}
    app = poison_app(schema, url, **env)
    app.die.delay("poison")
    for i in range(10):
        app.record.delay(f"r{i}")
    row = db.execute(f"SELECT max_attempts FROM \"{schema}\".pgjobs_job "
                     "WHERE task = 'poison.die'").fetchone()
    assert row == (3,), "celery_ext sent the task's max_attempts as a header"

    deaths: list[int] = []
    survivor = None
    deadline = time.monotonic() + 120
    while not dead_for(db, schema, "poison.die"):
        assert time.monotonic() < deadline, f"not buried after {len(deaths)} deaths"
        assert len(deaths) <= 3, "a fourth worker was killed: the poison was handed out again"
        w = start_worker(app=POISON, name=f"w{len(deaths)}", concurrency=1, env=env, ready=False)
        while w.proc.poll() is None and not dead_for(db, schema, "poison.die"):
            time.sleep(0.1)
        if w.proc.poll() is None:
            survivor = w
        else:
            deaths.append(w.proc.returncode)
    assert deaths == [13, 13, 13], deaths
    assert starts(db, schema, "poison") == 3, "exactly three claims ran the task"
    (dead,) = dead_for(db, schema, "poison.die")
    assert dead["reason"] == "lease_expired_final_attempt"
    assert (dead["attempts"], dead["claim"], dead["max_attempts"]) == (3, 3, 3)
    assert dead["error"]["type"] == "LeaseExpired"

    # The survivor keeps working: the queue flows, and nobody else dies.
    assert survivor is not None
    for i in range(10, 15):
        app.record.delay(f"r{i}")
    wait_for(lambda: len(runs(db, schema)) == 15, 60, what="every other task to run")
    assert survivor.proc.poll() is None
    assert starts(db, schema, "poison") == 3

    code, page = run_cli(capsys, schema, url, "dead", "ls", "--reason",
                         "lease_expired_final_attempt")
    assert code == 0 and [r["id"] for r in page["items"]] == [dead["id"]]


def test_prefork_lost_child_requeues_until_the_final_attempt_then_dead(
        db, poison_tables, url, start_worker):
    """The requeue path: with prefork, acks_late and task_reject_on_worker_lost, the worker's
    main process survives its child's death and rejects the message with requeue — the lease
    never lapses (lease_ttl stays 30 s). On the final attempt (the transport option
    max_attempts=3; a plain app, no celery_ext) the requeue dead-letters it instead."""
    schema = poison_tables
    env = {"PGJOBS_TEST_CELERY_EXT": "0", "PGJOBS_TEST_MAX_ATTEMPTS": "3",
           "PGJOBS_TEST_REJECT_ON_LOST": "1", "PGJOBS_TEST_PREFETCH": "1"}
    app = poison_app(schema, url, **env)
    began = time.monotonic()
    app.die.delay("poison")
    for i in range(5):
        app.record.delay(f"r{i}")
    w = start_worker(app=POISON, name="prefork", pool="prefork", concurrency=1, env=env)
    wait_for(lambda: dead_for(db, schema, "poison.die"), 60, what="the dead letter")
    assert time.monotonic() - began < 25, "requeued by the worker, not rescued after a lease"
    (dead,) = dead_for(db, schema, "poison.die")
    assert dead["reason"] == "max_attempts", w.output()[-6000:]
    assert (dead["attempts"], dead["claim"]) == (3, 3)
    assert dead["max_attempts"] is None, "a plain app sends no header: the option applies"
    assert starts(db, schema, "poison") == 3
    wait_for(lambda: len(runs(db, schema)) == 5, 60, what="the other tasks")
    assert w.proc.poll() is None


def test_reject_and_final_failures_become_dead_letters_and_requeue_runs_them_again(
        db, poison_tables, url, start_worker, capsys):
    schema = poison_tables
    env = {"PGJOBS_TEST_CELERY_EXT": "1"}
    app = poison_app(schema, url, **env)
    rejected = app.reject.delay("rj")
    failed = app.fail.delay("f1")
    fixable = app.fail_until_fixed.delay("fx")
    job_ids = dict(db.execute(
        f"SELECT message -> 'headers' ->> 'id', id FROM \"{schema}\".pgjobs_job").fetchall())
    start_worker(app=POISON, name="ext", concurrency=2, env=env)
    wait_for(lambda: len(dead_rows(db, schema)) == 3, 60, what="three dead letters")
    by_task = {d["task_id"]: d for d in dead_rows(db, schema)}
    assert set(by_task) == {rejected.id, failed.id, fixable.id}, "one dead letter each"

    rj = by_task[rejected.id]
    assert rj["reason"] == "rejected" and rj["id"] == job_ids[rejected.id]
    f1 = by_task[failed.id]
    assert f1["reason"] == "failed"
    assert f1["error"]["type"] == "builtins.ValueError"
    assert f1["error"]["message"] == "boom f1"
    assert "ValueError: boom f1" in f1["error"]["traceback"]
    assert f1["error"]["rule"] == "unclassified"
    assert f1["error"]["job_id"] == job_ids[failed.id], "points at the message it copies"
    assert f1["attempts"] == 1 and f1["claim"] == 1
    # Celery acks each failed message after its dead letter is written; the ack is flushed
    # within ack_flush_interval (a few milliseconds).
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job '
                                "WHERE queue = 'celery'").fetchone()[0] == 0, 5,
             what="the failed messages themselves settled (acked) by Celery")

    # Requeue from the CLI runs them again: the fixed one succeeds ...
    fx = by_task[fixable.id]
    db.execute(f'INSERT INTO "{schema}".pgjobs_test_fix VALUES (%s)', ("fx",))
    code, out = run_cli(capsys, schema, url, "dead", "requeue", str(fx["id"]))
    assert code == 0
    assert out["requeued"] == [{"id": fx["id"], "new_id": fx["id"], "queue": "celery"}]
    wait_for(lambda: runs(db, schema).get("fx") == 1, 30, what="the requeued task to succeed")
    assert starts(db, schema, "fx") == 2
    # ... and the rejected one runs, is rejected again, and comes back under the same id.
    code, out = run_cli(capsys, schema, url, "requeue", str(rj["id"]))
    assert code == 0 and out["requeued"][0]["new_id"] == rj["id"]
    wait_for(lambda: starts(db, schema, "rj") == 2, 30, what="the rejected task to run again")
    wait_for(lambda: any(d["id"] == rj["id"] for d in dead_rows(db, schema)), 30,
             what="the rejected task to be dead again")
    again = next(d for d in dead_rows(db, schema) if d["id"] == rj["id"])
    assert again["reason"] == "rejected" and again["attempts"] == 1 and again["claim"] == 2
    assert {d["task_id"] for d in dead_rows(db, schema)} == {rejected.id, failed.id}


def test_plain_app_failures_and_ack_before_run(db, poison_tables, url, start_worker, capsys):
    """What a plain app gets: a failed task is acked and gone (its failure is in Celery's result
    backend), unless it is acks_late with acks_on_failure_or_timeout=False: Celery rejects it and
    pgjobs keeps it as a dead letter ('rejected'). With celery_ext and acks_late off the message
    is acked before the task runs; the dead letter is rebuilt from the request, and requeuing it
    runs the task again."""
    schema = poison_tables
    plain = {"PGJOBS_TEST_CELERY_EXT": "0"}
    app = poison_app(schema, url, **plain)
    app.fail.delay("pf")
    rejecting = app.fail_rejecting.delay("pr")
    w = start_worker(app=POISON, name="plain", concurrency=2, env=plain)
    wait_or_explain(lambda: starts(db, schema, "pf") == 1 and dead_rows(db, schema), 30,
                    "both failures", db, schema, w)
    time.sleep(1.0)  # a dead letter for pf would show now
    (dead,) = dead_rows(db, schema)
    assert dead["task_id"] == rejecting.id and dead["reason"] == "rejected"
    assert dead["error"] is None, "the transport knows only that Celery rejected it"
    w.kill()  # idle; a warm shutdown is not what this test is about

    ext = {"PGJOBS_TEST_CELERY_EXT": "1", "PGJOBS_TEST_ACKS_LATE": "0"}
    app = poison_app(schema, url, **ext)
    early = app.fail_until_fixed.delay("early")
    start_worker(app=POISON, name="early-ack", concurrency=2, env=ext)
    wait_for(lambda: len(dead_rows(db, schema)) == 2, 30, what="the early-acked failure")
    rebuilt = next(d for d in dead_rows(db, schema) if d["task_id"] == early.id)
    assert rebuilt["reason"] == "failed" and rebuilt["error"]["type"] == "builtins.RuntimeError"
    db.execute(f'INSERT INTO "{schema}".pgjobs_test_fix VALUES (%s)', ("early",))
    code, _ = run_cli(capsys, schema, url, "dead", "requeue", str(rebuilt["id"]))
    assert code == 0
    wait_for(lambda: runs(db, schema).get("early") == 1, 30,
             what="the rebuilt message to run again")


def test_pause_stops_claims_and_resume_wakes_the_worker(db, poison_tables, url, start_worker,
                                                         capsys):
    schema = poison_tables
    env = {"PGJOBS_TEST_CELERY_EXT": "0"}
    app = poison_app(schema, url, **env)
    app.record.delay("before")
    start_worker(app=POISON, name="w", concurrency=2, env=env)
    wait_for(lambda: runs(db, schema).get("before") == 1, 30, what="a task before the pause")

    code, out = run_cli(capsys, schema, url, "pause", "celery")
    assert (code, out) == (0, {"queue": "celery", "paused": True})
    app.record.delay("during")
    app.sleep.apply_async(("delayed", 0), countdown=1)
    time.sleep(4.0)  # generous: an unpaused queue runs these within ~1.5 s
    rows = db.execute(f'SELECT state, claim FROM "{schema}".pgjobs_job '
                      "WHERE queue = 'celery' ORDER BY id").fetchall()
    assert rows == [("ready", 0), ("ready", 0)], "nothing was claimed while paused"
    code, out = run_cli(capsys, schema, url, "queues", "--queue", "celery")
    (q,) = out["queues"]
    assert q["paused"] is True and q["ready"] == 2 and q["oldest_ready_age"] >= 3

    resumed = time.monotonic()
    code, out = run_cli(capsys, schema, url, "resume", "celery")
    assert (code, out) == (0, {"queue": "celery", "paused": False})
    wait_for(lambda: runs(db, schema).get("during") == 1 and runs(db, schema).get("delayed"),
             30, what="the tasks to run after resume")
    assert time.monotonic() - resumed < 15, "resume woke the idle worker (NOTIFY), not a poll"
