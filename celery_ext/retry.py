"""Retry classification: which exceptions end a task, which wait the time the error names, and
which retry on Celery's own backoff.

A task declares it with options (``@app.task(terminal=..., retry_after=..., retryable=...)``)
and the :class:`Task` base class applies them where the exception leaves the task body and where
``Task.retry`` is called (so Celery's ``autoretry_for`` goes through it too):

* ``terminal``: the task fails on the attempt it happens, whatever retries remain; with
  celery_ext installed the failure is recorded as a dead letter (rule ``terminal``).
* ``retry_after``: the next attempt is scheduled at the time the error names (an HTTP 429's
  ``Retry-After``), clamped to ``retry_after_max`` with ``retry_after_jitter`` added on top so
  many tasks told the same time do not come back at once. The delay becomes the message's due
  time in Postgres, so nothing waits in a worker's memory.
* ``retryable``: retried on Celery's own backoff (``retry_backoff``, ``retry_backoff_max``,
  ``retry_jitter``; ``default_retry_delay`` when backoff is off).

Unclassified exceptions keep Celery's behaviour. Every rule counts against ``max_retries``; when
they are spent the task fails for good and the dead letter records the rule that stopped it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from email.utils import parsedate_to_datetime
from typing import Any

from celery import Task as CeleryTask
from celery.exceptions import TaskPredicate
from celery.utils.time import get_exponential_backoff_interval

from kombu_pgjobs.errors import InvalidLimit, InvalidTaskOption, PgJobsError, PublishFailed
from kombu_pgjobs.store.admin import LAST_ERROR_HEADER
from kombu_pgjobs.store.core import take_publish_outcome

from .headers import with_task_headers
from .idempotency import check_idempotency_option, retrying, with_guards
from .limits import check_task_limits, needs_late_ack, with_limits
from .tenant import (
    check_tenant_option,
    check_tenant_required,
    installed_tenant,
    tenant_for_body,
    with_tenant,
)

__all__ = [
    "RULES",
    "PgJobsTask",
    "classify",
    "parse_retry_after",
    "retry_after_delay",
    "retry_after_seconds",
    "rule_of",
]

#: what a dead letter's ``error.rule`` can say
RULES = ("terminal", "retry_after", "retryable", "unclassified")
_RULE_ATTR = "_pgjobs_rule"
_EXC_OPTIONS = ("terminal", "retry_after", "retryable")


def _mark(exc: BaseException, rule: str) -> None:
    try:
        setattr(exc, _RULE_ATTR, rule)
    except (AttributeError, TypeError):  # an exception type that refuses attributes
        pass


def rule_of(exc: BaseException | None) -> str:
    """The rule that applied to this exception (``unclassified`` when none did)."""
    return str(getattr(exc, _RULE_ATTR, None) or "unclassified")


def classify(task: Any, exc: BaseException) -> str | None:
    """``terminal`` beats ``retry_after`` beats ``retryable``; None: unclassified."""
    for rule in _EXC_OPTIONS:
        kinds = getattr(task, rule, ()) or ()
        if kinds and isinstance(exc, kinds):
            return rule
    return None


def parse_retry_after(value: Any, *, now: datetime | None = None) -> float | None:
    """Seconds from a Retry-After value: a number of seconds (int, float or numeric string), a
    timedelta, a datetime, or an HTTP-date string. None when absent or unreadable; never
    negative."""
    if value is None or isinstance(value, bool):
        return None
    seconds: float | None = None
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (datetime, str, bytes)):
        when: datetime | None = value if isinstance(value, datetime) else None
        if when is None:
            text = value.decode("latin-1") if isinstance(value, bytes) else value
            text = text.strip()
            try:
                seconds = float(text)
            except ValueError:
                try:
                    when = parsedate_to_datetime(text)
                except (TypeError, ValueError, IndexError):
                    return None
        if when is not None:
            if when.tzinfo is None:
                when = when.replace(tzinfo=timezone.utc)
            seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    if seconds is None or not math.isfinite(seconds):
        return None
    return max(seconds, 0.0)


def retry_after_seconds(exc: BaseException,
                        source: Callable[[BaseException], Any] | str | None = None
                        ) -> float | None:
    """The delay an error names. ``source`` is a callable (exc -> seconds/date), or the name of
    the exception's attribute; by default ``exc.retry_after``, then a ``Retry-After`` header on
    ``exc.response.headers`` or ``exc.headers`` (requests, httpx and most HTTP clients)."""
    if callable(source):
        return parse_retry_after(source(exc))
    if isinstance(source, str):
        return parse_retry_after(getattr(exc, source, None))
    value = getattr(exc, "retry_after", None)
    if value is None:
        for holder in (getattr(exc, "response", None), exc):
            headers = getattr(holder, "headers", None)
            if headers is not None and hasattr(headers, "get"):
                value = headers.get("Retry-After") or headers.get("retry-after")
                if value is not None:
                    break
    return parse_retry_after(value)


def retry_after_delay(seconds: float, *, maximum: float, jitter: float,
                      rand: Callable[[], float] = random.random) -> float:
    """Clamp to ``maximum``, then add up to ``jitter`` x the delay (never earlier than asked,
    unless the maximum cut it)."""
    base = min(max(float(seconds), 0.0), float(maximum))
    return base * (1.0 + max(float(jitter), 0.0) * rand())


def _check_options(cls: type) -> None:
    """Task options are checked when the task class is made: a mistake fails at definition,
    not on the first failure in production."""
    for name in _EXC_OPTIONS:
        kinds = getattr(cls, name, ())
        if isinstance(kinds, type):
            kinds = (kinds,)
            setattr(cls, name, kinds)
        if not isinstance(kinds, (tuple, list)) or not all(
                isinstance(k, type) and issubclass(k, BaseException) for k in kinds):
            raise InvalidTaskOption(
                f"task option {name}= of {cls.__name__} must be exception classes, got {kinds!r}")
        setattr(cls, name, tuple(kinds))
    max_attempts = getattr(cls, "max_attempts", None)
    if max_attempts is not None and (
            isinstance(max_attempts, bool) or not isinstance(max_attempts, int)
            or not 1 <= max_attempts <= 1_000_000):
        raise InvalidTaskOption(
            f"task option max_attempts= of {cls.__name__} must be a whole number in "
            f"1-1000000, got {max_attempts!r}")
    for name, low in (("retry_after_max", 0.0), ("retry_after_jitter", 0.0)):
        value = getattr(cls, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < low:
            raise InvalidTaskOption(
                f"task option {name}= of {cls.__name__} must be a finite number >= {low:g}, "
                f"got {value!r}")
    source = getattr(cls, "retry_after_seconds", None)
    if source is not None and not (callable(source) or isinstance(source, str)):
        raise InvalidTaskOption(
            f"task option retry_after_seconds= of {cls.__name__} must be a callable or an "
            f"attribute name, got {source!r}")


#: headers whose publish has an outcome to read (an idempotency key, a tenant cap)
_GUARD_HEADERS = ("x-pgjobs-idempotency-key", "x-pgjobs-tenant-max-queued")


class PgJobsTask(CeleryTask):
    """Celery's Task with pgjobs options: attempts, retry classification, dead letters."""

    abstract = True
    #: the worker's request class: notes how each run ended, for on_settled's outcome
    Request = "celery_ext.settled:OutcomeRequest"
    #: deliveries before pgjobs buries the message (x-pgjobs-max-attempts; None: transport's)
    max_attempts: int | None = None
    #: exceptions that fail the task at once (dead-lettered, remaining retries unspent)
    terminal: tuple[type[BaseException], ...] = ()
    #: exceptions that name when to retry (Retry-After)
    retry_after: tuple[type[BaseException], ...] = ()
    #: how to read that time: callable(exc) or an attribute name; default: see
    #: :func:`retry_after_seconds`
    retry_after_seconds: Callable[[BaseException], Any] | str | None = None
    #: most seconds a retry_after error may push the next attempt out
    retry_after_max: float = 3600.0
    #: up to this fraction of the delay is added at random
    retry_after_jitter: float = 0.1
    #: exceptions retried on Celery's backoff
    retryable: tuple[type[BaseException], ...] = ()
    #: record a final failure as a dead letter (celery_ext.install)
    dead_letter: bool = True
    #: at most this many messages of the task running fleet-wide (see celery_ext.limits)
    concurrency: int | None = None
    #: callable(*args, **kwargs) -> str: the key whose running messages are capped
    concurrency_key: Callable[..., str] | None = None
    #: the cap per key (default 1 when a key is given)
    concurrency_per_key: int | None = None
    #: a full key: "wait" (stay queued, uncounted) or "fail" (dead-lettered, PGJ-302)
    when_busy: str = "wait"
    #: callable(*args, **kwargs) -> str: whose work a message is; "none": no one's; None:
    #: undeclared (see celery_ext.tenant)
    tenant: Callable[..., str] | str | None = None
    #: callable(*args, **kwargs) -> str: while a live message of this task and tenant holds the
    #: key, publishing another inserts nothing (see celery_ext.idempotency)
    idempotency_key: Callable[..., str] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for option in ("retry_after_seconds", "concurrency_key", "tenant", "idempotency_key"):
            if isinstance(cls.__dict__.get(option), type(lambda: None)):
                # a plain function given as a task option must not become a bound method
                setattr(cls, option, staticmethod(cls.__dict__[option]))
        _check_options(cls)
        check_task_limits(cls)
        check_tenant_option(cls)
        check_idempotency_option(cls)

    @classmethod
    def bind(cls, app: Any) -> Any:
        explicit = cls.__dict__.get("acks_late")
        bound = super().bind(app)
        # the decorator checked the settings known then; a configuration loaded later
        # (config_from_object) is checked here, before the task can publish or run
        check_tenant_required(cls.name, cls.tenant, app.conf)
        if needs_late_ack(cls, app.conf):
            if explicit is False:
                raise InvalidLimit(
                    f"task {cls.name} has a concurrency limit and acks_late=False: a limit "
                    "holds from claim to ack, so it needs acks_late=True (the default here)")
            cls.acks_late = True
        return bound

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # when the run began, for the outcome a failure tells the transport (deadletter.py)
        self.request.pgjobs_started = time.monotonic()
        try:
            tenant = tenant_for_body(self, args, kwargs)
        except PgJobsError as exc:  # the body must not run; retrying cannot fix the message
            _mark(exc, "terminal")
            raise
        with installed_tenant(tenant):
            return self._run_classified(*args, **kwargs)

    def _run_classified(self, *args: Any, **kwargs: Any) -> Any:
        from .cancel import Cancelled, ended

        try:
            return super().__call__(*args, **kwargs)
        except TaskPredicate:  # Retry, Ignore, Reject: Celery's own control flow
            raise
        except Cancelled as exc:  # celery_ext.checkpoint(): the run was cancelled or lost
            if self.request.called_directly:
                raise
            raise ended(self, exc) from None
        except Exception as exc:
            if self.request.called_directly:
                raise
            rule = classify(self, exc)
            _mark(exc, rule or "unclassified")
            if rule is None or rule == "terminal":
                raise
            raise self.retry(exc=exc) from None

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: Any = None,
                    producer: Any = None, link: Any = None, link_error: Any = None,
                    shadow: Any = None, **options: Any) -> Any:
        headers = with_task_headers(self, options.get("headers"))
        headers = with_tenant(self, args, kwargs, headers)  # before limits: tenant caps read it
        headers = with_limits(self, args, kwargs, options, headers)
        headers = with_guards(self, args, kwargs, options, headers)  # after the tenant
        if headers is not None:
            options["headers"] = headers
        guarded = headers is not None and any(h in headers for h in _GUARD_HEADERS)
        if guarded:
            take_publish_outcome()  # nothing stale can answer for this publish
        result = super().apply_async(args, kwargs, task_id, producer, link, link_error,
                                     shadow, **options)
        if not guarded:
            return result
        outcome = take_publish_outcome(result.id)
        if outcome is None or outcome.inserted:  # inserted, or held for a batch (or eager)
            return result
        if outcome.holder_task_id is None:
            raise PublishFailed(
                f"task {self.name}: the idempotency key of message {result.id} was taken and "
                "freed again three times while it was published; nothing was queued: "
                "publish it again")
        return self.AsyncResult(outcome.holder_task_id)

    def _backoff(self) -> float:
        """Celery's own retry delay, read the way its autoretry reads these options."""
        backoff = getattr(self, "retry_backoff", False)
        if backoff:
            return float(get_exponential_backoff_interval(
                factor=int(max(1.0, float(backoff))), retries=self.request.retries,
                maximum=int(getattr(self, "retry_backoff_max", 600)),
                full_jitter=getattr(self, "retry_jitter", True)))
        return float(self.default_retry_delay)

    def retry(self, args: Any = None, kwargs: Any = None, exc: BaseException | None = None,
              throw: bool = True, eta: Any = None, countdown: Any = None,
              max_retries: int | None = None, **options: Any) -> Any:
        if exc is not None and not self.request.called_directly:
            rule = classify(self, exc)
            if rule is not None:
                _mark(exc, rule)
            if rule == "terminal":
                raise exc
            if rule == "retry_after":
                seconds = retry_after_seconds(exc, self.retry_after_seconds)
                if seconds is not None:
                    eta, countdown = None, retry_after_delay(
                        seconds, maximum=self.retry_after_max, jitter=self.retry_after_jitter)
            if rule is not None and eta is None and countdown is None:
                countdown = self._backoff()
            if "headers" not in options:
                headers = dict(self.request.headers or {})
                headers.pop("x-death", None)  # as Celery's own retry: a RabbitMQ header
                headers[LAST_ERROR_HEADER] = {
                    "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
                    "message": str(exc)[:2000], "rule": rule or "unclassified",
                    "retries": self.request.retries}
                options["headers"] = headers
        with retrying():  # not capped; takes its key over from the message it retries
            return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                                 countdown=countdown, max_retries=max_retries, **options)
