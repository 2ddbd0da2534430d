"""The ``pgjobs`` commands of durable steps (celery_ext.steps, issue 32).

* ``pgjobs steps TASK_ID``: a task's steps (name, kind, state, attempts, started and finished,
  result size, error) and what it sleeps or waits for, and where its message is;
* ``pgjobs requeue ID... --from-step NAME`` and ``pgjobs dead requeue ID... --from-step NAME``:
  drop that step of each message's task and every later one, then requeue the messages (their
  next run replays the steps before NAME and runs the rest again);
* ``pgjobs prune``: also the steps of tasks whose message is gone and that were not written
  within ``--steps-older-than`` (default ``--older-than``), and events older than it.

Registered by :func:`register` from :mod:`kombu_pgjobs.ops.cli.main` (kept here so the step commands
read as one piece).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...errors import ConfigurationError
from ...store import steps as db
from ...store.admin import Admin, parse_duration
from ..common import safe_line, table_text

__all__ = ["register"]

Opener = Callable[[argparse.Namespace], AbstractContextManager[Admin]]


def _ts(value: Any) -> str:
    return "-" if value is None else str(value).replace("T", " ")[:19]


def _size(n: Any) -> str:
    if n is None:
        return "-"
    n = int(n)
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} kB" if n < 1024 * 1024 else \
        f"{n / 1024 / 1024:.1f} MB"


def _error(error: Any) -> str | None:
    if not isinstance(error, dict):
        return None
    text = ": ".join(str(error[k]) for k in ("type", "message") if error.get(k))
    return f"[{error['code']}] {text}" if error.get("code") else text


def _render_steps(result: dict[str, Any]) -> str:
    steps = result["steps"]
    if not steps:
        return f"task {safe_line(result['task_id'])}: no steps recorded"
    rows = []
    for s in steps:
        what = "-"
        if s["kind"] == "sleep":
            what = f"until {_ts(s['due_at'])}"
        elif s["kind"] == "event":
            what = f"{s['event']} key={s['event_key'] or '-'}"
            if s["due_at"]:
                what += f" (timeout {_ts(s['due_at'])})"
        rows.append({"name": s["name"], "kind": s["kind"], "state": s["state"],
                     "attempts": s["attempts"], "started": _ts(s["started_at"]),
                     "finished": _ts(s["finished_at"]), "result": _size(s["result_bytes"]),
                     "for": what, "error": _error(s["error"])})
    text = table_text(rows, [("STEP", "name"), ("KIND", "kind"), ("STATE", "state"),
                         ("ATTEMPTS", "attempts"), ("STARTED", "started"),
                         ("FINISHED", "finished"), ("RESULT", "result"), ("FOR", "for"),
                         ("ERROR", "error")])
    where = ", ".join(f"{m['id']} ({m['state']}, {safe_line(m['queue'])})"
                      for m in result["messages"]) or "gone (completed, or purged)"
    text += f"\nmessage: {where}"
    waiting = result["suspended"]
    if waiting and any(m["place"] == "job" and m["state"] == "delayed"
                       for m in result["messages"]):
        if waiting["kind"] == "sleep":
            text += f"\nsleeping ({safe_line(waiting['name'])}) until {_ts(waiting['due_at'])}"
        else:
            text += (f"\nwaiting for event {safe_line(waiting['event'])} key "
                     f"{safe_line(waiting['key'] or '-')}"
                     + (f" until {_ts(waiting['due_at'])}" if waiting["due_at"] else ""))
    return text


def _from_step(func: Callable[[argparse.Namespace], Any], opener: Opener,
               dead: bool) -> Callable[[argparse.Namespace], Any]:
    """``requeue`` / ``dead requeue`` that drop steps first when ``--from-step`` is given."""

    def cmd(args: argparse.Namespace) -> Any:
        name = getattr(args, "from_step", None)
        if name is None:
            return func(args)
        if dead and (args.all or not args.ids):
            raise ConfigurationError("--from-step takes dead-letter ids, not --all")
        with opener(args) as admin:
            return db.requeue_from_step(admin.conn, admin.schema, args.ids, name)

    return cmd


def _pruning(func: Callable[[argparse.Namespace], Any], render: Callable[[Any], str],
             opener: Opener) -> tuple[Callable[..., Any], Callable[..., str]]:
    """``pgjobs prune`` that also removes the steps of gone messages and old events."""

    def cmd(args: argparse.Namespace) -> Any:
        result = func(args)
        with opener(args) as admin:
            cutoff = admin.cutoff(parse_duration(args.steps_older_than or args.older_than))
            result["steps"] = db.prune(admin.conn, admin.schema, cutoff, limit=args.limit,
                                       batch=args.batch, dry_run=args.dry_run)
            result["steps"]["cutoff"] = cutoff.isoformat()
        return result

    def show(result: dict[str, Any]) -> str:
        text = render(result)
        got = result.get("steps")
        if got is None:
            return text
        steps, events = got["steps"], got["events"]
        if result["dry_run"]:
            return text + (f"\nwould delete {steps['matched']} steps of gone messages and "
                           f"{events['matched']} events (before {_ts(got['cutoff'])})")
        text += f"\ndeleted {steps['deleted']} steps of gone messages, {events['deleted']} events"
        if steps["remaining"] or events["remaining"]:
            text += (f"; remaining {steps['remaining']} steps, {events['remaining']} events: "
                     "run again")
        return text

    return cmd, show


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return subs[0].choices[name]  # type: ignore[no-any-return]


def register(sub: Any, common: argparse.ArgumentParser, add: Callable[..., Any],
             opener: Opener) -> None:
    """Add ``steps``, ``--from-step`` to ``requeue`` and ``dead requeue``, and the steps'
    retention to ``prune``. ``add`` is the CLI's subcommand maker, ``opener`` its Admin."""

    def cmd_steps(args: argparse.Namespace) -> dict[str, Any]:
        """A task's durable steps (celery_ext.steps): state, attempts, times, result size,
        error, what it sleeps or waits for, and where its message is."""
        with opener(args) as admin:
            return db.steps_of(admin.conn, admin.schema, args.task_id)

    p = add(sub, "steps", cmd_steps, _render_steps, common)
    p.add_argument("task_id", metavar="TASK_ID", help="the Celery task id")

    help_text = ("drop this step of each message's task and every later one first (the next "
                 "run replays the earlier steps and runs the rest again)")
    requeue = sub.choices["requeue"]
    requeue.add_argument("--from-step", metavar="NAME", help=help_text)
    requeue.set_defaults(func=_from_step(requeue.get_default("func"), opener, dead=False))
    dead_requeue = _subcommand(sub.choices["dead"], "requeue")
    dead_requeue.add_argument("--from-step", metavar="NAME", help=help_text + " (ids only)")
    dead_requeue.set_defaults(
        func=_from_step(dead_requeue.get_default("func"), opener, dead=True))

    prune = sub.choices["prune"]
    prune.add_argument("--steps-older-than", metavar="DURATION",
                       help="delete the steps of gone messages not written for this long, and "
                            "events emitted before it (default: --older-than)")
    func, render = _pruning(prune.get_default("func"), prune.get_default("render"), opener)
    prune.set_defaults(func=func, render=render)
