"""Batch publishing: many publishes, one INSERT.

Inside ``with kombu_pgjobs.batch():`` every message this thread publishes through pgjobs (kombu
``Producer.publish``, Celery ``delay``/``apply_async``, ``group(...).apply_async()``) is held and
inserted in one statement per database when the block exits — durable when the block returns.
If the block raises, nothing is published. A block nested in another joins it (the outer one
inserts); a nested block that raises takes back what it held, the outer one's stays. Fanout
publishes (remote control) are not batched.

Messages with an idempotency key are answered per message: ``with batch() as b:`` gives a
:class:`Batch` whose :attr:`Batch.duplicates` maps, once the block has exited, the task id of
each message that inserted nothing (its key was held by a live message, or by an earlier
message of the same batch) to the task id of the holder. Inside the block, ``apply_async``
returns the ``AsyncResult`` of the message it built: the batch has not been sent yet. A tenant
over its queue cap (``TenantQueueFull``) fails the whole batch of that database: nothing of it
is written.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..store.core import NewJob

__all__ = ["Batch", "batch", "capture", "pending"]

_local = threading.local()


def pending(backend: Any) -> list[NewJob] | None:
    """The jobs held for ``backend`` on this thread, or None outside a batch."""
    held: dict[Any, list[NewJob]] | None = getattr(_local, "held", None)
    if held is None:
        return None
    return held.setdefault(backend, [])


@dataclass
class Batch:
    """What a ``batch()`` block published, filled when it exits."""

    #: messages inserted
    inserted: int = 0
    #: task id of a message that inserted nothing (a duplicate idempotency key) -> the task id
    #: of the live message holding its key (None: the key was taken and freed again meanwhile;
    #: publish it again)
    duplicates: dict[str | None, str | None] = field(default_factory=dict)


@contextmanager
def batch() -> Iterator[Batch]:
    result = Batch()
    outer: Batch | None = getattr(_local, "result", None)
    held: dict[Any, list[NewJob]] | None = getattr(_local, "held", None)
    if held is not None:  # nested: the outer block publishes
        marks = {backend: len(jobs) for backend, jobs in held.items()}
        try:
            yield outer if outer is not None else result
        except BaseException:
            # A nested block that raises takes its own messages back, so an outer block that
            # catches the error and goes on publishes none of them (a batched group stays
            # all or none inside an outer batch too).
            for backend, jobs in held.items():
                del jobs[marks.get(backend, 0):]
            raise
        return
    _local.held = {}
    _local.result = result
    try:
        yield result
    except BaseException:
        _local.held = _local.result = None
        raise
    held, _local.held, _local.result = _local.held, None, None
    for backend, jobs in held.items():
        if jobs:
            outcomes = backend.publishing(
                lambda conn, b=backend, j=jobs: b.core.publish_batch(conn, j))
            for o in outcomes:
                if o is None or o.inserted:
                    result.inserted += 1
                else:
                    result.duplicates[o.task_id] = o.holder_task_id


@contextmanager
def capture() -> Iterator[list[NewJob]]:
    """Hold what this thread publishes through pgjobs and publish none of it: the block gets
    the list of messages, built exactly as the transport builds them (routing, headers,
    validation), for a caller that inserts them itself in a statement of its own (the
    scheduler inserts a fire's message with its fence). Not nestable in a batch."""
    if getattr(_local, "held", None) is not None:
        raise RuntimeError("kombu_pgjobs capture() inside a batch() or capture() block")
    _local.held = {}
    jobs: list[NewJob] = []
    try:
        yield jobs
    finally:
        held, _local.held, _local.result = _local.held, None, None
        for backend_jobs in held.values():
            jobs.extend(backend_jobs)
