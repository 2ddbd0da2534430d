"""Durable steps (issue 32) against real Postgres, without worker processes: the fence of every
write, the parking statement, the emit/park race, retention, and the API's checks.

A run is a message claimed with the queue core (its ``(id, claim)`` is what a worker holds);
:class:`celery_ext.steps.Steps` is driven with a real backend, as a task body would.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from celery import Celery

import celery_ext
from celery_ext.steps import Fenced, Steps, Suspended
from kombu_pgjobs.broker.backend import backend_for
from kombu_pgjobs.errors import (
    DuplicateStep,
    EventTimeout,
    InvalidStep,
    StepMismatch,
    StepsUnavailable,
)
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.store import steps as db_steps
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.database import conninfo_from_url
from kombu_pgjobs.store.schema import migrate

from .test_cli import claim, publish


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=5, worker="steps-test:1")


@pytest.fixture
def backend(core: QueueCore, schema: str, url: str) -> Any:
    options = TransportOptions(schema=schema)
    return backend_for(conninfo_from_url(url, options), options)


def run_of(core: QueueCore, db: psycopg.Connection[Any], backend: Any,
           job_id: int | None = None) -> tuple[Steps, db_steps.Delivery]:
    """Claim the (or a fresh) message of queue ``q``: a run's steps."""
    if job_id is None:
        job_id = publish(core, db, "q")
    pair = next(p for p in claim(core, db, "q", 50) if p[0] == job_id)
    task_id = db.execute(f'SELECT message -> \'headers\' ->> \'id\' FROM "{core.schema}".'
                         "pgjobs_job WHERE id = %s", (job_id,)).fetchone()[0]
    delivery = db_steps.Delivery(pair[0], pair[1], task_id)
    return Steps(None, backend, delivery), delivery


def stored(db: psycopg.Connection[Any], schema: str, task_id: str) -> dict[str, Any]:
    return {r[0]: r[1:] for r in db.execute(
        f'SELECT name, state, attempts, result::text FROM "{schema}".pgjobs_step '
        "WHERE task_id = %s", (task_id,)).fetchall()}


def test_a_step_runs_once_and_replays_its_stored_result(core, db, backend, schema):
    steps, d = run_of(core, db, backend)
    calls: list[int] = []

    def charge(n: int) -> tuple[int, str]:
        calls.append(n)
        return (n, "ok")

    assert steps.run("charge", charge, 7) == [7, "ok"]  # as stored: a tuple comes back a list
    assert stored(db, schema, d.task_id)["charge"] == ("done", 1, '[7,"ok"]')
    # the next run of the message (a redelivery: requeued, claimed again) replays it
    core.requeue(db, [(d.job_id, d.claim)], uncount=True)
    again, _ = run_of(core, db, backend, d.job_id)
    assert again.run("charge", charge, 7) == [7, "ok"]
    assert calls == [7]


def test_an_exception_is_recorded_and_raised_and_the_next_run_runs_it_again(core, db, backend,
                                                                            schema):
    steps, d = run_of(core, db, backend)

    def flaky() -> str:
        raise ValueError("partner down")

    with pytest.raises(ValueError, match="partner down"):
        steps.run("call", flaky)
    row = db.execute(f'SELECT state, attempts, error FROM "{schema}".pgjobs_step').fetchone()
    assert row == ("failed", 1, {"type": "builtins.ValueError", "message": "partner down"})
    core.requeue(db, [(d.job_id, d.claim)], uncount=True)
    again, _ = run_of(core, db, backend, d.job_id)
    assert again.run("call", lambda: "up") == "up"
    assert stored(db, schema, d.task_id)["call"] == ("done", 2, '"up"')


def test_names_are_the_replay_key(core, db, backend, schema):
    steps, d = run_of(core, db, backend)
    steps.run("a", lambda: 1)
    ran: list[int] = []
    with pytest.raises(DuplicateStep) as duplicate:
        steps.run("a", lambda: ran.append(2) or 2)
    assert duplicate.value.code == "PGJ-902"
    assert ran == []  # never run, never an overwrite: the stored value is the first one
    assert stored(db, schema, d.task_id) == {"a": ("done", 1, "1")}
    with pytest.raises(StepMismatch):
        steps._used.discard("a")
        steps.sleep("a", 5)
    for bad in ("", "x" * 201, "bad\nname", None, 3):
        with pytest.raises(InvalidStep):
            steps.run(bad, lambda: 1)
    with pytest.raises(InvalidStep):
        steps.run("set", lambda: {1, 2})  # not JSON: recorded as failed, raised
    with pytest.raises(InvalidStep):
        steps.sleep("nap", timedelta(days=365 * 101))
    with pytest.raises(InvalidStep):
        steps.wait_for_event("e", key=1.5)


@pytest.mark.parametrize("how", ["rescued", "reclaimed", "acked", "cancelled"])
def test_a_stale_run_writes_nothing_and_is_told_so(core, db, backend, schema, how):
    """The run's (id, claim) no longer holds the message: its lease lapsed and a keeper
    rescued it, another worker claimed it, it was settled, or an operator cancelled it. Every
    read and write of the run is refused (PGJ-903) and nothing is written; a body that already
    ran does not get its result stored."""
    steps, d = run_of(core, db, backend)
    steps.run("first", lambda: 1)
    table = f'"{schema}".pgjobs_job'
    if how in ("rescued", "reclaimed"):
        db.execute(f"UPDATE {table} SET state = 'ready', lease_expires_at = NULL WHERE id = %s",
                   (d.job_id,))
        if how == "reclaimed":
            claim(core, db, "q")
    elif how == "acked":
        core.ack(db, [(d.job_id, d.claim)])
    else:
        db.execute(f"UPDATE {table} SET cancelled_at = now() WHERE id = %s", (d.job_id,))
    ran: list[int] = []
    with pytest.raises(Fenced) as refused:
        steps.run("second", lambda: ran.append(1))
    assert refused.value.code == "PGJ-903"
    assert refused.value.why == ("cancelled" if how == "cancelled" else "lost")
    assert isinstance(refused.value, celery_ext.Cancelled)  # the task base ends the run
    assert ran == [1]
    assert set(stored(db, schema, d.task_id)) == {"first"}
    fresh = Steps(None, backend, d)  # a stale run's first read is refused too
    with pytest.raises(Fenced):
        fresh.run("first", lambda: 1)


def test_a_write_waits_for_a_concurrent_rescue_and_then_is_refused(core, db, backend, schema,
                                                                  dsn):
    """The fence reads the job row FOR SHARE: a rescue that updated the row but has not
    committed makes the write wait, then refuse (it never lands on a row that changed)."""
    steps, d = run_of(core, db, backend)
    with psycopg.connect(dsn) as rescuer:
        rescuer.execute(f'UPDATE "{schema}".pgjobs_job SET state = \'ready\' WHERE id = %s',
                        (d.job_id,))
        outcome: list[BaseException] = []

        def write() -> None:
            try:
                steps.run("late", lambda: 1)
            except Fenced as exc:
                outcome.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        time.sleep(0.5)
        assert writer.is_alive()  # waiting for the rescue's commit
        rescuer.commit()
    writer.join(10)
    assert outcome and not writer.is_alive()
    assert stored(db, schema, d.task_id) == {}


def test_park_is_fenced_uncounted_and_due_at_the_sleeps_time(core, db, backend, schema):
    steps, d = run_of(core, db, backend)
    with pytest.raises(Suspended) as suspended:
        steps.sleep("nap", 60)
    exc = suspended.value
    with pytest.raises(Suspended):  # a swallowed suspension comes back at the next step
        steps.run("after", lambda: 1)
    verdict, due_in = backend.publishing(lambda c: db_steps.park(
        c, schema, d, exc.name, kind=exc.kind, seconds=exc.seconds))
    assert verdict == "parked" and 59 < due_in <= 60
    row = db.execute(f'SELECT state, attempts, delayed, worker, lease_expires_at, claim FROM '
                     f'"{schema}".pgjobs_job WHERE id = %s', (d.job_id,)).fetchone()
    assert row == ("ready", 0, True, None, None, d.claim)
    # the same delivery cannot park twice, nor write
    assert backend.publishing(lambda c: db_steps.park(
        c, schema, d, "nap", kind="sleep", seconds=1))[0] == "lost"
    # the next run before the due time (an operator made it due) parks again until the same time
    db.execute(f'UPDATE "{schema}".pgjobs_job SET run_at = now(), delayed = false')
    again, d2 = run_of(core, db, backend, d.job_id)
    with pytest.raises(Suspended):
        again.sleep("nap", 5)
    verdict, due_in2 = backend.publishing(lambda c: db_steps.park(
        c, schema, d2, "nap", kind="sleep", seconds=5))
    assert verdict == "parked" and 58 < due_in2 <= 60


def test_an_emit_in_flight_makes_a_parking_waiter_look_again(core, db, backend, schema, dsn):
    """The race: a waiter parks while an emit of its key is uncommitted (in an app
    transaction). The park cannot see the event nor wait for it: it finds the event's lock row
    held and parks due in a second; once the emit commits, that next look finds the event."""
    steps, d = run_of(core, db, backend)
    with pytest.raises(Suspended) as suspended:
        steps.wait_for_event("paid", key="o-1", timeout=3600)
    exc = suspended.value
    with psycopg.connect(dsn) as app_conn:
        app_conn.execute(f'INSERT INTO "{schema}".pgjobs_event (name, key, data) '
                         "VALUES ('paid', 'o-1', '{\"n\": 1}')")  # not committed yet
        verdict, due_in = backend.publishing(lambda c: db_steps.park(
            c, schema, d, exc.name, kind=exc.kind, seconds=exc.seconds, event=exc.event,
            key=exc.key))
        assert verdict == "parked" and 0 < due_in <= 1.0
        app_conn.commit()
    time.sleep(1.1)
    again, _ = run_of(core, db, backend, d.job_id)
    assert again.wait_for_event("paid", key="o-1", timeout=3600) == {"n": 1}


def test_an_emit_after_the_park_wakes_it_and_one_before_makes_it_due_at_once(core, db, backend,
                                                                           schema):
    emit = lambda key: backend.publishing(  # noqa: E731
        lambda c: db_steps.emit(c, schema, "paid", key, json.dumps({"key": key})))
    steps, d = run_of(core, db, backend)
    with pytest.raises(Suspended) as s1:
        steps.wait_for_event("paid", key="a")
    exc = s1.value
    assert backend.publishing(lambda c: db_steps.park(
        c, schema, d, exc.name, kind="event", seconds=None, event="paid", key="a"))[0] == \
        "parked"
    assert db.execute(f'SELECT run_at > now() + interval \'99 years\' FROM "{schema}".'
                      "pgjobs_job").fetchone() == (True,)  # no timeout: parked for a century
    emit("b")  # another key: nothing
    assert db.execute(f'SELECT run_at > now() FROM "{schema}".pgjobs_job').fetchone() == (True,)
    emit("a")
    assert db.execute(f'SELECT run_at <= now(), delayed FROM "{schema}".pgjobs_job'
                      ).fetchone() == (True, False)
    # an event already there when a waiter parks (it came between the run's look and the park)
    steps2, d2 = run_of(core, db, backend)
    with pytest.raises(Suspended):
        steps2.wait_for_event("other", key="z")
    backend.publishing(lambda c: db_steps.emit(c, schema, "other", "z", "1"))
    verdict, due_in = backend.publishing(lambda c: db_steps.park(
        c, schema, d2, "other", kind="event", seconds=60, event="other", key="z"))
    assert verdict == "parked" and due_in <= 0


def test_a_wait_past_its_deadline_times_out_and_a_retry_waits_anew(core, db, backend, schema):
    steps, d = run_of(core, db, backend)
    with pytest.raises(Suspended):
        steps.wait_for_event("never", key=1, timeout=0.2)
    backend.publishing(lambda c: db_steps.park(c, schema, d, "never", kind="event",
                                               seconds=0.2, event="never", key="1"))
    time.sleep(0.3)
    again, d2 = run_of(core, db, backend, d.job_id)
    with pytest.raises(EventTimeout):
        again.wait_for_event("never", key=1, timeout=0.2)
    row = db.execute(f'SELECT state, error ->> \'code\' FROM "{schema}".pgjobs_step').fetchone()
    assert row == ("failed", "PGJ-905")
    # a retry of the task (the same task id, the next run) waits again, with a new deadline
    core.requeue(db, [(d2.job_id, d2.claim)], uncount=True)
    third, d3 = run_of(core, db, backend, d.job_id)
    with pytest.raises(Suspended):
        third.wait_for_event("never", key=1, timeout=30)
    verdict, due_in = backend.publishing(lambda c: db_steps.park(
        c, schema, d3, "never", kind="event", seconds=30, event="never", key="1"))
    assert verdict == "parked" and 29 < due_in <= 30


def test_of_refuses_what_cannot_hold_steps(url, schema):
    app = Celery("refuses", broker=url)
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(bind=True, acks_late=True)
    def bare(self: Any) -> None:
        celery_ext.steps.of(self)

    with pytest.raises(StepsUnavailable):  # called directly
        bare()
    installed = celery_ext.install(Celery("installed", broker=url))

    @installed.task(bind=True, acks_late=False)
    def early(self: Any) -> None:
        celery_ext.steps.of(self)

    with pytest.raises(StepsUnavailable):
        early.apply().get()  # eagerly
    delivered = SimpleNamespace(id="t1", called_directly=False, is_eager=False,
                                properties={"delivery_tag": "1.1"}, delivery_info={})
    with pytest.raises(StepsUnavailable, match="acks_late"):  # an early ack: gone already
        celery_ext.steps.of(SimpleNamespace(request=delivered, app=installed, name="early",
                                            acks_late=False))
    with pytest.raises(StepsUnavailable):
        celery_ext.steps.emit("e", app=Celery("memory", broker="memory://"))


# -- retention ---------------------------------------------------------------------------------
def test_prune_removes_the_steps_of_gone_messages_only(core, db, backend, schema):
    """Steps of an acked message go once older than the window; those of a parked, a live, a
    dead (its own id, or a celery_ext failure record naming it), or a retry waiting for its
    countdown stay; events go unless a waiter still needs them. Bounded batches."""
    sql = f'"{schema}"'
    gone: list[str] = []
    for _ in range(5):  # acked
        steps, d = run_of(core, db, backend)
        steps.run("a", lambda: 1)
        steps.run("b", lambda: 2)
        core.ack(db, [(d.job_id, d.claim)])
        gone.append(d.task_id)
    live, dl = run_of(core, db, backend)
    live.run("a", lambda: 1)
    dead, dd = run_of(core, db, backend)
    dead.run("a", lambda: 1)
    core.bury(db, [(dd.job_id, dd.claim)], reason="rejected")
    failed, df = run_of(core, db, backend)
    failed.run("a", lambda: 1)
    core.ack(db, [(df.job_id, df.claim)])
    db.execute(f"INSERT INTO {sql}.pgjobs_dead_letter (id, queue, claim, attempts, reason, error, "
               "created_at, message) VALUES (999999, 'q', 1, 1, 'failed', %s, now(), '{}')",
               (json.dumps({"job_id": df.job_id}),))
    retried, dr = run_of(core, db, backend)
    retried.run("a", lambda: 1)
    core.ack(db, [(dr.job_id, dr.claim)])
    db.execute(f"INSERT INTO {sql}.pgjobs_job (queue, message, run_at, delayed) VALUES "
               "('q', %s, now() + interval '1 hour', true)",
               (json.dumps({"headers": {"id": dr.task_id}, "properties": {}}),))
    waiting, dw = run_of(core, db, backend)
    with pytest.raises(Suspended):
        waiting.wait_for_event("w", key="k")
    backend.publishing(lambda c: db_steps.park(c, schema, dw, "w", kind="event", seconds=None,
                                               event="w", key="k"))
    for key in ("k", "other"):  # an event a waiter needs, and one nobody does
        db.execute(f"INSERT INTO {sql}.pgjobs_event (name, key, emitted_at) "
                   "VALUES ('x', %s, now() - interval '2 days')", (key,))
    db.execute(f"UPDATE {sql}.pgjobs_event SET name = 'w' WHERE key = 'k'")
    db.execute(f"UPDATE {sql}.pgjobs_step SET updated_at = now() - interval '2 days'")
    db.execute(f"UPDATE {sql}.pgjobs_job SET run_at = now() + interval '1 hour' "
               "WHERE id = %s", (dw.job_id,))
    cutoff = db.execute("SELECT now() - interval '1 day'").fetchone()[0]
    dry = db_steps.prune(db, schema, cutoff, limit=1000, batch=3, dry_run=True)
    assert dry["steps"] == {"matched": 10, "deleted": 0, "remaining": 10}
    assert dry["events"]["matched"] == 1
    done = db_steps.prune(db, schema, cutoff, limit=1000, batch=3)
    assert done["steps"] == {"matched": 10, "deleted": 10, "remaining": 0}
    assert done["events"] == {"matched": 1, "deleted": 1, "remaining": 0}
    left = {r[0] for r in db.execute(f"SELECT DISTINCT task_id FROM {sql}.pgjobs_step")}
    assert left == {dl.task_id, dd.task_id, df.task_id, dr.task_id, dw.task_id}
    assert [r[0] for r in db.execute(f"SELECT key FROM {sql}.pgjobs_event")] == ["k"]
    # recent steps of an acked message stay until the window passes
    steps, d = run_of(core, db, backend)
    steps.run("a", lambda: 1)
    core.ack(db, [(d.job_id, d.claim)])
    assert db_steps.prune(db, schema, cutoff, limit=1000, batch=3)["steps"]["deleted"] == 0


def test_pgjobs_prune_and_steps_commands(core, db, backend, schema, url, capsys):
    from kombu_pgjobs.ops.cli.main import main as cli

    steps, d = run_of(core, db, backend)
    steps.run("a", lambda: {"big": "x" * 2000})
    with pytest.raises(ValueError):
        steps.run("b", lambda: (_ for _ in ()).throw(ValueError("nope")))
    capsys.readouterr()
    assert cli(["steps", d.task_id, "--dsn", url, "--schema", schema]) == 0
    text = capsys.readouterr().out
    assert "a     run   done" in text and "2.0 kB" in text
    assert "builtins.ValueError: nope" in text and f"message: {d.job_id} (running, q)" in text
    assert cli(["steps", "no-such-task", "--dsn", url, "--schema", schema]) == 0
    assert "no steps recorded" in capsys.readouterr().out
    core.ack(db, [(d.job_id, d.claim)])
    db.execute(f'UPDATE "{schema}".pgjobs_step SET updated_at = now() - interval \'3 days\'')
    assert cli(["prune", "--older-than", "7d", "--steps-older-than", "1d", "--dsn", url,
                "--schema", schema, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"]["steps"] == {"matched": 2, "deleted": 2, "remaining": 0}
    assert cli(["requeue", "1", "--from-step", "a", "--dsn", url, "--schema", schema]) == 2


def test_the_metric_counts_suspended_messages_by_reason(core, db, backend, schema):
    from kombu_pgjobs.ops.metrics import collect
    from kombu_pgjobs.store.admin import Admin

    for kind in ("sleep", "event", "event"):
        steps, d = run_of(core, db, backend)
        with pytest.raises(Suspended) as suspended:
            if kind == "sleep":
                steps.sleep("s", 60)
            else:
                steps.wait_for_event("e", key=d.job_id)
        exc = suspended.value
        backend.publishing(lambda c, d=d, exc=exc: db_steps.park(
            c, schema, d, exc.name, kind=exc.kind, seconds=exc.seconds, event=exc.event,
            key=exc.key))
    metric = next(m for m in collect(Admin(db, schema)) if m.name == "pgjobs_suspended_messages")
    assert sorted((labels["reason"], value) for labels, value in metric.samples) == [
        ("event", 2), ("sleep", 1)]


def test_the_dashboard_message_page_shows_the_steps(core, db, backend, schema, url):
    from starlette.testclient import TestClient

    from kombu_pgjobs.ops.dashboard import create_app

    steps, d = run_of(core, db, backend)
    steps.run("charge", lambda: {"id": "ch_1"})
    with pytest.raises(Suspended):
        steps.wait_for_event("order.confirmed", key=42, timeout=3600)
    backend.publishing(lambda c: db_steps.park(c, schema, d, "order.confirmed", kind="event",
                                               seconds=3600, event="order.confirmed",
                                               key="42"))
    plain = publish(core, db, "other")
    app: Any = create_app(url, schema=schema, pool_size=1)
    try:
        with TestClient(app) as client:
            page = client.get(f"/messages/{d.job_id}")
            assert page.status_code == 200, page.text
            assert 'id="steps"' in page.text and "<td>charge</td>" in page.text
            assert "waiting for event <code>order.confirmed</code> key <code>42</code>" \
                in page.text
            other = client.get(f"/messages/{plain}")
            assert other.status_code == 200 and 'id="steps"' not in other.text
    finally:
        app.state.dashboard.close()


def test_a_parked_message_frees_its_concurrency_slot(core, db, backend, schema):
    """A message of a key capped at 1 sleeps: its slot is released with the park, so the next
    message of the key is claimed meanwhile (a sleeping flow holds no limit either)."""
    from kombu_pgjobs.store.core import LIMITS_HEADER, job_from_message

    def message(n: int) -> dict[str, Any]:
        return {"body": str(n), "properties": {},
                "headers": {"task": "t", "id": f"limited-{n}",
                            LIMITS_HEADER: {"concurrency": [{"key": "k", "limit": 1}]}}}

    core.publish_many(db, [job_from_message("q", message(n)) for n in (1, 2)])
    first = core.claim(db, ["q"], 10).claimed
    assert len(first) == 1
    assert core.claim(db, ["q"], 10).claimed == []  # the key is full
    d = db_steps.Delivery(first[0].id, first[0].claim, "limited-1")
    verdict, _ = backend.publishing(lambda c: db_steps.park(c, schema, d, "nap", kind="sleep",
                                                            seconds=60))
    assert verdict == "parked"
    second = core.claim(db, ["q"], 10).claimed
    assert [c.id for c in second] == [first[0].id + 1]


def _cli_json(capsys: Any, url: str, schema: str, *argv: str) -> tuple[int, Any]:
    from kombu_pgjobs.ops.cli.main import main as cli

    capsys.readouterr()
    code = cli([*argv, "--dsn", url, "--schema", schema, "--json"])
    out = capsys.readouterr()
    text = out.out.strip()
    return code, (json.loads(text) if text else None), out.out + out.err


def test_dead_requeue_from_step_drops_that_step_and_the_later_ones(core, db, backend, schema,
                                                                   url, capsys):
    """`pgjobs dead requeue ID --from-step b`: the dead letter's task loses steps b and c (read
    back from Postgres), the message is back in its queue, ready; --all is refused with it."""
    steps, d = run_of(core, db, backend)
    for name in ("a", "b", "c"):
        steps.run(name, lambda name=name: name)
    core.bury(db, [(d.job_id, d.claim)], reason="rejected")
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter WHERE id = %s',
                      (d.job_id,)).fetchone() == (1,)
    code, out, _ = _cli_json(capsys, url, schema, "dead", "requeue", str(d.job_id),
                             "--from-step", "b")
    assert code == 0, out
    assert out["dropped"] == {str(d.job_id): ["b", "c"]}
    assert stored(db, schema, d.task_id) == {"a": ("done", 1, '"a"')}
    assert db.execute(f'SELECT state, run_at <= now() FROM "{schema}".pgjobs_job WHERE '
                      "message -> 'headers' ->> 'id' = %s", (d.task_id,)).fetchone() == \
        ("ready", True)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone() == (0,)
    code, _, text = _cli_json(capsys, url, schema, "dead", "requeue", "--all",
                              "--from-step", "a")
    assert code == 2 and "--from-step takes dead-letter ids" in text, text
    assert stored(db, schema, d.task_id) == {"a": ("done", 1, '"a"')}


def test_requeue_from_step_of_a_running_message_is_refused(core, db, backend, schema, url,
                                                           capsys):
    """A claimed (running) message: `requeue ID --from-step a` exits 2 with PGJ-406 and
    changes nothing: its steps, read back from Postgres, and the message still running."""
    steps, d = run_of(core, db, backend)
    steps.run("a", lambda: 1)
    steps.run("b", lambda: 2)
    before = stored(db, schema, d.task_id)
    code, out, text = _cli_json(capsys, url, schema, "requeue", str(d.job_id),
                                "--from-step", "a")
    assert code == 2, text
    assert out["error"]["code"] == "PGJ-406" and "PGJ-406" in text, text
    assert stored(db, schema, d.task_id) == before == {"a": ("done", 1, "1"),
                                                       "b": ("done", 1, "2")}
    assert db.execute(f'SELECT state, claim FROM "{schema}".pgjobs_job WHERE id = %s',
                      (d.job_id,)).fetchone() == ("running", d.claim)


def test_prune_deletes_at_most_limit_steps(core, db, backend, schema):
    """--limit bounds the steps deleted per call, whatever the batch: seven gone tasks of one
    step and three of two; a task's steps go together, so a task that does not fit in what is
    left of the limit is left whole for the next call. Events keep their own limit."""
    sql = f'"{schema}"'
    for n in [1] * 7 + [2] * 3:
        steps, d = run_of(core, db, backend)
        for i in range(n):
            steps.run(f"s{i}", lambda: 1)
        core.ack(db, [(d.job_id, d.claim)])
    for i in range(5):
        db.execute(f"INSERT INTO {sql}.pgjobs_event (name, key, emitted_at) "
                   "VALUES ('x', %s, now() - interval '2 days')", (str(i),))
    # the one-step tasks first in the prune's order (updated_at, task_id, name)
    db.execute(f"UPDATE {sql}.pgjobs_step AS s SET updated_at = now() - interval '2 days' "
               f"- CASE WHEN (SELECT count(*) FROM {sql}.pgjobs_step AS o "
               "WHERE o.task_id = s.task_id) = 1 THEN interval '1 hour' ELSE interval '0' END")
    cutoff = db.execute("SELECT now() - interval '1 day'").fetchone()[0]
    total = 13

    def left() -> int:
        return int(db.execute(f"SELECT count(*) FROM {sql}.pgjobs_step").fetchone()[0])

    got = db_steps.prune(db, schema, cutoff, limit=5, batch=2)  # batches of 2 would pass 5
    assert got["steps"] == {"matched": total, "deleted": 5, "remaining": total - 5}
    assert got["events"] == {"matched": 5, "deleted": 5, "remaining": 0}
    assert left() == total - 5
    # two one-step tasks left, then two-step ones: a limit of 3 takes the two and stops short
    # of a two-step task (it would make 4)
    got = db_steps.prune(db, schema, cutoff, limit=3, batch=1000)
    assert got["steps"] == {"matched": total - 5, "deleted": 2, "remaining": total - 7}
    assert left() == total - 7
    got = db_steps.prune(db, schema, cutoff, limit=4, batch=3)
    assert got["steps"] == {"matched": 6, "deleted": 4, "remaining": 2}
    got = db_steps.prune(db, schema, cutoff, limit=1, batch=3)  # a two-step task: not 1
    assert got["steps"] == {"matched": 2, "deleted": 0, "remaining": 2}
    got = db_steps.prune(db, schema, cutoff, limit=100, batch=1)
    assert got["steps"] == {"matched": 2, "deleted": 2, "remaining": 0}
    assert left() == 0
