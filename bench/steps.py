"""``python -m bench.steps``: what durable steps (celery_ext.steps, issue 32) cost a worker, in
statements.

A real ``celery worker -P solo`` (this module is also its app) talks to Postgres through a
counting proxy of the wire protocol (tests/wirecount.py), so every statement the worker
sends is counted: claims, acks, keeper ticks, and the steps' own. The bench publishes ``--n``
tasks of each kind directly (not through the proxy), waits until they ran, and reports the
worker's statements per task, all of them and those of the steps (sql/steps.sql):

* ``plain``: a task without steps;
* ``of() only``: calls ``celery_ext.steps.of(self)`` and no step;
* ``1 step`` / ``3 steps``: ``steps.run`` once / three times;
* ``3 steps, replayed``: the same three steps under task ids whose steps are stored (a
  redelivery, a retry): nothing runs, the stored results are read;
* ``sleep``: one ``steps.sleep`` of 0.2 s (two runs: the one that parks, the one after).

Schema ``bench_steps`` of the database of $BENCH_PG_URL (default the local test database),
dropped first. Not a test: numbers only (tests/test_steps.py asserts the step statements).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

import celery_ext

URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = "bench_steps"
ROOT = Path(__file__).resolve().parent.parent

# -- the app the worker runs (configured from the environment the bench gives it) ----------------
app = celery_ext.install(Celery("bench_steps", broker=os.environ.get(
    "BENCH_STEPS_BROKER", "pgjobs://postgres@127.0.0.1:5432/test")))
app.conf.update(broker_transport_options={"schema": SCHEMA}, task_acks_late=True,
                task_ignore_result=True, worker_hijack_root_logger=False,
                broker_connection_retry_on_startup=True)
_record: psycopg.Connection[Any] | None = None


def _done() -> None:
    """Count the run on a connection of its own, past the proxy (not counted)."""
    global _record
    if _record is None:
        _record = psycopg.connect(URL, autocommit=True)
    _record.execute(f"INSERT INTO {SCHEMA}.bench_done DEFAULT VALUES")


def _value(i: int) -> dict[str, int]:
    return {"i": i}


@app.task(name="bench_steps.plain")
def plain() -> None:
    _done()


@app.task(bind=True, name="bench_steps.unused")
def unused(self: Any) -> None:
    celery_ext.steps.of(self)
    _done()


@app.task(bind=True, name="bench_steps.steps")
def steps(self: Any, n: int) -> None:
    s = celery_ext.steps.of(self)
    for i in range(n):
        s.run(f"step-{i}", _value, i)
    _done()


@app.task(bind=True, name="bench_steps.nap")
def nap(self: Any) -> None:
    celery_ext.steps.of(self).sleep("nap", 0.2)
    _done()


# -- the bench -------------------------------------------------------------------------------------
def _prepare() -> None:
    from kombu_pgjobs.store.schema import migrate

    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")
        migrate(conn, SCHEMA)
        conn.execute(f"CREATE TABLE {SCHEMA}.bench_done (at timestamptz DEFAULT now())")


def _done_count() -> int:
    with psycopg.connect(URL, autocommit=True) as conn:
        return int(conn.execute(f"SELECT count(*) FROM {SCHEMA}.bench_done").fetchone()[0])


def _is_step(text: str) -> bool:
    """A statement of sql/steps.sql (the first 60 characters the proxy keeps)."""
    return text.startswith(("WITH fence AS MATERIALIZED", "WITH held AS MATERIALIZED")) or \
        "l.class = 'event'" in text


def run(n: int) -> list[tuple[str, int, float, float]]:
    sys.path.insert(0, str(ROOT))
    from tests.wirecount import WireCounter

    _prepare()
    info = psycopg.conninfo.conninfo_to_dict(URL)
    rows: list[tuple[str, int, float, float]] = []
    with WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432))) as wire, \
            tempfile.TemporaryDirectory() as tmp:
        broker = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
                  f"{info.get('dbname', 'test')}")
        log = Path(tmp) / "worker.log"
        env = {**os.environ, "BENCH_STEPS_BROKER": broker, "BENCH_PG_URL": URL,
               "PYTHONPATH": str(ROOT)}
        with open(log, "wb") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "bench.steps", "worker", "-P", "solo",
                 "-l", "warning", "--without-gossip", "--without-mingle",
                 "--without-heartbeat"], stdout=out, stderr=subprocess.STDOUT, env=env,
                cwd=ROOT)
        try:
            publisher = Celery("bench_steps", broker=f"pgjobs://{info.get('user', 'postgres')}"
                               f"@{info.get('host', '127.0.0.1')}:{info.get('port', 5432)}/"
                               f"{info.get('dbname', 'test')}")
            publisher.conf.broker_transport_options = {"schema": SCHEMA}
            warm = time.monotonic() + 60
            publisher.send_task("bench_steps.plain")
            while _done_count() < 1:
                if worker.poll() is not None or time.monotonic() > warm:
                    raise SystemExit(f"the worker did not start:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
            replayed = [str(uuid.uuid4()) for _ in range(n)]
            kinds: list[tuple[str, list[tuple[str, tuple[Any, ...], str | None]]]] = [
                ("plain (no steps)", [("bench_steps.plain", (), None)] * n),
                ("of() only", [("bench_steps.unused", (), None)] * n),
                ("1 step", [("bench_steps.steps", (1,), None)] * n),
                ("3 steps", [("bench_steps.steps", (3,), t) for t in replayed]),
                ("3 steps, replayed", [("bench_steps.steps", (3,), t) for t in replayed]),
                ("sleep 0.2 s", [("bench_steps.nap", (), None)] * n),
            ]
            for label, tasks in kinds:
                time.sleep(1.0)  # the previous kind's acks flushed
                target = _done_count() + len(tasks)
                before, steps_before = wire.count(), _steps(wire)
                for name, args, task_id in tasks:
                    publisher.send_task(name, args, task_id=task_id)
                deadline = time.monotonic() + 120
                while _done_count() < target:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{label}: not done in 120 s")
                    time.sleep(0.05)
                time.sleep(1.0)  # its last acks
                rows.append((label, len(tasks), (wire.count() - before) / len(tasks),
                             (_steps(wire) - steps_before) / len(tasks)))
        finally:
            worker.terminate()
            worker.wait(30)
    return rows


def _steps(wire: Any) -> int:
    with wire.lock:
        return sum(v for k, v in wire.by_text.items() if _is_step(k))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__)
    parser.add_argument("--n", type=int, default=300, help="tasks per kind (default 300)")
    args = parser.parse_args(argv)
    rows = run(args.n)
    print(f"{'kind':<20} {'tasks':>6} {'worker statements/task':>24} {'of them steps':>14}")
    for label, n, total, step in rows:
        print(f"{label:<20} {n:>6} {total:>24.2f} {step:>14.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
