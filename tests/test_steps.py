"""Durable steps (celery_ext.steps, issue 32) with real workers of tests/apps/stepped.py.

Crashes are real SIGKILLs of the worker's process group; a stale run is a prefork worker whose
main process is frozen (SIGSTOP) until another worker took its message over. Counts are read
back from the database: step bodies' starts (``pgjobs_test_start``), completions
(``pgjobs_test_run``), wake-ups (``pgjobs_test_woke``), the step and job rows.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import psycopg
import pytest

import celery_ext
from kombu_pgjobs.ops.cli.main import main as cli

from .conftest import import_app, wait_for
from .test_roles import _apply_roles, _denied
from .test_roles import roles as roles  # the fixture, for the roles test

pytestmark = pytest.mark.e2e

APP = "tests.apps.stepped"


@pytest.fixture
def stepped(db: psycopg.Connection[Any], recorder_tables: str, url: str) -> Any:
    db.execute(f'CREATE TABLE "{recorder_tables}".pgjobs_test_woke (label text, task_id text, '
               "what text, at timestamptz DEFAULT clock_timestamp())")
    db.execute(f'CREATE TABLE "{recorder_tables}".pgjobs_test_flag (name text)')
    return import_app(APP, recorder_tables, url)


def count(db: psycopg.Connection[Any], query: str, *args: Any) -> Any:
    return db.execute(query, args).fetchone()[0]


def starts(db: psycopg.Connection[Any], schema: str, label: str) -> dict[str, int]:
    """How often each step body of ``label`` started."""
    return dict(db.execute(
        f'SELECT split_part(label, \':\', 2), count(*) FROM "{schema}".pgjobs_test_start '
        "WHERE label LIKE %s GROUP BY 1", (f"{label}:%",)).fetchall())


def done(db: psycopg.Connection[Any], schema: str, label: str) -> int:
    return count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_run WHERE label = %s', label)


def steps_of(db: psycopg.Connection[Any], schema: str, task_id: str) -> dict[str, dict[str, Any]]:
    cur = db.execute(f'SELECT name, kind, state, attempts, result::text, error, due_at, '
                     f'claim FROM "{schema}".pgjobs_step WHERE task_id = %s', (task_id,))
    names = [c.name for c in cur.description]
    return {r[0]: dict(zip(names, r, strict=True)) for r in cur.fetchall()}


def job(db: psycopg.Connection[Any], schema: str, task_id: str) -> Any:
    return db.execute(f'SELECT id, state, attempts, delayed, run_at > now() FROM "{schema}".'
                      "pgjobs_job WHERE message -> 'headers' ->> 'id' = %s", (task_id,)).fetchone()


def woke(db: psycopg.Connection[Any], schema: str, label: str) -> list[Any]:
    return [json.loads(r[0]) for r in db.execute(
        f'SELECT what FROM "{schema}".pgjobs_test_woke WHERE label = %s ORDER BY at',
        (label,)).fetchall()]


# -- crashes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_killed_inside_step_two_completes_on_the_next_worker(
        db, stepped, schema, start_worker, pool):
    """SIGKILL inside step 2's body: the next worker replays step 1 (its body ran once), runs
    step 2 again (twice: its write never committed) and step 3 once; one completion."""
    env = {"PGJOBS_TEST_LEASE_TTL": "3", "PGJOBS_TEST_STEP_SLEEP": "two=60"}
    first = start_worker(name="k1", app=APP, pool=pool, concurrency=2, env=env)
    result = stepped.three.delay("crash")
    wait_for(lambda: starts(db, schema, "crash").get("two") == 1, 30,
             what="step two to start on the first worker")
    assert steps_of(db, schema, result.id)["one"]["state"] == "done"
    first.kill()
    start_worker(name="k2", app=APP, pool=pool, concurrency=2,
                 env={"PGJOBS_TEST_LEASE_TTL": "3"})
    wait_for(lambda: done(db, schema, "crash") == 1, 60, what="the task to complete")
    time.sleep(1.0)  # a duplicate would show now
    assert starts(db, schema, "crash") == {"one": 1, "two": 2, "gap": 1, "three": 1}
    assert done(db, schema, "crash") == 1
    stored = steps_of(db, schema, result.id)
    assert {n: s["state"] for n, s in stored.items()} == {
        "one": "done", "two": "done", "three": "done"}
    assert job(db, schema, result.id) is None


def test_killed_after_step_two_committed_runs_it_once(db, stepped, schema, start_worker):
    """SIGKILL between steps two and three (outside any step): step two's write had
    committed, so its body ran once; three once."""
    env = {"PGJOBS_TEST_LEASE_TTL": "3", "PGJOBS_TEST_STEP_SLEEP": "gap=60"}
    first = start_worker(name="g1", app=APP, pool="prefork", concurrency=2, env=env)
    stepped.three.delay("gap")
    wait_for(lambda: starts(db, schema, "gap").get("gap") == 1, 30, what="the gap")
    first.kill()
    start_worker(name="g2", app=APP, concurrency=2, env={"PGJOBS_TEST_LEASE_TTL": "3"})
    wait_for(lambda: done(db, schema, "gap") == 1, 60, what="the task to complete")
    time.sleep(1.0)
    assert starts(db, schema, "gap") == {"one": 1, "two": 1, "gap": 2, "three": 1}


def test_a_stale_runs_step_write_is_refused(db, stepped, schema, start_worker):
    """Worker A (prefork, lease 3 s) is inside step two's body (15 s) when its main process
    is frozen: its keeper cannot renew. Worker B rescues the message and runs it to the end
    (step one replayed). A's child then finishes step two's body and writes: refused
    (PGJ-903, logged pgjobs.step.refused PGJ-920), nothing written: the stored result of
    step two is B's, and A's run never reaches step three."""
    env = {"PGJOBS_TEST_LEASE_TTL": "3", "PGJOBS_TEST_STEP_SLEEP": "two=15"}
    a = start_worker(name="sa", app=APP, pool="prefork", concurrency=1, env=env)
    result = stepped.three.delay("stale")
    wait_for(lambda: starts(db, schema, "stale").get("two") == 1, 30, what="A in step two")
    a_child = db.execute(f'SELECT pid FROM "{schema}".pgjobs_test_start WHERE label = %s',
                         ("stale:two",)).fetchone()[0]
    os.kill(a.proc.pid, signal.SIGSTOP)
    try:
        b = start_worker(name="sb", app=APP, concurrency=2, env={"PGJOBS_TEST_LEASE_TTL": "3"})
        wait_for(lambda: done(db, schema, "stale") == 1, 60, what="B to complete the task")
        b_pid = b.proc.pid
        wait_for(lambda: "pgjobs.step.refused" in a.output(), 30,
                 what="A's step write to be refused")
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    out = a.output()
    assert "PGJ-920" in out and "why=lost" in out, out[-3000:]
    stored = steps_of(db, schema, result.id)
    assert json.loads(stored["two"]["result"])["pid"] == b_pid != a_child
    assert stored["two"]["attempts"] == 1  # A's write never landed
    time.sleep(1.0)
    assert starts(db, schema, "stale") == {"one": 1, "two": 2, "gap": 1, "three": 1}
    assert done(db, schema, "stale") == 1



def test_a_cancelled_run_writes_no_step_after_the_cancel(db, stepped, schema, start_worker):
    """Threads pool (a run cannot be stopped from outside, only flagged): cancelled while step
    two's body runs, the body finishes but its write is refused (PGJ-903, why=cancelled), the
    run ends, step three never starts, and the message is a dead letter `cancelled`."""
    w = start_worker(name="cx", app=APP, concurrency=2,
                     env={"PGJOBS_TEST_STEP_SLEEP": "two=3"})
    result = stepped.three.delay("cx")
    wait_for(lambda: starts(db, schema, "cx").get("two") == 1, 30, what="step two")
    assert celery_ext.cancel(result.id, app=stepped.app)["stopping"] == [result.id]
    dead = f'SELECT reason FROM "{schema}".pgjobs_dead_letter WHERE message -> \'headers\' ' \
           "->> 'id' = %s"
    wait_for(lambda: db.execute(dead, (result.id,)).fetchone(), 30, what="the dead letter")
    assert db.execute(dead, (result.id,)).fetchone() == ("cancelled",)
    time.sleep(0.5)
    assert set(steps_of(db, schema, result.id)) == {"one"}
    assert starts(db, schema, "cx") == {"one": 1, "two": 1}
    assert "pgjobs.step.refused" in w.output() and "why=cancelled" in w.output()



def test_a_retry_replays_the_steps_before_the_one_that_failed(db, stepped, schema,
                                                              start_worker):
    """autoretry_for: step two raises, Celery publishes the retry (a new message, the same task
    id); the retry replays step one and runs step two again. The failure is recorded."""
    start_worker(name="rt", app=APP, concurrency=2)
    result = stepped.retried.delay("rt")
    wait_for(lambda: done(db, schema, "rt") == 1, 30, what="the retried task to complete")
    assert starts(db, schema, "rt") == {"one": 1, "two": 2}
    two = steps_of(db, schema, result.id)["two"]
    assert (two["state"], two["attempts"]) == ("done", 2)


# -- sleeping ----------------------------------------------------------------------------------
@pytest.mark.exclusive  # a bound of a second on 200 wake-ups: not while other tests load the box
def test_two_hundred_sleepers_hold_no_slot_and_wake_on_time(db, stepped, schema, start_worker):
    """200 tasks sleep 12-14 s on a prefork -c 2 worker: once they are all parked, 200 other
    tasks run at full speed (no slot is held, nothing is prefetched): at most twice as long
    (plus a second, for a loaded machine) as the same 200 took on the same worker before any
    sleeper was published; and every sleeper resumes within a second of its due time (both
    read on the database's clock)."""
    start_worker(name="n1", app=APP, pool="prefork", concurrency=2)

    def quick_batch(label: str) -> float:
        started = time.monotonic()
        for i in range(200):
            stepped.record.delay(f"{label}{i}")
        wait_for(lambda: count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_run '
                                   "WHERE label LIKE %s", f"{label}%") == 200, 60,
                 interval=0.05, what=f"200 {label} tasks to run")
        return time.monotonic() - started

    stepped.record.delay("warm")  # the pool's children up and connected
    wait_for(lambda: done(db, schema, "warm") == 1, 30, what="the warm-up task")
    baseline = quick_batch("base")
    sleepers = [stepped.nap.delay(f"nap{i}", 12 + (i % 100) * 0.02) for i in range(200)]
    parked = f'SELECT count(*) FROM "{schema}".pgjobs_step WHERE state = \'sleeping\''
    wait_for(lambda: count(db, parked) == 200, 60, interval=0.1, what="200 sleepers parked")
    # parked: ready, out of the claim index until due, their delivery given back (uncounted)
    assert db.execute(f'SELECT state, delayed, max(attempts), count(*) FROM "{schema}".'
                      "pgjobs_job GROUP BY 1, 2").fetchall() == [("ready", True, 0, 200)]
    first_due = count(db, f'SELECT min(due_at) - now() FROM "{schema}".pgjobs_step')
    took = quick_batch("quick")
    assert took < first_due.total_seconds(), \
        f"other tasks took {took:.1f}s: the sleepers should hold nothing"
    assert took <= 2 * baseline + 1.0, \
        f"200 quick tasks took {took:.2f}s among the sleepers, {baseline:.2f}s before them"
    wait_for(lambda: count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_woke') == 200,
             60, what="200 sleepers to wake")
    lateness = db.execute(
        f'SELECT w.label, extract(epoch FROM w.at - s.due_at) FROM "{schema}".pgjobs_test_woke '
        f'AS w JOIN "{schema}".pgjobs_step AS s ON s.task_id = w.task_id AND s.name = \'nap\' '
        "ORDER BY 2 DESC").fetchall()
    assert all(0 <= late < 1.0 for _, late in lateness), lateness[:5]
    assert {r.id for r in sleepers} == {r[0] for r in db.execute(
        f'SELECT task_id FROM "{schema}".pgjobs_test_woke').fetchall()}
    assert count(db, f'SELECT count(*) FROM "{schema}".pgjobs_test_run '
                     "WHERE label LIKE 'nap%%'") == 200


# -- events ------------------------------------------------------------------------------------
def test_an_event_emitted_before_the_wait_is_matched(db, stepped, schema, start_worker):
    start_worker(name="e1", app=APP, concurrency=2)
    celery_ext.steps.emit("payment.confirmed", key=42, data={"by": "card"}, app=stepped.app)
    result = stepped.wait.delay("before", "payment.confirmed", 42, 30)
    wait_for(lambda: woke(db, schema, "before"), 30, what="the waiter")
    assert woke(db, schema, "before") == [{"by": "card"}]
    step = steps_of(db, schema, result.id)["payment.confirmed"]
    assert (step["state"], step["attempts"], step["due_at"]) == ("done", 1, None)  # never parked


def test_an_event_after_the_wait_wakes_every_waiter_of_its_key(db, stepped, schema,
                                                              start_worker):
    """Three waiters of key 7 and one of key 8 park; one emit of key 7 wakes the three within
    a second or two (not the fourth), each returning its data."""
    start_worker(name="e2", app=APP, concurrency=2)
    results = [stepped.wait.delay(f"after{i}", "order.confirmed", 7, 600) for i in range(3)]
    other = stepped.wait.delay("other", "order.confirmed", 8, 600)
    waiting = f'SELECT count(*) FROM "{schema}".pgjobs_step WHERE state = \'waiting\''
    wait_for(lambda: count(db, waiting) == 4, 30, what="four waiters parked")
    wait_for(lambda: all(job(db, schema, r.id)[1:] == ("ready", 0, True, True)
                         for r in [*results, other]), 10, what="the messages parked")
    emitted = time.monotonic()
    celery_ext.steps.emit("order.confirmed", key=7, data={"n": 1}, app=stepped.app)
    wait_for(lambda: all(woke(db, schema, f"after{i}") for i in range(3)), 15, interval=0.05,
             what="the three waiters of key 7")
    assert time.monotonic() - emitted < 3.0
    assert [woke(db, schema, f"after{i}") for i in range(3)] == [[{"n": 1}]] * 3
    time.sleep(1.0)
    assert woke(db, schema, "other") == []
    assert job(db, schema, other.id)[1] == "ready"


def test_a_wait_times_out(db, stepped, schema, start_worker):
    """No event within its 2 s timeout: the step raises EventTimeout (recorded, PGJ-905)."""
    start_worker(name="e3", app=APP, concurrency=2)
    started = time.monotonic()
    result = stepped.wait.delay("late", "never.comes", "x", 2)
    wait_for(lambda: woke(db, schema, "late"), 20, what="the timeout")
    assert 1.5 < time.monotonic() - started < 6.0
    assert woke(db, schema, "late") == ["timeout"]
    step = steps_of(db, schema, result.id)["never.comes"]
    assert step["state"] == "failed" and step["error"]["code"] == "PGJ-905"


def test_an_emit_in_a_rolled_back_transaction_is_never_delivered(
        db, stepped, schema, start_worker, dsn):
    """celery_ext.transaction(conn): an emit whose transaction rolls back leaves no event and
    wakes nobody; the same emit in a transaction that commits wakes the waiter."""
    start_worker(name="e4", app=APP, concurrency=2)
    result = stepped.wait.delay("tx", "invoice.paid", "inv-1", 600)
    wait_for(lambda: (job(db, schema, result.id) or (0, ""))[1:2] == ("ready",)
             and steps_of(db, schema, result.id), 30, what="the waiter parked")

    class Rollback(Exception):
        pass

    with psycopg.connect(dsn) as conn:
        with pytest.raises(Rollback), conn.transaction():
            conn.execute("SELECT 1")
            with celery_ext.transaction(conn, app=stepped.app):
                celery_ext.steps.emit("invoice.paid", key="inv-1", data={"ok": 1},
                                      app=stepped.app)
            raise Rollback
    time.sleep(3.0)
    assert count(db, f'SELECT count(*) FROM "{schema}".pgjobs_event') == 0
    assert woke(db, schema, "tx") == []
    assert job(db, schema, result.id)[1:] == ("ready", 0, True, True)
    with psycopg.connect(dsn) as conn, conn.transaction():
        with celery_ext.transaction(conn, app=stepped.app):
            celery_ext.steps.emit("invoice.paid", key="inv-1", data={"ok": 2}, app=stepped.app)
        assert woke(db, schema, "tx") == []  # not before the commit
    wait_for(lambda: woke(db, schema, "tx"), 15, what="the committed emit to wake it")
    assert woke(db, schema, "tx") == [{"ok": 2}]


# -- operators ---------------------------------------------------------------------------------
def _cli(capsys: Any, url: str, schema: str, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli([*argv, "--dsn", url, "--schema", schema, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def test_requeue_from_step_runs_that_step_and_the_later_ones_again(
        db, stepped, schema, url, start_worker, capsys):
    """A task whose third step fails for good is a dead letter; `pgjobs requeue DEAD_ID
    --from-step two` drops steps two and three and requeues it: step one is replayed, two
    and three run again. `pgjobs steps` shows it all; a step the task does not have and a
    running message are refused, nothing changed."""
    start_worker(name="r1", app=APP, concurrency=2)
    result = stepped.flaky.delay("fl")
    dead = f'SELECT id FROM "{schema}".pgjobs_dead_letter WHERE message -> \'headers\' ->> ' \
           "'id' = %s"
    wait_for(lambda: db.execute(dead, (result.id,)).fetchone(), 30, what="the dead letter")
    dead_id = db.execute(dead, (result.id,)).fetchone()[0]
    code, shown = _cli(capsys, url, schema, "steps", result.id)
    assert code == 0
    assert [(s["name"], s["state"]) for s in shown["steps"]] == [
        ("one", "done"), ("two", "done"), ("three", "failed")]
    assert shown["steps"][2]["error"]["type"] == "builtins.RuntimeError"
    assert shown["steps"][0]["result_bytes"] > 0
    code, out = _cli(capsys, url, schema, "requeue", str(dead_id), "--from-step", "nope")
    assert code == 2 and out["error"]["code"] == "PGJ-907"
    assert count(db, f'SELECT count(*) FROM "{schema}".pgjobs_step WHERE task_id = %s',
                 result.id) == 3
    db.execute(f'INSERT INTO "{schema}".pgjobs_test_flag VALUES (%s)', ("fl",))
    code, out = _cli(capsys, url, schema, "requeue", str(dead_id), "--from-step", "two")
    assert code == 0, out
    assert out["dropped"] == {str(dead_id): ["two", "three"]}
    assert [r["id"] for r in out["requeued"]] == [dead_id]
    wait_for(lambda: done(db, schema, "fl") == 1, 30, what="the requeued task to complete")
    assert starts(db, schema, "fl") == {"one": 1, "two": 2, "three": 2}
    assert {n: s["state"] for n, s in steps_of(db, schema, result.id).items()} == {
        "one": "done", "two": "done", "three": "done"}


def test_requeue_from_step_of_a_sleeping_message(db, stepped, schema, url, start_worker,
                                                 capsys):
    """A message asleep for an hour: `requeue ID --from-step before` drops both steps and
    makes it due: the step before the sleep runs again and it sleeps anew."""
    start_worker(name="r2", app=APP, concurrency=2)
    result = stepped.nap.delay("long", 3600, True)
    wait_for(lambda: steps_of(db, schema, result.id).get("nap"), 30, what="the sleep")
    wait_for(lambda: job(db, schema, result.id)[1] == "ready", 10, what="parked")
    job_id = job(db, schema, result.id)[0]
    code, shown = _cli(capsys, url, schema, "steps", result.id)
    assert shown["suspended"]["kind"] == "sleep" and shown["suspended"]["name"] == "nap"
    first_due = steps_of(db, schema, result.id)["nap"]["due_at"]
    code, out = _cli(capsys, url, schema, "requeue", str(job_id), "--from-step", "before")
    assert code == 0 and out["made_due"] == [job_id], out
    wait_for(lambda: starts(db, schema, "long").get("before") == 2, 30, what="the rerun")
    wait_for(lambda: (steps_of(db, schema, result.id).get("nap") or {}).get("due_at"), 10,
             what="the new sleep")
    assert steps_of(db, schema, result.id)["nap"]["due_at"] > first_due


def test_a_cancelled_sleeping_task_is_a_dead_letter(db, stepped, schema, start_worker):
    start_worker(name="c1", app=APP, concurrency=2)
    result = stepped.nap.delay("zz", 3600)
    wait_for(lambda: (job(db, schema, result.id) or (0, ""))[1] == "ready"
             and steps_of(db, schema, result.id), 30, what="parked")
    assert celery_ext.cancel(result.id, app=stepped.app)["cancelled"] == [result.id]
    assert count(db, f'SELECT reason FROM "{schema}".pgjobs_dead_letter') == "cancelled"


# -- the docs ----------------------------------------------------------------------------------
def test_the_worked_example_of_docs_steps_runs(db, stepped, schema, dsn, start_worker):
    """docs/steps.md's order flow, executed from the page: the charge is stored, the run
    parks waiting for order.confirmed, an emit (as the page shows, in the app's transaction)
    wakes it, and the receipt is sent with the event's data; the message is gone."""
    start_worker(name="doc", app=f"{APP}:doc_app", concurrency=2)
    result = stepped.order_flow.delay(1001)
    wait_for(lambda: (steps_of(db, schema, result.id).get("order.confirmed") or {}).get(
        "state") == "waiting", 30, what="the flow to wait for its confirmation")
    stored = steps_of(db, schema, result.id)
    assert json.loads(stored["charge"]["result"]) == {"charge_id": "ch_1001", "amount": 4200}
    with psycopg.connect(dsn) as conn, conn.transaction():
        with celery_ext.transaction(conn, app=stepped.doc_app):
            celery_ext.steps.emit("order.confirmed", key=1001, data={"by": "email link"},
                                  app=stepped.doc_app)
    wait_for(lambda: (steps_of(db, schema, result.id).get("receipt") or {}).get("state")
             == "done", 30, what="the receipt")
    assert json.loads(steps_of(db, schema, result.id)["receipt"]["result"]) == \
        "receipt for order 1001 (ch_1001, confirmed by email link)"
    wait_for(lambda: job(db, schema, result.id) is None, 10, what="the message acked")




# -- cost ----------------------------------------------------------------------------------------
def test_a_task_without_steps_pays_nothing_and_each_step_one_statement_plus_one_read_per_run(
        db, schema, start_worker, dsn):
    """Every statement of a solo worker counted at the wire, with bench/steps.py's app and its
    count (each statement of sql/steps.sql recognised by its whole text). Tasks run one at a
    time, the next published once the last is acked, so every kind claims, takes and acks
    alike. Per kind of n tasks:

    * no steps, and of() with no step: no step statement, and exactly the other statements of
      a plain task;
    * 1 step: two step statements a task (the one read per run of what earlier runs stored,
      then its fenced write); 3 steps: four (each step adds one); the same three steps
      replayed (another message of the same task ids): one, the read;
    * every kind sends the plain task's other statements besides its step ones, and as often.

    "Other statements" are those sent at least n/2 times in the batch (claim, hand-off, ack:
    at least once a task); the keeper's periodic ones (lease renewal, fleet tick, roll-up,
    every lease_ttl/3 = 10 s) come a few times a batch and are left out. "As often": within
    n/2 of the plain batch's count, since the consumer's own polls when idle add a few claims
    a batch (time, not tasks); one statement more per task would add n."""
    import re

    from celery import Celery

    from bench import steps as bench
    from kombu_pgjobs.store.schema import migrate
    from kombu_pgjobs.store.sql import queries

    from .wirecount import WireCounter, wire_text

    migrate(db, schema)
    bench.create_done_table(db, schema)
    def norm(text: str) -> str:  # whitespace collapsed, a LIMIT's literal as n (the claim
        return re.sub(r"LIMIT \d+", "LIMIT n", " ".join(text.split()))  # is composed per batch)

    step_texts = {norm(wire_text(queries(schema)[name].as_string(None)))
                  for name in bench.STEP_STATEMENTS}
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    host, port = info.get("host", "127.0.0.1"), int(info.get("port", 5432))
    user, dbname = info.get("user", "postgres"), info.get("dbname", "test")
    publisher = Celery("cost", broker=f"pgjobs://{user}@{host}:{port}/{dbname}")
    publisher.conf.broker_transport_options = {"schema": schema}
    jobs = f'SELECT count(*) FROM "{schema}".pgjobs_job'

    def sent(wire: WireCounter) -> dict[str, int]:
        """Statements executed so far, by whole text (:func:`norm`)."""
        with wire.lock:
            raw = list(wire.by_query.items())
        out: dict[str, int] = {}
        for text, k in raw:
            out[norm(text)] = out.get(norm(text), 0) + k
        return out

    with WireCounter(host, port) as wire:
        start_worker(name="cost", app="bench.steps", pool="solo", concurrency=1, ready=False,
                     env={"BENCH_STEPS_BROKER": f"pgjobs://{user}@127.0.0.1:{wire.port}/"
                                                f"{dbname}",
                          "BENCH_STEPS_SCHEMA": schema, "BENCH_PG_URL": dsn})

        def one_by_one(tasks: list[tuple[str, tuple[Any, ...], str | None]]) -> None:
            for name, args, task_id in tasks:
                target = bench.done_count(db, schema) + 1
                publisher.send_task(name, args, task_id=task_id)
                wait_for(lambda t=target: bench.done_count(db, schema) >= t
                         and count(db, jobs) == 0, 60, interval=0.02,
                         what=f"{name} to run and be acked")

        one_by_one([("bench_steps.plain", (), None)] * 3)  # warm: connected, prepared
        time.sleep(0.5)
        n = 30
        ids = [f"cost-{i}" for i in range(n)]
        kinds = {"plain": [("bench_steps.plain", (), None)] * n,
                 "of() only": [("bench_steps.unused", (), None)] * n,
                 "1 step": [("bench_steps.steps", (1,), None)] * n,
                 "3 steps": [("bench_steps.steps", (3,), t) for t in ids],
                 "3 steps, replayed": [("bench_steps.steps", (3,), t) for t in ids]}
        steps: dict[str, dict[str, int]] = {}
        others: dict[str, dict[str, int]] = {}
        for label, tasks in kinds.items():
            before, counted = sent(wire), bench.step_counts(wire, schema)
            one_by_one(tasks)
            time.sleep(0.3)  # nothing is left to send: the last ack was seen
            after, now = sent(wire), bench.step_counts(wire, schema)
            steps[label] = {k: now[k] - counted[k] for k in now if now[k] != counted[k]}
            others[label] = {k: v - before.get(k, 0) for k, v in after.items()
                             if k not in step_texts and v - before.get(k, 0) >= n / 2}
    assert steps == {"plain": {}, "of() only": {}, "1 step": {"load": n, "save": n},
                     "3 steps": {"load": n, "save": 3 * n},
                     "3 steps, replayed": {"load": n}}, steps
    short = {label: {k[:40]: v for k, v in o.items()} for label, o in others.items()}
    for label in kinds:  # the same statements as a plain task, as often but for the noise
        assert others[label].keys() == others["plain"].keys(), f"{label}: {short}"
        for text, times in others[label].items():
            assert times >= n and abs(times - others["plain"][text]) < n / 2, \
                f"{label}: {short}"


# -- roles ---------------------------------------------------------------------------------------
def test_each_component_uses_steps_as_its_role(roles, db, schema, start_worker, capsys):
    """`pgjobs roles` grants: the worker role runs steps, sleeps and waits (it parks); the
    publisher role emits (INSERT only: the wake runs as the owner) and cannot read or change
    steps; the operator reads steps, requeues from a step and prunes."""
    db.execute(f'CREATE TABLE "{schema}".pgjobs_test_woke (label text, task_id text, '
               "what text, at timestamptz DEFAULT clock_timestamp())")
    db.execute(f'CREATE TABLE "{schema}".pgjobs_test_flag (name text)')
    _apply_roles(capsys, schema, roles.prefix)
    worker = start_worker(name="rw", app=APP, concurrency=2,
                          env={"PGJOBS_TEST_BROKER": roles.url("w")})
    pub = import_app(APP, schema, roles.url("pub"))
    pub.wait.delay("rw", "paid", 5, 600)
    sleeper = pub.nap.delay("rs", 600, True)
    wait_for(lambda: count(db, f'SELECT count(*) FROM "{schema}".pgjobs_step WHERE state IN '
                               "('waiting', 'sleeping')") == 2, 30, what="both parked")
    celery_ext.steps.emit("paid", key=5, data={"by": "publisher"}, app=pub.app)
    wait_for(lambda: woke(db, schema, "rw"), 30, what="the waiter woken by the publisher")
    assert woke(db, schema, "rw") == [{"by": "publisher"}]
    with roles.connect("pub") as conn:
        _denied(conn, f'SELECT * FROM "{schema}".pgjobs_step')
        _denied(conn, f'DELETE FROM "{schema}".pgjobs_step')
        _denied(conn, f'SELECT * FROM "{schema}".pgjobs_event')
        _denied(conn, f'UPDATE "{schema}".pgjobs_event SET data = NULL')
    op = roles.url("op")
    code, shown = _cli(capsys, op, schema, "steps", sleeper.id)
    assert code == 0 and shown["suspended"]["kind"] == "sleep", shown
    job_id = job(db, schema, sleeper.id)[0]
    code, out = _cli(capsys, op, schema, "requeue", str(job_id), "--from-step", "nap")
    assert code == 0 and out["made_due"] == [job_id], out
    wait_for(lambda: count(db, f'SELECT count(*) FROM "{schema}".pgjobs_step WHERE task_id = '
                               "%s AND name = 'nap' AND state = 'sleeping'", sleeper.id), 30,
             what="the sleeper to sleep again")
    code, out = _cli(capsys, op, schema, "prune", "--older-than", "7d")
    assert code == 0 and "steps" in out, out
    log = worker.output()
    assert "permission denied" not in log.lower() and "InsufficientPrivilege" not in log, \
        log[-4000:]
    assert worker.stop() == 0
