"""Caps are the app's, not the publisher's (issue 28, item 4).

An explicit ``x-pgjobs-limits`` header given at publish can tighten what the app declares for
the task, queue or tenant, never loosen it. Checked three ways: the merge itself (pure), the
``limits`` column of the rows a celery_ext app publishes to a real Postgres, and the overlap of
real runs in real ``celery worker`` processes (tests/apps/limited.py: ``capped`` has
``concurrency=3``, ``keyed`` 2 per key, ``refusing`` 1 per key with ``when_busy="fail"``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest

import kombu_pgjobs
from kombu_pgjobs.errors import InvalidLimit
from kombu_pgjobs.limits import LIMITS_HEADER, tighten
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate

from .conftest import import_app, wait_for

APP = "tests.apps.limited"

DECLARED = {
    "concurrency": [
        {"key": "key:sync:acct-1", "limit": 2, "when_busy": "wait"},
        {"key": "task:sync", "limit": 3, "when_busy": "wait"},
        {"key": "queue:reports", "limit": 4},
        {"key": "tenant:acme", "limit": 5},
    ],
    "rate": [{"key": "tenant:acme", "limit": 100, "per": 60.0}],
}


def _caps(limits: dict[str, Any] | None) -> dict[str, tuple[int, str]]:
    return {c["key"]: (c["limit"], c.get("when_busy", "wait"))
            for c in (limits or {}).get("concurrency", [])}


def _rates(limits: dict[str, Any] | None) -> dict[str, tuple[int, float]]:
    return {r["key"]: (r["limit"], r["per"]) for r in (limits or {}).get("rate", [])}


# --- the merge --------------------------------------------------------------------------------

@pytest.mark.parametrize("given", [
    None,                                                       # an explicit null
    {},                                                         # an empty header
    {"concurrency": [], "rate": []},
    {"concurrency": [{"key": "task:sync", "limit": 100_000}]},  # a higher limit, keys dropped
    json.dumps({"rate": [{"key": "tenant:acme", "limit": 10_000, "per": 60}]}),  # as JSON text
])
def test_a_header_cannot_raise_or_drop_a_declared_cap_or_rate(given):
    merged = tighten(DECLARED, given)
    assert _caps(merged) == _caps(DECLARED)
    assert _rates(merged) == _rates(DECLARED)
    assert [c["key"] for c in merged["concurrency"]] == [
        c["key"] for c in DECLARED["concurrency"]], "declared order kept: first key parks"


def test_a_header_lowers_a_declared_limit_and_adds_its_own_keys():
    given = {"concurrency": [{"key": "task:sync", "limit": 1},
                             {"key": "queue:reports", "limit": 9},
                             {"key": "webhook:7", "limit": 2}],
             "rate": [{"key": "tenant:acme", "limit": 10, "per": 60},
                      {"key": "ip:10.0.0.1", "limit": 5, "per": 1}]}
    merged = tighten(DECLARED, given)
    assert _caps(merged) == {"webhook:7": (2, "wait"), "key:sync:acct-1": (2, "wait"),
                             "task:sync": (1, "wait"), "queue:reports": (4, "wait"),
                             "tenant:acme": (5, "wait")}
    assert merged["concurrency"][0]["key"] == "webhook:7", "the publisher's own key first"
    assert _rates(merged) == {"ip:10.0.0.1": (5, 1.0), "tenant:acme": (10, 60.0)}


def test_when_busy_fail_is_the_stricter_and_is_never_softened():
    refusing = {"concurrency": [{"key": "key:pay:o1", "limit": 1, "when_busy": "fail"}]}
    assert _caps(tighten(refusing, {"concurrency": [
        {"key": "key:pay:o1", "limit": 1, "when_busy": "wait"}]})) == {"key:pay:o1": (1, "fail")}
    assert _caps(tighten(DECLARED, {"concurrency": [
        {"key": "task:sync", "limit": 7, "when_busy": "fail"}]}))["task:sync"] == (3, "fail")


def test_a_rate_of_a_declared_key_keeps_the_declared_window():
    """One key's starts are counted per window; a header cannot move the key to a window where
    the declared limit would count for less (100 per minute is not loosened by '100 per
    hour' nor by '1 per second'); its lower limit is kept, in the declared window."""
    for given in ({"limit": 100, "per": 3600}, {"limit": 1, "per": 1}):
        merged = tighten(DECLARED, {"rate": [{"key": "tenant:acme", **given}]})
        assert _rates(merged) == {"tenant:acme": (min(100, given["limit"]), 60.0)}


def test_without_a_declaration_the_header_is_kept_as_given():
    given = {"concurrency": [{"key": "k", "limit": 2, "when_busy": "fail"}]}
    assert _caps(tighten(None, given)) == {"k": (2, "fail")}
    assert tighten(None, None) is None and tighten(None, {}) is None


@pytest.mark.parametrize("bad", [
    "not json", {"concurrency": [{"key": "task:sync", "limit": 0}]}, {"other": []},
    {"rate": [{"key": "r", "limit": 5, "per": 60}, {"key": "r", "limit": 9, "per": 1}]},
])
def test_a_malformed_header_is_refused_not_dropped(bad):
    with pytest.raises(InvalidLimit) as info:
        tighten(DECLARED, bad)
    assert info.value.code == "PGJ-301"


def test_one_key_rated_twice_is_refused_at_publish_and_never_reaches_a_claim(db, schema):
    """Two rates of one key in one message counted the same window twice in the admission's
    single INSERT ... ON CONFLICT: every claim of the queue failed (CardinalityViolation) for
    as long as the message stayed queued. The transport refuses it at publish now."""
    twice = {"rate": [{"key": "r", "limit": 5, "per": 60}, {"key": "r", "limit": 5, "per": 60}]}
    with pytest.raises(InvalidLimit) as info:
        job_from_message("q", {"body": "x", "headers": {"task": "t", LIMITS_HEADER: twice},
                               "properties": {}})
    assert info.value.code == "PGJ-301"
    # one rate per key is claimed as before
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    once = {"rate": [{"key": "r", "limit": 5, "per": 60}]}
    core.publish_many(db, [job_from_message("q", {
        "body": "x", "headers": {"task": "t", LIMITS_HEADER: once}, "properties": {}})])
    assert len(core.claim(db, ["q"], 5).claimed) == 1


# --- what a celery_ext app stores -------------------------------------------------------------

def _stored(db: psycopg.Connection[Any], schema: str) -> list[dict[str, Any] | None]:
    return [r[0] for r in db.execute(
        f'SELECT limits FROM "{schema}".pgjobs_job ORDER BY id').fetchall()]


@pytest.mark.parametrize("task, args, given, caps", [
    # a higher limit than concurrency=3
    ("capped", ("c", 0), {"concurrency": [{"key": "task:capped", "limit": 50}]},
     {"task:capped": (3, "wait")}),
    # an explicit null, and an empty list: "no limits"
    ("capped", ("c", 0), None, {"task:capped": (3, "wait")}),
    ("capped", ("c", 0), {"concurrency": []}, {"task:capped": (3, "wait")}),
    # the declared key dropped for a made-up one
    ("keyed", ("k", "acct", 0), {"concurrency": [{"key": "mine", "limit": 50}]},
     {"mine": (50, "wait"), "key:keyed:acct": (2, "wait")}),
    # 'wait' for a task that refuses a busy key
    ("refusing", ("r", "R", 0), {"concurrency": [
        {"key": "key:refusing:R", "limit": 9, "when_busy": "wait"}]},
     {"key:refusing:R": (1, "fail")}),
    # tightening takes effect
    ("capped", ("c", 0), {"concurrency": [{"key": "task:capped", "limit": 1}]},
     {"task:capped": (1, "wait")}),
    ("keyed", ("k", "acct", 0), {"concurrency": [
        {"key": "key:keyed:acct", "limit": 1, "when_busy": "fail"}]},
     {"key:keyed:acct": (1, "fail")}),
])
def test_the_stored_limits_are_the_apps_tightened_never_loosened(
        db, recorder_tables, url, task, args, given, caps):
    schema = recorder_tables
    app = import_app(APP, schema, url)
    getattr(app, task).apply_async(args, headers={LIMITS_HEADER: given})
    (stored,) = _stored(db, schema)
    assert _caps(stored) == caps


def test_a_retry_keeps_the_tightened_header_and_the_apps_caps(db, recorder_tables, url):
    """A retry republishes its message's headers: the publisher's tightening is carried on,
    and the app's caps are applied to it again."""
    schema = recorder_tables
    app = import_app(APP, schema, url)
    app.capped.apply_async(("c", 0), headers={
        LIMITS_HEADER: {"concurrency": [{"key": "task:capped", "limit": 2},
                                        {"key": "mine", "limit": 1}]}})
    app.capped.apply_async(("d", 0), headers={
        LIMITS_HEADER: {"concurrency": [{"key": "mine", "limit": 7}]}})
    first, second = _stored(db, schema)
    assert _caps(first) == {"mine": (1, "wait"), "task:capped": (2, "wait")}
    assert _caps(second) == {"mine": (7, "wait"), "task:capped": (3, "wait")}


# --- real workers -----------------------------------------------------------------------------

@pytest.fixture
def spans(db: psycopg.Connection[Any], recorder_tables: str) -> str:
    db.execute(f'CREATE TABLE "{recorder_tables}".pgjobs_test_span (id bigserial PRIMARY KEY, '
               "label text, key text, pid int, started timestamptz, finished timestamptz)")
    return recorder_tables


def _done(db: psycopg.Connection[Any], schema: str) -> int:
    return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_span '
                      "WHERE finished IS NOT NULL").fetchone()[0]


def _max_overlap(db: psycopg.Connection[Any], schema: str) -> int:
    return db.execute(f"""
        SELECT max((SELECT count(*) FROM "{schema}".pgjobs_test_span AS b
                     WHERE b.started <= a.started
                       AND coalesce(b.finished, 'infinity') > a.started))
          FROM "{schema}".pgjobs_test_span AS a""").fetchone()[0]


@pytest.mark.e2e
@pytest.mark.parametrize("limit, expected", [(50, 3), (1, 1)])
def test_real_runs_hold_the_apps_cap_whatever_the_header_says(
        db, spans, url, start_worker, limit, expected):
    """30 runs of ``capped`` (``concurrency=3``), each published with a header claiming
    ``task:capped`` may run ``limit`` at once, on two workers of 8 threads: a header of 50
    still runs at most 3 at once (the app's cap, and it is used); a header of 1 runs one at a
    time."""
    schema = spans
    app = import_app(APP, schema, url)
    header = {"concurrency": [{"key": "task:capped", "limit": limit}]}
    with kombu_pgjobs.batch():
        for i in range(30):
            app.capped.apply_async((f"c{i}", 0.15), headers={LIMITS_HEADER: header})
    for n in range(2):
        start_worker(name=f"w{n}", app=APP, concurrency=8)
    wait_for(lambda: _done(db, schema) >= 30, 120, interval=0.3, what="30 capped runs")
    time.sleep(0.3)  # a duplicate would show up now
    runs = db.execute(f'SELECT count(*), count(DISTINCT label) FROM "{schema}".pgjobs_test_span'
                      ).fetchone()
    assert runs == (30, 30), "every task ran exactly once"
    assert _max_overlap(db, schema) == expected


@pytest.mark.e2e
def test_a_busy_key_still_refuses_when_the_header_says_wait(db, spans, url, start_worker):
    schema = spans
    app = import_app(APP, schema, url)
    start_worker(name="w", app=APP, concurrency=4)
    soften = {"concurrency": [{"key": "key:refusing:R", "limit": 5, "when_busy": "wait"}]}
    app.refusing.apply_async(("holder", "R", 3.0), headers={LIMITS_HEADER: soften})
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_span'
                                ).fetchone()[0] == 1, 30, what="the holder to start")
    app.refusing.apply_async(("second", "R", 0.0), headers={LIMITS_HEADER: soften})
    row = wait_for(lambda: db.execute(
        f'SELECT reason, error FROM "{schema}".pgjobs_dead_letter').fetchone(), 30,
        what="the refused dead letter")
    assert row[0] == "refused" and row[1]["code"] == "PGJ-302"
    wait_for(lambda: _done(db, schema) == 1, 30, what="the holder to end")
    labels = [r[0] for r in db.execute(f'SELECT label FROM "{schema}".pgjobs_test_span')]
    assert labels == ["holder"], "the second message's body never ran"
