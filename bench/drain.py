"""Drain throughput only, per pool and concurrency, brokers side by side in interleaved rounds.

    python -m bench.drain [--brokers pgjobs,amqp] [--pools prefork:2,prefork:8,threads:8]
                          [--n 3000] [--rounds 5] [--json PATH]

The full ``python -m bench`` run measures a drain on prefork c=2 and threads c=8 among many
other phases; this one measures only drains, so five rounds fit in minutes. Per round and pool,
each broker in turn (the order rotates each round): purge, publish ``--n`` ``noop`` tasks
(untimed), start a real ``celery worker`` of that pool and concurrency, and time from its ready
signal until the ``--n`` tasks ran (bench/app.py, the same app and worker flags as ``python -m
bench``). It prints each round's tasks/s and every broker's ratio to the first broker within
the round; the figure per pool is the **worst round's** ratio (issue 35: a median must not hide
a losing round) and the median's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.brokers import BrokerUnavailable, prepare, registry
from bench.measure import BrokerRun, Config, PhaseFailed
from bench.worker import stop_all


def _pools(text: str) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        pool, _, conc = item.strip().partition(":")
        out.append((pool, int(conc or 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.drain", description=__doc__.splitlines()[0])
    p.add_argument("--brokers", default="pgjobs,amqp", help="comma list; the first is measured "
                   "against the others (default pgjobs,amqp)")
    p.add_argument("--pools", type=_pools, default=_pools("prefork:2,prefork:8,threads:8"))
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    names = [b.strip() for b in args.brokers.split(",") if b.strip()]
    known = registry()
    state_root = Path(tempfile.mkdtemp(prefix="pgjobs-bench-drain-"))
    runs: dict[str, BrokerRun] = {}
    try:
        for name in names:
            broker = known[name]
            try:
                prepare(broker)
            except BrokerUnavailable as exc:
                print(f"[{name}] skipped: {exc}", file=sys.stderr)
                continue
            state = state_root / name
            state.mkdir()
            runs[name] = BrokerRun(broker, Config(n=args.n), state, lambda m: None)
        if len(runs) < 1:
            return 1
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = list(runs)[r % len(runs):] + list(runs)[:r % len(runs)]
            for pool, conc in args.pools:
                got: dict[str, float] = {}
                for name in order:
                    run = runs[name]
                    run.cfg.prefork_concurrency = conc if pool == "prefork" else 2
                    run.cfg.threads_concurrency = conc if pool == "threads" else 8
                    try:
                        run.purge()
                        run.publish("single", None)
                        with run.worker(pool) as worker:
                            run.drain(worker, "drain")
                        got[name] = run.figures["drain"]
                    except PhaseFailed as exc:
                        print(f"round {r + 1} {pool}:{conc} {name}: {exc}", file=sys.stderr)
                first = names[0]
                ratios = {n: got[first] / got[n] for n in got if n != first and first in got}
                rounds.append({"round": r + 1, "pool": f"{pool}:{conc}", "tasks_per_s": got,
                               "ratios": ratios})
                print(f"round {r + 1} {pool} c={conc}: "
                      + ", ".join(f"{n} {v:,.0f}/s" for n, v in got.items()) + "; "
                      + ", ".join(f"{first}/{n} {v:.2f}" for n, v in ratios.items()),
                      flush=True)
        summary: dict[str, Any] = {"n": args.n, "rounds": rounds, "per_pool": {}}
        for pool, conc in args.pools:
            key = f"{pool}:{conc}"
            for other in names[1:]:
                rs = [x["ratios"][other] for x in rounds
                      if x["pool"] == key and other in x["ratios"]]
                if rs:
                    summary["per_pool"][f"{key} {names[0]}/{other}"] = {
                        "worst": min(rs), "median": statistics.median(rs), "rounds": rs}
        for key, v in summary["per_pool"].items():
            print(f"{key}: worst round {v['worst']:.2f}, median {v['median']:.2f} "
                  f"({', '.join(f'{x:.2f}' for x in v['rounds'])})")
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2))
        return 0
    finally:
        stop_all()
        time.sleep(0.1)


if __name__ == "__main__":
    raise SystemExit(main())
