"""Where an idle task's latency goes: ``delay()`` to task body, stage by stage, side by side.

    python -m bench.stages [--brokers pgjobs,amqp,redis] [--samples 60] [--pool threads,prefork]
                           [--runs 3]

One real ``celery worker`` per broker and pool (the harness's app and flags, plus ``-I
bench.stage_hooks``), idle between samples (a random pause of 50 to 150 ms); each sample
publishes ``bench.stages`` with ``delay()`` and times one task from the call to its body.
Rounds are interleaved (round 1 of every pool and broker, then round 2 ...), so a ratio
compares runs minutes apart, never a whole run apart. Every broker goes through the same
points:

``delay``    the ``delay()`` call (``sent`` to ``returned``);
``wake``     ``delay()`` returned until the worker's event loop read the broker's signal
             (pgjobs: the notification parsed; RabbitMQ, Redis: the socket turned readable);
             a broker that delivers before ``delay()`` returns shows a negative figure;
``deliver``  that read until Celery's consumer made a request of the message (the
             ``task_received`` signal, main process): the transport's work and Celery's;
``pool``     the request until the task body runs (Celery's pool: a thread, or a prefork
             child).

pgjobs splits two of them further. From its row (the task acks late, so the row is still
there) ``delay`` is ``client`` (the call until the INSERT's transaction starts: Celery, kombu,
encoding, half a round trip) and ``commit`` (the INSERT, its trigger and its durable commit,
until ``delay()`` returns). A message the publish handed to the idle worker (schema 18, 21)
is read by the worker with one fenced statement before it is delivered: ``take`` is that
read (the notification parsed until its rows are in), and ``deliver`` starts after it;
``handed%`` is the share of samples delivered so (the others were claimed: their ``deliver``
holds the claim).

Its brokers live apart from the other benchmarks' (the queue is ``bench`` for all of them, and a
worker of a ``python -m bench`` run elsewhere on the machine would take these tasks): pgjobs in
the database ``bench_stages``, RabbitMQ in the vhost ``bench_stages`` (made with ``rabbitmqctl``
when it is there), Redis in its database 15; ``BENCH_<NAME>_URL`` overrides each.

A broker may be given as a variant with transport options, e.g. ``pgjobs+hand_off=false``
(values are JSON, else text), to compare settings side by side within one run.

Every timestamp is the machine's one clock (Python's ``time.time()`` and PostgreSQL's
``now()``). Stages are medians of the samples of a run; ``total`` is shown as p50 and p95
(nearest rank); the first broker's ratios to each other broker are taken within each run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.brokers import Broker, prepare, variant
from bench.measure import REPO_ROOT, BrokerRun, Config
from bench.worker import Worker

STAGES = ("client", "commit", "wake", "take", "deliver", "pool")


APART = "bench_stages"


def _vhost(name: str) -> bool:
    """RabbitMQ's vhost ``name`` for guest (made when missing); False without rabbitmqctl."""
    ctl = shutil.which("rabbitmqctl") or (
        "/usr/sbin/rabbitmqctl" if os.path.exists("/usr/sbin/rabbitmqctl") else None)
    if ctl is None:
        return False
    listed = subprocess.run([ctl, "-q", "list_vhosts"], capture_output=True, text=True)
    if listed.returncode:
        return False
    if name not in listed.stdout.split():
        made = subprocess.run([ctl, "-q", "add_vhost", name], capture_output=True)
        perms = subprocess.run([ctl, "-q", "set_permissions", "-p", name, "guest", ".*", ".*",
                                ".*"], capture_output=True)
        return not (made.returncode or perms.returncode)
    return True


def apart(broker: Broker) -> Broker:
    """``broker`` in a place of its own (see the module docstring), unless its URL is set."""
    base = broker.name.split("+")[0]
    if f"BENCH_{base.upper()}_URL" in os.environ:
        return broker
    if base == "pgjobs":
        return dataclasses.replace(broker, url=f"pgjobs://postgres@127.0.0.1:5432/{APART}",
                                   pg_database=APART)
    if base == "amqp" and _vhost(APART):
        return dataclasses.replace(broker, url=f"amqp://guest:guest@127.0.0.1:5672/{APART}")
    if base == "redis":
        return dataclasses.replace(broker, url="redis://127.0.0.1:6379/15")
    return broker


class HookedWorker(Worker):
    """The harness's worker with the stage timestamps of :mod:`bench.stage_hooks` loaded."""

    @property
    def argv(self) -> list[str]:
        return [*super().argv, "-I", "bench.stage_hooks"]


def _lines(path: Path, seen: int) -> list[str]:
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(seen)
        data = f.read()
    return data.decode().splitlines() if data.endswith(b"\n") else []


def _samples(state: Path, count: int, timeout: float = 10.0) -> list[dict[str, float]]:
    os.environ.update({"BENCH_STATE_DIR": str(state)})
    from bench.app import stages

    body, hooks = state / "stages", state / "received"
    rng = random.Random(7)
    rows: list[dict[str, float]] = []
    for i in range(count + 3):  # three warm-up samples
        seen = {p: (p.stat().st_size if p.exists() else 0) for p in (body, hooks)}
        sent = time.time()
        stages.delay(sent)
        returned = time.time()
        deadline = time.monotonic() + timeout
        while not (_lines(body, seen[body]) and _lines(hooks, seen[hooks])):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sample {i}: no task start within {timeout:g} s")
            time.sleep(0.001)
        if i >= 3:
            _, started, created, claimed = (float(x) for x in _lines(body, seen[body])[0].split())
            _, woke, taken, received = (float(x) for x in _lines(hooks, seen[hooks])[0].split())
            row = {"total": started - sent, "delay": returned - sent, "pool": started - received}
            handed = not math.isnan(created) and claimed == created  # claimed by the publish
            if not math.isnan(created):
                row.update(client=created - sent, commit=returned - created)
                row["handed"] = float(handed)
            if not math.isnan(woke):
                row["wake"] = woke - returned
                if handed and not math.isnan(taken) and taken >= woke:
                    row.update(take=taken - woke, deliver=received - taken)
                else:
                    row["deliver"] = received - woke
            rows.append(row)
        time.sleep(rng.uniform(0.05, 0.15))
    return rows


def one(spec: str, pool: str, count: int, tmp: Path) -> dict[str, float]:
    """Median ms of each stage over ``count`` samples (and the total's p95), in a fresh
    interpreter per broker."""
    import sys

    broker = apart(variant(spec))
    state = tmp / f"{spec.replace('/', '_')}-{pool}"
    state.mkdir(exist_ok=True)
    run = BrokerRun(broker, Config(), state, lambda _msg: None)
    run.client("purge")
    with HookedWorker(pool=pool, concurrency=8 if pool == "threads" else 2, env=run.env,
                      state_dir=state, cwd=REPO_ROOT) as worker:
        worker.wait_ready(60)
        time.sleep(1.0)  # the worker settles into its idle wait
        code = ("import json, sys; from pathlib import Path; from bench.stages import _samples;"
                f"print(json.dumps(_samples(Path({str(state)!r}), {count})))")
        out = subprocess.run([sys.executable, "-c", code], env=run.env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=count * 12 + 60)
        if out.returncode:
            raise RuntimeError(f"{spec}: {out.stderr.strip().splitlines()[-1:]}\n"
                               f"{worker.log_tail()}")
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    keys = {k for r in rows for k in r} - {"handed"}
    medians = {k: 1000 * statistics.median(r[k] for r in rows if k in r) for k in keys}
    totals = sorted(r["total"] for r in rows)
    medians["p95"] = 1000 * totals[max(0, math.ceil(0.95 * len(totals)) - 1)]
    if any("handed" in r for r in rows):
        medians["handed%"] = 100.0 * sum(r.get("handed", 0.0) for r in rows) / len(rows)
    return medians


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--brokers", default="pgjobs,amqp,redis")
    p.add_argument("--samples", type=int, default=60)
    p.add_argument("--pool", default="threads",
                   help="threads, prefork, or both as threads,prefork (interleaved per round)")
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    names = args.brokers.split(",")
    pools = args.pool.split(",")
    if not set(pools) <= {"threads", "prefork"}:
        p.error("--pool: threads, prefork or threads,prefork")
    for name in names:
        prepare(apart(variant(name)))
    runs: dict[tuple[str, str], list[dict[str, float]]] = {
        (pool, n): [] for pool in pools for n in names}
    with tempfile.TemporaryDirectory(prefix="bench-stages-") as tmp:
        for _ in range(args.runs):
            for pool in pools:
                for name in names:
                    runs[pool, name].append(one(name, pool, args.samples, Path(tmp)))
    for pool in pools:
        print(f"idle latency, {pool} pool, {args.samples} samples per run, "
              f"medians in ms (per run):")
        for name in names:
            got = runs[pool, name]
            keys = [k for k in ("total", "p95", "delay", *STAGES, "handed%")
                    if any(k in r for r in got)]
            print(f"  {name:<7} " + "  ".join(
                f"{k} " + "/".join(f"{r[k]:.2f}" if k in r else "-" for r in got)
                for k in keys))
        first = names[0]
        for other in names[1:]:
            for key, label in (("total", "p50"), ("p95", "p95")):
                ratios = [x[key] / y[key] for x, y in
                          zip(runs[pool, first], runs[pool, other], strict=True)]
                print(f"  {first}/{other} {label}, per run: "
                      + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
