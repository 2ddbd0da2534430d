"""Flower's queue lengths on pgjobs (issue 16, item 8): celery_ext teaches Flower's broker
factory the pgjobs scheme; the counts are read back from a real schema."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import flower.utils.broker as flower_broker
import psycopg
import pytest

from celery_ext.flower import PgJobsFlowerBroker, register
from kombu_pgjobs.core import QueueCore
from kombu_pgjobs.schema import migrate

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
