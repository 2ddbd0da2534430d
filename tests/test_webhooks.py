"""celery_ext.webhooks: signing and verify, egress safety, and deliveries on a real worker.

The deliveries go to a real HTTP server in this process (tests/webhook_server.py), scripted per
path, from real ``celery worker`` processes (tests/apps/webhooked.py, backoff base 0.1 s). What
happened is read back from the database: the ledger, the endpoint row, the dead letters.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any

import psycopg
import pytest
from celery import Celery, current_app

import celery_ext
import celery_ext.webhooks as webhooks
from celery_ext.webhooks.delivery import backoff_delay, classify_status
from celery_ext.webhooks.egress import guarded_client, refusal
from celery_ext.webhooks.settings import WebhookSettings, webhook_settings
from kombu_pgjobs.errors import (
    EgressRefused,
    InvalidWebhookEndpoint,
    InvalidWebhookEvent,
    InvalidWebhookSetting,
    WebhookEndpointNotFound,
    WebhookSignatureInvalid,
)

from .conftest import ROOT, wait_for
from .webhook_server import Reply, WebhookServer, webhook_server

APP = "tests.apps.webhooked"
SECRET = "whsec_" + "Zq8vR2mK5xT9bN3c"  # 22 characters; grepped for everywhere below


@pytest.fixture
def server() -> Iterator[WebhookServer]:
    with webhook_server() as s:
        yield s


def sender(schema: str, url: str, **conf: Any) -> Celery:
    """A celery_ext app in this process on the test's schema (the publisher side)."""
    app = Celery("sender", broker=url, set_as_current=False)
    celery_ext.install(app)
    app.conf.update({"broker_transport_options": {"schema": schema},
                     "task_ignore_result": True,
                     "pgjobs_webhook_allow_hosts": ["127.0.0.1"], **conf})
    app.finalize()
    return app


def ledger(db: psycopg.Connection[Any], schema: str, endpoint: int) -> list[dict[str, Any]]:
    cur = db.execute(
        "SELECT *, extract(epoch FROM started_at)::float8 AS started, "
        "extract(epoch FROM finished_at)::float8 AS finished, "
        "extract(epoch FROM next_attempt_at)::float8 AS next_at "
        f'FROM "{schema}".pgjobs_webhook_attempt WHERE endpoint_id = %s ORDER BY id',
        (endpoint,))
    names = [d.name for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def endpoint_row(db: psycopg.Connection[Any], schema: str, endpoint: int) -> dict[str, Any]:
    cur = db.execute(f'SELECT * FROM "{schema}".pgjobs_webhook_endpoint WHERE id = %s',
                     (endpoint,))
    names = [d.name for d in cur.description]
    row = cur.fetchone()
    assert row is not None
    return dict(zip(names, row, strict=True))


def dead_letters(db: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    cur = db.execute(f"SELECT id, reason, error, message::text AS message "
                     f'FROM "{schema}".pgjobs_dead_letter ORDER BY id')
    names = [d.name for d in cur.description]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def event_of(dead: dict[str, Any]) -> str:
    """The event id a dead letter's task carried (its argsrepr)."""
    headers = json.loads(dead["message"])["headers"]
    return str(headers["argsrepr"])


def secret_leaks(db: psycopg.Connection[Any], schema: str, *logs: str,
                 secrets: tuple[str, ...] = (SECRET,)) -> list[str]:
    """Every place outside the endpoint row where a secret appears."""
    found = []
    for table in ("pgjobs_job", "pgjobs_dead_letter", "pgjobs_webhook_attempt"):
        rows = db.execute(f'SELECT t::text FROM "{schema}".{table} AS t').fetchall()
        found += [f"{table}: {r[0][:200]}" for r in rows if any(s in r[0] for s in secrets)]
    found += [f"log: {line}" for text in logs for line in text.splitlines()
              if any(s in line for s in secrets)]
    return found


def explain_unless(predicate: Any, timeout: float, what: str, db: psycopg.Connection[Any],
                   schema: str, worker: Any) -> None:
    """wait_for, failing with the ledger, the live rows and the worker's log tail."""
    try:
        wait_for(predicate, timeout, what=what)
    except AssertionError as exc:
        rows = db.execute(f'SELECT endpoint_id, attempt, status, outcome, error '
                          f'FROM "{schema}".pgjobs_webhook_attempt ORDER BY id').fetchall()
        jobs = db.execute(f'SELECT id, state, run_at, attempts FROM "{schema}".pgjobs_job'
                          ).fetchall()
        raise AssertionError(f"{exc}\nledger: {rows}\njobs: {jobs}\n"
                             f"worker:\n{worker.output()[-6000:]}") from None


# -- signing and verify --------------------------------------------------------------------------
def test_verify_accepts_the_real_signature_and_rejects_the_rest():
    body = b'{"id":"evt_1","type":"order.paid","created":1,"data":{"n":1}}'
    now = 1_700_000_000
    header = webhooks.sign(SECRET, body, "evt_1", now)
    assert header.startswith(f"t={now},v2=") and len(header.split("v2=")[1]) == 64
    base = {"Pgjobs-Event-Id": "evt_1", "Content-Type": "application/json"}
    headers = {"pgjobs-signature": header, **base}
    assert webhooks.verify(headers, body, SECRET, now=now + 10) == \
        webhooks.Verified(event_id="evt_1", timestamp=now)
    assert webhooks.verify(list(headers.items()), body, SECRET, now=now - 299).timestamp == now
    from email.message import Message  # what http.server hands a handler as self.headers

    message = Message()
    message["Pgjobs-Signature"] = header
    message["Pgjobs-Event-Id"] = "evt_1"
    assert webhooks.verify(message, body, SECRET, now=now).event_id == "evt_1"

    def refused(hdrs: Any, data: bytes, secret: Any, **kw: Any) -> str:
        with pytest.raises(WebhookSignatureInvalid) as err:
            webhooks.verify(hdrs, data, secret, **kw)
        assert err.value.code == "PGJ-810"
        return str(err.value)

    assert "matches" in refused(headers, body.replace(b"1}", b"2}"), SECRET, now=now)
    assert "matches" in refused(headers, body, SECRET + "x", now=now)
    assert "matches" in refused({**headers, "Pgjobs-Event-Id": "evt_2"}, body, SECRET, now=now)
    assert "tolerance" in refused(headers, body, SECRET, now=now + 301)
    assert "tolerance" in refused(headers, body, SECRET, now=now - 301), "from the future"
    assert "tolerance" in refused(headers, body, SECRET, now=now + 61, tolerance=60)
    assert "no Pgjobs-Signature" in refused({"Pgjobs-Event-Id": "evt_1"}, body, SECRET,
                                            now=now)
    assert "no Pgjobs-Event-Id" in refused({"Pgjobs-Signature": header}, body, SECRET, now=now)
    assert "malformed" in refused({**headers, "Pgjobs-Event-Id": "evt 1"}, body, SECRET,
                                  now=now)
    assert "malformed" in refused({**base, "Pgjobs-Signature": "t=abc,v2=00"}, body,
                                  SECRET, now=now)
    assert "no v2=" in refused({**base, "Pgjobs-Signature": f"t={now}"}, body, SECRET,
                               now=now)
    # the old scheme alone is refused, even when it is right
    old = f"t={now},v1={webhooks.signing.signature_v1(SECRET, now, body)}"
    assert "v1" in refused({**base, "Pgjobs-Signature": old}, body, SECRET, now=now)
    both = webhooks.sign(SECRET, body, "evt_1", now, v1=True)
    assert ",v1=" in both
    assert webhooks.verify({**base, "Pgjobs-Signature": both}, body, SECRET, now=now)
    # a timestamp moved forward keeps the old signature: refused
    moved = header.replace(f"t={now}", f"t={now + 100}")
    assert "matches" in refused({**base, "Pgjobs-Signature": moved}, body, SECRET,
                                now=now + 100)
    with pytest.raises(TypeError):
        webhooks.verify(headers, body.decode(), SECRET, now=now)  # type: ignore[arg-type]


def test_verify_during_a_secret_rotation():
    body = b"{}"
    old, new = "old-secret-0123456789", "new-secret-0123456789"
    now = 1_700_000_000
    signed_old = webhooks.sign(old, body, "evt_r", now)
    event = {"Pgjobs-Event-Id": "evt_r"}
    assert webhooks.verify({"Pgjobs-Signature": signed_old, **event}, body, [new, old],
                           now=now).event_id == "evt_r"
    both = f"{webhooks.sign(new, body, 'evt_r', now)},v2={signed_old.split('v2=')[1]}"
    assert webhooks.verify({"Pgjobs-Signature": both, **event}, body, [old], now=now)
    assert webhooks.verify({"Pgjobs-Signature": both, **event}, body, new, now=now)
    with pytest.raises(WebhookSignatureInvalid):
        webhooks.verify({"Pgjobs-Signature": signed_old, **event}, body,
                        ["third-secret-0123456"], now=now)


def receiver_snippet(name: str = "verify_pgjobs_webhook", marker: str = "receiver-snippet",
                     namespace: dict[str, Any] | None = None) -> Any:
    """A function docs/webhooks.md offers to copy, as written there."""
    text = (ROOT / "docs" / "webhooks.md").read_text("utf-8")
    block = text.split(f"<!-- {marker} -->", 1)[1].split("```python\n", 1)[1]
    namespace = {} if namespace is None else namespace
    exec(compile(block.split("```", 1)[0], "docs/webhooks.md", "exec"), namespace)
    return namespace[name]


def test_the_docs_receiver_snippet_verifies_like_verify():
    check = receiver_snippet()
    body = b'{"id":"evt_1","data":{}}'
    now = int(time.time())
    headers = {"Pgjobs-Signature": webhooks.sign(SECRET, body, "evt_1", now),
               "Pgjobs-Event-Id": "evt_1"}
    assert check(headers, body, SECRET) == "evt_1"
    assert check({k.lower(): v for k, v in headers.items()}, body,
                 ["other-secret-0000", SECRET]) == "evt_1"
    assert check(headers, body + b" ", SECRET) is None
    assert check(headers, body, "wrong-secret-000000") is None
    assert check({**headers, "Pgjobs-Event-Id": "evt_2"}, body, SECRET) is None
    assert check({"Pgjobs-Signature": webhooks.sign(SECRET, body, "evt_1", now - 301),
                  "Pgjobs-Event-Id": "evt_1"}, body, SECRET) is None
    assert check({}, body, SECRET) is None
    assert check({"Pgjobs-Signature": "t=x,v2=00", "Pgjobs-Event-Id": "evt_1"}, body,
                 SECRET) is None
    old = f"t={now},v1={webhooks.signing.signature_v1(SECRET, now, body)}"
    assert check({"Pgjobs-Signature": old, "Pgjobs-Event-Id": "evt_1"}, body, SECRET) is None


# -- the retry table and the settings -------------------------------------------------------------
def test_status_classification_and_backoff():
    assert [classify_status(s, None) for s in (200, 204, 299)] == ["delivered"] * 3
    assert [classify_status(s, None) for s in (408, 500, 502, 503, 599)] == ["unavailable"] * 5
    assert classify_status(429, None) == "throttled"
    assert classify_status(503, 5.0) == "throttled", "a Retry-After on a retried status"
    assert [classify_status(s, None) for s in (301, 302, 307, 400, 401, 404, 410, 422)] == \
        ["rejected"] * 8
    assert classify_status(410, 5.0) == "rejected", "Retry-After does not make a 4xx retried"
    s = WebhookSettings(backoff=1.0, backoff_max=10.0)
    assert [backoff_delay(s, n, rand=lambda: 1.0) for n in (1, 2, 3, 4, 5, 6)] == \
        [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff_delay(s, 3, rand=lambda: 0.0) == 2.0, "jitter takes at most half off"


def test_settings_are_checked():
    got = webhook_settings({"pgjobs_webhook_allow_hosts": ["Hooks.Internal.", "10.0.0.0/8",
                                                           "::1"],
                            "pgjobs_webhook_backoff": 0.5, "pgjobs_webhook_timeout": 2})
    assert got.allow_names == ("hooks.internal",)
    assert [str(n) for n in got.allow_networks] == ["10.0.0.0/8", "::1/128"]
    assert (got.backoff, got.timeout, got.disable_after) == (0.5, 2.0, 20)
    for bad in ({"pgjobs_webhook_allow_hosts": "127.0.0.1"},
                {"pgjobs_webhook_allow_hosts": ["10.0.0.0/33"]},
                {"pgjobs_webhook_allow_hosts": ["a b"]},
                {"pgjobs_webhook_disable_after": 0}, {"pgjobs_webhook_disable_after": 2.5},
                {"pgjobs_webhook_backoff": float("nan")}, {"pgjobs_webhook_backoff": -1},
                {"pgjobs_webhook_timeout": 0}, {"pgjobs_webhook_timeout": True},
                {"pgjobs_webhook_max_attempts": 0},
                {"pgjobs_webhook_concurrency_per_endpoint": 0},
                {"pgjobs_webhook_concurrency_per_endpoint": "2"},
                {"pgjobs_webhook_backoff": 10, "pgjobs_webhook_backoff_max": 5}):
        with pytest.raises(InvalidWebhookSetting) as err:
            webhook_settings(bad)
        assert err.value.code == "PGJ-803", bad


# -- egress ------------------------------------------------------------------------------------
def test_refused_addresses():
    import ipaddress

    for address in ("127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                    "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fd00:ec2::254",
                    "::ffff:127.0.0.1", "2002:7f00:1::", "168.63.129.16", "100.100.100.200"):
        assert refusal(ipaddress.ip_address(address)) is not None, address
    for address in ("93.184.216.34", "2606:2800:220:1::"):
        assert refusal(ipaddress.ip_address(address)) is None, address


def test_a_local_endpoint_is_refused_at_connect_time_without_the_allow_list(server):
    url = server.script("/ok", Reply(200))
    with guarded_client(WebhookSettings()) as client:
        for target in (url, server.url("/ok", host="localhost")):
            with pytest.raises(EgressRefused) as err:
                client.post(target, content=b"{}")
            assert err.value.code == "PGJ-805" and "loopback" in str(err.value)
    assert server.requests("/ok") == [], "no request reached the server"
    allowed = WebhookSettings(allow_networks=webhook_settings(
        {"pgjobs_webhook_allow_hosts": ["127.0.0.0/8"]}).allow_networks)
    with guarded_client(allowed) as client:
        assert client.post(url, content=b"{}").status_code == 200
    with guarded_client(WebhookSettings(allow_names=("localhost",))) as client:
        assert client.post(server.url("/ok", host="localhost"), content=b"{}").status_code \
            == 200
    assert len(server.requests("/ok")) == 2


def test_the_connection_goes_to_the_address_that_was_checked(server):
    """DNS rebinding: a name that resolves to an allowed address when checked and to another
    one a moment later. The backend resolves once and connects to the checked address."""
    import socket

    calls: list[str] = []

    def rebinding(host: str, port: int, **kw: Any) -> list[tuple[Any, ...]]:
        calls.append(host)
        address = "127.0.0.1" if len(calls) == 1 else "10.255.255.1"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port))]

    url = server.script("/rebind", Reply(200))
    settings = WebhookSettings(allow_networks=webhook_settings(
        {"pgjobs_webhook_allow_hosts": ["127.0.0.1"]}).allow_networks)
    with guarded_client(settings, resolve=rebinding) as client:
        reply = client.post(url.replace("127.0.0.1", "hooks.rebind.test"), content=b"{}")
    assert reply.status_code == 200 and len(server.requests("/rebind")) == 1
    assert calls == ["hooks.rebind.test"], "one lookup: the connect did not resolve again"

    def mixed(host: str, port: int, **kw: Any) -> list[tuple[Any, ...]]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.7", port))]

    with guarded_client(WebhookSettings(), resolve=mixed) as client, \
            pytest.raises(EgressRefused, match=r"10\.0\.0\.7"):
        client.post("http://public-and-private.test/x", content=b"{}")


def test_redirects_are_not_followed_by_the_client(server):
    target = server.script("/elsewhere", Reply(200))
    url = server.script("/moved", Reply(302, {"Location": target}))
    settings = WebhookSettings(allow_networks=webhook_settings(
        {"pgjobs_webhook_allow_hosts": ["127.0.0.1"]}).allow_networks)
    with guarded_client(settings) as client:
        assert client.post(url, content=b"{}").status_code == 302
    assert server.requests("/elsewhere") == []


# -- the Python API ----------------------------------------------------------------------------
def test_add_endpoint_and_send_check_their_input(db, schema, url):
    app = sender(schema, url)
    plain = Celery("plain", broker=url, set_as_current=False)
    plain.conf.update(broker_transport_options={"schema": schema})
    for bad_url in ("ftp://x.test/", "https://", "https://user:pw@x.test/", "x.test/hook",
                    "https://x.test/ hook", "https://x.test/#frag", 42):
        with pytest.raises(InvalidWebhookEndpoint) as err:
            webhooks.add_endpoint(bad_url, secret=SECRET, app=app)  # type: ignore[arg-type]
        assert err.value.code == "PGJ-801", bad_url
    for bad_secret in ("short", "x" * 1001, SECRET + "\n", None):
        with pytest.raises(InvalidWebhookEndpoint) as err:
            webhooks.add_endpoint("https://x.test/", secret=bad_secret, app=app)  # type: ignore
        assert SECRET not in str(err.value), "the error never repeats the secret"
    with pytest.raises(InvalidWebhookEndpoint):
        webhooks.add_endpoint("https://x.test/", secret=SECRET, disable_after=0, app=app)
    strict = sender(schema, url, pgjobs_webhook_allow_hosts=[])
    with pytest.raises(EgressRefused):
        webhooks.add_endpoint("http://169.254.169.254/latest", secret=SECRET, app=strict)
    count = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_webhook_endpoint').fetchone()
    assert count == (0,), "nothing was written"

    ep = webhooks.add_endpoint("https://x.test/hook", secret=SECRET, app=app)
    for kind, payload, event in (("", {}, None), ("t\x00", {}, None), ("ok", {}, ""),
                                 ("ok", {"n": float("nan")}, None), ("ok", {1j}, None)):
        with pytest.raises(InvalidWebhookEvent) as err:
            webhooks.send(ep, kind, payload, event, app=app)
        assert err.value.code == "PGJ-804"
    with pytest.raises(WebhookEndpointNotFound):
        webhooks.send(ep + 1, "ok", {}, app=app)
    with pytest.raises(InvalidWebhookSetting, match=r"celery_ext\.install"):
        webhooks.send(ep, "ok", {}, app=plain)
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone() == (0,)
    sent = webhooks.send(ep, "order.paid", {"order": 1}, "evt_fixed", app=app)
    assert sent.event_id == "evt_fixed"
    row = db.execute(f'SELECT task, message::text FROM "{schema}".pgjobs_job').fetchone()
    assert row[0] == webhooks.DELIVER_TASK and "evt_fixed" in row[1] and SECRET not in row[1]
    assert webhooks.disable(ep, app=app)["enabled"] is False
    assert endpoint_row(db, schema, ep)["disabled_reason"] == "operator"
    assert webhooks.enable(ep, app=app)["enabled"] is True
    with pytest.raises(WebhookEndpointNotFound):
        webhooks.enable(ep + 1, app=app)


# -- deliveries on a real worker -------------------------------------------------------------------
@pytest.mark.e2e
def test_deliveries_retries_and_the_ledger(db, schema, url, server, start_worker):
    app = sender(schema, url)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    skewed = now - timedelta(hours=1)   # the server's clock is an hour behind
    script = {
        "/ok": [Reply(200, body=b'{"received":true}')],
        "/flaky": [Reply(500, body=b"boom"), Reply(200)],
        "/throttled": [Reply(429, {"Retry-After": "2"}), Reply(200)],
        "/dated": [Reply(429, {"Date": format_datetime(skewed, usegmt=True),
                               "Retry-After": format_datetime(skewed + timedelta(seconds=2),
                                                              usegmt=True)}), Reply(200)],
        "/gone": [Reply(410, body=b"endpoint deleted")],
        "/moved": [Reply(302, {"Location": server.url("/elsewhere")})],
        "/hang": [Reply(200, delay=3.0)],
        "/elsewhere": [Reply(200)],
    }
    ids = {path: webhooks.add_endpoint(server.script(path, *replies), secret=SECRET, app=app)
           for path, replies in script.items() if path != "/elsewhere"}
    sent = {path: webhooks.send(ep, "order.paid", {"path": path, "n": 1}, f"evt{path}",
                                app=app) for path, ep in ids.items()}
    worker = start_worker(app=APP, name="hooks", concurrency=8,
                          env={"PGJOBS_TEST_WEBHOOK_TIMEOUT": "0.5",
                               "PGJOBS_TEST_WEBHOOK_ATTEMPTS": "3"})

    def done() -> bool:
        jobs = db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0]
        return jobs == 0 and len(dead_letters(db, schema)) == 3
    explain_unless(done, 60, "every delivery settled", db, schema, worker)

    # 200: one signed POST, verified with the secret; delivered in the ledger
    (ok,) = server.requests("/ok")
    assert webhooks.verify(ok.headers, ok.body, SECRET).event_id == "evt/ok"
    assert receiver_snippet()(ok.headers, ok.body, SECRET) == "evt/ok"
    assert ok.headers["Pgjobs-Event-Id"] == "evt/ok" == sent["/ok"].event_id
    assert ok.headers["Pgjobs-Event-Type"] == "order.paid"
    assert ok.headers["Pgjobs-Delivery-Attempt"] == "1"
    assert json.loads(ok.body) == {"id": "evt/ok", "type": "order.paid",
                                   "created": json.loads(ok.body)["created"],
                                   "data": {"path": "/ok", "n": 1}}
    (row,) = ledger(db, schema, ids["/ok"])
    assert (row["outcome"], row["status"], row["attempt"]) == ("delivered", 200, 1)
    assert row["response_excerpt"] == '{"received":true}' and row["latency_ms"] > 0
    assert row["task_id"] == sent["/ok"].task_id

    # 500 then 200: retried, the same body both times, a fresh signature each time
    flaky = server.requests("/flaky")
    assert len(flaky) == 2 and flaky[0].body == flaky[1].body
    assert [r.headers["Pgjobs-Delivery-Attempt"] for r in flaky] == ["1", "2"]
    assert all(webhooks.verify(r.headers, r.body, SECRET) for r in flaky)
    rows = ledger(db, schema, ids["/flaky"])
    assert [(r["outcome"], r["status"]) for r in rows] == [("retrying", 500), ("delivered", 200)]
    assert rows[0]["response_excerpt"] == "boom" and rows[0]["next_at"] is not None
    assert endpoint_row(db, schema, ids["/flaky"])["consecutive_failures"] == 0

    # 429 with Retry-After: 2, and an HTTP-date against the server's own (skewed) Date: the
    # next attempt started at least 2 s after the response
    for path in ("/throttled", "/dated"):
        rows = ledger(db, schema, ids[path])
        assert [(r["outcome"], r["status"]) for r in rows] == \
            [("retrying", 429), ("delivered", 200)], path
        assert rows[0]["retry_after"] == 2.0, (path, rows[0]["retry_after"])
        assert rows[0]["next_at"] - rows[0]["finished"] >= 2.0, path
        assert rows[1]["started"] - rows[0]["finished"] >= 2.0, (path, rows)
        assert rows[1]["started"] - rows[0]["finished"] < 20.0, path

    dead = {event_of(d): d for d in dead_letters(db, schema)}
    assert len(dead) == 3

    # 410: terminal, one attempt, dead-lettered with the response
    assert len(server.requests("/gone")) == 1
    (row,) = ledger(db, schema, ids["/gone"])
    assert (row["outcome"], row["status"]) == ("failed", 410)
    gone = next(d for e, d in dead.items() if "evt/gone" in e)
    assert gone["reason"] == "failed" and gone["error"]["rule"] == "terminal"
    assert gone["error"]["type"] == "kombu_pgjobs.errors.WebhookRejected"
    assert "410" in gone["error"]["message"] and "endpoint deleted" in gone["error"]["message"]
    assert endpoint_row(db, schema, ids["/gone"])["consecutive_failures"] == 1

    # 302: not followed, a failure with Location recorded
    assert len(server.requests("/moved")) == 1 and server.requests("/elsewhere") == []
    (row,) = ledger(db, schema, ids["/moved"])
    assert (row["outcome"], row["status"]) == ("failed", 302)
    assert row["location"] == server.url("/elsewhere")
    moved = next(d for e, d in dead.items() if "evt/moved" in e)
    assert "not followed" in moved["error"]["message"]

    # a server that never answers in time: three timed-out attempts, then a dead letter
    rows = ledger(db, schema, ids["/hang"])
    assert [r["outcome"] for r in rows] == ["retrying", "retrying", "failed"]
    assert all(r["status"] is None and "no answer within 0.5 s" in r["error"] for r in rows)
    assert all(400 <= r["latency_ms"] < 2900 for r in rows), [r["latency_ms"] for r in rows]
    hang = next(d for e, d in dead.items() if "evt/hang" in e)
    assert hang["error"]["rule"] == "retryable"
    assert hang["error"]["type"] == "kombu_pgjobs.errors.WebhookUnavailable"

    assert secret_leaks(db, schema, worker.output()) == []
    assert "celery_ext.webhook.delivered" in worker.output()
    # the same grep finds the secret where it is meant to be: the endpoint rows
    rows = db.execute(f'SELECT t::text FROM "{schema}".pgjobs_webhook_endpoint AS t').fetchall()
    assert all(SECRET in r[0] for r in rows) and len(rows) == len(ids)


@pytest.mark.e2e
def test_an_endpoint_is_disabled_after_n_failed_deliveries(db, schema, url, server,
                                                           start_worker):
    app = sender(schema, url)
    ep = webhooks.add_endpoint(server.script("/down", Reply(410)), secret=SECRET,
                               disable_after=2, app=app)
    worker = start_worker(app=APP, name="down", concurrency=2)
    for n in (1, 2):
        webhooks.send(ep, "ping", {"n": n}, f"evt_{n}", app=app)
        wait_for(lambda n=n: len(dead_letters(db, schema)) == n, 30, what=f"dead letter {n}")
    row = endpoint_row(db, schema, ep)
    assert (row["enabled"], row["consecutive_failures"], row["disabled_reason"]) == \
        (False, 2, "failures")
    assert row["disabled_at"] is not None

    # disabled: the next delivery opens no socket and ends as a dead letter endpoint_disabled
    third = webhooks.send(ep, "ping", {"n": 3}, "evt_3", app=app)
    wait_for(lambda: len(dead_letters(db, schema)) == 3, 30, what="the third dead letter")
    last = dead_letters(db, schema)[-1]
    assert last["reason"] == "endpoint_disabled" and "evt_3" in last["message"]
    assert last["error"]["type"] == "kombu_pgjobs.errors.WebhookEndpointDisabled"
    assert len(server.requests("/down")) == 2, "no POST reached the server"
    assert [r["event_id"] for r in ledger(db, schema, ep)] == ["evt_1", "evt_2"]

    # only an operator turns it back on; the dead letter can then be sent again
    server.script("/down", Reply(200))
    assert webhooks.enable(ep, app=app)["enabled"] is True
    assert endpoint_row(db, schema, ep)["consecutive_failures"] == 0
    from kombu_pgjobs.store.admin import Admin

    # a rotation on the way: the requeued delivery is signed with the new secret
    rotated = SECRET[::-1]
    assert webhooks.rotate_secret(ep, secret=rotated, app=app)["secret"] == "********"
    Admin(db, schema).dead_requeue([last["id"]])
    wait_for(lambda: len(server.requests("/down")) == 3, 30, what="the requeued delivery")
    wait_for(lambda: ledger(db, schema, ep)[-1]["outcome"] == "delivered", 30,
             what="delivered")
    resent = server.requests("/down")[-1]
    assert resent.headers["Pgjobs-Event-Id"] == "evt_3" == third.event_id
    assert webhooks.verify(resent.headers, resent.body, [SECRET, rotated]).timestamp > 0
    with pytest.raises(WebhookSignatureInvalid):
        webhooks.verify(resent.headers, resent.body, SECRET)
    assert secret_leaks(db, schema, worker.output(), secrets=(SECRET, rotated)) == []


@pytest.mark.e2e
def test_the_worker_refuses_a_local_endpoint_without_the_allow_list(db, schema, url, server,
                                                                    start_worker):
    app = sender(schema, url)
    ep = webhooks.add_endpoint(server.script("/local", Reply(200)).replace(
        "127.0.0.1", "localhost"), secret=SECRET, app=app)
    webhooks.send(ep, "ping", {}, "evt_local", app=app)
    worker = start_worker(app=APP, name="strict", concurrency=1,
                          env={"PGJOBS_TEST_WEBHOOK_ALLOW": ""})
    wait_for(lambda: dead_letters(db, schema), 30, what="the refused delivery")
    (dead,) = dead_letters(db, schema)
    assert dead["error"]["type"] == "kombu_pgjobs.errors.EgressRefused"
    assert dead["error"]["rule"] == "terminal" and "loopback" in dead["error"]["message"]
    (row,) = ledger(db, schema, ep)
    assert row["outcome"] == "failed" and row["status"] is None and "PGJ-805" in row["error"]
    assert server.requests("/local") == []
    assert secret_leaks(db, schema, worker.output()) == []



@pytest.mark.e2e
def test_an_attempt_the_worker_abandoned_counts_toward_nothing(db, schema, url, server,
                                                               start_worker):
    """A worker killed while its POST waits for the answer writes no ledger row; the message
    comes back when its lease lapses and the next worker delivers it as attempt 1."""
    app = sender(schema, url)
    ep = webhooks.add_endpoint(server.script("/slow", Reply(200, delay=30.0)), secret=SECRET,
                               disable_after=1, app=app)
    webhooks.send(ep, "ping", {}, "evt_abandoned", app=app)
    env = {"PGJOBS_TEST_LEASE_TTL": "2", "PGJOBS_TEST_WEBHOOK_TIMEOUT": "60"}
    first = start_worker(app=APP, name="doomed", concurrency=1, env=env)
    wait_for(lambda: server.requests("/slow"), 30, what="the first POST")
    first.kill()
    assert ledger(db, schema, ep) == [], "nothing recorded for the abandoned attempt"
    server.script("/slow", Reply(200))
    start_worker(app=APP, name="heir", concurrency=1, env=env)
    wait_for(lambda: ledger(db, schema, ep), 30, what="the delivery after the lease lapsed")
    (row,) = ledger(db, schema, ep)
    assert (row["outcome"], row["attempt"], row["event_id"]) == ("delivered", 1, "evt_abandoned")
    posts = server.requests("/slow")
    assert len(posts) == 2 and posts[0].body == posts[1].body
    row = endpoint_row(db, schema, ep)
    assert (row["enabled"], row["consecutive_failures"]) == (True, 0)


@pytest.mark.e2e
def test_concurrency_per_endpoint(db, schema, url, server, start_worker):
    """pgjobs_webhook_concurrency_per_endpoint = 1: a slow endpoint gets one delivery at a
    time from a worker with four threads; an endpoint sent without the setting gets several."""
    capped = sender(schema, url, pgjobs_webhook_concurrency_per_endpoint=1)
    free = sender(schema, url)
    slow = webhooks.add_endpoint(server.script("/one", Reply(200, delay=0.5)), secret=SECRET,
                                 app=capped)
    other = webhooks.add_endpoint(server.script("/many", Reply(200, delay=0.5)),
                                  secret=SECRET, app=free)
    for n in range(4):
        webhooks.send(slow, "ping", {"n": n}, app=capped)
        webhooks.send(other, "ping", {"n": n}, app=free)
    limits = db.execute(f'SELECT DISTINCT limits::text FROM "{schema}".pgjobs_job '
                        "WHERE limits IS NOT NULL").fetchall()
    assert len(limits) == 1 and f'"webhook:{slow}"' in limits[0][0]
    worker = start_worker(app=APP, name="capped", concurrency=4)
    explain_unless(lambda: len([r for e in (slow, other) for r in ledger(db, schema, e)
                                if r["outcome"] == "delivered"]) == 8, 60, "eight deliveries",
                   db, schema, worker)
    assert server.most_in_flight["/one"] == 1
    assert server.most_in_flight["/many"] >= 2, "without the cap the worker overlaps them"


def test_send_with_no_app_uses_the_current_app(db, schema, url):
    """``app=None``, the documented default: Celery's current app (it was its proxy, never
    the installed app: PGJ-803 every time)."""
    app = sender(schema, url)
    ep = webhooks.add_endpoint("https://x.test/hook", secret=SECRET, app=app)
    before = current_app._get_current_object()
    app.set_current()
    try:
        sent = webhooks.send(ep, "order.paid", {"order": 2}, "evt_current")
        assert sent.event_id == "evt_current"
        assert webhooks.disable(ep)["enabled"] is False
    finally:
        before.set_current()  # the next test's current app is what it was
    row = db.execute(f'SELECT message::text FROM "{schema}".pgjobs_job').fetchone()
    assert "evt_current" in row[0]
