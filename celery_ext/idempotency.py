"""Idempotency keys and the tenant queue cap: guards checked by Postgres at publish.

Idempotency keys::

    @app.task(tenant=lambda order_id: ORG_OF[order_id],
              idempotency_key=lambda order_id: f"order-{order_id}")
    def charge(order_id): ...

    charge.delay(42)                                        # queued
    charge.delay(42)                                        # inserts nothing; the AsyncResult
                                                            # of the first
    charge.apply_async((43,), idempotency_key="manual-1")   # a key given per call wins

While a live message (ready, delayed, waiting or running) of the same task and tenant holds the
key, a publish of another one inserts nothing and ``apply_async`` returns the ``AsyncResult`` of
the message that holds it. A partial unique index over the live rows enforces it, so publishers
in any number of processes cannot both insert. Once the holder is acked (or dead) the key is
free again. The key travels as the ``x-pgjobs-idempotency-key`` header; the transport checks it
(``PGJ-505``, nothing written) and stores it. A retry (``Task.retry``, same task id) takes the
key over from the message it retries.

The tenant queue cap: ``app.conf.pgjobs_tenant_max_queued = N``. A publish that would give a
tenant more than N live messages raises :class:`~kombu_pgjobs.errors.TenantQueueFull`
(``PGJ-506``) at ``delay()``, nothing written. Each tenanted message carries N as the
``x-pgjobs-tenant-max-queued`` header (the transport never reads Celery's configuration); the
count is Postgres's, taken under a per-tenant lock in the publish's own statement. A retry is
not capped: the message it replaces is still live, and refusing it would fail the task.

Both make the publish confirmed even with ``confirm_publish=False``: its outcome is the answer.
Inside ``kombu_pgjobs.batch()`` ``apply_async`` returns the message's own ``AsyncResult`` (the
batch is sent when the block exits); duplicates are reported by the block's ``Batch``.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kombu_pgjobs.errors import InvalidIdempotencyKey
from kombu_pgjobs.limits import check_cap, check_key
from kombu_pgjobs.store.core import IDEMPOTENCY_HEADER, MAX_QUEUED_HEADER

from .groups import once_per_group
from .limits import TENANT_HEADER
from .state import UNSET, declared_option

__all__ = [
    "check_idempotency_option",
    "max_queued",
    "retrying",
    "with_guards",
]

_RETRYING: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "pgjobs_retrying", default=False)


@contextmanager
def retrying() -> Iterator[None]:
    """Mark the publishes of a block as a task's retry (not capped)."""
    token = _RETRYING.set(True)
    try:
        yield
    finally:
        _RETRYING.reset(token)


def check_idempotency_option(cls: type) -> None:
    """Refuse an ``idempotency_key=`` that is not callable when the task class is made
    (``PGJ-505``): a fixed key would make every message of the task a duplicate of the first."""
    value = declared_option(cls, "idempotency_key")
    if value is UNSET or value is None or (callable(value) and not isinstance(value, str)):
        return
    name = getattr(cls, "name", None) or cls.__name__
    raise InvalidIdempotencyKey(
        f"idempotency_key= of task {name} must be a callable of the task's arguments "
        f"(a key per call goes to apply_async(idempotency_key=...)), got {value!r}")


def max_queued(conf: Any) -> int | None:
    """``pgjobs_tenant_max_queued``: the most live messages a tenant may have (None: no cap);
    a whole number in 1..100,000, else InvalidLimit (``PGJ-301``)."""
    value = conf.get("pgjobs_tenant_max_queued") if conf is not None else None
    return None if value is None else check_cap(value, "pgjobs_tenant_max_queued")


def _key(task: Any, args: Any, kwargs: Any, given: Any,
         headers: Mapping[str, Any]) -> str | None:
    if given is None:
        fn: Callable[..., Any] | None = getattr(task, "idempotency_key", None)
        if fn is None:
            carried = headers.get(IDEMPOTENCY_HEADER)  # a retry keeps its message's key
            if carried is None:
                return None
            given = carried
        else:
            try:
                given = fn(*(args or ()), **(kwargs or {}))
            except Exception as exc:  # the app's function: the publisher's mistake
                raise InvalidIdempotencyKey(
                    f"idempotency_key function of task {task.name} failed on the task's "
                    f"arguments: {type(exc).__name__}: {exc}") from exc
    return check_key(given, f"idempotency key of task {task.name}",
                     error=InvalidIdempotencyKey)


def with_guards(task: Any, args: Any, kwargs: Any, options: dict[str, Any],
                headers: dict[str, Any] | None) -> dict[str, Any] | None:
    """``headers`` with the idempotency key (``options["idempotency_key"]``, popped, or the
    task's declared function) and the tenant cap stamped. Run after the tenant is stamped."""
    given = options.pop("idempotency_key", None)
    current = headers or {}
    key = _key(task, args, kwargs, given, current)
    retry = _RETRYING.get()
    cap = None if retry else once_per_group(task.app.conf, max_queued)
    capped = cap is not None and current.get(TENANT_HEADER) is not None
    stale = retry and MAX_QUEUED_HEADER in current  # a retry's copy of its message's headers
    if key is None and not capped and not stale:
        return headers
    out = dict(current)
    if key is not None:
        out[IDEMPOTENCY_HEADER] = key
    if capped:
        out[MAX_QUEUED_HEADER] = cap
    elif stale:
        del out[MAX_QUEUED_HEADER]
    return out
