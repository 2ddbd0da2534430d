"""pgjobs:// — a kombu transport on PostgreSQL with fenced leases.

Features
========
* Type: virtual (kombu's virtual Channel/QoS; the queue core decides, this module translates)
* Supports direct, topic and fanout exchanges (bindings stored in Postgres): yes
* Supports priority: yes, 0-9, higher first (as on RabbitMQ)
* Supports TTL: yes (per-message ``expiration``, queue ``x-message-ttl`` and ``x-expires``)
* Delayed delivery: Celery ``eta``/``countdown`` become the row's due time
* Native delayed delivery, acks: fenced on ``(id, claim)``; leases renewed while unacked

Connection string
=================
``pgjobs://user:password@host:port/database`` — libpq parameters such as ``sslmode`` go in the
``connect_options`` transport option. ``pgjobs://`` (no host) or ``pgjobs:///name`` starts or
reuses an embedded PostgreSQL in a per-user data directory (``kombu-pgjobs[embedded]``).

Transport options
=================
See :data:`kombu_pgjobs.options.OPTIONS` and docs/reference/configuration.md.

Design
======
This module is the thin kombu adapter; the consumer loop (claims, waits, Celery's event loop,
the claim connection's states on faults) is :mod:`kombu_pgjobs.broker.consumer`, every statement is
in
:mod:`kombu_pgjobs.core` and ``sql/``.

* ``drain_events`` claims up to the channel's free prefetch window in ONE statement that also
  deletes the acks buffered since the last claim (fenced), and delivers every claimed row.
* It refills at a low-water mark (half the window), not per freed slot, and never sleeps a
  polling interval while work waits: it blocks in ``poll()`` on the claim connection's socket
  (which LISTENs while the connection consumes) and on a self-pipe that acks poke.
* A broken database connection is not a kombu connection loss: the loop reconnects by itself
  and nothing delivered is handed back (see :mod:`kombu_pgjobs.broker.consumer`).
* An ack is buffered (thread-safe, non-blocking) and flushed within ``ack_flush_interval`` by
  the consumer thread, or folded into the next claim. A crash before the flush re-delivers the
  message after its lease lapses; nothing acked-and-flushed is ever re-delivered.
* With a ``shards`` map (docs/sharding.md) each queue is published, claimed and settled on its
  own database (:mod:`kombu_pgjobs.broker.sharding`: one backend and one consumer loop per database;
  delivery tags ``id.claim.N`` name it); remote control, events and bindings stay on the
  broker URL's database. Without one, nothing here looks further than ``self.backend``.
  Shards are independent: connecting opens the default database only, and a shard that is
  down fails only its own queues' work (``ShardUnavailable``, PGJ-113; a queue declared
  meanwhile is declared when it is back: sharding.py).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from amqp.protocol import queue_declare_ok_t
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.utils.objects import cached_property

from ..errors import DatabaseUnavailable, PermissionDenied, PgJobsError, ShardUnavailable
from ..events import log_event, one_line
from ..options import (
    TransportOptions,
    queue_arguments,
    validate_exchange_name,
    validate_queue_name,
    validate_routing_key,
)
from ..store.core import Claimed, job_from_message
from ..store.database import conninfo_from_parts
from ..store.revoke import revoked_task_ids
from ..url import host_list
from .backend import Backend, backend_for, settle_listeners
from .consumer import ConsumerLoop, refill_mark
from .sharding import ShardedConsumer, Shards, log_unavailable

__all__ = ["Channel", "QoS", "Transport", "parse_shard_tag", "parse_tag"]

log = logging.getLogger("kombu_pgjobs")


def make_tag(job_id: int, claim: int, shard: int = 0) -> str:
    """``id.claim`` on the default database, ``id.claim.N`` on shard N (sharding.py)."""
    return f"{job_id}.{claim}.{shard}" if shard else f"{job_id}.{claim}"


def parse_shard_tag(tag: Any) -> tuple[int, int, int] | None:
    """``(id, claim, shard)`` of a delivery tag; anything else is not ours (None)."""
    try:
        parts = str(tag).split(".")
        if len(parts) == 2:
            return int(parts[0]), int(parts[1]), 0
        if len(parts) == 3:
            return int(parts[0]), int(parts[1]), int(parts[2])
    except ValueError:
        pass
    return None


def parse_tag(tag: Any) -> tuple[int, int] | None:
    """Delivery tags carry ``(id, claim)``; anything else is not ours (None). The database
    (a shard's number) is :func:`parse_shard_tag`'s."""
    found = parse_shard_tag(tag)
    return None if found is None else (found[0], found[1])


class QoS(virtual.QoS):
    """Acks are buffered in the backend and flushed fenced; rejects settle at once."""

    channel: Channel

    def ack(self, delivery_tag: Any) -> None:
        """Buffered, fenced on the tag's claim: it reaches the database whatever became of
        this channel or its connection meanwhile (a task that ran through a reconnect)."""
        found = parse_shard_tag(delivery_tag)
        if found is not None:
            backend = self.channel.backend_at(found[2])
            if backend is not None:
                backend.buffer_ack(found[0], found[1])
        super().ack(delivery_tag)
        window = self.prefetch_count
        connection = self.channel.connection
        if window and connection is not None and \
                self.can_consume_max_estimate() == refill_mark(window):
            # The window just reopened enough to refill: wake the consumer now rather than
            # when the buffered acks fall due (only the first ack of a batch pokes otherwise).
            connection.poke()

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        found = parse_shard_tag(delivery_tag)
        if found is not None:
            self.channel.settle([found[:2]], requeue=requeue, uncount=False, shard=found[2])
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Hand unacked (prefetched, unstarted) messages back at once, without an attempt.
        If that fails for good their leases are no longer renewed: they lapse and the rows
        come back (Channel.settle)."""
        self._flush()
        by_shard: dict[int, list[tuple[int, int]]] = {}
        for found in (parse_shard_tag(t) for t in self._delivered):
            if found is not None:
                by_shard.setdefault(found[2], []).append(found[:2])
        self._delivered.clear()
        for shard, pairs in by_shard.items():  # per database: not atomic across them
            self.channel.settle(pairs, requeue=True, uncount=True, shard=shard)
        return []


class Channel(virtual.Channel):
    QoS = QoS
    supports_fanout = True
    do_restore = True
    #: cached routing tables: exchange -> (monotonic time, table, type)
    _table_cache_ttl = 1.0

    connection: Transport

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        self.closing = False
        # The process-wide backend, kept: acks and rejects of messages this channel delivered
        # must reach it after the channel (or its connection) closed.
        self.backend: Backend = connection.backend
        #: with a shard map, every database's backend (sharding.py); None without one
        self.shards: Shards | None = connection.shards
        super().__init__(connection, **kwargs)
        self._tables: dict[str, tuple[float, list[tuple[str, str, str]], str | None]] = {}
        self._no_ack_queues: set[str] = set()

    # -- databases (one without a shard map) ----------------------------------------------
    def backend_of(self, queue: str) -> Backend:
        """The backend of ``queue``'s database."""
        shards = self.shards
        return self.backend if shards is None else shards.backend_of(queue)

    def backend_at(self, shard: int) -> Backend | None:
        """The backend of a delivery tag's database (None: not one of this channel's)."""
        shards = self.shards
        if shards is None:
            return self.backend if shard == 0 else None
        return shards.backend_at(shard)

    def on_queue(self, queue: str, fn: Callable[[Backend], Any]) -> Any:
        """``fn(backend)`` on ``queue``'s database: a shard that cannot be reached raises
        ShardUnavailable (PGJ-113) and touches no other database (sharding.py)."""
        shards = self.shards
        if shards is None:
            return fn(self.backend)
        return shards.run(shards.index_of(queue), fn)

    # -- publish -------------------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.on_queue(queue, lambda backend: backend.publish(job_from_message(
            queue, message, max_bytes=backend.options.max_message_bytes)))

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        job = job_from_message(exchange, message,
                               max_bytes=self.backend.options.max_message_bytes)
        revoked = revoked_task_ids(exchange, message)
        shards = self.shards
        queues = {q for _, _, q in self.get_table(exchange)} if shards is not None else ()
        if shards is not None and any(shards.index_of(q) for q in queues):
            # Bound queues on several databases: one publish per queue, on its database
            # (not atomic across databases: see docs/sharding.md). A shard that is down
            # keeps no other database's copy from being written; its error is raised after.
            down: ShardUnavailable | None = None
            for queue in sorted(queues):
                try:
                    self._put(queue, message)
                except ShardUnavailable as exc:
                    down = down or exc
            if down is not None:
                raise down
        else:
            fanout = lambda c: self.backend.core.publish_fanout(c, exchange, job)  # noqa: E731
            if not self.backend.in_caller_transaction(fanout):
                self.backend.publishing(fanout)
        if revoked:  # Celery's revoke broadcast: its waiting (ETA) rows go for good
            def revoke(b: Backend) -> Any:
                return b.publishing(lambda c: b.core.revoke(c, revoked))

            for index, backend in enumerate(shards.backends if shards is not None
                                            else [self.backend]):
                try:
                    gone = revoke(backend) if shards is None else shards.run(index, revoke)
                except ShardUnavailable as exc:
                    # The broadcast is out (workers discard the task); the shard's delayed
                    # rows of it wait until they are due, and the revoke is not kept there.
                    log_unavailable("revoke not applied to the shard's delayed messages", exc,
                                    tasks=len(revoked))
                    continue
                except PermissionDenied as exc:
                    # A publisher role may not delete rows: the broadcast is out (workers
                    # discard the task), the delayed rows wait until they are due.
                    log_event("pgjobs.revoke.refused", code=exc.code, tasks=len(revoked),
                              error=one_line(exc))
                    continue
                for job_id, queue in gone:
                    log_event("pgjobs.revoke.deleted", logging.INFO, job_id=job_id,
                              queue=queue)

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        validate_exchange_name(exchange)
        validate_routing_key(routing_key)
        if exchange and exchange not in self.state.exchanges:
            self._remote_type(exchange)
        return super().basic_publish(message, exchange, routing_key, **kwargs)

    def exchange_declare(self, exchange: str | None = None, *args: Any, **kwargs: Any) -> Any:
        if exchange is not None:
            validate_exchange_name(exchange)
        return super().exchange_declare(exchange, *args, **kwargs)

    # -- routing -------------------------------------------------------------------------
    def _remote_table(self, exchange: str) -> tuple[list[tuple[str, str, str]], str | None]:
        now = time.monotonic()
        hit = self._tables.get(exchange)
        if hit and now - hit[0] < self._table_cache_ttl:
            return hit[1], hit[2]
        table, kind = self.backend.publishing(
            lambda c: self.backend.core.binding_table(c, exchange))
        self._tables[exchange] = (now, table, kind)
        return table, kind

    def _remote_type(self, exchange: str) -> None:
        """Learn an exchange declared by another process (its type) from its bindings."""
        _, kind = self._remote_table(exchange)
        if kind:
            self.state.exchanges.setdefault(exchange, {
                "type": kind, "durable": True, "auto_delete": False, "arguments": {},
                "table": []})

    def get_table(self, exchange: str) -> list[tuple[str, str, str]]:
        table, _ = self._remote_table(exchange)
        return table

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        found = super()._lookup(exchange, routing_key, default)
        if not found or found == [default]:
            # A binding made by another process within the cache TTL: look again, fresh.
            self._tables.pop(exchange, None)
            found = super()._lookup(exchange, routing_key, default)
        return found

    def _queue_bind(self, exchange: str, routing_key: str, pattern: str, queue: str) -> None:
        validate_exchange_name(exchange)
        validate_routing_key(routing_key)
        ex_type = self.state.exchanges.get(exchange, {}).get("type", "direct")
        self.backend.publishing(lambda c: self.backend.core.bind(
            c, exchange, ex_type, routing_key, pattern, queue))
        self._tables.pop(exchange, None)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        self.state.binding_delete(queue, exchange, routing_key)
        if exchange:
            self.backend.publishing(
                lambda c: self.backend.core.unbind(c, exchange, routing_key, queue))
            self._tables.pop(exchange, None)

    # -- queues --------------------------------------------------------------------------
    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> dict[str, Any]:
        """kombu's ``expires``/``message_ttl``/``max_priority`` become RabbitMQ arguments."""
        return to_rabbitmq_queue_arguments(arguments, **kwargs)

    def queue_declare(self, queue: str | None = None, passive: bool = False,
                      **kwargs: Any) -> Any:
        """kombu's. A queue on a shard that is down is declared when the shard is back (a
        consumer starting meanwhile starts), its message count unknown meanwhile (0); a
        passive declare asks the shard and raises ShardUnavailable (sharding.py)."""
        shards = self.shards
        if shards is None or passive or not queue or not shards.index_of(queue):
            return super().queue_declare(queue, passive, **kwargs)
        size = 0
        if self._declare(queue, **kwargs):
            try:
                size = self._size(queue)
            except ShardUnavailable:  # down since, just now
                pass
        return queue_declare_ok_t(queue, size, 0)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        self._declare(queue, **kwargs)

    def _declare(self, queue: str, **kwargs: Any) -> bool:
        """Declare ``queue`` on its database; False: its shard is down and keeps the
        declaration until it is back (sharding.py)."""
        validate_queue_name(queue)
        args = queue_arguments(queue, kwargs.get("arguments"))

        def declare(backend: Backend) -> None:
            backend.publishing(lambda c: backend.core.declare_queue(
                c, queue, expires_ms=args.expires_ms, message_ttl_ms=args.message_ttl_ms,
                max_priority=args.max_priority, auto_delete=bool(kwargs.get("auto_delete"))))

        shards = self.shards
        if shards is None:
            declare(self.backend)
            return True
        return shards.declare(shards.index_of(queue), queue, declare)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self.on_queue(queue, lambda backend: backend.publishing(
            lambda c: backend.core.queue_exists(c, queue))))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        backend = self.backend_of(queue)
        self.on_queue(queue, lambda b: b.publishing(lambda c: b.core.delete_queue(c, queue)))
        if backend is not self.backend:  # its bindings are on the default database
            self.backend.publishing(lambda c: self.backend.core.delete_queue(c, queue))

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        if if_empty and self._size(queue):
            return
        self._delete(queue)
        self.state.queue_bindings_delete(queue)
        self._tables.clear()

    def _purge(self, queue: str) -> int:
        return int(self.on_queue(queue, lambda backend: backend.publishing(
            lambda c: backend.core.purge(c, queue))))

    def _size(self, queue: str) -> int:
        return int(self.on_queue(queue, lambda backend: backend.publishing(
            lambda c: backend.core.size(c, queue))))

    # -- consume -------------------------------------------------------------------------
    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Claim exactly one message; with ``no_ack`` it is settled as soon as it is taken."""
        rows = self.connection.claim_for(self, [queue], 1, no_ack=no_ack)
        if not rows:
            return None
        try:
            message = self.Message(self.connection.to_message(
                rows[0], self.connection.shard_index(queue)), channel=self)
        except Exception as exc:  # not a kombu message: dead-lettered, never held
            self.backend_of(queue).bury_malformed([(rows[0], f"{type(exc).__name__}: {exc}")])
            return None
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str,
                      **kwargs: Any) -> Any:
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        if no_ack:  # remote control, event receivers: delivered means settled
            self._no_ack_queues.add(queue)
        self.backend_of(queue).consume([queue], +1)
        self.connection.consumer.mark_dirty([queue])
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None:
            self.backend_of(queue).consume([queue], -1)
            self._no_ack_queues.discard(queue)
        if not self._consumers and self.connection is not None:
            if not any(ch._consumers for ch in self.connection.channels if ch is not self):
                self.connection.consumer.stop_listening()
        return result

    def settle(self, pairs: list[tuple[int, int]], *, requeue: bool, uncount: bool,
               shard: int = 0) -> None:
        """Fenced reject: requeue (to ready) or bury (to the dead-letter table), on the
        database of the tags' ``shard``; see :meth:`Backend.settle` for what happens when the
        database cannot be reached."""
        backend = self.backend_at(shard)
        if backend is not None:
            backend.settle(pairs, requeue=requeue, uncount=uncount)

    def close(self) -> None:
        if not self.closed and self.connection is not None:
            self.closing = True
            self.connection.consumer.channel_closing(self)
            # Flush buffered acks before unacked messages are restored (what fails stays
            # buffered: the keeper retries it, and so does the exit hook).
            for backend in self.shards.backends if self.shards else [self.backend]:
                backend.flush_pending()
        super().close()


class Transport(virtual.Transport):
    Channel = Channel

    driver_type = "postgresql"
    driver_name = "psycopg"
    default_port = 5432
    polling_interval = 1.0

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = (
        *virtual.Transport.connection_errors,
        DatabaseUnavailable,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )
    channel_errors = (*virtual.Transport.channel_errors, PgJobsError, psycopg.DatabaseError)
    #: What kombu's ``ensure`` (Celery's publish retry) retries on a new connection: an
    #: unreachable database and database errors. A coded refusal (a bad message, a tenant over
    #: its queue cap, a bad idempotency key) is the publisher's mistake, raised at once as
    #: itself: retried, it would fail the same way after the retry policy's sleeps, and reach
    #: Celery's caller wrapped in kombu's OperationalError instead of its code. (kombu falls
    #: back to every connection and channel error when a transport does not say.)
    recoverable_connection_errors = (
        *connection_errors,
        *(e for e in channel_errors if e is not PgJobsError),
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = TransportOptions.parse(client.transport_options)
        super().__init__(client, **kwargs)
        if "polling_interval" not in client.transport_options:
            self.polling_interval = self.options.polling_interval
        #: the claim connection, LISTEN, waits and Celery's event loop (consumer.py); with a
        #: shard map, one loop per database (sharding.py), the map checked now (at connect)
        self.shards: Shards | None = None
        self.consumer: ConsumerLoop | ShardedConsumer
        if self.options.shards is None:
            self.consumer = ConsumerLoop(self)
        else:
            c = client
            self.shards = Shards(self.backend, self.options.shards, user=c.userid,
                                 password=c.password, ssl=c.ssl)
            self.consumer = ShardedConsumer(self, self.shards)
        if not self.options.event_loop:
            self.implements = virtual.Transport.implements.extend(
                exchange_type=frozenset(["direct", "topic", "fanout"]), heartbeats=False,
                asynchronous=False)

    def driver_version(self) -> str:
        return psycopg.__version__

    @property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": None}

    @cached_property
    def backend(self) -> Backend:
        c = self.client
        # several hosts (pgjobs://app@db1:5432,db2:5432/db) arrive whole as the hostname, ports
        # included (see _alias.py); kombu's port then applies to hosts that give none
        hosts = host_list(c.hostname) if c.hostname and "," in c.hostname else \
            ((c.hostname, None),) if c.hostname else ()
        conninfo = conninfo_from_parts(
            host=",".join(h for h, _ in hosts) or None,
            port=",".join(str(p or c.port or self.default_port) for _, p in hosts) or c.port,
            user=c.userid, password=c.password, dbname=c.virtual_host, options=self.options,
            ssl=c.ssl)
        return backend_for(conninfo, self.options)

    def establish_connection(self) -> Any:
        # connect (and migrate) the default database now: fail early. A shard map's other
        # databases connect on first use: a shard that is down fails its own queues' work,
        # never the connection (sharding.py)
        self.backend.publishing(lambda conn: None)
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            self.consumer.close()

    def shard_index(self, queue: str) -> int:
        """The database of ``queue``: 0 (the default) without a shard map."""
        return 0 if self.shards is None else self.shards.index_of(queue)

    def to_message(self, row: Claimed, shard: int = 0) -> dict[str, Any]:
        """The kombu message of a row claimed on database ``shard``; ValueError when the
        stored text is not one (the consumer loop dead-letters such a row)."""
        message = json.loads(row.message)
        props = message.get("properties") if isinstance(message, dict) else None
        if not isinstance(props, dict):
            raise ValueError("the stored message is not a kombu message (a JSON object "
                             "with a properties object)")
        encoding = props.get("body_encoding")
        if encoding is not None and encoding not in self.Channel.codecs:
            raise ValueError(f"the stored message's body_encoding {encoding!r} is unknown")
        props["delivery_tag"] = make_tag(row.id, row.claim, shard)
        if settle_listeners:  # headers for whoever is told of the settle (celery_ext)
            backend = self.backend if shard == 0 or self.shards is None else \
                self.shards.backends[shard]
            backend.note_delivery(row.id, row.claim, message.get("headers"))
        if row.claim > 1:  # where kombu and Celery look for it
            info = props.get("delivery_info")
            if not isinstance(info, dict):
                info = props["delivery_info"] = {}
            info["redelivered"] = True
        return message

    # -- the consumer loop (consumer.py) ---------------------------------------------------
    def poke(self) -> None:
        self.consumer.poke()

    def claim_for(self, channel: Channel, queues: list[str], n: int, *,
                  no_ack: bool = False) -> list[Claimed]:
        return self.consumer.claim_for(channel, queues, n, no_ack=no_ack)

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        self.consumer.drain_events(timeout)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.consumer.register_with_event_loop(loop)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self.consumer.unregister_from_event_loop(loop)
