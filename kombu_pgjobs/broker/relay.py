"""The outbox relay: publishes messages staged in the app's database to the real broker.

``pgjobs relay --dsn APP_DB --broker URL`` (or :class:`Relay` from a worker bootstep). Kombu
only: the broker is any kombu URL (``redis://``, ``amqp://``, ``pgjobs://`` in another
database).

How it keeps the outbox's promise (at least once, in order per transaction, never lost):

* It claims committed rows (``outbox_claim``) under a fenced lease: the claim number only grows,
  and the row is marked published only by the claim that published it. A relay that dies
  leaves its rows to lapse; any relay re-claims them within one lease. Several relays share the
  table (``FOR UPDATE SKIP LOCKED``).
* A row is claimed only with every earlier unpublished row of its transaction, and published
  in id order: a transaction's messages reach the broker in the order they were staged.
* It publishes the batch, then marks it published in one statement. A relay killed in between
  publishes nothing twice by itself, but another relay publishes the batch again after the
  lease: duplicates happen only across a crash and are bounded by ``batch``.
* RabbitMQ is used with publisher confirms (``confirm_publish``): a publish returns once the
  broker has the message. A publish that fails even after kombu's retries puts the row and the
  rest of its transaction back after ``retry_delay`` (``pgjobs.relay.publish_failed``).
* Idle, it waits on LISTEN (staging NOTIFYs at commit), polling every ``poll_interval`` as the
  fallback.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from kombu import Connection, Exchange, Queue, binding
from psycopg import sql

from ..errors import ConfigurationError, DatabaseUnavailable
from ..events import log_event, one_line
from ..store.database import connect
from ..store.schema import migrate
from ..store.sql import queries, with_limit
from .outbox import notify_channel

__all__ = ["Relay", "RelayStats"]

log = logging.getLogger("kombu_pgjobs.relay")


@dataclass(frozen=True, slots=True)
class Staged:
    id: int
    claim: int
    exchange: str
    routing_key: str
    body: bytes
    content_type: str
    content_encoding: str
    headers: dict[str, Any]
    properties: dict[str, Any]
    declare: list[dict[str, Any]]


@dataclass
class RelayStats:
    """What this relay did (for its log line, the CLI and tests)."""

    published: int = 0
    batches: int = 0
    failed: int = 0
    lease_lost: int = 0


def _loaded(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str | bytes) else value


def _exchange(d: dict[str, Any]) -> Exchange:
    return Exchange(**d)


def _entity(d: dict[str, Any]) -> Any:
    """A kombu Queue or Exchange from its staged JSON (kombu_pgjobs.outbox._entity)."""
    if "exchange" in d:
        return _exchange(d["exchange"])
    q = dict(d["queue"])
    ex = q.pop("exchange", None)
    binds = [binding(_exchange(b["exchange"]), routing_key=b["routing_key"],
                     arguments=b["arguments"]) for b in q.pop("bindings", None) or ()]
    return Queue(exchange=_exchange(ex) if ex else None, bindings=binds or None, **q)


class Relay:
    """One relay: claims staged rows of ``schema`` in the app's database and publishes them to
    ``broker``."""

    def __init__(self, dsn: str, broker: str, *, schema: str = "pgjobs", batch: int = 100,
                 lease_ttl: float = 30.0, poll_interval: float = 1.0, retry_delay: float = 5.0,
                 transport_options: dict[str, Any] | None = None, auto_migrate: bool = True,
                 name: str | None = None) -> None:
        for what, value, low in (("batch", batch, 1), ("lease_ttl", lease_ttl, 1.0),
                                 ("poll_interval", poll_interval, 0.01),
                                 ("retry_delay", retry_delay, 0.0)):
            if not (isinstance(value, int | float) and value >= low and value < 1e9):
                raise ConfigurationError(f"relay {what} must be a number >= {low}, "
                                         f"got {value!r}")
        self.dsn = dsn
        self.broker = broker
        self.schema = schema
        self.batch = int(batch)
        self.lease_ttl = float(lease_ttl)
        self.poll_interval = float(poll_interval)
        self.retry_delay = float(retry_delay)
        options = dict(transport_options or {})
        if broker.split("://", 1)[0] in ("amqp", "pyamqp", "amqps"):
            options.setdefault("confirm_publish", True)  # published = the broker has it
        self.transport_options = options
        self.auto_migrate = auto_migrate
        self.name = name or f"{socket.gethostname()}:{os.getpid()}"
        self.stats = RelayStats()
        self.q = queries(schema)
        self._claim = with_limit(schema, "outbox_claim", self.batch)
        self._db: psycopg.Connection[Any] | None = None
        self._broker: Connection | None = None
        self._producer: Any = None

    # -- connections ---------------------------------------------------------------------
    def _database(self) -> psycopg.Connection[Any]:
        if self._db is None or self._db.closed or self._db.broken:
            self._db = conn = connect(self.dsn)
            if self.auto_migrate:
                migrate(conn, self.schema)
            conn.execute(sql.SQL("LISTEN {}").format(
                sql.Identifier(notify_channel(self.schema))))
        return self._db

    def _producer_for(self) -> Any:
        if self._producer is None:
            self._broker = Connection(self.broker, transport_options=self.transport_options)
            self._producer = self._broker.Producer()
        return self._producer

    def close(self) -> None:
        if self._broker is not None:
            self._broker.release()
        self._broker = self._producer = None
        if self._db is not None:
            self._db.close()
        self._db = None

    # -- one batch -----------------------------------------------------------------------
    def run_once(self) -> int:
        """Claim, publish and mark one batch; the number of rows published."""
        db = self._database()
        rows = db.execute(self._claim, {"owner": self.name, "ttl": self.lease_ttl}).fetchall()
        if not rows:
            return 0
        staged = sorted((Staged(r[0], r[1], r[2], r[3], bytes(r[4]), r[5], r[6],
                                _loaded(r[7]), _loaded(r[8]), _loaded(r[9])) for r in rows),
                        key=lambda s: s.id)
        claimed_at = time.monotonic()
        done: list[Staged] = []
        for n, row in enumerate(staged):
            if time.monotonic() - claimed_at > self.lease_ttl / 3:
                staged, claimed_at = self._renew(db, done, staged[n:]), time.monotonic()
                if row not in staged:
                    break
            try:
                self._publish(row)
            except Exception as exc:  # the broker refused or is unreachable after retries
                self._failed(db, row, staged[n:], exc)
                break
            done.append(row)
        self._mark(db, done)
        self.stats.batches += 1
        return len(done)

    def _publish(self, row: Staged) -> None:
        producer = self._producer_for()
        props = dict(row.properties)
        producer.publish(
            row.body, exchange=row.exchange, routing_key=row.routing_key,
            content_type=row.content_type, content_encoding=row.content_encoding,
            headers=dict(row.headers), declare=[_entity(d) for d in row.declare],
            retry=True, retry_policy={"max_retries": 3, "interval_start": 0.2,
                                      "interval_step": 0.5, "interval_max": 2},
            **props)

    def _renew(self, db: psycopg.Connection[Any], done: Sequence[Staged],
               rest: Sequence[Staged]) -> list[Staged]:
        """Extend the leases of the rows not yet marked; the rest still held (a row whose
        lease lapsed and was re-claimed is left to its new holder)."""
        held = list(done) + list(rest)
        got = {r[0] for r in db.execute(self.q["outbox_renew"], {
            "ids": [s.id for s in held], "claims": [s.claim for s in held],
            "ttl": self.lease_ttl}).fetchall()}
        lost = [s for s in rest if s.id not in got]
        if lost:
            self.stats.lease_lost += len(lost)
            log_event("pgjobs.relay.lease_lost", count=len(lost))
        return [s for s in rest if s.id in got]

    def _failed(self, db: psycopg.Connection[Any], row: Staged, rest: Sequence[Staged],
                exc: Exception) -> None:
        """Put ``row`` and the rest of the batch back after the retry delay (the rest of its
        transaction must not overtake it; other transactions' rows just wait one delay)."""
        self.stats.failed += 1
        error = one_line(exc)
        log_event("pgjobs.relay.publish_failed", outbox_id=row.id, error=error)
        db.execute(self.q["outbox_failed"], {
            "ids": [s.id for s in rest], "claims": [s.claim for s in rest],
            "delay": self.retry_delay, "failed": row.id, "error": error[:1000]})
        self._producer = None  # a fresh broker connection for the next try
        if self._broker is not None:
            self._broker.release()
            self._broker = None

    def _mark(self, db: psycopg.Connection[Any], done: Sequence[Staged]) -> None:
        if not done:
            return
        marked = db.execute(self.q["outbox_published"], {
            "ids": [s.id for s in done], "claims": [s.claim for s in done]}).fetchall()
        self.stats.published += len(done)
        if len(marked) < len(done):  # another relay re-claimed them: published twice
            self.stats.lease_lost += len(done) - len(marked)
            log_event("pgjobs.relay.lease_lost", count=len(done) - len(marked))

    # -- the loop ------------------------------------------------------------------------
    def wait(self, timeout: float) -> None:
        """Until a staging transaction commits (NOTIFY) or ``timeout`` seconds. A NOTIFY that
        arrived while a claim or mark ran is kept by psycopg and ends the wait at once."""
        for _ in self._database().notifies(timeout=timeout, stop_after=1):
            pass

    def run(self, stop: threading.Event | None = None,
            on_batch: Callable[[int], None] | None = None) -> None:
        """Relay until ``stop`` is set: batches back to back while full, else wait for a
        commit. A lost database or broker is reconnected with a backoff."""
        stop = stop or threading.Event()
        backoff = 0.5
        log.info("pgjobs relay %s: %s.pgjobs_outbox -> the broker, batch %d", self.name,
                 self.schema, self.batch, extra={"action": "pgjobs.relay.started"})
        try:
            while not stop.is_set():
                try:
                    n = self.run_once()
                    if on_batch is not None:
                        on_batch(n)
                    if n < self.batch:
                        self.wait(self.poll_interval)
                    backoff = 0.5
                except (psycopg.OperationalError, DatabaseUnavailable) as exc:
                    log_event("pgjobs.relay.database_lost", error=one_line(exc))
                    if self._db is not None:
                        self._db.close()
                        self._db = None
                    stop.wait(backoff)
                    backoff = min(backoff * 2, 10.0)
        finally:
            self.close()
