"""Where a drain's CPU goes: CPU milliseconds per task of each process, broker by broker.

    python -m bench.cpu_split [--brokers pgjobs,amqp] [--pool prefork] [--concurrency 2]
                              [--n 4000] [--runs 3]

A broker may be a variant with transport options, e.g. ``pgjobs+hand_off=false`` (as in
``bench.stages``).

Each run, broker after broker: purge, publish --n no-op tasks with the batch path (untimed),
start one real ``celery worker`` (the harness's app and flags, ``bench/worker.py``) and, from
its ``worker_ready`` to the last task, read the CPU time (user + system, ``/proc/<pid>/stat``)
of the worker's main process, its pool children, and the broker's server processes (every
``postgres`` backend of the broker's database and the server's own auxiliary processes (WAL
writer, checkpointer...) for the PostgreSQL brokers, ``beam.smp`` for RabbitMQ,
``redis-server`` for Redis). Reports tasks/s and CPU ms per task of each part, median of
--runs, and the ratio of drain rates within each run.

On a 2-core machine a drain is bound by the main process's round trips with its children as
much as by CPU: a busy broker server slows it by taking the cores the main process and the
children wait for. Nothing here is a test; see docs/benchmarks.md for recorded runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.brokers import prepare, variant
from bench.measure import REPO_ROOT, BrokerRun, Config
from bench.pgidle import proc_stats
from bench.worker import Worker

_TICK = os.sysconf("SC_CLK_TCK")
_SERVERS = {"postgres": ("postgres",), "amqp": ("beam.smp",), "redis": ("redis-server",)}


def _processes() -> dict[int, tuple[str, int, float]]:
    """pid -> (command name, parent pid, CPU seconds) of every process we may read."""
    return {pid: (name, int(f[1]), (int(f[11]) + int(f[12])) / _TICK)
            for pid, name, f in proc_stats()}


def _ours(pid: int, database: str | None) -> bool:
    """A server process of the broker: for PostgreSQL, a backend of ``database`` or one of the
    server's auxiliary processes (no client address in its title), not other clients'."""
    if database is None:
        return True
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return f" {database} " in title or ("(" not in title and "[local]" not in title)


def _split(worker_pid: int, server: tuple[str, ...], database: str | None) -> dict[str, float]:
    parts = {"main": 0.0, "children": 0.0, "server": 0.0}
    for pid, (name, ppid, cpu) in _processes().items():
        if pid == worker_pid:
            parts["main"] += cpu
        elif ppid == worker_pid:
            parts["children"] += cpu
        elif name in server and _ours(pid, database):
            parts["server"] += cpu
    return parts


def one(run: BrokerRun, pool: str, concurrency: int, n: int) -> dict[str, float]:
    run.client("purge")
    run.client("publish", "--mode", "batch", "--n", str(n))
    worker = Worker(pool=pool, concurrency=concurrency, env=run.env,
                    state_dir=run.state_dir, cwd=REPO_ROOT)
    server = _SERVERS["postgres" if run.broker.pg_database else run.broker.name]
    with worker:
        t_ready = worker.wait_ready(60)
        assert worker.proc is not None
        before = _split(worker.proc.pid, server, run.broker.pg_database)
        done, t_done = worker.wait_count(n, 120)
        after = _split(worker.proc.pid, server, run.broker.pg_database)
    if done < n:
        raise RuntimeError(f"{run.broker.name}: {done}/{n} tasks ran")
    return {"rate": n / max(t_done - t_ready, 1e-9),
            **{k: 1000 * (after[k] - before[k]) / n for k in before}}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.cpu_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--brokers", default="pgjobs,amqp")
    p.add_argument("--pool", default="prefork", choices=["prefork", "threads"])
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    brokers = [variant(b) for b in args.brokers.split(",")]
    for broker in brokers:
        prepare(broker)
    rows: dict[str, list[dict[str, float]]] = {b.name: [] for b in brokers}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        for _ in range(args.runs):
            for broker in brokers:
                state = Path(tmp) / broker.name
                state.mkdir(exist_ok=True)
                run = BrokerRun(broker, Config(n=args.n), state, lambda _msg: None)
                rows[broker.name].append(one(run, args.pool, args.concurrency, args.n))
                time.sleep(1.0)
            if len(brokers) > 1:
                ratios.append(rows[brokers[0].name][-1]["rate"] / rows[brokers[1].name][-1]["rate"])
    summary = {name: {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
               for name, runs in rows.items()}
    if args.json:
        print(json.dumps({"summary": summary, "runs": rows, "ratios": ratios}, indent=2))
        return
    print(f"{args.pool} c={args.concurrency}, {args.n} no-op tasks, median of {args.runs}:")
    for name, s in summary.items():
        print(f"  {name:<7} {s['rate']:>7,.0f} tasks/s; CPU ms per task: main {s['main']:.3f}, "
              f"children {s['children']:.3f}, broker server {s['server']:.3f}")
    if ratios:
        print(f"  {brokers[0].name}/{brokers[1].name} drain, per run: "
              + ", ".join(f"{r:.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
