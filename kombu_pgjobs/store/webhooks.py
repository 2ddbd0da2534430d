"""Webhook endpoints and the ledger of delivery attempts: the tables, read and written.

``celery_ext.webhooks`` (the delivery task, ``add_endpoint``, ``send``) and the ``pgjobs
webhooks`` CLI both go through :class:`WebhookStore`; every statement lives in
``sql/webhook.sql``. This module knows nothing of HTTP or Celery.

The secret is written by :meth:`WebhookStore.add` and read back only by
:meth:`WebhookStore.for_delivery`, into an :class:`Endpoint` whose ``repr`` leaves it out; what
operators see (:meth:`WebhookStore.ls`, :meth:`WebhookStore.show`) never selects it, and the
operator and read-only roles cannot (``pgjobs roles``: no SELECT on the column).

**At rest.** Given a :class:`SecretBox` (Fernet keys, newest first: the app's
``pgjobs_webhook_secret_keys``), the store seals every secret it writes
(``pgjobs:fernet:<token>``) and opens sealed ones for a delivery; a row written without keys
stays plain text and is still read. :meth:`WebhookStore.reseal` seals plain secrets and
re-seals the others with the newest key (key rotation). A sealed secret no key opens is
:class:`~kombu_pgjobs.errors.WebhookSecretLocked`.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from typing import Any
from urllib.parse import urlsplit

import psycopg

from ..errors import (
    EgressRefused,
    InvalidArgument,
    InvalidWebhookEndpoint,
    InvalidWebhookSetting,
    PgJobsError,
    WebhookEndpointNotFound,
    WebhookSecretLocked,
)
from ..options import validate_schema_name
from .sql import queries

__all__ = [
    "MASK",
    "MAX_EXCERPT",
    "METADATA_ADDRESSES",
    "SEALED",
    "WEBHOOK_SCHEMA_VERSION",
    "Endpoint",
    "SecretBox",
    "WebhookStore",
    "check_addresses",
    "check_disable_after",
    "check_endpoint_id",
    "check_secret",
    "check_url",
    "check_url_egress",
    "parse_allow_hosts",
    "refusal",
]

#: the schema version that has the webhook tables
WEBHOOK_SCHEMA_VERSION = 10

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

#: what operators see instead of a secret
MASK = "********"
#: the most characters of a response body the ledger keeps
MAX_EXCERPT = 1024
MAX_URL = 2048
MIN_SECRET, MAX_SECRET = 16, 1000
MAX_PAGE = 1000
_CONTROL = re.compile(r"[\x00-\x20\x7f-\x9f]")
_SECRET_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def check_url(url: Any) -> str:
    """An absolute http(s) URL with a host, no ``user:password@`` (it would travel to every
    log and CLI listing the URL appears in: put credentials in the signature), no fragment, no
    whitespace or control characters, at most 2048 characters."""
    if not isinstance(url, str) or not url:
        raise InvalidWebhookEndpoint(f"webhook URL must be a non-empty string, got {url!r}")
    if len(url) > MAX_URL:
        raise InvalidWebhookEndpoint(f"webhook URL is longer than {MAX_URL} characters")
    if _CONTROL.search(url):
        raise InvalidWebhookEndpoint(
            f"webhook URL holds whitespace or control characters: {url[:80]!r}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidWebhookEndpoint(f"webhook URL {url[:80]!r} is malformed: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise InvalidWebhookEndpoint(
            f"webhook URL must start with https:// or http://, got {url[:80]!r}")
    if not parts.hostname:
        raise InvalidWebhookEndpoint(f"webhook URL {url[:80]!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise InvalidWebhookEndpoint(
            "webhook URL must not carry user:password@ (it would be shown wherever the URL "
            "is): the signature authenticates deliveries")
    if parts.fragment:
        raise InvalidWebhookEndpoint(f"webhook URL {url[:80]!r} has a #fragment")
    if port == 0:
        raise InvalidWebhookEndpoint(f"webhook URL {url[:80]!r} has port 0")
    return url


# -- egress: which addresses a delivery may connect to -------------------------------------
# Here, not in celery_ext.webhooks.egress (which connects through it), so that `pgjobs
# webhooks add` refuses what add_endpoint refuses without importing Celery or httpx.

#: cloud metadata services, refused even where they are public addresses (Azure's wire server)
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",   # AWS, GCP, Azure, OpenStack, DigitalOcean...
    "169.254.170.2",     # AWS ECS task metadata
    "fd00:ec2::254",     # AWS over IPv6
    "100.100.100.200",   # Alibaba Cloud
    "192.0.0.192",       # Oracle Cloud
    "168.63.129.16",     # Azure wire server
))


def refusal(address: Address) -> str | None:
    """Why a delivery must not connect to ``address`` (None: it may)."""
    if isinstance(address, ipaddress.IPv6Address):
        mapped = address.ipv4_mapped or address.sixtofour
        if mapped is not None:
            return refusal(mapped)
    if address in METADATA_ADDRESSES:
        return "a cloud metadata address"
    for what, flag in (("loopback", address.is_loopback), ("link-local", address.is_link_local),
                       ("unspecified", address.is_unspecified),
                       ("multicast", address.is_multicast), ("private", address.is_private),
                       ("reserved", address.is_reserved)):
        if flag:
            return f"a {what} address"
    if not address.is_global:
        return "not a public address"
    return None


def check_addresses(host: str, addresses: Iterable[Address], *, allow_names: Iterable[str],
                    allow_networks: Iterable[Network]) -> None:
    """Raise :class:`EgressRefused` (``PGJ-805``) if any address of ``host`` is refused."""
    if host.lower().rstrip(".") in set(allow_names):
        return
    networks = list(allow_networks)
    for address in addresses:
        why = refusal(address)
        if why is not None and not any(address in net for net in networks
                                       if net.version == address.version):
            raise EgressRefused(
                f"webhook host {host} resolves to {address}, {why}: refused (add the host or "
                "a network holding it to pgjobs_webhook_allow_hosts if it is really meant)")


def parse_allow_hosts(value: Any, what: str = "pgjobs_webhook_allow_hosts",
                      error: type[PgJobsError] = InvalidWebhookSetting
                      ) -> tuple[tuple[str, ...], tuple[Network, ...]]:
    """``pgjobs_webhook_allow_hosts`` (or the CLI's ``--allow-host``) as (host names in lower
    case, networks); ``error`` names what is wrong."""
    if value is None:
        return (), ()
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise error(
            f"{what} must be a list of host names, addresses or networks "
            f"(['hooks.internal', '10.0.0.0/8']), got {value!r}")
    names: list[str] = []
    networks: list[Network] = []
    for item in value:
        if not isinstance(item, str) or not item or len(item) > 253 or any(
                c.isspace() or ord(c) < 32 or 0x7f <= ord(c) <= 0x9f for c in item):
            raise error(f"{what}: {item!r} is not a host name, address or network")
        try:
            networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
        except ValueError:
            if "/" in item:
                raise error(f"{what}: {item!r} is not a valid network") from None
            names.append(item.lower().rstrip("."))
    return tuple(names), tuple(networks)


def check_url_egress(url: str, *, allow_names: Iterable[str] = (),
                     allow_networks: Iterable[Network] = ()) -> None:
    """The check an endpoint's URL gets when it is added (``add_endpoint``, ``pgjobs webhooks
    add``): a host that is an address literal the egress rule refuses is ``PGJ-805``. A host
    name is left to the connect-time check (what it resolves to may change; the delivery
    checks the address it connects to)."""
    host = urlsplit(url).hostname or ""
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        return
    check_addresses(host, [literal], allow_names=allow_names, allow_networks=allow_networks)


def check_secret(secret: Any) -> str:
    """16 to 1000 characters, no control characters, not starting with ``pgjobs:`` (what a
    sealed secret looks like). The error never repeats the value."""
    if not isinstance(secret, str):
        raise InvalidWebhookEndpoint(
            f"webhook secret must be a string, got {type(secret).__name__}")
    if not MIN_SECRET <= len(secret) <= MAX_SECRET:
        raise InvalidWebhookEndpoint(
            f"webhook secret must be {MIN_SECRET} to {MAX_SECRET} characters long, got "
            f"{len(secret)} (make one with: python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))')")
    if _SECRET_CONTROL.search(secret):
        raise InvalidWebhookEndpoint("webhook secret holds control characters")
    if secret.startswith("pgjobs:"):
        raise InvalidWebhookEndpoint("webhook secret must not start with 'pgjobs:' (sealed "
                                     "secrets are stored so)")
    return secret


#: how a sealed secret starts in its endpoint row (then a Fernet token)
SEALED = "pgjobs:fernet:"


class SecretBox:
    """Fernet keys that seal endpoint secrets at rest: the first seals, every one opens
    (:class:`cryptography.fernet.MultiFernet`), so a key is rotated by putting the new one
    first, re-sealing (:meth:`WebhookStore.reseal`), then dropping the old one. Needs the
    ``cryptography`` package (``kombu-pgjobs[encryption]``). Keys never appear in a repr or
    an error."""

    def __init__(self, keys: Sequence[str | bytes],
                 what: str = "pgjobs_webhook_secret_keys") -> None:
        try:
            from cryptography.fernet import Fernet, MultiFernet
        except ImportError:
            raise InvalidWebhookSetting(
                f"{what} needs the cryptography package: pip install "
                "'kombu-pgjobs[encryption]'") from None
        if isinstance(keys, (str, bytes)) or not keys:
            raise InvalidWebhookSetting(
                f"{what} must be a non-empty list of Fernet keys, newest first "
                "(cryptography.fernet.Fernet.generate_key())")
        fernets = []
        for i, key in enumerate(keys):
            try:
                fernets.append(Fernet(key))
            except (ValueError, TypeError):
                raise InvalidWebhookSetting(
                    f"{what}[{i}] is not a Fernet key (32 url-safe base64-encoded bytes, as "
                    "Fernet.generate_key() makes)") from None
        self._box = MultiFernet(fernets)

    def __repr__(self) -> str:
        return "SecretBox(<keys>)"

    @staticmethod
    def sealed(stored: str) -> bool:
        return stored.startswith(SEALED)

    def seal(self, secret: str) -> str:
        return SEALED + self._box.encrypt(secret.encode("utf-8")).decode("ascii")

    def open(self, stored: str) -> str:
        from cryptography.fernet import InvalidToken

        try:
            return self._box.decrypt(stored[len(SEALED):].encode("ascii")).decode("utf-8")
        except (InvalidToken, UnicodeError, ValueError):
            raise WebhookSecretLocked(
                "the endpoint's secret is sealed with a key that none of "
                "pgjobs_webhook_secret_keys opens (a key missing, or dropped before every "
                "secret was re-sealed)") from None

    def reseal(self, stored: str) -> str:
        """``stored`` sealed with the newest key (a plain secret sealed for the first time)."""
        return self.seal(self.open(stored) if self.sealed(stored) else stored)


def open_secret(stored: str, box: SecretBox | None) -> str:
    """The secret a row holds: as is when plain, opened when sealed."""
    if not SecretBox.sealed(stored):
        return stored
    if box is None:
        raise WebhookSecretLocked(
            "the endpoint's secret is sealed and this process has no "
            "pgjobs_webhook_secret_keys to open it")
    return box.open(stored)


def check_disable_after(value: Any, what: str = "disable_after") -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1_000_000:
        raise InvalidWebhookEndpoint(
            f"{what} must be a whole number in 1-1000000 (consecutive failed deliveries), "
            f"got {value!r}")
    return value


def check_endpoint_id(value: Any) -> int:
    try:
        ident = int(str(value)) if not isinstance(value, bool) else -1
    except ValueError:
        raise InvalidArgument(f"webhook endpoint id {value!r} is not a number") from None
    if not 1 <= ident < 2**63:
        raise InvalidArgument(f"webhook endpoint id {value!r} is out of range")
    return ident


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What a delivery needs. ``secret`` is left out of ``repr`` (tracebacks, logs)."""

    id: int
    url: str
    enabled: bool
    secret: str = field(repr=False)


def _plain(value: Any) -> Any:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _dicts(cur: psycopg.Cursor[Any]) -> list[dict[str, Any]]:
    names = [d.name for d in cur.description or ()]
    return [{k: _plain(v) for k, v in zip(names, row, strict=True)} for row in cur.fetchall()]


class WebhookStore:
    """Webhook statements on one schema, over a connection the caller owns (autocommit)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str, *,
                 box: SecretBox | None = None) -> None:
        self.conn = conn
        self.q = queries(validate_schema_name(schema))
        self.box = box

    def _stored(self, secret: str) -> str:
        return self.box.seal(secret) if self.box is not None else secret

    # -- endpoints -------------------------------------------------------------------------
    def add(self, url: str, secret: str, *, description: str | None = None,
            disable_after: int | None = None) -> int:
        """Store an endpoint (validated: nothing is written on bad input); return its id."""
        check_url(url)
        check_secret(secret)
        check_disable_after(disable_after)
        if description is not None and (not isinstance(description, str)
                                        or len(description) > 1000):
            raise InvalidWebhookEndpoint("description must be a string of at most 1000 "
                                         "characters")
        row = self.conn.execute(self.q["webhook_endpoint_add"], {
            "url": url, "secret": self._stored(secret), "description": description,
            "disable_after": disable_after}).fetchone()
        assert row is not None
        return int(row[0])

    def exists(self, endpoint_id: Any) -> bool:
        ident = check_endpoint_id(endpoint_id)
        row = self.conn.execute(self.q["webhook_endpoint_exists"], {"id": ident}).fetchone()
        return bool(row and row[0])

    def for_delivery(self, endpoint_id: int) -> Endpoint | None:
        row = self.conn.execute(self.q["webhook_endpoint_for_delivery"],
                                {"id": int(endpoint_id)}).fetchone()
        if row is None:
            return None
        return Endpoint(id=int(endpoint_id), url=row[0], secret=open_secret(row[1], self.box),
                        enabled=bool(row[2]))

    def ls(self, *, after: Any = None, limit: int = 50) -> dict[str, Any]:
        if not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_PAGE}, got {limit}")
        cursor = 0 if after in (None, "") else check_endpoint_id(after)
        rows = _dicts(self.conn.execute(self.q["webhook_endpoint_ls"], {
            "after": cursor, "id": None, "limit": int(limit) + 1}))
        more = len(rows) > limit
        rows = rows[:limit]
        for r in rows:
            r["secret"] = MASK
        return {"items": rows, "next": str(rows[-1]["id"]) if more else None}

    def show(self, endpoint_id: Any) -> dict[str, Any]:
        ident = check_endpoint_id(endpoint_id)
        rows = _dicts(self.conn.execute(self.q["webhook_endpoint_ls"], {
            "after": 0, "id": ident, "limit": 1}))
        if not rows:
            raise WebhookEndpointNotFound(f"no webhook endpoint with id {ident}")
        return {**rows[0], "secret": MASK}

    def set_enabled(self, endpoint_id: Any, enabled: bool) -> dict[str, Any]:
        """Enable (failure count back to 0) or disable (reason ``operator``) an endpoint."""
        ident = check_endpoint_id(endpoint_id)
        cur = self.conn.execute(self.q["webhook_endpoint_set_enabled"],
                                {"id": ident, "enabled": bool(enabled)})
        rows = _dicts(cur)
        if not rows:
            raise WebhookEndpointNotFound(f"no webhook endpoint with id {ident}")
        return rows[0]

    def set_secret(self, endpoint_id: Any, secret: str) -> dict[str, Any]:
        """Rotate an endpoint's secret (checked like a new one; never echoed)."""
        ident = check_endpoint_id(endpoint_id)
        check_secret(secret)
        row = self.conn.execute(self.q["webhook_endpoint_set_secret"],
                                {"id": ident, "secret": self._stored(secret)}).fetchone()
        if row is None:
            raise WebhookEndpointNotFound(f"no webhook endpoint with id {ident}")
        return self.show(ident)

    def reseal(self, *, dry_run: bool = False, tries: int = 5) -> dict[str, Any]:
        """Seal every plain secret and re-seal every sealed one with the newest key (after a
        key rotation), one endpoint per transaction. A secret rotated at the same moment is
        never overwritten: each endpoint is read and written in one REPEATABLE READ
        transaction, which a concurrent change makes fail, and it is tried again. Needs the
        right to read the secret column (the owner's or the worker's role)."""
        if self.box is None:
            raise InvalidWebhookSetting("resealing needs keys (pgjobs_webhook_secret_keys)")
        counts = {"endpoints": 0, "sealed": 0, "resealed": 0, "dry_run": dry_run}
        after = 0
        while True:
            page = self.ls(after=after or None, limit=MAX_PAGE)
            for item in page["items"]:
                ident = int(item["id"])
                counts["endpoints"] += 1
                kind = self._reseal_one(ident, dry_run, tries)
                if kind:
                    counts[kind] += 1
                after = ident
            if page["next"] is None:
                return counts

    def _reseal_one(self, ident: int, dry_run: bool, tries: int) -> str | None:
        assert self.box is not None
        for attempt in range(tries):
            try:
                with self.conn.transaction():
                    self.conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    row = self.conn.execute(self.q["webhook_endpoint_for_delivery"],
                                            {"id": ident}).fetchone()
                    if row is None:  # removed meanwhile
                        return None
                    kind = "resealed" if SecretBox.sealed(row[1]) else "sealed"
                    if not dry_run:
                        self.conn.execute(self.q["webhook_endpoint_set_secret"],
                                          {"id": ident, "secret": self.box.reseal(row[1])})
                    return kind
            except psycopg.errors.SerializationFailure:
                if attempt == tries - 1:
                    raise
        return None

    # -- the ledger ------------------------------------------------------------------------
    def record_attempt(self, attempt: Mapping[str, Any], *, effect: str,
                       disable_after: int) -> dict[str, Any]:
        """Write one attempt (keys: endpoint_id, event_id, event_type, task_id, attempt,
        status, latency_ms, outcome, error, excerpt, location, retry_after, delay) and its
        effect on the endpoint (``reset``, ``count`` or ``none``, see webhook_attempt_record).
        Returns the ledger id, the next attempt's due time, and the endpoint's failure count
        and state when they changed (``disabled_now``: this attempt disabled it)."""
        if effect not in ("reset", "count", "none"):
            raise ValueError(f"effect {effect!r}")
        row = self.conn.execute(self.q["webhook_attempt_record"], {
            **attempt, "effect": effect, "disable_after": int(disable_after)}).fetchone()
        assert row is not None
        return {"id": int(row[0]), "next_attempt_at": _plain(row[1]),
                "consecutive_failures": row[2], "enabled": row[3], "disabled_now": bool(row[4])}

    def attempts(self, endpoint_id: Any, *, before: Any = None,
                 limit: int = 50) -> dict[str, Any]:
        """An endpoint's attempts, newest first; ``next`` is the ``--before`` of the next
        page."""
        ident = check_endpoint_id(endpoint_id)
        if not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidArgument(f"--limit must be between 1 and {MAX_PAGE}, got {limit}")
        cursor = 0 if before in (None, "") else check_endpoint_id(before)
        if not self.exists(ident):
            raise WebhookEndpointNotFound(f"no webhook endpoint with id {ident}")
        rows = _dicts(self.conn.execute(self.q["webhook_attempt_ls"], {
            "endpoint_id": ident, "before": cursor, "limit": int(limit) + 1}))
        more = len(rows) > limit
        rows = rows[:limit]
        return {"items": rows, "next": str(rows[-1]["id"]) if more else None}

    def prune(self, cutoff: datetime, *, bound: int, batch: int,
              dry_run: bool = False) -> dict[str, Any]:
        """Delete ledger rows finished before ``cutoff``, ``batch`` per transaction, at most
        ``bound`` in all."""
        row = self.conn.execute(self.q["webhook_attempt_prune_count"],
                                {"cutoff": cutoff}).fetchone()
        matched = int(row[0]) if row else 0
        deleted = 0
        while not dry_run and deleted < bound:
            got = self.conn.execute(self.q["webhook_attempt_prune"], {
                "cutoff": cutoff, "limit": min(batch, bound - deleted)}).fetchone()
            n = int(got[0]) if got else 0
            deleted += n
            if n == 0:
                break
        return {"cutoff": _plain(cutoff), "matched": matched, "deleted": deleted,
                "remaining": matched - deleted}

