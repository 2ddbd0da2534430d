"""Worker sync (mingle) and gossip on pgjobs.

Celery turns both off for every broker but RabbitMQ and Redis (its bootsteps check the
transport's ``driver_type``), so a worker that restarts forgets the revokes its neighbours know
about. Both need only a fanout exchange and remote control, which pgjobs has (bindings in
Postgres): celery_ext adds pgjobs (``driver_type`` ``postgresql``) to the transports they accept.
``--without-mingle`` and ``--without-gossip`` still turn them off.

Better than mingle: the revokes pgjobs keeps in Postgres (see :mod:`kombu_pgjobs.store.revoke`) are
loaded by every starting worker (:func:`load_revokes`), so they survive a restart of the whole
fleet, which mingle (asking the workers that are up) cannot.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.worker.consumer.gossip import Gossip
from celery.worker.consumer.mingle import Mingle

from kombu_pgjobs.broker.backend import set_identity
from kombu_pgjobs.broker.transport import Transport
from kombu_pgjobs.events import one_line

from .state import installed

__all__ = ["enable_worker_sync", "load_revokes", "name_worker"]

log = logging.getLogger("celery_ext")


def enable_worker_sync() -> None:
    """Let Celery's Mingle and Gossip bootsteps run on pgjobs (idempotent, process-wide)."""
    for step in (Mingle, Gossip):
        if Transport.driver_type not in step.compatible_transports:
            step.compatible_transports = {*step.compatible_transports, Transport.driver_type}


def name_worker(sender: Any = None, **_: Any) -> None:
    """``worker_init``: the worker's leases, its ``pgjobs_consumer`` row (``pgjobs workers``,
    the dashboard) and its counter shard name its Celery node (``-n``, ``celery@host``), its
    PID and an incarnation id (a restarted process that reuses a PID is another worker)."""
    app = getattr(sender, "app", None)
    hostname = getattr(sender, "hostname", None)
    if app is not None and installed(app) and isinstance(hostname, str) and hostname:
        set_identity(hostname)


def load_revokes(sender: Any = None, **_: Any) -> None:
    """``worker_init``: put the revokes pgjobs kept in Postgres (``pgjobs_revoked``: every
    ``celery control revoke`` broadcast of the last three hours) into the starting worker's
    revoked set, so a revoked message still in the queue is discarded (and acked) by whichever
    worker claims it, even after every worker restarted. Only for apps with celery_ext
    installed whose broker is pgjobs; a database that cannot be read is logged, not fatal (the
    worker then knows what mingle tells it)."""
    app = getattr(sender, "app", None)
    if app is None or not installed(app):
        return
    try:
        with app.connection_for_read() as conn:
            transport = conn.transport
            if not isinstance(transport, Transport):
                return
            backend = transport.backend
            rows = backend.publishing(lambda c: backend.core.revoked(c))
    except Exception as exc:  # the worker starts anyway; Celery reconnects to the broker
        log.warning("celery_ext: revokes kept in Postgres could not be read: %s",
                    one_line(exc))
        return
    from celery.worker import state

    for task_id, _left in rows:
        state.revoked.add(task_id)
    if rows:
        log.info("celery_ext: %d revoked task ids loaded from Postgres", len(rows))
