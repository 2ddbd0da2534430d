"""The dashboard's on-call pages (issue 34, item 4) against real Postgres and real settles.

History is made by the transport's own settles: messages published and acked through kombu
(``Connection`` + ``SimpleQueue`` on the test schema), and claimed, acked and buried through the
queue core's statements (a dead letter as the transport keeps one, and celery_ext's copy with
its own id recorded by :func:`kombu_pgjobs.store.admin.record_dead_letter`). Every figure a page
shows is compared with what is read back from ``pgjobs_history``; every action's effect and its
audit row are read back from the database.
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from typing import Any

import psycopg
import pytest
from kombu import Connection
from starlette.testclient import TestClient

from kombu_pgjobs.ops.dashboard import create_app
from kombu_pgjobs.ops.dashboard.oncall import ARGS_SCAN, contains
from kombu_pgjobs.store import history
from kombu_pgjobs.store.admin import record_dead_letter
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.scheduling import EntryDef, ScheduleStore
from kombu_pgjobs.store.schema import migrate
from tests.test_cli import claim, publish
from tests.test_dashboard import TOKEN, sign_in

ERROR = {"type": "CardDeclined", "message": "card 4242 declined by issuer",
         "traceback": "Traceback (most recent call last):\n  ...\nCardDeclined"}


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=20, worker="oncall-test@host:77:1")


@pytest.fixture
def client(url: str, schema: str) -> Any:
    made: list[TestClient] = []

    def make(*, write: bool = False) -> TestClient:
        app = create_app(url, schema=schema, write=write, token=TOKEN if write else None,
                         pool_size=2)
        c = TestClient(app)
        made.append(c)
        return c

    yield make
    for c in made:
        c.app.state.dashboard.close()  # type: ignore[attr-defined]


def settle_through_kombu(url: str, schema: str, queue: str, task: str, n: int) -> None:
    """``n`` messages of ``task`` published and acked through kombu: real completions."""
    with Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue(queue)
        for i in range(n):
            q.put({"i": i}, headers={"task": task, "id": str(uuid.uuid4())})
        for _ in range(n):
            q.get(timeout=10).ack()
        q.close()


def ack(core: QueueCore, db: psycopg.Connection[Any], queue: str, task: str, n: int) -> list[int]:
    ids = [publish(core, db, queue, task=task) for _ in range(n)]
    pairs = [p for p in claim(core, db, queue, 100) if p[0] in ids]
    assert core.ack(db, pairs) == set(ids)
    return ids


def bury(core: QueueCore, db: psycopg.Connection[Any], queue: str, task: str,
         error: dict[str, Any] | None = None) -> int:
    """A failure as the transport keeps it: the dead letter has the message's id."""
    job_id = publish(core, db, queue, task=task)
    pairs = [p for p in claim(core, db, queue, 100) if p[0] == job_id]
    assert core.bury(db, pairs, reason="rejected", error=error or ERROR) == {job_id}
    return job_id


def fail_with_copy(core: QueueCore, db: psycopg.Connection[Any], queue: str,
                   task: str) -> tuple[int, int]:
    """A failure as celery_ext keeps it: a dead letter copy with its own id naming the job in
    error ->> 'job_id', the outcome told, then the ack. Returns (job id, dead letter id)."""
    job_id = publish(core, db, queue, task=task)
    pair = next(p for p in claim(core, db, queue, 100) if p[0] == job_id)
    dead_id = record_dead_letter(db, core.schema, queue=queue, task=task, message={},
                                 reason="failed", error={**ERROR, "job_id": job_id}, job=pair,
                                 attempts=1, shard=core.worker)
    history.record_outcome(db, core.schema, job=pair, outcome="failed", queue=queue,
                           shard=core.worker)
    assert core.ack(db, [pair]) == {job_id}
    assert dead_id != job_id
    return job_id, dead_id


def table_rows(page: str) -> dict[str, dict[str, str]]:
    """The tasks page's rows: task -> {column: text}."""
    out = {}
    for task, body in re.findall(r'<tr data-task="([^"]*)">(.*?)</tr>', page, re.S):
        cols = dict(re.findall(r'data-col="(\w+)">([^<]*)<', body))
        out[task] = cols
    return out


def order_of(page: str) -> list[str]:
    return re.findall(r'<tr data-task="([^"]*)">', page)


def test_tasks_page_numbers_agree_with_the_history(core, db, client, schema, url):
    settle_through_kombu(url, schema, "shop", "shop.add", 6)
    ack(core, db, "shop", "shop.charge", 4)
    for _ in range(2):
        bury(core, db, "shop", "shop.charge")
    fail_with_copy(core, db, "shop", "shop.charge")
    ack(core, db, "mail", "mail.send", 3)
    bury(core, db, "mail", "mail.send")

    # half the history two minutes back, rolled up: the page adds rollups and the tail
    db.execute(f'UPDATE "{schema}".pgjobs_history SET settled_at = settled_at - '
               "interval '2 minutes' WHERE job_id % 2 = 0")
    db.execute(f"UPDATE \"{schema}\".pgjobs_rollup SET upto = now() - interval '1 hour'")
    done = history.rollup(db, schema, "test")
    assert done is not None and done[1] > 0
    rolled = db.execute(f'SELECT sum(completed + failed) FROM "{schema}".pgjobs_task_minute'
                        ).fetchone()[0]
    assert rolled > 0

    truth = {t: (n, f) for t, n, f in db.execute(
        f"SELECT coalesce(task, ''), count(*), count(*) FILTER (WHERE outcome = 'failed') "
        f'FROM "{schema}".pgjobs_history GROUP BY 1').fetchall()}
    assert truth == {"shop.add": (6, 0), "shop.charge": (7, 3), "mail.send": (4, 1)}

    c = client()
    page = c.get("/tasks?window=5m").text
    rows = table_rows(page)
    assert set(rows) == set(truth)
    for task, (n, failed) in truth.items():
        assert rows[task]["settled"] == f"{n:,}"
        assert rows[task]["failed"] == f"{failed:,}"
        assert rows[task]["rate"] == f"{n / 5:.2f}"
        assert rows[task]["failure"] == f"{failed / n * 100:.1f}%"
    # runtimes: the settles' own, p50 <= p95 <= max
    for task in truth:
        p50, p95, top = (float(rows[task][k]) for k in ("p50", "p95", "max"))
        assert 0 <= p50 <= p95 <= top + 1e-6
    assert "<polyline" in page

    # sorted on the server by each column, both ways
    assert order_of(c.get("/tasks?window=5m&sort=failure&dir=desc").text) == [
        "shop.charge", "mail.send", "shop.add"]
    assert order_of(c.get("/tasks?window=5m&sort=failure&dir=asc").text) == [
        "shop.add", "mail.send", "shop.charge"]
    assert order_of(c.get("/tasks?window=5m&sort=rate").text) == [
        "shop.charge", "shop.add", "mail.send"]
    assert order_of(c.get("/tasks?window=5m&sort=task&dir=asc").text) == [
        "mail.send", "shop.add", "shop.charge"]
    assert order_of(c.get("/tasks?window=5m&sort=task&dir=desc").text) == [
        "shop.charge", "shop.add", "mail.send"]
    for window in ("1h", "24h"):
        assert set(table_rows(c.get(f"/tasks?window={window}").text)) == set(truth)
    assert c.get("/tasks?sort=evil").status_code == 400
    assert c.get("/tasks?window=7y").status_code == 400


def test_task_page_links_each_failure_to_its_dead_letter(core, db, client, schema):
    done = ack(core, db, "shop", "shop.charge", 3)
    own = bury(core, db, "shop", "shop.charge")
    job, copy = fail_with_copy(core, db, "shop", "shop.charge")
    ack(core, db, "shop", "shop.other", 2)

    page = client().get("/tasks/shop.charge").text
    rows = re.findall(r'<tr data-job="(\d+)" data-outcome="(\w+)"(?: data-dead="(\d+)")?>',
                      page)
    expected = db.execute(
        f'SELECT job_id, outcome FROM "{schema}".pgjobs_history WHERE task = %s '
        "ORDER BY settled_at DESC, job_id DESC", ["shop.charge"]).fetchall()
    assert [(int(j), o) for j, o, _ in rows] == [(j, o) for j, o in expected]
    dead = {int(j): int(d) for j, _, d in rows if d}
    assert dead == {own: own, job: copy}  # the transport's by id, celery_ext's by error.job_id
    assert {int(j) for j, o, _ in rows if o == "completed"} == set(done)
    assert "CardDeclined" in page and "card 4242 declined by issuer" in page
    assert f'href="/dead/{copy}"' in page and f'href="/dead/{own}"' in page

    # paged newest first by the settle-time cursor
    more = ack(core, db, "shop", "shop.charge", 60)
    first = client().get("/tasks/shop.charge").text
    listed = [int(j) for j in re.findall(r'<tr data-job="(\d+)"', first)]
    assert len(listed) == 50
    nxt = re.search(r'href="([^"]+)" rel="next"', first).group(1).replace("&amp;", "&")
    second = [int(j) for j in re.findall(r'<tr data-job="(\d+)"',
                                         client().get(nxt).text)]
    assert len(set(listed) | set(second)) == len(more) + 5 and not set(listed) & set(second)
    only_failed = client().get("/tasks/shop.charge?outcome=failed").text
    assert sorted(int(j) for j in re.findall(r'<tr data-job="(\d+)"', only_failed)) == sorted(
        [own, job])


def test_history_search_by_fields_and_bounded_args_search(core, db, client, schema):
    acked = ack(core, db, "shop", "shop.charge", 3)
    failed = bury(core, db, "shop", "shop.charge")
    ack(core, db, "mail", "mail.send", 2)
    c = client()
    page = c.get("/history?task=shop.charge&outcome=failed").text
    assert [int(j) for j in re.findall(r'<tr data-job="(\d+)"', page)] == [failed]
    assert f'href="/dead/{failed}"' in page
    page = c.get("/history?worker=oncall-test@host:77:1&since=1h").text
    assert len(re.findall(r'<tr data-job="', page)) == 6
    page = c.get("/history?outcome=completed&task=shop.charge").text
    assert sorted(int(j) for j in re.findall(r'<tr data-job="(\d+)"', page)) == sorted(acked)

    # args containment: live messages and dead letters (history keeps no args)
    def put(args: list[Any], kwargs: dict[str, Any], task: str = "shop.refund") -> int:
        body = base64.b64encode(json.dumps([args, kwargs, {}]).encode()).decode()
        message = {"body": body, "content-encoding": "utf-8",
                   "content-type": "application/json",
                   "headers": {"task": task, "id": str(uuid.uuid4())},
                   "properties": {"body_encoding": "base64", "priority": 0,
                                  "delivery_info": {"exchange": "", "routing_key": "shop"},
                                  "delivery_tag": str(uuid.uuid4())}}
        core.publish(db, job_from_message("shop", message))
        return int(db.execute(f'SELECT max(id) FROM "{schema}".pgjobs_job').fetchone()[0])

    target = put([7, "eur"], {"order": {"id": 991, "lines": 2}})
    put([8, "eur"], {"order": {"id": 992}})
    page = c.get('/history?kwargs={"order": {"id": 991}}').text
    assert re.findall(r'<tr data-kind="(\w+)" data-id="(\d+)"', page) == [
        ("message", str(target))]
    assert "searched the newest" in page
    page = c.get("/history?args=[7]&task=shop.refund").text
    assert re.findall(r'data-id="(\d+)"><td>message', page) == [str(target)]

    # bounded: the target behind the newest `scan` candidates is not found, and the page says so
    for i in range(5):
        put([100 + i], {})
    page = c.get('/history?kwargs={"order": {"id": 991}}&scan=3').text
    assert 'data-kind="message"' not in page
    assert 'id="args-cut"' in page and "stopped at the bound of 3" in page
    # bodies are read up to a budget, newest first: past it, the page says so
    from kombu_pgjobs.ops.dashboard import oncall

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oncall, "BODY_BUDGET", 200)
        page = c.get('/history?kwargs={"order": {"id": 991}}').text
        assert 'data-kind="message"' not in page
        assert "older bodies were not read" in page
    # beyond the bound, or not JSON: refused with a stable code, nothing searched
    r = c.get(f"/history?args=[7]&scan={ARGS_SCAN + 1}", headers={"accept": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "PGJ-440"
    r = c.get("/history?args={oops", headers={"accept": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "PGJ-440"
    r = c.get('/history?args={"a": 1}', headers={"accept": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "PGJ-440"


def test_containment_is_jsonb_containment(db):
    cases = [([1, 2, [3]], [[3], 1]), ({"a": {"b": 1, "c": 2}}, {"a": {"b": 1}}),
             ([1, 2], [3]), ({"a": 1}, {"a": True}), ([True], [1]), ("x", "x"), (1, 1.0),
             ({"a": [1, {"b": 2}]}, {"a": [{"b": 2}]}), ({"a": 1}, {"b": 1})]
    for have, want in cases:
        pg = db.execute("SELECT %s::jsonb @> %s::jsonb",
                        [json.dumps(have), json.dumps(want)]).fetchone()[0]
        assert contains(have, want) is pg, (have, want)


def test_selected_requeue_acts_on_exactly_the_selected_ids_and_is_audited(
        core, db, client, schema):
    dead = [bury(core, db, "shop", "shop.charge") for _ in range(4)]
    c = client(write=True)
    csrf = sign_in(c)
    listing = c.get("/dead").text
    assert all(f'name="pick" value="{d}"' in listing for d in dead)
    chosen = [dead[1], dead[3]]
    confirm = c.post("/dead/selected/requeue",
                     data={"csrf": csrf, "pick": [str(i) for i in chosen]})
    assert confirm.status_code == 200 and 'id="confirm-form"' in confirm.text
    assert "This touches <b>2</b> rows" in confirm.text
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 4
    ids = re.search(r'name="ids" value="([^"]+)"', confirm.text).group(1)
    assert sorted(map(int, ids.split(","))) == sorted(chosen)
    done = c.post("/dead/selected/requeue", data={"csrf": csrf, "confirm": "yes", "ids": ids})
    assert done.status_code == 200 and "Requeued 2 dead letters" in done.text
    left = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id')]
    assert left == sorted([dead[0], dead[2]])
    back = db.execute(f'SELECT id, state FROM "{schema}".pgjobs_job WHERE id = ANY(%s) '
                      "ORDER BY id", [chosen]).fetchall()
    assert back == [(i, "ready") for i in sorted(chosen)]
    audit = db.execute(f'SELECT origin, actor, action, target, rows FROM "{schema}".pgjobs_audit '
                       "ORDER BY id").fetchall()
    assert len(audit) == 1
    origin, actor, action, target, rows = audit[0]
    assert (origin, actor, action, rows) == ("dashboard", "session", "dead requeue", 2)
    assert sorted(map(int, target["ids"].split(","))) == sorted(chosen)

    # purge selected: exactly the one ticked; the messages list: requeue/cancel selected
    csrf = sign_in(c)
    c.post("/dead/selected/purge", data={"csrf": csrf, "confirm": "yes", "pick": str(dead[0])})
    left = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".pgjobs_dead_letter')]
    assert left == [dead[2]]
    r = c.post("/messages/selected/cancel",
               data={"csrf": csrf, "confirm": "yes", "pick": str(chosen[0])})
    assert r.status_code == 200, r.text
    cancelled = db.execute(f'SELECT reason FROM "{schema}".pgjobs_dead_letter WHERE id = %s',
                           [chosen[0]]).fetchone()
    assert cancelled == ("cancelled",)
    actions = [r[0] for r in db.execute(f'SELECT action FROM "{schema}".pgjobs_audit ORDER BY id')]
    assert actions == ["dead requeue", "dead purge", "cancel"]
    # nothing selected: refused, nothing done
    r = c.post("/dead/selected/requeue", data={"csrf": csrf, "confirm": "yes"},
               headers={"accept": "application/json"})
    assert r.status_code == 400
    # read-only: refused
    ro = client()
    r = ro.post("/dead/selected/requeue", data={"confirm": "yes", "pick": str(dead[2])})
    assert r.status_code == 403
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter WHERE id = %s',
                      [dead[2]]).fetchone()[0] == 1


def test_run_now_publishes_exactly_one_message_and_is_audited(core, db, client, schema):
    store = ScheduleStore(schema)
    store.add(db, EntryDef("nightly/report", "app.report", "0 3 * * *", "UTC", [1, "a"],
                           {"full": True}, {"queue": "reports"}))
    before = store.get(db, "nightly/report")
    c = client(write=True)
    csrf = sign_in(c)
    page = c.get("/schedules/nightly%2Freport").text
    assert "run now" in page
    confirm = c.post("/schedules/nightly%2Freport/run", data={"csrf": csrf})
    assert 'id="confirm-form"' in confirm.text
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0
    r = c.post("/schedules/nightly%2Freport/run", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200 and "Published app.report once to queue reports" in r.text
    rows = db.execute(f'SELECT id, queue, task, state, message FROM "{schema}".pgjobs_job'
                      ).fetchall()
    assert len(rows) == 1
    job_id, queue, task, state, message = rows[0]
    assert (queue, task, state) == ("reports", "app.report", "ready")
    assert f"/messages/{job_id}" in r.text  # the result page links the message published
    body = json.loads(base64.b64decode(message["body"]))
    assert body[:2] == [[1, "a"], {"full": True}]
    assert message["headers"]["pgjobs_schedule_entry"] == "nightly/report"
    after = store.get(db, "nightly/report")
    assert (after.last_occurrence, after.fires) == (before.last_occurrence, before.fires)
    audit = db.execute(f'SELECT action, target, rows FROM "{schema}".pgjobs_audit').fetchall()
    assert audit == [("schedule run", {"name": "nightly/report"}, 1)]


def test_workers_page_shows_node_leases_and_throughput(core, db, client, schema):
    ack(core, db, "shop", "shop.charge", 10)
    publish(core, db, "shop")
    claim(core, db, "shop", 1)
    db.execute(f'INSERT INTO "{schema}".pgjobs_consumer (worker, queues, held) '
               "VALUES (%s, %s, 1)", [core.worker, ["shop"]])
    page = client().get("/workers").text
    row = re.search(r'<tr class="" data-worker="oncall-test@host:77:1">(.*?)</tr>', page,
                    re.S).group(1)
    assert "<td title=\"oncall-test@host:77:1\">oncall-test@host</td>" in row
    assert "<td>77:1</td>" in row
    truth = db.execute(f'SELECT sum(n) FROM "{schema}".pgjobs_counter WHERE shard = %s',
                       [core.worker]).fetchone()[0]
    assert truth == 10
    assert f'data-col="rate">{10 / 5}<' in row
    assert '<td class="n">1</td>' in row  # the lease it holds


def test_tasks_and_workers_pages_span_a_shard_map(core, db, schema, url, second_database):
    """With a shard map the tasks page sums each task over every database (read back from
    each database's history) and the workers page lists each database's workers."""
    ack(core, db, "shop", "shop.charge", 3)
    bury(core, db, "shop", "shop.charge")
    other_dsn = psycopg.conninfo.make_conninfo(db.info.dsn, dbname=second_database.rsplit(
        "/", 1)[1])
    with psycopg.connect(other_dsn, autocommit=True) as db2:
        migrate(db2, schema)
        far = QueueCore(schema, lease_ttl=30, max_attempts=20, worker="far@host:88:1")
        ack(far, db2, "b.mail", "shop.charge", 4)
        ack(far, db2, "b.mail", "mail.send", 2)
        publish(far, db2, "b.mail")
        claim(far, db2, "b.mail", 1)
        truth2 = dict(db2.execute(f'SELECT task, count(*) FROM "{schema}".pgjobs_history '
                                  "GROUP BY 1").fetchall())
    truth1 = dict(db.execute(f'SELECT task, count(*) FROM "{schema}".pgjobs_history '
                             "GROUP BY 1").fetchall())
    assert truth1 == {"shop.charge": 4} and truth2 == {"shop.charge": 4, "mail.send": 2}
    app = create_app(url, schema=schema, pool_size=2, shards={"b.*": second_database})
    try:
        c = TestClient(app)
        page = c.get("/tasks?window=5m&sort=failure").text
        rows = table_rows(page)
        assert rows["shop.charge"]["settled"] == "8" and rows["shop.charge"]["failed"] == "1"
        assert rows["shop.charge"]["failure"] == "12.5%"
        assert rows["mail.send"]["settled"] == "2" and rows["mail.send"]["failure"] == "0.0%"
        assert order_of(page) == ["shop.charge", "mail.send"]
        assert "pgjobs_test_shard2" in page  # the databases it spans are named
        workers = c.get("/workers").text
        assert re.search(r'data-worker="far@host:88:1" data-shard="[^"]*pgjobs_test_shard2"',
                         workers)
        row = re.search(r'data-worker="far@host:88:1".*?</tr>', workers, re.S).group(0)
        assert '<td class="n">1</td>' in row  # its lease, held in the second database
        assert f'data-col="rate">{6 / 5}<' in row
    finally:
        app.state.dashboard.close()


def test_filtered_lists_read_at_most_the_bound_and_say_so(core, db, client, schema,
                                                          monkeypatch):
    """The history search and a task's page read at most SCAN candidates (here 5): a failure
    older than the 5 newest settles is not found, and the page says the search stopped."""
    from kombu_pgjobs.ops.dashboard import oncall

    old = bury(core, db, "shop", "shop.charge")
    ack(core, db, "shop", "shop.charge", 8)
    c = client()
    assert 'id="scan-cut"' not in c.get("/history?outcome=failed").text
    page = c.get("/tasks/shop.charge?outcome=failed").text
    assert f'data-job="{old}"' in page and 'id="scan-cut"' not in page
    monkeypatch.setattr(oncall, "SCAN", 5)
    page = c.get("/history?outcome=failed").text
    assert f'data-job="{old}"' not in page and 'id="scan-cut"' in page
    assert "read the newest 5 settles" in page
    page = c.get("/tasks/shop.charge?outcome=failed").text
    assert f'data-job="{old}"' not in page and 'id="scan-cut"' in page
    # unfiltered too: the 5 newest, and it says it stopped there
    page = c.get("/history").text
    assert 'id="scan-cut"' in page and len(re.findall(r'<tr data-job=', page)) == 5
    monkeypatch.setattr(oncall, "SCAN", 9)  # all of it: nothing cut
    page = c.get("/history").text
    assert 'id="scan-cut"' not in page and len(re.findall(r'<tr data-job=', page)) == 9


@pytest.mark.e2e
def test_a_real_workers_settles_on_the_tasks_and_workers_pages(db, recorder_tables, url,
                                                               start_worker, client):
    """A real ``celery worker`` runs 20 tasks: the tasks page counts the 20 settles its history
    holds, and the workers page names its node and its settles per minute (its counter shard
    is its consumer row's identity), and, asked, the pool and concurrency the worker tells."""
    from tests.conftest import import_app, wait_for

    schema = recorder_tables
    migrate(db, schema)
    rec = import_app("tests.apps.recorder", schema, url)
    worker = start_worker(name="w1", concurrency=2)
    with rec.app.connection_for_write() as conn:
        for i in range(20):
            rec.record.apply_async((f"t{i}",), connection=conn)

    def settled() -> int:
        return int(db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_history '
                              "WHERE task = 'record'").fetchone()[0])

    wait_for(lambda: settled() >= 20, 60, what="20 settles in the history")
    wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_consumer'
                                ).fetchone()[0] >= 1, 30, what="the consumer row")
    assert settled() == 20
    c = client()
    rows = table_rows(c.get("/tasks?window=5m").text)
    assert rows["record"]["settled"] == "20" and rows["record"]["failed"] == "0"
    consumer = db.execute(f'SELECT worker FROM "{schema}".pgjobs_consumer').fetchone()[0]
    shards = dict(db.execute(f'SELECT shard, sum(n) FROM "{schema}".pgjobs_counter '
                             "WHERE outcome = 'completed' GROUP BY 1").fetchall())
    assert shards.get(consumer) == 20, (consumer, shards)  # the consumer is the shard
    page = c.get("/workers").text
    row = re.search(rf'data-worker="{re.escape(consumer)}">(.*?)</tr>', page, re.S).group(1)
    # its node: Celery's node name, read from the remote-control mailbox it consumes
    node = re.search(r'<td title="[^"]*">([^<]*)</td>', row).group(1)
    assert node.startswith("w1@") and node.split("@", 1)[1] == consumer.rsplit(":", 2)[0]
    assert 'data-col="rate">4.0<' in row  # 20 settles over 5 minutes
    assert 'data-col="pool">-<' in row and 'id="ask"' in page  # not recorded: asked on demand
    # asked of the worker itself (remote control, as `celery inspect stats`)
    page = c.get("/workers?inspect=1").text
    row = re.search(rf'data-worker="{re.escape(consumer)}">(.*?)</tr>', page, re.S).group(1)
    assert re.search(r'data-col="pool" title="celery.concurrency.thread:TaskPool">thread<', row)
    assert 'data-col="concurrency">2<' in row
    assert "1 of 1 workers answered" in page
    worker.kill()
