"""kombu-pgjobs: a Celery-compatible kombu transport on PostgreSQL.

``broker_url = "pgjobs://user@host/db"`` selects it; importing this package (or the ``.pth``
hook installed with it) registers the ``pgjobs`` scheme with kombu.
"""

from __future__ import annotations

from . import _alias
from .errors import PgJobsError

__all__ = ["PgJobsError", "__version__"]
__version__ = "0.1.0"

_alias.register()
