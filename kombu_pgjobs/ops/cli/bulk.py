"""Bulk operator commands: ``pgjobs bulk promote``, ``pgjobs bulk requeue``, ``pgjobs bulk remove``.

A selection is a queue, a Celery task name and/or a tenant (at least one: a bulk change never
covers a whole schema by accident). Each call changes at most ``--limit`` rows, in batches of
``--batch`` rows (each its own short transaction, rows another command holds skipped), and says
what it did and what is left: ``{"affected": n, "remaining": m}``; run it again for the rest.

* promote: delayed messages become due now, their Celery ``eta`` cleared (as ``pgjobs requeue``
  of one: the worker runs them at once);
* requeue: dead letters of the selection back to ready, attempts reset (as ``pgjobs requeue`` of
  one; a dead letter whose idempotency key a live message holds stays dead);
* remove: messages no worker holds (``--state`` ready, delayed and/or waiting; default all three)
  are deleted, counted ``cancelled``. Running messages are never removed: cancel them by id.

``pgjobs dead requeue --all`` and ``dead purge`` select dead letters by reason and age too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ...errors import BulkRefused, InvalidArgument
from ...store.admin import Admin, bulk_limit

__all__ = ["REMOVABLE", "bulk_promote", "bulk_remove", "bulk_requeue"]

#: the states ``bulk remove`` takes (``ready`` is due now)
REMOVABLE = ("ready", "delayed", "waiting")


def _selection(admin: Admin, queue: str | None, task: str | None,
               tenant: str | None) -> dict[str, Any]:
    if queue is None and task is None and tenant is None:
        raise BulkRefused("name the messages: --queue, --task and/or --tenant")
    if queue is not None:
        admin.require_queue(queue)
    return {"queue": queue, "task": task, "tenant": tenant}


def _batched(limit: int | None, batch: int, step: Callable[[int], int]) -> int:
    """Run ``step(n)`` (changes at most ``n`` rows, returns how many it changed) in batches
    of ``batch`` until ``limit`` rows changed or a batch changes none; the rows changed."""
    bound = bulk_limit(limit)
    if not 1 <= int(batch) <= 100_000:
        raise BulkRefused(f"--batch must be between 1 and 100000, got {batch}")
    done = 0
    while done < bound:
        n = step(min(int(batch), bound - done))
        done += n
        if n == 0:
            break
    return done


def _statement(admin: Admin, name: str, params: dict[str, Any]) -> Callable[[int], int]:
    """A batch step running the named statement (its first column: rows changed)."""
    def step(n: int) -> int:
        row = admin.conn.execute(admin.q[name], {**params, "limit": n}).fetchone()
        return int(row[0]) if row else 0
    return step


def bulk_promote(admin: Admin, *, queue: str | None = None, task: str | None = None,
                 tenant: str | None = None, limit: int | None = None,
                 batch: int = 1000) -> dict[str, int]:
    params = _selection(admin, queue, task, tenant)
    affected = _batched(limit, batch, _statement(
        admin, "bulk_promote", {**params, "channel": admin.channel}))
    remaining = admin.conn.execute(admin.q["bulk_count"], {
        **params, "states": ["delayed"]}).fetchone()
    return {"affected": affected, "remaining": int(remaining[0]) if remaining else 0}


def bulk_requeue(admin: Admin, *, queue: str | None = None, task: str | None = None,
                 tenant: str | None = None, limit: int | None = None,
                 batch: int = 1000) -> dict[str, int]:
    params = _selection(admin, queue, task, tenant)
    remaining = 0

    def step(n: int) -> int:
        nonlocal remaining
        done = admin.dead_requeue(**params, limit=n)
        remaining = int(done["remaining"])
        return len(done["requeued"])

    affected = _batched(limit, batch, step)
    return {"affected": affected, "remaining": remaining}


def bulk_remove(admin: Admin, *, queue: str | None = None, task: str | None = None,
                tenant: str | None = None, states: Sequence[str] | None = None,
                limit: int | None = None, batch: int = 1000) -> dict[str, int]:
    params = _selection(admin, queue, task, tenant)
    wanted = list(states or REMOVABLE)
    bad = [s for s in wanted if s not in REMOVABLE]
    if bad:
        raise InvalidArgument(f"--state {', '.join(bad)}: bulk remove takes "
                              f"{', '.join(REMOVABLE)} (running messages: cancel them by id)")
    params["states"] = wanted
    affected = _batched(limit, batch, _statement(
        admin, "bulk_remove", {**params, "shard": admin.shard}))
    remaining = admin.conn.execute(admin.q["bulk_count"], params).fetchone()
    return {"affected": affected, "remaining": int(remaining[0]) if remaining else 0}


def add_commands(sub: Any, common: Any, add: Any, admin: Any) -> None:
    """Register ``pgjobs bulk promote|remove`` (called by
    :func:`kombu_pgjobs.ops.cli.main.build_parser` with its subparsers, common options,
    ``add_command`` and ``open_admin``)."""

    def cmd_promote(args: Any) -> dict[str, int]:
        """Make delayed messages of a queue, task and/or tenant due now (bounded batches)."""
        with admin(args) as a:
            return bulk_promote(a, queue=args.queue, task=args.task, tenant=args.tenant,
                                limit=args.limit, batch=args.batch)

    def cmd_requeue(args: Any) -> dict[str, int]:
        """Put dead letters of a queue, task and/or tenant back to ready (bounded batches)."""
        with admin(args) as a:
            return bulk_requeue(a, queue=args.queue, task=args.task, tenant=args.tenant,
                                limit=args.limit, batch=args.batch)

    def cmd_remove(args: Any) -> dict[str, int]:
        """Delete ready, delayed or waiting messages of a queue, task and/or tenant."""
        states = [s.strip() for v in args.state or () for s in v.split(",") if s.strip()]
        with admin(args) as a:
            return bulk_remove(a, queue=args.queue, task=args.task, tenant=args.tenant,
                               states=states or None, limit=args.limit, batch=args.batch)

    def render(r: dict[str, int]) -> str:
        more = f"; {r['remaining']} remaining: run again" if r["remaining"] else ""
        return f"{r['affected']} messages{more}"

    bulk = sub.add_parser("bulk", parents=[common],
                          help="bulk changes: promote, requeue, remove")
    bsub = bulk.add_subparsers(dest="bulk_command", required=True, metavar="COMMAND")
    for name, func in (("promote", cmd_promote), ("requeue", cmd_requeue),
                       ("remove", cmd_remove)):
        p = add(bsub, name, func, render, common)
        p.add_argument("--queue")
        p.add_argument("--task", help="Celery task name")
        p.add_argument("--tenant", help="the x-pgjobs-tenant header")
        if name == "remove":
            p.add_argument("--state", action="append",
                           help=f"{', '.join(REMOVABLE)} (repeat or comma-separate; "
                                "default: all three)")
        p.add_argument("--limit", type=int, default=1000,
                       help="most messages changed by this call (default 1000)")
        p.add_argument("--batch", type=int, default=1000, help="rows per transaction")
