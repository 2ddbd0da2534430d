"""Transport options: one table, parsed and validated once on connect.

Every option pgjobs reads is declared in :data:`OPTIONS` with its default and its meaning; the
configuration reference (docs/reference/configuration.md) is checked against this table by a
test. Options that belong to other brokers (Redis, RabbitMQ, SQS) are accepted with a warning that
says what they mean here, so an app moving to pgjobs keeps starting. kombu's own connection-retry
options are passed through silently: kombu reads them itself.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import psycopg

from .errors import InvalidName, InvalidOption
from .shardmap import ShardMap
from .shardmap import parse as parse_shard_map

__all__ = [
    "FOREIGN_OPTIONS",
    "OPTIONS",
    "PASSTHROUGH_OPTIONS",
    "QueueArguments",
    "TransportOptions",
    "UnknownOptionWarning",
    "queue_arguments",
    "validate_exchange_name",
    "validate_queue_name",
    "validate_routing_key",
    "validate_schema_name",
]

SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,47}$")
#: Schema names PostgreSQL reserves (pg_*) or owns (information_schema): a pgjobs schema there
#: would mix its tables with the catalogue's, or fail on CREATE SCHEMA with an uncoded error.
RESERVED_SCHEMA = re.compile(r"^(pg_|information_schema$)")
MAX_QUEUE_NAME = 200
#: Exchange names and routing keys are text columns like queue names (pgjobs_binding): the same
#: bound, so an operator can read them and a key never bloats the binding's primary-key index.
MAX_EXCHANGE_NAME = 200
MAX_ROUTING_KEY = 255  # AMQP's shortstr bound, what a RabbitMQ app already respects
#: Queue arguments live in ``integer`` (x-expires, x-message-ttl) and ``smallint``
#: (x-max-priority) columns of pgjobs_queue.
MAX_QUEUE_MS = 2**31 - 1  # about 24.8 days
MAX_QUEUE_PRIORITY = 255  # RabbitMQ's own limit; pgjobs runs 0-9 whatever is declared
#: max_message_bytes's default: far above any task message (arguments belong in the app's
#: tables, not in the queue), far below what a ``json`` column or a pipelined INSERT can hold.
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: connect_options keys libpq knows (an unknown one used to fail at connect with psycopg's
#: uncoded ProgrammingError)
LIBPQ_KEYWORDS = frozenset(d.keyword.decode() for d in psycopg.pq.Conninfo.get_defaults())


class UnknownOptionWarning(UserWarning):
    """A transport option pgjobs does not use was given."""


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    default: Any
    kind: type
    minimum: float | None = None
    maximum: float | None = None
    doc: str = ""


OPTIONS: tuple[Option, ...] = (
    Option("schema", "pgjobs", str, doc="Postgres schema that holds every pgjobs table."),
    Option("lease_ttl", 30.0, float, 0.5, 86400.0,
           "Seconds a claimed message stays leased without renewal. Renewed every lease_ttl/3 "
           "while unacked; a dead worker's messages come back within about this long."),
    Option("max_attempts", 20, int, 1, 1_000_000,
           "Deliveries of one message before a lapsed lease buries it as dead (poison message)."),
    Option("polling_interval", 1.0, float, 0.01, 3600.0,
           "Poll period when LISTEN/NOTIFY is off (use_listen_notify=False)."),
    Option("idle_poll_interval", 60.0, float, 1.0, 86400.0,
           "Safety claim period of an idle consumer that LISTENs (a missed NOTIFY costs at most "
           "this long)."),
    Option("use_listen_notify", True, bool,
           doc="Wake consumers with LISTEN/NOTIFY. Turn off behind PgBouncer transaction pooling."),
    Option("hand_off", True, bool,
           doc="A publish that wakes an idle consumer claims the message for it in the "
               "publish's own (durable) transaction, and the wake-up carries it: no claim "
               "round trip on the idle path. Off: the woken consumer claims it."),
    Option("durable_publish", True, bool,
           doc="A publish returns after its commit is flushed to disk. Off: the publish "
               "connection uses synchronous_commit=off — the row is committed and visible at "
               "once, but a PostgreSQL crash can lose the last ~0.6 s of publishes (like "
               "RabbitMQ without publisher confirms)."),
    Option("confirm_publish", True, bool,
           doc="A publish returns after PostgreSQL confirmed its commit. Off: it returns once "
               "sent (libpq pipeline mode, each message still its own transaction) and is "
               "confirmed later, as RabbitMQ publishes without publisher confirms; a process "
               "killed right after can lose its last publishes."),
    Option("event_loop", True, bool,
           doc="Join Celery's event loop (asynloop, AsynPool for prefork) with fd readers. Off: "
               "Celery polls drain_events in its synchronous loop."),
    Option("auto_migrate", True, bool,
           doc="Install or upgrade the schema on first connect (under an advisory lock)."),
    Option("failover_fence", True, bool,
           doc="On every new connection, check that the server's start is the one claim "
               "numbers were last fenced for; after a restart, a promotion or a restore, move "
               "their base up once (logged). Off: only this check is skipped; every claim "
               "fences a new server start itself."),
    Option("max_claim", 100, int, 1, 10_000,
           "Most messages one claim takes when the channel has no prefetch limit."),
    Option("ack_flush_interval", 0.005, float, 0.0, 1.0,
           "Seconds an ack may wait to be folded into the next claim before it is flushed alone."),
    Option("vacuum_every", 2000, int, 0, 10_000_000,
           "Rows this process settles (acks, requeues, dead letters) between its keeper's own "
           "VACUUMs of the job table, which keep the claim index free of dead entries between "
           "autovacuum runs. 0: leave vacuuming to autovacuum."),
    Option("retention", True, bool,
           doc="The automatic retention sweep: one worker's keeper at a time deletes what is "
               "past its window (the retention_* options), in bounded batches. False: none "
               "(run `pgjobs prune` from cron instead). See docs/operations.md."),
    Option("retention_interval", 3600.0, float, 1.0, 7 * 86400.0,
           "Seconds between two sweeps across the fleet; a worker's first turn comes one "
           "interval after it started. A sweep stops after half an interval."),
    Option("retention_batch", 1000, int, 1, 100_000,
           "Rows per batch of the sweep, each its own short transaction."),
    Option("retention_limit", 100_000, int, 1, 100_000_000,
           "Most rows of each kind one sweep deletes; the rest waits for the next sweep."),
    Option("retention_dead_letters", 30 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds a dead letter is kept after it died (0: for ever)."),
    Option("retention_counters", 30 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds a per-minute settle counter is kept before it is folded into its queue's "
           "roll-up (totals never go backwards; 0: never folded)."),
    Option("retention_outbox", 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds an outbox row is kept after the relay published it (staged rows are "
           "never deleted; 0: for ever)."),
    Option("retention_webhook_attempts", 30 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds a webhook ledger row is kept after its attempt finished (0: for ever)."),
    Option("retention_schedule_history", 14 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds a leader scheduler's fire is kept in its history (0: for ever)."),
    Option("retention_steps", 14 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds the durable steps of a task whose message is gone are kept after their "
           "last write, and events after they were emitted (0: for ever)."),
    Option("retention_audit", 90 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds an audit log row is kept (0: for ever)."),
    Option("history", True, bool,
           doc="Every settle leaves a compact row in pgjobs_history (task, queue, tenant, "
               "outcome, runtime, attempts, worker), written by the settle's own statement, "
               "and the keepers roll it up per task and minute. False: no history, no rollups."),
    Option("retention_history", 7 * 86400.0, float, 0.0, 36500 * 86400.0,
           "Seconds a history row and a per-minute rollup are kept (0: for ever)."),
    Option("connect_timeout", 10.0, float, 0.1, 600.0, "Seconds to wait for a connection."),
    Option("lock_timeout", 10.0, float, 0.0, 86400.0,
           "Seconds a statement waits for a lock (a table someone LOCKed, a DDL in progress) "
           "before it fails with DatabaseTimeout (PGJ-108). 0: wait forever. Set per "
           "connection as a startup parameter (libpq options)."),
    Option("statement_timeout", 60.0, float, 0.0, 86400.0,
           "Seconds any statement may run before it fails with DatabaseTimeout (PGJ-108). "
           "0: no limit. Migrations lift it; the keeper cancels each of its statements after "
           "half a lease, and its vacuum has its own, shorter bound."),
    Option("max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES, int, 1024, 512 * 1024 * 1024,
           "Largest message a publish accepts, in bytes of its stored JSON (body, headers and "
           "properties; the outbox: body, headers and properties as staged). A larger one is "
           "refused with MessageTooLarge (PGJ-110) and nothing is written."),
    Option("connect_options", None, dict,
           doc="Extra libpq connection parameters, e.g. {'sslrootcert': '/etc/ca.pem'} or "
               "{'keepalives_idle': '30'}."),
    Option("application_name", "pgjobs", str, doc="application_name of pgjobs connections."),
    Option("embedded_data_dir", None, str,
           doc="Data directory of the embedded server (pgjobs:// with no host)."),
    Option("shards", None, dict,
           doc="Shard map: queue patterns to database URLs, e.g. {'billing': "
               "'pgjobs://app@db2/jobs', '*': 'pgjobs://app@db1/jobs'} (or that as JSON). "
               "Each queue is published and claimed on its database; remote control, events "
               "and bindings stay on the broker URL's. See docs/sharding.md."),
)

#: kombu reads these itself (connection retry, body encoding); pgjobs passes them through.
PASSTHROUGH_OPTIONS = frozenset({
    "max_retries", "interval_start", "interval_step", "interval_max", "connect_retries_timeout",
    "body_encoding", "deadletter_queue", "client_properties",
})

#: Options of other brokers, with what they mean on pgjobs. Accepted with a warning.
FOREIGN_OPTIONS: dict[str, str] = {
    "visibility_timeout": "used as lease_ttl (leases are renewed while a message is unacked, "
                          "so a long task is not re-delivered; no need to outlast it)",
    "fanout_prefix": "ignored, not needed: fanout bindings live in Postgres, scoped by schema",
    "fanout_patterns": "ignored, not needed: a fanout exchange delivers to every bound "
                       "queue, as on RabbitMQ",
    "unacked_restore_interval": "ignored, not needed: lapsed leases are rescued every lease_ttl/3",
    "unacked_mutex_expire": "ignored, not needed: there is no unacked index to lock",
    "priority_steps": "ignored, not needed: priorities 0-9 are exact, higher first (RabbitMQ's "
                      "order; Redis ran 0 first)",
    "queue_order_strategy": "ignored, not needed: priority, then due time, then insertion order",
    "sep": "ignored, not needed: queue names are stored as they are",
    "global_keyprefix": "ignored; use the schema option to separate apps",
    "max_connections": "ignored, not needed: a process holds at most three connections",
    "socket_timeout": "ignored; use connect_timeout",
    "socket_connect_timeout": "ignored; use connect_timeout",
    "socket_keepalive": "ignored; configure keepalives through connect_options",
    "health_check_interval": "ignored, not needed: connections are checked when used",
    "retry_on_timeout": "ignored, not needed",
    "region": "ignored (an SQS option)",
    "predefined_queues": "ignored (an SQS option)",
    "wait_time_seconds": "ignored (an SQS option): pgjobs waits on LISTEN instead",
}


def _shown(raw: Any) -> str:
    """``repr(raw)`` bounded for an error message (a 5000-digit int cannot even be printed)."""
    try:
        text = repr(raw)
    except ValueError:
        return f"an integer of {raw.bit_length()} bits"
    return text if len(text) <= 80 else f"{text[:60]}… ({len(text)} characters)"


def _bound(value: float | None) -> str:
    if value is None:
        return "any"
    return f"{value:g}" if value < 1e6 else f"{int(value):,}"


#: lock_timeout and statement_timeout are sent in whole milliseconds, and 0 turns the server's
#: timeout off: a positive value under 1 ms would silently mean "no timeout"
_MILLISECOND_OPTIONS = ("lock_timeout", "statement_timeout")


def _coerce(opt: Option, raw: Any) -> Any:
    if opt.kind is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in {"1", "true", "yes", "on", "0", "false",
                                                     "no", "off"}:
            return raw.lower() in {"1", "true", "yes", "on"}
        raise InvalidOption(f"transport option {opt.name!r} must be a boolean, got {raw!r}")
    if opt.kind in (int, float):
        if isinstance(raw, bool):
            raise InvalidOption(f"transport option {opt.name!r} must be a number, got {raw!r}")
        try:
            value = float(raw)
        except OverflowError:  # an int past float's range: out of every option's range
            raise InvalidOption(
                f"transport option {opt.name!r} must be between {_bound(opt.minimum)} and "
                f"{_bound(opt.maximum)}, got {_shown(raw)}") from None
        except (TypeError, ValueError):
            raise InvalidOption(
                f"transport option {opt.name!r} must be a number, got {_shown(raw)}") from None
        if not math.isfinite(value):
            raise InvalidOption(
                f"transport option {opt.name!r} must be finite, got {_shown(raw)}")
        if opt.kind is int:
            if value != int(value):
                raise InvalidOption(
                    f"transport option {opt.name!r} must be a whole number, got {_shown(raw)}")
            value = int(value)
        if (opt.minimum is not None and value < opt.minimum) or (
            opt.maximum is not None and value > opt.maximum
        ):
            raise InvalidOption(
                f"transport option {opt.name!r} must be between {_bound(opt.minimum)} and "
                f"{_bound(opt.maximum)}, got {_shown(raw)}")
        if opt.name in _MILLISECOND_OPTIONS and 0 < value < 0.001:
            raise InvalidOption(
                f"transport option {opt.name!r} must be 0 (no timeout) or at least 0.001 "
                f"(1 ms, the server's unit), got {_shown(raw)}: under 1 ms it would round to "
                "0, which turns the timeout off")
        return value
    if opt.name == "shards":
        return parse_shard_map(raw)  # its own codes: PGJ-230..232
    if opt.kind is dict:
        if not isinstance(raw, Mapping):
            raise InvalidOption(f"transport option {opt.name!r} must be a mapping, got {raw!r}")
        return {str(k): str(v) for k, v in raw.items()}
    if opt.name == "schema":
        return validate_schema_name(raw)
    if not isinstance(raw, str) or not raw:
        raise InvalidOption(f"transport option {opt.name!r} must be a non-empty string")
    return raw


@dataclass(frozen=True, slots=True)
class TransportOptions:
    """The validated transport options of one connection."""

    schema: str = "pgjobs"
    lease_ttl: float = 30.0
    max_attempts: int = 20
    polling_interval: float = 1.0
    idle_poll_interval: float = 60.0
    use_listen_notify: bool = True
    hand_off: bool = True
    durable_publish: bool = True
    confirm_publish: bool = True
    event_loop: bool = True
    auto_migrate: bool = True
    failover_fence: bool = True
    max_claim: int = 100
    ack_flush_interval: float = 0.005
    vacuum_every: int = 2000
    retention: bool = True
    retention_interval: float = 3600.0
    retention_batch: int = 1000
    retention_limit: int = 100_000
    retention_dead_letters: float = 30 * 86400.0
    retention_counters: float = 30 * 86400.0
    retention_outbox: float = 86400.0
    retention_webhook_attempts: float = 30 * 86400.0
    retention_schedule_history: float = 14 * 86400.0
    retention_steps: float = 14 * 86400.0
    retention_audit: float = 90 * 86400.0
    history: bool = True
    retention_history: float = 7 * 86400.0
    connect_timeout: float = 10.0
    lock_timeout: float = 10.0
    statement_timeout: float = 60.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    #: may hold a password: never in a repr (a log line, a traceback's locals)
    connect_options: dict[str, str] | None = field(default=None, hash=False, repr=False)
    application_name: str = "pgjobs"
    embedded_data_dir: str | None = None
    shards: ShardMap | None = None

    @property
    def tick_interval(self) -> float:
        """How often leases are renewed and lapsed leases rescued."""
        return self.lease_ttl / 3.0

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None, *, warn: bool = True) -> TransportOptions:
        """Validate ``broker_transport_options``; raise on bad values, warn on unknown keys."""
        raw = dict(raw or {})
        known = {o.name: o for o in OPTIONS}
        values: dict[str, Any] = {}
        if "visibility_timeout" in raw and "lease_ttl" not in raw:
            try:
                values["lease_ttl"] = _coerce(known["lease_ttl"], raw["visibility_timeout"])
            except InvalidOption as exc:
                raise InvalidOption(exc.message.replace(
                    "'lease_ttl'", "'visibility_timeout' (an alias of lease_ttl)")) from None
        for key, value in raw.items():
            if key in known:
                if value is None and known[key].default is None:
                    continue
                values[key] = _coerce(known[key], value)
            elif key in PASSTHROUGH_OPTIONS:
                continue
            elif warn:
                meaning = FOREIGN_OPTIONS.get(key, "pgjobs does not know this option; ignored")
                warnings.warn(f"pgjobs: transport option {key!r}: {meaning}",
                              UnknownOptionWarning, stacklevel=3)
        opts = cls(**values)
        validate_schema_name(opts.schema)
        _check_connect_options(opts.connect_options or {})
        return opts

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _check_connect_options(extra: Mapping[str, str]) -> None:
    """connect_options keys that pgjobs sets itself from its own options are refused, naming the
    option to use instead (a duplicate keyword used to end a worker with a TypeError). URL parts
    (host, port, user, password, dbname) are merged when the URL leaves them out: see
    :func:`kombu_pgjobs.store.database.conninfo_from_parts`."""
    unknown = sorted(str(k) for k in extra if k not in LIBPQ_KEYWORDS)
    if unknown:
        raise InvalidOption(
            f"connect_options has keys libpq does not know: {', '.join(map(_shown, unknown))}"
            " (see libpq's connection parameters, e.g. sslrootcert, keepalives_idle, "
            "target_session_attrs)")
    for key, option in (("connect_timeout", "connect_timeout"),
                        ("application_name", "application_name")):
        if key in extra:
            raise InvalidOption(
                f"connect_options[{key!r}] collides with pgjobs's own setting: use the "
                f"{option!r} transport option instead")


def validate_schema_name(name: str) -> str:
    """Schema names are identifiers we interpolate (quoted) into SQL: keep them boring, and out
    of PostgreSQL's own namespaces."""
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise InvalidName(
            f"schema name {name!r} is invalid: use 1-48 characters of a-z, 0-9 and _, "
            "starting with a letter or _")
    if RESERVED_SCHEMA.match(name):
        raise InvalidName(
            f"schema name {name!r} is reserved by PostgreSQL (pg_* and information_schema): "
            "choose another, e.g. 'pgjobs'")
    return name


def _check_characters(what: str, value: str) -> None:
    """No control characters (NUL is refused by PostgreSQL text, the others garble terminals
    and logs) and no lone surrogates (not encodable: an uncoded UnicodeEncodeError at the
    driver). One C-level call for the usual printable name."""
    if value.isprintable():
        return
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise InvalidName(f"{what} {value!r} contains control characters")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise InvalidName(f"{what} {value!r} contains a lone surrogate (not valid Unicode)")


def _text_name(what: str, value: object, maximum: int, *, empty: bool) -> str:
    if not isinstance(value, str):
        raise InvalidName(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if not value and not empty:
        raise InvalidName(f"{what} must be a non-empty string")
    if len(value) > maximum:
        raise InvalidName(f"{what} is longer than {maximum} characters: {value[:40]!r}…")
    _check_characters(what, value)
    return value


def validate_exchange_name(name: str) -> str:
    """Exchange names are stored (pgjobs_binding.exchange) and shown to operators like queue
    names; the empty name is the default exchange."""
    return _text_name("exchange name", name, MAX_EXCHANGE_NAME, empty=True)


def validate_routing_key(key: str) -> str:
    """Routing keys are stored as binding keys (pgjobs_binding.routing_key): no NUL (which
    PostgreSQL text refuses with an uncoded error, after the queue row was written), no
    control characters, at most 255 characters as on AMQP. Empty is a valid key."""
    return _text_name("routing key", key, MAX_ROUTING_KEY, empty=True)


@dataclass(frozen=True, slots=True)
class QueueArguments:
    """A queue's RabbitMQ-style arguments, validated for the pgjobs_queue columns."""

    expires_ms: int | None = None
    message_ttl_ms: int | None = None
    max_priority: int | None = None


def _queue_number(queue: str, key: str, value: Any, maximum: int, unit: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidName(f"queue {queue!r}: {key} must be {unit}, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidName(f"queue {queue!r}: {key} must be {unit}, got {value!r}") from None
    if isinstance(value, float) and value != number:
        raise InvalidName(f"queue {queue!r}: {key} must be whole {unit}, got {value!r}")
    if number <= 0:
        raise InvalidName(f"queue {queue!r}: {key} must be positive, got {value!r}")
    if number > maximum:
        raise InvalidName(f"queue {queue!r}: {key} must be at most {maximum:,}, got {value!r}")
    return number


def queue_arguments(queue: str, arguments: Mapping[str, Any] | None) -> QueueArguments:
    """``x-expires``, ``x-message-ttl`` (milliseconds, at most 2^31-1: an ``integer`` column)
    and ``x-max-priority`` (1-255, RabbitMQ's range: a ``smallint`` column), refused with
    InvalidName (PGJ-103) before anything is written. Other arguments are ignored, as the
    virtual transport always did."""
    args = arguments or {}
    if not isinstance(args, Mapping):
        raise InvalidName(f"queue {queue!r}: arguments must be a mapping, got {args!r}")
    return QueueArguments(
        expires_ms=_queue_number(queue, "x-expires", args.get("x-expires"), MAX_QUEUE_MS,
                                 "milliseconds"),
        message_ttl_ms=_queue_number(queue, "x-message-ttl", args.get("x-message-ttl"),
                                     MAX_QUEUE_MS, "milliseconds"),
        max_priority=_queue_number(queue, "x-max-priority", args.get("x-max-priority"),
                                   MAX_QUEUE_PRIORITY, "a whole number"),
    )


def validate_queue_name(name: object) -> str:
    """Queue names are bound parameters, but must still be sane for operators and NOTIFY."""
    if not isinstance(name, str) or not name:
        raise InvalidName(f"queue name must be a non-empty string, got {name!r}")
    if len(name) > MAX_QUEUE_NAME:
        raise InvalidName(f"queue name is longer than {MAX_QUEUE_NAME} characters: {name[:40]!r}…")
    _check_characters("queue name", name)
    return name
