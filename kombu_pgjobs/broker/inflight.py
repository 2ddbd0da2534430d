"""A statement sent on a psycopg connection whose result is read later, without blocking.

Celery's event loop must not sit in a claim's round trip: while Postgres runs the claim, the
worker's main process has tasks to hand to pool children and results to read. :class:`InFlight`
sends the statement and returns; the loop calls :meth:`InFlight.poll` when the connection's
socket is readable, and the rows are read once the whole result is in.

It drives psycopg's own execution generator (the one ``Cursor.execute`` runs to completion), so
prepared statements, adaptation and error handling stay psycopg's. That generator is not public
API: :data:`SUPPORTED` says whether this psycopg has it, and callers fall back to a blocking
``execute`` when it does not.
"""

from __future__ import annotations

import select
import time
from typing import Any

import psycopg
from psycopg.waiting import Ready, Wait

from ..store.database import timeout_error

__all__ = ["SUPPORTED", "InFlight"]

_READABLE = select.POLLIN | select.POLLHUP | select.POLLERR
_WRITABLE = select.POLLOUT | select.POLLHUP | select.POLLERR


def _poll(fd: int, events: int, timeout: float | None) -> int:
    """poll() one fd (select() fails past fd 1024: a prefork parent has many); the events.
    Only Celery's event loop sends claims in flight, and it never runs under a green pool
    (where eventlet deletes ``select.poll``)."""
    poller = select.poll()
    poller.register(fd, events)
    found = poller.poll(None if timeout is None else timeout * 1000)
    return found[0][1] if found else 0

#: Whether this psycopg has the execution generator :class:`InFlight` drives.
SUPPORTED = hasattr(psycopg.Cursor, "_execute_gen")


class InFlight:
    """One statement in flight on ``conn``; nothing else may use ``conn`` until it is done.
    Its placeholders are numbered (``$1``...) and ``params`` a sequence: it goes through a raw
    cursor, which sends the text as it is (see :func:`kombu_pgjobs.store.sql.positional`)."""

    def __init__(self, conn: psycopg.Connection[Any], query: bytes,
                 params: list[Any]) -> None:
        self.conn = conn
        self.cursor: psycopg.RawCursor[Any] = psycopg.RawCursor(conn)
        self.done = False
        self._gen = self.cursor._execute_gen(query, params)
        self._advance(None)  # send it

    def _advance(self, ready: Ready | None) -> None:
        try:
            state = next(self._gen) if ready is None else self._gen.send(ready)
            while state & Wait.W:
                # The send buffer is full (a very large statement): wait until it drains.
                events = _poll(self.conn.fileno(), select.POLLOUT |
                               (select.POLLIN if state & Wait.R else 0), None)
                state = self._gen.send(Ready((Ready.R if events & _READABLE else 0) |
                                             (Ready.W if events & _WRITABLE else 0)))
        except StopIteration:
            self.done = True
        except (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled) as exc:
            # The statement was cancelled by a timeout and its result is complete: the
            # connection is fine (a coded error, not a broken connection).
            self.done = True
            raise timeout_error(exc) from exc

    def poll(self) -> bool:
        """Read what arrived (never blocks); True once the result is complete."""
        if not self.done:
            self._advance(Ready.R)
        return self.done

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the result is complete (or ``timeout`` seconds in all); True when it
        is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not _poll(self.conn.fileno(), select.POLLIN, left):
                return False
            self._advance(Ready.R)
        return True

    def rows(self) -> list[tuple[Any, ...]]:
        return self.cursor.fetchall()
