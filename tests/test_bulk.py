"""`pgjobs bulk promote|remove` (issue 16, item 4): a selection by queue, task and tenant,
bounded per call, {affected, remaining}; promote clears Celery's eta; remove never takes running
messages. Read back from the database."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate

from .test_cli import claim, publish


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=5, worker="bulk:1")


def _run(capsys: Any, schema: str, url: str, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli([*argv, "--dsn", url, "--schema", schema, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_bulk_promote_by_task_and_tenant_in_bounded_calls(core, db, schema, url, capsys):
    later = (datetime.now(timezone.utc) + timedelta(hours=1)).isoformat()
    ours = [publish(core, db, "alpha", task="t.report", tenant="acme", eta=later)
            for _ in range(5)]
    theirs = publish(core, db, "alpha", task="t.report", tenant="other", eta=later)
    other_task = publish(core, db, "alpha", task="t.mail", tenant="acme", eta=later)
    code, out = _run(capsys, schema, url, "bulk", "promote", "--task", "t.report",
                     "--tenant", "acme", "--limit", "3", "--batch", "2")
    assert code == 0 and out == {"affected": 3, "remaining": 2}
    code, out = _run(capsys, schema, url, "bulk", "promote", "--task", "t.report",
                     "--tenant", "acme")
    assert out == {"affected": 2, "remaining": 0}
    rows = dict(db.execute(
        f"SELECT id, run_at <= now() AND NOT delayed AND message -> 'headers' ->> 'eta' IS NULL "
        f'FROM "{schema}".pgjobs_job').fetchall())
    assert all(rows[i] for i in ours) and not rows[theirs] and not rows[other_task]


def test_bulk_remove_spares_running_and_other_queues(core, db, schema, url, capsys):
    for _ in range(4):
        publish(core, db, "alpha")
    publish(core, db, "beta")
    running = claim(core, db, "alpha")
    code, out = _run(capsys, schema, url, "bulk", "remove", "--queue", "alpha",
                     "--state", "ready")
    assert code == 0 and out == {"affected": 3, "remaining": 0}
    left = db.execute(f'SELECT queue, state FROM "{schema}".pgjobs_job ORDER BY queue').fetchall()
    assert left == [("alpha", "running"), ("beta", "ready")]
    assert running
    cancelled = db.execute(f"SELECT sum(n) FROM \"{schema}\".pgjobs_counter "
                           "WHERE outcome = 'cancelled'").fetchone()[0]
    assert cancelled == 3
    code, out = _run(capsys, schema, url, "bulk", "remove", "--state", "running",
                     "--queue", "alpha")
    assert code != 0 and out["error"]["code"] == "PGJ-405"
    code, out = _run(capsys, schema, url, "bulk", "remove")
    assert code != 0 and out["error"]["code"] == "PGJ-404", "no selection: refused"


def test_bulk_requeue_brings_one_tasks_dead_letters_back_in_bounded_calls(core, db, schema,
                                                                          url, capsys):
    from .test_cli import kill_dead

    ours = [kill_dead(core, db, "alpha") for _ in range(3)]
    mail = publish(core, db, "alpha", task="t.mail")
    pairs = [p for p in claim(core, db, "alpha", 10) if p[0] == mail]
    assert core.bury(db, pairs, reason="rejected") == {mail}
    code, out = _run(capsys, schema, url, "bulk", "requeue", "--task", "t.add",
                     "--limit", "2", "--batch", "1")
    assert code == 0 and out == {"affected": 2, "remaining": 1}
    code, out = _run(capsys, schema, url, "bulk", "requeue", "--task", "t.add")
    assert out == {"affected": 1, "remaining": 0}
    live = {r[0]: r[1] for r in db.execute(
        f'SELECT id, attempts FROM "{schema}".pgjobs_job WHERE state = \'ready\'')}
    assert set(ours) <= set(live) and all(live[i] == 0 for i in ours)
    dead = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".pgjobs_dead_letter')]
    assert dead == [mail], "another task's dead letter stays dead"
    code, out = _run(capsys, schema, url, "dead", "requeue", "--all", "--task", "t.mail")
    assert code == 0 and [r["id"] for r in out["requeued"]] == [mail]
