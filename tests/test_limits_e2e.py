"""Fleet-wide limits end to end: a celery_ext app (tests/apps/limited.py), real worker processes.

Overlaps and run counts are read back from the spans the tasks write to Postgres.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

import kombu_pgjobs

from .conftest import import_app, wait_for

pytestmark = pytest.mark.e2e

APP = "tests.apps.limited"


@pytest.fixture
def spans(db: psycopg.Connection[Any], recorder_tables: str) -> str:
    db.execute(f'CREATE TABLE "{recorder_tables}".pgjobs_test_span (id bigserial PRIMARY KEY, '
               "label text, key text, pid int, started timestamptz, finished timestamptz)")
    return recorder_tables


def _app(schema: str, url: str, **env: str) -> Any:
    return import_app(APP, schema, url, **env)


def _done(db: psycopg.Connection[Any], schema: str, like: str = "%") -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_span '
                      "WHERE finished IS NOT NULL AND label LIKE %s", (like,)).fetchone()[0]


def _max_overlap(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """Per key, the most spans open at one instant (at some span's start)."""
    rows = db.execute(f"""
        SELECT a.key, max((SELECT count(*) FROM "{schema}".pgjobs_test_span AS b
                            WHERE b.key = a.key AND b.started <= a.started
                              AND coalesce(b.finished, 'infinity') > a.started))
          FROM "{schema}".pgjobs_test_span AS a GROUP BY a.key""").fetchall()
    return dict(rows)


def _runs_per_label(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    return dict(db.execute(
        f'SELECT label, count(*) FROM "{schema}".pgjobs_test_span GROUP BY label').fetchall())


def test_keyed_limit_holds_across_four_workers(db, spans, url, start_worker):
    schema = spans
    app = _app(schema, url)
    with kombu_pgjobs.batch():
        for i in range(2000):
            app.keyed.delay(f"k{i}", f"acct-{i % 20}", 0.003)
    for n in range(4):
        start_worker(name=f"w{n}", app=APP, concurrency=8)
    wait_for(lambda: _done(db, schema) >= 2000, 240, interval=0.5, what="2000 keyed runs")
    time.sleep(1.0)  # a duplicate would show up now
    runs = _runs_per_label(db, schema)
    assert len(runs) == 2000 and set(runs.values()) == {1}, "every task ran exactly once"
    overlap = _max_overlap(db, schema)
    assert len(overlap) == 20
    assert max(overlap.values()) <= 2, overlap
    assert max(overlap.values()) == 2, "the limit is used, not just respected"
    pids = db.execute(f'SELECT count(DISTINCT pid) FROM "{schema}".pgjobs_test_span').fetchone()
    assert pids[0] == 4, "every worker took part"


def test_fleet_wide_task_concurrency(db, spans, url, start_worker):
    schema = spans
    app = _app(schema, url)
    for n in range(4):
        start_worker(name=f"w{n}", app=APP, concurrency=8)
    for i in range(60):
        app.capped.delay(f"c{i}", 0.15)
    wait_for(lambda: _done(db, schema) >= 60, 120, interval=0.5, what="60 capped runs")
    runs = _runs_per_label(db, schema)
    assert len(runs) == 60 and set(runs.values()) == {1}
    overlap = _max_overlap(db, schema)["capped"]
    assert overlap <= 3, f"{overlap} ran at once with concurrency=3"
    assert overlap == 3


def test_flood_of_one_key_does_not_hold_up_another(db, spans, url, start_worker):
    schema = spans
    app = _app(schema, url, PGJOBS_TEST_PER_KEY="1")
    with kombu_pgjobs.batch():
        for i in range(10_000):
            app.keyed.delay(f"a{i}", "A", 0.01)
        for i in range(5):
            app.keyed.delay(f"b{i}", f"B{i}", 0.0)
    start_worker(name="w", app=APP, concurrency=4, env={"PGJOBS_TEST_PER_KEY": "1"})
    wait_for(lambda: _done(db, schema, "b%") == 5, 60, interval=0.2, what="the B messages")
    a_done = _done(db, schema, "a%")
    assert a_done < 1000, f"B waited for {a_done} of A's 10,000"
    assert _max_overlap(db, schema)["A"] == 1


def test_sigkilled_holder_frees_its_slot(db, spans, url, start_worker):
    schema = spans
    env = {"PGJOBS_TEST_LEASE_TTL": "2", "PGJOBS_TEST_PER_KEY": "1"}
    app = _app(schema, url, **env)
    victim = start_worker(name="victim", app=APP, concurrency=2, env=env)
    app.keyed.delay("long", "K", 5.0)

    def started() -> int:
        return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_span').fetchone()[0]

    wait_for(lambda: started() == 1, 30, what="the long task to start")
    app.keyed.delay("next", "K", 0.0)
    time.sleep(0.5)
    assert started() == 1, "the key is full while its holder lives"
    killed = time.monotonic()
    victim.kill()
    # The victim's span ended when it died (it could not record that itself).
    db.execute(f'UPDATE "{schema}".pgjobs_test_span SET finished = clock_timestamp() '
               "WHERE finished IS NULL")
    start_worker(name="rescuer", app=APP, concurrency=2, env=env)
    # The dead holder's slot is freed when its lease lapses: the key runs again (the rescued
    # message first, in its order), then the message that waited behind it.
    wait_for(lambda: started() >= 2, 20, what="the key to run again after the kill")
    assert time.monotonic() - killed < 15
    wait_for(lambda: _runs_per_label(db, schema).get("next") == 1, 40,
             what="the key's waiting message to run")
    assert _max_overlap(db, schema)["K"] == 1
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_slot '
                                'WHERE job_id IS NOT NULL').fetchone()[0] == 0, 20,
             what="no slot left held")


def test_when_busy_fail_settles_refused_without_running(db, spans, url, start_worker):
    schema = spans
    app = _app(schema, url)
    start_worker(name="w", app=APP, concurrency=4)
    app.refusing.delay("holder", "R", 3.0)
    wait_for(lambda: _runs_per_label(db, schema).get("holder") == 1, 30, what="holder start")
    app.refusing.delay("refused", "R", 0.0)
    row = wait_for(lambda: db.execute(
        f'SELECT reason, error FROM "{schema}".pgjobs_dead_letter').fetchone(), 30,
        what="the refused dead letter")
    assert row[0] == "refused" and row[1]["code"] == "PGJ-302"
    wait_for(lambda: _done(db, schema, "holder") == 1, 30, what="holder end")
    assert "refused" not in _runs_per_label(db, schema), "its body never ran"


def test_a_deploy_that_raises_a_cap_never_stops_the_key(db, spans, url, start_worker):
    """Messages published before a deploy (concurrency_per_key=1) and after it (3) share a key:
    all of them run, once each, and the key never runs more than the larger cap at once.
    Before schema version 5 the first claim that met both failed (TriggeredDataChangeViolation)
    and so did every claim after it: the worker reconnected in a loop and ran nothing."""
    schema = spans
    old = _app(schema, url, PGJOBS_TEST_PER_KEY="1")
    with kombu_pgjobs.batch():
        for i in range(8):
            old.keyed.delay(f"old{i}", "acct", 0.2)
    new = _app(schema, url, PGJOBS_TEST_PER_KEY="3")
    with kombu_pgjobs.batch():
        for i in range(16):
            new.keyed.delay(f"new{i}", "acct", 0.2)
    old = _app(schema, url, PGJOBS_TEST_PER_KEY="1")  # a worker of the old release publishes
    with kombu_pgjobs.batch():
        for i in range(8, 12):
            old.keyed.delay(f"old{i}", "acct", 0.2)
    headers = db.execute(
        f"SELECT DISTINCT (limits -> 'concurrency' -> 0 ->> 'limit')::int "
        f'FROM "{schema}".pgjobs_job ORDER BY 1').fetchall()
    assert [h[0] for h in headers] == [1, 3], "old and new caps side by side"
    w = start_worker(name="w", app=APP, concurrency=8, env={"PGJOBS_TEST_PER_KEY": "3"})
    wait_for(lambda: _done(db, schema) >= 28, 90, interval=0.5, what="28 runs of one key")
    time.sleep(0.5)  # a duplicate would show up now
    runs = _runs_per_label(db, schema)
    assert len(runs) == 28 and set(runs.values()) == {1}, "every task ran exactly once"
    overlap = _max_overlap(db, schema)["acct"]
    assert 2 <= overlap <= 3, f"{overlap} ran at once under caps 1 and 3"
    left = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0]
    assert left == 0, "nothing left behind"
    assert "TriggeredDataChangeViolation" not in w.output()


@pytest.mark.exclusive  # timing bound: gaps under 0.5 s between a release and the next start
def test_a_released_slot_wakes_the_next_message_at_once(db, spans, url, start_worker):
    """One worker, one key with cap 1, six 0.2 s tasks: each release wakes the next parked
    message and the worker claims it at once. The wake-up's NOTIFY comes back on the claim
    connection with the result of the statement that released the slot; it used to mark the
    queue and then wait up to a second for the next poll (about 1.2 s per step)."""
    schema = spans
    app = _app(schema, url, PGJOBS_TEST_PER_KEY="1")
    start_worker(name="w", app=APP, concurrency=4, env={"PGJOBS_TEST_PER_KEY": "1"})
    with kombu_pgjobs.batch():
        for i in range(6):
            app.keyed.delay(f"chain{i}", "one", 0.2)
    wait_for(lambda: _done(db, schema) >= 6, 60, interval=0.2, what="the chain to run")
    gaps = [r[0] for r in db.execute(
        f"""SELECT extract(epoch FROM started - lag(finished) OVER (ORDER BY started))
              FROM "{schema}".pgjobs_test_span ORDER BY started""").fetchall()[1:]]
    assert max(gaps) < 0.5, f"gaps between a release and the next start: {gaps}"
