"""Bounded pages: the overview pages over queues and hides Celery's internal queues; a message
page cuts a huge body or header and offers the part whole as a download.

Against real Postgres through Starlette's test client. The overview is measured with 20,000
queues (each holding a message, some dead letters and settle counters, 2,000 of Celery's
remote-control and event queues besides): one page answers in under a second and weighs the
same as with a handful of queues; its counts equal ``Admin.queues(bound=...)``'s.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from kombu_pgjobs.ops.dashboard import create_app
from kombu_pgjobs.ops.dashboard.pages import PART_PREVIEW, QUEUE_PAGE
from kombu_pgjobs.ops.dashboard.queries import internal, queue_page
from kombu_pgjobs.store.admin import Admin
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.schema import migrate
from tests.test_cli import claim, in_future, kill_dead, publish

#: queues of the big overview, and Celery's own among them (hidden by default)
QUEUES = 20_000
INTERNAL = 2_000


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=20, worker="pages-test:1")


@pytest.fixture
def client(url: str, schema: str) -> Any:
    made: list[TestClient] = []

    def make(**options: Any) -> TestClient:
        c = TestClient(create_app(url, schema=schema, pool_size=2, **options))
        made.append(c)
        return c

    yield make
    for c in made:
        c.app.state.dashboard.close()  # type: ignore[attr-defined]


def queue_names(html: str) -> list[str]:
    return re.findall(r'<td><a href="/messages\?queue=([^"&]+)">', html)


def clone(db: psycopg.Connection[Any], schema: str, job: int, names_sql: str) -> None:
    """Copies of message ``job``, one per queue name the SQL expression ``names_sql`` makes
    from ``g`` (generate_series): a row each, as a publish writes it, in one statement."""
    cols = [r[0] for r in db.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s "
        "AND table_name = 'pgjobs_job' AND column_name NOT IN ('id', 'queue') "
        "AND is_generated = 'NEVER' AND identity_generation IS NULL ORDER BY ordinal_position",
        [schema]).fetchall()]
    listed = ", ".join(f'"{c}"' for c in cols)
    db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, {listed}) '
               f'SELECT {names_sql}, {listed} FROM "{schema}".pgjobs_job AS j, '
               f"generate_series(1, %s) AS g WHERE j.id = %s", [QUEUES, job])


def test_the_overview_pages_over_20000_queues(core, db, client, schema):
    # 20,000 of the app's queues, each declared and holding one ready message
    job = publish(core, db, "q-template")
    clone(db, schema, job, "'app.q' || lpad(g::text, 5, '0')")
    db.execute(f'INSERT INTO "{schema}".pgjobs_queue (name) SELECT DISTINCT queue '
               f'FROM "{schema}".pgjobs_job ON CONFLICT DO NOTHING')
    db.execute(f'DELETE FROM "{schema}".pgjobs_job WHERE id = %s', [job])
    db.execute(f"DELETE FROM \"{schema}\".pgjobs_queue WHERE name = 'q-template'")
    # Celery's own: remote-control mailboxes and replies, event queues (declared only)
    db.execute(f'INSERT INTO "{schema}".pgjobs_queue (name) '
               "SELECT CASE g %% 3 WHEN 0 THEN 'w' || g || '@host.celery.pidbox' "
               "WHEN 1 THEN md5(g::text) || '.reply.celery.pidbox' "
               "ELSE 'celeryev.' || md5(g::text) END "
               "FROM generate_series(1, %s) AS g", [INTERNAL])
    # dead letters, a running message and settle counters on a few queues
    dead = kill_dead(core, db, "app.q00002")
    claim(core, db, "app.q00001")
    db.execute(f'INSERT INTO "{schema}".pgjobs_counter (queue, outcome, bucket, shard, n) '
               "SELECT 'app.q' || lpad(g::text, 5, '0'), 'acked', "
               "date_trunc('minute', now()) - make_interval(mins => g %% 30), 'default', g "
               "FROM generate_series(1, %s) AS g", [QUEUES])
    db.execute(f'ANALYZE "{schema}".pgjobs_job, "{schema}".pgjobs_queue, '
               f'"{schema}".pgjobs_counter')
    assert dead
    c = client()
    c.get("/")  # the pool's first connection, the schema check
    took = []
    for _ in range(3):
        started = time.monotonic()
        r = c.get("/")
        took.append(time.monotonic() - started)
        assert r.status_code == 200
    first = r.text
    names = queue_names(first)
    assert names == [f"app.q{i:05d}" for i in range(1, QUEUE_PAGE + 1)]
    assert min(took) < 1.0, took
    size = len(r.content)
    assert size < 400_000, size
    row = re.search(r'queue=app.q00001">app.q00001</a>.*?</tr>', first, re.S).group(0)
    assert 'state=running">1<' in row
    assert re.search(r'queue=app.q00002">1</a>', first)  # its dead letter
    assert "<rect" in first  # the settle chart of the page's queues
    print(f"overview of {QUEUES:,} queues: {min(took) * 1000:.0f} ms, {size:,} bytes")

    # keyset pages: the next link goes on after the last queue listed
    nxt = re.search(r'href="([^"]+)" rel="next"', first).group(1).replace("&amp;", "&")
    assert f"after=app.q{QUEUE_PAGE:05d}" in nxt
    second = c.get(nxt).text
    assert queue_names(second) == [f"app.q{i:05d}" for i in range(QUEUE_PAGE + 1,
                                                                   2 * QUEUE_PAGE + 1)]
    last = c.get("/", params={"after": f"app.q{QUEUES - 10:05d}"}).text
    assert queue_names(last) == [f"app.q{i:05d}" for i in range(QUEUES - 9, QUEUES + 1)]
    assert 'rel="next"' not in last
    assert not any(internal(n) for n in names + queue_names(second) + queue_names(last))

    # Celery's internal queues: behind the toggle, paged the same way
    shown = c.get("/", params={"internal": "1"}).text
    assert 'href="/">hide them</a>' in shown
    listed = queue_names(shown)
    assert len(listed) == QUEUE_PAGE and all(internal(n) for n in listed[:10]), listed[:10]
    assert listed == sorted(listed)
    nxt = re.search(r'href="([^"]+)" rel="next"', shown).group(1).replace("&amp;", "&")
    assert "internal=1" in nxt
    assert 'href="/?internal=1">show them</a>' in first


def test_a_page_counts_what_admin_queues_counts(core, db, client, schema):
    """The overview's statement (dashboard/overview.sql) repeats admin_queue_stats_bounded's
    counts for a page of queues: the same numbers, queue by queue, at several bounds."""
    for q in ("alpha", "beta", "gamma"):
        for _ in range(3):
            publish(core, db, q)
    publish(core, db, "alpha", eta=in_future())
    claim(core, db, "beta", 2)
    kill_dead(core, db, "gamma")
    parked = publish(core, db, "delta")
    db.execute(f"UPDATE \"{schema}\".pgjobs_job SET state = 'waiting', waiting_on = 'k' "
               "WHERE id = %s", [parked])
    core.declare_queue(db, "empty")
    core.declare_queue(db, "w1@host.celery.pidbox")
    db.execute(f'UPDATE "{schema}".pgjobs_queue SET paused = true WHERE name = %s', ["gamma"])
    db.execute("SET jit = off")
    admin = Admin(db, schema)
    keys = ("ready", "delayed", "running", "waiting", "dead", "paused", "running_more",
            "waiting_more")
    for bound in (1, 2, 1000):
        expected = {q["queue"]: q for q in admin.queues(bound=bound)}
        got: dict[str, Any] = {}
        after = None
        while True:  # pages of two
            page = queue_page(admin, after=after, limit=2, bound=bound, show_internal=True)
            got.update({q["queue"]: q for q in page["items"]})
            after = page["next"]
            if after is None:
                break
        assert set(got) == set(expected)
        for name, q in expected.items():
            assert {k: got[name][k] for k in keys} == {k: q[k] for k in keys}, (bound, name)
            assert (got[name]["oldest_ready_age"] is None) == (q["oldest_ready_age"] is None)
        hidden = queue_page(admin, after=None, limit=100, bound=bound, show_internal=False)
        assert [q["queue"] for q in hidden["items"]] == sorted(set(expected) - {
            "w1@host.celery.pidbox"})


def _huge_message(queue: str, header: str, body_size: int = 0) -> dict[str, Any]:
    body = base64.b64encode(json.dumps([["x" * body_size], {}, {}]).encode()).decode()
    return {"body": body, "content-encoding": "utf-8", "content-type": "application/json",
            "headers": {"task": "t.big", "id": str(uuid.uuid4()), "argsrepr": "(" + "9" * 50_000
                        + ")", "kwargsrepr": "{}", "retries": 0, "x-big": header},
            "properties": {"body_encoding": "base64", "priority": 0,
                           "delivery_info": {"exchange": "", "routing_key": queue},
                           "delivery_tag": str(uuid.uuid4())}}


def test_a_20_mib_header_is_cut_on_the_page_and_downloadable_whole(core, db, client, schema):
    header = "h" * (20 * 1024 * 1024)
    # as an app that raised max_message_bytes publishes it
    core.publish(db, job_from_message("big", _huge_message("big", header, 3 * 1024 * 1024),
                                      max_bytes=64 * 1024 * 1024))
    job = int(db.execute(f'SELECT max(id) FROM "{schema}".pgjobs_job').fetchone()[0])
    c = client()
    started = time.monotonic()
    r = c.get(f"/messages/{job}")
    took = time.monotonic() - started
    assert r.status_code == 200
    size = len(r.content)
    assert size < 4 * PART_PREVIEW + 20_000, size  # body, headers, properties cut, and args
    assert f'href="/messages/{job}/raw/headers" download' in r.text
    assert f'href="/messages/{job}/raw/body" download' in r.text
    assert re.search(r'id="headers-cut">cut at 65,536 of 2[01],\d{3},\d{3} characters', r.text)
    assert "more characters)" in r.text  # the 50,000-character argsrepr
    print(f"message page with a 20 MiB header: {took * 1000:.0f} ms, {size:,} bytes")
    r = c.get(f"/messages/{job}/raw/headers")
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.headers["content-disposition"] == \
        f'attachment; filename="pgjobs-message-{job}-headers.json"'
    assert json.loads(r.content)["x-big"] == header
    assert json.loads(c.get(f"/messages/{job}/raw/body").content)["args"] == \
        ["x" * 3 * 1024 * 1024]
    assert c.get(f"/messages/{job}/raw/secret").status_code == 404
    # a dead letter the same way
    pairs = claim(core, db, "big")
    assert core.bury(db, pairs, reason="rejected",
                     error={"type": "E", "message": "m", "traceback": "t" * 200_000}) == {job}
    r = c.get(f"/dead/{job}")
    assert r.status_code == 200 and len(r.content) < 5 * PART_PREVIEW + 20_000
    assert f'href="/dead/{job}/raw/headers" download' in r.text
    assert "of 200,000 characters" in r.text  # the traceback, cut
    assert json.loads(c.get(f"/dead/{job}/raw/headers").content)["x-big"] == header
    # a small message is shown whole, without a download link
    small = publish(core, db, "small")
    page = c.get(f"/messages/{small}").text
    assert "raw/headers" not in page and '"argsrepr": "(1, 2)"' in page.replace("&#34;", '"')


def test_downloads_are_behind_the_read_gate(core, db, client):
    job = publish(core, db, "alpha")
    c = client(read_token="read-only-viewer-token-4242")
    r = c.get(f"/messages/{job}/raw/headers", follow_redirects=False)
    assert r.status_code == 303
    r = c.get(f"/messages/{job}/raw/headers",
              headers={"authorization": "Bearer read-only-viewer-token-4242"})
    assert r.status_code == 200 and json.loads(r.content)["task"] == "t.add"
