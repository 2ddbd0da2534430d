"""The ``pgjobs`` operator CLI.

The database comes from ``--dsn`` or, failing that, ``PGJOBS_DSN``, ``CELERY_BROKER_URL`` or
``BROKER_URL`` (pgjobs:// or postgresql:// URLs). Every command takes ``--json``. Bad input exits
with status 2 and prints the error's stable code; a database problem exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .database import connect, conninfo_from_url
from .errors import ConfigurationError, PgJobsError
from .options import TransportOptions
from .schema import current_version, latest_version, migrate

__all__ = ["main"]

Command = Callable[[argparse.Namespace], Any]
_COMMANDS: dict[str, Command] = {}


def _dsn(args: argparse.Namespace) -> str:
    url = args.dsn or os.environ.get("PGJOBS_DSN") or os.environ.get("CELERY_BROKER_URL") \
        or os.environ.get("BROKER_URL")
    if not url:
        raise ConfigurationError(
            "no database given: pass --dsn pgjobs://user@host/db or set PGJOBS_DSN")
    return conninfo_from_url(url, TransportOptions(schema=args.schema))


def cmd_migrate(args: argparse.Namespace) -> dict[str, Any]:
    """Install or upgrade the schema (idempotent; safe to run from many hosts at once)."""
    with connect(_dsn(args)) as conn:
        before = current_version(conn, args.schema)
        applied = migrate(conn, args.schema)
        return {"schema": args.schema, "from_version": before,
                "to_version": latest_version(), "applied": applied}


def _render_migrate(result: dict[str, Any]) -> str:
    if result["applied"]:
        return (f"schema {result['schema']}: migrated {result['from_version']} -> "
                f"{result['to_version']} (applied {', '.join(map(str, result['applied']))})")
    return f"schema {result['schema']}: up to date at version {result['to_version']}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pgjobs", description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--dsn", help="pgjobs:// or postgresql:// URL (default: $PGJOBS_DSN)")
    common.add_argument("--schema", default=os.environ.get("PGJOBS_SCHEMA", "pgjobs"),
                        help="pgjobs schema (default: pgjobs or $PGJOBS_SCHEMA)")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("migrate", parents=[common], help=cmd_migrate.__doc__)
    p.set_defaults(func=cmd_migrate, render=_render_migrate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except PgJobsError as exc:
        payload = {"error": {"code": exc.code, "message": exc.message}}
        if getattr(args, "json", False):
            print(json.dumps(payload))
        else:
            print(f"pgjobs: error [{exc.code}] {exc.message}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigurationError) or exc.code.startswith("PGJ-4") else 3
    if args.json:
        print(json.dumps(result, default=str))
    else:
        print(args.render(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
