"""What the docs show runs (issue 33, item 4): ``pgjobs --help`` says each command's whole first
paragraph (a line cut mid-sentence fails), every Python block of the docs parses, and the
snippets a reader copies first run as written. docs/testing.md's files are run by
tests/test_pytest_plugin.py; shell examples of ``pgjobs`` are parsed by tests/test_docs.py."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kombu_pgjobs.ops.cli.main import build_parser
from kombu_pgjobs.ops.common import summary

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
_PY = re.compile(r"^( *)```(?:py|python)[ \t]*\n(.*?)^\1```", re.MULTILINE | re.DOTALL)


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


def test_no_cli_help_line_is_cut() -> None:
    """A command's line in ``pgjobs --help`` is its docstring's whole first paragraph, with
    its brackets closed (the first line alone cut relay's "(runs until" mid-sentence)."""
    commands = _commands(build_parser())
    assert len(commands) >= 40
    for name, choice, sub in commands:
        text = choice.help or ""
        assert text, f"pgjobs {name} has no help line"
        if sub.description:
            assert text == summary(sub.description), f"pgjobs {name}: {text!r}"
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


def test_the_scheduler_page_setup_runs_and_leads() -> None:
    """docs/scheduler.md's "Use it" block on an app with celery_ext and a pgjobs broker."""
    from celery import Celery
    from celery.schedules import crontab

    import celery_ext
    from celery_ext.beat import LEADER

    app = celery_ext.install(Celery("docs", broker="pgjobs://app@db/app", set_as_current=False))
    exec(_block("docs/scheduler.md", "beat_schedule"), {"app": app, "crontab": crontab})
    assert app.conf.beat_scheduler == LEADER
    assert set(app.conf.beat_schedule) == {"sync-invoices", "nightly-report"}
