"""Batch publish paths. The default is Celery's own ``group(...).apply_async()``.

A broker may have a faster helper (e.g. one multi-row INSERT for pgjobs). Plug one in with
``--batch-helper BROKER=module:function``; the function is called as
``function(app, signatures)`` and must publish every signature before it returns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

from celery import Celery, group
from celery.canvas import Signature

BatchPublisher = Callable[[Celery, Sequence[Signature]], object]


def group_publish(app: Celery, signatures: Sequence[Signature]) -> None:
    group(list(signatures), app=app).apply_async()


def load(spec: str | None) -> tuple[str, BatchPublisher]:
    """Return (label, callable) for ``module:function``, or the group path for None."""
    if not spec:
        return "group", group_publish
    module_name, _, func_name = spec.partition(":")
    if not func_name:
        raise ValueError(f"batch helper {spec!r} is not module:function")
    func = getattr(importlib.import_module(module_name), func_name)
    if not callable(func):
        raise ValueError(f"batch helper {spec!r} is not callable")
    return spec, func
