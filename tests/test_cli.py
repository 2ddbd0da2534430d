"""The `pgjobs` operator CLI against real Postgres: every command, its --json shape, its table
output, and its errors (stable code, non-zero exit). Messages are set up through the queue core
(publish, claim, bury) exactly as the transport does; the CLI runs in-process through
``kombu_pgjobs.ops.cli.main.main`` and, for the console script and the HTTP exporter, as a
subprocess.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate

PGJOBS = shutil.which("pgjobs", path=str(Path(sys.executable).parent)) or "pgjobs"


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=20, worker="cli-test:1")


@pytest.fixture
def run(capsys: Any, schema: str, url: str) -> Any:
    """run(*argv) -> (exit code, parsed --json output)."""

    def call(*argv: str, json_out: bool = True) -> tuple[int, Any]:
        capsys.readouterr()
        extra = ["--json"] if json_out else []
        code = cli([*argv, "--dsn", url, "--schema", schema, *extra])
        captured = capsys.readouterr()
        if not json_out:
            return code, captured.out + captured.err
        return code, json.loads(captured.out) if captured.out.strip() else None

    return call


def publish(core: QueueCore, db: psycopg.Connection[Any], queue: str, *, task: str = "t.add",
            tenant: str | None = None, eta: str | None = None) -> int:
    """A Celery-shaped message, published as the transport publishes it; returns its id."""
    headers: dict[str, Any] = {"task": task, "id": str(uuid.uuid4()), "argsrepr": "(1, 2)",
                               "kwargsrepr": "{}", "retries": 0, "eta": eta}
    if tenant:
        headers["x-pgjobs-tenant"] = tenant
    body = base64.b64encode(json.dumps([[1, 2], {}, {"callbacks": None}]).encode()).decode()
    message = {"body": body, "content-encoding": "utf-8", "content-type": "application/json",
               "headers": headers,
               "properties": {"body_encoding": "base64", "priority": 0,
                              "delivery_info": {"exchange": "", "routing_key": queue},
                              "delivery_tag": str(uuid.uuid4())}}
    core.publish(db, job_from_message(queue, message))
    return int(db.execute(f'SELECT max(id) FROM "{core.schema}".pgjobs_job').fetchone()[0])


def claim(core: QueueCore, db: psycopg.Connection[Any], queue: str,
          n: int = 1) -> list[tuple[int, int]]:
    return [(c.id, c.claim) for c in core.claim(db, [queue], n).claimed]


def kill_dead(core: QueueCore, db: psycopg.Connection[Any], queue: str, *,
              error: dict[str, Any] | None = None) -> int:
    """Publish, claim and bury one message (a dead letter as the transport makes one)."""
    job_id = publish(core, db, queue)
    pairs = [p for p in claim(core, db, queue, 50) if p[0] == job_id]
    assert core.bury(db, pairs, reason="rejected", error=error) == {job_id}
    return job_id


def in_future(seconds: float = 3600) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).isoformat()


def assert_error(result: tuple[int, Any], code: str, exit_code: int = 2) -> None:
    rc, out = result
    assert rc == exit_code, out
    assert set(out) == {"error"} and out["error"]["code"] == code, out
    assert out["error"]["message"]


def test_queues_and_ls_with_filters_and_keyset_pages(core, db, run):
    ids = [publish(core, db, "alpha", task="t.mul" if i % 2 else "t.add",
                   tenant="acme" if i % 2 else "globex") for i in range(5)]
    delayed = publish(core, db, "alpha", eta=in_future())
    beta = [publish(core, db, "beta") for _ in range(2)]
    running = claim(core, db, "alpha", 2)  # ids[0], ids[1]
    assert core.bury(db, [running[0]], reason="rejected") == {ids[0]}

    code, out = run("queues")
    assert code == 0 and out["minutes"] == 5
    by_name = {q["queue"]: q for q in out["queues"]}
    assert set(by_name) == {"alpha", "beta"}
    alpha = by_name["alpha"]
    assert set(alpha) == {"queue", "ready", "delayed", "running", "dead", "paused",
                          "oldest_ready_age", "waiting", "settled", "completed_per_minute",
                          "minutes"}
    assert (alpha["ready"], alpha["delayed"], alpha["running"], alpha["dead"]) == (3, 1, 1, 1)
    assert alpha["paused"] is False and alpha["oldest_ready_age"] >= 0
    assert alpha["settled"] == {"failed": 1}
    assert by_name["beta"]["ready"] == 2
    code, text = run("queues", json_out=False)
    assert code == 0 and text.splitlines()[0].startswith("QUEUE") and "alpha" in text

    def page_ids(*argv: str) -> list[int]:
        rc, page = run("ls", *argv)
        assert rc == 0, page
        return [r["id"] for r in page["items"]]

    live = sorted([*ids[1:], delayed, *beta])
    assert page_ids() == live
    code, page = run("ls", "--limit", "1")
    item = page["items"][0]
    assert {"id", "queue", "state", "task", "priority", "attempts", "max_attempts", "claim",
            "run_at", "created_at", "worker", "lease_expires_at", "cancelled_at", "reason",
            "died_at", "task_id", "tenant", "waiting_on"} == set(item)
    assert page_ids("--state", "dead") == [ids[0]]
    assert page_ids("--state", "running") == [ids[1]]
    assert page_ids("--state", "delayed") == [delayed]
    assert page_ids("--state", "ready,delayed", "--queue", "alpha") == [*ids[2:], delayed]
    assert page_ids("--state", "ready", "--state", "dead") == sorted([ids[0], *ids[2:], *beta])
    assert page_ids("--task", "t.mul") == [ids[1], ids[3]]
    assert page_ids("--tenant", "acme", "--state", "ready,running,dead") == [ids[1], ids[3]]
    assert page_ids("--created-after", "1h") == live
    assert page_ids("--created-before", "1h") == []
    assert page_ids("--created-after", "2000-01-01T00:00:00Z") == live

    seen: list[int] = []
    after: str | None = None
    while True:
        code, page = run("ls", "--limit", "2", *(["--after", after] if after else []))
        seen += [r["id"] for r in page["items"]]
        after = page["next"]
        if after is None:
            break
    assert seen == live, "keyset pages cover everything once, in order"
    code, text = run("ls", "--limit", "2", json_out=False)
    assert code == 0 and f"--after {live[1]}" in text

    assert_error(run("ls", "--state", "bogus"), "PGJ-402")
    assert_error(run("ls", "--queue", "nope"), "PGJ-403")
    assert_error(run("queues", "--queue", "nope"), "PGJ-403")
    assert_error(run("ls", "--after", "abc"), "PGJ-405")
    assert_error(run("ls", "--limit", "0"), "PGJ-405")
    assert_error(run("ls", "--created-after", "yesterday"), "PGJ-405")


def test_show_live_and_dead(core, db, run):
    job = publish(core, db, "alpha", tenant="acme")
    claim(core, db, "alpha")
    dead = kill_dead(core, db, "alpha", error={"type": "ValueError", "message": "boom",
                                               "traceback": "Traceback...\nValueError: boom"})
    code, out = run("show", str(job))
    assert code == 0
    assert out["state"] == "running" and out["worker"] == "cli-test:1"
    assert 0 < out["lease_remaining"] <= 30
    assert out["attempts"] == 1 and out["claim"] == 1 and out["tenant"] == "acme"
    assert out["args"] == "(1, 2)" and out["headers"]["task"] == "t.add"
    assert "body" not in out, "the raw body only when asked"
    assert out["last_error"] is None
    code, out = run("show", str(job), "--body")
    assert out["body"]["args"] == [1, 2]
    code, text = run("show", str(job), json_out=False)
    assert "lease holder: cli-test:1" in text

    code, out = run("dead", "show", str(dead))
    assert code == 0 and out["state"] == "dead" and out["reason"] == "rejected"
    assert out["last_error"]["message"] == "boom"
    code, text = run("dead", "show", str(dead), json_out=False)
    assert "reason:       rejected" in text and "ValueError: boom" in text

    assert_error(run("show", "999999"), "PGJ-401")
    assert_error(run("dead", "show", str(job)), "PGJ-401")
    assert_error(run("show", "abc"), "PGJ-405")
    code, text = run("show", "999999", json_out=False)
    assert code == 2 and "[PGJ-401]" in text


def test_dead_requeue_keeps_id_resets_attempts_notifies_and_is_bounded(
        core, db, run, dsn, schema):
    first = kill_dead(core, db, "alpha")
    more = [kill_dead(core, db, "alpha") for _ in range(4)]
    kill_dead(core, db, "beta")
    code, page = run("dead", "ls", "--queue", "alpha")
    assert code == 0 and [r["id"] for r in page["items"]] == [first, *more]
    assert {"id", "queue", "task", "priority", "claim", "attempts", "max_attempts", "reason",
            "error_type", "error_message", "rule", "created_at", "died_at", "task_id",
            "tenant"} == set(page["items"][0])
    code, text = run("dead", "ls", json_out=False)
    assert "REASON" in text and "rejected" in text

    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "pgjobs.{schema}"')
        code, out = run("dead", "requeue", str(first))
        assert code == 0
        assert out == {"requeued": [{"id": first, "new_id": first, "queue": "alpha"}],
                       "skipped": [], "remaining": 0}
        notes = list(listener.notifies(timeout=5, stop_after=1))
        assert [(n.channel, n.payload) for n in notes] == [(f"pgjobs.{schema}", "alpha")]
    row = db.execute(f'SELECT state, attempts, claim FROM "{schema}".pgjobs_job WHERE id = %s',
                     (first,)).fetchone()
    assert row == ("ready", 0, 1), "same id, attempts reset, fence kept"
    assert core.ack(db, [(first, 1)]) == set(), "the old claim cannot settle the revived row"
    assert claim(core, db, "alpha", 50) == [(first, 2)]

    # All or nothing: an unknown id (or a live one) changes nothing.
    assert_error(run("dead", "requeue", str(more[0]), "999999"), "PGJ-401")
    assert_error(run("dead", "requeue", str(first)), "PGJ-401")
    assert run("dead", "ls", "--queue", "alpha")[1]["items"][0]["id"] == more[0]

    assert_error(run("dead", "requeue", "--all"), "PGJ-404")
    assert_error(run("dead", "requeue", "--all", "--queue", "alpha", "--limit", "0"), "PGJ-404")
    assert_error(run("dead", "requeue", "--all", "--queue", "nope"), "PGJ-403")
    assert_error(run("dead", "requeue", str(more[0]), "--all", "--queue", "alpha"), "PGJ-100")
    code, out = run("dead", "requeue", "--all", "--queue", "alpha", "--limit", "3")
    assert [r["id"] for r in out["requeued"]] == more[:3] and out["remaining"] == 1
    code, text = run("dead", "requeue", "--all", "--queue", "alpha", json_out=False)
    assert code == 0 and text.startswith(f"requeued 1: {more[3]}")

    # An id taken by a live row meanwhile: the dead letter comes back under a fresh id.
    live = publish(core, db, "beta")
    db.execute(f'INSERT INTO "{schema}".pgjobs_dead_letter (id, queue, claim, attempts, reason, '
               "created_at, message) SELECT id, queue, claim, attempts, 'test', created_at, "
               f'message FROM "{schema}".pgjobs_job WHERE id = %s', (live,))
    code, out = run("dead", "requeue", str(live))
    (moved,) = out["requeued"]
    assert moved["id"] == live and moved["new_id"] > live


def test_requeue_cancel_and_purge(core, db, run, schema):
    delayed = publish(core, db, "alpha", eta=in_future())
    ready = publish(core, db, "alpha")
    running_id, running_claim = claim(core, db, "alpha")[0]
    assert running_id == ready
    waiting = [publish(core, db, "alpha") for _ in range(4)]
    dead = kill_dead(core, db, "beta")

    assert_error(run("requeue", str(running_id)), "PGJ-406")
    assert_error(run("requeue", "424242"), "PGJ-401")
    code, out = run("requeue", str(delayed), str(waiting[0]), str(dead))
    assert code == 0
    assert out == {"requeued": [{"id": dead, "new_id": dead, "queue": "beta"}],
                   "made_due": [delayed], "unchanged": [waiting[0]]}
    due = db.execute(f'SELECT run_at <= now() FROM "{schema}".pgjobs_job WHERE id = %s',
                     (delayed,)).fetchone()[0]
    assert due

    def counted(outcome: str) -> int:
        return db.execute(f'SELECT coalesce(sum(n), 0) FROM "{schema}".pgjobs_counter '
                          "WHERE outcome = %s", (outcome,)).fetchone()[0]

    code, out = run("cancel", str(waiting[0]), str(running_id))
    assert out == {"cancelled": [waiting[0]], "marked": [running_id]}
    assert counted("cancelled") == 1
    marked = db.execute(f'SELECT state, cancelled_at IS NOT NULL FROM "{schema}".pgjobs_job '
                        "WHERE id = %s", (running_id,)).fetchone()
    assert marked == ("running", True)
    # its holder's requeue cannot bring it back: a dead letter (cancelled), counted so
    assert core.requeue(db, [(running_id, running_claim)], uncount=False) == {running_id}
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE id = %s',
                      (running_id,)).fetchone()[0] == 0
    assert counted("cancelled") == 2
    kill_dead(core, db, "beta")
    dead_again = db.execute(f'SELECT max(id) FROM "{schema}".pgjobs_dead_letter').fetchone()[0]
    assert_error(run("cancel", str(dead_again)), "PGJ-401")
    assert_error(run("cancel", "777777"), "PGJ-401")
    code, text = run("cancel", str(waiting[1]), json_out=False)
    assert code == 0 and f"cancelled (now dead letters, reason cancelled): {waiting[1]}" in text

    held = claim(core, db, "alpha")  # one running stays untouched by purge
    code, out = run("purge", "alpha", "--limit", "1")
    assert out == {"queue": "alpha", "purged": 1, "remaining": 1, "running": 1}
    code, text = run("purge", "alpha", json_out=False)
    assert code == 0 and "purged 1" in text and "1 running" in text
    assert counted("purged") == 2
    assert db.execute(f'SELECT id FROM "{schema}".pgjobs_job WHERE queue = %s',
                      ("alpha",)).fetchall() == [(held[0][0],)]
    assert_error(run("purge", "nope"), "PGJ-403")
    assert_error(run("purge", "alpha", "--limit", "100001"), "PGJ-404")


def test_pause_resume_upserts_the_queue_and_claims_skip_it(core, db, run, dsn, schema):
    job = publish(core, db, "gamma")  # never declared: no pgjobs_queue row
    code, out = run("pause", "gamma")
    assert (code, out) == (0, {"queue": "gamma", "paused": True})
    assert core.claim(db, ["gamma"], 5).claimed == []
    code, out = run("queues", "--queue", "gamma")
    assert out["queues"][0]["paused"] is True and out["queues"][0]["ready"] == 1
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "pgjobs.{schema}"')
        code, text = run("resume", "gamma", json_out=False)
        assert (code, text.strip()) == (0, "queue gamma: resumed")
        notes = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.payload for n in notes] == ["gamma"], "resume wakes idle consumers"
    assert [c.id for c in core.claim(db, ["gamma"], 5).claimed] == [job]
    assert_error(run("pause", "nope"), "PGJ-403")
    assert_error(run("resume", "nope"), "PGJ-403")
    code, out = run("pause", "incoming", "--create")
    assert out == {"queue": "incoming", "paused": True}


def _metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_workers_and_metrics(core, db, run, schema):
    publish(core, db, "alpha")
    mine = claim(core, db, "alpha")
    core.maintain(db, consumed=["alpha"], grace=30, held=1)
    ghost = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="ghost:2")
    publish(core, db, "alpha")
    theirs = [(c.id, c.claim) for c in ghost.claim(db, ["alpha"], 1).claimed]
    publish(core, db, 'we"ird\\q')

    code, out = run("workers")
    by = {w["worker"]: w for w in out["workers"]}
    assert set(by) == {"cli-test:1", "ghost:2"}
    me = by["cli-test:1"]
    assert me["alive"] is True and me["queues"] == ["alpha"] and me["running"] == 1
    assert [lease["id"] for lease in me["leases"]] == [mine[0][0]]
    assert 0 < me["leases"][0]["lease_remaining"] <= 30
    assert by["ghost:2"]["alive"] is False and by["ghost:2"]["running"] == 1
    assert [lease["id"] for lease in by["ghost:2"]["leases"]] == [theirs[0][0]]
    code, text = run("workers", json_out=False)
    assert code == 0 and "ghost:2" in text and "LEASE ENDS IN" in text

    core.ack(db, mine)
    code, text = run("metrics", json_out=False)
    assert code == 0
    for name in ("pgjobs_up", "pgjobs_messages", "pgjobs_oldest_ready_age_seconds",
                 "pgjobs_dead_letters", "pgjobs_queue_paused", "pgjobs_settled_total",
                 "pgjobs_consumers", "pgjobs_orphaned_leases"):
        assert f"# TYPE {name} " in text and f"# HELP {name} " in text
    values = _metrics(text)
    assert values["pgjobs_up"] == 1
    assert values['pgjobs_messages{queue="alpha",state="running"}'] == 1
    assert values['pgjobs_settled_total{queue="alpha",outcome="completed"}'] == 1
    assert values['pgjobs_messages{queue="we\\"ird\\\\q",state="ready"}'] == 1
    assert values["pgjobs_consumers"] == 1 and values["pgjobs_orphaned_leases"] == 1
    assert re.search(r"^# TYPE pgjobs_settled_total counter$", text, re.M)
    code, out = run("metrics")
    names = {m["name"] for m in out["metrics"]}
    assert "pgjobs_settled_total" in names
    sample = next(m for m in out["metrics"] if m["name"] == "pgjobs_messages")["samples"][0]
    assert set(sample) == {"labels", "value"} and set(sample["labels"]) == {"queue", "state"}


def test_prune_and_dead_purge_in_bounded_batches(core, db, run, schema):
    old = [kill_dead(core, db, "alpha") for _ in range(3)]
    recent = kill_dead(core, db, "alpha")
    db.execute(f"UPDATE \"{schema}\".pgjobs_dead_letter SET died_at = now() - interval '8 days' "
               "WHERE id = ANY(%s)", (old,))
    for days, n in ((10, 5), (9, 2), (8, 1)):
        db.execute(f'INSERT INTO "{schema}".pgjobs_counter (queue, outcome, bucket, shard, n) '
                   "VALUES ('alpha', 'acked', date_trunc('minute', now()) - make_interval("
                   "days => %s), 'old', %s)", (days, n))

    def total() -> float:
        code, text = run("metrics", json_out=False)
        assert code == 0
        return _metrics(text)['pgjobs_settled_total{queue="alpha",outcome="completed"}']

    assert total() == 8
    code, out = run("prune", "--older-than", "7d", "--dry-run")
    assert out["dry_run"] is True
    assert out["dead_letters"]["matched"] == 3 and out["dead_letters"]["deleted"] == 0
    assert out["counter_buckets"]["matched"] == 3 and out["counter_buckets"]["folded"] == 0
    code, text = run("prune", "--older-than", "7d", "--dry-run", json_out=False)
    assert "would delete 3 dead letters" in text
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 4

    code, out = run("prune", "--older-than", "7d", "--batch", "1", "--limit", "2")
    assert out["dead_letters"] | {"cutoff": None} == {
        "cutoff": None, "matched": 3, "deleted": 2, "remaining": 1}
    assert out["counter_buckets"]["folded"] == 2 and out["counter_buckets"]["remaining"] == 1
    assert total() == 8, "folding keeps the totals"
    code, out = run("prune", "--older-than", "7d")
    assert out["dead_letters"]["deleted"] == 1 and out["counter_buckets"]["folded"] == 1
    assert total() == 8
    rollup = db.execute(f"SELECT n FROM \"{schema}\".pgjobs_counter WHERE shard = 'rollup' "
                        "AND bucket = '-infinity'").fetchall()
    assert rollup == [(8,)]
    remaining = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".pgjobs_dead_letter')]
    assert remaining == [recent]

    another = kill_dead(core, db, "beta")
    code, out = run("dead", "purge", "--older-than", "1h", "--dry-run")
    assert out["matched"] == 0 and out["purged"] == 0
    code, out = run("dead", "purge", "--queue", "beta", "--dry-run")
    assert out["matched"] == 1 and out["purged"] == 0
    code, out = run("dead", "purge", str(recent), str(another))
    assert code == 0 and (out["matched"], out["purged"], out["remaining"]) == (2, 2, 0)
    assert_error(run("dead", "purge"), "PGJ-404")
    assert_error(run("dead", "purge", "424242"), "PGJ-401")
    assert_error(run("prune", "--older-than", "7 days"), "PGJ-405")
    assert_error(run("prune", "--older-than", "7d", "--batch", "0"), "PGJ-404")


def test_configuration_errors_and_database_errors(capsys, dsn, url, monkeypatch):
    for var in ("PGJOBS_DSN", "CELERY_BROKER_URL", "BROKER_URL"):
        monkeypatch.delenv(var, raising=False)
    assert cli(["queues", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-100"
    missing = f"pgjt_missing_{uuid.uuid4().hex[:8]}"
    assert cli(["queues", "--dsn", url, "--schema", missing, "--json"]) == 3
    err = json.loads(capsys.readouterr().out)["error"]
    assert err["code"] == "PGJ-701" and "pgjobs migrate" in err["message"]
    assert cli(["queues", "--dsn", "pgjobs://postgres@127.0.0.1:1/test", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-104"
    assert cli(["nosuchcommand"]) == 2
    assert cli(["show"]) == 2, "usage errors exit 2 too"


def test_metrics_per_tenant_are_bounded_to_the_busiest(core, db, run):
    for tenant, n in (("acme", 3), ("globex", 2), ("initech", 1)):
        for _ in range(n):
            publish(core, db, "alpha", tenant=tenant)
    publish(core, db, "alpha")  # no tenant: not counted
    claim(core, db, "alpha")  # the oldest: one of acme's
    code, text = run("metrics", "--tenants", "2", json_out=False)
    assert code == 0, text
    values = _metrics(text)
    assert values['pgjobs_tenant_messages{tenant="acme",state="running"}'] == 1
    assert values['pgjobs_tenant_messages{tenant="acme",state="ready"}'] == 2
    assert values['pgjobs_tenant_messages{tenant="globex",state="ready"}'] == 2
    assert not any("initech" in name for name in values), "only the 2 busiest get samples"
    assert values["pgjobs_tenants"] == 3
    code, text = run("metrics", "--tenants", "0", json_out=False)
    assert code == 0 and "pgjobs_tenant" not in text
    code, out = run("metrics", "--tenants", "-1")
    assert code == 2 and out["error"]["code"] == "PGJ-405"


def test_console_script_and_metrics_server(core, db, schema, url):
    publish(core, db, "alpha")
    env = {**os.environ, "PGJOBS_DSN": url, "PGJOBS_SCHEMA": schema}
    done = subprocess.run([PGJOBS, "queues", "--json"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["queues"][0]["ready"] == 1
    done = subprocess.run([PGJOBS, "show", "999999", "--json"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert json.loads(done.stdout)["error"]["code"] == "PGJ-401"
    done = subprocess.run([PGJOBS, "ls", "--state", "nope"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "[PGJ-402]" in done.stderr

    server = subprocess.Popen([PGJOBS, "metrics", "--serve", "0"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline() if server.stdout else ""
        found = re.search(r"http://127\.0\.0\.1:\d+/metrics", line)
        assert found, (line, server.stderr.read() if server.poll() is not None else "")
        with urllib.request.urlopen(found.group(0), timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            body = resp.read().decode()
        assert "pgjobs_up 1" in body
        assert 'pgjobs_messages{queue="alpha",state="ready"} 1' in body
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(found.group(0).replace("/metrics", "/nope"), timeout=10)
        assert err.value.code == 404
    finally:
        server.terminate()
        server.wait(10)
