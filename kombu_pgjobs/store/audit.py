"""The audit log (schema version 24): who changed what through the ``pgjobs`` CLI or the
dashboard, with the exact filter or ids, how many rows, and when.

The dashboard records an action in the action's own transaction
(:func:`kombu_pgjobs.ops.dashboard.actions.action`): the write and its row commit together or not
at all. The CLI records a command right after it succeeded, on its own connection: a bulk
command runs in bounded batches, each its own transaction, so no single transaction holds them
all. A command that failed records nothing (it changed nothing, or said what it did not do).

What is recorded as the target is the command's filter as given, never a secret: arguments
whose names say secret, token, password or key material are left out.
"""

from __future__ import annotations

import getpass
import socket
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from ..options import validate_schema_name
from .sql import queries

__all__ = ["AUDIT_VERSION", "MAX_LIMIT", "clean_target", "cli_actor", "ls", "record", "rows_of"]

#: the schema version that made pgjobs_audit
AUDIT_VERSION = 24
MAX_LIMIT = 1000
#: argument names never recorded (a webhook secret, a token, a DSN with its password)
_HIDDEN = ("secret", "token", "password", "dsn", "csrf", "keys_env", "key_env")
#: result keys that count rows changed, and result keys that list them
_COUNTS = ("purged", "affected", "deleted", "folded", "sealed", "resealed")
_LISTS = ("requeued", "made_due", "cancelled", "marked", "dropped")


def cli_actor() -> tuple[str, str]:
    """(OS user, host name) of this process."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (a container)
        user = "unknown"
    return user, socket.gethostname()


def clean_target(given: Mapping[str, Any]) -> dict[str, Any]:
    """The filter of a write as recorded: values that say something (not None, not False,
    not empty), JSON-ready, without anything secret."""
    out: dict[str, Any] = {}
    for key, value in given.items():
        name = str(key)
        if any(h in name.lower() for h in _HIDDEN) or value in (None, False, "", [], ()):
            continue
        if isinstance(value, (str, int, float, bool)):
            out[name] = value
        elif isinstance(value, (list, tuple)):
            out[name] = [v if isinstance(v, (str, int, float)) else str(v) for v in value]
        else:
            out[name] = str(value)
    return out


def _count(result: Mapping[str, Any]) -> int | None:
    total: int | None = None
    for key, value in result.items():
        n: int | None = None
        if key in _COUNTS and isinstance(value, int) and not isinstance(value, bool):
            n = value
        elif key in _LISTS and isinstance(value, list):
            n = len(value)
        elif isinstance(value, Mapping):
            n = _count(value)
        if n is not None:
            total = (total or 0) + n
    return total


def rows_of(result: Any) -> int | None:
    """How many rows a write's result says it changed: the counts it names (purged, deleted,
    ...) and the ids it lists (requeued, cancelled, ...), its nested parts summed (a prune); a
    result that names none changed one thing (a queue paused, a schedule entry added)."""
    if not isinstance(result, Mapping):
        return None
    n = _count(result)
    return 1 if n is None else n


def record(conn: psycopg.Connection[Any], schema: str, *, origin: str, actor: str,
           host: str | None, action: str, target: Mapping[str, Any],
           rows: int | None) -> None:
    """Insert one audit row on ``conn`` (in its open transaction, if any)."""
    conn.execute(queries(validate_schema_name(schema))["audit_record"], {
        "origin": origin, "actor": actor, "host": host, "action": action,
        "target": Jsonb(clean_target(target)), "rows": rows})


def ls(conn: psycopg.Connection[Any], schema: str, *, limit: int = 50,
       before: int | None = None) -> list[dict[str, Any]]:
    """The audit log, newest first."""
    cur = conn.execute(queries(validate_schema_name(schema))["audit_ls"],
                       {"n": int(limit), "before": before})
    names = [d.name for d in cur.description or ()]
    return [{k: (v.isoformat() if isinstance(v, datetime) else v)
             for k, v in zip(names, row, strict=True)} for row in cur.fetchall()]
