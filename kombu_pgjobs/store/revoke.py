"""Celery's revoke broadcast, read by the broker: a revoked task that waits in Postgres goes.

``celery control revoke ID`` (and ``AsyncResult.revoke()``) publishes a remote-control message to
the fanout exchange ``<namespace>.pidbox``; on Redis and RabbitMQ only the workers that are up
hear it and keep the id in memory, so a revoked ETA task runs after a restart. pgjobs sees the
broadcast when it is published (:meth:`kombu_pgjobs.broker.transport.Channel._put_fanout`) and
deletes the delayed rows of those task ids in Postgres for good (counted ``revoked``), and keeps the
ids in ``pgjobs_revoked`` for three hours (Celery's own time for a revoke). Running messages are
left to Celery (``terminate=True`` is the worker's business); a message already due is claimed
and discarded (acked: gone) by a worker that knows the revoke — the ones up at the broadcast, and
with celery_ext every worker that starts later, which loads the kept ids
(``celery_ext.worker_sync.load_revokes``).

Reading the message needs no Celery: a remote-control body is a JSON (or pickle: not read)
object ``{"method": "revoke", "arguments": {"task_id": ID or [IDs]}}``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

__all__ = ["revoked_task_ids"]

#: the most ids one broadcast deletes (a revoke of a whole group is one broadcast)
MAX_IDS = 10_000


def revoked_task_ids(exchange: str, message: Mapping[str, Any]) -> list[str]:
    """The task ids a ``revoke`` broadcast names; [] for any other message (cheap: a
    string test for every fanout publish that is not to a ``.pidbox`` exchange)."""
    if not exchange.endswith(".pidbox"):
        return []
    if message.get("content-type") != "application/json":
        return []
    body = message.get("body")
    props = message.get("properties") or {}
    try:
        raw: Any = body
        if props.get("body_encoding") == "base64" and isinstance(body, str):
            raw = base64.b64decode(body)
        decoded = json.loads(raw)
    except (ValueError, TypeError):
        return []
    if not isinstance(decoded, dict) or decoded.get("method") != "revoke":
        return []
    args = decoded.get("arguments")
    ids = args.get("task_id") if isinstance(args, dict) else None
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list):
        return []
    return [i for i in ids if isinstance(i, str) and i][:MAX_IDS]
