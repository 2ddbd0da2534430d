"""Claim throughput with limits on versus off: kombu consume+ack from one process, no Celery.

    python -m bench.limits [--n 10000] [--prefetch 32] [--keys 100] [--per-key 4] [--runs 3]

Each run publishes N messages and drains them with one kombu Consumer acking each message, four
ways, in the same run:

* ``off``: no limits (the plain claim);
* ``keyed``: every message carries a concurrency key (one of ``--keys``, ``--per-key`` each);
* ``keyed+cap``: the key plus a fleet-wide cap of the prefetch window (two slots per message);
* ``rate``: a start rate per key high enough never to bind (the rate bookkeeping alone).

It reports the median msg/s of each and its ratio to ``off``. With one consumer the caps never
bind, so the figure is what the slot bookkeeping costs per claim and ack, not waiting.

``--celery`` adds the same comparison (off / keyed) inside a real ``celery worker`` (the
benchmark app, threads pool, ``--concurrency`` 8): the drain rate of N no-op tasks published with
and without a concurrency key. Schema ``bench_limits``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import kombu
import psycopg

from bench.kombu_level import consume_and_ack, publish_in_batches
from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.limits import LIMITS_HEADER
from kombu_pgjobs.store.core import job_from_message

SCHEMA = "bench_limits"


def _limits(mode: str, i: int, keys: int, per_key: int, prefetch: int) -> Any:
    key = {"key": f"key:bench:{i % keys}", "limit": per_key}
    if mode == "keyed":
        return {"concurrency": [key]}
    if mode == "keyed+cap":
        return {"concurrency": [key, {"key": "task:bench", "limit": prefetch}]}
    if mode == "rate":
        return {"rate": [{"key": f"tenant:{i % keys}", "limit": 100_000, "per": 60}]}
    return None


def vacuum(url: str) -> None:
    """Start every run from a vacuumed table, so that no mode pays for an earlier one's dead rows
    (this machine's server runs with autovacuum off; see docs/benchmarks.md)."""
    with psycopg.connect(url.replace("pgjobs://", "postgresql://"), autocommit=True) as db:
        for table in ("pgjobs_job", "pgjobs_slot", "pgjobs_rate"):
            if db.execute("SELECT to_regclass(%s)", (f"{SCHEMA}.{table}",)).fetchone()[0]:
                db.execute(f"VACUUM ANALYZE {SCHEMA}.{table}")


def one_run(conn: kombu.Connection, mode: str, n: int, prefetch: int, keys: int,
            per_key: int) -> float:
    queue = kombu.Queue("kl", kombu.Exchange("kl"), "kl")
    channel = conn.channel()
    queue(channel).declare()
    queue(channel).purge()
    backend = conn.transport.backend
    jobs = []
    for i in range(n):
        message = channel.prepare_message('{"x": 1}', content_type="application/json",
                                          content_encoding="utf-8")
        limits = _limits(mode, i, keys, per_key, prefetch)
        if limits is not None:
            message["headers"] = {LIMITS_HEADER: limits}
        jobs.append(job_from_message("kl", message))
    publish_in_batches(backend, jobs)
    vacuum(conn.as_uri(include_password=True))
    rate = consume_and_ack(conn, channel, queue, n, prefetch)
    channel.close()
    return rate


def celery_run(url: str, mode: str, n: int, keys: int, per_key: int) -> float:
    """Drain rate (tasks/s) of a real worker over N no-op tasks published with ``mode``."""
    import kombu_pgjobs
    from bench.app import app, noop
    from bench.worker import Worker

    with tempfile.TemporaryDirectory() as state:
        env = {**os.environ, "BENCH_BROKER_URL": url, "BENCH_STATE_DIR": state,
               "BENCH_TRANSPORT_OPTIONS": json.dumps({"schema": SCHEMA}),
               "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        with app.connection_for_write() as conn:
            conn.default_channel.queue_purge("bench")
        with kombu_pgjobs.batch():
            for i in range(n):
                limits = _limits(mode, i, keys, per_key, 0)
                noop.apply_async((i,), headers={LIMITS_HEADER: limits} if limits else None)
        vacuum(url)
        worker = Worker(pool="threads", concurrency=8, env=env, state_dir=Path(state),
                        cwd=Path(__file__).resolve().parent.parent)
        with worker:
            t_ready = worker.wait_ready(60)
            done, t_done = worker.wait_count(n, 120)
        if done < n:
            raise SystemExit(f"only {done}/{n} ran: {worker.log_tail()}")
        return n / (t_done - t_ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="pgjobs://postgres@127.0.0.1:5432/test")
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--prefetch", type=int, default=32)
    parser.add_argument("--keys", type=int, default=100)
    parser.add_argument("--per-key", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--celery", action="store_true",
                        help="also drain through a real celery worker (off vs keyed)")
    args = parser.parse_args()
    os.environ.setdefault("BENCH_BROKER_URL", args.url)
    os.environ.setdefault("BENCH_TRANSPORT_OPTIONS", json.dumps({"schema": SCHEMA}))
    modes = ("off", "keyed", "keyed+cap", "rate")
    results: dict[str, list[float]] = {m: [] for m in modes}
    with kombu.Connection(args.url, transport_options={"schema": SCHEMA}) as conn:
        for _ in range(args.runs):
            for mode in modes:
                results[mode].append(one_run(conn, mode, args.n, args.prefetch, args.keys,
                                             args.per_key))
    base = statistics.median(results["off"])
    print(f"consume+ack, N={args.n}, prefetch {args.prefetch}, {args.keys} keys x "
          f"{args.per_key}, median of {args.runs} runs")
    print(f"{'mode':<10} {'msg/s':>8} {'min-max':>15} {'vs off':>7}")
    for mode in modes:
        med = statistics.median(results[mode])
        spread = f"{min(results[mode]):,.0f}-{max(results[mode]):,.0f}"
        print(f"{mode:<10} {med:>8,.0f} {spread:>15} {med / base:>6.2f}x")
    if args.celery:
        drained: dict[str, list[float]] = {"off": [], "keyed": []}
        for _ in range(args.runs):
            for mode in drained:
                drained[mode].append(celery_run(args.url, mode, args.n, args.keys, args.per_key))
        base = statistics.median(drained["off"])
        print(f"celery worker drain (threads x 8), N={args.n}, median of {args.runs} runs")
        for mode, rates in drained.items():
            med = statistics.median(rates)
            print(f"{mode:<10} {med:>8,.0f} {min(rates):>7,.0f}-{max(rates):<7,.0f}"
                  f" {med / base:>6.2f}x")
    release_all()  # the process's backends deregister before their schema goes
    with psycopg.connect(args.url.replace("pgjobs://", "postgresql://"), autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


if __name__ == "__main__":
    main()
