"""``pgjobs dashboard``: the command's arguments, and serving the app with uvicorn.

Importing this module imports argparse only; the web packages (the ``dashboard`` extra) are
imported when the command runs, so ``pgjobs`` works without them and says what to install
when they are missing.

What it refuses at start, before anything listens: ``--write`` without a write token
(``PGJ-431``); a token too easy to guess (``PGJ-436``); a bind other than loopback without a
read token unless ``--public-read`` says so (``PGJ-435``); a malformed ``--trusted-proxy``
(``PGJ-405``).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any

from ...errors import (
    DashboardExposed,
    DashboardNotInstalled,
    DashboardTokenRequired,
    InvalidArgument,
)
from ..common import DSN_ENV, open_admin, shard_map

__all__ = ["READ_TOKEN_ENV", "TOKEN_ENV", "allowed_hosts", "cmd_dashboard", "register"]

TOKEN_ENV = "PGJOBS_DASHBOARD_TOKEN"
READ_TOKEN_ENV = "PGJOBS_DASHBOARD_READ_TOKEN"
DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 8787
#: Host headers answered on every bind, besides --allowed-host (a DNS-rebinding page gets 400)
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]", "::1"]
#: proxies whose X-Forwarded-* headers are trusted with --proxy-headers, unless named
DEFAULT_PROXIES = ["127.0.0.1", "::1"]
#: what --public-read lets anyone who reaches the port read
PUBLIC_READ_EXPOSES = ("every queue and its counts, every message's body, headers and "
                       "arguments, every dead letter's error and traceback, workers, tenants, "
                       "schedules, and webhook endpoint URLs and their delivery attempts")

log = logging.getLogger("kombu_pgjobs.dashboard.command")


def _loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return bind == "localhost"


def allowed_hosts(bind: str, extra: list[str]) -> list[str]:
    """The Host names answered: the loopback names, the bind address itself when it is one
    address (not 0.0.0.0 or ::), and ``--allowed-host``."""
    hosts = [*LOOPBACK_HOSTS, *extra]
    try:
        address = ipaddress.ip_address(bind.strip("[]"))
    except ValueError:
        if bind and bind not in hosts:
            hosts.append(bind)  # a name to bind is a name to be reached by
        return hosts
    if not address.is_unspecified:
        hosts.append(f"[{address}]" if address.version == 6 else str(address))
    return hosts


def _proxies(given: list[str]) -> list[str]:
    out = []
    for item in given or DEFAULT_PROXIES:
        try:
            out.append(str(ipaddress.ip_network(item.strip("[]"), strict=False)))
        except ValueError:
            raise InvalidArgument(
                f"--trusted-proxy {item!r} is not an address or a network (10.0.0.5, "
                "10.0.0.0/8); name the proxies, '*' is not taken") from None
    return out


def cmd_dashboard(args: argparse.Namespace) -> None:
    """Serve the web dashboard (read-only unless --write with a token)."""
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"--port must be between 0 and 65535, got {args.port}")
    token = args.auth_token or os.environ.get(TOKEN_ENV) or None
    read_token = args.read_token or os.environ.get(READ_TOKEN_ENV) or None
    if args.write and not token:
        raise DashboardTokenRequired()
    loopback = _loopback(args.bind)
    if args.public_read and read_token:
        raise InvalidArgument("--public-read and a read token contradict each other: give "
                              "one or the other")
    if not loopback and not read_token and not args.public_read:
        raise DashboardExposed(
            f"the dashboard would listen on {args.bind}, beyond this host, and anyone who "
            f"reaches it would read {PUBLIC_READ_EXPOSES}: give a read token (--read-token "
            f"or ${READ_TOKEN_ENV}), or pass --public-read if that is really meant")
    proxies = _proxies(args.trusted_proxy) if args.proxy_headers else []
    if args.trusted_proxy and not args.proxy_headers:
        raise InvalidArgument("--trusted-proxy needs --proxy-headers")
    from .security import check_token  # no web package: checked even without the extra

    if args.write:
        check_token(token, "write token")
    if read_token:
        check_token(read_token, "read token")
    try:
        import uvicorn

        from .factory import create_app
    except ImportError as exc:
        raise DashboardNotInstalled(
            f"the dashboard needs its extra ({exc.name} is missing): "
            "pip install 'kombu-pgjobs[dashboard]'") from None
    with open_admin(args):  # a database is given, the schema is there and recent enough
        pass
    url = args.dsn or next(os.environ[v] for v in DSN_ENV if os.environ.get(v))
    hosts = allowed_hosts(args.bind, args.allowed_host)
    app: Any = create_app(url, schema=args.schema, write=args.write, token=token,
                          read_token=read_token, allowed_hosts=hosts,
                          secure_cookies=True if args.secure_cookies else None,
                          shards=shard_map(args))
    if args.public_read and not loopback:
        log.warning("pgjobs.dashboard.public_read on %s: anyone who reaches it reads %s",
                    args.bind, PUBLIC_READ_EXPOSES, extra={"action": "dashboard"})
        sys.stderr.write(f"pgjobs dashboard: --public-read: anyone who reaches {args.bind} "
                         f"reads {PUBLIC_READ_EXPOSES}\n")
    if not loopback and not args.allowed_host:
        sys.stderr.write(f"pgjobs dashboard: it answers only Host {', '.join(hosts)}; add "
                         "the name it is reached by with --allowed-host NAME\n")
    if (args.write or read_token) and not loopback and not args.proxy_headers \
            and not args.secure_cookies:
        log.warning("pgjobs.dashboard.exposed tokens on %s: put it behind TLS "
                    "(--proxy-headers behind a TLS proxy)", args.bind,
                    extra={"action": "dashboard"})
    mode = "write" if args.write else "read-only"
    reads = "reading needs a token" if read_token else "reading is open"
    behind = f", links under {args.root_path}" if args.root_path else ""
    proxied = f", trusting X-Forwarded-* from {', '.join(proxies)}" if proxies else ""
    sys.stderr.write(f"pgjobs dashboard: http://{args.bind}:{args.port} "
                     f"({mode}, {reads}, schema {args.schema}{behind}{proxied})\n")
    sys.stderr.flush()
    uvicorn.run(app, host=args.bind, port=args.port, root_path=args.root_path,
                log_level=args.log_level, proxy_headers=bool(args.proxy_headers),
                forwarded_allow_ips=proxies or None, server_header=False)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``dashboard`` to the ``pgjobs`` command line (called by cli.build_parser)."""
    p = sub.add_parser("dashboard", parents=[common], help=cmd_dashboard.__doc__,
                       description=cmd_dashboard.__doc__)
    p.set_defaults(func=cmd_dashboard, render=str)
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help=f"address to listen on (default {DEFAULT_BIND}; anything else needs "
                        "a read token or --public-read)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on (default {DEFAULT_PORT})")
    p.add_argument("--write", action="store_true",
                   help=f"allow actions (pause, requeue, cancel, purge); needs --auth-token or "
                        f"${TOKEN_ENV} (at least 16 characters, not guessable)")
    p.add_argument("--auth-token", metavar="TOKEN",
                   help=f"the write token (prefer ${TOKEN_ENV}: a command line is visible "
                        "to every local user)")
    p.add_argument("--read-token", metavar="TOKEN",
                   help=f"every page needs this token or the write token (prefer "
                        f"${READ_TOKEN_ENV}); required off loopback unless --public-read")
    p.add_argument("--public-read", action="store_true",
                   help="off loopback, let anyone who reaches the port read every page "
                        "(message bodies, headers, tracebacks) without a token")
    p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="another Host header to answer besides the loopback names and the "
                        "bind address (the name a proxy or users reach it by; *.example.com "
                        "for subdomains, '*' for any)")
    p.add_argument("--proxy-headers", action="store_true",
                   help="trust X-Forwarded-Proto and X-Forwarded-For from --trusted-proxy "
                        "(cookies get Secure behind a TLS proxy; the login backoff counts "
                        "the client's address, not the proxy's)")
    p.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDR",
                   help="a proxy address or network whose forwarded headers are trusted "
                        "(default 127.0.0.1 and ::1; repeat for several)")
    p.add_argument("--secure-cookies", action="store_true",
                   help="set Secure on every cookie (TLS ends before the dashboard, and the "
                        "proxy sends no X-Forwarded-Proto)")
    p.add_argument("--shards", metavar="JSON|@FILE",
                   help="shard map (the transport's shards option; default $PGJOBS_SHARDS): "
                        "the tasks and workers pages span every database it names")
    p.add_argument("--root-path", default="", metavar="PREFIX",
                   help="the path prefix a reverse proxy serves the dashboard under")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
