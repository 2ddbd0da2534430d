"""Transport-level figures without Celery: batch publish and consume+ack from one process.

    python -m bench.kombu_level [--n 20000] [--prefetch 100] [--url pgjobs://...]

Batch publish: the messages go through ``QueueCore.publish_many`` 1,000 per INSERT (what
``kombu_pgjobs.batch()`` does). Consume+ack: one kombu Consumer with ``prefetch_count``,
acking each message in its callback, one ``drain_events`` loop. Schema ``bench_kombu``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import kombu
import psycopg

from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.store.core import job_from_message

SCHEMA = "bench_kombu"


def publish_in_batches(backend: Any, jobs: list[Any]) -> None:
    """Insert prepared jobs 1,000 per statement (what ``kombu_pgjobs.batch()`` does)."""
    for i in range(0, len(jobs), 1000):
        chunk = jobs[i:i + 1000]
        backend.publishing(lambda c, chunk=chunk: backend.core.publish_many(c, chunk))


def consume_and_ack(conn: kombu.Connection, channel: Any, queue: kombu.Queue, n: int,
                    prefetch: int) -> float:
    """msg/s of one kombu Consumer acking each of ``n`` messages in its callback."""
    got = 0

    def on_message(body: object, msg: kombu.Message) -> None:
        nonlocal got
        got += 1
        msg.ack()

    with kombu.Consumer(channel, [queue], callbacks=[on_message], accept=["json"],
                        prefetch_count=prefetch):
        start = time.perf_counter()
        while got < n:
            conn.drain_events(timeout=10)
        return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="pgjobs://postgres@127.0.0.1:5432/test")
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--prefetch", type=int, default=100)
    args = parser.parse_args()
    n = args.n
    queue = kombu.Queue("kb", kombu.Exchange("kb"), "kb")
    with kombu.Connection(args.url, transport_options={"schema": SCHEMA}) as conn:
        channel = conn.channel()
        queue(channel).declare()
        queue(channel).purge()
        message = channel.prepare_message('{"x": 1}', content_type="application/json",
                                          content_encoding="utf-8")
        message["properties"]["delivery_info"] = {"exchange": "kb", "routing_key": "kb"}
        jobs = [job_from_message("kb", message)] * n
        backend = conn.transport.backend
        start = time.perf_counter()
        publish_in_batches(backend, jobs)
        print(f"batch publish: {n / (time.perf_counter() - start):,.0f} msg/s")
        rate = consume_and_ack(conn, channel, queue, n, args.prefetch)
        print(f"consume+ack (prefetch {args.prefetch}): {rate:,.0f} msg/s")
    release_all()  # the process's backends deregister before their schema goes
    with psycopg.connect(args.url.replace("pgjobs://", "postgresql://"), autocommit=True) as db:
        db.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


if __name__ == "__main__":
    main()
