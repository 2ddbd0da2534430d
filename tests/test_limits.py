"""Limits in the claim, against a real Postgres: slots, parking, floods, rates, refusals, races.

These drive the queue core directly (the statements the transport runs); the end-to-end tests
with real workers are in test_limits_e2e.py.
"""

from __future__ import annotations

import json
import multiprocessing
from typing import Any

import psycopg
import pytest
from celery import Celery

import celery_ext
from kombu_pgjobs.errors import InvalidLimit, InvalidLimitKey, MessageError
from kombu_pgjobs.limits import LIMITS_HEADER
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate

from .conftest import DSN


def _core(db: psycopg.Connection[Any], schema: str, **kw: Any) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=kw.pop("lease_ttl", 30.0), max_attempts=5, **kw)


def _msg(body: str, limits: Any = None) -> dict[str, Any]:
    headers: dict[str, Any] = {"task": "t"}
    if limits is not None:
        headers[LIMITS_HEADER] = limits
    return {"body": body, "headers": headers, "properties": {}}


def _keyed(key: str, limit: int, **extra: Any) -> dict[str, Any]:
    return {"concurrency": [{"key": key, "limit": limit, **extra}]}


def _publish(core: QueueCore, db: psycopg.Connection[Any], bodies: list[tuple[str, Any]],
             queue: str = "q") -> None:
    core.publish_many(db, [job_from_message(queue, _msg(b, lim)) for b, lim in bodies])


def _states(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    return dict(db.execute(
        f'SELECT state, count(*) FROM "{schema}".pgjobs_job GROUP BY state').fetchall())


@pytest.mark.parametrize("bad, code", [
    ({"concurrency": [{"key": "k", "limit": 0}]}, "PGJ-301"),
    ({"concurrency": [{"key": "k", "limit": -2}]}, "PGJ-301"),
    ({"concurrency": [{"key": "k", "limit": 1.5}]}, "PGJ-301"),
    ({"concurrency": [{"key": "k", "limit": float("nan")}]}, "PGJ-301"),
    ({"concurrency": [{"key": "k", "limit": float("inf")}]}, "PGJ-301"),
    ({"concurrency": [{"key": "k", "limit": True}]}, "PGJ-301"),
    ({"concurrency": [{"key": "k", "limit": 2, "when_busy": "later"}]}, "PGJ-301"),
    ({"rate": [{"key": "k", "limit": 2, "per": 0}]}, "PGJ-301"),
    ({"concurrency": [{"key": "", "limit": 1}]}, "PGJ-303"),
    ({"concurrency": [{"key": 42, "limit": 1}]}, "PGJ-303"),
    ({"concurrency": [{"key": "x" * 513, "limit": 1}]}, "PGJ-303"),
    ({"other": []}, "PGJ-301"),
])
def test_bad_limits_header_is_refused_at_publish(bad, code):
    with pytest.raises(InvalidLimit) as info:
        job_from_message("q", _msg("x", bad))
    assert info.value.code == code


def test_parked_rows_burn_no_attempt_and_wake_one_per_release(db, schema):
    core = _core(db, schema)
    _publish(core, db, [(f"a{i}", _keyed("acct:1", 2)) for i in range(6)])
    first = core.claim(db, ["q"], 6)
    assert len(first.claimed) == 2, "two slots, two claimed"
    assert not first.drained, "rows were held back: the caller must claim again"
    assert _states(db, schema) == {"running": 2, "waiting": 4}
    attempts = db.execute(
        f"SELECT max(attempts) FROM \"{schema}\".pgjobs_job WHERE state = 'waiting'").fetchone()
    assert attempts[0] == 0, "a parked message burns no attempt"
    # An ack releases one slot and wakes exactly one parked row.
    core.ack(db, [(first.claimed[0].id, first.claimed[0].claim)])
    assert _states(db, schema) == {"running": 1, "waiting": 3, "ready": 1}
    again = core.claim(db, ["q"], 6)
    assert len(again.claimed) == 1
    # A requeue releases too.
    core.requeue(db, [(again.claimed[0].id, again.claimed[0].claim)], uncount=True)
    assert _states(db, schema) == {"running": 1, "waiting": 2, "ready": 2}
    slots = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_slot '
                      'WHERE job_id IS NOT NULL').fetchone()[0]
    assert slots == 1


def _held_slots(db: psycopg.Connection[Any], schema: str) -> list[tuple[str, int]]:
    return db.execute(f'SELECT limit_key, job_id FROM "{schema}".pgjobs_slot '
                      "WHERE job_id IS NOT NULL ORDER BY job_id").fetchall()


def test_acks_ride_on_the_claim_and_release_slots_first(db, schema):
    core = _core(db, schema)
    _publish(core, db, [("a", _keyed("k", 1)), ("plain", None), ("b", _keyed("k", 1))])
    got = core.claim(db, ["q"], 3).claimed
    assert ['"a"' in c.message for c in got] == [True, False]
    assert _states(db, schema) == {"running": 2, "waiting": 1}
    assert _held_slots(db, schema) == [("k", got[0].id)]
    # One list of acks: the statement tells from each row which ones hold slots.
    result = core.claim(db, ["q"], 2, [(c.id, c.claim) for c in got])
    assert result.acked == {c.id for c in got} and result.unsettled == []
    # The release ran before admission and woke "b"; "b" is claimed next (the claim's own
    # snapshot predates the wake-up).
    assert _states(db, schema) == {"ready": 1}
    assert _held_slots(db, schema) == []
    (b,) = core.claim(db, ["q"], 2).claimed
    assert '"b"' in b.message
    assert _held_slots(db, schema) == [("k", b.id)]


def test_a_claim_leaves_the_ack_of_a_busy_key_held_and_ack_settles_it(db, dsn, schema):
    core = _core(db, schema)
    _publish(core, db, [("a", _keyed("k", 1)), ("plain", None)])
    a, plain = core.claim(db, ["q"], 2).claimed
    with psycopg.connect(dsn) as other:  # another transaction is changing key k right now
        other.execute(f'SELECT "{schema}".pgjobs_lock_v1(%s, %s, %s)',
                      ("limit", ["k"], "wait"))
        result = core.claim(db, ["q"], 2, [(a.id, a.claim), (plain.id, plain.claim)])
        assert result.acked == {plain.id}, "a claim never waits for a key's lock"
        assert result.unsettled == [(a.id, a.claim)]
        assert _states(db, schema) == {"running": 1}
        assert _held_slots(db, schema) == [("k", a.id)]
    assert core.ack(db, result.unsettled) == {a.id}  # the ack alone waits, then releases
    assert _states(db, schema) == {} and _held_slots(db, schema) == []


def test_flood_of_one_key_does_not_block_other_keys(db, schema):
    core = _core(db, schema)
    _publish(core, db, [(f"a{i}", _keyed("A", 1)) for i in range(10_000)])
    _publish(core, db, [(f"b{i}", _keyed("B", 1)) for i in range(3)] + [("free", None)])
    claimed: list[str] = []
    rounds = 0
    while rounds < 50:
        rounds += 1
        r = core.claim(db, ["q"], 8)
        for c in r.claimed:
            claimed.append(c.message)
        if any('"free"' in m for m in claimed) and any('"b0"' in m for m in claimed):
            break
    assert any('"b0"' in m for m in claimed) and any('"free"' in m for m in claimed)
    assert rounds <= 15, f"other keys reached after {rounds} claims of 8"
    waiting = _states(db, schema).get("waiting", 0)
    assert waiting >= 9_000, "the flood was parked, not scanned again and again"


# -- a key whose messages disagree on its cap (a deploy changed concurrency_per_key) ----------

def _slot_invariant(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    """Held slots per key, after checking the slot table's invariant: every held slot is below
    the cap its holder was admitted under, and its holder is running under that claim."""
    rows = db.execute(f"""
        SELECT sl.limit_key, sl.slot, sl.cap, j.state, j.claim = sl.claim
          FROM "{schema}".pgjobs_slot AS sl
          LEFT JOIN "{schema}".pgjobs_job AS j ON j.id = sl.job_id
         WHERE sl.job_id IS NOT NULL""").fetchall()
    held: dict[str, int] = {}
    for key, slot, cap, state, same_claim in rows:
        assert slot < cap, f"slot {slot} of {key} held under cap {cap}"
        assert state == "running" and same_claim, f"slot {slot} of {key} held by a non-holder"
        held[key] = held.get(key, 0) + 1
    return held


def _drain_mixed(core: QueueCore, db: psycopg.Connection[Any], schema: str, n: int,
                 window: int) -> tuple[list[str], int]:
    """Claim and ack until every message ran; return bodies in claim order and the most
    slots of key k held at once."""
    ran: list[str] = []
    most = 0
    for _ in range(200):
        got = core.claim(db, ["q"], window)
        most = max(most, _slot_invariant(db, schema).get("k", 0))
        ran += [json.loads(c.message)["body"] for c in got.claimed]
        if got.claimed:
            core.ack(db, [(c.id, c.claim) for c in got.claimed])
        if len(ran) == n:
            break
    return ran, most


@pytest.mark.parametrize("window", [1, 4, 12])
def test_old_and_new_caps_of_one_key_never_wedge_the_claim(db, schema, window):
    # Before version 5 the first claim failed: the old message's flood parked a new-cap
    # candidate that the same claim then admitted (TriggeredDataChangeViolation), and so did
    # every claim after it.
    core = _core(db, schema)
    bodies = [(f"old{i}", _keyed("k", 1)) for i in range(4)]
    bodies += [(f"new{i}", _keyed("k", 3)) for i in range(6)]
    bodies += [(f"old{i}", _keyed("k", 1)) for i in range(4, 6)]
    _publish(core, db, [*bodies, ("free", None)])
    ran, most = _drain_mixed(core, db, schema, len(bodies) + 1, window)
    assert sorted(ran) == sorted([*(b for b, _ in bodies), "free"]), ran
    assert len(ran) == len(set(ran)), "every message claimed once"
    assert most <= 3, "never more holders than the larger cap"
    assert _states(db, schema) == {}


def test_a_larger_cap_is_used_while_old_messages_of_the_key_wait(db, schema):
    core = _core(db, schema)
    _publish(core, db, [(f"old{i}", _keyed("k", 1)) for i in range(3)]
             + [(f"new{i}", _keyed("k", 3)) for i in range(4)])
    first = core.claim(db, ["q"], 2)  # old0 admitted; old1 full under cap 1: parks its flood
    assert [json.loads(c.message)["body"] for c in first.claimed] == ["old0"]
    waiting = db.execute(f"SELECT message::json ->> 'body' FROM \"{schema}\".pgjobs_job "
                         "WHERE state = 'waiting' ORDER BY id").fetchall()
    assert [w[0] for w in waiting] == ["old1", "old2"], "the flood parks only cap-1 rows"
    second = core.claim(db, ["q"], 4)
    assert [json.loads(c.message)["body"] for c in second.claimed] == ["new0", "new1"]
    assert _slot_invariant(db, schema) == {"k": 3}, "the new cap of 3 is used at once"


def test_the_previous_release_claim_statement_gets_the_cap_rule_too(db, schema):
    """A rolling deploy: a process of the previous release claims with pgjobs_admit_v1 against
    the migrated schema (v1 is now a wrapper of v2 without the candidate list)."""
    from psycopg import sql as psql

    from kombu_pgjobs.store.sql import raw_queries

    core = _core(db, schema)
    text = raw_queries()["job_claim"]
    start = text.index("{schema}.pgjobs_admit_v2(")
    end = text.index("END AS v", start)
    old = text[:start] + ("{schema}.pgjobs_admit_v1(c.id, c.claim + 1, c.queue, c.limits, "
                          "%(channel)s, %(worker)s)\n                 ") + text[end:]
    query = psql.SQL(old).format(schema=psql.Identifier(schema), limit=psql.Literal(4))
    _publish(core, db, [("old0", _keyed("k", 1)), ("old1", _keyed("k", 1)),
                        ("new0", _keyed("k", 3)), ("new1", _keyed("k", 3))])
    _, params = core.claim_statement(["q"], 4)
    got = core.claim_result(db.execute(query, params).fetchall())
    assert [json.loads(c.message)["body"] for c in got.claimed] == ["old0", "new0", "new1"]
    assert _slot_invariant(db, schema) == {"k": 3}


def test_a_claim_whose_acks_wake_parked_rows_is_not_drained(db, schema):
    """The release in a claim wakes rows its own snapshot cannot see: saying 'drained' would
    leave them for a notification or the next poll instead of the next claim."""
    core = _core(db, schema)
    _publish(core, db, [("a", _keyed("k", 1)), ("b", _keyed("k", 1))])
    (a,) = core.claim(db, ["q"], 2).claimed
    result = core.claim(db, ["q"], 2, [(a.id, a.claim)])
    assert result.acked == {a.id} and result.claimed == []
    assert not result.drained, "b was woken: claim again"
    assert [json.loads(c.message)["body"] for c in core.claim(db, ["q"], 2).claimed] == ["b"]
    assert core.claim(db, ["q"], 2).drained


def test_when_busy_fail_refuses_into_dead_letters_with_code(db, schema):
    core = _core(db, schema)
    _publish(core, db, [("first", _keyed("k", 1, when_busy="fail")),
                        ("second", _keyed("k", 1, when_busy="fail"))])
    r = core.claim(db, ["q"], 2)
    assert len(r.claimed) == 1 and '"first"' in r.claimed[0].message
    assert [(h.verdict, h.key) for h in r.held_back] == [("refused", "k")]
    row = db.execute(f'SELECT reason, error, message::text FROM "{schema}".pgjobs_dead_letter'
                     ).fetchone()
    assert row[0] == "refused"
    assert row[1]["code"] == "PGJ-302" and row[1]["key"] == "k"
    assert '"second"' in row[2]
    assert _states(db, schema) == {"running": 1}


def test_rate_defers_to_next_window_without_an_attempt(db, schema):
    core = _core(db, schema)
    rate = {"rate": [{"key": "tenant:acme", "limit": 2, "per": 3600}]}
    _publish(core, db, [(f"r{i}", rate) for i in range(5)])
    r = core.claim(db, ["q"], 5)
    assert len(r.claimed) == 2
    assert sorted(h.verdict for h in r.held_back) == ["later"] * 3
    rows = db.execute(
        f"SELECT attempts, run_at > now() FROM \"{schema}\".pgjobs_job WHERE state = 'ready'"
    ).fetchall()
    assert rows and all(a == 0 and later for a, later in rows)


def test_lapsed_holder_frees_its_slot_and_keeper_wakes_parked(db, schema):
    core = _core(db, schema, lease_ttl=0.5)
    _publish(core, db, [("a0", _keyed("k", 1)), ("a1", _keyed("k", 1))])
    assert len(core.claim(db, ["q"], 2).claimed) == 1  # a1 parked
    db.execute("SELECT pg_sleep(0.7)")  # the holder "dies": its lease lapses
    outcomes = core.maintain(db, consumed=["q"], grace=30)
    assert ("release", None, None) in outcomes
    assert core.release_orphans(db) == 1, "the parked row is woken when the slot is freed"
    claimed = core.claim(db, ["q"], 2).claimed
    assert len(claimed) == 1, "one slot: the rescued row or the woken one, not both"


def _race(schema: str, barrier: Any, out: Any) -> None:
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    with psycopg.connect(DSN, autocommit=True) as conn:
        barrier.wait()
        total = 0
        for _ in range(5):
            total += len(core.claim(conn, ["q"], 10).claimed)
        out.put(total)


@pytest.mark.parametrize("cap", [1, 3])
def test_racing_claims_never_overshoot_a_cap(db, schema, cap):
    core = _core(db, schema)
    _publish(core, db, [(f"x{i}", _keyed("hot", cap)) for i in range(200)])
    procs = 8
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_race, args=(schema, barrier, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    totals = [out.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(30)
    assert sum(totals) == cap, f"{procs} racing claimers took {sum(totals)} slots of {cap}"
    running = db.execute(
        f"SELECT count(*) FROM \"{schema}\".pgjobs_job WHERE state = 'running'").fetchone()[0]
    assert running == cap


def test_declarations_are_refused_where_they_are_written(schema, url):
    app = Celery("decl", broker=url)
    celery_ext.install(app)
    for bad in (0, -1, 2.5, float("nan"), float("inf")):
        with pytest.raises(InvalidLimit) as info:
            app.task(name=f"t{bad}", concurrency=bad)(lambda: None)
        assert info.value.code == "PGJ-301"
    with pytest.raises(InvalidLimitKey) as key_info:
        app.task(name="k", concurrency_key="account_id")(lambda account_id: None)
    assert key_info.value.code == "PGJ-303"
    with pytest.raises(InvalidLimit):
        app.task(name="w", concurrency=1, when_busy="maybe")(lambda: None)


@pytest.mark.parametrize("value", ["", "x" * 201, 17, None])
def test_bad_key_values_are_refused_at_publish_and_nothing_is_written(db, schema, url, value):
    app = Celery("pub", broker=url)
    celery_ext.install(app)
    app.conf.broker_transport_options = {"schema": schema}

    @app.task(name="sync", concurrency_key=lambda account: account)
    def sync(account: Any) -> None:
        pass

    with pytest.raises(InvalidLimitKey) as info:
        sync.delay(value)
    assert info.value.code == "PGJ-303"
    migrate(db, schema)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0


def test_limited_task_with_early_ack_is_refused():
    app = Celery("late")
    celery_ext.install(app)

    @app.task(name="early", concurrency=2, acks_late=False, shared=False)
    def early() -> None:
        pass

    with pytest.raises(InvalidLimit, match="acks_late"):
        early.run  # noqa: B018 - evaluating the lazy task binds it

    @app.task(name="fine", concurrency=2)
    def fine() -> None:
        pass

    assert fine.acks_late is True


def test_message_error_is_still_raised_for_other_bad_input():
    with pytest.raises(MessageError):
        job_from_message("q", {"headers": {}, "properties": {"priority": "high"}})


def test_cli_shows_held_slots_and_why_a_message_waits(db, schema, url, capsys):
    core = _core(db, schema)
    _publish(core, db, [(f"a{i}", _keyed("key:sync:acct-1", 2)) for i in range(5)]
             + [("r", {"rate": [{"key": "tenant:acme", "limit": 5, "per": 60}]})])
    held = core.claim(db, ["q"], 8).claimed
    assert len(held) == 3  # two slots of the key, and the rated one

    def run(*argv: str) -> Any:
        capsys.readouterr()
        assert cli([*argv, "--dsn", url, "--schema", schema, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    limits = run("limits")
    (key,) = limits["keys"]
    assert key["key"] == "key:sync:acct-1" and key["held"] == 2 and key["cap"] == 2
    assert key["waiting"] == 3
    assert sorted(key["holders"]) == sorted(c.id for c in held if '"r"' not in c.message)
    assert [r["key"] for r in limits["rates"]] == ["tenant:acme"]
    assert limits["rates"][0]["starts"] == 1
    waiting = run("ls", "--state", "waiting")["items"]
    assert len(waiting) == 3 and all(w["waiting_on"] == "key:sync:acct-1" for w in waiting)
    shown = run("show", str(waiting[0]["id"]))
    assert shown["state"] == "waiting" and shown["waiting_on_held"] == 2
    capsys.readouterr()
    assert cli(["show", str(waiting[0]["id"]), "--dsn", url, "--schema", schema]) == 0
    text = capsys.readouterr().out
    assert "concurrency key key:sync:acct-1 is full (2 of 2 running" in text
    assert cli(["queues", "--dsn", url, "--schema", schema, "--json"]) == 0
    (queue,) = json.loads(capsys.readouterr().out)["queues"]
    assert queue["waiting"] == 3 and queue["running"] == 3


def test_app_level_caps_and_tenant_rate_become_the_header():
    from celery_ext.limits import limits_header

    app = Celery("appcaps", broker="memory://")
    celery_ext.install(app)
    app.conf.update(pgjobs_queue_limits={"reports": 4}, pgjobs_global_limit=50,
                    pgjobs_tenant_limit=2, pgjobs_tenant_rate=(100, 60),
                    task_routes={"build_report": {"queue": "reports"}})

    @app.task(name="build_report", concurrency_key=lambda account: account, concurrency=3)
    def build_report(account: str) -> None:
        pass

    header = limits_header(build_report, ("acct-9",), {}, {}, {"x-pgjobs-tenant": "acme"})
    assert header == {
        "concurrency": [
            {"key": "key:build_report:acct-9", "limit": 1, "when_busy": "wait"},
            {"key": "task:build_report", "limit": 3, "when_busy": "wait"},
            {"key": "queue:reports", "limit": 4},
            {"key": "global", "limit": 50},
            {"key": "tenant:acme", "limit": 2},
        ],
        "rate": [{"key": "tenant:acme", "limit": 100, "per": 60.0}],
    }
    # The transport accepts what celery_ext sends, unchanged in meaning.
    stored = json.loads(job_from_message("reports", _msg("x", header)).limits)
    assert [c["key"] for c in stored["concurrency"]] == [
        c["key"] for c in header["concurrency"]]
    assert build_report.acks_late is True, "a limited task is acked when it ends"


@pytest.mark.parametrize("setting, value", [
    ("pgjobs_global_limit", 0), ("pgjobs_tenant_limit", -3), ("pgjobs_tenant_limit", 1.5),
    ("pgjobs_queue_limits", {"q": float("inf")}), ("pgjobs_tenant_rate", (10, 0)),
    ("pgjobs_tenant_rate", (0, 60)), ("pgjobs_queue_limits", ["q", 3]),
])
def test_invalid_app_limits_are_refused(setting, value):
    app = Celery("badcaps", broker="memory://")
    app.conf[setting] = value
    with pytest.raises(InvalidLimit) as info:
        celery_ext.install(app)
    assert info.value.code == "PGJ-301"
