"""``python -m bench``: every figure, every broker, same machine, one go.

Exit status: 0, or 1 when pgjobs was asked for and could not be measured or failed a phase
in any run (that is what the CI smoke run, ``--quick``, checks), or 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.brokers import BrokerUnavailable, option_value, prepare, registry
from bench.measure import BrokerRun, Config, PhaseFailed
from bench.worker import stop_all

DEFAULT_BROKERS = "pgjobs,redis,amqp,sqla,pgmq"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _parse_opt(text: str) -> tuple[str, str, Any]:
    """``BROKER.KEY=VALUE``; VALUE is JSON when it parses, else a string."""
    target, sep, raw = text.partition("=")
    broker, dot, key = target.partition(".")
    if not (sep and dot and broker and key):
        raise argparse.ArgumentTypeError(f"expected BROKER.KEY=VALUE, got {text!r}")
    return broker, key, option_value(raw)


def _parse_helper(text: str) -> tuple[str, str]:
    broker, sep, spec = text.partition("=")
    if not (sep and ":" in spec):
        raise argparse.ArgumentTypeError(f"expected BROKER=module:function, got {text!r}")
    return broker, spec


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--brokers", help=f"comma list (default {DEFAULT_BROKERS}; pgjobs in --quick)")
    p.add_argument("--n", type=int, help="tasks per publish/drain (default 2000; 200 in --quick)")
    p.add_argument("--runs", type=int, help="repetitions, medians reported (default 3; 1 quick)")
    p.add_argument("--quick", action="store_true", help="CI smoke run: small N, one run, pgjobs")
    p.add_argument("--latency-samples", type=int, default=50)
    p.add_argument("--idle-window", type=float, help="seconds watched (default 30; 20 in --quick)")
    p.add_argument("--drain-timeout", type=float, help="seconds (default 90; 60 in --quick)")
    p.add_argument("--opt", type=_parse_opt, action="append", default=[], metavar="BROKER.KEY=VAL",
                   help="extra transport option, e.g. pgjobs.polling_interval=0.5")  # fmt: skip
    p.add_argument("--batch-helper", type=_parse_helper, action="append", default=[],
                   metavar="BROKER=module:function",
                   help="batch publish path, called as function(app, signatures)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write raw runs and summary as JSON")
    p.add_argument("--markdown", type=Path, help="write the table as Markdown")
    args = p.parse_args(argv)
    chosen = args.brokers or ("pgjobs" if args.quick else DEFAULT_BROKERS)
    args.brokers = [b.strip() for b in chosen.split(",") if b.strip()]
    args.n = args.n or (200 if args.quick else 2000)
    args.runs = args.runs or (1 if args.quick else 3)
    args.idle_window = args.idle_window or (20.0 if args.quick else 30.0)
    args.drain_timeout = args.drain_timeout or (60.0 if args.quick else 90.0)
    known = registry()
    for name in args.brokers + [o[0] for o in args.opt] + [h[0] for h in args.batch_helper]:
        if name not in known:
            p.error(f"unknown broker {name!r}; known: {', '.join(known)}")
    if args.n < 1 or args.runs < 1 or args.latency_samples < 1:
        p.error("--n, --runs and --latency-samples must be positive")
    return args


def _on_signal(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    atexit.register(stop_all)
    signal.signal(signal.SIGTERM, _on_signal)
    cfg = Config(
        n=args.n,
        latency_samples=args.latency_samples,
        idle_window=args.idle_window,
        drain_timeout=args.drain_timeout,
        batch_helpers=dict(args.batch_helper),
    )
    brokers = registry()
    for name, key, value in args.opt:
        brokers[name].transport_options[key] = value

    started = time.monotonic()
    meta: dict[str, Any] = {
        "n": args.n,
        "runs": args.runs,
        "host": f"{platform.node()} ({os.cpu_count()} cpu, Python {platform.python_version()})",
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "argv": sys.argv,
    }
    results: dict[str, dict[str, Any]] = {}
    state_root = Path(tempfile.mkdtemp(prefix="pgjobs-bench-"))
    try:
        for name in args.brokers:
            broker = brokers[name]
            results[name] = {"status": "ok", "url": broker.display_url, "runs": []}
            log(f"[{name}] preparing {broker.display_url}")
            try:
                prepare(broker)
                state = state_root / name
                state.mkdir()
                check = BrokerRun(broker, cfg, state, log).client("check", timeout=60)
                results[name]["transport"] = check["transport"]
            except (BrokerUnavailable, PhaseFailed) as exc:
                results[name].update(status="skipped", reason=str(exc))
                log(f"[{name}] skipped: {exc}")

        for run in range(1, args.runs + 1):
            for name, res in results.items():
                if res["status"] != "ok":
                    continue
                log(f"[{name}] run {run}/{args.runs}")
                res["runs"].append(BrokerRun(brokers[name], cfg, state_root / name, log).run())
    except KeyboardInterrupt:
        log("interrupted; stopping workers")
        stop_all()
        return 130
    finally:
        stop_all()
        shutil.rmtree(state_root, ignore_errors=True)

    meta["elapsed_s"] = time.monotonic() - started
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = report.markdown(results, meta)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        payload = {"meta": meta, "results": results, "summary": report.build(results)}
        args.json.write_text(json.dumps(payload, indent=2, default=str) + "\n")

    pg = results.get("pgjobs")
    if pg is not None and (pg["status"] != "ok" or any(r["errors"] for r in pg["runs"])):
        log("pgjobs did not complete every phase (see Notes)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
