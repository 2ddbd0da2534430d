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

No error says any part of a password. A password holding an unescaped ``/``, ``?`` or ``#``
ends the URL's host part early (``pgjobs://app:pa/ss@db/x`` reads as host ``app``, port
``pa``), so an error about "the host" or "the port" would quote a piece of it: such a URL (an
``@`` after the end of the host part) is refused as a whole, before its parts are read, with
the advice to percent-encode the password (:func:`check_userinfo`; kombu's own parser is
guarded the same way for pgjobs URLs, see ``_alias.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

from .errors import InvalidURL

__all__ = ["SCHEMES", "BrokerURL", "check_userinfo", "host_list", "masked", "parse"]

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


#: libpq's ``password=`` URI parameter (and conninfo keyword), quoted or not
_PASSWORD_PARAM = re.compile(r"(?i)(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|[^&#\s]*)")


def check_userinfo(url: str) -> None:
    """InvalidURL (``PGJ-101``) when an ``@`` comes after the end of the URL's host part (the
    first ``/``, ``?`` or ``#`` after ``://``): a user name or password holding one of those
    unescaped, which would otherwise be read as host, port or path, and quoted in errors."""
    rest = url.partition("://")[2]
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0),
              default=len(rest))
    if "@" in rest[end:]:
        raise InvalidURL(
            f"broker URL {masked(url)!r} is malformed: its user name or password holds an "
            "unescaped '/', '?', '#' or '@' (or an '@' follows the host part): percent-encode "
            "them, e.g. urllib.parse.quote(password, safe='') ('/' is %2F, '?' %3F, '#' %23, "
            "'@' %40)")


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
    if not isinstance(url, str) or "://" not in url:  # not echoed: it may be all password
        raise InvalidURL(f"not a broker URL ({type(url).__name__} without scheme://): use "
                         "pgjobs://user@host:port/database")
    check_userinfo(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # its text may quote the netloc, password included
        why = "an unclosed '['" if "IPv6" in str(exc) else "characters a URL cannot hold"
        raise _fail(url, why) from None
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
    never raises, so it is safe in an error message about a malformed URL.

    The user information runs to the *last* ``@`` of the URL, not to the end of the host
    part: a password may hold an unescaped ``/``, ``?``, ``#`` or ``@``, and none of it may
    show (a URL with an ``@`` in its query loses its host to the mask: a secret never shows).
    A ``password=`` parameter is masked too; text without ``://`` loses what precedes its
    last ``@``."""
    if not isinstance(url, str):
        return url
    text = _PASSWORD_PARAM.sub(lambda m: m.group(1) + mask, url)
    scheme, sep, rest = text.partition("://")
    userinfo, at, tail = (rest if sep else text).rpartition("@")
    if not at:
        return text
    if not sep:
        return f"{mask}@{tail}"
    name, colon, _ = userinfo.partition(":")
    if not colon:
        return text
    return f"{scheme}://{name}:{quote(mask, safe='*')}@{tail}"
