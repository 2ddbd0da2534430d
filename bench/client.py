"""Publisher-side operations, each run in a fresh subprocess with ``BENCH_BROKER_URL`` set.

A process per operation keeps brokers from sharing imports, pools or threads, and lets the
orchestrator bound every operation with a timeout. The result is one JSON line on stdout,
prefixed with ``BENCH-RESULT``.

  python -m bench.client check
  python -m bench.client purge
  python -m bench.client publish --mode single|batch --n N [--batch-helper module:function]
                                [--options JSON]
  python -m bench.client latency --samples 50 [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

RESULT_PREFIX = "BENCH-RESULT "
GAP_MIN, GAP_MAX = 0.05, 1.05  # seconds between latency samples


def _queue_op(purge: bool) -> int | None:
    """Declare the bench queue (so publishes never race its creation) and maybe purge it.

    Uses the app's connection pool, so a publish that follows reuses this connection and its
    timing does not include connecting. Returns the number of messages removed when the
    transport reports it.
    """
    from bench.app import QUEUE, app

    with app.pool.acquire(block=True) as conn:
        conn.ensure_connection(max_retries=1, timeout=10)
        channel = conn.default_channel
        queue = app.amqp.queues[QUEUE](channel)
        queue.declare()
        removed = queue.purge() if purge else None
    return removed if isinstance(removed, int) else None


def op_check(_: argparse.Namespace) -> dict[str, Any]:
    from bench import app as bench_app

    url = bench_app.app.conf.broker_url or ""
    if url.startswith("pgjobs") and bench_app.PGJOBS_IMPORT_ERROR:
        raise RuntimeError(f"import kombu_pgjobs failed: {bench_app.PGJOBS_IMPORT_ERROR}")
    with bench_app.app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=10)
        transport = type(conn.transport)
        name = f"{transport.__module__}.{transport.__qualname__}"
    _queue_op(purge=False)
    return {"transport": name}


def op_purge(_: argparse.Namespace) -> dict[str, Any]:
    return {"purged": _queue_op(purge=True)}


def op_publish(args: argparse.Namespace) -> dict[str, Any]:
    from bench import batch
    from bench.app import app, noop

    if args.options:
        app.conf.broker_transport_options = {
            **app.conf.broker_transport_options, **json.loads(args.options)}

    _queue_op(purge=True)
    if args.mode == "single":
        label = "delay"
        t0 = time.perf_counter()
        for i in range(args.n):
            noop.delay(i)
    else:
        scheme = str(app.conf.broker_url or "").partition(":")[0]
        label, publish = batch.load(args.batch_helper or batch.default_spec(scheme))
        t0 = time.perf_counter()
        publish(app, [noop.s(i) for i in range(args.n)])
    # The clock stops once the connection is closed: every publish is with the broker
    # (pgjobs confirms its unconfirmed publishes when the channel closes).
    app.pool.force_close_all()
    seconds = time.perf_counter() - t0
    return {"n": args.n, "seconds": seconds, "path": label}


def op_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Publish one task at a time to an idle worker; the task measures its own delay.

    After each sample a random pause, uniform in [GAP_MIN, GAP_MAX], lets the worker go back
    to its idle wait and puts each publish at a random phase of any polling loop of up to
    1 s (kombu's default ``polling_interval``). A short fixed pause would instead land every
    publish just after the previous delivery and bias polling brokers towards a full period.
    """
    from bench.app import stamp

    path = os.path.join(os.environ["BENCH_STATE_DIR"], "latency")
    rng = random.Random(args.seed)
    delays: list[float] = []
    publishes: list[float] = []
    timeouts = 0
    deadline = time.monotonic() + args.budget
    offset = os.path.getsize(path) if os.path.exists(path) else 0
    buf = b""
    for i in range(args.warmup + args.samples):
        if time.monotonic() > deadline:
            break
        sent = time.time()
        stamp.delay(sent)
        took = time.time() - sent  # the publish call alone
        wait_until = min(deadline, time.monotonic() + args.sample_timeout)
        got: float | None = None
        while got is None and time.monotonic() < wait_until:
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            buf += chunk
            if b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                got = float(line)
            else:
                time.sleep(0.002)
        if got is None:
            timeouts += 1
            # A late arrival would be mistaken for the next sample's; stop here.
            break
        if i >= args.warmup:
            delays.append(got)
            publishes.append(took)
        time.sleep(rng.uniform(GAP_MIN, GAP_MAX))
    return {"delays": delays, "publishes": publishes, "timeouts": timeouts}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.client")
    sub = parser.add_subparsers(dest="op", required=True)
    sub.add_parser("check")
    sub.add_parser("purge")
    p = sub.add_parser("publish")
    p.add_argument("--mode", choices=("single", "batch"), required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--batch-helper", default=None)
    p.add_argument("--options", default=None, help="JSON: extra transport options")
    p = sub.add_parser("latency")
    p.add_argument("--samples", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--sample-timeout", type=float, default=10.0)
    p.add_argument("--budget", type=float, default=120.0)
    args = parser.parse_args(argv)
    ops = {"check": op_check, "purge": op_purge, "publish": op_publish, "latency": op_latency}
    result = ops[args.op](args)
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
