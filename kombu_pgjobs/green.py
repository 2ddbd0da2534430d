"""Waiting on sockets in a process whose threads may be green (Celery's ``-P eventlet``/gevent).

Celery monkey-patches the standard library before anything else is imported when a green pool
is chosen. Two waits in pgjobs must then yield to the green hub instead of blocking the whole
process (which is what made an eventlet worker deaf: no new tasks, no ping reply, SIGTERM only
seen by a hub that never ran again):

* the consumer loop's own wait on the claim socket and the self-pipe. It uses ``poll()``
  (``select()`` fails past fd 1024, and a prefork parent has many), but eventlet deletes
  ``select.poll``; its green ``select()`` registers the fds with eventlet's hub, which has no
  such limit. gevent replaces ``poll()`` with a cooperative one, so nothing changes there.
* psycopg's wait for a statement's result. psycopg detects gevent's patching itself and then
  waits with ``select``; it does not detect eventlet and waits in C, holding the hub.
  :func:`cooperate` points psycopg at its ``select`` wait when eventlet patched ``select``.

And one must never wait: the self-pipe is non-blocking, read until empty and poked from any
thread without blocking, but eventlet's green ``os.read``/``os.write`` wait for the pipe instead
of raising ``BlockingIOError`` (so draining the pipe blocked the loop until the next poke).
:func:`pipe_read` and :func:`pipe_write` are the plain system calls, under any pool.
"""

from __future__ import annotations

import select
import sys
from posix import read as pipe_read  # never patched (eventlet patches os.read in place)
from posix import write as pipe_write

import psycopg.waiting

__all__ = ["cooperate", "eventlet_patched", "pipe_read", "pipe_write", "wait_readable"]


def eventlet_patched() -> bool:
    """Whether eventlet monkey-patched ``select`` in this process (never imports eventlet)."""
    patcher = sys.modules.get("eventlet.patcher")
    return bool(patcher is not None and patcher.is_monkey_patched("select"))


def cooperate() -> None:
    """Make psycopg's blocking waits green under eventlet (idempotent; cheap: called when a
    connection opens, never per statement)."""
    if psycopg.waiting.wait is not psycopg.waiting.wait_select and eventlet_patched():
        psycopg.waiting.wait = psycopg.waiting.wait_select


def wait_readable(fds: list[int], timeout: float | None) -> None:
    """Wait until one of ``fds`` is readable or ``timeout`` seconds passed (None: forever)."""
    if hasattr(select, "poll"):
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(None if timeout is None else max(timeout, 0.0) * 1000)
    else:  # eventlet: its green select() waits on its hub (no fd-number limit)
        select.select(fds, [], [], None if timeout is None else max(timeout, 0.0))
