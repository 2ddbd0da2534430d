"""``celery inspect scheduled`` answered from Postgres, with nothing to install in the app.

On Redis and RabbitMQ a worker holds every countdown/ETA task it received in memory until it is
due, and ``inspect scheduled`` lists them. On pgjobs an ETA task waits in Postgres (not in any
worker), so Celery's own answer is empty. This module replaces the command (and its alias
``dump_schedule``): a worker on pgjobs answers with the delayed messages of the queues it consumes,
read from ``pgjobs_job`` (soonest first, at most :data:`LIMIT`), in Celery's shape
(``{"eta", "priority", "request": {"id", "name", "args", "kwargs", "type", "hostname",
"time_start", "acknowledged", "delivery_info", "worker_pid"}}``), followed by whatever Celery
itself holds in memory. ``hostname``, ``time_start`` and ``worker_pid`` are None: no worker has
the message yet.

Several workers that consume the same queue each list the same messages (any of them may run
it); dashboards that add up the replies count such a task once per worker. A worker on another
broker answers as Celery does.

Installed by the import hook that registers the ``pgjobs`` URL scheme (``_alias.py``): when
Celery imports ``celery.worker.control``, :func:`install` is handed that module and replaces the
command in its ``Panel``, so a worker of an app that only changed ``broker_url`` answers from
Postgres. kombu_pgjobs never imports Celery itself: the hook runs only in a process where Celery
is being imported anyway, and works on the module it is given.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["LIMIT", "install", "scheduled"]

#: the most delayed messages one reply lists
LIMIT = 1000

#: Celery's own ``scheduled`` command (what workers hold in memory), kept by :func:`install`
_celery_scheduled: Any = None


def _queues(consumer: Any) -> list[str]:
    task_consumer = getattr(consumer, "task_consumer", None)
    return sorted({q.name for q in getattr(task_consumer, "queues", None) or ()})


def _entry(queue: str, priority: int, run_at: Any, headers: Any, info: Any) -> dict[str, Any]:
    headers = headers if isinstance(headers, dict) else {}
    info = info if isinstance(info, dict) else {}
    return {
        "eta": run_at.isoformat(),
        "priority": priority,
        "request": {
            "id": headers.get("id"), "name": headers.get("task"),
            "args": headers.get("argsrepr"), "kwargs": headers.get("kwargsrepr"),
            "type": headers.get("task"), "hostname": None, "time_start": None,
            "acknowledged": False,
            "delivery_info": {"exchange": info.get("exchange", ""),
                              "routing_key": info.get("routing_key", queue),
                              "priority": priority, "redelivered": False},
            "worker_pid": None,
        },
    }


def scheduled(state: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """List of currently scheduled ETA/countdown tasks (on pgjobs: read from Postgres)."""
    held = list(_celery_scheduled(state, **kwargs)) if _celery_scheduled else []
    consumer = state.consumer
    connection = getattr(consumer, "connection", None)
    transport = getattr(connection, "transport", None)
    queues = _queues(consumer)
    # not loaded: this worker is not on pgjobs
    ours = sys.modules.get("kombu_pgjobs.broker.transport")
    if ours is None or not isinstance(transport, ours.Transport) or not queues:
        return held
    # imported here: this module is loaded into every Celery worker, on pgjobs or not
    import psycopg

    from ..errors import DatabaseUnavailable
    from ..events import log_event, one_line

    # each database of a shard map lists its own queues' ETA rows
    shards = transport.shards
    by_backend: dict[int, tuple[Any, list[str]]] = {}
    for queue in queues:
        backend = transport.backend if shards is None else shards.backend_of(queue)
        by_backend.setdefault(id(backend), (backend, []))[1].append(queue)
    rows: list[Any] = []
    for backend, names in by_backend.values():
        try:
            rows += backend.publishing(lambda c, b=backend, n=names: c.execute(
                b.core.q["scheduled_list"], {"queues": n, "limit": LIMIT}).fetchall())
        except (DatabaseUnavailable, psycopg.OperationalError) as exc:
            if backend is transport.backend:
                raise  # the default database: the reply is the error, as for any command
            # a shard that is down: the others' ETA tasks are listed (PGJ-217)
            log_event("pgjobs.shard.unavailable", what="inspect scheduled",
                      queues=",".join(names), error=one_line(exc))
    if len(by_backend) > 1:
        rows.sort(key=lambda r: r[3])  # soonest first across databases
    return [_entry(queue, priority, run_at, headers, info)
            for _, queue, priority, run_at, headers, info in rows[:LIMIT]] + held


def install(control: Any) -> None:
    """Replace the ``scheduled`` inspect command (and ``dump_schedule``) in the ``Panel`` of
    ``control`` (the module ``celery.worker.control``); idempotent, process-wide."""
    global _celery_scheduled
    data = control.Panel.data
    current = data.get("scheduled")
    if current is scheduled:
        return
    _celery_scheduled = current
    data["scheduled"] = scheduled
    if data.get("dump_schedule") is current:
        data["dump_schedule"] = scheduled
