"""celery_ext: what a Celery app gets from pgjobs beyond the broker URL.

``celery_ext.install(app)`` — right after creating the app, before its tasks are defined — makes
:class:`celery_ext.Task` the app's task base class and connects a ``task_failure`` receiver
(for this app's tasks only). Tasks then take these options
(``@app.task(max_attempts=3, terminal=(BadInput,), ...)``):

* ``max_attempts``: deliveries before pgjobs buries the message as dead (a task that kills its
  worker ends in the dead-letter table after N tries). Sent as the ``x-pgjobs-max-attempts``
  header; without it the transport option ``max_attempts`` applies.
* ``terminal``, ``retry_after`` (+ ``retry_after_seconds``, ``retry_after_max``,
  ``retry_after_jitter``), ``retryable``: retry classification, see :mod:`celery_ext.retry`.
* ``dead_letter`` (default True): a task that fails for good is recorded as a dead letter with
  its exception type, message, traceback and the rule that stopped it.
* ``concurrency``, ``concurrency_key`` + ``concurrency_per_key``, ``when_busy``: fleet-wide
  limits enforced by the claim in Postgres; app settings ``pgjobs_queue_limits``,
  ``pgjobs_global_limit``, ``pgjobs_tenant_limit``, ``pgjobs_tenant_rate``. See
  :mod:`celery_ext.limits`.
* ``tenant``: a function of the task's arguments naming the tenant a message acts for, or
  ``"none"``; stamped as ``x-pgjobs-tenant`` at publish and installed for the body as
  :func:`celery_ext.current_tenant`. App setting ``pgjobs_tenant_required = True`` refuses tasks
  that declare none. See :mod:`celery_ext.tenant` and docs/tenancy.md.
* ``idempotency_key``: a function of the task's arguments naming a key; while a live message
  of the task and tenant holds it, another publish inserts nothing and returns the holder's
  ``AsyncResult`` (also ``apply_async(..., idempotency_key="...")``). App setting
  ``pgjobs_tenant_max_queued = N`` refuses a publish that would give a tenant more than N live
  messages (``TenantQueueFull``, ``PGJ-506``). See :mod:`celery_ext.idempotency`.

``with celery_ext.transaction(conn):`` publishes the block's tasks in the app's own transaction
(the transactional outbox): see :mod:`celery_ext.outbox` and docs/outbox.md.

Celery parity (docs/compatibility.md): :data:`celery_ext.on_settled` (sent once per ack, requeue
or dead letter that committed, :mod:`celery_ext.settled`); ``Reject(reason)`` stored in the dead
letter; worker sync (mingle) and gossip on pgjobs (:mod:`celery_ext.worker_sync`); ``celery
inspect scheduled`` from Postgres (:mod:`celery_ext.scheduled`); queue lengths in Flower
(:mod:`celery_ext.flower`).

A task with its own base class gets the same by deriving it from :class:`celery_ext.Task`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from celery import signals
from celery.utils.imports import symbol_by_name

from kombu_pgjobs.errors import InvalidTaskOption

from . import steps
from .beat import default_to_leader
from .cancel import Cancelled, cancel, cancelled, checkpoint, start_stopping
from .deadletter import on_task_failure, on_task_rejected
from .flower import register as register_flower
from .groups import install_groups
from .idempotency import max_queued
from .limits import check_app_limits
from .outbox import OutboxRelay, transaction
from .retry import RULES, PgJobsTask
from .scheduled import install_scheduled
from .settled import on_settled, start_telling
from .state import add_app, installed
from .tenant import check_tenant_required, current_tenant, tenant_required
from .worker_sync import enable_worker_sync, load_revokes, name_worker

__all__ = ["RULES", "Cancelled", "OutboxRelay", "Task", "cancel", "cancelled", "checkpoint",
           "current_tenant", "install", "on_settled", "steps", "transaction"]

#: the task base class (use as ``base=celery_ext.Task`` in apps that set their own base)
Task = PgJobsTask


def install(app: Any) -> Any:
    """Install celery_ext into ``app`` (idempotent) and return it.

    Call it before the app's tasks are defined (tasks are made from the app's base task class,
    which this replaces); a task already made without it is reported, not silently left out.
    """
    if installed(app):
        return app
    # Settings given so far (without loading the app's configuration early); the rest are
    # checked at the first publish.
    given = app.conf if getattr(app, "configured", False) \
        else getattr(app, "_preconf", None) or {}
    check_app_limits(given)
    tenant_required(given)
    max_queued(given)
    base = symbol_by_name(app.task_cls)
    if not issubclass(base, PgJobsTask):
        composed = PgJobsTask if base.__name__ == "Task" and base.__module__ == \
            "celery.app.task" else type("Task", (PgJobsTask, base), {"__module__": __name__})
        if "Task" in app.__dict__:  # the app's base class was already built
            made = [name for name, t in app._tasks.items()
                    if not name.startswith("celery.") and not isinstance(t, PgJobsTask)]
            if made:
                raise InvalidTaskOption(
                    "celery_ext.install(app) ran after tasks were defined "
                    f"({', '.join(sorted(made)[:5])}): call it right after creating the app, "
                    "or give those tasks base=celery_ext.Task")
            del app.__dict__["Task"]
        app.task_cls = composed
    app.task = _checked_at_declaration(app, app.task)
    signals.task_failure.connect(
        on_task_failure, weak=False, dispatch_uid="celery_ext.deadletter")
    # Celery parity (issue 16): the Reject reason in dead letters, on_settled, mingle/gossip
    signals.task_failure.connect(
        on_task_rejected, weak=False, dispatch_uid="celery_ext.reject_reason")
    start_telling()
    start_stopping()
    steps.start_parking()  # durable steps: a suspended run's message is parked (steps.py)
    enable_worker_sync()
    signals.worker_init.connect(name_worker, weak=False, dispatch_uid="celery_ext.identity")
    signals.worker_init.connect(load_revokes, weak=False, dispatch_uid="celery_ext.revokes")
    install_scheduled()
    register_flower()
    install_groups()  # a group or chord: one batch, one INSERT (groups.py)
    default_to_leader(app)  # beat: LeaderScheduler unless the app set one, on a pgjobs broker
    add_app(app)
    return app


#: task options celery_ext reads; checked where ``@app.task(...)`` is written
_OPTIONS = ("max_attempts", "terminal", "retry_after", "retry_after_seconds", "retry_after_max",
            "retry_after_jitter", "retryable", "dead_letter", "concurrency", "concurrency_key",
            "concurrency_per_key", "when_busy", "tenant", "idempotency_key")


def _checked_at_declaration(app: Any, task: Callable[..., Any]) -> Callable[..., Any]:
    """``app.task`` that checks celery_ext's options at the decorator: Celery makes task
    classes lazily (at the first use of the task), which would report a bad declaration far from
    where it was written. ``pgjobs_tenant_required`` is read from the settings given so far
    (without loading the app's configuration early); the task's ``bind`` checks it again
    against the loaded configuration."""
    if getattr(task, "_celery_ext_checked", False):
        return task

    def check(opts: dict[str, Any], fun: Any) -> None:
        name = opts.get("name") or (app.gen_task_name(fun.__name__, fun.__module__)
                                    if fun is not None else None)
        ours = {k: v for k, v in opts.items() if k in _OPTIONS}
        if ours:  # making a throwaway subclass runs the same checks the real one will
            type("declared", (PgJobsTask,), {"__module__": __name__, "name": name, **ours})
        check_tenant_required(
            name or "?", opts.get("tenant", getattr(opts.get("base"), "tenant", None)),
            app.conf if getattr(app, "configured", False)
            else getattr(app, "_preconf", None) or {})

    @functools.wraps(task)
    def checked(*args: Any, **opts: Any) -> Any:
        if len(args) == 1 and callable(args[0]):  # @app.task without parentheses
            check(opts, args[0])
            return task(*args, **opts)
        decorator = task(*args, **opts)

        @functools.wraps(decorator)
        def decorate(fun: Any) -> Any:
            check(opts, fun)
            return decorator(fun)
        return decorate

    checked._celery_ext_checked = True  # type: ignore[attr-defined]
    return checked
