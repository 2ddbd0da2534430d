"""kombu-pgjobs: a Celery-compatible kombu transport on PostgreSQL.

``broker_url = "pgjobs://user@host/db"`` selects it; importing this package (or the ``.pth``
hook installed with it) registers the ``pgjobs`` scheme with kombu. The package itself stays
light: the ``.pth`` hook imports it at every interpreter start.
"""

from __future__ import annotations

from . import _alias

__all__ = ["__version__"]
__version__ = "0.1.0"

_alias.register()
