"""Prometheus metrics of one pgjobs schema, read from the database itself.

Everything is computed from the tables at scrape time — queue depths and ages from
``pgjobs_job``, dead letters from ``pgjobs_dead_letter``, settled totals from ``pgjobs_counter``
(moved by the statements that settle rows, so they are exact and shared by every worker) — so one
exporter per database is enough, however many workers run, and a restarted worker loses nothing.
``pgjobs metrics`` prints the text once; ``pgjobs metrics --serve PORT`` serves it over
:mod:`http.server` (bound to 127.0.0.1 unless told otherwise: metrics name queues and tasks).
Label values are bounded: the top N queues (``--queues``, default 100) and tenants
(``--tenants``, default 10) get series of their own, the other queues one ``(other)`` series.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg

from ..errors import InvalidArgument, PgJobsError
from ..store.admin import Admin
from ..store.database import connect
from ..store.steps import suspended as suspended_messages

__all__ = ["DEFAULT_QUEUES", "OTHER", "Metric", "MetricsSource", "ShardedMetrics",
           "check_queues", "collect", "make_server", "merge", "render"]

log = logging.getLogger("kombu_pgjobs")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Metric:
    name: str
    kind: str  # gauge | counter
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)

    def add(self, value: float, **labels: str) -> None:
        self.samples.append((labels, value))


#: tenants given their own samples by default (the ones with the most live messages)
DEFAULT_TENANTS = 10
#: queues given their own samples by default: the rest are summed into :data:`OTHER`
DEFAULT_QUEUES = 100
MAX_QUEUES = 100_000
#: the ``queue`` label of the sum of the queues past the top N (a queue of that very name is
#: always summed into it, so a series never has two meanings)
OTHER = "(other)"


def _rank(rows: list[dict[str, Any]], top: int,
          weight: Callable[[dict[str, Any]], float]) -> tuple[list[dict[str, Any]],
                                                              list[dict[str, Any]]]:
    """(the ``top`` rows by ``weight``, ties by name; the rest). ``top`` 0: every row."""
    if not top:
        return rows, []
    mine = [r for r in rows if r["queue"] != OTHER]
    ranked = sorted(mine, key=lambda r: (-weight(r), r["queue"]))
    kept = ranked[:top]
    return kept, ranked[top:] + [r for r in rows if r["queue"] == OTHER]


def check_queues(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_QUEUES:
        raise InvalidArgument(f"--queues must be a whole number in 0-{MAX_QUEUES} (0: every "
                              f"queue), got {value!r}")
    return value


def collect(admin: Admin, *, tenants: int = DEFAULT_TENANTS,
            queues: int = DEFAULT_QUEUES) -> list[Metric]:
    """Read every metric in a few statements (no row locks). ``tenants``: how many tenants
    (those with the most live messages) get ``pgjobs_tenant_messages`` samples; 0: none.
    ``queues``: how many queues get samples of their own in each per-queue metric — those
    with the most messages (live and dead) for the gauges, the most settled for
    ``pgjobs_settled_total`` — the rest summed into ``queue="(other)"`` (the oldest age: their
    oldest; paused: how many); 0: every queue. The number of series stays bounded however
    many queues there are."""
    check_queues(queues)
    started = time.monotonic()
    messages = Metric("pgjobs_messages", "gauge",
                      "Messages in the job table by queue and state: ready (due now), delayed "
                      "(waiting for their ETA), running (leased to a worker) and waiting "
                      "(parked by a full concurrency key).")
    oldest = Metric("pgjobs_oldest_ready_age_seconds", "gauge",
                    "Seconds the oldest due message of a queue has waited (0 when none): the "
                    "queue's latency.")
    dead = Metric("pgjobs_dead_letters", "gauge", "Dead letters held for a queue.")
    paused = Metric("pgjobs_queue_paused", "gauge", "1 when a queue is paused (not claimed).")
    settled = Metric("pgjobs_settled_total", "counter",
                     "Messages settled, by queue and outcome (completed, failed, dropped, "
                     "cancelled, requeued, rescued, expired, refused, purged, revoked), since "
                     "the schema was installed.")
    consumers = Metric("pgjobs_consumers", "gauge",
                       "Consuming processes seen by their keeper tick in the last few ticks.")
    orphaned = Metric("pgjobs_orphaned_leases", "gauge",
                      "Leases held by processes that no longer report as consumers (they lapse "
                      "within lease_ttl and are re-delivered or buried).")
    every = admin.queues(minutes=1)
    listed, folded = _rank(every, queues, lambda q: sum(
        q[k] for k in ("ready", "delayed", "running", "waiting", "dead")))
    for q in listed:
        name = q["queue"]
        for state in ("ready", "delayed", "running", "waiting"):
            messages.add(q[state], queue=name, state=state)
        oldest.add(q["oldest_ready_age"] or 0.0, queue=name)
        dead.add(q["dead"], queue=name)
        paused.add(1 if q["paused"] else 0, queue=name)
    if folded:
        for state in ("ready", "delayed", "running", "waiting"):
            messages.add(sum(q[state] for q in folded), queue=OTHER, state=state)
        oldest.add(max((q["oldest_ready_age"] or 0.0 for q in folded), default=0.0),
                   queue=OTHER)
        dead.add(sum(q["dead"] for q in folded), queue=OTHER)
        paused.add(sum(1 for q in folded if q["paused"]), queue=OTHER)
    totals: dict[str, dict[str, int]] = {}
    for row in admin.counter_totals():
        totals.setdefault(row["queue"], {})[row["outcome"]] = int(row["n"])
    rows = [{"queue": name, "outcomes": outcomes} for name, outcomes in totals.items()]
    kept, rest = _rank(rows, queues, lambda r: sum(r["outcomes"].values()))
    for r in sorted(kept, key=lambda r: r["queue"]):
        for outcome, n in sorted(r["outcomes"].items()):
            settled.add(n, queue=r["queue"], outcome=outcome)
    summed: dict[str, int] = {}
    for r in rest:
        for outcome, n in r["outcomes"].items():
            summed[outcome] = summed.get(outcome, 0) + n
    for outcome, n in sorted(summed.items()):
        settled.add(n, queue=OTHER, outcome=outcome)
    count = Metric("pgjobs_queues", "gauge",
                   "Queues, and how many of them are summed into queue=\"(other)\" (past "
                   "the top N that get series of their own).")
    count.add(len(every), kind="all")
    count.add(len(folded), kind="other")
    alive = gone = 0
    for w in admin.workers(leases=0):
        if w["alive"]:
            alive += 1
        else:
            gone += int(w["running"])
    consumers.add(alive)
    orphaned.add(gone)
    # durable steps (issue 32): parked messages by reason, never by queue (bounded: two series)
    suspended = Metric("pgjobs_suspended_messages", "gauge",
                       "Messages parked by a durable step (celery_ext.steps), by reason: sleep "
                       "(steps.sleep) or event (steps.wait_for_event). No worker holds them.")
    by_reason = {"sleep": 0, "event": 0}
    for _, reason, n in suspended_messages(admin.conn, admin.schema):
        by_reason[reason] = by_reason.get(reason, 0) + n
    for reason, n in sorted(by_reason.items()):
        suspended.add(n, reason=reason)
    per_tenant = _tenant_metrics(admin, tenants) if tenants else []
    up = Metric("pgjobs_up", "gauge", "1 when the exporter could read the pgjobs schema.")
    up.add(1)
    took = Metric("pgjobs_scrape_duration_seconds", "gauge", "Seconds this scrape took.")
    took.add(round(time.monotonic() - started, 6))
    return [up, messages, oldest, dead, paused, settled, count, consumers, orphaned,
            suspended, *per_tenant, took]


def _tenant_metrics(admin: Admin, top: int) -> list[Metric]:
    """Live messages of the ``top`` busiest tenants, and the number of tenants: bounded label
    values, whatever the number of tenants."""
    messages = Metric("pgjobs_tenant_messages", "gauge",
                      f"Live messages of the {top} tenants with the most, by state (ready, "
                      "delayed, running, waiting).")
    count = Metric("pgjobs_tenants", "gauge", "Tenants with live messages.")
    rows = admin.tenant_stats(top)
    for row in rows:
        for state in ("ready", "delayed", "running", "waiting"):
            messages.add(row[state], tenant=row["tenant"], state=state)
    count.add(rows[0]["tenants"] if rows else 0)
    return [messages, count]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(metrics: list[Metric]) -> str:
    """Prometheus text exposition format 0.0.4."""
    lines: list[str] = []
    for m in metrics:
        lines.append(f"# HELP {m.name} {m.help}")
        lines.append(f"# TYPE {m.name} {m.kind}")
        for labels, value in m.samples:
            if labels:
                inner = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                lines.append(f"{m.name}{{{inner}}} {_number(value)}")
            else:
                lines.append(f"{m.name} {_number(value)}")
    return "\n".join(lines) + "\n"


class MetricsSource:
    """One connection, reopened after a failure; a failed scrape reports ``pgjobs_up 0``
    rather than an HTTP error, so "exporter up, database down" is its own alert."""

    def __init__(self, conninfo: str, schema: str, *, tenants: int = DEFAULT_TENANTS,
                 queues: int = DEFAULT_QUEUES) -> None:
        self.conninfo = conninfo
        self.schema = schema
        self.tenants = tenants
        self.queues = check_queues(queues)
        self._conn: psycopg.Connection[Any] | None = None
        self._lock = threading.Lock()

    def metrics(self) -> list[Metric]:
        with self._lock:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.conninfo, prepare=False)
                Admin(self._conn, self.schema).check_schema()
            return collect(Admin(self._conn, self.schema), tenants=self.tenants,
                           queues=self.queues)

    def text(self) -> str:
        try:
            return render(self.metrics())
        except (psycopg.Error, PgJobsError) as exc:
            log.warning("pgjobs.metrics.failed %s", exc, extra={"action": "metrics"})
            with self._lock:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
            down = Metric("pgjobs_up", "gauge",
                          "1 when the exporter could read the pgjobs schema.")
            down.add(0)
            return f"# pgjobs: {str(exc).splitlines()[0] if str(exc) else 'error'}\n" + \
                render([down])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def merge(per_shard: list[tuple[Any, list[Metric]]]) -> list[Metric]:
    """The metrics of a shard map's databases as one set: every sample gains a ``shard``
    label (``default`` for the broker URL's database, ``host:port/db`` for the others);
    metrics keep their order, samples their database's order."""
    merged: dict[str, Metric] = {}
    for shard, metrics in per_shard:
        for m in metrics:
            into = merged.setdefault(m.name, Metric(m.name, m.kind, m.help))
            into.samples += [({"shard": str(shard), **labels}, v) for labels, v in m.samples]
    return list(merged.values())


class ShardedMetrics:
    """One :class:`MetricsSource` per database of a shard map, scraped together. A database
    that cannot be read reports ``pgjobs_up{shard=...} 0``; the others are served."""

    def __init__(self, sources: list[tuple[str, MetricsSource]]) -> None:
        self.sources = sources

    def metrics(self) -> list[Metric]:
        return merge([(shard, source.metrics()) for shard, source in self.sources])

    def text(self) -> str:
        per_shard: list[tuple[Any, list[Metric]]] = []
        notes = []
        for shard, source in self.sources:
            try:
                per_shard.append((shard, source.metrics()))
            except (psycopg.Error, PgJobsError) as exc:
                log.warning("pgjobs.metrics.failed %s", exc, extra={"action": "metrics"})
                source.close()
                down = Metric("pgjobs_up", "gauge",
                              "1 when the exporter could read the pgjobs schema.")
                down.add(0)
                per_shard.append((shard, [down]))
                notes.append(f"# pgjobs: {shard}: "
                             f"{str(exc).splitlines()[0] if str(exc) else 'error'}\n")
        return "".join(notes) + render(merge(per_shard))

    def close(self) -> None:
        for _, source in self.sources:
            source.close()


def make_server(text: Callable[[], str], port: int,
                bind: str = "127.0.0.1") -> ThreadingHTTPServer:
    """An HTTP server answering ``GET /metrics`` (and ``/``) with ``text()``."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/", "/metrics"):
                self.send_error(404, "metrics are at /metrics")
                return
            body = text().encode("utf-8")
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("pgjobs.metrics.request " + format, *args)

    server = ThreadingHTTPServer((bind, port), Handler)
    server.daemon_threads = True
    return server
