"""The delivery task: one event to one endpoint per message, signed, recorded, retried.

One run of :data:`deliver` is one attempt:

1. read the endpoint (URL, secret, enabled) by id. A disabled endpoint is not attempted (no
   socket is opened): the task fails at once with :class:`WebhookEndpointDisabled`, which the
   dead letters record with reason ``endpoint_disabled``;
2. POST the event (a JSON envelope, the same bytes on every attempt) with the signature (v2:
   timestamp, event id and body), event-id, event-type and attempt headers, through the
   egress-checked client, the whole attempt within ``pgjobs_webhook_timeout`` of wall-clock
   time, never following a redirect;
3. classify the outcome (see :func:`classify_status`) and, before anything is retried or
   dead-lettered, write the attempt to the ledger in one statement with its effect on the
   endpoint: a 2xx clears the endpoint's consecutive failed deliveries; a delivery that failed
   for good (a terminal answer, or the last attempt) adds one, and disables the endpoint when
   that reaches its threshold;
4. return (delivered), or hand the error to celery_ext's retry classification: retried ones
   wait the backoff or the ``Retry-After`` the ledger row already names as ``next_attempt_at``;
   terminal ones and spent retries become dead letters (celery_ext's ``task_failure``
   receiver).

An attempt the worker abandons (killed mid-request, a shutdown that interrupts the body) writes
nothing and counts toward nothing: the message comes back by its lease like any other.
"""

from __future__ import annotations

import json
import logging
import os
import random
import time
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
import psycopg
from celery import shared_task

from kombu_pgjobs.errors import (
    DatabaseTimeout,
    DatabaseUnavailable,
    EgressRefused,
    InvalidWebhookEndpoint,
    PgJobsError,
    WebhookEndpointDisabled,
    WebhookEndpointNotFound,
    WebhookRejected,
    WebhookSecretLocked,
    WebhookThrottled,
    WebhookUnavailable,
)
from kombu_pgjobs.store.webhooks import MAX_EXCERPT, WebhookStore

from ..deadletter import _backend, storable
from ..retry import PgJobsTask, parse_retry_after, retry_after_delay
from .egress import attempt_deadline, guarded_client
from .settings import WebhookSettings, webhook_settings
from .signing import ATTEMPT_HEADER, EVENT_ID_HEADER, EVENT_TYPE_HEADER, SIGNATURE_HEADER, sign

__all__ = ["DELIVER_TASK", "Outcome", "backoff_delay", "classify_status", "deliver", "store"]

log = logging.getLogger("celery_ext.webhooks")

DELIVER_TASK = "pgjobs.webhooks.deliver"
USER_AGENT = "pgjobs-webhooks/1"
#: statuses retried (besides 5xx); every other non-2xx is terminal
RETRIED = frozenset({408, 429})
_clients: dict[tuple[Any, ...], tuple[int, httpx.Client]] = {}


def classify_status(status: int, retry_after: float | None) -> str:
    """``delivered`` (2xx), ``throttled`` (429, or a retried status naming a Retry-After),
    ``unavailable`` (408, 5xx) or ``rejected`` (everything else, redirects included)."""
    if 200 <= status < 300:
        return "delivered"
    if status in RETRIED or 500 <= status < 600:
        return "throttled" if status == 429 or retry_after is not None else "unavailable"
    return "rejected"


def backoff_delay(settings: WebhookSettings, attempt: int,
                  rand: Any = random.random) -> float:
    """Exponential backoff with jitter: ``backoff * 2**(attempt-1)``, capped at
    ``backoff_max``, then a random half of it taken off (never sooner than half the step, so a
    herd of retries spreads out without any coming back at once)."""
    step = min(settings.backoff_max, settings.backoff * 2.0 ** min(attempt - 1, 60))
    return step * (0.5 + 0.5 * rand())


@dataclass(slots=True)
class Outcome:
    """What one POST gave (no secret in it)."""

    kind: str                    # delivered | throttled | unavailable | rejected | refused
    status: int | None = None
    error: str | None = None
    excerpt: str | None = None
    location: str | None = None
    retry_after: float | None = None
    latency_ms: float = 0.0


def _client(settings: WebhookSettings) -> httpx.Client:
    """One client per process and egress policy (kept-alive connections were checked when
    they were made); a forked child makes its own."""
    key = (settings.allow_names, settings.allow_networks, settings.timeout)
    hit = _clients.get(key)
    if hit is not None and hit[0] == os.getpid():
        return hit[1]
    client = guarded_client(settings)
    _clients[key] = (os.getpid(), client)
    return client


def _read_excerpt(response: httpx.Response) -> str:
    """At most MAX_EXCERPT characters of the body: the rest is never read (a huge or endless
    response cannot hold the worker). A body cut short (the deadline's watchdog, a reset)
    leaves what arrived: the status is the answer."""
    got = b""
    try:
        for chunk in response.iter_raw():
            got += chunk
            if len(got) >= MAX_EXCERPT:
                break
    except httpx.TransportError:
        pass
    return storable(got[:MAX_EXCERPT].decode("utf-8", "replace"))


def _retry_after(response: httpx.Response) -> float | None:
    """Retry-After in seconds: delta-seconds, or an HTTP-date read against the response's own
    Date header (the server's clock, so a server whose clock is off still gets its wait)."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    now = None
    dates = response.headers.get_list("date")
    if dates:
        try:
            now = parsedate_to_datetime(dates[0])
        except (TypeError, ValueError, IndexError):
            now = None
        if now is not None and now.tzinfo is None:  # "-0000": UTC, says RFC 5322
            now = now.replace(tzinfo=timezone.utc)
    return parse_retry_after(value, now=now)


def post(settings: WebhookSettings, url: str, body: bytes,
         headers: dict[str, str]) -> Outcome:
    """One POST, all of it (the name lookup, connect, TLS, sending, the answer's head and the
    excerpt) within ``pgjobs_webhook_timeout`` of wall-clock time: a server that trickles
    cannot stretch it (:func:`.egress.attempt_deadline`)."""
    started = time.monotonic()
    budget = settings.timeout
    with attempt_deadline(budget) as attempt:
        try:
            with _client(settings).stream("POST", url, content=body, headers=headers,
                                          timeout=httpx.Timeout(budget)) as response:
                excerpt = _read_excerpt(response)
                retry_after = _retry_after(response)
                status = response.status_code
                # the status came in time: it is the answer, even if the watchdog then cut a
                # trickling body short (the excerpt is what arrived)
                out = Outcome(kind=classify_status(status, retry_after), status=status,
                              excerpt=excerpt, location=response.headers.get("location"),
                              retry_after=retry_after)
                if out.kind != "delivered":
                    out.error = f"HTTP {status} {response.reason_phrase}".strip()
        except EgressRefused as exc:
            out = Outcome(kind="refused", error=str(exc))
        except httpx.UnsupportedProtocol as exc:
            out = Outcome(kind="rejected", error=f"{type(exc).__name__}: {exc}")
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.TimeoutException) or attempt.expired:
                out = Outcome(kind="unavailable",
                              error=f"{type(exc).__name__}: no answer within {budget:g} s "
                                    "(the attempt's deadline: connect, send and receive)")
            else:
                out = Outcome(kind="unavailable", error=f"{type(exc).__name__}: {exc}"[:1000])
    out.latency_ms = (time.monotonic() - started) * 1000.0
    return out


def store(app: Any) -> tuple[Any, str]:
    """The pgjobs backend of ``app``'s broker and its schema (webhooks need a pgjobs://
    broker)."""
    backend = _backend(app)
    if backend is None:
        raise InvalidWebhookEndpoint(
            "webhooks keep their endpoints and ledger in the pgjobs schema: the app's broker "
            "must be pgjobs://")
    return backend, backend.options.schema


def envelope(event_id: str, event_type: str, payload: Any, created: int) -> bytes:
    """The body: the same bytes on every attempt of the event."""
    return json.dumps({"id": event_id, "type": event_type, "created": created,
                       "data": payload}, separators=(",", ":"), ensure_ascii=False
                      ).encode("utf-8")


def _error(outcome: Outcome, url: str) -> PgJobsError:
    text = f"POST {url}: {outcome.error}"
    if outcome.location:
        text += f"; redirect to {outcome.location} not followed"
    if outcome.excerpt:
        text += f"; response: {outcome.excerpt[:300]}"
    if outcome.kind == "refused":
        return EgressRefused(outcome.error)
    if outcome.kind == "rejected":
        return WebhookRejected(text)
    if outcome.kind == "throttled":
        return WebhookThrottled(text)
    return WebhookUnavailable(text)


class WebhookTask(PgJobsTask):
    """The delivery task's class: its retry classification. The body computes each delay
    itself (it is in the ledger before the retry is published), so the ``retry_after`` rule
    takes the exception's value as it is: no further clamp or jitter here."""

    abstract = True
    terminal = (WebhookRejected, EgressRefused, WebhookEndpointDisabled,
                WebhookEndpointNotFound, InvalidWebhookEndpoint)
    retry_after = (WebhookThrottled,)
    #: a database that failed under the attempt (the ledger could not be written) is an
    #: ordinary fault: the event is sent again later (receivers deduplicate on its id)
    retryable = (WebhookUnavailable, psycopg.OperationalError, DatabaseUnavailable,
                 DatabaseTimeout, WebhookSecretLocked)
    retry_after_max = 1e9
    retry_after_jitter = 0.0
    acks_late = True
    tenant = "none"


@shared_task(bind=True, base=WebhookTask, name=DELIVER_TASK, max_retries=11)
def deliver(self: WebhookTask, endpoint_id: int, event_id: str, event_type: str,
            payload: Any, created: int) -> dict[str, Any]:
    settings = webhook_settings(self.app.conf)
    self.max_retries = settings.max_attempts - 1  # Celery's retry reads it
    backend, schema = store(self.app)
    attempt = int(self.request.retries or 0) + 1
    try:
        endpoint = backend.publishing(lambda c: WebhookStore(
            c, schema, box=settings.secret_box).for_delivery(endpoint_id))
    except WebhookSecretLocked as exc:
        # nothing was sent, so no ledger row; waits the backoff like an unanswered attempt
        # (another worker may hold the key), and fails for good when the attempts run out
        log.warning("celery_ext.webhook.secret_locked endpoint=%s event=%s: %s", endpoint_id,
                    event_id, exc, extra={"action": "celery_ext.webhook.secret_locked",
                                          "endpoint_id": endpoint_id, "event_id": event_id})
        if attempt >= settings.max_attempts:
            raise
        raise self.retry(exc=exc, countdown=backoff_delay(settings, attempt)) from None
    if endpoint is None:
        raise WebhookEndpointNotFound(f"no webhook endpoint with id {endpoint_id}")
    if not endpoint.enabled:
        exc = WebhookEndpointDisabled(
            f"webhook endpoint {endpoint_id} is disabled: event {event_id} was not attempted "
            "(`pgjobs webhooks enable ID`, then `pgjobs dead requeue`)")
        exc.dead_letter_reason = "endpoint_disabled"  # type: ignore[attr-defined]
        raise exc
    body = envelope(event_id, event_type, payload, created)
    headers = {
        "Content-Type": "application/json", "User-Agent": USER_AGENT,
        "Accept-Encoding": "identity",  # the excerpt is raw bytes, never a decompressed bomb
        EVENT_ID_HEADER: event_id, EVENT_TYPE_HEADER: event_type,
        ATTEMPT_HEADER: str(attempt),
        SIGNATURE_HEADER: sign(endpoint.secret, body, event_id, v1=settings.sign_v1),
    }
    outcome = post(settings, endpoint.url, body, headers)
    final = outcome.kind in ("rejected", "refused") or attempt >= settings.max_attempts
    delay: float | None = None
    if outcome.kind == "delivered":
        effect, result = "reset", "delivered"
    elif final:
        effect, result = "count", "failed"
    else:
        effect, result = "none", "retrying"
        if outcome.retry_after is not None:
            delay = retry_after_delay(outcome.retry_after, maximum=settings.backoff_max,
                                      jitter=0.1)
        else:
            delay = backoff_delay(settings, attempt)
    row = backend.publishing(lambda c: WebhookStore(c, schema).record_attempt({
        "endpoint_id": endpoint_id, "event_id": event_id, "event_type": event_type,
        "task_id": self.request.id, "attempt": attempt, "status": outcome.status,
        "latency_ms": outcome.latency_ms, "outcome": result, "error": outcome.error,
        "excerpt": outcome.excerpt, "location": outcome.location,
        "retry_after": outcome.retry_after, "delay": delay,
    }, effect=effect, disable_after=settings.disable_after))
    fields = {"action": f"celery_ext.webhook.{result}", "endpoint_id": endpoint_id,
              "event_id": event_id, "attempt": attempt, "status": outcome.status}
    log.info("celery_ext.webhook.%s endpoint=%s event=%s attempt=%s status=%s error=%s",
             result, endpoint_id, event_id, attempt, outcome.status, outcome.error,
             extra=fields)
    if row["disabled_now"]:
        log.warning("celery_ext.webhook.endpoint_disabled endpoint=%s after %s consecutive "
                    "failed deliveries", endpoint_id, row["consecutive_failures"],
                    extra={**fields, "action": "celery_ext.webhook.endpoint_disabled"})
    if outcome.kind == "delivered":
        return {"endpoint_id": endpoint_id, "event_id": event_id, "status": outcome.status,
                "attempt": attempt, "attempt_id": row["id"]}
    error = _error(outcome, endpoint.url)
    if final:
        raise error
    if isinstance(error, WebhookThrottled):
        error.retry_after = delay  # type: ignore[attr-defined]  # read by the retry_after rule
    raise self.retry(exc=error, countdown=delay)
