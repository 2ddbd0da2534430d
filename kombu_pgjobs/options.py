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

from .errors import InvalidName, InvalidOption

__all__ = [
    "FOREIGN_OPTIONS",
    "OPTIONS",
    "PASSTHROUGH_OPTIONS",
    "TransportOptions",
    "UnknownOptionWarning",
    "validate_queue_name",
    "validate_schema_name",
]

SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,47}$")
MAX_QUEUE_NAME = 200


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
    Option("max_claim", 100, int, 1, 10_000,
           "Most messages one claim takes when the channel has no prefetch limit."),
    Option("ack_flush_interval", 0.005, float, 0.0, 1.0,
           "Seconds an ack may wait to be folded into the next claim before it is flushed alone."),
    Option("vacuum_every", 2000, int, 0, 10_000_000,
           "Rows this process settles (acks, requeues, dead letters) between its keeper's own "
           "VACUUMs of the job table, which keep the claim index free of dead entries between "
           "autovacuum runs. 0: leave vacuuming to autovacuum."),
    Option("connect_timeout", 10.0, float, 0.1, 600.0, "Seconds to wait for a connection."),
    Option("connect_options", None, dict,
           doc="Extra libpq connection parameters, e.g. {'sslmode': 'require'}."),
    Option("application_name", "pgjobs", str, doc="application_name of pgjobs connections."),
    Option("embedded_data_dir", None, str,
           doc="Data directory of the embedded server (pgjobs:// with no host)."),
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
        except (TypeError, ValueError):
            raise InvalidOption(
                f"transport option {opt.name!r} must be a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise InvalidOption(f"transport option {opt.name!r} must be finite, got {raw!r}")
        if opt.kind is int:
            if value != int(value):
                raise InvalidOption(
                    f"transport option {opt.name!r} must be a whole number, got {raw!r}")
            value = int(value)
        if (opt.minimum is not None and value < opt.minimum) or (
            opt.maximum is not None and value > opt.maximum
        ):
            raise InvalidOption(
                f"transport option {opt.name!r} must be between {opt.minimum:g} and "
                f"{opt.maximum:g}, got {raw!r}")
        return value
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
    durable_publish: bool = True
    confirm_publish: bool = True
    event_loop: bool = True
    auto_migrate: bool = True
    max_claim: int = 100
    ack_flush_interval: float = 0.005
    vacuum_every: int = 2000
    connect_timeout: float = 10.0
    connect_options: dict[str, str] | None = field(default=None, hash=False)
    application_name: str = "pgjobs"
    embedded_data_dir: str | None = None

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
        return opts

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def validate_schema_name(name: str) -> str:
    """Schema names are identifiers we interpolate (quoted) into SQL: keep them boring."""
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise InvalidName(
            f"schema name {name!r} is invalid: use 1-48 characters of a-z, 0-9 and _, "
            "starting with a letter or _")
    return name


def validate_queue_name(name: object) -> str:
    """Queue names are bound parameters, but must still be sane for operators and NOTIFY."""
    if not isinstance(name, str) or not name:
        raise InvalidName(f"queue name must be a non-empty string, got {name!r}")
    if len(name) > MAX_QUEUE_NAME:
        raise InvalidName(f"queue name is longer than {MAX_QUEUE_NAME} characters: {name[:40]!r}…")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise InvalidName(f"queue name {name!r} contains control characters")
    return name
