"""Versioned, idempotent migrations of the pgjobs schema.

Migrations are ``NNNN_name.sql`` files beside this module, applied in order, each once, in one
transaction under the lock of the ``pgjobs_migration`` table (a first install: a transaction-
scoped advisory lock, waited on for a bounded time): ten workers starting at once install the
schema once, and the others wait and then see it installed. ``{schema}`` in a file is replaced by
the quoted schema identifier.

A schema newer than this code (a later kombu-pgjobs migrated it) is refused with
:class:`~kombu_pgjobs.errors.SchemaTooNew` (PGJ-702) when its version is read, so on every
connect and by ``pgjobs migrate``: old code would run old statements against tables whose
meaning changed, silently.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from importlib import resources

import psycopg
from psycopg import sql

from ...errors import DatabaseTimeout, MigrationError, SchemaTooNew
from ...options import validate_schema_name

__all__ = ["Migration", "check_not_newer", "current_version", "latest_version", "migrate",
           "migrations"]

log = logging.getLogger("kombu_pgjobs.schema")
_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    text: str


def migrations() -> list[Migration]:
    found = []
    for entry in resources.files(__package__).iterdir():
        m = _FILE.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    return sorted(found, key=lambda mg: mg.version)


def latest_version() -> int:
    return migrations()[-1].version


def check_not_newer(version: int, schema: str) -> int:
    """``version`` if this code knows it; SchemaTooNew when a later kombu-pgjobs migrated the
    schema."""
    latest = latest_version()
    if version > latest:
        raise SchemaTooNew(
            f"schema {schema!r} is at version {version}, newer than this kombu-pgjobs knows "
            f"(up to {latest}): upgrade kombu-pgjobs in this process (every worker and "
            "publisher of the schema) instead of running older code against it")
    return version


def current_version(conn: psycopg.Connection, schema: str, *,
                    allow_newer: bool = False) -> int:
    """The applied version, 0 when the schema is not installed. One round trip (two when it is
    installed). A version newer than this code raises SchemaTooNew unless ``allow_newer`` (a
    caller that only reports it)."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".pgjobs_migration',)
    ).fetchone()
    if not row or not row[0]:
        return 0
    q = sql.SQL("SELECT version FROM {}.pgjobs_migration").format(sql.Identifier(schema))
    applied = {int(r[0]) for r in conn.execute(q).fetchall()}
    version = max(applied, default=0)
    if not allow_newer:
        check_not_newer(version, schema)
    # A known migration missing below the top one (numbers are handed out ahead and may land
    # out of order): the schema is behind at the first gap, so auto_migrate applies it.
    gaps = [m.version for m in migrations() if m.version < version and m.version not in applied]
    return min(gaps) - 1 if gaps else version


#: How long a first install waits for another process's (the advisory lock it takes has no
#: table to lock yet, and any role may hold an advisory lock: the wait must end).
FIRST_INSTALL_WAIT = "120s"


def _lock_migrations(conn: psycopg.Connection, schema: str) -> None:
    """Serialise migrators of ``schema``. An installed schema: the lock of its
    ``pgjobs_migration`` table (``SHARE ROW EXCLUSIVE``, which needs a write grant on it: no
    role outside the app can take or hold it), waited on without a bound (another process's
    migration). A first install has no table to lock: a transaction-scoped advisory lock, which
    any role that can connect could hold, so its wait is bounded (FIRST_INSTALL_WAIT) and ends
    in MigrationError. The first installer takes the table's lock too once it made the table,
    so the two paths exclude each other."""
    ident = sql.Identifier(schema)
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                       (f'"{schema}".pgjobs_migration',)).fetchone()
    if row and row[0]:
        conn.execute("SET LOCAL lock_timeout = 0", prepare=False)
        conn.execute(sql.SQL("LOCK TABLE {}.pgjobs_migration IN SHARE ROW EXCLUSIVE MODE")
                     .format(ident))
        return
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(
        sql.Literal(FIRST_INSTALL_WAIT)), prepare=False)
    try:
        with conn.transaction():  # a savepoint: the error below is ours to report
            conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))",
                         (f"pgjobs.migrate.{schema}",))
    except (psycopg.errors.LockNotAvailable, DatabaseTimeout):
        raise MigrationError(
            f"installing schema {schema!r} waited {FIRST_INSTALL_WAIT} for another "
            "installer's lock (pg_advisory_xact_lock(hashtext('pgjobs.migrate.<schema>'))): "
            "find the session holding it in pg_locks; if it is not a pgjobs process, "
            "terminate it (any role that can connect may take an advisory lock)") from None


def migrate(conn: psycopg.Connection, schema: str) -> list[int]:
    """Apply pending migrations; return the versions applied (empty when up to date)."""
    validate_schema_name(schema)
    ident = sql.Identifier(schema)
    applied: list[int] = []
    try:
        with conn.transaction():
            # No timeouts inside a migration (the lock_timeout/statement_timeout options hold
            # for the session): the advisory lock waits for another process's migration, and
            # a DDL on a big table must not be cut short and retried by every worker forever.
            conn.execute("SET LOCAL statement_timeout = 0", prepare=False)
            _lock_migrations(conn, schema)
            conn.execute("SET LOCAL lock_timeout = 0", prepare=False)
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.pgjobs_migration ("
                " version integer PRIMARY KEY,"
                " name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())").format(ident))
            conn.execute(sql.SQL("LOCK TABLE {}.pgjobs_migration IN SHARE ROW EXCLUSIVE MODE")
                         .format(ident))
            rows = conn.execute(
                sql.SQL("SELECT version FROM {}.pgjobs_migration").format(ident)).fetchall()
            done = {r[0] for r in rows}
            check_not_newer(max(done, default=0), schema)
            for mg in migrations():
                if mg.version in done:
                    continue
                # A multi-statement script: never a prepared statement.
                conn.execute(sql.SQL(mg.text).format(schema=ident),  # type: ignore[arg-type]
                             prepare=False)
                conn.execute(
                    sql.SQL("INSERT INTO {}.pgjobs_migration (version, name) VALUES (%s, %s)")
                    .format(ident), (mg.version, mg.name))
                applied.append(mg.version)
    except psycopg.Error as exc:
        raise MigrationError(f"migrating schema {schema!r} failed: {exc}") from exc
    if applied:
        log.info("pgjobs.migrate.applied", extra={"action": "migrate", "schema": schema,
                                                  "versions": applied})
    return applied
