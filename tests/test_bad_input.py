"""Bad input and connection settings (issue 11, items 10-12, 14, 15): every bad value is a coded
error where the mistake is made, nothing is written, nothing is lost; TLS is never dropped;
timeouts turn a locked table into a coded error; a schema newer than the code is refused.

Real Postgres throughout; counts are read back from the database. The kombu-level tests go
through the transport, which calls the validators of kombu_pgjobs.options and passes kombu's
``ssl`` to the conninfo.
"""

from __future__ import annotations

import base64
import json
import math
import socket
import ssl
import threading
import time
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery

import celery_ext
from kombu_pgjobs.errors import (
    DatabaseTimeout,
    DatabaseUnavailable,
    InvalidLimitKey,
    InvalidName,
    InvalidOption,
    InvalidSSL,
    MessageError,
    SchemaTooNew,
)
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.options import (
    QueueArguments,
    TransportOptions,
    queue_arguments,
    validate_exchange_name,
    validate_routing_key,
)
from kombu_pgjobs.store.core import job_from_message
from kombu_pgjobs.store.database import (
    connect,
    conninfo_from_parts,
    conninfo_from_url,
    ssl_parameters,
)
from kombu_pgjobs.store.schema import current_version, latest_version, migrate, migrations

from .conftest import DSN, wait_for


def _deep(n: int) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for _ in range(n):
        d = {"a": d}
    return d


def _jobs(db: psycopg.Connection[Any], schema: str) -> list[str]:
    """Labels (the message body) of the rows in the job table, in insertion order."""
    rows = db.execute(f'SELECT message ->> \'body\' FROM "{schema}".pgjobs_job ORDER BY id')
    return [base64.b64decode(r[0]).decode() for r in rows.fetchall()]


def _table_count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    if not db.execute("SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".{table}',)).fetchone()[0]:
        return 0
    return db.execute(f'SELECT count(*) FROM "{schema}".{table}').fetchone()[0]


def _dsn_parts() -> dict[str, Any]:
    info = psycopg.conninfo.conninfo_to_dict(DSN)
    return {"host": info.get("host", "127.0.0.1"), "port": int(info.get("port", 5432)),
            "user": info.get("user", "postgres"), "password": info.get("password"),
            "dbname": info.get("dbname", "test")}


# -- item 12: non-JSON values refused at publish, before anything is sent ------------------------
HOSTILE = {
    "nan header": {"headers": {"x": math.nan}},
    "infinity deep in a header": {"headers": {"x": [{"y": [1, -math.inf]}]}},
    "nan property": {"props": {"custom": math.nan}},
    "5000-deep header": {"headers": {"x": _deep(5000)}},
    "lone surrogate in a header": {"headers": {"x": "file-\udc80.txt"}},
    "lone high surrogate in a property": {"props": {"custom": "\ud83d"}},
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_job_from_message_refuses_non_json(case: str) -> None:
    spec = HOSTILE[case]
    message = {"body": "b", "headers": spec.get("headers", {}),
               "properties": spec.get("props", {})}
    with pytest.raises(MessageError) as err:
        job_from_message("q", message)
    assert err.value.code == "PGJ-106"


@pytest.mark.parametrize("text", ["\U0001f600 emoji", "\ud55c\uae00 Hangul",
                                  "\\ud800 an escaped backslash, not an escape",
                                  "\ud83d\ude00 a pair given as two code points"])
def test_job_from_message_keeps_valid_text(text: str) -> None:
    job = job_from_message("q", {"body": "b", "headers": {"x": text}, "properties": {}})
    assert json.loads(job.message)["headers"]["x"].encode("utf-16", "surrogatepass") == \
        text.encode("utf-16", "surrogatepass")


@pytest.mark.parametrize("confirm", [True, False], ids=["confirmed", "unconfirmed"])
@pytest.mark.parametrize("case", list(HOSTILE))
def test_non_json_publish_refused_and_the_connection_keeps_working(
        case: str, confirm: bool, url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """Refused before it is sent, so with confirm_publish=False the next valid publish is not
    failed by it: exactly the valid messages are in the table."""
    spec = HOSTILE[case]
    opts = {"schema": schema, "confirm_publish": confirm}
    with kombu.Connection(url, transport_options=opts) as c:
        producer = c.Producer()
        queue = kombu.Queue("hostile", routing_key="hostile")
        producer.publish("before", routing_key="hostile", declare=[queue], serializer="raw")
        with pytest.raises(MessageError) as err:
            producer.publish("bad", routing_key="hostile", serializer="raw",
                             headers=spec.get("headers"), **spec.get("props", {}))
        assert err.value.code == "PGJ-106"
        producer.publish("after", routing_key="hostile", serializer="raw")
        c.default_channel.backend.confirm_publishes()  # raises PublishFailed had one failed
    assert _jobs(db, schema) == ["before", "after"]


def test_nul_in_a_header_is_refused(url: str, schema: str,
                                    db: psycopg.Connection[Any]) -> None:
    """A NUL was stored (valid JSON) and then broke every statement reading the row's headers
    as text (``pgjobs cancel --task-id``): refused at publish since issue 28 (more paths in
    tests/test_trust_inputs.py)."""
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        q = c.SimpleQueue("nul")
        with pytest.raises(MessageError) as err:
            q.put({"a": 1}, headers={"note": "a\u0000b"})
        assert err.value.code == "PGJ-106" and "headers['note']" in str(err.value)
        assert q.qsize() == 0
        q.close()


# -- item 12: a failure whose text jsonb refuses is still dead-lettered, escaped ----------------
@pytest.mark.e2e
def test_failure_text_with_nul_or_lone_surrogate_is_dead_lettered_escaped(
        url: str, recorder_tables: str, db: psycopg.Connection[Any], start_worker: Any) -> None:
    schema = recorder_tables
    app = Celery("hostile-publisher", broker=url)
    app.conf.broker_transport_options = {"schema": schema}
    app.send_task("hostile.fail_nul", args=["n1"])
    app.send_task("hostile.fail_surrogate", args=["s1"])
    worker = start_worker(app="tests.apps.hostile", concurrency=2)

    def dead() -> dict[str, Any]:
        rows = db.execute(f'SELECT task, reason, error FROM "{schema}".pgjobs_dead_letter')
        return {r[0]: (r[1], r[2]) for r in rows.fetchall()}

    try:
        found = wait_for(lambda: len(dead()) == 2 and dead(), 45,
                         what="both failures dead-lettered")
    except AssertionError:
        raise AssertionError(worker.output()[-3000:]) from None
    reason, error = found["hostile.fail_nul"]
    assert reason == "failed"
    assert error["message"] == "bad\\x00byte in n1"  # visible, not a NUL
    assert "bad\\x00byte in n1" in error["traceback"]
    reason, error = found["hostile.fail_surrogate"]
    assert error["message"] == "undecodable \\udc80 file name in s1"
    starts = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_start').fetchone()[0]
    assert starts == 2
    wait_for(lambda: _table_count(db, schema, "pgjobs_job") == 0, 10, what="messages settled")


# -- item 14: names and queue arguments ---------------------------------------------------------
@pytest.mark.parametrize("bad", ["ex\x00change", "ex\nchange", "x" * 201, "lone\udc80", 7])
def test_validate_exchange_name(bad: Any) -> None:
    with pytest.raises(InvalidName) as err:
        validate_exchange_name(bad)
    assert err.value.code == "PGJ-103"


@pytest.mark.parametrize("bad", ["key\x00", "k\x1b[31m", "k" * 256, "\ud800", None])
def test_validate_routing_key(bad: Any) -> None:
    with pytest.raises(InvalidName) as err:
        validate_routing_key(bad)
    assert err.value.code == "PGJ-103"


def test_valid_names_pass_unchanged() -> None:
    assert validate_exchange_name("") == ""
    assert validate_exchange_name("celery.pidbox") == "celery.pidbox"
    assert validate_routing_key("") == ""
    assert validate_routing_key("a.*.#" + "k" * 250) == "a.*.#" + "k" * 250
    assert validate_routing_key("café ünïcode") == "café ünïcode"


@pytest.mark.parametrize("args", [
    {"x-message-ttl": 10**12}, {"x-expires": 2**31}, {"x-max-priority": 10**6},
    {"x-max-priority": 256}, {"x-message-ttl": 0}, {"x-expires": -5}, {"x-expires": "soon"},
    {"x-message-ttl": 1.5}, {"x-max-priority": True}, {"x-message-ttl": math.inf},
])
def test_queue_arguments_range_checked(args: dict[str, Any]) -> None:
    with pytest.raises(InvalidName) as err:
        queue_arguments("q", args)
    assert err.value.code == "PGJ-103"
    assert "'q'" in str(err.value)


def test_queue_arguments_values() -> None:
    assert queue_arguments("q", None) == QueueArguments()
    got = queue_arguments("q", {"x-expires": 60000, "x-message-ttl": 2**31 - 1,
                                "x-max-priority": 10, "x-dead-letter-exchange": "dlx"})
    assert got == QueueArguments(expires_ms=60000, message_ttl_ms=2**31 - 1, max_priority=10)
    with pytest.raises(AttributeError):
        got.expires_ms = 1  # type: ignore[misc]


@pytest.mark.parametrize("args", [{"x-message-ttl": 10**12}, {"x-max-priority": 10**6}])
def test_queue_declare_with_overflowing_argument_refused(args: dict[str, Any], url: str,
                                                         schema: str,
                                                         db: psycopg.Connection[Any]) -> None:
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        with pytest.raises(InvalidName):
            c.default_channel.queue_declare("q", arguments=args)
    assert _table_count(db, schema, "pgjobs_queue") == 0


@pytest.mark.parametrize("exchange,key", [("ex\x00", "k"), ("ex", "k\x00"), ("ex", "k" * 300),
                                          ("x" * 201, "k")])
def test_bad_exchange_or_routing_key_refused_before_the_queue_row(
        exchange: str, key: str, url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        queue = kombu.Queue("named", kombu.Exchange(exchange, type="direct"), routing_key=key)
        with pytest.raises(InvalidName):
            queue(c.default_channel).declare()
    if exchange == "ex":  # kombu declares the queue before it binds it: only the key is late
        assert _table_count(db, schema, "pgjobs_binding") == 0
    else:  # a bad exchange is refused at exchange_declare, before the queue
        assert _table_count(db, schema, "pgjobs_queue") == 0
        assert _table_count(db, schema, "pgjobs_binding") == 0


def test_publish_to_bad_exchange_name_refused(url: str, schema: str,
                                              db: psycopg.Connection[Any]) -> None:
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        with pytest.raises(InvalidName):
            c.Producer().publish("x", exchange="ex\x00", routing_key="k", serializer="raw")
    assert _table_count(db, schema, "pgjobs_job") == 0


@pytest.mark.parametrize("name", ["pg_catalog", "pg_toast", "pg_jobs", "information_schema"])
def test_reserved_schema_names_refused(name: str, url: str, db: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidName) as err:
        TransportOptions.parse({"schema": name})
    assert err.value.code == "PGJ-103"
    tables = db.execute("SELECT count(*) FROM pg_class c JOIN pg_namespace n ON "
                        "n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname LIKE "
                        "'pgjobs%%'", (name,)).fetchone()[0]
    assert tables == 0


@pytest.mark.parametrize("extra,hint", [
    ({"connect_timeout": "5"}, "'connect_timeout' transport option"),
    ({"application_name": "mine"}, "'application_name' transport option"),
    ({"host": "elsewhere"}, "URL"),
    ({"port": "6432"}, "URL"),
    ({"user": "someone_else"}, "broker URL"),
])
def test_connect_options_colliding_with_url_or_own_settings_refused(
        extra: dict[str, str], hint: str, url: str, schema: str,
        db: psycopg.Connection[Any]) -> None:
    """A worker used to die with an uncoded TypeError (a keyword given twice)."""
    with kombu.Connection(url, transport_options={"schema": schema,
                                                  "connect_options": extra}) as c:
        with pytest.raises(InvalidOption) as err:
            c.connect()
    assert err.value.code == "PGJ-102"
    assert hint in str(err.value)
    assert _table_count(db, schema, "pgjobs_migration") == 0


def test_connect_options_fill_what_the_url_leaves_out(url: str, schema: str,
                                                      db: psycopg.Connection[Any]) -> None:
    """A password kept out of the URL (the test server trusts, so any password connects)."""
    parts = _dsn_parts()
    info = conninfo_from_parts(host=parts["host"], port=parts["port"], user=None, password=None,
                               dbname=None, options=TransportOptions(connect_options={
                                   "user": parts["user"], "password": "from-options",
                                   "dbname": parts["dbname"]}))
    got = psycopg.conninfo.conninfo_to_dict(info)
    assert (got["user"], got["password"], got["dbname"]) == (
        parts["user"], "from-options", parts["dbname"])
    with kombu.Connection(url, transport_options={
            "schema": schema, "connect_options": {"password": "from-options"}}) as c:
        c.SimpleQueue("merged").put({"a": 1})
    assert _table_count(db, schema, "pgjobs_job") == 1


def test_key_function_raising_anything_is_invalid_limit_key(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    app = Celery("keyfn", broker=url)
    celery_ext.install(app)
    app.conf.broker_transport_options = {"schema": schema}

    def key(account: Any) -> str:
        return str(int(account))  # ValueError on "abc", which celery_ext did not catch

    @app.task(name="keyed", concurrency_key=key, shared=False)
    def keyed(account: Any) -> None:
        pass

    for bad in ("abc", {"nested": 1}):
        with pytest.raises(InvalidLimitKey) as err:
            keyed.delay(bad)
        assert err.value.code == "PGJ-303"
        assert "keyed" in str(err.value)
    assert _table_count(db, schema, "pgjobs_job") == 0


# -- item 11: TLS is mapped to libpq, or refused ------------------------------------------------
@pytest.mark.parametrize("given,expected", [
    (None, {}), (False, {}), ({}, {}), ("false", {}),
    (True, {"sslmode": "require"}), ("true", {"sslmode": "require"}),
    ("verify-full", {"sslmode": "verify-full"}),
    ({"sslmode": "verify-ca", "sslrootcert": "/ca.pem"},
     {"sslmode": "verify-ca", "sslrootcert": "/ca.pem"}),
    ({"ssl_cert_reqs": ssl.CERT_NONE}, {"sslmode": "require"}),
    ({"ssl_cert_reqs": "required", "ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem",
      "ssl_keyfile": "/k.pem"},
     {"sslmode": "verify-full", "sslrootcert": "/ca.pem", "sslcert": "/c.pem",
      "sslkey": "/k.pem"}),
    ({"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": "/ca.pem", "check_hostname": False},
     {"sslmode": "verify-ca", "sslrootcert": "/ca.pem"}),
    ({"cert_reqs": ssl.CERT_REQUIRED}, {"sslmode": "verify-full", "sslrootcert": "system"}),
    ({"keyfile": "/k.pem", "certfile": "/c.pem", "cert_reqs": "CERT_NONE"},
     {"sslmode": "require", "sslkey": "/k.pem", "sslcert": "/c.pem"}),
])
def test_ssl_settings_map_to_libpq(given: Any, expected: dict[str, str]) -> None:
    assert ssl_parameters(given) == expected


@pytest.mark.parametrize("given", [
    "sometimes", 3, ssl.create_default_context(), {"ciphers": "HIGH"},
    {"server_hostname": "db.example"}, {"cert_reqs": 7}, {"ssl_cert_reqs": True},
    {"sslmode": "always"}, {"sslmode": "require", "cert_reqs": ssl.CERT_NONE},
])
def test_unmappable_ssl_settings_refused(given: Any) -> None:
    with pytest.raises(InvalidSSL) as err:
        ssl_parameters(given)
    assert err.value.code == "PGJ-109"


def test_ssl_conflicting_with_connect_options_refused() -> None:
    parts = _dsn_parts()
    with pytest.raises(InvalidSSL):
        conninfo_from_parts(**parts, options=TransportOptions(
            connect_options={"sslmode": "disable"}), ssl=True)


def test_sslmode_require_reaches_libpq(db: psycopg.Connection[Any], schema: str) -> None:
    """The test server runs without TLS: a connection that asks for TLS must fail, which
    proves the setting was passed through rather than dropped."""
    assert db.execute("SHOW ssl").fetchone()[0] == "off", "the test needs a server without TLS"
    parts = _dsn_parts()
    opts = TransportOptions(schema=schema, connect_timeout=2)
    connect(conninfo_from_parts(**parts, options=opts)).close()
    for tls in (True, "require", {"ssl_cert_reqs": ssl.CERT_NONE}):
        with pytest.raises(DatabaseUnavailable) as err:
            connect(conninfo_from_parts(**parts, options=opts, ssl=tls))
        assert "ssl" in str(err.value).lower() or "tls" in str(err.value).lower()
    with pytest.raises(DatabaseUnavailable):
        connect(conninfo_from_url(f"{_url(parts)}?ssl=true", opts))
    with pytest.raises(DatabaseUnavailable):
        connect(conninfo_from_url(f"{_url(parts)}?sslmode=require", opts))


def _url(parts: dict[str, Any]) -> str:
    pw = f":{parts['password']}" if parts["password"] else ""
    return f"pgjobs://{parts['user']}{pw}@{parts['host']}:{parts['port']}/{parts['dbname']}"


def test_cli_takes_tls_from_the_url_and_refuses_other_query_parameters(
        schema: str, db: psycopg.Connection[Any], capsys: Any) -> None:
    url = _url(_dsn_parts())
    assert cli(["migrate", "--dsn", f"{url}?ssl=true", "--schema", schema, "--json"]) == 3
    out = capsys.readouterr().out
    assert "PGJ-104" in out and "ssl" in out.lower()
    assert cli(["migrate", "--dsn", f"{url}?application_name=x", "--schema", schema]) == 2
    assert _table_count(db, schema, "pgjobs_migration") == 0


@pytest.mark.parametrize("how", ["url", "argument"])
def test_kombu_ssl_is_not_dropped(how: str, url: str, schema: str,
                                  db: psycopg.Connection[Any]) -> None:
    opts = {"schema": schema, "connect_timeout": 2}
    conn = (kombu.Connection(f"{url}?ssl=true", transport_options=opts) if how == "url"
            else kombu.Connection(url, ssl=True, transport_options=opts))
    with conn as c:
        with pytest.raises((DatabaseUnavailable, kombu.exceptions.OperationalError)):
            c.ensure_connection(max_retries=1)
    assert _table_count(db, schema, "pgjobs_migration") == 0


def test_kombu_unmappable_ssl_refused(url: str, schema: str) -> None:
    with kombu.Connection(url, ssl={"ciphers": "HIGH"},
                          transport_options={"schema": schema}) as c:
        with pytest.raises(InvalidSSL):
            c.connect()


# -- item 10: timeouts and keepalives -----------------------------------------------------------
def test_publish_into_locked_table_fails_within_lock_timeout(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    with kombu.Connection(url, transport_options={"schema": schema, "lock_timeout": 1}) as c:
        q = c.SimpleQueue("locked")
        q.put("first", serializer="raw")
        holder = psycopg.connect(DSN)
        holder.execute(f'LOCK TABLE "{schema}".pgjobs_job IN ACCESS EXCLUSIVE MODE')
        release = threading.Timer(8.0, holder.rollback)  # bounds the test before the fix
        release.start()
        try:
            start = time.monotonic()
            with pytest.raises(DatabaseTimeout) as err:
                q.put("blocked", serializer="raw")
            took = time.monotonic() - start
        finally:
            release.cancel()
            holder.rollback()
            holder.close()
        assert err.value.code == "PGJ-108"
        assert "lock_timeout" in str(err.value)
        assert took < 5.0, f"a lock_timeout of 1 s took {took:.1f} s"
        # a kombu channel error, not a connection error: Celery must not reconnect over it
        assert isinstance(err.value, c.channel_errors)
        assert not isinstance(err.value, c.connection_errors)
        q.put("after", serializer="raw")  # the same connection still works
        q.close()
    assert _jobs(db, schema) == ["first", "after"]


def test_timeouts_are_set_per_connection(url: str, schema: str) -> None:
    def show(opts: dict[str, Any]) -> tuple[str, str]:
        with kombu.Connection(url, transport_options={"schema": schema, **opts}) as c:
            c.connect()
            backend = c.default_channel.backend
            return backend.publishing(lambda conn: tuple(
                conn.execute(f"SHOW {name}").fetchone()[0]
                for name in ("lock_timeout", "statement_timeout")))

    assert show({}) == ("10s", "1min")
    assert show({"lock_timeout": 2.5, "statement_timeout": 30}) == ("2500ms", "30s")
    assert show({"lock_timeout": 0, "statement_timeout": 0}) == ("0", "0")
    # an explicit -c of the caller's own comes after pgjobs's and wins
    assert show({"connect_options": {"options": "-c lock_timeout=300"}}) == ("300ms", "1min")


def test_timeout_option_values_validated() -> None:
    for bad in ({"lock_timeout": -1}, {"statement_timeout": math.nan},
                {"statement_timeout": "long"}, {"lock_timeout": 10**6}):
        with pytest.raises(InvalidOption):
            TransportOptions.parse(bad)


def test_migration_and_statements_under_a_tiny_statement_timeout(
        schema: str, db: psycopg.Connection[Any]) -> None:
    """A migration lifts the timeouts (it must never be cut short); an ordinary statement
    that runs past statement_timeout is a coded DatabaseTimeout."""
    parts = _dsn_parts()
    opts = TransportOptions(schema=schema, statement_timeout=0.001, lock_timeout=0.001)
    with connect(conninfo_from_parts(**parts, options=opts)) as conn:
        assert migrate(conn, schema) == [m.version for m in migrations()]
        with pytest.raises(DatabaseTimeout) as err:
            conn.execute("SELECT pg_sleep(0.2)")
        assert "statement_timeout" in str(err.value)
        assert conn.execute("SELECT 1").fetchone() == (1,)  # still usable
    assert current_version(db, schema) == latest_version()


def test_tcp_keepalives_on_by_default_and_overridable() -> None:
    parts = _dsn_parts()
    if parts["host"].startswith("/"):
        pytest.skip("keepalives apply to TCP connections")
    for extra, idle in (({}, 30), ({"keepalives_idle": "7"}, 7)):
        opts = TransportOptions(connect_options=extra)
        with connect(conninfo_from_parts(**parts, options=opts)) as conn:
            sock = socket.socket(fileno=conn.pgconn.socket)
            try:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
            finally:
                sock.detach()


# -- item 15: a schema newer than the code ------------------------------------------------------
def test_schema_newer_than_the_code_is_refused(url: str, schema: str,
                                               db: psycopg.Connection[Any],
                                               capsys: Any) -> None:
    migrate(db, schema)
    db.execute(f'INSERT INTO "{schema}".pgjobs_migration (version, name) VALUES (99, %s)',
               ("from_the_future",))
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        with pytest.raises(SchemaTooNew) as err:
            c.connect()
    assert err.value.code == "PGJ-702"
    assert "99" in str(err.value)
    capsys.readouterr()
    code = cli(["migrate", "--dsn", url, "--schema", schema, "--json"])
    out = capsys.readouterr().out
    assert code != 0 and "PGJ-702" in out, out
    with pytest.raises(SchemaTooNew):
        migrate(db, schema)
    assert current_version(db, schema, allow_newer=True) == 99
    versions = [r[0] for r in db.execute(
        f'SELECT version FROM "{schema}".pgjobs_migration ORDER BY version').fetchall()]
    assert versions == [*(m.version for m in migrations()), 99]
