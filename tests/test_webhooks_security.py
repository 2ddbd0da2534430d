"""Webhooks against an attacker and a hostile receiver: a captured delivery replayed under a new
event id is refused (signature v2 covers it) and a receiver that deduplicates as the docs say
processes each event once; a receiver that trickles its answer cannot hold an attempt past its
deadline; the read-only and operator roles cannot read an endpoint's secret by any SQL route;
secrets are sealed at rest with the app's Fernet keys, rotated and re-sealed; ``current_app``
proxies resolve to the app.

Real parts throughout: a real HTTP server (tests/webhook_server.py, or a raw socket server that
trickles), real ``celery worker`` processes, real PostgreSQL roles made by ``pgjobs roles``.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from celery import Celery
from cryptography.fernet import Fernet

import celery_ext
import celery_ext.webhooks as webhooks
from celery_ext.state import installed
from celery_ext.webhooks.delivery import post
from celery_ext.webhooks.settings import WebhookSettings
from kombu_pgjobs.errors import InvalidWebhookSetting, WebhookSecretLocked, WebhookSignatureInvalid
from kombu_pgjobs.ops.cli.main import main as cli
from kombu_pgjobs.store.webhooks import SEALED, SecretBox, WebhookStore
from tests.test_roles import _denied, roles  # noqa: F401  (the fixture)
from tests.test_webhooks import (
    APP,
    SECRET,
    dead_letters,
    explain_unless,
    ledger,
    receiver_snippet,
    sender,
    server,  # noqa: F401  (the fixture)
)

from .conftest import DSN
from .webhook_server import Reply


def stored_secret(db: psycopg.Connection[Any], schema: str, endpoint: int) -> str:
    return db.execute(f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint WHERE id = %s',
                      [endpoint]).fetchone()[0]


# -- replays ------------------------------------------------------------------------------------
@pytest.mark.e2e
def test_a_replay_under_a_new_event_id_is_refused(db, schema, url, server,  # noqa: F811
                                                  start_worker):
    """A real delivery, captured and replayed within the tolerance with a new
    Pgjobs-Event-Id (to pass the receiver's deduplication): the signature does not match.
    Replayed as it was, it verifies, and the documented receiver processes it once."""
    app = sender(schema, url)
    ep = webhooks.add_endpoint(server.script("/hook", Reply(200)), secret=SECRET, app=app)
    webhooks.send(ep, "order.paid", {"order": 42}, "evt_original", app=app)
    worker = start_worker(app=APP, name="replay")
    explain_unless(lambda: server.requests("/hook"), 30, "the delivery", db, schema, worker)
    (captured,) = server.requests("/hook")
    assert captured.headers["Pgjobs-Signature"].count("v2=") == 1
    assert "v1=" not in captured.headers["Pgjobs-Signature"]
    assert webhooks.verify(captured.headers, captured.body, SECRET).event_id == "evt_original"
    replayed = {**captured.headers, "Pgjobs-Event-Id": "evt_replayed"}
    with pytest.raises(WebhookSignatureInvalid):
        webhooks.verify(replayed, captured.body, SECRET)
    snippet = receiver_snippet()
    assert snippet(replayed, captured.body, SECRET) is None
    assert snippet(captured.headers, captured.body, SECRET) == "evt_original"

    # the documented deduplicating receiver, on real Postgres
    namespace: dict[str, Any] = {"verify_pgjobs_webhook": snippet}
    receive = receiver_snippet("receive", "receiver-dedupe", namespace)
    db.execute(f'CREATE TABLE "{schema}".received_webhook (event_id text PRIMARY KEY, '
               "received_at timestamptz NOT NULL DEFAULT now())")
    handled: list[Any] = []
    lock = threading.Lock()

    def handle(event: Any) -> None:
        time.sleep(0.2)  # duplicates arrive while the first is being processed
        with lock:
            handled.append(event)

    def deliver_once(headers: dict[str, str]) -> int:
        options = f"-c search_path={schema}"
        with psycopg.connect(DSN, autocommit=True, options=options) as conn:
            return int(receive(conn, headers, captured.body, [SECRET], handle))

    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(deliver_once, [captured.headers] * 4))
    assert statuses == [200] * 4
    assert deliver_once(replayed) == 400
    assert deliver_once(captured.headers) == 200
    assert [e["id"] for e in handled] == ["evt_original"], "processed once"


def test_send_refuses_event_ids_that_cannot_be_headers(db, schema, url):
    from kombu_pgjobs.errors import InvalidWebhookEvent

    app = sender(schema, url)
    ep = webhooks.add_endpoint("https://example.com/hook", secret=SECRET, app=app)
    for event_id in ("évt_1", "evt 1", "evt\t1"):
        with pytest.raises(InvalidWebhookEvent):
            webhooks.send(ep, "order.paid", {}, event_id, app=app)
    with pytest.raises(InvalidWebhookEvent):
        webhooks.send(ep, "order paid", {}, app=app)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0


# -- a trickling receiver ------------------------------------------------------------------------
@contextmanager
def trickler(head: bytes, trickle: bytes, every: float = 0.1,
             lasting: float = 12.0) -> Iterator[tuple[int, list[float]]]:
    """A raw HTTP server that reads the request, sends ``head`` at once, then one byte of
    ``trickle`` (repeated) every ``every`` seconds for at most ``lasting`` seconds: each byte
    arrives well within any per-read timeout. Yields its port and when each connection
    ended (the client gave up)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    ended: list[float] = []
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                conn.sendall(head)
                started = time.monotonic()
                i = 0
                while not stop.is_set() and time.monotonic() - started < lasting:
                    conn.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
                    i += 1
                    time.sleep(every)
            except OSError:
                pass
            ended.append(time.monotonic())

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield port, ended
    finally:
        stop.set()
        listener.close()


LOOPBACK = WebhookSettings(allow_names=("127.0.0.1",), timeout=2.0)


@pytest.mark.parametrize("head, trickle, outcome", [
    (b"", b"HTTP/1.1 200 OK\r\n", "unavailable"),                 # the status line
    (b"HTTP/1.1 200 OK\r\n", b"X-Slow: aaaaaaaa\r\n", "unavailable"),  # the headers
    (b"HTTP/1.1 500 Oops\r\nContent-Length: 100000\r\n\r\n", b"x", "unavailable"),  # the body
])
def test_a_trickling_receiver_cannot_stretch_an_attempt(head, trickle, outcome):
    with trickler(head, trickle) as (port, _):
        started = time.monotonic()
        out = post(LOOPBACK, f"http://127.0.0.1:{port}/hook", b"{}",
                   {"Content-Type": "application/json"})
        took = time.monotonic() - started
    assert took < LOOPBACK.timeout + 1.0, took  # it trickled on for 12 s
    assert out.kind == outcome, out
    if out.status is None:
        assert "no answer within 2 s" in (out.error or ""), out.error
    else:  # the status came in time and is the answer; the body arrived in part
        assert out.status == 500 and 0 < len(out.excerpt or "") < 1024


def test_a_receiver_that_never_accepts_the_body_cannot_stretch_an_attempt():
    """A server that accepts the connection and never reads: a 4 MiB body fills the socket
    buffers and the send blocks; the deadline ends it."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    try:
        started = time.monotonic()
        out = post(LOOPBACK, f"http://127.0.0.1:{listener.getsockname()[1]}/hook",
                   b"x" * (4 * 1024 * 1024), {"Content-Type": "application/json"})
        took = time.monotonic() - started
    finally:
        for s in held:
            s.close()
        listener.close()
    assert took < LOOPBACK.timeout + 1.0, took
    assert out.kind == "unavailable" and out.status is None


@pytest.mark.e2e
def test_a_worker_attempt_against_a_trickler_ends_by_its_deadline(db, schema, url,
                                                                 start_worker):
    app = sender(schema, url)
    with trickler(b"HTTP/1.1 200 OK\r\n", b"X-Slow: aaaaaaaa\r\n", lasting=20) as (port, _):
        ep = webhooks.add_endpoint(f"http://127.0.0.1:{port}/hook", secret=SECRET, app=app)
        webhooks.send(ep, "order.paid", {}, "evt_slow", app=app)
        worker = start_worker(app=APP, name="trickled",
                              env={"PGJOBS_TEST_WEBHOOK_TIMEOUT": "1.5",
                                   "PGJOBS_TEST_WEBHOOK_ATTEMPTS": "2"})
        explain_unless(lambda: len(dead_letters(db, schema)) == 1, 30,
                       "both attempts timed out", db, schema, worker)
    rows = ledger(db, schema, ep)
    assert [r["outcome"] for r in rows] == ["retrying", "failed"]
    assert all(r["status"] is None for r in rows)
    assert all(1400 <= r["latency_ms"] < 2500 for r in rows), [r["latency_ms"] for r in rows]
    assert all("no answer within 1.5 s" in r["error"] for r in rows)


# -- who can read a secret -----------------------------------------------------------------------
def test_the_read_only_and_operator_roles_cannot_read_a_secret(roles, db, schema):  # noqa: F811
    """Column privileges (pgjobs roles): every other column of the endpoints table, never
    the secret: not by name, not by *, not as a whole row, not by COPY, not from the planner's
    statistics (pg_stats shows a column only to who may select it)."""
    hook = WebhookStore(db, schema).add("https://example.com/hook", SECRET)
    db.execute(f'ANALYZE "{schema}".pgjobs_webhook_endpoint')
    table = f'"{schema}".pgjobs_webhook_endpoint'
    for component in ("ro", "op"):
        with roles.connect(component) as conn:
            _denied(conn, f"SELECT secret FROM {table}")
            _denied(conn, f"SELECT * FROM {table}")
            _denied(conn, f"SELECT e::text FROM {table} AS e")
            _denied(conn, f"SELECT to_jsonb(e) FROM {table} AS e")
            _denied(conn, f"SELECT id FROM {table} WHERE secret LIKE 'whsec%%'")
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                with conn.cursor().copy(f"COPY {table} TO STDOUT") as copy:
                    list(copy)
            stats = conn.execute(
                "SELECT attname FROM pg_stats WHERE schemaname = %s AND tablename = %s",
                [schema, "pgjobs_webhook_endpoint"]).fetchall()
            assert ("secret",) not in stats and ("url",) in stats, (component, stats)
            assert conn.execute(f"SELECT url FROM {table} WHERE id = %s", [hook]).fetchone() \
                == ("https://example.com/hook",)
    # the worker's role signs deliveries: it reads it
    with roles.connect("w") as conn:
        assert conn.execute(f"SELECT secret FROM {table} WHERE id = %s",
                            [hook]).fetchone() == (SECRET,)


def test_a_role_that_cannot_read_secrets_cannot_reseal_them(roles, db, schema, capsys,  # noqa: F811
                                                            monkeypatch):
    WebhookStore(db, schema).add("https://example.com/hook", SECRET)
    monkeypatch.setenv("PGJOBS_WEBHOOK_SECRET_KEYS", Fernet.generate_key().decode())
    code = cli(["webhooks", "reseal", "--dsn", roles.url("op"), "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code != 0 and "permission" in out["error"]["message"].lower(), out
    assert db.execute(f'SELECT secret FROM "{schema}".pgjobs_webhook_endpoint').fetchone() \
        == (SECRET,)


# -- secrets at rest ------------------------------------------------------------------------------
@pytest.mark.e2e
def test_secrets_are_sealed_at_rest_and_keys_rotate(db, schema, url, server,  # noqa: F811
                                                    start_worker, capsys, monkeypatch):
    old_key, new_key = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    app = sender(schema, url, pgjobs_webhook_secret_keys=[old_key])
    ep = webhooks.add_endpoint(server.script("/sealed", Reply(200)), secret=SECRET, app=app)
    stored = stored_secret(db, schema, ep)
    assert stored.startswith(SEALED) and SECRET not in stored
    assert SecretBox([old_key]).open(stored) == SECRET
    plain = WebhookStore(db, schema).add(server.script("/plain", Reply(200)), SECRET)
    assert stored_secret(db, schema, plain) == SECRET  # written without keys: stays readable

    # a worker with the key delivers, signed with the secret itself
    webhooks.send(ep, "order.paid", {"n": 1}, "evt_sealed", app=app)
    webhooks.send(plain, "order.paid", {"n": 2}, "evt_plain", app=app)
    worker = start_worker(app=APP, name="sealed", env={"PGJOBS_TEST_WEBHOOK_KEYS": old_key})
    explain_unless(lambda: server.requests("/sealed") and server.requests("/plain"), 30,
                   "both delivered", db, schema, worker)
    for path in ("/sealed", "/plain"):
        (got,) = server.requests(path)
        assert webhooks.verify(got.headers, got.body, SECRET)
    assert SECRET not in worker.output()
    worker.stop()

    # rotation: the new key first, re-seal, then the old key goes
    rotated = sender(schema, url, pgjobs_webhook_secret_keys=[new_key, old_key])
    assert webhooks.reseal_secrets(app=rotated, dry_run=True) == {
        "endpoints": 2, "sealed": 1, "resealed": 1, "dry_run": True}
    assert stored_secret(db, schema, ep) == stored
    assert webhooks.reseal_secrets(app=rotated) == {
        "endpoints": 2, "sealed": 1, "resealed": 1, "dry_run": False}
    for endpoint in (ep, plain):
        value = stored_secret(db, schema, endpoint)
        assert SecretBox([new_key]).open(value) == SECRET
        with pytest.raises(WebhookSecretLocked):
            SecretBox([old_key]).open(value)
    # rotate_secret seals with the newest key too
    webhooks.rotate_secret(ep, secret="a-fresh-secret-0123456789", app=rotated)
    assert SecretBox([new_key]).open(stored_secret(db, schema, ep)) == \
        "a-fresh-secret-0123456789"

    # a worker whose keys open nothing sends nothing; the delivery waits for one that can
    webhooks.send(plain, "order.paid", {"n": 3}, "evt_locked", app=rotated)
    locked = start_worker(app=APP, name="locked",
                          env={"PGJOBS_TEST_WEBHOOK_KEYS": old_key,
                               "PGJOBS_TEST_WEBHOOK_ATTEMPTS": "12"})
    explain_unless(lambda: "PGJ-811" in locked.output(), 30, "the secret locked", db, schema,
                   locked)
    assert len(server.requests("/plain")) == 1
    locked.stop()
    fixed = start_worker(app=APP, name="fixed", env={"PGJOBS_TEST_WEBHOOK_KEYS": new_key})
    explain_unless(lambda: len(server.requests("/plain")) == 2, 60, "delivered by a worker "
                   "with the new key", db, schema, fixed)
    assert webhooks.verify(server.requests("/plain")[1].headers,
                           server.requests("/plain")[1].body, SECRET).event_id == "evt_locked"

    # the CLI seals as the app does when it has the keys, and re-seals on demand
    monkeypatch.setenv("CLI_SECRET", "a-cli-added-secret-0123456789")
    monkeypatch.setenv("PGJOBS_WEBHOOK_SECRET_KEYS", new_key)
    code = cli(["webhooks", "add", "https://example.com/cli", "--secret-env", "CLI_SECRET",
                "--dsn", url, "--schema", schema, "--json"])
    added = json.loads(capsys.readouterr().out)
    assert code == 0, added
    assert SecretBox([new_key]).open(stored_secret(db, schema, added["id"])) == \
        "a-cli-added-secret-0123456789"
    newest = Fernet.generate_key().decode()
    monkeypatch.setenv("PGJOBS_WEBHOOK_SECRET_KEYS", f"{newest},{new_key}")
    code = cli(["webhooks", "reseal", "--dsn", url, "--schema", schema, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["resealed"] == 3, out
    assert SecretBox([newest]).open(stored_secret(db, schema, added["id"]))
    assert newest not in json.dumps(out) and new_key not in json.dumps(out)


def test_bad_keys_are_refused_and_never_repeated():
    key = Fernet.generate_key().decode()
    for keys in ([], "not-a-list", ["short"], [key, "x" * 44], [key[:-2]]):
        with pytest.raises(InvalidWebhookSetting) as err:
            SecretBox(keys)  # type: ignore[arg-type]
        assert key not in str(err.value) and "x" * 44 not in str(err.value)
    box = SecretBox([key])
    assert key not in repr(box)
    with pytest.raises(WebhookSecretLocked):
        SecretBox([Fernet.generate_key().decode()]).open(box.seal(SECRET))
    from kombu_pgjobs.store.webhooks import open_secret

    with pytest.raises(WebhookSecretLocked):
        open_secret(box.seal(SECRET), None)
    assert open_secret(SECRET, None) == SECRET
    from celery_ext.webhooks.settings import webhook_settings

    with pytest.raises(InvalidWebhookSetting):
        webhook_settings({"pgjobs_webhook_secret_keys": ["nope"]})
    with pytest.raises(InvalidWebhookSetting):
        webhook_settings({"pgjobs_webhook_sign_v1": "yes"})
    from kombu_pgjobs.errors import InvalidWebhookEndpoint
    from kombu_pgjobs.store.webhooks import check_secret

    with pytest.raises(InvalidWebhookEndpoint):
        check_secret(box.seal(SECRET))  # a sealed value is never taken as a secret


# -- current_app -----------------------------------------------------------------------------------
def test_install_and_send_resolve_the_current_app_proxy(db, schema, url):
    from celery import current_app

    app = Celery("proxied", broker=url, set_as_current=True)
    try:
        celery_ext.install(current_app)  # the proxy, as `celery_ext.install(current_app)`
        assert installed(app) and installed(current_app)
        app.conf.update({"broker_transport_options": {"schema": schema},
                         "task_ignore_result": True,
                         "pgjobs_webhook_allow_hosts": ["127.0.0.1"]})
        ep = webhooks.add_endpoint("https://example.com/hook", secret=SECRET)
        sent = webhooks.send(ep, "order.paid", {"n": 1})
        assert sent.event_id.startswith("evt_")
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 1
    finally:
        Celery("other", set_as_current=True)
