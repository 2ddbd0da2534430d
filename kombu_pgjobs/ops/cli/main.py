"""The ``pgjobs`` operator CLI.

The database comes from ``--dsn`` or, failing that, ``PGJOBS_DSN``, ``CELERY_BROKER_URL`` or
``BROKER_URL`` (pgjobs:// or postgresql:// URLs). Every command takes ``--json`` (before or after
the command name). Bad input, usage errors included, exits with status 2 and prints the error's
stable code; a database problem exits with status 3.

What the CLI prints is read by people in terminals and pasted into tickets, so every line goes
through one place (:func:`_emit`) that removes passwords (``user:pass@`` in URLs, ``password=``
in conninfo, and the literal password of the DSN in use, wherever a driver echoed it), and
text output escapes control characters (ESC, CR, the C1 range, bidi overrides) that a message's
task name, headers or error could carry: a hostile message cannot rewrite the operator's
terminal. ``--json`` output is JSON with every control character escaped by the encoder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NoReturn
from urllib.parse import quote, unquote, urlsplit

import psycopg

from ...errors import (
    ConfigurationError,
    InvalidArgument,
    InvalidName,
    MigrationError,
    PgJobsError,
    UsageError,
)
from ...options import TransportOptions, validate_schema_name
from ...shardmap import DEFAULT as SHARD_DEFAULT
from ...shardmap import shard_label
from ...store import audit, retention
from ...store.admin import (
    DEFAULT_BATCH,
    DEFAULT_BULK_LIMIT,
    DEFAULT_PAGE,
    MAX_LEASES,
    STATES,
)
from ...store.database import connect, conninfo_from_url
from ...store.schema import current_version, latest_version, migrate
from ...url import parse as parse_url
from ..common import (
    DSN_ENV,
    add_command,
    age_text,
    args_dsn,
    args_url,
    open_admin,
    safe_line,
    safe_text,
    shard_map,
    table_text,
    ts_text,
)
from .bulk import add_commands as add_bulk_commands

__all__ = ["build_parser", "main"]


# -- what may reach the terminal ---------------------------------------------------------------
# userinfo of any URL (scheme://user:password@): the password goes, the user stays. Greedy up
# to the last "@" of the word, as urlsplit reads a password holding a raw "@".
_URL_PASSWORD = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://[^\s/@:]*):\S*@")
# libpq conninfo and URL query parameters: password=..., quoted or not
_KV_PASSWORD = re.compile(
    r"""(?i)\b(password\s*=\s*)('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s&;,'"]*)""")
# passwords shorter than this are only removed where they appear as a password (above): a
# literal "pw" replaced everywhere would garble messages instead of protecting anything
_MIN_LITERAL = 4


def _hide_url_password(match: re.Match[str]) -> str:
    # our own hint "pgjobs://user:password@host" is a placeholder, not a secret
    if match.group(0).endswith("://user:password@"):
        return match.group(0)
    return f"{match.group(1)}:***@"


class _Secrets:
    """The passwords this run could leak: those of --dsn, of the DSN variables, of any URL on
    the command line (a DSN given where a command was expected is echoed by argparse), and
    ``PGPASSWORD``."""

    def __init__(self, argv: Iterable[str]) -> None:
        found: set[str] = set()
        candidates = [a for a in argv if "://" in a]
        candidates += [os.environ[v] for v in DSN_ENV if os.environ.get(v)]
        for text in candidates:
            try:
                password = urlsplit(text.split("=", 1)[-1] if text.startswith("--") else text
                                    ).password
            except ValueError:
                password = None
            if password:
                found |= {password, unquote(password), quote(unquote(password), safe="")}
        if os.environ.get("PGPASSWORD"):
            found.add(os.environ["PGPASSWORD"])
        # longest first, so a password containing another is removed whole
        self.literals = sorted((p for p in found if len(p) >= _MIN_LITERAL), key=len,
                               reverse=True)

    def scrub(self, text: str) -> str:
        text = _URL_PASSWORD.sub(_hide_url_password, text)
        text = _KV_PASSWORD.sub(r"\1***", text)
        for literal in self.literals:
            text = text.replace(literal, "***")
        return text

    def scrub_all(self, value: Any) -> Any:
        """Every string in a JSON-ready value scrubbed (keys too)."""
        if isinstance(value, str):
            return self.scrub(value)
        if isinstance(value, dict):
            return {self.scrub_all(k): self.scrub_all(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.scrub_all(v) for v in value]
        return value


def _emit(secrets: _Secrets, value: Any, *, as_json: bool, err: bool = False) -> None:
    """The one place output leaves the CLI: scrubbed of passwords; text escaped for the
    terminal; JSON as JSON (the encoder escapes every control character)."""
    if as_json:
        text = json.dumps(secrets.scrub_all(value), default=str) + "\n"
    else:
        text = secrets.scrub(safe_text(value))
        if not text.endswith("\n"):
            text += "\n"
    stream = sys.stderr if err else sys.stdout
    stream.write(text)
    stream.flush()


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors raised as :class:`UsageError` instead of printed and exited
    on: main() answers them as it answers every error (a code, JSON under --json, no
    password)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (usage: {' '.join(self.format_usage().split()[1:])})")


def _each_shard(args: argparse.Namespace) -> Iterator[tuple[str | None, argparse.Namespace]]:
    """``(None, args)`` without a shard map; else ``(shard, args for its database)`` for the
    default database and each database of the map (the map's URLs take the DSN's user and
    password where they give none, as the transport does)."""
    shardmap = shard_map(args)
    if shardmap is None:
        yield None, args
        return
    options = TransportOptions(schema=args.schema)
    url = args_url(args)
    default = conninfo_from_url(url, options)
    base = parse_url(url)
    seen = {default}
    targets = [(SHARD_DEFAULT, default)]
    for shard_url in shardmap.urls:
        conninfo = conninfo_from_url(shard_url, options, user=base.user, password=base.password)
        if conninfo not in seen:
            seen.add(conninfo)
            targets.append((shard_label(shard_url), conninfo))
    for name, conninfo in targets:
        yield name, argparse.Namespace(**{**vars(args), "shard_dsn": conninfo})


def _shard_column(rows: list[dict[str, Any]],
                  columns: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A SHARD column first when the rows came from a shard map's databases."""
    return [("SHARD", "shard"), *columns] if any("shard" in r for r in rows) else columns


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, default=str)


# -- commands ------------------------------------------------------------------------------
def cmd_migrate(args: argparse.Namespace) -> dict[str, Any]:
    """Install or upgrade the schema (idempotent; safe to run from many hosts at once)."""
    validate_schema_name(args.schema)  # before connecting: a bad name is bad input (2), not 3
    results = []
    for shard, one in _each_shard(args):
        with connect(args_dsn(one)) as conn:
            before = current_version(conn, args.schema)
            applied = migrate(conn, args.schema)
            result = {"schema": args.schema, "from_version": before,
                      "to_version": latest_version(), "applied": applied}
        if shard is None:
            return result
        results.append({"shard": shard, **result})
    return {"schema": args.schema, "shards": results}


def _render_migrate(result: dict[str, Any]) -> str:
    if "shards" in result:
        return "\n".join(f"{r['shard']}: {_render_migrate(r)}" for r in result["shards"])
    if result["applied"]:
        return (f"schema {result['schema']}: migrated {result['from_version']} -> "
                f"{result['to_version']} (applied {', '.join(map(str, result['applied']))})")
    return f"schema {result['schema']}: up to date at version {result['to_version']}"


def cmd_queues(args: argparse.Namespace) -> dict[str, Any]:
    """Per queue: ready, delayed, running, waiting, dead, paused, oldest ready age, throughput."""
    queues = []
    for shard, one in _each_shard(args):
        with open_admin(one) as admin:
            rows = admin.queues(args.queue, minutes=args.minutes)
        queues += rows if shard is None else [{"shard": shard, **q} for q in rows]
    return {"minutes": args.minutes, "queues": queues}


def _render_queues(result: dict[str, Any]) -> str:
    rows = []
    for q in result["queues"]:
        rows.append({**q, "oldest": age_text(q["oldest_ready_age"]),
                     "settled": " ".join(f"{k}={v}" for k, v in sorted(q["settled"].items()))})
    if not rows:
        return "no queues"
    return table_text(rows, _shard_column(rows, [
        ("QUEUE", "queue"), ("READY", "ready"), ("DELAYED", "delayed"),
        ("RUNNING", "running"), ("WAITING", "waiting"), ("DEAD", "dead"),
        ("PAUSED", "paused"),
        ("OLDEST READY", "oldest"), ("COMPLETED/MIN", "completed_per_minute"),
        (f"SETTLED (last {result['minutes']}m)", "settled")]))


def _states(values: list[str] | None) -> list[str] | None:
    if not values:
        return None
    return [s.strip() for v in values for s in v.split(",") if s.strip()]


def cmd_ls(args: argparse.Namespace) -> dict[str, Any]:
    """List messages (live, or dead with --state dead), oldest id first, a page at a time."""
    with open_admin(args) as admin:
        return admin.ls(states=_states(args.state), queue=args.queue, task=args.task,
                        tenant=args.tenant, created_after=args.created_after,
                        created_before=args.created_before, after=args.after,
                        limit=args.limit)


def _render_page(result: dict[str, Any], columns: list[tuple[str, str]]) -> str:
    if not result["items"]:
        return "no messages"
    text = table_text(result["items"], columns)
    if result["next"]:
        text += f"\n-- more: add --after {result['next']}"
    return text


def _render_ls(result: dict[str, Any]) -> str:
    for r in result["items"]:
        r["when"] = ts_text(r["died_at"] if r["state"] == "dead" else r["run_at"])
        r["holder"] = r["worker"] or r.get("reason") or (
            f"on {r['waiting_on']}" if r.get("waiting_on") else None)
        if r.get("cancelled_at"):
            r["state"] += " (cancelled)"
    return _render_page(result, [
        ("ID", "id"), ("QUEUE", "queue"), ("STATE", "state"), ("TASK", "task"),
        ("ATTEMPTS", "attempts"), ("PRI", "priority"), ("DUE/DIED", "when"),
        ("WORKER/REASON", "holder"), ("TENANT", "tenant"), ("TASK ID", "task_id")])


def cmd_show(args: argparse.Namespace) -> dict[str, Any]:
    """One message or dead letter: headers, arguments, attempts, lease holder, last error."""
    with open_admin(args) as admin:
        return admin.show(args.id, body=args.body)


def _render_show(result: dict[str, Any]) -> str:
    # every field a message carries is escaped to one line; the traceback keeps its lines
    r = {k: v if k in ("headers", "body", "limits", "last_error") or v is None
         or isinstance(v, (int, float)) else safe_line(v) for k, v in result.items()}
    lines = [f"id:           {r['id']}", f"queue:        {r['queue']}",
             f"state:        {r['state']}" + (" (cancelled)" if r.get("cancelled_at") else ""),
             f"task:         {r['task']}  [{r['task_id']}]",
             f"args:         {r['args']}", f"kwargs:       {r['kwargs']}",
             f"attempts:     {r['attempts']} of {r['max_attempts'] or 'the transport default'}"
             f" (claims: {r['claim']}, Celery retries: {r['retries']})",
             f"priority:     {r['priority']}", f"created:      {ts_text(r['created_at'])}"]
    if r["state"] == "dead":
        lines += [f"died:         {ts_text(r['died_at'])}", f"reason:       {r['reason']}"]
    else:
        lines.append(f"due:          {ts_text(r['run_at'])}")
    if r["state"] == "running":
        lines.append(f"lease holder: {r['worker']} "
                     f"(lease ends in {age_text(r['lease_remaining'])})")
    if r["state"] == "waiting":
        cap = next((c["limit"] for c in (r.get("limits") or {}).get("concurrency", [])
                    if c["key"] == r["waiting_on"]), "?")
        lines.append(f"waiting:      concurrency key {r['waiting_on']} is full "
                     f"({r['waiting_on_held']} of {cap} running; `pgjobs limits` shows them)")
    if r.get("limits"):
        lines.append(f"limits:       {_pretty(r['limits'])}")
    if r.get("tenant"):
        lines.append(f"tenant:       {r['tenant']}")
    if r.get("last_error"):
        err = dict(r["last_error"])
        tb = err.pop("traceback", None)
        lines.append(f"last error:   {_pretty(err)}")
        if tb:
            lines.append("traceback:\n" + safe_text(tb).rstrip())
    lines.append(f"headers:      {_pretty(r['headers'])}")
    if "body" in r:
        lines.append(f"body:         {_pretty(r['body'])}")
    return "\n".join(lines)


def cmd_dead_ls(args: argparse.Namespace) -> dict[str, Any]:
    """List dead letters, oldest id first, a page at a time."""
    with open_admin(args) as admin:
        return admin.dead_ls(queue=args.queue, task=args.task, reason=args.reason,
                             tenant=args.tenant, after=args.after, limit=args.limit)


def _render_dead_ls(result: dict[str, Any]) -> str:
    for r in result["items"]:
        r["died"] = ts_text(r["died_at"])
        r["error"] = ": ".join(x for x in (r["error_type"], r["error_message"]) if x) or None
    return _render_page(result, [
        ("ID", "id"), ("QUEUE", "queue"), ("TASK", "task"), ("REASON", "reason"),
        ("RULE", "rule"), ("ATTEMPTS", "attempts"), ("DIED", "died"), ("ERROR", "error")])


def cmd_dead_show(args: argparse.Namespace) -> dict[str, Any]:
    """One dead letter: why it died, its error and traceback, headers and arguments."""
    with open_admin(args) as admin:
        return admin.dead_show(args.id, body=args.body)


def cmd_dead_requeue(args: argparse.Namespace) -> dict[str, Any]:
    """Put dead letters back to ready (attempts reset, same id if free) and wake consumers."""
    if args.all == bool(args.ids):
        raise ConfigurationError(
            "give dead-letter ids, or --all with --queue, --task and/or --tenant (not both)")
    with open_admin(args) as admin:
        return admin.dead_requeue(args.ids or None, queue=args.queue, reason=args.reason,
                                  limit=args.limit, tenant=args.tenant, task=args.task)


def _render_requeued(result: dict[str, Any]) -> str:
    parts = []
    moved = result.get("requeued", [])
    if moved:
        ids = ", ".join(str(r["id"]) if r["id"] == r["new_id"] else f"{r['id']}->{r['new_id']}"
                        for r in moved)
        parts.append(f"requeued {len(moved)}: {ids}")
    if result.get("made_due"):
        parts.append(f"made due now: {', '.join(map(str, result['made_due']))}")
    if result.get("unchanged"):
        parts.append(f"already ready: {', '.join(map(str, result['unchanged']))}")
    if result.get("skipped"):
        parts.append(f"skipped (locked by a concurrent command): "
                     f"{', '.join(map(str, result['skipped']))}")
    if result.get("remaining"):
        parts.append(f"{result['remaining']} remaining: run again")
    return "\n".join(parts) or "nothing to requeue"


def cmd_dead_purge(args: argparse.Namespace) -> dict[str, Any]:
    """Delete dead letters by id, or by age/queue/reason in bounded batches (--dry-run counts)."""
    with open_admin(args) as admin:
        return admin.dead_purge(args.ids or None, queue=args.queue, reason=args.reason,
                                older_than=args.older_than, limit=args.limit,
                                batch=args.batch, dry_run=args.dry_run)


def _render_dead_purge(r: dict[str, Any]) -> str:
    if r["dry_run"]:
        return f"would purge {r['matched']} dead letters (dry run)"
    text = f"purged {r['purged']} of {r['matched']} dead letters"
    return text + (f"; {r['remaining']} remaining: run again" if r["remaining"] else "")


def cmd_requeue(args: argparse.Namespace) -> dict[str, Any]:
    """Run messages now: dead letters go back to ready, delayed messages become due."""
    with open_admin(args) as admin:
        return admin.requeue(args.ids)


def cmd_cancel(args: argparse.Namespace) -> dict[str, Any]:
    """Cancel messages: queued ones become dead letters (reason cancelled), running ones stop.

    A running message's holder learns of the cancel within a second and ends the run (with
    celery_ext in the worker: the prefork child terminated, a green thread killed, a thread
    flagged for celery_ext.checkpoint()); its message then goes to the dead letters as
    cancelled. Dead letters are kept: `pgjobs dead requeue` brings one back."""
    with open_admin(args) as admin:
        result = admin.cancel(args.ids, task_ids=args.task_id or ())
    result.pop("by_task", None)
    return result


def _render_cancel(r: dict[str, Any]) -> str:
    parts = []
    if r["cancelled"]:
        parts.append(f"cancelled (now dead letters, reason cancelled): "
                     f"{', '.join(map(str, r['cancelled']))}")
    if r["marked"]:
        parts.append(f"running, told to stop (then dead letters, reason cancelled): "
                     f"{', '.join(map(str, r['marked']))}")
    return "\n".join(parts)


def cmd_purge(args: argparse.Namespace) -> dict[str, Any]:
    """Delete a queue's ready, delayed and waiting messages (bounded by --limit); running finish."""
    with open_admin(args) as admin:
        return admin.purge(args.queue, limit=args.limit)


def _render_purge(r: dict[str, Any]) -> str:
    text = f"queue {r['queue']}: purged {r['purged']}"
    if r["remaining"]:
        text += f"; {r['remaining']} remaining: run again"
    if r["running"]:
        text += f"; {r['running']} running (left to finish)"
    return text


def cmd_pause(args: argparse.Namespace) -> dict[str, Any]:
    """Pause a queue: no claims until resumed; running messages finish."""
    with open_admin(args) as admin:
        return admin.pause(args.queue, paused=True, create=args.create)


def cmd_resume(args: argparse.Namespace) -> dict[str, Any]:
    """Resume a paused queue and wake its idle consumers."""
    with open_admin(args) as admin:
        return admin.pause(args.queue, paused=False)


def _render_pause(r: dict[str, Any]) -> str:
    return f"queue {r['queue']}: {'paused' if r['paused'] else 'resumed'}"


def cmd_limits(args: argparse.Namespace) -> dict[str, Any]:
    """Concurrency keys: slots held, cap, holders, messages waiting; and rate windows."""
    merged: dict[str, Any] = {}
    for shard, one in _each_shard(args):
        with open_admin(one) as admin:
            result = admin.limits(prefix=args.key, limit=args.limit)
        if shard is None:
            return result
        for part, rows in result.items():
            if isinstance(rows, list):
                merged.setdefault(part, []).extend({"shard": shard, **r} for r in rows)
            else:
                merged.setdefault(part, rows)
    return merged


def _render_limits(result: dict[str, Any]) -> str:
    if not result["keys"] and not result["rates"]:
        return "no limits in use"
    parts = []
    if result["keys"]:
        rows = [{**k, "holders": " ".join(map(str, k["holders"][:8])) +
                 (" ..." if len(k["holders"]) > 8 else ""),
                 "oldest": age_text(k["oldest_waiting_age"])} for k in result["keys"]]
        parts.append(table_text(rows, _shard_column(rows, [
            ("KEY", "key"), ("HELD", "held"), ("CAP", "cap"), ("WAITING", "waiting"),
            ("OLDEST WAITING", "oldest"), ("HELD BY", "holders")])))
    if result["rates"]:
        rates = [{**r, "window": ts_text(r["window_start"])} for r in result["rates"]]
        parts.append(table_text(rates, _shard_column(rates, [
            ("RATE KEY", "key"), ("WINDOW START", "window"), ("STARTS", "starts")])))
    return "\n\n".join(parts)


def cmd_workers(args: argparse.Namespace) -> dict[str, Any]:
    """Live consumers, the leases they hold, and processes gone with leases still held."""
    workers = []
    for shard, one in _each_shard(args):
        with open_admin(one) as admin:
            rows = admin.workers(leases=args.leases)
        workers += rows if shard is None else [{"shard": shard, **w} for w in rows]
    return {"workers": workers}


def _render_workers(result: dict[str, Any]) -> str:
    rows = result["workers"]
    if not rows:
        return "no workers"
    for w in rows:
        w["seen"] = age_text(w["last_seen_age"]) + " ago" if w["last_seen_age"] is not None \
            else "gone"
        w["expiry"] = age_text(w["next_expiry"])
    text = table_text(rows, _shard_column(rows, [
        ("WORKER", "worker"), ("ALIVE", "alive"), ("QUEUES", "queues"),
        ("RUNNING", "running"), ("NEXT LEASE END", "expiry"), ("LAST SEEN", "seen")]))
    held = [({"shard": w["shard"]} if "shard" in w else {}, w["worker"], lease)
            for w in rows for lease in w["leases"]]
    if held:
        leases = [{**where, "worker": who, **lease, "ends": age_text(lease["lease_remaining"])}
                  for where, who, lease in held]
        text += "\n\n" + table_text(leases, _shard_column(leases, [
            ("WORKER", "worker"), ("ID", "id"), ("QUEUE", "queue"), ("TASK", "task"),
            ("ATTEMPTS", "attempts"), ("LEASE ENDS IN", "ends"), ("CANCELLED", "cancelled")]))
    return text


def cmd_metrics(args: argparse.Namespace) -> Any:
    """Prometheus metrics (text exposition); --serve PORT serves them over HTTP."""
    from ..metrics import MetricsSource, ShardedMetrics, collect, make_server, merge, render

    shards = list(_each_shard(args))
    if args.serve is None:
        per_shard = []
        for shard, one in shards:
            with open_admin(one) as admin:
                per_shard.append((shard, collect(admin, tenants=args.tenants,
                                                 queues=args.queues)))
        metrics = per_shard[0][1] if per_shard[0][0] is None else merge(per_shard)
        if args.json:
            return {"metrics": [{"name": m.name, "type": m.kind, "help": m.help,
                                 "samples": [{"labels": lb, "value": v} for lb, v in m.samples]}
                                for m in metrics]}
        return render(metrics)
    if not 0 <= args.serve <= 65535:
        raise InvalidArgument(f"--serve port {args.serve} is out of range 0-65535")
    source: MetricsSource | ShardedMetrics = \
        MetricsSource(args_dsn(args), args.schema, tenants=args.tenants, queues=args.queues) \
        if shards[0][0] is None else ShardedMetrics(
            [(str(shard), MetricsSource(args_dsn(one), args.schema, tenants=args.tenants,
                                        queues=args.queues))
             for shard, one in shards])
    source.metrics()  # fail now, with the error's code, rather than on the first scrape
    try:
        server = make_server(source.text, args.serve, args.bind)
    except (OSError, OverflowError) as exc:
        source.close()
        raise InvalidArgument(f"cannot serve metrics on {args.bind}:{args.serve}: {exc}") \
            from None
    host, port = server.server_address[:2]
    url = f"http://{host}:{port}/metrics"
    print(json.dumps({"serving": url}) if args.json else f"pgjobs: serving metrics on {url}",
          flush=True)  # our own address: nothing to scrub or escape
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        source.close()
    return None


def cmd_prune(args: argparse.Namespace) -> dict[str, Any]:
    """Retention: delete old dead letters and roll old counter buckets up, in bounded batches."""
    with open_admin(args) as admin:
        result = admin.prune(args.older_than, counters_older_than=args.counters_older_than,
                             dry_run=args.dry_run, limit=args.limit, batch=args.batch)
        if args.dry_run and current_version(admin.conn, admin.schema) >= \
                retention.RETENTION_VERSION:  # what the automatic sweep would remove next
            result["sweep"] = retention.plan(admin.conn, admin.schema, _sweep_options(args))
        return result


def _sweep_options(args: argparse.Namespace) -> TransportOptions:
    """The workers' retention windows for ``prune --dry-run``: ``--transport-options`` (the
    app's ``broker_transport_options`` as JSON), else the defaults."""
    from .relay import parse_transport_options  # relay_cli imports this module

    given = parse_transport_options(getattr(args, "transport_options", None)) or {}
    return TransportOptions.parse({**given, "schema": args.schema}, warn=False)


def _render_prune(r: dict[str, Any]) -> str:
    d, c = r["dead_letters"], r["counter_buckets"]
    if r["dry_run"]:
        text = (f"would delete {d['matched']} dead letters "
                f"(died before {ts_text(d['cutoff'])}) and "
                f"roll up {c['matched']} counter buckets (before {ts_text(c['cutoff'])}) (dry run)")
        sweep = r.get("sweep")
        if sweep:
            kinds = ", ".join(f"{k.replace('_', ' ')} {v['matched']}"
                              for k, v in sweep["kinds"].items())
            text += (f"\nthe next automatic sweep{'' if sweep['enabled'] else ' (off)'} "
                     f"would remove: {kinds}")
        return text
    text = (f"deleted {d['deleted']} dead letters, rolled up {c['folded']} counter buckets")
    if d["remaining"] or c["remaining"]:
        text += f"; remaining {d['remaining']} dead letters, {c['remaining']} buckets: run again"
    return text


def cmd_audit(args: argparse.Namespace) -> dict[str, Any]:
    """The audit log: who changed what through this CLI or the dashboard, newest first."""
    if not 1 <= args.limit <= audit.MAX_LIMIT:
        raise InvalidArgument(f"--limit must be between 1 and {audit.MAX_LIMIT}, "
                              f"got {args.limit}")
    with open_admin(args) as admin:
        if current_version(admin.conn, admin.schema) < audit.AUDIT_VERSION:
            raise MigrationError(f"the audit log needs schema version {audit.AUDIT_VERSION}: "
                                 "run `pgjobs migrate`")
        items = audit.ls(admin.conn, admin.schema, limit=args.limit, before=args.before)
    more = len(items) == args.limit
    return {"items": items, "next": str(items[-1]["id"]) if more and items else None}


def _render_audit(result: dict[str, Any]) -> str:
    rows = [{**r, "when": ts_text(r["at"]), "who": f"{r['origin']}:{r['actor']}@{r['host'] or '-'}",
             "target": json.dumps(r["target"], sort_keys=True, separators=(",", ":"))}
            for r in result["items"]]
    text = table_text(rows, [("ID", "id"), ("WHEN", "when"), ("WHO", "who"),
                         ("ACTION", "action"), ("ROWS", "rows"), ("TARGET", "target")])
    if result.get("next"):
        text += f"\nmore: --before {result['next']}"
    return text


#: the commands that change something: each success is recorded in pgjobs_audit (a dry run
#: is not)
AUDITED = ("dead requeue", "dead purge", "requeue", "cancel", "purge", "pause", "resume",
           "prune", "bulk promote", "bulk requeue", "bulk remove", "webhooks add",
           "webhooks rotate", "webhooks reseal", "webhooks enable", "webhooks disable",
           "schedule add", "schedule pause", "schedule resume", "schedule remove",
           "outbox prune")
#: arguments that are how the CLI runs, not what a command acts on
_NOT_TARGET = frozenset({"func", "render", "json", "schema", "audit", "shards", "command",
                         "transport_options",
                         "dead_command", "bulk_command", "outbox_command",
                         "schedule_command", "webhooks_command"})


def _audit(args: argparse.Namespace, result: Any) -> None:
    """Record a write that succeeded (see :mod:`kombu_pgjobs.store.audit`): on a schema older than
    the audit log, nothing."""
    action = getattr(args, "audit", None)
    if action is None or getattr(args, "dry_run", False):
        return
    user, host = audit.cli_actor()
    target = {k: v for k, v in vars(args).items() if k not in _NOT_TARGET}
    try:
        with connect(args_dsn(args), prepare=False) as conn:
            if current_version(conn, args.schema) < audit.AUDIT_VERSION:
                return
            audit.record(conn, args.schema, origin="cli", actor=user, host=host,
                         action=action, target=target, rows=audit.rows_of(result))
    except psycopg.Error as exc:
        # The change is made and committed: an error exit would have a script make it again.
        # Said on stderr instead (a role without INSERT on pgjobs_audit: `pgjobs roles
        # --apply` was not run again after `pgjobs migrate`).
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"pgjobs: warning: the change was made but not recorded in the audit log: "
              f"{first}", file=sys.stderr)


def _render_text(result: Any) -> str:
    return str(result)


def _page_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--after", metavar="ID", help="the page after this id (from the last page)")
    p.add_argument("--limit", type=int, default=DEFAULT_PAGE,
                   help=f"rows per page (default {DEFAULT_PAGE}, at most 1000)")


def _bulk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=int, default=DEFAULT_BULK_LIMIT,
                   help=f"most rows changed by this call (default {DEFAULT_BULK_LIMIT}); the "
                        "result says how many remain")


def _global_args(p: argparse.ArgumentParser) -> None:
    """--dsn, --schema and --json, accepted before the command name and after it.

    Their defaults are SUPPRESS and filled in by :func:`_resolve`: with a real default, the
    subcommand's parser would overwrite a value given before the command with its own
    default."""
    p.add_argument("--dsn", default=argparse.SUPPRESS,
                   help="pgjobs:// or postgresql:// URL (default: $PGJOBS_DSN, "
                        "$CELERY_BROKER_URL, $BROKER_URL)")
    p.add_argument("--schema", default=argparse.SUPPRESS,
                   help="pgjobs schema (default: $PGJOBS_SCHEMA or pgjobs)")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                   help="machine-readable output, errors included")


def _shards_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shards", metavar="JSON|@FILE",
                   help="shard map (the transport's shards option): every database it names "
                        "is shown too (default: $PGJOBS_SHARDS)")


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    args.dsn = getattr(args, "dsn", None)
    if getattr(args, "schema", None) == "":  # `migrate --schema ''` migrated 'pgjobs'
        raise InvalidName("--schema is empty: name the schema (1-48 characters of a-z, 0-9 "
                          "and _), or leave the option out for $PGJOBS_SCHEMA or 'pgjobs'")
    args.schema = getattr(args, "schema", None) or os.environ.get("PGJOBS_SCHEMA", "pgjobs")
    args.json = getattr(args, "json", False)
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pgjobs", description=__doc__.splitlines()[0].replace("``", ""))
    _global_args(parser)
    common = _Parser(add_help=False)
    _global_args(common)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = add_command(sub, "migrate", cmd_migrate, _render_migrate, common)
    _shards_arg(p)

    p = add_command(sub, "queues", cmd_queues, _render_queues, common)
    _shards_arg(p)
    p.add_argument("--queue", help="only this queue")
    p.add_argument("--minutes", type=int, default=5,
                   help="throughput window in minutes (default 5)")

    p = add_command(sub, "ls", cmd_ls, _render_ls, common)
    p.add_argument("--queue")
    p.add_argument("--state", action="append",
                   help=f"{', '.join(STATES)} (repeat or comma-separate; default: live ones)")
    p.add_argument("--task", help="Celery task name")
    p.add_argument("--tenant", help="the x-pgjobs-tenant header")
    p.add_argument("--created-after", metavar="TIME",
                   help="ISO 8601 time, or a duration ago (2h, 7d)")
    p.add_argument("--created-before", metavar="TIME")
    _page_args(p)

    p = add_command(sub, "show", cmd_show, _render_show, common)
    p.add_argument("id")
    p.add_argument("--body", action="store_true",
                   help="decode the JSON body too (arguments as sent, unmasked)")

    p = add_command(sub, "limits", cmd_limits, _render_limits, common)
    _shards_arg(p)
    p.add_argument("--key", help="only keys starting with this (e.g. key:sync_account:)")
    p.add_argument("--limit", type=int, default=DEFAULT_PAGE,
                   help=f"most keys listed (default {DEFAULT_PAGE}, at most 1000)")

    dead = sub.add_parser("dead", parents=[common],
                          help="dead letters: ls, show, requeue, purge")
    dsub = dead.add_subparsers(dest="dead_command", required=True, metavar="COMMAND")
    p = add_command(dsub, "ls", cmd_dead_ls, _render_dead_ls, common)
    p.add_argument("--queue")
    p.add_argument("--task")
    p.add_argument("--reason", help="e.g. rejected, failed, lease_expired_final_attempt")
    p.add_argument("--tenant")
    _page_args(p)
    p = add_command(dsub, "show", cmd_dead_show, _render_show, common)
    p.add_argument("id")
    p.add_argument("--body", action="store_true")
    p = add_command(dsub, "requeue", cmd_dead_requeue, _render_requeued, common)
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--all", action="store_true",
                   help="every dead letter of --queue, --task and/or --tenant")
    p.add_argument("--queue")
    p.add_argument("--task", help="with --all: only dead letters of this Celery task")
    p.add_argument("--reason", help="with --all: only dead letters with this reason")
    p.add_argument("--tenant", help="with --all: only dead letters of this tenant "
                                    "(the x-pgjobs-tenant header)")
    _bulk_args(p)
    p = add_command(dsub, "purge", cmd_dead_purge, _render_dead_purge, common)
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--older-than", metavar="DURATION", help="died more than this ago (7d)")
    p.add_argument("--queue")
    p.add_argument("--reason")
    p.add_argument("--dry-run", action="store_true", help="count only")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per transaction")
    _bulk_args(p)

    p = add_command(sub, "requeue", cmd_requeue, _render_requeued, common)
    p.add_argument("ids", nargs="+", metavar="ID")
    p = add_command(sub, "cancel", cmd_cancel, _render_cancel, common)
    p.add_argument("ids", nargs="*", metavar="ID")
    p.add_argument("--task-id", action="append", metavar="TASK_ID",
                   help="a Celery task id (repeatable): its live message")
    p = add_command(sub, "purge", cmd_purge, _render_purge, common)
    p.add_argument("queue")
    _bulk_args(p)
    add_bulk_commands(sub, common, add_command, open_admin)  # pgjobs bulk promote|remove (bulk.py)
    p = add_command(sub, "pause", cmd_pause, _render_pause, common)
    p.add_argument("queue")
    p.add_argument("--create", action="store_true",
                   help="pause a queue that does not exist yet (ahead of a deploy)")
    p = add_command(sub, "resume", cmd_resume, _render_pause, common)
    p.add_argument("queue")

    p = add_command(sub, "workers", cmd_workers, _render_workers, common)
    _shards_arg(p)
    p.add_argument("--leases", type=int, default=20,
                   help=f"leases listed per worker (default 20, at most {MAX_LEASES})")

    p = add_command(sub, "metrics", cmd_metrics, _render_text, common)
    _shards_arg(p)
    p.add_argument("--serve", type=int, metavar="PORT",
                   help="serve /metrics over HTTP on this port (0: any free port)")
    p.add_argument("--bind", default="127.0.0.1", help="address to serve on (127.0.0.1)")
    p.add_argument("--tenants", type=int, default=10, metavar="N",
                   help="per-tenant samples for the N tenants with the most live messages "
                        "(default 10; 0: none)")
    p.add_argument("--queues", type=int, default=100, metavar="N",
                   help="per-queue samples for the N queues with the most messages (settled "
                        "totals: the most settled); the rest summed as queue=\"(other)\" "
                        "(default 100; 0: every queue)")

    p = add_command(sub, "prune", cmd_prune, _render_prune, common)
    p.add_argument("--older-than", required=True, metavar="DURATION",
                   help="delete dead letters that died more than this ago (7d, 12h)")
    p.add_argument("--counters-older-than", metavar="DURATION",
                   help="roll up counter buckets older than this (default: --older-than)")
    p.add_argument("--dry-run", action="store_true", help="print the exact counts only")
    p.add_argument("--batch", type=int, default=DEFAULT_BATCH, help="rows per transaction")
    p.add_argument("--limit", type=int, default=100_000, help="most rows per table per call")
    p.add_argument("--transport-options", metavar="JSON",
                   help="with --dry-run: the workers' broker_transport_options (JSON), whose "
                        "retention_* windows the next automatic sweep applies (default: the "
                        "defaults)")

    from .webhooks import register as register_webhooks  # its module imports this one
    register_webhooks(sub, common, add_command)
    from .relay import register as register_outbox  # `relay`, `outbox` (issue 13)
    register_outbox(sub, common, add_command)
    from .schedule import add_schedule_commands  # here: schedule_cli imports cli
    add_schedule_commands(sub, common)
    from ..dashboard.command import register as register_dashboard  # argparse only, no web
    register_dashboard(sub, common)
    from .roles import register as register_roles  # `roles` (issue 28)
    register_roles(sub, common, add_command)
    from .steps import register as register_steps  # `steps`, --from-step (issue 32)
    register_steps(sub, common, add_command, open_admin)

    from .history import register as register_history  # `history`, `stats` (issue 34)
    register_history(sub, common, add_command, open_admin)

    p = add_command(sub, "audit", cmd_audit, _render_audit, common)
    p.add_argument("--limit", type=int, default=DEFAULT_PAGE,
                   help=f"rows (default {DEFAULT_PAGE}, at most {audit.MAX_LIMIT})")
    p.add_argument("--before", type=int, metavar="ID", help="the rows before this audit id")
    for name in AUDITED:  # issue 34: every write is recorded in pgjobs_audit
        _subparser(sub, name.split()).set_defaults(audit=name)
    return parser


def _subparser(sub: Any, path: list[str]) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.choices[path[0]]
    for name in path[1:]:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = subs[0].choices[name]
    return parser


def _exit_code(exc: PgJobsError) -> int:
    return 2 if isinstance(exc, ConfigurationError) \
        or exc.code.startswith(("PGJ-4", "PGJ-8", "PGJ-9")) else 3


def _wants_json(argv: Sequence[str]) -> bool:
    """--json on a command line argparse could not parse (abbreviations included)."""
    for token in argv:
        if token == "--":
            break
        if token.startswith("--j") and "--json".startswith(token):
            return True
    return False


def _database_error(exc: psycopg.Error) -> tuple[dict[str, Any], str]:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ({"error": {"code": None, "sqlstate": exc.sqlstate,
                       "message": f"database error: {message}"}},
            f"pgjobs: database error: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    secrets = _Secrets(argv)
    for stream in (sys.stdout, sys.stderr):  # a lone surrogate must not crash the output
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(errors="backslashreplace")
    as_json = _wants_json(argv)
    try:
        try:
            if any("\x00" in a for a in argv):
                raise UsageError("an argument holds a NUL character")
            args = _resolve(build_parser().parse_args(argv))
            as_json = args.json
            result = args.func(args)
            _audit(args, result)
        except PgJobsError as exc:
            if as_json:
                _emit(secrets, {"error": {"code": exc.code, "message": exc.message}},
                      as_json=True)
            else:
                _emit(secrets, f"pgjobs: error [{exc.code}] {exc.message}", as_json=False,
                      err=True)
            return _exit_code(exc)
        except psycopg.Error as exc:
            payload, line = _database_error(exc)
            if as_json:
                _emit(secrets, payload, as_json=True)
            else:
                _emit(secrets, line, as_json=False, err=True)
            return 3
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            raise
        except Exception as exc:  # a bug: say so in one line, without a password in it
            if os.environ.get("PGJOBS_DEBUG"):
                _emit(secrets, traceback.format_exc(), as_json=False, err=True)
            payload = {"error": {"code": None,
                                 "message": f"internal error: {type(exc).__name__}: {exc}"}}
            if as_json:
                _emit(secrets, payload, as_json=True)
            else:
                _emit(secrets, f"pgjobs: {payload['error']['message']} (set PGJOBS_DEBUG=1 "
                      "for the traceback)", as_json=False, err=True)
            return 1
        if result is None:
            return 0
        if as_json:
            _emit(secrets, result, as_json=True)
        elif isinstance(result, str):
            _emit(secrets, result, as_json=False)
        else:
            _emit(secrets, args.render(result), as_json=False)
        return 0
    except BrokenPipeError:  # `pgjobs ls | head`: the reader has what it wanted
        try:  # so the interpreter's flush at exit cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
