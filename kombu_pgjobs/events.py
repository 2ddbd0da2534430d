"""Stable log event names and codes.

Events that are logged rather than raised (a stale settle must never raise at Celery) still get
a stable name and code, so operators can alert on them.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["EVENTS", "log_event", "one_line"]

log = logging.getLogger("kombu_pgjobs")

#: event name -> (code, meaning)
EVENTS: dict[str, tuple[str, str]] = {
    "pgjobs.settle.unowned": (
        "PGJ-201", "an ack/reject/requeue hit no row: the lease had lapsed and the message was "
        "rescued (and maybe re-delivered); nothing was changed"),
    "pgjobs.lease.lost": (
        "PGJ-202", "a lease could not be renewed: it had lapsed or the message was settled "
        "elsewhere"),
    "pgjobs.claim.buried": (
        "PGJ-203", "a message whose lease lapsed on its final attempt was dead-lettered"),
    "pgjobs.lease.rescued": (
        "PGJ-204", "a message whose lease lapsed was put back to ready"),
    "pgjobs.queue.expired": ("PGJ-205", "a queue unused past its x-expires was dropped"),
    "pgjobs.limit.refused": (
        "PGJ-304", "a message found its concurrency key full and its task says "
        "when_busy='fail': it was dead-lettered (reason refused) and its body never ran"),
    "pgjobs.keeper.vacuum": (
        "PGJ-206", "the server runs with autovacuum off and the job table's dead rows piled up: "
        "the keeper vacuumed it (turn autovacuum on; see docs/operations.md)"),
    "pgjobs.publish.resent": (
        "PGJ-207", "the publish connection broke with publishes unconfirmed "
        "(confirm_publish=False): they were sent again on a new connection (one whose commit "
        "had reached the server is queued twice)"),
    "pgjobs.publish.lost": (
        "PGJ-208", "publishes sent with confirm_publish=False could be neither confirmed nor "
        "sent again before the connection closed: they may not be queued"),
    "pgjobs.consumer.broken": (
        "PGJ-209", "the claim connection failed (a terminated backend, a restarted server, a "
        "failed claim): it reconnects by itself after a backoff; nothing delivered was handed "
        "back, running tasks keep their leases and their acks stay buffered until they settle"),
    "pgjobs.consumer.reconnected": (
        "PGJ-210", "the claim connection is back after a failure (INFO)"),
    "pgjobs.claim.malformed": (
        "PGJ-211", "a claimed row's stored message is not a kombu message (not a JSON object "
        "with a properties object): it was dead-lettered (reason malformed) and the rows "
        "claimed with it were delivered"),
    "pgjobs.settle.failed": (
        "PGJ-212", "a fenced requeue, reject or hand-back failed on a fresh connection too: "
        "its leases are no longer renewed, so the messages come back when they lapse"),
    "pgjobs.epoch.fenced": (
        "PGJ-213", "the server started since claim numbers were last fenced (a restart, a "
        "promoted standby, a restore from backup or snapshot): their base moved up once, so "
        "no claim number handed out before can be handed out again; messages running across "
        "it keep their numbers"),
    "pgjobs.run.cancelled": (
        "PGJ-215", "a message this process runs was cancelled by an operator (pgjobs cancel, "
        "celery_ext.cancel, the dashboard): the run is ended (celery_ext) and the message "
        "goes to the dead letters as cancelled when it settles"),
    "pgjobs.run.stopped": (
        "PGJ-216", "celery_ext ended a run: cancelled by an operator, or its lease lost (the "
        "message is another worker's now); how depends on the pool"),
    "pgjobs.shard.unavailable": (
        "PGJ-217", "work on a shard's database waits for it or skips it: the shard cannot be "
        "reached (PGJ-113); the other databases' queues go on"),
    "pgjobs.shard.declare_failed": (
        "PGJ-218", "a queue declaration kept for a down shard was refused when the shard came "
        "back (not for being unreachable: a bad name, a missing right); it is not retried"),
    "pgjobs.keeper.unsupported": (
        "PGJ-219", "the keeper's statements fail behind a transaction pooler (PGJ-112): it "
        "stops, and the consumer raises the error so the worker stops rather than run while "
        "its leases cannot be renewed"),
    "pgjobs.queue.redeclared": (
        "PGJ-214", "a queue this process consumes was found dropped (an operator, or a keeper "
        "of an older version): it was declared again with the bindings this process made"),
    "pgjobs.limit.woken": (
        "PGJ-305", "a message parked on a concurrency key with no running holder was woken "
        "by the keeper's safety net"),
    # Celery parity (issue 16): PGJ-220..229
    "pgjobs.revoke.deleted": (
        "PGJ-220", "a Celery revoke broadcast named a task waiting for its ETA: its row was "
        "deleted from Postgres (counted revoked; INFO)"),
    "pgjobs.revoke.refused": (
        "PGJ-222", "a Celery revoke broadcast was sent by a role that may not delete rows (a "
        "publisher role): the broadcast went out and workers discard the task, but its "
        "waiting (ETA) rows stay until due and the revoke is not kept for starting workers; "
        "send revokes as a worker or operator role, or use pgjobs cancel --task-id"),
    "pgjobs.settled.listener_failed": (
        "PGJ-221", "a receiver of the on_settled notification raised: logged, the settle it "
        "reported stands"),
    "pgjobs.schedule.fenced": (
        "PGJ-620", "a scheduled fire was refused by its fence: this process no longer leads "
        "(its term moved on or its lease lapsed), or the entry changed or was fired meanwhile; "
        "nothing was published"),
    "pgjobs.schedule.missed": (
        "PGJ-621", "occurrences of a scheduled entry were missed (no leader at their time) and "
        "were not fired, per the entry's catch-up policy"),
    "pgjobs.schedule.failed": (
        "PGJ-622", "a scheduled fire failed (the database or the broker): nothing was "
        "recorded for the occurrence, which is tried again at the next tick"),
    "pgjobs.leader.elected": ("PGJ-623", "this process leads the scheduler (INFO)"),
    "pgjobs.schedule.invalid": (
        "PGJ-625", "an entry in pgjobs_schedule cannot be read (written by hand, or by another "
        "version): it does not fire; fix or remove it with `pgjobs schedule`"),
    "pgjobs.leader.lost": (
        "PGJ-624", "this process stopped leading the scheduler: another took over, its lease "
        "lapsed or the database could not be reached to renew it"),
}


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An error as a log field: one line (psycopg's messages span several), bounded."""
    return str(exc).strip().replace("\n", " ")[:limit]


def log_event(name: str, level: int = logging.WARNING, **fields: Any) -> None:
    """Log a named event with its stable code and structured fields (never a payload)."""
    code, meaning = EVENTS[name]
    log.log(level, "%s [%s] %s %s", name, code, meaning,
            " ".join(f"{k}={v}" for k, v in fields.items()),
            extra={"action": name, "code": code, **fields})

# the automatic retention sweep (issue 34)
EVENTS.update({
    "pgjobs.retention.swept": (
        "PGJ-223", "the automatic retention sweep ran on this process and deleted what was past "
        "its window, rows per kind (INFO)"),
    "pgjobs.retention.failed": (
        "PGJ-224", "the automatic retention sweep could not run or stopped on an error: the "
        "next turn tries again (a missing table or right: no sweep from this process)"),
})

# history rollups (issue 34)
EVENTS.update({
    "pgjobs.history.rolled_up": (
        "PGJ-225", "this process took the history rollup's turn and rolled up closed minutes "
        "into pgjobs_task_minute (DEBUG)"),
    "pgjobs.history.rollup_failed": (
        "PGJ-226", "the history rollup cannot run on this process (a schema before version 25, "
        "or roles not applied again): said once, no rollup from this process"),
})

# the outbox relay (issue 13)
EVENTS.update({
    "pgjobs.relay.publish_failed": (
        "PGJ-515", "the outbox relay could not publish a staged message to the broker (after "
        "kombu's retries): it and the rest of its batch go back to the outbox and are tried "
        "again after the retry delay; nothing is lost"),
    "pgjobs.relay.lease_lost": (
        "PGJ-516", "the outbox relay published rows whose lease had lapsed and been re-claimed "
        "by another relay: they may reach the broker twice (at least once); marking them "
        "changed nothing"),
    "pgjobs.relay.database_lost": (
        "PGJ-517", "the outbox relay lost the app database: it reconnects after a backoff; "
        "claimed rows it did not mark come back when their lease lapses"),
})

# durable steps (celery_ext.steps, issue 32)
EVENTS.update({
    "pgjobs.step.refused": (
        "PGJ-920", "a step's write was refused (PGJ-903): the run no longer holds its message "
        "(its lease lapsed and another worker took it over, it was settled elsewhere, or an "
        "operator cancelled it); nothing was written and the run ends"),
    "pgjobs.step.park_failed": (
        "PGJ-921", "a run that suspended (a durable sleep or wait) could not hand its message "
        "back parked (the database failed on a fresh connection too): its lease is no longer "
        "renewed, so the message comes back when it lapses (an attempt counted) and replays"),
    "pgjobs.step.park_missed": (
        "PGJ-922", "a run suspended, but its message was no longer held under its claim when "
        "it was handed back (its lease lapsed and was rescued, or it was settled elsewhere): "
        "nothing was changed"),
})
