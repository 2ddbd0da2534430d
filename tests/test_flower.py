"""Flower's queue lengths on pgjobs (issue 16, item 8): Flower's broker factory learns the pgjobs
scheme when Flower is imported (kombu_pgjobs/ops/flower.py, by the import hook that registers the
scheme: issue 33), so an app that only changed ``broker_url`` gets the broker page too; the counts
are read back from a real schema. Flower's worker and task pages on pgjobs, from a real worker's
events."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import flower.utils.broker as flower_broker
import psycopg
import pytest

from celery_ext.flower import PgJobsFlowerBroker, register
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate

from .conftest import DSN, ROOT, import_app, wait_for
from .test_cli import claim, publish


def test_flower_broker_for_pgjobs_counts_from_postgres(
        db: psycopg.Connection[Any], schema: str, url: str) -> None:
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=5, worker="flower:1")
    for _ in range(3):
        publish(core, db, "celery")
    claim(core, db, "celery")
    db.execute(f'INSERT INTO "{schema}".pgjobs_consumer (worker, queues, held) '
               "VALUES ('w:1', ARRAY['celery'], 1)")
    assert register() is True and register() is True  # idempotent
    broker = flower_broker.Broker(url, http_api=None, broker_options={"schema": schema},
                                  broker_use_ssl=None)
    assert isinstance(broker, PgJobsFlowerBroker)
    rows = asyncio.run(broker.queues(["celery", "other"]))
    assert rows == [
        {"name": "celery", "messages": 3, "messages_ready": 2, "messages_unacknowledged": 1,
         "consumers": 1, "idle_since": None},
        {"name": "other", "messages": 0, "messages_ready": 0, "messages_unacknowledged": 0,
         "consumers": 0, "idle_since": None},
    ]
    with pytest.raises(NotImplementedError):  # other brokers still go to Flower's own code
        flower_broker.Broker("sqs://", http_api=None, broker_options={}, broker_use_ssl=None)


@pytest.mark.e2e
def test_real_flower_answers_queue_lengths_for_pgjobs(db, recorder_tables, url, tmp_path):
    """`celery -A app flower` with celery_ext in the app: the broker page and the queue-length
    API answer (404 "broker is not supported" before)."""
    schema = recorder_tables
    parity = import_app("tests.apps.parity", schema, url)
    for i in range(3):
        parity.record.delay(f"queued{i}")  # no worker: they wait
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_BROKER": url,
           "PGJOBS_TEST_DSN": DSN, "PYTHONPATH": str(ROOT), "FLOWER_UNAUTHENTICATED_API": "true"}
    log = tmp_path / "flower.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "tests.apps.parity", "flower",
             f"--port={port}", "--address=127.0.0.1"], stdout=fh, stderr=subprocess.STDOUT,
            env=env, cwd=ROOT, start_new_session=True)
    try:
        def lengths() -> Any:
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/api/queues/length", timeout=5) as r:
                    return json.loads(r.read())
            except OSError:
                return None
        body = wait_for(lengths, 40, interval=0.5, what="Flower's queue-length API")
        celery_q = [q for q in body["active_queues"] if q["name"] == "celery"]
        assert celery_q and celery_q[0]["messages"] == 3 and celery_q[0]["messages_ready"] == 3
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/broker", timeout=10) as r:
            assert r.status == 200 and b"celery" in r.read()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


@contextmanager
def _flower(app: str, schema: str, url: str, tmp_path: Path) -> Iterator[str]:
    """A real `celery -A app flower` on a free port; yields its base URL once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_BROKER": url,
           "PGJOBS_TEST_DSN": DSN, "PYTHONPATH": str(ROOT), "FLOWER_UNAUTHENTICATED_API": "true"}
    log = tmp_path / "flower.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", app, "flower", f"--port={port}",
             "--address=127.0.0.1"], stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _get(f"{base}/healthcheck") is not None or proc.poll() is not None,
                 40, interval=0.3, what="Flower to answer")
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _get(url: str) -> Any:
    """The body of a GET (JSON decoded when it is JSON), None when it fails."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = r.read()
    except OSError:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return body.decode(errors="replace")


@pytest.mark.e2e
def test_flower_pages_for_a_plain_app_that_only_changed_broker_url(
        db, recorder_tables, url, tmp_path, start_worker):
    """tests/apps/recorder.py never imports pgjobs and installs nothing: Flower's broker page
    and queue-length API answer from Postgres (404 "'postgresql' broker is not supported"
    before), and its worker and task pages show a worker started with -E and its tasks."""
    schema = recorder_tables
    recorder = import_app("tests.apps.recorder", schema, url)
    start_worker(name="flowered", app="tests.apps.recorder", concurrency=1, extra=["-E"])
    for i in range(3):
        recorder.record.apply_async((f"later{i}",), countdown=600)  # waiting in Postgres
    with _flower("tests.apps.recorder", schema, url, tmp_path) as base:
        def celery_queue() -> Any:
            body = _get(f"{base}/api/queues/length")
            rows = [q for q in (body or {}).get("active_queues", []) if q["name"] == "celery"]
            return rows[0] if rows and rows[0]["messages"] == 3 else None
        row = wait_for(celery_queue, 40, interval=0.5, what="the queue-length API")
        assert row["messages_ready"] == 0 and row["consumers"] == 1, row
        page = _get(f"{base}/broker")
        assert isinstance(page, str) and "celery" in page and "not supported" not in page

        # the workers page (remote control) and the tasks page (the worker's -E events)
        workers = wait_for(lambda: (lambda w: w if isinstance(w, dict) and any(
            n.startswith("flowered@") for n in w) else None)(
                _get(f"{base}/api/workers?refresh=1")), 40, interval=1, what="the worker")
        name = next(n for n in workers if n.startswith("flowered@"))
        assert any(q["name"] == "celery" for q in workers[name]["active_queues"])
        done = recorder.record.delay("now")
        task = wait_for(lambda: (lambda t: t if isinstance(t, dict) and t.get("state")
                                 == "SUCCESS" else None)(_get(f"{base}/api/task/info/{done.id}")),
                        40, interval=0.5, what="the task's events in Flower")
        assert task["name"] == "record" and task["worker"] == name, task
        for page in ("workers", "tasks", f"worker/{name}", f"task/{done.id}"):
            body = _get(f"{base}/{page}")
            assert isinstance(body, str) and "<html" in body.lower(), page
