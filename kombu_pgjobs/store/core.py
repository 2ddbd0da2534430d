"""The queue core: every statement pgjobs runs against the job tables, and what it means.

The kombu transport, the CLI and celery_ext call this module; none of them writes SQL of their
own for the job tables. Methods take the connection to run on, so a caller can publish inside a
transaction it holds (the outbox and the scheduler do): when the caller's transaction commits,
the row and its NOTIFY are committed together; when it rolls back, neither exists.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import cache
from typing import Any, NewType

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from ..errors import (
    InvalidArgument,
    InvalidIdempotencyKey,
    InvalidTenant,
    MessageError,
    MessageTooLarge,
    TenantQueueFull,
)
from ..events import log_event
from ..limits import LIMITS_HEADER, check_cap, check_key
from ..limits import normalise as normalise_limits
from ..options import DEFAULT_MAX_MESSAGE_BYTES, validate_queue_name, validate_schema_name
from .database import RawTimeoutTranslatingCursor
from .sql import positional, queries, raw_queries, text_params, with_limit

__all__ = [
    "IDEMPOTENCY_HEADER",
    "MAX_ATTEMPTS_HEADER",
    "MAX_QUEUED_HEADER",
    "TENANT_HEADER",
    "ClaimResult",
    "Claimed",
    "Handed",
    "HeldBack",
    "JobId",
    "NewJob",
    "PublishOutcome",
    "QueueCore",
    "WaitPlan",
    "bounded",
    "job_from_message",
    "queue_full",
    "take_publish_outcome",
]


JobId = NewType("JobId", int)
#: Header a publisher (celery_ext) may set to override the max_attempts transport option.
MAX_ATTEMPTS_HEADER = "x-pgjobs-max-attempts"
#: The tenant a message acts for (celery_ext stamps it from the task's declaration): stored in
#: the row's ``tenant`` column, which the tenant queue cap counts and the CLI filters on.
TENANT_HEADER = "x-pgjobs-tenant"
#: While a live message of the same task and tenant holds this key, a publish of another one
#: inserts nothing (the publisher learns the holder's task id): see :class:`PublishOutcome`.
IDEMPOTENCY_HEADER = "x-pgjobs-idempotency-key"
#: The most live messages the message's tenant may have (the app's
#: ``pgjobs_tenant_max_queued``, carried by each message because the transport never reads
#: Celery's configuration); a publish beyond it is refused with TenantQueueFull (PGJ-506).
MAX_QUEUED_HEADER = "x-pgjobs-tenant-max-queued"
#: How long a revoke broadcast's task ids are kept in Postgres for starting workers: Celery's
#: own default for a worker's revoked set (``CELERY_WORKER_REVOKE_EXPIRES``, three hours).
REVOKE_KEEP_SECONDS = 10_800.0
#: SQLSTATE pgjobs_publish_guarded_v1 raises when a tenant's queue cap would be exceeded
_QUEUE_FULL = "PJ506"

Pair = tuple[int, int]  # (job id, claim number): what a delivery tag carries


@dataclass(frozen=True, slots=True)
class NewJob:
    """A message ready to be inserted: the columns derived from a kombu message."""

    queue: str
    priority: int
    run_at: datetime | None
    ttl_ms: float | None
    max_attempts: int | None
    task: str | None
    message: str
    #: validated x-pgjobs-limits header as JSON (None: no limits)
    limits: str | None = None
    #: x-pgjobs-tenant (None: no tenant)
    tenant: str | None = None
    #: x-pgjobs-idempotency-key (None: none)
    idempotency_key: str | None = None
    #: x-pgjobs-tenant-max-queued, kept only when the message has a tenant (None: no cap)
    max_queued: int | None = None
    #: the Celery task id (headers ``id``), read only for a guarded message: what its
    #: publisher is told it published
    task_id: str | None = None

    @property
    def guarded(self) -> bool:
        """Published by the guarded statement (a key or a cap), not the plain INSERT."""
        return self.idempotency_key is not None or self.max_queued is not None


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    """What became of a guarded publish (a message with an idempotency key or a tenant cap).

    ``inserted``: the message is queued (``job_id`` its row, when it has a key). Otherwise it
    was a duplicate and ``holder_job_id`` / ``holder_task_id`` name the live message that holds
    its key (that task id is what celery_ext's ``apply_async`` returns) — or, both None, the
    key was taken and freed again three times during the publish and nothing was inserted
    (publish again)."""

    task_id: str | None
    inserted: bool
    job_id: int | None = None
    holder_job_id: int | None = None
    holder_task_id: str | None = None

    @property
    def duplicate(self) -> bool:
        return not self.inserted and self.holder_job_id is not None


#: The outcome of the last guarded publish on this thread (celery_ext reads it right after the
#: publish it made; kombu_pgjobs never imports Celery).
_outcome = threading.local()


def take_publish_outcome(task_id: str | None = None) -> PublishOutcome | None:
    """The outcome of this thread's last guarded publish, forgotten once read; None when there
    was none (or it was for another ``task_id``: never a stale answer for this message)."""
    outcome: PublishOutcome | None = getattr(_outcome, "last", None)
    _outcome.last = None
    if outcome is None or (task_id is not None and outcome.task_id != task_id):
        return None
    return outcome


def _set_outcome(outcome: PublishOutcome | None) -> None:
    _outcome.last = outcome


@dataclass(frozen=True, slots=True)
class Claimed:
    id: int
    claim: int
    queue: str
    message: str


@dataclass(frozen=True, slots=True)
class Handed:
    """What a hand-off's wake-up names: the row and claim a publish took for the consumer
    listening on wake id ``waiter`` (``waiting.handed_ids`` reads it). Nothing in it is
    trusted: the consumer delivers only what :meth:`QueueCore.take_handed` reads back."""

    waiter: int
    id: int
    claim: int
    queue: str


@dataclass(frozen=True, slots=True)
class HeldBack:
    """A candidate a limit kept from this claim: parked (full), refused (fail), deferred
    to its rate's next window (later), or left for the next round (busy)."""

    id: int
    verdict: str
    key: str | None


@dataclass(frozen=True, slots=True)
class ClaimResult:
    claimed: list[Claimed]
    acked: set[int]
    #: seconds until the next delayed message of these queues is due (None: none or unknown)
    due_in: float | None
    #: True when fewer rows than asked were claimable (the queues are drained for now)
    drained: bool
    #: candidates held back by a limit (the queues are not drained: claim again)
    held_back: list[HeldBack] = field(default_factory=list)
    #: acks the claim left held (their concurrency key was busy): settle with :meth:`ack`
    unsettled: list[Pair] = field(default_factory=list)
    #: drained with queues to wait on (``barrier``): whether no publish to them was in flight
    #: (True), or one was (False); None when the claim registered nothing
    quiet: bool | None = None


@dataclass(frozen=True, slots=True)
class WaitPlan:
    """What a claim registers when it drains (0017_wake_one.sql): consumer ``waiter`` (its
    wake id; None for a consumer that polls) as waiting on ``register``, and the wake lock
    of each queue in ``barrier`` tried (the claim's ``quiet``)."""

    waiter: int | None
    register: Sequence[str] = ()
    barrier: Sequence[str] = ()


def _parse_eta(value: Any) -> datetime | None:
    if value in (None, ""):
        return None
    if isinstance(value, datetime):
        dt = value
    else:
        try:
            text = str(value)
            if text.endswith("Z"):
                text = text[:-1] + "+00:00"
            dt = datetime.fromisoformat(text)
        except ValueError:
            raise MessageError(f"message eta {value!r} is not an ISO 8601 timestamp") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt


def _number(name: str, value: Any, *, minimum: float, maximum: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise MessageError(f"message {name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or not minimum <= number <= maximum:
        raise MessageError(
            f"message {name} must be between {minimum:g} and {maximum:g}, got {value!r}")
    return number


#: A UTF-16 surrogate escape in dumped JSON, a valid pair, or any other escape (consumed whole,
#: so an escaped backslash before "u" is never read as the start of an escape).
_ESCAPE = re.compile(r"\\ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|\\(ud[89a-f][0-9a-f]{2})|\\.")


def nul_path(value: Any, path: str = "") -> str | None:
    """Where the first NUL of a JSON-ready value is (``headers['a'][0]``, a key included), or
    None: for the error message, so the publisher can find it."""
    if isinstance(value, str):
        return (path or "the value") if "\x00" in value else None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(k, str) and "\x00" in k:
                return f"a key of {path or 'the message'}"
            found = nul_path(v, f"{path}[{k!r}]" if path else str(k))
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = nul_path(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _message_json(message: Mapping[str, Any],
                  max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> str:
    """The message as compact JSON that PostgreSQL's ``json`` accepts and every reader can
    decode, or MessageError (PGJ-106) before anything is sent.

    Refused: NaN and Infinity (not JSON; the INSERT would fail at the server, and with
    confirm_publish=False only at the next publish), nesting too deep to encode (RecursionError),
    lone surrogates (stored, they make ``->>`` and every UTF-8 reader fail), and NUL anywhere
    (a header's key or value, the task name or id): valid JSON (``\\u0000``) that the ``json``
    column stores, but PostgreSQL text cannot hold it, so every ``message -> 'headers' ->> ...``
    over the row would fail (``pgjobs cancel --task-id``, dead letters, the dashboard). Also
    refused, with MessageTooLarge (PGJ-110): text longer than ``max_bytes`` (the JSON is ASCII,
    ``ensure_ascii``: its length is its size in bytes). The surrogate and NUL checks cost one
    substring search each unless the text has such an escape."""
    try:
        text = json.dumps(message, separators=(",", ":"), allow_nan=False)
    except RecursionError:
        raise MessageError("message is nested too deeply to encode as JSON") from None
    except ValueError as exc:
        raise MessageError(f"message is not valid JSON ({exc}): NaN and Infinity are not "
                           "JSON numbers; send them as strings or null") from None
    except TypeError as exc:
        raise MessageError(f"message is not JSON-serializable: {exc}") from None
    if "\\ud" in text:
        for m in _ESCAPE.finditer(text):
            if m.group(1) is not None:
                raise MessageError(
                    f"message has a lone surrogate (\\{m.group(1)}) in a string: not valid "
                    "Unicode; decode bytes with errors='replace' or send them base64-encoded")
    if "\\u0000" in text:  # or an escaped backslash before "u0000": the walk tells
        where = nul_path(message)
        if where is not None:
            raise MessageError(
                f"message has a NUL character (\\x00) in {where}: PostgreSQL text cannot hold "
                "it (the task name, id and headers are read as text); remove it, or send "
                "binary data base64-encoded")
    if len(text) > max_bytes:
        raise MessageTooLarge(
            f"message is {len(text):,} bytes as stored, more than max_message_bytes "
            f"({max_bytes:,}): nothing was written. Keep large data in the app's tables (or "
            "object storage) and send its key, or raise the max_message_bytes transport option")
    return text


def job_from_message(queue: str, message: Mapping[str, Any], *,
                     max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> NewJob:
    """Validate a kombu message and derive its columns; raise MessageError on bad input
    (MessageTooLarge past ``max_bytes``, the ``max_message_bytes`` transport option)."""
    validate_queue_name(queue)
    props = message.get("properties") or {}
    headers = message.get("headers") or {}
    raw_priority = props.get("priority")
    priority = 0 if raw_priority is None else int(
        _number("priority", raw_priority, minimum=0, maximum=255))
    priority = min(priority, 9)  # kombu's virtual range; x-max-priority above 9 is clamped
    expiration = props.get("expiration")
    ttl_ms = None if expiration in (None, "") else _number(
        "expiration", expiration, minimum=0, maximum=2**53)
    if ttl_ms is not None and headers.get("expires") and isinstance(headers.get("task"), str):
        # A Celery task's ``expires`` (Celery also sends it as the expiration): the worker
        # must receive the message to end it as REVOKED (a stored result, a failed chord), as
        # on Redis; dropped here, its result would wait forever. Other messages keep the TTL.
        ttl_ms = None
    raw_max = headers.get(MAX_ATTEMPTS_HEADER)
    max_attempts = None if raw_max is None else int(
        _number(MAX_ATTEMPTS_HEADER, raw_max, minimum=1, maximum=1_000_000))
    task = headers.get("task")
    limits = normalise_limits(headers.get(LIMITS_HEADER))
    tenant = headers.get(TENANT_HEADER)
    if tenant is not None:
        tenant = check_key(tenant, f"{TENANT_HEADER} header", error=InvalidTenant)
    key = headers.get(IDEMPOTENCY_HEADER)
    if key is not None:
        key = check_key(key, f"{IDEMPOTENCY_HEADER} header", error=InvalidIdempotencyKey)
    raw_cap = headers.get(MAX_QUEUED_HEADER)
    max_queued = None if raw_cap is None else check_cap(raw_cap, f"{MAX_QUEUED_HEADER} header")
    if tenant is None:
        max_queued = None  # nobody's queue to cap
    task_id = None
    if key is not None or max_queued is not None:
        raw_id = headers.get("id", props.get("correlation_id"))
        task_id = raw_id if isinstance(raw_id, str) else None
    text = _message_json(message, max_bytes)
    return NewJob(queue, priority, _parse_eta(headers.get("eta")), ttl_ms, max_attempts,
                  task if isinstance(task, str) else None, text, limits, tenant, key,
                  max_queued, task_id)


def queue_full(exc: psycopg.Error) -> TenantQueueFull | None:
    """TenantQueueFull (PGJ-506) for the guarded statement's cap refusal, else None."""
    if exc.sqlstate != _QUEUE_FULL:
        return None
    detail = exc.diag.message_primary or str(exc)
    return TenantQueueFull(f"{detail}: nothing was published. Wait for the tenant's messages "
                           "to run, or raise pgjobs_tenant_max_queued")


def _pairs(pairs: Iterable[Pair]) -> tuple[list[int], list[int]]:
    ids: list[int] = []
    claims: list[int] = []
    for job_id, claim in pairs:
        ids.append(job_id)
        claims.append(claim)
    return ids, claims


#: Connections whose publishes commit asynchronously (QueueCore.commit_async).
_ASYNC_COMMIT: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
#: Joined into a publish statement: synchronous_commit off for that statement's transaction.
#: A subquery whose output is volatile is neither pulled up nor pruned, so it always runs.
_ASYNC_JOIN = ("CROSS JOIN (SELECT set_config('synchronous_commit', 'off', true)) "
               "AS async_commit\n  ")
_ASYNC_ANCHOR = "LEFT JOIN {schema}.pgjobs_queue AS q"
#: Joined into a publish statement that is its whole transaction (autocommit, or one message
#: of a pipeline): the wake trigger may hand its messages off (0018_hand_off.sql), whose
#: leases start with the transaction.
_HAND_OFF_JOIN = ("CROSS JOIN (SELECT set_config('pgjobs.hand_off', 'on', true)) "
                  "AS hand_off\n  ")
#: job_insert's constant one-row source (replaced by a CTE in QueueCore.insert_from)
_ONE_ROW = "FROM (SELECT) AS one"
#: job_insert_guarded's select list and call (fed by a CTE in QueueCore.insert_from)
_GUARDED_CALL = ("SELECT g.n, g.id, g.holder_id, g.holder_task_id\n"
                 "  FROM {schema}.pgjobs_publish_guarded_v1(")


@cache
def _publish_variant(schema: str, name: str, durable: bool, hand_off: bool) -> sql.Composed:
    """Publish statement ``name`` with :data:`_ASYNC_JOIN` (not ``durable``) and
    :data:`_HAND_OFF_JOIN` (``hand_off``) joined in (cached per schema)."""
    text = raw_queries()[name]
    if text.count(_ASYNC_ANCHOR) != 1:  # the statement changed shape: say so, never publish
        raise RuntimeError(f"{name}: cannot place the per-transaction settings")
    joins = ("" if durable else _ASYNC_JOIN) + (_HAND_OFF_JOIN if hand_off else "")
    return sql.SQL(text.replace(_ASYNC_ANCHOR, joins + _ASYNC_ANCHOR)).format(
        schema=sql.Identifier(schema))  # type: ignore[arg-type]


class _Watchdog:
    """Cancels the statement ``conn`` runs once ``timeout`` seconds have passed, and again
    every quarter second until the block ends (a cancel that reached the server between two
    statements is ignored there). Never after the block: the lock orders the last cancel
    before the next statement is sent."""

    def __init__(self, conn: psycopg.Connection[Any], timeout: float) -> None:
        self.conn = conn
        self.timeout = timeout
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="pgjobs-watchdog", daemon=True)

    def _run(self) -> None:
        wait = self.timeout
        while not self.done.wait(wait):
            with self.lock:
                if self.done.is_set():
                    return
                try:
                    self.conn.cancel_safe(timeout=5.0)
                except (psycopg.Error, OSError):
                    return  # the connection is gone: its statement ends anyway
            wait = 0.25

    def __enter__(self) -> _Watchdog:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            self.done.set()
        self.thread.join(10)


def bounded(conn: psycopg.Connection[Any], timeout: float | None) -> Any:
    """A block whose statements are cancelled after ``timeout`` seconds (none: unbounded)."""
    return _Watchdog(conn, timeout) if timeout else contextlib.nullcontext()


class QueueCore:
    """Statements on the job tables of one schema."""

    def __init__(self, schema: str, *, lease_ttl: float, max_attempts: int,
                 worker: str = "", hand_off: bool = True, history: bool = True) -> None:
        self.schema = validate_schema_name(schema)
        #: this process (host:pid): the lease holder's name and its counter shard
        self.worker = worker or f"{socket.gethostname()}:{os.getpid()}"
        self.lease_ttl = lease_ttl
        #: queues this process declared and bound, by name: what the keeper declares again if
        #: a consumed queue is found dropped (declare_queue's arguments; bind's rows)
        self.declared: dict[str, dict[str, Any]] = {}
        self.bound: dict[str, set[tuple[str, str, str, str]]] = {}
        #: registrations ask for the message a publish wakes them for (0018_hand_off.sql)
        self.hand_off = hand_off
        #: settles record their deliveries in pgjobs_history (0025_history.sql)
        self.history = history
        #: held delivery -> how its run ended, noted before its ack (note_outcome): sent with
        #: the ack, which counts and records that word instead of 'completed'
        self._hints: dict[Pair, str] = {}
        self.max_attempts = max_attempts
        self.channel = f"pgjobs.{schema}"
        self.q = queries(schema)

    # -- publish -------------------------------------------------------------------------
    def commit_async(self, conn: psycopg.Connection) -> None:
        """From now on the publishes on ``conn`` commit asynchronously (``durable_publish=False``).

        Each publish statement sets ``synchronous_commit = off`` for its own transaction
        (``set_config(..., true)``: Postgres applies the setting in effect at commit), never
        for the session: behind PgBouncer in transaction pooling a session ``SET`` stays on
        whichever server connection ran it, for every client that gets it next. Other
        statements on ``conn`` (declares, purges) stay durable."""
        _ASYNC_COMMIT.add(conn)

    def insert_query(self, name: str, *, durable: bool = True,
                     own_transaction: bool = False) -> sql.Composed:
        """Publish statement ``name`` (job_insert, job_insert_many, job_insert_fanout), as
        :meth:`commit_async` runs it when not ``durable``; ``own_transaction``: the statement
        is its whole transaction, so the wake trigger may hand its messages off."""
        if durable and not own_transaction:
            return self.q[name]
        return _publish_variant(self.schema, name, durable, own_transaction)

    def _insert(self, conn: psycopg.Connection, name: str) -> sql.Composed:
        # Its own transaction: an autocommit connection with no transaction block open.
        own = bool(getattr(conn, "autocommit", False)) and \
            conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        return self.insert_query(name, durable=conn not in _ASYNC_COMMIT, own_transaction=own)

    def publish(self, conn: psycopg.Connection, job: NewJob) -> PublishOutcome | None:
        """Insert one message (one round trip). Durable when ``conn`` commits (unless
        :meth:`commit_async` was called for ``conn``).

        A guarded message (an idempotency key or a tenant cap) goes through the guarded
        statement, still one round trip; its outcome is returned and kept for
        :func:`take_publish_outcome`. A tenant over its cap raises TenantQueueFull (PGJ-506)
        and nothing is written. Other messages run the plain INSERT and return None."""
        if job.guarded:
            return self.publish_batch(conn, [job])[0]
        conn.execute(self._insert(conn, "job_insert"), self.job_params(job))
        return None

    @staticmethod
    def job_params(job: NewJob) -> dict[str, Any]:
        """The parameters of ``job_insert`` (and :meth:`insert_from`) for ``job``."""
        return {
            "queue": job.queue, "priority": job.priority, "run_at": job.run_at,
            "ttl_ms": job.ttl_ms, "max_attempts": job.max_attempts, "task": job.task,
            "limits": job.limits, "message": job.message, "tenant": job.tenant,
        }

    def insert_from(self, source: str, job: NewJob) -> tuple[sql.Composed, dict[str, Any]]:
        """The statement and parameters that publish ``job`` reading its row from the CTE
        named ``source``, yielding the new row's ``id``: a caller writes it as a CTE after
        one that decides whether the message is published at all (the scheduler's fence), so
        the decision and the row are one statement. Nothing is published when ``source`` is
        empty.

        The row is built exactly as a publish builds it: the same statement text
        (``job_insert``, its constant row replaced by ``source``; for a guarded message —
        an idempotency key or a tenant cap — ``job_insert_guarded``, called once per row of
        ``source``) and the same parameters. A guarded message whose key is held inserts
        nothing (no ``id``); one over its tenant's cap raises SQLSTATE PJ506 (translate it
        with :func:`queue_full`)."""
        if not re.fullmatch(r"[a-z_]+", source):
            raise ValueError(f"not a CTE name: {source!r}")
        if job.guarded:
            name, anchor, into = "job_insert_guarded", _GUARDED_CALL, (
                f"SELECT g.id\n  FROM {source} CROSS JOIN LATERAL "
                "{schema}.pgjobs_publish_guarded_v1(")
            params = {k: [v] for k, v in self.job_params(job).items()}
            params.update(key=[job.idempotency_key], max_queued=[job.max_queued],
                          task_id=[job.task_id], channel=self.channel)
            params["async"] = False
        else:
            name, anchor, into = "job_insert", _ONE_ROW, f"FROM {source} AS one"
            params = self.job_params(job)
        text = raw_queries()[name]
        if text.count(anchor) != 1:  # the statement changed shape: say so, never publish
            raise RuntimeError(f"{name}: cannot place the row source")
        text = text.replace(anchor, into) + ("" if job.guarded else "\nRETURNING id")
        return sql.SQL(text).format(  # type: ignore[arg-type]
            schema=sql.Identifier(self.schema)), params

    def publish_many(self, conn: psycopg.Connection, jobs: Sequence[NewJob]) -> int:
        """Insert many messages in one statement: the batch path. Returns the number of rows
        inserted (a duplicate of a held idempotency key inserts none)."""
        outcomes = self.publish_batch(conn, jobs)
        return sum(1 for o in outcomes if o is None or o.job_id is not None)

    def publish_batch(self, conn: psycopg.Connection,
                      jobs: Sequence[NewJob]) -> list[PublishOutcome | None]:
        """Insert many messages in one statement; one outcome per message (None for a message
        without a key or cap: inserted). A batch with a guarded message runs the guarded
        statement for all of them (one statement: a cap refusal writes nothing of the batch)."""
        if not jobs:
            return []
        params: dict[str, Any] = {
            "queue": [j.queue for j in jobs],
            "priority": [j.priority for j in jobs],
            "run_at": [j.run_at for j in jobs],
            "ttl_ms": [j.ttl_ms for j in jobs],
            "max_attempts": [j.max_attempts for j in jobs],
            "task": [j.task for j in jobs],
            "limits": [j.limits for j in jobs],
            "message": [j.message for j in jobs],
            "tenant": [j.tenant for j in jobs],
        }
        if not any(j.guarded for j in jobs):
            conn.execute(self._insert(conn, "job_insert_many"), params)
            return [None] * len(jobs)
        params.update(key=[j.idempotency_key for j in jobs],
                      max_queued=[j.max_queued for j in jobs],
                      task_id=[j.task_id for j in jobs], channel=self.channel)
        params["async"] = conn in _ASYNC_COMMIT
        try:
            rows = conn.execute(self.q["job_insert_guarded"], params).fetchall()
        except psycopg.Error as exc:
            full = queue_full(exc)
            if full is not None:
                raise full from None
            raise
        # Keyless messages are all inserted (a cap refusal raised above); keyed ones are
        # answered row by row.
        outcomes: list[PublishOutcome | None] = [
            None if not j.guarded else PublishOutcome(j.task_id, j.idempotency_key is None)
            for j in jobs]
        for n, job_id, holder_id, holder_task in rows:
            outcomes[n - 1] = PublishOutcome(jobs[n - 1].task_id, job_id is not None, job_id,
                                             holder_id, holder_task)
        if len(jobs) == 1:
            _set_outcome(outcomes[0])
        return outcomes

    def publish_fanout(self, conn: psycopg.Connection, exchange: str, job: NewJob) -> None:
        """Insert one copy of a message per queue bound to a fanout exchange."""
        conn.execute(self._insert(conn, "job_insert_fanout"), {
            "exchange": exchange, "priority": job.priority, "run_at": job.run_at,
            "ttl_ms": job.ttl_ms, "max_attempts": job.max_attempts, "task": job.task,
            "limits": job.limits, "message": job.message, "tenant": job.tenant,
        })

    def revoke(self, conn: psycopg.Connection, task_ids: Sequence[str], *,
               keep: float | None = REVOKE_KEEP_SECONDS) -> list[tuple[int, str]]:
        """Delete the delayed rows of these Celery task ids (a revoke broadcast, see
        :mod:`kombu_pgjobs.store.revoke`) and keep the ids ``keep`` seconds for starting workers
        (None: not kept); returns ``[(id, queue)]``."""
        if not task_ids:
            return []
        return [(r[0], r[1]) for r in conn.execute(self.q["revoke_delete"], {
            "task_ids": list(task_ids), "worker": self.worker, "keep": keep}).fetchall()]

    def revoked(self, conn: psycopg.Connection, limit: int = 50_000) -> list[tuple[str, float]]:
        """The revokes kept in Postgres, newest first: ``[(task_id, seconds left)]``."""
        return [(r[0], float(r[1])) for r in conn.execute(self.q["revoke_list"],
                                                          {"n": int(limit)}).fetchall()]

    # -- claim and settle ----------------------------------------------------------------
    def claim(self, conn: psycopg.Connection, queues: Sequence[str], n: int,
              acks: Sequence[Pair] = (), wait: WaitPlan | None = None) -> ClaimResult:
        """Flush fenced acks and claim up to ``n`` due messages, in one round trip.

        Acked messages that hold concurrency slots release them first. A claim (n > 0) never
        waits for a key's lock, so the acks of a busy key come back in ``unsettled`` (settle
        them with :meth:`ack`, which waits). ``wait``: what a consumer that LISTENs registers
        when the queues are drained (see :class:`WaitPlan`)."""
        query, params = self.claim_wire(queues, n, acks, wait)
        return self.claim_result(
            RawTimeoutTranslatingCursor(conn).execute(query, params).fetchall())

    def claim_statement(self, queues: Sequence[str], n: int, acks: Sequence[Pair] = (),
                        wait: WaitPlan | None = None) -> tuple[sql.Composed, dict[str, Any]]:
        """The statement and parameters of :meth:`claim`, for a caller that sends it itself
        (the transport, without blocking Celery's event loop); read its rows with
        :meth:`claim_result`."""
        ack_ids, ack_claims = _pairs(acks)
        wait = wait or WaitPlan(None)
        hints = [(p, self._hints.pop(p)) for p in acks if p in self._hints] \
            if self._hints else []
        return with_limit(self.schema, "job_claim", n), {
            "ack_ids": ack_ids, "ack_claims": ack_claims, "queues": list(queues), "n": n,
            "hint_ids": [p[0] for p, _ in hints], "hint_words": [w for _, w in hints],
            "ttl": self.lease_ttl, "worker": self.worker, "channel": self.channel,
            "hand_off": self.hand_off, "waiter": wait.waiter, "register": list(wait.register),
            "barrier": list(wait.barrier), "schema_name": self.schema,
            "history": self.history,
        }

    def claim_wire(self, queues: Sequence[str], n: int, acks: Sequence[Pair] = (),
                   wait: WaitPlan | None = None) -> tuple[bytes, list[Any]]:
        """:meth:`claim_statement` as it is sent: numbered placeholders and their values in
        order, for a raw cursor (see :func:`kombu_pgjobs.store.sql.positional`), as text of unknown
        type (:func:`kombu_pgjobs.store.sql.text_params`): one prepared statement per window size,
        whatever the acks' ids or the wake id."""
        _, params = self.claim_statement(queues, n, acks, wait)
        query, keys = positional(self.schema, "job_claim", n)
        return query, text_params([params[k] for k in keys])

    def note_outcome(self, pair: Pair, outcome: str) -> None:
        """The run of held delivery ``pair`` ended as ``outcome`` (``failed``, ``dropped`` or
        ``requeued``): its ack, when it is sent, counts and records that word instead of
        ``completed``. At most 100,000 are kept (an ack that never comes: the oldest go)."""
        if outcome not in ("failed", "dropped", "requeued"):
            raise InvalidArgument(f"an ack's outcome is failed, dropped or requeued, "
                                  f"not {outcome!r}")
        if len(self._hints) >= 100_000:
            self._hints.pop(next(iter(self._hints)), None)
        self._hints[pair] = outcome

    def noted_outcomes(self, pairs: Iterable[Pair]) -> dict[Pair, str]:
        """The words :meth:`note_outcome` holds for ``pairs`` (kept: an ack statement takes
        them as it sends them, so a caller whose ack may fail notes them again from this)."""
        return {p: self._hints[p] for p in pairs if p in self._hints} if self._hints else {}

    def hold_waiter(self, conn: psycopg.Connection, waiter: int) -> None:
        """Take wake id ``waiter``'s lock for the life of ``conn`` (its registrations are
        alive while it is held)."""
        conn.execute(self.q["waiter_hold"], {"waiter": waiter})

    def unwait(self, conn: psycopg.Connection, waiter: int,
               queues: Sequence[str] | None = None, *,
               release: bool | None = None) -> list[str]:
        """Drop consumer ``waiter``'s registrations (of ``queues``; None: all of them, and
        its wake id's lock unless ``release`` is False: a wake id of another session).
        Returns the queues whose registrations were dropped."""
        row = conn.execute(self.q["waiter_forget"], {
            "waiter": waiter, "queues": None if queues is None else list(queues),
            "release": queues is None if release is None else release}).fetchone()
        return list(row[0]) if row else []

    def take_handed(self, conn: psycopg.Connection,
                    handed: Sequence[Handed]) -> list[Claimed]:
        """Read the messages publishes handed to this consumer, as wake-ups named them: only
        rows still running under that claim, held by this worker and recorded for that wake
        id are returned (the record deleted): a forged, altered or replayed wake-up returns
        nothing (0021_trust_boundary.sql). One statement each (a registration is handed one
        message; several at once are rare), in the order of ``handed``."""
        query, keys = positional(self.schema, "waiter_take", 0)
        cur = RawTimeoutTranslatingCursor(conn)
        taken: list[Claimed] = []
        for h in handed:
            # numbered placeholders and text values, as the claim is sent: no parse of the
            # statement's text per call, one prepared statement whatever the ids' sizes
            values = {"waiter": h.waiter, "id": h.id, "claim": h.claim, "worker": self.worker}
            taken += [Claimed(*r) for r in
                      cur.execute(query, text_params([values[k] for k in keys])).fetchall()]
        return taken

    def wake_all(self, conn: psycopg.Connection, queues: Sequence[str]) -> None:
        """Tell every consumer of ``queues`` to claim (a wake-up that reached a consumer
        no longer consuming them is passed on)."""
        conn.execute(self.q["waiter_pass_on"], {"channel": self.channel, "queues": list(queues)})

    def claim_result(self, rows: Sequence[tuple[Any, ...]]) -> ClaimResult:
        claimed: list[Claimed] = []
        acked: set[int] = set()
        held_back: list[HeldBack] = []
        due_in: float | None = None
        drained = False
        quiet: bool | None = None
        unsettled: list[Pair] = []
        for kind, job_id, claim, queue, message, due, on_key in rows:
            if kind == "c":
                claimed.append(Claimed(job_id, claim, queue, message))
            elif kind == "a":
                acked.add(job_id)
            elif kind == "u":
                unsettled.append((job_id, claim))
            elif kind == "h":
                held_back.append(HeldBack(job_id, message, on_key))
            elif kind == "n":
                drained = True
                due_in = due
            elif kind == "w":
                quiet = bool(job_id)
        for h in held_back:
            if h.verdict == "refused":
                log_event("pgjobs.limit.refused", job_id=h.id, key=h.key)
        return ClaimResult(claimed, acked, due_in, drained, held_back, unsettled, quiet)

    def ack(self, conn: psycopg.Connection, pairs: Sequence[Pair], *,
            timeout: float | None = None) -> set[int]:
        """Fenced delete of acked messages when no claim goes with them (the claim statement
        with nothing to claim); those holding slots release them, waiting for their keys'
        locks. Returns the ids that were still held. ``timeout``: seconds after which the
        statement is cancelled (QueryCanceled, raised as DatabaseTimeout), whatever the
        session's statement_timeout; one statement, so a cancelled ack settles nothing."""
        with bounded(conn, timeout):
            return self.claim(conn, (), 0, pairs).acked

    def vacuum(self, conn: psycopg.Connection, *, timeout: float | None = None) -> None:
        """VACUUM the job and slot tables: the keeper, after its process settled
        ``vacuum_every`` rows, or when the server runs without autovacuum and :meth:`maintain`
        says dead rows piled up. Index cleanup always (a claim steps over every dead entry at
        the head of the claim index until a vacuum removes it); no truncation (its exclusive
        lock would stall claims, and a queue table grows back). Skips a table another vacuum
        holds. ``timeout``: seconds after which it is cancelled (QueryCanceled).

        The timeout is a cancel request from a watchdog thread, not ``SET statement_timeout``:
        VACUUM cannot run in a transaction block (so no ``SET LOCAL``) nor in a multi-statement
        string, and a session setting leaks behind PgBouncer in transaction pooling (the next
        client of that server connection inherits it; the ``RESET`` may even run on another
        server). PgBouncer forwards a cancel to the server running this client's statement."""
        statements = [sql.SQL(
            "VACUUM (SKIP_LOCKED, INDEX_CLEANUP ON, TRUNCATE false) {}.{}").format(
            sql.Identifier(self.schema), sql.Identifier(table))
            for table in ("pgjobs_job", "pgjobs_slot")]
        if timeout is None:
            for statement in statements:
                conn.execute(statement, prepare=False)
            return
        deadline = time.monotonic() + timeout
        with _Watchdog(conn, timeout):
            for statement in statements:
                if time.monotonic() >= deadline:
                    raise psycopg.errors.QueryCanceled(
                        f"vacuum cancelled after {timeout:g}s (its timeout)")
                conn.execute(statement, prepare=False)

    def release_orphans(self, conn: psycopg.Connection, *, limit: int = 1000,
                        timeout: float | None = None) -> int:
        """Free slots whose holder is gone and wake rows parked on them (the keeper, when
        :meth:`maintain` says so). Returns the number of rows woken. ``timeout``: seconds
        after which the statement is cancelled (QueryCanceled)."""
        with bounded(conn, timeout):
            row = conn.execute(self.q["job_release_orphans"], {
                "channel": self.channel, "limit": limit}).fetchone()
        return int(row[0]) if row else 0

    def requeue(self, conn: psycopg.Connection, pairs: Sequence[Pair], *,
                uncount: bool) -> set[int]:
        """Fenced return to ready; ``uncount`` when the message never started. A message on
        its final attempt is dead-lettered instead, a cancelled one deleted. Returns the ids
        that were still held (whatever became of them)."""
        ids, claims = _pairs(pairs)
        rows = conn.execute(self.q["job_requeue"], {
            "ids": ids, "claims": claims, "uncount": uncount, "channel": self.channel,
            "max_attempts": self.max_attempts, "worker": self.worker,
            "history": self.history,
        }).fetchall()
        for job_id, outcome, _ in rows:
            if outcome == "failed":
                log_event("pgjobs.claim.buried", job_id=job_id, reason="max_attempts")
        return {r[0] for r in rows}

    def bury(self, conn: psycopg.Connection, pairs: Sequence[Pair], *, reason: str,
             error: Mapping[str, Any] | None = None) -> set[int]:
        """Fenced move to the dead-letter table with a reason (and error, if known)."""
        ids, claims = _pairs(pairs)
        return {r[0] for r in conn.execute(self.q["job_bury"], {
            "ids": ids, "claims": claims, "reason": reason, "worker": self.worker,
            "channel": self.channel, "history": self.history,
            "error": Jsonb(dict(error)) if error else None,
        }).fetchall()}

    def renew(self, conn: psycopg.Connection, pairs: Sequence[Pair], *,
              timeout: float | None = None) -> dict[int, bool]:
        """Fenced lease renewal (a lapsed lease still running under its claim is revived);
        returns the ids still held, each with whether an operator cancelled it meanwhile.
        ``timeout``: seconds after which the statement is cancelled (QueryCanceled), whatever
        the session's statement_timeout."""
        ids, claims = _pairs(pairs)
        with bounded(conn, timeout):
            return {r[0]: bool(r[1]) for r in conn.execute(self.q["job_renew"], {
                "ids": ids, "claims": claims, "ttl": self.lease_ttl}).fetchall()}

    def maintain(self, conn: psycopg.Connection, *, consumed: Sequence[str], grace: float,
                 fleet: bool = True, held: int = 0, limit: int = 1000,
                 vacuum_after: int = 5000,
                 timeout: float | None = None) -> list[tuple[str, int | None, str]]:
        """The keeper's tick: rescue or bury lapsed leases, drop expired messages and queues,
        mark consumed queues in use. ``fleet``: this keeper has reached the database for a
        full lease without a break, so it may judge other processes gone (rescue their lapsed
        leases, drop their consumer rows, expire queues); see job_maintain. Returns
        [(outcome, id, queue)]."""
        with bounded(conn, timeout):
            rows = conn.execute(self.q["job_maintain"], {
                "limit": limit, "max_attempts": self.max_attempts, "channel": self.channel,
                "consumed": list(consumed), "grace": grace, "worker": self.worker,
                "held": held, "vacuum_after": vacuum_after, "fleet": fleet,
                "ttl": self.lease_ttl, "history": self.history,
            }).fetchall()
        return [(r[0], r[1], r[2]) for r in rows]

    # -- queues and bindings -------------------------------------------------------------
    def declare_queue(self, conn: psycopg.Connection, name: str, *,
                      expires_ms: int | None = None, message_ttl_ms: int | None = None,
                      max_priority: int | None = None, auto_delete: bool = False) -> None:
        validate_queue_name(name)
        declared = {"name": name, "expires_ms": expires_ms, "message_ttl_ms": message_ttl_ms,
                    "max_priority": max_priority, "auto_delete": auto_delete}
        conn.execute(self.q["queue_declare"], declared)
        self.declared[name] = declared

    def redeclare(self, conn: psycopg.Connection, name: str, *,
                  timeout: float | None = None) -> bool:
        """Declare again a queue this process declared (and bind it as it did), found dropped
        while it consumes it (the keeper's ``queue_missing``). False: this process never
        declared it, nothing done. One transaction: a failed or cancelled redeclare leaves the
        queue missing (the next tick finds it so again), never declared without its bindings.
        ``timeout``: seconds after which its statements are cancelled (QueryCanceled)."""
        declared = self.declared.get(name)
        if declared is None:
            return False
        # the watchdog inside the transaction: its COMMIT or ROLLBACK is never cancelled
        with conn.transaction(), bounded(conn, timeout):
            conn.execute(self.q["queue_declare"], declared)
            for exchange, exchange_type, routing_key, pattern in sorted(
                    self.bound.get(name, ())):
                self.bind(conn, exchange, exchange_type, routing_key, pattern, name)
        return True

    def queue_exists(self, conn: psycopg.Connection, name: str) -> bool:
        row = conn.execute(self.q["queue_exists"], {"name": name}).fetchone()
        return bool(row and row[0])

    def delete_queue(self, conn: psycopg.Connection, name: str) -> None:
        conn.execute(self.q["queue_delete"], {"name": name})
        self.declared.pop(name, None)
        self.bound.pop(name, None)

    def purge(self, conn: psycopg.Connection, queue: str) -> int:
        row = conn.execute(self.q["job_purge"], {"queue": queue}).fetchone()
        return int(row[0]) if row else 0

    def size(self, conn: psycopg.Connection, queue: str) -> int:
        row = conn.execute(self.q["job_size"], {"queue": queue}).fetchone()
        return int(row[0]) if row else 0

    def bind(self, conn: psycopg.Connection, exchange: str, exchange_type: str,
             routing_key: str, pattern: str, queue: str) -> None:
        conn.execute(self.q["binding_add"], {
            "exchange": exchange, "exchange_type": exchange_type,
            "routing_key": routing_key or "", "pattern": pattern or "", "queue": queue})
        self.bound.setdefault(queue, set()).add(
            (exchange, exchange_type, routing_key or "", pattern or ""))

    def unbind(self, conn: psycopg.Connection, exchange: str, routing_key: str,
               queue: str) -> None:
        conn.execute(self.q["binding_remove"], {
            "exchange": exchange, "routing_key": routing_key or "", "queue": queue})
        bound = self.bound.get(queue)
        if bound:
            bound -= {b for b in bound if b[0] == exchange and b[2] == (routing_key or "")}

    def binding_table(self, conn: psycopg.Connection,
                      exchange: str) -> tuple[list[tuple[str, str, str]], str | None]:
        """(routing_key, pattern, queue) rows of an exchange, and its type (None: unknown)."""
        rows = conn.execute(self.q["binding_table"], {"exchange": exchange}).fetchall()
        kind = rows[0][3] if rows else None
        return [(r[0], r[1], r[2]) for r in rows], kind
