"""``python -m bench.steps``: what durable steps (celery_ext.steps, issue 32) cost a worker, in
statements.

A real ``celery worker -P solo`` (this module is also its app) talks to Postgres through a
counting proxy of the wire protocol (tests/wirecount.py), so every statement the worker
sends is counted: claims, acks, keeper ticks, and the steps' own. The bench publishes ``--n``
tasks of each kind directly (not through the proxy), waits until they ran, and reports the
worker's statements per task, all of them and those of the steps (sql/steps.sql), each step
statement recognised by its whole text (not a prefix: several begin alike):

* ``plain``: a task without steps;
* ``of() only``: calls ``celery_ext.steps.of(self)`` and no step;
* ``1 step`` / ``3 steps``: ``steps.run`` once / three times;
* ``3 steps, replayed``: the same three steps under task ids whose steps are stored (a
  redelivery, a retry): nothing runs, the stored results are read;
* ``sleep 0.2 s``: one ``steps.sleep`` of 0.2 s (two runs: the one that parks, the one after);
* ``wait (suspends)``: one ``steps.wait_for_event`` of an event not yet emitted: the run parks;
  once every waiter is parked the bench emits their events (not through the proxy), which wake
  them, and the next run reads the event's data (two runs).

Schema ``$BENCH_STEPS_SCHEMA`` (default ``bench_steps``) of the database of $BENCH_PG_URL
(default the local test database), dropped first. Not a test: numbers only
(tests/test_steps.py runs this app and asserts the step statements with :func:`step_counts`).
"""

from __future__ import annotations

import argparse
import json
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
SCHEMA = os.environ.get("BENCH_STEPS_SCHEMA", "bench_steps")
ROOT = Path(__file__).resolve().parent.parent
#: the statements of sql/steps.sql a worker sends, and how the bench names them
STEP_STATEMENTS = {"step_load": "load", "step_save": "save", "step_wait": "wait",
                   "step_event_lock": "lock", "step_park": "park"}
#: the event the ``wait`` kind waits for
EVENT = "bench.go"

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
    _record.execute(f'INSERT INTO "{SCHEMA}".bench_done DEFAULT VALUES')


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


@app.task(bind=True, name="bench_steps.wait")
def wait(self: Any, key: str) -> None:
    celery_ext.steps.of(self).wait_for_event(EVENT, key=key, timeout=600)
    _done()


# -- counting ------------------------------------------------------------------------------------
def step_counts(wire: Any, schema: str) -> dict[str, int]:
    """Executions of each statement of sql/steps.sql a worker sends (by its short name in
    :data:`STEP_STATEMENTS`), read from a tests.wirecount.WireCounter: each recognised by its
    whole text, composed for ``schema``."""
    from kombu_pgjobs.store.sql import queries

    composed = queries(schema)
    return {short: wire.executed(composed[name].as_string(None))
            for name, short in STEP_STATEMENTS.items()}


def create_done_table(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(f'CREATE TABLE "{schema}".bench_done (at timestamptz DEFAULT now())')


def done_count(conn: psycopg.Connection[Any], schema: str) -> int:
    return int(conn.execute(f'SELECT count(*) FROM "{schema}".bench_done').fetchone()[0])


# -- the bench -------------------------------------------------------------------------------------
def _prepare() -> None:
    from kombu_pgjobs.store.schema import migrate

    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        migrate(conn, SCHEMA)
        create_done_table(conn, SCHEMA)


def _done_count() -> int:
    with psycopg.connect(URL, autocommit=True) as conn:
        return done_count(conn, SCHEMA)


def _wake_waiters(n: int, keys: list[str]) -> None:
    """Once ``n`` waiters are parked (their message handed back), emit each one's event."""
    from kombu_pgjobs.store import steps as db_steps

    deadline = time.monotonic() + 120
    with psycopg.connect(URL, autocommit=True) as conn:
        while int(conn.execute(
                f'SELECT count(*) FROM "{SCHEMA}".pgjobs_step AS s JOIN "{SCHEMA}".pgjobs_job '
                "AS j ON j.id = s.job_id WHERE s.state = 'waiting' AND j.state = 'ready'"
        ).fetchone()[0]) < n:
            if time.monotonic() > deadline:
                raise SystemExit("wait: the waiters did not park in 120 s")
            time.sleep(0.05)
        for key in keys:
            db_steps.emit(conn, SCHEMA, EVENT, key, json.dumps({"key": key}))


def run(n: int) -> list[tuple[str, int, float, dict[str, int]]]:
    sys.path.insert(0, str(ROOT))
    from tests.wirecount import WireCounter

    _prepare()
    info = psycopg.conninfo.conninfo_to_dict(URL)
    rows: list[tuple[str, int, float, dict[str, int]]] = []
    with WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432))) as wire, \
            tempfile.TemporaryDirectory() as tmp:
        broker = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
                  f"{info.get('dbname', 'test')}")
        log = Path(tmp) / "worker.log"
        env = {**os.environ, "BENCH_STEPS_BROKER": broker, "BENCH_PG_URL": URL,
               "BENCH_STEPS_SCHEMA": SCHEMA, "PYTHONPATH": str(ROOT)}
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
            keys = [f"k{i}" for i in range(n)]
            kinds: list[tuple[str, list[tuple[str, tuple[Any, ...], str | None]]]] = [
                ("plain (no steps)", [("bench_steps.plain", (), None)] * n),
                ("of() only", [("bench_steps.unused", (), None)] * n),
                ("1 step", [("bench_steps.steps", (1,), None)] * n),
                ("3 steps", [("bench_steps.steps", (3,), t) for t in replayed]),
                ("3 steps, replayed", [("bench_steps.steps", (3,), t) for t in replayed]),
                ("sleep 0.2 s", [("bench_steps.nap", (), None)] * n),
                ("wait (suspends)", [("bench_steps.wait", (k,), None) for k in keys]),
            ]
            for label, tasks in kinds:
                time.sleep(1.0)  # the previous kind's acks flushed
                target = _done_count() + len(tasks)
                before, steps_before = wire.count(), step_counts(wire, SCHEMA)
                for name, args, task_id in tasks:
                    publisher.send_task(name, args, task_id=task_id)
                if name == "bench_steps.wait":
                    _wake_waiters(len(tasks), keys)
                deadline = time.monotonic() + 120
                while _done_count() < target:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{label}: not done in 120 s")
                    time.sleep(0.05)
                time.sleep(1.0)  # its last acks
                after = step_counts(wire, SCHEMA)
                rows.append((label, len(tasks), (wire.count() - before) / len(tasks),
                             {k: after[k] - steps_before[k] for k in after}))
        finally:
            worker.terminate()
            worker.wait(30)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=300, help="tasks per kind (default 300)")
    args = parser.parse_args(argv)
    rows = run(args.n)
    names = list(STEP_STATEMENTS.values())
    print(f"{'kind':<20} {'tasks':>6} {'worker statements/task':>23} {'steps/task':>11}  "
          + " ".join(f"{s:>5}" for s in names))
    for label, n, total, counts in rows:
        print(f"{label:<20} {n:>6} {total:>23.2f} {sum(counts.values()) / n:>11.2f}  "
              + " ".join(f"{counts[s] / n:>5.2f}" for s in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
