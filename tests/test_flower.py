"""Flower's queue lengths on pgjobs (issue 16, item 8): celery_ext teaches Flower's broker
factory the pgjobs scheme; the counts are read back from a real schema."""

from __future__ import annotations

import asyncio
from typing import Any

import flower.utils.broker as flower_broker
import psycopg
import pytest

from celery_ext.flower import PgJobsFlowerBroker, register
from kombu_pgjobs.core import QueueCore
from kombu_pgjobs.schema import migrate

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
