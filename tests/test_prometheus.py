"""pgjobs's metrics through prometheus_client (issue 16, item 9): a Collector an app registers
in its own registry; values read back from a real schema; parked (waiting) messages counted."""

from __future__ import annotations

from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest

from kombu_pgjobs.ops.prometheus import PgJobsCollector
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate

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
            "pgjobs_settled_total", {"queue": "alpha", "outcome": "completed"}) == 1.0
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


def test_per_queue_series_are_capped_with_an_other_bucket(db: psycopg.Connection[Any],
                                                           schema: str) -> None:
    """20,000 queues: the top N by messages (settled totals: by settles) get series of their
    own, every other queue is summed into queue="(other)", so the exposition stays bounded
    (it was 140,000 series) and the sums stay right; --queues 0 lists every queue."""
    from kombu_pgjobs.ops.metrics import OTHER, collect, render
    from kombu_pgjobs.store.admin import Admin

    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=5, worker="prom:1")
    job = publish(core, db, "template")
    cols = [r[0] for r in db.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
        "AND table_name = 'pgjobs_job' AND column_name NOT IN ('id', 'queue') "
        "AND is_generated = 'NEVER' AND identity_generation IS NULL", [schema]).fetchall()]
    listed = ", ".join(f'"{c}"' for c in cols)
    # queue q<g> holds g % 7 + 1 messages: the busiest hold 7 (g % 7 == 6), ties by name
    db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, {listed}) '
               f"SELECT 'q' || lpad(g::text, 5, '0'), {listed} "
               f'FROM "{schema}".pgjobs_job AS j, generate_series(1, 20000) AS g, '
               "generate_series(0, g %% 7) AS k WHERE j.id = %s", [job])
    db.execute(f'DELETE FROM "{schema}".pgjobs_job WHERE id = %s', [job])
    db.execute(f'INSERT INTO "{schema}".pgjobs_counter (queue, outcome, bucket, shard, n) '
               "SELECT 'q' || lpad(g::text, 5, '0'), 'acked', date_trunc('minute', now()), "
               "'s', g FROM generate_series(1, 20000) AS g")
    admin = Admin(db, schema)
    total_ready = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0]
    metrics = {m.name: m for m in collect(admin, queues=5)}
    ready = {lb["queue"]: v for lb, v in metrics["pgjobs_messages"].samples
             if lb["state"] == "ready"}
    assert len(ready) == 6 and OTHER in ready
    assert sorted(q for q in ready if q != OTHER) == [
        f"q{g:05d}" for g in (6, 13, 20, 27, 34)]  # 7 messages each, first by name
    assert sum(ready.values()) == total_ready
    settled = {lb["queue"]: v for lb, v in metrics["pgjobs_settled_total"].samples}
    assert set(settled) == {"q20000", "q19999", "q19998", "q19997", "q19996", OTHER}
    assert settled[OTHER] == sum(range(1, 19996))
    counts = {lb["kind"]: v for lb, v in metrics["pgjobs_queues"].samples}
    assert counts == {"all": 20000, "other": 19995}
    text = render(collect(admin))  # the default: 100 queues
    series = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert len(series) < 1000, len(series)
    for name in ("pgjobs_messages", "pgjobs_dead_letters", "pgjobs_settled_total"):
        assert len({ln.split('queue="')[1].split('"')[0] for ln in series
                    if ln.startswith(name + "{")}) == 101, name
    every = {m.name: m for m in collect(admin, queues=0)}
    assert len(every["pgjobs_dead_letters"].samples) == 20000
    assert not any(lb.get("queue") == OTHER for lb, _ in every["pgjobs_messages"].samples)
    # the Collector takes the same cap
    registry = CollectorRegistry()
    collector = PgJobsCollector(DSN, schema=schema, queues=3)
    registry.register(collector)
    try:
        assert registry.get_sample_value("pgjobs_queues", {"kind": "other"}) == 19997.0
        assert registry.get_sample_value(
            "pgjobs_messages", {"queue": OTHER, "state": "ready"}) == total_ready - 21
    finally:
        collector.close()
