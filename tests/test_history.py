"""The task history (issue 34, item 1) and one vocabulary of outcomes (issue 30, item 4).

Real settles only: a real ``celery worker`` for the outcomes Celery decides (a retry, a final
failure kept or dropped, an early ack's failure, a cancel), kombu consumers and the queue core
for the rest. Every figure is read back from the database: history rows per outcome, the
counters under the same words, rollups against the history they were made from, the rollup's
turn taken once by processes racing for it, and nothing written with ``history`` off."""

from __future__ import annotations

import json
import multiprocessing
import time
import uuid
from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from kombu import Connection

import celery_ext
from kombu_pgjobs.errors import InvalidArgument
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store import history
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate

from .conftest import wait_for
from .test_cancel_running import APP, _settled, _started

pytestmark = pytest.mark.e2e


def _history(db: psycopg.Connection[Any], schema: str, where: str = "true"
             ) -> list[tuple[Any, ...]]:
    return db.execute(f'SELECT task, outcome, runtime, attempts, worker, job_id, claim '
                      f'FROM "{schema}".pgjobs_history WHERE {where} '
                      "ORDER BY settled_at, job_id").fetchall()


def _counters(db: psycopg.Connection[Any], schema: str, queue: str) -> dict[str, int]:
    return {o: int(n) for o, n in db.execute(
        f'SELECT outcome, sum(n) FROM "{schema}".pgjobs_counter WHERE queue = %s '
        "GROUP BY outcome HAVING sum(n) > 0", (queue,)).fetchall()}


def _message(body: str, task: str = "t.plain") -> dict[str, Any]:
    return {"body": body, "content-encoding": "utf-8", "content-type": "text/plain",
            "headers": {"task": task, "id": str(uuid.uuid4())},
            "properties": {"delivery_info": {"exchange": "", "routing_key": "q"},
                           "delivery_tag": str(uuid.uuid4())}}


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_every_settle_leaves_one_row_under_the_words_of_on_settled_and_the_counters(
        db, parity, recorder_tables, schema, start_worker, pool):
    """A real worker settles one task of each kind. Its history says, per task: completed;
    failed (a final failure kept as a dead letter; a Reject; an early-acked failure, whose
    ack's row is amended when the run fails); dropped (dead_letter=False); requeued then
    completed (a Celery retry; a Reject(requeue=True)); cancelled. The counters of the queue
    hold exactly the history's counts under the same words, and on_settled said the same word
    for each final settle."""
    start_worker(name=f"h{pool}", app=APP, pool=pool, concurrency=4)
    sent = {
        "parity.record": parity.record.delay("done"),
        "parity.fail_kept": parity.fail_kept.delay("kept"),
        "parity.fail": parity.fail.delay("dropped"),
        "parity.reject": parity.reject.delay("rejected"),
        "parity.retry_once": parity.retry_once.delay("retried"),
        "parity.requeue_once": parity.requeue_once.delay("requeued"),
        "parity.early_fail": parity.early_fail.delay("early"),
        "parity.steps": parity.steps.delay("stopped", 60, 0.25),
    }
    wait_for(lambda: _started(db, schema, "stopped") == 1, 30, what="the long task to start")
    celery_ext.cancel(sent["parity.steps"].id, app=parity.app)
    expected = {"parity.record": ["completed"], "parity.fail_kept": ["failed"],
                "parity.fail": ["dropped"], "parity.reject": ["failed"],
                "parity.retry_once": ["requeued", "completed"],
                "parity.requeue_once": ["requeued", "completed"],
                "parity.early_fail": ["failed"], "parity.steps": ["cancelled"]}

    def by_task() -> dict[str, list[str]]:
        # each task's outcomes as a multiset: a retry's two messages settle in either order
        got: dict[str, list[str]] = {}
        for task, outcome, *_ in _history(db, schema, "task LIKE 'parity.%'"):
            got.setdefault(task, []).append(outcome)
        return {task: sorted(words) for task, words in got.items()}

    want = {task: sorted(words) for task, words in expected.items()}
    wait_for(lambda: by_task() == want and len(_settled(db, schema)) == len(sent), 40,
             interval=0.25, what=f"one history row per settle: {by_task()}")
    time.sleep(1.0)  # nothing more comes
    assert by_task() == want
    rows = _history(db, schema, "task LIKE 'parity.%'")
    assert all(r[4] and r[4].startswith(f"h{pool}@") for r in rows), rows  # node:pid:inc
    assert all(r[3] >= 1 for r in rows)
    stopped = next(r for r in rows if r[0] == "parity.steps")
    assert stopped[2] is not None and stopped[2] > 0.2, stopped  # it ran before its cancel
    # the queue's counters: the same words, the same numbers (an early ack's 'completed'
    # moved to 'failed'; the old words gone)
    counted = Counter(o for _, o, *_ in rows)
    assert _counters(db, schema, "celery") == dict(counted)
    # on_settled's word for each task's final settle is the history's last word for it
    words = _settled(db, schema)
    assert {task: words[r.id][-1] for task, r in sent.items()} == \
        {task: outcomes[-1] for task, outcomes in expected.items()}


def test_history_off_writes_no_row_and_the_counters_stand(db, url, schema):
    """``history: False``: settles count as ever, no history row."""
    for on in (False, True):
        with Connection(url, transport_options={"schema": schema, "history": on}) as conn:
            q = conn.SimpleQueue(f"off{on}")
            for n in range(3):
                q.put({"n": n}, headers={"task": "t.off"})
            for n in range(3):
                m = q.get(timeout=10)
                m.ack() if n else m.reject()
            q.close()
        assert _counters(db, schema, f"off{on}") == {"completed": 2, "failed": 1}
        assert len(_history(db, schema, f"queue = 'off{on}'")) == (3 if on else 0)


def _rolled_from_history(db: psycopg.Connection[Any], schema: str) -> set[tuple[Any, ...]]:
    return set(db.execute(
        f"SELECT coalesce(task, ''), date_trunc('minute', settled_at), "
        "count(*) FILTER (WHERE outcome = 'completed'), "
        "count(*) FILTER (WHERE outcome = 'failed'), "
        "count(*) FILTER (WHERE outcome = 'requeued'), "
        "round(max(runtime)::numeric, 4) "
        f'FROM "{schema}".pgjobs_history GROUP BY 1, 2').fetchall())


def _rollups(db: psycopg.Connection[Any], schema: str) -> set[tuple[Any, ...]]:
    return set(db.execute(
        "SELECT task, minute, completed, failed, requeued, round(runtime_max::numeric, 4) "
        f'FROM "{schema}".pgjobs_task_minute').fetchall())


def _settle_some(db: psycopg.Connection[Any], schema: str, n: int) -> None:
    """``n`` messages of two tasks claimed and settled by the queue core: a tenth buried, a
    tenth requeued (then acked), the rest acked."""
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5, worker="history-test:1")
    core.publish_many(db, [job_from_message("q", _message(f"m{i}", f"t.{i % 2}"))
                           for i in range(n)])
    while True:
        got = core.claim(db, ["q"], 50).claimed
        if not got:
            break
        pairs = [(c.id, c.claim) for c in got]
        core.bury(db, [p for p in pairs if p[0] % 10 == 0], reason="failed")
        core.requeue(db, [p for p in pairs if p[0] % 10 == 1 and p[1] == 1], uncount=False)
        core.ack(db, [p for p in pairs if p[0] % 10 != 0 and not (p[0] % 10 == 1 and p[1] == 1)])


def test_rollups_agree_with_the_history_they_were_made_from(db, schema):
    """Settles spread over five closed minutes: the rollup's per task and minute counts and
    longest runtime are the history's; its p50/p95 are the history's percentiles; the turn
    is not taken again within the minute; a later failure amends a rolled-up minute."""
    migrate(db, schema)
    _settle_some(db, schema, 400)
    # spread the settles over minutes that are closed (the rollup waits a minute after one)
    db.execute(f'UPDATE "{schema}".pgjobs_history SET settled_at = now() - '
               "make_interval(mins => 2 + (job_id % 5)::int), runtime = (job_id % 97) / 10.0")
    db.execute(f'UPDATE "{schema}".pgjobs_rollup SET upto = now() - interval \'1 hour\'')
    done = history.rollup(db, schema, "test")
    assert done is not None and done[1] == len(_rolled_from_history(db, schema)) >= 10
    assert _rollups(db, schema) == _rolled_from_history(db, schema)
    exact = set(db.execute(
        "SELECT coalesce(task, ''), date_trunc('minute', settled_at), "
        "round(percentile_cont(0.5) WITHIN GROUP (ORDER BY runtime)::numeric, 3), "
        "round(percentile_cont(0.95) WITHIN GROUP (ORDER BY runtime)::numeric, 3) "
        f'FROM "{schema}".pgjobs_history GROUP BY 1, 2').fetchall())
    assert set(db.execute("SELECT task, minute, round(runtime_p50::numeric, 3), "
                          f'round(runtime_p95::numeric, 3) FROM "{schema}".pgjobs_task_minute'
                          ).fetchall()) == exact
    assert history.rollup(db, schema, "test") is None  # the minute's turn is taken
    # the stats over the window add up to the history
    stats = {s["task"]: s for s in history.stats(db, schema, seconds=3600)}
    for task in ("t.0", "t.1"):
        rows = Counter(o for _, o in db.execute(
            f'SELECT task, outcome FROM "{schema}".pgjobs_history WHERE task = %s', (task,)))
        assert (stats[task]["completed"], stats[task]["failed"], stats[task]["requeued"]) == \
            (rows["completed"], rows["failed"], rows["requeued"])
        assert stats[task]["failure_ratio"] == pytest.approx(
            rows["failed"] / (rows["completed"] + rows["failed"]))
    # an early-acked run's failure told after its minute was rolled up moves its settle
    job_id, claim, task = db.execute(
        f"SELECT job_id, claim, task FROM \"{schema}\".pgjobs_history "
        "WHERE outcome = 'completed' ORDER BY job_id LIMIT 1").fetchone()
    assert history.record_outcome(db, schema, job=(job_id, claim), outcome="failed",
                                  queue="q", shard="x", task=task, elapsed=600.0) == 1
    assert _rollups(db, schema) == _rolled_from_history(db, schema)


def test_a_rollup_behind_by_hours_catches_up_an_hour_a_turn(db, schema):
    """After a long stall the rollup takes at most an hour of minutes a turn (each turn stays
    well inside the keeper's bound of half a lease) and says it is behind, until the rollups
    equal the history again."""
    migrate(db, schema)
    _settle_some(db, schema, 300)
    db.execute(f'UPDATE "{schema}".pgjobs_history SET settled_at = now() - '
               "make_interval(mins => 2 + (job_id % 170)::int)")
    db.execute(f"UPDATE \"{schema}\".pgjobs_rollup SET upto = "
               "date_trunc('minute', now()) - interval '4 hours'")
    start = db.execute(f'SELECT upto FROM "{schema}".pgjobs_rollup').fetchone()[0]
    turns = []
    while True:
        done = history.rollup(db, schema, "test")
        assert done is not None
        turns.append(done)
        if not done[2]:
            break
        assert len(turns) < 10
    assert [t[0] - start for t in turns[:-1]] == [
        timedelta(hours=n) for n in range(1, len(turns))]
    assert len(turns) == 4 and turns[-1][0] - turns[-2][0] <= timedelta(hours=1)
    assert _rollups(db, schema) == _rolled_from_history(db, schema)


def _race(dsn: str, schema: str, start: Any, out: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        start.wait()
        got = history.rollup(conn, schema, f"racer-{multiprocessing.current_process().pid}")
        out.put(None if got is None else got[1])


def test_processes_racing_for_the_rollup_take_it_once(db, dsn, schema):
    """Six processes ask for the rollup's turn at once: one rolls up, the others get nothing,
    and no minute is counted twice."""
    migrate(db, schema)
    _settle_some(db, schema, 200)
    db.execute(f'UPDATE "{schema}".pgjobs_history SET settled_at = now() - '
               "make_interval(mins => 2 + (job_id % 3)::int)")
    db.execute(f'UPDATE "{schema}".pgjobs_rollup SET upto = now() - interval \'1 hour\'')
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(dsn, schema, start, out)) for _ in range(6)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    start.set()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert sum(g is not None for g in got) == 1, got
    assert _rollups(db, schema) == _rolled_from_history(db, schema)


def test_a_keeper_asks_for_the_rollup_after_its_settles_and_never_when_idle(db, url, schema):
    """A consumer's keeper asks for the rollup's turn at its first tick after its process
    settled something, never before any settle (an idle fleet sends nothing for it)."""
    migrate(db, schema)
    turn = f'SELECT rolled_by, upto FROM "{schema}".pgjobs_rollup'
    db.execute(f'UPDATE "{schema}".pgjobs_rollup SET upto = now() - interval \'1 hour\'')
    with Connection(url, transport_options={"schema": schema, "lease_ttl": 3}) as conn:
        q = conn.SimpleQueue("k")
        q.put({"n": 1}, headers={"task": "t.k"})
        time.sleep(2.5)  # keeper ticks (every second under this lease) before any settle
        assert db.execute(turn).fetchone()[0] is None
        q.get(timeout=10).ack()
        who = wait_for(lambda: db.execute(turn).fetchone()[0], 10, what="the keeper's turn")
        assert who == db.execute(f'SELECT worker FROM "{schema}".pgjobs_history').fetchone()[0]
        upto = db.execute(turn).fetchone()[1]
        time.sleep(2.5)  # more ticks: no second turn within the minute
        assert db.execute(turn).fetchone()[1] == upto
        q.close()


def test_the_cli_lists_history_newest_first_and_prints_stats(db, url, schema, capsys):
    """``pgjobs history`` filters by task, outcome and age, newest first, with a cursor;
    ``pgjobs stats`` prints per-task figures; bad input is a coded error."""
    migrate(db, schema)
    _settle_some(db, schema, 60)
    common = ["--dsn", url, "--schema", schema, "--json"]
    capsys.readouterr()
    assert cli(["history", "--task", "t.1", "--outcome", "failed", "--since", "1h",
                *common]) == 0
    items = json.loads(capsys.readouterr().out)["items"]
    expect = db.execute(f"SELECT job_id FROM \"{schema}\".pgjobs_history WHERE task = 't.1' "
                        "AND outcome = 'failed' ORDER BY settled_at DESC, job_id DESC"
                        ).fetchall()
    assert [i["job_id"] for i in items] == [r[0] for r in expect] and items
    assert cli(["history", "--limit", "5", *common]) == 0
    page = json.loads(capsys.readouterr().out)
    assert len(page["items"]) == 5 and page["next"]
    assert cli(["stats", *common]) == 0
    tasks = {t["task"]: t for t in json.loads(capsys.readouterr().out)["tasks"]}
    assert sum(t["settled"] for t in tasks.values()) == db.execute(
        f'SELECT count(*) FROM "{schema}".pgjobs_history').fetchone()[0]
    assert cli(["history", "--outcome", "acked", "--dsn", url, "--schema", schema]) == 2
    assert cli(["history", "--limit", "0", "--dsn", url, "--schema", schema]) != 0
    capsys.readouterr()
    with pytest.raises(InvalidArgument):
        history.list_history(db, schema, outcome="acked")
