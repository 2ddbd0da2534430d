"""`pgjobs webhooks ...` and `pgjobs prune --webhook-attempts-older-than` on a real schema.

The ledger rows are written by the same statement the delivery task uses
(WebhookStore.record_attempt); the CLI runs in this process (its main()) and its output is
parsed, or searched for the secret.
"""

from __future__ import annotations

import io
import json
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.schema import migrate
from kombu_pgjobs.store.webhooks import WebhookStore

SECRET = "cli-secret-" + "Yp4wQ7nL2s"


@pytest.fixture
def migrated(db: psycopg.Connection[Any], schema: str) -> str:
    migrate(db, schema)
    return schema


def run(capsys: Any, url: str, schema: str, *argv: str, code: int = 0,
        as_json: bool = True) -> Any:
    capsys.readouterr()
    got = cli([*argv, "--dsn", url, "--schema", schema, *(["--json"] if as_json else [])])
    out, err = capsys.readouterr()
    assert got == code, (out, err)
    assert SECRET not in out and SECRET not in err
    return json.loads(out) if as_json else out + err


def attempt(store: WebhookStore, endpoint: int, n: int, **kw: Any) -> dict[str, Any]:
    row = {"endpoint_id": endpoint, "event_id": f"evt_{n}", "event_type": "ping",
           "task_id": None, "attempt": 1, "status": 500, "latency_ms": 12.5,
           "outcome": "failed", "error": "HTTP 500", "excerpt": "boom", "location": None,
           "retry_after": None, "delay": None, **kw}
    return store.record_attempt(row, effect="count" if row["outcome"] == "failed" else "reset",
                                disable_after=3)


def test_webhooks_commands(db, migrated, url, capsys, monkeypatch):
    schema = migrated
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    added = run(capsys, url, schema, "webhooks", "add", "https://hooks.example/in",
                "--secret-env", "HOOK_SECRET", "--description", "shop", "--disable-after", "3")
    ep = added["id"]
    assert added["secret"] == "********" and added["enabled"] is True
    stored = db.execute(f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint WHERE id = %s',
                        (ep,)).fetchone()
    assert stored == (SECRET,), "the secret was stored as given"

    monkeypatch.setattr("sys.stdin", io.StringIO(SECRET + "\n"))
    second = run(capsys, url, schema, "webhooks", "add", "https://b.example/", "--secret-stdin")
    assert second["id"] == ep + 1

    store = WebhookStore(db, schema)
    first = attempt(store, ep, 1)
    assert (first["consecutive_failures"], first["enabled"]) == (1, True)
    attempt(store, ep, 2)
    third = attempt(store, ep, 3, status=302, location="https://elsewhere.example/")
    assert (third["consecutive_failures"], third["enabled"], third["disabled_now"]) == \
        (3, False, True)

    listed = run(capsys, url, schema, "webhooks", "ls")["items"]
    assert [(r["id"], r["enabled"], r["consecutive_failures"], r["last_status"]) for r in
            listed] == [(ep, False, 3, 302), (ep + 1, True, 0, None)]
    assert all(r["secret"] == "********" for r in listed)
    shown = run(capsys, url, schema, "webhooks", "show", str(ep))
    assert shown["disabled_reason"] == "failures" and shown["description"] == "shop"
    page = run(capsys, url, schema, "webhooks", "attempts", str(ep), "--limit", "2")
    assert [r["event_id"] for r in page["items"]] == ["evt_3", "evt_2"]
    assert page["items"][0]["location"] == "https://elsewhere.example/"
    rest = run(capsys, url, schema, "webhooks", "attempts", str(ep), "--before", page["next"])
    assert [r["event_id"] for r in rest["items"]] == ["evt_1"] and rest["next"] is None

    enabled = run(capsys, url, schema, "webhooks", "enable", str(ep))
    assert enabled == {"id": ep, "enabled": True, "disabled_reason": None}
    row = db.execute(f'SELECT consecutive_failures FROM "{schema}".pgjobs_webhook_endpoint '
                     "WHERE id = %s", (ep,)).fetchone()
    assert row == (0,)
    assert run(capsys, url, schema, "webhooks", "disable", str(ep))["disabled_reason"] == \
        "operator"

    monkeypatch.setenv("NEW_SECRET", SECRET + "-2")
    run(capsys, url, schema, "webhooks", "rotate", str(ep), "--secret-env", "NEW_SECRET")
    monkeypatch.setenv("SHORT", "short")
    bad = run(capsys, url, schema, "webhooks", "rotate", str(ep), "--secret-env", "SHORT",
              code=2)
    assert bad["error"]["code"] == "PGJ-801"
    stored = db.execute(f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint WHERE id = %s',
                        (ep,)).fetchone()
    assert stored == (SECRET + "-2",), "rotated once; the short one was refused"

    text = run(capsys, url, schema, "webhooks", "show", str(ep), as_json=False)
    assert "disabled (operator)" in text and "********" in text
    text = run(capsys, url, schema, "webhooks", "attempts", str(ep), as_json=False)
    assert "evt_3" in text and "https://elsewhere.example/" in text
    assert "shop" in run(capsys, url, schema, "webhooks", "ls", as_json=False)


def test_webhooks_commands_refuse_bad_input(db, migrated, url, capsys, monkeypatch):
    schema = migrated
    monkeypatch.setenv("SHORT", "short")
    monkeypatch.setenv("HOOK_SECRET", SECRET)
    cases = [
        (("webhooks", "show", "999"), 2, "PGJ-802"),
        (("webhooks", "enable", "999"), 2, "PGJ-802"),
        (("webhooks", "attempts", "999"), 2, "PGJ-802"),
        (("webhooks", "show", "abc"), 2, "PGJ-405"),
        (("webhooks", "add", "https://a.example/"), 2, "PGJ-801"),
        (("webhooks", "add", "https://a.example/", "--secret-env", "SHORT"), 2, "PGJ-801"),
        (("webhooks", "add", "https://a.example/", "--secret-env", "UNSET_VAR_X"), 2,
         "PGJ-801"),
        (("webhooks", "add", "ftp://a.example/", "--secret-env", "HOOK_SECRET"), 2, "PGJ-801"),
        (("webhooks", "add", "https://a.example/", "--secret-env", "HOOK_SECRET",
          "--disable-after", "0"), 2, "PGJ-801"),
        (("webhooks", "add", "https://a.example/", "--secret", SECRET), 2, "PGJ-408"),
        (("webhooks", "ls", "--limit", "0"), 2, "PGJ-405"),
    ]
    for argv, code, expected in cases:
        out = run(capsys, url, schema, *argv, code=code)
        assert out["error"]["code"] == expected, (argv, out)
    count = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_webhook_endpoint').fetchone()
    assert count == (0,), "nothing was written"


def test_prune_deletes_old_ledger_rows(db, migrated, url, capsys):
    schema = migrated
    store = WebhookStore(db, schema)
    ep = store.add("https://a.example/", SECRET)
    for n in range(5):
        attempt(store, ep, n, outcome="delivered", status=200, error=None)
    db.execute(f'UPDATE "{schema}".pgjobs_webhook_attempt SET finished_at = now() - '
               "interval '40 days' WHERE event_id IN ('evt_0', 'evt_1', 'evt_2')")
    dry = run(capsys, url, schema, "prune", "--older-than", "7d",
              "--webhook-attempts-older-than", "30d", "--dry-run")
    assert dry["webhook_attempts"]["matched"] == 3 and dry["webhook_attempts"]["deleted"] == 0
    done = run(capsys, url, schema, "prune", "--older-than", "7d",
               "--webhook-attempts-older-than", "30d", "--batch", "2")
    assert done["webhook_attempts"] == {**done["webhook_attempts"], "matched": 3, "deleted": 3,
                                        "remaining": 0}
    left = db.execute(f'SELECT event_id FROM "{schema}".pgjobs_webhook_attempt ORDER BY id')
    assert [r[0] for r in left.fetchall()] == ["evt_3", "evt_4"]
    assert "dead_letters" in done, "the rest of prune ran as before"
    plain = run(capsys, url, schema, "prune", "--older-than", "7d")
    assert "webhook_attempts" not in plain
    db.execute(f'UPDATE "{schema}".pgjobs_webhook_attempt SET finished_at = now() - '
               "interval '2 days'")
    text = run(capsys, url, schema, "prune", "--older-than", "7d",
               "--webhook-attempts-older-than", "1d", as_json=False)
    assert "deleted 2 webhook attempts" in text


def test_a_success_never_reenables_a_disabled_endpoint(db, migrated):
    """A delivery already in flight when its endpoint was disabled may still succeed: it
    clears the failure count, but only an operator turns the endpoint back on."""
    store = WebhookStore(db, migrated)
    ep = store.add("https://a.example/", SECRET, disable_after=1)
    assert attempt(store, ep, 1)["disabled_now"] is True
    late = attempt(store, ep, 2, outcome="delivered", status=200, error=None)
    assert (late["enabled"], late["consecutive_failures"], late["disabled_now"]) == \
        (False, 0, False)
    assert attempt(store, ep, 3)["disabled_now"] is False, "already disabled: not again"
    row = db.execute(f'SELECT enabled, disabled_reason FROM "{migrated}".'
                     "pgjobs_webhook_endpoint WHERE id = %s", (ep,)).fetchone()
    assert row == (False, "failures")
    assert store.set_enabled(ep, True)["enabled"] is True


def test_the_cli_does_not_import_celery_or_httpx():
    """kombu_pgjobs depends on kombu and psycopg only: the webhooks commands included."""
    import subprocess
    import sys

    code = ("import sys; from kombu_pgjobs.ops.cli.main import build_parser; build_parser(); "
            "import kombu_pgjobs.store.webhooks; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'celery', 'celery_ext', 'httpx', 'httpcore'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
