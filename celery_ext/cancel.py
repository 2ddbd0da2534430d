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

**Shutdown with a deadline** (issue 30, item 3): Celery's soft then cold shutdown
(``worker_soft_shutdown_timeout``, SIGQUIT) cuts runs off at the deadline; their messages go back
at once, uncounted, on every pool — prefork by Celery and the transport alone; threads, solo,
gevent and eventlet through the pool patches below (Celery's own fail there: threads and solo
raise NotImplementedError, gevent and eventlet block in the hub). See docs/compatibility.md.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from celery import platforms as _platforms
from celery import signals
from celery.exceptions import Ignore

from kombu_pgjobs.broker.backend import add_run_listener, cut_off, release_all
from kombu_pgjobs.broker.transport import parse_shard_tag
from kombu_pgjobs.events import log_event
from kombu_pgjobs.options import TransportOptions
from kombu_pgjobs.store.admin import Admin
from kombu_pgjobs.store.database import connect, conninfo_from_url

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


# -- gevent and eventlet: a cold shutdown out of signal context -------------------------------
#
# Celery runs its cold shutdown (``on_cold_shutdown``: the soft shutdown's sleep, cancelling the
# consumer, ``Request.cancel`` of every running task, ``pool.stop()``) inside its SIGQUIT/SIGINT
# handler. Under a green pool that handler runs in the hub (the greenlet that waits on sockets),
# where nothing may block: gevent raised BlockingSwitchOutError at the first wait, eventlet
# "do not call blocking functions from the mainloop"; Celery called it an unrecoverable error,
# waited for every running task to end (unbounded) and acked them. So on these pools the
# signal handler only records the shutdown — from then on no task starts, the task channel
# claims nothing more (its prefetch window is closed, in memory), and a real thread bounds the
# exit — and runs Celery's handler in a greenlet of its own.

#: set (in signal context) when a cold shutdown began on a green pool: no task starts after it
_green_cold: list[bool] = []
#: the cut-off deliveries were handed back (once per process)
_green_cut: list[bool] = []
#: seconds past the soft shutdown's deadline after which a green pool's worker exits by force
#: (a task greenlet that never yields to its kill starves everything else)
GREEN_GRACE = 8.0


def _green() -> str | None:
    """"gevent" or "eventlet" when that library monkey-patched this process (a green pool)."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("socket"):
        return "gevent"
    from kombu_pgjobs.green import eventlet_patched

    return "eventlet" if eventlet_patched() else None


def _spawn(green: str, fn: Any, *args: Any) -> None:
    """Run ``fn`` in a new greenlet (never blocks: callable from the hub)."""
    if green == "gevent":
        import gevent

        gevent.spawn(fn, *args)
    else:
        import eventlet

        eventlet.spawn(fn, *args)


def _watchdog(green: str, after: float) -> None:
    """A real thread (a greenlet would starve with the rest) that ends the process ``after``
    seconds from now if it is still alive. A last resort that writes nothing to the database:
    what was not handed back by then returns when its lease lapses."""
    if green == "gevent":
        from gevent import monkey

        start = monkey.get_original("_thread", "start_new_thread")
        sleep = monkey.get_original("time", "sleep")
    else:
        from eventlet import patcher

        start = patcher.original("_thread").start_new_thread
        sleep = patcher.original("time").sleep

    def watch() -> None:
        sleep(after)
        os.write(2, f"celery_ext: the cold shutdown did not end {after:g}s after the signal: "
                    "exiting\n".encode())
        os._exit(1)

    start(watch, ())


def _close_window(consumer: Any) -> None:
    """The task channel claims nothing more: its prefetch window reads as full (in memory:
    safe in a signal handler). Celery cancels the consumer later, in the loop."""
    qos = getattr(getattr(getattr(consumer, "task_consumer", None), "channel", None), "qos",
                  None)
    if qos is not None:
        qos.can_consume = lambda: False
        qos.can_consume_max_estimate = lambda: 0


def _cancel_in_loop(task_consumer: Any) -> None:
    """Cancel the task consumer in the main greenlet only: the consumer loop's, which may be
    waiting on the claim connection's socket, where a statement from another greenlet is a
    second reader (eventlet refuses it; the connection is marked broken). From another
    greenlet — Celery's cold-shutdown handler here — the cancel is queued for the loop's next
    turn (Celery's ``call_soon``, as for its own remote-control commands). Idempotent."""
    if getattr(task_consumer.cancel, "_celery_ext_in_loop", False):
        return
    import greenlet

    real = task_consumer.cancel
    consumer = _consumer

    def in_loop() -> None:
        real()
        # Run by the loop's cycle that follows the shutdown flag (Celery's synloop runs one
        # more cycle after maybe_shutdown() raised): its drain returns at once too.
        _interrupt_drain(getattr(consumer, "connection", None))

    def cancel() -> None:
        if greenlet.getcurrent().parent is None:  # the main greenlet: the loop's
            real()
        else:
            consumer.call_soon(in_loop)

    cancel._celery_ext_in_loop = True  # type: ignore[attr-defined]
    task_consumer.cancel = cancel


def _interrupt_transport(transport: Any) -> None:
    """The transport's waiting ``drain_events`` returns now (its consumer loop's
    ``interrupt``; a transport without one waits out its timeout)."""
    interrupt = getattr(getattr(transport, "consumer", None), "interrupt", None)
    if callable(interrupt):
        interrupt()


def _interrupt_drain(connection: Any) -> None:
    """A kombu connection's waiting ``drain_events`` returns now."""
    _interrupt_transport(getattr(connection, "transport", None))


def _interrupt_pidbox_on_stop(consumer: Any) -> None:
    """Celery's green remote-control loop (``gPidbox``) checks its shutdown event only between
    calls to ``drain_events(timeout=1.0)``, and the consumer's stop waits for it: set the event
    and interrupt that drain at once. Idempotent."""
    for step in getattr(consumer, "steps", None) or ():
        box = getattr(step, "box", None)
        if box is None or not hasattr(box, "_node_shutdown") or \
                getattr(box.on_stop, "_celery_ext_interrupts", False):
            continue
        real = box.on_stop

        def on_stop(box: Any = box, real: Any = real) -> None:
            shutdown = box._node_shutdown
            if shutdown is not None:
                shutdown.set()
                channel = getattr(getattr(box, "node", None), "channel", None)
                _interrupt_transport(getattr(channel, "connection", None))  # the transport
            real()

        on_stop._celery_ext_interrupts = True  # type: ignore[attr-defined]
        box.on_stop = on_stop


def _run_cold(handler: Any, signum: Any, frame: Any) -> None:
    """Celery's cold-shutdown handler, in a greenlet: its sleep, its waits and the hand-back
    are cooperative there. Once it has set the shutdown flag, the consumer loop's drain (up to
    2 s, then one more cycle's) and the remote-control loop's (1 s) are interrupted: the
    worker exits now rather than about 5 s later."""
    task_consumer = getattr(_consumer, "task_consumer", None)
    if task_consumer is not None:
        _cancel_in_loop(task_consumer)
    _interrupt_pidbox_on_stop(_consumer)
    try:
        handler(signum, frame)
    finally:
        _interrupt_drain(getattr(_consumer, "connection", None))


def _deferred(handler: Any) -> Any:
    """Celery's cold-shutdown signal handler, run in a greenlet when the pool is green."""
    if getattr(handler, "_celery_ext_deferred", False):
        return handler

    def worker_Cold(signum: Any = None, frame: Any = None) -> None:
        green = _green()
        if green is None:
            if _is_solo(getattr(_consumer, "pool", None)) and not _solo_cut:
                _close_window(_consumer)
                _solo_cancel_later(getattr(_consumer, "task_consumer", None))
            handler(signum, frame)
            return
        if not _green_cold:  # the first cold signal
            _green_cold.append(True)
            conf = getattr(getattr(_consumer, "app", None), "conf", None)
            soft = float(getattr(conf, "worker_soft_shutdown_timeout", 0) or 0)
            _watchdog(green, soft + GREEN_GRACE)
            _close_window(_consumer)
        _spawn(green, _run_cold, handler, signum, frame)

    worker_Cold._celery_ext_deferred = True  # type: ignore[attr-defined]
    return worker_Cold


def _install_signal(self: Any, name: Any, handler: Any) -> None:
    """``celery.platforms.Signals.__setitem__``: Celery's cold-shutdown handlers (named
    ``worker_Cold``) are deferred to a greenlet on green pools (see above)."""
    if callable(handler) and getattr(handler, "__name__", "") == "worker_Cold":
        handler = _deferred(handler)
    _signals_setitem(self, name, handler)


def _unless_cold(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A green pool's task greenlet: a task not started when the cold shutdown began never
    starts (its request stays reserved, its message unacked: handed back uncounted)."""
    if _green_cold:
        return None
    return fn(*args, **kwargs)


def _gate(pool: Any) -> None:
    """Put :func:`_unless_cold` in front of every task a gevent/eventlet pool starts."""
    spawn = getattr(pool, "_quick_put", None)
    if spawn is None or getattr(spawn, "_celery_ext_gated", False):
        return

    def gated(fn: Any, *args: Any, **kwargs: Any) -> Any:
        return spawn(_unless_cold, fn, *args, **kwargs)

    gated._celery_ext_gated = True  # type: ignore[attr-defined]
    pool._quick_put = gated


def _holder(request: Any) -> tuple[Any, tuple[int, int]] | None:
    """The backend holding this request's delivery, and its ``(id, claim)``."""
    message = getattr(request, "message", None)
    tag = parse_shard_tag(getattr(message, "delivery_tag", None))
    channel = getattr(message, "channel", None)
    backend = channel.backend_at(tag[2]) if tag is not None and \
        hasattr(channel, "backend_at") else None
    return None if tag is None or backend is None else (backend, (tag[0], tag[1]))


def _hand_back_unfinished() -> None:
    """At the cold shutdown's cut-off (the first ``Request.cancel``), on a green pool: every
    delivery whose run was not acked and did not succeed — running, or never started — goes
    back to ready at once, uncounted (an interrupted run is not an attempt), and is no longer
    renewed. Celery's ack of a run it cancels (a killed greenlet "returns") is suppressed
    first, before anything yields, so no ack can land on a message handed back. A finished
    run's ack flows as usual: the event loop still runs."""
    from celery.worker import state as worker_state

    by_backend: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    for request in [*worker_state.active_requests, *worker_state.reserved_requests]:
        if request.acknowledged or request.id in worker_state.successful_requests:
            continue
        found = _holder(request)
        if found is None:
            continue
        request.acknowledged = True  # Celery will not ack it: it goes back
        backend, pair = found
        by_backend.setdefault(id(backend), (backend, []))[1].append(pair)
    handed = 0
    for backend, pairs in by_backend.values():
        backend.settle(pairs, requeue=True, uncount=True)
        backend.release(pairs)
        handed += len(pairs)
    log_event("pgjobs.run.stopped", task_id="*", job_id="*", why="shutdown",
              how=f"{handed} handed back")


def _green_terminate_job(original: Any) -> Any:
    """gevent's/eventlet's ``terminate_job``, when Celery's cold shutdown cancels a run
    (``Request.cancel``): the first call hands every unfinished delivery back
    (:func:`_hand_back_unfinished`), then the run's greenlet is killed as before. A revoke's
    terminate and the run listener's go straight to the pool's own."""

    def terminate_job(pool: Any, pid: Any, signal: Any = None) -> None:
        if sys._getframe(1).f_code.co_name == "cancel" and not _green_cut:
            _green_cut.append(True)
            try:
                _hand_back_unfinished()
            except Exception as exc:  # never stop the shutdown: the leases lapse then
                log_event("pgjobs.run.stopped", task_id="*", job_id="*", why="shutdown",
                          how=f"not handed back: {type(exc).__name__}: {exc}")
        original(pool, pid, signal)

    terminate_job._celery_ext_original = original  # type: ignore[attr-defined]
    return terminate_job


_signals_setitem = _platforms.Signals.__setitem__


# -- solo: the task runs in the main thread, where Celery's signal handler runs too ----------

#: the cold shutdown cut the solo pool's run off (once per process)
_solo_cut: list[bool] = []


def _solo_terminate_job(pool: Any, pid: Any, signal: Any = None) -> None:
    """solo's ``terminate_job`` (Celery's raises NotImplementedError — which, raised in the
    signal handler, ended the interrupted task body as a failure: its message acked, gone).
    At a cold shutdown (``Request.cancel``) the handler interrupted the running task itself:
    its message (and any prefetched one) is kept unacked — Celery's ack suppressed, nothing
    written here, in signal context — so the transport hands it back, uncounted, as the
    worker closes its channel; and :class:`Cancelled` is raised into the body, which ends the
    run (a body that catches every exception runs on to its end: nothing can stop it)."""
    if sys._getframe(1).f_code.co_name != "cancel":
        raise NotImplementedError(f"{type(pool)} does not implement kill_job")
    from celery.worker import state as worker_state

    if not _solo_cut:
        _solo_cut.append(True)
        for request in [*worker_state.active_requests, *worker_state.reserved_requests]:
            if not request.acknowledged and request.id not in worker_state.successful_requests:
                request.acknowledged = True  # Celery will not ack it: it goes back
    raise Cancelled("shutdown")


def _is_solo(pool: Any) -> bool:
    return pool is not None and type(pool).__module__ == "celery.concurrency.solo"


def _solo_cancel_later(task_consumer: Any) -> None:
    """On solo, Celery's handler cancels the task consumer while the task it interrupted is
    in the middle of a delivered batch: the rest of the batch then finds no consumer, and
    kombu requeues it through ``reject(requeue=True)``, counting an attempt. Called from the
    signal handler, the cancel waits for the event loop (``call_soon``); the rows behind then
    reach the consumer, are not started (:func:`_gate_solo`) and go back uncounted with the
    cut-off run as the channel closes. Idempotent."""
    if task_consumer is None or getattr(task_consumer.cancel, "_celery_ext_in_loop", False):
        return
    from celery.utils import log as celery_log

    real = task_consumer.cancel
    consumer = _consumer

    def cancel() -> None:
        if celery_log._in_sighandler:
            consumer.call_soon(real)
        else:
            real()

    cancel._celery_ext_in_loop = True  # type: ignore[attr-defined]
    task_consumer.cancel = cancel


def _gate_solo(pool: Any) -> None:
    """No task starts on the solo pool after its run was cut off (the messages prefetched
    behind it stay unacked: handed back with it)."""
    apply = pool.on_apply
    if getattr(apply, "_celery_ext_gated", False):
        return

    def on_apply(*args: Any, **kwargs: Any) -> Any:
        return None if _solo_cut else apply(*args, **kwargs)

    on_apply._celery_ext_gated = True  # type: ignore[attr-defined]
    pool.on_apply = on_apply


def _ready_solo(sender: Any = None, **_: Any) -> None:
    pool = getattr(sender, "pool", None)
    if _is_solo(pool):
        _gate_solo(pool)


def _ready_green(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` of a gevent/eventlet worker: gate its task starts, and hand cut-off
    deliveries back from its ``terminate_job`` (patched on the pool's class, once)."""
    pool = getattr(sender, "pool", None)
    pool_class = type(pool)
    if pool is None or _green() is None or \
            not pool_class.__module__.endswith(("gevent", "eventlet")):
        return
    _gate(pool)
    if not hasattr(pool_class.terminate_job, "_celery_ext_original"):
        pool_class.terminate_job = _green_terminate_job(pool_class.terminate_job)


def start_stopping() -> None:
    """Register the run listener, capture the worker's pool, give the threads pool a cold
    shutdown that ends, and run the green pools' out of signal context (idempotent)."""
    from celery.concurrency import solo, thread

    signals.worker_ready.connect(_worker_ready, weak=False, dispatch_uid="celery_ext.cancel")
    signals.worker_ready.connect(_ready_green, weak=False, dispatch_uid="celery_ext.green")
    add_run_listener(_stop)
    thread.TaskPool.terminate_job = _threads_terminate_job  # type: ignore[method-assign]
    solo.TaskPool.terminate_job = _solo_terminate_job  # type: ignore[method-assign]
    signals.worker_ready.connect(_ready_solo, weak=False, dispatch_uid="celery_ext.solo")
    _platforms.Signals.__setitem__ = _install_signal  # type: ignore[method-assign]
