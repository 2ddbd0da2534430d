"""``celery_ext.on_settled``: sent once per message whose outcome is final in Postgres.

Celery's ``task_success`` and ``task_failure`` are sent before the message is acked, so a receiver
cannot know the outcome is final: the ack may never land (the worker dies first, or the lease was
lost and another worker runs the message again). ``on_settled`` is sent once the fenced settle
committed *and* the run's outcome is known, with ``outcome`` one of the words ``pgjobs queues``,
the metrics and the dashboard use:

* ``completed``: the task returned, and its ack deleted the row;
* ``failed``: it failed for good — an exception once its retries were spent (celery_ext keeps
  it as a dead letter), ``Reject(requeue=False)``, a malformed message — and the message is
  settled (acked, or dead-lettered by the transport);
* ``dropped``: it failed for good with ``dead_letter=False``: settled, nothing kept;
* ``cancelled``: an operator cancelled it while it ran (``celery_ext.cancel``, ``pgjobs
  cancel``, the dashboard) and its message became a dead letter with reason ``cancelled``;
* ``requeued``: a requeue put it back to ready (``Reject(requeue=True)``,
  ``task_reject_on_worker_lost``).

Never for a retry (``self.retry``, ``autoretry_for``: the retry is the same task's next message,
and that one settles in its turn), never for a settle that missed its fence (a stale ack after a
lost lease), never for a warm shutdown's hand-back of unstarted messages, at most once per
message delivery. With Celery's early ack (``acks_late=False``) the ack lands when the task
starts: the signal waits for the outcome. A message that never reaches a worker's settle (its
lease lapsed on the final attempt and a keeper buried it, a queued message cancelled) has no
``on_settled``: ``pgjobs queues`` and the history count those (``failed``, ``cancelled``).

Arguments: ``sender`` (the task name), ``outcome``, ``task_id``, ``job_id``, ``attempts`` (the
delivery's claim number: 1 for a first delivery), ``retries`` (Celery's) and ``tenant`` (its
``x-pgjobs-tenant``, or None). It is sent in the process that holds the lease (a prefork
worker's main process), on the thread that settled or that learned the outcome: keep receivers
short and thread-safe. A receiver that raises is logged by Celery and changes nothing. Tasks
whose class is not celery_ext's (``celery_ext.install(app)``, or ``base=celery_ext.Task``) give
``completed`` for every ack: their outcome is not known to the transport.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from billiard.exceptions import Terminated
from celery.exceptions import Reject, Retry
from celery.utils.dispatch import Signal
from celery.worker.request import Request

from kombu_pgjobs.broker.backend import add_settle_listener
from kombu_pgjobs.broker.transport import parse_shard_tag
from kombu_pgjobs.store.core import TENANT_HEADER

__all__ = ["OutcomeRequest", "on_settled", "start_telling"]

log = logging.getLogger(__name__)

on_settled = Signal(
    name="on_settled",
    providing_args={"outcome", "task_id", "job_id", "attempts", "retries", "tenant"})

#: the transport's settle (kombu_pgjobs.broker.backend) -> on_settled's word, for settles that are
#: outcomes by themselves; an ack waits for the run's outcome
_SETTLED = {"requeued": "requeued", "dead": "failed", "cancelled": "cancelled"}
#: the most runs remembered while their ack or their outcome is still to come
_MAX_RUNS = 100_000
#: delivery (job id, claim) -> [the run's outcome or None, the landed ack's headers or None],
#: in the process that holds the lease; runs of celery_ext's tasks only (OutcomeRequest). By
#: delivery, not task id: a retry's message (the same task id) may arrive before the retried
#: one's ack lands
_runs: dict[tuple[int, int], list[Any]] = {}
_runs_lock = threading.Lock()


def _send(outcome: str, task_id: str, job_id: int, claim: int,
          headers: dict[str, Any]) -> None:
    on_settled.send(sender=headers.get("task"), outcome=outcome, task_id=task_id,
                    job_id=job_id, attempts=claim, retries=headers.get("retries"),
                    tenant=headers.get(TENANT_HEADER))


def _tell(settled: str, job_id: int, claim: int, headers: dict[str, Any]) -> None:
    """The transport's settle listener: a fenced settle of this delivery committed."""
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not on_settled.receivers:
        return  # not a Celery task message (remote control, events), or nobody listens
    key = (job_id, claim)
    if settled != "acked":
        with _runs_lock:
            _runs.pop(key, None)
        _send(_SETTLED.get(settled, settled), task_id, job_id, claim, headers)
        return
    with _runs_lock:
        run = _runs.get(key)
        if run is None:  # not a celery_ext task: its outcome is not known here
            outcome = "completed"
        elif run[0] is None:  # early ack: the run goes on; sent when it ends
            run[1] = headers
            return
        else:
            outcome = _runs.pop(key)[0]
    if outcome != "retried":
        _send(outcome, task_id, job_id, claim, headers)


def _ran(key: tuple[int, int] | None, outcome: str) -> None:
    """The run of delivery ``key`` ended as ``outcome`` (OutcomeRequest, in the process that
    holds the lease): sent now if its ack already landed (early ack), else when it lands."""
    if key is None:
        return
    with _runs_lock:
        run = _runs.get(key)
        if run is None:
            return
        if run[1] is None:
            run[0] = outcome
            return
        del _runs[key]
    if outcome != "retried":
        headers = run[1]
        _send(outcome, headers.get("id"), key[0], key[1], headers)


class OutcomeRequest(Request):
    """celery_ext's task request (``PgJobsTask.Request``): in the worker's main process, it
    notes how each run ended, for :data:`on_settled`'s outcome."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        found = parse_shard_tag(getattr(self.message, "delivery_tag", None))
        self._delivery: tuple[int, int] | None = found[:2] if found else None
        if not on_settled.receivers or self._delivery is None:
            return
        with _runs_lock:
            if len(_runs) >= _MAX_RUNS:
                _runs.pop(next(iter(_runs)))
            _runs.setdefault(self._delivery, [None, None])
        # The worker builds a subclass of this class per task whose on_success does not call
        # ours (celery.worker.request.create_request_cls); the pool is given the bound method
        # self.on_success, so an instance attribute sees every run that returned.
        succeeded = self.on_success

        def on_success(failed__retval__runtime: Any, **kw: Any) -> Any:
            if not failed__retval__runtime[0]:  # a failure goes on to on_failure
                _ran(self._delivery, "completed")
            return succeeded(failed__retval__runtime, **kw)

        self.on_success = on_success  # type: ignore[method-assign]

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft:  # the hard limit killed the run (a soft one raises: on_failure)
            _ran(self._delivery, "failed" if getattr(self.task, "dead_letter", True) else "dropped")
        return super().on_timeout(soft, timeout)

    def on_retry(self, exc_info: Any) -> Any:
        _ran(self._delivery, "retried")
        self._tell_transport("requeued")
        return super().on_retry(exc_info)

    def _tell_transport(self, outcome: str) -> None:
        """Tell the message's backend how this run ended, for its counters and history
        (kombu_pgjobs.store.history): with acks_late the ack that follows carries the word; an early
        ack already landed (counted ``completed`` when the run started), so its history row is
        amended (one statement). Never raises."""
        from kombu_pgjobs.store.history import record_outcome

        from .deadletter import _backend, queue_of

        found = parse_shard_tag(getattr(self.message, "delivery_tag", None))
        if found is None:
            return
        try:
            backend = _backend(self.task.app, found[2])
            if backend is None:
                return
            if self.task.acks_late:
                backend.note_outcome(found[:2], outcome)
            else:
                queue = queue_of(self.task, self.delivery_info)
                began = self.time_start
                elapsed = time.time() - began if began else None
                backend.publishing(lambda conn: record_outcome(
                    conn, backend.options.schema, job=found[:2], outcome=outcome,
                    queue=queue, shard=backend.worker, task=self.task.name, elapsed=elapsed))
        except Exception:  # the task's own outcome stands; only the record is off
            log.exception("celery_ext.outcome.not_told id=%s", self.id)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True,
                   return_ok: bool = False) -> Any:
        exc = exc_info.exception
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        if isinstance(exc, (Reject, Retry)):
            pass  # the transport's requeue or dead letter says it; a retry is on_retry's
        elif isinstance(exc, Terminated):
            pass  # revoked (a cancel: the transport says cancelled) or a lost lease (nothing)
        else:
            _ran(self._delivery, "failed" if getattr(self.task, "dead_letter", True) else "dropped")
        return super().on_failure(exc_info, send_failed_event=send_failed_event,
                                  return_ok=return_ok)


def start_telling() -> None:
    """Register with the transport (idempotent; every pgjobs backend of the process)."""
    add_settle_listener(_tell)
