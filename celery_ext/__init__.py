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

A task with its own base class gets the same by deriving it from :class:`celery_ext.Task`.
"""

from __future__ import annotations

from typing import Any

from celery import signals
from celery.utils.imports import symbol_by_name

from kombu_pgjobs.errors import InvalidTaskOption

from .deadletter import on_task_failure
from .retry import RULES, PgJobsTask
from .state import add_app, installed

__all__ = ["RULES", "Task", "install"]

#: the task base class (use as ``base=celery_ext.Task`` in apps that set their own base)
Task = PgJobsTask


def install(app: Any) -> Any:
    """Install celery_ext into ``app`` (idempotent) and return it.

    Call it before the app's tasks are defined (tasks are made from the app's base task class,
    which this replaces); a task already made without it is reported, not silently left out.
    """
    if installed(app):
        return app
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
    signals.task_failure.connect(
        on_task_failure, weak=False, dispatch_uid="celery_ext.deadletter")
    add_app(app)
    return app
