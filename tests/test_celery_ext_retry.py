"""celery_ext: retry classification, the max_attempts header, dead letters of final failures.

The pure parts (reading a Retry-After, clamping, jitter, precedence, option checks) are tested
as functions; the behaviour is tested end to end on a real worker (tests/apps/poison.py with
celery_ext installed), timing from the database's clock.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any

import pytest
from celery import Celery

import celery_ext
from celery_ext.retry import (
    classify,
    parse_retry_after,
    retry_after_delay,
    retry_after_seconds,
)
from kombu_pgjobs.errors import InvalidTaskOption
from kombu_pgjobs.ops.cli.main import main as cli

from .conftest import wait_for
from .test_dead_letters import POISON, dead_rows, poison_app, runs, starts
from .test_dead_letters import poison_tables as poison_tables  # the fixture, shared


class Limited(Exception):
    def __init__(self, retry_after: Any = None) -> None:
        super().__init__("limited")
        self.retry_after = retry_after


class _Response:
    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


class HTTPError(Exception):
    def __init__(self, headers: dict[str, str]) -> None:
        super().__init__("http error")
        self.response = _Response(headers)


# -- pure logic ---------------------------------------------------------------------------------
def test_parse_retry_after_forms():
    now = datetime(2024, 5, 1, 12, 0, 0, tzinfo=timezone.utc)
    assert parse_retry_after(5) == 5.0
    assert parse_retry_after(2.5) == 2.5
    assert parse_retry_after(" 120 ") == 120.0
    assert parse_retry_after(b"7") == 7.0
    assert parse_retry_after(timedelta(minutes=2)) == 120.0
    assert parse_retry_after(now + timedelta(seconds=30), now=now) == 30.0
    http_date = format_datetime(now + timedelta(seconds=90), usegmt=True)
    assert parse_retry_after(http_date, now=now) == 90.0
    assert parse_retry_after(now - timedelta(seconds=30), now=now) == 0.0, "never negative"
    for junk in (None, "soon", float("nan"), float("inf"), True, object()):
        assert parse_retry_after(junk) is None


def test_retry_after_sources():
    assert retry_after_seconds(Limited(3)) == 3.0
    assert retry_after_seconds(HTTPError({"Retry-After": "11"})) == 11.0
    assert retry_after_seconds(Limited(None)) is None
    assert retry_after_seconds(Limited(1), lambda exc: 42) == 42.0
    err = Limited(1)
    err.wait_for = 9  # type: ignore[attr-defined]
    assert retry_after_seconds(err, "wait_for") == 9.0


def test_retry_after_delay_clamps_then_adds_jitter():
    assert retry_after_delay(10, maximum=60, jitter=0.0) == 10
    assert retry_after_delay(3600, maximum=60, jitter=0.0) == 60
    assert retry_after_delay(10, maximum=60, jitter=0.5, rand=lambda: 1.0) == 15
    assert retry_after_delay(10, maximum=60, jitter=0.5, rand=lambda: 0.0) == 10
    assert retry_after_delay(-5, maximum=60, jitter=0.5) == 0
    delays = {retry_after_delay(10, maximum=60, jitter=0.2) for _ in range(50)}
    assert all(10 <= d <= 12 for d in delays) and len(delays) > 1


def test_classification_precedence_and_option_checks():
    app = Celery("classify", set_as_current=False)
    celery_ext.install(app)

    @app.task(shared=False, terminal=(ValueError,), retry_after=(Limited, LookupError),
              retryable=(Exception,))
    def t() -> None: ...

    task = app.tasks[t.name]
    assert isinstance(task, celery_ext.Task)
    assert classify(task, ValueError()) == "terminal"
    assert classify(task, Limited()) == "retry_after"
    assert classify(task, KeyError()) == "retry_after"
    assert classify(task, OSError()) == "retryable"
    assert classify(task, SystemExit()) is None

    bad = [{"terminal": "ValueError"}, {"retryable": (ValueError, 3)}, {"max_attempts": 0},
           {"max_attempts": 2.5}, {"retry_after_max": -1}, {"retry_after_jitter": float("nan")},
           {"retry_after_seconds": 5}]
    for i, opts in enumerate(bad):
        other = Celery(f"bad{i}", set_as_current=False)
        celery_ext.install(other)
        with pytest.raises(InvalidTaskOption) as err:
            def body() -> None: ...

            other.task(name=f"bad{i}", shared=False, **opts)(body)
            other.finalize()
            other.tasks[f"bad{i}"]
        assert err.value.code == "PGJ-407"


def test_install_after_tasks_were_made_is_refused():
    app = Celery("late", set_as_current=False)

    # (the refusal names five tasks, sorted: shared tasks of other test apps in this process
    # are this app's too, so this one's name sorts first)
    @app.task(name="_made", shared=False)
    def made() -> None: ...

    app.finalize()
    assert app.tasks["_made"]
    with pytest.raises(InvalidTaskOption, match="after tasks were defined") as err:
        celery_ext.install(app)
    assert "_made" in str(err.value)


# -- end to end ---------------------------------------------------------------------------------
def _cli(capsys: Any, schema: str, url: str, *argv: str) -> Any:
    capsys.readouterr()
    assert cli([*argv, "--dsn", url, "--schema", schema, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _start_times(db: Any, schema: str, label: str) -> list[float]:
    rows = db.execute(f'SELECT extract(epoch FROM at)::float8 FROM "{schema}".pgjobs_test_start '
                      "WHERE label = %s ORDER BY at", (label,)).fetchall()
    return [r[0] for r in rows]


@pytest.mark.e2e
def test_retry_rules_on_a_real_worker(db, url, start_worker, capsys, poison_tables):
    schema = poison_tables
    env = {"PGJOBS_TEST_CELERY_EXT": "1", "PGJOBS_TEST_RETRY_AFTER_MAX": "2"}
    app = poison_app(schema, url, **env)
    terminal = app.terminal.delay("t")
    app.rate_limited.delay("rl", 1.5, 1)      # names 1.5 s: waits 1.5 s, then succeeds
    app.rate_limited.delay("rc", 3600, 1)     # names an hour: clamped to retry_after_max=2
    app.flaky.delay("fl", 2)                  # retryable on Celery's backoff: 1 s, then 2 s
    exhausted = app.exhaust.delay("ex")       # retryable, max_retries=1: fails for good
    plain = app.unclassified.delay("uc")      # unclassified: Celery's behaviour (fails)
    start_worker(app=POISON, name="ext", concurrency=4, env=env)

    # While "rc" waits for its retry, the retry is a delayed row in Postgres carrying the error.
    def delayed_retry() -> Any:
        page = _cli(capsys, schema, url, "ls", "--state", "delayed", "--task",
                    "poison.rate_limited")
        return page["items"]
    items = wait_for(delayed_retry, 30, interval=0.05, what="a delayed retry")
    shown = _cli(capsys, schema, url, "show", str(items[0]["id"]))
    assert shown["state"] == "delayed" and shown["retries"] == 1
    assert shown["last_error"]["type"].endswith("TooManyRequests")
    assert shown["last_error"]["rule"] == "retry_after"

    wait_for(lambda: {"rl", "rc", "fl"} <= set(runs(db, schema)) and len(dead_rows(db, schema))
             == 3, 60, what="successes and dead letters")
    dead = {d["task_id"]: d for d in dead_rows(db, schema)}

    t = dead[terminal.id]
    assert t["reason"] == "failed" and t["error"]["rule"] == "terminal"
    assert t["error"]["type"] == "tests.apps.poison.PermanentError"
    assert t["error"]["retries"] == 0, "terminal: the remaining retries were not spent"
    assert starts(db, schema, "t") == 1, "autoretry_for=(Exception,) did not retry it"

    rl = _start_times(db, schema, "rl")
    assert len(rl) == 2 and 1.5 <= rl[1] - rl[0] < 15, rl
    rc = _start_times(db, schema, "rc")
    assert len(rc) == 2 and 2.0 <= rc[1] - rc[0] < 15, ("clamped to 2 s", rc)
    fl = _start_times(db, schema, "fl")
    assert len(fl) == 3, fl
    assert fl[1] - fl[0] >= 1.0 and fl[2] - fl[1] >= 2.0, ("Celery's backoff 1 s, 2 s", fl)

    ex = dead[exhausted.id]
    assert ex["error"]["rule"] == "retryable" and ex["error"]["retries"] == 1
    assert ex["error"]["type"] == "tests.apps.poison.Flaky"
    assert starts(db, schema, "ex") == 2

    uc = dead[plain.id]
    assert uc["error"]["rule"] == "unclassified" and uc["error"]["type"] == "builtins.KeyError"
    assert starts(db, schema, "uc") == 1
    assert set(runs(db, schema)) == {"rl", "rc", "fl"}

    counted = _cli(capsys, schema, url, "queues", "--queue", "celery")["queues"][0]["settled"]
    assert counted.get("failed") == 3, counted


def test_max_attempts_header_is_sent_per_task(db, url, poison_tables):
    schema = poison_tables
    app = poison_app(schema, url, PGJOBS_TEST_CELERY_EXT="1")
    app.die.delay("x")                                       # max_attempts=3 on the task
    app.record.delay("y")                                    # no option: transport default
    app.die.apply_async(("z",), headers={"x-pgjobs-max-attempts": 7})  # explicit wins
    rows = db.execute(f'SELECT task, max_attempts FROM "{schema}".pgjobs_job ORDER BY id')
    assert rows.fetchall() == [("poison.die", 3), ("poison.record", None), ("poison.die", 7)]
    plain = poison_app(schema, url, PGJOBS_TEST_CELERY_EXT="0")
    plain.die.delay("w")
    last = db.execute(f'SELECT max_attempts FROM "{schema}".pgjobs_job ORDER BY id DESC')
    assert last.fetchone() == (None,), "a plain app sends no header"
