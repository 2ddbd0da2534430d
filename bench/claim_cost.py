"""What a claim costs with dead entries at the head of the claim index, and after a vacuum.

    python -m bench.claim_cost [--window 4] [--rows 3000] [--dead 30000] [--runs 3]

Every settled message leaves dead entries in the claim index until a vacuum removes them, and
a claim walks over those at the head of its queue. This first publishes, claims and acks
``--dead`` messages (autovacuum off for the table, so what they leave behind stays), then
publishes ``--rows`` messages and claims them
``--window`` at a time with the previous claim's acks folded in, as a Celery worker with that
free window does. It reports the claim statement's p50/p90 time and messages/s, once with the
dead entries in place and once after ``VACUUM``. Schema ``bench_claim`` in the database of
$BENCH_PG_URL (default the local test database); dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import psycopg

from kombu_pgjobs.store.core import NewJob, QueueCore
from kombu_pgjobs.store.database import connect
from kombu_pgjobs.store.schema import migrate

URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = "bench_claim"
MESSAGE = json.dumps({"body": "x" * 300, "headers": {}, "properties": {}})


def run(window: int, rows: int, dead: int, vacuum: bool) -> tuple[float, float, float]:
    """(p50 ms, p90 ms, messages/s) of claiming ``rows`` messages ``window`` at a time."""
    with psycopg.connect(URL, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        migrate(admin, SCHEMA)
        admin.execute(f"ALTER TABLE {SCHEMA}.pgjobs_job SET (autovacuum_enabled = false)")
    core = QueueCore(SCHEMA, lease_ttl=30, max_attempts=5, worker="bench:1")
    conn = connect(URL)
    conn.execute("SET plan_cache_mode = force_generic_plan")  # as the transport's claims
    try:
        if dead:  # what earlier traffic leaves behind: claimed (updated), then acked (deleted)
            core.publish_many(conn, [NewJob("q", 0, None, None, None, "t", MESSAGE)] * dead)
            while claimed := core.claim(conn, ["q"], 100).claimed:
                core.ack(conn, [(c.id, c.claim) for c in claimed])
        if vacuum:
            conn.execute(f"VACUUM {SCHEMA}.pgjobs_job")
        core.publish_many(conn, [NewJob("q", 0, None, None, None, "t", MESSAGE)] * rows)
        times: list[float] = []
        acks: list[tuple[int, int]] = []
        done = 0
        start = time.perf_counter()
        while True:
            t = time.perf_counter()
            claimed = core.claim(conn, ["q"], window, acks).claimed
            times.append(time.perf_counter() - t)
            acks = [(c.id, c.claim) for c in claimed]
            done += len(acks)
            if not acks:
                break
        rate = done / (time.perf_counter() - start)
    finally:
        conn.close()
        with psycopg.connect(URL, autocommit=True) as admin:
            admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    times.sort()
    return times[len(times) // 2] * 1e3, times[int(len(times) * 0.9)] * 1e3, rate


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.claim_cost", description=__doc__)
    p.add_argument("--window", type=int, default=4, help="messages per claim (default 4)")
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--dead", type=int, default=30_000)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    for vacuum in (False, True):
        got = [run(args.window, args.rows, args.dead, vacuum) for _ in range(args.runs)]
        p50 = statistics.median(g[0] for g in got)
        p90 = statistics.median(g[1] for g in got)
        rate = statistics.median(g[2] for g in got)
        label = "after VACUUM" if vacuum else f"{args.dead:,} dead entries"
        print(f"claim {args.window} + ack, {label}: p50 {p50:.2f} ms, p90 {p90:.2f} ms, "
              f"{rate:,.0f} msg/s (median of {args.runs})")


if __name__ == "__main__":
    main()
