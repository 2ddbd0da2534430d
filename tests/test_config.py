"""Bad input is refused where it is made, with a stable code, and nothing is written."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import kombu
import kombu.exceptions
import psycopg
import pytest

from kombu_pgjobs.errors import (
    InvalidName,
    InvalidOption,
    InvalidURL,
    MessageError,
    all_error_classes,
)
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.options import TransportOptions, UnknownOptionWarning
from kombu_pgjobs.store.schema import migrations


def _schema_exists(db: psycopg.Connection, schema: str) -> bool:
    return bool(db.execute("SELECT to_regnamespace(%s) IS NOT NULL", (schema,)).fetchone()[0])


@pytest.mark.parametrize("value", [math.nan, math.inf, -1, 0, 0.1, 1e9, "soon", True])
def test_lease_ttl_must_be_finite_and_in_range(value, url, schema, db):
    with kombu.Connection(url, transport_options={"schema": schema, "lease_ttl": value}) as c:
        with pytest.raises(InvalidOption) as err:
            c.connect()
    assert err.value.code == "PGJ-102"
    assert "lease_ttl" in str(err.value)
    assert not _schema_exists(db, schema), "nothing written"


@pytest.mark.parametrize("opts", [{"max_attempts": 2.5}, {"max_attempts": 0},
                                  {"ack_flush_interval": -0.1}, {"use_listen_notify": "maybe"},
                                  {"connect_options": "sslmode=require"}])
def test_other_bad_options(opts):
    with pytest.raises(InvalidOption):
        TransportOptions.parse(opts)


@pytest.mark.parametrize("name", ["Bad", "1abc", "a-b", "x" * 49, "", "pg;drop", "pg_catalog",
                                  "pg_mine", "information_schema"])
def test_invalid_schema_name(name, url, db):
    with pytest.raises(InvalidName) as err:
        TransportOptions.parse({"schema": name})
    assert err.value.code == "PGJ-103"


def test_invalid_queue_name_refused_at_declaration(url, schema, db):
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        for bad in ("x" * 201, "bad\nname"):
            with pytest.raises(InvalidName):
                kombu.Queue(bad, kombu.Exchange(""), routing_key=bad)(c.default_channel).declare()
        with pytest.raises(InvalidName):
            c.default_channel.queue_declare("q", arguments={"x-expires": -5})
    rows = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_queue').fetchone()[0]
    assert rows == 0


@pytest.mark.parametrize("props", [{"priority": "high"}, {"priority": math.nan},
                                   {"expiration": -5}, {"headers": {"eta": "next tuesday"}}])
def test_bad_message_refused_at_publish(props, url, schema, db):
    with kombu.Connection(url, transport_options={"schema": schema}) as c:
        q = c.SimpleQueue("badmsg")
        headers = props.pop("headers", None)
        with pytest.raises(MessageError) as err:
            if "expiration" in props:
                q.put({"a": 1}, headers=headers, expiration=props["expiration"])
            else:
                q.put({"a": 1}, headers=headers, **props)
        assert err.value.code == "PGJ-106"
        assert q.qsize() == 0
        q.close()


def test_malformed_urls(url, schema):
    with pytest.raises(InvalidURL):
        with kombu.Connection("pgjobs://postgres@127.0.0.1:5432/a/b") as c:
            c.connect()
    # kombu itself refuses a non-numeric port before any transport runs
    with pytest.raises(ValueError):
        kombu.Connection("pgjobs://postgres@127.0.0.1:notaport/test").connect()
    # a host list (libpq's multi-host form) is the transport's to split
    for bad in ("pgjobs://postgres@h1,,h2/test", "pgjobs://postgres@h1:5432,h2:0/test",
                "pgjobs://u@h1:5432,h2:5432:1/test", "pgjobs://u@h1,h2:x/test"):
        with pytest.raises(InvalidURL):
            kombu.Connection(bad).connect()
        assert cli(["migrate", "--dsn", bad, "--json"]) == 2
    assert cli(["migrate", "--dsn", "pgjobs://h:99999/x", "--json"]) == 2
    assert cli(["migrate", "--dsn", "redis://localhost/0"]) == 2
    # TLS parameters are read from the query (tests/test_bad_input.py); nothing else is
    assert cli(["migrate", "--dsn", "pgjobs://h/db?options=-csearch_path%3Dx"]) == 2


def test_foreign_options_warn_and_visibility_timeout_is_lease_ttl():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        opts = TransportOptions.parse({"visibility_timeout": 120, "fanout_prefix": True,
                                       "bogus": 1, "max_retries": 3, "interval_start": 0})
    messages = [str(w.message) for w in seen if issubclass(w.category, UnknownOptionWarning)]
    assert opts.lease_ttl == 120
    assert any("visibility_timeout" in m and "lease_ttl" in m for m in messages)
    assert any("fanout_prefix" in m for m in messages)
    assert any("'bogus'" in m for m in messages)
    assert not any("max_retries" in m or "interval_start" in m for m in messages)


def test_kombu_connection_retry_options_keep_working():
    c = kombu.Connection("pgjobs://postgres@127.0.0.1:1/test",
                         transport_options={"connect_timeout": 1, "max_retries": 1})
    with pytest.raises(kombu.exceptions.OperationalError):
        c.ensure_connection(max_retries=2, interval_start=0, interval_step=0.1)
    c.release()


def test_error_codes_are_unique_and_documented():
    from pathlib import Path

    from kombu_pgjobs.events import EVENTS
    codes = [cls.code for cls in all_error_classes()] + [c for c, _ in EVENTS.values()]
    assert len(codes) == len(set(codes))
    doc = (Path(__file__).parent.parent / "docs/reference/errors.md").read_text()
    missing = [c for c in codes if c not in doc]
    assert not missing


def test_every_option_is_documented():
    from pathlib import Path

    from kombu_pgjobs.options import OPTIONS
    doc = (Path(__file__).parent.parent / "docs/reference/configuration.md").read_text()
    assert [o.name for o in OPTIONS if f"`{o.name}`" not in doc] == []


def test_ten_processes_migrate_once(dsn, schema, db):
    code = ("import sys; from kombu_pgjobs.ops.cli.main import main; "
            f"sys.exit(main(['migrate', '--dsn', {dsn!r}, '--schema', {schema!r}, '--json']))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(10)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    all_versions = [m.version for m in migrations()]
    assert sum(f'"applied": {all_versions}' in o for o in outs) == 1, outs
    assert sum('"applied": []' in o for o in outs) == 9, outs
    rows = db.execute(
        f'SELECT version FROM "{schema}".pgjobs_migration ORDER BY version').fetchall()
    assert [r[0] for r in rows] == all_versions
