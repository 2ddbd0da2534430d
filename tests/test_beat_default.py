"""beat with no flag (issue 33, item 3): on a pgjobs broker ``celery_ext.install(app)`` makes the
leader scheduler the default ``beat_scheduler`` unless the app set one, so two ``celery worker
-B`` processes with no scheduler flag fire each occurrence once (counted from the database)."""

from __future__ import annotations

import types
from typing import Any

import pytest
from celery import Celery

import celery_ext
from celery_ext.beat import LEADER

from .conftest import wait_for

PERSISTENT = "celery.beat:PersistentScheduler"


def _app(broker: str, **preconf: Any) -> Celery:
    app = Celery("beat_default_unit", broker=broker, set_as_current=False, **preconf)
    return celery_ext.install(app)


def test_a_pgjobs_app_gets_the_leader_scheduler() -> None:
    assert _app("pgjobs://u@h/db").conf.beat_scheduler == LEADER


def test_another_broker_keeps_celerys_default() -> None:
    assert _app("redis://localhost:6379/0").conf.beat_scheduler == PERSISTENT


def test_broker_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CELERY_BROKER_URL", "pgjobs://u@h/db")
    app = celery_ext.install(Celery("env", set_as_current=False))
    assert app.conf.beat_scheduler == LEADER


@pytest.mark.parametrize("how", ["constructor", "update", "attribute", "object", "old_name",
                                 "after"])
def test_a_scheduler_the_app_set_is_kept(how: str) -> None:
    mine = "myapp.beat:MyScheduler"
    app = _app("pgjobs://u@h/db", **({"beat_scheduler": mine} if how == "constructor" else {}))
    if how == "update":
        app.conf.update(beat_scheduler=mine)
    elif how == "attribute":
        app.conf.beat_scheduler = mine
    elif how == "object":
        app.config_from_object(types.SimpleNamespace(beat_scheduler=mine))
    elif how == "old_name":
        app.config_from_object(types.SimpleNamespace(CELERYBEAT_SCHEDULER=mine))
    elif how == "after":
        assert app.conf.beat_scheduler == LEADER  # configured now, then the app sets its own
        app.conf.beat_scheduler = mine
    assert app.conf.beat_scheduler == mine
    # even Celery's own default, when the app names it
    other = _app("pgjobs://u@h/db")
    other.conf.update(beat_scheduler=PERSISTENT)
    assert other.conf.beat_scheduler == PERSISTENT


def test_install_after_the_configuration_was_loaded() -> None:
    app = Celery("late", broker="pgjobs://u@h/db", set_as_current=False)
    assert app.conf.beat_scheduler == PERSISTENT  # loads the configuration
    assert celery_ext.install(app).conf.beat_scheduler == LEADER


@pytest.mark.e2e
@pytest.mark.slow
def test_two_workers_with_beat_and_no_scheduler_flag_fire_each_occurrence_once(
        db, recorder_tables, start_worker) -> None:
    schema = recorder_tables
    env = {"PGJOBS_TEST_SCHED_TTL": "3"}
    workers = [start_worker(name=f"b{i}", app="tests.apps.beat_default", env=env,
                            concurrency=2, extra=["-B", "-s", f"/tmp/pgjobs-beat-{schema}-{i}"],
                            ready=False) for i in range(2)]
    wait_for(lambda: db.execute(
        f'SELECT count(*) >= 8 FROM "{schema}".pgjobs_test_run').fetchone()[0], 90,
        what="eight scheduled runs")
    for w in workers:  # both run beat, and both are up all along
        assert w.proc.poll() is None, w.output()[-3000:]
        assert "beat: Starting..." in w.output(), w.output()[-3000:]
    runs = db.execute(f'SELECT started, count(*) FROM "{schema}".pgjobs_test_run '
                      "GROUP BY 1 ORDER BY 1").fetchall()
    assert all(r[0] is not None for r in runs), "a run without its occurrence header"
    assert [r for r in runs if r[1] != 1] == [], "an occurrence fired more than once"
    # the leader scheduler fired them: its history has each occurrence once
    fires = db.execute(f'SELECT count(*), count(DISTINCT occurrence) FROM "{schema}".'
                       "pgjobs_schedule_fire WHERE entry = 'tick'").fetchone()
    assert fires[0] == fires[1] >= len(runs)
