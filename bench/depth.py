"""Claim throughput against queue depth: kombu consume+ack of the same batch of messages with
1,000 versus 1,000,000 ready rows queued behind it (the hot table and its index at depth).

    python -m bench.depth [--deep 1000000] [--shallow 1000] [--n 5000] [--runs 3]
    python -m bench.depth --delayed 100000 [--n 3000] [--window 4] [--runs 3]

Messages are consumed with one kombu consumer (prefetch 100), acking each; the figure is
messages/s for the first --n messages. The backlog is inserted with the batch path and purged
afterwards. Schema ``bench_depth`` in the database of $BENCH_PG_URL (default the local test
database).

With ``--delayed N`` it measures instead what N delayed (ETA) rows cost the claim: N rows of
priority 9 due in an hour stand in front of the claim order of --n due rows of priority 0. It
reports the claim statement's p50 when idle (no due row: only the delayed ones), and p50 and
messages/s of claiming the due rows --window at a time with the previous claim's acks folded
in (as a Celery worker with that free window does), with no delayed rows and with N.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timedelta, timezone

import kombu
import psycopg

import kombu_pgjobs
from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.store.core import NewJob, QueueCore
from kombu_pgjobs.store.database import connect
from kombu_pgjobs.store.schema import migrate

URL = "pgjobs://postgres@127.0.0.1:5432/test"
SCHEMA = "bench_depth"


def fill(url: str, depth: int) -> None:
    with kombu.Connection(url, transport_options={"schema": SCHEMA}) as conn:
        producer = conn.Producer()
        queue = kombu.Queue("depth", kombu.Exchange("depth"), "depth")
        queue(conn.default_channel).declare()
        done = 0
        while done < depth:
            step = min(10_000, depth - done)
            with kombu_pgjobs.batch():
                for _ in range(step):
                    producer.publish({"x": 1}, exchange=queue.exchange, routing_key="depth")
            done += step


def drain(url: str, n: int) -> float:
    got = 0

    def on_message(body: object, message: kombu.Message) -> None:
        nonlocal got
        got += 1
        message.ack()

    with kombu.Connection(url, transport_options={"schema": SCHEMA}) as conn:
        queue = kombu.Queue("depth", kombu.Exchange("depth"), "depth")
        with conn.Consumer(queue, callbacks=[on_message], prefetch_count=100):
            start = time.perf_counter()
            while got < n:
                conn.drain_events(timeout=10)
            return n / (time.perf_counter() - start)


def measure(url: str, depth: int, n: int) -> float:
    with psycopg.connect(url.replace("pgjobs://", "postgresql://"), autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    fill(url, depth + n)
    with psycopg.connect(url.replace("pgjobs://", "postgresql://"), autocommit=True) as db:
        db.execute(f"VACUUM ANALYZE {SCHEMA}.pgjobs_job")
    rate = drain(url, n)
    release_all()
    return rate


MESSAGE = json.dumps({"body": "x" * 300, "headers": {}, "properties": {}})


def _p50(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def delayed_cost(url: str, delayed: int, n: int, window: int) -> tuple[float, float, float]:
    """(idle claim p50 ms, claim+ack p50 ms, messages/s) with ``delayed`` rows in front."""
    dsn = url.replace("pgjobs://", "postgresql://")
    with psycopg.connect(dsn, autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        migrate(db, SCHEMA)
    core = QueueCore(SCHEMA, lease_ttl=30, max_attempts=5, worker="bench:1")
    conn = connect(dsn)
    conn.execute("SET plan_cache_mode = force_generic_plan")  # as the transport's claims
    try:
        later = datetime.now(timezone.utc) + timedelta(hours=1)
        for done in range(0, delayed, 10_000):
            step = min(10_000, delayed - done)
            core.publish_many(conn, [NewJob("depth", 9, later, None, None, "t", MESSAGE)] * step)
        conn.execute(f"VACUUM ANALYZE {SCHEMA}.pgjobs_job")
        idle: list[float] = []
        for _ in range(200):
            t = time.perf_counter()
            core.claim(conn, ["depth"], window)
            idle.append(time.perf_counter() - t)
        core.publish_many(conn, [NewJob("depth", 0, None, None, None, "t", MESSAGE)] * n)
        times: list[float] = []
        acks: list[tuple[int, int]] = []
        got = 0
        start = time.perf_counter()
        while True:
            t = time.perf_counter()
            claimed = core.claim(conn, ["depth"], window, acks).claimed
            times.append(time.perf_counter() - t)
            acks = [(c.id, c.claim) for c in claimed]
            got += len(acks)
            if not acks:
                break
        rate = got / (time.perf_counter() - start)
        assert got == n, f"claimed {got} of {n} due rows"
    finally:
        conn.close()
        with psycopg.connect(dsn, autocommit=True) as db:
            db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    return _p50(idle), _p50(times), rate


def main_delayed(args: argparse.Namespace) -> None:
    for delayed in (0, args.delayed):
        got = [delayed_cost(args.url, delayed, args.n, args.window) for _ in range(args.runs)]
        idle = statistics.median(g[0] for g in got)
        p50 = statistics.median(g[1] for g in got)
        rate = statistics.median(g[2] for g in got)
        print(f"{delayed:,} delayed rows in front: idle claim p50 {idle:.2f} ms; "
              f"claim {args.window} + ack p50 {p50:.2f} ms, {rate:,.0f} msg/s "
              f"(median of {args.runs})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--deep", type=int, default=1_000_000)
    parser.add_argument("--shallow", type=int, default=1_000)
    parser.add_argument("--n", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--delayed", type=int, default=0,
                        help="measure the claim with this many delayed rows in front instead")
    parser.add_argument("--window", type=int, default=4,
                        help="--delayed: messages per claim (default 4)")
    args = parser.parse_args()
    if args.delayed:
        main_delayed(args)
        return
    shallow, deep = [], []
    for _ in range(args.runs):
        shallow.append(measure(args.url, args.shallow, args.n))
        deep.append(measure(args.url, args.deep, args.n))
        print(f"run: {args.shallow:,} queued {shallow[-1]:,.0f}/s, "
              f"{args.deep:,} queued {deep[-1]:,.0f}/s", flush=True)
    s, d = statistics.median(shallow), statistics.median(deep)
    print(f"consume+ack with {args.shallow:,} queued: {s:,.0f}/s (median of {args.runs})")
    print(f"consume+ack with {args.deep:,} queued: {d:,.0f}/s (median of {args.runs})")
    print(f"ratio deep/shallow: {d / s:.2f}")
    with psycopg.connect(args.url.replace("pgjobs://", "postgresql://"), autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


if __name__ == "__main__":
    main()
