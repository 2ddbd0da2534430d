"""``pgjobs dashboard``: the command's arguments, and serving the app with uvicorn.

Importing this module imports argparse only; the web packages (the ``dashboard`` extra) are
imported when the command runs, so ``pgjobs`` works without them and says what to install
when they are missing.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any

from ..errors import DashboardNotInstalled, DashboardTokenRequired, InvalidArgument

__all__ = ["TOKEN_ENV", "cmd_dashboard", "register"]

TOKEN_ENV = "PGJOBS_DASHBOARD_TOKEN"
DEFAULT_BIND = "127.0.0.1"
DEFAULT_PORT = 8787
#: Host headers a loopback-bound dashboard answers (a DNS-rebinding page gets 400)
LOOPBACK_HOSTS = ["127.0.0.1", "localhost", "[::1]", "::1"]

log = logging.getLogger(__name__)


def _loopback(bind: str) -> bool:
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return bind == "localhost"


def cmd_dashboard(args: argparse.Namespace) -> None:
    """Serve the web dashboard (read-only unless --write with a token)."""
    if not 0 <= args.port <= 65535:
        raise InvalidArgument(f"--port must be between 0 and 65535, got {args.port}")
    token = args.auth_token or os.environ.get(TOKEN_ENV) or None
    if args.write and not token:
        raise DashboardTokenRequired()
    try:
        import uvicorn
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        from .app import create_app
    except ImportError as exc:
        raise DashboardNotInstalled(
            f"the dashboard needs its extra ({exc.name} is missing): "
            "pip install 'kombu-pgjobs[dashboard]'") from None
    from ..cli import DSN_ENV, _admin

    with _admin(args):  # a database is given, the schema is there and recent enough
        pass
    url = args.dsn or next(os.environ[v] for v in DSN_ENV if os.environ.get(v))
    app: Any = create_app(url, schema=args.schema, write=args.write, token=token)
    hosts = [*LOOPBACK_HOSTS, *args.allowed_host] if _loopback(args.bind) and \
        "*" not in args.allowed_host else ["*"]
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=hosts)
    if args.write and not _loopback(args.bind):
        log.warning("pgjobs.dashboard.exposed write mode on %s: put it behind TLS",
                    args.bind, extra={"action": "dashboard"})
    mode = "write" if args.write else "read-only"
    behind = f", links under {args.root_path}" if args.root_path else ""
    sys.stderr.write(f"pgjobs dashboard: http://{args.bind}:{args.port} "
                     f"({mode}, schema {args.schema}{behind})\n")
    sys.stderr.flush()
    uvicorn.run(app, host=args.bind, port=args.port, root_path=args.root_path,
                log_level=args.log_level, proxy_headers=False, server_header=False)


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``dashboard`` to the ``pgjobs`` command line (called by cli.build_parser)."""
    p = sub.add_parser("dashboard", parents=[common], help=cmd_dashboard.__doc__,
                       description=cmd_dashboard.__doc__)
    p.set_defaults(func=cmd_dashboard, render=str)
    p.add_argument("--bind", default=DEFAULT_BIND,
                   help=f"address to listen on (default {DEFAULT_BIND}; never 0.0.0.0 unless "
                        "you say so)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on (default {DEFAULT_PORT})")
    p.add_argument("--write", action="store_true",
                   help=f"allow actions (pause, requeue, cancel, purge); needs --auth-token or "
                        f"${TOKEN_ENV} (at least 16 characters)")
    p.add_argument("--auth-token", metavar="TOKEN",
                   help=f"the write token (prefer ${TOKEN_ENV}: a command line is visible "
                        "to every local user)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="HOST",
                   help="another Host header to answer when bound to loopback (behind a "
                        "proxy); '*' for any")
    p.add_argument("--root-path", default="", metavar="PREFIX",
                   help="the path prefix a reverse proxy serves the dashboard under")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])

