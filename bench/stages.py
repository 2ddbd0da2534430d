"""Where an idle task's latency goes: ``delay()`` to task body, stage by stage.

    python -m bench.stages [--brokers pgjobs,amqp] [--samples 60] [--pool threads] [--runs 3]

One real ``celery worker`` per broker (the harness's app and flags), idle between samples (a
random pause of 50 to 150 ms); each sample publishes ``bench.stages`` with ``delay()`` and the
task records when its body started. On pgjobs the task also reads its own row (it acks late,
so the row is still there): the publish transaction's ``now()`` and the claim's (the lease's
start), which split the path into

``client``   the ``delay()`` call until the INSERT's transaction starts (Celery, kombu, pgjobs's
             encoding, half a round trip);
``commit``   the INSERT and its durable commit, until ``delay()`` returns;
``wake``     ``delay()`` returned until the worker's claim transaction starts (the NOTIFY, the
             worker's wake-up, the claim sent);
``deliver``  the claim's start until the task body runs (the claim, its commit, its rows read,
             Celery's hand-off to the pool).

A message the publish handed to the idle worker (``0018_hand_off.sql``: its lease starts at the
publish transaction's ``now()``) has no claim of its own: its last stage is

``handed``   ``delay()`` returned until the task body runs (the NOTIFY carrying the message, the
             worker's wake-up, Celery's hand-off to the pool),

and ``handed%`` is the share of samples delivered so.

A broker may be given as a variant with transport options, e.g. ``pgjobs+hand_off=false``
(values are JSON, else text), to compare settings side by side within one run.

Every timestamp is the machine's one clock (Python's ``time.time()`` and PostgreSQL's
``now()``). Other brokers report the total and the ``delay()`` call only. Medians of the
samples of each run; the total's ratio to the second broker is taken within each run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.brokers import prepare, variant
from bench.measure import REPO_ROOT, BrokerRun, Config
from bench.worker import Worker

STAGES = ("client", "commit", "wake", "deliver", "handed")


def _samples(state: Path, count: int, timeout: float = 10.0) -> list[dict[str, float]]:
    os.environ.update({"BENCH_STATE_DIR": str(state)})
    from bench.app import stages

    path = state / "stages"
    rng = random.Random(7)
    rows: list[dict[str, float]] = []
    for i in range(count + 3):  # three warm-up samples
        seen = path.stat().st_size if path.exists() else 0
        sent = time.time()
        stages.delay(sent)
        returned = time.time()
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sample {i}: no task start within {timeout:g} s")
            time.sleep(0.001)
            if path.exists():
                with open(path, "rb") as f:
                    f.seek(seen)
                    line = f.read()
        if i >= 3:
            _, started, created, claimed = (float(x) for x in line.split())
            row = {"total": started - sent, "delay": returned - sent}
            if not math.isnan(created):
                row.update(client=created - sent, commit=returned - created)
                if claimed == created:  # claimed in the publish's transaction: handed off
                    row.update(handed=started - returned)
                else:
                    row.update(wake=claimed - returned, deliver=started - claimed)
            rows.append(row)
        time.sleep(rng.uniform(0.05, 0.15))
    return rows


def one(spec: str, pool: str, count: int, tmp: Path) -> dict[str, float]:
    """Median ms of each stage over ``count`` samples, in a fresh interpreter per broker."""
    import subprocess
    import sys

    name = spec
    broker = variant(spec)
    state = tmp / spec.replace("/", "_")
    state.mkdir(exist_ok=True)
    run = BrokerRun(broker, Config(), state, lambda _msg: None)
    run.client("purge")
    with Worker(pool=pool, concurrency=8 if pool == "threads" else 2, env=run.env,
                state_dir=state, cwd=REPO_ROOT) as worker:
        worker.wait_ready(60)
        time.sleep(1.0)  # the worker settles into its idle wait
        code = ("import json, sys; from pathlib import Path; from bench.stages import _samples;"
                f"print(json.dumps(_samples(Path({str(state)!r}), {count})))")
        out = subprocess.run([sys.executable, "-c", code], env=run.env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=count * 12 + 60)
    if out.returncode:
        raise RuntimeError(f"{name}: {out.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    keys = {k for r in rows for k in r}
    medians = {k: 1000 * statistics.median(r[k] for r in rows if k in r) for k in keys}
    if "handed" in keys:
        medians["handed%"] = 100.0 * sum("handed" in r for r in rows) / len(rows)
    return medians


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--brokers", default="pgjobs,amqp")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--pool", default="threads", choices=["threads", "prefork"])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    names = args.brokers.split(",")
    for name in names:
        prepare(variant(name))
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as tmp:
        for _ in range(args.runs):
            for name in names:
                runs[name].append(one(name, args.pool, args.samples, Path(tmp)))
    print(f"idle latency, {args.pool} pool, {args.samples} samples per run, "
          f"medians in ms (per run):")
    for name in names:
        keys = [k for k in ("total", "delay", *STAGES, "handed%")
                if any(k in r for r in runs[name])]
        print(f"  {name:<7} " + "  ".join(
            f"{k} " + "/".join(f"{r[k]:.2f}" if k in r else "-" for r in runs[name])
            for k in keys))
    if len(names) > 1:
        a, b = names[:2]
        ratios = [x["total"] / y["total"] for x, y in zip(runs[a], runs[b], strict=True)]
        print(f"  {a}/{b} total, per run: " + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
