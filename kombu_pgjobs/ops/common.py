"""What the operator tools share: where the database comes from (``--dsn`` or the DSN
variables), an :class:`~kombu_pgjobs.store.admin.Admin` on it, how a subcommand is added, and
the words an operator reads (ages, timestamps, tables; text escaped for a terminal).

The CLI's command groups and the dashboard import this module; it imports the store and the
ground, never a tool.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import (
    ConfigurationError,
    InvalidShardMap,
)
from ..options import TransportOptions
from ..shardmap import ShardMap
from ..shardmap import parse as parse_shard_map
from ..store.admin import Admin
from ..store.database import connect, conninfo_from_url

__all__ = ["DSN_ENV", "Command", "add_command", "age_text", "args_dsn", "args_url", "cell_text",
           "open_admin", "safe_line", "safe_text", "shard_map", "summary", "table_text", "ts_text"]

Command = Callable[[argparse.Namespace], Any]

#: where a DSN may come from besides --dsn, in order
DSN_ENV = ("PGJOBS_DSN", "CELERY_BROKER_URL", "BROKER_URL")


# characters that control a terminal, or reorder or hide text: C0 (but \t and \n), DEL, C1,
# bidi overrides and isolates, line/paragraph separators, and lone surrogates (which cannot
# even be encoded to UTF-8)
_OTHER_UNSAFE = r"\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_TEXT = re.compile(rf"[\x00-\x08\x0b-\x1f{_OTHER_UNSAFE}]")
# in one table cell or one "field: value" line, \t and \n are unsafe too (they forge rows)
_UNSAFE_LINE = re.compile(rf"[\x00-\x1f{_OTHER_UNSAFE}]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape_char(match: re.Match[str]) -> str:
    c = match.group(0)
    if c in _NAMED:
        return _NAMED[c]
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def safe_line(value: Any) -> str:
    """One field for one line of text output: every control character escaped."""
    return _UNSAFE_LINE.sub(_escape_char, str(value))


def safe_text(value: Any) -> str:
    """Multi-line text output (a traceback, a whole table): controls escaped, lines kept."""
    return _UNSAFE_TEXT.sub(_escape_char, str(value))


def args_url(args: argparse.Namespace) -> str:
    url = args.dsn or next((os.environ[v] for v in DSN_ENV if os.environ.get(v)), None)
    if not url:
        raise ConfigurationError(
            "no database given: pass --dsn pgjobs://user@host/db or set PGJOBS_DSN")
    return str(url)


def args_dsn(args: argparse.Namespace) -> str:
    shard_dsn = getattr(args, "shard_dsn", None)  # one database of a shard map (_each_shard)
    if shard_dsn is not None:
        return str(shard_dsn)
    return conninfo_from_url(args_url(args), TransportOptions(schema=args.schema))


def shard_map(args: argparse.Namespace) -> ShardMap | None:
    """``--shards JSON|@file`` or ``$PGJOBS_SHARDS`` (the transport's ``shards`` option)."""
    raw = getattr(args, "shards", None) or os.environ.get("PGJOBS_SHARDS") or None
    if raw is not None and raw.startswith("@"):
        try:
            with open(raw[1:], encoding="utf-8") as fh:
                raw = fh.read()
        except OSError as exc:
            raise InvalidShardMap(f"cannot read the shard map {raw[1:]!r}: "
                                  f"{exc.strerror or exc}") from None
    return parse_shard_map(raw)


@contextmanager
def open_admin(args: argparse.Namespace) -> Iterator[Admin]:
    # Unprepared: operator statements run rarely and with optional filters, where a custom plan
    # per call beats the generic plan the transport's hot statements use.
    with connect(args_dsn(args), prepare=False) as conn:
        admin = Admin(conn, args.schema)
        admin.check_schema()
        yield admin


# -- rendering -----------------------------------------------------------------------------
def age_text(seconds: Any) -> str:
    """Seconds as an operator reads them: 42s, 5m12s, 3h05m, 2d04h."""
    if seconds is None:
        return "-"
    s = float(seconds)
    sign = "-" if s < 0 else ""
    s = abs(s)
    if s < 60:
        return f"{sign}{s:.1f}s" if s < 10 else f"{sign}{s:.0f}s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{sign}{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{sign}{int(s // 86400)}d{int(s % 86400 // 3600):02d}h"


def ts_text(value: Any) -> str:
    return "-" if value is None else str(value).replace("T", " ")[:19]


def cell_text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple)):
        return safe_line(",".join(map(str, value))) or "-"
    return safe_line(value)


def table_text(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """Left-aligned columns sized to their content; long cells are cut at 60 characters."""
    head = [title for title, _ in columns]
    body = [[cell_text(r.get(key))[:60] for _, key in columns] for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h)
              for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
              for line in body]
    return "\n".join(lines)


# -- parser --------------------------------------------------------------------------------
def summary(doc: str | None) -> str:
    """A command's line in ``pgjobs --help``: its docstring's first paragraph, whole (its first
    line alone cut sentences such as relay's mid-way)."""
    paragraph = (doc or "").strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def add_command(sub: Any, name: str, func: Command, render: Callable[[Any], str],
         common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = sub.add_parser(name, parents=[common], help=summary(func.__doc__),
                       description=func.__doc__)
    p.set_defaults(func=func, render=render)
    return p
