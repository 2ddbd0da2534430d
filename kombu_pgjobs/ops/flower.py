"""Queue lengths in Flower for pgjobs, with nothing to install in the app.

Flower's broker page and its queue-length API (``/api/queues/length``) ask a broker client chosen
by the broker URL's scheme; for anything but RabbitMQ and Redis they answer 404 ("broker is not
supported"). :func:`register` teaches Flower's factory the ``pgjobs`` scheme: the client reads
the queues' counts from Postgres (``pgjobs_job``, ``pgjobs_consumer``) on a thread, so Flower's
event loop never waits on the database.

What Flower shows for each queue Flower knows (the active queues of its workers, else the app's
``task_default_queue`` and ``task_queues``): ``Messages`` = ready + delayed + running + waiting,
``Unacked`` = running (claimed and leased, prefetched ones included), ``Ready`` = ready (due
now), ``Consumers`` = worker processes consuming it (as their keepers last reported), ``Idle
since``: empty.

Registered by the import hook that registers the ``pgjobs`` URL scheme (``_alias.py``, run at
interpreter start by ``kombu_pgjobs.pth``): when ``flower.utils.broker`` is imported, by
``celery -A app flower`` or any other way of starting Flower, its factory learns the scheme, so
an app that only changed ``broker_url`` gets it. Imports neither Flower nor Celery itself.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from ..options import TransportOptions
from ..store.admin import Admin
from ..store.database import connect, conninfo_from_url

__all__ = ["SCHEMES", "PgJobsFlowerBroker", "queue_lengths", "register"]

SCHEMES = ("pgjobs",)


def queue_lengths(conninfo: str, schema: str, names: list[str]) -> list[dict[str, Any]]:
    """Flower's queue rows for ``names`` (blocking: run it on a thread)."""
    with connect(conninfo, prepare=False) as conn:
        admin = Admin(conn, schema)
        stats = {q["queue"]: q for q in admin.queues(minutes=1)}
        consumers: dict[str, int] = {}
        for w in admin.workers(leases=0):
            for q in (w.get("queues") or []) if w.get("alive") else []:
                consumers[q] = consumers.get(q, 0) + 1
    rows = []
    for name in names:
        q = stats.get(name) or {}
        ready, running = int(q.get("ready") or 0), int(q.get("running") or 0)
        total = ready + running + int(q.get("delayed") or 0) + int(q.get("waiting") or 0)
        rows.append({"name": name, "messages": total, "messages_ready": ready,
                     "messages_unacknowledged": running, "consumers": consumers.get(name, 0),
                     "idle_since": None})
    return rows


class PgJobsFlowerBroker:
    """Flower's broker client for ``pgjobs://`` URLs (the ``queues(names)`` coroutine)."""

    def __init__(self, broker_url: str, *_: Any, broker_options: Any = None, **__: Any) -> None:
        options = TransportOptions.parse(broker_options or {}, warn=False)
        self.schema = options.schema
        self.conninfo = conninfo_from_url(broker_url, options)

    async def queues(self, names: Any) -> list[dict[str, Any]]:
        return await asyncio.to_thread(queue_lengths, self.conninfo, self.schema, list(names))


def register(module: Any = None) -> bool:
    """Teach Flower's broker factory (``flower.utils.broker.Broker``) the pgjobs scheme
    (idempotent). False when Flower is not imported in this process (nothing to do)."""
    module = module or sys.modules.get("flower.utils.broker")
    factory = getattr(module, "Broker", None)
    if factory is None:
        return False
    if getattr(factory, "_pgjobs", False):
        return True
    original = factory.__new__

    def __new__(cls: Any, broker_url: str, *args: Any, **kwargs: Any) -> Any:
        if broker_url.split(":", 1)[0] in SCHEMES:
            return PgJobsFlowerBroker(broker_url, *args, **kwargs)
        return original(cls, broker_url, *args, **kwargs)

    factory.__new__ = __new__
    factory._pgjobs = True
    return True
