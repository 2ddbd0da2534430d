"""The leader scheduler in one process, on a real Postgres: fencing, catch-up after a simulated
outage (an injected clock, never a sleep), DST in two time zones, dynamic entries from the CLI,
bad input, another broker.
"""

from __future__ import annotations

import json
import socket
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.schedules import crontab

from celery_ext.scheduler import LeaderScheduler
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.recurrence import catch_up_plan, parse_schedule
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.scheduling import EntryDef, ScheduleStore
from kombu_pgjobs.store.schema import migrate

from .conftest import ROOT, wait_for

UTC = timezone.utc


def _app(url: str, schema: str, schedule: dict[str, Any], **conf: Any) -> Celery:
    app = Celery("sched_test", broker=url, set_as_current=False)
    app.conf.update(broker_transport_options={"schema": schema}, beat_schedule=schedule,
                    task_ignore_result=True,
                    **{"pgjobs_scheduler_lease_ttl_seconds": 1.5,
                       "result_expires": None,  # no celery.backend_cleanup entry
                       **conf})
    return app


class Clock:
    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now


def _fired(db: psycopg.Connection[Any], schema: str, entry: str) -> list[tuple[str, int]]:
    """(occurrence header, missed header) of each message of ``entry``, oldest first."""
    return [(r[0], int(r[1])) for r in db.execute(
        f"""SELECT message->'headers'->>'pgjobs_schedule_occurrence',
                   message->'headers'->>'pgjobs_schedule_missed'
              FROM "{schema}".pgjobs_job
             WHERE message->'headers'->>'pgjobs_schedule_entry' = %s ORDER BY id""",
        (entry,)).fetchall()]


@pytest.fixture
def scheduler(url: str, schema: str) -> Any:
    made: list[LeaderScheduler] = []

    def make(schedule: dict[str, Any], clock: Any = None, **conf: Any) -> LeaderScheduler:
        s = LeaderScheduler(app=_app(url, schema, schedule, **conf), clock=clock)
        made.append(s)
        wait_for(lambda: (s.elector.current() or None) and s.elector.current().leading, 10,
                 what="leadership")
        return s

    yield make
    for s in made:
        s.close()


# -- fencing ---------------------------------------------------------------------------------
def test_a_deposed_term_fires_nothing(db, schema):
    """The fence is in the statement: a holder whose lease was taken over inserts no message
    and moves no watermark, whatever it believes; nor does a fire for an entry redefined or
    paused since it was loaded, nor a second fire of the same occurrence."""
    migrate(db, schema)
    store = ScheduleStore(schema)
    core = QueueCore(schema, lease_ttl=30, max_attempts=5)
    old = store.elect(db, "old", 0.2)
    assert old is not None and old.leading
    store.sync_static(db, "old", old.term, [EntryDef("e", "t", "every 1s", None, [], {}, {})])
    entry = store.load(db)[0]
    job = job_from_message("celery", {"body": "x", "headers": {"task": "t"}, "properties": {}})
    occ = entry.anchor + timedelta(seconds=1)
    wait_for(lambda: (lambda lease: lease is not None and lease.leading and lease.term > old.term)(
        store.elect(db, "new", 5.0)), 5, what="takeover after the lease lapsed")
    fields = {"entry": entry, "occurrence": occ, "watermark": occ, "missed": 0, "job": job,
              "core": core}
    assert store.fire(db, holder="old", term=old.term, **fields) is None
    new = store.elect(db, "new", 5.0)
    assert new is not None and new.term == old.term + 1
    assert store.fire(db, holder="new", term=old.term, **fields) is None  # stale term
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0
    assert store.fire(db, holder="new", term=new.term, **fields) is not None
    assert store.fire(db, holder="new", term=new.term, **fields) is None  # same occurrence
    store.pause(db, "e", True)
    later = {**fields, "occurrence": occ + timedelta(seconds=1),
             "watermark": occ + timedelta(seconds=1)}
    assert store.fire(db, holder="new", term=new.term, **later) is None  # paused since loaded
    store.pause(db, "e", False)
    assert store.fire(db, holder="new", term=new.term, **later) is None  # redefined since
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 1
    history = db.execute(f'SELECT term, holder, job_id IS NOT NULL FROM "{schema}".'
                         "pgjobs_schedule_fire").fetchall()
    assert history == [(new.term, "new", True)]


def test_a_leader_that_still_believes_it_leads_is_fenced_by_the_statement(db, schema, scheduler,
                                                                         caplog):
    """The old leader's own view still says "leading" (its lease looked valid when it last
    renewed, and it has not run a round since: a pause) while the database gave the lease to
    another process: its fire is refused by the fire statement itself, nothing is queued,
    and the new leader fires the occurrence once."""
    clock = Clock()
    entries = {"e": {"task": "t", "schedule": 10.0}}
    old = scheduler(entries, clock, pgjobs_scheduler_lease_ttl_seconds=30.0)
    old.tick()
    old.elector._stop.set()  # its elector stops renewing (the process is "paused")
    old.elector._thread.join(5)
    assert old.elector.current().leading  # what it believes
    db.execute(f'UPDATE "{schema}".pgjobs_leader SET expires_at = clock_timestamp()')
    new = scheduler(entries, clock)  # takes the lapsed lease: term 2
    assert new.elector.current().term == old.elector.current().term + 1
    clock.now = old._entries["e"].row.anchor + timedelta(seconds=11)
    with caplog.at_level("WARNING"):
        assert old.tick() <= 0.25
    assert _fired(db, schema, "e") == []
    assert any("PGJ-620" in r.getMessage() for r in caplog.records)
    new.tick()
    new.tick()
    old.tick()
    assert len(_fired(db, schema, "e")) == 1
    terms = db.execute(f'SELECT term FROM "{schema}".pgjobs_schedule_fire').fetchall()
    assert terms == [(new.elector.current().term,)]


# -- catch-up --------------------------------------------------------------------------------
def test_catch_up_policies_after_a_ten_minute_outage(db, schema, scheduler):
    every = 60.0
    policies = {"skip": {"pgjobs_catch_up": "skip"},
                "skip_none": {"pgjobs_catch_up": "skip", "pgjobs_catch_up_latest": False},
                "once": {"pgjobs_catch_up": "once"},
                "all": {"pgjobs_catch_up": "all"},
                "all3": {"pgjobs_catch_up": "all", "pgjobs_catch_up_max": 3}}
    clock = Clock()
    s = scheduler({name: {"task": "t", "schedule": every, "options": opts}
                   for name, opts in policies.items()}, clock,
                  pgjobs_scheduler_grace_seconds=5.0)
    s.tick()  # elected: writes the entries, nothing due yet
    assert set(s.schedule) == set(policies)
    anchor = {name: s._entries[name].row.anchor for name in policies}
    assert all(_fired(db, schema, name) == [] for name in policies)

    def occ(name: str, k: int) -> str:
        return (anchor[name] + timedelta(seconds=every * k)).astimezone(UTC).isoformat()

    # ten minutes and ten seconds later: occurrences 1..10 are missed (older than the grace)
    clock.now = max(anchor.values()) + timedelta(seconds=610)
    s.tick()
    assert _fired(db, schema, "skip") == [(occ("skip", 10), 9)]
    assert _fired(db, schema, "skip_none") == []
    assert _fired(db, schema, "once") == [(occ("once", 1), 10)]
    assert _fired(db, schema, "all") == [(occ("all", k), 0) for k in range(1, 11)]
    assert _fired(db, schema, "all3") == [(occ("all3", 8), 7), (occ("all3", 9), 0),
                                          (occ("all3", 10), 0)]
    s.tick()  # nothing more for the same time
    assert len(_fired(db, schema, "all")) == 10
    # the next occurrence is on time for everyone; skip_none resumes with it
    clock.now = max(anchor.values()) + timedelta(seconds=661)
    s.tick()
    assert _fired(db, schema, "skip_none") == [(occ("skip_none", 11), 10)]
    assert _fired(db, schema, "all")[-1] == (occ("all", 11), 0)
    marks = dict(db.execute(f'SELECT name, last_occurrence FROM "{schema}".pgjobs_schedule')
                 .fetchall())
    assert all(marks[n] == anchor[n] + timedelta(seconds=660) for n in policies)


def test_watermark_survives_a_new_leader(db, schema, scheduler):
    """A new scheduler (another process after a crash) resumes from the durable watermark:
    what the first one fired is not fired again."""
    clock = Clock()
    first = scheduler({"e": {"task": "t", "schedule": 10.0,
                             "options": {"pgjobs_catch_up": "all"}}}, clock)
    first.tick()
    anchor = first._entries["e"].row.anchor
    clock.now = anchor + timedelta(seconds=35)
    first.tick()
    assert len(_fired(db, schema, "e")) == 3
    first.close()  # resigns
    second = scheduler({"e": {"task": "t", "schedule": 10.0,
                              "options": {"pgjobs_catch_up": "all"}}}, clock)
    second.tick()
    assert len(_fired(db, schema, "e")) == 3
    clock.now = anchor + timedelta(seconds=41)
    second.tick()
    fired = _fired(db, schema, "e")
    assert len(fired) == 4 and len(set(fired)) == 4


# -- time zones and DST ----------------------------------------------------------------------
def _utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


@pytest.mark.parametrize(("tz", "spring", "fall"), [
    # 2026: US changes Mar 8 (02:00 -> 03:00) and Nov 1 (02:00 -> 01:00)
    ("America/New_York", "2026-03-08", "2026-11-01"),
    # EU changes Mar 29 (02:00 -> 03:00) and Oct 25 (03:00 -> 02:00)
    ("Europe/Berlin", "2026-03-29", "2026-10-25"),
])
def test_dst_transitions(tz, spring, fall):
    from zoneinfo import ZoneInfo
    zi = ZoneInfo(tz)

    def local(text: str, fold: int = 0) -> datetime:
        return datetime.fromisoformat(text).replace(tzinfo=zi, fold=fold).astimezone(UTC)

    # spring forward: 02:30 does not exist that day; it fires once, at 03:00 (end of the gap)
    daily = parse_schedule("30 2 * * *", tz)
    before = local(f"{spring}T00:00")
    got = daily.next_after(before)
    assert got == local(f"{spring}T03:00")
    assert got.astimezone(zi).strftime("%H:%M") == "03:00"
    # and the next day it is back at 02:30
    assert daily.next_after(got) == local(
        (datetime.fromisoformat(spring) + timedelta(days=1)).strftime("%Y-%m-%d") + "T02:30")
    # a quarter-hourly entry: the skipped wall times collapse into one fire at the gap's end
    quarter = parse_schedule("*/15 * * * *", tz)
    start = local(f"{spring}T01:50")
    fires = quarter.occurrences(start, start + timedelta(hours=1), 100)
    walls = [f.astimezone(zi).strftime("%H:%M") for f in fires]
    assert walls == ["03:00", "03:15", "03:30", "03:45"]
    assert len(fires) == len(set(fires))

    # fall back: the repeated hour
    repeated = "01" if tz == "America/New_York" else "02"
    fixed = parse_schedule(f"30 {int(repeated)} * * *", tz)
    first_pass = local(f"{fall}T{repeated}:30", fold=0)
    second_pass = local(f"{fall}T{repeated}:30", fold=1)
    assert second_pass - first_pass == timedelta(hours=1)
    assert fixed.next_after(local(f"{fall}T00:00")) == first_pass
    # a fixed hour fires once: after the first pass comes the next day
    assert fixed.next_after(first_pass) > second_pass + timedelta(hours=12)
    # an every-hour entry follows real time: both passes fire
    hourly = parse_schedule("30 * * * *", tz)
    assert hourly.next_after(first_pass) == second_pass


def test_crontab_entry_fires_in_its_time_zone(db, schema, scheduler):
    """A beat_schedule crontab fires at its wall time in its time zone, through the
    scheduler (injected clock), and its message says which occurrence it is."""
    clock = Clock()
    clock.now = datetime(2026, 3, 8, 6, 0, tzinfo=UTC)  # 01:00 EST, spring-forward day
    s = scheduler({"ny": {"task": "t", "schedule": crontab(minute="30", hour="2"),
                          "options": {"pgjobs_timezone": "America/New_York"}}}, clock)
    s.tick()
    # the DB anchor is "now" on the real clock: move the watermark to the simulated night
    db.execute(f'UPDATE "{schema}".pgjobs_schedule SET anchor = %s, '
               "updated_at = clock_timestamp()", (clock.now,))
    wait_for(lambda: s.elector.current().version != s._version, 5, what="version change")
    clock.now = _utc("2026-03-08T07:00:30")  # 03:00:30 EDT: the gap just ended
    s.tick()
    assert _fired(db, schema, "ny") == [("2026-03-08T07:00:00+00:00", 0)]


def test_backend_cleanup_entry_as_celery_beat_installs_it(url, schema, scheduler):
    s = scheduler({"mine": {"task": "t", "schedule": 60.0}}, result_expires=3600)
    s.tick()
    assert set(s.schedule) == {"mine", "celery.backend_cleanup"}
    assert s.schedule["celery.backend_cleanup"].schedule == "0 4 * * *"


def test_solar_entry_fires_once_per_event(db, schema, scheduler):
    """A Celery solar schedule (sunset in Paris) fires once per sunset, at the sunset: the
    same event found again from a later tick is not a second occurrence."""
    from celery.schedules import solar

    clock = Clock()
    s = scheduler({"dusk": {"task": "t", "schedule": solar("sunset", 48.8566, 2.3522)}}, clock)
    s.tick()
    assert s.schedule["dusk"].schedule == "solar sunset 48.8566 2.3522"
    db.execute(f'UPDATE "{schema}".pgjobs_schedule SET anchor = %s, '
               "updated_at = clock_timestamp()", (_utc("2026-06-21T00:00:00"),))
    wait_for(lambda: s.elector.current().version != s._version, 5, what="version change")
    for now in ("2026-06-21T12:00:00", "2026-06-21T20:30:00", "2026-06-21T23:00:00",
                "2026-06-22T20:30:00", "2026-06-22T20:31:00"):
        clock.now = _utc(now)
        s.tick()
    fired = [datetime.fromisoformat(o) for o, _ in _fired(db, schema, "dusk")]
    assert len(fired) == 2
    # sunset in Paris on the solstice is 21:58 CEST (19:58 UTC)
    assert _utc("2026-06-21T19:50:00") <= fired[0] <= _utc("2026-06-21T20:05:00")
    assert timedelta(hours=23, minutes=55) < fired[1] - fired[0] < timedelta(hours=24, minutes=5)


def test_solar_entry_added_from_the_cli(db, schema, dsn, scheduler, capsys):
    s = scheduler({})
    assert cli(["--dsn", dsn, "--schema", schema, "schedule", "add", "dawn", "t",
                "solar sunrise 40.7128 -74.006"]) == 0
    wait_for(lambda: (s.tick() or True) and "dawn" in s._entries, 10, what="the entry loaded")
    nxt = s._entries["dawn"].rec.next_after(datetime(2026, 3, 20, tzinfo=UTC))
    assert _utc("2026-03-20T10:30:00") <= nxt <= _utc("2026-03-20T11:30:00")  # ~07:00 EDT


def test_catch_up_plan_is_pure_and_bounded():
    rec = parse_schedule("every 1s")
    anchor = datetime(2026, 1, 1, tzinfo=UTC)
    now = anchor + timedelta(days=30)  # a month down: 2.6 million missed occurrences
    plan = catch_up_plan(rec, anchor, anchor, now, policy="all", cap=5, grace=0)
    # the newest 5 missed ones (the older counted on the first), then the one due now
    assert [f[0] for f in plan.fires] == [now - timedelta(seconds=k) for k in range(5, -1, -1)]
    assert plan.fires[0][2] == 30 * 86400 - 1 - 5
    plan = catch_up_plan(rec, anchor, anchor, now, policy="skip", cap=5, grace=0,
                         latest=False)
    assert plan.fires == [(now, now, 30 * 86400 - 1)]  # only the one due now, with the count
    assert plan.next_due == now + timedelta(seconds=1)



@pytest.mark.parametrize("policy", ["skip", "once", "all"])
def test_an_outage_shorter_than_the_grace_fires_every_occurrence_whatever_the_policy(policy):
    """The grace is per occurrence (docs/scheduler.md, catch-up): a 54 s outage of an every-2 s
    entry leaves 27 occurrences, each under 60 s old, so all 27 fire at once under any policy;
    after a 10-minute outage the last minute's 31 (60 s old included) fire that way, and the
    policy decides only for the 269 older ones."""
    rec = parse_schedule("every 2s")
    anchor = datetime(2026, 1, 1, tzinfo=UTC)
    now = anchor + timedelta(seconds=600)
    plan = catch_up_plan(rec, now - timedelta(seconds=54), anchor, now, policy=policy, cap=100,
                         grace=60)
    assert len(plan.fires) == 27 and all(f[2] == 0 for f in plan.fires)
    plan = catch_up_plan(rec, anchor, anchor, now, policy=policy, cap=100, grace=60)
    on_time = [f for f in plan.fires if f[0] >= now - timedelta(seconds=60)]
    assert len(on_time) == 31
    older = len(plan.fires) - len(on_time)
    assert older == {"skip": 0, "once": 1, "all": 100}[policy], plan.fires[:3]  # all: the cap


def test_the_catch_up_table_example_fires_what_each_cell_says():
    """docs/scheduler.md's catch-up table, on its own example: every minute, last fired at
    12:00, down from 12:00:30 to 12:10:30, the default 60 s grace (12:10 on time, 12:01-12:09
    missed); then the paragraph under it, a grace of 0."""
    doc = (ROOT / "docs" / "scheduler.md").read_text("utf-8")
    assert "down from\n12:00:30 to 12:10:30, the default grace of 60 s" in doc  # the example
    rec = parse_schedule("every 1m")
    noon = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    now = noon + timedelta(minutes=10, seconds=30)

    def at(minute: int) -> datetime:
        return noon + timedelta(minutes=minute)

    def plan(policy: str, grace: float = 60, latest: bool = True) -> Any:
        return catch_up_plan(rec, noon, noon, now, policy=policy, cap=100, grace=grace,
                             latest=latest)

    # skip: one run, the on-time 12:10, carrying missed = 9 (pgjobs_catch_up_latest moot)
    assert plan("skip").fires == plan("skip", latest=False).fires == [(at(10), at(10), 9)]
    # once: the first missed (12:01, accounting up to 12:09) with missed = 9, then 12:10
    assert plan("once").fires == [(at(1), at(9), 9), (at(10), at(10), 0)]
    # all: ten runs, oldest first, none carrying a count
    assert plan("all").fires == [(at(m), at(m), 0) for m in range(1, 11)]
    assert all(plan(p).next_due == at(11) for p in ("skip", "once", "all"))
    # a grace of 0: nothing on time
    assert plan("skip", grace=0).fires == [(at(10), at(10), 9)]
    none = plan("skip", grace=0, latest=False)
    assert none.fires == [] and none.skipped == (at(10), 10)
    assert plan("once", grace=0).fires == [(at(1), at(10), 10)]


# -- dynamic entries -------------------------------------------------------------------------
def test_cli_entry_fires_without_restart(db, schema, scheduler, dsn, capsys):
    s = scheduler({})
    s.tick()
    assert cli(["--dsn", dsn, "--schema", schema, "schedule", "add", "dyn", "t",
                "every 1s", "--args", '["a"]', "--queue", "dynq"]) == 0
    capsys.readouterr()

    def fired() -> int:
        s.tick()
        return len(_fired(db, schema, "dyn"))

    wait_for(lambda: fired() >= 2, 15, what="the dynamic entry to fire")
    queues = {r[0] for r in db.execute(f'SELECT DISTINCT queue FROM "{schema}".pgjobs_job')}
    assert queues == {"dynq"}
    assert cli(["--dsn", dsn, "--schema", schema, "--json", "schedule", "history", "dyn"]) == 0
    history = json.loads(capsys.readouterr().out)
    assert len(history["fires"]) >= 2 and all(f["job_id"] for f in history["fires"])
    assert cli(["--dsn", dsn, "--schema", schema, "--json", "schedule", "ls"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["leader"]["holder"] == s.holder and listed["entries"][0]["name"] == "dyn"
    # paused: nothing more fires
    assert cli(["--dsn", dsn, "--schema", schema, "schedule", "pause", "dyn"]) == 0
    wait_for(lambda: (s.tick() or True) and s._entries["dyn"].row.paused, 10,
             what="pause seen")
    n = len(_fired(db, schema, "dyn"))
    for _ in range(3):
        s.tick()
    clock_end = datetime.now(UTC) + timedelta(seconds=1.2)
    while datetime.now(UTC) < clock_end:
        s.tick()
    assert len(_fired(db, schema, "dyn")) == n


# -- bad input -------------------------------------------------------------------------------
@pytest.mark.parametrize(("entry", "code"), [
    ({"task": "t", "schedule": 0}, "PGJ-601"),
    ({"task": "t", "schedule": timedelta(seconds=-5)}, "PGJ-601"),
    ({"task": "t", "schedule": crontab(), "options": {"pgjobs_timezone": "Mars/Base"}},
     "PGJ-602"),
    ({"task": "t", "schedule": 5, "options": {"pgjobs_catch_up": "sometimes"}}, "PGJ-603"),
    ({"task": "t", "schedule": 5, "options": {"pgjobs_catch_up": "all",
                                              "pgjobs_catch_up_max": 0}}, "PGJ-603"),
    ({"task": "t", "schedule": 5, "args": [object()]}, "PGJ-604"),
    ({"schedule": 5}, "PGJ-604"),
])
def test_bad_beat_schedule_refused_at_start(url, schema, db, entry, code):
    app = _app(url, schema, {"bad": entry})
    with pytest.raises(Exception) as info:
        LeaderScheduler(app=app)
    assert getattr(info.value, "code", None) == code, info.value
    # nothing was written: not even the schema
    assert db.execute("SELECT to_regclass(%s)", (f'"{schema}".pgjobs_schedule',)
                      ).fetchone()[0] is None


@pytest.mark.parametrize(("argv", "code"), [
    (["e", "t", "61 * * * *"], "PGJ-601"),
    (["e", "t", "* * *"], "PGJ-601"),
    (["e", "t", "0 0 30 2 *"], "PGJ-601"),  # never matches (Feb 30)
    (["e", "t", "every 0s"], "PGJ-601"),
    (["e", "t", "every -3m"], "PGJ-601"),
    (["e", "t", "*/5 * * * *", "--timezone", "Mars/Base"], "PGJ-602"),
    (["e", "t", "every 5s", "--catch-up", "sometimes"], "PGJ-603"),
    (["e", "t", "every 5s", "--args", "{not json"], "PGJ-604"),
    (["e\x07", "t", "every 5s"], "PGJ-604"),
    (["e", "t", "every 5s", "--priority", "12"], "PGJ-604"),
    (["e", "t", "every 5s", "--queue", "q\x07"], "PGJ-103"),
    (["e", "t", "solar moonrise 48.85 2.35"], "PGJ-601"),
    (["e", "t", "solar sunset 95 2.35"], "PGJ-601"),
    (["e", "t", "solar sunset north east"], "PGJ-601"),
])
def test_bad_schedule_add_refused(db, schema, dsn, capsys, argv, code):
    migrate(db, schema)
    rc = cli(["--dsn", dsn, "--schema", schema, "--json", "schedule", "add", *argv])
    assert rc == 2
    assert json.loads(capsys.readouterr().out)["error"]["code"] == code
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_schedule').fetchone()[0] == 0


def test_schedule_commands_on_unknown_entries(db, schema, dsn, capsys):
    migrate(db, schema)
    for command in ("pause", "resume", "remove", "history"):
        assert cli(["--dsn", dsn, "--schema", schema, "--json", "schedule", command,
                    "nope"]) == 2
        assert json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-605"
    assert cli(["--dsn", dsn, "--schema", schema, "schedule", "add", "e", "t",
                "every 5s"]) == 0
    assert cli(["--dsn", dsn, "--schema", schema, "--json", "schedule", "add", "e", "t",
                "every 9s"]) == 2
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["error"]["code"] == "PGJ-606"
    assert cli(["--dsn", dsn, "--schema", schema, "schedule", "add", "e", "t",
                "every 9s", "--replace"]) == 0
    assert db.execute(f'SELECT schedule FROM "{schema}".pgjobs_schedule').fetchone()[0] == \
        "every 9s"


# -- another broker --------------------------------------------------------------------------
def _leading_on_memory_broker(schema: str, dsn: str, queue: str,
                              **conf: Any) -> tuple[Celery, Clock, LeaderScheduler]:
    """A scheduler on kombu's in-process memory broker (another broker than pgjobs), leading,
    its 10-second entry three occurrences behind (catch-up ``all``) after two ticks."""
    app = Celery("sched_memory", broker="memory://", set_as_current=False)
    app.conf.update(beat_schedule={"e": {"task": "t", "schedule": 10.0,
                                         "options": {"queue": queue,
                                                     "pgjobs_catch_up": "all"}}},
                    pgjobs_scheduler_url=dsn, pgjobs_scheduler_schema=schema,
                    pgjobs_scheduler_lease_ttl_seconds=1.5, **conf)
    clock = Clock()
    s = LeaderScheduler(app=app, clock=clock)
    try:
        wait_for(lambda: s.elector.current() and s.elector.current().leading, 10,
                 what="leadership")
        s.tick()
        clock.now = s._entries["e"].row.anchor + timedelta(seconds=31)
        s.tick()
    except BaseException:
        s.close()
        raise
    return app, clock, s


def test_other_broker_publishes_after_the_watermark(db, schema, dsn):
    """With another broker (kombu's in-process memory transport here) the fire is recorded
    (watermark, history) in Postgres, then published to that broker: one message per
    occurrence, with its headers."""
    queue = f"q_{schema}"
    app, _clock, s = _leading_on_memory_broker(schema, dsn, queue)
    try:
        s.tick()
        rows = db.execute(f'SELECT count(*), count(job_id) FROM "{schema}".'
                          "pgjobs_schedule_fire").fetchone()
        assert rows == (3, 0)
        with app.connection_for_read() as conn:
            q = conn.SimpleQueue(queue)
            got = [q.get(timeout=1) for _ in range(3)]
            assert q.qsize() == 0
            q.close()
        assert [m.headers["pgjobs_schedule_entry"] for m in got] == ["e"] * 3
        assert len({m.headers["pgjobs_schedule_occurrence"] for m in got}) == 3
    finally:
        s.close()


def test_other_broker_through_the_outbox_stages_each_fire_in_its_own_transaction(
        db, schema, dsn):
    """``pgjobs_scheduler_outbox``: with another broker, each fire and its message are one
    transaction — the message is staged in the scheduler schema's outbox (nothing published
    directly), and the relay publishes it once. A refused (fenced) fire stages nothing."""
    from kombu_pgjobs.broker.relay import Relay

    queue = f"q_{schema}"
    app, clock, s = _leading_on_memory_broker(schema, dsn, queue, pgjobs_scheduler_outbox=True)
    try:
        fires = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_schedule_fire').fetchone()
        staged = db.execute(f'SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) '
                            f'FROM "{schema}".pgjobs_outbox').fetchone()
        assert fires == (3,) and staged == (3, 3), (fires, staged)
        with app.connection_for_read() as conn:
            assert conn.SimpleQueue(queue).qsize() == 0, "nothing published past the outbox"
        # a deposed leader's fire: refused by the fence, and its message never staged
        lease = s.elector.current()
        db.execute(f'UPDATE "{schema}".pgjobs_leader SET term = term + 1')
        entry = s._entries["e"]
        assert not s._fire(lease, entry, clock.now + timedelta(seconds=10),
                           clock.now + timedelta(seconds=10), 0)
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_outbox').fetchone() == (3,)
    finally:
        s.close()
    relay = Relay(dsn, "memory://", schema=schema, batch=10)
    try:
        assert relay.run_once() == 3
    finally:
        relay.close()
    with app.connection_for_read() as conn:
        q = conn.SimpleQueue(queue)
        got = [q.get(timeout=1) for _ in range(3)]
        assert q.qsize() == 0
        q.close()
    assert len({m.headers["pgjobs_schedule_occurrence"] for m in got}) == 3


# -- idle cost -------------------------------------------------------------------------------
@pytest.mark.exclusive  # timing bound: statements counted per 0.5 s election round
def test_idle_cost_is_one_statement_per_election_round(dsn, schema):
    """An idle leader (nothing due) sends one statement per election round (every third of the
    lease TTL) and nothing else; an idle follower the same. Counted on the wire by a proxy.
    At the default TTL of 15 s that is 12 statements per idle minute per replica."""
    from .wirecount import WireCounter

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    ttl = 1.5  # rounds every 0.5 s: a minute's worth of rounds in 6 s
    with WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432))) as wire:
        url = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
               f"{info.get('dbname', 'test')}")
        schedule = {"hourly": {"task": "t", "schedule": crontab(minute="0")}}
        leader = LeaderScheduler(app=_app(url, schema, schedule))
        follower = LeaderScheduler(app=_app(url, schema, schedule))
        try:
            leading = wait_for(lambda: next((s for s in (leader, follower)
                                             if (s.elector.current() or None)
                                             and s.elector.current().leading), None), 10,
                               what="a leader")
            leading.tick()  # elected: writes and loads the entries
            before = wire.count()
            seen = dict(wire.by_text)
            start = time.monotonic()
            while time.monotonic() - start < 6.0:  # what celery beat's loop does
                for s in (leader, follower):
                    s.tick()
                time.sleep(min(leader.tick(), follower.tick(), 0.5))
            elapsed = time.monotonic() - start
            idle = wire.count() - before
            during = {k: v - seen.get(k, 0) for k, v in wire.by_text.items()
                      if v - seen.get(k, 0)}
        finally:
            leader.close()
            follower.close()
    rounds = 2 * elapsed / (ttl / 3)
    assert idle <= rounds + 4, f"{idle} statements in {elapsed:.1f}s ({rounds:.0f} rounds): "\
        f"{during}"
    # (by_text is not checked: psycopg names prepared statements per connection, the same
    # names on both replicas' connections, so the proxy cannot attribute them)
    assert idle >= rounds / 2, f"fewer statements than election rounds: {idle}"
    per_minute_at_default = idle / 2 / elapsed * (ttl / 15.0) * 60
    print(f"idle: {idle} statements in {elapsed:.1f}s for 2 replicas; "
          f"{per_minute_at_default:.1f} per replica per idle minute at the default TTL")


def _leading(s: LeaderScheduler) -> bool:
    lease = s.elector.current()
    return lease is not None and lease.leading


@pytest.mark.exclusive  # timing bound: a takeover within 2.5 lease TTLs of 1.5 s
def test_leader_that_loses_the_database_is_replaced(db, dsn, schema, url):
    """The leader reaches PostgreSQL through a proxy that is then cut: it stops leading (its
    renewals fail), and a follower takes over within about one lease TTL and fires."""
    from .wirecount import WireCounter

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    schedule = {"e": {"task": "t", "schedule": 1.0}}
    wire = WireCounter(info.get("host", "127.0.0.1"), int(info.get("port", 5432)))
    cut_url = (f"pgjobs://{info.get('user', 'postgres')}@127.0.0.1:{wire.port}/"
               f"{info.get('dbname', 'test')}")
    leader = LeaderScheduler(app=_app(cut_url, schema, schedule))
    follower = None
    try:
        wait_for(lambda: _leading(leader), 10, what="the first leader")
        first_term = leader.elector.current().term
        follower = LeaderScheduler(app=_app(url, schema, schedule))
        assert not _leading(follower)
        # the leader's connections drop and it cannot reconnect (shutdown first: a close
        # alone does not wake the proxy's thread blocked in accept(), which would take one
        # more connection)
        wire.server.shutdown(socket.SHUT_RDWR)
        wire.close()
        cut = time.monotonic()
        wait_for(lambda: not _leading(leader), 5, what="the leader to step down")
        wait_for(lambda: _leading(follower), 10, what="a takeover")
        took = time.monotonic() - cut
        assert took < 1.5 * 2.5, f"takeover after {took:.1f}s with a 1.5s lease"
        assert follower.elector.current().term == first_term + 1
        assert leader.tick() > 0  # a follower's round: nothing attempted
        wait_for(lambda: (follower.tick() or True) and db.execute(
            f'SELECT count(*) FROM "{schema}".pgjobs_schedule_fire WHERE term = %s',
            (first_term + 1,)).fetchone()[0] >= 2, 10, what="the new leader to fire")
    finally:
        leader.close()
        if follower is not None:
            follower.close()


def test_history_retention(db, schema, scheduler):
    """The leader deletes fires older than pgjobs_scheduler_history_days, newer ones stay."""
    migrate(db, schema)
    db.execute(f'INSERT INTO "{schema}".pgjobs_schedule_fire '
               "(entry, occurrence, fired_at, term, holder) "
               "SELECT 'e', now() - make_interval(days => d), now() - make_interval(days => d),"
               " 1, 'h' FROM generate_series(1, 10) AS d")
    s = scheduler({}, pgjobs_scheduler_history_days=3)
    s.tick()
    left = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_schedule_fire').fetchone()[0]
    assert left == 2  # 1 and 2 days old


def _reference_fires(text: str, tz: str, start: datetime, hours: int) -> list[datetime]:
    """The documented DST rules applied minute by minute, independently of the scheduler's
    search: a matching wall time fires on its first pass (on both passes when the hour field
    is '*'); matching wall times skipped by a gap fire once, at the gap's end."""
    from zoneinfo import ZoneInfo

    cron = parse_schedule(text, tz)
    zi = ZoneInfo(tz)

    def matches(w: datetime) -> bool:
        return (w.minute in cron.minute and w.hour in cron.hour and w.day in cron.day_of_month
                and w.month in cron.month and w.isoweekday() % 7 in cron.day_of_week)

    fires = []
    t = start
    prev = (t - timedelta(minutes=1)).astimezone(zi)
    while t < start + timedelta(hours=hours):
        local = t.astimezone(zi)
        wall = local.replace(tzinfo=None)
        expected_prev = prev.replace(tzinfo=None) + timedelta(minutes=1)
        skipped = []
        while expected_prev < wall:  # a gap: wall times that never happen
            skipped.append(expected_prev)
            expected_prev += timedelta(minutes=1)
        if (matches(wall) and (local.fold == 0 or cron.every_hour)) or \
                any(matches(w) for w in skipped):
            fires.append(t)
        prev = local
        t += timedelta(minutes=1)
    return fires


@pytest.mark.parametrize("tz", ["America/New_York", "Europe/Berlin", "Australia/Lord_Howe"])
@pytest.mark.parametrize("text", ["*/15 * * * *", "30 2 * * *", "0 * * * *", "30 1 * * *",
                                  "5,35 0-3 * * *", "0 2 * * *"])
@pytest.mark.parametrize("day", ["spring", "fall"])
def test_dst_matches_the_documented_rules_minute_by_minute(tz, text, day):
    days = {("America/New_York", "spring"): "2026-03-07T20:00", ("America/New_York", "fall"):
            "2026-10-31T20:00", ("Europe/Berlin", "spring"): "2026-03-28T20:00",
            ("Europe/Berlin", "fall"): "2026-10-24T20:00",
            # a half-hour shift: 02:00 -> 02:30 in October, 02:00 -> 01:30 in April
            ("Australia/Lord_Howe", "spring"): "2026-10-03T20:00",
            ("Australia/Lord_Howe", "fall"): "2026-04-04T20:00"}
    from zoneinfo import ZoneInfo
    start = datetime.fromisoformat(days[tz, day]).replace(tzinfo=ZoneInfo(tz)).astimezone(UTC)
    hours = 12
    expected = _reference_fires(text, tz, start, hours)
    rec = parse_schedule(text, tz)
    got = rec.occurrences(start - timedelta(seconds=1), start + timedelta(hours=hours)
                          - timedelta(seconds=1), 10_000)
    assert got == expected


def test_guarded_messages_keys_absorb_caps_refuse_others_go_on(db, schema, scheduler, caplog):
    """A scheduled message with an idempotency key goes through the guarded publish inside
    the fenced statement: while the previous occurrence's message holds the key, the next
    occurrence is recorded and queues nothing. One over its tenant's queue cap is refused
    (PGJ-506, logged as pgjobs.schedule.failed): nothing recorded, its watermark unmoved, and
    the other entries fire."""
    clock = Clock()
    s = scheduler({
        "keyed": {"task": "t", "schedule": 10.0, "options": {
            "headers": {"x-pgjobs-idempotency-key": "k"}}},
        "capped": {"task": "t", "schedule": 10.0, "options": {
            "headers": {"x-pgjobs-tenant": "acme", "x-pgjobs-tenant-max-queued": 1}}},
        "plain": {"task": "t", "schedule": 10.0}}, clock)
    s.tick()
    base = max(e.row.anchor for e in s._entries.values())
    clock.now = base + timedelta(seconds=11)
    s.tick()
    assert [len(_fired(db, schema, n)) for n in ("keyed", "capped", "plain")] == [1, 1, 1]
    clock.now = base + timedelta(seconds=21)
    with caplog.at_level("WARNING"):
        s.tick()
    assert len(_fired(db, schema, "keyed")) == 1  # absorbed by the live holder of "k"
    assert len(_fired(db, schema, "capped")) == 1  # refused by the cap
    assert len(_fired(db, schema, "plain")) == 2
    assert any("PGJ-622" in r.getMessage() and "PGJ-506" in r.getMessage()
               for r in caplog.records)
    fires = dict(db.execute(f'SELECT name, fires FROM "{schema}".pgjobs_schedule').fetchall())
    assert fires == {"keyed": 2, "capped": 1, "plain": 2}
    history = db.execute(f'SELECT job_id IS NOT NULL FROM "{schema}".pgjobs_schedule_fire '
                         "WHERE entry = 'keyed' ORDER BY occurrence").fetchall()
    assert history == [(True,), (False,)]
