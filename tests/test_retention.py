"""The automatic retention sweep (issue 34): each kind loses exactly what is past its window
and nothing else; ``pgjobs prune --dry-run`` counts what it would remove; one process sweeps
at a time (processes racing for the turn, counts read back); a worker's keeper runs it one
interval after start, at an idle cost of one statement per interval (counted on the wire)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.store import retention
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate
from kombu_pgjobs.store.webhooks import WebhookStore
from tests.conftest import ROOT, wait_for
from tests.test_cli import kill_dead
from tests.test_roles import roles  # noqa: F401  (the fixture)

DAY = 86400.0
#: every kind's window one day: "old" rows are two days old, "fresh" ones twelve hours
WINDOWS = {name: DAY for name in retention.KINDS.values() if name}
OLD, FRESH = "now() - interval '2 days'", "now() - interval '12 hours'"


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=20, worker="retention-test:1")


def _count(db: psycopg.Connection[Any], schema: str, table: str, where: str = "true") -> int:
    return int(db.execute(f'SELECT count(*) FROM "{schema}".{table} WHERE {where}'
                          ).fetchone()[0])


def seed(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, int]:
    """Two old and one fresh row of every kind (and rows no window applies to); returns how
    many of each kind are past the window."""
    s = core.schema
    t = f'"{s}"'
    dead = [kill_dead(core, db, "alpha") for _ in range(3)]
    db.execute(f"UPDATE {t}.pgjobs_dead_letter SET died_at = {OLD} WHERE id = ANY(%s)",
               (dead[:2],))
    db.execute(f"UPDATE {t}.pgjobs_dead_letter SET died_at = {FRESH} WHERE id = %s",
               (dead[2],))
    db.execute(f"DELETE FROM {t}.pgjobs_counter")
    for age, shard in ((OLD, "a"), (OLD, "b"), (FRESH, "a")):
        db.execute(f"INSERT INTO {t}.pgjobs_counter (queue, outcome, bucket, shard, n) "
                   f"VALUES ('alpha', 'acked', date_trunc('minute', {age}), %s, 5)", (shard,))
    for published in (OLD, OLD, FRESH, "NULL"):  # NULL: staged, never deleted
        db.execute(f"INSERT INTO {t}.pgjobs_outbox (exchange, routing_key, body, content_type, "
                   "content_encoding, headers, properties, staged_at, published_at) VALUES "
                   f"('', 'alpha', 'x', 'application/json', 'utf-8', '{{}}', '{{}}', {OLD}, "
                   f"{published})")
    store = WebhookStore(db, s)
    hook = store.add("https://example.com/h", "s3cret-never-shown-0123456789")
    for n in range(3):
        store.record_attempt({"endpoint_id": hook, "event_id": f"evt_{n}", "event_type": "p",
                              "task_id": None, "attempt": 1, "status": 200,
                              "latency_ms": 1.0, "outcome": "delivered", "error": None,
                              "excerpt": None, "location": None, "retry_after": None,
                              "delay": None}, effect="reset", disable_after=3)
    db.execute(f"UPDATE {t}.pgjobs_webhook_attempt SET finished_at = {OLD} "
               "WHERE event_id IN ('evt_0', 'evt_1')")
    db.execute(f"UPDATE {t}.pgjobs_webhook_attempt SET finished_at = {FRESH} "
               "WHERE event_id = 'evt_2'")
    for n, age in enumerate((OLD, OLD, FRESH)):
        db.execute(f"INSERT INTO {t}.pgjobs_schedule_fire (entry, occurrence, fired_at, term, "
                   f"holder) VALUES ('e', now() - make_interval(mins => %s), {age}, 1, 'h')",
                   (n,))
    for n, expires in enumerate(("now() - interval '1 second'", "now() - interval '1 hour'",
                                 "now() + interval '1 hour'")):
        db.execute(f"INSERT INTO {t}.pgjobs_revoked (task_id, expires_at) VALUES (%s, "
                   f"{expires})", (f"rev-{n}",))
    for task, age in (("gone-1", OLD), ("gone-2", OLD), ("gone-3", FRESH)):
        db.execute(f"INSERT INTO {t}.pgjobs_step (task_id, name, kind, state, job_id, claim, "
                   f"updated_at) VALUES (%s, 'a', 'run', 'done', 999999999, 1, {age})", (task,))
    for age in (OLD, FRESH):
        db.execute(f"INSERT INTO {t}.pgjobs_event (name, key, emitted_at) VALUES ('ev', '', "
                   f"{age})")
    for age in (OLD, OLD, FRESH):
        db.execute(f"INSERT INTO {t}.pgjobs_audit (origin, actor, action, at) VALUES "
                   f"('cli', 'ops', 'pause', {age})")
    for n, age in enumerate((OLD, OLD, FRESH)):
        db.execute(f"INSERT INTO {t}.pgjobs_history (settled_at, job_id, claim, task, queue, "
                   f"outcome, attempts) VALUES ({age}, %s, 1, 't', 'alpha', 'completed', 1)",
                   (900000 + n,))
    for age in (OLD, FRESH):
        db.execute(f"INSERT INTO {t}.pgjobs_task_minute (task, minute, completed) VALUES "
                   f"('t', date_trunc('minute', {age}), 1)")
    # steps: two old steps of gone tasks and one old event (the latest of its name is kept
    # only while a waiter may read it: none waits); history: two old rows and an old minute
    return {"dead_letters": 2, "counters": 2, "outbox": 2, "webhook_attempts": 2,
            "schedule_history": 2, "revokes": 2, "steps": 3, "audit": 2, "history": 3}


def left(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    return {
        "dead_letters": _count(db, schema, "pgjobs_dead_letter"),
        "counters": _count(db, schema, "pgjobs_counter", "bucket > '-infinity'"),
        "outbox": _count(db, schema, "pgjobs_outbox"),
        "webhook_attempts": _count(db, schema, "pgjobs_webhook_attempt"),
        "schedule_history": _count(db, schema, "pgjobs_schedule_fire"),
        "revokes": _count(db, schema, "pgjobs_revoked"),
        "steps": _count(db, schema, "pgjobs_step") + _count(db, schema, "pgjobs_event"),
        "audit": _count(db, schema, "pgjobs_audit"),
        "history": _count(db, schema, "pgjobs_history")
        + _count(db, schema, "pgjobs_task_minute"),
    }


def test_each_kind_loses_exactly_what_is_past_its_window(core, db, schema):
    past = seed(core, db)
    before = left(db, schema)
    options = TransportOptions(schema=schema, retention_batch=1, **WINDOWS)  # batch by batch
    planned = retention.plan(db, schema, options)
    assert {k: v["matched"] for k, v in planned["kinds"].items()} == past
    done = retention.sweep(db, schema, options)
    assert done == past
    after = left(db, schema)
    assert after == {k: before[k] - past[k] for k in before}
    # what stayed is the fresh rows (and the staged outbox row, the unexpired revoke)
    assert _count(db, schema, "pgjobs_dead_letter", "died_at < now() - interval '1 day'") == 0
    assert _count(db, schema, "pgjobs_outbox", "published_at IS NULL") == 1
    assert _count(db, schema, "pgjobs_revoked", "expires_at > now()") == 1
    # counters fold, never vanish: the totals stand
    total = db.execute(f'SELECT sum(n) FROM "{schema}".pgjobs_counter').fetchone()[0]
    assert total == 15
    assert retention.sweep(db, schema, options) == dict.fromkeys(past, 0)


def test_a_zero_window_keeps_its_kind_and_the_limit_bounds_a_sweep(core, db, schema):
    past = seed(core, db)
    keep = {**WINDOWS, "retention_dead_letters": 0.0, "retention_audit": 0.0}
    options = TransportOptions(schema=schema, retention_limit=1, **keep)
    done = retention.sweep(db, schema, options)
    assert done["dead_letters"] == 0 and done["audit"] == 0
    assert done["outbox"] == 1 and done["schedule_history"] == 1  # one row per kind per sweep
    second = retention.sweep(db, schema, options)
    assert second["outbox"] == 1 and second["dead_letters"] == 0
    assert _count(db, schema, "pgjobs_dead_letter") == 3
    assert past["dead_letters"] == 2


def test_prune_dry_run_shows_what_the_next_sweep_would_remove(core, db, schema, url, capsys):
    seed(core, db)
    db.execute(f'UPDATE "{schema}".pgjobs_dead_letter SET died_at = now() - interval '
               "'40 days' WHERE died_at < now() - interval '1 day'")
    capsys.readouterr()
    assert cli(["prune", "--older-than", "7d", "--dry-run", "--dsn", url, "--schema", schema,
                "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    sweep = out["sweep"]
    assert sweep["enabled"] is True and sweep["interval"] == 3600.0
    assert sweep["kinds"]["dead_letters"] == {"window": 30 * DAY, "matched": 2}
    assert sweep["kinds"]["revokes"] == {"window": None, "matched": 2}
    assert sweep["kinds"]["audit"]["matched"] == 0  # two days old: inside 90 days
    assert _count(db, schema, "pgjobs_dead_letter") == 3, "a dry run deletes nothing"
    assert cli(["prune", "--older-than", "7d", "--dry-run", "--dsn", url, "--schema",
                schema]) == 0
    assert "next automatic sweep" in capsys.readouterr().out
    # the workers' own windows, as their broker_transport_options
    own = json.dumps({"retention": False, "retention_dead_letters": DAY,
                      "retention_audit": DAY})
    assert cli(["prune", "--older-than", "7d", "--dry-run", "--transport-options", own,
                "--dsn", url, "--schema", schema, "--json"]) == 0
    sweep = json.loads(capsys.readouterr().out)["sweep"]
    assert sweep["enabled"] is False
    assert sweep["kinds"]["dead_letters"] == {"window": DAY, "matched": 2}
    assert sweep["kinds"]["audit"] == {"window": DAY, "matched": 2}
    assert cli(["prune", "--older-than", "7d", "--dry-run", "--transport-options",
                '{"retention_audit": -1}', "--dsn", url, "--schema", schema]) == 2


def test_one_process_takes_the_turn(core, db, schema, dsn):
    """Eight connections ask for the turn at the same moment: exactly one gets it, and nobody
    again before an interval has passed."""
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(8)]
    barrier = threading.Barrier(len(conns))
    won: list[bool] = []

    def ask(conn: psycopg.Connection[Any]) -> None:
        barrier.wait()
        won.append(retention.take_turn(conn, schema, 60.0, "t"))

    threads = [threading.Thread(target=ask, args=(c,)) for c in conns]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert sorted(won) == [False] * 7 + [True]
        assert not retention.take_turn(conns[0], schema, 60.0, "t")
        assert retention.take_turn(conns[0], schema, 0.0, "t"), "due again after the interval"
    finally:
        for c in conns:
            c.close()


RACER = """
import json, sys, psycopg
from kombu_pgjobs.store import retention
from kombu_pgjobs.options import TransportOptions
dsn, schema, windows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
options = TransportOptions(schema=schema, retention_batch=1, **windows)
with psycopg.connect(dsn, autocommit=True) as conn:
    sys.stdin.readline()  # every racer connected: go
    won = retention.take_turn(conn, schema, 600.0, f"racer")
    print(json.dumps(retention.sweep(conn, schema, options) if won else None))
"""


def test_processes_racing_sweep_once(core, db, schema, dsn):
    past = seed(core, db)
    before = left(db, schema)
    procs = [subprocess.Popen([sys.executable, "-c", RACER, dsn, schema, json.dumps(WINDOWS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=ROOT) for _ in range(4)]
    time.sleep(1.0)
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    swept = [o for o in outs if o is not None]
    assert swept == [past], outs
    assert left(db, schema) == {k: before[k] - past[k] for k in before}


def test_a_keeper_sweeps_one_interval_after_start_at_one_statement_per_interval(
        core, db, schema, dsn):
    """A consuming worker's keeper: no turn before one interval, then one statement per
    interval on the wire (the turn), and the sweep deletes the old dead letter."""
    from .wirecount import WireCounter

    past = kill_dead(core, db, "alpha")
    db.execute(f'UPDATE "{schema}".pgjobs_dead_letter SET died_at = now() - interval '
               "'2 days' WHERE id = %s", (past,))
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    interval = 1.5
    with WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432))) as wire:
        url = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
               f"{info.get('dbname', 'test')}")
        options = {"schema": schema, "lease_ttl": 1.5, "retention_interval": interval,
                   "retention_dead_letters": DAY}
        with kombu.Connection(url, transport_options=options) as conn:
            queue = conn.SimpleQueue("idle")
            started = time.monotonic()
            with pytest.raises(queue.Empty):
                queue.get(timeout=0.5)  # consuming: the keeper ticks every half second
            wait_for(lambda: _count(db, schema, "pgjobs_dead_letter") == 0, 15,
                     what="the keeper's sweep")
            assert time.monotonic() - started >= interval * 0.9, "not before one interval"
            turns_before = sum(v for k, v in wire.by_text.items() if "pgjobs_retention" in k)
            start = time.monotonic()
            while time.monotonic() - start < 6.0:
                with pytest.raises(queue.Empty):
                    queue.get(timeout=0.5)
            elapsed = time.monotonic() - start
            turns = sum(v for k, v in wire.by_text.items()
                        if "pgjobs_retention" in k) - turns_before
            queue.close()
    assert 1 <= turns <= elapsed / interval + 1, (turns, elapsed, wire.by_text)
    swept_by = db.execute(f'SELECT swept_by FROM "{schema}".pgjobs_retention').fetchone()[0]
    assert swept_by and ":" in swept_by


def test_the_worker_role_sweeps_and_other_roles_cannot_take_the_turn(roles, db):  # noqa: F811
    """The sweep runs as the worker's role (DELETE on every swept table, UPDATE on the turn's
    row); the operator, the read-only dashboard and the publisher cannot take the turn."""
    schema = roles.schema
    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="retention-roles:1")
    past = seed(core, db)
    options = TransportOptions(schema=schema, **WINDOWS)
    for component in ("op", "ro", "pub"):
        with roles.connect(component) as conn, pytest.raises(
                psycopg.errors.InsufficientPrivilege):
            retention.take_turn(conn, schema, 0.0, component)
    with roles.connect("w") as conn:
        assert retention.take_turn(conn, schema, 0.0, "worker")
        assert retention.sweep(conn, schema, options) == past
