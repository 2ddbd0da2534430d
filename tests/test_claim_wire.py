"""The claim as it is sent: numbered placeholders through a raw cursor (sql.positional) must be
the very statement psycopg would send for the named ones, values in the same places."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from kombu_pgjobs.store.core import QueueCore, WaitPlan, job_from_message
from kombu_pgjobs.store.schema import migrate
from kombu_pgjobs.store.sql import positional, raw_queries


def _message(body: str) -> dict[str, Any]:
    return {"body": body, "headers": {"task": "t"}, "properties": {"priority": 0},
            "content-type": "application/json", "content-encoding": "utf-8"}


def test_every_placeholder_is_numbered_once_and_a_literal_percent_survives():
    query, keys = positional("s", "job_claim", 4)
    assert b"%(" not in query
    assert len(keys) == len(set(keys)) and f"${len(keys)}".encode() in query
    assert f"${len(keys) + 1}".encode() not in query
    assert set(keys) == {"ack_ids", "ack_claims", "queues", "n", "ttl", "worker", "channel",
                         "hand_off", "waiter", "register", "barrier", "schema_name",
                         "history", "hint_ids", "hint_words"}
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


def _generic_plan(db: psycopg.Connection[Any], core: QueueCore, acks: list[tuple[int, int]]
                  ) -> list[str]:
    """The claim's plan as a worker's claim connection runs it: prepared, generic."""
    query, _ = positional(core.schema, "job_claim", 4)
    _, params = core.claim_wire(["q"], 4, acks, None)
    db.execute("SET plan_cache_mode = force_generic_plan")
    db.execute(b"PREPARE pgjt_claim AS " + query)
    try:
        marks = ", ".join(["%s"] * len(params))
        return [r[0] for r in psycopg.ClientCursor(db).execute(
            f"EXPLAIN EXECUTE pgjt_claim({marks})", params).fetchall()]
    finally:
        db.execute("DEALLOCATE pgjt_claim")
        db.execute("RESET plan_cache_mode")


def test_the_claims_acks_read_their_rows_by_primary_key(db: psycopg.Connection[Any],
                                                       schema: str):
    """During a drain acked rows leave dead entries in the lease index until a vacuum. The
    claim's generic plan read every running row through that index, twice (the fenced acks,
    then their delete): with 2,400 dead entries a claim of 4 with 4 acks executed in
    0.64-0.82 ms against 0.42-0.46 ms by primary key."""
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    core.publish_many(db, [job_from_message("q", _message(f"m{i}")) for i in range(2000)])
    acks: list[tuple[int, int]] = []
    for _ in range(50):  # a drain under way: some running, many acked
        acks = [(c.id, c.claim) for c in core.claim(db, ["q"], 4, acks).claimed]
    db.execute(f'ANALYZE "{schema}".pgjobs_job')
    plan = _generic_plan(db, core, acks)
    for cte, following in (("given", "released"), ("acked", "acked_count")):
        start = next(i for i, line in enumerate(plan) if line.strip() == f"CTE {cte}")
        end = next(i for i, line in enumerate(plan) if line.strip() == f"CTE {following}")
        section = "\n".join(plan[start:end])
        assert "pgjobs_job_pkey" in section and "lease_idx" not in section, "\n".join(plan)


def test_an_ack_of_an_earlier_claim_beside_the_current_ones_settles_only_the_current(
        db: psycopg.Connection[Any], schema: str):
    """The same message acked twice in one flush, under its lapsed claim and its current
    one (it came back to this process): the current claim's ack deletes it, the other
    misses its fence."""
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    core.publish_many(db, [job_from_message("q", _message("m"))])
    (first,) = core.claim(db, ["q"], 1).claimed
    db.execute(f'UPDATE "{schema}".pgjobs_job SET state = \'ready\'')  # its lease was rescued
    (second,) = core.claim(db, ["q"], 1).claimed
    assert (second.id, second.claim) == (first.id, first.claim + 1)
    result = core.claim(db, ["q"], 1, [(first.id, first.claim), (second.id, second.claim)])
    assert result.acked == {first.id}
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0


def test_one_prepared_claim_per_window_size_whatever_its_values(dsn: str, schema: str):
    """psycopg keys a prepared statement by its text and the parameter types it sends, which
    follow the values (an id as smallint, integer or bigint by its size, an empty list
    untyped). A worker's claim connection prepared a dozen claims, each planned anew (3-4 ms
    of the server's CPU); sent as text of unknown type, one per window size."""
    from kombu_pgjobs.store.database import connect

    with connect(dsn) as conn:  # as a worker's: statements prepared on first use
        migrate(conn, schema)
        core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
        core.publish_many(conn, [job_from_message("q", _message(f"m{i}")) for i in range(9)])
        conn.execute("SET plan_cache_mode = force_generic_plan")
        claimed = core.claim(conn, ["q"], 4).claimed  # no acks, no wait plan
        acks = [(c.id, c.claim) for c in claimed]
        claimed = core.claim(conn, ["q"], 4, acks).claimed  # small ids
        # a bigint id (no such message: it misses its fence) beside real ones
        core.claim(conn, ["q"], 4, [(2**40, 1)] + [(c.id, c.claim) for c in claimed])
        core.claim(conn, ["q"], 4, [], WaitPlan(2**40, ["q"], ["q"]))  # a wake id
        core.claim(conn, ["q"], 4, [], WaitPlan(7, ["q"], []))
        core.claim(conn, ["q"], 2)  # another window size
        prepared = conn.execute("SELECT parameter_types::text FROM pg_prepared_statements "
                                "WHERE statement LIKE %s", ["%claimed AS (%"]).fetchall()
        assert len(prepared) == 2, prepared


def test_queue_names_with_quotes_backslashes_and_commas_reach_the_claim(db: psycopg.Connection[Any],
                                                                       schema: str):
    """The claim's text arrays are array literals: each element quoted and escaped."""
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    names = ['a"b', "c\\d", "e,f", "{g}", " h ", "NULL"]
    core.publish_many(db, [job_from_message(name, _message(name)) for name in names])
    claimed = core.claim(db, names, 10, [], WaitPlan(3, names, names)).claimed
    assert sorted(c.queue for c in claimed) == sorted(names)
    assert sorted(json.loads(c.message)["body"] for c in claimed) == sorted(names)


def _statistics_say_empty(db: psycopg.Connection[Any], core: QueueCore) -> None:
    """As the keeper leaves a drained table: a message published, claimed and acked, then a
    VACUUM of the empty table (reltuples 0, its pages kept)."""
    core.publish_many(db, [job_from_message("q", _message("m"))])
    core.claim(db, ["q"], 1, [(c.id, c.claim) for c in core.claim(db, ["q"], 1).claimed])
    db.execute(f'VACUUM "{core.schema}".pgjobs_job')


def test_the_claim_takes_its_rows_by_primary_key_when_the_statistics_say_empty(
        db: psycopg.Connection[Any], schema: str):
    """A keeper's VACUUM of the drained table records it as empty; a claim connection that
    prepares its claim after a burst arrives keeps that generic plan. The lease's UPDATE
    joined to the admitted rows then read the whole table per claim (a nested loop over the
    primary key): 2.2 ms a claim with 1,000 rows left, 0.65 ms by primary key, and a prefork
    drain of 2,000 tasks at 0.53-0.78x RabbitMQ's against 0.91-1.39x."""
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    _statistics_say_empty(db, core)
    core.publish_many(db, [job_from_message("q", _message(f"m{i}")) for i in range(400)])
    acks = [(c.id, c.claim) for c in core.claim(db, ["q"], 4).claimed]
    plan = _generic_plan(db, core, acks)
    start = next(i for i, line in enumerate(plan) if line.strip() == "CTE claimed")
    end = next(i for i, line in enumerate(plan) if line.strip() == "CTE drained")
    section = "\n".join(plan[start:end])
    assert "Index Cond: (id = ANY" in section and "Join Filter" not in section, "\n".join(plan)


def test_a_claim_prepared_on_an_empty_table_reads_the_grown_table_through_indexes(
        url: str, db: psycopg.Connection[Any], schema: str):
    """A generic plan is kept until the table's statistics change. A worker that started on
    an empty queue prepared its claim with sequential scans of the job table (the cheapest
    read of a table of no pages), and kept them when a burst arrived: 68 ms a claim with
    200,000 rows queued, against 0.73 ms through the indexes (sequential scans off on the
    claim connection)."""
    import kombu

    with kombu.Connection(url, transport_options={"schema": schema}) as kconn:
        backend = kconn.transport.backend
        conn = backend.connect(hot=True)  # the claim connection, schema installed
        try:
            core = backend.core
            query, _ = positional(schema, "job_claim", 4)
            _, params = core.claim_wire(["q"], 4, [], None)
            conn.execute(b"PREPARE pgjt_claim AS " + query)
            explain = f"EXPLAIN EXECUTE pgjt_claim({', '.join(['%s'] * len(params))})"
            psycopg.ClientCursor(conn).execute(explain, params)  # planned: the table is empty
            for _ in range(3):
                core.publish_many(db, [job_from_message("q", _message("m"))] * 1000)
            delayed = {**_message("d"), "headers": {"task": "t", "id": "d",
                                                    "eta": "2999-01-01T00:00:00+00:00"}}
            core.publish_many(db, [job_from_message("q", delayed)] * 1000)
            plan = "\n".join(r[0] for r in psycopg.ClientCursor(conn).execute(
                explain, params).fetchall())
        finally:
            conn.close()
    assert "Seq Scan on pgjobs_job" not in plan, plan
    assert "pgjobs_job_ready_idx" in plan, plan
    # the delayed rows through their own index, never a whole scan of the task-id index
    assert "task_id_idx" not in plan, plan


def test_parking_a_full_keys_flood_reads_it_by_primary_key_when_the_statistics_say_empty(
        db: psycopg.Connection[Any], schema: str):
    """A claim that finds a concurrency key full parks the rest of the key's rows
    (pgjobs_admit_v2). Planned on 'empty' statistics, that UPDATE joined the whole job table
    to its locking subquery, run again per row: 7.9 s for one claim with 2,000 rows of the
    key queued (schema 20: 54 ms). Counted in shared buffers, not time: EXPLAIN's buffers
    include the statements the claim's function runs."""
    from kombu_pgjobs.broker.backend import CLAIM_SESSION

    # psycopg's own prepared statements would make it DEALLOCATE ALL at the ROLLBACK below,
    # pgjt_claim included
    db.prepare_threshold = None
    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    _statistics_say_empty(db, core)
    limited = {**_message("l"), "headers": {
        "task": "t", "x-pgjobs-limits": json.dumps({"concurrency": [{"key": "k", "limit": 2}]})}}
    core.publish_many(db, [job_from_message("lq", limited)] * 2000)
    query, _ = positional(schema, "job_claim", 4)
    _, params = core.claim_wire(["lq"], 4, [], None)
    for setting in CLAIM_SESSION:
        db.execute(setting)
    db.execute(b"PREPARE pgjt_claim AS " + query)
    try:
        with db.transaction(force_rollback=True):
            plan = psycopg.ClientCursor(db).execute(
                f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE pgjt_claim("
                f"{', '.join(['%s'] * len(params))})", params).fetchone()[0][0]["Plan"]
    finally:
        db.execute("DEALLOCATE pgjt_claim")
        db.execute("RESET ALL")
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE state = %s',
                      ["waiting"]).fetchone()[0] == 0, "rolled back"
    touched = int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])
    assert touched < 200_000, touched  # 49,000 here; 15.2 million before schema 20
