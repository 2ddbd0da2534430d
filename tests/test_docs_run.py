"""What the docs show runs (issue 33, item 4): ``pgjobs --help`` says each command's whole first
paragraph (a line cut mid-sentence fails), every Python block of the docs parses, and the
snippets a reader copies run as written: the README's configuration, the blocks a page marks
``<!-- doc-run: NAME -->`` (each run by the check of that name below) and a few
self-contained blocks of other pages. docs/testing.md's files are run by
tests/test_pytest_plugin.py; shell examples of ``pgjobs`` are parsed by tests/test_docs.py."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kombu_pgjobs.ops.cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_PY = re.compile(r"^( *)```(?:py|python)[ \t]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
_RUN = re.compile(r"^<!-- doc-run: ([\w-]+) -->\n```(?:py|python)[ \t]*\n(.*?)^```",
                  re.MULTILINE | re.DOTALL)


def python_blocks() -> list[tuple[str, str]]:
    """(where, code) of every ```py / ```python block of README.md and docs/."""
    found = []
    for path in DOCS:
        text = path.read_text("utf-8")
        for m in _PY.finditer(text):
            code = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
            line = text[:m.start()].count("\n") + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", code))
    return found


def _block(doc: str, containing: str) -> str:
    found = [code for where, code in python_blocks()
             if where.startswith(doc + ":") and containing in code]
    assert len(found) == 1, f"{doc}: expected one python block with {containing!r}"
    return found[0]


def _commands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(name, the choice's help action, its parser) of every command and subcommand."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a for a in action._choices_actions}
            for name, sub in action.choices.items():
                if name in helps:
                    out.append((prefix + name, helps[name], sub))
                out += _commands(sub, prefix + name + " ")
    return out


def _first_paragraphs() -> dict[str, str]:
    """Each function docstring of the CLI's source (cleaned) -> its first paragraph on one
    line, read from the source files with ``ast``, not through the parser or ops.common."""
    out: dict[str, str] = {}
    for path in sorted((ROOT / "kombu_pgjobs" / "ops").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    first = re.split(r"\n[ \t]*\n", doc.strip(), maxsplit=1)[0]
                    out[doc] = " ".join(first.split())
    return out


def _printed(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_help().split())


def test_no_cli_help_line_is_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command's line in ``pgjobs --help`` (and ``pgjobs GROUP --help``) is its docstring's
    whole first paragraph, ending as a sentence ends, with its brackets closed (the first line
    alone cut relay's "(runs until" mid-sentence); a group's line ends with the list of its
    commands."""
    import inspect

    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens ("--older-" "than")
    parser = build_parser()
    parents = {"": parser, **{name: sub for name, _, sub in _commands(parser)}}
    expected_of = _first_paragraphs()
    commands = _commands(parser)
    assert len(commands) >= 40
    for name, choice, sub in commands:
        text = choice.help or ""
        assert text, f"pgjobs {name} has no help line"
        parent, _, leaf = name.rpartition(" ")
        assert f"{leaf} {text}" in _printed(parents[parent]), f"pgjobs {name}: not printed whole"
        if sub.description:
            expected = expected_of.get(inspect.cleandoc(sub.description))
            assert expected, f"pgjobs {name}: its description is no docstring of the CLI"
            assert text == expected, f"pgjobs {name}: {text!r} is not {expected!r}"
            assert text.endswith((".", ")", "?", "!")), f"pgjobs {name}: cut: {text!r}"
        else:  # a group: "dead letters: ls, show, requeue, purge"
            listed = [n.rpartition(" ")[2] for n, _, _ in commands if n.rpartition(" ")[0] == name]
            assert listed and text.endswith(": " + ", ".join(listed)), \
                f"pgjobs {name}: {text!r} does not end with its commands {listed}"
        for left, right in ("()", "[]", "``"):
            opened = text.count(left) - (text.count(right) if left != right else 0)
            assert opened == 0 if left != right else text.count(left) % 2 == 0, \
                f"pgjobs {name}: unbalanced {left}{right} in {text!r}"


def test_pgjobs_help_prints_the_relay_line_whole() -> None:
    out = subprocess.run([sys.executable, "-m", "kombu_pgjobs.ops.cli", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    if out.returncode != 0 or not out.stdout:  # no __main__: the console script
        out = subprocess.run([str(Path(sys.executable).with_name("pgjobs")), "--help"],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
    text = " ".join(out.stdout.split())
    assert "relay Publish messages staged in the app database's outbox to the broker (runs " \
           "until stopped; SIGTERM or Ctrl-C ends it after the current batch)." in text, text


@pytest.mark.parametrize(("where", "code"), python_blocks(), ids=[w for w, _ in python_blocks()])
def test_every_python_block_of_the_docs_parses(where: str, code: str) -> None:
    try:
        ast.parse(code)
    except SyntaxError as exc:
        pytest.fail(f"{where}: {exc}")


def test_the_readme_configuration_selects_the_pgjobs_transport() -> None:
    from kombu import Connection

    from kombu_pgjobs.broker.transport import Transport

    settings: dict[str, Any] = {}
    exec(_block("README.md", "broker_url"), settings)
    assert settings["broker_url"].startswith("pgjobs://")
    assert Connection(settings["broker_url"]).transport_cls is not None
    assert isinstance(Connection(settings["broker_url"]).transport, Transport)


def marked_blocks() -> dict[str, tuple[str, str]]:
    """name -> (where, code) of every ```python block a page marks ``<!-- doc-run: NAME -->``
    (the line right above it)."""
    found: dict[str, tuple[str, str]] = {}
    for path in DOCS:
        text = path.read_text("utf-8")
        for m in _RUN.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 2}"
            assert m.group(1) not in found, f"{where}: doc-run {m.group(1)} marked twice"
            found[m.group(1)] = (where, m.group(2))
    return found


@contextmanager
def _current_app_kept() -> Iterator[None]:
    """A block that makes a Celery app makes it the current one: not past the test."""
    from celery import _state

    default, current = _state.default_app, getattr(_state._tls, "current_app", None)
    try:
        yield
    finally:
        _state.default_app, _state._tls.current_app = default, current


def _app() -> Any:
    from celery import Celery

    import celery_ext

    return celery_ext.install(Celery("docs", broker="pgjobs://app@db/app", set_as_current=False))


def _run(where: str, code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    namespace.setdefault("__name__", "docs_snippet")
    with _current_app_kept():
        exec(compile(code, where, "exec"), namespace)
    return namespace


def check_scheduler_setup(where: str, code: str) -> None:
    """docs/scheduler.md's setup on an app with celery_ext and a pgjobs broker."""
    from celery.schedules import crontab

    from celery_ext.beat import LEADER

    app = _app()
    _run(where, code, {"app": app, "crontab": crontab})
    assert app.conf.beat_scheduler == LEADER
    assert set(app.conf.beat_schedule) == {"sync-invoices", "nightly-report"}


def check_schedule_headers(where: str, code: str) -> None:
    """The task reads the occurrence under the header the scheduler sets (the block, with
    ``return occurrence`` added, run under a request carrying that header)."""
    from celery_ext.scheduler import OCCURRENCE_HEADER

    assert f'"{OCCURRENCE_HEADER}"' in code
    build = _run(where, code + "    return occurrence\n", {"app": _app()})["build"]
    build.push_request(**{OCCURRENCE_HEADER: "2026-03-08T07:30:00+00:00"})
    try:
        assert build.run("daily") == "2026-03-08T07:30:00+00:00"
    finally:
        build.pop_request()


def check_shard_map(where: str, code: str) -> None:
    """The map parses, and each queue the comments name lands on the database they say."""
    from kombu_pgjobs.options import TransportOptions
    from kombu_pgjobs.shardmap import shard_label

    app = _app()
    _run(where, code, {"app": app})
    shards = TransportOptions.parse(app.conf.broker_transport_options).shards
    assert shards is not None

    def database(queue: str) -> str:
        n = shards.shard_of(queue)
        return shard_label(shards.urls[n - 1] if n else app.conf.broker_url)

    assert database("billing") == "db2:5432/jobs"
    assert database("reports.daily") == "db3:5432/jobs"
    assert database("orders") == database("celeryev.x") == "db1:5432/jobs"


def check_on_settled(where: str, code: str) -> None:
    """The receiver connects, and a settle reaches the reader's ``audit.record``."""
    import celery_ext

    records: list[dict[str, Any]] = []

    class Audit:
        def record(self, **fields: Any) -> None:
            records.append(fields)

    settled = _run(where, code, {"audit": Audit()})["settled"]
    try:
        celery_ext.on_settled.send(sender="billing.charge", outcome="completed",
                                   task_id="t-1", job_id=7, attempts=1, retries=0, tenant=None)
    finally:
        celery_ext.on_settled.disconnect(settled)
    assert records == [{"task": "billing.charge", "task_id": "t-1", "outcome": "completed",
                        "attempts": 1}]


CHECKS: dict[str, Callable[[str, str], None]] = {
    "scheduler-setup": check_scheduler_setup,
    "schedule-headers": check_schedule_headers,
    "shard-map": check_shard_map,
    "on-settled": check_on_settled,
}


def test_every_marked_block_has_its_check() -> None:
    assert set(marked_blocks()) == set(CHECKS)


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_a_marked_docs_block_runs(name: str) -> None:
    where, code = marked_blocks()[name]
    CHECKS[name](where, code)


def test_the_limits_page_declarations_give_the_limits_it_says() -> None:
    """docs/limits.md's "Declaring limits" block, whole (it makes its own app)."""
    from celery_ext.limits import limits_header

    ns = _run("docs/limits.md", _block("docs/limits.md", "pgjobs_queue_limits"), {})
    sync, rebuild, capture = (ns[n] for n in ("sync_account", "rebuild_search_index",
                                               "capture_payment"))
    assert limits_header(sync, (7,), {}, {}, {"x-pgjobs-tenant": "acme"}) == {
        "concurrency": [{"key": f"key:{sync.name}:7", "limit": 2, "when_busy": "wait"},
                        {"key": "global", "limit": 200}, {"key": "tenant:acme", "limit": 10}],
        "rate": [{"key": "tenant:acme", "limit": 100, "per": 60}]}
    assert limits_header(rebuild, (), {}, {"queue": "reports"}, {})["concurrency"] == [
        {"key": f"task:{rebuild.name}", "limit": 3, "when_busy": "wait"},
        {"key": "queue:reports", "limit": 4}, {"key": "global", "limit": 200}]
    assert limits_header(capture, ("o-1",), {}, {}, {})["concurrency"][0] == {
        "key": f"key:{capture.name}:o-1", "limit": 1, "when_busy": "fail"}


def test_the_pgbouncer_setting_turns_listen_notify_off() -> None:
    from kombu_pgjobs.options import TransportOptions

    ns = _run("docs/operations.md", _block("docs/operations.md", "use_listen_notify"), {})
    assert TransportOptions.parse(ns["broker_transport_options"]).use_listen_notify is False
