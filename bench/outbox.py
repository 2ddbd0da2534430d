"""``python -m bench.outbox``: what the transactional outbox costs a publisher, and how fast the
relay empties it (issue 13).

Publisher side (one process, sequential, the app's own INSERT in every transaction, durable
commits, pgjobs broker in the same database, schema ``bench_outbox`` of database
``bench_outbox``):

* ``delay()``, no transaction: the plain publish (autocommit on the transport's connection)
* app transaction, then ``delay()`` after COMMIT: the ``on_commit`` / ``delay_on_commit``
  pattern (two commits per task, and the lost-after-commit window)
* ``delay()`` inside ``celery_ext.transaction(conn)``, one task per transaction: the outbox,
  same database (one commit per task, the row in the app's transaction)
* many ``delay()`` in one block: per-task cost when a transaction publishes many
* staged for Redis, one task per transaction: the outbox with a broker elsewhere

Relay side: N staged rows published by one in-process :class:`kombu_pgjobs.broker.relay.Relay` to
Redis and to RabbitMQ (publisher confirms), rows/s until the outbox is empty.

Kept short (N=2000: well under a minute here); ``--n`` changes it. Not a test: numbers only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import kombu
import psycopg
from celery import Celery

import celery_ext
from kombu_pgjobs.broker.relay import Relay
from kombu_pgjobs.store.schema import migrate

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
DB = "bench_outbox"
DSN = f"postgresql://postgres@127.0.0.1:5432/{DB}"
SCHEMA = "bench_outbox"
QUEUE = "bench_outbox"
BROKERS = {"redis": "redis://127.0.0.1:6379/6", "amqp": "amqp://guest:guest@127.0.0.1:5672//"}


def _database() -> None:
    with psycopg.connect(ADMIN, autocommit=True) as admin:
        if not admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DB,)).fetchone():
            admin.execute(f'CREATE DATABASE "{DB}"')
    with psycopg.connect(DSN, autocommit=True) as conn:
        migrate(conn, SCHEMA)
        conn.execute(f'CREATE TABLE IF NOT EXISTS "{SCHEMA}".orders (id bigserial PRIMARY KEY,'
                     " n int)")


def _app(broker: str) -> tuple[Celery, Any]:
    app = Celery(f"bench_outbox_{abs(hash(broker))}", broker=broker)
    celery_ext.install(app)
    app.conf.update(task_ignore_result=True, task_default_queue=QUEUE,
                    pgjobs_outbox_schema=SCHEMA,
                    broker_transport_options={"schema": SCHEMA}
                    if broker.startswith("pgjobs") else {})

    @app.task(name="bench_outbox.noop")
    def noop(i: int) -> None:
        return None

    return app, noop


def _clean(db: psycopg.Connection[Any]) -> None:
    db.execute(f'TRUNCATE "{SCHEMA}".pgjobs_job, "{SCHEMA}".pgjobs_outbox, '
               f'"{SCHEMA}".orders')


def _rate(n: int, fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return n / (time.perf_counter() - started)


def publisher(n: int, db: psycopg.Connection[Any]) -> list[tuple[str, float]]:
    pg_app, noop = _app(f"pgjobs://postgres@127.0.0.1:5432/{DB}")
    _, staged = _app(BROKERS["redis"])
    insert = f'INSERT INTO "{SCHEMA}".orders (n) VALUES (%s)'
    noop.delay(-1)  # connect and declare once, outside the timings
    rows: list[tuple[str, float]] = []
    with psycopg.connect(DSN) as conn:
        def plain() -> None:
            for i in range(n):
                noop.delay(i)

        def after_commit() -> None:
            for i in range(n):
                with conn.transaction():
                    conn.execute(insert, (i,))
                noop.delay(i)

        def in_block() -> None:
            for i in range(n):
                with conn.transaction():
                    conn.execute(insert, (i,))
                    with celery_ext.transaction(conn, app=pg_app):
                        noop.delay(i)

        def one_block() -> None:
            with conn.transaction():
                conn.execute(insert, (0,))
                with celery_ext.transaction(conn, app=pg_app):
                    for i in range(n):
                        noop.delay(i)

        def staged_redis() -> None:
            for i in range(n):
                with conn.transaction():
                    conn.execute(insert, (i,))
                    with celery_ext.transaction(conn, app=pg_app):
                        staged.delay(i)

        for label, fn, table in (
                ("delay(), no transaction", plain, "pgjobs_job"),
                ("app transaction, then delay() after COMMIT (on_commit)", after_commit,
                 "pgjobs_job"),
                ("delay() in celery_ext.transaction(), 1 task/transaction", in_block,
                 "pgjobs_job"),
                (f"delay() x{n} in one celery_ext.transaction()", one_block, "pgjobs_job"),
                ("staged for Redis, 1 task/transaction", staged_redis, "pgjobs_outbox")):
            _clean(db)
            rate = _rate(n, fn)
            got = db.execute(f'SELECT count(*) FROM "{SCHEMA}".{table}').fetchone()[0]
            assert got == n, (label, got)
            rows.append((label, rate))
    return rows


def relay(n: int, db: psycopg.Connection[Any]) -> list[tuple[str, float]]:
    rows: list[tuple[str, float]] = []
    for name, url in BROKERS.items():
        app, noop = _app(url)
        _clean(db)
        with psycopg.connect(DSN) as conn:
            for start in range(0, n, 100):
                with conn.transaction(), celery_ext.transaction(conn, app=app):
                    for i in range(start, min(start + 100, n)):
                        noop.delay(i)
        r = Relay(DSN, url, schema=SCHEMA, batch=100)
        try:
            def drain(r: Relay = r) -> None:
                while r.run_once():
                    pass
            rate = _rate(n, drain)
        finally:
            r.close()
        left = db.execute(f'SELECT count(*) FROM "{SCHEMA}".pgjobs_outbox '
                          "WHERE published_at IS NULL").fetchone()[0]
        assert left == 0, (name, left)
        with kombu.Connection(url) as bc:
            kombu.Queue(QUEUE, channel=bc.default_channel).delete()
        rows.append((f"relay -> {name}, batch 100", rate))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.outbox", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2000, help="tasks per case (default 2000)")
    p.add_argument("--runs", type=int, default=1, help="rounds, median reported (default 1)")
    args = p.parse_args(argv)
    _database()
    rates: dict[str, list[float]] = {}
    with psycopg.connect(DSN, autocommit=True) as db:
        for _ in range(args.runs):  # rounds interleave the cases: noise hits them alike
            for label, rate in publisher(args.n, db) + relay(args.n, db):
                rates.setdefault(label, []).append(rate)
        _clean(db)
    print(f"| case (N={args.n}, sequential, durable commits; median of {args.runs}) "
          "| tasks/s | min..max |")
    print("|---|---:|---|")
    for label, got in rates.items():
        got.sort()
        print(f"| {label} | {got[len(got) // 2]:,.0f} | {got[0]:,.0f}..{got[-1]:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
