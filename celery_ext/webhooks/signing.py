"""Signing webhook deliveries, and verifying them on the receiving side.

Every delivery carries ``Pgjobs-Signature: t=<unix seconds>,v2=<hex>``, where ``<hex>`` is the
lower-case hex HMAC-SHA256, keyed with the endpoint's secret (its UTF-8 bytes), of the
canonical string::

    <t> "." <event id> "." <body>

the timestamp's decimal digits, a full stop, the event id exactly as sent in
``Pgjobs-Event-Id`` (printable ASCII), a full stop, then the request body exactly as sent
(bytes, before any JSON parsing). The timestamp is signed, so a captured request replayed later
fails the receiver's tolerance check; the event id is signed, so a captured request replayed
within the tolerance under a new id (to slip past the receiver's deduplication) fails the
signature; the body is signed, so nothing in it can change.

``v1`` (``<t> "." <body>``, without the event id) is the scheme before it: :func:`verify`
accepts ``v2`` only. A sender can add a ``v1`` entry while receivers upgrade
(``pgjobs_webhook_sign_v1``); a header may carry several ``v2`` entries (a secret being
rotated), and :func:`verify` accepts a request when any entry matches any of the secrets it is
given.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kombu_pgjobs.errors import WebhookSignatureInvalid

__all__ = [
    "ATTEMPT_HEADER",
    "EVENT_ID_HEADER",
    "EVENT_TYPE_HEADER",
    "SCHEME",
    "SIGNATURE_HEADER",
    "Verified",
    "sign",
    "signature",
    "signature_v1",
    "verify",
]

SIGNATURE_HEADER = "Pgjobs-Signature"
EVENT_ID_HEADER = "Pgjobs-Event-Id"
EVENT_TYPE_HEADER = "Pgjobs-Event-Type"
ATTEMPT_HEADER = "Pgjobs-Delivery-Attempt"
#: the signature scheme :func:`verify` accepts
SCHEME = "v2"
_MAX_HEADER = 4096
#: what an event id may be: it travels in a header and in the signed string
_EVENT_ID = re.compile(r"^[\x21-\x7e]{1,200}$")


@dataclass(frozen=True, slots=True)
class Verified:
    """What :func:`verify` vouches for: the event id and the timestamp, both signed.
    Deduplicate on ``event_id``."""

    event_id: str
    timestamp: int


def _event(event_id: str) -> bytes:
    if not isinstance(event_id, str) or not _EVENT_ID.match(event_id):
        raise ValueError("a webhook event id is 1 to 200 printable ASCII characters")
    return event_id.encode("ascii")


def signature(secret: str, timestamp: int, event_id: str, body: bytes) -> str:
    """The v2 signature: hex HMAC-SHA256 of ``b"<timestamp>.<event_id>." + body``."""
    message = str(int(timestamp)).encode("ascii") + b"." + _event(event_id) + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def signature_v1(secret: str, timestamp: int, body: bytes) -> str:
    """The old v1 signature (``b"<timestamp>." + body``, no event id): only for a sender
    that still serves receivers not yet upgraded; :func:`verify` never accepts it."""
    message = str(int(timestamp)).encode("ascii") + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, event_id: str, timestamp: int | None = None, *,
         v1: bool = False) -> str:
    """The ``Pgjobs-Signature`` header value for ``body`` of event ``event_id`` sent at
    ``timestamp`` (now); ``v1=True`` adds the old scheme's entry too."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    value = f"t={t},v2={signature(secret, t, event_id, body)}"
    return value + (f",v1={signature_v1(secret, t, body)}" if v1 else "")


def _header(headers: Mapping[str, Any] | Iterable[tuple[str, Any]], name: str) -> str | None:
    """A header by name, whatever its case, from anything with ``items()`` (a dict, Django's
    ``request.headers``, werkzeug's ``Headers``, ``http.server``'s message) or a list of
    pairs. Two different values are refused as ambiguous."""
    items = headers.items() if hasattr(headers, "items") else headers
    found: list[str] = []
    for key, value in items:
        if str(key).lower() == name.lower():
            text = value.decode("latin-1") if isinstance(value, bytes) else str(value)
            found.append(text)
    if len(set(found)) > 1:
        raise WebhookSignatureInvalid(f"the request has {len(found)} {name} headers")
    return found[0] if found else None


def _parse(value: str) -> tuple[int, list[str], bool]:
    """(timestamp, the v2 signatures, whether a v1 entry was there)."""
    if len(value) > _MAX_HEADER:
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} is too long")
    timestamp: int | None = None
    signatures: list[str] = []
    old = False
    for part in value.split(","):
        key, sep, item = part.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            if timestamp is not None or not item.isdigit() or not item.isascii() \
                    or len(item) > 12:
                raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} has a malformed t=")
            timestamp = int(item)
        elif key == SCHEME:
            signatures.append(item)
        elif key == "v1":
            old = True
    if timestamp is None:
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} has no t= timestamp")
    if not signatures:
        raise WebhookSignatureInvalid(
            f"{SIGNATURE_HEADER} has no {SCHEME}= signature"
            + (" (v1, which does not cover the event id, is no longer accepted: upgrade the "
               "sender)" if old else ""))
    return timestamp, signatures, old


def verify(headers: Mapping[str, Any] | Iterable[tuple[str, Any]], body: bytes,
           secret: str | Iterable[str], tolerance: float = 300, *,
           now: float | None = None) -> Verified:
    """Check a received delivery; return its signed event id and timestamp, or raise
    :class:`~kombu_pgjobs.errors.WebhookSignatureInvalid` (``PGJ-810``).

    ``body`` is the raw request body (bytes, as received). ``secret`` is one secret or several
    (during a rotation: the new one and the old one). The ``v2`` signature must cover the
    ``Pgjobs-Event-Id`` header and the body; its timestamp must be within ``tolerance``
    seconds of ``now`` (either side), which bounds how long a captured request can be
    replayed — and a replay within it carries an event id already seen: deduplicate on
    :attr:`Verified.event_id`. Signatures are compared in constant time.
    """
    if isinstance(body, str):
        raise TypeError("verify() needs the raw body as bytes, exactly as received")
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets or not all(isinstance(s, str) and s for s in secrets):
        raise TypeError("verify() needs at least one non-empty secret")
    value = _header(headers, SIGNATURE_HEADER)
    if value is None:
        raise WebhookSignatureInvalid(f"the request has no {SIGNATURE_HEADER} header")
    timestamp, given, _ = _parse(value)
    event_id = _header(headers, EVENT_ID_HEADER)
    if event_id is None:
        raise WebhookSignatureInvalid(f"the request has no {EVENT_ID_HEADER} header")
    if not _EVENT_ID.match(event_id):
        raise WebhookSignatureInvalid(f"the request's {EVENT_ID_HEADER} is malformed")
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise WebhookSignatureInvalid(
            f"the signature's timestamp is {current - timestamp:.0f} s from now, outside the "
            f"tolerance of {tolerance:g} s (a replay, or a clock that is off)")
    matched = False
    for key in secrets:
        expected = signature(key, timestamp, event_id, bytes(body)).encode("ascii")
        for candidate in given:
            # every pair is compared, so the time taken does not tell which one matched
            matched |= hmac.compare_digest(expected, candidate.encode("ascii", "replace"))
    if not matched:
        raise WebhookSignatureInvalid(
            "no signature in the request matches the secret(s) for this event id and body")
    return Verified(event_id=event_id, timestamp=timestamp)
