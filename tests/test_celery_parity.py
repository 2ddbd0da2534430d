"""Celery parity end to end (issue 16): real workers of tests/apps/parity.py (celery_ext, a
database result backend). Counts come from the database: runs, settle notifications, rows.
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from celery import chord
from celery.exceptions import ChordError, TaskRevokedError

from kombu_pgjobs.ops.cli.main import main as cli

from .conftest import wait_for

pytestmark = pytest.mark.e2e

APP = "tests.apps.parity"


def _ran(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_run WHERE label = %s',
                      (label,)).fetchone()[0]


def _rows(db: psycopg.Connection[Any], schema: str, task_id: str) -> int:
    return db.execute(f"SELECT count(*) FROM \"{schema}\".pgjobs_job "
                      "WHERE message -> 'headers' ->> 'id' = %s", (task_id,)).fetchone()[0]


def test_expires_behind_a_busy_queue_ends_revoked(db, parity, recorder_tables, start_worker):
    """expires=1 behind 2-second tasks on a one-slot worker: TaskRevokedError, never run
    (before: the row was dropped silently and get() waited forever). Five of them: one runs
    and four fill the prefetch window (4), so the late message waits in the queue; a message
    with a free slot is delivered at once (hand-off, as RabbitMQ pushes it), and Celery checks
    ``expires`` when it receives a task."""
    schema = recorder_tables
    start_worker(name="oneslot", app=APP, concurrency=1)
    for i in range(5):
        parity.sleep.delay(f"busy{i}", 2.0)
    late = parity.record.apply_async(("late",), expires=1)
    with pytest.raises(TaskRevokedError):
        late.get(timeout=40)
    assert late.state == "REVOKED"
    assert _ran(db, schema, "late") == 0
    # The worker stores REVOKED, then acks: the ack reaches the table a moment later.
    wait_for(lambda: _rows(db, schema, late.id) == 0, 5, interval=0.05,
             what="the expired message settled, not left")


def test_revoked_countdown_task_is_deleted_and_never_runs_after_restart(
        db, parity, recorder_tables, start_worker):
    schema = recorder_tables
    worker = start_worker(name="sync", app=APP, concurrency=2, worker_sync=True)
    doomed = parity.record.apply_async(("doomed",), countdown=6)
    parity.record.apply_async(("kept",), countdown=6)
    assert _rows(db, schema, doomed.id) == 1
    parity.app.control.revoke(doomed.id)  # what `celery control revoke ID` sends
    assert _rows(db, schema, doomed.id) == 0, "the broadcast's publish deleted the row"
    revoked = db.execute(f"SELECT coalesce(sum(n), 0) FROM \"{schema}\".pgjobs_counter "
                         "WHERE outcome = 'revoked'").fetchone()[0]
    assert revoked == 1
    assert worker.stop() == 0
    start_worker(name="sync2", app=APP, concurrency=2, worker_sync=True)  # before the ETA
    wait_for(lambda: _ran(db, schema, "kept") == 1, 30, what="the other ETA task")
    time.sleep(1.0)
    assert _ran(db, schema, "doomed") == 0
    assert "mingle: " in worker.output(), "worker sync (mingle) runs on pgjobs"


def test_a_revoke_outlives_the_whole_fleet_for_a_due_task(
        db, parity, recorder_tables, start_worker):
    """A task already due is revoked while no worker runs (so no worker hears it, and mingle has
    no one to ask): pgjobs keeps the revoke in Postgres, and the worker that starts later loads
    it, discards the message and acks it: it never runs and its row is gone."""
    schema = recorder_tables
    doomed = parity.record.delay("doomed-due")
    parity.record.delay("kept-due")
    parity.app.control.revoke(doomed.id)
    kept = db.execute(f'SELECT task_id FROM "{schema}".pgjobs_revoked').fetchall()
    assert kept == [(doomed.id,)]
    assert _rows(db, schema, doomed.id) == 1, "due (not delayed): left for the worker to discard"
    worker = start_worker(name="fresh", app=APP, concurrency=2)  # --without-mingle
    wait_for(lambda: _ran(db, schema, "kept-due") == 1, 30, what="the other task")
    wait_for(lambda: _rows(db, schema, doomed.id) == 0, 30, what="the revoked row to go")
    assert _ran(db, schema, "doomed-due") == 0
    assert f"Discarding revoked task: parity.record[{doomed.id}]" in worker.output(), \
        worker.output()[-2000:]


def test_cancel_by_task_id(db, parity, recorder_tables, url, capsys):
    schema = recorder_tables
    waiting = parity.record.apply_async(("waiting",), countdown=600)
    code = cli(["cancel", "--task-id", waiting.id, "--dsn", url, "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and len(out["cancelled"]) == 1, out
    assert _rows(db, schema, waiting.id) == 0
    code = cli(["cancel", "--task-id", waiting.id, "--dsn", url, "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code != 0 and out["error"]["code"] == "PGJ-401", out


@pytest.mark.exclusive  # timing bound: the task starts within 1.5 s of the promote
def test_promote_runs_the_delayed_task_within_a_second(
        db, parity, recorder_tables, url, start_worker, capsys):
    schema = recorder_tables
    start_worker(name="promote", app=APP, concurrency=2)
    later = parity.record.apply_async(("promoted",), countdown=3600)
    job_id = db.execute(f"SELECT id FROM \"{schema}\".pgjobs_job "
                        "WHERE message -> 'headers' ->> 'id' = %s", (later.id,)).fetchone()[0]
    time.sleep(1.0)  # the worker is idle, waiting (the ETA is an hour away)
    promoted_at = db.execute("SELECT clock_timestamp()").fetchone()[0]
    assert cli(["requeue", str(job_id), "--dsn", url, "--schema", schema, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["made_due"] == [job_id]
    wait_for(lambda: _ran(db, schema, "promoted") == 1, 20, what="the promoted task")
    started = db.execute(f"SELECT started FROM \"{schema}\".pgjobs_test_run "
                         "WHERE label = 'promoted'").fetchone()[0]
    # within a second of the promote (a loaded CI machine gets a little more)
    assert (started - promoted_at).total_seconds() < 1.5, started - promoted_at


def test_on_settled_once_per_landed_settle_and_dead_letters_keep_the_reason(
        db, parity, recorder_tables, start_worker):
    schema = recorder_tables
    worker = start_worker(name="settled", app=APP, pool="prefork", concurrency=2)
    ok = parity.record.delay("ok")
    failed = parity.fail.delay("failed")
    rejected = parity.reject.delay("rejected")
    lost = parity.lose_lease.delay("lost")
    wait_for(lambda: db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_test_settled').fetchone()[0] >= 3, 30,
        what="three settle notifications")
    wait_for(lambda: _ran(db, schema, "lost") == 1, 30, what="the task that loses its lease")
    time.sleep(1.5)  # past the ack flush: a notification for the stale ack would show now
    rows = db.execute(f'SELECT task_id, outcome, attempts FROM "{schema}".pgjobs_test_settled '
                      "ORDER BY task_id").fetchall()
    got = {tid: (outcome, attempts) for tid, outcome, attempts in rows}
    assert len(rows) == 3, rows  # once each
    assert got == {ok.id: ("completed", 1), failed.id: ("dropped", 1),
                   rejected.id: ("failed", 1)}
    assert lost.id not in got, "a stale ack (its fence missed) is never reported"
    assert "pgjobs.settle.unowned" in worker.output()
    reason, error, run_at, holder = db.execute(
        f"SELECT reason, error, run_at, worker FROM \"{schema}\".pgjobs_dead_letter "
        "WHERE message -> 'headers' ->> 'id' = %s", (rejected.id,)).fetchone()
    assert reason == "rejected"
    assert error == {"type": "Reject",
                     "message": "rejected: the invoice is for a closed account"}
    # the holder: the Celery node name, the PID, an incarnation id (issue 30, item 6)
    assert run_at is not None and holder and holder.startswith("settled@") \
        and f":{worker.proc.pid}:" in holder


def test_clean_stop_deregisters_the_worker(db, parity, recorder_tables, start_worker):
    schema = recorder_tables
    worker = start_worker(name="clean", app=APP, concurrency=1,
                          env={"PGJOBS_TEST_LEASE_TTL": "3"})
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_consumer').fetchone()[0],
             20, what="the worker's consumer row")
    assert worker.stop() == 0
    left = db.execute(f'SELECT worker FROM "{schema}".pgjobs_consumer').fetchall()
    assert left == [], "a cleanly stopped worker is not listed as alive"


def test_inspect_scheduled_lists_eta_tasks_from_postgres(db, parity, recorder_tables,
                                                         start_worker):
    start_worker(name="sched", app=APP, concurrency=1)
    later = parity.record.apply_async(("later",), countdown=600, priority=7)
    replies = parity.app.control.inspect(timeout=10.0, limit=1).scheduled()
    assert replies, "the worker answered"
    (name, entries), = replies.items()
    assert name.startswith("sched@")
    mine = [e for e in entries if e["request"]["id"] == later.id]
    assert len(mine) == 1, entries
    assert mine[0]["priority"] == 7 and mine[0]["eta"]
    assert mine[0]["request"]["name"] == "parity.record"
    assert mine[0]["request"]["args"] == "('later',)"


def test_chord_with_an_expired_member_fails_instead_of_hanging(
        db, parity, recorder_tables, start_worker):
    """A chord whose member expires while waiting fails (Celery's ChordError), as on Redis."""
    start_worker(name="chord", app=APP, concurrency=1)
    for i in range(4):  # the prefetch window (4): the chord's members wait in Postgres
        parity.sleep.delay(f"busy{i}", 1.5)
    result = chord([parity.record.si("member"),
                    parity.record.si("expired").set(expires=1)])(parity.record.si("callback"))
    with pytest.raises((ChordError, TaskRevokedError)):
        result.get(timeout=40)
    assert _ran(db, recorder_tables, "callback") == 0
