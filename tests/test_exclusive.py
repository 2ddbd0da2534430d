"""The ``exclusive`` marker (tests/conftest.py): under xdist, an exclusive test overlaps no other
test, while the others still run side by side. A small suite is run by pytest on three workers,
with this repository's conftest hooks; every test records when it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from .conftest import ROOT

SUITE = '''
import json, os, time
import pytest

def _ran(name, exclusive):
    start = time.time()
    time.sleep(0.4)
    with open(os.environ["SPANS"], "a") as fh:
        fh.write(json.dumps([name, os.environ["PYTEST_XDIST_WORKER"], start, time.time()])
                 + "\\n")

@pytest.mark.parametrize("i", range(9))
def test_shared(i):
    _ran(f"shared{i}", False)

@pytest.mark.exclusive
@pytest.mark.parametrize("i", range(3))
def test_exclusive(i):
    _ran(f"exclusive{i}", True)

@pytest.mark.parametrize("i", range(9, 18))
def test_shared_late(i):
    _ran(f"shared{i}", False)
'''


def test_an_exclusive_test_overlaps_no_other(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(SUITE))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    exclusive: x\n    slow: x\n    e2e: x\n")
    spans = tmp_path / "spans.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "3",
         "--strict-markers", str(tmp_path)],
        cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")},
             "SPANS": str(spans), "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = [json.loads(line) for line in spans.read_text().splitlines()]
    assert len(runs) == 21
    overlaps = [(a[0], b[0]) for a in runs for b in runs
                if a[0] < b[0] and a[2] < b[3] and b[2] < a[3]]
    assert not [o for o in overlaps if o[0].startswith("exclusive")
                or o[1].startswith("exclusive")], overlaps
    assert len(overlaps) >= 5, "the shared tests did not run side by side"
    # one worker ran the exclusive tests back to back (the others paused once, not thrice)
    assert len({r[1] for r in runs if r[0].startswith("exclusive")}) == 1, runs
