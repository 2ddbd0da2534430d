"""Fleet-wide limits, declared on tasks and on the app, sent as the ``x-pgjobs-limits`` header.

Task options (checked when the task is defined, :class:`kombu_pgjobs.errors.InvalidLimit`,
``PGJ-301``, or ``InvalidLimitKey``, ``PGJ-303``)::

    @app.task(concurrency=3)                          # at most 3 running, fleet-wide
    def rebuild_index(): ...

    @app.task(concurrency_key=lambda account_id, *a, **kw: str(account_id),
              concurrency_per_key=2, when_busy="wait")
    def sync_account(account_id, since=None): ...

* ``concurrency``: at most N messages of this task run at once across every worker.
* ``concurrency_key``: called with the task's arguments at publish; its value (a non-empty
  string of at most 200 characters) names the key; ``concurrency_per_key`` (default 1) caps it.
* ``when_busy``: ``"wait"`` (default: the message stays queued, uncounted, and runs when a slot
  frees) or ``"fail"`` (the message is dead-lettered as ``refused`` with code ``PGJ-302`` and its
  body never runs).

App settings (checked by :func:`celery_ext.install` and again at publish), for every task of a
celery_ext app:

* ``pgjobs_queue_limits = {"reports": 4}``: at most N running per queue;
* ``pgjobs_global_limit = 50``: at most N running in all;
* ``pgjobs_tenant_limit = 5``: at most N running per tenant (the ``x-pgjobs-tenant`` header);
* ``pgjobs_tenant_rate = (100, 60)``: at most 100 starts per tenant per 60-second window.

A concurrency limit counts a message from its claim to its ack, so tasks it applies to are made
``acks_late`` (acked when they end); declaring one with ``acks_late=False`` is refused.

A header the publisher passes itself (``apply_async(headers={"x-pgjobs-limits": ...})``) can
tighten these, never loosen them (:func:`with_limits`). The transport validates the header again
at publish and enforces it in the claim; nothing here runs in the worker.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kombu_pgjobs.errors import InvalidLimit, InvalidLimitKey
from kombu_pgjobs.limits import LIMITS_HEADER, WHEN_BUSY, check_cap, check_key, tighten

from .groups import once_per_group

__all__ = [
    "TENANT_HEADER",
    "AppLimits",
    "check_app_limits",
    "check_task_limits",
    "limits_header",
    "needs_late_ack",
    "with_limits",
]

#: where a message's tenant travels (the tenant-context feature sets it; any publisher may)
TENANT_HEADER = "x-pgjobs-tenant"


def check_task_limits(cls: type) -> None:
    """Refuse an invalid declaration when the task class is made."""
    name = getattr(cls, "name", None) or cls.__name__
    cap = getattr(cls, "concurrency", None)
    if cap is not None:
        check_cap(cap, f"concurrency= of task {name}")
    key = getattr(cls, "concurrency_key", None)
    per_key = getattr(cls, "concurrency_per_key", None)
    if key is not None and not callable(key):
        raise InvalidLimitKey(
            f"concurrency_key= of task {name} must be a callable taking the task's arguments "
            f"and returning a string, got {key!r}")
    if per_key is not None:
        check_cap(per_key, f"concurrency_per_key= of task {name}")
        if key is None:
            raise InvalidLimit(f"concurrency_per_key= of task {name} needs a concurrency_key=")
    busy = getattr(cls, "when_busy", "wait")
    if busy not in WHEN_BUSY:
        raise InvalidLimit(f"when_busy= of task {name} must be 'wait' or 'fail', got {busy!r}")


@dataclass(frozen=True)
class AppLimits:
    """The app-level limit settings, validated."""

    queues: dict[str, int]
    global_limit: int | None
    tenant_limit: int | None
    tenant_rate: tuple[int, float] | None

    @property
    def caps_running(self) -> bool:
        return bool(self.queues) or self.global_limit is not None \
            or self.tenant_limit is not None


def check_app_limits(conf: Any) -> AppLimits:
    """The app-level limit settings, or InvalidLimit for the first invalid one."""
    queues = conf.get("pgjobs_queue_limits") or {}
    if not isinstance(queues, Mapping):
        raise InvalidLimit(f"pgjobs_queue_limits must map queue names to limits, got {queues!r}")
    caps = {setting: None if conf.get(setting) is None else check_cap(conf.get(setting), setting)
            for setting in ("pgjobs_global_limit", "pgjobs_tenant_limit")}
    rate = conf.get("pgjobs_tenant_rate")
    return AppLimits(
        queues={q: check_cap(cap, f"pgjobs_queue_limits[{q!r}]") for q, cap in queues.items()},
        global_limit=caps["pgjobs_global_limit"], tenant_limit=caps["pgjobs_tenant_limit"],
        tenant_rate=None if rate is None else _rate(rate))


def needs_late_ack(cls: type, conf: Any) -> bool:
    """A limit counts a message from its claim to its ack, so a limited task must be acked
    when it ends (``acks_late``), not when it starts."""
    own = getattr(cls, "concurrency", None) is not None or \
        getattr(cls, "concurrency_key", None) is not None
    return own or check_app_limits(conf).caps_running


def _rate(rate: Any) -> tuple[int, float]:
    if not isinstance(rate, (tuple, list)) or len(rate) != 2:
        raise InvalidLimit(f"pgjobs_tenant_rate must be (starts, seconds), got {rate!r}")
    starts = check_cap(rate[0], "pgjobs_tenant_rate starts")
    per = rate[1]
    if isinstance(per, bool) or not isinstance(per, (int, float)) or not math.isfinite(per) \
            or not 0 < per <= 86_400:
        raise InvalidLimit(f"pgjobs_tenant_rate window must be seconds in (0, 86400], got {per!r}")
    return starts, float(per)


def _key_value(task: Any, fn: Callable[..., Any], args: Any, kwargs: Any) -> str:
    try:
        value = fn(*(args or ()), **(kwargs or {}))
    except Exception as exc:  # whatever the app's function raises: the publisher's mistake
        raise InvalidLimitKey(
            f"concurrency_key of task {task.name} failed on the task's arguments: "
            f"{type(exc).__name__}: {exc}") from exc
    return check_key(value, f"concurrency key of task {task.name}")


def _queue_of(task: Any, args: Any, kwargs: Any, options: Mapping[str, Any]) -> str | None:
    queue = options.get("queue")
    if queue is None:
        routed = task.app.amqp.router.route(dict(options), task.name, args, kwargs)
        queue = routed.get("queue")
    return getattr(queue, "name", queue)


def limits_header(task: Any, args: Any, kwargs: Any, options: Mapping[str, Any],
                  headers: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``x-pgjobs-limits`` value for one publish of ``task`` (None: no limits)."""
    # Most specific first: a flood of one key is parked by its first key (see 0003_limits.sql).
    caps: list[dict[str, Any]] = []
    busy = getattr(task, "when_busy", "wait")
    fn = getattr(task, "concurrency_key", None)
    if fn is not None:
        value = _key_value(task, fn, args, kwargs)
        caps.append({"key": f"key:{task.name}:{value}",
                     "limit": int(getattr(task, "concurrency_per_key", None) or 1),
                     "when_busy": busy})
    cap = getattr(task, "concurrency", None)
    if cap is not None:
        caps.append({"key": f"task:{task.name}", "limit": int(cap), "when_busy": busy})
    app = once_per_group(task.app.conf, check_app_limits)  # a group reads them once
    rates: list[dict[str, Any]] = []
    if app.queues:
        queue = _queue_of(task, args, kwargs, options)
        if queue in app.queues:
            caps.append({"key": f"queue:{queue}", "limit": app.queues[queue]})
    if app.global_limit is not None:
        caps.append({"key": "global", "limit": app.global_limit})
    tenant = headers.get(TENANT_HEADER)
    if tenant is not None and (app.tenant_limit is not None or app.tenant_rate is not None):
        tenant = check_key(tenant, f"{TENANT_HEADER} header")
        if app.tenant_limit is not None:
            caps.append({"key": f"tenant:{tenant}", "limit": app.tenant_limit})
        if app.tenant_rate is not None:
            starts, per = app.tenant_rate
            rates.append({"key": f"tenant:{tenant}", "limit": starts, "per": per})
    if not caps and not rates:
        return None
    out: dict[str, Any] = {}
    if caps:
        out["concurrency"] = caps
    if rates:
        out["rate"] = rates
    return out


def with_limits(task: Any, args: Any, kwargs: Any, options: Mapping[str, Any],
                headers: dict[str, Any] | None) -> dict[str, Any] | None:
    """``headers`` with the limits header the task and app declare for this publish.

    Caps are the app's, not the publisher's: an explicit ``x-pgjobs-limits`` in ``headers``
    (``apply_async(headers=...)``, a retry carrying its message's headers on, a webhook's
    endpoint cap) is combined with the declaration by :func:`kombu_pgjobs.limits.tighten`,
    so it can lower a declared limit, make a busy key refuse, or add a key of its own, and
    never raise, drop or soften what the app declares."""
    declared = limits_header(task, args, kwargs, options, headers or {})
    if headers is not None and LIMITS_HEADER in headers:
        value = tighten(declared, headers[LIMITS_HEADER])
    elif declared is None:
        return headers
    else:
        value = declared
    out = dict(headers or {})
    if value is None:
        out.pop(LIMITS_HEADER, None)  # an explicit null and nothing declared: no limits
    else:
        out[LIMITS_HEADER] = value
    return out
