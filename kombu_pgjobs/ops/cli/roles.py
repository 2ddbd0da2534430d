"""``pgjobs roles``: least-privilege roles for a pgjobs schema, as SQL to read or to run.

Five NOLOGIN group roles, ``<prefix>_owner``, ``_worker``, ``_publisher``, ``_operator`` and
``_readonly``: the user grants them to the login roles each component connects as (see
docs/security.md). The rights come from what each component's statements need, found by running
it as its role (tests/test_roles.py); the objects they are granted on come from the catalog as
it is when the command runs, so a table a later migration adds is covered by running the
command again (it is idempotent, and converges: every right of the four non-owner roles on the
schema's objects is revoked and granted afresh in one transaction).

Two things are decided from the catalog rather than from a list:

* which tables, sequences and functions exist (a table this code does not name gets the
  default of each role: everything but TRUNCATE for the worker, SELECT for the operator and the
  read-only role, nothing for the publisher);
* whether the publish path's functions run with their owner's rights (``SECURITY DEFINER``).
  A publish runs the wake trigger and, with an idempotency key or a tenant cap, the guarded
  publish function. Where those run with the caller's rights (schema versions before the trust
  boundary), the publisher needs what they read and write, message columns included; where
  they are ``SECURITY DEFINER``, it needs only ``INSERT`` and ``EXECUTE``.

The one column held back by name is the webhook endpoints' ``secret``: the read-only and
operator roles get ``SELECT`` on every other column of that table (column privileges), so
``SELECT secret`` (or ``SELECT *``) fails for them with permission denied.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ...errors import InvalidArgument
from ...options import validate_schema_name
from ..common import args_dsn

__all__ = ["KINDS", "Catalog", "Statement", "apply", "as_text", "cmd_roles", "read_catalog",
           "register", "role_names", "statements", "table_grants"]

#: the roles, in the order they are created
KINDS = ("owner", "worker", "publisher", "operator", "readonly")
#: a prefix is a role name's start: lower-case, so it needs no quoting in a login's GRANT
_PREFIX = re.compile(r"^[a-z_][a-z0-9_]{0,47}$")

#: table rights, the default of each non-owner role for a table not named below
DEFAULT_RIGHTS: dict[str, tuple[str, ...]] = {
    "worker": ("SELECT", "INSERT", "UPDATE", "DELETE"),
    "publisher": (),
    "operator": ("SELECT",),
    "readonly": ("SELECT",),
}
#: rights per table that differ from the default (a table absent from the catalog is skipped)
TABLE_RIGHTS: dict[str, dict[str, tuple[str, ...]]] = {
    # applied migrations: only the migrate runner (the owner) writes them; everyone reads the
    # version on connect
    "pgjobs_migration": {"worker": ("SELECT",), "publisher": ("SELECT",)},
    # the failover fence: every pgjobs connection reads it
    "pgjobs_epoch": {"publisher": ("SELECT",)},
    # routing: a publish reads an exchange's bindings; Celery declares its queues (and
    # binds them) when it first publishes to them
    "pgjobs_binding": {"publisher": ("SELECT", "INSERT", "UPDATE")},
    # operator writes: the CLI's pause/resume, requeue, cancel, purge, prune, schedule and
    # webhook commands
    "pgjobs_job": {"operator": ("SELECT", "INSERT", "UPDATE", "DELETE")},
    # FOR UPDATE: a lock; INSERT: a cancel keeps a queued message as a dead letter
    "pgjobs_dead_letter": {"operator": ("SELECT", "INSERT", "UPDATE", "DELETE")},
    "pgjobs_queue": {"operator": ("SELECT", "INSERT", "UPDATE")},
    "pgjobs_counter": {"operator": ("SELECT", "INSERT", "UPDATE", "DELETE")},
    # Celery's revoke broadcast, sent by an operator's process: recorded for starting workers
    "pgjobs_revoked": {"operator": ("SELECT", "INSERT", "UPDATE", "DELETE")},
    "pgjobs_schedule": {"operator": ("SELECT", "INSERT", "UPDATE", "DELETE")},
    "pgjobs_webhook_attempt": {"operator": ("SELECT", "DELETE")},
    "pgjobs_outbox": {"operator": ("SELECT", "DELETE"), "publisher": ("INSERT",)},
    # the trust boundary's lock rows (schema version 21): claims and operator writes lock them
    # (a row lock needs UPDATE); a publish locks them only inside functions that run as the
    # owner (the wake trigger, the guarded publish), so the publisher needs nothing here
    "pgjobs_lock": {"worker": ("SELECT", "UPDATE"), "operator": ("SELECT", "UPDATE")},
    # durable steps (schema 23): the worker's runs write steps and may emit (the default);
    # an operator reads them, drops them (requeue --from-step) and prunes steps and events; a
    # publisher (the web app) emits events: INSERT only, the trigger that wakes the waiters
    # runs as the owner
    "pgjobs_step": {"operator": ("SELECT", "DELETE")},
    "pgjobs_event": {"operator": ("SELECT", "DELETE"), "publisher": ("INSERT",)},
    # the audit log (schema 24): the CLI and the dashboard (operators) append to it and read
    # it; a worker's keeper runs the retention sweep, which deletes its old rows; nobody
    # updates a row
    "pgjobs_audit": {"worker": ("SELECT", "DELETE"), "operator": ("SELECT", "INSERT")},
    # the retention sweep's turn (schema 24): a keeper takes it with a conditional UPDATE
    "pgjobs_retention": {"worker": ("SELECT", "UPDATE")},
}
#: the webhook endpoints' table and its secret: no SELECT on that column but for the worker
#: (which signs deliveries with it)
SECRET_TABLE, SECRET_COLUMN = "pgjobs_webhook_endpoint", "secret"
#: what the operator may change in it (add, enable/disable, rotate, remove): writes that need no
#: SELECT on the secret
SECRET_TABLE_WRITES = ("INSERT", "UPDATE", "DELETE")
#: pgjobs_job columns a publisher never writes: what a claim, a lease and a cancel set. With
#: column privileges on the rest, a publisher can insert ready rows only, never a running
#: (claimed, handed-off) one
JOB_FENCE_COLUMNS = frozenset({"id", "state", "claim", "attempts", "lease_expires_at", "worker",
                               "cancelled_at", "waiting_on", "created_at", "claimed_at",
                               "outcome"})
#: pgjobs_job columns a publisher reads: what counts a queue's deliverable messages (kombu's
#: queue_declare and queue size), never a message's content
JOB_COUNTED = ("id", "queue", "state", "run_at", "expires_at")
#: what a publish may write of a queue when it declares one (it reads them all: a declare's
#: upsert reads the columns it sets, a publish the queue's x-message-ttl, the wake trigger its
#: pause): never ``paused``, which only operators set
QUEUE_DECLARE = ("name", "expires_ms", "message_ttl_ms", "max_priority", "auto_delete",
                 "last_used_at")
#: the publisher's functions, by name prefix (EXECUTE): the guarded publish and the failover
#: fence every new pgjobs connection runs (with the timeline function it calls)
PUBLISHER_FUNCTIONS = ("pgjobs_publish_", "pgjobs_fence_epoch_", "pgjobs_timeline_")
#: the operator's functions: a promote clears a message's ETA
OPERATOR_FUNCTIONS = ("pgjobs_without_eta_",)
#: tables a worker may VACUUM (the keeper's, after settling): MAINTAIN, PostgreSQL 17 and later
MAINTAINED = ("pgjobs_job", "pgjobs_slot")


@dataclass(frozen=True)
class Function:
    name: str
    args: str  # pg_get_function_identity_arguments
    security_definer: bool
    owner: str


@dataclass(frozen=True)
class Catalog:
    """What ``pgjobs roles`` reads of the database before writing its SQL."""

    database: str
    server_version: int
    schema_owner: str | None  # None: the schema does not exist
    #: table -> (owner, its columns in order)
    tables: dict[str, tuple[str, tuple[str, ...]]] = field(default_factory=dict)
    #: sequences not owned by an identity column (those follow their table's owner)
    free_sequences: dict[str, str] = field(default_factory=dict)
    sequences: tuple[str, ...] = ()
    functions: tuple[Function, ...] = ()
    #: composite and other free-standing types -> owner
    types: dict[str, str] = field(default_factory=dict)
    #: trigger functions of pgjobs_job that run AFTER INSERT (the wake trigger)
    wake_functions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Statement:
    comment: str
    query: sql.Composable


def role_names(prefix: str) -> dict[str, str]:
    """``{kind: role name}`` for ``prefix`` (validated)."""
    if not isinstance(prefix, str) or not _PREFIX.match(prefix):
        raise InvalidArgument(
            f"role prefix {prefix!r} is invalid: use 1-48 characters of a-z, 0-9 and _, "
            "starting with a letter or _")
    if prefix.startswith("pg_"):
        raise InvalidArgument(f"role prefix {prefix!r} is reserved by PostgreSQL (pg_*)")
    return {kind: f"{prefix}_{kind}" for kind in KINDS}


def read_catalog(conn: psycopg.Connection[Any], schema: str) -> Catalog:
    """The schema's objects and owners, the database's name and the server's version."""
    validate_schema_name(schema)
    database, version = conn.execute(
        "SELECT current_database(), current_setting('server_version_num')::int").fetchone() \
        or ("", 0)
    row = conn.execute("SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = %s",
                       (schema,)).fetchone()
    if row is None:
        return Catalog(database=database, server_version=version, schema_owner=None)
    tables: dict[str, tuple[str, tuple[str, ...]]] = {}
    for name, owner, columns in conn.execute(
            """SELECT c.relname, pg_get_userbyid(c.relowner),
                      array(SELECT a.attname::text FROM pg_attribute AS a
                             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
                             ORDER BY a.attnum)
                 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
                WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm')
                ORDER BY c.relname""", (schema,)):
        tables[name] = (owner, tuple(columns))
    sequences: list[str] = []
    free: dict[str, str] = {}
    for name, owner, bound in conn.execute(
            """SELECT c.relname, pg_get_userbyid(c.relowner),
                      EXISTS (SELECT 1 FROM pg_depend AS d
                               WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                                 AND d.deptype IN ('i', 'a'))
                 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
                WHERE n.nspname = %s AND c.relkind = 'S' ORDER BY c.relname""", (schema,)):
        sequences.append(name)
        if not bound:
            free[name] = owner
    functions = tuple(Function(name, args, secdef, owner) for name, args, secdef, owner in
                      conn.execute(
                          """SELECT p.proname, pg_get_function_identity_arguments(p.oid),
                                    p.prosecdef, pg_get_userbyid(p.proowner)
                               FROM pg_proc AS p
                               JOIN pg_namespace AS n ON n.oid = p.pronamespace
                              WHERE n.nspname = %s AND p.prokind IN ('f', 'p')
                              ORDER BY p.proname, 2""", (schema,)))
    types = dict(conn.execute(
        """SELECT t.typname, pg_get_userbyid(t.typowner)
             FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
             LEFT JOIN pg_class AS c ON c.oid = t.typrelid
            WHERE n.nspname = %s AND t.typelem = 0 AND t.typtype IN ('c', 'e', 'd', 'r')
              AND (t.typrelid = 0 OR c.relkind = 'c')
            ORDER BY t.typname""", (schema,)).fetchall())
    wake: tuple[str, ...] = ()
    if "pgjobs_job" in tables:
        wake = tuple(r[0] for r in conn.execute(
            """SELECT DISTINCT p.proname
                 FROM pg_trigger AS t JOIN pg_proc AS p ON p.oid = t.tgfoid
                WHERE t.tgrelid = %s::regclass AND NOT t.tgisinternal
                  AND t.tgtype & 2 = 0        -- AFTER
                  AND t.tgtype & 4 <> 0       -- INSERT
                ORDER BY 1""",
            (sql.Identifier(schema, "pgjobs_job").as_string(conn),)))
    return Catalog(database=database, server_version=version, schema_owner=row[0],
                   tables=tables, free_sequences=free, sequences=tuple(sequences),
                   functions=functions, types=types, wake_functions=wake)


def _ident(*parts: str) -> sql.Identifier:
    return sql.Identifier(*parts)


def _list(names: Iterable[str]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def _create_role(name: str) -> sql.Composed:
    # A DO block: CREATE ROLE has no IF NOT EXISTS; a concurrent creator is not an error.
    return sql.SQL(
        "DO $pgjobs$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = {lit}) THEN "
        "CREATE ROLE {role} NOLOGIN; END IF; "
        "EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $pgjobs$"
    ).format(lit=sql.Literal(name), role=_ident(name))


def _publish_invoker(cat: Catalog) -> tuple[bool, bool]:
    """(the wake trigger runs with the publisher's rights, the guarded publish does)."""
    by_name = {f.name: f for f in cat.functions}
    wake = any(not by_name[n].security_definer for n in cat.wake_functions if n in by_name)
    guarded = any(not f.security_definer for f in cat.functions
                  if f.name.startswith("pgjobs_publish_"))
    return wake, guarded


def table_grants(cat: Catalog, kind: str) -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    """``{table: [(privilege, columns or () for the whole table)]}`` for a non-owner role."""
    wake_invoker, guarded_invoker = _publish_invoker(cat)
    out: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for table, (_, columns) in cat.tables.items():
        rights = TABLE_RIGHTS.get(table, {}).get(kind, DEFAULT_RIGHTS[kind])
        grants: list[tuple[str, tuple[str, ...]]] = []
        if table == SECRET_TABLE and kind in ("operator", "readonly"):
            readable = tuple(c for c in columns if c != SECRET_COLUMN)
            grants.append(("SELECT", readable))
            if kind == "operator":
                grants += [(p, ()) for p in SECRET_TABLE_WRITES]
        elif kind == "publisher" and table == "pgjobs_job":
            insertable = tuple(c for c in columns if c not in JOB_FENCE_COLUMNS)
            grants.append(("INSERT", insertable))
            # kombu's queue_declare answers with the queue's size (Celery declares on its
            # first publish to a queue): rows counted by queue, state and due time
            read: list[str] = list(JOB_COUNTED)
            write: list[str] = []
            if guarded_invoker:
                # the guarded publish counts a tenant's rows, finds a key's holder (and its
                # Celery task id, in the message) and hands a retry the key
                read += ["id", "task", "tenant", "idempotency_key", "message"]
                write += ["idempotency_key"]
            if wake_invoker:
                # the wake trigger claims the message it hands off
                read += ["id", "state", "claim", "attempts", "message"]
                write += ["state", "claim", "attempts", "lease_expires_at", "worker"]
            grants.append(("SELECT", tuple(c for c in columns if c in read)))
            if write:
                grants.append(("UPDATE", tuple(c for c in columns if c in write)))
        elif kind == "publisher" and table == "pgjobs_queue":
            grants += [("SELECT", ()),
                       ("INSERT", tuple(c for c in columns if c in QUEUE_DECLARE)),
                       ("UPDATE", tuple(c for c in columns if c in QUEUE_DECLARE))]
        elif kind == "publisher" and table == "pgjobs_waiter" and wake_invoker:
            grants += [("SELECT", ()), ("UPDATE", ()), ("DELETE", ())]
        elif kind == "publisher" and table == SECRET_TABLE:
            grants.append(("SELECT", ("id",)))  # celery_ext's send() checks the endpoint
        else:
            grants += [(p, ()) for p in rights]
        if grants:
            out[table] = grants
    return out


def statements(cat: Catalog, schema: str, prefix: str) -> list[Statement]:
    """The SQL that makes the roles and gives them their rights on ``schema``, in order."""
    validate_schema_name(schema)
    roles = role_names(prefix)
    users = [roles[k] for k in KINDS if k != "owner"]
    s = _ident(schema)
    out: list[Statement] = []

    def add(comment: str, query: sql.Composable) -> None:
        out.append(Statement(comment, query))

    for kind in KINDS:
        add(f"the {kind} role (NOLOGIN: grant it to a login role)", _create_role(roles[kind]))
    add("every role connects (recommended: REVOKE CONNECT ON DATABASE ... FROM PUBLIC)",
        sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
            _ident(cat.database), _list(roles[k] for k in KINDS)))
    owner = roles["owner"]
    add("the migrate runner creates the schema if it is absent (CREATE SCHEMA IF NOT EXISTS "
        "needs CREATE on the database even when the schema exists)",
        sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(_ident(cat.database),
                                                            _ident(owner)))
    if cat.schema_owner is None:
        add("the schema, owned by the owner role: `pgjobs migrate` as the owner installs it; "
            "run `pgjobs roles --apply` again afterwards",
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}").format(s, _ident(owner)))
    else:
        if cat.schema_owner != owner:
            add("the owner role owns the schema and everything in it (migrations alter them)",
                sql.SQL("ALTER SCHEMA {} OWNER TO {}").format(s, _ident(owner)))
        for table, (who, _) in cat.tables.items():
            if who != owner:
                add("", sql.SQL("ALTER TABLE {} OWNER TO {}").format(
                    _ident(schema, table), _ident(owner)))
        for seq, who in cat.free_sequences.items():
            if who != owner:
                add("", sql.SQL("ALTER SEQUENCE {} OWNER TO {}").format(
                    _ident(schema, seq), _ident(owner)))
        for f in cat.functions:
            if f.owner != owner:
                add("", sql.SQL("ALTER FUNCTION {}({}) OWNER TO {}").format(
                    _ident(schema, f.name), sql.SQL(f.args), _ident(owner)))
        for typ, who in cat.types.items():
            if who != owner:
                add("", sql.SQL("ALTER TYPE {} OWNER TO {}").format(
                    _ident(schema, typ), _ident(owner)))
    add("the schema: every role may name its objects (no one else: no USAGE for PUBLIC)",
        sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, _list(users)))
    add("", sql.SQL("REVOKE CREATE ON SCHEMA {} FROM PUBLIC, {}").format(s, _list(users)))
    add("objects the owner creates later: the worker's rights (the others': run this again "
        "after a migration)",
        sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} GRANT SELECT, INSERT, "
                "UPDATE, DELETE ON TABLES TO {}").format(_ident(owner), s,
                                                       _ident(roles["worker"])))
    add("", sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} GRANT USAGE ON "
                    "SEQUENCES TO {}").format(_ident(owner), s, _ident(roles["worker"])))
    add("", sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} REVOKE EXECUTE ON "
                    "FUNCTIONS FROM PUBLIC").format(_ident(owner), s))
    add("", sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE {} IN SCHEMA {} GRANT EXECUTE ON "
                    "FUNCTIONS TO {}").format(_ident(owner), s, _ident(roles["worker"])))
    if cat.schema_owner is None:
        return out

    add("start from nothing: every right of these roles on the schema's objects is granted "
        "below (one transaction: no moment without them)",
        sql.SQL("REVOKE ALL ON ALL TABLES IN SCHEMA {} FROM {}").format(s, _list(users)))
    if cat.sequences:
        add("", sql.SQL("REVOKE ALL ON ALL SEQUENCES IN SCHEMA {} FROM {}").format(
            s, _list(users)))
    if cat.functions:
        add("functions: no EXECUTE for PUBLIC (a SECURITY DEFINER one runs as the owner)",
            sql.SQL("REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {} FROM PUBLIC, {}").format(
                s, _list(users)))
    for kind in ("worker", "publisher", "operator", "readonly"):
        role = _ident(roles[kind])
        grants = table_grants(cat, kind)
        # whole-table rights: one statement per set of rights; column rights: one per table
        whole: dict[tuple[str, ...], list[str]] = {}
        for table, rights in grants.items():
            plain = tuple(p for p, cols in rights if not cols)
            if plain:
                whole.setdefault(plain, []).append(table)
        comment = f"the {kind} role's tables"
        for plain, tables in whole.items():
            add(comment, sql.SQL("GRANT {} ON TABLE {} TO {}").format(
                sql.SQL(", ").join(sql.SQL(p) for p in plain),
                sql.SQL(", ").join(_ident(schema, t) for t in tables), role))
            comment = ""
        for table, rights in grants.items():
            cols = [sql.SQL("{} ({})").format(sql.SQL(p), _list(c)) for p, c in rights if c]
            if cols:
                add(comment, sql.SQL("GRANT {} ON TABLE {} TO {}").format(
                    sql.SQL(", ").join(cols), _ident(schema, table), role))
                comment = ""
        if kind != "readonly" and cat.sequences and any(
                p == "INSERT" for rights in grants.values() for p, _ in rights):
            add("", sql.SQL("GRANT USAGE ON SEQUENCE {} TO {}").format(
                sql.SQL(", ").join(_ident(schema, q) for q in cat.sequences), role))
        functions = [f for f in cat.functions if _may_execute(kind, f.name)]
        if functions:
            add("", sql.SQL("GRANT EXECUTE ON FUNCTION {} TO {}").format(
                sql.SQL(", ").join(sql.SQL("{}({})").format(_ident(schema, f.name),
                                                            sql.SQL(f.args))
                                   for f in functions), role))
    if cat.server_version >= 170000:
        present = [t for t in MAINTAINED if t in cat.tables]
        if present:
            add("the keeper's VACUUM of the job and slot tables (PostgreSQL 17: MAINTAIN)",
                sql.SQL("GRANT MAINTAIN ON TABLE {} TO {}").format(
                    sql.SQL(", ").join(_ident(schema, t) for t in present),
                    _ident(roles["worker"])))
    return out


def _may_execute(kind: str, function: str) -> bool:
    if kind == "worker":
        return True
    if kind == "operator":
        return function.startswith(OPERATOR_FUNCTIONS)
    if kind == "publisher":
        return function.startswith(PUBLISHER_FUNCTIONS)
    return False  # the read-only role calls none


def as_text(stmts: list[Statement], conn: psycopg.Connection[Any] | None = None) -> str:
    """The statements as a script: each with its comment, terminated by ``;``."""
    lines: list[str] = []
    for st in stmts:
        if st.comment:
            lines.append(f"-- {st.comment}")
        lines.append(st.query.as_string(conn) + ";")
    return "\n".join(lines)


#: Tries of the whole transaction when another session changed the same catalog rows at the
#: same moment (two deploys applying at once: GRANT ON DATABASE and CREATE ROLE race).
APPLY_TRIES = 5


def _catalog_race(exc: psycopg.Error) -> bool:
    return (isinstance(exc, psycopg.errors.UniqueViolation | psycopg.errors.DuplicateObject)
            or (exc.sqlstate == "XX000" and "concurrently" in str(exc)))


def apply(conn: psycopg.Connection[Any], stmts: list[Statement]) -> None:
    """Run ``stmts`` in one transaction; again, after a short pause, when it lost a race for
    a catalog row to another session applying at the same time (PostgreSQL answers that with
    "tuple concurrently updated" rather than waiting)."""
    for attempt in range(1, APPLY_TRIES + 1):
        try:
            with conn.transaction():
                for st in stmts:
                    conn.execute(st.query, prepare=False)
            return
        except psycopg.Error as exc:
            if attempt == APPLY_TRIES or not _catalog_race(exc):
                raise
            time.sleep(random.uniform(0.05, 0.2) * attempt)


# -- the command ---------------------------------------------------------------------------
def cmd_roles(args: argparse.Namespace) -> dict[str, Any]:
    """Print (or --apply) the SQL of least-privilege roles: owner, worker, publisher, operator,
    read-only. Idempotent; run it again after every migration."""
    from ...store.database import connect

    roles = role_names(args.prefix)
    with connect(args_dsn(args), prepare=False) as conn:
        cat = read_catalog(conn, args.schema)
        stmts = statements(cat, args.schema, args.prefix)
        script = as_text(stmts, conn)
        if args.apply:
            apply(conn, stmts)
    return {"schema": args.schema, "database": cat.database, "roles": roles,
            "schema_exists": cat.schema_owner is not None, "applied": bool(args.apply),
            "sql": script}


def _render(result: dict[str, Any]) -> str:
    head = ["-- pgjobs roles for schema "
            f"{result['schema']} in database {result['database']}"
            + (" (applied)" if result["applied"] else " (not applied: --apply runs it)")]
    if not result["schema_exists"]:
        head.append("-- the schema does not exist yet: after `pgjobs migrate` (as the owner), "
                    "run this again for the grants on its tables")
    return "\n".join([*head, result["sql"]])


def register(sub: Any, common: argparse.ArgumentParser,
             add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``roles`` to the ``pgjobs`` command line (called by cli.build_parser)."""
    p = add(sub, "roles", cmd_roles, _render, common)
    p.add_argument("--prefix", default="pgjobs",
                   help="role names are PREFIX_owner, _worker, _publisher, _operator, _readonly "
                        "(default pgjobs)")
    p.add_argument("--apply", action="store_true",
                   help="run the SQL (one transaction) instead of only printing it; needs a "
                        "superuser, or CREATEROLE and the schema's owner")
