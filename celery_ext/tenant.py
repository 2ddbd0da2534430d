"""The tenant a task acts for: declared on the task, carried in the message, installed for the body.

A task says whose work it is::

    @app.task(tenant=lambda *a, **kw: kw["org_id"])
    def sync_org(*, org_id: str) -> None:
        assert celery_ext.current_tenant() == org_id

    @app.task(tenant="none")          # acts for no tenant
    def rebuild_search_index() -> None: ...

At publish (the task's ``apply_async``: ``delay``, canvas members, ``retry``) the declared
function is called with the task's arguments and its value is stamped as the
``x-pgjobs-tenant`` header, which the tenant caps and rate (:mod:`celery_ext.limits`) read. A
function that raises or returns anything but a non-empty string of at most 200 characters
without control characters is :class:`~kombu_pgjobs.errors.InvalidTenant` (``PGJ-503``) and
nothing is written.

In the worker the body runs with :func:`current_tenant` set to the tenant its *declaration*
gives for its *arguments* — computed again there, never read from the header: the header is
attribution (which tenant's caps the message counts against), never authority. A header that
disagrees with the declaration stops the message (:class:`TenantMismatch`, ``PGJ-504``).
``tenant="none"`` and tasks that declare nothing run with None whatever header the message
carries. The value lives in a :class:`contextvars.ContextVar` set around the body and reset in
a ``finally``, so it never outlives the body on a prefork child, a thread or a greenlet.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kombu_pgjobs.errors import (
    InvalidTenant,
    InvalidTenantOption,
    TenantMismatch,
    TenantRequired,
)
from kombu_pgjobs.limits import check_key

from .limits import TENANT_HEADER
from .state import UNSET, declared_option

__all__ = [
    "NO_TENANT",
    "TENANT_HEADER",
    "check_tenant_option",
    "check_tenant_required",
    "current_tenant",
    "declared_tenant",
    "tenant_for_body",
    "tenant_required",
    "with_tenant",
]

#: ``tenant=NO_TENANT``: the task acts for no tenant (its body always sees None)
NO_TENANT = "none"

_CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pgjobs_tenant", default=None)


def current_tenant() -> str | None:
    """The tenant the running task body acts for; None outside a task body, in a task declared
    ``tenant="none"`` and in a task that declares no tenant."""
    return _CURRENT.get()


@contextmanager
def installed_tenant(tenant: str | None) -> Iterator[None]:
    """Run a block with ``tenant`` as :func:`current_tenant` and put back what was there
    before, however the block ends (return, exception, Celery's Retry/Reject/Ignore)."""
    token = _CURRENT.set(tenant)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def check_tenant_option(cls: type) -> None:
    """Refuse a ``tenant=`` that is neither callable nor ``"none"`` when the task class is made
    (``PGJ-502``). An explicit ``tenant=None`` is refused too: "no tenant" is said with
    ``"none"``, so a forgotten value cannot pass for a deliberate one."""
    value = declared_option(cls, "tenant")
    if value is UNSET or value == NO_TENANT or (callable(value) and not isinstance(value, str)):
        return
    name = getattr(cls, "name", None) or cls.__name__
    raise InvalidTenantOption(
        f'tenant= of task {name} must be a callable of the task\'s arguments or "none", '
        f"got {value!r}")


def tenant_required(conf: Any) -> bool:
    """``pgjobs_tenant_required``: whether every task must declare ``tenant=``."""
    value = conf.get("pgjobs_tenant_required") if conf is not None else None
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidTenantOption(
            f"pgjobs_tenant_required must be True or False, got {value!r}")
    return value


def check_tenant_required(name: str | None, declared: Any, conf: Any) -> None:
    """Fail closed: with ``pgjobs_tenant_required`` a task without ``tenant=`` is refused
    (``PGJ-501``). Celery's own tasks (``celery.*``) act for no tenant and are let through."""
    required = tenant_required(conf)  # a bad setting is refused whatever the task declares
    if declared is not None or not name or name.startswith("celery."):
        return
    if required:
        raise TenantRequired(
            f"task {name or '?'} has no tenant= and the app sets pgjobs_tenant_required: "
            'declare tenant=<function of its arguments>, or tenant="none"')


def _declaration(task: Any) -> Callable[..., Any] | str | None:
    return getattr(task, "tenant", None)


def declared_tenant(task: Any, args: Any, kwargs: Any) -> str | None:
    """The tenant ``task``'s declaration gives for these arguments (None: no tenant)."""
    fn = _declaration(task)
    if fn is None or fn == NO_TENANT:
        return None
    try:
        value = fn(*(args or ()), **(kwargs or {}))
    except Exception as exc:  # whatever the app's function raises: the publisher's mistake
        raise InvalidTenant(
            f"tenant function of task {task.name} failed on the task's arguments: "
            f"{type(exc).__name__}: {exc}") from exc
    return check_key(value, f"tenant of task {task.name}", error=InvalidTenant)


def with_tenant(task: Any, args: Any, kwargs: Any,
                headers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``headers`` with the declared tenant stamped (the declaration wins over a header given
    by hand). A task declared ``"none"`` or not at all keeps whatever header the caller passed:
    it still attributes the message to that tenant's caps, and never reaches the body."""
    tenant = declared_tenant(task, args, kwargs)
    if tenant is None:
        return dict(headers) if headers is not None else None
    out = dict(headers or {})
    out[TENANT_HEADER] = tenant
    return out


def tenant_for_body(task: Any, args: Any, kwargs: Any) -> str | None:
    """The tenant to install for one run of ``task``'s body: computed from its declaration and
    arguments; a message header naming another tenant is refused (``PGJ-504``)."""
    tenant = declared_tenant(task, args, kwargs)
    if tenant is None:
        return None
    request = task.request
    headers = getattr(request, "headers", None) or {}
    carried = headers.get(TENANT_HEADER) if isinstance(headers, Mapping) else None
    if carried is None and not request.called_directly:
        carried = getattr(request, TENANT_HEADER, None)  # protocol 1 / headers merged flat
    if carried is not None and carried != tenant:
        raise TenantMismatch(
            f"message {request.id} of task {task.name} carries {TENANT_HEADER}={carried!r} "
            f"but its arguments give tenant {tenant!r}: refused (the header is attribution, "
            "never authority)")
    return tenant
