"""Fleet scale on one database: 1, 4 and 16 ``celery worker`` processes on one pgjobs schema.

    python -m bench.fleet [--pools threads,prefork] [--workers 1,4,16] [--prefork-workers 1,4,8]
                          [--runs 3] [--messages 300] [--rate 50] [--window 20] [--drain 3000]
                          [--quick] [--json PATH] [--markdown PATH]
    python -m bench.fleet --cross-db 20000

Real worker subprocesses (``bench/app.py``, the flags of ``bench/worker.py``; threads c=4 and
prefork c=2, each worker its own node name), all in the database ``bench_fleet`` of the server
of $BENCH_PG_ADMIN_DSN (created when missing; nothing else uses it, autovacuum off on the
pgjobs tables, so ``xact_commit + xact_rollback`` of that database is ours alone). Per run, per
pool, per number of workers N (runs interleaved: run 1 of every case, then run 2 ...):

1. **idle**: N workers start and become ready, a publisher connection opens (the queue
   declared), ``--settle`` seconds pass, then a ``--window`` of seconds with no publish; the
   workers and the publisher stop. Watched in the window: TCP writes of each worker's process
   group to the Postgres port (statements, as bench/pgidle.py counts them), the connections
   each holds, and the database's transactions (read from the admin database at both ends;
   backends report theirs up to 10 s late, which ``--settle`` covers).
2. **busy**: the same timeline, but ``--messages`` ``noop`` tasks are published at ``--rate``
   per second from the start of the window, and every one must run within it.
   Transactions of each phase are read only once every backend of the database disconnected
   (a backend reports its counts when it exits). **Transactions per message** = (busy - idle)
   / messages: starting, settling and stopping cancel out.
3. **listener probe** (same run, same N): N plain psycopg connections LISTEN on a channel
   nobody notifies, another sends ``--messages`` NOTIFYs on another channel ``1/--rate`` s
   apart; once more with no NOTIFY. On PostgreSQL 17 and older every NOTIFY signals every
   listening backend of the database, and each signalled backend runs a transaction to read
   the queue, whatever the channel: **listener transactions per NOTIFY per listener** =
   (with - without - NOTIFYs) / (NOTIFYs x N). A Celery worker's claim connection LISTENs
   (one per worker; prefork children hold none), and pgjobs sends one NOTIFY per message
   published while a consumer waits (schema 17, docs/delivery.md "Wake-ups"), so of the
   transactions per message, **listener share** = N x that figure, and **client** = total -
   listener share (an estimate: it assumes every message woke a consumer, true at this rate).
4. **drain**: N workers start and go idle, then ``--drain`` ``noop`` tasks are published in
   one batch (``kombu_pgjobs.batch()``); rate = tasks / (time the last ran - time the publish
   committed). Its transactions per message (start and stop included) too.

Idle statements/min per worker are the TCP writes of the idle window over N (a window shorter
than ``idle_poll_interval``, 60 s, sees the keeper's statements and may miss the safety
claims); idle transactions/min per worker the database's over N. That one also counts the
notify-queue reads NOTIFYs in *other* databases of the server cause (a listener is signalled
when the queue head is 4 pages past it): on a shared server it is noisy, and ``--cross-db
NOTIFIES`` measures that effect alone (4 listeners here, NOTIFIES sent as fast as one
connection can from the database ``bench_fleet_other``; prints notifications per read).
Ratios (N workers / 1 worker) are taken within a run. Figures are ``median (min..max)`` over
runs. Exit status 1 when any phase failed (a worker not ready, a task not run, backends still
connected), 2 on bad arguments.
Nothing here is a test: figures depend on the machine; docs/scaling.md records runs.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from celery import group

from bench.brokers import PG_ADMIN_DSN, ensure_database, pg_dsn
from bench.measure import REPO_ROOT
from bench.pgidle import tcp_writes
from bench.pgstats import settle, transactions
from bench.report import cell, summarize
from bench.worker import Worker, stop_all
from kombu_pgjobs.store.schema import migrate

DATABASE = "bench_fleet"
SCHEMA = "pgjobs"  # the transport's default
CONCURRENCY = {"threads": 4, "prefork": 2}
PROBE_CHANNEL = "bench_fleet_probe"
OTHER_DATABASE = "bench_fleet_other"


class PhaseFailed(Exception):
    """One phase of one case failed; the run goes on with the next."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _url() -> str:
    return urlsplit(pg_dsn(DATABASE))._replace(scheme="pgjobs").geturl()


def _port() -> int:
    return urlsplit(PG_ADMIN_DSN).port or 5432


# -- the database ------------------------------------------------------------------------------
def setup() -> None:
    """``bench_fleet`` with an up-to-date, empty schema; autovacuum off on its tables (its
    transactions would count)."""
    ensure_database(DATABASE)
    with psycopg.connect(pg_dsn(DATABASE), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        migrate(conn, SCHEMA)
        tables = conn.execute("SELECT c.relname FROM pg_class c JOIN pg_namespace n"
                              " ON n.oid = c.relnamespace WHERE n.nspname = %s"
                              " AND c.relkind = 'r'", (SCHEMA,)).fetchall()
        for (table,) in tables:
            conn.execute(f'ALTER TABLE "{SCHEMA}"."{table}" SET (autovacuum_enabled = false)')


def xacts() -> int:
    return transactions(DATABASE)


def quiet(timeout: float = 30.0) -> None:
    """Wait until no backend is connected to the database: each has reported its counts."""
    left = settle(DATABASE, timeout)
    if left:
        raise PhaseFailed(f"{left} backend(s) still connected to {DATABASE} after {timeout:g}s")


# -- workers -----------------------------------------------------------------------------------
class FleetWorker(Worker):
    """A bench worker with a node name and state directory of its own."""

    def __init__(self, *, index: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index
        self.log_path = self.state_dir / "worker.log"

    @property
    def argv(self) -> list[str]:
        argv = super().argv
        argv[-1] = f"fleet{self.index}-{self.pool}@bench"  # after -n
        return argv


def _env(state_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "BENCH_BROKER_URL": _url(),
        "BENCH_TRANSPORT_OPTIONS": "{}",
        "BENCH_STATE_DIR": str(state_dir),
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }


class Fleet:
    """N workers started together, stopped together (SIGTERM to all, then wait)."""

    def __init__(self, pool: str, n: int, root: Path, ready_timeout: float) -> None:
        self.ready_timeout = ready_timeout
        self.workers: list[FleetWorker] = []
        for i in range(n):
            state = root / f"{pool}-{i}"
            state.mkdir(parents=True, exist_ok=True)
            self.workers.append(FleetWorker(index=i, pool=pool, concurrency=CONCURRENCY[pool],
                                            env=_env(state), state_dir=state, cwd=REPO_ROOT))

    def __enter__(self) -> Fleet:
        try:
            for w in self.workers:
                w.start()
            deadline = time.monotonic() + self.ready_timeout
            for w in self.workers:
                w.wait_ready(max(1.0, deadline - time.monotonic()))
        except Exception:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def count(self) -> int:
        return sum(w.count() for w in self.workers)

    def wait_count(self, n: int, timeout: float) -> tuple[int, float]:
        deadline = time.monotonic() + timeout
        while True:
            done, now = self.count(), time.time()
            if done >= n or time.monotonic() >= deadline:
                return done, now
            time.sleep(0.002)

    def stop(self, timeout: float = 20.0) -> None:
        for w in self.workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            if w.proc is not None:
                try:
                    w.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            w.stop(timeout=0.0)  # SIGKILLs the group of one still running, reaps it

    def pgids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]


_STAT_PGRP = re.compile(rb"\)\s+\S+\s+\d+\s+(\d+)")


def pids_by_group(pgids: list[int]) -> dict[int, set[int]]:
    """One pass over /proc: the processes of each process group in ``pgids``."""
    out: dict[int, set[int]] = {g: set() for g in pgids}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                m = _STAT_PGRP.search(fh.read())
        except OSError:
            continue
        if m and int(m.group(1)) in out:
            out[int(m.group(1))].add(int(entry))
    return out


class Wire:
    """TCP writes and connections of each worker's process group to Postgres, sampled."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.conns: list[int] = [0] * len(fleet.workers)
        self.enabled = shutil.which("ss") is not None

    def sample(self) -> None:
        if not self.enabled:
            return
        groups = pids_by_group(self.fleet.pgids())
        seen: dict[str, int] = {}
        for i, pids in enumerate(groups.values()):
            now = tcp_writes(pids, _port())
            self.conns[i] = max(self.conns[i], len(now))
            seen.update(now)
        for sock, segs in seen.items():
            self.first.setdefault(sock, 0 if self.last else segs)  # 0: opened in the window
        self.last.update(seen)

    def writes(self) -> int:
        return sum(self.last[s] - self.first[s] for s in self.last)


# -- the publisher (in this process) -----------------------------------------------------------
class Publisher:
    """A connection of the bench app, the queue declared (in both phases, so it cancels out);
    closed with every pgjobs connection of this process."""

    def __init__(self) -> None:
        from bench.app import QUEUE, app

        self.app = app
        self.conn = app.connection_for_write()
        self.conn.ensure_connection(max_retries=1, timeout=10)
        app.amqp.queues[QUEUE](self.conn.default_channel).declare()
        self.producer = app.amqp.Producer(self.conn, auto_declare=False)

    def spaced(self, n: int, rate: float) -> None:
        """``n`` noop tasks, one every 1/rate s."""
        from bench.app import noop

        t0 = time.monotonic()
        for i in range(n):
            wait = t0 + i / rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            noop.apply_async((i,), producer=self.producer)

    def batch(self, n: int) -> float:
        """``n`` noop tasks in one ``kombu_pgjobs.batch()``; returns time.time() at commit."""
        import kombu_pgjobs
        from bench.app import noop

        with kombu_pgjobs.batch():
            group([noop.s(i) for i in range(n)], app=self.app).apply_async(
                producer=self.producer)
        return time.time()

    def close(self) -> None:
        from kombu_pgjobs.broker.backend import release_all

        self.conn.release()
        release_all()


# -- phases ------------------------------------------------------------------------------------
def fleet_phase(args: argparse.Namespace, pool: str, n: int, root: Path,
                busy: bool) -> dict[str, float]:
    quiet()
    x0 = xacts()
    fig: dict[str, float] = {}
    with Fleet(pool, n, root, args.ready_timeout) as fleet:
        publisher = Publisher()
        time.sleep(args.settle)
        wire = Wire(fleet)
        wire.sample()
        xa, t0 = xacts(), time.monotonic()
        if busy:
            publisher.spaced(args.messages, args.rate)
            left = args.window - (time.monotonic() - t0)
            done, _ = fleet.wait_count(args.messages, max(left, 0.0))
            if done < args.messages:
                raise PhaseFailed(f"busy: {done}/{args.messages} tasks ran within the "
                                  f"{args.window:g}s window; log tail of worker 0:\n"
                                  f"{fleet.workers[0].log_tail()}")
        while (left := args.window - (time.monotonic() - t0)) > 0:
            time.sleep(min(1.0, left))
            wire.sample()
        elapsed = time.monotonic() - t0
        xb = xacts()
        publisher.close()
        per_min = 60.0 / elapsed / n
        fig["window_xacts_per_min_per_worker"] = (xb - xa) * per_min
        if wire.enabled:
            fig["statements_per_min_per_worker"] = wire.writes() * per_min
            fig["connections_per_worker"] = statistics.mean(wire.conns)
            fig["connections_per_worker_max"] = max(wire.conns)
    quiet()
    fig["xacts"] = xacts() - x0
    return fig


def drain_phase(args: argparse.Namespace, pool: str, n: int, root: Path) -> dict[str, float]:
    quiet()
    x0 = xacts()
    with Fleet(pool, n, root, args.ready_timeout) as fleet:
        publisher = Publisher()
        committed = publisher.batch(args.drain)
        publisher.close()
        done, t_done = fleet.wait_count(args.drain, args.drain_timeout)
        if done < args.drain:
            raise PhaseFailed(f"drain: {done}/{args.drain} tasks ran within "
                              f"{args.drain_timeout:g}s")
    quiet()
    return {"drain_per_s": args.drain / max(t_done - committed, 1e-9),
            "drain_xacts_per_message": (xacts() - x0) / args.drain}


def probe_phase(listeners: int, notifies: int, gap: float = 0.0,
                sender_database: str = DATABASE, payload: str = "") -> int:
    """Transactions of ``listeners`` idle LISTENing connections here while another connection,
    to ``sender_database``, sends ``notifies`` NOTIFYs on another channel, ``gap`` s apart
    (connections included)."""
    quiet()
    x0 = xacts()
    conns = [psycopg.connect(pg_dsn(DATABASE), autocommit=True) for _ in range(listeners)]
    notify = f"NOTIFY {PROBE_CHANNEL}_other" + (f", '{payload}'" if payload else "")
    try:
        for c in conns:
            c.execute(f"LISTEN {PROBE_CHANNEL}")
        with psycopg.connect(pg_dsn(sender_database), autocommit=True) as sender:
            for _ in range(notifies):
                sender.execute(notify)
                if gap:
                    time.sleep(gap)
            time.sleep(0.5)
    finally:
        for c in conns:
            c.close()
    quiet()
    return xacts() - x0


def listener_share(listeners: int, notifies: int, gap: float) -> float:
    """Transactions per NOTIFY per listening backend."""
    with_ = probe_phase(listeners, notifies, gap)
    without = probe_phase(listeners, 0, gap)
    return (with_ - without - notifies) / (notifies * listeners)


def cross_database_reads(listeners: int, notifies: int) -> dict[str, float]:
    """NOTIFYs sent as fast as one connection can in ANOTHER database of the same server
    (``bench_fleet_other``), ``listeners`` LISTENing here: on PostgreSQL 17 and older a
    listener of another database is signalled once the queue head is 4 pages past it, and
    reads (one transaction) then. Returns notifications per read, per listener."""
    ensure_database(OTHER_DATABASE)

    def phase(m: int) -> int:
        return probe_phase(listeners, m, sender_database=OTHER_DATABASE, payload="bench")

    reads = (phase(notifies) - phase(0)) / listeners
    return {"listeners": listeners, "notifies": notifies, "reads_per_listener": reads,
            "notifies_per_read": notifies / reads if reads > 0 else float("inf")}


def one_case(args: argparse.Namespace, pool: str, n: int, root: Path) -> dict[str, Any]:
    figures: dict[str, float] = {}
    errors: list[str] = []

    def phase(name: str, fn: Any) -> Any:
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:  # recorded; the run goes on
            errors.append(f"{name}: {exc}")
            log(f"    ! {name}: {str(exc).splitlines()[0]}")
            return None
        log(f"    {name} done in {time.monotonic() - t0:.1f}s")
        return out

    idle = phase("idle", lambda: fleet_phase(args, pool, n, root, busy=False))
    busy = phase("busy", lambda: fleet_phase(args, pool, n, root, busy=True))
    share = phase("listener probe", lambda: listener_share(n, args.messages, 1.0 / args.rate))
    drain = phase("drain", lambda: drain_phase(args, pool, n, root))
    if idle:
        figures["idle_xacts_per_min_per_worker"] = idle["window_xacts_per_min_per_worker"]
        for key in ("statements_per_min_per_worker", "connections_per_worker",
                    "connections_per_worker_max"):
            if key in idle:
                figures[f"idle_{key}"] = idle[key]
    if idle and busy:
        total = (busy["xacts"] - idle["xacts"]) / args.messages
        figures["xacts_per_message"] = total
        if "statements_per_min_per_worker" in busy:
            extra = (busy["statements_per_min_per_worker"]
                     - idle["statements_per_min_per_worker"]) * n * args.window / 60.0
            figures["worker_statements_per_message"] = extra / args.messages
        if share is not None:
            figures["listener_xacts_per_notify_per_listener"] = share
            figures["listener_xacts_per_message"] = share * n
            figures["client_xacts_per_message"] = total - share * n
    if drain:
        figures.update(drain)
    raw = {f"{name}_xacts": ph["xacts"] for name, ph in (("idle", idle), ("busy", busy)) if ph}
    return {"pool": pool, "workers": n, "figures": figures, "raw": raw, "errors": errors}


# -- report ------------------------------------------------------------------------------------
ROWS = (
    ("xacts_per_message", "transactions per message, total", "{:.2f}"),
    ("listener_xacts_per_message", "  of which listeners reading the NOTIFY queue", "{:.2f}"),
    ("client_xacts_per_message", "  of which client transactions", "{:.2f}"),
    ("listener_xacts_per_notify_per_listener", "listener transactions per NOTIFY per listener",
     "{:.2f}"),
    ("worker_statements_per_message", "worker statements per message (TCP writes)", "{:.2f}"),
    ("idle_statements_per_min_per_worker", "idle statements/min per worker (TCP writes)",
     "{:.1f}"),
    ("idle_xacts_per_min_per_worker",
     "idle transactions/min per worker (+ other databases' NOTIFY traffic)", "{:.1f}"),
    ("idle_connections_per_worker", "connections per worker (idle)", "{:.1f}"),
    ("drain_per_s", "drain, all workers (tasks/s)", "{:,.0f}"),
    ("drain_vs_1", "drain vs 1 worker, same run", "{:.2f}"),
    ("drain_xacts_per_message", "drain: transactions per message (start/stop incl.)",
     "{:.2f}"),
)


def _cell(values: list[float], fmt: str, runs: int) -> str:
    return cell(summarize(values), fmt, runs)


def add_ratios(cases: list[dict[str, Any]]) -> None:
    """drain of N workers / drain of 1 worker of the same pool in the same run."""
    base = {(c["run"], c["pool"]): c["figures"].get("drain_per_s")
            for c in cases if c["workers"] == 1}
    for c in cases:
        one = base.get((c["run"], c["pool"]))
        mine = c["figures"].get("drain_per_s")
        if one and mine:
            c["figures"]["drain_vs_1"] = mine / one


def markdown(cases: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    columns = sorted({(c["pool"], c["workers"]) for c in cases},
                     key=lambda k: (k[0] != "threads", k[1]))
    runs = meta["runs"]
    head = [f"{p} c={CONCURRENCY[p]}, {n} worker{'s' if n > 1 else ''}" for p, n in columns]
    out = [f"| figure | {' | '.join(head)} |", "|---|" + "---:|" * len(columns)]
    for key, label, fmt in ROWS:
        cells = []
        for col in columns:
            values = [c["figures"][key] for c in cases
                      if (c["pool"], c["workers"]) == col and key in c["figures"]]
            cells.append(_cell(values, fmt, runs))
        out.append(f"| {label} | {' | '.join(cells)} |")
    out.append("")
    out.append(f"{meta['messages']} messages at {meta['rate']:g}/s in a {meta['window']:g} s "
               f"window (idle: the same window, none), drain of {meta['drain']}; "
               f"{runs} run(s), median (min..max); {meta['host']}; load {meta['load_before']} "
               f"before, {meta['load_after']} after; {meta['elapsed_s']:.0f} s.")
    for c in cases:
        for err in c["errors"]:
            out.append(f"- run {c['run']}, {c['pool']} x{c['workers']}: "
                       f"{err.splitlines()[0]}")
    return "\n".join(out) + "\n"


# -- main --------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pools", default=None, help="threads,prefork (threads in --quick)")
    p.add_argument("--workers", type=_ints, help="threads fleet sizes (1,4,16; 1,2 quick)")
    p.add_argument("--prefork-workers", type=_ints,
                   help="prefork fleet sizes (default 1,4,8: 16 prefork workers are 48 "
                        "processes on this 2-core machine)")
    p.add_argument("--runs", type=int, help="repetitions (default 3; 1 quick)")
    p.add_argument("--messages", type=int, help="busy-phase tasks (default 300; 50 quick)")
    p.add_argument("--rate", type=float, default=50.0, help="busy-phase tasks/s (default 50)")
    p.add_argument("--window", type=float, help="seconds watched per phase (20; 3 quick)")
    p.add_argument("--settle", type=float, help="seconds before the window (11; 1 quick)")
    p.add_argument("--drain", type=int, help="tasks drained (default 3000; 300 quick)")
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--quick", action="store_true", help="CI smoke run (< 60 s)")
    p.add_argument("--cross-db", type=int, metavar="NOTIFIES",
                   help="only this: 4 listeners here, NOTIFIES sent in another database")
    p.add_argument("--json", type=Path, help="write every run's figures as JSON")
    p.add_argument("--markdown", type=Path, help="write the table as Markdown")
    args = p.parse_args(argv)
    q = args.quick
    args.pools = [x for x in (args.pools or ("threads" if q else "threads,prefork")).split(",")
                  if x]
    if set(args.pools) - set(CONCURRENCY):
        p.error(f"--pools: threads and/or prefork, got {args.pools}")
    args.workers = args.workers or ([1, 2] if q else [1, 4, 16])
    args.prefork_workers = args.prefork_workers or ([1, 2] if q else [1, 4, 8])
    args.runs = args.runs or (1 if q else 3)
    args.messages = args.messages or (50 if q else 300)
    args.window = args.window or (3.0 if q else 20.0)
    args.settle = args.settle if args.settle is not None else (1.0 if q else 11.0)
    args.drain = args.drain or (300 if q else 3000)
    if args.messages / args.rate >= args.window:
        p.error("--window must be longer than --messages / --rate")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    atexit.register(stop_all)
    started = time.monotonic()
    meta: dict[str, Any] = {
        "runs": args.runs, "messages": args.messages, "rate": args.rate,
        "window": args.window, "drain": args.drain, "argv": sys.argv,
        "host": f"{platform.node()} ({os.cpu_count()} cpu, Python {platform.python_version()})",
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    if args.cross_db:
        setup()
        print(json.dumps(cross_database_reads(4, args.cross_db)))
        return 0
    os.environ["BENCH_BROKER_URL"] = _url()
    os.environ.pop("BENCH_STATE_DIR", None)  # the publisher runs no task
    root = Path(tempfile.mkdtemp(prefix="pgjobs-fleet-"))
    cases: list[dict[str, Any]] = []
    try:
        setup()
        for run in range(1, args.runs + 1):
            for pool in args.pools:
                for n in (args.workers if pool == "threads" else args.prefork_workers):
                    log(f"[run {run}/{args.runs}] {pool} x{n}")
                    cases.append({"run": run, **one_case(args, pool, n, root)})
    except KeyboardInterrupt:
        log("interrupted; stopping workers")
        return 130
    finally:
        stop_all()
        shutil.rmtree(root, ignore_errors=True)
    add_ratios(cases)
    meta["elapsed_s"] = time.monotonic() - started
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    table = markdown(cases, meta)
    print(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "cases": cases}, indent=2) + "\n")
    if any(c["errors"] for c in cases):
        log("some phases failed (see the notes under the table)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
