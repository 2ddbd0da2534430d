"""Signed webhook deliveries: endpoints in Postgres, one Celery task per event and endpoint, a
ledger of every attempt, Retry-After, automatic disabling, and the receiver's ``verify``.

::

    import celery_ext
    import celery_ext.webhooks as webhooks

    app = Celery("shop", broker="pgjobs://...")
    celery_ext.install(app)          # the delivery task is registered by importing this module

    endpoint = webhooks.add_endpoint("https://customer.example/hooks", secret=secret)
    webhooks.send(endpoint, "order.paid", {"order": 42})

On the receiving side::

    event = webhooks.verify(request.headers, request.body, secret)  # WebhookSignatureInvalid
    # then process event.event_id at most once (docs/webhooks.md: deduplicating)

App settings: ``pgjobs_webhook_allow_hosts``, ``pgjobs_webhook_disable_after``,
``pgjobs_webhook_backoff``, ``pgjobs_webhook_backoff_max``, ``pgjobs_webhook_timeout``,
``pgjobs_webhook_max_attempts``, ``pgjobs_webhook_concurrency_per_endpoint``,
``pgjobs_webhook_secret_keys``, ``pgjobs_webhook_sign_v1`` (see
:mod:`celery_ext.webhooks.settings` and docs/webhooks.md).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from celery import current_app

from kombu_pgjobs.errors import InvalidWebhookEvent, InvalidWebhookSetting, WebhookEndpointNotFound
from kombu_pgjobs.limits import LIMITS_HEADER, check_key
from kombu_pgjobs.store.webhooks import (
    WebhookStore,
    check_endpoint_id,
    check_url,
    check_url_egress,
)

from ..limits import limits_header
from ..state import installed
from .delivery import DELIVER_TASK, deliver, store
from .settings import WebhookSettings, webhook_settings
from .signing import (
    ATTEMPT_HEADER,
    EVENT_ID_HEADER,
    EVENT_TYPE_HEADER,
    SIGNATURE_HEADER,
    Verified,
    sign,
    verify,
)

__all__ = [
    "ATTEMPT_HEADER",
    "DELIVER_TASK",
    "EVENT_ID_HEADER",
    "EVENT_TYPE_HEADER",
    "SIGNATURE_HEADER",
    "Sent",
    "Verified",
    "WebhookSettings",
    "add_endpoint",
    "deliver",
    "disable",
    "enable",
    "reseal_secrets",
    "rotate_secret",
    "send",
    "sign",
    "verify",
    "webhook_settings",
]


@dataclass(frozen=True, slots=True)
class Sent:
    """What :func:`send` published: the event id receivers see, and the Celery task id."""

    event_id: str
    task_id: str


def _app(app: Any) -> Any:
    """The app given, else Celery's current app itself: ``current_app`` is a proxy, which is
    never the app ``celery_ext.install`` recorded (``send(..., app=None)``, the documented
    default, always failed with PGJ-803)."""
    return app if app is not None else current_app._get_current_object()


def add_endpoint(url: str, *, secret: str, description: str | None = None,
                 disable_after: int | None = None, app: Any = None) -> int:
    """Store an endpoint and return its id. ``secret`` signs its deliveries (16 to 1000
    characters; it is never shown again). ``disable_after`` overrides
    ``pgjobs_webhook_disable_after`` for this endpoint. A URL whose host is an address the
    egress rule refuses is refused here already (``PGJ-805``); host names are checked on
    every connection."""
    app = _app(app)
    check_url(url)
    settings = webhook_settings(app.conf)
    check_url_egress(url, allow_names=settings.allow_names,
                     allow_networks=settings.allow_networks)
    backend, schema = store(app)
    return int(backend.publishing(lambda c: WebhookStore(c, schema, box=settings.secret_box).add(
        url, secret, description=description, disable_after=disable_after)))


def enable(endpoint_id: int, *, app: Any = None) -> dict[str, Any]:
    """Turn an endpoint back on; its consecutive failed deliveries start again from 0."""
    backend, schema = store(_app(app))
    return dict(backend.publishing(
        lambda c: WebhookStore(c, schema).set_enabled(endpoint_id, True)))


def disable(endpoint_id: int, *, app: Any = None) -> dict[str, Any]:
    """Turn an endpoint off: its deliveries are dead-lettered (``endpoint_disabled``) without
    a connection until an operator enables it."""
    backend, schema = store(_app(app))
    return dict(backend.publishing(
        lambda c: WebhookStore(c, schema).set_enabled(endpoint_id, False)))


def rotate_secret(endpoint_id: int, *, secret: str, app: Any = None) -> dict[str, Any]:
    """Sign the endpoint's deliveries with a new secret from the next attempt on. Have the
    receiver accept both (``verify(..., [new, old])``) first, rotate, then let it drop the
    old one. Sealed with the app's newest key when ``pgjobs_webhook_secret_keys`` is set."""
    app = _app(app)
    box = webhook_settings(app.conf).secret_box
    backend, schema = store(app)
    return dict(backend.publishing(
        lambda c: WebhookStore(c, schema, box=box).set_secret(endpoint_id, secret)))


def reseal_secrets(*, dry_run: bool = False, app: Any = None) -> dict[str, Any]:
    """Seal every endpoint secret stored as plain text, and re-seal every sealed one with the
    newest of ``pgjobs_webhook_secret_keys`` (run it after putting a new key first; then the
    old key can go). Returns how many endpoints there are, were sealed and were re-sealed.
    Runs as the app's own database role (the operator and read-only roles cannot read a
    secret)."""
    app = _app(app)
    box = webhook_settings(app.conf).secret_box
    if box is None:
        raise InvalidWebhookSetting("reseal_secrets needs pgjobs_webhook_secret_keys")
    backend, schema = store(app)
    return dict(backend.publishing(
        lambda c: WebhookStore(c, schema, box=box).reseal(dry_run=dry_run)))


def _header_value(value: Any, what: str) -> str:
    """An event id or type: it travels in a header (and the id in the signed string), so 1
    to 200 printable ASCII characters without spaces."""
    text = check_key(value, what, error=InvalidWebhookEvent)
    if not text.isascii() or not text.isprintable() or " " in text:
        raise InvalidWebhookEvent(
            f"{what} must be printable ASCII without spaces (it is sent as an HTTP header): "
            f"{text[:40]!r}")
    return text


def _payload(payload: Any) -> None:
    try:
        json.dumps(payload, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidWebhookEvent(
            f"webhook payload must be plain JSON (dicts, lists, strings, finite numbers, "
            f"booleans, None): {exc}") from None


def send(endpoint_id: int, event_type: str, payload: Any, event_id: str | None = None, *,
         app: Any = None, **options: Any) -> Sent:
    """Publish one delivery of an event to an endpoint; return the event and task ids.

    ``event_id`` (default: a fresh ``evt_<uuid>``; 1 to 200 printable ASCII characters) is
    sent as the ``Pgjobs-Event-Id`` header, in the body, and in the signed string: receivers
    deduplicate on it (a delivery is at least once). ``options``
    go to ``apply_async`` (``queue``, ``countdown``, ``priority``...). Bad input raises
    ``PGJ-804`` (event), ``PGJ-802`` (no such endpoint) or ``PGJ-803`` (a bad
    ``pgjobs_webhook_*`` setting), and nothing is published.
    """
    app = _app(app)
    if not installed(app):
        raise InvalidWebhookSetting(
            "webhooks need celery_ext: call celery_ext.install(app) right after creating the "
            "app (the delivery's retries and dead letters are celery_ext's)")
    settings = webhook_settings(app.conf)  # a bad setting fails the sender, not a delivery
    ident = check_endpoint_id(endpoint_id)
    kind = _header_value(event_type, "webhook event type")
    event = _header_value(event_id if event_id is not None else f"evt_{uuid.uuid4().hex}",
                          "webhook event id")
    _payload(payload)
    backend, schema = store(app)
    if not backend.publishing(lambda c: WebhookStore(c, schema).exists(ident)):
        raise WebhookEndpointNotFound(f"no webhook endpoint with id {ident}")
    created = math.floor(time.time())
    task = app.tasks[DELIVER_TASK]
    args = (ident, event, kind, payload, created)
    if settings.concurrency_per_endpoint is not None:
        options["headers"] = _endpoint_cap(task, args, options, ident,
                                           settings.concurrency_per_endpoint)
    result = task.apply_async(args, **options)
    return Sent(event_id=event, task_id=str(result.id))


def _endpoint_cap(task: Any, args: tuple[Any, ...], options: dict[str, Any], endpoint: int,
                  cap: int) -> dict[str, Any]:
    """The publish's headers with a concurrency key per endpoint first, then whatever limits
    the app declares (queue, global): held from claim to ack, fleet-wide, by the claim in
    Postgres. Retries carry it on (they copy the message's headers)."""
    headers = dict(options.get("headers") or {})
    limits = limits_header(task, args, {}, options, headers) or {}
    limits["concurrency"] = [{"key": f"webhook:{endpoint}", "limit": cap},
                             *limits.get("concurrency", [])]
    headers[LIMITS_HEADER] = limits
    return headers
