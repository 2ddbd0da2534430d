"""The web dashboard through Starlette's test client, against real Postgres.

Messages are set up through the queue core exactly as the transport does (tests/test_cli.py's
helpers); every page is read as HTML, every action's effect (or, when refused, its absence) is
read back from the database. Proves: the pages show what Admin reads (counts, filters, keyset
pages, lease holders, dead letters' errors, tenants); read-only mode answers 403 to every action;
write mode refuses without the token, with a wrong one, and without a valid CSRF token; actions
ask for confirmation first; hostile values are escaped; the app works mounted under a prefix;
the schedule and webhook pages show what ScheduleStore and WebhookStore read, never an
endpoint's secret, and on a schema older than their tables refuse alone (the rest still works).
"""

from __future__ import annotations

import base64
import html
import json
import re
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from markupsafe import escape
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

from kombu_pgjobs.errors import DashboardTokenRequired
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.ops.dashboard import create_app
from kombu_pgjobs.store.core import QueueCore, job_from_message
from kombu_pgjobs.store.scheduling import EntryDef, ScheduleStore, next_due
from kombu_pgjobs.store.schema import migrate
from kombu_pgjobs.store.webhooks import WebhookStore
from tests.test_cli import claim, in_future, kill_dead, publish

TOKEN = "correct-horse-battery-staple"
#: every action route, with a form that would make it act (confirm=yes)
ACTIONS = [
    ("/queues/{q}/pause", {}), ("/queues/{q}/resume", {}), ("/queues/{q}/purge", {}),
    ("/messages/{ready}/requeue", {}), ("/messages/{ready}/cancel", {}),
    ("/dead/{dead}/requeue", {}), ("/dead/{dead}/purge", {}),
    ("/dead/requeue", {"queue": "{q}"}), ("/dead/purge", {"queue": "{q}"}),
    ("/schedules/{entry}/pause", {}), ("/schedules/{paused_entry}/resume", {}),
    ("/webhooks/{hook}/disable", {}), ("/webhooks/{off_hook}/enable", {}),
]
#: an endpoint's signing secret: no page may ever show it
SECRET = "s3cret-never-shown-0123456789"


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=20, worker="dash-test:1")


@pytest.fixture
def client(url: str, schema: str) -> Any:
    """client(write=False, token=None, prefix=None) -> a TestClient of a fresh app."""
    made: list[TestClient] = []

    def make(*, write: bool = False, token: str | None = None,
             prefix: str | None = None) -> TestClient:
        app: Any = create_app(url, schema=schema, write=write, token=token, pool_size=2)
        if prefix:
            app = Starlette(routes=[Mount(prefix, app=app)])
        c = TestClient(app)
        made.append(c)
        return c

    yield make
    for c in made:
        app = c.app
        inner = app.routes[0].app if isinstance(app, Starlette) and not hasattr(
            app.state, "dashboard") else app
        inner.state.dashboard.close()


def ids_in(html: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-id="(\d+)"', html)]


def snapshot(db: psycopg.Connection[Any], schema: str) -> tuple[Any, ...]:
    """Everything an action could change, to show a refused one changed nothing."""
    jobs = db.execute(f'SELECT id, state, run_at, cancelled_at FROM "{schema}".pgjobs_job '
                      "ORDER BY id").fetchall()
    dead = db.execute(f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id').fetchall()
    queues = db.execute(f'SELECT name, paused FROM "{schema}".pgjobs_queue ORDER BY name'
                        ).fetchall()
    entries = db.execute(f'SELECT name, paused, updated_at FROM "{schema}".pgjobs_schedule '
                         "ORDER BY name").fetchall()
    hooks = db.execute(f'SELECT id, enabled, consecutive_failures, disabled_at FROM "{schema}"'
                       ".pgjobs_webhook_endpoint ORDER BY id").fetchall()
    return (jobs, dead, queues, entries, hooks)


def seeded(core: QueueCore, db: psycopg.Connection[Any]) -> dict[str, Any]:
    dead = kill_dead(core, db, "alpha", error={"type": "ValueError", "message": "boom",
                                               "traceback": "Traceback: line 1"})
    ready = [publish(core, db, "alpha", tenant="acme" if i % 2 else "globex") for i in range(4)]
    running = claim(core, db, "alpha", 1)[0][0]  # ready[0]
    delayed = publish(core, db, "alpha", eta=in_future())
    beta = [publish(core, db, "beta") for _ in range(2)]
    store = ScheduleStore(core.schema)
    store.add(db, EntryDef("nightly/report", "app.report", "every 1h", "UTC", [], {}, {}))
    store.add(db, EntryDef("held", "app.held", "0 3 * * *", "Europe/Paris", [], {}, {}),
              paused=True)
    hooks = WebhookStore(db, core.schema)
    hook = hooks.add("https://example.com/hook", SECRET, description="orders")
    off_hook = hooks.add("https://example.com/off", SECRET)
    hooks.set_enabled(off_hook, False)
    return {"q": "alpha", "ready": ready[1], "ready_ids": ready[1:], "running": running,
            "delayed": delayed, "dead": dead, "beta": beta, "acme": [ready[1], ready[3]],
            "entry": "nightly/report", "paused_entry": "held", "hook": hook,
            "off_hook": off_hook}


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([^"]+)"', html).group(1)


def sign_in(c: TestClient, prefix: str = "", token: str = TOKEN) -> str:
    """Sign in as a browser does; returns the CSRF token of the session's pages (the
    session's own: the sign-in form's is not it)."""
    login_csrf = csrf_of(c.get(f"{prefix}/login").text)
    r = c.post(f"{prefix}/login", data={"csrf": login_csrf, "token": token},
               follow_redirects=False)
    assert r.status_code == 303, r.text
    csrf = csrf_of(c.get(f"{prefix}/").text)
    assert csrf != login_csrf
    return csrf


def test_pages_show_what_admin_reads(core, db, client, schema):
    s = seeded(core, db)
    core.declare_queue(db, "idle")
    db.execute(f'UPDATE "{schema}".pgjobs_queue SET paused = true WHERE name = %s', ["idle"])
    c = client()

    r = c.get("/")
    assert r.status_code == 200
    alpha = re.search(r"<tr class=\"\">\s*<td><a href=\"/messages\?queue=alpha\">.*?</tr>",
                      r.text, re.S).group(0)
    counts = dict(re.findall(r"state=(\w+)\">(\d+)<", alpha))
    assert counts == {"ready": "3", "delayed": "1", "running": "1", "waiting": "0"}
    assert re.search(r"queue=alpha\">1</a>", alpha)  # one dead letter
    idle = re.search(r'<tr class="paused">.*?</tr>', r.text, re.S).group(0)
    assert "idle" in idle and "badge paused" in idle
    tenants = c.get("/tenants").text
    assert re.search(r'tenant=acme">acme</a></td><td class="n">2</td>', tenants)  # ready
    assert re.search(r'tenant=globex">globex</a></td><td class="n">1</td>', tenants)
    assert "<svg class=\"chart\"" in r.text  # the settle chart (the dead letter settled)
    assert "read-only" in r.text and 'method="post"' not in r.text

    r = c.get("/messages", params={"queue": "alpha", "state": "ready"})
    assert r.status_code == 200 and ids_in(r.text) == sorted(s["ready_ids"])
    r = c.get("/messages", params={"tenant": "acme"})
    assert sorted(ids_in(r.text)) == sorted(s["acme"])
    r = c.get("/messages", params={"state": "dead"})
    assert ids_in(r.text) == [s["dead"]]

    r = c.get(f"/messages/{s['running']}")
    assert r.status_code == 200 and "dash-test:1" in r.text and "lease expires" in r.text
    assert 'id="state">running<' in r.text and '"retries": 0' in html.unescape(r.text)
    r = c.get(f"/dead/{s['dead']}")
    assert r.status_code == 200 and "rejected" in r.text and "Traceback: line 1" in r.text
    assert "ValueError" in r.text
    assert '"args": [\n    1,\n    2\n  ]' in html.unescape(r.text)  # body preview
    r = c.get("/dead", params={"queue": "alpha"})
    assert ids_in(r.text) == [s["dead"]] and "boom" in r.text

    r = c.get("/workers")
    assert r.status_code == 200 and "dash-test:1" in r.text
    assert f'href="/messages/{s["running"]}"' in r.text
    r = c.get("/limits")
    assert r.status_code == 200 and "no key holds a slot" in r.text

    # bad input: a stable code and the right status, as JSON for scripts
    assert c.get("/messages", params={"state": "bogus"}).status_code == 400
    r = c.get("/messages/999999999", headers={"accept": "application/json"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "PGJ-401"
    r = c.get("/messages/abc", headers={"accept": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "PGJ-405"
    r = c.get("/messages", params={"queue": "nope"})
    assert r.status_code == 404 and "PGJ-403" in r.text


def test_messages_keyset_pages(core, db, client):
    ids = [publish(core, db, "gamma") for _ in range(57)]
    c = client()
    first = c.get("/messages", params={"queue": "gamma"}).text
    assert ids_in(first) == ids[:50]
    nxt = re.search(r'href="([^"]+)" rel="next"', first).group(1).replace("&amp;", "&")
    assert f"after={ids[49]}" in nxt and "queue=gamma" in nxt
    second = c.get(nxt).text
    assert ids_in(second) == ids[50:] and 'rel="next"' not in second


def test_hostile_values_are_escaped(core, db, client):
    evil = "<script>alert('pwn')</script>"
    headers = {"task": "t.<b>bold</b>", "id": str(uuid.uuid4()), "argsrepr": evil,
               "kwargsrepr": "{}", "retries": 0, "x-pgjobs-tenant": "<i>t</i>"}
    body = base64.b64encode(json.dumps([[evil], {}, {}]).encode()).decode()
    message = {"body": body, "content-encoding": "utf-8", "content-type": "application/json",
               "headers": headers,
               "properties": {"body_encoding": "base64", "priority": 0,
                              "delivery_info": {"exchange": "", "routing_key": "q<script>"},
                              "delivery_tag": str(uuid.uuid4())}}
    core.publish(db, job_from_message("q<script>", message))
    job_id = int(db.execute(f'SELECT max(id) FROM "{core.schema}".pgjobs_job').fetchone()[0])
    dead = kill_dead(core, db, "evil", error={"type": "X", "message": evil})
    c = client()
    for path in ("/", f"/messages/{job_id}", "/messages", "/dead", f"/dead/{dead}"):
        r = c.get(path)
        assert r.status_code == 200, path
        assert "<script>alert" not in r.text and "<b>bold" not in r.text, path
        assert "<i>t</i>" not in r.text, path
    page = c.get(f"/messages/{job_id}").text
    assert "&lt;script&gt;alert(&#39;pwn&#39;)&lt;/script&gt;" in page
    assert "t.&lt;b&gt;bold&lt;/b&gt;" in page
    assert "&lt;script&gt;" in c.get(f"/dead/{dead}").text
    csp = c.get("/").headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp


def test_read_only_refuses_every_action(core, db, client, schema):
    s = seeded(core, db)
    before = snapshot(db, schema)
    c = client()  # the default: read-only
    for path, form in ACTIONS:
        target = path.format(**s)
        data = {k: v.format(**s) for k, v in form.items()} | {"confirm": "yes"}
        r = c.post(target, data=data, headers={"accept": "application/json"})
        assert r.status_code == 403, target
        assert r.json()["error"]["code"] == "PGJ-432", target
        r = c.post(target, data=data, headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403 and "PGJ-432" in r.text, target
    assert c.post("/login", data={"token": TOKEN}).status_code == 403
    assert snapshot(db, schema) == before


def test_write_mode_refuses_without_the_right_token(core, db, client, schema, url):
    with pytest.raises(DashboardTokenRequired):
        create_app(url, schema=schema, write=True)
    with pytest.raises(DashboardTokenRequired):
        create_app(url, schema=schema, write=True, token="short")
    s = seeded(core, db)
    before = snapshot(db, schema)
    c = client(write=True, token=TOKEN)
    for path, form in ACTIONS:
        target = path.format(**s)
        data = {k: v.format(**s) for k, v in form.items()} | {"confirm": "yes"}
        r = c.post(target, data=data, headers={"accept": "application/json"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "PGJ-433", target
        r = c.post(target, data=data, headers={"authorization": "Bearer wrong-token-123456",
                                               "accept": "application/json"})
        # five wrong tokens are checked; from then on the client must wait (backoff)
        assert (r.status_code, r.json()["error"]["code"]) in (
            (403, "PGJ-433"), (429, "PGJ-438")), target
    c = client(write=True, token=TOKEN)  # another app: its own backoff
    # signing in with a wrong token sets no session, and actions still refuse
    page = c.get("/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)
    r = c.post("/login", data={"csrf": csrf, "token": TOKEN + "x"}, follow_redirects=False)
    assert r.status_code == 403 and "pgjobs_session" not in r.headers.get("set-cookie", "")
    r = c.post(f"/queues/{s['q']}/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 403 and "PGJ-433" in r.text
    # a forged session cookie is refused too
    c.cookies.set("pgjobs_session", "9999999999.deadbeef")
    r = c.post(f"/queues/{s['q']}/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 403 and "PGJ-433" in r.text
    assert snapshot(db, schema) == before


def test_csrf_is_required_with_a_session(core, db, client, schema):
    s = seeded(core, db)
    before = snapshot(db, schema)
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    other = client(write=True, token=TOKEN)  # another browser's valid token
    other_csrf = re.search(r'name="csrf" value="([^"]+)"', other.get("/login").text).group(1)
    for path, form in ACTIONS:
        target = path.format(**s)
        data = {k: v.format(**s) for k, v in form.items()} | {"confirm": "yes"}
        for bad in ({}, {"csrf": ""}, {"csrf": csrf[:-2] + "00"}, {"csrf": other_csrf}):
            r = c.post(target, data=data | bad, headers={"accept": "application/json"})
            assert r.status_code == 403 and r.json()["error"]["code"] == "PGJ-434", target
    # login and logout are forms too
    r = other.post("/login", data={"token": TOKEN}, follow_redirects=False)
    assert r.status_code == 403 and "PGJ-434" in r.text
    assert snapshot(db, schema) == before
    assert c.post("/logout", data={}, follow_redirects=False).status_code == 403


def test_actions_confirm_then_act(core, db, client, schema):
    s = seeded(core, db)
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    assert 'action="/queues/alpha/pause"' in c.get("/").text  # buttons once signed in

    def paused() -> bool:
        row = db.execute(f'SELECT paused FROM "{schema}".pgjobs_queue WHERE name = %s',
                         ["alpha"]).fetchone()
        return bool(row and row[0])

    r = c.post("/queues/alpha/pause", data={"csrf": csrf})
    assert r.status_code == 200 and "Pause queue alpha" in r.text and not paused()
    assert 'name="confirm" value="yes"' in r.text  # the confirmation page's own form
    r = c.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200 and paused()
    c.post("/queues/alpha/resume", data={"csrf": csrf, "confirm": "yes"})
    assert not paused()

    r = c.post(f"/dead/{s['dead']}/requeue", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200
    row = db.execute(f'SELECT state, attempts FROM "{schema}".pgjobs_job WHERE id = %s',
                     [s["dead"]]).fetchone()
    assert row == ("ready", 0)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 0

    r = c.post(f"/messages/{s['ready']}/cancel", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE id = %s',
                      [s["ready"]]).fetchone()[0] == 0
    # a cancelled queued message is kept as a dead letter, reason cancelled (issue 30)
    assert db.execute(f'SELECT reason FROM "{schema}".pgjobs_dead_letter WHERE id = %s',
                      [s["ready"]]).fetchone() == ("cancelled",)
    db.execute(f'DELETE FROM "{schema}".pgjobs_dead_letter WHERE id = %s', [s["ready"]])
    r = c.post(f"/messages/{s['delayed']}/requeue", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200
    assert db.execute(f'SELECT run_at <= now() FROM "{schema}".pgjobs_job WHERE id = %s',
                      [s["delayed"]]).fetchone()[0] is True
    r = c.post(f"/messages/{s['running']}/requeue", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 409 and "PGJ-406" in r.text

    # a script: bearer token, no CSRF, JSON out
    r = c.post("/queues/beta/purge", data={"confirm": "yes", "limit": "1"},
               headers={"authorization": f"Bearer {TOKEN}", "accept": "application/json"})
    assert r.status_code == 200 and r.json()["purged"] == 1
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job WHERE queue = %s',
                      ["beta"]).fetchone()[0] == 1
    # dead letters by filter
    more = [kill_dead(core, db, "alpha") for _ in range(2)]
    r = c.post("/dead/requeue", data={"csrf": csrf, "confirm": "yes", "queue": "alpha"},
               headers={"accept": "application/json"})
    assert sorted(x["id"] for x in r.json()["requeued"]) == more
    dead_one = kill_dead(core, db, "alpha")
    r = c.post(f"/dead/{dead_one}/purge", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 0
    # signing out ends the session
    c.post("/logout", data={"csrf": csrf})
    r = c.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 403 and not paused()


def test_mounted_under_a_prefix(core, db, client, schema):
    s = seeded(core, db)
    c = client(write=True, token=TOKEN, prefix="/ops/pgjobs")
    r = c.get("/ops/pgjobs/")
    assert r.status_code == 200
    assert 'href="/ops/pgjobs/messages?queue=alpha"' in r.text
    assert 'href="/ops/pgjobs/static/dashboard.css"' in r.text
    assert c.get("/ops/pgjobs/static/dashboard.css").status_code == 200
    assert c.get(f"/ops/pgjobs/messages/{s['running']}").status_code == 200
    csrf = sign_in(c, "/ops/pgjobs")
    assert "Path=/ops/pgjobs" in c.get("/ops/pgjobs/login").headers.get(
        "set-cookie", "Path=/ops/pgjobs")
    r = c.post(f"/ops/pgjobs/dead/{s['dead']}/requeue", data={"csrf": csrf})
    assert f'action="/ops/pgjobs/dead/{s["dead"]}/requeue"' in r.text  # confirm posts back
    r = c.post(f"/ops/pgjobs/dead/{s['dead']}/requeue", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200 and 'href="/ops/pgjobs/dead"' in r.text
    assert db.execute(f'SELECT state FROM "{schema}".pgjobs_job WHERE id = %s',
                      [s["dead"]]).fetchone() == ("ready",)


def test_cli_write_without_token_and_no_web_import(capsys, url, schema, monkeypatch):
    monkeypatch.delenv("PGJOBS_DASHBOARD_TOKEN", raising=False)
    code = cli(["dashboard", "--write", "--dsn", url, "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"]["code"] == "PGJ-431"
    code = cli(["dashboard", "--port", "70000", "--dsn", url, "--json"])
    assert code == 2 and json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-405"
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # the extra not installed
    code = cli(["dashboard", "--dsn", url, "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"]["code"] == "PGJ-430"
    assert "kombu-pgjobs[dashboard]" in out["error"]["message"]
    monkeypatch.delitem(sys.modules, "uvicorn")
    probe = ("import sys, kombu_pgjobs, kombu_pgjobs.ops.cli.main, kombu_pgjobs.store.admin;"
             "kombu_pgjobs.ops.cli.main.build_parser();"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('starlette', 'jinja2', 'uvicorn', 'psycopg_pool')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_overview_counts_are_exact_up_to_the_bound(core, db, schema):
    """The overview's statement (Admin.queues(bound=...)) agrees with the CLI's exact one up
    to the bound, and says "more" (bound + 1) beyond it, for every state and queue."""
    from kombu_pgjobs.store.admin import Admin

    s = seeded(core, db)
    for _ in range(3):
        publish(core, db, "alpha", eta=in_future())
        kill_dead(core, db, "beta")
    core.declare_queue(db, "declared-only")
    db.execute("SET jit = off")  # as the dashboard's connections do (see dashboard/app.py)
    db.execute("SET enable_bitmapscan = off")
    admin = Admin(db, schema)
    exact = {q["queue"]: q for q in admin.queues()}
    since = time.monotonic()
    states = ("ready", "delayed", "running", "waiting", "dead")
    for bound in (1, 2, 3, 100):
        bounded = {q["queue"]: q for q in admin.queues(bound=bound)}
        assert set(bounded) == set(exact) == {"alpha", "beta", "declared-only"}
        for name, q in exact.items():
            for state in states:
                assert bounded[name][state] == min(q[state], bound + 1), (bound, name, state)
            assert bounded[name]["paused"] == q["paused"]
            assert bounded[name]["settled"] == q["settled"]
            age = q["oldest_ready_age"]
            assert (bounded[name]["oldest_ready_age"] is None) == (age is None)
            if age is not None:
                drift = time.monotonic() - since + 1  # ages grow as the test runs
                assert age <= bounded[name]["oldest_ready_age"] <= age + drift
    assert exact["alpha"]["ready"] == 3 and exact["alpha"]["delayed"] == 4
    assert s["running"] and exact["alpha"]["running"] == 1
    assert not any(q["running_more"] or q["waiting_more"] for q in admin.queues(bound=1))
    # running rows are read once for every queue, at most 10 x bound of them: past that the
    # counts are lower bounds, and say so
    for _ in range(12):
        publish(core, db, "gamma")
    assert len(claim(core, db, "gamma", 12)) == 12  # 13 running in all
    exact = {q["queue"]: q for q in admin.queues()}
    bounded = {q["queue"]: q for q in admin.queues(bound=1)}
    assert all(q["running_more"] for q in bounded.values())
    assert sum(min(q["running"], 2) for q in exact.values()) >= \
        sum(q["running"] for q in bounded.values()) >= 1
    for name, q in bounded.items():
        assert q["running"] <= min(exact[name]["running"], 2)
    assert {q["queue"]: q["running_more"] for q in admin.queues(bound=2)} == \
        dict.fromkeys(exact, False)  # 13 <= 20: exact again


def test_pages_survive_terminated_connections(core, db, client, schema):
    """A terminated backend (a failover, an admin's pg_terminate_backend) is an ordinary
    event: the pool finds the dead connection and the next page is served on a new one."""
    s = seeded(core, db)
    c = client()
    assert c.get("/").status_code == 200
    name = f"pgjobs-dashboard:{schema}"
    killed = db.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = %s", [name]).fetchone()[0]
    assert killed >= 1
    for path in ("/", f"/messages/{s['running']}", "/dead", "/workers"):
        assert c.get(path).status_code == 200, path
    assert db.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                      [name]).fetchone()[0] >= 1


def test_tenant_page_is_bounded_paged_and_agrees_with_the_exact_counts(core, db, schema):
    """Admin.tenants (the tenants page): tenants in name order, keyset pages, and counts equal
    to the exact per-tenant statement (Admin.tenant_stats) up to the bound, "more" beyond."""
    from kombu_pgjobs.store.admin import Admin

    for tenant, n in (("acme", 4), ("globex", 2), ("initech", 1)):
        for _ in range(n):
            publish(core, db, "alpha", tenant=tenant)
    publish(core, db, "alpha", tenant="globex", eta=in_future())
    publish(core, db, "alpha")  # no tenant: not listed
    claim(core, db, "alpha")  # acme's oldest
    admin = Admin(db, schema)
    exact = {r["tenant"]: r for r in admin.tenant_stats(10)}
    page = admin.tenants(limit=2, bound=100)
    assert [r["tenant"] for r in page["items"]] == ["acme", "globex"] and page["next"] == "globex"
    rest = admin.tenants(after=page["next"], limit=2, bound=100)
    assert [r["tenant"] for r in rest["items"]] == ["initech"] and rest["next"] is None
    for r in page["items"] + rest["items"]:
        for state in ("ready", "delayed", "running", "waiting"):
            assert r[state] == exact[r["tenant"]][state], (r, state)
        assert not r["more"]
    capped = {r["tenant"]: r for r in admin.tenants(bound=2)["items"]}
    assert capped["acme"]["more"] and capped["acme"]["live"] == 3
    assert capped["globex"]["more"] and capped["globex"]["live"] == 3  # 2 ready + 1 delayed
    assert capped["initech"]["live"] == 1 and not capped["initech"]["more"]


def test_limits_bounded_count_agrees_with_the_exact_one_up_to_the_bound(core, db, schema):
    """Admin.limits(bound=) (the dashboard's /limits): parked messages per key found by
    skipping through the parking index and counted up to bound + 1; the same keys, order and
    counts as the exact statement up to the bound."""
    from kombu_pgjobs.store.admin import Admin

    for key, n in (("key:a", 5), ("key:b", 2), ("key:c", 1)):
        for _ in range(n):
            job = publish(core, db, "alpha")
            db.execute(f'UPDATE "{schema}".pgjobs_job SET state = \'waiting\', waiting_on = %s '
                       "WHERE id = %s", (key, job))
    admin = Admin(db, schema)
    exact = admin.limits()["keys"]
    assert [(k["key"], k["waiting"]) for k in exact] == [("key:a", 5), ("key:b", 2),
                                                         ("key:c", 1)]
    for bound in (1, 2, 10):
        got = admin.limits(bound=bound)["keys"]
        assert [k["key"] for k in got] == [k["key"] for k in exact]
        assert [k["waiting"] for k in got] == [min(k["waiting"], bound + 1) for k in exact]
        assert all(g["oldest_waiting_age"] is not None for g in got)


def fire_once(db: psycopg.Connection[Any], core: QueueCore, name: str) -> tuple[int, int]:
    """Elect a leader and fire the entry's next occurrence as the scheduler does (a message
    and a history row in one fenced statement); returns (term, message id)."""
    store = ScheduleStore(core.schema)
    lease = store.elect(db, "beat@host-1", 30.0)
    assert lease is not None and lease.leading
    entry = store.get(db, name)
    occurrence = entry.anchor + timedelta(hours=1)
    job = job_from_message("celery", {"body": "x", "headers": {"task": entry.task},
                                      "properties": {}})
    fired = store.fire(db, holder="beat@host-1", term=lease.term, entry=entry,
                       occurrence=occurrence, watermark=occurrence, missed=0, job=job,
                       core=core)
    assert fired is not None and fired[1] is not None
    return lease.term, int(fired[1])


def test_schedule_pages_show_what_the_store_reads(core, db, client, schema):
    seeded(core, db)
    store = ScheduleStore(schema)
    evil = "<script>alert('pwn')</script>"
    store.add(db, EntryDef(evil, "t.<b>bold</b>", "every 30s", None, [evil], {}, {}))
    c = client()
    r = c.get("/schedules")
    assert r.status_code == 200 and "Leader: none yet" in r.text
    assert 'href="/schedules"' in r.text and 'href="/webhooks"' in r.text  # navigation
    term, job_id = fire_once(db, core, "nightly/report")
    page = c.get("/schedules").text
    leader = store.leader(db)
    assert f"<b>beat@host-1</b>, term {term}, live" in page
    assert dashboard_ts(leader["expires_at"]) in page
    rows = {html.unescape(k): v for k, v in re.findall(
        r'<tr class="(?:paused)?" data-name="([^"]+)">(.*?)</tr>', page, re.S)}
    assert set(rows) == {"nightly/report", "held", evil}
    for entry in store.load(db):
        row = rows[entry.name]
        due = next_due(entry)
        assert str(escape(entry.task)) in row and str(escape(entry.schedule)) in row
        assert (dashboard_ts(due) in row) if due else "<td>-</td>" in row
        assert f'<td class="n">{entry.fires}</td>' in row and entry.source in row
        assert ("badge paused" in row) == entry.paused
    nightly = rows["nightly/report"]
    assert "<td>UTC</td>" in nightly and '<td class="n">1</td>' in nightly
    assert dashboard_ts(store.get(db, "nightly/report").last_fired_at) in nightly
    assert "Europe/Paris" in rows["held"] and "<td>-</td>" in rows["held"]  # paused: no due
    assert 'href="/schedules/nightly%2Freport"' in page

    r = c.get("/schedules/nightly%2Freport")
    assert r.status_code == 200 and "Schedule entry nightly/report" in r.text
    fires = re.findall(r'<tr data-id="(\d+)">(.*?)</tr>', r.text, re.S)
    history = store.history(db, "nightly/report")
    assert [int(i) for i, _ in fires] == [f["id"] for f in history] and len(fires) == 1
    assert f'href="/messages/{job_id}"' in fires[0][1] and "beat@host-1" in fires[0][1]
    assert f'<td class="n">{term}</td>' in fires[0][1]
    assert c.get("/schedules/no-such-entry").status_code == 404
    for path in ("/schedules", f"/schedules/{quote(evil, safe='')}"):
        r = c.get(path)
        assert r.status_code == 200, path
        assert "<script>alert" not in r.text and "<b>bold" not in r.text, path
        assert "&lt;script&gt;alert(&#39;pwn&#39;)&lt;/script&gt;" in r.text, path


def dashboard_ts(value: Any) -> str:
    from kombu_pgjobs.ops.common import ts_text as _ts

    return _ts(value)


def test_webhook_pages_show_the_store_and_never_the_secret(core, db, client, schema):
    s = seeded(core, db)
    hooks = WebhookStore(db, schema)
    evil = "<script>alert('pwn')</script>"
    bad = hooks.add("https://example.com/evil", SECRET, description=evil, disable_after=2)
    attempt = {"endpoint_id": bad, "event_id": "evt_1", "event_type": "order.paid",
               "task_id": None, "attempt": 1, "status": 500, "latency_ms": 12.5,
               "outcome": "retrying", "error": None, "excerpt": evil, "location": None,
               "retry_after": None, "delay": 30}
    first = hooks.record_attempt(attempt, effect="none", disable_after=5)["id"]
    second = hooks.record_attempt({**attempt, "attempt": 2, "outcome": "failed"},
                                  effect="count", disable_after=5)["id"]
    extra = [hooks.add(f"https://example.com/{i}", SECRET) for i in range(49)]
    c = client()
    first_page = c.get("/webhooks").text
    assert ids_in(first_page) == [s["hook"], s["off_hook"], bad, *extra[:47]]
    nxt = re.search(r'href="([^"]+)" rel="next"', first_page).group(1).replace("&amp;", "&")
    second_page = c.get(nxt).text
    assert ids_in(second_page) == extra[47:] and 'rel="next"' not in second_page
    row = re.search(rf'<tr data-id="{bad}".*?</tr>', first_page, re.S).group(0)
    assert '<td class="n">1</td>' in row and "failed 500" in row and "<td>2</td>" in row
    off = re.search(rf'<tr data-id="{s["off_hook"]}".*?</tr>', first_page, re.S).group(0)
    assert "badge paused" in off and "(operator)" in off

    page = c.get(f"/webhooks/{bad}").text
    assert [int(i) for i in re.findall(r'<tr data-id="(\d+)"', page)] == [second, first]
    assert "order.paid" in page and "evt_1" in page and "********" in page
    assert "<script>alert" not in page and "&lt;script&gt;alert(" in page
    assert c.get("/webhooks/999999").status_code == 404
    assert c.get("/webhooks/x").status_code == 400
    pages = [first_page, second_page, page, c.get(f"/webhooks/{s['off_hook']}").text]
    # write mode, signed in: the confirmation and result pages don't show it either
    w = client(write=True, token=TOKEN)
    csrf = sign_in(w)
    pages.append(w.get(f"/webhooks/{s['hook']}").text)
    pages.append(w.post(f"/webhooks/{s['hook']}/disable", data={"csrf": csrf}).text)
    pages.append(w.post(f"/webhooks/{s['hook']}/disable",
                        data={"csrf": csrf, "confirm": "yes"}).text)
    for text in pages:
        assert SECRET not in text and SECRET[:12] not in text


def test_schedule_and_webhook_actions_confirm_then_act(core, db, client, schema):
    s = seeded(core, db)
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)

    def paused(name: str) -> bool:
        return db.execute(f'SELECT paused FROM "{schema}".pgjobs_schedule WHERE name = %s',
                          [name]).fetchone()[0]

    def enabled(ident: int) -> tuple[Any, ...]:
        return db.execute(f'SELECT enabled, disabled_reason FROM "{schema}"'
                          ".pgjobs_webhook_endpoint WHERE id = %s", [ident]).fetchone()

    assert 'action="/schedules/nightly%2Freport/pause"' in c.get("/schedules").text
    r = c.post("/schedules/nightly%2Freport/pause", data={"csrf": csrf})
    assert r.status_code == 200 and 'name="confirm" value="yes"' in r.text
    assert "Pause schedule entry nightly/report" in r.text and not paused("nightly/report")
    r = c.post("/schedules/nightly%2Freport/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200 and paused("nightly/report")
    r = c.post("/schedules/held/resume", data={"confirm": "yes"},
               headers={"authorization": f"Bearer {TOKEN}", "accept": "application/json"})
    assert r.json() == {"name": "held", "paused": False} and not paused("held")
    r = c.post("/schedules/nope/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 404 and "PGJ-605" in r.text

    assert f'action="/webhooks/{s["hook"]}/disable"' in c.get(f"/webhooks/{s['hook']}").text
    r = c.post(f"/webhooks/{s['hook']}/disable", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200 and enabled(s["hook"]) == (False, "operator")
    r = c.post(f"/webhooks/{s['off_hook']}/enable", data={"confirm": "yes"},
               headers={"authorization": f"Bearer {TOKEN}", "accept": "application/json"})
    assert r.json()["enabled"] is True and enabled(s["off_hook"]) == (True, None)
    r = c.post("/webhooks/999999/enable", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 404 and "PGJ-802" in r.text


def test_an_older_schema_keeps_the_other_pages(core, db, client, schema):
    """A schema from before the scheduler and webhooks (versions 9, 10): their pages say to
    migrate (503, PGJ-701) and every other page works."""
    s = seeded(core, db)
    for table in ("pgjobs_schedule_fire", "pgjobs_schedule", "pgjobs_leader",
                  "pgjobs_webhook_attempt", "pgjobs_webhook_endpoint"):
        db.execute(f'DROP TABLE "{schema}".{table}')
    db.execute(f'DELETE FROM "{schema}".pgjobs_migration WHERE version IN (9, 10)')
    c = client()
    for path in ("/schedules", "/schedules/x", "/webhooks", "/webhooks/1"):
        r = c.get(path)
        assert r.status_code == 503 and "PGJ-701" in r.text and "pgjobs migrate" in r.text, path
    for path in ("/", "/messages", f"/messages/{s['ready']}", "/dead", "/limits", "/workers",
                 "/tenants"):
        assert c.get(path).status_code == 200, path
    migrate(db, schema)  # the pages come back once migrated, without a restart
    assert c.get("/schedules").status_code == 200 and c.get("/webhooks").status_code == 200


def test_bulk_dead_letter_actions_act_on_the_filter_shown(core, db, client, schema):
    """A task-filtered dead letters page: "requeue all" requeues that task's dead letters
    only (the form dropped the task filter: every dead letter of the queue went back); "purge
    all" is not offered for a filter the purge cannot apply, and a purge posted with one is
    refused with nothing deleted."""
    boom = [kill_dead(core, db, "alpha") for _ in range(2)]
    other = [kill_dead(core, db, "alpha") for _ in range(3)]
    db.execute(f'UPDATE "{schema}".pgjobs_dead_letter '
               "SET task = CASE WHEN id = ANY(%s) THEN 'shop.boom' ELSE 'shop.other' END",
               [boom])

    def dead() -> list[int]:
        return [r[0] for r in db.execute(
            f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id').fetchall()]

    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    page = c.get("/dead?queue=alpha&task=shop.boom").text
    assert sorted(ids_in(page)) == sorted(boom)
    assert 'action="/dead/requeue"' in page and 'value="shop.boom"' in page
    assert 'action="/dead/purge"' not in page
    r = c.post("/dead/requeue", data={"csrf": csrf, "confirm": "yes", "queue": "alpha",
                                      "task": "shop.boom"},
               headers={"accept": "application/json"})
    assert sorted(x["id"] for x in r.json()["requeued"]) == sorted(boom)
    assert dead() == sorted(other)
    r = c.post("/dead/purge", data={"csrf": csrf, "confirm": "yes", "queue": "alpha",
                                    "task": "shop.other"},
               headers={"accept": "application/json"})
    assert r.status_code >= 400 and "PGJ-405" in r.text, r.text
    assert dead() == sorted(other)


def test_bulk_confirmation_counts_the_rows_and_acts_on_those_only(core, db, client, schema):
    """A bulk action's confirmation (the form without confirm=yes) reads the rows the page's
    filter lists now and says how many; confirmed, it touches exactly those: a dead letter of
    the same filter that arrives between the confirmation and the click stays dead. The
    result is a page in words for a browser, JSON only when asked for."""
    boom = [kill_dead(core, db, "alpha") for _ in range(3)]
    other = [kill_dead(core, db, "alpha") for _ in range(2)]
    db.execute(f'UPDATE "{schema}".pgjobs_dead_letter '
               "SET task = CASE WHEN id = ANY(%s) THEN 'shop.boom' ELSE 'shop.other' END",
               [boom])

    def dead() -> list[int]:
        return [r[0] for r in db.execute(
            f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id').fetchall()]

    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    page = c.get("/dead?queue=alpha&task=shop.boom").text
    bulk = re.search(r'<div class="bulk".*?</div>', page, re.S).group(0)
    assert "data-confirm" not in bulk  # the server's confirmation, which counts
    r = c.post("/dead/requeue", data={"csrf": csrf, "queue": "alpha", "task": "shop.boom"})
    assert r.status_code == 200
    count = re.search(r'<p id="count">This touches <b>(\d+)</b>', r.text)
    assert count and int(count.group(1)) == 3, r.text
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', r.text))
    assert sorted(int(i) for i in form["ids"].split(",")) == sorted(boom)
    assert form["confirm"] == "yes" and form["task"] == "shop.boom"
    late = kill_dead(core, db, "alpha")  # matches the filter, after the confirmation
    db.execute(f"UPDATE \"{schema}\".pgjobs_dead_letter SET task = 'shop.boom' WHERE id = %s",
               [late])
    r = c.post("/dead/requeue", data=form)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "Requeued 3 dead letters" in r.text
    assert 'href="/dead?queue=alpha&amp;task=shop.boom" id="back"' in r.text
    assert dead() == sorted([*other, late])
    # a script gets JSON: the preview, then the result
    r = c.post("/dead/requeue", data={"queue": "alpha", "task": "shop.boom"},
               headers={"authorization": f"Bearer {TOKEN}", "accept": "application/json"})
    assert r.json()["count"] == 1 and r.json()["fields"]["ids"] == str(late)
    # purge all: counted the same way, and confirmed on the rows listed only
    r = c.post("/dead/purge", data={"csrf": csrf, "queue": "alpha"})
    assert re.search(r"This touches <b>3</b>", r.text), r.text
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', r.text))
    extra = kill_dead(core, db, "alpha")
    r = c.post("/dead/purge", data=form)
    assert r.status_code == 200 and "Deleted 3 dead letters for good" in r.text
    assert dead() == [extra]
    # a filter the purge cannot apply is refused at the confirmation already
    r = c.post("/dead/purge", data={"csrf": csrf, "queue": "alpha", "task": "shop.other"})
    assert r.status_code == 400 and "PGJ-405" in r.text and dead() == [extra]
    # nothing listed: nothing to confirm
    r = c.post("/dead/requeue", data={"csrf": csrf, "queue": "alpha", "task": "no.such"})
    assert "Nothing matches now" in r.text and 'id="confirm-form"' not in r.text


def test_queue_purge_confirmation_counts_and_bounds_the_purge(core, db, client, schema):
    ids = [publish(core, db, "gamma") for _ in range(4)]
    claim(core, db, "gamma")  # ids[0] runs: a purge leaves it
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    assert 'action="/queues/gamma/purge" class="inline">' in c.get("/").text  # no dialog
    r = c.post("/queues/gamma/purge", data={"csrf": csrf})
    assert re.search(r"This touches <b>3</b>", r.text), r.text
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', r.text))
    assert form["limit"] == "3"
    later = publish(core, db, "gamma")
    r = c.post("/queues/gamma/purge", data=form)
    assert r.status_code == 200 and "Deleted 3 messages of queue gamma" in r.text
    left = [r[0] for r in db.execute(f'SELECT id FROM "{schema}".pgjobs_job '
                                     "WHERE queue = 'gamma' ORDER BY id")]
    assert left == [ids[0], later]


def test_bulk_actions_refuse_a_field_they_cannot_apply(core, db, client, schema):
    """A bulk action given a field it cannot apply acts on more than the field names (a
    requeue ``older_than`` 1 day requeued every dead letter of the queue; a queue purge of
    one ``task`` purged the whole queue): refused (400, ``PGJ-405``) at the confirmation and
    confirmed, from a browser and from a script, and nothing changed."""
    [kill_dead(core, db, "alpha") for _ in range(2)]
    [publish(core, db, "alpha", tenant="acme") for _ in range(2)]
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    before = snapshot(db, schema)
    cases = [("/dead/requeue", {"queue": "alpha", "older_than": "1d"}),
             ("/dead/requeue", {"ids": "1", "older_than": "1d"}),
             ("/queues/alpha/purge", {"task": "shop.boom"}),
             ("/queues/alpha/purge", {"tenant": "acme"}),
             ("/queues/alpha/purge", {"tenant": "acme", "limit": "1"})]
    for path, form in cases:
        for confirm in ({}, {"confirm": "yes"}):
            r = c.post(path, data={"csrf": csrf, **form, **confirm},
                       headers={"accept": "application/json"})
            assert r.status_code == 400, (path, form, confirm, r.text)
            assert r.json()["error"]["code"] == "PGJ-405", (path, form, confirm)
            r = c.post(path, data={**form, **confirm},  # a script, by bearer token
                       headers={"authorization": f"Bearer {TOKEN}",
                                "accept": "application/json"})
            assert r.status_code == 400 and "PGJ-405" in r.text, (path, form, confirm)
        r = c.post(path, data={"csrf": csrf, **form})  # a browser: an error page
        assert r.status_code == 400 and "PGJ-405" in r.text, (path, form)
    assert snapshot(db, schema) == before
    # without the field, the same actions still run
    r = c.post("/dead/requeue", data={"csrf": csrf, "confirm": "yes", "queue": "alpha"},
               headers={"accept": "application/json"})
    assert r.status_code == 200 and len(r.json()["requeued"]) == 2
    r = c.post("/queues/alpha/purge", data={"csrf": csrf, "confirm": "yes"},
               headers={"accept": "application/json"})
    assert r.status_code == 200 and r.json()["purged"] == 4


def test_a_bulk_confirmation_is_refused_when_a_listed_row_changed(core, db, client, schema):
    """docs/dashboard.md: "if one of the listed rows changed meanwhile (requeued by someone
    else), the action is refused with nothing done (PGJ-401; reload and confirm again)". The
    confirmation lists three dead letters; one is requeued directly (the CLI's statement);
    the confirmed form is answered 404 PGJ-401, and the other two are still dead letters,
    nothing else moved."""
    from kombu_pgjobs.store.admin import Admin

    listed = [kill_dead(core, db, "alpha") for _ in range(3)]
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    r = c.post("/dead/requeue", data={"csrf": csrf, "queue": "alpha"})
    assert re.search(r"This touches <b>3</b>", r.text), r.text
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', r.text))
    assert sorted(int(i) for i in form["ids"].split(",")) == sorted(listed)
    moved = Admin(db, schema).dead_requeue([listed[1]])  # by other means, meanwhile
    assert [x["id"] for x in moved["requeued"]] == [listed[1]]
    before = snapshot(db, schema)
    r = c.post("/dead/requeue", data=form)  # the browser's confirmed form
    assert r.status_code == 404 and "PGJ-401" in r.text, r.text
    r = c.post("/dead/requeue", data=form, headers={"accept": "application/json"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "PGJ-401", r.text
    assert snapshot(db, schema) == before
    dead = [row[0] for row in db.execute(
        f'SELECT id FROM "{schema}".pgjobs_dead_letter ORDER BY id').fetchall()]
    assert dead == sorted([listed[0], listed[2]])
    audited = db.execute(f"SELECT count(*) FROM \"{schema}\".pgjobs_audit "
                         "WHERE action = 'dead requeue'").fetchone()[0]
    assert audited == 0  # refused: not recorded as done
