"""A server running without autovacuum: the keeper's tick asks for a VACUUM of the job table."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate

from .conftest import wait_for


def _dead(db: psycopg.Connection[Any], schema: str) -> int:
    db.execute("SELECT pg_stat_clear_snapshot()")
    return db.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE relid = %s::regclass",
                      (f'"{schema}".pgjobs_job',)).fetchone()[0]


# exclusive (tests/conftest.py): VACUUM removes the dead rows only when no other transaction in
# the database holds an older snapshot, and other tests keep transactions open
@pytest.mark.exclusive
# exclusive (tests/conftest.py): VACUUM removes dead rows only if no other session of the
# database holds an older snapshot, which a concurrent test may (a transaction held open)
@pytest.mark.exclusive
def test_keeper_vacuums_when_autovacuum_is_off(db, schema):
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=5)
    core.publish_many(db, [job_from_message("q", {"body": str(i), "headers": {},
                                                  "properties": {}}) for i in range(300)])
    claimed = core.claim(db, ["q"], 300).claimed
    core.ack(db, [(c.id, c.claim) for c in claimed])
    db.execute("SELECT pg_stat_force_next_flush()")
    wait_for(lambda: _dead(db, schema) >= 300, 10, what="dead rows counted")
    autovacuum_off = db.execute("SELECT current_setting('autovacuum') = 'off'").fetchone()[0]
    outcomes = core.maintain(db, consumed=["q"], grace=30, vacuum_after=100)
    asked = ("vacuum", None, None) in outcomes
    assert asked == autovacuum_off, "a vacuum is asked for exactly when autovacuum is off"
    core.vacuum(db)
    db.execute("SELECT pg_stat_force_next_flush()")
    wait_for(lambda: _dead(db, schema) < 300, 10, what="dead rows vacuumed")
    assert ("vacuum", None, None) not in core.maintain(db, consumed=["q"], grace=30,
                                                        vacuum_after=100)


def _vacuums(db: psycopg.Connection[Any], schema: str) -> int:
    db.execute("SELECT pg_stat_clear_snapshot()")
    return db.execute("SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = %s::regclass",
                      (f'"{schema}".pgjobs_job',)).fetchone()[0]


def test_consumer_vacuums_after_vacuum_every_settled_rows(db, schema, url):
    """Between autovacuum runs a claim steps over every dead entry at the head of the claim
    index: a consumer's keeper vacuums the job table after it settled vacuum_every rows."""
    import kombu

    with kombu.Connection(url, transport_options={"schema": schema,
                                                  "vacuum_every": 100}) as conn:
        queue = conn.SimpleQueue("vac")
        for i in range(150):
            queue.put({"i": i})
        before = _vacuums(db, schema)
        for _ in range(150):
            queue.get(timeout=10).ack()
        wait_for(lambda: _vacuums(db, schema) > before, 15, what="a vacuum by the keeper")
        queue.close()
    reloptions = db.execute("SELECT reloptions FROM pg_class WHERE oid = %s::regclass",
                            (f'"{schema}".pgjobs_job',)).fetchone()[0]
    assert "vacuum_truncate=false" in reloptions
