"""Queues on several databases: one backend and one consumer loop per database.

With a shard map (:mod:`kombu_pgjobs.shardmap`) a transport talks to the broker URL's database
(shard 0, the *default*) and to each database the map names (shards 1..n). Nothing is shared
between databases: each has its own :class:`~kombu_pgjobs.backend.Backend` (publish and keeper
connections, ack buffer, held leases, schema migrated on first connect) and, in a consuming
transport, its own :class:`~kombu_pgjobs.consumer.ConsumerLoop` (claim connection, LISTEN and
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
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from .backend import Backend, backend_for
from .consumer import ConsumerLoop
from .core import Claimed
from .errors import ConfigurationError, InvalidShardURL
from .green import wait_readable
from .shardmap import DEFAULT, ShardMap, shard_label
from .url import masked

if TYPE_CHECKING:
    from .transport import Channel, Transport

__all__ = ["ShardedConsumer", "Shards"]


class Shards:
    """The databases of one transport: ``backends[0]`` is the default database's."""

    def __init__(self, default: Backend, shardmap: ShardMap, *, user: str | None = None,
                 password: str | None = None, ssl: Any = None) -> None:
        from .database import conninfo_from_url

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


class ShardedConsumer:
    """One :class:`ConsumerLoop` per database, behind the interface of one."""

    def __init__(self, transport: Transport, shards: Shards) -> None:
        self.transport = transport
        self.shards = shards
        self.loops = [
            ConsumerLoop(transport, backend=b, shard=i,
                         owns=lambda q, i=i: shards.index_of(q) == i)  # type: ignore[misc]
            for i, b in enumerate(shards.backends)]

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

    def mark_dirty(self, queues: Iterable[str]) -> None:
        for index, qs in self._by_loop(queues).items():
            self.loops[index].mark_dirty(qs)

    def claim_for(self, channel: Channel, queues: list[str], n: int, *,
                  no_ack: bool = False) -> list[Claimed]:
        rows: list[Claimed] = []
        for index, qs in self._by_loop(queues).items():
            if len(rows) >= n:
                break
            rows += self.loops[index].claim_for(channel, qs, n - len(rows), no_ack=no_ack)
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
