"""A task that fails for good becomes a dead letter, with its error, without changing task code.

Celery settles a failed message itself (acked, the default) and stores the failure in the
result backend; nothing in the broker would remember it. celery_ext listens to ``task_failure``
(sent in the process that ran the task, or in the worker's main process when a pool child was
lost) and records a dead letter: the exception type, message and traceback, and the rule that
stopped the task (see :mod:`celery_ext.retry`). ``pgjobs dead requeue`` then runs it again.

Not recorded here, because the transport already dead-letters them: ``Reject(requeue=False)``,
and failures of ``acks_late`` tasks configured to reject on failure
(``acks_on_failure_or_timeout=False``): Celery rejects those without requeue, which pgjobs turns
into a dead letter (reason ``rejected``), and a second one would run the task twice on requeue.
"""

from __future__ import annotations

import base64
import logging
import os
import time
import traceback as tb_module
import uuid
from typing import Any

from celery.exceptions import Ignore, Reject, Retry, TimeLimitExceeded
from kombu.serialization import dumps

from kombu_pgjobs.broker.backend import Backend
from kombu_pgjobs.broker.transport import Transport as PgJobsTransport
from kombu_pgjobs.broker.transport import parse_shard_tag
from kombu_pgjobs.store.admin import record_dead_letter
from kombu_pgjobs.store.history import record_outcome

from .retry import rule_of
from .state import installed

__all__ = ["on_task_failure", "on_task_rejected", "rebuild_message", "storable"]

log = logging.getLogger("celery_ext")

#: Celery protocol 2 headers, copied from the request when the original row is gone
_HEADERS = ("lang", "task", "id", "shadow", "eta", "expires", "group", "group_index",
            "retries", "timelimit", "root_id", "parent_id", "argsrepr", "kwargsrepr", "origin",
            "ignore_result", "replaced_task_nesting", "stamped_headers", "stamps")
_MAX_TEXT = 64 * 1024
_backends: dict[int, tuple[int, list[Backend]]] = {}


def _all_backends(app: Any) -> list[Backend]:
    """This process's pgjobs backends for the app's broker, one per database of its shard map
    (index = the shard number in delivery tags; [] when the broker is not pgjobs)."""
    hit = _backends.get(id(app))
    if hit is not None and hit[0] == os.getpid():
        return hit[1]
    with app.pool.acquire(block=True, timeout=10) as conn:
        transport = conn.transport
        backends: list[Backend] = []
        if isinstance(transport, PgJobsTransport):
            shards = transport.shards
            backends = list(shards.backends) if shards is not None else [transport.backend]
    _backends[id(app)] = (os.getpid(), backends)
    return backends


def _backend(app: Any, shard: int = 0) -> Backend | None:
    """The backend of database ``shard`` (0: the broker URL's); None when not pgjobs."""
    backends = _all_backends(app)
    return backends[shard] if 0 <= shard < len(backends) else None


def queue_of(task: Any, delivery_info: dict[str, Any] | None) -> str:
    """The queue a delivered task came from: its routing key, else the task's or the app's
    default queue (a dead letter, an outcome told to the transport)."""
    return ((delivery_info or {}).get("routing_key") or task.queue
            or task.app.conf.task_default_queue)


def _transport_buries(task: Any, exc: BaseException) -> bool:
    """Will Celery reject this failure without requeue (so pgjobs dead-letters it itself)?"""
    if not getattr(task, "acks_late", False):
        return False
    flag = getattr(task, "acks_on_timeout" if isinstance(exc, TimeLimitExceeded)
                   else "acks_on_failure", None)
    if flag is None:
        flag = getattr(task, "acks_on_failure_or_timeout", True)
    return not flag


def rebuild_message(task: Any, request: Any) -> dict[str, Any]:
    """The kombu message of a request whose row is gone (acked before it ran: ``acks_late``
    off), rebuilt so that ``pgjobs dead requeue`` gives Celery a message it can run."""
    data = request.__dict__
    headers = {k: data[k] for k in _HEADERS if k in data}
    headers.update(request.headers or {})
    headers.update({"lang": "py", "task": task.name, "eta": None})
    embed = {"callbacks": request.callbacks, "errbacks": request.errbacks,
             "chain": request.chain, "chord": request.chord}
    serializer = task.serializer or task.app.conf.task_serializer
    content_type, encoding, body = dumps(
        [list(request.args or ()), dict(request.kwargs or {}), embed], serializer=serializer)
    raw = body if isinstance(body, bytes) else body.encode(encoding or "utf-8")
    info = request.delivery_info or {}
    return {
        "body": base64.b64encode(raw).decode("ascii"),
        "content-encoding": encoding,
        "content-type": content_type,
        "headers": headers,
        "properties": {
            "correlation_id": request.correlation_id or request.id,
            "reply_to": request.reply_to,
            "delivery_mode": 2,
            "delivery_info": {"exchange": info.get("exchange") or "",
                              "routing_key": info.get("routing_key")},
            "priority": info.get("priority") or 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }


def storable(text: str) -> str:
    """Text an operator reads, made storable in a ``jsonb`` column: a NUL (which jsonb refuses)
    becomes the visible escape ``\\x00`` and a lone surrogate (which no UTF-8 reader takes)
    ``\\udc80``. Never refused: a failure whose text the database would reject must still be
    dead-lettered (its message was already acked; the failure would be gone)."""
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _error(task: Any, request: Any, exc: BaseException, einfo: Any) -> dict[str, Any]:
    text = getattr(einfo, "traceback", None) or "".join(
        tb_module.format_exception(type(exc), exc, exc.__traceback__))
    return {
        "type": storable(f"{type(exc).__module__}.{type(exc).__qualname__}"),
        "message": storable(str(exc)[:_MAX_TEXT]),
        "traceback": storable(str(text)[-_MAX_TEXT:]),
        "rule": rule_of(exc),
        "task_id": request.id,
        "retries": request.retries,
        "max_retries": task.max_retries,
        "hostname": request.hostname,
    }


def _reason(exc: BaseException) -> str:
    """``failed``, or the reason an exception names for itself (``dead_letter_reason``: a
    webhook to a disabled endpoint is ``endpoint_disabled``)."""
    reason = getattr(exc, "dead_letter_reason", None)
    return reason if isinstance(reason, str) and reason else "failed"


def on_task_failure(sender: Any = None, exception: BaseException | None = None,
                    einfo: Any = None, **_: Any) -> None:
    """Signal receiver. Never raises: a dead letter that cannot be written is logged, and the
    failure is still in Celery's result backend."""
    task = sender
    app = getattr(task, "app", None)
    if app is None or not installed(app):
        return
    if exception is None or isinstance(exception, (Reject, Ignore, Retry)):
        return
    request = task.request
    if request is None or request.called_directly or request.is_eager or request.id is None:
        return
    if _transport_buries(task, exception):
        return
    try:
        props = request.properties or {}
        found = parse_shard_tag(props.get("delivery_tag"))
        # on the message's own database (a shard map's): its row, its dead letters
        backend = _backend(app, found[2] if found else 0)
        if backend is None:
            return
        pair = found[:2] if found else None
        info = request.delivery_info or {}
        queue = queue_of(task, info)
        started = getattr(request, "pgjobs_started", None)
        elapsed = time.monotonic() - started if isinstance(started, float) else None
        if not getattr(task, "dead_letter", True):
            # nothing kept: the settle is 'dropped' (its ack records it, or amends an early
            # ack's history row)
            backend.publishing(lambda conn: record_outcome(
                conn, backend.options.schema, job=pair, outcome="dropped", queue=queue,
                shard=backend.worker, task=task.name, elapsed=elapsed))
            return
        error = _error(task, request, exception, einfo)
        try:
            message: dict[str, Any] = rebuild_message(task, request)
        except Exception as exc:  # arguments the serializer refuses: keep what we know
            message = {"headers": {"task": task.name, "id": request.id}, "body": None,
                       "x-pgjobs-unrebuildable": str(exc)[:500]}
        dead_id = backend.publishing(lambda conn: record_dead_letter(
            conn, backend.options.schema, queue=queue, task=task.name, message=message,
            reason=_reason(exception),
            error={**error, "job_id": pair[0] if pair else None}, job=pair,
            priority=int(info.get("priority") or 0), attempts=1,
            max_attempts=getattr(task, "max_attempts", None), shard=backend.worker,
            elapsed=elapsed))
        log.info("celery_ext.dead_letter.recorded task=%s id=%s dead_letter=%s rule=%s",
                 task.name, request.id, dead_id, error["rule"],
                 extra={"action": "celery_ext.dead_letter.recorded", "dead_letter": dead_id})
    except Exception:
        log.exception("celery_ext.dead_letter.failed task=%s id=%s", task.name, request.id,
                      extra={"action": "celery_ext.dead_letter.failed"})


def on_task_rejected(sender: Any = None, task_id: str | None = None,
                     exception: BaseException | None = None, **_: Any) -> None:
    """``task_failure`` of ``Reject(reason, requeue=False)`` (sent in the worker's main process
    just before it rejects the message): tell the transport the reason, which it stores in the
    dead letter's ``error`` (``{"type": "Reject", "message": reason}``). Never raises."""
    if not isinstance(exception, Reject) or exception.requeue or not task_id:
        return
    app = getattr(sender, "app", None)
    if app is None or not installed(app):
        return
    try:
        # the reject settles on the message's database, which is not known here: each
        # database's backend keeps the reason (bounded; an unused one goes with the oldest)
        for backend in _all_backends(app):
            backend.note_reject_reason(task_id, storable(str(exception.reason)))
    except Exception:
        log.exception("celery_ext.dead_letter.reason_lost id=%s", task_id,
                      extra={"action": "celery_ext.dead_letter.reason_lost"})
