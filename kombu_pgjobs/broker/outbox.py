"""Publishing inside the app's own transaction: the transactional outbox, at the kombu level.

::

    with conn.transaction():                       # the app's psycopg 3 connection
        conn.execute("INSERT INTO orders ...")
        with kombu_pgjobs.outbox.transaction(conn):
            kombu_pgjobs.outbox.publish(producer, {"order": 42}, routing_key="orders")

Inside the block a message exists exactly when the app's transaction commits:

* **Same database.** When the producer's broker is a ``pgjobs://`` schema in the database
  ``conn`` is connected to, the transport writes the message row on ``conn`` itself (see
  :func:`connection_for`), in the caller's transaction; its NOTIFY is delivered at commit.
* **Broker elsewhere** (Redis, RabbitMQ, a pgjobs schema in another database): the message is
  serialized as kombu would send it and staged in ``<schema>.pgjobs_outbox`` in the caller's
  transaction; ``pgjobs relay`` (:mod:`kombu_pgjobs.broker.relay`) publishes committed rows.

"Same database" is decided from the server's identity (``pg_control_system()``'s
system_identifier and the database name), read once per connection, never from URL text.

The block is a savepoint: an exception leaving it undoes what the block wrote (its messages
first of all), whatever the app then does with its transaction. Blocks nest (the innermost
connection wins) and are per thread and per asyncio task (a context variable). A connection
that is not in a transaction is refused (:class:`~kombu_pgjobs.errors.NotInTransaction`,
PGJ-510), nothing written. celery_ext's ``celery_ext.transaction()`` builds on this module.
"""

from __future__ import annotations

import contextvars
import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from kombu import Exchange, Queue
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from ..errors import (
    MessageError,
    MessageTooLarge,
    NotInTransaction,
    OutboxBypassed,
    OutboxNotInstalled,
    OutboxUnserializable,
    UnsupportedConnection,
)
from ..options import TransportOptions, validate_schema_name
from ..store.core import nul_path
from ..store.sql import queries, raw_queries
from .backend import Backend, use_outbox
from .transport import Transport

__all__ = ["Block", "active", "connection_for", "notify_channel", "publish", "stage",
           "transaction"]

#: the innermost open block of this context
_ACTIVE: contextvars.ContextVar[Block | None] = contextvars.ContextVar(
    "pgjobs_outbox_block", default=None)
#: server identity per connection (read once): (system identifier, database name)
_IDENTITY: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
#: the same, per pgjobs backend (its database, read on its publish connection)
_BACKEND_IDENTITY: weakref.WeakKeyDictionary[Any, tuple[str, str]] = \
    weakref.WeakKeyDictionary()
#: connections on which the outbox table of a schema was found
_INSTALLED: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


@dataclass(eq=False)
class Block:
    """One open ``transaction()`` block."""

    conn: psycopg.Connection[Any]
    #: schema of the outbox table (in the app's database) staged messages go to
    schema: str
    #: messages this block wrote (job rows or staged rows)
    written: int = 0
    #: of which staged in the outbox
    staged: int = 0
    #: the block this one is nested in (None: outermost)
    outer: Block | None = None
    #: False once the block has exited: an asyncio task created inside it inherits the
    #: context, and must not publish on the app's connection after the block is over
    open: bool = True


def active() -> Block | None:
    """The innermost open block of this thread / task, or None."""
    block = _ACTIVE.get()
    while block is not None and not block.open:
        block = block.outer
    return block


def notify_channel(schema: str) -> str:
    """The channel committed staged rows NOTIFY (the relay LISTENs on it)."""
    return f"pgjobs_outbox.{schema}"


def _check_open(conn: psycopg.Connection[Any]) -> None:
    status = conn.info.transaction_status
    if conn.closed or conn.broken:
        raise NotInTransaction("the connection given to transaction() is closed")
    if status == TransactionStatus.INERROR:
        raise NotInTransaction(
            "the connection's transaction has failed (an earlier statement raised): roll it "
            "back before publishing in it")
    if status == TransactionStatus.IDLE and conn.autocommit:
        raise NotInTransaction(
            "the connection is in autocommit mode with no transaction open: every statement "
            "would commit on its own. Open one first (`with conn.transaction():`), then the "
            "block inside it")
    if status not in (TransactionStatus.IDLE, TransactionStatus.INTRANS):
        raise NotInTransaction(f"the connection is busy ({status.name}): publish on a "
                               "connection that is not running another statement")


@contextmanager
def transaction(conn: psycopg.Connection[Any], *, schema: str = "pgjobs") -> Iterator[Block]:
    """Publish inside ``conn``'s open transaction for the duration of the block.

    ``schema``: where the outbox table lives in the app's database (for a broker elsewhere).
    A non-autocommit connection with no statement run yet counts as in a transaction (its
    first statement opens one, as the DB-API says); an autocommit connection outside
    ``conn.transaction()`` does not."""
    if not isinstance(conn, psycopg.Connection):
        raise UnsupportedConnection(
            f"transaction() takes a psycopg 3 connection, got {type(conn).__name__}")
    validate_schema_name(schema)
    _check_open(conn)
    block = Block(conn, schema, outer=active())
    savepoint = sql.Identifier(f"pgjobs_outbox_{id(block):x}")
    conn.execute(sql.SQL("SAVEPOINT {}").format(savepoint), prepare=False)
    token = _ACTIVE.set(block)
    try:
        yield block
    except BaseException:
        block.open = False
        _ACTIVE.reset(token)
        if not conn.closed and conn.info.transaction_status in (
                TransactionStatus.INTRANS, TransactionStatus.INERROR):
            try:
                conn.execute(sql.SQL("ROLLBACK TO SAVEPOINT {}").format(savepoint),
                             prepare=False)
                conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(savepoint),
                             prepare=False)
            except psycopg.Error:
                pass  # the transaction cannot commit anyway: nothing of the block survives
        raise
    block.open = False
    _ACTIVE.reset(token)
    if conn.info.transaction_status == TransactionStatus.IDLE:
        raise NotInTransaction(
            "the transaction ended inside the transaction() block (a commit or rollback in "
            "it): end the transaction after the block, so that its messages and the app's "
            "writes commit or roll back together")
    conn.execute(sql.SQL("RELEASE SAVEPOINT {}").format(savepoint), prepare=False)


def _identity(conn: psycopg.Connection[Any]) -> tuple[str, str]:
    got = _IDENTITY.get(conn)
    if got is None:
        row = _run(conn, raw_queries()["outbox_identity"], prepare=False).fetchone()
        assert row is not None
        got = _IDENTITY[conn] = (str(row[0]), str(row[1]))
    return got


def _backend_identity(backend: Backend) -> tuple[str, str]:
    got = _BACKEND_IDENTITY.get(backend)
    if got is None:
        got = _BACKEND_IDENTITY[backend] = backend.publishing(_identity)
    return got


def _run(conn: psycopg.Connection[Any], query: Any, params: Any = None, *,
         prepare: bool | None = None) -> psycopg.Cursor[Any]:
    """A statement on the app's connection whose rows are tuples, with server-side binding,
    whatever row or cursor factory the app gave its connection (``dict_row``,
    ``ClientCursor``)."""
    return psycopg.Cursor(conn, row_factory=tuple_row).execute(query, params, prepare=prepare)


class AppConnection:
    """The app's connection as the queue core uses it (``execute`` returning tuple rows, see
    :func:`_run`; ``transaction`` for a savepoint)."""

    __slots__ = ("__weakref__", "conn")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def execute(self, query: Any, params: Any = None, *,
                prepare: bool | None = None) -> psycopg.Cursor[Any]:
        return _run(self.conn, query, params, prepare=prepare)

    def transaction(self) -> Any:
        return self.conn.transaction()


def connection_for(backend: Backend) -> AppConnection | None:
    """The connection a pgjobs transport publishes on inside an open block: the block's own
    connection when it is on the backend's database (None outside a block). A block on
    another database never reaches the transport (:func:`publish` staged the message
    instead): a message that does was published past the outbox, and is refused."""
    block = active()
    if block is None:
        return None
    if _identity(block.conn) == _backend_identity(backend):
        block.written += 1
        return AppConnection(block.conn)
    raise OutboxBypassed(
        "a pgjobs broker on another database than the transaction() block's connection was "
        "published to directly: publish through kombu_pgjobs.outbox.publish() (Celery: "
        "celery_ext.transaction()), which stages the message for the relay")


def _same_database(producer: Any, block: Block) -> bool:
    transport = producer.connection.transport
    if not isinstance(transport, Transport):
        return False
    return _identity(block.conn) == _backend_identity(transport.backend)


def publish(producer: Any, body: Any, **kwargs: Any) -> Any:
    """``producer.publish(body, **kwargs)``, in the open block's transaction if there is one:
    written by the pgjobs transport on the block's connection when the broker is that
    database, else staged in the outbox for the relay (returns None then)."""
    block = active()
    if block is None or _same_database(producer, block):
        return producer.publish(body, **kwargs)
    stage(block, [_staged_row(producer, body, **kwargs)])
    return None


def _entity(entity: Any) -> dict[str, Any]:
    """A kombu Queue or Exchange as JSON (rebuilt by the relay to declare it)."""
    if isinstance(entity, Queue):
        d = entity.as_dict(recurse=True)
        d["bindings"] = [{"exchange": b.exchange.as_dict(recurse=True),
                          "routing_key": b.routing_key, "arguments": b.arguments}
                         for b in entity.bindings or ()]
        return {"queue": d}
    if isinstance(entity, Exchange):
        return {"exchange": entity.as_dict(recurse=True)}
    raise OutboxUnserializable(
        f"declare= holds {type(entity).__name__}, not a kombu Queue or Exchange")


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise OutboxUnserializable(
            f"the message's {what} cannot be staged as JSON ({exc}): nothing was written"
        ) from None


def _max_bytes(producer: Any) -> int:
    """The broker's ``max_message_bytes``: a pgjobs transport's own option; for another
    broker, the same transport option if given (validated alike), else the default."""
    connection = producer.connection
    transport = connection.transport
    if isinstance(transport, Transport):
        return transport.options.max_message_bytes
    raw = (connection.transport_options or {}).get("max_message_bytes")
    return TransportOptions.parse({} if raw is None else {"max_message_bytes": raw},
                                  warn=False).max_message_bytes


def _check_staged(row: StagedRow, hdrs: Mapping[str, Any], props: Mapping[str, Any],
                  max_bytes: int) -> None:
    """What the transport refuses at publish, refused at staging too (nothing written): a NUL
    in a header or property (the outbox's jsonb columns cannot hold one: the app's transaction
    would fail with a driver error) and a message larger than ``max_message_bytes``."""
    if "\\u0000" in row.headers or "\\u0000" in row.properties:
        where = nul_path(hdrs, "headers") or nul_path(props, "properties")
        if where is not None:
            raise MessageError(
                f"message has a NUL character (\\x00) in {where}: PostgreSQL text cannot "
                "hold it (the task name, id and headers are read as text); remove it. Nothing "
                "was written")
    size = len(row.body) + len(row.headers) + len(row.properties)
    if size > max_bytes:
        raise MessageTooLarge(
            f"message is {size:,} bytes as staged (body, headers and properties), more than "
            f"max_message_bytes ({max_bytes:,}): nothing was written. Keep large data in the "
            "app's tables (or object storage) and send its key, or raise the broker's "
            "max_message_bytes transport option")


@dataclass(frozen=True, slots=True)
class StagedRow:
    exchange: str
    routing_key: str
    body: bytes
    content_type: str
    content_encoding: str
    headers: str
    properties: str
    declare: str


def _staged_row(producer: Any, body: Any, *, routing_key: str | None = None,
                delivery_mode: Any = None, mandatory: bool = False, immediate: bool = False,
                priority: int = 0, content_type: str | None = None,
                content_encoding: str | None = None, serializer: str | None = None,
                headers: Mapping[str, Any] | None = None, compression: str | None = None,
                exchange: Any = None, retry: bool = False, retry_policy: Any = None,
                declare: Sequence[Any] | None = None, expiration: float | None = None,
                timeout: float | None = None, confirm_timeout: float | None = None,
                **properties: Any) -> StagedRow:
    """Serialize a publish as ``kombu.Producer.publish`` would (same serializer, compression
    and delivery details, through its own helpers), for the relay to send verbatim."""
    hdrs = dict(headers or {})
    rkey = producer.routing_key if routing_key is None else routing_key
    exchange_name, mode = producer._delivery_details(exchange or producer.exchange,
                                                     delivery_mode)
    data, ctype, cenc = producer._prepare(
        body, serializer, content_type, content_encoding,
        producer.compression if compression is None else compression, hdrs)
    props: dict[str, Any] = {**properties, "delivery_mode": mode, "priority": priority}
    if expiration is not None:
        props["expiration"] = expiration
    entities = list(declare or ())
    if producer.auto_declare and producer.exchange.name and producer.exchange not in entities:
        entities.append(producer.exchange)
    row = StagedRow(exchange_name or "", rkey or "",
                    data.encode(cenc) if isinstance(data, str) else bytes(data), ctype, cenc,
                    _json(hdrs, "headers"), _json(props, "properties"),
                    _json([_entity(e) for e in entities], "declare entities"))
    _check_staged(row, hdrs, props, _max_bytes(producer))
    return row


def stage(block: Block, rows: Sequence[StagedRow]) -> list[int]:
    """Insert staged rows on the block's connection (its transaction); their ids."""
    conn = block.conn
    installed = _INSTALLED.setdefault(conn, set())
    if block.schema not in installed:
        row = _run(conn, "SELECT to_regclass(%s) IS NOT NULL",
                   (f'"{block.schema}".pgjobs_outbox',), prepare=False).fetchone()
        if not row or not row[0]:
            raise OutboxNotInstalled(
                f"the outbox table {block.schema}.pgjobs_outbox is not in the app's database: "
                f"run `pgjobs migrate --dsn APP_DB --schema {block.schema}` (nothing was "
                "written)")
        installed.add(block.schema)
    got = _run(conn, queries(block.schema)["outbox_stage"], {
        "exchange": [r.exchange for r in rows], "routing_key": [r.routing_key for r in rows],
        "body": [r.body for r in rows], "content_type": [r.content_type for r in rows],
        "content_encoding": [r.content_encoding for r in rows],
        "headers": [r.headers for r in rows], "properties": [r.properties for r in rows],
        "declare": [r.declare for r in rows], "channel": notify_channel(block.schema),
    }).fetchall()
    block.written += len(rows)
    block.staged += len(rows)
    return [int(r[0]) for r in got]


use_outbox(connection_for)
