"""What the failover fence costs on a deep job table: the first connection and claim after a
server start, under the default timeouts.

    python -m bench.fence [--rows 10000000] [--compare-v14]

Fills schema ``bench_fence`` (in the database of $BENCH_PG_URL, default the local test
database) with ``--rows`` messages, then makes the schema see a server start it has not fenced
(its recorded ``pgjobs_epoch.started`` set back: what a restart, a promotion or a restore looks
like to the fence, without restarting a shared server) and times, with the transport's default
``statement_timeout`` (60 s), the first pgjobs connection (which fences) and the first claim.
It checks that no message's claim number moved and that the claim is numbered above every
earlier one. ``--compare-v14`` also times what schema 14's fence did on the same table — one
``UPDATE`` of every row's claim number — inside a transaction rolled back. Dropped afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import psycopg

from kombu_pgjobs.broker.backend import Backend
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate

URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = "bench_fence"
MESSAGE = json.dumps({"body": "x" * 100, "headers": {}, "properties": {}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--compare-v14", action="store_true")
    args = parser.parse_args()
    with psycopg.connect(URL, autocommit=True) as admin:
        admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        migrate(admin, SCHEMA)
        started = time.monotonic()
        done = 0
        while done < args.rows:  # in slices: one statement of 10M rows needs much memory
            n = min(1_000_000, args.rows - done)
            admin.execute(
                f"INSERT INTO {SCHEMA}.pgjobs_job (queue, message, claim) "
                "SELECT 'deep', %s::json, (g %% 1000) + 1 FROM generate_series(1, %s) AS g",
                (MESSAGE, n))
            done += n
        admin.execute(f"INSERT INTO {SCHEMA}.pgjobs_job (queue, message) VALUES ('fresh', %s)",
                      (MESSAGE,))
        admin.execute(f"ANALYZE {SCHEMA}.pgjobs_job")
        filled = time.monotonic() - started
        deep = f"SELECT sum(claim), max(claim) FROM {SCHEMA}.pgjobs_job WHERE queue = 'deep'"
        before = admin.execute(deep).fetchone()
        assert before is not None
        # what a server start looks like to the fence
        admin.execute(f"UPDATE {SCHEMA}.pgjobs_epoch SET started = '-infinity'")
        options = TransportOptions(schema=SCHEMA)  # statement_timeout 60 s, lock_timeout 10 s
        backend = Backend(URL, options)
        t0 = time.monotonic()
        conn = backend.connect(hot=True)
        connected = time.monotonic() - t0
        core = QueueCore(SCHEMA, lease_ttl=30, max_attempts=5, worker="bench:1")
        t0 = time.monotonic()
        claimed = core.claim(conn, ["fresh"], 1).claimed
        claimed_in = time.monotonic() - t0
        conn.close()
        after = admin.execute(deep).fetchone()
        epoch = admin.execute(f"SELECT base, fences FROM {SCHEMA}.pgjobs_epoch").fetchone()
        assert claimed and claimed[0].claim > before[1], (claimed, before)
        assert after == before, "the fence rewrote claim numbers"
        result = {
            "rows": args.rows, "fill_s": round(filled, 1),
            "first_connection_ms": round(connected * 1000, 1),
            "first_claim_ms": round(claimed_in * 1000, 1),
            "claim_numbers_moved": 0, "new_claim": claimed[0].claim,
            "max_claim_before": before[1], "base": epoch[0] if epoch else None,
        }
        if args.compare_v14:
            with psycopg.connect(URL) as tx:  # a transaction, rolled back at the end
                tx.execute("SET statement_timeout = 0")
                t0 = time.monotonic()
                tx.execute(f"UPDATE {SCHEMA}.pgjobs_job SET claim = claim + 1048576")
                result["v14_rewrite_s"] = round(time.monotonic() - t0, 1)
                tx.rollback()
        admin.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
