"""End to end: a plain Celery app (tests/apps/recorder.py) on pgjobs, real worker processes.

Counts come from the database the tasks write to, never from worker logs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.store.core import QueueCore

from .conftest import ROOT, import_app, wait_for
from .wirecount import WireCounter

pytestmark = pytest.mark.e2e


def _app(schema: str, url: str, **env: str) -> Any:
    """Import the recorder app in this process, configured like the workers."""
    return import_app("tests.apps.recorder", schema, url, **env)


def _runs(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    rows = db.execute(f'SELECT label, count(*) FROM "{schema}".pgjobs_test_run GROUP BY label')
    return dict(rows.fetchall())


def test_two_thousand_tasks_three_workers_exactly_once(db, recorder_tables, url, start_worker):
    schema = recorder_tables
    rec = _app(schema, url)
    for i in range(3):
        start_worker(name=f"w{i}", concurrency=4)
    with rec.app.connection_for_write() as conn:
        for i in range(2000):
            rec.record.apply_async((f"t{i}",), connection=conn)
    wait_for(lambda: sum(_runs(db, schema).values()) >= 2000, 120, what="2000 executions")
    time.sleep(1.0)  # let any duplicate show up
    runs = _runs(db, schema)
    assert len(runs) == 2000
    assert set(runs.values()) == {1}, {k: v for k, v in runs.items() if v != 1}
    pids = db.execute(
        f'SELECT count(DISTINCT pid) FROM "{schema}".pgjobs_test_run').fetchone()[0]
    assert pids == 3, "every worker took part"
    left = wait_for(lambda: db.execute(
        f'SELECT count(*) = 0 FROM "{schema}".pgjobs_job WHERE queue = %s',
        ("celery",)).fetchone()[0], 10, what="acked rows deleted")
    assert left


def test_sigkill_mid_task_redelivers_and_stale_ack_changes_nothing(
        db, recorder_tables, url, start_worker):
    schema = recorder_tables
    env = {"PGJOBS_TEST_LEASE_TTL": "2"}
    rec = _app(schema, url, **env)
    victim = start_worker(name="victim", concurrency=1, env=env)
    rec.sleep_record.delay("long", 4.0)
    wait_for(lambda: db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_test_start').fetchone()[0] == 1, 30,
        what="the task to start")
    first = db.execute(f'SELECT id, claim FROM "{schema}".pgjobs_job').fetchone()
    killed_at = time.monotonic()
    victim.kill()
    start_worker(name="rescuer", concurrency=1, env=env)
    wait_for(lambda: _runs(db, schema).get("long") == 1, 40, what="re-delivered run")
    assert time.monotonic() - killed_at < 2 + 2 + 4 + 15, "re-delivered within about one TTL"
    starts = db.execute(
        f'SELECT count(*), count(DISTINCT pid) FROM "{schema}".pgjobs_test_start').fetchone()
    assert starts == (2, 2), "killed run + the re-delivery, in two processes"
    # The killed run's late ack (a stale holder) changes nothing: publish a row that a new
    # claim holds, then ack with the old claim number.
    core = QueueCore(schema, lease_ttl=2, max_attempts=20)
    rec.sleep_record.delay("held", 30.0)
    wait_for(lambda: db.execute(
        f"SELECT count(*) FROM \"{schema}\".pgjobs_job WHERE state = 'running'").fetchone()[0],
        20, what="the second task to be held")
    job_id, claim = db.execute(
        f"SELECT id, claim FROM \"{schema}\".pgjobs_job WHERE state = 'running'").fetchone()
    assert core.ack(db, [(job_id, claim - 1)]) == set()
    assert core.requeue(db, [(job_id, claim - 1)], uncount=False) == set()
    assert core.bury(db, [(job_id, claim - 1)], reason="stale") == set()
    row = db.execute(f'SELECT state, claim FROM "{schema}".pgjobs_job WHERE id = %s',
                     (job_id,)).fetchone()
    assert row == ("running", claim)
    assert first[0] != job_id


def test_long_task_with_short_lease_runs_once_and_prefetched_stay_put(
        db, recorder_tables, url, start_worker):
    schema = recorder_tables
    env = {"PGJOBS_TEST_LEASE_TTL": "2"}
    rec = _app(schema, url, **env)
    rec.sleep_record.delay("long", 12.0)
    for i in range(3):
        rec.record.delay(f"behind{i}")
    holder = start_worker(name="holder", concurrency=1, env=env)
    wait_for(lambda: db.execute(
        f"SELECT count(*) FROM \"{schema}\".pgjobs_job WHERE state = 'running'"
    ).fetchone()[0] == 4, 20, what="all four claimed by the first worker")
    start_worker(name="idle", concurrency=2, env=env)
    wait_for(lambda: len(_runs(db, schema)) == 4, 60, what="all four to run")
    time.sleep(2 * 2.0)  # two more lease periods: a duplicate would show now
    runs = _runs(db, schema)
    assert runs == {"long": 1, "behind0": 1, "behind1": 1, "behind2": 1}
    starts = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_start').fetchone()[0]
    assert starts == 1
    pids = {r[0] for r in db.execute(f'SELECT DISTINCT pid FROM "{schema}".pgjobs_test_run')}
    assert pids == {holder.proc.pid}, "prefetched messages were not re-delivered elsewhere"


def test_eta_task_waits_in_postgres(db, recorder_tables, url, start_worker):
    schema = recorder_tables
    rec = _app(schema, url)
    start_worker(name="w", concurrency=2)
    sent = time.time()
    rec.record.apply_async(("later",), countdown=5)
    deadline = sent + 4.0
    samples = 0
    while time.time() < deadline:
        row = db.execute(f'SELECT state, claim, worker FROM "{schema}".pgjobs_job').fetchone()
        assert row == ("ready", 0, None), row
        samples += 1
        time.sleep(0.25)
    assert samples >= 10
    wait_for(lambda: _runs(db, schema).get("later") == 1, 20, what="the ETA task")
    started = db.execute(
        f'SELECT extract(epoch FROM started) FROM "{schema}".pgjobs_test_run').fetchone()[0]
    assert float(started) >= sent + 4.9


def test_inspect_ping_two_workers_and_reply_rows_go(db, recorder_tables, url, start_worker):
    schema = recorder_tables
    start_worker(name="alpha", concurrency=1)
    start_worker(name="beta", concurrency=1)
    env = {**os.environ, "PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_BROKER": url,
           "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.apps.recorder", "inspect", "ping",
         "--timeout", "5"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "alpha@" in out.stdout and "beta@" in out.stdout, out.stdout
    assert out.stdout.count("pong") == 2
    left = wait_for(lambda: db.execute(
        f"SELECT count(*) = 0 FROM \"{schema}\".pgjobs_job WHERE queue LIKE '%%reply%%'"
    ).fetchone()[0], 30, what="reply rows to go")
    assert left
    queues = [r[0] for r in db.execute(
        f"SELECT name FROM \"{schema}\".pgjobs_queue WHERE name LIKE '%%reply%%'")]
    assert queues == []


def test_warm_shutdown_hands_back_prefetched_uncounted(db, recorder_tables, url, start_worker):
    schema = recorder_tables
    rec = _app(schema, url)
    rec.sleep_record.delay("long", 3.0)
    for i in range(3):
        rec.record.delay(f"waiting{i}")
    w = start_worker(name="w", concurrency=1)
    wait_for(lambda: db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_test_start').fetchone()[0] == 1, 20,
        what="the long task to start")
    assert w.stop() == 0
    rows = db.execute(
        f'SELECT state, attempts, claim FROM "{schema}".pgjobs_job ORDER BY id').fetchall()
    runs = _runs(db, schema)
    assert runs.get("long") == 1, "the running task finished"
    unstarted = 3 - sum(v for k, v in runs.items() if k.startswith("waiting"))
    assert len(rows) == unstarted
    assert all(r[0] == "ready" and r[1] == 0 for r in rows), rows


def test_connections_per_worker_do_not_grow_with_queues(db, recorder_tables, start_worker):
    """Claim+LISTEN, publish and keeper connections: three, for one queue or six."""
    names = {n: f"pgjt_conn_{n}_{recorder_tables[-6:]}" for n in (1, 6)}
    workers = [start_worker(name=f"c{n}", concurrency=2, env={"PGJOBS_TEST_APPNAME": name},
                            extra=["-Q", ",".join(f"q{i}" for i in range(n))])
               for n, name in names.items()]  # side by side: each counted by its own name
    time.sleep(12)  # past the first keeper tick (lease_ttl / 3)
    counts = [db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                         (name,)).fetchone()[0] for name in names.values()]
    for w in workers:
        w.stop()
    assert counts == [3, 3], counts


@pytest.mark.slow
def test_idle_worker_statement_budget(dsn, start_worker, recorder_tables):
    """An idle worker for 60 s sends at most 10 statements to Postgres (expected 7-8: one keeper
    tick per lease_ttl/3 = 10 s, plus one safety claim per channel per idle_poll_interval).

    Statements are counted on the wire by a proxy between the worker and Postgres."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    with WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432))) as wire:
        url = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
               f"{info.get('dbname', 'test')}")
        start_worker(name="idle", concurrency=2, env={"PGJOBS_TEST_BROKER": url})
        time.sleep(5)  # start-up (migration check, declares, first claims) is not idle time
        before = wire.count()
        seen_before = dict(wire.by_text)
        time.sleep(60)
        idle = wire.count() - before
        during = {k: v - seen_before.get(k, 0) for k, v in wire.by_text.items()
                  if v - seen_before.get(k, 0)}
    assert 1 <= idle <= 10, f"{idle} statements in an idle minute: {during}"
