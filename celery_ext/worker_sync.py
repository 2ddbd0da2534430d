"""Worker sync (mingle) and gossip on pgjobs.

Celery turns both off for every broker but RabbitMQ and Redis (its bootsteps check the
transport's ``driver_type``), so a worker that restarts forgets the revokes its neighbours know
about. Both need only a fanout exchange and remote control, which pgjobs has (bindings in
Postgres): celery_ext adds pgjobs (``driver_type`` ``postgresql``) to the transports they accept.
``--without-mingle`` and ``--without-gossip`` still turn them off.
"""

from __future__ import annotations

from celery.worker.consumer.gossip import Gossip
from celery.worker.consumer.mingle import Mingle

from kombu_pgjobs.transport import Transport

__all__ = ["enable_worker_sync"]


def enable_worker_sync() -> None:
    """Let Celery's Mingle and Gossip bootsteps run on pgjobs (idempotent, process-wide)."""
    for step in (Mingle, Gossip):
        if Transport.driver_type not in step.compatible_transports:
            step.compatible_transports = {*step.compatible_transports, Transport.driver_type}
