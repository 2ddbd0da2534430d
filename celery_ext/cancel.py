"""Running work under control: a cancel that stops a run, a lost lease that ends it.

``celery_ext.cancel(task_id)`` (like ``pgjobs cancel --task-id`` and the dashboard's cancel)
cancels a Celery task wherever it is:

* **queued** (ready, delayed, waiting on a limit): its message moves to the dead letters with
  reason ``cancelled`` at once (kept: ``pgjobs dead requeue`` brings it back) and never runs;
  ``celery_ext.cancel`` also stores REVOKED in the app's result backend (``pgjobs cancel`` and
  the dashboard cannot: they have no app; with ``pgjobs cancel -A app`` it does);
* **running**: the message is marked, every worker's keeper renews at once (a wake-up on the
  schema's channel that names nothing), and the holder learns it from its renewal. The run
  listener below (registered in every worker of an app with ``celery_ext.install``) ends it:

  =================  ===========================================================================
  pool               how the run ends
  =================  ===========================================================================
  prefork            the child running it is terminated (SIGTERM: what Celery's
                     ``revoke(terminate=True)`` does), within a second or two of the cancel;
                     Celery stores REVOKED
  gevent, eventlet   its green thread is killed (the pool's ``terminate_job``); REVOKED
  threads, solo      a thread cannot be stopped from outside: the run is *flagged*.
                     ``celery_ext.cancelled()`` turns true in the task body and
                     ``celery_ext.checkpoint()`` raises :class:`Cancelled` there, which ends the
                     run as REVOKED. A body that never checks runs to its end.
  =================  ===========================================================================

  Either way its message then goes to the dead letters as ``cancelled`` (the ack of a run its
  holder knows was cancelled is a dead-lettering), never runs again, and a prefetched copy not
  yet started is revoked when Celery reaches it.

**A lost lease ends the run the same way** (issue 30, item 2). When the keeper's renewal finds
that a message it holds is no longer its own — the lease lapsed while this process could not
renew (it was frozen, or cut off from the database alone) and a keeper rescued it — the run is
ended at once (terminated, killed or flagged as above; no result is stored for it: the message
is another worker's now). So at most one run of a message is alive once its first holder
reaches the database again. Both are logged as ``pgjobs.run.stopped`` (``PGJ-216``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from celery import signals
from celery.exceptions import Ignore

from kombu_pgjobs.admin import Admin
from kombu_pgjobs.backend import add_run_listener, cut_off, release_all
from kombu_pgjobs.database import connect, conninfo_from_url
from kombu_pgjobs.events import log_event
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.transport import parse_shard_tag

__all__ = ["Cancelled", "cancel", "cancelled", "checkpoint", "start_stopping"]

#: the worker's consumer (its pool), captured when it is ready
_consumer: Any = None
#: task ids whose run was flagged (a pool that cannot stop it from outside): why, by task id
_flagged: dict[str, str] = {}
_flagged_lock = threading.Lock()


class Cancelled(Exception):
    """Raised by :func:`checkpoint` in a task body whose run was cancelled (an operator) or
    whose lease was lost: the run ends (REVOKED for a cancel; nothing stored for a lost lease)."""

    def __init__(self, why: str = "cancelled") -> None:
        self.why = why
        super().__init__({"cancelled": "the run was cancelled",
                          "shutdown": "the run was cut off by a cold shutdown"}.get(
                              why, "the run was ended: its lease was lost"))


def _current_task_id() -> str | None:
    from celery import current_task

    task = current_task
    request = getattr(task, "request", None) if task else None
    task_id = getattr(request, "id", None)
    return task_id if isinstance(task_id, str) else None


def cancelled() -> bool:
    """Whether the current task's run was cancelled or lost its lease (threads, solo: the
    pools whose runs are flagged, not terminated). False outside a task."""
    task_id = _current_task_id()
    return task_id is not None and task_id in _flagged


def checkpoint() -> None:
    """Raise :class:`Cancelled` if the current run was cancelled or lost its lease; call it
    between steps of a long task body (threads and solo pools: see the module doc)."""
    task_id = _current_task_id()
    why = _flagged.get(task_id) if task_id is not None else None
    if why is not None:
        raise Cancelled(why)


def ended(task: Any, exc: Cancelled) -> Ignore:
    """What the task base does with :class:`Cancelled`: a cancel stores REVOKED, a lost lease
    nothing; either way Celery acks (the transport dead-letters a cancelled message, and the
    ack of a lost lease misses its fence)."""
    task_id = task.request.id
    with _flagged_lock:
        _flagged.pop(task_id, None)
    if exc.why == "cancelled" and not task.request.called_directly:
        task.backend.mark_as_revoked(task_id, "cancelled", request=task.request)
    return Ignore()


def cancel(task_ids: str | Iterable[str], *, app: Any = None) -> dict[str, Any]:
    """Cancel Celery tasks by id wherever they are (see the module doc). Returns
    ``{"cancelled": [task ids dead-lettered while queued], "stopping": [task ids running,
    their holders told]}``. Raises ``NotFound`` (``PGJ-402``) for an id with no live message."""
    from celery import current_app

    app = app or current_app._get_current_object()
    ids = [task_ids] if isinstance(task_ids, str) else list(task_ids)
    options = TransportOptions.parse(app.conf.broker_transport_options or {}, warn=False)
    url = app.conf.broker_write_url or app.conf.broker_url
    with connect(conninfo_from_url(url, options), prepare=False) as conn:
        admin = Admin(conn, options.schema)
        admin.check_schema()
        result = admin.cancel([], task_ids=ids)
    queued = [t for t, i in result["by_task"].items() if i in result["cancelled"]]
    for task_id in queued:
        app.backend.mark_as_revoked(task_id, "cancelled")
    return {"cancelled": sorted(queued),
            "stopping": sorted(t for t, i in result["by_task"].items()
                               if i in result["marked"])}


def _pool() -> Any:
    consumer = _consumer
    return getattr(consumer, "pool", None) if consumer is not None else None


def _can_terminate(pool: Any) -> bool:
    """Whether the pool can end a run from outside (prefork, gevent, eventlet)."""
    name = type(pool).__module__ if pool is not None else ""
    return name.endswith(("prefork", "gevent", "eventlet"))


def _stop(why: str, job_id: int, claim: int, headers: dict[str, Any]) -> None:
    """The run listener: end the run of a message an operator cancelled, or whose lease this
    process lost (on the keeper's thread)."""
    task_id = headers.get("id")
    if not isinstance(task_id, str):
        return  # not a Celery task message
    from celery.worker import state as worker_state

    pool = _pool()
    request = next((r for r in list(worker_state.active_requests) if r.id == task_id), None)
    if request is None:
        request = next((r for r in list(worker_state.reserved_requests) if r.id == task_id),
                       None)
    if why == "cancelled":
        worker_state.revoked.add(task_id)  # a copy not started yet is revoked on arrival
    if request is None or not request.time_start:
        how = "revoked" if why == "cancelled" else "skipped"
        if request is not None and why == "lost":
            request._already_revoked = True  # never started here: skipped, nothing stored
    elif _can_terminate(pool):
        how = "terminated"
        if why == "cancelled":
            request.terminate(pool, signal=signal.SIGTERM)  # Celery stores REVOKED
        else:  # the message is another worker's now: end this run, store nothing
            request._already_cancelled = True
            pool.terminate_job(request.worker_pid, signal.SIGTERM)
    else:
        how = "flagged"
        with _flagged_lock:
            _flagged[task_id] = why
    log_event("pgjobs.run.stopped", task_id=task_id, job_id=job_id, why=why, how=how)


def _worker_ready(sender: Any = None, **_: Any) -> None:
    global _consumer
    _consumer = sender


#: seconds a cold shutdown of the threads pool waits for flagged runs to reach a checkpoint,
#: after their messages went back, before the process exits without them
COLD_GRACE = 3.0
_cold = threading.Event()


def _threads_terminate_job(pool: Any, pid: Any, signal: Any = None) -> None:
    """The threads pool's ``terminate_job`` (Celery's raises NotImplementedError, which made a
    cold shutdown an unrecoverable error that then waited for every running task), when
    Celery cuts runs off (``Request.cancel``: a cold shutdown, after
    ``worker_soft_shutdown_timeout``; a revoke's terminate still raises). A thread cannot be
    stopped, so: every running or prefetched message goes back at once, uncounted (an
    interrupted run is not an attempt); a task that finished is acked (its ack waits in
    Celery's event loop, which the cold shutdown stops); every run is flagged
    (``checkpoint()`` ends it); and the process exits after :data:`COLD_GRACE` seconds whether
    or not they ended."""
    from celery.worker import state as worker_state

    if sys._getframe(1).f_code.co_name != "cancel":
        # Request.terminate (revoke --terminate): Celery's own answer for this pool stands
        raise NotImplementedError(f"{type(pool)} does not implement kill_job")
    if _cold.is_set():
        return
    _cold.set()
    # in the signal handler: what is unfinished, and the flags; the database is the thread's
    unfinished: set[tuple[int, int]] = set()
    with _flagged_lock:
        for request in [*worker_state.active_requests, *worker_state.reserved_requests]:
            _flagged[request.id] = "shutdown"
            found = parse_shard_tag(getattr(request.message, "delivery_tag", None))
            if found is not None:
                unfinished.add(found[:2])

    def exit_soon() -> None:
        handed, acked = cut_off(unfinished)
        log_event("pgjobs.run.stopped", task_id="*", job_id="*", why="shutdown",
                  how=f"{handed} handed back, {acked} finished acked; exiting in "
                      f"{COLD_GRACE:g}s")
        time.sleep(COLD_GRACE)
        release_all()  # acks of runs that ended meanwhile, the consumer row
        code = worker_state.should_terminate
        os._exit(code if isinstance(code, int) and not isinstance(code, bool) else 0)

    threading.Thread(target=exit_soon, name="celery_ext-cold-exit", daemon=True).start()


def start_stopping() -> None:
    """Register the run listener, capture the worker's pool, and give the threads pool a
    cold shutdown that ends (idempotent)."""
    from celery.concurrency import thread

    signals.worker_ready.connect(_worker_ready, weak=False, dispatch_uid="celery_ext.cancel")
    add_run_listener(_stop)
    thread.TaskPool.terminate_job = _threads_terminate_job  # type: ignore[method-assign]
