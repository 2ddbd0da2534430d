"""The leader scheduler with real processes: `celery beat -S celery_ext.scheduler:LeaderScheduler`
replicas killed with SIGKILL, paused with SIGSTOP, and `celery worker -B` on three workers.

Counts come from the database: the message rows the fires inserted (each carries its entry and
occurrence in its headers), the fire history, and the runs the workers recorded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
import pytest

from .conftest import DSN, ROOT, Worker, wait_for

APP = "tests.apps.scheduled"
TTL = 3.0


class Beat(Worker):
    """A real `celery beat` subprocess (its own process group)."""

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture
def start_beat(tmp_path: Path, schema: str, url: str) -> Any:
    beats: list[Beat] = []

    def start(name: str) -> Beat:
        log = tmp_path / f"{name}.log"
        env = {**os.environ, "PGJOBS_TEST_DSN": DSN, "PGJOBS_TEST_SCHEMA": schema,
               "PGJOBS_TEST_BROKER": url, "PYTHONPATH": str(ROOT),
               "PGJOBS_TEST_SCHED_TTL": str(TTL)}
        cmd = [sys.executable, "-m", "celery", "-A", APP, "beat", "-l", "info",
               "-S", "celery_ext.scheduler:LeaderScheduler",
               "-s", str(tmp_path / f"{name}-schedule")]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    cwd=ROOT, start_new_session=True)
        b = Beat(proc, log)
        beats.append(b)
        return b

    yield start
    for b in beats:
        b.signal(signal.SIGCONT)
        b.signal(signal.SIGKILL)
        b.proc.wait(10)


def _leader(db: psycopg.Connection[Any], schema: str) -> tuple[int, int] | None:
    """(pid, term) of the live lease, None while nobody holds one."""
    try:
        row = db.execute(f'SELECT holder, term FROM "{schema}".pgjobs_leader '
                         "WHERE expires_at > clock_timestamp()").fetchone()
    except psycopg.errors.UndefinedTable:
        return None
    if row is None:
        return None
    return int(row[0].split(":")[1]), int(row[1])


def _by_pid(beats: list[Beat], pid: int) -> Beat:
    return next(b for b in beats if b.proc.pid == pid)


def _occurrences(db: psycopg.Connection[Any], schema: str) -> list[tuple[Any, int]]:
    """(occurrence, messages) for every occurrence fired, from the message rows themselves."""
    return db.execute(
        f"""SELECT (message->'headers'->>'pgjobs_schedule_occurrence')::timestamptz AS occ,
                   count(*)
              FROM "{schema}".pgjobs_job
             WHERE message->'headers'->>'pgjobs_schedule_entry' = 'tick'
             GROUP BY 1 ORDER BY 1""").fetchall()


def _assert_once_each_none_missing(db: psycopg.Connection[Any], schema: str) -> int:
    occ = _occurrences(db, schema)
    doubled = [(o, n) for o, n in occ if n != 1]
    assert not doubled, f"occurrences fired more than once: {doubled}"
    # catch-up 'all' on a 1-second grid: every second between the first and the last fired
    steps = [(b[0] - a[0]) for a, b in pairwise(occ)]
    assert all(s == timedelta(seconds=1) for s in steps), f"gaps in the grid: {steps}"
    history = db.execute(f'SELECT count(*), count(DISTINCT occurrence) FROM "{schema}".'
                         "pgjobs_schedule_fire WHERE entry = 'tick'").fetchone()
    assert history == (len(occ), len(occ))
    return len(occ)


@pytest.mark.slow
def test_leader_killed_twice_no_double_none_missing(db, schema, start_beat):
    beats = [start_beat(f"b{i}") for i in range(3)]
    first = wait_for(lambda: _leader(db, schema), 60, what="a first leader")
    wait_for(lambda: len(_occurrences(db, schema)) >= 3, 30, what="first fires")
    terms = {first[1]}
    for _ in range(2):
        pid, term = _leader(db, schema) or (0, 0)
        victim = _by_pid(beats, pid)
        victim.signal(signal.SIGKILL)
        victim.proc.wait(10)
        killed_at = time.monotonic()
        new = wait_for(lambda t=term: (lambda lead: lead if lead and lead[1] > t else None)(
            _leader(db, schema)), 30, what="a takeover")
        took = time.monotonic() - killed_at
        assert took < TTL * 4, f"takeover took {took:.1f}s with a {TTL}s lease"
        terms.add(new[1])
        before = len(_occurrences(db, schema))
        wait_for(lambda b=before: len(_occurrences(db, schema)) >= b + 3, 30,
                 what="fires after the takeover")
    fired = _assert_once_each_none_missing(db, schema)
    fired_terms = {r[0] for r in db.execute(
        f'SELECT DISTINCT term FROM "{schema}".pgjobs_schedule_fire').fetchall()}
    assert len(fired_terms) == 3 and fired_terms <= terms, (fired_terms, terms)
    assert fired >= 9


@pytest.mark.slow
def test_paused_leader_dispatches_nothing_after_takeover(db, schema, start_beat):
    beats = [start_beat(f"b{i}") for i in range(2)]
    pid, term = wait_for(lambda: _leader(db, schema), 60, what="a first leader")
    wait_for(lambda: len(_occurrences(db, schema)) >= 2, 30, what="first fires")
    paused = _by_pid(beats, pid)
    paused.signal(signal.SIGSTOP)
    new = wait_for(lambda: (lambda lead: lead if lead and lead[1] > term else None)(
        _leader(db, schema)), 30, what="a takeover")
    assert new[0] != pid
    taken = db.execute(f'SELECT elected_at FROM "{schema}".pgjobs_leader').fetchone()[0]
    time.sleep(1.5)
    paused.signal(signal.SIGCONT)
    # the deposed leader runs again for a few of its rounds next to the new leader
    time.sleep(TTL)
    assert paused.proc.poll() is None, "the resumed process died"
    late = db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_schedule_fire '
        "WHERE term = %s AND fired_at >= %s", (term, taken)).fetchone()[0]
    assert late == 0, "the deposed leader fired after the takeover"
    rows = db.execute(f'SELECT DISTINCT holder FROM "{schema}".pgjobs_schedule_fire '
                      "WHERE fired_at >= %s", (taken,)).fetchall()
    assert all(int(h[0].split(":")[1]) == new[0] for h in rows)
    _assert_once_each_none_missing(db, schema)
    # it knows it is a follower now
    assert "pgjobs.leader.lost" in paused.output()


@pytest.mark.slow
def test_three_workers_with_embedded_beat_fire_once(db, recorder_tables, start_worker):
    schema = recorder_tables
    env = {"PGJOBS_TEST_SCHED_TTL": str(TTL)}
    workers = [start_worker(name=f"w{i}", app=APP, env=env, concurrency=2,
                            extra=["-B", "-s", f"/tmp/pgjobs-beat-{schema}-{i}"], ready=False)
               for i in range(3)]
    wait_for(lambda: db.execute(
        f'SELECT count(*) >= 6 FROM "{schema}".pgjobs_test_run').fetchone()[0], 90,
        what="six scheduled runs")
    runs = db.execute(f'SELECT started, count(*) FROM "{schema}".pgjobs_test_run '
                      "GROUP BY 1 ORDER BY 1").fetchall()
    # each run recorded the occurrence it was sent for (self.request header): once each
    assert all(r[0] is not None for r in runs), "a run without its occurrence header"
    assert [r for r in runs if r[1] != 1] == []
    fires = db.execute(f'SELECT count(*), count(DISTINCT term) FROM "{schema}".'
                       "pgjobs_schedule_fire").fetchone()
    assert fires[0] >= len(runs)
    # every worker embedded the scheduler (one leads, two follow)
    for w in workers:
        assert "beat: Starting..." in w.output(), w.output()[-2000:]
