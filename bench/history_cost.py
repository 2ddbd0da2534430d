"""What the task history costs a drain's settles, measured on the statements themselves.

    python -m bench.history_cost [--rows 4000] [--window 8] [--rounds 5]

A Celery worker settles through the claim statement: each claim carries the previous window's
acks, and with ``history`` on that statement also inserts one ``pgjobs_history`` row per ack.
This publishes ``--rows`` messages of two task names into a fresh schema and drains them
``--window`` at a time exactly so (the previous claim's acks folded into the next claim), once
with history on and once off, in ``--rounds`` interleaved rounds (the order alternates), and
prints each round's messages/s and the on/off ratio; the figure is the worst round's ratio and
the median's. Schemas ``bench_hist_on`` / ``bench_hist_off`` in $BENCH_PG_URL (default the
local test database), dropped afterwards. The whole-worker figure is ``python -m bench
--brokers pgjobs,pgjobs_nohist`` (a real Celery worker each), which a busy machine makes noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import psycopg

from kombu_pgjobs.store.core import NewJob, QueueCore
from kombu_pgjobs.store.schema import migrate

URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _message(n: int) -> str:
    return json.dumps({"body": "x" * 200, "headers": {"task": f"bench.t{n % 2}", "id": str(n)},
                       "properties": {}})


def drain(history: bool, rows: int, window: int) -> float:
    """Messages/s of draining ``rows`` messages with acks folded into the next claim."""
    schema = f"bench_hist_{'on' if history else 'off'}"
    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        migrate(conn, schema)
        core = QueueCore(schema, lease_ttl=30, max_attempts=5, worker="bench:1",
                         history=history)
        core.publish_many(conn, [NewJob(queue="q", priority=0, run_at=None, ttl_ms=None,
                                        max_attempts=None, task=f"bench.t{i % 2}",
                                        message=_message(i)) for i in range(rows)])
        conn.execute(f"VACUUM ANALYZE {schema}.pgjobs_job")
        acks: list[tuple[int, int]] = []
        started = time.perf_counter()
        done = 0
        while True:
            result = core.claim(conn, ["q"], window, acks)
            acks = [(c.id, c.claim) for c in result.claimed]
            done += len(result.acked)
            if not acks:
                break
        took = time.perf_counter() - started
        kept = conn.execute(f"SELECT count(*) FROM {schema}.pgjobs_history").fetchone()[0]
        assert done == rows and kept == (rows if history else 0), (done, kept)
        conn.execute(f"DROP SCHEMA {schema} CASCADE")
    return rows / took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {h: drain(h, args.rows, args.window) for h in order}
        rounds.append({"on": got[True], "off": got[False], "ratio": got[True] / got[False]})
        if not args.json:
            print(f"round {r + 1}: history on {got[True]:,.0f}/s, off {got[False]:,.0f}/s, "
                  f"on/off {got[True] / got[False]:.3f}", flush=True)
    ratios = [x["ratio"] for x in rounds]
    summary = {"rows": args.rows, "window": args.window, "rounds": rounds,
               "ratio_median": statistics.median(ratios), "ratio_worst": min(ratios),
               "load": os.getloadavg()}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"on/off: median {summary['ratio_median']:.3f}, worst round "
              f"{summary['ratio_worst']:.3f} (load {summary['load'][0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
