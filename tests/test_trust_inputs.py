"""Issue 28, items 5-7: secrets off argv and out of errors, bounded input, NUL and the
remaining uncoded errors.

Each bad input is refused with a coded error on every publish path (immediate, delayed,
``batch()``, the outbox both ways, ``confirm_publish=False``) and nothing is written; a
password never shows in an error, whatever characters it holds. Real PostgreSQL throughout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kombu
import psycopg
import pytest
from celery import Celery

import kombu_pgjobs
from kombu_pgjobs.broker import outbox
from kombu_pgjobs.errors import (
    InvalidIdempotencyKey,
    InvalidLimitKey,
    InvalidOption,
    InvalidTenant,
    InvalidURL,
    MessageError,
    MessageTooLarge,
    PgJobsError,
)
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.options import DEFAULT_MAX_MESSAGE_BYTES, TransportOptions
from kombu_pgjobs.store.database import conninfo_from_url
from kombu_pgjobs.store.schema import migrate
from kombu_pgjobs.url import masked
from kombu_pgjobs.url import parse as parse_url

from .conftest import DSN, ROOT, broker_url, wait_for


def _count(db: psycopg.Connection[Any], schema: str, table: str) -> int:
    if not db.execute("SELECT to_regclass(%s) IS NOT NULL",
                      (f'"{schema}".{table}',)).fetchone()[0]:
        return 0
    return int(db.execute(f'SELECT count(*) FROM "{schema}".{table}').fetchone()[0])


# -- item 5: no fragment of a password in any error ---------------------------------------------
PIECES = ("Qz7x", "Wk9v", "Jm4p", "Rt2y")


def _leaks(text: str) -> list[str]:
    return [p for p in PIECES if p in text]


#: passwords whose unescaped characters end the URL's host part early (today url.py and
#: kombu's parser quoted the part before the character as a host or port)
BAD_PASSWORDS = {
    "slash": "Qz7x/Wk9v",
    "question": "Qz7x?Wk9v",
    "hash": "Qz7x#Wk9v",
    "all": "Qz7x/Wk9v?Jm4p#Rt2y",
    "digits before a slash": "Qz7x1234/Wk9v",
    "fullwidth solidus (NFKC)": "Qz7x\uff0fWk9v",
}


@pytest.mark.parametrize("scheme", ["pgjobs", "postgresql"])
@pytest.mark.parametrize("case", list(BAD_PASSWORDS))
def test_url_errors_never_quote_a_password(case: str, scheme: str) -> None:
    password = BAD_PASSWORDS[case]
    for url in (f"{scheme}://app:{password}@db.example:5432/jobs",
                f"{scheme}://app:{password}@db1:5432,db2/jobs",
                f"{scheme}://:{password}@db.example/jobs"):
        with pytest.raises(InvalidURL) as err:
            parse_url(url)
        assert err.value.code == "PGJ-101"
        assert _leaks(str(err.value)) == [], str(err.value)
        with pytest.raises(InvalidURL) as err:
            conninfo_from_url(url, TransportOptions())
        assert _leaks(str(err.value)) == [], str(err.value)
        assert _leaks(masked(url)) == [], masked(url)


# Not the NFKC case: kombu.Connection() runs urllib's urlparse on the URL itself before any
# transport code, and urllib's ValueError quotes the netloc (kombu's to fix, for every scheme).
@pytest.mark.parametrize("case", [c for c in BAD_PASSWORDS if "NFKC" not in c])
def test_kombu_and_celery_refuse_such_a_url_without_quoting_it(case: str) -> None:
    url = f"pgjobs://app:{BAD_PASSWORDS[case]}@127.0.0.1:5432/test"
    with pytest.raises(InvalidURL) as err:
        kombu.Connection(url).connect()
    assert err.value.code == "PGJ-101"
    assert _leaks(str(err.value)) == [], str(err.value)
    app = Celery("leak", broker=url, set_as_current=False)  # never the later tests' app
    with pytest.raises(InvalidURL) as err:
        app.send_task("t")
    assert _leaks(str(err.value)) == [], str(err.value)


@pytest.mark.parametrize("case", list(BAD_PASSWORDS))
@pytest.mark.parametrize("where", ["argv", "env"])
def test_cli_error_holds_no_fragment_of_the_password(where: str, case: str,
                                                     capsys: Any, monkeypatch: Any) -> None:
    url = f"postgresql://app:{BAD_PASSWORDS[case]}@127.0.0.1:5432/test"
    argv = ["queues", "--json"]
    if where == "argv":
        argv += ["--dsn", url]
    else:
        for var in ("CELERY_BROKER_URL", "BROKER_URL"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("PGJOBS_DSN", url)
    assert cli(argv) == 2
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "PGJ-101"
    assert _leaks(out + err) == [], out + err


def test_masked_hides_every_form_of_password() -> None:
    for url, shown in [
        ("pgjobs://app:Qz7x/Wk9v@db/x", "pgjobs://app:**@db/x"),
        ("pgjobs://app:Qz7x@Wk9v@db:5432/x", "pgjobs://app:**@db:5432/x"),
        ("pgjobs://app@db/x?sslmode=require&password=Qz7x", "pgjobs://app@db/x?sslmode=require"
                                                             "&password=**"),
        ("app:Qz7x@db/x", "**@db/x"),
        ("pgjobs://app@db/x", "pgjobs://app@db/x"),
    ]:
        assert masked(url) == shown, url


def test_not_a_url_is_not_echoed() -> None:
    with pytest.raises(InvalidURL) as err:
        parse_url("app:Qz7xWk9v-db.example-5432")
    assert "Qz7x" not in str(err.value)


def test_connect_options_are_not_in_the_options_repr() -> None:
    opts = TransportOptions.parse({"connect_options": {"password": "Qz7xWk9v"}})
    assert "Qz7x" not in repr(opts)


# -- item 5: the relay takes its secrets from the environment or a file --------------------------
@pytest.fixture
def app_schema(db: psycopg.Connection[Any], schema: str) -> Iterator[tuple[str, str]]:
    """The app's outbox schema (the test's) and the broker's schema (another one), both in
    the test database: the relay publishes from one to the other through pgjobs://."""
    broker_schema = f"pgjt_{uuid.uuid4().hex[:12]}"
    migrate(db, schema)
    yield schema, broker_schema
    kombu_pgjobs.broker.backend.release_all()
    db.execute(f'DROP SCHEMA IF EXISTS "{broker_schema}" CASCADE')


def _stage_one(dsn: str, schema: str, label: str) -> None:
    with psycopg.connect(dsn) as conn, conn.transaction(), \
            outbox.transaction(conn, schema=schema):
        with kombu.Connection("memory://") as mem:
            outbox.publish(mem.Producer(), label, routing_key="relayed", serializer="raw")


def _relayed(db: psycopg.Connection[Any], schema: str) -> int:
    return _count(db, schema, "pgjobs_job")


@pytest.mark.parametrize("how", ["env", "file", "file-env"])
def test_relay_takes_the_broker_and_dsn_from_env_or_file(
        how: str, app_schema: tuple[str, str], db: psycopg.Connection[Any],
        tmp_path: Path) -> None:
    schema, broker_schema = app_schema
    broker = broker_url()
    broker_file, dsn_file = tmp_path / "broker", tmp_path / "dsn"
    broker_file.write_text(broker + "\n")
    dsn_file.write_text(DSN + "\n")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PGJOBS_DSN", "CELERY_BROKER_URL", "BROKER_URL")}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "kombu_pgjobs.ops.cli", "relay", "--schema", schema,
           "--poll-interval", "0.2", "--transport-options",
           json.dumps({"schema": broker_schema})]
    if how == "env":
        env["PGJOBS_RELAY_BROKER"], env["PGJOBS_DSN"] = broker, DSN
    elif how == "file":
        cmd += ["--broker-file", str(broker_file), "--dsn-file", str(dsn_file)]
    else:
        env["PGJOBS_RELAY_BROKER_FILE"], env["PGJOBS_DSN_FILE"] = str(broker_file), str(dsn_file)
    _stage_one(DSN, schema, "one")
    log = tmp_path / "relay.log"
    with open(log, "wb") as fh:
        relay = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    try:
        argv = Path(f"/proc/{relay.pid}/cmdline").read_bytes().decode()
        assert "://" not in argv, "no URL on the relay's command line"
        try:
            wait_for(lambda: _relayed(db, broker_schema) == 1, 30, what="the row relayed")
        except AssertionError:
            raise AssertionError(log.read_text()) from None
    finally:
        relay.terminate()
        relay.wait(30)


def test_relay_without_a_broker_or_with_an_unreadable_file_is_a_coded_error(
        app_schema: tuple[str, str], capsys: Any, monkeypatch: Any, tmp_path: Path) -> None:
    schema, _ = app_schema
    for var in ("PGJOBS_RELAY_BROKER", "PGJOBS_RELAY_BROKER_FILE"):
        monkeypatch.delenv(var, raising=False)
    common = ["--dsn", DSN, "--schema", schema, "--json"]
    assert cli(["relay", *common]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-100"
    assert cli(["relay", "--broker-file", str(tmp_path / "missing"), *common]) == 2
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["code"] == "PGJ-100" and "missing" in error["message"]
    two = tmp_path / "two-lines"
    two.write_text("redis://:Qz7xWk9v@cache/0\nsecond line\n")
    assert cli(["relay", "--broker-file", str(two), *common]) == 2
    out = capsys.readouterr().out
    assert json.loads(out)["error"]["code"] == "PGJ-100" and "Qz7x" not in out


@pytest.mark.parametrize("text,why", [
    ('{"password": "Qz7xWk9v"', "not JSON"),
    ("{'visibility_timeout': 1}", "not JSON"),
    ('["Qz7xWk9v"]', "JSON object"),
    ("NaN-Qz7x", "not JSON"),
])
def test_relay_bad_transport_options_json_is_coded(text: str, why: str,
                                                   app_schema: tuple[str, str],
                                                   capsys: Any) -> None:
    schema, _ = app_schema
    assert cli(["relay", "--dsn", DSN, "--schema", schema, "--broker", "memory://",
                "--transport-options", text, "--json"]) == 2
    out = capsys.readouterr().out
    error = json.loads(out)["error"]
    assert error["code"] == "PGJ-405" and why in error["message"], error
    assert "Qz7x" not in out


# -- items 6 and 7: every publish path ---------------------------------------------------------
Publish = Callable[..., None]


class Paths:
    """One publish of (body, headers, properties) through each path; what each wrote."""

    def __init__(self, url: str, schema: str, db: psycopg.Connection[Any], **opts: Any) -> None:
        self.url, self.schema, self.db = url, schema, db
        self.opts = {"schema": schema, **opts}

    def _producer_publish(self, body: Any, headers: dict[str, Any], props: dict[str, Any],
                          **opts: Any) -> None:
        with kombu.Connection(self.url, transport_options={**self.opts, **opts}) as c:
            producer = c.Producer()
            try:
                producer.publish(body, routing_key="trust", declare=[self.queue(c)],
                                 headers=headers, serializer="json", **props)
            finally:
                c.default_channel.backend.confirm_publishes()

    def queue(self, c: kombu.Connection) -> kombu.Queue:
        return kombu.Queue("trust", routing_key="trust", channel=c.default_channel)

    def immediate(self, body: Any, headers: dict[str, Any], props: dict[str, Any]) -> None:
        self._producer_publish(body, headers, props)

    def delayed(self, body: Any, headers: dict[str, Any], props: dict[str, Any]) -> None:
        self._producer_publish(body, {**headers, "eta": "2999-01-01T00:00:00+00:00"}, props)

    def unconfirmed(self, body: Any, headers: dict[str, Any], props: dict[str, Any]) -> None:
        self._producer_publish(body, headers, props, confirm_publish=False)

    def batch(self, body: Any, headers: dict[str, Any], props: dict[str, Any]) -> None:
        with kombu_pgjobs.batch():
            self._producer_publish(body, headers, props)

    def outbox_same_db(self, body: Any, headers: dict[str, Any], props: dict[str, Any]) -> None:
        with kombu.Connection(self.url, transport_options=self.opts) as c, \
                psycopg.connect(DSN) as conn, conn.transaction(), \
                outbox.transaction(conn, schema=self.schema):
            outbox.publish(c.Producer(), body, routing_key="trust", declare=[self.queue(c)],
                           headers=headers, serializer="json", **props)

    def outbox_staged(self, body: Any, headers: dict[str, Any], props: dict[str, Any]) -> None:
        migrate(self.db, self.schema)
        opts = {k: v for k, v in self.opts.items() if k == "max_message_bytes"}
        with kombu.Connection("memory://", transport_options=opts) as c, \
                psycopg.connect(DSN) as conn, conn.transaction(), \
                outbox.transaction(conn, schema=self.schema):
            outbox.publish(c.Producer(), body, routing_key="trust", headers=headers,
                           serializer="json", **props)

    def written(self) -> int:
        return _count(self.db, self.schema, "pgjobs_job") + \
            _count(self.db, self.schema, "pgjobs_outbox")


PATHS = ["immediate", "delayed", "unconfirmed", "batch", "outbox_same_db", "outbox_staged"]

#: NUL where Celery puts the task name and id, and in any header, nested too, key or value
NUL_CASES: dict[str, dict[str, Any]] = {
    "task name": {"headers": {"task": "tasks.a\x00b", "id": "i1"}},
    "task id": {"headers": {"task": "tasks.ok", "id": "i\x001"}},
    "header value": {"headers": {"note": "a\x00b"}},
    "header key": {"headers": {"no\x00te": "ab"}},
    "nested header": {"headers": {"x": [{"y": ["ok", "a\x00"]}]}},
    "nested key": {"headers": {"x": {"k\x00": 1}}},
    "correlation id": {"props": {"correlation_id": "c\x00"}},
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", list(NUL_CASES))
def test_nul_refused_on_every_path_nothing_written(case: str, path: str, url: str, schema: str,
                                                   db: psycopg.Connection[Any]) -> None:
    spec = NUL_CASES[case]
    paths = Paths(url, schema, db)
    with pytest.raises(MessageError) as err:
        getattr(paths, path)({"a": 1}, dict(spec.get("headers", {})), spec.get("props", {}))
    assert err.value.code == "PGJ-106", err.value
    assert "NUL" in str(err.value)
    assert paths.written() == 0
    getattr(paths, path)({"a": 1}, {"task": "tasks.ok", "id": "after"}, {})  # still works
    assert paths.written() == 1


@pytest.mark.parametrize("path", PATHS)
def test_message_over_max_message_bytes_refused_on_every_path(
        path: str, url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    paths = Paths(url, schema, db, max_message_bytes=4096)
    with pytest.raises(MessageTooLarge) as err:
        getattr(paths, path)({"blob": "x" * 5000}, {"task": "tasks.big", "id": "b1"}, {})
    assert err.value.code == "PGJ-110" and isinstance(err.value, MessageError)
    assert "4,096" in str(err.value)
    assert paths.written() == 0
    getattr(paths, path)({"blob": "x" * 1000}, {"task": "tasks.ok", "id": "b2"}, {})
    assert paths.written() == 1


def test_default_max_message_bytes_refuses_a_huge_message(url: str, schema: str,
                                                          db: psycopg.Connection[Any]) -> None:
    assert DEFAULT_MAX_MESSAGE_BYTES == 8 * 1024 * 1024
    paths = Paths(url, schema, db)
    with pytest.raises(MessageTooLarge):
        paths.immediate({"blob": "x" * DEFAULT_MAX_MESSAGE_BYTES}, {}, {})
    assert paths.written() == 0
    paths.immediate({"blob": "x" * (DEFAULT_MAX_MESSAGE_BYTES // 2)}, {}, {})
    assert paths.written() == 1


def test_celery_task_name_or_id_with_nul_is_refused(url: str, schema: str,
                                                    db: psycopg.Connection[Any]) -> None:
    app = Celery("nul", broker=url)
    app.conf.broker_transport_options = {"schema": schema}
    with pytest.raises(MessageError):
        app.send_task("tasks.a\x00b", args=[1])
    with pytest.raises(MessageError):
        app.send_task("tasks.ok", args=[1], task_id="id\x00x")
    assert _count(db, schema, "pgjobs_job") == 0


def test_cancel_by_task_id_works_after_nul_publishes(url: str, schema: str,
                                                     db: psycopg.Connection[Any],
                                                     capsys: Any) -> None:
    """A stored NUL made `message -> 'headers' ->> 'id'` fail for every row of the table:
    `pgjobs cancel --task-id` of any message failed with an uncoded driver error."""
    app = Celery("cancel", broker=url)
    app.conf.broker_transport_options = {"schema": schema}
    app.send_task("tasks.ok", args=[1], task_id="keep-me", countdown=3600)
    for headers in ({"note": "a\x00b"}, {"x\x00": 1}):
        try:
            app.send_task("tasks.ok", args=[2], headers=headers)
        except MessageError:
            pass
    assert cli(["cancel", "--task-id", "keep-me", "--dsn", url, "--schema", schema,
                "--json"]) == 0, capsys.readouterr()
    assert _count(db, schema, "pgjobs_job") == 0


# -- item 7: options ---------------------------------------------------------------------------
@pytest.mark.parametrize("opts", [
    {"lock_timeout": 0.0004}, {"statement_timeout": 0.0009}, {"lock_timeout": "0.0001"},
    {"statement_timeout": 1e-9},
])
def test_sub_millisecond_timeouts_refused(opts: dict[str, Any]) -> None:
    with pytest.raises(InvalidOption) as err:
        TransportOptions.parse(opts)
    assert err.value.code == "PGJ-102" and "1 ms" in str(err.value)


def test_millisecond_and_zero_timeouts_accepted() -> None:
    opts = TransportOptions.parse({"lock_timeout": 0.001, "statement_timeout": 0})
    assert (opts.lock_timeout, opts.statement_timeout) == (0.001, 0.0)


@pytest.mark.parametrize("name", ["max_claim", "lease_ttl", "vacuum_every", "lock_timeout",
                                  "max_message_bytes"])
@pytest.mark.parametrize("value", [10**400, -(10**400), 10**5000],
                         ids=["1e400", "-1e400", "1e5000"])
def test_huge_int_option_is_coded(name: str, value: int) -> None:
    with pytest.raises(InvalidOption) as err:
        TransportOptions.parse({name: value})
    assert err.value.code == "PGJ-102"
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("bad", [0, 1023, 10**12, "lots", 4096.5, True])
def test_max_message_bytes_validated(bad: Any) -> None:
    with pytest.raises(InvalidOption):
        TransportOptions.parse({"max_message_bytes": bad})
    assert TransportOptions.parse({"max_message_bytes": "65536"}).max_message_bytes == 65536


def test_unknown_connect_options_key_is_coded_at_connect(url: str, schema: str,
                                                         db: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidOption) as err:
        TransportOptions.parse({"connect_options": {"sslmdoe": "require"}})
    assert "sslmdoe" in str(err.value)
    with kombu.Connection(url, transport_options={
            "schema": schema, "connect_options": {"keepalive_idle": "5"}}) as c:
        with pytest.raises(InvalidOption) as err:
            c.connect()
    assert err.value.code == "PGJ-102" and "keepalive_idle" in str(err.value)
    assert _count(db, schema, "pgjobs_migration") == 0


# -- item 7: DEL in keys ------------------------------------------------------------------------
@pytest.mark.parametrize("header,error", [
    ("x-pgjobs-tenant", InvalidTenant),
    ("x-pgjobs-idempotency-key", InvalidIdempotencyKey),
])
def test_del_in_a_tenant_or_idempotency_key_is_coded(header: str, error: type[PgJobsError],
                                                     url: str, schema: str,
                                                     db: psycopg.Connection[Any]) -> None:
    paths = Paths(url, schema, db)
    with pytest.raises(error):
        paths.immediate({"a": 1}, {"task": "t", "id": "i", header: "acme\x7f"}, {})
    assert paths.written() == 0


def test_del_in_a_concurrency_key_is_coded() -> None:
    from kombu_pgjobs.limits import check_key

    with pytest.raises(InvalidLimitKey):
        check_key("user\x7f42")


def test_del_in_queue_names_and_routing_keys_is_coded(url: str, schema: str) -> None:
    from kombu_pgjobs.errors import InvalidName

    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        producer = c.Producer()
        with pytest.raises(InvalidName):
            producer.publish({"a": 1}, routing_key="rk\x7f")
        with pytest.raises(InvalidName):
            c.SimpleQueue("q\x7f").put({"a": 1})


# -- item 7: a bad `pgjobs migrate --schema` ----------------------------------------------------
@pytest.mark.parametrize("bad", ["", "Upper", "pg_mine", "a" * 49, "semi;colon", "d\x7fl"])
def test_migrate_bad_schema_is_coded_and_migrates_nothing(bad: str, capsys: Any) -> None:
    """A database that does not exist: the empty name used to migrate the default schema
    ('pgjobs') wherever the DSN pointed; here it would fail to connect instead (PGJ-104)."""
    nowhere = DSN.rsplit("/", 1)[0] + f"/pgjt_none_{uuid.uuid4().hex[:8]}"
    assert cli(["migrate", "--dsn", nowhere, "--schema", bad, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-103"


def test_a_tls_key_password_is_never_repeated_in_an_error() -> None:
    """broker_use_ssl's key password (and connect_options' sslpassword) in a clash of the
    two: the error names the setting, never its value (issue 28, item 5)."""
    from kombu_pgjobs.errors import InvalidSSL

    options = TransportOptions.parse({"connect_options": {"sslpassword": "Qz7x-first-pw"}})
    with pytest.raises(InvalidSSL) as err:
        conninfo_from_url("pgjobs://app@127.0.0.1:5432/test", options,
              ssl={"keyfile": "/k.pem", "password": "Qz7x-second-pw"})
    assert "Qz7x" not in str(err.value), str(err.value)
    assert "sslpassword" in str(err.value)
