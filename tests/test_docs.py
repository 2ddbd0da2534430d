"""The SQL in docs/operations.md runs, and does what the page says, on a real schema.

Every fenced ```sql block is run against a freshly migrated schema holding a few messages in
known states (ready, delayed, expired, running, lapsed, dead). The docs are written against the
default schema ``pgjobs``; :func:`for_schema` points them at the test's schema. The blocks the
page makes promises about (the per-queue overview, requeueing dead letters, pause and resume,
purge) are also checked for their effect.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate

DOC = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
_FENCE = re.compile(r"^[ \t]*```sql[ \t]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)


def sql_blocks() -> list[str]:
    return [m.group(1).strip() for m in _FENCE.finditer(DOC.read_text("utf-8"))]


def for_schema(text: str, schema: str) -> str:
    """Point SQL written for the default schema ``pgjobs`` at ``schema``."""
    text = re.sub(r"\bpgjobs\.(?=pgjobs_)", f'"{schema}".', text)  # tables and indexes
    text = text.replace("'pgjobs.pgjobs'", f"'pgjobs.{schema}'")    # the NOTIFY channel
    text = text.replace("schemaname = 'pgjobs'", f"schemaname = '{schema}'")
    leftover = re.search(r"\bpgjobs\.pgjobs_|'pgjobs\.pgjobs'|schemaname = 'pgjobs'", text)
    assert leftover is None, f"the test would touch the real pgjobs schema: {text}"
    return text


def _block(containing: str) -> str:
    found = [b for b in sql_blocks() if containing in b]
    assert len(found) == 1, f"expected one sql block containing {containing!r}, got {found}"
    return found[0]


def _message(task: str, args: list[Any], *, priority: int = 0, eta: datetime | None = None,
             expires_ms: int | None = None) -> dict[str, Any]:
    """A message shaped like the ones Celery publishes (JSON body, base64 body encoding)."""
    task_id = str(uuid.uuid4())
    body = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chain": None,
                                   "chord": None}])
    props: dict[str, Any] = {
        "priority": priority, "body_encoding": "base64", "delivery_mode": 2,
        "correlation_id": task_id, "delivery_tag": str(uuid.uuid4()),
        "delivery_info": {"exchange": "", "routing_key": "celery"},
    }
    if expires_ms is not None:
        props["expiration"] = str(expires_ms)
    return {
        "body": base64.b64encode(body.encode()).decode(),
        "content-type": "application/json", "content-encoding": "utf-8",
        "headers": {"id": task_id, "task": task, "argsrepr": repr(tuple(args)),
                    "eta": eta.isoformat() if eta else None, "retries": 0},
        "properties": props,
    }


class Seeded:
    """Ids of the seeded messages, by what happened to them."""

    def __init__(self, db: psycopg.Connection[Any], schema: str) -> None:
        migrate(db, schema)
        core = QueueCore(schema, lease_ttl=30.0, max_attempts=20)
        self.core = core
        core.declare_queue(db, "celery")
        for i in range(4):
            core.publish(db, job_from_message("celery", _message("add", [i, i])))
        later = datetime.now(timezone.utc) + timedelta(hours=1)
        core.publish(db, job_from_message("celery", _message("add", [9, 9], eta=later)))
        claimed = core.claim(db, ["celery"], 3).claimed
        assert len(claimed) == 3
        self.lapsed, self.running, dead = claimed
        db.execute(f'UPDATE "{schema}".pgjobs_job SET lease_expires_at = now() - interval '
                   "'1 minute' WHERE id = %s", (self.lapsed.id,))
        assert core.bury(db, [(dead.id, dead.claim)], reason="rejected") == {dead.id}
        self.dead = dead
        core.publish(db, job_from_message("celery", _message("add", [7, 7], expires_ms=1)))
        time.sleep(0.05)  # the 1 ms expiration has passed


@pytest.fixture
def seeded(db: psycopg.Connection[Any], schema: str) -> Seeded:
    return Seeded(db, schema)


def _run(db: psycopg.Connection[Any], schema: str, block: str) -> list[tuple[Any, ...]]:
    cur = db.execute(for_schema(block, schema))
    return cur.fetchall() if cur.description else []


def test_the_page_has_sql_blocks() -> None:
    assert len(sql_blocks()) >= 10


@pytest.mark.parametrize("index", range(len(sql_blocks())))
def test_every_sql_block_runs(index: int, db, schema, seeded) -> None:
    _run(db, schema, sql_blocks()[index])


def test_queue_overview_counts_each_state(db, schema, seeded) -> None:
    cur = db.execute(for_schema(_block("oldest_ready_age"), schema))
    names = [c.name for c in cur.description]
    rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    assert len(rows) == 1
    row = rows[0]
    assert row["queue"] == "celery" and row["paused"] is False
    assert (row["ready"], row["delayed"], row["running"], row["lapsed"], row["expired"]) == (
        1, 1, 2, 1, 1)
    assert row["oldest_ready_age"] >= timedelta(0)


def test_lapsed_leases_query_lists_the_lapsed_row(db, schema, seeded) -> None:
    rows = _run(db, schema, _block("AS lapsed_for"))
    assert [r[0] for r in rows] == [seeded.lapsed.id]


def test_requeue_one_dead_letter_by_id(db, schema, seeded) -> None:
    block = _block("WHERE id = 42")
    rows = _run(db, schema, block.replace("id = 42", f"id = {seeded.dead.id}"))
    assert len(rows) == 1 and rows[0][1] == "celery"
    _assert_requeued(db, schema, seeded, rows[0][0])


def test_requeue_dead_letters_of_a_queue(db, schema, seeded) -> None:
    rows = _run(db, schema, _block("AND reason = 'rejected'"))
    assert len(rows) == 1
    _assert_requeued(db, schema, seeded, rows[0][0])


def _assert_requeued(db: psycopg.Connection[Any], schema: str, seeded: Seeded,
                     new_id: int) -> None:
    left = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()
    assert left == (0,)
    state, attempts, claim, message = db.execute(
        f'SELECT state, attempts, claim, message::text FROM "{schema}".pgjobs_job '
        "WHERE id = %s", (new_id,)).fetchone()
    assert (state, attempts, claim) == ("ready", 0, 0)
    assert message == seeded.dead.message
    # and a worker can take it
    taken = seeded.core.claim(db, ["celery"], 10).claimed
    assert new_id in {c.id for c in taken}


def test_pause_stops_claims_and_resume_wakes_consumers(db, schema, seeded, dsn) -> None:
    _run(db, schema, _block("SET paused = true"))
    assert seeded.core.claim(db, ["celery"], 10).claimed == []
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute(f'LISTEN "pgjobs.{schema}"')
        _run(db, schema, _block("SET paused = false"))
        notes = list(listener.notifies(timeout=5.0, stop_after=1))
    assert [(n.channel, n.payload) for n in notes] == [(f"pgjobs.{schema}", "celery")]
    assert len(seeded.core.claim(db, ["celery"], 10).claimed) == 1


def test_purge_deletes_ready_and_delayed_not_running(db, schema, seeded) -> None:
    _run(db, schema, _block("DELETE FROM pgjobs.pgjobs_job WHERE queue = 'celery'"))
    states = db.execute(
        f'SELECT state, count(*) FROM "{schema}".pgjobs_job GROUP BY state').fetchall()
    assert dict(states) == {"running": 2}


# -- the `pgjobs` commands the docs show exist, with those flags -----------------------------
CLI_DOCS = [Path(__file__).resolve().parent.parent / "docs" / name for name in (
    "operations.md", "migration.md", "howto/dead-letters.md", "reference/cli.md")]
_SH_FENCE = re.compile(r"^[ \t]*```(?:sh|bash|console)[ \t]*\n(.*?)^[ \t]*```",
                       re.MULTILINE | re.DOTALL)
_SPAN = re.compile(r"`(pgjobs\s[^`]+)`")


def doc_commands() -> list[tuple[str, str]]:
    """(doc file, command) for every `pgjobs …` line of a shell block (``$`` before it: run
    as written) and every inline `pgjobs …` span (prose names a command, maybe without its
    arguments) of the pages that show the CLI."""
    found: list[tuple[str, str]] = []
    for path in CLI_DOCS:
        text = path.read_text("utf-8")
        for block in _SH_FENCE.finditer(text):
            for line in block.group(1).splitlines():
                line = line.strip().removeprefix("$ ")
                for part in line.split("&&"):
                    if part.strip().startswith("pgjobs "):
                        found.append((path.name, "$ " + part.strip()))
        found += [(path.name, " ".join(m.group(1).split())) for m in _SPAN.finditer(text)]
    return found


def _subparser(parser: Any, words: list[str]) -> tuple[Any, list[str]]:
    """The parser of the command the leading words name, and the words left over."""
    import argparse

    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser, words = subs[0].choices[words[0]], words[1:]
    return parser, words


def test_the_docs_show_pgjobs_commands() -> None:
    commands = doc_commands()
    assert len(commands) >= 40
    assert {name for name, _ in commands} == {p.name for p in CLI_DOCS}


@pytest.mark.parametrize(("doc", "command"), doc_commands())
def test_every_pgjobs_command_in_the_docs_exists(doc: str, command: str) -> None:
    """A shell example must parse as it is written; a mention in prose or a synopsis
    (``ID…``, ``[--limit N]``, ``ls|show``) must name real commands, and only options those
    commands take."""
    import shlex

    from kombu_pgjobs.errors import UsageError
    from kombu_pgjobs.ops.cli.main import build_parser

    parser = build_parser()
    if command.startswith("$ "):
        command = command.removeprefix("$ ")
        try:
            parser.parse_args(shlex.split(command, comments=True)[1:])
        except UsageError as exc:
            pytest.fail(f"{doc}: `{command}` does not parse: {exc.message}")
        return
    words = re.findall(r"[^\s\[\]]+", command)[1:]
    while words and words[0].startswith("--"):  # global options before the command name
        assert words[0] in ("--json", "--dsn", "--schema"), f"{doc}: `{command}`"
        words = words[1 if words[0] == "--json" else 2:]
    heads = words[0].split("|") if words else []
    for head in heads or [""]:
        sub, rest = _subparser(parser, [head, *words[1:]] if head else [])
        if head:
            assert sub is not parser, f"{doc}: `{command}`: no command {head!r}"
        options = {o for a in sub._actions for o in a.option_strings}
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", " ".join(rest)):
            assert flag in options, f"{doc}: `{command}`: {head or 'pgjobs'} has no {flag}"


def test_the_queues_table_in_the_how_to_has_the_columns_pgjobs_prints() -> None:
    from kombu_pgjobs.ops.cli.main import _render_queues

    text = (Path(__file__).resolve().parent.parent / "docs/howto/dead-letters.md").read_text()
    shown = text.split("$ pgjobs queues\n", 1)[1].splitlines()[0]
    row = {"queue": "q", "ready": 0, "delayed": 0, "running": 0, "waiting": 0, "dead": 0,
           "paused": False, "oldest_ready_age": None, "settled": {}, "completed_per_minute": 0.0}
    printed = _render_queues({"minutes": 5, "queues": [row]}).splitlines()[0]
    assert re.split(r"\s{2,}", shown) == re.split(r"\s{2,}", printed)
