"""Limits a message carries: the ``x-pgjobs-limits`` header, validated at publish.

The header (set by celery_ext from task declarations, or by any publisher) is a JSON object::

    {"concurrency": [{"key": "task:report", "limit": 3},
                     {"key": "key:report:acct-42", "limit": 2, "when_busy": "fail"}],
     "rate": [{"key": "tenant:acme", "limit": 100, "per": 60}]}

* ``concurrency``: at most ``limit`` messages holding ``key`` run at once, across every worker
  of the database. A message that finds a key full waits (``when_busy: "wait"``, the default;
  no attempt is counted) or is refused into the dead letters (``"fail"``, code ``PGJ-302``).
* ``rate``: at most ``limit`` starts per fixed window of ``per`` seconds with ``key``; a message
  over the rate waits for the next window, uncounted.

The claim enforces them in Postgres (``schema/0003_limits.sql``); this module only refuses a
header that could not be enforced, where it is published, with a stable code. The validated
header is stored as the row's ``limits`` column (the same JSON, normalised).

:func:`tighten` combines the limits an app declares with a header a publisher wrote: the
result is never looser than the declaration (celery_ext applies it at every publish).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .errors import InvalidLimit, InvalidLimitKey, PgJobsError

__all__ = [
    "LIMITS_HEADER",
    "MAX_KEY_LENGTH",
    "MAX_LIMIT",
    "MAX_RATE_WINDOW",
    "MAX_STORED_KEY_LENGTH",
    "WHEN_BUSY",
    "check_cap",
    "check_key",
    "normalise",
    "tighten",
]

#: the header a message's limits travel in
LIMITS_HEADER = "x-pgjobs-limits"
#: longest key value a publisher computes (an account id, a tenant)
MAX_KEY_LENGTH = 200
#: longest stored key: a value with its prefix (``key:<task name>:<value>``)
MAX_STORED_KEY_LENGTH = 512
#: a cap is a number of slots; beyond this a limit is no limit
MAX_LIMIT = 100_000
#: longest rate window (seconds): a day
MAX_RATE_WINDOW = 86_400.0
WHEN_BUSY = ("wait", "fail")


def check_cap(value: Any, what: str) -> int:
    """A whole number in 1..MAX_LIMIT; refuses bools, fractions, NaN, infinities, strings."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidLimit(f"{what} must be a whole number of at least 1, got {value!r}")
    if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
        raise InvalidLimit(f"{what} must be a whole number of at least 1, got {value!r}")
    if not 1 <= value <= MAX_LIMIT:
        raise InvalidLimit(f"{what} must be between 1 and {MAX_LIMIT:,}, got {value!r} "
                           "(zero would stop the task for good: pause its queue instead)")
    return int(value)


def check_key(value: Any, what: str = "concurrency key", *,
              maximum: int = MAX_KEY_LENGTH,
              error: type[PgJobsError] = InvalidLimitKey) -> str:
    """A non-empty string of at most ``maximum`` characters, no control characters; else
    ``error`` (the same rule serves concurrency keys, tenants and idempotency keys, each
    refused with its own code)."""
    if not isinstance(value, str):
        raise error(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if not value:
        raise error(f"{what} is empty")
    if len(value) > maximum:
        raise error(
            f"{what} is {len(value)} characters long (at most {maximum}): {value[:40]!r}...")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):  # DEL too, as names refuse it
        raise error(f"{what} has control characters: {value!r}")
    return value


def _window(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or not 0 < value <= MAX_RATE_WINDOW:
        raise InvalidLimit(
            f"rate window 'per' must be seconds in (0, {MAX_RATE_WINDOW:g}], got {value!r}")
    return float(value)


def normalise(header: Any) -> str | None:
    """Validate an ``x-pgjobs-limits`` header; return it as compact JSON (None: no limits)."""
    if header is None:
        return None
    if isinstance(header, (str, bytes)):
        try:
            header = json.loads(header)
        except ValueError:
            raise InvalidLimit(f"{LIMITS_HEADER} is not JSON: {header!r:.80}") from None
    if not isinstance(header, Mapping):
        raise InvalidLimit(f"{LIMITS_HEADER} must be an object, got {type(header).__name__}")
    unknown = set(header) - {"concurrency", "rate"}
    if unknown:
        raise InvalidLimit(f"{LIMITS_HEADER} has unknown entries {sorted(unknown)}: "
                           "use 'concurrency' and 'rate'")
    out: dict[str, list[dict[str, Any]]] = {}
    seen: set[str] = set()
    for entry in _entries(header, "concurrency"):
        key = check_key(entry.get("key"), maximum=MAX_STORED_KEY_LENGTH)
        if key in seen:
            raise InvalidLimit(f"concurrency key {key!r} is listed twice")
        seen.add(key)
        item: dict[str, Any] = {"key": key,
                                "limit": check_cap(entry.get("limit"), f"limit of {key!r}")}
        busy = entry.get("when_busy", "wait")
        if busy not in WHEN_BUSY:
            raise InvalidLimit(f"when_busy of {key!r} must be 'wait' or 'fail', got {busy!r}")
        if busy == "fail":
            item["when_busy"] = "fail"
        out.setdefault("concurrency", []).append(item)
    rated: set[str] = set()
    for entry in _entries(header, "rate"):
        key = check_key(entry.get("key"), "rate key", maximum=MAX_STORED_KEY_LENGTH)
        if key in rated:  # two counts of one key's window in one claim would fail the claim
            raise InvalidLimit(f"rate key {key!r} is listed twice")
        rated.add(key)
        out.setdefault("rate", []).append({
            "key": key, "limit": check_cap(entry.get("limit"), f"rate of {key!r}"),
            "per": _window(entry.get("per"))})
    return json.dumps(out, separators=(",", ":")) if out else None


def _entries(header: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    entries = header.get(name) or []
    if not isinstance(entries, (list, tuple)) or not all(
            isinstance(e, Mapping) for e in entries):
        raise InvalidLimit(f"{LIMITS_HEADER}[{name!r}] must be a list of objects")
    if len(entries) > 8:
        raise InvalidLimit(f"{LIMITS_HEADER}[{name!r}] has {len(entries)} entries (at most 8)")
    return list(entries)


def _parsed(header: Any) -> dict[str, list[dict[str, Any]]]:
    """A header validated by :func:`normalise`, as plain lists (``when_busy`` always set)."""
    text = normalise(header)
    out: dict[str, list[dict[str, Any]]] = json.loads(text) if text else {}
    for cap in out.get("concurrency", []):
        cap.setdefault("when_busy", "wait")
    return out


def tighten(declared: Any, given: Any) -> dict[str, Any] | None:
    """The limits a message runs under when its app declares ``declared`` and its publisher
    wrote ``given`` (either an ``x-pgjobs-limits`` value or None): never looser than
    ``declared``.

    * Every declared cap and rate is kept, in its declared order.
    * A given cap of a declared key can lower its limit (the smaller one is kept) and turn
      ``when_busy`` from ``"wait"`` into ``"fail"``, never back: ``"fail"`` is the stricter
      (a busy key refuses the message for good instead of running it later), so an app that
      refuses duplicates keeps refusing them.
    * A given rate of a declared key can lower its limit; the declared window is kept (the
      starts of one key are counted per window, and one key has one window).
    * A given cap or rate of a key the app does not declare is kept as given (it can only hold
      the message back more), listed before the declared ones: a key the publisher adds for its
      own message (a webhook endpoint's, say) is the most specific, and the first key is the
      one a flood of messages is parked by.

    ``given`` is validated first (:class:`InvalidLimit`, ``PGJ-301``, or
    :class:`InvalidLimitKey`, ``PGJ-303``), so a malformed header is refused, not dropped.
    """
    mine = _parsed(declared)
    theirs = _parsed(given)
    out: dict[str, Any] = {}
    for kind in ("concurrency", "rate"):
        given_by_key = {e["key"]: e for e in theirs.get(kind, [])}
        own = {e["key"] for e in mine.get(kind, [])}
        merged = [e for key, e in given_by_key.items() if key not in own]
        for entry in mine.get(kind, []):
            other = given_by_key.get(entry["key"])
            if other is not None:
                entry["limit"] = min(entry["limit"], other["limit"])
                if other.get("when_busy") == "fail":  # (caps only: a rate has none)
                    entry["when_busy"] = "fail"
            merged.append(entry)
        if merged:
            out[kind] = merged
    return out or None
