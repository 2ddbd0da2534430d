"""The pgjobs operator dashboard: queues, messages, dead letters, limits, workers, tenants,
schedules and webhooks as web pages.

An optional part (``pip install 'kombu-pgjobs[dashboard]'``): a Starlette app with Jinja2
templates, served by ``pgjobs dashboard`` (uvicorn) or mounted under a prefix in an existing
ASGI app. Every page reads through :class:`kombu_pgjobs.store.admin.Admin` (schedules and webhooks
through their stores), the same statements the CLI runs, but for the overview's page of queues
(``overview.sql``: the CLI never pages over queues). It is read-only unless started with
``write=True`` and a write token, and open to read unless given a read token (see
:mod:`.security`). Importing this package imports no web framework: :func:`create_app` does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(dsn: str, **options: Any) -> Any:
    """The dashboard as an ASGI app (see :func:`kombu_pgjobs.ops.dashboard.factory.create_app`)."""
    from .factory import create_app as make

    return make(dsn, **options)
