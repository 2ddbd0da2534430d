"""All runtime SQL, one file per table, loaded once.

Each statement sits under a ``-- name: <table>_<verb> :kind`` header followed by comment lines
that say what it does. ``{schema}`` is replaced by the quoted schema identifier with
:mod:`psycopg.sql`, never by string formatting, and the composed text is cached per schema.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

from psycopg import sql

__all__ = ["as_text", "positional", "queries", "raw_queries", "text_params", "with_limit"]

_HEADER = re.compile(r"^-- name: (\w+)(?: :\w+)?\s*$", re.MULTILINE)


@cache
def raw_queries() -> dict[str, str]:
    found: dict[str, str] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        text = entry.read_text("utf-8")
        parts = _HEADER.split(text)
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise RuntimeError(f"duplicate query name {name}")
            # Comment lines are for readers: they are not sent (and psycopg would read a
            # %(name)s in a comment as a placeholder).
            lines = [ln for ln in body.splitlines() if not ln.lstrip().startswith("--")]
            found[name] = "\n".join(lines).strip().rstrip(";")
    return found


@cache
def queries(schema: str) -> dict[str, sql.Composed]:
    """Every query composed for ``schema`` (validated by the caller). A ``{limit}`` in a
    statement is left as the ``%(n)s`` parameter here; see :func:`with_limit`."""
    ident = sql.Identifier(schema)
    return {name: sql.SQL(text).format(schema=ident,  # type: ignore[arg-type]
                                       limit=sql.SQL("%(n)s"))
            for name, text in raw_queries().items()}


@cache
def with_limit(schema: str, name: str, limit: int) -> sql.Composed:
    """Statement ``name`` with its ``{limit}`` written as the literal ``limit``: a prepared
    statement per value, whose generic plan knows its LIMIT (a parameter LIMIT makes the
    planner assume a tenth of the table and sort it)."""
    return sql.SQL(raw_queries()[name]).format(  # type: ignore[arg-type]
        schema=sql.Identifier(schema), limit=sql.Literal(int(limit)))


_PLACEHOLDER = re.compile(rb"%(?:\((\w+)\)s|%)")


@cache
def positional(schema: str, name: str, limit: int) -> tuple[bytes, tuple[str, ...]]:
    """Statement ``name`` as :func:`with_limit` writes it, its ``%(key)s`` placeholders
    numbered once (``$1``, ``$2``...), and the keys in that order: for a raw cursor.

    psycopg parses a statement's text for placeholders on every execute, and caches the
    result only for statements under 4 kB; the claim is longer, and that parse was about
    70 µs of the consumer's CPU per claim. A raw cursor sends the numbered text as it is."""
    text = with_limit(schema, name, limit).as_bytes(None)
    keys: list[str] = []

    def number(found: re.Match[bytes]) -> bytes:
        if found.group(1) is None:
            return b"%"  # %% is a literal %
        key = found.group(1).decode()
        if key not in keys:
            keys.append(key)
        return b"$%d" % (keys.index(key) + 1)

    return _PLACEHOLDER.sub(number, text), tuple(keys)


def as_text(value: Any) -> str | None:
    """``value`` as PostgreSQL's text input of its type (None stays NULL): booleans,
    numbers, strings, and flat sequences of them as array literals (elements quoted)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, (int, float, str)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "{" + ",".join(_element(item) for item in value) + "}"
    raise TypeError(f"no text form for a parameter of type {type(value).__name__}")


def _element(item: Any) -> str:
    if item is None:
        return "NULL"
    if isinstance(item, (list, tuple)):
        raise TypeError("nested sequences have no text form here")
    text = as_text(item)
    assert text is not None
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def text_params(values: Sequence[Any]) -> list[str | None]:
    """``values`` as text of unknown type (see :func:`as_text`), for a statement that casts
    every parameter: the server types them from the statement, so every call sends the same
    parameter types. psycopg keys a prepared statement by its text *and* the types it sends,
    which follow the values (an int goes as smallint, integer or bigint by its size, an empty
    list untyped): the claim's acks, ids and wake id gave one connection a dozen prepared
    claims, each planned anew (3-4 ms of the server's CPU for this statement)."""
    return [as_text(value) for value in values]
