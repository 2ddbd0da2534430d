"""kombu-pgjobs: a Celery-compatible kombu transport on PostgreSQL.

``broker_url = "pgjobs://user@host/db"`` selects it; importing this package (or the ``.pth``
hook installed with it) registers the ``pgjobs`` scheme with kombu. The ``.pth`` hook imports
this package at every interpreter start, so everything else is imported lazily.

PYTEST_DONT_REWRITE: the package ships a pytest plugin (``kombu_pgjobs.pytest``), so pytest
marks it for assertion rewriting, and warns when it finds it imported already (by the ``.pth``
hook); that marker tells pytest this module is not to be rewritten.
"""

from __future__ import annotations

from . import _alias

__all__ = ["__version__", "batch"]
__version__ = "0.1.0"

_alias.register()


def __getattr__(name: str) -> object:
    if name == "batch":
        from .broker.batching import batch
        return batch
    raise AttributeError(name)
