"""The dashboard against an attacker: reading needs a token off loopback, the Host allow-list
(DNS rebinding, on the default loopback bind too), server-side sessions (reuse after sign-out,
token rotation, a planted id never promoted), CSRF bound to the session (a tossed cookie),
malformed cookies, the sign-in backoff, token strength, Secure cookies behind a TLS proxy, and
what ``--public-read`` says it exposes.

Through Starlette's test client against real Postgres, and through a real ``pgjobs
dashboard`` server (a subprocess, real HTTP) for what the command line decides: the bind, the
Host check, the proxy headers. Every attack is shown changing nothing in the database.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from starlette.testclient import TestClient

from kombu_pgjobs.errors import DashboardTokenRequired, DashboardWeakToken
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.ops.dashboard import create_app
from kombu_pgjobs.ops.dashboard.security import FREE_FAILURES, check_token
from kombu_pgjobs.store.core import QueueCore
from kombu_pgjobs.store.schema import migrate
from tests.test_cli import kill_dead, publish
from tests.test_dashboard import csrf_of, sign_in

TOKEN = "correct-horse-battery-staple"
READ = "read-only-viewer-token-4242"
PAGES = ("/", "/messages", "/dead", "/limits", "/workers", "/tenants", "/schedules",
         "/webhooks")


@pytest.fixture
def core(db: psycopg.Connection[Any], schema: str) -> QueueCore:
    migrate(db, schema)
    return QueueCore(schema, lease_ttl=30, max_attempts=20, worker="sec-test:1")


@pytest.fixture
def client(url: str, schema: str) -> Iterator[Any]:
    """client(**create_app options, base_url=...) -> a TestClient of a fresh app."""
    made: list[TestClient] = []

    def make(base_url: str = "http://testserver", **options: Any) -> TestClient:
        app: Any = create_app(url, schema=schema, pool_size=2, **options)
        c = TestClient(app, base_url=base_url)
        made.append(c)
        return c

    yield make
    for c in made:
        c.app.state.dashboard.close()  # type: ignore[attr-defined]


def paused(db: psycopg.Connection[Any], schema: str, queue: str = "alpha") -> bool:
    row = db.execute(f'SELECT paused FROM "{schema}".pgjobs_queue WHERE name = %s',
                     [queue]).fetchone()
    return bool(row and row[0])


# -- reading needs a token ----------------------------------------------------------------
def test_a_read_token_gates_every_page(core, db, client, schema):
    job = publish(core, db, "alpha")
    c = client(write=True, token=TOKEN, read_token=READ)
    for path in (*PAGES, f"/messages/{job}"):
        r = c.get(path, follow_redirects=False)
        assert r.status_code == 303, path
        assert r.headers["location"].startswith("/login?next="), path
        r = c.get(path, headers={"accept": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "PGJ-439", path
    assert c.get("/static/dashboard.css").status_code == 200  # no data in it
    assert c.get("/login").status_code == 200
    # a script: either token as a bearer header reads
    for token in (READ, TOKEN):
        r = c.get(f"/messages/{job}", headers={"authorization": f"Bearer {token}"})
        assert r.status_code == 200 and f"Message {job}" in r.text
    # a browser signs in with the read token, and comes back where it was sent from
    r = c.get("/dead?queue=alpha", follow_redirects=False)
    login = c.get(r.headers["location"]).text
    assert 'name="next" value="/dead?queue=alpha"' in login
    r = c.post("/login", data={"csrf": csrf_of(login), "token": READ,
                               "next": "/dead?queue=alpha"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dead?queue=alpha"
    page = c.get("/")
    assert page.status_code == 200 and "signed in to read" in page.text
    assert 'action="/queues/alpha/pause"' not in page.text  # no buttons for a reader
    r = c.post("/queues/alpha/pause", data={"csrf": csrf_of(page.text), "confirm": "yes"})
    assert r.status_code == 403 and "PGJ-433" in r.text and not paused(db, schema)
    r = c.post("/queues/alpha/pause", data={"confirm": "yes"},
               headers={"authorization": f"Bearer {READ}", "accept": "application/json"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "PGJ-433"
    # the write token signs in to act (a new session: the reader's ends)
    csrf = sign_in(c)
    r = c.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"})
    assert r.status_code == 200 and paused(db, schema)
    # a redirect after sign-in never leaves the dashboard
    for evil in ("//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:1"):
        other = client(read_token=READ)
        r = other.post("/login", data={"csrf": csrf_of(other.get("/login").text),
                                       "token": READ, "next": evil}, follow_redirects=False)
        assert r.headers["location"] == "/", evil


def test_read_only_dashboard_with_a_read_token(core, db, client, schema):
    c = client(read_token=READ)  # no write mode: a reader signs in, nobody acts
    assert c.get("/", follow_redirects=False).status_code == 303
    sign_in(c, token=READ)
    assert c.get("/").status_code == 200
    r = c.post("/login", data={"csrf": csrf_of(c.get("/").text), "token": TOKEN})
    assert r.status_code == 403 and "PGJ-433" in r.text  # no write token exists here


# -- sessions end on the server ----------------------------------------------------------
def test_a_session_cookie_is_worthless_after_sign_out(core, db, client, schema):
    """A session cookie copied while it was live (a shared machine, a proxy log) opens
    nothing once its owner signed out: the session ended on the server."""
    core.declare_queue(db, "alpha")
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    stolen = c.cookies.get("pgjobs_session")
    assert stolen
    raw = f"pgjobs_session={stolen}; pgjobs_csrf={c.cookies.get('pgjobs_csrf')}"
    r = c.post("/logout", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and "pgjobs_session=" in r.headers["set-cookie"]
    thief = TestClient(c.app)  # the copied cookies, replayed after the sign-out
    r = thief.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"},
                   headers={"cookie": raw})
    assert r.status_code == 403 and "PGJ-433" in r.text and not paused(db, schema)
    assert "sign in to act" in thief.get("/", headers={"cookie": raw}).text
    # with a read token, the copied cookie does not even read
    gated = client(write=True, token=TOKEN, read_token=READ)
    csrf = sign_in(gated, token=READ)
    stolen = gated.cookies.get("pgjobs_session")
    assert gated.get("/").status_code == 200
    gated.post("/logout", data={"csrf": csrf})
    thief = TestClient(gated.app)
    r = thief.get("/", headers={"cookie": f"pgjobs_session={stolen}"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"].startswith("/login")


def test_rotating_the_tokens_ends_every_session(core, db, client, schema):
    core.declare_queue(db, "alpha")
    c = client(write=True, token=TOKEN, read_token=READ)
    csrf = sign_in(c)
    reader = TestClient(c.app)
    sign_in(reader, token=READ)
    dash = c.app.state.dashboard  # type: ignore[attr-defined]
    assert dash.guard.sessions() == 2
    with pytest.raises(DashboardWeakToken):
        dash.rotate(token="aaaaaaaaaaaaaaaaaaaa")  # checked as at start; nothing changed
    assert dash.guard.sessions() == 2
    new = "a-new-write-token-after-the-leak-77"
    dash.rotate(token=new)
    assert dash.guard.sessions() == 0
    r = c.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"},
               headers={"accept": "application/json"})
    assert r.status_code == 401 and not paused(db, schema)
    assert reader.get("/", follow_redirects=False).status_code == 303
    r = c.get("/", headers={"authorization": f"Bearer {TOKEN}", "accept": "application/json"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "PGJ-433"
    csrf = sign_in(c, token=new)
    assert c.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"}
                  ).status_code == 200 and paused(db, schema)


def test_sessions_expire(core, db, client, schema):
    from kombu_pgjobs.ops.dashboard.security import IDLE_SECONDS, SESSION_SECONDS

    c = client(write=True, token=TOKEN, read_token=READ)
    guard = c.app.state.dashboard.guard  # type: ignore[attr-defined]
    now = [time.time()]
    guard.clock = lambda: now[0]
    sign_in(c)
    now[0] += IDLE_SECONDS - 60
    assert c.get("/").status_code == 200  # used: the idle clock starts again
    now[0] += IDLE_SECONDS - 60
    assert c.get("/").status_code == 200
    now[0] += IDLE_SECONDS + 1
    assert c.get("/", follow_redirects=False).status_code == 303  # idle too long
    sign_in(c)
    for _ in range(int(SESSION_SECONDS / (IDLE_SECONDS - 60)) + 1):
        now[0] += IDLE_SECONDS - 60
        r = c.get("/", follow_redirects=False)
    assert r.status_code == 303  # 12 hours after sign-in, used or not


def test_a_planted_session_id_is_never_promoted(core, db, client, schema):
    """Session fixation: before the operator signs in, an attacker plants a session cookie
    in the operator's browser (cookie tossing from a sibling domain): an id of their own
    making, or the live session of the attacker's own read-token sign-in. Signing in with
    the write token makes a new id; the planted one is not it, and opens nothing after."""
    core.declare_queue(db, "alpha")
    c = client(write=True, token=TOKEN, read_token=READ)
    guard = c.app.state.dashboard.guard  # type: ignore[attr-defined]
    attacker = TestClient(c.app)
    attacker_csrf = sign_in(attacker, token=READ)
    readers = attacker.cookies.get("pgjobs_session")
    assert readers and attacker.get("/").status_code == 200
    made_up = "A" * 20 + "attacker-chosen-id-0" + "xyz"  # the shape of a real id
    assert len(made_up) == 43 and guard.session(made_up) is None
    for planted in (made_up, readers):
        victim = TestClient(c.app)
        victim.cookies.set("pgjobs_session", planted, domain="testserver.local")
        csrf = sign_in(victim)  # the planted cookie goes with the sign-in
        session = victim.cookies.get("pgjobs_session")
        assert session and session != planted
        assert guard.session(planted) is None  # the planted id names no session now
        # the attacker's copy of the planted id opens nothing: not a page, not an action
        thief = TestClient(c.app)
        r = thief.get("/", headers={"cookie": f"pgjobs_session={planted}"},
                      follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"].startswith("/login")
        for form_csrf in (csrf, attacker_csrf):
            r = thief.post("/queues/alpha/pause", data={"csrf": form_csrf, "confirm": "yes"},
                           headers={"cookie": f"pgjobs_session={planted}",
                                    "accept": "application/json"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "PGJ-439"
        assert not paused(db, schema)
        assert victim.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"},
                           headers={"accept": "application/json"}).status_code == 200
        assert paused(db, schema)
        db.execute(f'UPDATE "{schema}".pgjobs_queue SET paused = false')
    # the reader's session ended when the victim's browser signed in over it
    assert attacker.get("/", follow_redirects=False).status_code == 303


# -- CSRF is the session's own -------------------------------------------------------------
def test_a_tossed_csrf_cookie_does_not_pass_for_the_session(core, db, client, schema):
    """Cookie tossing: a page on a sibling domain can set cookies for the dashboard's host.
    The attacker takes an anonymous (nonce cookie, CSRF token) pair from the sign-in page,
    plants the nonce in the operator's browser and posts a form with the token: refused, the
    CSRF token a session's forms need is that session's own."""
    kill_dead(core, db, "alpha")
    c = client(write=True, token=TOKEN)
    csrf = sign_in(c)
    attacker = TestClient(c.app)
    pair_token = csrf_of(attacker.get("/login").text)
    pair_nonce = attacker.cookies.get("pgjobs_csrf")
    assert pair_nonce and pair_token
    # the operator's browser sends its session and, from now on, the tossed nonce
    tossed = f"pgjobs_session={c.cookies.get('pgjobs_session')}; pgjobs_csrf={pair_nonce}"
    for path in ("/queues/alpha/pause", "/dead/requeue"):
        r = c.post(path, data={"csrf": pair_token, "confirm": "yes", "queue": "alpha"},
                   headers={"accept": "application/json", "cookie": tossed})
        assert r.status_code == 403 and r.json()["error"]["code"] == "PGJ-434", path
    r = c.post("/logout", data={"csrf": pair_token}, headers={"cookie": tossed})
    assert r.status_code == 403 and "PGJ-434" in r.text
    assert not paused(db, schema)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 1
    # another signed-in browser's CSRF token does not pass either
    other = TestClient(c.app)
    other_csrf = sign_in(other)
    r = c.post("/queues/alpha/pause", data={"csrf": other_csrf, "confirm": "yes"})
    assert r.status_code == 403 and not paused(db, schema)
    assert c.post("/queues/alpha/pause", data={"csrf": csrf, "confirm": "yes"}
                  ).status_code == 200 and paused(db, schema)


# -- malformed cookies ---------------------------------------------------------------------
def test_malformed_cookies_are_no_cookies_never_a_500(core, db, client, schema):
    """docs/dashboard.md: malformed cookies are absent cookies: a page answers as to a
    signed-out browser (200, or 303 to /login behind a read token) and clears the session
    cookie; a form is refused as a signed-out browser's: an action 403 (PGJ-433; 401,
    PGJ-439, behind a read token), the sign-in form 403 (PGJ-434: its CSRF nonce is no
    nonce); a sign-out has no session to end and goes back to / (303)."""
    job = publish(core, db, "alpha")
    bad = ["1.\u00e9", "\u00e9\u00e9\u00e9", "9999999999.deadbeef", "x" * 5000, "\u0663.\u00ff",
           '"quoted"', "a;b"]
    open_app = client(write=True, token=TOKEN)
    gated = client(write=True, token=TOKEN, read_token=READ)
    forms = {open_app: {"/queues/alpha/pause": (403, "PGJ-433"), "/logout": (303, None),
                        "/login": (403, "PGJ-434")},
             gated: {"/queues/alpha/pause": (401, "PGJ-439"), "/logout": (303, None),
                     "/login": (403, "PGJ-434")}}
    for value in bad:
        raw = f"pgjobs_session={value}; pgjobs_csrf={value}".encode()
        for c, expect in ((open_app, 200), (gated, 303)):
            for path in (*PAGES, f"/messages/{job}", "/login"):
                r = c.get(path, headers=[(b"cookie", raw)], follow_redirects=False)
                want = 200 if path == "/login" else expect
                assert r.status_code == want, (value, path, r.status_code)
            # the bad session cookie is cleared on the way back
            r = c.get("/login", headers=[(b"cookie", raw)])
            assert 'pgjobs_session=""' in r.headers.get("set-cookie", "") or \
                "pgjobs_session=;" in r.headers.get("set-cookie", ""), r.headers
            for path, (status, code) in forms[c].items():
                r = c.post(path, data={"csrf": value, "confirm": "yes", "token": value},
                           headers=[(b"cookie", raw)], follow_redirects=False)
                assert r.status_code == status, (value, path, r.status_code)
                if code is not None:
                    assert code in r.text, (value, path, r.text[:300])
                else:
                    assert r.headers["location"] == "/", (value, path)
                assert 'pgjobs_session=""' in r.headers.get("set-cookie", ""), (value, path)
    # a malformed bearer token: ignored where reading is open; where not, a wrong token
    # like any other (403, PGJ-433), which counts toward the backoff (429 after the fifth)
    for c, want in ((open_app, [200] * len(bad)),
                    (gated, [403] * FREE_FAILURES + [429] * (len(bad) - FREE_FAILURES))):
        got = [c.get("/", headers=[(b"cookie", f"pgjobs_session={value}".encode()),
                                   (b"authorization", f"Bearer {value}".encode())],
                     follow_redirects=False).status_code for value in bad]
        assert got == want, (c is open_app, got)
    assert not paused(db, schema)


# -- guessing --------------------------------------------------------------------------------
def test_wrong_tokens_back_off(core, db, client, schema):
    """200 guesses in a row: five are checked, every other one is answered 429 unchecked
    (the right token too, while the client must wait); the wait doubles; once it has passed
    the right token signs in and the count starts again."""
    c = client(write=True, token=TOKEN)
    guard = c.app.state.dashboard.guard  # type: ignore[attr-defined]
    now = [1000.0]
    guard.throttle.clock = lambda: now[0]
    csrf = csrf_of(c.get("/login").text)
    statuses = []
    started = time.monotonic()
    for i in range(200):
        r = c.post("/login", data={"csrf": csrf, "token": f"guess-number-{i:05d}-xyz"},
                   follow_redirects=False)
        statuses.append(r.status_code)
    took = time.monotonic() - started
    assert statuses[:FREE_FAILURES] == [403] * FREE_FAILURES
    assert set(statuses[FREE_FAILURES:]) == {429}, statuses
    assert "PGJ-438" in r.text and int(r.headers["retry-after"]) >= 1
    r = c.post("/login", data={"csrf": csrf, "token": TOKEN}, follow_redirects=False)
    assert r.status_code == 429  # not even the right token is looked at
    # bearer guesses count against the same address
    r = c.post("/queues/alpha/pause", data={"confirm": "yes"},
               headers={"authorization": "Bearer another-guess-123456",
                        "accept": "application/json"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "PGJ-438"
    assert guard.throttle.wait("testclient") == 1.0  # after the fifth: 1 s
    now[0] += 1  # the wait has passed: one more wrong guess earns twice the wait
    r = c.post("/login", data={"csrf": csrf, "token": "guess-after-the-wait-0"},
               follow_redirects=False)
    assert r.status_code == 403
    assert guard.throttle.wait("testclient") == 2.0
    now[0] += 2
    r = c.post("/login", data={"csrf": csrf, "token": TOKEN}, follow_redirects=False)
    assert r.status_code == 303
    assert guard.throttle.wait("testclient") == 0.0
    print(f"200 guesses answered in {took:.2f} s")


def test_tokens_must_be_hard_to_guess(url, schema, client, capsys, monkeypatch):
    for weak, error in (("short", DashboardTokenRequired), ("a" * 16, DashboardWeakToken),
                        ("0123456789012345", DashboardWeakToken),
                        ("abababababababababababab", DashboardWeakToken),
                        ("with spaces in it 0123456789", DashboardWeakToken),
                        ("caf\u00e9-caf\u00e9-0123456789", DashboardWeakToken)):
        with pytest.raises(error) as raised:
            create_app(url, schema=schema, write=True, token=weak)
        assert weak not in str(raised.value)
        with pytest.raises(error):
            create_app(url, schema=schema, read_token=weak)
    with pytest.raises(DashboardWeakToken):
        create_app(url, schema=schema, write=True, token=TOKEN, read_token=TOKEN)
    assert check_token(TOKEN) == TOKEN
    monkeypatch.setenv("PGJOBS_DASHBOARD_TOKEN", "aaaaaaaaaaaaaaaaaaaaaaaa")
    code = cli(["dashboard", "--write", "--dsn", url, "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and out["error"]["code"] == "PGJ-436"
    assert "aaaaaaaa" not in out["error"]["message"]


# -- where it listens, and whom it answers ---------------------------------------------------
def test_off_loopback_it_refuses_to_start_without_a_read_token(url, schema, capsys,
                                                                monkeypatch):
    monkeypatch.delenv("PGJOBS_DASHBOARD_READ_TOKEN", raising=False)
    for bind in ("0.0.0.0", "::", "10.1.2.3", "dash.example.com"):
        code = cli(["dashboard", "--bind", bind, "--dsn", url, "--schema", schema, "--json"])
        out = json.loads(capsys.readouterr().out)
        assert code == 2 and out["error"]["code"] == "PGJ-435", bind
        assert "--public-read" in out["error"]["message"]
    code = cli(["dashboard", "--bind", "0.0.0.0", "--public-read", "--read-token", READ,
                "--dsn", url, "--schema", schema, "--json"])
    assert code == 2 and json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-405"
    code = cli(["dashboard", "--trusted-proxy", "*", "--proxy-headers", "--dsn", url,
                "--schema", schema, "--json"])
    assert code == 2 and json.loads(capsys.readouterr().out)["error"]["code"] == "PGJ-405"


def test_the_host_allow_list_in_the_app(core, client):
    c = client(allowed_hosts=["127.0.0.1", "localhost", "[::1]", "dash.example.com",
                              "*.ops.example.com"])
    for host in ("127.0.0.1:8787", "LOCALHOST", "[::1]:8787", "dash.example.com.",
                 "a.ops.example.com"):
        assert c.get("/", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", "127.0.0.1.evil.example", "dash.example.com.evil",
                 "ops.example.com", "evil-ops.example.com", "", "[::2]"):
        r = c.get("/", headers={"host": host})
        assert r.status_code == 400 and r.json()["error"]["code"] == "PGJ-437", host
        assert r.headers["x-frame-options"] == "DENY"


def test_secure_cookies(core, client):
    for c in (client(write=True, token=TOKEN, base_url="https://testserver"),
              client(write=True, token=TOKEN, secure_cookies=True)):
        page = c.get("/login")
        assert "Secure" in page.headers["set-cookie"]
        r = c.post("/login", data={"csrf": csrf_of(page.text), "token": TOKEN},
                   follow_redirects=False)
        assert "Secure" in r.headers["set-cookie"] and "HttpOnly" in r.headers["set-cookie"]
    c = client(write=True, token=TOKEN)
    assert "Secure" not in c.get("/login").headers["set-cookie"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(url: str, schema: str, tmp_path: Path, *args: str,
          env: dict[str, str] | None = None) -> Iterator[int]:
    """A real ``pgjobs dashboard`` on a free port, stopped afterwards."""
    port = _free_port()
    log = tmp_path / f"dashboard-{port}.log"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PGJOBS_DASHBOARD")}
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kombu_pgjobs.ops.cli", "dashboard", "--dsn", url, "--schema",
             schema, "--port", str(port), *args], stdout=fh, stderr=subprocess.STDOUT,
            env={**environ, **(env or {})})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"dashboard did not start:\n{log.read_text()}")
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def get(port: int, path: str, headers: dict[str, str]) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def request(port: int, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """A GET to a real server: its status and body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_a_real_server_off_loopback_answers_only_its_names(core, url, schema, tmp_path):
    """DNS rebinding: a page on evil.example whose name the attacker's DNS points at the
    dashboard's address sends ``Host: evil.example``. Bound beyond loopback (0.0.0.0, read
    token required), the server answers only its allowed names; with one of them, reading
    still needs the token."""
    with serve(url, schema, tmp_path, "--bind", "0.0.0.0", "--allowed-host", "dash.test",
               env={"PGJOBS_DASHBOARD_READ_TOKEN": READ}) as port:
        for host in ("evil.example", f"evil.example:{port}", "dash.test.evil.example"):
            r = get(port, "/", {"Host": host, "Authorization": f"Bearer {READ}"})
            assert r.status == 400, host
        r = get(port, "/", {"Host": f"dash.test:{port}"})
        assert r.status == 303 and r.getheader("location").startswith("/login")
        r = get(port, "/", {"Host": f"dash.test:{port}", "Authorization": f"Bearer {READ}"})
        assert r.status == 200
        r = get(port, "/", {"Host": f"127.0.0.1:{port}", "Authorization": f"Bearer {READ}"})
        assert r.status == 200  # loopback names: always
    with serve(url, schema, tmp_path, "--bind", "0.0.0.0", "--public-read") as port:
        assert get(port, "/", {"Host": "evil.example"}).status == 400
        assert get(port, "/", {"Host": f"localhost:{port}"}).status == 200


def test_a_real_server_on_the_default_loopback_bind_refuses_a_foreign_host(core, db, url, schema,
                                                                          tmp_path):
    """DNS rebinding against the default bind: a page on evil.example, whose name the
    attacker's DNS points at 127.0.0.1, makes the operator's browser ask the dashboard with
    ``Host: evil.example``. Bound to 127.0.0.1 (the default, reading open there), it answers
    400 (PGJ-437) and shows no data; its loopback names are answered."""
    job = publish(core, db, "alpha")
    with serve(url, schema, tmp_path) as port:  # no --bind: 127.0.0.1
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                     f"localhost.evil.example:{port}"):
            for path in ("/", f"/messages/{job}", "/dead"):
                status, body = request(port, path, {"Host": host,
                                                    "Accept": "application/json"})
                assert status == 400, (host, path, status)
                assert json.loads(body)["error"]["code"] == "PGJ-437", (host, body)
            status, body = request(port, "/", {"Host": host})  # the browser's own page
            assert status == 400 and b"PGJ-437" in body and b"alpha" not in body, host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost"):
            status, body = request(port, f"/messages/{job}", {"Host": host})
            assert status == 200 and f"Message {job}".encode() in body, host


def test_a_real_server_with_public_read_says_what_it_exposes(core, url, schema, tmp_path):
    """``--public-read`` off loopback: the server says on stderr and in its log what anyone
    who reaches it reads (docs/dashboard.md's list); on loopback it has nothing to say."""
    exposed = ("every queue", "every message's body, headers and arguments",
               "every dead letter's error and traceback", "workers", "tenants", "schedules",
               "webhook endpoint URLs and their delivery attempts")
    with serve(url, schema, tmp_path, "--bind", "0.0.0.0", "--public-read") as port:
        assert get(port, "/", {"Host": f"127.0.0.1:{port}"}).status == 200
        out = (tmp_path / f"dashboard-{port}.log").read_text("utf-8")
    said = [line for line in out.splitlines()
            if line.startswith("pgjobs dashboard: --public-read: anyone who reaches 0.0.0.0 "
                               "reads ")]
    logged = [line for line in out.splitlines()
              if "pgjobs.dashboard.public_read on 0.0.0.0: anyone who reaches it reads " in line]
    assert len(said) == 1 and len(logged) == 1, out
    for what in exposed:
        assert what in said[0] and what in logged[0], (what, out)
    with serve(url, schema, tmp_path, "--public-read") as port:  # loopback: not exposed
        assert get(port, "/", {"Host": f"127.0.0.1:{port}"}).status == 200
        out = (tmp_path / f"dashboard-{port}.log").read_text("utf-8")
    assert "anyone who reaches" not in out, out


def test_a_real_server_behind_a_tls_proxy_sets_secure_cookies(core, url, schema, tmp_path):
    forwarded = {"Host": "127.0.0.1", "X-Forwarded-Proto": "https",
                 "X-Forwarded-For": "203.0.113.9"}
    with serve(url, schema, tmp_path, "--write", "--proxy-headers",
               env={"PGJOBS_DASHBOARD_TOKEN": TOKEN}) as port:
        cookie = get(port, "/login", forwarded).getheader("set-cookie")
        assert "Secure" in cookie and "HttpOnly" in cookie, cookie
        plain = get(port, "/login", {"Host": "127.0.0.1"}).getheader("set-cookie")
        assert "Secure" not in plain
    # a proxy it does not trust cannot claim HTTPS
    with serve(url, schema, tmp_path, "--write", "--proxy-headers", "--trusted-proxy",
               "10.9.9.9", env={"PGJOBS_DASHBOARD_TOKEN": TOKEN}) as port:
        assert "Secure" not in get(port, "/login", forwarded).getheader("set-cookie")
    with serve(url, schema, tmp_path, "--write",
               env={"PGJOBS_DASHBOARD_TOKEN": TOKEN}) as port:  # no --proxy-headers
        assert "Secure" not in get(port, "/login", forwarded).getheader("set-cookie")


def test_the_backoff_counts_the_client_behind_a_trusted_proxy(core, url, schema, tmp_path):
    """Behind a proxy every request comes from the proxy's address: with --proxy-headers
    the backoff counts X-Forwarded-For's client, so one guesser does not lock out the rest."""
    with serve(url, schema, tmp_path, "--write", "--proxy-headers",
               env={"PGJOBS_DASHBOARD_TOKEN": TOKEN,
                    "PGJOBS_DASHBOARD_READ_TOKEN": READ}) as port:
        def bearer(token: str, client: str) -> int:
            return get(port, "/", {"Host": "127.0.0.1", "X-Forwarded-For": client,
                                   "Authorization": f"Bearer {token}"}).status

        statuses = [bearer(f"wrong-guess-{i:04d}-abcdef", "203.0.113.9") for i in range(8)]
        assert statuses == [403] * FREE_FAILURES + [429] * (8 - FREE_FAILURES)
        assert bearer(TOKEN, "198.51.100.7") == 200
        assert bearer(TOKEN, "203.0.113.9") == 429


def test_no_500_on_a_real_server_for_raw_non_ascii_cookies(core, url, schema, tmp_path):
    with serve(url, schema, tmp_path, "--write",
               env={"PGJOBS_DASHBOARD_TOKEN": TOKEN}) as port:
        for path in ("/", "/login", "/dead"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.putrequest("GET", path, skip_host=True)
            conn.putheader("Host", "127.0.0.1")
            conn.putheader("Cookie", "pgjobs_session=1.\xe9\xe9; pgjobs_csrf=\xff\xfe".encode(
                "latin-1"))
            conn.endheaders()
            r = conn.getresponse()
            r.read()
            conn.close()
            assert r.status == 200, (path, r.status)
        assert re.search("pgjobs", get(port, "/", {"Host": "127.0.0.1"}).getheader(
            "set-cookie") or "")


def test_network_facing_dependency_floors_are_the_documented_ones():
    """docs/security.md's table of floors, pyproject.toml's extras and what is installed agree:
    a floor cannot move without the page, nor the tests run below a floor."""
    from importlib.metadata import version
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    requirements_mod = pytest.importorskip("packaging.requirements")
    Requirement = requirements_mod.Requirement
    Version = pytest.importorskip("packaging.version").Version

    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "security.md").read_text("utf-8")
    section = doc.split("## Dependencies that face the network", 1)[1]
    floors = dict(re.findall(r"^\| `([\w-]+)` \| `>=([\d.]+)` \|", section, re.M))
    assert set(floors) == {"starlette", "python-multipart", "jinja2", "uvicorn", "h11",
                           "httpx", "cryptography"}, floors
    extras = tomllib.loads((root / "pyproject.toml").read_text("utf-8"))["project"][
        "optional-dependencies"]
    seen: dict[str, set[str]] = {}
    for extra, requirements in extras.items():
        for text in requirements:
            req = Requirement(text)
            name = req.name.lower()
            if name in floors:
                lows = {s.version for s in req.specifier if s.operator == ">="}
                assert lows == {floors[name]}, (extra, text, floors[name])
                seen.setdefault(name, set()).add(extra)
    assert {"dashboard", "test"} <= seen["starlette"] and "webhooks" in seen["httpx"]
    assert "encryption" in seen["cryptography"] and {"dashboard", "webhooks"} <= seen["h11"]
    for name, floor in floors.items():
        assert Version(version(name)) >= Version(floor), (name, version(name), floor)
