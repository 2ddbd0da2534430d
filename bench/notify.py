"""What waking consumers costs: publish throughput, and transactions per message.

    python -m bench.notify [--threads 8] [--seconds 5] [--runs 3]
                           [--consumers 1,6,16] [--messages 200] [--gap 0.02]

Since schema version 17 the insert trigger (``pgjobs_wake_v3`` since version 21) wakes one
registered consumer per message and sends no NOTIFY when no consumer waits. Each figure is
measured with three triggers on the job table, side by side: ``wake`` (today's), ``broadcast``
(version 1's ``pgjobs_notify_v1``, installed here from its migration for the comparison:
one NOTIFY per publishing statement on the schema's channel, heard by every consumer) and
``none`` (no trigger: the ceiling). In the database ``bench_notify`` (``--database``) of the
server of $BENCH_PG_ADMIN_DSN (created when missing; nothing else uses it, so its counters
are ours):

(a) **Publish throughput**: ``--threads`` threads publish through kombu for ``--seconds``
    each, every thread on its own publish connection (a backend per thread: distinct
    ``application_name``), no consumer registered (a fleet that is busy), each trigger in turn,
    ``--runs`` times; each also with ``durable_publish=False``. PostgreSQL serialises the
    commits of every transaction that notified (a lock held from pre-commit to the end of
    commit, WAL flush included, across the cluster), so with ``broadcast`` concurrent
    publishers commit one at a time. Messages/s, median of runs.

(b) **Transactions per message**: ``N`` idle kombu consumers (LISTEN, the default), each on
    its own connection, consume one queue; ``--messages`` messages are published one at a
    time, ``--gap`` seconds apart, so every message finds the consumers idle (the common case
    for a lightly loaded queue). With ``broadcast`` each NOTIFY wakes every consumer (all
    claim, one gets the message); with ``wake`` one. ``xact_commit + xact_rollback`` of the
    database is read before and after, once with publishes and once idle for the same time
    (same consumers, same start and stop), and the difference divided by the messages. The
    counters are read only after every connection of the phase closed (a backend reports them
    when it exits).

    PostgreSQL (15, and up to 17 at least) signals *every* LISTENing backend of the database on
    every NOTIFY, whatever its channel, and each signalled backend runs a short transaction of
    its own to read the notification queue: a server-side cost per listener per NOTIFY that
    ``xact_commit`` counts, though no client wakes for it. (c) measures it in the same run:
    ``N`` plain connections LISTEN on an unrelated channel while ``--messages`` NOTIFYs are
    sent. (b)'s *client* figure is its per-message figure less that share (``N`` listeners times
    one NOTIFY per message): the round trips the consumers themselves make.

Nothing here is a test: figures depend on the machine; see docs/benchmarks.md for recorded
runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import kombu
import psycopg

from bench.brokers import ensure_database, pg_dsn
from bench.pgstats import settle, transactions
from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.store.schema import migrate

DATABASE = "bench_notify"
SCHEMA = "bench_notify"
QUEUE = "bn"


def _url() -> str:
    parts = urlsplit(pg_dsn(DATABASE))
    return parts._replace(scheme="pgjobs").geturl()


def _broadcast_trigger() -> str:
    """Version 1's insert trigger and its function, as its migration wrote them (version 17
    dropped both): the ``broadcast`` comparison."""
    text = resources.files("kombu_pgjobs.store.schema").joinpath("0001_initial.sql").read_text()
    start = text.index("CREATE FUNCTION {schema}.pgjobs_notify_v1()")
    end = text.index("EXECUTE FUNCTION {schema}.pgjobs_notify_v1();", start)
    return text[start:end + len("EXECUTE FUNCTION {schema}.pgjobs_notify_v1();")]


TRIGGERS = ("wake", "broadcast", "none")


def _setup(trigger: str) -> None:
    """A fresh schema with ``trigger`` (one of TRIGGERS) on the job table; autovacuum off (its
    transactions would count in (b))."""
    ensure_database(DATABASE)
    with psycopg.connect(pg_dsn(DATABASE), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE')
        migrate(conn, SCHEMA)
        for table in ("pgjobs_job", "pgjobs_slot", "pgjobs_queue", "pgjobs_counter",
                      "pgjobs_consumer"):
            conn.execute(f'ALTER TABLE "{SCHEMA}".{table} SET (autovacuum_enabled = false)')
        if trigger != "wake":  # the schema's wake trigger, whichever version it is
            (name,) = conn.execute(
                "SELECT tgname FROM pg_trigger WHERE tgrelid = %s::regclass "
                "AND tgname LIKE 'pgjobs_job_wake_%%'", [f'"{SCHEMA}".pgjobs_job']).fetchone()
            conn.execute(f'ALTER TABLE "{SCHEMA}".pgjobs_job DISABLE TRIGGER "{name}"')
        if trigger == "broadcast":
            conn.execute(_broadcast_trigger().replace("{schema}", f'"{SCHEMA}"'))


def _connection(name: str, **options: Any) -> kombu.Connection:
    return kombu.Connection(_url(), transport_options={
        "schema": SCHEMA, "application_name": f"bench-notify-{name}", **options})


# -- (a) publish throughput --------------------------------------------------------------------
def publish_rate(threads: int, seconds: float, *, durable: bool = True) -> float:
    """Messages/s of ``threads`` threads publishing through kombu for ``seconds``."""
    queue = kombu.Queue(QUEUE)
    counts = [0] * threads
    ready = threading.Barrier(threads + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def publisher(i: int) -> None:
        try:
            with _connection(f"p{i}", durable_publish=durable) as conn:
                producer = conn.Producer()
                queue(conn.default_channel).declare()
                producer.publish({"warm": i}, routing_key=QUEUE)  # connection opened
                ready.wait()
                n = 0
                while not stop.is_set():
                    producer.publish({"i": n, "t": i}, routing_key=QUEUE)
                    n += 1
                counts[i] = n
        except BaseException as exc:  # reported, never a silent low figure
            errors.append(exc)
            ready.abort()

    pool = [threading.Thread(target=publisher, args=(i,), daemon=True) for i in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    started = time.monotonic()
    time.sleep(seconds)
    stop.set()
    for t in pool:
        t.join(60)
    elapsed = time.monotonic() - started
    release_all()
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


# -- (b) transactions per message --------------------------------------------------------------
def _xacts() -> int:
    return transactions(DATABASE)


def _quiet(timeout: float = 15.0) -> None:
    """Wait until no backend is connected to the database (each reported its counters)."""
    settle(DATABASE, timeout)


def consume_phase(consumers: int, messages: int, gap: float,
                  idle_for: float = 0.0) -> tuple[int, float]:
    """(transactions, seconds) of one phase: ``consumers`` idle consumers, ``messages``
    published ``gap`` apart, or none and ``idle_for`` seconds idle."""
    queue = kombu.Queue(QUEUE)
    got = [0]
    lock = threading.Lock()
    ready = threading.Barrier(consumers + 1)
    stop = threading.Event()
    errors: list[BaseException] = []

    def on_message(body: Any, message: kombu.Message) -> None:
        message.ack()
        with lock:
            got[0] += 1

    def consumer(i: int) -> None:
        try:
            with _connection(f"c{i}") as conn, conn.Consumer(queue, callbacks=[on_message],
                                                             prefetch_count=4):
                try:
                    conn.drain_events(timeout=0.2)  # claim connection open, LISTENing
                except TimeoutError:
                    pass
                ready.wait()
                while not stop.is_set():
                    try:
                        conn.drain_events(timeout=0.5)
                    except TimeoutError:
                        pass
        except BaseException as exc:
            errors.append(exc)
            ready.abort()

    _quiet()
    before = _xacts()
    pool = [threading.Thread(target=consumer, args=(i,), daemon=True)
            for i in range(consumers)]
    for t in pool:
        t.start()
    ready.wait()
    started = time.monotonic()
    with _connection("pub") as conn:
        producer = conn.Producer()
        for n in range(messages):
            producer.publish({"n": n}, routing_key=QUEUE)
            time.sleep(gap)
        if not messages:
            time.sleep(idle_for)
        deadline = time.monotonic() + 30
        while got[0] < messages and time.monotonic() < deadline:
            time.sleep(0.01)
    elapsed = time.monotonic() - started
    stop.set()
    for t in pool:
        t.join(30)
    release_all()
    if errors:
        raise errors[0]
    if got[0] != messages:
        raise RuntimeError(f"consumed {got[0]} of {messages}")
    _quiet()
    return _xacts() - before, elapsed


def xacts_per_message(consumers: int, messages: int, gap: float) -> dict[str, Any]:
    busy, busy_s = consume_phase(consumers, messages, gap)
    idle, idle_s = consume_phase(consumers, 0, gap, idle_for=busy_s)
    # what the same consumers cost doing nothing for as long, scaled to the busy phase's time
    idle_scaled = idle * busy_s / idle_s if idle_s else idle
    return {"consumers": consumers, "messages": messages, "xacts_busy": busy,
            "xacts_idle_same_time": round(idle_scaled, 1),
            "per_message": round((busy - idle_scaled) / messages, 2),
            "per_message_raw": round(busy / messages, 2)}


def signal_cost(listeners: int, notifies: int) -> float:
    """(c): server transactions per NOTIFY per listening backend that is not the channel's."""
    def run(n: int) -> int:
        _quiet()
        before = _xacts()
        held = [psycopg.connect(pg_dsn(DATABASE), autocommit=True) for _ in range(n)]
        try:
            for conn in held:
                conn.execute('LISTEN "bench.elsewhere"')
            with psycopg.connect(pg_dsn(DATABASE), autocommit=True) as pub:
                for _ in range(notifies):
                    pub.execute("SELECT pg_notify('bench.nobody', 'x')")
            time.sleep(0.3)  # every listener read the queue
        finally:
            for conn in held:
                conn.close()
        _quiet()
        return _xacts() - before
    extra = run(listeners) - run(0)
    return extra / (listeners * notifies) if listeners else 0.0


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.notify", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--consumers", default="1,6,16", help="idle consumer counts for (b)")
    p.add_argument("--messages", type=int, default=200)
    p.add_argument("--gap", type=float, default=0.02, help="seconds between (b)'s publishes")
    p.add_argument("--skip", choices=["a", "b"], help="leave one part out")
    p.add_argument("--json", action="store_true")
    p.add_argument("--database", default=DATABASE,
                   help="database to use, created when missing; its counters must be ours alone "
                        "(two runs at once need two databases)")
    args = p.parse_args()
    globals()["DATABASE"] = args.database
    result: dict[str, Any] = {}
    if args.skip != "a":
        # durable_publish=False as well: the lock NOTIFY takes is held through the commit's
        # WAL flush, which an asynchronous commit does not wait for
        cases = {f"{t}{suffix}": (durable, t) for durable, suffix in ((True, ""),
                                                                     (False, "_async"))
                 for t in TRIGGERS}
        rates: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.runs):
            for name, (durable, trigger) in cases.items():
                _setup(trigger)
                rates[name].append(publish_rate(args.threads, args.seconds, durable=durable))
        result["publish"] = {"threads": args.threads, "seconds": args.seconds,
                             **{k: {"median": round(statistics.median(v)),
                                    "runs": [round(x) for x in v]} for k, v in rates.items()}}
    if args.skip != "b":
        result["xacts"] = []
        for n in (int(x) for x in args.consumers.split(",")):
            for trigger in ("wake", "broadcast"):
                _setup(trigger)
                row = xacts_per_message(n, args.messages, args.gap)
                row["signal_per_listener"] = round(signal_cost(n, args.messages), 2)
                row["client_per_message"] = round(row["per_message"]
                                                  - n * row["signal_per_listener"], 2)
                result["xacts"].append({"trigger": trigger, **row})
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if "publish" in result:
        r = result["publish"]
        print(f"(a) {r['threads']} threads publishing through kombu, {r['seconds']:g} s each, "
              f"median of {args.runs}:")
        for k in (f"{t}{suffix}" for suffix in ("", "_async") for t in TRIGGERS):
            print(f"    {k:<16} {r[k]['median']:>7,} msg/s   runs {r[k]['runs']}")
    for r in result.get("xacts", []):
        print(f"(b) {r['trigger']:<9} {r['consumers']:>2} idle consumer(s), "
              f"{r['messages']} messages "
              f"{args.gap:g} s apart: {r['per_message']} transactions per message "
              f"({r['xacts_busy']} in all, {r['xacts_idle_same_time']} of them the idle "
              f"cost of that time; {r['per_message_raw']} per message raw); "
              f"(c) {r['signal_per_listener']} per listener per NOTIFY, so "
              f"{r['client_per_message']} made by the clients")


if __name__ == "__main__":
    main()
