"""An app that only changed ``broker_url`` (issue 33, item 2): ``celery inspect scheduled``
lists the countdown tasks waiting in Postgres, with a real worker of tests/apps/recorder.py — a
plain Celery app that imports neither kombu_pgjobs nor celery_ext — and nothing installed in it.
What makes it work is the import hook that registers the ``pgjobs`` URL scheme
(kombu_pgjobs/_alias.py, run at interpreter start by kombu_pgjobs.pth). Flower's pages for the
same app are in tests/test_flower.py."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest

from .conftest import DSN, ROOT, import_app

APP = "tests.apps.recorder"


def test_the_app_never_imports_pgjobs() -> None:
    for module in ("tests/apps/recorder.py", "tests/apps/common.py"):
        tree = ast.parse((ROOT / module).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.split(".")[0] in ("kombu_pgjobs", "celery_ext")}, names


@pytest.mark.e2e
def test_inspect_scheduled_lists_countdown_tasks_for_a_plain_app(
        recorder_tables: str, url: str, start_worker) -> None:
    schema = recorder_tables
    start_worker(name="plain", app=APP, concurrency=1)
    recorder = import_app(APP, schema, url)
    later = recorder.record.apply_async(("later",), countdown=600, priority=5)
    replies = recorder.app.control.inspect(timeout=10.0, limit=1).scheduled()
    assert replies, "the worker answered"
    (name, entries), = replies.items()
    assert name.startswith("plain@")
    mine = [e for e in entries if e["request"]["id"] == later.id]
    assert len(mine) == 1, entries
    assert mine[0]["request"]["name"] == "record" and mine[0]["eta"]
    assert mine[0]["request"]["args"] == "('later',)" and mine[0]["priority"] == 5

    # and the command line, as an operator types it
    env = {**os.environ, "PGJOBS_TEST_DSN": DSN, "PGJOBS_TEST_SCHEMA": schema,
           "PGJOBS_TEST_BROKER": url, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "inspect", "scheduled", "--json",
         "--timeout", "10"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    listed = json.loads(out.stdout.strip().splitlines()[-1])
    assert [e["request"]["id"] for es in listed.values() for e in es] == [later.id]
