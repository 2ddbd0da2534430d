"""The consumer loop of one kombu connection: its claim connection, LISTEN, and what each
connection state means for the work it holds.

One :class:`ConsumerLoop` per kombu :class:`~kombu_pgjobs.broker.transport.Transport`. It claims for
the channels of that connection, delivers what it claimed, folds buffered acks into its claims, and
waits — in ``drain_events`` (Celery's synchronous loop, plain kombu) or as readers and timers in
Celery's event loop (the kombu Hub).

States of the claim connection, and what each transition does to held, buffered and in-flight
work (the only place that decides it is :meth:`ConsumerLoop._broken` and :meth:`close`):

``disconnected``
    No claim connection. The next claim opens one (and LISTENs once the connection consumes).
``connected``
    Idle or claiming synchronously.
``in_flight``
    A claim was sent from the Hub and its result is not read yet; nothing else may use the
    connection. Its rows are delivered when the result comes in; a channel that closes
    meanwhile hands its rows back unstarted (no attempt counted).
``broken``
    A statement or the connection failed. A connection that is gone, or that a statement was
    left unfinished on, is closed (its Hub reader removed first: a new socket may reuse the
    number); one whose statement merely failed is kept. The acks an in-flight claim carried
    go back to the process's ack buffer (fenced: a retry can only miss, never double-settle);
    its queues are marked for a new claim. **Nothing delivered is handed back**: prefetched
    messages stay with Celery and run, running tasks keep their leases (the keeper renews
    them on its own connection) and their acks reach the buffer whatever happened here. After
    a backoff (0.1 s doubling to 5 s, reset by a claim that works) the next claim reconnects.
    Errors that no retry can clear (a schema newer than the code, a failed migration, a bad
    option) are raised, not retried; a transaction pooler found in front in the default mode
    (:class:`~kombu_pgjobs.errors.PoolerUnsupported`) is raised by every pump after it. A
    broken database connection is therefore not a kombu connection loss: Celery never restarts
    its consumer for it, so it never drops or re-delivers what it holds.
``closed``
    The kombu connection closed: a channel closing with a claim in flight waits for it and
    hands its rows back (:meth:`ConsumerLoop.channel_closing`); at the connection's close an
    in-flight claim's acks go back to the buffer. Hub readers and timers are removed, the
    connection and the self-pipe are closed.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from ..errors import DatabaseTimeout, DatabaseUnavailable, PgJobsError, PoolerUnsupported
from ..events import log_event, one_line
from ..green import pipe_read, pipe_write, wait_readable
from ..store.core import Claimed, ClaimResult, Pair
from ..store.database import PREPARED_STATEMENT_ERRORS, pooler_error
from .inflight import SUPPORTED, InFlight
from .waiting import HAND_OFF, Handed, Ticket, Waits, handed_ids

if TYPE_CHECKING:
    from .backend import Backend
    from .transport import Channel, Transport

__all__ = ["ConsumerLoop", "State", "is_connection_failure", "refill_mark"]

#: the payload admin_cancel sends on the schema's channel (sql/admin.sql): not a queue name
#: (queue names have no control characters), and it names nothing
CANCEL_ANNOUNCED = "\x1d"

log = logging.getLogger("kombu_pgjobs")

#: Seconds after a hand-off before the claim that registers its queue again (_notified).
REARM_DELAY = 0.005

#: Round trips a connection that stops listening waits for the wake-ups of registrations
#: publishes took (ConsumerLoop._await_taken).
TAKEN_READS = 20

#: Reconnect backoff after a failure: first wait, and the most it grows to.
BACKOFF_FIRST = 0.1
BACKOFF_MAX = 5.0


class State(enum.Enum):
    DISCONNECTED = "disconnected"
    CONNECTED = "connected"
    IN_FLIGHT = "in_flight"
    BROKEN = "broken"
    CLOSED = "closed"


def refill_mark(window: int) -> int:
    """Free slots at which a channel with a prefetch window claims again: half the window."""
    return max(1, window // 2)


def is_connection_failure(exc: BaseException, conn: psycopg.Connection[Any] | None) -> bool:
    """Whether ``exc`` means the connection is gone (as opposed to a statement that failed on
    a healthy connection: a lock timeout, a constraint)."""
    if isinstance(exc, DatabaseUnavailable | psycopg.InterfaceError):
        return True
    if isinstance(exc, psycopg.OperationalError):
        return conn is None or conn.closed or conn.broken
    return False


class ConsumerLoop:
    """Claims, deliveries and waits of one kombu connection (see the module docstring)."""

    def __init__(self, transport: Transport, *, backend: Backend | None = None,
                 shard: int = 0, owns: Callable[[str], bool] | None = None) -> None:
        self.transport = transport
        # One database's loop of a sharded transport (sharding.py): its backend, its shard
        # number (carried in delivery tags) and which queues are its own. None: the transport's.
        self._backend = backend
        self.shard = shard
        self.owns = owns
        self.options = transport.options
        self.lock = threading.RLock()
        self.state = State.DISCONNECTED
        self.conn: psycopg.Connection[Any] | None = None
        self.listening = False
        self.waits = Waits()  # the queues this connection is registered as waiting on
        # Messages publishes claimed for this consumer, as wake-ups on its channel named them
        # (never trusted: taken by a fenced statement, then delivered by the next pump; see
        # _deliver_handed).
        self.handed: list[Handed] = []
        # The wake id of a claim connection dropped while it listened: its session may live
        # on at the server (a network cut it has not noticed), its registrations with it.
        self._dropped_waiter: int | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Queues that may have messages: consumed ones only (a name nothing here claims would
        # stay for good, and wake an idle loop every second: wait_budget)
        self.dirty: set[str] = set()
        self.again = False  # a claim held rows back by a limit: claim again at once
        self.handed_delivered = 0  # of the last pump's deliveries, those handed off
        self.woken = False  # a notification came in with a statement's result
        self.due_at: float | None = None
        # when the queues handed a message (Waits.rearm) are claimed, so registered, again:
        # those queues only (the others are still armed: a claim of them is a wasted trip)
        self.rearm_at: float | None = None
        self.next_poll = 0.0
        self._ack_listener = False
        # after a failure: no claim before retry_at; the backoff doubles while failures last
        self.retry_at = 0.0
        self._backoff = 0.0
        # an outage is under way since (monotonic), or 0.0; logged when it starts, every
        # minute while it lasts, and when a claim works again
        self._failing = 0.0
        self._logged_at = 0.0
        self._wake_lock = threading.Lock()  # poke (pool threads) against close
        self._interrupted = False  # interrupt(): the next drain_events returns without waiting
        # Celery's event loop (kombu Hub), when the worker runs one
        self.hub: Any = None
        self._hub_fds: list[int] = []
        self._hub_timer: Any = None
        self._hub_timer_at = 0.0
        self._hub_conn: psycopg.Connection[Any] | None = None  # whose socket the hub watches
        # A claim sent from the Hub whose result is not read yet: (InFlight, channel, queues,
        # acks, wait ticket). The claim connection does nothing else meanwhile.
        self.inflight: tuple[InFlight, Channel, list[str], list[Pair], Ticket | None] | None = None
        self.next_channel = 0  # where the next pump starts among the channels (round robin)
        # A transaction pooler refused this loop's prepared statements: no retry clears it,
        # every pump raises it (Celery's event loop logs and drops what a timer raises).
        self.unsupported: PoolerUnsupported | None = None

    @property
    def backend(self) -> Backend:
        return self._backend if self._backend is not None else self.transport.backend

    def consumed(self) -> Collection[str]:
        """The queues this loop consumes: the transport's, or (a shard's loop) those of them
        on its database."""
        callbacks = self.transport._callbacks
        owns = self.owns
        if owns is None:
            return callbacks
        return {q for q in callbacks if owns(q)}

    # -- the claim connection --------------------------------------------------------------
    def claim_conn(self) -> psycopg.Connection[Any]:
        """The claim connection (under ``lock``), opened on first use or after a failure."""
        conn = self.conn
        if conn is None or conn.closed:
            conn = self.conn = self.backend.connect(hot=True)
            self.state = State.CONNECTED
            self.listening = False
            if self.options.use_listen_notify:
                conn.add_notify_handler(lambda n: self._notified(n.channel, n.payload))
            self.dirty.update(self.consumed())  # anything may have arrived meanwhile
        if not self._ack_listener:
            self.backend.add_ack_listener(self.poke)
            self._ack_listener = True
        return conn

    def _listen(self, want: bool) -> None:
        """LISTEN while this connection consumes, UNLISTEN when it stops: a session that
        listens and never reads holds the server's notification queue (cluster-wide) back.
        Two channels: the schema's (requeues, resumes, released limits wake every consumer)
        and the connection's own wake channel (a publish wakes one registered consumer:
        :mod:`kombu_pgjobs.broker.waiting`), whose wake id's lock the connection holds meanwhile."""
        if want == self.listening or not self.options.use_listen_notify:
            return
        conn = self.claim_conn()
        core = self.backend.core
        channel = sql.Identifier(core.channel)
        if want:
            waiter = self.waits.start()
            # Nothing is registered under a new wake id: claim every queue (a claim that
            # drains registers it), or no publish would wake this connection.
            self.dirty.update(self.consumed())
            core.hold_waiter(conn, waiter)
            if self._dropped_waiter is not None:
                # A half-dead session holds its wake id's lock, so its registrations look
                # alive: each would swallow a hand-off until its lease lapsed. Drop them.
                core.unwait(conn, self._dropped_waiter, release=False)
                self._dropped_waiter = None
            conn.execute(sql.SQL("LISTEN {}").format(channel))
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.waits.channel)))
        else:
            if self.waits.waiter is not None:
                self._await_taken(conn, core.unwait(conn, self.waits.waiter))
            conn.execute(sql.SQL("UNLISTEN *"))
            passed = self.waits.stop()  # wake-ups read meanwhile go to the others
            if passed:
                core.wake_all(conn, sorted(passed))
            self._return_handed()
        self.listening = want

    def _await_taken(self, conn: psycopg.Connection[Any], dropped: Collection[str]) -> None:
        """Before UNLISTEN: a registration this connection had and did not drop itself was
        taken by a publish that committed just now, and its wake-up (maybe a hand-off) is on
        its way; read it (a few round trips at most), or it would be lost with the LISTEN."""
        for _ in range(TAKEN_READS):
            if all(q in dropped for q in self.waits.state):  # each read pops a woken queue
                return
            time.sleep(0.001)
            conn.execute("SELECT 1")  # a round trip: the notifications sent meanwhile come in

    def stop_listening(self) -> None:
        """The connection's last consumer was cancelled (a basic_get caller, a reply
        consumer of ``celery inspect`` done with its replies)."""
        with self.lock:
            if self.listening and self.inflight is None and self.state is not State.BROKEN:
                try:
                    self._listen(False)
                except Exception as exc:
                    self._broken(exc, "unlisten")

    def _consuming(self) -> bool:
        owns = self.owns
        if owns is None:
            return any(ch._consumers and not ch.closed for ch in self.transport.channels)
        return any(owns(q) for ch in self.transport.channels
                   if ch._consumers and not ch.closed for q in ch._active_queues)

    def _drop_conn(self) -> None:
        """Close the claim connection; its Hub reader goes first (by connection: a new
        socket may reuse the number, and the Hub must not lose another reader of it)."""
        conn, self.conn = self.conn, None
        self.listening = False
        if self.waits.waiter is not None:
            self._dropped_waiter = self.waits.waiter
        self.waits.stop()  # the server drops a closed session's registrations' locks
        if conn is None:
            return
        if self.hub is not None and self._hub_conn is conn:
            fd = self._hub_fds[-1] if len(self._hub_fds) > 1 else None
            if fd is not None:
                self.hub.remove_reader(fd)
                self._hub_fds = self._hub_fds[:-1]
            self._hub_conn = None
        try:
            conn.close()
        except Exception:  # pragma: no cover - closing a dead socket
            pass

    def _broken(self, exc: BaseException, action: str) -> None:
        """A claim, a flush or a read failed: the ``broken`` transition (module docstring).
        The connection is dropped when it is gone, or when a statement was left unfinished
        on it; a statement that failed on a healthy connection keeps it. Either way the next
        claim waits for the backoff, which grows until a claim works again."""
        with self.lock:
            abandoned = False
            if self.inflight is not None:
                pending, _, queues, acks, _ = self.inflight
                abandoned = not pending.done
                self.inflight = None
                self.backend.restore_acks(acks)
                self.dirty.update(queues)
            if abandoned or is_connection_failure(exc, self.conn):
                self._drop_conn()
            self.state = State.BROKEN
            self._backoff = min(BACKOFF_MAX, max(BACKOFF_FIRST, self._backoff * 2))
            now = time.monotonic()
            self.retry_at = now + self._backoff
            self.dirty.update(self.consumed())
            if not self._failing or now - self._logged_at >= 60.0:
                self._logged_at = now
                log_event("pgjobs.consumer.broken", action=action,
                          since=f"{now - (self._failing or now):.0f}s",
                          error=one_line(exc))
            self._failing = self._failing or now

    def _recovered(self) -> None:
        """A claim worked: the outage (if any) is over and the backoff starts afresh."""
        self._backoff = 0.0
        if self.state is State.BROKEN:
            self.state = State.CONNECTED
        if self._failing:
            log_event("pgjobs.consumer.reconnected", logging.INFO,
                      after=f"{time.monotonic() - self._failing:.1f}s")
            self._failing = 0.0

    def _may_claim(self) -> bool:
        return self.state is not State.BROKEN or time.monotonic() >= self.retry_at

    # -- wake-ups ---------------------------------------------------------------------------
    def poke(self) -> None:
        """Wake the consumer loop (thread-safe: a byte on the self-pipe)."""
        with self._wake_lock:  # never a closed (and maybe reused) descriptor
            if self._wake_w < 0:
                return
            try:
                pipe_write(self._wake_w, b"x")  # never green: green.py
            except (BlockingIOError, OSError):
                pass

    def interrupt(self) -> None:
        """Make a waiting ``drain_events`` (or the next one) return without waiting more: it
        raises TimeoutError (kombu's "nothing delivered") once and the flag clears. For a
        shutdown: Celery's green loop (synloop) checks its state only between calls to
        ``drain_events(timeout=2.0)``. Thread-safe (a flag and a byte on the self-pipe)."""
        self._interrupted = True
        self.poke()

    def mark_dirty(self, queues: Iterable[str]) -> None:
        self.dirty.update(queues)

    def _notified(self, channel: str, queue: str) -> None:
        """A NOTIFY for ``queue``. One read by psycopg together with a statement's result
        (the release in an ack wakes a parked message and notifies this very session) leaves
        the socket unreadable: :meth:`pump` claims again at once instead of waiting for it.
        On this consumer's own channel the payload may be a hand-off: the ids of a message
        claimed for this consumer, queued for the next pump to take and deliver.

        Any role that can connect may NOTIFY any channel, so nothing here is trusted: a
        wake-up makes the consumer claim (a queue it does not consume is ignored), and a
        hand-off is delivered only if the fenced take reads it back (_deliver_handed)."""
        row: Handed | None = None
        if queue.startswith(CANCEL_ANNOUNCED):
            # An operator cancelled a running message somewhere: the keeper renews now and
            # reads which (a forged one costs a renewal, at most one a second).
            self.backend.renew_soon()
            return
        consumed = self.consumed()
        if queue.startswith(HAND_OFF):
            waiter = self.waits.waiter
            if (waiter is None or channel != self.waits.channel
                    or not self.backend.core.hand_off):
                return  # no registration of ours asked for a message: not a real hand-off
            row = handed_ids(queue, waiter)
            if row is None:
                return  # in no format a publish sends (an older one carried the message)
            queue = row.queue
            if not self.waits.expects(queue, consumed):
                return  # no registration of ours on that queue was ever taken
            self.handed.append(row)
            self.waits.handed(queue)
        elif self.waits.waiter is not None and channel == self.waits.channel:
            if not self.waits.expects(queue, consumed):
                return
            self.waits.woken(queue, consumed)
        elif queue not in consumed:
            return  # the schema's channel: a queue this connection does not consume
        if self.owns is not None and not self.owns(queue):
            return  # a shard's loop claims only the queues the map gives its database
        if row is not None:
            # The claim that registers the queue again waits a moment: sent at once, it takes
            # the database's CPU while the task it just got starts (measured: a prefork
            # child started 2.4 ms after the hand-off, against 1 ms with the claim later).
            at = time.monotonic() + REARM_DELAY
            if self.rearm_at is None or at < self.rearm_at:
                self.rearm_at = at
        elif queue in consumed:  # a dropped registration's wake-up is passed on, not claimed
            self.dirty.add(queue)
        self.woken = True

    def read_wakeups(self) -> None:
        """Empty the self-pipe and take pending notifications (never blocks)."""
        try:
            while pipe_read(self._wake_r, 4096):  # never green: green.py
                pass
        except (BlockingIOError, OSError):
            pass
        conn = self.conn
        if self.listening and conn is not None and not conn.closed and self.inflight is None:
            with self.lock:
                try:
                    pg = conn.pgconn
                    pg.consume_input()
                    while (n := pg.notifies()) is not None:
                        self._notified(n.relname.decode("utf-8", "replace"),
                                       n.extra.decode("utf-8", "replace"))
                except psycopg.Error as exc:
                    self._broken(exc, "listen")

    # -- claims -----------------------------------------------------------------------------
    def claim_for(self, channel: Channel, queues: list[str], n: int, *,
                  no_ack: bool = False) -> list[Claimed]:
        """Claim up to ``n`` for ``channel`` and wait for the rows (acks ride along). A
        connection found dead is replaced once: a claim that never reached the server is
        safe to send again, and one that did leaves rows that come back at lease expiry."""
        backend = self.backend
        with self.lock:
            self.finish_inflight()
            for attempt in (1, 2):
                conn = self.claim_conn()
                # Clear before the claim: a NOTIFY read together with its result re-marks
                # the queue (notify handler) and must not be erased by a later clear.
                self.dirty.difference_update(queues)
                acks = backend.take_acks()
                ticket = self.waits.ticket(queues, self.consumed())
                try:
                    result = backend.core.claim(conn, queues, n, acks,
                                                ticket and ticket.plan)
                except BaseException as exc:
                    # (a lock or statement timeout arrives as DatabaseTimeout, a channel
                    # error: the connection's cursor translates it)
                    backend.restore_acks(acks)
                    self.dirty.update(queues)
                    if not isinstance(exc, Exception) or is_connection_failure(exc, conn):
                        self._drop_conn()  # gone, or left in the middle of the statement
                        self.state = State.DISCONNECTED
                        if attempt == 1 and isinstance(exc, Exception):
                            continue
                    raise
                return self._claimed(channel, queues, acks, result, ticket, no_ack=no_ack)
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_claim(self, channel: Channel, queues: list[str], n: int) -> None:
        """Send a claim from Celery's event loop and return; :meth:`poll_inflight` reads it."""
        backend = self.backend
        with self.lock:
            conn = self.claim_conn()
            self.dirty.difference_update(queues)
            acks = backend.take_acks()
            ticket = self.waits.ticket(queues, self.consumed())
            try:
                query, params = backend.core.claim_wire(queues, n, acks,
                                                        ticket and ticket.plan)
                pending = InFlight(conn, query, params)
            except BaseException:
                # Not sent (or not wholly): the acks go back to the buffer; the connection
                # is in an unknown state and goes too.
                backend.restore_acks(acks)
                self.dirty.update(queues)
                self._drop_conn()
                self.state = State.DISCONNECTED
                raise
            self.inflight = (pending, channel, queues, acks, ticket)
            self.state = State.IN_FLIGHT

    def poll_inflight(self, *, block: bool = False) -> list[Claimed]:
        """Read the claim in flight if its result is in (or wait for it): deliverable rows.
        Raises what the claim raised (the caller decides: :meth:`_broken`)."""
        if self.inflight is None:
            return []
        with self.lock:
            if self.inflight is None:
                return []
            pending, channel, queues, acks, ticket = self.inflight
            timeout = self.options.connect_timeout + self.options.lease_ttl if block else None
            try:
                done = pending.wait(timeout) if block else pending.poll()
            except PREPARED_STATEMENT_ERRORS as exc:  # read here, not by a pgjobs cursor
                pooler = pooler_error(exc, pending.conn)
                if pooler is None:
                    raise
                # Nothing was claimed (the statement did not run): its acks go back
                self.inflight = None
                self.state = State.CONNECTED
                self.backend.restore_acks(acks)
                self.dirty.update(queues)
                self.unsupported = pooler
                raise pooler from exc
            if not done:
                if block:
                    raise DatabaseUnavailable("a claim's result did not come in time")
                return []
            self.inflight = None
            self.state = State.CONNECTED
            result = self.backend.core.claim_result(pending.rows())
            rows = self._claimed(channel, queues, acks, result, ticket, no_ack=False)
        closed = channel.closed or channel.closing or not channel._consumers
        callbacks = self.consumed()
        orphans = [r for r in rows if closed or r.queue not in callbacks]
        if orphans:
            rows = [r for r in rows if not closed and r.queue in callbacks]
            # Their consumer went away while the claim was in flight: hand them back unstarted
            # (no attempt counted), and stop renewing them whatever happens.
            self.backend.settle([(r.id, r.claim) for r in orphans], requeue=True,
                                uncount=True)
        return rows

    def finish_inflight(self) -> None:
        """Before any other use of the claim connection: complete the claim in flight and
        deliver what it took (a failure is the ``broken`` transition)."""
        if self.inflight is None:
            return
        try:
            rows = self.poll_inflight(block=True)
        except PoolerUnsupported:
            raise
        except Exception as exc:
            self._broken(exc, "claim")
            return
        self.deliver(rows)

    def channel_closing(self, channel: Channel) -> None:
        """A claim in flight for a closing channel: wait for it and hand its rows back."""
        with self.lock:
            inflight = self.inflight
            if inflight is not None and inflight[1] is channel:
                try:
                    self.poll_inflight(block=True)
                except Exception as exc:
                    self._broken(exc, "close")

    def _claimed(self, channel: Channel, queues: list[str], acks: list[Pair],
                 result: ClaimResult, ticket: Ticket | None, *,
                 no_ack: bool) -> list[Claimed]:
        """Account for a claim's result: settled acks, held leases, what to claim next."""
        self._recovered()
        backend = self.backend
        hit = result.acked
        if result.unsettled:  # a key's lock was busy: settle them now, waiting
            try:
                hit = hit | backend.core.ack(self.claim_conn(), result.unsettled)
            except psycopg.Error as exc:
                # The claim itself committed: deliver what it took, and let the next flush
                # retry these acks (fenced, so a retry can only miss, never double-settle).
                log.warning("pgjobs.ack.flush_failed %s", exc, extra={"action": "ack"})
                backend.restore_acks(result.unsettled)
                acks = [p for p in acks if p not in result.unsettled]
                if is_connection_failure(exc, self.conn):
                    self._drop_conn()
                    self.state = State.DISCONNECTED
        if acks:
            backend.settled(acks, hit, "ack")
        if result.claimed:
            self._take(channel, result.claimed, no_ack=no_ack)
        if any(h.verdict != "busy" for h in result.held_back):
            # A limit parked, deferred or refused candidates: they left the claim's index, so
            # the next claim reaches the rows behind them. Claim again now.
            self.again = True
        elif result.held_back:
            # Only keys another claim is changing right now: try again very soon, not at once.
            self._due(time.monotonic() + 0.005)
        if not result.drained:
            self.dirty.update(queues)  # more may be waiting
        elif result.due_in is not None:
            self._due(time.monotonic() + max(result.due_in, 0.0))
        recheck = self.waits.settle(ticket, result)
        if recheck == 0.0:  # registered: one more claim proves the queues empty
            self.dirty.update(queues)
            self.again = True
        elif recheck is not None:  # a publish was in flight: look again shortly
            self._due(time.monotonic() + recheck)
        return result.claimed

    def _due(self, at: float) -> None:
        if self.due_at is None or at < self.due_at:
            self.due_at = at

    def deliver(self, rows: list[Claimed]) -> int:
        """Hand claimed rows to their consumers. A row whose stored message is not a kombu
        message (written by hand, or by another program) is dead-lettered, reason
        ``malformed``; the rows claimed with it are delivered. When a consumer's callback
        raises, the rows not yet delivered go back (uncounted) before the error goes on."""
        transport = self.transport
        bad: list[tuple[Claimed, str]] = []
        delivered = 0
        try:
            for index, row in enumerate(rows):
                try:
                    message = transport.to_message(row, self.shard)
                except ValueError as exc:
                    bad.append((row, str(exc)))
                    continue
                try:
                    transport._deliver(message, row.queue)
                except Exception as exc:
                    if self._handed_over(message, row.queue):
                        self._hand_back(rows[index + 1:])
                        raise
                    # kombu could not make a Message of it (a body it cannot decode)
                    bad.append((row, f"{type(exc).__name__}: {exc}"))
                    continue
                delivered += 1
        finally:
            if bad:
                self.backend.bury_malformed(bad)
        return delivered

    def _handed_over(self, message: dict[str, Any], queue: str) -> bool:
        """Whether a consumer got this message (its callback ran) — as opposed to kombu
        failing to make a Message of it first."""
        tag = message["properties"]["delivery_tag"]
        for ch in self.transport.channels:
            if queue in ch._no_ack_queues or tag in ch.qos._delivered:
                return True
        return False

    def _take(self, channel: Channel, rows: list[Claimed], *, no_ack: bool = False) -> None:
        """Rows claimed for ``channel``: held (their leases renewed until settled), or, on a
        queue consumed without acks, settled once delivered."""
        held = []
        for r in rows:
            if no_ack or r.queue in channel._no_ack_queues:
                self.backend.buffer_ack(r.id, r.claim)
            else:
                held.append((r.id, r.claim))
        if held:
            self.backend.hold(held)

    def _hand_back(self, rows: list[Claimed]) -> None:
        if rows:
            self.backend.settle([(r.id, r.claim) for r in rows], requeue=True, uncount=True)

    def _take_handed(self, *, returning: bool = False) -> list[Claimed]:
        """Take what wake-ups said publishes handed to this consumer: a statement each,
        fenced on the row's claim, this worker and the wake id it was handed to (a forged or
        replayed wake-up reads nothing). A failure keeps them for the next try (the fence is
        on the wake id they were handed to, so another connection of this loop may take
        them); meanwhile their leases are not renewed, and lapse if the outage lasts.
        ``returning``: the consumer stops or closes and takes them to hand them back, on the
        connection it has or not at all (a failure is logged; the leases then lapse)."""
        with self.lock:
            pending, self.handed = self.handed, []
            if not pending:
                return []
            conn = self.conn if returning else self.claim_conn()
            if conn is None or conn.closed:
                return []  # (returning) the leases lapse
            try:
                return self.backend.core.take_handed(conn, pending)
            except (psycopg.Error, DatabaseUnavailable, DatabaseTimeout) as exc:
                if returning:
                    log_event("pgjobs.consumer.broken", action="return", error=one_line(exc))
                    return []
                self.handed = pending + self.handed
                self._broken(exc, "take")
                return []

    def _deliver_handed(self) -> int:
        """Deliver the messages publishes handed to this consumer (``0018_hand_off.sql``,
        ``0021_trust_boundary.sql``), each as a claim's row once taken: held (its lease
        renewed) unless its queue is consumed without acks. One that no open channel
        consumes, or whose channel's prefetch window is full, goes back unstarted (no attempt
        counted; the requeue wakes the queue's consumers)."""
        if not self.handed or not self._may_claim():
            return 0
        rows = self._take_handed()
        if not rows:
            return 0
        back: list[Claimed] = []
        delivered = 0
        try:
            while rows:
                row = rows.pop(0)
                channel = self._channel_of(row.queue)
                if channel is None or not channel.qos.can_consume():
                    back.append(row)
                    continue
                self._take(channel, [row])
                delivered += self.deliver([row])
        finally:  # a consumer's callback raised: the rows not delivered go back too
            self._hand_back(back + rows)
            self.handed_delivered += delivered
        return delivered

    def _return_handed(self) -> None:
        """Hand back what was handed to this consumer and not delivered (it stops consuming
        or closes): taken first (only what the fenced take reads back is ours to requeue).
        A failure here is logged by the settle; the leases then lapse."""
        self._hand_back(self._take_handed(returning=True))

    def _channel_of(self, queue: str) -> Channel | None:
        """The open channel consuming ``queue`` (None: no consumer of it here any more)."""
        for channel in self.transport.channels:
            if (queue in channel._active_queues and channel._consumers
                    and not (channel.closed or channel.closing)):
                return channel
        return None

    # -- the loop ---------------------------------------------------------------------------
    def pump(self, *, on_hub: bool = False) -> int:
        """Claim and deliver for every channel whose window is open enough; flush acks.
        ``on_hub``: a claim is sent and left in flight (one at a time); its rows are delivered
        when its result comes in, by a later call. Database failures never leave this method:
        they are the ``broken`` transition, retried after a backoff; but a transaction pooler
        that refuses prepared statements (:class:`PoolerUnsupported`) is raised, then and at
        every later call."""
        if self.unsupported is None and self.backend.unsupported is not None:
            self.unsupported = self.backend.unsupported  # the keeper ran into it
        if self.unsupported is not None:
            raise self.unsupported
        try:
            return self._pump_once(on_hub)
        except PoolerUnsupported as exc:
            self.unsupported = exc
            self.poke()  # raised in a Hub timer it is only logged: the self-pipe raises it again
            raise

    def _pump_once(self, on_hub: bool) -> int:
        self.again = False
        self.handed_delivered = 0
        # First, as they need no statement (even when broken); but never while a claim is in
        # flight: its rows count against the window first (_pump delivers these after them).
        handed = self._deliver_handed() if self.inflight is None else 0
        if not self._may_claim():
            return handed
        self.woken = False
        try:
            delivered = handed + self._pump(on_hub)
        except (psycopg.Error, DatabaseUnavailable, DatabaseTimeout) as exc:
            self._broken(exc, "claim")
            return handed
        if self.woken and self.inflight is None:
            self.again = True  # work was announced while this pump ran: look again now
        return delivered

    def _pump(self, on_hub: bool) -> int:
        delivered = 0
        if on_hub and self.inflight is not None:
            delivered += self.deliver(self.poll_inflight())
            if self.inflight is not None:
                return delivered  # the claim connection is busy until its result is read
        # Hand-offs read with a statement's result, before any window is measured below.
        delivered += self._deliver_handed()
        transport = self.transport
        consuming = self._consuming()
        if consuming != self.listening:  # LISTEN while consuming, and only then
            with self.lock:
                self._listen(consuming)
        if self.listening:
            self._tidy_waits()
        # Marks of queues no longer consumed go: a claim marks its queues to claim again,
        # and a consumer cancelled meanwhile (a reply queue of `celery inspect`) leaves its
        # name there, which nothing would ever claim or clear.
        self.dirty.intersection_update(self.consumed())
        now = time.monotonic()
        if now >= self.next_poll:
            self.dirty.update(self.consumed())
            self.next_poll = now + (self.options.idle_poll_interval if self.listening
                                    else transport.polling_interval)
        if self.due_at is not None and now >= self.due_at:
            self.due_at = None
            self.dirty.update(self.consumed())
        if self.rearm_at is not None and now >= self.rearm_at:
            self.rearm_at = None
            self.dirty.update(self.waits.rearm.intersection(self.consumed()))
        age = self.backend.oldest_ack_age()
        acks_due = age is not None and age >= self.options.ack_flush_interval
        channels = list(transport.channels)
        first = self.next_channel % len(channels) if channels else 0
        for index, channel in enumerate(channels[first:] + channels[:first], first):
            if not channel._consumers or channel.closed:
                continue
            queues = [q for q in channel._active_queues if q in self.dirty]
            if not queues:
                continue
            qos = channel.qos
            free = qos.can_consume_max_estimate()
            if free is None:
                free = self.options.max_claim
            if free <= 0:
                self.waits.gated(queues)
                continue
            window = qos.prefetch_count or free
            unacked = len(qos._delivered) - len(qos._dirty)
            if (free < refill_mark(window) and unacked > 0 and not acks_due
                    and self.waits.rearm.isdisjoint(queues)):
                # Refill at the low-water mark, not per freed slot; but acks that are due
                # ride on a claim (which also refills) rather than on a statement of their own,
                # and a queue just handed a message is claimed (so registered) again.
                self.waits.gated(queues)
                continue
            n = min(free, self.options.max_claim)
            acks_due = False
            if on_hub and self.listening and SUPPORTED:
                # The result is read when the claim socket turns readable: LISTEN has it
                # registered with the Hub (see hub_rearm).
                self._start_claim(channel, queues, n)
                # One claim in flight: the next pump starts with the next channel, so a busy
                # task queue cannot starve Celery's remote-control channel.
                self.next_channel = index + 1
                return delivered
            delivered += self.deliver(self.claim_for(channel, queues, n))
        if self.listening and self.waits.pass_on:  # wake-ups a closed window passed on
            self._tidy_waits()
        if acks_due:  # nothing to claim (and no claim in flight): the acks go alone
            with self.lock:
                self.backend.flush_acks(self.claim_conn())
        return delivered

    def _tidy_waits(self) -> None:
        """Registrations of queues no longer consumed go (a cancelled consumer); wake-ups
        that came for them are passed on to every consumer of those queues."""
        waits = self.waits
        callbacks = self.consumed()
        stale = waits.stale(callbacks)
        if not stale and not waits.pass_on:
            return
        with self.lock:
            core = self.backend.core
            conn = self.claim_conn()
            if stale and waits.waiter is not None:
                core.unwait(conn, waits.waiter, stale)
            passed, waits.pass_on = waits.pass_on, set()
            if passed:
                core.wake_all(conn, sorted(passed))

    def wait_budget(self, now: float) -> float:
        """Seconds until something is due: a poll, an ETA, an ack flush, a reconnect."""
        if self.state is State.BROKEN:
            return max(self.retry_at - now, 0.0)
        wait = self.next_poll - now
        if self.due_at is not None:
            wait = min(wait, self.due_at - now)
        if self.rearm_at is not None:
            wait = min(wait, self.rearm_at - now)
        age = self.backend.oldest_ack_age()
        if age is not None and self.inflight is None:  # a claim's result wakes us anyway
            wait = min(wait, self.options.ack_flush_interval - age)
        if self.dirty and self._consuming():
            # Work may be waiting but the window is closed: an ack pokes us; check anyway.
            wait = min(wait, 1.0)
        return max(wait, 0.0)

    def wait_fds(self) -> list[int]:
        """What a wait watches: the self-pipe, and the claim socket while it LISTENs."""
        fds = [self._wake_r]
        conn = self.conn
        if self.listening and conn is not None and not conn.closed:
            fds.append(conn.fileno())
        return fds

    def _wait(self, timeout: float) -> None:
        try:
            wait_readable(self.wait_fds(), timeout)  # poll(), or eventlet's green select (green.py)
        except InterruptedError:  # pragma: no cover
            return
        self.read_wakeups()

    def drain_events(self, timeout: float | None = None) -> None:
        """kombu's ``drain_events``: deliver at least one message or raise TimeoutError. A
        database outage looks like an empty queue here: the loop reconnects by itself."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.pump():
                return
            if self._interrupted:  # interrupt(): nothing delivered, return now
                self._interrupted = False
                raise TimeoutError()
            if self.again:
                continue
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError()
            wait = self.wait_budget(now)
            if deadline is not None:
                wait = min(wait, deadline - now)
            self._wait(wait)

    # -- Celery's event loop (asynloop): readers on the LISTEN socket and the self-pipe -----
    def register_with_event_loop(self, loop: Any) -> None:
        self.hub = loop
        with self.lock:
            try:
                self.claim_conn()
            except PoolerUnsupported as exc:
                self.unsupported = exc  # the first pump raises it
            except (psycopg.Error, PgJobsError) as exc:
                self._broken(exc, "connect")
        self.hub_rearm()
        loop.call_soon(self.on_hub_event)

    def unregister_from_event_loop(self, loop: Any) -> None:
        for fd in self._hub_fds:
            loop.remove_reader(fd)
        self._hub_fds = []
        self._hub_conn = None
        if self._hub_timer is not None:
            self._hub_timer.cancel()
            self._hub_timer = None
        self.hub = None

    def hub_rearm(self) -> None:
        """(Re)register readers: the claim connection's socket changes on reconnect."""
        hub = self.hub
        if hub is None or self.state is State.CLOSED:
            return
        conn = self.conn if self.listening else None
        if self._hub_fds and conn is self._hub_conn:
            return
        # By connection, not fd number: a new socket may get a closed one's number.
        for fd in self._hub_fds:
            hub.remove_reader(fd)
        self._hub_fds = [self._wake_r]
        hub.add_reader(self._wake_r, self.on_hub_event)
        if conn is not None and not conn.closed:
            self._hub_fds.append(conn.fileno())
            hub.add_reader(conn.fileno(), self.on_hub_event)
        self._hub_conn = conn

    def on_hub_event(self, *args: Any) -> None:
        hub = self.hub
        if hub is None or self.state is State.CLOSED:
            return
        self.read_wakeups()
        delivered = self.pump(on_hub=True)
        self.hub_rearm()
        if delivered > self.handed_delivered or self.again or self.handed:
            # More may be waiting: keep draining. A byte on the self-pipe, not call_soon: the
            # Hub runs what call_soon queued only after its next poll(), which waits for a
            # timer (up to a second) when no socket is readable. Not after hand-offs alone:
            # each announced one message, all taken, and a pass of the loop now would hold
            # the Hub (and the GIL) while the task it just got starts.
            self.poke()
            return
        now = time.monotonic()
        # At most a second: Celery's warm shutdown is a flag its loop checks between events.
        at = now + min(self.wait_budget(now), 1.0)
        if self._hub_timer is None or at < self._hub_timer_at or self._hub_timer_at <= now:
            if self._hub_timer is not None:
                self._hub_timer.cancel()
            self._hub_timer = hub.call_later(max(at - now, 0.0), self.on_hub_event)
            self._hub_timer_at = at

    # -- closing ----------------------------------------------------------------------------
    def close(self) -> None:
        """The ``closed`` transition: an in-flight claim's acks go back to the buffer (its
        rows, if it claimed any, come back when their leases lapse: their channels closed
        first, see :meth:`channel_closing`), the connection and the self-pipe close."""
        if self.state is State.CLOSED:
            return
        if self._ack_listener:
            self.backend.remove_ack_listener(self.poke)
            self._ack_listener = False
        with self.lock:
            if self.inflight is not None:
                # Its claim's rows come back when their leases lapse; its acks go with the
                # next flush (fenced: a retry can only miss).
                self.backend.restore_acks(self.inflight[3])
                self.inflight = None
            if (self.listening and self.state is State.CONNECTED and self.conn is not None
                    and not self.conn.closed):
                # A healthy connection says goodbye: its registrations go (no publish hands
                # it anything more), and hand-offs already sent to it are read and go back.
                try:
                    self._listen(False)
                except Exception:  # a dying connection: the leases lapse instead
                    pass
            if self.handed:
                self._return_handed()
            if self.hub is not None:
                self.unregister_from_event_loop(self.hub)
            self._drop_conn()
            self.state = State.CLOSED
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self._wake_r = self._wake_w = -1
