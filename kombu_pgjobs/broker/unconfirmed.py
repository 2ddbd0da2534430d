"""Publishes that return before PostgreSQL confirms them (``confirm_publish=False``).

Celery on RabbitMQ publishes without confirms by default: ``delay()`` returns once the message
is written to the socket. With ``confirm_publish=False`` pgjobs does the same. The publish
connection enters libpq's pipeline mode, and each message goes out as the same INSERT a
confirmed publish runs, followed by its own Sync: its own implicit transaction, committed on its
own, in the order sent. The call returns once libpq has handed the bytes to the kernel.

Confirmations (each INSERT's result) are read without waiting at the next publish, and all of
them by :meth:`Unconfirmed.confirm`, which the backend runs before any other use of the
publish connection (batch publish, purge, size, declare, reject) and when it closes: a process
always sees its own publishes, in order.

While a message is unconfirmed:

* if the connection breaks, the backend sends it again on a new connection; one whose commit
  reached the server before the break is then queued twice (at least once, like a redelivery);
* if PostgreSQL refuses the statement (a statement timeout, a full disk), the message is not
  queued and the next publish or confirm raises :class:`PublishFailed` naming the error;
* if the process is killed, it can be lost (as with RabbitMQ without publisher confirms).
"""

from __future__ import annotations

import re
import select
import time
from collections import deque
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg
from psycopg import pq, sql

from ..errors import PoolerUnsupported, PublishFailed
from ..store.core import NewJob
from ..store.database import pooler_error

__all__ = ["Unconfirmed", "positional"]

_NAME = b"pgjobs_publish_unconfirmed"
_OK = pq.ExecStatus.COMMAND_OK
_SYNC = pq.ExecStatus.PIPELINE_SYNC
#: parameter types that are not strings; a string goes as "unknown" and Postgres infers its type
#: from where it is used (what psycopg does for a str)
_OIDS = {"priority": 23, "max_attempts": 23, "run_at": 1184, "ttl_ms": 701}


#: SQLSTATEs of a prepared statement the server does not hold (26000) or holds from another
#: client (42P05): a transaction pooler between (database.PREPARED_STATEMENT_ERRORS)
_PREPARED_STATEMENT_STATES = (b"26000", b"42P05")

def positional(query: bytes) -> tuple[bytes, list[str]]:
    """``%(name)s`` placeholders as ``$1, $2...`` (a name used twice gets one number), and the
    names in parameter order."""
    names: list[str] = []

    def number(match: re.Match[bytes]) -> bytes:
        name = match.group(1).decode()
        if name not in names:
            names.append(name)
        return b"$%d" % (names.index(name) + 1)

    return re.sub(rb"%\((\w+)\)s", number, query), names


def _wait(fd: int, events: int, timeout: float | None) -> int:
    """poll() one socket (select() fails on descriptors past 1024); the events that came."""
    poller = select.poll()
    poller.register(fd, events)
    ready = poller.poll(None if timeout is None else timeout * 1000)
    return ready[0][1] if ready else 0


def _text(value: Any, encoding: str) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value.isoformat().encode()
    if isinstance(value, float):
        return repr(value).encode()
    return str(value).encode(encoding)


class Unconfirmed:
    """The publish connection sending unconfirmed INSERTs (the caller serializes calls).

    A message handed to :meth:`send` is in :attr:`jobs` until confirmed. If the connection
    breaks, :attr:`broken` is set and the owner sends :attr:`jobs` again elsewhere."""

    def __init__(self, conn: psycopg.Connection[Any], insert: sql.Composed, *,
                 prepare: bool = True) -> None:
        self.pg = conn.pgconn
        self.encoding = conn.info.encoding  # the connection's client_encoding, as Python names it
        self.query, self.names = positional(insert.as_bytes(conn))
        self.types = [_OIDS.get(n, 0) for n in self.names]
        self.prepare = prepare
        self.prepared = False
        #: sent and not yet confirmed, oldest first
        self.jobs: deque[NewJob] = deque()
        self.broken = False
        self._head_error: str | None = None  # the oldest message's INSERT failed with this
        self._failed: list[str] = []  # failures not yet raised
        #: a prepared statement the server did not hold: a transaction pooler (PGJ-112),
        #: raised instead of the failures it caused
        self.unsupported: PoolerUnsupported | None = None

    # -- sending -------------------------------------------------------------------------
    def send(self, job: NewJob) -> None:
        """Send one INSERT and its Sync; return once the bytes are with the kernel.

        Raises (the message not taken) when an earlier message failed, or when the connection
        is found broken before sending; once taken, a broken connection only sets
        :attr:`broken`."""
        self.read()
        self._raise_failed(" This message was not sent: publish it again.")
        self._enter()
        self._take(job)

    def resend(self, jobs: Iterable[NewJob]) -> None:
        """Send messages a broken connection left unconfirmed, in their order."""
        self._enter()
        for job in jobs:
            self._take(job)

    def _enter(self) -> None:
        """Prepare the INSERT once, and enter pipeline mode."""
        pg = self.pg
        if self.broken:
            raise psycopg.OperationalError("the publish connection is broken")
        if pg.pipeline_status != pq.PipelineStatus.OFF:
            return
        if self.prepare and not self.prepared:
            pg.send_prepare(_NAME, self.query, self.types)
            self._write()
            self._check(self._last_result())
            self.prepared = True
        pg.enter_pipeline_mode()

    def _take(self, job: NewJob) -> None:
        # raises (an unencodable name) before anything is sent
        params = [_text(getattr(job, n), self.encoding) for n in self.names]
        if self.broken:
            self.jobs.append(job)
            return
        try:
            if self.prepare:
                self.pg.send_query_prepared(_NAME, params)
            else:
                self.pg.send_query_params(self.query, params, self.types)
            self.pg.pipeline_sync()
        except BaseException as exc:
            # libpq may hold half a message: this connection's results can no longer be
            # matched to messages, so it is done; the message goes again on the next one.
            self.broken = True
            self.jobs.append(job)
            if not isinstance(exc, psycopg.OperationalError):
                raise
            return
        self.jobs.append(job)
        try:
            self._write()
        except psycopg.OperationalError:
            self.broken = True

    def _write(self) -> None:
        """Write libpq's buffer out, reading results while the socket is full (the server
        stops reading when nobody reads its results)."""
        while self.pg.flush():
            if _wait(self.pg.socket, select.POLLIN | select.POLLOUT, None) & select.POLLIN:
                self.pg.consume_input()
                self.read()

    # -- confirmations -------------------------------------------------------------------
    def read(self) -> None:
        """Take in the confirmations that have arrived, without waiting."""
        pg = self.pg
        if not self.jobs:
            return
        pg.consume_input()
        ended = False
        while self.jobs and not pg.is_busy():
            result = pg.get_result()
            if result is None:  # the end of one statement's results
                if ended or pg.status == pq.ConnStatus.BAD:  # nothing more will come
                    raise psycopg.OperationalError("the publish connection is broken")
                ended = True
                continue
            ended = False
            if result.status == _SYNC:  # the end of one message's transaction
                self.jobs.popleft()
                if self._head_error is not None:
                    self._failed.append(self._head_error)
                    self._head_error = None
            elif result.status != _OK:
                self._head_error = (result.error_message or b"").decode(errors="replace")
                state = result.error_field(pq.DiagnosticField.SQLSTATE)
                if self.prepare and state in _PREPARED_STATEMENT_STATES:
                    error = psycopg.errors.lookup(state.decode())(self._head_error)
                    self.unsupported = pooler_error(error, None)
                    if self.unsupported is not None:
                        self.unsupported.__cause__ = error

    def confirm(self, timeout: float | None = None, *, raise_failed: bool = True) -> None:
        """Wait until every message sent is confirmed, then leave pipeline mode (the
        connection can run ordinary statements). Raise :class:`PublishFailed` if one failed
        (``raise_failed=False``: keep it for the next publish)."""
        if self.broken:
            raise psycopg.OperationalError("the publish connection is broken")
        self._write()
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not _wait(self.pg.socket, select.POLLIN, left):
                # Not a broken connection: the server may still commit them, so they must not
                # be sent again.
                raise TimeoutError(
                    f"{len(self.jobs)} unconfirmed publishes got no answer in {timeout} s")
            self.read()
        if self.pg.pipeline_status != pq.PipelineStatus.OFF:
            self.pg.exit_pipeline_mode()
        if raise_failed:
            self._raise_failed()

    def take_failed(self) -> list[str]:
        """Failures not raised yet (for the owner to report when it drops the connection)."""
        failed, self._failed = self._failed, []
        return failed

    def _raise_failed(self, then: str = "") -> None:
        if self.unsupported is not None and self._failed:
            # those publishes failed for the pooler, not for what they carried: say so
            self._failed = []
            raise self.unsupported
        if self._failed:
            failed, self._failed = self._failed, []
            raise PublishFailed(
                f"{len(failed)} earlier publish(es) sent with confirm_publish=False failed in "
                f"PostgreSQL and were not queued: {failed[0].strip()}.{then}")

    def _last_result(self) -> pq.abc.PGresult | None:
        """Wait for the results of one statement sent outside pipeline mode; the last one."""
        pg = self.pg
        last = None
        while True:
            while pg.is_busy():
                _wait(pg.socket, select.POLLIN, None)
                pg.consume_input()
            result = pg.get_result()
            if result is None:
                return last
            last = result

    def _check(self, result: pq.abc.PGresult | None) -> None:
        if result is None or result.status != _OK:
            if self.pg.status == pq.ConnStatus.BAD or result is None:
                raise psycopg.OperationalError("the publish connection is broken")
            exc = psycopg.errors.error_from_result(result, encoding="utf-8")
            if self.prepare and (unsupported := pooler_error(exc, None)) is not None:
                raise unsupported from exc
            raise exc
