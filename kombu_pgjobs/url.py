"""Broker URLs: ``pgjobs://user:password@host:port/database``, one host or several.

Several hosts are libpq's multi-host form, for a primary and its standbys::

    pgjobs://app@db1:5432,db2:5432/app

Every pgjobs connection (publish, claim, keeper, CLI) then tries the hosts in order and takes
the first that accepts writes (``target_session_attrs=read-write`` unless ``connect_options``
says otherwise), so after a standby is promoted the next reconnect finds it: no restart.

kombu's own URL parser reads one port per URL; for a pgjobs URL that lists hosts it is taught
(``_alias.py``) to hand the list over whole as the hostname, which the transport splits with
:func:`host_list`; one-host URLs are kombu's to parse, as for every transport. The CLI and tools
parse with :func:`parse`. :func:`masked` hides a password for messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from .errors import InvalidURL

__all__ = ["SCHEMES", "BrokerURL", "host_list", "masked", "parse"]

SCHEMES = ("pgjobs", "postgres", "postgresql")


@dataclass(frozen=True)
class BrokerURL:
    """What a broker URL says. ``hosts`` is empty for ``pgjobs://`` (the embedded server)."""

    hosts: tuple[tuple[str, int | None], ...]
    user: str | None
    password: str | None
    dbname: str | None
    query: str

    @property
    def host(self) -> str | None:
        """libpq's ``host``: the hosts comma-separated, None for none."""
        return ",".join(h for h, _ in self.hosts) or None

    @property
    def port(self) -> str | None:
        """libpq's ``port``: one port, or one per host (5432 where a host gives none)."""
        ports = [p for _, p in self.hosts]
        if not any(ports):
            return None
        if len(ports) == 1:
            return str(ports[0])
        return ",".join(str(p or 5432) for p in ports)


def _fail(url: str, why: str) -> InvalidURL:
    return InvalidURL(f"broker URL {masked(url)!r} is malformed ({why}): use "
                      "pgjobs://user:password@host:port/database (several hosts: "
                      "pgjobs://user@db1:5432,db2:5432/database)")


def _host(item: str, url: str) -> tuple[str, int | None]:
    if item.startswith("["):  # [IPv6]:port
        end = item.find("]")
        if end < 0:
            raise _fail(url, f"unclosed '[' in host {item!r}")
        host, rest = item[1:end], item[end + 1:]
        if rest and not rest.startswith(":"):
            raise _fail(url, f"unexpected {rest!r} after host {host!r}")
        port_text = rest[1:] if rest else ""
    else:
        host, _, port_text = item.partition(":")
    host = unquote(host)
    if not host:
        raise _fail(url, "an empty host in the host list")
    if any(c in host for c in "/?#@ ") or any(ord(c) < 32 for c in host):
        raise _fail(url, f"host {host!r} holds a character a host cannot have")
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise InvalidURL(f"port {port_text!r} of host {host!r} is not in 1-65535")
    return host, int(port_text)


def host_list(text: str, url: str | None = None) -> tuple[tuple[str, int | None], ...]:
    """``db1:5432,db2,[::1]:5433`` -> ``(("db1", 5432), ("db2", None), ("::1", 5433))``."""
    return tuple(_host(item, url or text) for item in text.split(","))


def parse(url: str) -> BrokerURL:
    """Split a broker URL; :class:`~kombu_pgjobs.errors.InvalidURL` (``PGJ-101``) when it
    is not one."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidURL(f"not a broker URL: {url!r}: use pgjobs://user@host:port/database")
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise _fail(url, str(exc)) from None
    if parts.scheme not in SCHEMES:
        raise InvalidURL(f"URL scheme {parts.scheme!r} is not pgjobs:// or postgresql://")
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    user = password = None
    if at:
        name, colon, secret = userinfo.partition(":")
        user = unquote(name) or None
        password = unquote(secret) if colon else None
    hosts = host_list(hostlist, url) if hostlist else ()
    dbname = unquote(parts.path.removeprefix("/")) or None
    return BrokerURL(hosts=hosts, user=user, password=password or None, dbname=dbname,
                     query=parts.query)


def masked(url: str, mask: str = "**") -> str:
    """``url`` with its password replaced by ``mask`` (the URL as given when it has none);
    never raises, so it is safe in an error message about a malformed URL."""
    if not isinstance(url, str) or "://" not in url:
        return url
    scheme, _, rest = url.partition("://")
    netloc_end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
                     default=len(rest))
    netloc, tail = rest[:netloc_end], rest[netloc_end:]
    userinfo, at, hostlist = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    name = userinfo.partition(":")[0]
    return f"{scheme}://{name}:{quote(mask, safe='*')}@{hostlist}{tail}"
