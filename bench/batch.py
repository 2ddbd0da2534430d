"""Batch publish paths. The default is Celery's own ``group(...).apply_async()``.

For pgjobs, when ``kombu_pgjobs`` exposes ``batch()`` (a context manager that holds every
publish of the block and inserts them in one statement when it exits), the batch path is the
same ``group(...).apply_async()`` inside ``with kombu_pgjobs.batch():``. Any broker's path
can be replaced with ``--batch-helper BROKER=module:function``; the function is called as
``function(app, signatures)`` and must have published every signature when it returns
(``--batch-helper pgjobs=bench.batch:group_publish`` forces the plain group for pgjobs).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from celery import Celery, group
from celery.canvas import Signature

BatchPublisher = Callable[[Celery, Sequence[Signature]], object]


def group_publish(app: Celery, signatures: Sequence[Signature]) -> None:
    group(list(signatures), app=app).apply_async()


def pgjobs_batch(app: Celery, signatures: Sequence[Signature]) -> None:
    """The group inside ``kombu_pgjobs.batch()``: one INSERT, durable when the block exits."""
    import kombu_pgjobs

    with kombu_pgjobs.batch():
        group_publish(app, signatures)


def default_spec(scheme: str) -> str | None:
    """The built-in batch path for a broker URL scheme, when it has one here."""
    if scheme == "pgjobs":
        try:
            import kombu_pgjobs
        except ImportError:
            return None
        if callable(getattr(kombu_pgjobs, "batch", None)):
            return "bench.batch:pgjobs_batch"
    return None


def load(spec: str | None) -> tuple[str, BatchPublisher]:
    """Return (label, callable) for ``module:function``, or the group path for None."""
    if not spec or spec == "bench.batch:group_publish":
        return "group", group_publish
    if spec == "bench.batch:pgjobs_batch":
        return "kombu_pgjobs.batch() + group", pgjobs_batch
    module_name, _, func_name = spec.partition(":")
    if not func_name:
        raise ValueError(f"batch helper {spec!r} is not module:function")
    func = getattr(importlib.import_module(module_name), func_name)
    if not callable(func):
        raise ValueError(f"batch helper {spec!r} is not callable")
    return spec, func
