"""Signing webhook deliveries, and verifying them on the receiving side.

Every delivery carries ``Pgjobs-Signature: t=<unix seconds>,v1=<hex>``, where ``<hex>`` is the
lower-case hex HMAC-SHA256, keyed with the endpoint's secret (its UTF-8 bytes), of the
canonical string ``b"<t>." + body``: the timestamp's decimal digits, a full stop, then the
request body exactly as sent (bytes, before any JSON parsing). The timestamp is signed with
the body, so a captured request replayed later fails the receiver's tolerance check, and one
whose timestamp was changed fails the signature.

A header may carry several ``v1=`` entries (a sender signing with two secrets while one is
rotated); :func:`verify` accepts a request when any entry matches any of the secrets it is
given.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from typing import Any

from kombu_pgjobs.errors import WebhookSignatureInvalid

__all__ = [
    "ATTEMPT_HEADER",
    "EVENT_ID_HEADER",
    "EVENT_TYPE_HEADER",
    "SIGNATURE_HEADER",
    "sign",
    "signature",
    "verify",
]

SIGNATURE_HEADER = "Pgjobs-Signature"
EVENT_ID_HEADER = "Pgjobs-Event-Id"
EVENT_TYPE_HEADER = "Pgjobs-Event-Type"
ATTEMPT_HEADER = "Pgjobs-Delivery-Attempt"
_MAX_HEADER = 4096


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The hex HMAC-SHA256 of ``b"<timestamp>." + body`` keyed with ``secret``."""
    message = str(int(timestamp)).encode("ascii") + b"." + body
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    """The ``Pgjobs-Signature`` header value for ``body`` sent at ``timestamp`` (now)."""
    t = int(time.time()) if timestamp is None else int(timestamp)
    return f"t={t},v1={signature(secret, t, body)}"


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


def _parse(value: str) -> tuple[int, list[str]]:
    if len(value) > _MAX_HEADER:
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} is too long")
    timestamp: int | None = None
    signatures: list[str] = []
    for part in value.split(","):
        key, sep, item = part.strip().partition("=")
        if not sep:
            continue
        if key == "t":
            if timestamp is not None or not item.isdigit() or len(item) > 12:
                raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} has a malformed t=")
            timestamp = int(item)
        elif key == "v1":
            signatures.append(item)
    if timestamp is None:
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} has no t= timestamp")
    if not signatures:
        raise WebhookSignatureInvalid(f"{SIGNATURE_HEADER} has no v1= signature")
    return timestamp, signatures


def verify(headers: Mapping[str, Any] | Iterable[tuple[str, Any]], body: bytes,
           secret: str | Iterable[str], tolerance: float = 300, *,
           now: float | None = None) -> int:
    """Check a received delivery; return its signed timestamp, or raise
    :class:`~kombu_pgjobs.errors.WebhookSignatureInvalid` (``PGJ-810``).

    ``body`` is the raw request body (bytes, as received). ``secret`` is one secret or several
    (during a rotation: the new one and the old one). The timestamp must be within
    ``tolerance`` seconds of ``now`` (either side), which bounds how long a captured request
    can be replayed. Signatures are compared in constant time.
    """
    if isinstance(body, str):
        raise TypeError("verify() needs the raw body as bytes, exactly as received")
    secrets = [secret] if isinstance(secret, str) else list(secret)
    if not secrets or not all(isinstance(s, str) and s for s in secrets):
        raise TypeError("verify() needs at least one non-empty secret")
    value = _header(headers, SIGNATURE_HEADER)
    if value is None:
        raise WebhookSignatureInvalid(f"the request has no {SIGNATURE_HEADER} header")
    timestamp, given = _parse(value)
    current = time.time() if now is None else now
    if abs(current - timestamp) > tolerance:
        raise WebhookSignatureInvalid(
            f"the signature's timestamp is {current - timestamp:.0f} s from now, outside the "
            f"tolerance of {tolerance:g} s (a replay, or a clock that is off)")
    matched = False
    for key in secrets:
        expected = signature(key, timestamp, bytes(body)).encode("ascii")
        for candidate in given:
            # every pair is compared, so the time taken does not tell which one matched
            matched |= hmac.compare_digest(expected, candidate.encode("ascii", "replace"))
    if not matched:
        raise WebhookSignatureInvalid("no signature in the request matches the secret(s)")
    return timestamp
