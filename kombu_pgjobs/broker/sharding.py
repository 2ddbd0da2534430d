"""Queues on several databases: one backend and one consumer loop per database.

With a shard map (:mod:`kombu_pgjobs.shardmap`) a transport talks to the broker URL's database
(shard 0, the *default*) and to each database the map names (shards 1..n). Nothing is shared
between databases: each has its own :class:`~kombu_pgjobs.broker.backend.Backend` (publish and
keeper connections, ack buffer, held leases, schema migrated on first use) and, in a consuming
transport, its own :class:`~kombu_pgjobs.broker.consumer.ConsumerLoop` (claim connection, LISTEN and
wake-one registrations on that database). So every guarantee holds per message as on one
database — fencing on ``(id, claim)``, leases renewed by that database's keeper, lapsed leases
rescued there — and limits are enforced per database: a cap of 5 on a key means 5 on each
database whose queues carry that key.

Delivery tags name the database: ``id.claim`` on the default database (as without a map),
``id.claim.N`` on shard N, so an ack, reject or requeue goes to the database that holds the
row, fenced on its claim number there.

:class:`ShardedConsumer` has the interface the transport uses of a ConsumerLoop; it routes
claims, dirty marks and pokes to the loops, and ``drain_events`` waits on every loop's
descriptors at once (:meth:`ConsumerLoop.wait_fds`). In Celery's event loop each loop registers
its own readers and timers.

Shards are independent: one that is down fails only its own queues
------------------------------------------------------------------
(docs/sharding.md, "When one shard is down", says it for users.)

* Opening a kombu connection opens the default database only (a connection error if it is
  down, as without a map); a shard is connected (and migrated) on its first use. So a
  connection opens, and kombu's reconnect in a publish retry works, whatever shard is down.
* Whatever a channel runs on a shard's database (publish, purge, size, ``basic_get``) goes
  through :meth:`Shards.run`: a shard that cannot be reached raises
  :class:`~kombu_pgjobs.errors.ShardUnavailable` (PGJ-113) naming it. It is a
  ``DatabaseUnavailable``, a kombu connection error, on purpose: kombu's publish retry sends
  the message again (its reconnect opens only the default database, so it is cheap and
  works) and, when its retries are used up, the publisher gets the error; nothing was
  written, nothing is dropped silently. It never reaches Celery's consumer (which would
  restart itself for a connection error): nothing on a worker's consuming path raises it.
* A queue declared while its shard is down (a worker starting, a producer's ``declare=``) is
  not an error: :meth:`Shards.declare` hands it to :data:`kept` (process-wide, as a declared
  queue outlives its connection), which applies it before anything else runs on that
  database, or from a retry thread once the shard is back. So a worker whose queues include a
  down shard's starts, and its consumer is never restarted for it.
* Claims: each database's consumer loop claims on its own connection; a down shard's loop is
  in its ``broken`` state (consumer.py: it reconnects by itself, backoff at most 5 s) while
  the other loops claim and deliver as before. A shard whose server does not answer at all
  (no refusal: each attempt lasts ``connect_timeout``) would hold the consumer's thread, and
  with it every database's claims, at each attempt: a shard's loop reconnects through a
  :class:`ShardConnector`, which opens the connection on a helper thread and waits at most
  :data:`RECONNECT_WAIT`.
* Settles: acks of messages held from a down shard stay buffered in its backend (its loop
  and its keeper retry them; fenced) and land when it is back; rejects and hand-backs that
  fail are logged (PGJ-212) and their leases lapse there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

import psycopg

from ..errors import ConfigurationError, DatabaseUnavailable, InvalidShardURL, ShardUnavailable
from ..events import log_event, one_line
from ..green import wait_readable
from ..shardmap import DEFAULT, ShardMap, shard_label
from ..store.core import Claimed
from ..url import masked
from .backend import Backend, backend_for
from .consumer import ConsumerLoop

if TYPE_CHECKING:
    from .transport import Channel, Transport

__all__ = ["ShardedConsumer", "Shards", "log_unavailable", "unreachable"]

log = logging.getLogger("kombu_pgjobs")
T = TypeVar("T")

#: Server states that mean "not reachable now" rather than "this statement failed":
#: admin_shutdown, crash_shutdown, cannot_connect_now (starting up or shutting down).
_SHUTTING_DOWN = frozenset({"57P01", "57P02", "57P03"})
#: The retry of declarations kept for a down shard: first wait, and the most it grows to.
RETRY_FIRST = 1.0
RETRY_MAX = 10.0
#: The longest a shard's consumer loop waits for a reconnect (:class:`ShardConnector`).
RECONNECT_WAIT = 0.5


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means the database cannot be reached (no connection, a connection lost,
    a server shutting down), as opposed to a statement refused on a healthy connection (a
    permission, a timeout, a bad message): only the first is a shard being down."""
    if isinstance(exc, DatabaseUnavailable | psycopg.InterfaceError):
        return True
    if isinstance(exc, psycopg.OperationalError):
        state = exc.sqlstate or ""
        return not state or state.startswith("08") or state in _SHUTTING_DOWN
    return False


def log_unavailable(what: str, exc: ShardUnavailable, **fields: Any) -> None:
    """Log work that waits for (or skips) a down shard instead of raising (PGJ-113)."""
    log_event("pgjobs.shard.unavailable", what=what, shard=exc.shard, error=exc.message,
              **fields)


class Shards:
    """The databases of one transport: ``backends[0]`` is the default database's."""

    def __init__(self, default: Backend, shardmap: ShardMap, *, user: str | None = None,
                 password: str | None = None, ssl: Any = None) -> None:
        from ..store.database import conninfo_from_url

        self.map = shardmap
        self.backends: list[Backend] = [default]
        self.names: list[str] = [DEFAULT]
        #: shard number in the map -> index in backends (a URL naming the default database
        #: is the default database: same backend, no second connection)
        self._index: list[int] = [0]
        for url in shardmap.urls:
            try:
                conninfo = conninfo_from_url(url, default.options, user=user,
                                             password=password, ssl=ssl)
            except ConfigurationError as exc:
                raise InvalidShardURL(f"shard map: {masked(url)!r}: {exc.message}") from None
            if conninfo == default.conninfo:
                self._index.append(0)
                continue
            backend = backend_for(conninfo, default.options)
            if backend in self.backends:
                self._index.append(self.backends.index(backend))
                continue
            self._index.append(len(self.backends))
            self.backends.append(backend)
            self.names.append(shard_label(url))
        self._cache: dict[str, int] = {}

    def index_of(self, queue: str) -> int:
        """The index (in :attr:`backends`) of ``queue``'s database."""
        index = self._cache.get(queue)
        if index is None:
            index = self._index[self.map.shard_of(queue)]
            if len(self._cache) < 100_000:
                self._cache[queue] = index
        return index

    def backend_of(self, queue: str) -> Backend:
        return self.backends[self.index_of(queue)]

    def backend_at(self, index: int) -> Backend | None:
        """The backend of a delivery tag's shard number (None: no such database here)."""
        return self.backends[index] if 0 <= index < len(self.backends) else None

    # -- a shard that is down fails only its own queues -------------------------------------
    def unavailable(self, index: int, exc: BaseException) -> ShardUnavailable:
        """The coded error of database ``index`` (a shard) found unreachable."""
        error = ShardUnavailable(
            f"shard {self.names[index]} cannot be reached ({one_line(exc, 200)}): the "
            "publishes and claims of the queues the shard map gives it fail until it is "
            "back; the default database and the other shards go on. Start its server, or "
            "check its URL in the shard map")
        error.shard = self.names[index]
        return error

    def run(self, index: int, fn: Callable[[Backend], T]) -> T:
        """``fn(backend)`` on database ``index``. On a shard, the declarations kept for it go
        first, and a database that cannot be reached raises :class:`ShardUnavailable`; the
        default database's errors are what they are without a map (its connection's)."""
        backend = self.backends[index]
        if index == 0:
            return fn(backend)
        try:
            kept.apply(backend)
            return fn(backend)
        except Exception as exc:
            if isinstance(exc, ShardUnavailable) or not unreachable(exc):
                raise
            raise self.unavailable(index, exc) from exc

    def declare(self, index: int, queue: str, fn: Callable[[Backend], Any]) -> bool:
        """Run ``queue``'s declaration ``fn`` on database ``index`` (True). A shard that
        cannot be reached keeps it (:data:`kept`; False): a consumer that starts while a
        shard is down declares its queues without failing (logged, PGJ-113)."""
        try:
            self.run(index, fn)
            return True
        except ShardUnavailable as exc:
            kept.keep(self.backends[index], queue, fn, lambda i=index: self.run(i, _nothing))
            log_unavailable("queue declaration kept until the shard is back", exc,
                            queue=queue)
            return False


def _nothing(backend: Backend) -> None:
    return None


class KeptDeclarations:
    """Queue declarations waiting for a shard that is down, for the whole process (a declared
    queue outlives the connection that declared it, as on a broker): the latest per queue
    and database. They are applied before anything else runs on that database
    (:meth:`Shards.run`), and by a retry thread (1 s, doubling to 10 s) once it is back; the
    thread ends when none is left. One the database refuses (not a lost connection) is
    logged and dropped: declared later it would fail the same way."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: backend -> queue -> declaration
        self.waiting: dict[Backend, dict[str, Callable[[Backend], Any]]] = {}
        #: backend -> how the retry thread reaches it (Shards.run: errors coded)
        self.retry: dict[Backend, Callable[[], Any]] = {}
        self.thread: threading.Thread | None = None

    def keep(self, backend: Backend, queue: str, fn: Callable[[Backend], Any],
             retry: Callable[[], Any]) -> None:
        with self.lock:
            self.waiting.setdefault(backend, {})[queue] = fn
            self.retry[backend] = retry
            thread = self.thread
            if thread is None or not thread.is_alive():
                thread = self.thread = threading.Thread(
                    target=self._retry, name="pgjobs-shard-declare", daemon=True)
                thread.start()

    def apply(self, backend: Backend) -> None:
        """Run the declarations kept for ``backend``'s database, if any; a lost connection
        keeps those not done and is raised."""
        if backend not in self.waiting:
            return
        with self.lock:
            todo = list(self.waiting.pop(backend, {}).items())
        for done, (queue, fn) in enumerate(todo):
            try:
                fn(backend)
            except Exception as exc:
                if unreachable(exc):
                    with self.lock:  # a newer declaration of the queue made meanwhile wins
                        left = self.waiting.setdefault(backend, {})
                        for q, f in todo[done:]:
                            left.setdefault(q, f)
                    raise
                log_event("pgjobs.shard.declare_failed", queue=queue, error=one_line(exc))

    def _retry(self) -> None:
        delay = RETRY_FIRST
        while True:
            time.sleep(delay)
            with self.lock:
                retries = [self.retry[b] for b, todo in self.waiting.items() if todo]
            for retry in retries:
                try:
                    retry()
                except ShardUnavailable:
                    pass
                except Exception:  # pragma: no cover - apply() logs the refusals
                    log.exception("pgjobs.shard.declare_failed")
            with self.lock:
                for backend in [b for b, todo in self.waiting.items() if not todo]:
                    del self.waiting[backend]
                for backend in [b for b in self.retry if b not in self.waiting]:
                    del self.retry[backend]
                if not self.waiting:
                    self.thread = None
                    return
            delay = min(RETRY_MAX, delay * 2)

    def forget(self) -> None:
        """After a fork: the parent's backends (and its thread) are not the child's."""
        self.waiting.clear()
        self.retry.clear()
        self.thread = None


#: this process's queue declarations waiting for a down shard
kept = KeptDeclarations()
os.register_at_fork(after_in_child=kept.forget)


class _Attempt(threading.Thread):
    """One claim connection being opened for a shard's loop, on a thread of its own."""

    def __init__(self, backend: Backend, hot: bool) -> None:
        super().__init__(name="pgjobs-shard-connect", daemon=True)
        self.backend = backend
        self.hot = hot
        self.pid = os.getpid()
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.conn: psycopg.Connection[Any] | None = None
        self.error: BaseException | None = None
        self.abandoned = False
        self.start()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        error: BaseException | None = None
        try:
            conn = self.backend.connect(hot=self.hot)
        except BaseException as exc:
            error = exc
        with self.lock:
            if self.abandoned and conn is not None:
                conn.close()  # its loop closed meanwhile
                conn = None
            self.conn, self.error = conn, error
            self.done.set()

    def abandon(self) -> None:
        with self.lock:
            self.abandoned = True
            conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()


class ShardConnector:
    """A shard's backend as its consumer loop sees it: the backend itself (every attribute is
    its), but for ``connect``. The loop's first claim connection opens on the loop's thread,
    as the default database's does; every later one (a reconnect: after a failure, or after
    its connection was lost) opens on a helper thread, and the loop waits for it at most
    :data:`RECONNECT_WAIT`. A shard whose server does not answer at all (a host gone, a server
    hung: a connection is never refused, each attempt lasts ``connect_timeout``) therefore
    never holds the worker's consumer thread — nor the default database's claims that run on
    it — for ``connect_timeout`` at each attempt. An attempt not done in time goes on; the
    loop takes its connection at a later try (after its backoff)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._first = True
        self._attempt: _Attempt | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)

    def connect(self, *, hot: bool = False) -> psycopg.Connection[Any]:
        if self._first:
            self._first = False
            return self.backend.connect(hot=hot)
        with self._lock:
            attempt = self._attempt
            if attempt is None or attempt.pid != os.getpid():
                attempt = self._attempt = _Attempt(self.backend, hot)
        if not attempt.done.wait(RECONNECT_WAIT):
            raise DatabaseUnavailable(
                f"the database did not answer within {RECONNECT_WAIT} s: still connecting "
                "(on a helper thread, up to connect_timeout)")
        with self._lock:
            if self._attempt is attempt:
                self._attempt = None
        if attempt.error is not None:
            raise attempt.error
        assert attempt.conn is not None
        return attempt.conn

    def stop(self) -> None:
        """The loop closed: a connection still being opened for it is closed when it comes."""
        with self._lock:
            attempt, self._attempt = self._attempt, None
        if attempt is not None:
            attempt.abandon()


class ShardedConsumer:
    """One :class:`ConsumerLoop` per database, behind the interface of one. A shard's loop
    opens its connections through a :class:`ShardConnector`."""

    def __init__(self, transport: Transport, shards: Shards) -> None:
        self.transport = transport
        self.shards = shards
        self.connectors = [ShardConnector(b) for b in shards.backends[1:]]
        backends = [shards.backends[0], *(cast("Backend", c) for c in self.connectors)]
        self.loops = [
            ConsumerLoop(transport, backend=b, shard=i,
                         owns=lambda q, i=i: shards.index_of(q) == i)  # type: ignore[misc]
            for i, b in enumerate(backends)]
        self._interrupted = False  # interrupt(): the next drain_events returns at once

    def loop_of(self, queue: str) -> ConsumerLoop:
        return self.loops[self.shards.index_of(queue)]

    def _by_loop(self, queues: Iterable[str]) -> dict[int, list[str]]:
        grouped: dict[int, list[str]] = {}
        for q in queues:
            grouped.setdefault(self.shards.index_of(q), []).append(q)
        return grouped

    def poke(self) -> None:
        for loop in self.loops:
            loop.poke()

    def interrupt(self) -> None:
        """As :meth:`ConsumerLoop.interrupt`, over every database: a waiting
        :meth:`drain_events` raises TimeoutError once, without waiting more."""
        self._interrupted = True
        self.poke()

    def mark_dirty(self, queues: Iterable[str]) -> None:
        for index, qs in self._by_loop(queues).items():
            self.loops[index].mark_dirty(qs)

    def claim_for(self, channel: Channel, queues: list[str], n: int, *,
                  no_ack: bool = False) -> list[Claimed]:
        """Claim on each database of ``queues`` (``basic_get``). A shard that cannot be
        reached raises :class:`ShardUnavailable` when nothing was claimed elsewhere; rows
        claimed on other databases are returned, never left held undelivered."""
        rows: list[Claimed] = []
        down: ShardUnavailable | None = None
        for index, qs in self._by_loop(queues).items():
            want = n - len(rows)
            if want <= 0:
                break
            loop = self.loops[index]
            try:
                rows += self.shards.run(index, lambda backend, loop=loop, qs=qs, want=want:
                                        loop.claim_for(channel, qs, want, no_ack=no_ack))
            except ShardUnavailable as exc:
                down = down or exc
        if down is not None and not rows:
            raise down
        return rows

    def stop_listening(self) -> None:
        for loop in self.loops:
            loop.stop_listening()

    def channel_closing(self, channel: Channel) -> None:
        for loop in self.loops:
            loop.channel_closing(channel)

    def drain_events(self, timeout: float | None = None) -> None:
        """As :meth:`ConsumerLoop.drain_events`, over every database: claim where work is
        marked, else wait on every loop's self-pipe and LISTEN socket at once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            delivered = 0
            for loop in self.loops:
                delivered += loop.pump()
            if delivered:
                return
            if self._interrupted:  # interrupt(): nothing delivered, return now
                self._interrupted = False
                raise TimeoutError()
            if any(loop.again for loop in self.loops):
                continue
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise TimeoutError()
            wait = min(loop.wait_budget(now) for loop in self.loops)
            if deadline is not None:
                wait = min(wait, deadline - now)
            fds = [fd for loop in self.loops for fd in loop.wait_fds()]
            try:
                wait_readable(fds, wait)
            except InterruptedError:  # pragma: no cover
                pass
            for loop in self.loops:
                loop.read_wakeups()

    def register_with_event_loop(self, hub: Any) -> None:
        for loop in self.loops:
            loop.register_with_event_loop(hub)

    def unregister_from_event_loop(self, hub: Any) -> None:
        for loop in self.loops:
            loop.unregister_from_event_loop(hub)

    def close(self) -> None:
        for loop in self.loops:
            loop.close()
        for connector in self.connectors:
            connector.stop()
