"""Queue lengths in Flower for pgjobs: now in :mod:`kombu_pgjobs.ops.flower`, registered with no
step by the hook that registers the ``pgjobs`` URL scheme. Kept so imports of this module
(and ``celery_ext.flower.register()``) go on working."""

from __future__ import annotations

from kombu_pgjobs.ops.flower import SCHEMES, PgJobsFlowerBroker, queue_lengths, register

__all__ = ["SCHEMES", "PgJobsFlowerBroker", "queue_lengths", "register"]
