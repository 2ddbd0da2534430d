"""``pgjobs relay`` and ``pgjobs outbox``: the outbox relay and its table, from the CLI.

Registered by :func:`kombu_pgjobs.ops.cli.main.build_parser` (one call); the commands live here.

The relay's two secrets, the broker URL and the app database's DSN, need never be on its
command line (where ``ps`` and ``/proc/PID/cmdline`` show them to every user of the host):
``--broker-file``/``$PGJOBS_RELAY_BROKER_FILE`` or ``$PGJOBS_RELAY_BROKER`` for the broker,
``--dsn-file``/``$PGJOBS_DSN_FILE`` or ``$PGJOBS_DSN`` for the database (a file holds the URL
alone; surrounding whitespace and the final newline are ignored, as in a Docker or Kubernetes
secret).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from ...broker.relay import Relay
from ...errors import ConfigurationError, InvalidArgument
from ...options import validate_schema_name
from ...store.admin import parse_duration
from ...store.database import connect
from ...store.sql import queries
from ..common import args_dsn

__all__ = ["register"]

#: published rows kept by default before `pgjobs outbox prune` deletes them
DEFAULT_RETENTION = "1d"
#: where the relay's broker URL may come from besides --broker / --broker-file, in order
BROKER_ENV = "PGJOBS_RELAY_BROKER"
BROKER_FILE_ENV = "PGJOBS_RELAY_BROKER_FILE"
#: a file holding the app database's DSN (after --dsn-file, --dsn and the DSN variables)
DSN_FILE_ENV = "PGJOBS_DSN_FILE"
#: the variables the CLI reads a DSN from (kombu_pgjobs.ops.cli.main.DSN_ENV, not imported: a cycle)
_DSN_ENV = ("PGJOBS_DSN", "CELERY_BROKER_URL", "BROKER_URL")


def read_secret(path: str, what: str) -> str:
    """The URL a secret file holds (whitespace around it dropped). Errors name the file and
    the reason, never its content."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read(65_536).strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or type(exc).__name__
        raise ConfigurationError(f"cannot read the {what} from {path!r}: {reason}") from None
    if not text:
        raise ConfigurationError(f"the {what} file {path!r} is empty")
    if any(c in text for c in "\r\n\x00"):
        raise ConfigurationError(f"the {what} file {path!r} holds more than one line: put "
                                 "the URL alone in it")
    return text


def _broker(args: argparse.Namespace) -> str:
    """--broker, --broker-file, $PGJOBS_RELAY_BROKER, $PGJOBS_RELAY_BROKER_FILE: the first
    given."""
    if args.broker:
        return str(args.broker)
    if args.broker_file:
        return read_secret(args.broker_file, "broker URL")
    if os.environ.get(BROKER_ENV):
        return os.environ[BROKER_ENV]
    if os.environ.get(BROKER_FILE_ENV):
        return read_secret(os.environ[BROKER_FILE_ENV], "broker URL")
    raise ConfigurationError(
        f"no broker given: pass --broker URL or --broker-file PATH, or set ${BROKER_ENV} or "
        f"${BROKER_FILE_ENV} (the environment and files keep the URL's password out of the "
        "process list)")


def _dsn_from_file(args: argparse.Namespace) -> None:
    """--dsn-file (before the DSN variables) or $PGJOBS_DSN_FILE (after them) into args.dsn."""
    if args.dsn:
        return
    if args.dsn_file:
        args.dsn = read_secret(args.dsn_file, "database URL")
    elif os.environ.get(DSN_FILE_ENV) and not any(os.environ.get(v) for v in _DSN_ENV):
        args.dsn = read_secret(os.environ[DSN_FILE_ENV], "database URL")


def parse_transport_options(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:  # the text is not echoed: it may hold a password
        raise InvalidArgument(f"--transport-options is not JSON ({exc.msg} at character "
                              f"{exc.pos}): pass a JSON object, e.g. "
                              "'{\"visibility_timeout\": 3600}'") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"--transport-options must be a JSON object, got a "
                              f"{type(value).__name__}")
    return value


def _number(text: str, what: str, low: float) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InvalidArgument(f"--{what} must be a number, got {text!r}") from None
    if not low <= value < 1e9:
        raise InvalidArgument(f"--{what} must be at least {low:g}, got {text!r}")
    return value


def cmd_relay(args: argparse.Namespace) -> None:
    """Publish messages staged in the app database's outbox to the broker (runs until
    stopped; SIGTERM or Ctrl-C ends it after the current batch)."""
    schema = validate_schema_name(args.schema)
    _dsn_from_file(args)
    options = parse_transport_options(args.transport_options)
    relay = Relay(args_dsn(args), _broker(args), schema=schema,
                  batch=int(_number(args.batch, "batch", 1)),
                  lease_ttl=_number(args.lease_ttl, "lease-ttl", 1),
                  poll_interval=_number(args.poll_interval, "poll-interval", 0.01),
                  retry_delay=_number(args.retry_delay, "retry-delay", 0),
                  transport_options=options)
    retention = parse_duration(args.prune_after) if args.prune_after else None
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    last_prune = [0.0]

    def after_batch(n: int) -> None:
        if retention is None or n:
            return
        if time.monotonic() - last_prune[0] > 60:  # idle: prune at most once a minute
            last_prune[0] = time.monotonic()
            prune(relay.dsn, schema, retention)

    try:
        relay.run(stop, on_batch=after_batch)
    except KeyboardInterrupt:
        pass
    return None


def prune(conninfo: str, schema: str, older_than: float, *, limit: int = 10_000) -> int:
    """Delete published outbox rows older than ``older_than`` seconds, in batches of
    ``limit``; the number deleted."""
    with connect(conninfo, prepare=False) as conn:
        return prune_published(conn, schema, older_than, limit=limit)["deleted"]


def prune_published(conn: Any, schema: str, older_than: float, *, dry_run: bool = False,
                    limit: int = 10_000) -> dict[str, int]:
    """Published outbox rows older than ``older_than`` seconds: counted, and deleted in
    batches of ``limit`` (each its own statement) unless ``dry_run``. Staged rows are never
    touched. ``pgjobs prune`` and ``pgjobs outbox prune`` both run it."""
    q = queries(schema)
    row = conn.execute(q["outbox_prunable"], {"older": older_than}).fetchone()
    matched = int(row[0]) if row else 0
    deleted = 0
    while not dry_run and deleted < matched:
        got = conn.execute(q["outbox_prune"], {"older": older_than, "limit": limit}).fetchone()
        n = int(got[0]) if got else 0
        deleted += n
        if n < limit:
            break
    return {"matched": matched, "deleted": deleted}


def cmd_outbox_prune(args: argparse.Namespace) -> dict[str, Any]:
    """Delete outbox rows the relay published more than --older-than ago."""
    older = parse_duration(args.older_than)
    deleted = prune(args_dsn(args), validate_schema_name(args.schema), older)
    return {"schema": args.schema, "older_than_seconds": older, "deleted": deleted}


def cmd_outbox_status(args: argparse.Namespace) -> dict[str, Any]:
    """Staged (not yet published) and published rows of the outbox."""
    with connect(args_dsn(args), prepare=False) as conn:
        row = conn.execute(queries(validate_schema_name(args.schema))["outbox_counts"]
                           ).fetchone()
    staged, published = (int(row[0]), int(row[1])) if row else (0, 0)
    return {"schema": args.schema, "staged": staged, "published": published}


def _pruning(func: Callable[[argparse.Namespace], Any],
             render: Callable[[Any], str]) -> tuple[Callable[..., Any], Callable[..., str]]:
    """``pgjobs prune`` that also deletes outbox rows published more than
    ``--outbox-older-than`` ago (default: ``--older-than``), with the same --batch and
    --dry-run."""

    def cmd(args: argparse.Namespace) -> Any:
        result = func(args)
        older = parse_duration(args.outbox_older_than or args.older_than)
        with connect(args_dsn(args), prepare=False) as conn:
            result["outbox"] = prune_published(conn, validate_schema_name(args.schema), older,
                                               dry_run=args.dry_run, limit=args.batch)
        return result

    def show(result: dict[str, Any]) -> str:
        outbox = result["outbox"]
        if result["dry_run"]:
            return render(result) + f"\nwould delete {outbox['matched']} published outbox rows"
        return render(result) + f"\ndeleted {outbox['deleted']} published outbox rows"

    return cmd, show


def register(sub: Any, common: argparse.ArgumentParser,
             add: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``relay`` and ``outbox {status,prune}`` to the ``pgjobs`` parser, and the published
    outbox rows to ``pgjobs prune``."""
    prune = sub.choices["prune"]
    prune.add_argument("--outbox-older-than", metavar="DURATION",
                       help="delete outbox rows published more than this ago "
                            "(default: --older-than)")
    func, render = _pruning(prune.get_default("func"), prune.get_default("render"))
    prune.set_defaults(func=func, render=render)
    p = add(sub, "relay", cmd_relay, str, common)
    p.add_argument("--broker", metavar="URL",
                   help="the broker to publish to (redis://, amqp://, pgjobs://); default: "
                        f"--broker-file, ${BROKER_ENV}, ${BROKER_FILE_ENV}")
    p.add_argument("--broker-file", metavar="PATH",
                   help="a file holding the broker URL (keeps its password off the command "
                        "line)")
    p.add_argument("--dsn-file", metavar="PATH",
                   help="a file holding the app database's URL, read when --dsn is not given "
                        f"(before $PGJOBS_DSN; ${DSN_FILE_ENV} after it)")
    p.add_argument("--batch", default="100", help="rows claimed and published per round "
                   "(default 100; bounds the duplicates a crashed relay can cause)")
    p.add_argument("--lease-ttl", default="30", metavar="SECONDS",
                   help="lease on claimed rows (default 30): a dead relay's rows come back "
                        "after it")
    p.add_argument("--poll-interval", default="1", metavar="SECONDS",
                   help="longest wait for a NOTIFY before looking anyway (default 1)")
    p.add_argument("--retry-delay", default="5", metavar="SECONDS",
                   help="wait before a failed publish is tried again (default 5)")
    p.add_argument("--transport-options", metavar="JSON",
                   help="kombu transport options for the broker connection (JSON object)")
    p.add_argument("--prune-after", metavar="DURATION",
                   help="when idle, delete rows published more than this ago (e.g. 1d)")
    outbox = sub.add_parser("outbox", parents=[common],
                            help="the transactional outbox's table: status, prune")
    osub = outbox.add_subparsers(dest="outbox_command", required=True, metavar="COMMAND")
    add(osub, "status", cmd_outbox_status,
        lambda r: f"outbox {r['schema']}: {r['staged']} staged, {r['published']} published",
        common)
    p = add(osub, "prune", cmd_outbox_prune,
            lambda r: f"outbox {r['schema']}: deleted {r['deleted']} published rows", common)
    p.add_argument("--older-than", default=DEFAULT_RETENTION, metavar="DURATION",
                   help=f"published more than this ago (default {DEFAULT_RETENTION})")
