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
* ``drain_events`` claims up to the channel's free prefetch window in ONE statement that also
  deletes the acks buffered since the last claim (fenced), and delivers every claimed row.
* It refills at a low-water mark (half the window), not per freed slot, and never sleeps a
  polling interval while work waits: it blocks in ``select()`` on the claim connection's socket
  (which LISTENs) and on a self-pipe that acks poke.
* An ack is buffered (thread-safe, non-blocking) and flushed within ``ack_flush_interval`` by
  the consumer thread, or folded into the next claim. A crash before the flush re-delivers the
  message after its lease lapses; nothing acked-and-flushed is ever re-delivered.
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from collections.abc import Iterable
from typing import Any

import psycopg
from kombu.transport import virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.utils.objects import cached_property
from psycopg import sql

from .backend import Backend, backend_for
from .core import Claimed, ClaimResult, Pair, job_from_message
from .database import conninfo_from_parts
from .errors import DatabaseUnavailable, InvalidName, PgJobsError
from .inflight import SUPPORTED, InFlight
from .options import TransportOptions, validate_queue_name

__all__ = ["Channel", "QoS", "Transport", "parse_tag"]

log = logging.getLogger("kombu_pgjobs")


def make_tag(job_id: int, claim: int) -> str:
    return f"{job_id}.{claim}"


def parse_tag(tag: Any) -> tuple[int, int] | None:
    """Delivery tags carry ``(id, claim)``; anything else is not ours (None)."""
    try:
        job_id, claim = str(tag).split(".", 1)
        return int(job_id), int(claim)
    except ValueError:
        return None


def refill_mark(window: int) -> int:
    """Free slots at which a channel with a prefetch window claims again: half the window."""
    return max(1, window // 2)


class QoS(virtual.QoS):
    """Acks are buffered in the backend and flushed fenced; rejects settle at once."""

    channel: Channel

    def ack(self, delivery_tag: Any) -> None:
        pair = parse_tag(delivery_tag)
        if pair is not None:
            self.channel.backend.buffer_ack(*pair)
        super().ack(delivery_tag)
        window = self.prefetch_count
        if window and self.can_consume_max_estimate() == refill_mark(window):
            # The window just reopened enough to refill: wake the consumer now rather than
            # when the buffered acks fall due (only the first ack of a batch pokes otherwise).
            self.channel.connection.poke()

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        pair = parse_tag(delivery_tag)
        if pair is not None:
            self.channel.settle([pair], requeue=requeue, uncount=False)
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Hand unacked (prefetched, unstarted) messages back at once, without an attempt."""
        self._flush()
        pairs = [p for p in (parse_tag(t) for t in self._delivered) if p is not None]
        self._delivered.clear()
        if pairs:
            try:
                self.channel.settle(pairs, requeue=True, uncount=True)
            except Exception as exc:  # the lease will lapse and rescue them anyway
                log.warning("pgjobs.restore.failed %s", exc, extra={"action": "restore"})
                return [(exc, None)]
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
        super().__init__(connection, **kwargs)
        self._tables: dict[str, tuple[float, list[tuple[str, str, str]], str | None]] = {}
        self._no_ack_queues: set[str] = set()

    @property
    def backend(self) -> Backend:
        return self.connection.backend

    # -- publish -------------------------------------------------------------------------
    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        self.backend.publish(job_from_message(queue, message))

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        job = job_from_message(exchange, message)
        self.backend.publishing(lambda c: self.backend.core.publish_fanout(c, exchange, job))

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        if exchange and exchange not in self.state.exchanges:
            self._remote_type(exchange)
        return super().basic_publish(message, exchange, routing_key, **kwargs)

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

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        args = kwargs.get("arguments") or {}

        def ms(key: str) -> int | None:
            value = args.get(key)
            if value is None:
                return None
            try:
                number = int(value)
            except (TypeError, ValueError):
                raise InvalidName(f"queue {queue!r}: {key} must be milliseconds") from None
            if number <= 0:
                raise InvalidName(f"queue {queue!r}: {key} must be positive, got {value!r}")
            return number

        expires, ttl, max_priority = ms("x-expires"), ms("x-message-ttl"), ms("x-max-priority")
        validate_queue_name(queue)
        self.backend.publishing(lambda c: self.backend.core.declare_queue(
            c, queue, expires_ms=expires, message_ttl_ms=ttl, max_priority=max_priority,
            auto_delete=bool(kwargs.get("auto_delete"))))

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return bool(self.backend.publishing(lambda c: self.backend.core.queue_exists(c, queue)))

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.backend.publishing(lambda c: self.backend.core.delete_queue(c, queue))

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        if if_empty and self._size(queue):
            return
        self._delete(queue)
        self.state.queue_bindings_delete(queue)
        self._tables.clear()

    def _purge(self, queue: str) -> int:
        return int(self.backend.publishing(lambda c: self.backend.core.purge(c, queue)))

    def _size(self, queue: str) -> int:
        return int(self.backend.publishing(lambda c: self.backend.core.size(c, queue)))

    # -- consume -------------------------------------------------------------------------
    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        """Claim exactly one message; with ``no_ack`` it is settled as soon as it is taken."""
        rows = self.connection.claim_for(self, [queue], 1, no_ack=no_ack)
        if not rows:
            return None
        message = self.Message(self.connection.to_message(rows[0]), channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
        return message

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str,
                      **kwargs: Any) -> Any:
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        if no_ack:  # remote control, event receivers: delivered means settled
            self._no_ack_queues.add(queue)
        self.backend.consume([queue], +1)
        self.connection.mark_dirty([queue])
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None:
            self.backend.consume([queue], -1)
            self._no_ack_queues.discard(queue)
        return result

    def settle(self, pairs: list[tuple[int, int]], *, requeue: bool, uncount: bool) -> None:
        """Fenced reject: requeue (to ready) or bury (to the dead-letter table)."""
        backend = self.backend
        if requeue:
            hit = backend.publishing(
                lambda c: backend.core.requeue(c, pairs, uncount=uncount))
        else:
            hit = backend.publishing(lambda c: backend.core.bury(c, pairs, reason="rejected"))
        backend.settled(pairs, hit, "requeue" if requeue else "reject")

    def close(self) -> None:
        if not self.closed and self.connection is not None:
            self.closing = True
            try:
                self.connection.channel_closing(self)
            except Exception as exc:  # their leases lapse and they come back
                log.warning("pgjobs.claim.failed %s", exc, extra={"action": "close"})
            # Flush buffered acks before unacked messages are restored.
            try:
                self.backend.publishing(self.backend.flush_acks)
            except Exception as exc:
                log.warning("pgjobs.ack.flush_failed %s", exc, extra={"action": "close"})
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

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = TransportOptions.parse(client.transport_options)
        super().__init__(client, **kwargs)
        if "polling_interval" not in client.transport_options:
            self.polling_interval = self.options.polling_interval
        self._conn: psycopg.Connection[Any] | None = None
        self._conn_lock = threading.RLock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._dirty: set[str] = set()
        self._again = False  # a claim held rows back by a limit: claim again at once
        self._due_at: float | None = None
        self._next_poll = 0.0
        self._listening = False
        self._registered = False
        # Celery's event loop (kombu Hub), when the worker runs one: see register_with_event_loop
        self._hub: Any = None
        self._hub_fds: list[int] = []
        self._hub_timer: Any = None
        self._hub_timer_at = 0.0
        self._hub_conn: psycopg.Connection[Any] | None = None  # whose socket the hub watches
        # A claim sent from the hub whose result is not read yet: (InFlight, channel, queues,
        # acks). The claim connection does nothing else meanwhile.
        self._inflight: tuple[InFlight, Channel, list[str], list[Pair]] | None = None
        self._async_claims = False
        self._next_channel = 0  # where the next pump starts among the channels (round robin)
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
        conninfo = conninfo_from_parts(
            host=c.hostname, port=c.port, user=c.userid, password=c.password,
            dbname=c.virtual_host, options=self.options)
        return backend_for(conninfo, self.options)

    def establish_connection(self) -> Any:
        self.backend.publishing(lambda conn: None)  # connect (and migrate) now: fail early
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            if self._registered:
                self.backend.remove_ack_listener(self.poke)
                self._registered = False
            with self._conn_lock:
                if self._inflight is not None:
                    # Its claim's rows come back when their leases lapse; its acks go with
                    # the next flush (fenced: a retry can only miss).
                    self.backend.restore_acks(self._inflight[3])
                    self._inflight = None
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1

    # -- the claim connection (also the LISTEN session) ----------------------------------
    def _claim_conn(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is None or conn.closed:
            conn = self._conn = self.backend.connect(hot=True)
            self._listening = False
            if self.options.use_listen_notify:
                conn.add_notify_handler(lambda n: self._dirty.add(n.payload))
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.backend.core.channel)))
                self._listening = True
            # A claim sent from the hub is read when this socket turns readable: LISTEN has
            # the socket registered with the hub (see _hub_rearm).
            self._async_claims = self._listening and SUPPORTED
            self._dirty.update(self._callbacks)  # anything may have arrived meanwhile
        if not self._registered:
            self.backend.add_ack_listener(self.poke)
            self._registered = True
        return conn

    def poke(self) -> None:
        """Wake the consumer loop (thread-safe: a byte on the self-pipe)."""
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass

    def mark_dirty(self, queues: Iterable[str]) -> None:
        self._dirty.update(queues)

    def to_message(self, row: Claimed) -> dict[str, Any]:
        message: dict[str, Any] = json.loads(row.message)
        props = message.setdefault("properties", {})
        props["delivery_tag"] = make_tag(row.id, row.claim)
        if row.claim > 1:  # where kombu and Celery look for it
            props.setdefault("delivery_info", {})["redelivered"] = True
        return message

    def claim_for(self, channel: Channel, queues: list[str], n: int, *,
                  no_ack: bool = False) -> list[Claimed]:
        """Claim up to ``n`` for ``channel`` and wait for the rows (acks ride along)."""
        backend = self.backend
        with self._conn_lock:
            self._finish_inflight()
            conn = self._claim_conn()
            # Clear before the claim: a NOTIFY read together with its result re-marks the
            # queue (notify handler), and must not be erased by a clear that comes after.
            self._dirty.difference_update(queues)
            acks = backend.take_acks()
            try:
                result = backend.core.claim(conn, queues, n, acks)
            except BaseException:
                self._claim_failed(queues, acks)
                raise
            return self._claimed(channel, queues, acks, result, no_ack=no_ack)

    def _start_claim(self, channel: Channel, queues: list[str], n: int) -> None:
        """Send a claim from Celery's event loop and return; :meth:`_poll_inflight` reads it."""
        backend = self.backend
        with self._conn_lock:
            conn = self._claim_conn()
            self._dirty.difference_update(queues)
            acks = backend.take_acks()
            try:
                query, params = backend.core.claim_statement(queues, n, acks)
                self._inflight = (InFlight(conn, query, params), channel, queues, acks)
            except BaseException:
                self._claim_failed(queues, acks, abandoned=True)
                raise

    def _poll_inflight(self, *, block: bool = False) -> list[Claimed]:
        """Read the claim in flight if its result is in (or wait for it): deliverable rows."""
        if self._inflight is None:
            return []
        with self._conn_lock:
            if self._inflight is None:
                return []
            pending, channel, queues, acks = self._inflight
            try:
                if not (pending.wait() if block else pending.poll()):
                    return []
                self._inflight = None
                result = self.backend.core.claim_result(pending.rows())
            except BaseException:
                self._inflight = None
                self._claim_failed(queues, acks, abandoned=not pending.done)
                raise
            rows = self._claimed(channel, queues, acks, result, no_ack=False)
        closed = channel.closed or channel.closing or not channel._consumers
        orphans = [r for r in rows if closed or r.queue not in self._callbacks]
        if orphans:
            rows = [r for r in rows if not closed and r.queue in self._callbacks]
            # Their consumer went away while the claim was in flight: hand them back unstarted
            # (no attempt counted), and stop renewing them whatever happens.
            pairs = [(r.id, r.claim) for r in orphans]
            try:
                channel.settle(pairs, requeue=True, uncount=True)
            finally:
                self.backend.forget(pairs)
        return rows

    def _finish_inflight(self) -> None:
        """Before any other use of the claim connection: complete the claim in flight and
        deliver what it took."""
        self._deliver_rows(self._poll_inflight(block=True))

    def _deliver_rows(self, rows: list[Claimed]) -> int:
        for row in rows:
            self._deliver(self.to_message(row), row.queue)
        return len(rows)

    def channel_closing(self, channel: Channel) -> None:
        """A claim in flight for a closing channel: wait for it and hand its rows back."""
        with self._conn_lock:
            inflight = self._inflight
            if inflight is not None and inflight[1] is channel:
                self._poll_inflight(block=True)

    def _claim_failed(self, queues: list[str], acks: list[Pair], *,
                      abandoned: bool = False) -> None:
        self.backend.restore_acks(acks)
        self._dirty.update(queues)
        self._drop_if_broken(abandoned=abandoned)

    def _drop_if_broken(self, *, abandoned: bool = False) -> None:
        """Close and forget a claim connection that broke, or (``abandoned``) whose statement
        was left unfinished: the next use reconnects (and re-LISTENs)."""
        conn = self._conn
        if conn is not None and (abandoned or conn.closed or conn.broken):
            self._conn = None
            conn.close()

    def _claimed(self, channel: Channel, queues: list[str], acks: list[Pair],
                 result: ClaimResult, *, no_ack: bool) -> list[Claimed]:
        """Account for a claim's result: settled acks, held leases, what to claim next."""
        backend = self.backend
        hit = result.acked
        if result.unsettled:  # a key's lock was busy: settle them now, waiting
            try:
                hit = hit | backend.core.ack(self._claim_conn(), result.unsettled)
            except psycopg.Error as exc:
                # The claim itself committed: deliver what it took, and let the next flush
                # retry these acks (fenced, so a retry can only miss, never double-settle).
                log.warning("pgjobs.ack.flush_failed %s", exc, extra={"action": "ack"})
                backend.restore_acks(result.unsettled)
                acks = [p for p in acks if p not in result.unsettled]
                self._drop_if_broken()
        if acks:
            backend.settled(acks, hit, "ack")
        if result.claimed:
            held = []
            for r in result.claimed:
                if no_ack or r.queue in channel._no_ack_queues:
                    backend.buffer_ack(r.id, r.claim)  # settled once delivered
                else:
                    held.append((r.id, r.claim))
            if held:
                backend.hold(held)
        if any(h.verdict != "busy" for h in result.held_back):
            # A limit parked, deferred or refused candidates: they left the claim's index, so
            # the next claim reaches the rows behind them. Claim again now.
            self._again = True
        elif result.held_back:
            # Only keys another claim is changing right now: try again very soon, not at once.
            soon = time.monotonic() + 0.005
            if self._due_at is None or soon < self._due_at:
                self._due_at = soon
        if not result.drained:
            self._dirty.update(queues)  # more may be waiting
        else:
            if result.due_in is not None:
                due = time.monotonic() + max(result.due_in, 0.0)
                if self._due_at is None or due < self._due_at:
                    self._due_at = due
        return result.claimed

    # -- the consumer loop ---------------------------------------------------------------
    def _pump(self, *, on_hub: bool = False) -> int:
        """Claim and deliver for every channel whose window is open enough; flush acks.
        ``on_hub``: a claim is sent and left in flight (one at a time); its rows are delivered
        when its result comes in, by a later call."""
        delivered = 0
        self._again = False
        if on_hub:
            delivered += self._deliver_rows(self._poll_inflight())
            if self._inflight is not None:
                return delivered  # the claim connection is busy until its result is read
        now = time.monotonic()
        if now >= self._next_poll:
            self._dirty.update(self._callbacks)
            self._next_poll = now + (self.options.idle_poll_interval if self._listening
                                     else self.polling_interval)
        if self._due_at is not None and now >= self._due_at:
            self._due_at = None
            self._dirty.update(self._callbacks)
        age = self.backend.oldest_ack_age()
        acks_due = age is not None and age >= self.options.ack_flush_interval
        channels = list(self.channels)
        first = self._next_channel % len(channels) if channels else 0
        for index, channel in enumerate(channels[first:] + channels[:first], first):
            if not channel._consumers or channel.closed:
                continue
            queues = [q for q in channel._active_queues if q in self._dirty]
            if not queues:
                continue
            qos = channel.qos
            free = qos.can_consume_max_estimate()
            if free is None:
                free = self.options.max_claim
            if free <= 0:
                continue
            window = qos.prefetch_count or free
            unacked = len(qos._delivered) - len(qos._dirty)
            if free < refill_mark(window) and unacked > 0 and not acks_due:
                # Refill at the low-water mark, not per freed slot; but acks that are due
                # ride on a claim (which also refills) rather than on a statement of their own.
                continue
            n = min(free, self.options.max_claim)
            acks_due = False
            if on_hub and self._async_claims:
                self._start_claim(channel, queues, n)
                # One claim in flight: the next pump starts with the next channel, so a busy
                # task queue cannot starve Celery's remote-control channel.
                self._next_channel = index + 1
                return delivered
            delivered += self._deliver_rows(self.claim_for(channel, queues, n))
        if acks_due:  # nothing to claim (and no claim in flight): the acks go alone
            with self._conn_lock:
                self.backend.flush_acks(self._claim_conn())
        return delivered

    def _wait(self, timeout: float) -> None:
        conn = self._claim_conn()
        fds = [self._wake_r]
        if self._listening:
            fds.append(conn.fileno())
        try:
            select.select(fds, [], [], max(timeout, 0.0))
        except InterruptedError:  # pragma: no cover
            return
        self._read_wakeups()

    def _read_wakeups(self) -> None:
        """Empty the self-pipe and take pending notifications (never blocks)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        conn = self._conn
        if self._listening and conn is not None and not conn.closed:
            with self._conn_lock:
                pg = conn.pgconn
                pg.consume_input()
                while (n := pg.notifies()) is not None:
                    self._dirty.add(n.extra.decode("utf-8", "replace"))

    def _wait_budget(self, now: float) -> float:
        """Seconds until something is due: a poll, an ETA, an ack flush."""
        wait = self._next_poll - now
        if self._due_at is not None:
            wait = min(wait, self._due_at - now)
        age = self.backend.oldest_ack_age()
        if age is not None and self._inflight is None:  # a claim's result wakes us anyway
            wait = min(wait, self.options.ack_flush_interval - age)
        if self._dirty and any(ch._consumers for ch in self.channels):
            # Work may be waiting but the window is closed: an ack pokes us; check anyway.
            wait = min(wait, 1.0)
        return max(wait, 0.0)

    # -- Celery's event loop (asynloop): readers on the LISTEN socket and the self-pipe ----
    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._hub = loop
        with self._conn_lock:
            self._claim_conn()
        self._hub_rearm()
        loop.call_soon(self._on_hub_event)

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        for fd in self._hub_fds:
            loop.remove_reader(fd)
        self._hub_fds = []
        if self._hub_timer is not None:
            self._hub_timer.cancel()
            self._hub_timer = None
        self._hub = None

    def _hub_rearm(self) -> None:
        """(Re)register readers: the claim connection's socket changes on reconnect."""
        hub = self._hub
        fds = [self._wake_r]
        if self._listening and self._conn is not None:
            fds.append(self._conn.fileno())
        if not self._hub_fds or self._conn is not self._hub_conn:
            # By connection, not fd number: a new socket may get a closed one's number.
            self._hub_conn = self._conn
            for fd in self._hub_fds:
                hub.remove_reader(fd)
            for fd in fds:
                hub.add_reader(fd, self._on_hub_event)
            self._hub_fds = fds

    def _on_hub_event(self, *args: Any) -> None:
        hub = self._hub
        if hub is None:
            return
        self._read_wakeups()
        delivered = self._pump(on_hub=True)
        self._hub_rearm()
        if delivered or self._again:
            hub.call_soon(self._on_hub_event)  # more may be waiting: keep draining
            return
        now = time.monotonic()
        # At most a second: Celery's warm shutdown is a flag its loop checks between events.
        at = now + min(self._wait_budget(now), 1.0)
        if self._hub_timer is None or at < self._hub_timer_at or self._hub_timer_at <= now:
            if self._hub_timer is not None:
                self._hub_timer.cancel()
            self._hub_timer = hub.call_later(max(at - now, 0.0), self._on_hub_event)
            self._hub_timer_at = at

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._pump():
                return
            if self._again:
                continue
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError()
            wait = self._wait_budget(now)
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._wait(wait)
