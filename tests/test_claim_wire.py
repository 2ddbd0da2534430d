"""The claim as it is sent: numbered placeholders through a raw cursor (sql.positional) must be
the very statement psycopg would send for the named ones, values in the same places."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from kombu_pgjobs.core import QueueCore, WaitPlan, job_from_message
from kombu_pgjobs.schema import migrate
from kombu_pgjobs.sql import positional, raw_queries


def _message(body: str) -> dict[str, Any]:
    return {"body": body, "headers": {"task": "t"}, "properties": {"priority": 0},
            "content-type": "application/json", "content-encoding": "utf-8"}


def test_every_placeholder_is_numbered_once_and_a_literal_percent_survives():
    query, keys = positional("s", "job_claim", 4)
    assert b"%(" not in query
    assert len(keys) == len(set(keys)) and f"${len(keys)}".encode() in query
    assert f"${len(keys) + 1}".encode() not in query
    assert set(keys) == {"ack_ids", "ack_claims", "queues", "n", "ttl", "worker", "channel",
                         "hand_off", "waiter", "register", "barrier", "schema_name"}
    # no statement of ours has %% today; the numbering keeps one as a literal %
    assert all("%%" not in text for text in raw_queries().values())


def test_the_raw_claim_claims_acks_and_registers_like_the_named_one(db: psycopg.Connection[Any],
                                                                   schema: str):
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    core.publish_many(db, [job_from_message("q", _message(f"m{i}")) for i in range(5)])
    first = core.claim(db, ["q"], 2)  # the raw cursor
    assert [json.loads(c.message)["body"] for c in first.claimed] == ["m0", "m1"]
    named, params = core.claim_statement(["q"], 2, [(c.id, c.claim) for c in first.claimed])
    second = core.claim_result(db.execute(named, params).fetchall())
    assert second.acked == {c.id for c in first.claimed}
    assert [json.loads(c.message)["body"] for c in second.claimed] == ["m2", "m3"]
    plan = WaitPlan(2**40, ["q"], ["q"])
    third = core.claim(db, ["q"], 4, [(c.id, c.claim) for c in second.claimed], plan)
    assert [json.loads(c.message)["body"] for c in third.claimed] == ["m4"]
    assert third.drained and third.quiet is True and len(third.acked) == 2
    assert db.execute(f'SELECT queue, waiter FROM "{schema}".pgjobs_waiter').fetchall() == [
        ("q", 2**40)]
