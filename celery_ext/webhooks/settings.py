"""The ``pgjobs_webhook_*`` app settings, read and checked in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kombu_pgjobs.errors import InvalidWebhookSetting
from kombu_pgjobs.store.webhooks import Network, SecretBox, parse_allow_hosts

__all__ = ["Network", "WebhookSettings", "webhook_settings"]


@dataclass(frozen=True, slots=True)
class WebhookSettings:
    #: host names allowed whatever they resolve to (lower case)
    allow_names: tuple[str, ...] = ()
    #: networks whose addresses are allowed although private, loopback, ...
    allow_networks: tuple[Network, ...] = ()
    #: consecutive failed deliveries before an endpoint is disabled (unless it says otherwise)
    disable_after: int = 20
    #: base seconds of the exponential backoff
    backoff: float = 30.0
    #: most seconds between two attempts (backoff and Retry-After alike)
    backoff_max: float = 21600.0
    #: seconds one attempt may take in all: name lookup, connect, TLS, send and receive (a
    #: wall-clock deadline, see celery_ext.webhooks.egress)
    timeout: float = 10.0
    #: attempts of one event before the delivery fails for good
    max_attempts: int = 12
    #: at most this many deliveries to one endpoint running at once, fleet-wide (None: no cap)
    concurrency_per_endpoint: int | None = None
    #: also sign with the old v1 scheme (no event id), for receivers not upgraded yet
    sign_v1: bool = False
    #: seals endpoint secrets at rest (pgjobs_webhook_secret_keys; None: stored as given)
    secret_box: SecretBox | None = field(default=None, repr=False, compare=False)


def _number(conf: Any, name: str, default: float, low: float, high: float) -> float:
    value = conf.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not low < value <= high:
        raise InvalidWebhookSetting(
            f"{name} must be a number of seconds in ({low:g}, {high:g}], got {value!r}")
    return float(value)


def _whole(conf: Any, name: str, default: int, high: int) -> int:
    value = conf.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise InvalidWebhookSetting(f"{name} must be a whole number in 1-{high}, got {value!r}")
    return value


def _allowed(conf: Any) -> tuple[tuple[str, ...], tuple[Network, ...]]:
    return parse_allow_hosts(conf.get("pgjobs_webhook_allow_hosts"))


def webhook_settings(conf: Any) -> WebhookSettings:
    """The webhook settings of an app's configuration, checked (``PGJ-803`` when invalid)."""
    names, networks = _allowed(conf)
    backoff = _number(conf, "pgjobs_webhook_backoff", 30.0, 0.0, 86400.0)
    backoff_max = _number(conf, "pgjobs_webhook_backoff_max", max(21600.0, backoff), 0.0,
                          7 * 86400.0)
    if backoff_max < backoff:
        raise InvalidWebhookSetting(
            f"pgjobs_webhook_backoff_max ({backoff_max:g}) is below pgjobs_webhook_backoff "
            f"({backoff:g})")
    keys = conf.get("pgjobs_webhook_secret_keys")
    box = SecretBox(keys) if keys is not None else None
    sign_v1 = conf.get("pgjobs_webhook_sign_v1")
    if sign_v1 is not None and not isinstance(sign_v1, bool):
        raise InvalidWebhookSetting(f"pgjobs_webhook_sign_v1 must be True or False, got "
                                    f"{sign_v1!r}")
    return WebhookSettings(
        allow_names=names, allow_networks=networks, sign_v1=bool(sign_v1), secret_box=box,
        disable_after=_whole(conf, "pgjobs_webhook_disable_after", 20, 1_000_000),
        backoff=backoff, backoff_max=backoff_max,
        timeout=_number(conf, "pgjobs_webhook_timeout", 10.0, 0.0, 300.0),
        max_attempts=_whole(conf, "pgjobs_webhook_max_attempts", 12, 100),
        concurrency_per_endpoint=None if conf.get("pgjobs_webhook_concurrency_per_endpoint")
        is None else _whole(conf, "pgjobs_webhook_concurrency_per_endpoint", 1, 100_000),
    )
