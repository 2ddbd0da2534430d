"""Durable steps: a Celery task that survives crashes, sleeps for days and waits for events
without holding a worker.

::

    @app.task(bind=True, acks_late=True)
    def order_flow(self, order_id):
        steps = celery_ext.steps.of(self)
        charge = steps.run("charge", charge_card, order_id)       # once per task id
        steps.wait_for_event("payment.confirmed", key=order_id,   # the worker is free
                             timeout=timedelta(days=3))           # meanwhile
        steps.run("receipt", send_receipt, order_id, charge["id"])

    celery_ext.steps.emit("payment.confirmed", key=order_id, data={"by": "card"})

* :meth:`Steps.run` runs a function once per Celery task id (which retries keep): its result,
  as JSON, is committed in ``pgjobs_step`` before ``run`` returns, keyed by the task id and the
  step's name. A later run of the task (a redelivery after a crash, a retry, a requeue from the
  dead letters) returns the stored result without running it. A step's exception is recorded
  and raised again: the task's retry policy decides, and the next run runs that step again.
* :meth:`Steps.sleep` ends the run and hands the message back **parked** until the due time
  (the row's ``run_at``), uncounted: no worker slot, no prefetch, no beat entry holds it. The
  next run replays up to the sleep and goes on.
* :meth:`Steps.wait_for_event` suspends the same way until :func:`emit` of its name and key
  (an event emitted before the wait began counts: events are rows) or its timeout
  (:class:`~kombu_pgjobs.errors.EventTimeout`, ``PGJ-905``).

Every write is fenced on the delivery the run holds, as an ack is: a run whose lease was lost,
that was cancelled or cut off writes nothing, and is told so (``StepFenced``, ``PGJ-903``,
which ends the run as a cancel does). A suspension is control flow: :class:`Suspended`, an
``Ignore``, ends the run; the worker's main process (the holder of the lease, whatever the pool)
parks the message: it stops renewing the lease, then hands the row back in one fenced
statement, and drops the ack Celery sends after
(:meth:`kombu_pgjobs.broker.backend.Backend.release`).

Needs: a ``pgjobs://`` broker, ``celery_ext.install(app)``, ``bind=True`` and
``acks_late=True``. A task that never calls :func:`of` pays nothing; each step costs one
statement, and a run that uses steps reads what earlier runs stored once, at its first step.
See docs/steps.md.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from celery import signals
from celery.exceptions import Ignore, TaskPredicate

from kombu_pgjobs.broker import outbox
from kombu_pgjobs.broker.backend import Backend
from kombu_pgjobs.broker.transport import parse_shard_tag
from kombu_pgjobs.errors import (
    DuplicateStep,
    EmitElsewhere,
    EventTimeout,
    OutboxBypassed,
    PgJobsError,
    StepFenced,
    StepMismatch,
    StepsUnavailable,
)
from kombu_pgjobs.events import log_event, one_line
from kombu_pgjobs.store import steps as db

from .cancel import Cancelled
from .deadletter import _all_backends, _backend, storable
from .state import installed

__all__ = ["EventTimeout", "Fenced", "Steps", "Suspended", "emit", "of", "start_parking"]

log = logging.getLogger("celery_ext")

#: a step's error message as stored (the traceback stays in the logs)
_MAX_ERROR = 2000


class Suspended(Ignore):
    """Raised by :meth:`Steps.sleep` and :meth:`Steps.wait_for_event` to end the run: the
    worker's main process parks the message (see the module doc). Never catch it in a task
    body (a broad ``except Exception`` around a sleep would swallow the suspension)."""

    def __init__(self, task_id: str, name: str, kind: str, seconds: float | None,
                 event: str | None = None, key: str | None = None) -> None:
        super().__init__(f"step {name!r} suspends the run ({kind})")
        self.task_id = task_id
        self.name = name
        self.kind = kind
        self.seconds = seconds
        self.event = event
        self.key = key

    def __reduce__(self) -> Any:  # to the prefork pool's main process, whole
        return (type(self), (self.task_id, self.name, self.kind, self.seconds, self.event,
                             self.key))


class Fenced(StepFenced, Cancelled, Ignore):
    """``StepFenced`` (``PGJ-903``) as a task body sees it: the run no longer holds its
    message, and ends without a result (an ``Ignore``; a :class:`celery_ext.cancel.Cancelled`
    too, for code that handles those). For a cancel, REVOKED is stored and the worker's main
    process settles the message as a cancel (a dead letter ``cancelled``), whether or not its
    keeper had learned of the cancel yet; for a lost lease nothing is stored, and the ack
    misses its fence (the message is another worker's)."""

    def __init__(self, message: str, why: str) -> None:
        self.message = message
        self.why = why
        Exception.__init__(self, f"[{self.code}] {message}")

    def __reduce__(self) -> Any:
        return (type(self), (self.message, self.why))


def _loads(text: str | None) -> Any:
    return None if text is None else json.loads(text)


class Steps:
    """The durable steps of one run of a task (:func:`of`)."""

    def __init__(self, task: Any, backend: Backend, delivery: db.Delivery) -> None:
        self._task = task
        self._backend = backend
        self._schema = backend.options.schema
        self._d = delivery
        self._stored: dict[str, db.Stored] | None = None
        self._used: set[str] = set()
        self._suspended: Suspended | None = None

    # -- plumbing --------------------------------------------------------------------------
    def _run(self, fn: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        return self._backend.publishing(fn)

    def _fence(self, verdict: str, doing: str) -> None:
        if verdict in ("held", "saved", "stored"):
            return
        why = "cancelled" if verdict == "cancelled" else "lost"
        log_event("pgjobs.step.refused", task_id=self._d.task_id, job_id=self._d.job_id,
                  fence=self._d.claim, doing=doing, why=why)
        because = "an operator cancelled it" if why == "cancelled" else \
            "its lease was lost: another worker runs it now, or it was settled"
        if why == "cancelled" and self._task is not None:
            self._task.backend.mark_as_revoked(self._d.task_id, "cancelled",
                                               request=self._task.request)
        raise Fenced(f"{doing} of task {self._d.task_id} was refused: this run no longer "
                     f"holds its message ({because}); nothing was written", why)

    def _load(self) -> dict[str, db.Stored]:
        if self._stored is None:
            verdict, stored = self._run(lambda c: db.load(c, self._schema, self._d))
            self._fence(verdict, "reading the stored steps")
            self._stored = stored
        return self._stored

    def _claim(self, name: Any) -> str:
        name = db.check_name(name)
        if self._suspended is not None:  # a swallowed suspension: the run must end
            raise self._suspended
        if name in self._used:
            raise DuplicateStep(f"step {name!r} was already used in this run of task "
                                f"{self._d.task_id}: give each step its own name")
        self._used.add(name)
        return name

    def _stored_as(self, name: str, kind: str, event: str | None = None,
                   key: str | None = None) -> db.Stored | None:
        stored = self._load().get(name)
        if stored is None:
            return None
        if stored.kind != kind or (kind == "event" and (stored.event, stored.event_key)
                                   != (event, key)):
            asked = kind if kind != "event" else f"event {event!r} key {key!r}"
            had = stored.kind if stored.kind != "event" else \
                f"event {stored.event!r} key {stored.event_key!r}"
            raise StepMismatch(f"step {name!r} of task {self._d.task_id} is stored as {had}, "
                               f"and this run asks for {asked}: rename the step, or run the "
                               f"task again from it (`pgjobs requeue ID --from-step {name}`)")
        return stored

    def _save(self, name: str, **kw: Any) -> tuple[str, str | None]:
        verdict, prior = self._run(lambda c: db.save(c, self._schema, self._d, name, **kw))
        self._fence(verdict, f"recording step {name!r}")
        self._note(name, kw["kind"], "done" if verdict == "stored" else kw["state"],
                   prior if verdict == "stored" else kw.get("result"), kw.get("event"),
                   kw.get("key"))
        return verdict, prior

    def _note(self, name: str, kind: str, state: str, result: str | None,
              event: str | None = None, key: str | None = None) -> None:
        """Keep what this run stored (it is read once, at the first step)."""
        if self._stored is not None:
            self._stored[name] = db.Stored(name, kind, state, result, event, key, False)

    def _suspend(self, name: str, kind: str, seconds: float | None, event: str | None = None,
                 key: str | None = None) -> Suspended:
        self._suspended = Suspended(self._d.task_id, name, kind, seconds, event, key)
        return self._suspended

    # -- the API ---------------------------------------------------------------------------
    def run(self, name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` once per task id: its result (JSON) is committed before this
        returns, and every later run returns the stored result without calling ``fn``. The
        first run returns the result as stored too (a tuple comes back a list), so every run
        sees the same value. An exception of ``fn`` is recorded (``pgjobs steps``) and raised
        again; the next run calls ``fn`` again."""
        name = self._claim(name)
        stored = self._stored_as(name, "run")
        if stored is not None and stored.state == "done":
            return _loads(stored.result)
        started = time.monotonic()
        try:
            value = fn(*args, **kwargs)
        except (TaskPredicate, Cancelled):  # Celery's control flow, a cancel: no outcome
            raise
        except Exception as exc:
            self._failed(name, exc, time.monotonic() - started)
            raise
        took = time.monotonic() - started
        try:
            text = db.to_json(value, f"the result of step {name!r}",
                              self._backend.options.max_message_bytes)
        except PgJobsError as exc:
            self._failed(name, exc, took)
            raise
        verdict, prior = self._save(name, kind="run", state="done", result=text, took=took)
        if verdict == "stored" and prior is not None:
            text = prior  # another run of the task id stored it first: every run sees one value
        return json.loads(text)

    def _failed(self, name: str, exc: BaseException, took: float) -> None:
        error = {"type": storable(f"{type(exc).__module__}.{type(exc).__qualname__}"),
                 "message": storable(str(exc)[:_MAX_ERROR])}
        code = getattr(exc, "code", None)
        if isinstance(code, str):
            error["code"] = code
        try:
            self._save(name, kind="run", state="failed", error=error, took=took)
        except Fenced as fenced:
            raise fenced from exc

    def sleep(self, name: str, duration: Any) -> None:
        """End this run and come back in ``duration`` (a timedelta or seconds): the message is
        parked until then, holding nothing. The due time is fixed by the first run that
        reaches the sleep; a later run before it (an operator's requeue) parks again until
        it. A zero duration returns at once."""
        name = self._claim(name)
        seconds = db.seconds(duration, f"the duration of sleep {name!r}")
        stored = self._stored_as(name, "sleep")
        if stored is not None and stored.state == "done":
            return
        if stored is None and seconds == 0:
            return
        raise self._suspend(name, "sleep", seconds)

    def wait_for_event(self, event: str, *, key: Any = None, timeout: Any = None,
                       name: str | None = None) -> Any:
        """The ``data`` of the latest event ``event`` with ``key`` (:func:`emit`), however old:
        one emitted before the wait began counts. Until there is one the run ends and the
        message is parked (holding nothing); an emit wakes it. ``timeout`` (a timedelta or
        seconds; None: none) fixes a deadline when the wait first parks: past it, with no
        event, :class:`~kombu_pgjobs.errors.EventTimeout` is raised (and recorded). The step is
        named after the event unless ``name`` is given."""
        event = db.check_name(event, "event name")
        key_text = db.event_key(key)
        seconds = None if timeout is None else db.seconds(timeout, "the timeout")
        step = self._claim(event if name is None else name)
        stored = self._stored_as(step, "event", event, key_text)
        if stored is not None and stored.state == "done":
            return _loads(stored.result)
        if stored is not None and stored.state == "waiting":
            if stored.due:  # its deadline passed, and the load found no event
                self._timed_out(step, event, key_text)
            raise self._suspend(step, "event", seconds, event, key_text)
        verdict, heard, data = self._run(
            lambda c: db.wait(c, self._schema, self._d, step, event, key_text))
        self._fence(verdict, f"waiting for {event!r}")
        if heard:
            self._note(step, "event", "done", data, event, key_text)
            return _loads(data)
        if seconds == 0:
            self._timed_out(step, event, key_text)
        raise self._suspend(step, "event", seconds, event, key_text)

    def _timed_out(self, step: str, event: str, key: str) -> None:
        message = (f"no event {event!r} with key {key!r} came before the timeout of step "
                   f"{step!r}")
        self._save(step, kind="event", state="failed", event=event, key=key,
                   error={"type": "kombu_pgjobs.errors.EventTimeout",
                          "code": EventTimeout.code, "message": message})
        raise EventTimeout(message)


def of(task: Any) -> Steps:
    """The durable steps of the current run of ``task`` (a bound task's ``self``); the same
    object for every call in one run. Nothing is read until the first step."""
    request = task.request
    found = getattr(request, "_pgjobs_steps", None)
    if isinstance(found, Steps):
        return found
    name = getattr(task, "name", "?")
    if request is None or request.called_directly or request.is_eager or not request.id:
        raise StepsUnavailable(f"task {name}: durable steps run only in a worker's run of a "
                               "delivered message, not called directly or eagerly")
    app = task.app
    if not installed(app):
        raise StepsUnavailable(f"task {name}: durable steps need celery_ext.install(app)")
    if not getattr(task, "acks_late", False):
        raise StepsUnavailable(f"task {name}: durable steps need acks_late=True (the message "
                               "must stay held while the body runs)")
    tag = parse_shard_tag((request.properties or {}).get("delivery_tag")
                          or (request.delivery_info or {}).get("delivery_tag"))
    backend = _backend(app, tag[2]) if tag is not None else None
    if tag is None or backend is None:
        raise StepsUnavailable(f"task {name}: durable steps need a pgjobs:// broker")
    steps = Steps(task, backend, db.Delivery(tag[0], tag[1], str(request.id)))
    request._pgjobs_steps = steps
    return steps


def emit(event: str, *, key: Any = None, data: Any = None, app: Any = None) -> None:
    """Emit event ``event`` with ``key``: every parked waiter of that name and key wakes and
    its ``wait_for_event`` returns ``data`` (JSON); a wait that begins later returns it too,
    while it is the latest of its name and key and kept (``pgjobs prune``). Inside
    ``celery_ext.transaction(conn)`` the event is written in the app's transaction (its
    database must be the broker's: ``EmitElsewhere``, ``PGJ-908``, otherwise): it exists, and
    wakes anyone, exactly when that transaction commits. Otherwise it is committed when this
    returns."""
    from celery import current_app

    app = app if app is not None else current_app._get_current_object()
    event = db.check_name(event, "event name")
    key_text = db.event_key(key)
    backends = _all_backends(app)
    if not backends:
        raise StepsUnavailable("celery_ext.steps.emit needs the app's broker to be pgjobs://")
    text = db.to_json(data, f"the data of event {event!r}",
                      backends[0].options.max_message_bytes)
    if outbox.active() is not None:
        for backend in backends:
            try:
                conn = outbox.connection_for(backend)
            except OutboxBypassed:
                continue
            if conn is not None:
                db.emit(conn, backend.options.schema, event, key_text, text)
                return
        raise EmitElsewhere(
            f"event {event!r} was emitted inside a transaction() block whose connection is "
            "not the broker's database: nothing was written")
    for backend in backends:  # with a shard map, every database: a waiter is on one of them
        backend.publishing(lambda c, b=backend: db.emit(c, b.options.schema, event, key_text,
                                                         text))


# -- the worker's main process: parking a suspended run's message ---------------------------------
def _park(request: Any, exc: Suspended) -> None:
    """Hand the message of a run that suspended back parked, from the process that holds its
    lease. Never raises: a failure is logged, and the lease (no longer renewed) lapses, so the
    message comes back and replays."""
    found = _holder(request)
    if found is None or exc.task_id != request.id:
        log.warning("celery_ext.steps.not_parked task=%s: not a pgjobs delivery of this task",
                    request.id, extra={"action": "celery_ext.steps.not_parked"})
        return
    backend, pair = found
    if pair in backend.cancelled:
        return  # its ack (sent next) dead-letters it as cancelled
    # First stop renewing it (and drop the ack to come): renewed while the row is parked, the
    # keeper would find the lease gone and end whatever the pool runs now.
    backend.release([pair])
    delivery = db.Delivery(pair[0], pair[1], str(request.id))
    try:
        verdict, due_in = backend.publishing(lambda c: db.park(
            c, backend.options.schema, delivery, exc.name, kind=exc.kind,
            seconds=exc.seconds, event=exc.event, key=exc.key))
    except (psycopg.Error, PgJobsError) as err:
        log_event("pgjobs.step.park_failed", task_id=request.id, job_id=pair[0],
                  fence=pair[1], error=one_line(err))
        return
    if verdict == "parked":
        log.info("celery_ext.steps.parked task=%s step=%s %s due_in=%.1fs", request.id,
                 exc.name, exc.kind, due_in or 0.0,
                 extra={"action": "celery_ext.steps.parked", "job_id": pair[0]})
    elif verdict == "cancelled":  # an operator cancelled it while it ran: a dead letter
        try:
            hit = backend.publishing(lambda c: backend.core.bury(c, [pair], reason="cancelled"))
            backend.settled([pair], hit, "cancel")
        except (psycopg.Error, PgJobsError) as err:
            log_event("pgjobs.step.park_failed", task_id=request.id, job_id=pair[0],
                      fence=pair[1], error=one_line(err))
    elif verdict == "refused":  # its step is done already (another run): run it again now
        backend.settle([pair], requeue=True, uncount=True)
    else:
        log_event("pgjobs.step.park_missed", task_id=request.id, job_id=pair[0],
                  fence=pair[1])


def _holder(request: Any) -> tuple[Backend, tuple[int, int]] | None:
    """The backend holding this request's delivery, and its ``(id, claim)``."""
    message = getattr(request, "message", None)
    tag = parse_shard_tag(getattr(message, "delivery_tag", None))
    channel = getattr(message, "channel", None)
    backend = channel.backend_at(tag[2]) if tag is not None and \
        hasattr(channel, "backend_at") else None
    return None if tag is None or backend is None else (backend, (tag[0], tag[1]))


def _cancelled(request: Any) -> None:
    """A run whose step write found its message cancelled: its coming ack settles it as a
    cancel (a dead letter ``cancelled``), as when the keeper has learned of the cancel."""
    found = _holder(request)
    if found is not None:
        found[0].cancelled.add(found[1])


def _received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_received`` (the worker's main process, before the run): a run of an installed
    app's late-acked task that ends suspended parks its message. Costs no statement."""
    task = getattr(request, "task", None)
    if task is None or not getattr(task, "acks_late", False) or not installed(task.app):
        return
    finished = request.on_success

    def on_success(failed__retval__runtime: Any, **kw: Any) -> Any:
        if failed__retval__runtime[0]:
            exc = getattr(failed__retval__runtime[1], "exception", None)
            exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
            if isinstance(exc, Suspended):
                _park(request, exc)
            elif isinstance(exc, Fenced) and exc.why == "cancelled":
                _cancelled(request)
        return finished(failed__retval__runtime, **kw)

    request.on_success = on_success


def start_parking() -> None:
    """Connect the receiver that parks suspended runs (idempotent; celery_ext.install)."""
    signals.task_received.connect(_received, weak=False, dispatch_uid="celery_ext.steps")
