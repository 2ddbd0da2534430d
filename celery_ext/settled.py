"""``celery_ext.on_settled``: sent once per settle that landed in Postgres.

Celery's ``task_success`` and ``task_failure`` are sent before the message is acked, so a receiver
cannot know the outcome is final: the ack may never land (the worker dies first, or the lease was
lost and another worker runs the message again). ``on_settled`` is sent after the fenced
statement committed:

* ``outcome="acked"``: the ack deleted the row (the task succeeded, failed and was acked, or was
  retried: Celery's retry is a new message, and the old one is acked);
* ``outcome="requeued"``: a requeue put it back to ready (``Reject(requeue=True)``,
  ``task_reject_on_worker_lost``); on its final attempt that requeue dead-letters it instead;
* ``outcome="dead"``: a reject moved it to the dead letters (``Reject(requeue=False)``,
  ``acks_on_failure_or_timeout=False``).

Never for a settle that missed its fence (a stale ack after a lost lease), never for a warm
shutdown's hand-back of unstarted messages, at most once per settle. Arguments: ``sender`` (the
task name), ``outcome``, ``task_id``, ``job_id``, ``attempts`` (the delivery's claim number:
1 for a first delivery), ``retries`` (Celery's) and ``tenant`` (its ``x-pgjobs-tenant``, or
None). It is sent in the process that holds the lease (a prefork worker's main process), on the
thread that settled: keep receivers short and thread-safe. A receiver that raises is logged by
Celery and changes nothing.
"""

from __future__ import annotations

from typing import Any

from celery.utils.dispatch import Signal

from kombu_pgjobs.backend import add_settle_listener
from kombu_pgjobs.core import TENANT_HEADER

__all__ = ["on_settled", "start_telling"]

on_settled = Signal(
    name="on_settled",
    providing_args={"outcome", "task_id", "job_id", "attempts", "retries", "tenant"})


def _tell(outcome: str, job_id: int, claim: int, headers: dict[str, Any]) -> None:
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not on_settled.receivers:
        return  # not a Celery task message (remote control, events), or nobody listens
    on_settled.send(sender=headers.get("task"), outcome=outcome, task_id=task_id,
                    job_id=job_id, attempts=claim, retries=headers.get("retries"),
                    tenant=headers.get(TENANT_HEADER))


def start_telling() -> None:
    """Register with the transport (idempotent; every pgjobs backend of the process)."""
    add_settle_listener(_tell)
