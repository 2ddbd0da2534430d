"""Claim throughput against queue depth: kombu consume+ack of the same batch of messages with
1,000 versus 1,000,000 ready rows queued behind it (the hot table and its index at depth).

    python -m bench.depth [--deep 1000000] [--shallow 1000] [--n 5000] [--runs 3]

Messages are consumed with one kombu consumer (prefetch 100), acking each; the figure is
messages/s for the first --n messages. The backlog is inserted with the batch path and purged
afterwards. Schema ``bench_depth`` in the database of $BENCH_PG_URL (default the local test
database).
"""

from __future__ import annotations

import argparse
import statistics
import time

import kombu
import psycopg

import kombu_pgjobs
from kombu_pgjobs.backend import release_all

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=URL)
    parser.add_argument("--deep", type=int, default=1_000_000)
    parser.add_argument("--shallow", type=int, default=1_000)
    parser.add_argument("--n", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
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
