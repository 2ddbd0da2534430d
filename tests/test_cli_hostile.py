"""The `pgjobs` CLI against hostile input, driven as an operator runs it: the real console script
in a subprocess, against a real schema.

- A NUL (or a lone surrogate) in a message header: Postgres refuses to parse such a json
  document, and one such message used to make `pgjobs ls` fail for every queue. Every command
  that lists or shows messages keeps working, for that queue and the others, and shows the
  character escaped.
- Passwords never reach the output: not in usage errors (a DSN where a command was expected is
  echoed by argparse), not in URL errors, not under --json.
- --json answers usage errors with JSON too (PGJ-408); out-of-range durations, ports and counts
  are PGJ-405 (or PGJ-101 for a DSN), never a traceback.
- Terminal control sequences in what a message carries (task name, headers, error, traceback)
  are printed escaped.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.ops.cli.main import _Secrets
from kombu_pgjobs.store.admin import record_dead_letter
from kombu_pgjobs.store.schema import migrate

PGJOBS = shutil.which("pgjobs", path=str(Path(sys.executable).parent)) or "pgjobs"
SECRET = "s3cret-Pa55"
HOSTILE_TASK = "evil\x1b]0;pwned\x07\x1b[2J\rtask\x9b31m"
CONTROLS = ("\x1b", "\x07", "\r", "\x9b", "\x00")


def pgjobs(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run the console script; (exit status, stdout, stderr). Never a traceback."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PGJOBS_DSN", "CELERY_BROKER_URL", "BROKER_URL", "PGJOBS_SCHEMA")}
    done = subprocess.run([PGJOBS, *argv], env={**environ, **(env or {})},
                          capture_output=True, text=True, timeout=60, errors="surrogateescape")
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stdout, done.stderr


@pytest.fixture
def cli(dsn: str, schema: str, db: psycopg.Connection[Any]) -> Any:
    """cli(*argv, json_out=True) against the test schema -> (status, JSON or text)."""
    migrate(db, schema)

    def call(*argv: str, json_out: bool = True) -> tuple[int, Any]:
        code, out, err = pgjobs(*argv, "--dsn", dsn, "--schema", schema,
                                *(["--json"] if json_out else []))
        if json_out:
            assert err == "", err
            return code, json.loads(out)
        return code, out + err

    return call


def publish(url: str, schema: str, queue: str, headers: dict[str, Any]) -> None:
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = kombu.Queue(queue, routing_key=queue)
        with conn.Producer() as producer:
            producer.publish({"n": 1}, routing_key=queue, declare=[q],
                             headers={"id": str(uuid.uuid4()), **headers}, serializer="json")


def reject_one(url: str, schema: str, queue: str) -> None:
    """Take one message of ``queue`` and reject it: the transport makes it a dead letter."""
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        message = kombu.Queue(queue, routing_key=queue)(conn.default_channel).get()
        assert message is not None
        message.reject(requeue=False)


def ids(db: psycopg.Connection[Any], schema: str, table: str, queue: str) -> list[int]:
    return [r[0] for r in db.execute(
        f'SELECT id FROM "{schema}".{table} WHERE queue = %s ORDER BY id', (queue,))]


def test_nul_and_lone_surrogates_in_headers_do_not_break_any_listing(cli, db, schema, url):
    # rows an older version wrote: a NUL in a header (refused at publish since issue 28)
    publish(url, schema, "evil", {"x-note": "a<NUL>b", "x-pgjobs-tenant": "acme",
                                  "task": "t.nul"})
    publish(url, schema, "evil", {"x-note": "dead<NUL>letter", "task": "t.nul"})
    db.execute(f'UPDATE "{schema}".pgjobs_job SET message = replace(message::text, '
               "'<NUL>', '\\u0000')::json WHERE queue = 'evil'")
    publish(url, schema, "good", {"task": "t.fine", "x-pgjobs-tenant": "acme"})
    # a row an older version wrote: a lone surrogate escape, which Postgres cannot parse either
    publish(url, schema, "good", {"task": "t.old"})
    older = ids(db, schema, "pgjobs_job", "good")[1]
    db.execute(f'UPDATE "{schema}".pgjobs_job SET message = replace(message::text, '
               "'\"t.old\"', '\"t.old\", \"x-odd\": \"\\ud800\"')::json WHERE id = %s",
               (older,))
    nul_dead, nul_live = ids(db, schema, "pgjobs_job", "evil")
    good, _ = ids(db, schema, "pgjobs_job", "good")
    reject_one(url, schema, "evil")  # the oldest, nul_dead, with the tenant header
    assert ids(db, schema, "pgjobs_dead_letter", "evil") == [nul_dead]
    with pytest.raises(psycopg.errors.UntranslatableCharacter):  # what broke `ls` before
        db.execute(f"SELECT message -> 'headers' ->> 'id' FROM \"{schema}\".pgjobs_job "
                   "WHERE id = %s", (nul_live,))

    code, out = cli("ls")
    assert code == 0, out
    assert [r["id"] for r in out["items"]] == sorted([nul_live, good, older])
    by_id = {r["id"]: r for r in out["items"]}
    assert by_id[good]["tenant"] == "acme" and by_id[good]["task_id"]
    good_task = by_id[good]["task_id"]
    assert by_id[nul_live]["task_id"], "read from the message text in Python"
    code, out = cli("ls", "--state", "ready,dead")
    assert [r["id"] for r in out["items"]] == sorted([nul_dead, nul_live, good, older])
    assert cli("ls", "--queue", "good")[1]["items"][0]["id"] == good
    assert [r["id"] for r in cli("ls", "--queue", "evil")[1]["items"]] == [nul_live]
    code, out = cli("ls", "--tenant", "acme", "--state", "ready,dead")
    assert [r["id"] for r in out["items"]] == sorted([nul_dead, good])
    code, out = cli("ls", "--limit", "1", "--tenant", "nobody")
    assert code == 0 and out == {"items": [], "next": None}, \
        "live rows are filtered on the tenant column in SQL: nothing to page through"
    code, out = cli("ls", "--tenant", "nobody", "--state", "dead")
    assert code == 0 and out["items"] == [], "the unparsable dead letter is filtered in Python"
    code, text = cli("ls", json_out=False)
    assert code == 0 and "t.nul" in text and "t.old" in text

    code, out = cli("show", str(nul_live))
    assert code == 0 and out["headers"]["x-note"] == "dead\x00letter"
    code, text = cli("show", str(nul_live), json_out=False)
    assert code == 0 and "dead\\u0000letter" in text and "\x00" not in text
    code, out = cli("show", str(older))
    assert code == 0 and out["headers"]["x-odd"] == "\ud800"
    code, text = cli("show", str(older), json_out=False)
    assert code == 0 and "\\ud800" in text

    code, out = cli("queues")
    assert code == 0
    assert {q["queue"]: (q["ready"], q["dead"]) for q in out["queues"]} == {
        "evil": (1, 1), "good": (2, 0)}

    code, out = cli("dead", "ls")
    assert code == 0 and [r["id"] for r in out["items"]] == [nul_dead]
    assert out["items"][0]["tenant"] == "acme"
    assert cli("dead", "ls", "--tenant", "acme")[1]["items"][0]["id"] == nul_dead
    assert cli("dead", "ls", "--tenant", "other")[1]["items"] == []
    code, out = cli("dead", "show", str(nul_dead))
    assert code == 0 and out["headers"]["x-note"] == "a\x00b"
    code, text = cli("dead", "ls", json_out=False)
    assert code == 0 and "rejected" in text

    code, out = cli("dead", "requeue", str(nul_dead))
    assert code == 0 and out["requeued"][0]["id"] == nul_dead
    message = db.execute(f'SELECT message::text FROM "{schema}".pgjobs_job WHERE id = %s',
                         (nul_dead,)).fetchone()[0]
    assert json.loads(message)["headers"]["x-note"] == "a\x00b", "moved unchanged"
    # `pgjobs cancel --task-id` reads every live row's task id: the unreadable ones are
    # skipped, never an error (issue 28, item 7)
    code, out = cli("cancel", "--task-id", good_task)
    assert code == 0, out
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE id = %s',
                      (good,)).fetchone()[0] == 0


def test_an_error_with_nul_and_surrogates_is_dead_lettered_escaped(cli, db, schema):
    error = {"type": "ValueError", "message": "bad\x00byte \ud800 \x1b[31mred",
             "traceback": "Traceback (most recent call last):\n  x\x1b[2J\nValueError: bad",
             "ratio": float("nan")}
    dead = record_dead_letter(db, schema, queue="evil", task=HOSTILE_TASK,
                              message={"headers": {"task": HOSTILE_TASK, "id": "t-1"}},
                              reason="failed", error=error)
    code, out = cli("dead", "show", str(dead))
    assert code == 0
    assert out["last_error"]["message"] == "bad\\u0000byte \\ud800 \x1b[31mred"
    assert out["last_error"]["ratio"] == "nan"
    code, text = cli("dead", "show", str(dead), json_out=False)
    assert code == 0 and not any(c in text for c in CONTROLS), repr(text)
    assert "\\x1b[2J" in text and "evil\\x1b]0;pwned\\x07" in text
    assert "\nValueError: bad" in text, "the traceback keeps its lines"
    code, text = cli("dead", "ls", json_out=False)
    assert code == 0 and not any(c in text for c in CONTROLS), repr(text)
    assert "\\x1b[31mred" in text


def test_terminal_controls_in_message_fields_are_escaped(cli, schema, url):
    publish(url, schema, "evil", {"task": HOSTILE_TASK, "argsrepr": "(1,)\r\x1b[1Afake",
                                  "x-pgjobs-tenant": "t\u202egnp.exe"})
    for argv in (("ls",), ("show", "1"), ("ls", "--state", "ready", "--task", HOSTILE_TASK)):
        code, text = cli(*argv, json_out=False)
        assert code == 0, text
        assert not any(c in text for c in (*CONTROLS, "\u202e")), (argv, repr(text))
        assert "evil\\x1b]0;pwned\\x07" in text
    code, text = cli("show", "1", json_out=False)
    assert "(1,)\\r\\x1b[1Afake" in text and "t\\u202egnp.exe" in text
    code, out = cli("show", "1")
    assert out["task"] == HOSTILE_TASK, "--json keeps the value (the encoder escapes it)"


@pytest.mark.parametrize("argv", [
    ["--dsn", "postgresql://bob:{pw}@127.0.0.1:1/db", "queues"],
    ["queues", "postgresql://bob:{pw}@127.0.0.1:1/db"],
    ["postgresql://bob:{pw}@127.0.0.1:1/db", "queues"],
    ["dead", "postgresql://bob:{pw}@127.0.0.1:1/db"],
    ["show", "--dsn", "postgresql://bob:{pw}@127.0.0.1:1/db"],
    ["queues", "--dsn", "postgresql://bob:{pw}@127.0.0.1:99999/db"],
    ["queues", "--dsn", "postgresql://bob:{pw}@127.0.0.1:1/db"],
    ["queues", "--dsn", "ftp://bob:{pw}@127.0.0.1/db"],
    ["queues", "--dsn", "postgresql://bob:{pw}@127.0.0.1/db?password={pw}"],
    ["ls", "--limit", "x", "--dsn", "postgresql://bob:{pw}@127.0.0.1:1/db"],
])
@pytest.mark.parametrize("as_json", [False, True])
def test_no_password_in_any_output(argv: list[str], as_json: bool) -> None:
    for pw in (SECRET, "p%40ss%2Fw0rd"):  # as typed, and percent-encoded
        full = [a.format(pw=pw) for a in argv] + (["--json"] if as_json else [])
        code, out, err = pgjobs(*full)
        assert code in (2, 3), (full, out, err)
        for leaked in (pw, "p@ss/w0rd", "ss%2Fw0rd"):
            assert leaked not in out + err, (full, out, err)
        if as_json:
            assert err == "", err
            error = json.loads(out)["error"]
            assert error["code"] in ("PGJ-101", "PGJ-104", "PGJ-408"), error
            assert error["message"]
        else:
            assert out == "" and "pgjobs: error [PGJ-" in err, err


def test_no_password_from_the_environment(dsn: str) -> None:
    code, out, err = pgjobs("queues", "--json",
                            env={"PGJOBS_DSN": f"gopher://bob:{SECRET}@127.0.0.1/db"})
    assert code == 2 and json.loads(out)["error"]["code"] == "PGJ-101"
    assert SECRET not in out + err


def test_the_scrubber_knows_conninfo_and_echoed_passwords() -> None:
    """A driver error may echo the conninfo (password=...) or the password alone."""
    secrets = _Secrets(["--dsn", f"postgresql://bob:{SECRET}@db/x"])
    for text in (f"host=db password={SECRET} dbname=x", f"password = '{SECRET} x'",
                 f"FATAL: no pg_hba.conf entry ({SECRET})", f"pgjobs://u:{SECRET}@h/db",
                 f"postgresql://:{SECRET}@h/db", f"see postgres://u:p@ss:{SECRET}@h:1/db"):
        assert SECRET not in secrets.scrub(text), text
    assert secrets.scrub("use pgjobs://user:password@host:port/database").endswith(
        "user:password@host:port/database"), "our own hint is a placeholder"
    assert secrets.scrub_all({"a": [f"x://u:{SECRET}@h"]}) == {"a": ["x://u:***@h"]}


def test_usage_errors_are_coded_and_json_under_json(dsn, schema, db) -> None:
    for argv in (["--json"], ["nosuch", "--json"], ["ls", "--limit", "abc", "--json"],
                 ["show", "--json"], ["--json", "dead"], ["ls", "--bogus", "--js"]):
        code, out, err = pgjobs(*argv)
        assert code == 2 and err == "", (argv, err)
        error = json.loads(out)["error"]
        assert error["code"] == "PGJ-408" and "usage: pgjobs" in error["message"], error
    code, out, err = pgjobs("ls", "--limit", "abc")
    assert code == 2 and out == "" and err.startswith("pgjobs: error [PGJ-408] argument --limit")
    code, out, err = pgjobs("--help")
    assert code == 0 and "COMMAND" in out, "help is not an error"

    # the global options work before the command name too (and the command's own win)
    migrate(db, schema)
    code, out, err = pgjobs("--json", "--dsn", dsn, "--schema", schema, "queues")
    assert code == 0 and json.loads(out) == {"minutes": 5, "queues": []}, err
    code, out, err = pgjobs("--schema", "nope_nope", "dead", "--dsn", dsn, "ls",
                            "--schema", schema, "--json")
    assert code == 0 and json.loads(out)["items"] == [], err


@pytest.mark.parametrize(("argv", "expected"), [
    (["prune", "--older-than", "999999999d"], "PGJ-405"),
    (["prune", "--older-than", "7d", "--counters-older-than", "36501d"], "PGJ-405"),
    (["dead", "purge", "--older-than", "9" * 400 + "d"], "PGJ-405"),
    (["ls", "--created-after", "999999999d"], "PGJ-405"),
    (["ls", "--created-before", "1e9d"], "PGJ-405"),
    (["ls", "--limit", "99999999999999999999"], "PGJ-405"),
    (["ls", "--after", "99999999999999999999"], "PGJ-405"),
    (["workers", "--leases", "99999999999"], "PGJ-405"),
    (["metrics", "--serve", "99999"], "PGJ-405"),
    (["metrics", "--serve", "-1"], "PGJ-405"),
    (["queues", "--minutes", "99999999999999999999"], "PGJ-405"),
    (["queues", "--dsn", "postgresql://postgres@127.0.0.1:99999/test"], "PGJ-101"),
    (["queues", "--dsn", "postgresql://postgres@127.0.0.1:0/test"], "PGJ-101"),
])
def test_out_of_range_values_are_coded(argv: list[str], expected: str, dsn, schema, db):
    migrate(db, schema)
    full = [*argv, "--schema", schema, "--json"]
    if "--dsn" not in argv:
        full += ["--dsn", dsn]
    code, out, err = pgjobs(*full)
    assert code == 2, (out, err)
    assert json.loads(out)["error"]["code"] == expected, out
