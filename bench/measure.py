"""One run of every figure for one broker.

Order within a run (one broker at a time, so brokers never compete for the 2 cores):
  0. pgjobs only: the same publish with durable_publish=False, then also with
     confirm_publish=False                     -> publish_single_nondurable, _unconfirmed
     RabbitMQ only: with publisher confirms (confirm_publish=True)
                                               -> publish_single_confirmed
  1. purge, publish N with ``task.delay()`` (timed)       -> publish_single
  2. threads worker: drain those N (timed from ready)     -> drain_threads
  3. same worker, now idle: sequential latency samples    -> latency_p50/p95
  4. same worker, still idle (Postgres brokers only)      -> idle_* figures
  5. purge, publish N with the batch path (timed)         -> publish_batch
  6. purge, publish N with ``task.delay()`` (untimed), prefork worker drains them
                                                          -> drain_prefork
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.brokers import Broker
from bench.client import RESULT_PREFIX
from bench.pgidle import measure_idle
from bench.worker import Worker

REPO_ROOT = Path(__file__).resolve().parent.parent


class PhaseFailed(Exception):
    """One phase of one run failed; the run's other figures are kept."""


@dataclass
class Config:
    n: int = 2000
    latency_samples: int = 50
    idle_window: float = 30.0
    drain_timeout: float = 90.0
    ready_timeout: float = 60.0
    client_timeout: float = 300.0
    batch_helpers: dict[str, str] = field(default_factory=dict)
    threads_concurrency: int = 8
    prefork_concurrency: int = 2


def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (no interpolation between two samples)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100.0 * len(ordered))))
    return ordered[rank - 1]


class BrokerRun:
    def __init__(
        self, broker: Broker, cfg: Config, state_dir: Path, log: Callable[[str], None]
    ) -> None:
        self.broker = broker
        self.cfg = cfg
        self.state_dir = state_dir
        self.log = log
        self.env = {
            **os.environ,
            "BENCH_BROKER_URL": broker.url,
            "BENCH_TRANSPORT_OPTIONS": json.dumps(broker.transport_options),
            "BENCH_STATE_DIR": str(state_dir),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        self.figures: dict[str, float] = {}
        self.info: dict[str, Any] = {}
        self.errors: list[str] = []

    # -- subprocess plumbing ------------------------------------------------------------
    def client(self, *args: str, timeout: float | None = None) -> dict[str, Any]:
        argv = [sys.executable, "-m", "bench.client", *args]
        try:
            proc = subprocess.run(
                argv,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout or self.cfg.client_timeout,
            )
        except subprocess.TimeoutExpired as exc:
            msg = f"`bench.client {args[0]}` timed out after {exc.timeout:.0f}s"
            raise PhaseFailed(msg) from exc
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(RESULT_PREFIX):
                return dict(json.loads(line[len(RESULT_PREFIX) :]))
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise PhaseFailed(f"`bench.client {args[0]}` exited {proc.returncode}: {tail}")

    def worker(self, pool: str) -> Worker:
        conc = self.cfg.threads_concurrency if pool == "threads" else self.cfg.prefork_concurrency
        return Worker(
            pool=pool,
            concurrency=conc,
            env=self.env,
            state_dir=self.state_dir,
            cwd=REPO_ROOT,
        )

    # -- phases -------------------------------------------------------------------------
    def publish(self, mode: str, figure: str | None, **options: Any) -> None:
        """``options``: transport options for this publish only (on top of the broker's)."""
        args = ["publish", "--mode", mode, "--n", str(self.cfg.n)]
        if options:
            args += ["--options", json.dumps(options)]
        helper = self.cfg.batch_helpers.get(self.broker.name)
        if mode == "batch" and helper:
            args += ["--batch-helper", helper]
        res = self.client(*args)
        if figure:
            self.figures[figure] = res["n"] / res["seconds"]
            if mode == "batch":
                self.info["batch_path"] = res["path"]

    def drain(self, worker: Worker, figure: str) -> None:
        n = self.cfg.n
        t_ready = worker.wait_ready(self.cfg.ready_timeout)
        done, t_done = worker.wait_count(n, self.cfg.drain_timeout)
        elapsed = max(t_done - t_ready, 1e-9)
        self.info[f"{figure}_seconds"] = round(elapsed, 3)
        if done < n:
            # Kept out of the figures (and so out of medians and ratios); the notes show it.
            raise PhaseFailed(
                f"only {done}/{n} tasks ran within {self.cfg.drain_timeout:g}s"
                f" ({done / elapsed:,.1f}/s); worker log tail:\n{worker.log_tail()}"
            )
        self.figures[figure] = n / elapsed

    def latency(self, worker: Worker) -> None:
        budget = max(60.0, self.cfg.latency_samples * 3.0)
        res = self.client(
            "latency",
            "--samples", str(self.cfg.latency_samples),
            "--budget", str(budget),
            timeout=budget + 60,
        )  # fmt: skip
        delays = [d * 1000.0 for d in res["delays"]]
        if len(delays) < self.cfg.latency_samples:
            raise PhaseFailed(
                f"{len(delays)}/{self.cfg.latency_samples} samples ({res['timeouts']} timed out);"
                f" worker log tail:\n{worker.log_tail()}"
            )
        self.figures["latency_p50_ms"] = statistics.median(delays)
        self.figures["latency_p95_ms"] = _percentile(delays, 95)
        self.figures["latency_publish_p50_ms"] = statistics.median(
            d * 1000.0 for d in res["publishes"])

    def idle(self, worker: Worker) -> None:
        assert self.broker.pg_database and worker.proc is not None
        # Backends publish transaction counts up to 10 s late; let the latency phase's land.
        time.sleep(11.0)
        res = measure_idle(
            self.broker.pg_database, self.broker.address[1], worker.proc.pid, self.cfg.idle_window
        )
        for key in ("statements_per_min", "xacts_per_min", "connections", "tcp_writes_per_min"):
            if key in res:
                self.figures[f"idle_{key}"] = res[key]
        self.info["idle_method"] = res["method"]

    def purge(self) -> None:
        """Leave nothing behind (e.g. after a drain that timed out)."""
        self.client("purge")

    def _phase(self, name: str, fn: Callable[[], None]) -> bool:
        """Run one phase; a failure is recorded and the run goes on with the next phase."""
        t0 = time.monotonic()
        try:
            fn()
        except Exception as exc:  # a broker failing must not stop the others
            msg = f"{name}: {exc}".strip()
            self.errors.append(msg)
            self.log(f"    ! {msg.splitlines()[0]}")
            return False
        self.log(f"    {name} done in {time.monotonic() - t0:.1f}s")
        return True

    def run(self) -> dict[str, Any]:
        if self.broker.name == "pgjobs":  # what RabbitMQ without publisher confirms promises
            self._phase("publish single, durable_publish=False", lambda: self.publish(
                "single", "publish_single_nondurable", durable_publish=False))
            self._phase("publish single, unconfirmed", lambda: self.publish(
                "single", "publish_single_unconfirmed", durable_publish=False,
                confirm_publish=False))
        if self.broker.name == "amqp":  # pgjobs's own promise: the broker confirmed each one
            self._phase("publish single, confirm_publish=True", lambda: self.publish(
                "single", "publish_single_confirmed", confirm_publish=True))
        if self._phase("publish single", lambda: self.publish("single", "publish_single")):
            with self.worker("threads") as worker:
                ok = self._phase("drain threads", lambda: self.drain(worker, "drain_threads"))
                ok = ok and self._phase("latency", lambda: self.latency(worker))
                if ok and self.broker.pg_database:
                    self._phase("idle cost", lambda: self.idle(worker))
        self._phase("publish batch", lambda: self.publish("batch", "publish_batch"))
        if self._phase("prepublish", lambda: self.publish("single", None)):
            with self.worker("prefork") as worker:
                self._phase("drain prefork", lambda: self.drain(worker, "drain_prefork"))
        self._phase("purge", self.purge)
        return {"figures": self.figures, "info": self.info, "errors": self.errors}
