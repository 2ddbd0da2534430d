"""pgjobs's metrics through prometheus_client (issue 16, item 9): a Collector an app registers
in its own registry; values read back from a real schema; parked (waiting) messages counted."""

from __future__ import annotations

from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest

from kombu_pgjobs.core import QueueCore
from kombu_pgjobs.prometheus import PgJobsCollector
from kombu_pgjobs.schema import migrate

from .conftest import DSN
from .test_cli import claim, publish


def test_collector_in_an_app_registry(db: psycopg.Connection[Any], schema: str) -> None:
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=5, worker="prom:1")
    for _ in range(3):
        publish(core, db, "alpha")
    core.ack(db, claim(core, db, "alpha"))
    parked = publish(core, db, "alpha")
    db.execute(f"UPDATE \"{schema}\".pgjobs_job SET state = 'waiting', waiting_on = 'k' "
               "WHERE id = %s", (parked,))
    registry = CollectorRegistry()
    collector = PgJobsCollector(DSN, schema=schema)
    registry.register(collector)
    try:
        assert registry.get_sample_value("pgjobs_up") == 1.0
        assert registry.get_sample_value(
            "pgjobs_messages", {"queue": "alpha", "state": "ready"}) == 2.0
        assert registry.get_sample_value(
            "pgjobs_messages", {"queue": "alpha", "state": "waiting"}) == 1.0
        assert registry.get_sample_value(
            "pgjobs_settled_total", {"queue": "alpha", "outcome": "acked"}) == 1.0
        text = generate_latest(registry).decode()
        assert "# TYPE pgjobs_settled_total counter" in text
        assert "# TYPE pgjobs_messages gauge" in text
    finally:
        collector.close()


def test_collector_reports_down_instead_of_raising(dsn: str, schema: str) -> None:
    registry = CollectorRegistry()
    collector = PgJobsCollector(dsn, schema=schema)  # never migrated: no pgjobs schema
    registry.register(collector)
    try:
        assert registry.get_sample_value("pgjobs_up") == 0.0
        assert registry.get_sample_value(
            "pgjobs_messages", {"queue": "alpha", "state": "ready"}) is None
    finally:
        collector.close()
