"""Least-privilege roles (``pgjobs roles``), each component run as its role against real
Postgres: the owner migrates; a real ``celery worker`` runs as the worker role; a Celery app
publishes (delay, countdown, ``kombu_pgjobs.batch()``) as the publisher role; the CLI's writes
run as the operator role; the dashboard serves every page as the read-only role, which cannot
read a webhook secret; a role with CONNECT only reads nothing.

Each test makes its own roles (``pgjr_<random>_*``, NOLOGIN groups from ``pgjobs roles`` plus
a LOGIN role per component, trust authentication) and drops them afterwards.
"""

from __future__ import annotations

import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql

import kombu_pgjobs
from kombu_pgjobs.broker.backend import release_all
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.ops.cli.roles import KINDS, _publish_invoker, read_catalog, role_names, statements
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.webhooks import WebhookStore

from .conftest import DSN, broker_url, import_app, wait_for
from .test_cli import claim, in_future, kill_dead, publish

#: an endpoint's signing secret: the read-only role must never read it
SECRET = "roles-test-secret-0123456789"
#: components and the group role each login role is a member of
LOGINS = {"mig": "owner", "w": "worker", "pub": "publisher", "op": "operator",
          "ro": "readonly", "out": None}


def url_as(role: str) -> str:
    """The test server's pgjobs:// URL, logged in as ``role`` (trust authentication)."""
    return re.sub(r"^pgjobs://[^@]*@", f"pgjobs://{role}@", broker_url())


def dsn_as(role: str) -> str:
    return psycopg.conninfo.make_conninfo(DSN, user=role, password="")


@dataclass
class RoleSet:
    prefix: str
    schema: str
    groups: dict[str, str]  # kind -> NOLOGIN group role
    logins: dict[str, str]  # component -> LOGIN role

    def url(self, component: str) -> str:
        return url_as(self.logins[component])

    def connect(self, component: str) -> psycopg.Connection[Any]:
        return psycopg.connect(dsn_as(self.logins[component]), autocommit=True)


def _cli(capsys: Any, *argv: str) -> tuple[int, Any]:
    capsys.readouterr()
    code = cli([*argv, "--json"])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else None


def _apply_roles(capsys: Any, schema: str, prefix: str) -> dict[str, Any]:
    code, out = _cli(capsys, "roles", "--apply", "--dsn", broker_url(), "--schema", schema,
                     "--prefix", prefix)
    assert code == 0, out
    assert out["applied"] is True
    return out


def _acls(db: psycopg.Connection[Any], schema: str) -> list[Any]:
    """Every owner and privilege on the schema's objects, to compare two runs."""
    return db.execute(
        """SELECT c.relname, pg_get_userbyid(c.relowner), c.relacl::text,
                  (SELECT array_agg(a.attname || '=' || a.attacl::text ORDER BY a.attnum)
                     FROM pg_attribute AS a WHERE a.attrelid = c.oid AND a.attacl IS NOT NULL)
             FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
            WHERE n.nspname = %s ORDER BY 1""", (schema,)).fetchall() + db.execute(
        """SELECT p.proname, pg_get_userbyid(p.proowner), p.proacl::text, NULL
             FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
            WHERE n.nspname = %s ORDER BY 1""", (schema,)).fetchall()


def _drop_roles(db: psycopg.Connection[Any], names: list[str]) -> None:
    present = [r[0] for r in db.execute("SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)",
                                        (names,))]
    if not present:
        return
    # this test's own sessions (the pools of the publisher, the dashboard, a worker's leftovers)
    db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
               "WHERE usename = ANY(%s) AND pid <> pg_backend_pid()", (present,))
    for attempt in range(5):  # another test's GRANT ON DATABASE may race for the same row
        try:
            with db.transaction():
                for name in present:
                    db.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
                for name in present:
                    db.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
            return
        except psycopg.errors.InternalError_ as exc:
            if attempt == 4 or "concurrently" not in str(exc):
                raise
            time.sleep(0.1 * (attempt + 1))


@pytest.fixture
def roles(db: psycopg.Connection[Any], schema: str, capsys: Any) -> Iterator[RoleSet]:
    """The roles of a fresh schema: ``pgjobs roles --apply`` before the schema exists (it
    creates the schema, owned by the owner role), ``pgjobs migrate`` as the owner's login,
    the e2e recorder's tables, ``pgjobs roles --apply`` again for the grants on the tables."""
    prefix = f"pgjr_{uuid.uuid4().hex[:8]}"
    groups = role_names(prefix)
    logins = {c: f"{prefix}_{c}_login" for c in LOGINS}
    try:
        first = _apply_roles(capsys, schema, prefix)
        assert first["schema_exists"] is False
        for component, kind in LOGINS.items():
            role = sql.Identifier(logins[component])
            db.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
            if kind is not None:
                db.execute(sql.SQL("GRANT {} TO {}").format(sql.Identifier(groups[kind]), role))
        # the owner's login acts as the owner role, so what it creates is the owner's
        db.execute(sql.SQL("ALTER ROLE {} SET role = {}").format(
            sql.Identifier(logins["mig"]), sql.Literal(groups["owner"])))
        code, out = _cli(capsys, "migrate", "--dsn", url_as(logins["mig"]), "--schema", schema)
        assert code == 0, out
        assert out["applied"], out
        db.execute(f'CREATE TABLE "{schema}".pgjobs_test_run (label text, pid int, '
                   "started timestamptz, finished timestamptz)")
        db.execute(f'CREATE TABLE "{schema}".pgjobs_test_start (label text, pid int, '
                   "at timestamptz DEFAULT clock_timestamp())")
        _apply_roles(capsys, schema, prefix)
        yield RoleSet(prefix, schema, groups, logins)
    finally:
        release_all()
        db.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        _drop_roles(db, [*logins.values(), *groups.values()])


def _runs(db: psycopg.Connection[Any], schema: str) -> dict[str, int]:
    return dict(db.execute(
        f'SELECT label, count(*) FROM "{schema}".pgjobs_test_run GROUP BY label').fetchall())


def _denied(conn: psycopg.Connection[Any], query: str, params: Any = None) -> None:
    with pytest.raises(errors.InsufficientPrivilege):
        conn.execute(query, params)


# -- the SQL -----------------------------------------------------------------------------------
def test_roles_sql_prints_quoted_idempotent_and_converges(db, schema, capsys):
    prefix = f"pgjr_{uuid.uuid4().hex[:8]}"
    names = list(role_names(prefix).values())
    try:
        # printed, nothing applied: the schema does not exist and no role was made
        code, out = _cli(capsys, "roles", "--dsn", broker_url(), "--schema", schema,
                         "--prefix", prefix)
        assert code == 0, out
        assert out["applied"] is False and out["schema_exists"] is False
        assert out["roles"] == {k: f"{prefix}_{k}" for k in KINDS}
        assert f'CREATE SCHEMA IF NOT EXISTS "{schema}" AUTHORIZATION "{prefix}_owner"' \
            in out["sql"]
        assert db.execute("SELECT count(*) FROM pg_roles WHERE rolname = ANY(%s)",
                          (names,)).fetchone()[0] == 0
        # text output is the same script, runnable by psql
        assert cli(["roles", "--dsn", broker_url(), "--schema", schema, "--prefix",
                    prefix]) == 0
        assert out["sql"] in capsys.readouterr().out
        # a bad prefix is refused with a code, before any connection
        code, out = _cli(capsys, "roles", "--dsn", broker_url(), "--schema", schema,
                         "--prefix", 'x"; DROP ROLE postgres; --')
        assert code == 2 and out["error"]["code"] == "PGJ-405", out

        # an existing schema installed by someone else (the superuser): re-owned and granted
        from kombu_pgjobs.store.schema import migrate

        migrate(db, schema)
        _apply_roles(capsys, schema, prefix)
        owners = {r[0] for r in db.execute(
            """SELECT pg_get_userbyid(c.relowner) FROM pg_class AS c
                 JOIN pg_namespace AS n ON n.oid = c.relnamespace WHERE n.nspname = %s
               UNION SELECT pg_get_userbyid(p.proowner) FROM pg_proc AS p
                 JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s
               UNION SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = %s""",
            (schema, schema, schema))}
        assert owners == {f"{prefix}_owner"}
        before = _acls(db, schema)
        again = _apply_roles(capsys, schema, prefix)
        assert _acls(db, schema) == before, "a second run changes nothing"
        assert "OWNER TO" not in again["sql"], "nothing left to re-own"
        # a right granted by hand beyond the policy is taken back (the SQL converges)
        db.execute(sql.SQL("GRANT SELECT ({}) ON {} TO {}").format(
            sql.Identifier("secret"), sql.Identifier(schema, "pgjobs_webhook_endpoint"),
            sql.Identifier(f"{prefix}_readonly")))
        db.execute(sql.SQL("GRANT TRUNCATE ON {} TO {}").format(
            sql.Identifier(schema, "pgjobs_job"), sql.Identifier(f"{prefix}_worker")))
        _apply_roles(capsys, schema, prefix)
        assert _acls(db, schema) == before
        # the statements compose with any schema name pgjobs accepts, quoted
        cat = read_catalog(db, schema)
        text = "\n".join(s.query.as_string(db) for s in statements(cat, schema, prefix))
        assert f'"{schema}"."pgjobs_job"' in text
    finally:
        db.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        _drop_roles(db, names)


def test_outsider_with_connect_only_reads_nothing(roles, db):
    schema = roles.schema
    tables = [r[0] for r in db.execute(
        "SELECT c.relname FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind IN ('r', 'S') ORDER BY 1", (schema,))]
    assert {"pgjobs_job", "pgjobs_dead_letter", "pgjobs_webhook_endpoint"} <= set(tables)
    functions = [r[0] for r in db.execute(
        "SELECT p.oid::int FROM pg_proc AS p "
        "JOIN pg_namespace AS n ON n.oid = p.pronamespace WHERE n.nspname = %s", (schema,))]
    with roles.connect("out") as out:
        for table in tables:
            _denied(out, sql.SQL("SELECT * FROM {}").format(sql.Identifier(schema, table)))
        _denied(out, sql.SQL("INSERT INTO {} (queue, message) VALUES ('q', '{{}}')").format(
            sql.Identifier(schema, "pgjobs_job")))
        for function in functions:  # no USAGE on the schema, no EXECUTE for PUBLIC
            assert not out.execute("SELECT has_function_privilege(%s::oid, 'execute')",
                                   (function,)).fetchone()[0], function
        _denied(out, sql.SQL("SELECT {}(1)").format(
            sql.Identifier(schema, "pgjobs_fence_epoch_v1")))
        assert not out.execute("SELECT has_schema_privilege(%s, 'usage')",
                               (schema,)).fetchone()[0]


# -- each component as its role ------------------------------------------------------------
def test_worker_and_publisher_run_as_their_roles(roles, db, start_worker, schema):
    worker = start_worker(name="w", concurrency=2,
                          env={"PGJOBS_TEST_BROKER": roles.url("w")})
    rec = import_app("tests.apps.recorder", schema, roles.url("pub"))
    rec.record.delay("plain")
    rec.record.apply_async(("later",), countdown=2)
    with kombu_pgjobs.batch():
        for i in range(5):
            rec.record.delay(f"batch{i}")
    # the guarded publish (an idempotency key)
    rec.record.apply_async(("keyed",), headers={"x-pgjobs-idempotency-key": "k1"})
    wait_for(lambda: len(_runs(db, schema)) == 8, 60, what="eight tasks run")
    time.sleep(1.0)  # a duplicate would show now
    assert _runs(db, schema) == {"plain": 1, "later": 1, "keyed": 1,
                                 **{f"batch{i}": 1 for i in range(5)}}
    log = worker.output()
    assert "permission denied" not in log.lower() and "InsufficientPrivilege" not in log, \
        log[-4000:]
    # a revoke broadcast sent as the publisher: out at once, its delete of the task's delayed
    # rows refused and logged (PGJ-222), never retried as a lost connection (it hung before)
    done = threading.Event()

    def revoke() -> None:
        rec.app.control.revoke("no-such-task")
        done.set()

    threading.Thread(target=revoke, daemon=True).start()
    assert done.wait(30), "a revoke as the publisher role did not return"
    # the publisher's sessions were its own role's, and so were the worker's
    users = {r[0] for r in db.execute(
        "SELECT DISTINCT usename FROM pg_stat_activity WHERE usename LIKE %s",
        (f"{roles.prefix}%",))}
    assert roles.logins["w"] in users

    # what a publisher cannot do: settle, cancel, reschedule, read dead letters or secrets,
    # pause or unpause, insert a claimed (running) row
    job = f'"{schema}".pgjobs_job'
    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="roles-test:1")
    running = publish(core, db, "other")
    claim(core, db, "other")
    with roles.connect("pub") as pub:
        _denied(pub, f"DELETE FROM {job}")
        _denied(pub, f"UPDATE {job} SET run_at = now()")
        _denied(pub, f'UPDATE "{schema}".pgjobs_queue SET paused = false')
        _denied(pub, f'SELECT * FROM "{schema}".pgjobs_dead_letter')
        _denied(pub, f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint')
        _denied(pub, f"INSERT INTO {job} (queue, message, state, claim) "
                     "VALUES ('celery', '{}', 'running', 1)")
        _denied(pub, f'DELETE FROM "{schema}".pgjobs_slot')
        wake_invoker, guarded_invoker = _publish_invoker(read_catalog(db, schema))
        if not wake_invoker:  # schema version 21: the wake trigger runs as the owner
            _denied(pub, f'SELECT * FROM "{schema}".pgjobs_waiter')
            _denied(pub, f"UPDATE {job} SET state = 'ready' WHERE id = %s", (running,))
        if not wake_invoker and not guarded_invoker:  # no publish reads a message
            _denied(pub, f"SELECT message FROM {job}")
            _denied(pub, f"SELECT * FROM {job}")
    assert db.execute(f"SELECT state FROM {job} WHERE id = %s", (running,)).fetchone() == \
        ("running",)
    # the keeper's VACUUM under the worker role: skipped with a warning before PostgreSQL 17
    # (only the owner may), never an error that stops the keeper
    with roles.connect("w") as w:
        core.vacuum(w)
    assert worker.stop() == 0


def test_operator_cli_writes_as_its_role(roles, db, schema, capsys, monkeypatch):
    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="roles-test:1")
    dead = [kill_dead(core, db, "alpha") for _ in range(3)]
    ready = [publish(core, db, "alpha") for _ in range(3)]
    delayed = publish(core, db, "alpha", eta=in_future())
    running = publish(core, db, "beta")
    claim(core, db, "beta")
    hooks = WebhookStore(db, schema)
    hook = hooks.add("https://example.com/hook", SECRET)
    op = roles.url("op")

    def ok(*argv: str) -> Any:
        code, out = _cli(capsys, *argv, "--dsn", op, "--schema", schema)
        assert code == 0, (argv, out)
        return out

    for argv in (["queues"], ["ls"], ["show", str(ready[0])], ["dead", "ls"],
                 ["dead", "show", str(dead[0])], ["workers"], ["limits"], ["metrics"],
                 ["webhooks", "ls"], ["webhooks", "show", str(hook)], ["schedule", "ls"]):
        ok(*argv)
    assert ok("pause", "alpha")["paused"] is True
    assert ok("resume", "alpha")["paused"] is False
    ok("pause", "gamma", "--create")
    assert [r["id"] for r in ok("dead", "requeue", str(dead[0]))["requeued"]] == [dead[0]]
    assert ok("dead", "purge", str(dead[1]))["purged"] == 1
    assert ok("requeue", str(delayed))["made_due"] == [delayed]
    cancelled = ok("cancel", str(ready[0]), str(running))
    assert cancelled["cancelled"] == [ready[0]] and cancelled["marked"] == [running]
    task_id = db.execute(f"SELECT message -> 'headers' ->> 'id' FROM \"{schema}\".pgjobs_job "
                         "WHERE id = %s", (ready[1],)).fetchone()[0]
    assert ok("cancel", "--task-id", task_id)["cancelled"] == [ready[1]]
    assert ok("purge", "alpha")["purged"] >= 2
    publish(core, db, "delta", eta=in_future())
    publish(core, db, "delta", eta=in_future())
    ok("bulk", "promote", "--queue", "delta", "--limit", "1")
    ok("bulk", "remove", "--queue", "delta")
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE queue = %s',
                      ("delta",)).fetchone()[0] == 0
    ok("prune", "--older-than", "7d")
    monkeypatch.setenv("ROLES_HOOK_SECRET", SECRET)
    added = ok("webhooks", "add", "https://example.com/other", "--secret-env",
               "ROLES_HOOK_SECRET")
    ok("webhooks", "disable", str(added["id"]))
    ok("webhooks", "enable", str(added["id"]))
    ok("schedule", "add", "nightly", "app.report", "every 1h")
    ok("schedule", "pause", "nightly")
    ok("schedule", "resume", "nightly")
    # the writes landed
    assert db.execute(f'SELECT paused FROM "{schema}".pgjobs_queue WHERE name = %s',
                      ("gamma",)).fetchone() == (True,)
    # one left of the three, and the two queued messages cancelled (kept: issue 30)
    assert db.execute(f'SELECT reason, count(*) FROM "{schema}".pgjobs_dead_letter '
                      "GROUP BY reason ORDER BY reason").fetchall() == [("cancelled", 2),
                                                                       ("rejected", 1)]
    assert db.execute(f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint WHERE id = %s',
                      (added["id"],)).fetchone() == (SECRET,)
    # an operator sets a secret but never reads one
    with roles.connect("op") as conn:
        _denied(conn, f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint')
        _denied(conn, f'TRUNCATE "{schema}".pgjobs_job')
        _denied(conn, f'DELETE FROM "{schema}".pgjobs_migration')


def test_dashboard_serves_every_page_read_only_and_never_reads_a_secret(roles, db, schema):
    from starlette.testclient import TestClient

    from kombu_pgjobs.ops.dashboard import create_app
    from kombu_pgjobs.store.scheduling import EntryDef, ScheduleStore

    core = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="roles-test:1")
    dead = kill_dead(core, db, "alpha", error={"type": "ValueError", "message": "boom"})
    ready = publish(core, db, "alpha", tenant="acme")
    publish(core, db, "alpha", eta=in_future())
    claim(core, db, "alpha")
    ScheduleStore(schema).add(db, EntryDef("nightly", "app.report", "every 1h", "UTC", [], {},
                                           {}))
    hook = WebhookStore(db, schema).add("https://example.com/hook", SECRET)
    app: Any = create_app(roles.url("ro"), schema=schema, pool_size=2)
    try:
        with TestClient(app) as c:
            for path in ("/", "/messages", f"/messages/{ready}", "/messages?state=running",
                         "/dead", f"/dead/{dead}", "/limits", "/workers", "/tenants",
                         "/schedules", "/schedules/nightly", "/webhooks", f"/webhooks/{hook}"):
                r = c.get(path)
                assert r.status_code == 200, (path, r.text[-2000:])
                assert SECRET not in r.text
            # read-only mode refuses actions; the role could not perform them anyway
            assert c.post("/queues/alpha/pause", data={"confirm": "yes"}).status_code == 403
            users = {r[0] for r in db.execute(
                "SELECT usename FROM pg_stat_activity WHERE application_name = %s",
                (f"pgjobs-dashboard:{schema}",))}
            assert users == {roles.logins["ro"]}, "the pages were read as the read-only role"
    finally:
        app.state.dashboard.close()
    with roles.connect("ro") as ro:
        _denied(ro, f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint')
        _denied(ro, f'SELECT * FROM "{schema}".pgjobs_webhook_endpoint')
        assert ro.execute(f'SELECT url FROM "{schema}".pgjobs_webhook_endpoint').fetchall() \
            == [("https://example.com/hook",)]
        _denied(ro, f'UPDATE "{schema}".pgjobs_queue SET paused = true')
        _denied(ro, f'DELETE FROM "{schema}".pgjobs_job')
        _denied(ro, f'INSERT INTO "{schema}".pgjobs_job (queue, message) VALUES (%s, %s)',
                ("alpha", "{}"))
        _denied(ro, f'DELETE FROM "{schema}".pgjobs_dead_letter')


def test_every_role_exists_nologin(roles, db):
    rows = dict(db.execute("SELECT rolname, rolcanlogin FROM pg_roles WHERE rolname = ANY(%s)",
                           (list(roles.groups.values()),)).fetchall())
    assert rows == {name: False for name in roles.groups.values()}
