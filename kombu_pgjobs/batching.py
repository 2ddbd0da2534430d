"""Batch publishing: many publishes, one INSERT.

Inside ``with kombu_pgjobs.batch():`` every message this thread publishes through pgjobs (kombu
``Producer.publish``, Celery ``delay``/``apply_async``, ``group(...).apply_async()``) is held and
inserted in one statement per database when the block exits — durable when the block returns.
If the block raises, nothing is published. Fanout publishes (remote control) are not batched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .core import NewJob

__all__ = ["batch", "pending"]

_local = threading.local()


def pending(backend: Any) -> list[NewJob] | None:
    """The jobs held for ``backend`` on this thread, or None outside a batch."""
    held: dict[Any, list[NewJob]] | None = getattr(_local, "held", None)
    if held is None:
        return None
    return held.setdefault(backend, [])


@contextmanager
def batch() -> Iterator[None]:
    if getattr(_local, "held", None) is not None:  # nested: the outer block publishes
        yield
        return
    _local.held = {}
    try:
        yield
    except BaseException:
        _local.held = None
        raise
    held, _local.held = _local.held, None
    for backend, jobs in held.items():
        if jobs:
            backend.publishing(lambda conn, b=backend, j=jobs: b.core.publish_many(conn, j))
