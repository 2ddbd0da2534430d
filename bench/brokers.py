"""The brokers under test: URL, transport options, and what must exist before a run.

Each URL can be overridden with ``BENCH_<NAME>_URL`` (e.g. ``BENCH_REDIS_URL``). The
Postgres-based brokers each get a database of their own, so an idle worker's statements can
be attributed to one broker, and so their tables never meet.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

PG_ADMIN_DSN = os.environ.get("BENCH_PG_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")


class BrokerUnavailable(Exception):
    """The broker cannot be measured here; the message is the reason shown as 'skipped'."""


@dataclass
class Broker:
    name: str
    url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    pg_database: str | None = None  # set for brokers that live in Postgres
    setup: Callable[[Broker], None] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Host and port for the reachability probe."""
        parts = urlsplit(self.url.split("+", 1)[-1] if self.url.startswith("sqla+") else self.url)
        default_port = {"redis": 6379, "amqp": 5672}.get(parts.scheme, 5432)
        return parts.hostname or "127.0.0.1", parts.port or default_port

    @property
    def display_url(self) -> str:
        parts = urlsplit(self.url)
        if parts.password:
            return self.url.replace(f":{parts.password}@", ":***@", 1)
        return self.url


def probe(address: tuple[str, int], timeout: float = 2.0) -> None:
    """Fail fast with a readable reason when nothing listens on the broker's port."""
    try:
        with socket.create_connection(address, timeout=timeout):
            pass
    except OSError as exc:
        raise BrokerUnavailable(
            f"{address[0]}:{address[1]} unreachable ({type(exc).__name__}: {exc})"
        ) from exc


def ensure_database(name: str) -> None:
    """CREATE DATABASE if missing; the broker's own tables are its transport's business."""
    try:
        with psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if not row.fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.Error as exc:
        raise BrokerUnavailable(f"cannot create database {name}: {exc}") from exc


def pg_dsn(database: str) -> str:
    """The admin DSN pointed at another database of the same server."""
    parts = urlsplit(PG_ADMIN_DSN)
    return parts._replace(path=f"/{database}").geturl()


def install_pgmq_sql(broker: Broker) -> None:
    """Install the PGMQ schema shipped by the ``pgmq`` package (SQL-only, no extension).

    The transport is told ``init_extension=False``: it would otherwise run
    ``CREATE EXTENSION pgmq``, which needs the server-side extension this Postgres lacks.
    """
    assert broker.pg_database
    try:
        from pgmq.install import get_embedded_install_sql
    except ImportError as exc:
        raise BrokerUnavailable(f"pgmq package not installed ({exc})") from exc
    with psycopg.connect(pg_dsn(broker.pg_database), connect_timeout=5) as conn:
        present = conn.execute("SELECT to_regclass('pgmq.meta') IS NOT NULL").fetchone()
        if present and present[0]:
            return
        with conn.transaction():
            conn.execute(get_embedded_install_sql())  # type: ignore[arg-type]


def _url(name: str, default: str) -> str:
    return os.environ.get(f"BENCH_{name.upper()}_URL", default)


def option_value(raw: str) -> Any:
    """A transport option's value given on the command line: JSON when it parses, else text."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def registry() -> dict[str, Broker]:
    return {
        "pgjobs": Broker(
            "pgjobs", _url("pgjobs", "pgjobs://postgres@127.0.0.1:5432/bench"), pg_database="bench"
        ),
        # pgjobs with its task history off (issue 34: what the history costs, side by side)
        "pgjobs_nohist": Broker(
            "pgjobs_nohist",
            _url("pgjobs_nohist", "pgjobs://postgres@127.0.0.1:5432/bench_nohist"),
            transport_options={"history": False}, pg_database="bench_nohist",
        ),
        "redis": Broker("redis", _url("redis", "redis://127.0.0.1:6379/0")),
        "amqp": Broker("amqp", _url("amqp", "amqp://guest:guest@127.0.0.1:5672//")),
        "sqla": Broker(
            "sqla",
            _url("sqla", "sqla+postgresql://postgres@127.0.0.1:5432/bench_sqla"),
            pg_database="bench_sqla",
        ),
        "pgmq": Broker(
            "pgmq",
            _url("pgmq", "pgmq://postgres@127.0.0.1:5432/bench_pgmq"),
            transport_options={"init_extension": False},
            pg_database="bench_pgmq",
            setup=install_pgmq_sql,
        ),
    }


def prepare(broker: Broker) -> None:
    """Everything a broker needs before its first run; raises BrokerUnavailable."""
    probe(broker.address)
    if broker.pg_database:
        ensure_database(broker.pg_database)
    if broker.setup:
        try:
            broker.setup(broker)
        except psycopg.Error as exc:
            raise BrokerUnavailable(f"setup failed: {exc}") from exc


def variant(spec: str) -> Broker:
    """A broker of the registry, or ``name+key=value+...``: it with these transport options
    (values are JSON, else text), to compare settings side by side within one run."""
    name, *pairs = spec.split("+")
    broker = registry()[name]
    options = dict(broker.transport_options)
    for pair in pairs:
        key, _, text = pair.partition("=")
        options[key] = option_value(text)
    return dataclasses.replace(broker, name=spec, transport_options=options)
