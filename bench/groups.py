"""A plain ``group(...).apply_async()`` against the ceiling of Celery's own path, in one run.

    python -m bench.groups [--n 2000] [--rounds 5] [--paths memory,pgjobs,...] [--quick]

Each round publishes the same group of ``--n`` no-op signatures once per path, every path in
a fresh ``python -m bench.groups publish`` subprocess (no shared imports, pools or threads),
paths interleaved round after round (in reverse order every second round), so each ratio
compares figures taken seconds apart. The clock runs from ``group(...)`` to the producer's
connections closed (every broker holds every message by then), as in ``python -m bench``'s
batch row; the queue is declared on the producer's connection before the clock starts (a
process that has published before). After the clock stops, the queue is purged through a new
connection and the count removed must be ``--n`` for pgjobs (else the run fails: exit
status 1).

Paths (``--paths``):

``memory``        kombu's ``memory://`` (no I/O at all), a plain Celery app: the ceiling of the
                  Celery path on this machine;
``pgjobs``        the figure: a plain ``group(...).apply_async()`` on an app with
                  ``celery_ext.install(app)`` (one INSERT, durable when it returns);
``pgjobs-batch``  the same inside an explicit ``with kombu_pgjobs.batch():``;
``pgjobs-stock``  pgjobs without celery_ext: Celery's group, one INSERT per message;
``amqp``          RabbitMQ (no publisher confirms, Celery's default);
``redis``         Redis.

Reported: each path's tasks/s per round, and ``pgjobs`` over ``memory``, ``amqp`` and
``redis`` within each round (the per-round minimum is the figure that counts); then the
publishing process's own CPU time per signature (``time.process_time()`` over the same
window), which a busy machine disturbs far less than wall time (the broker's CPU is not in it:
pgjobs's INSERT runs in its server, RabbitMQ's and Redis's work in theirs). Brokers use
their ``python -m bench`` URLs (``BENCH_<NAME>_URL``); pgjobs works in its own schema
(``bench_groups``) and every path in the queue ``bench_groups``, so a concurrent
``python -m bench`` is not disturbed. A path whose broker cannot be reached is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.brokers import BrokerUnavailable, prepare, registry

QUEUE = "bench_groups"
SCHEMA = "bench_groups"
RESULT = "BENCH-GROUPS "
#: path -> (broker of bench.brokers, celery_ext installed, explicit batch())
PATHS: dict[str, tuple[str, bool, bool]] = {
    "memory": ("memory", False, False),
    "pgjobs": ("pgjobs", True, False),
    "pgjobs-batch": ("pgjobs", True, True),
    "pgjobs-stock": ("pgjobs", False, False),
    "amqp": ("amqp", False, False),
    "redis": ("redis", False, False),
}
DEFAULT_PATHS = "memory,pgjobs,pgjobs-batch,amqp,redis"


def _url(broker: str) -> str:
    return "memory://" if broker == "memory" else registry()[broker].url


def publish(path: str, n: int) -> dict[str, Any]:
    """One timed group publish on ``path`` (run in its own process)."""
    from celery import Celery, group

    broker, ext, explicit = PATHS[path]
    app = Celery("bench_groups", broker=_url(broker))
    if ext:
        import celery_ext

        celery_ext.install(app)
    app.conf.update(
        broker_transport_options={"schema": SCHEMA} if broker == "pgjobs" else {},
        broker_connection_retry_on_startup=True, broker_connection_max_retries=3,
        result_backend=None, task_ignore_result=True, task_default_queue=QUEUE)

    @app.task(name="bench.noop")
    def noop(seq: int) -> None:  # never run: the figure is the publish
        return None

    def purge() -> int | None:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=10)
            queue = app.amqp.queues[QUEUE](conn.default_channel)
            queue.declare()
            removed = queue.purge()
        return removed if isinstance(removed, int) else None

    purge()
    # Connected, and the queue declared on the producer's connection (kombu then skips its
    # declaration at the first member), before the clock: a process's steady state.
    with app.producer_or_acquire() as producer:
        producer.connection.ensure_connection(max_retries=1, timeout=10)
        producer.maybe_declare(app.amqp.queues[QUEUE])
    signatures = [noop.s(i) for i in range(n)]
    start, cpu = time.perf_counter(), time.process_time()
    if explicit:
        import kombu_pgjobs

        with kombu_pgjobs.batch():
            group(signatures, app=app).apply_async()
    else:
        group(signatures, app=app).apply_async()
    app.pool.force_close_all()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    # memory:// lives in this process only: its purge sees what the group put there
    landed = purge()
    return {"path": path, "n": n, "seconds": seconds, "rate": n / seconds, "cpu": cpu,
            "landed": landed}


def _run_child(path: str, n: int, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.groups", "publish", "--path", path, "--n", str(n)],
        capture_output=True, text=True, timeout=timeout, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return dict(json.loads(line[len(RESULT):]))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"path": path, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.groups", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="op")
    child = sub.add_parser("publish")
    child.add_argument("--path", choices=sorted(PATHS), required=True)
    child.add_argument("--n", type=int, required=True)
    p.add_argument("--n", type=int, help="signatures per group (default 2000; 200 in --quick)")
    p.add_argument("--rounds", type=int, help="interleaved rounds (default 5; 1 in --quick)")
    p.add_argument("--paths", help=f"comma list (default {DEFAULT_PATHS}; memory,pgjobs quick)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: N=200, one round")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per publish")
    p.add_argument("--json", help="write every round's figures here")
    args = p.parse_args(argv)
    if args.op == "publish":
        sys.stdout.write(RESULT + json.dumps(publish(args.path, args.n)) + "\n")
        return 0
    n = args.n or (200 if args.quick else 2000)
    rounds = args.rounds or (1 if args.quick else 5)
    paths = [x.strip() for x in (args.paths or ("memory,pgjobs" if args.quick
                                                else DEFAULT_PATHS)).split(",") if x.strip()]
    unknown = [x for x in paths if x not in PATHS]
    if unknown or n < 1 or rounds < 1:
        p.error(f"unknown paths {unknown}; known: {', '.join(PATHS)}" if unknown
                else "--n and --rounds must be positive")
    skipped: dict[str, str] = {}
    brokers = registry()
    for path in paths:
        broker = PATHS[path][0]
        if broker != "memory":
            try:
                prepare(brokers[broker])
            except BrokerUnavailable as exc:
                skipped[path] = str(exc)
    live = [x for x in paths if x not in skipped]
    table: list[dict[str, dict[str, Any]]] = []
    failed = False
    for r in range(1, rounds + 1):
        row: dict[str, dict[str, Any]] = {}
        for path in live if r % 2 else live[::-1]:  # no path always first after a pause
            res = _run_child(path, n, args.timeout)
            if "error" not in res and PATHS[path][0] == "pgjobs" and res.get("landed") != n:
                res["error"] = f"{res.get('landed')} of {n} messages in the queue after publish"
            if "error" in res and PATHS[path][0] == "pgjobs":
                failed = True
            row[path] = res
            shown = f"{res['rate']:,.0f}/s" if "error" not in res else res["error"]
            print(f"round {r}: {path:<13} {shown}", file=sys.stderr, flush=True)
        table.append(row)
    _report(table, live, skipped, n, rounds)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"n": n, "rounds": table, "skipped": skipped,
                       "load": os.getloadavg()}, fh, indent=2)
    return 1 if failed else 0


def _report(table: list[dict[str, dict[str, Any]]], paths: list[str], skipped: dict[str, str],
            n: int, rounds: int) -> None:
    def rate(row: dict[str, dict[str, Any]], path: str) -> float | None:
        res = row.get(path) or {}
        return None if "error" in res else res.get("rate")

    over = [x for x in ("memory", "amqp", "redis", "pgjobs-batch") if x in paths]
    head = ["round", *paths] + [f"pgjobs/{x}" for x in over if "pgjobs" in paths]
    print(f"group of {n} signatures, {rounds} interleaved rounds, tasks/s; ratios per round")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    ratios: dict[str, list[float]] = {x: [] for x in over}
    for i, row in enumerate(table, 1):
        cells = [str(i)]
        for path in paths:
            v = rate(row, path)
            cells.append(f"{v:,.0f}" if v else "failed")
        if "pgjobs" in paths:
            for x in over:
                q = _ratio(rate(row, "pgjobs"), rate(row, x))
                if q is not None:
                    ratios[x].append(q)
                cells.append(f"{q:.2f}x" if q is not None else "-")
        print("| " + " | ".join(cells) + " |")
    for x, qs in ratios.items():
        if qs and "pgjobs" in paths:
            print(f"pgjobs/{x}: min {min(qs):.2f}x, median {statistics.median(qs):.2f}x, "
                  f"max {max(qs):.2f}x")
    cpu = {x: [row[x]["cpu"] * 1000 / n for row in table if "cpu" in row.get(x, {})]
           for x in paths}
    print("publisher CPU per signature (µs, median of the rounds; the broker's own CPU not "
          "included): " + ", ".join(f"{x} {statistics.median(v) * 1000:.0f}"
                                    for x, v in cpu.items() if v))
    for path, reason in skipped.items():
        print(f"{path}: skipped ({reason})")


if __name__ == "__main__":
    sys.exit(main())
