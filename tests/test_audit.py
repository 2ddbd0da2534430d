"""The audit log (issue 34): every write of the ``pgjobs`` CLI and of the dashboard leaves one
row saying who (OS user and host; the dashboard's session or bearer token and the client's
address), what (the action and its exact filter or ids), how many rows, and when; read back
from ``pgjobs_audit`` and through ``pgjobs audit``. A refused or dry-run command records
nothing; the dashboard's row commits with its action or not at all."""

from __future__ import annotations

import getpass
import json
import re
import socket
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from cryptography.fernet import Fernet

from kombu_pgjobs.ops.cli.main import AUDITED
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.scheduling import EntryDef, ScheduleStore
from kombu_pgjobs.store.webhooks import WebhookStore
from tests import test_dashboard
from tests.test_cli import in_future, kill_dead, publish
from tests.test_dashboard import SECRET, TOKEN, seeded, sign_in
from tests.test_roles import roles  # noqa: F401  (the fixture)

#: the dashboard tests' fixtures: a migrated schema's QueueCore, and an app maker
core = test_dashboard.core
client = test_dashboard.client

Setup = Callable[[QueueCore, psycopg.Connection[Any]], dict[str, Any]]


def rows(db: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    cur = db.execute(f'SELECT origin, actor, host, action, target, rows, at FROM "{schema}"'
                     ".pgjobs_audit ORDER BY id")
    names = [d.name for d in cur.description or ()]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def run_cli(capsys: Any, url: str, schema: str, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli([*argv, "--dsn", url, "--schema", schema, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def _dead_two(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    return {"a": kill_dead(core, db, "alpha"), "b": kill_dead(core, db, "alpha")}


def _ready(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    return {"a": publish(core, db, "alpha"), "b": publish(core, db, "alpha")}


def _delayed(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    return {"a": publish(core, db, "alpha", eta=in_future()),
            "b": publish(core, db, "alpha", eta=in_future())}


def _entry(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    ScheduleStore(core.schema).add(db, EntryDef("nightly", "app.report", "every 1h", "UTC",
                                                [], {}, {}))
    return {}


def _hook(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    return {"hook": WebhookStore(db, core.schema).add("https://example.com/h", SECRET)}


def _old_dead(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    ids = _dead_two(core, db)
    db.execute(f'UPDATE "{core.schema}".pgjobs_dead_letter SET died_at = now() - '
               "interval '40 days'")
    return ids


#: command -> (setup, argv from the setup's ids, rows changed, target keys and values)
CLI_CASES: dict[str, tuple[Setup, Callable[[dict[str, Any]], list[str]], int,
                           dict[str, Any]]] = {
    "dead requeue": (_dead_two, lambda s: ["dead", "requeue", str(s["a"]), str(s["b"])], 2,
                     {"ids": "{a},{b}"}),
    "dead purge": (_dead_two, lambda s: ["dead", "purge", "--queue", "alpha"], 2,
                   {"queue": "alpha"}),
    "requeue": (_delayed, lambda s: ["requeue", str(s["a"])], 1, {"ids": "{a}"}),
    "cancel": (_ready, lambda s: ["cancel", str(s["a"]), str(s["b"])], 2, {"ids": "{a},{b}"}),
    "purge": (_ready, lambda s: ["purge", "alpha"], 2, {"queue": "alpha"}),
    "pause": (_ready, lambda s: ["pause", "alpha"], 1, {"queue": "alpha"}),
    "resume": (_ready, lambda s: ["resume", "alpha"], 1, {"queue": "alpha"}),
    "prune": (_old_dead, lambda s: ["prune", "--older-than", "30d"], 2,
              {"older_than": "30d"}),
    "bulk promote": (_delayed, lambda s: ["bulk", "promote", "--queue", "alpha"], 2,
                     {"queue": "alpha"}),
    "bulk requeue": (_dead_two, lambda s: ["bulk", "requeue", "--queue", "alpha"], 2,
                     {"queue": "alpha"}),
    "bulk remove": (_ready, lambda s: ["bulk", "remove", "--queue", "alpha"], 2,
                    {"queue": "alpha"}),
    "webhooks add": (lambda c, d: {}, lambda s: ["webhooks", "add", "https://example.com/x",
                                                  "--secret-env", "AUDIT_HOOK_SECRET"], 1,
                     {"url": "https://example.com/x"}),
    "webhooks rotate": (_hook, lambda s: ["webhooks", "rotate", str(s["hook"]),
                                          "--secret-env", "AUDIT_HOOK_SECRET"], 1,
                        {"id": "{hook}"}),
    "webhooks reseal": (_hook, lambda s: ["webhooks", "reseal"], 1, {}),
    "webhooks enable": (_hook, lambda s: ["webhooks", "enable", str(s["hook"])], 1,
                        {"id": "{hook}"}),
    "webhooks disable": (_hook, lambda s: ["webhooks", "disable", str(s["hook"])], 1,
                         {"id": "{hook}"}),
    "schedule add": (lambda c, d: {}, lambda s: ["schedule", "add", "nightly", "app.report",
                                                  "every 1h"], 1,
                     {"name": "nightly", "task": "app.report"}),
    "schedule pause": (_entry, lambda s: ["schedule", "pause", "nightly"], 1,
                       {"name": "nightly"}),
    "schedule resume": (_entry, lambda s: ["schedule", "resume", "nightly"], 1,
                        {"name": "nightly"}),
    "schedule remove": (_entry, lambda s: ["schedule", "remove", "nightly"], 1,
                        {"name": "nightly"}),
    "outbox prune": (lambda c, d: {}, lambda s: ["outbox", "prune", "--older-than", "1d"], 0,
                     {"older_than": "1d"}),
}


def test_every_write_command_has_a_case():
    assert sorted(CLI_CASES) == sorted(AUDITED)


def _text(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


@pytest.mark.parametrize("command", sorted(CLI_CASES))
def test_cli_writes_are_audited(command, core, db, schema, url, capsys, monkeypatch):
    setup, argv, changed, target = CLI_CASES[command]
    monkeypatch.setenv("AUDIT_HOOK_SECRET", SECRET)
    monkeypatch.setenv("PGJOBS_WEBHOOK_SECRET_KEYS", Fernet.generate_key().decode())
    ids = setup(core, db)
    code, out = run_cli(capsys, url, schema, *argv(ids))
    assert code == 0, out
    found = rows(db, schema)
    assert len(found) == 1, found
    row = found[0]
    assert (row["origin"], row["actor"], row["host"], row["action"]) == (
        "cli", getpass.getuser(), socket.gethostname(), command)
    if changed is not None:
        assert row["rows"] == changed
    for key, value in target.items():
        assert _text(row["target"][key]) == value.format(**ids), (key, row["target"])
    assert not any("secret" in k or "dsn" in k for k in row["target"]), row["target"]
    assert SECRET not in json.dumps(row["target"])
    assert row["at"] is not None


def test_refused_and_dry_run_commands_record_nothing(core, db, schema, url, capsys):
    _dead_two(core, db)
    code, out = run_cli(capsys, url, schema, "dead", "purge", "--queue", "alpha", "--dry-run")
    assert code == 0 and out["matched"] == 2
    code, out = run_cli(capsys, url, schema, "requeue", "999999")
    assert code != 0 and out["error"]["code"]
    code, out = run_cli(capsys, url, schema, "prune", "--older-than", "1d", "--dry-run")
    assert code == 0
    assert rows(db, schema) == []


def test_pgjobs_audit_lists_newest_first_in_pages(core, db, schema, url, capsys):
    publish(core, db, "alpha")
    for command in (["pause", "alpha"], ["resume", "alpha"], ["pause", "alpha"]):
        assert run_cli(capsys, url, schema, *command)[0] == 0
    code, page = run_cli(capsys, url, schema, "audit", "--limit", "2")
    assert code == 0
    assert [r["action"] for r in page["items"]] == ["pause", "resume"]
    assert page["items"][0]["id"] > page["items"][1]["id"] and page["next"]
    code, rest = run_cli(capsys, url, schema, "audit", "--before", page["next"])
    assert [r["action"] for r in rest["items"]] == ["pause"]
    capsys.readouterr()
    assert cli(["audit", "--dsn", url, "--schema", schema]) == 0
    text = capsys.readouterr().out
    assert "ACTION" in text and "resume" in text and f"cli:{getpass.getuser()}@" in text
    code, bad = run_cli(capsys, url, schema, "audit", "--limit", "0")
    assert code == 2 and bad["error"]["code"] == "PGJ-405"


#: dashboard action -> (path from the seeded ids, form fields, audit action, rows changed,
#: target keys)
DASH_CASES: dict[str, tuple[Callable[[dict[str, Any]], str], dict[str, str], str, int,
                            dict[str, Any]]] = {
    "pause": (lambda s: "/queues/alpha/pause", {}, "pause", 1, {"name": "alpha"}),
    "resume": (lambda s: "/queues/alpha/resume", {}, "resume", 1, {"name": "alpha"}),
    "purge": (lambda s: "/queues/beta/purge", {"limit": "1000"}, "purge", 2,
              {"name": "beta"}),
    "requeue": (lambda s: f"/messages/{s['delayed']}/requeue", {}, "requeue", 1,
                {"id": "{delayed}"}),
    "cancel": (lambda s: f"/messages/{s['ready']}/cancel", {}, "cancel", 1,
               {"id": "{ready}"}),
    "dead requeue one": (lambda s: f"/dead/{s['dead']}/requeue", {}, "dead requeue", 1,
                         {"id": "{dead}"}),
    "dead purge one": (lambda s: f"/dead/{s['dead']}/purge", {}, "dead purge", 1,
                       {"id": "{dead}"}),
    "dead requeue bulk": (lambda s: "/dead/requeue", {"queue": "alpha", "ids": "{dead}"},
                          "dead requeue", 1, {"queue": "alpha", "ids": "{dead}"}),
    "dead purge bulk": (lambda s: "/dead/purge", {"queue": "alpha", "ids": "{dead}"},
                        "dead purge", 1, {"queue": "alpha", "ids": "{dead}"}),
    "schedule pause": (lambda s: "/schedules/nightly/report/pause", {}, "schedule pause", 1,
                       {"name": "nightly/report"}),
    "schedule resume": (lambda s: "/schedules/held/resume", {}, "schedule resume", 1,
                        {"name": "held"}),
    "webhooks enable": (lambda s: f"/webhooks/{s['off_hook']}/enable", {}, "webhooks enable",
                        1, {"id": "{off_hook}"}),
    "webhooks disable": (lambda s: f"/webhooks/{s['hook']}/disable", {}, "webhooks disable",
                         1, {"id": "{hook}"}),
    # the lists' checkboxes: the exact ids selected
    "dead requeue selected": (lambda s: "/dead/selected/requeue", {"ids": "{dead}"},
                              "dead requeue", 1, {"ids": "{dead}"}),
    "dead purge selected": (lambda s: "/dead/selected/purge", {"ids": "{dead}"},
                            "dead purge", 1, {"ids": "{dead}"}),
    "requeue selected": (lambda s: "/messages/selected/requeue", {"ids": "{delayed}"},
                         "requeue", 1, {"ids": "{delayed}"}),
    "cancel selected": (lambda s: "/messages/selected/cancel", {"ids": "{ready}"},
                        "cancel", 1, {"ids": "{ready}"}),
    "schedule run": (lambda s: "/schedules/nightly/report/run", {}, "schedule run", 1,
                     {"name": "nightly/report"}),
}


def test_every_dashboard_action_has_a_case(client):
    c = client(write=True, token=TOKEN)
    posts = {r.path for r in c.app.routes if "POST" in (getattr(r, "methods", None) or ())}
    posts -= {"/login", "/logout"}
    covered = {"/queues/{name:path}/pause", "/queues/{name:path}/resume",
               "/queues/{name:path}/purge", "/messages/{id}/requeue", "/messages/{id}/cancel",
               "/dead/{id}/requeue", "/dead/{id}/purge", "/dead/requeue", "/dead/purge",
               "/schedules/{name:path}/pause", "/schedules/{name:path}/resume",
               "/webhooks/{id}/enable", "/webhooks/{id}/disable", "/dead/selected/requeue",
               "/dead/selected/purge", "/messages/selected/requeue",
               "/messages/selected/cancel", "/schedules/{name:path}/run"}
    assert posts == covered


@pytest.mark.parametrize("how", ["session", "bearer"])
@pytest.mark.parametrize("case", sorted(DASH_CASES))
def test_dashboard_actions_are_audited(case, how, core, db, client, schema):
    s = seeded(core, db)
    path, fields, action, changed, target = DASH_CASES[case]
    c = client(write=True, token=TOKEN)
    form = {k: v.format(**s) for k, v in fields.items()}
    headers: dict[str, str] = {}
    if how == "session":
        form["csrf"] = sign_in(c)
    else:
        headers["Authorization"] = f"Bearer {TOKEN}"
    r = c.post(path(s), data={**form, "confirm": "yes"}, headers=headers)
    assert r.status_code == 200, r.text
    found = rows(db, schema)
    assert len(found) == 1, found
    row = found[0]
    assert (row["origin"], row["actor"], row["action"], row["rows"]) == (
        "dashboard", how, action, changed)
    assert row["host"] == "testclient"
    for key, value in target.items():
        assert str(row["target"][key]) == value.format(**s), (key, row["target"])
    assert "csrf" not in row["target"] and "confirm" not in row["target"]
    page = c.get("/audit", headers=headers).text
    assert '<tr data-id="' in page and action in page


def test_a_refused_dashboard_action_records_nothing(core, db, client, schema):
    s = seeded(core, db)
    c = client(write=True, token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = c.post(f"/messages/{s['running']}/requeue", data={"confirm": "yes"}, headers=headers)
    assert r.status_code >= 400
    r = c.post("/queues/alpha/pause", data={"confirm": "yes"},
               headers={"Authorization": "Bearer wrong-token-wrong-token-1"})
    assert r.status_code == 403
    r = c.post("/queues/alpha/pause", data={})  # no token at all
    assert r.status_code in (401, 403)
    assert rows(db, schema) == []


def test_the_audit_page_is_listed_and_paged(core, db, client, schema):
    c = client()
    assert 'href="/audit"' in c.get("/").text
    for i in range(52):
        db.execute(f'INSERT INTO "{schema}".pgjobs_audit (origin, actor, host, action, target, '
                   "rows) VALUES ('cli', 'ops', 'h', %s, '{}', 1)", (f"act{i:02d}",))
    page = c.get("/audit").text
    assert page.index("act51") < page.index("act50") < page.index("act02")
    assert "act01" not in page  # 50 a page
    older = re.search(r'href="(/audit\?before=\d+)"', page).group(1)
    rest = c.get(older).text
    assert "act01" in rest and "act00" in rest and "act02" not in rest
    assert 'href="/audit?before=' not in rest
    assert c.get("/audit?before=x").status_code == 404


def test_requeue_from_step_records_the_step(core, db, schema, url, capsys):
    ids = _delayed(core, db)
    db.execute(f'INSERT INTO "{schema}".pgjobs_step (task_id, name, kind, state, job_id, claim) '
               "SELECT message -> 'headers' ->> 'id', 'charge', 'run', 'done', id, 0 "
               f'FROM "{schema}".pgjobs_job WHERE id = %s', (ids["a"],))
    code, out = run_cli(capsys, url, schema, "requeue", str(ids["a"]), "--from-step", "charge")
    assert code == 0, out
    (row,) = rows(db, schema)
    assert row["action"] == "requeue" and row["target"]["from_step"] == "charge"
    assert row["target"]["ids"] == [str(ids["a"])]


def test_the_operator_role_records_and_a_missing_grant_is_said_not_fatal(roles, db, capsys):  # noqa: F811
    """As the operator's role, a CLI write records itself (INSERT on pgjobs_audit); without
    that grant (roles not applied again after the migration) the change stands, exit 0, and
    stderr says it was not recorded."""
    schema = roles.schema
    db.execute(f'INSERT INTO "{schema}".pgjobs_queue (name) VALUES (%s)', ("alpha",))
    assert cli(["pause", "alpha", "--dsn", roles.url("op"), "--schema", schema]) == 0
    assert [r["action"] for r in rows(db, schema)] == ["pause"]
    db.execute(f'REVOKE INSERT ON "{schema}".pgjobs_audit FROM "{roles.groups["operator"]}"')
    capsys.readouterr()
    assert cli(["resume", "alpha", "--dsn", roles.url("op"), "--schema", schema]) == 0
    err = capsys.readouterr().err
    assert "not recorded in the audit log" in err
    paused = db.execute(f'SELECT paused FROM "{schema}".pgjobs_queue WHERE name = %s',
                        ("alpha",)).fetchone()[0]
    assert paused is False
    assert [r["action"] for r in rows(db, schema)] == ["pause"]


def test_a_schema_before_the_audit_log_keeps_every_write_working(core, db, client, schema,
                                                                  url, capsys):
    """On schema version 23 (no pgjobs_audit): the writes work and record nothing, the audit
    page and `pgjobs audit` say to migrate (PGJ-701); once migrated they work."""
    from kombu_pgjobs.store.schema import migrate

    s = seeded(core, db)
    db.execute(f'DROP TABLE "{schema}".pgjobs_audit')
    db.execute(f'DELETE FROM "{schema}".pgjobs_migration WHERE version = 24')
    c = client(write=True, token=TOKEN)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    r = c.post("/queues/alpha/pause", data={"confirm": "yes"}, headers=headers)
    assert r.status_code == 200
    r = c.get("/audit", headers=headers)
    assert r.status_code == 503 and "PGJ-701" in r.text
    assert run_cli(capsys, url, schema, "resume", "alpha")[0] == 0
    code, out = run_cli(capsys, url, schema, "audit")
    assert code != 0 and out["error"]["code"] == "PGJ-701"
    assert s["dead"]
    migrate(db, schema)
    assert c.get("/audit", headers=headers).status_code == 200
    assert run_cli(capsys, url, schema, "pause", "alpha")[0] == 0
    assert [r["action"] for r in rows(db, schema)] == ["pause"]
