"""``pgjobs webhooks ls | add | rotate ID | show ID | attempts ID | enable ID | disable ID |
reseal``, and the ledger's retention in ``pgjobs prune --webhook-attempts-older-than``.

Registered on the parser by :func:`register` (the only line :mod:`kombu_pgjobs.ops.cli.main` has for
it); everything goes through :class:`~kombu_pgjobs.store.webhooks.WebhookStore`. A secret is taken
from an environment variable or standard input, never from the command line (shell history,
``ps``), and never printed: ``ls`` and ``show`` print ``********``. With the app's Fernet keys
in ``$PGJOBS_WEBHOOK_SECRET_KEYS`` (comma-separated, newest first; another variable with
``--keys-env``), ``add`` and ``rotate`` seal the secret as the app does, and ``reseal`` seals
the plain ones and re-seals the rest with the newest key.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ...errors import InvalidArgument, InvalidWebhookEndpoint, InvalidWebhookSetting, MigrationError
from ...store.admin import Admin, parse_duration
from ...store.schema import current_version
from ...store.webhooks import (
    MASK,
    WEBHOOK_SCHEMA_VERSION,
    SecretBox,
    WebhookStore,
    check_url,
    check_url_egress,
    parse_allow_hosts,
)
from ..common import age_text, open_admin, safe_line, table_text, ts_text

__all__ = ["KEYS_ENV", "register"]

#: where the CLI finds the app's pgjobs_webhook_secret_keys (comma-separated, newest first)
KEYS_ENV = "PGJOBS_WEBHOOK_SECRET_KEYS"


@contextmanager
def _opened(args: argparse.Namespace) -> Iterator[tuple[Admin, WebhookStore]]:
    with open_admin(args) as admin:
        version = current_version(admin.conn, admin.schema)
        if version < WEBHOOK_SCHEMA_VERSION:
            raise MigrationError(
                f"schema {admin.schema!r} is at version {version}; webhooks need "
                f"{WEBHOOK_SCHEMA_VERSION}: run `pgjobs migrate`")
        yield admin, WebhookStore(admin.conn, admin.schema)


def _box(args: argparse.Namespace, required: bool = False) -> SecretBox | None:
    """The app's keys from the environment (``--keys-env``, else $PGJOBS_WEBHOOK_SECRET_KEYS);
    None without them (secrets written as given)."""
    name = getattr(args, "keys_env", None) or KEYS_ENV
    value = os.environ.get(name)
    if not value:
        if required or getattr(args, "keys_env", None):
            raise InvalidWebhookSetting(f"environment variable {name} holds no keys (the "
                                        "app's pgjobs_webhook_secret_keys, comma-separated, "
                                        "newest first)")
        return None
    return SecretBox([k.strip() for k in value.split(",") if k.strip()], what=name)


@contextmanager
def _store(args: argparse.Namespace) -> Iterator[WebhookStore]:
    with _opened(args) as (_, store):
        yield store


def _secret(args: argparse.Namespace) -> str:
    if bool(args.secret_env) == bool(args.secret_stdin):
        raise InvalidWebhookEndpoint(
            "give the secret with --secret-env VAR (an environment variable's name) or "
            "--secret-stdin, never on the command line")
    if args.secret_stdin:
        return sys.stdin.readline().rstrip("\r\n")
    value = os.environ.get(args.secret_env)
    if value is None:
        raise InvalidWebhookEndpoint(f"environment variable {args.secret_env} is not set")
    return value


# -- commands ------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> dict[str, Any]:
    """Webhook endpoints: URL, enabled, consecutive failed deliveries, last attempt."""
    with _store(args) as store:
        return store.ls(after=args.after, limit=args.limit)


def cmd_add(args: argparse.Namespace) -> dict[str, Any]:
    """Add an endpoint; the secret comes from --secret-env VAR or --secret-stdin. A URL whose
    host is an address the egress rule refuses is refused as ``add_endpoint`` refuses it
    (PGJ-805) unless ``--allow-host`` (the app's ``pgjobs_webhook_allow_hosts``) opens it."""
    check_url(args.url)
    names, networks = parse_allow_hosts(args.allow_host or [], "--allow-host",
                                        InvalidArgument)
    check_url_egress(args.url, allow_names=names, allow_networks=networks)
    secret = _secret(args)
    box = _box(args)
    with _store(args) as store:
        store.box = box
        ident = store.add(args.url, secret, description=args.description,
                          disable_after=args.disable_after)
        return store.show(ident)


def cmd_rotate(args: argparse.Namespace) -> dict[str, Any]:
    """Replace an endpoint's signing secret (from --secret-env VAR or --secret-stdin)."""
    secret = _secret(args)
    box = _box(args)
    with _store(args) as store:
        store.box = box
        return store.set_secret(args.id, secret)


def cmd_reseal(args: argparse.Namespace) -> dict[str, Any]:
    """Seal plain endpoint secrets and re-seal sealed ones with the newest key (after a key
    rotation); needs a role that may read secrets (the owner's or the worker's)."""
    box = _box(args, required=True)
    with _store(args) as store:
        store.box = box
        return store.reseal(dry_run=args.dry_run)


def cmd_show(args: argparse.Namespace) -> dict[str, Any]:
    """One endpoint (its secret masked)."""
    with _store(args) as store:
        return store.show(args.id)


def cmd_attempts(args: argparse.Namespace) -> dict[str, Any]:
    """An endpoint's delivery attempts from the ledger, newest first."""
    with _store(args) as store:
        return store.attempts(args.id, before=args.before, limit=args.limit)


def cmd_enable(args: argparse.Namespace) -> dict[str, Any]:
    """Enable an endpoint (its failure count starts again from 0)."""
    with _store(args) as store:
        return store.set_enabled(args.id, True)


def cmd_disable(args: argparse.Namespace) -> dict[str, Any]:
    """Disable an endpoint: its deliveries are dead-lettered unattempted until enabled."""
    with _store(args) as store:
        return store.set_enabled(args.id, False)


# -- rendering -----------------------------------------------------------------------------
def _state(r: dict[str, Any]) -> str:
    if r["enabled"]:
        return "enabled"
    return f"disabled ({r.get('disabled_reason') or '?'})"


def _render_ls(result: dict[str, Any]) -> str:
    if not result["items"]:
        return "no webhook endpoints"
    rows = [{**r, "state": _state(r), "last": ts_text(r["last_attempt_at"]),
             "limit": r["disable_after"] or "app"} for r in result["items"]]
    text = table_text(rows, [("ID", "id"), ("URL", "url"), ("STATE", "state"),
                         ("FAILURES", "consecutive_failures"), ("DISABLE AFTER", "limit"),
                         ("LAST ATTEMPT", "last"), ("LAST STATUS", "last_status"),
                         ("DESCRIPTION", "description")])
    if result["next"]:
        text += f"\n-- more: add --after {result['next']}"
    return text


def _render_show(r: dict[str, Any]) -> str:
    lines = [f"id:                   {r['id']}",
             f"url:                  {safe_line(r['url'])}",
             f"state:                {_state(r)}",
             f"secret:               {MASK}",
             f"consecutive failures: {r['consecutive_failures']} (disabled after "
             f"{r['disable_after'] or 'pgjobs_webhook_disable_after'})",
             f"last attempt:         {ts_text(r['last_attempt_at'])} "
             f"{r['last_outcome'] or ''} {r['last_status'] or ''}".rstrip(),
             f"created:              {ts_text(r['created_at'])}",
             f"updated:              {ts_text(r['updated_at'])}"]
    if r.get("disabled_at"):
        lines.append(f"disabled at:          {ts_text(r['disabled_at'])}")
    if r.get("description"):
        lines.append(f"description:          {safe_line(r['description'])}")
    return "\n".join(lines)


def _render_attempts(result: dict[str, Any]) -> str:
    if not result["items"]:
        return "no attempts"
    rows = [{**r, "at": ts_text(r["finished_at"]), "took": age_text(r["latency_ms"] / 1000.0),
             "next": ts_text(r["next_attempt_at"]) if r["next_attempt_at"] else None,
             "detail": r["error"] or r["response_excerpt"]} for r in result["items"]]
    text = table_text(rows, [("ID", "id"), ("EVENT", "event_id"), ("TYPE", "event_type"),
                         ("ATTEMPT", "attempt"), ("AT", "at"), ("STATUS", "status"),
                         ("OUTCOME", "outcome"), ("TOOK", "took"), ("NEXT", "next"),
                         ("LOCATION", "location"), ("DETAIL", "detail")])
    if result["next"]:
        text += f"\n-- more: add --before {result['next']}"
    return text


def _render_reseal(r: dict[str, Any]) -> str:
    verb = "would seal" if r["dry_run"] else "sealed"
    return (f"{r['endpoints']} endpoints: {verb} {r['sealed']} plain secrets, "
            f"{'would re-seal' if r['dry_run'] else 're-sealed'} {r['resealed']}")


def _render_enabled(r: dict[str, Any]) -> str:
    return f"webhook endpoint {r['id']}: {_state(r)}"


# -- prune ---------------------------------------------------------------------------------
def _pruning(func: Callable[[argparse.Namespace], Any],
             render: Callable[[Any], str]) -> tuple[Callable[..., Any], Callable[..., str]]:
    """``pgjobs prune`` that also deletes ledger rows older than
    ``--webhook-attempts-older-than`` (when given), with the same --batch, --limit and
    --dry-run."""

    def cmd(args: argparse.Namespace) -> Any:
        result = func(args)
        if args.webhook_attempts_older_than is None:
            return result
        with _opened(args) as (admin, store):
            cutoff = admin.cutoff(parse_duration(args.webhook_attempts_older_than))
            result["webhook_attempts"] = store.prune(
                cutoff, bound=args.limit, batch=args.batch, dry_run=args.dry_run)
        return result

    def show(result: dict[str, Any]) -> str:
        text = render(result)
        ledger = result.get("webhook_attempts")
        if ledger is not None:
            verb = "would delete" if result["dry_run"] else "deleted"
            count = ledger["matched"] if result["dry_run"] else ledger["deleted"]
            text += (f"\n{verb} {count} webhook attempts (finished before "
                     f"{ts_text(ledger['cutoff'])})")
            if ledger["remaining"] and not result["dry_run"]:
                text += f"; {ledger['remaining']} remaining: run again"
        return text

    return cmd, show


# -- registration --------------------------------------------------------------------------
def _secret_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--secret-env", metavar="VAR",
                   help="read the signing secret from this environment variable")
    p.add_argument("--secret-stdin", action="store_true",
                   help="read the signing secret from the first line of standard input")
    _keys_arg(p)


def _keys_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keys-env", metavar="VAR",
                   help=f"the app's Fernet keys (pgjobs_webhook_secret_keys, comma-separated, "
                        f"newest first) are in this environment variable (default ${KEYS_ENV}, "
                        "if set): secrets are sealed with the newest")


def register(sub: Any, common: argparse.ArgumentParser, add: Callable[..., Any]) -> None:
    """Add ``pgjobs webhooks ...`` to the CLI's subcommands, and the ledger's retention to
    ``pgjobs prune``. ``add`` is the CLI's own subcommand maker."""
    hooks = sub.add_parser("webhooks", parents=[common],
                           help="webhook endpoints: ls, add, rotate, show, attempts, enable, "
                                "disable, reseal")
    wsub = hooks.add_subparsers(dest="webhooks_command", required=True, metavar="COMMAND")
    p = add(wsub, "ls", cmd_ls, _render_ls, common)
    p.add_argument("--after", metavar="ID", help="the page after this endpoint id")
    p.add_argument("--limit", type=int, default=50, help="rows per page (default 50)")
    p = add(wsub, "add", cmd_add, _render_show, common)
    p.add_argument("url", help="https://... where deliveries are POSTed")
    _secret_args(p)
    p.add_argument("--description")
    p.add_argument("--disable-after", type=int, metavar="N",
                   help="disable after N consecutive failed deliveries (default: the app's "
                        "pgjobs_webhook_disable_after)")
    p.add_argument("--allow-host", action="append", metavar="HOST_OR_NETWORK",
                   help="allow this host name, address or network although the egress rule "
                        "refuses it (repeatable; as in the app's pgjobs_webhook_allow_hosts, "
                        "which the workers' deliveries are checked against)")
    p = add(wsub, "rotate", cmd_rotate, _render_show, common)
    p.add_argument("id")
    _secret_args(p)
    p = add(wsub, "show", cmd_show, _render_show, common)
    p.add_argument("id")
    p = add(wsub, "attempts", cmd_attempts, _render_attempts, common)
    p.add_argument("id")
    p.add_argument("--before", metavar="ATTEMPT_ID", help="the page before this attempt id")
    p.add_argument("--limit", type=int, default=50, help="rows per page (default 50)")
    p = add(wsub, "enable", cmd_enable, _render_enabled, common)
    p.add_argument("id")
    p = add(wsub, "disable", cmd_disable, _render_enabled, common)
    p.add_argument("id")
    p = add(wsub, "reseal", cmd_reseal, _render_reseal, common)
    _keys_arg(p)
    p.add_argument("--dry-run", action="store_true", help="count only; change nothing")

    prune = sub.choices["prune"]
    prune.add_argument("--webhook-attempts-older-than", metavar="DURATION",
                       help="also delete webhook ledger rows finished more than this ago")
    func, render = _pruning(prune.get_default("func"), prune.get_default("render"))
    prune.set_defaults(func=func, render=render)
