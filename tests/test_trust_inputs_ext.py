"""Issue 28, item 7 (second half): bad input around the outbox block, the webhooks CLI and the
scheduler is refused with a coded error, never a raw driver or framework exception.

* ``celery_ext.transaction()``: the app's code ends the transaction inside the block and goes
  on (``PGJ-510``), Django installed but not configured (``PGJ-514``).
* ``pgjobs webhooks add`` refuses what ``add_endpoint`` refuses (``PGJ-805``).
* Scheduler entries are checked like publishes when they are read: the app's beat_schedule at
  start, ``pgjobs schedule add``, and stored rows the leader loads.

Real Postgres and real Celery apps; the Django cases run in a fresh interpreter (this one may
have configured Django for another test).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from celery import Celery
from celery.schedules import schedule as celery_schedule

import celery_ext
from celery_ext.scheduler import LeaderScheduler
from celery_ext.webhooks.egress import refusal
from kombu_pgjobs.errors import NotInTransaction
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.schema import migrate

from .conftest import DSN, ROOT, import_app, wait_for

APP = "tests.apps.outboxed"


def _jobs(db: psycopg.Connection[Any], schema: str) -> list[str]:
    return [r[0] for r in db.execute(
        f"""SELECT message->'headers'->>'argsrepr' FROM "{schema}".pgjobs_job ORDER BY id""")]


# -- celery_ext.transaction(): the transaction ended inside the block ---------------------------
def _commit_then_publish(conn: psycopg.Connection[Any], mod: Any) -> None:
    with celery_ext.transaction(conn):
        conn.commit()
        mod.record.delay("after-commit")


def _sql_commit_inside_transaction_context(conn: psycopg.Connection[Any], mod: Any) -> None:
    with conn.transaction(), celery_ext.transaction(conn):
        conn.execute("COMMIT")
        mod.record.delay("after-sql-commit")


def _rollback_then_statement(conn: psycopg.Connection[Any], mod: Any) -> None:
    conn.execute("SELECT 1")
    with celery_ext.transaction(conn):
        mod.record.delay("rolled-back")
        conn.rollback()
        conn.execute("SELECT 1")


def _caught_failure(conn: psycopg.Connection[Any], mod: Any) -> None:
    with conn.transaction(), celery_ext.transaction(conn):
        mod.record.delay("before-failure")
        try:
            conn.execute("SELECT 1/0")
        except psycopg.errors.DivisionByZero:
            pass  # the app swallows it and leaves the block normally


def _sqlalchemy_commit_then_publish(conn: psycopg.Connection[Any], mod: Any) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    engine = create_engine(DSN.replace("postgresql://", "postgresql+psycopg://"))
    try:
        with Session(engine) as session:
            session.begin()
            with celery_ext.transaction(session):
                session.commit()
                session.execute(text("SELECT 1"))
                mod.record.delay("sa-after-commit")
    finally:
        engine.dispose()


@pytest.mark.parametrize("scenario", [
    _commit_then_publish, _sql_commit_inside_transaction_context, _rollback_then_statement,
    _caught_failure, _sqlalchemy_commit_then_publish])
def test_a_transaction_ended_inside_the_block_is_pgj_510(db, schema, url, scenario):
    """Today each of these leaves the block with psycopg's InvalidSavepointSpecification or
    InFailedSqlTransaction (the block's RELEASE SAVEPOINT, in a transaction that is not the
    block's): docs/outbox.md promises PGJ-510."""
    migrate(db, schema)
    mod = import_app(APP, schema, url)
    with psycopg.connect(DSN) as conn:
        with pytest.raises(NotInTransaction) as err:
            scenario(conn, mod)
        assert err.value.code == "PGJ-510"
    assert _jobs(db, schema) == [], "nothing published after the transaction ended survived"


def test_the_block_still_works_after_the_mistakes(db, schema, url):
    """The coded error leaves nothing behind: the same connection, rolled back, publishes in
    a block and commits."""
    migrate(db, schema)
    mod = import_app(APP, schema, url)
    with psycopg.connect(DSN) as conn:
        with pytest.raises(NotInTransaction):
            _commit_then_publish(conn, mod)
        conn.rollback()
        with conn.transaction(), celery_ext.transaction(conn):
            mod.record.delay("fine")
    assert _jobs(db, schema) == ["('fine',)"]


# -- celery_ext.transaction(): Django installed but not configured ------------------------------
_DJANGO = textwrap.dedent("""
    import sys
    import celery_ext
    from kombu_pgjobs.errors import PgJobsError
    if sys.argv[1] == "configured":
        from django.conf import settings
        settings.configure(DATABASES={})
    try:
        with celery_ext.transaction(using=sys.argv[2] or None):
            pass
    except PgJobsError as exc:
        print("CODE", exc.code, type(exc).__name__)
        print("MESSAGE", exc)
    else:
        print("NO ERROR")
""")


@pytest.mark.parametrize(("how", "using", "settings_module"), [
    ("unconfigured", "", None),                       # ImproperlyConfigured today
    ("unconfigured", "", "no_such_settings_module"),  # ImportError (ModuleNotFoundError) today
    ("configured", "replica", None),                  # ConnectionDoesNotExist today
])
def test_django_not_configured_is_pgj_514(how, using, settings_module):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    if settings_module:
        env["DJANGO_SETTINGS_MODULE"] = settings_module
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", _DJANGO, how, using], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "CODE PGJ-514 UnsupportedConnection" in proc.stdout, (proc.stdout, proc.stderr)
    if settings_module:
        assert settings_module in proc.stdout
    if using:
        assert repr(using) in proc.stdout


# -- pgjobs webhooks add: the egress check of add_endpoint ----------------------------------------
SECRET = "trust-inputs-secret-" + "Zr8kV1qT"


def _webhooks_add(capsys: Any, dsn: str, schema: str, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    rc = cli(["--dsn", dsn, "--schema", schema, "--json", "webhooks", "add", *argv,
              "--secret-env", "HOOK_SECRET"])
    out = capsys.readouterr().out
    return rc, json.loads(out.splitlines()[-1])


def _endpoints(db: psycopg.Connection[Any], schema: str) -> list[str]:
    return [r[0] for r in db.execute(
        f'SELECT url FROM "{schema}".pgjobs_webhook_endpoint ORDER BY id')]


@pytest.mark.parametrize("target", [
    "http://127.0.0.1:8080/hook", "http://169.254.169.254/latest/meta-data/",
    "https://10.0.0.5/in", "http://[::1]:9000/", "http://[::ffff:192.168.1.1]/",
    "http://0.0.0.0/", "http://168.63.129.16/", "http://[fd00:ec2::254]/",
])
def test_webhooks_add_refuses_what_add_endpoint_refuses(db, schema, dsn, capsys, monkeypatch,
                                                        target):
    migrate(db, schema)
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    rc, out = _webhooks_add(capsys, dsn, schema, target)
    assert rc == 2 and out["error"]["code"] == "PGJ-805", out
    assert _endpoints(db, schema) == [], "nothing was written"
    assert refusal(ipaddress.ip_address(urlsplit(target).hostname)) is not None


def test_webhooks_add_allow_host_opens_the_rule_as_the_app_setting_does(db, schema, dsn, capsys,
                                                                        monkeypatch):
    migrate(db, schema)
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    rc, out = _webhooks_add(capsys, dsn, schema, "http://10.20.0.7/in",
                            "--allow-host", "10.20.0.0/16")
    assert rc == 0, out
    rc, out = _webhooks_add(capsys, dsn, schema, "http://127.0.0.1:8080/in",
                            "--allow-host", "127.0.0.1")
    assert rc == 0, out
    rc, out = _webhooks_add(capsys, dsn, schema, "http://10.30.0.7/in",
                            "--allow-host", "10.20.0.0/16")
    assert rc == 2 and out["error"]["code"] == "PGJ-805", out
    rc, out = _webhooks_add(capsys, dsn, schema, "https://hooks.example/in")  # a name: at connect
    assert rc == 0, out
    rc, out = _webhooks_add(capsys, dsn, schema, "http://10.20.0.7/in",
                            "--allow-host", "10.20.0.0/99")
    assert rc == 2 and out["error"]["code"] == "PGJ-405", out
    assert _endpoints(db, schema) == ["http://10.20.0.7/in", "http://127.0.0.1:8080/in",
                                      "https://hooks.example/in"]


# -- scheduler entries: the app's beat_schedule, at start ---------------------------------------
def _app(url: str, schema: str, schedule: dict[str, Any]) -> Celery:
    app = Celery("trust_sched", broker=url, set_as_current=False)
    app.conf.update(broker_transport_options={"schema": schema}, beat_schedule=schedule,
                    task_ignore_result=True, pgjobs_scheduler_lease_ttl_seconds=1.5,
                    result_expires=None)
    return app


@pytest.mark.parametrize(("entry", "code"), [
    ({"task": "t", "schedule": 5, "args": "abc"}, "PGJ-604"),         # became ['a', 'b', 'c']
    ({"task": "t", "schedule": 5, "args": {"a": 1}}, "PGJ-604"),      # became ['a']
    ({"task": "t", "schedule": 5, "kwargs": "ab"}, "PGJ-604"),        # a bare ValueError
    ({"task": "t", "schedule": 5, "kwargs": {1: "x"}}, "PGJ-604"),    # stored as {"1": "x"}
    ({"task": "t", "schedule": 5, "options": "queue"}, "PGJ-604"),    # a bare ValueError
    ({"task": "t", "schedule": 5, "options": {"priority": 256}}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "options": {"priority": -1}}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "options": {"priority": "high"}}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "options": {"priority": True}}, "PGJ-604"),
    ({"task": "t\x00x", "schedule": 5}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "args": ["a\x00b"]}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "kwargs": {"k\x00": 1}}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "options": {"headers": {"h": "\x00"}}}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "options": {"queue": "q\x00"}}, "PGJ-604"),
    ({"task": "t", "schedule": 5, "options": {"queue": "q\x07"}}, "PGJ-103"),
    ({"task": "t", "schedule": 0.0005}, "PGJ-601"),
    ({"task": "t", "schedule": timedelta(microseconds=999)}, "PGJ-601"),
    ({"task": "t", "schedule": celery_schedule(run_every=timedelta(microseconds=10))},
     "PGJ-601"),
])
def test_bad_beat_schedule_entry_is_refused_at_start(url, schema, db, entry, code):
    made: list[LeaderScheduler] = []
    try:
        with pytest.raises(Exception) as info:
            made.append(LeaderScheduler(app=_app(url, schema, {"bad": entry})))
    finally:
        for s in made:
            s.close()
    assert getattr(info.value, "code", None) == code, repr(info.value)
    assert "bad" in str(info.value)
    assert db.execute("SELECT to_regclass(%s)", (f'"{schema}".pgjobs_schedule',)
                      ).fetchone()[0] is None, "nothing was written"


def test_good_entries_at_the_bounds_are_accepted(url, schema, db):
    """A tuple of args, priority 0 and 255 (what a publish takes), a one-millisecond interval
    in text: accepted, stored as given."""
    s = LeaderScheduler(app=_app(url, schema, {
        "tuple": {"task": "t", "schedule": 60, "args": (1, "two"), "options": {"priority": 0}},
        "top": {"task": "t", "schedule": 60, "options": {"priority": 255}},
        "fast": {"task": "t", "schedule": timedelta(milliseconds=1)}}))
    try:
        assert {e.name: e.args for e in s.static} == {"tuple": [1, "two"], "top": [],
                                                      "fast": []}
    finally:
        s.close()


# -- scheduler entries: pgjobs schedule add -------------------------------------------------------
@pytest.mark.parametrize(("argv", "code"), [
    (["e", "t", "every 5s", "--options", '{"priority": 300}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"priority": "9"}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"note": "a\\u0000b"}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"a\\u0000": 1}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"headers": {"x": ["\\u0000"]}}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"queue": 5}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"queue": "q\\u0000"}'], "PGJ-604"),
    (["e", "t", "every 5s", "--options", '{"queue": "q\\u0007"}'], "PGJ-103"),
    (["e", "t", "every 5s", "--options", '{"headers": "x"}'], "PGJ-604"),
    (["e", "t", "every 5s", "--args", '["\\u0000"]'], "PGJ-604"),
    (["e", "t", "every 5s", "--args", '["\\ud800"]'], "PGJ-604"),
    (["e", "t", "every 5s", "--kwargs", '{"k": "\\u0000"}'], "PGJ-604"),
    (["e", "t\x1b[2J", "every 5s"], "PGJ-604"),
    (["e", "t", "every 0.0005s"], "PGJ-601"),
    (["e", "t", "every 1e-5m"], "PGJ-601"),
])
def test_bad_schedule_add_is_refused(db, schema, dsn, capsys, argv, code):
    migrate(db, schema)
    capsys.readouterr()
    rc = cli(["--dsn", dsn, "--schema", schema, "--json", "schedule", "add", *argv])
    out = capsys.readouterr().out
    assert rc == 2, out
    assert json.loads(out.splitlines()[-1])["error"]["code"] == code, out
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_schedule').fetchone()[0] == 0


def test_schedule_add_at_the_bounds_is_accepted(db, schema, dsn, capsys):
    migrate(db, schema)
    for name, extra in (("p255", ["--options", '{"priority": 255}']),
                        ("ms", []), ("tab", ["--args", '["a\\tb"]'])):
        when = "every 0.001s" if name == "ms" else "every 5s"
        assert cli(["--dsn", dsn, "--schema", schema, "schedule", "add", name, "t", when,
                    *extra]) == 0, capsys.readouterr()
    rows = dict(db.execute(f'SELECT name, options FROM "{schema}".pgjobs_schedule').fetchall())
    assert rows["p255"] == {"priority": 255}


# -- scheduler entries: stored rows the leader reads ---------------------------------------------
def test_stored_entries_are_checked_when_the_leader_loads_them(url, schema, db, caplog):
    """Rows written past `pgjobs schedule add` (by hand, another version): each bad one is
    refused with its code when read (logged, not fired); the good one fires."""
    app = _app(url, schema, {})
    s = LeaderScheduler(app=app)
    try:
        wait_for(lambda: s.elector.current() and s.elector.current().leading, 10,
                 what="leadership")
        bad = {"string-args": ("t", '"abc"', "{}"),
               "priority": ("t", "[]", '{"priority": 999}'),
               "task-ctl": ("t\x07", "[]", "{}")}
        for name, (task, args, options) in {**bad, "good": ("t", "[]", "{}")}.items():
            db.execute(f"""INSERT INTO "{schema}".pgjobs_schedule
                               (name, source, task, schedule, args, options)
                           VALUES (%s, 'dynamic', %s, 'every 0.5s', %s::jsonb, %s::jsonb)""",
                       (name, task, args, options))
        with caplog.at_level(logging.WARNING):
            wait_for(lambda: (s.tick() or True) and "good" in s._entries, 15,
                     what="the entries loaded")
        assert set(s._entries) == {"good"}, sorted(s._entries)
        refused = [r for r in caplog.records
                   if getattr(r, "action", None) == "pgjobs.schedule.invalid"]
        assert {r.entry for r in refused} == set(bad), [r.getMessage() for r in refused]
        assert all("PGJ-604" in r.error for r in refused), [r.error for r in refused]
    finally:
        s.close()
