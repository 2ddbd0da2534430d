"""Two revisions of pgjobs side by side in one run: a benchmark of this checkout against the
same benchmark of an earlier commit, round after round, each beside RabbitMQ.

    python -m bench.revisions BASE [--rounds 3] [--bench stages] [-- BENCH ARGS...]

BASE is a commit (``4b54c29``, ``HEAD~3``). It is checked out in a temporary git worktree
and run with the same interpreter (its own ``bench/`` and ``kombu_pgjobs/`` first on the path),
alternating with this checkout, so that both meet the machine in the same state. Each side has
its own schema in the bench database (``pgjobs_base``, ``pgjobs_head``; dropped first), so a
newer schema never meets older code. ``--bench`` is ``stages`` (idle latency, stage by stage)
or ``cpu_split`` (a drain and its CPU); the arguments after ``--`` go to it (``--pool prefork
--samples 60``). An older ``cpu_split`` without broker variants runs on the default schema.

Nothing here is a test: see docs/benchmarks.md for recorded runs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

from bench.brokers import pg_dsn
from bench.measure import REPO_ROOT

SCHEMAS = {"base": "pgjobs_base", "head": "pgjobs_head"}


def _supports_variants(tree: Path, bench: str) -> bool:
    return "def variant(" in (tree / "bench" / "brokers.py").read_text() or (
        bench == "stages" and "def variant(" in (tree / "bench" / "stages.py").read_text())


def _drop(schemas: list[str]) -> None:
    """Drop both sides' schemas in every bench database (``bench``; ``bench_stages``, where
    bench.stages runs its brokers, when it exists)."""
    for database in ("bench", "bench_stages"):
        try:
            conn = psycopg.connect(pg_dsn(database), autocommit=True)
        except psycopg.OperationalError:
            continue  # not made yet: nothing of ours in it
        with conn:
            for name in schemas:
                conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bench", default="stages", choices=["stages", "cpu_split"])
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    extra = argv[cut + 1:]
    with tempfile.TemporaryDirectory(prefix="bench-base-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(tree),
                        args.base], check=True, capture_output=True)
        try:
            sides = {"base": tree, "head": REPO_ROOT}
            brokers = {}
            for side, root in sides.items():
                if _supports_variants(root, args.bench):
                    brokers[side] = f"pgjobs+schema={SCHEMAS[side]},amqp"
                else:
                    brokers[side] = "pgjobs,amqp"
            _drop([*SCHEMAS.values(), *(["pgjobs"] if "pgjobs,amqp" in brokers.values()
                                        else [])])
            for n in range(1, args.rounds + 1):
                order = ["base", "head"] if n % 2 else ["head", "base"]
                for side in order:
                    root = sides[side]
                    env = {**os.environ, "PYTHONPATH": str(root)}
                    cmd = [sys.executable, "-m", f"bench.{args.bench}",
                           "--brokers", brokers[side], "--runs", "1", *extra]
                    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True,
                                         text=True)
                    print(f"== round {n}, {side} ({args.base if side == 'base' else 'this'})",
                          flush=True)
                    print("\n".join((out.stdout or out.stderr).strip().splitlines()[-6:]),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force",
                            str(tree)], capture_output=True)


if __name__ == "__main__":
    main()
