"""Worker-side timestamps of ``python -m bench.stages`` (loaded with ``celery worker -I``).

Nothing here changes what a worker does: each hook notes ``time.time()`` (about 0.1 µs) and
calls the original.

``woke``
    The worker's event loop read the broker's signal: pgjobs's consumer parsed a
    notification (``ConsumerLoop._notified``), RabbitMQ's socket turned readable
    (``kombu.transport.pyamqp.Transport.on_readable``), Redis's
    (``MultiChannelPoller.on_readable``).
``taken``
    pgjobs only: the fenced read of a handed message returned (``ConsumerLoop._take_handed``).
``received``
    Celery's consumer made a request of the message (the ``task_received`` signal, in the
    worker's main process, before the pool gets it): the same point for every broker.

At ``received`` the worker appends ``sent woke taken received`` (``sent`` is the task's own
argument; a stamp older than ``sent`` is written as ``nan``) to ``$BENCH_STATE_DIR/received``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

from celery.signals import task_received

_last = {"woke": 0.0, "taken": 0.0}


def _stamp(key: str, fn: Callable[..., Any], *, after: bool = False) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not after:
            _last[key] = time.time()
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        finally:
            _last[key] = time.time()

    return wrapper


def _install() -> None:
    url = os.environ.get("BENCH_BROKER_URL", "")
    if url.startswith("pgjobs"):
        from kombu_pgjobs.broker.consumer import ConsumerLoop

        ConsumerLoop._notified = _stamp("woke", ConsumerLoop._notified)  # type: ignore[method-assign]
        ConsumerLoop._take_handed = _stamp(  # type: ignore[method-assign]
            "taken", ConsumerLoop._take_handed, after=True)
    elif url.startswith("amqp"):
        from kombu.transport.pyamqp import Transport

        Transport.on_readable = _stamp("woke", Transport.on_readable)  # type: ignore[method-assign]
    elif url.startswith("redis"):
        from kombu.transport.redis import MultiChannelPoller

        MultiChannelPoller.on_readable = _stamp(  # type: ignore[method-assign]
            "woke", MultiChannelPoller.on_readable)


_install()
_fd: int | None = None


@task_received.connect
def _on_received(request: Any = None, **_: Any) -> None:
    global _fd
    received = time.time()
    state = os.environ.get("BENCH_STATE_DIR", "")
    if request is None or request.name != "bench.stages" or not state:
        return
    sent = float(request.args[0])
    woke, taken = (v if v >= sent else float("nan") for v in (_last["woke"], _last["taken"]))
    if _fd is None:
        _fd = os.open(os.path.join(state, "received"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                      0o644)
    os.write(_fd, f"{sent:.6f} {woke:.6f} {taken:.6f} {received:.6f}\n".encode())
