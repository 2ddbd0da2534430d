"""Shard map: queues spread over two databases (the test database and pgjobs_test_shard2).

Each test runs in its own schema, on both databases. Counts are read back from the databases:
the jobs left on each, and the executions the tasks recorded.

The "shard down" tests (issue 29, item 3) put the shard on a private server (tests/pgserver.py)
that they really stop and start again: nothing else shares it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import kombu
import kombu.exceptions
import psycopg
import pytest

from kombu_pgjobs.errors import (
    DatabaseUnavailable,
    InvalidShardMap,
    InvalidShardPattern,
    InvalidShardURL,
    ShardUnavailable,
)
from kombu_pgjobs.ops.cli import main as cli
from kombu_pgjobs.shardmap import parse, shard_label

from .conftest import DSN, SECOND_DATABASE, wait_for
from .pgserver import PrivateServer, require_bindir

SECOND_DSN = psycopg.conninfo.make_conninfo(DSN, dbname=SECOND_DATABASE)


def jobs(dsn: str, schema: str) -> list[tuple[str, str, int]]:
    """(queue, state, claim) of every row of a database's job table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            f'SELECT queue, state::text, claim FROM "{schema}".pgjobs_job ORDER BY id')]


def connection(url: str, schema: str, shards: Any, **options: Any) -> kombu.Connection:
    return kombu.Connection(url, transport_options={"schema": schema, "shards": shards,
                                                    **options})


def drain(conn: kombu.Connection, queues: list[str], n: int, *,
          ack: bool = True) -> list[Any]:
    got: list[Any] = []
    consumer = conn.Consumer([kombu.Queue(q, kombu.Exchange(q), routing_key=q)
                              for q in queues],
                             callbacks=[lambda body, m: got.append(m)])
    with consumer:
        deadline = time.monotonic() + 10
        while len(got) < n and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=1)
            except TimeoutError:
                pass
        if ack:
            for m in got:
                m.ack()
    return got


def publish(conn: kombu.Connection, queue: str, body: Any, **kwargs: Any) -> None:
    q = kombu.Queue(queue, kombu.Exchange(queue), routing_key=queue)
    with conn.Producer() as producer:
        producer.publish(body, exchange=q.exchange, routing_key=queue, declare=[q], **kwargs)


# -- the map itself ---------------------------------------------------------------------------
def test_resolution_order() -> None:
    m = parse(json.dumps({"billing": "pgjobs://a@h/db2", "bill*": "pgjobs://a@h/db3",
                          "b*": "pgjobs://a@h/db4", "*": "pgjobs://a@h/db1"}))
    assert m is not None
    assert m.urls == ("pgjobs://a@h/db2", "pgjobs://a@h/db3", "pgjobs://a@h/db4",
                      "pgjobs://a@h/db1")
    assert m.shard_of("billing") == 1        # exact name first
    assert m.shard_of("billing2") == 2       # then the most specific glob
    assert m.shard_of("bx") == 3
    assert m.shard_of("other") == 4          # then "*"
    assert m.shard_of("w1@host.celery.pidbox") == 0  # remote control: always the default
    assert m.shard_of("celeryev.1234") == 0
    assert parse({"billing": "pgjobs://a@h/db2"}).shard_of("other") == 0  # type: ignore[union-attr]
    assert parse({}) is None and parse(None) is None


@pytest.mark.parametrize(("shards", "error"), [
    ("{not json", InvalidShardMap),
    ([["billing", "pgjobs://a@h/db"]], InvalidShardMap),
    ({"bill[ing]": "pgjobs://postgres@127.0.0.1/x"}, InvalidShardPattern),
    ({"": "pgjobs://postgres@127.0.0.1/x"}, InvalidShardPattern),
    ({"celeryev.*": "pgjobs://postgres@127.0.0.1/x"}, InvalidShardPattern),
    ({"*.pidbox": "pgjobs://postgres@127.0.0.1/x"}, InvalidShardPattern),
    ({"billing": "mysql://postgres@127.0.0.1/x"}, InvalidShardURL),
    ({"billing": "pgjobs:///x"}, InvalidShardURL),
    ({"billing": "pgjobs://postgres@127.0.0.1"}, InvalidShardURL),
    ({"billing": "pgjobs://postgres@127.0.0.1:99999/x"}, InvalidShardURL),
    ({"billing": 5432}, InvalidShardURL),
])
def test_bad_map_is_a_coded_error_at_connect(url: str, schema: str, shards: Any,
                                             error: type[Exception]) -> None:
    conn = connection(url, schema, shards)
    with pytest.raises(error) as caught:
        conn.connect()
    assert caught.value.code == error.code  # type: ignore[attr-defined]
    assert str(caught.value).startswith(f"[{error.code}]")  # type: ignore[attr-defined]


# -- kombu ------------------------------------------------------------------------------------
def test_routing_and_settles_go_to_each_database(url: str, schema: str,
                                                 second_database: str) -> None:
    shards = {"billing": second_database}
    with connection(url, schema, shards) as conn:
        publish(conn, "billing", {"n": 1})
        publish(conn, "other", {"n": 2})
        publish(conn, "w1@host.celery.pidbox", {"n": 3})
        assert [r[0] for r in jobs(SECOND_DSN, schema)] == ["billing"]
        assert sorted(r[0] for r in jobs(DSN, schema)) == ["other", "w1@host.celery.pidbox"]

        got = drain(conn, ["billing", "other"], 2, ack=False)
        tags = {m.payload["n"]: m.delivery_tag for m in got}
        assert set(tags) == {1, 2}
        assert tags[1].count(".") == 2 and tags[2].count(".") == 1  # id.claim.N vs id.claim
        assert jobs(SECOND_DSN, schema) == [("billing", "running", 1)]
        by_n = {m.payload["n"]: m for m in got}
        by_n[1].requeue()  # fenced requeue on the second database
        by_n[2].ack()
        wait_for(lambda: ("other", "running", 1) not in jobs(DSN, schema), 5, what="ack")
        assert jobs(SECOND_DSN, schema) == [("billing", "ready", 1)]

        again = drain(conn, ["billing"], 1)
        assert [m.payload for m in again] == [{"n": 1}]
        assert again[0].delivery_info.get("redelivered") is True
        wait_for(lambda: not jobs(SECOND_DSN, schema), 5, what="the ack on the second db")
        assert [r[0] for r in jobs(DSN, schema)] == ["w1@host.celery.pidbox"]  # untouched


def test_fanout_across_databases(url: str, schema: str, second_database: str) -> None:
    """A fanout exchange bound to queues on both databases: one copy per queue, each on
    its own database (per-queue publishes: not atomic across databases)."""
    with connection(url, schema, {"billing": second_database}) as conn:
        ex = kombu.Exchange("news", type="fanout")
        queues = [kombu.Queue(q, ex) for q in ("billing", "other")]
        with conn.Producer() as producer:
            producer.publish({"x": 1}, exchange=ex, declare=queues)
        assert [r[0] for r in jobs(SECOND_DSN, schema)] == ["billing"]
        assert [r[0] for r in jobs(DSN, schema)] == ["other"]


# -- real workers -----------------------------------------------------------------------------
def _shard_env(second_database: str, **extra: str) -> dict[str, str]:
    return {"PGJOBS_TEST_SHARDS": json.dumps({"billing": second_database}), **extra}


def _runs(schema: str) -> list[str]:
    with psycopg.connect(DSN, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            f'SELECT label FROM "{schema}".pgjobs_test_run ORDER BY label')]


def _starts(schema: str) -> int:
    with psycopg.connect(DSN, autocommit=True) as conn:
        row = conn.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_start').fetchone()
        return int(row[0]) if row else 0


@pytest.mark.parametrize(("pool", "event_loop"), [
    ("threads", "1"), ("prefork", "1"), ("threads", "0")])
def test_worker_on_two_databases_runs_each_task_once(
        url: str, recorder_tables: str, second_database: str, start_worker: Any,
        pool: str, event_loop: str) -> None:
    """In Celery's event loop (each database's consumer loop registers its own readers and
    timers with the Hub), and in its synchronous loop (``drain_events`` waits on every
    database's descriptors at once)."""
    from tests.conftest import import_app

    schema = recorder_tables
    env = _shard_env(second_database, PGJOBS_TEST_EVENT_LOOP=event_loop)
    app = import_app("tests.apps.sharded", schema, url, **env)
    start_worker(app="tests.apps.sharded", env=env, pool=pool, concurrency=2,
                 extra=["-Q", "billing,other"])
    app.record.apply_async(("other-w",), queue="other")
    wait_for(lambda: _runs(schema) == ["other-w"], 10, what="the first task")
    time.sleep(0.5)  # both databases' loops idle: woken by a publish, or by nothing
    labels = [f"{q}-{i}" for q in ("billing", "other") for i in range(15)]
    for label in labels:
        app.record.apply_async((label,), queue=label.split("-")[0])
    labels.append("other-w")
    wait_for(lambda: len(_runs(schema)) >= len(labels), 10, what="every task to run")
    time.sleep(0.3)  # a duplicate, if any, would land now
    assert _runs(schema) == sorted(labels)  # each exactly once
    wait_for(lambda: not jobs(SECOND_DSN, schema) and not [
        r for r in jobs(DSN, schema) if r[0] in ("billing", "other")], 5,
        what="every row acked on its database")


def test_sigkilled_worker_messages_come_back_on_both_databases(
        url: str, recorder_tables: str, second_database: str, start_worker: Any) -> None:
    from tests.conftest import import_app

    schema = recorder_tables
    lease = 2.0
    env = _shard_env(second_database, PGJOBS_TEST_LEASE_TTL=str(lease))
    app = import_app("tests.apps.sharded", schema, url, **env)
    w1 = start_worker(name="w1", app="tests.apps.sharded", env=env,
                      extra=["-Q", "billing,other"])
    labels = ["billing-0", "billing-1", "other-0", "other-1"]
    for label in labels:
        app.record.apply_async((label, 60.0), queue=label.split("-")[0])
    wait_for(lambda: _starts(schema) >= 4, 15, what="w1 to start all four")
    assert {r[1] for r in jobs(SECOND_DSN, schema)} == {"running"}
    assert {r[1] for r in jobs(DSN, schema) if r[0] != "celery"} == {"running"}
    w2 = start_worker(name="w2", app="tests.apps.sharded", env=env,
                      extra=["-Q", "billing,other"])
    w1.kill()
    killed = time.monotonic()
    wait_for(lambda: len(_runs(schema)) >= 4, lease + 8, what="w2 to finish w1's tasks")
    took = time.monotonic() - killed
    assert _runs(schema) == sorted(labels)
    assert _starts(schema) == 8  # each started by w1, then again by w2
    # back within one lease (plus the keeper's tick and a claim), on both databases
    assert took < lease + lease / 3 + 4.0, took
    wait_for(lambda: not jobs(SECOND_DSN, schema), 5, what="the second db drained")
    assert w2.proc.poll() is None


def _dead(dsn: str, schema: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            f'SELECT queue, reason FROM "{schema}".pgjobs_dead_letter ORDER BY queue')]


def test_celery_ext_dead_letters_and_remote_control(
        url: str, recorder_tables: str, second_database: str, start_worker: Any) -> None:
    """celery_ext records a failed task's dead letter on the database its message came from;
    remote control works and ``inspect scheduled`` reads every database."""
    from tests.conftest import import_app

    schema = recorder_tables
    env = _shard_env(second_database, PGJOBS_TEST_CELERY_EXT="1")
    app = import_app("tests.apps.sharded", schema, url, **env)
    start_worker(app="tests.apps.sharded", env=env, extra=["-Q", "billing,other"])
    app.fail.apply_async(("b",), queue="billing")
    app.fail.apply_async(("o",), queue="other")
    wait_for(lambda: _dead(SECOND_DSN, schema) and _dead(DSN, schema), 15,
             what="a dead letter on each database")
    assert _dead(SECOND_DSN, schema) == [("billing", "failed")]
    assert _dead(DSN, schema) == [("other", "failed")]

    # remote control stays on the default database and works; `inspect scheduled` lists
    # the ETA messages of both databases
    later = {q: app.record.apply_async((f"later-{q}",), queue=q, countdown=600)
             for q in ("billing", "other")}
    assert {r[0] for r in jobs(SECOND_DSN, schema)} == {"billing"}
    replies = app.app.control.inspect(timeout=10.0, limit=1).scheduled()
    assert replies, "the worker answered over the default database's pidbox"
    (entries,) = replies.values()
    assert {e["request"]["id"] for e in entries} == {r.id for r in later.values()}


# -- CLI --------------------------------------------------------------------------------------
def test_cli_shows_every_shard(url: str, schema: str, second_database: str,
                               capsys: Any, tmp_path: Any, monkeypatch: Any) -> None:
    shards = json.dumps({"billing": second_database})
    with connection(url, schema, {"billing": second_database}) as conn:
        publish(conn, "billing", {"n": 1})
        publish(conn, "other", {"n": 2})
    label = f"127.0.0.1:5432/{SECOND_DATABASE}"

    assert cli.main(["queues", "--dsn", url, "--schema", schema, "--shards", shards,
                     "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["queues"]
    assert {(r["shard"], r["queue"], r["ready"]) for r in rows} >= {
        (label, "billing", 1), ("default", "other", 1)}

    (tmp_path / "shards.json").write_text(shards)
    monkeypatch.setenv("PGJOBS_SHARDS", f"@{tmp_path / 'shards.json'}")
    assert cli.main(["queues", "--dsn", url, "--schema", schema]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].startswith("SHARD")
    assert any(line.startswith(label) and "billing" in line for line in text.splitlines())

    assert cli.main(["metrics", "--dsn", url, "--schema", schema]) == 0
    metrics = capsys.readouterr().out
    assert f'pgjobs_messages{{shard="{label}",queue="billing",state="ready"}} 1' in metrics
    assert 'pgjobs_up{shard="default"} 1' in metrics

    for command in (["migrate"], ["workers"], ["limits"]):
        assert cli.main([*command, "--dsn", url, "--schema", schema, "--json"]) == 0
        assert capsys.readouterr().out
    assert cli.main(["migrate", "--dsn", url, "--schema", schema]) == 0
    assert f"{label}: schema {schema}: up to date" in capsys.readouterr().out

    monkeypatch.setenv("PGJOBS_SHARDS", '{"bill[": "pgjobs://postgres@127.0.0.1/x"}')
    assert cli.main(["queues", "--dsn", url, "--schema", schema]) == 2
    assert "PGJ-231" in capsys.readouterr().err


def test_idle_consumer_wakes_for_a_publish_on_either_database(
        url: str, schema: str, second_database: str) -> None:
    """``drain_events`` waits on every database's LISTEN socket: a publish on the second
    database wakes an idle consumer at once, not at its next safety poll."""
    import threading

    with connection(url, schema, {"billing": second_database}) as conn, \
            connection(url, schema, {"billing": second_database}) as publisher:
        got: list[Any] = []
        queues = [kombu.Queue(q, kombu.Exchange(q), routing_key=q) for q in ("billing", "other")]
        with conn.Consumer(queues, callbacks=[lambda body, m: (got.append(body), m.ack())]):
            for _ in range(3):  # both databases' loops register and go idle
                try:
                    conn.drain_events(timeout=0.3)
                except TimeoutError:
                    pass
            for queue in ("billing", "other"):
                timer = threading.Timer(0.2, publish, (publisher, queue, {"q": queue}))
                timer.start()
                started = time.monotonic()
                conn.drain_events(timeout=10)
                took = time.monotonic() - started
                timer.join()
                assert got[-1] == {"q": queue}
                assert took < 1.5, (queue, took)


def test_queue_delete_removes_its_bindings_from_the_default_database(
        url: str, schema: str, second_database: str) -> None:
    with connection(url, schema, {"billing": second_database}) as conn:
        publish(conn, "billing", {"n": 1})
        with psycopg.connect(DSN, autocommit=True) as db:
            def bound() -> list[str]:
                return [r[0] for r in db.execute(
                    f'SELECT queue FROM "{schema}".pgjobs_binding ORDER BY queue')]
            assert bound() == ["billing"]  # bindings live on the default database
            channel = conn.default_channel
            assert channel.queue_declare("billing", passive=True).message_count == 1
            channel.queue_delete("billing")
            assert bound() == []
        assert jobs(SECOND_DSN, schema) == []


def test_a_shards_claim_connection_reconnects_on_its_own(
        url: str, schema: str, second_database: str) -> None:
    """A terminated claim connection on the second database is that loop's ``broken``
    transition: it reconnects by itself; the default database's loop is untouched."""
    with connection(url, schema, {"billing": second_database}) as conn:
        publish(conn, "billing", {"n": 1})
        publish(conn, "other", {"n": 2})
        assert len(drain(conn, ["billing", "other"], 2)) == 2
        loops = conn.transport.consumer.loops
        default_conn, shard_conn = loops[0].conn, loops[1].conn
        assert shard_conn is not None and default_conn is not None
        with psycopg.connect(SECOND_DSN, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (shard_conn.info.backend_pid,))
        publish(conn, "billing", {"n": 3})
        got = drain(conn, ["billing", "other"], 1)
        assert [m.payload for m in got] == [{"n": 3}]
        assert loops[1].conn is not shard_conn  # a new claim connection
        assert loops[0].conn is default_conn
        wait_for(lambda: not jobs(SECOND_DSN, schema), 5, what="the ack on the second db")


def test_metrics_server_reports_a_database_it_cannot_read(url: str, schema: str,
                                                          second_database: str) -> None:
    from kombu_pgjobs.ops.metrics import MetricsSource, ShardedMetrics

    with connection(url, schema, {"billing": second_database}) as conn:
        publish(conn, "billing", {"n": 1})
    source = ShardedMetrics([
        ("db2", MetricsSource(SECOND_DSN, schema)),
        ("gone", MetricsSource(psycopg.conninfo.make_conninfo(
            DSN, dbname="pgjobs_test_shard_absent", connect_timeout=2), schema))])
    try:
        text = source.text()
    finally:
        source.close()
    assert 'pgjobs_up{shard="db2"} 1' in text
    assert 'pgjobs_up{shard="gone"} 0' in text
    assert 'pgjobs_messages{shard="db2",queue="billing",state="ready"} 1' in text


# -- a shard that is down (issue 29, item 3) ---------------------------------------------------
@pytest.fixture
def shard_server() -> Iterator[PrivateServer]:
    """The shard's own server, which the test stops and starts again (tests/pgserver.py: it
    FAILS under CI=true when the server binaries are missing). Ask for it before ``schema``
    so the server outlives the test's connections."""
    server = PrivateServer(require_bindir())
    try:
        yield server
    finally:
        server.stop()


def _queue_args(dsn: str, schema: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {r[0]: r[1] for r in conn.execute(
            f'SELECT name, message_ttl_ms FROM "{schema}".pgjobs_queue')}


def test_a_stopped_shard_fails_only_its_own_queues(shard_server: PrivateServer, url: str,
                                                   schema: str) -> None:
    """The shard's server is stopped: the default database's publishes, claims and acks go
    on, on the open connection and on new ones; the shard's publish raises PGJ-113 (kombu's
    retry included) and writes nothing; a queue declared meanwhile is declared when it is
    back; the ack of a message held across the outage lands; the shard's consumer loop
    reconnects by itself. Every row is counted on both databases."""
    shards = {"billing*": shard_server.url}
    label = shard_label(shard_server.url)
    with connection(url, schema, shards) as conn:
        publish(conn, "billing", {"n": "b0"})
        publish(conn, "other", {"n": "o0"})
        held = drain(conn, ["billing", "other"], 2, ack=False)  # one held from each database
        assert sorted(m.payload["n"] for m in held) == ["b0", "o0"]

        shard_server.halt()

        publish(conn, "other", {"n": "o1"})  # the open connection's default database
        with connection(url, schema, shards) as fresh:
            fresh.connect()  # opens the default database only: a down shard is no error
            publish(fresh, "other", {"n": "o2"})
            started = time.monotonic()
            with pytest.raises(ShardUnavailable) as caught:
                publish(fresh, "billing", {"n": "refused-1"})
            assert caught.value.code == "PGJ-113" and caught.value.shard == label
            assert isinstance(caught.value, DatabaseUnavailable)  # a kombu connection error
            assert str(caught.value).startswith("[PGJ-113] shard " + label)
            # kombu's publish retry (Celery's retry_policy): each retry reconnects, which
            # opens the default database only; used up, the coded error, wrapped by kombu
            with pytest.raises(kombu.exceptions.OperationalError) as wrapped:
                publish(fresh, "billing", {"n": "refused-2"}, retry=True,
                        retry_policy={"max_retries": 2, "interval_start": 0,
                                      "interval_step": 0.1, "interval_max": 0.2})
            assert isinstance(wrapped.value.__cause__, ShardUnavailable)
            assert "PGJ-113" in str(wrapped.value)
            assert time.monotonic() - started < 10  # a refused connection fails at once
            # ... and the same connection goes on publishing on the default database
            publish(fresh, "other", {"n": "o3"}, retry=True)
            # a queue declared while its shard is down is no error: declared when it is back
            ttl_queue = kombu.Queue("billing.ttl", kombu.Exchange("billing.ttl"),
                                    message_ttl=60)
            assert ttl_queue(fresh.default_channel).declare() == "billing.ttl"

        # claims: the default database's go on while the shard's loop reconnects
        started = time.monotonic()
        got = drain(conn, ["billing", "other"], 3)
        assert sorted(m.payload["n"] for m in got) == ["o1", "o2", "o3"]
        time.sleep(1.5)  # the shard's loop backs off and retries meanwhile
        publish(conn, "other", {"n": "o4"})
        got += drain(conn, ["billing", "other"], 1)
        assert sorted(m.payload["n"] for m in got) == ["o1", "o2", "o3", "o4"]
        assert time.monotonic() - started < 10
        with pytest.raises(ShardUnavailable):
            conn.default_channel.basic_get("billing")  # claims on the shard: the coded error
        for m in held:  # acks of held messages: buffered, fenced, each on its own database
            m.ack()
        wait_for(lambda: not [r for r in jobs(DSN, schema) if r[0] == "other"], 5,
                 what="every default-database message acked while the shard is down")

        shard_server.start()

        # nothing refused was written; b0 is still held (its ack waits in the buffer)
        assert [r[:2] for r in jobs(shard_server.dsn, schema)] == [("billing", "running")]
        wait_for(lambda: _queue_args(shard_server.dsn, schema).get("billing.ttl") == 60000,
                 25, what="the declaration kept for the shard to be applied")
        publish(conn, "billing", {"n": "b1"})  # the shard's publish connection is new
        got = drain(conn, ["billing", "other"], 1)  # the shard's claim connection too
        assert [m.payload for m in got] == [{"n": "b1"}]
        wait_for(lambda: jobs(shard_server.dsn, schema) == [], 15,
                 what="b0's ack (held over the outage) and b1's to land on the shard")
        assert [r[0] for r in jobs(DSN, schema)] == []


def _worker_restarts(output: str) -> int:
    """Celery's consumer restarts (a kombu connection error reached it)."""
    return output.count("Connection to broker lost") + output.count(
        "consumer: Cannot connect")


@pytest.mark.e2e
@pytest.mark.parametrize("event_loop", ["1", "0"])
def test_a_worker_runs_the_default_databases_tasks_while_a_shard_is_down(
        shard_server: PrivateServer, url: str, recorder_tables: str, start_worker: Any,
        event_loop: str) -> None:
    """Real workers on the default database and a shard on a server that is stopped: the
    default database's tasks keep running (in Celery's event loop, and in its synchronous
    loop), a worker started meanwhile starts and runs them too, Celery's publish to the
    shard fails with PGJ-113 and is never run; messages queued on the shard before it
    stopped, and published after it is back, each run exactly once; no consumer restarts."""
    from tests.conftest import import_app

    schema = recorder_tables
    env = {"PGJOBS_TEST_SHARDS": json.dumps({"billing": shard_server.url}),
           "PGJOBS_TEST_EVENT_LOOP": event_loop}
    app = import_app("tests.apps.sharded", schema, url, **env)
    w1 = start_worker(name="w1", app="tests.apps.sharded", env=env,
                      extra=["-Q", "billing,other"])
    app.record.apply_async(("billing-0",), queue="billing")
    app.record.apply_async(("other-0",), queue="other")
    wait_for(lambda: _runs(schema) == ["billing-0", "other-0"], 15, what="the first tasks")
    # queued on the shard when it stops, due while it is down: they run once it is back
    queued = [f"billing-queued-{i}" for i in range(5)]
    for label in queued:
        app.record.apply_async((label,), queue="billing", countdown=1)

    shard_server.halt()
    halted = time.monotonic()

    with pytest.raises(kombu.exceptions.OperationalError) as caught:
        app.record.apply_async(("billing-refused",), queue="billing")  # Celery's retry too
    assert isinstance(caught.value.__cause__, ShardUnavailable)
    assert "PGJ-113" in str(caught.value)
    others = [f"other-{i}" for i in range(1, 11)]
    for label in others[:5]:
        app.record.apply_async((label,), queue="other")
    wait_for(lambda: set(others[:5]) <= set(_runs(schema)), 15,
             what="the default database's tasks to run while the shard is down")
    w2 = start_worker(name="w2", app="tests.apps.sharded", env=env,
                      extra=["-Q", "billing,other"])  # starts: a down shard is no error
    # a few seconds down: the shard's loops back off (and retry) meanwhile
    time.sleep(max(0.0, halted + 4.0 - time.monotonic()))
    published = time.monotonic()
    for label in others[5:]:
        app.record.apply_async((label,), queue="other")
    wait_for(lambda: set(others) <= set(_runs(schema)), 15,
             what="the default database's tasks to run with the second worker up")
    assert time.monotonic() - published < 5  # at once, not at a shard's backoff or poll
    assert _runs(schema) == sorted(["billing-0", "other-0", *others])  # none of the shard's

    shard_server.start()

    app.record.apply_async(("billing-1",), queue="billing")
    expected = sorted(["billing-0", "other-0", "billing-1", *queued, *others])
    wait_for(lambda: len(_runs(schema)) >= len(expected), 30,
             what="the shard's messages to run once it is back")
    time.sleep(0.5)  # a duplicate, if any, would land now
    assert _runs(schema) == expected  # each exactly once; the refused one never
    wait_for(lambda: not jobs(shard_server.dsn, schema) and not [
        r for r in jobs(DSN, schema) if r[0] in ("billing", "other")], 10,
        what="every row acked on its database")
    for worker in (w1, w2):
        assert worker.proc.poll() is None, worker.output()[-3000:]
        assert _worker_restarts(worker.output()) == 0, worker.output()[-3000:]


def _postmaster(server: PrivateServer) -> int:
    return int((server.data / "postmaster.pid").read_text().split()[0])


def test_a_shard_that_does_not_answer_never_holds_the_default_databases_claims(
        shard_server: PrivateServer, url: str, schema: str) -> None:
    """The shard's server hangs (its postmaster stopped with SIGSTOP, its backends ended):
    a connection to it is accepted by the kernel and never answered, so each attempt lasts
    ``connect_timeout`` (10 s here). The shard's consumer loop reconnects on a helper thread
    and waits for it at most RECONNECT_WAIT: the default database's messages are delivered
    without the 10 s stalls; when the server goes on, the shard's loop takes the connection
    the helper opened and its messages are delivered."""
    import os
    import signal

    from kombu_pgjobs.broker.sharding import RECONNECT_WAIT

    shards = {"billing": shard_server.url}
    with connection(url, schema, shards, connect_timeout=10.0) as conn:
        publish(conn, "billing", {"n": "b0"})
        publish(conn, "other", {"n": "o0"})
        assert len(drain(conn, ["billing", "other"], 2)) == 2
        wait_for(lambda: jobs(shard_server.dsn, schema) == [], 5, what="b0's ack")
        queues = [kombu.Queue(q, kombu.Exchange(q), routing_key=q) for q in ("billing", "other")]
        got: list[tuple[Any, float]] = []
        with conn.Consumer(queues, callbacks=[
                lambda body, m: (got.append((body, time.monotonic())), m.ack())]), \
                psycopg.connect(shard_server.dsn, autocommit=True) as admin:
            postmaster = _postmaster(shard_server)
            os.kill(postmaster, signal.SIGSTOP)
            try:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE "
                              "backend_type = 'client backend' AND pid <> pg_backend_pid()")
                latencies = []
                with connection(url, schema, shards) as publisher:
                    for i in range(12):
                        sent = time.monotonic()
                        publish(publisher, "other", {"n": f"o{i + 1}"})
                        while len(got) < i + 1 and time.monotonic() - sent < 30:
                            try:
                                conn.drain_events(timeout=1)
                            except TimeoutError:
                                pass
                        assert len(got) == i + 1
                        latencies.append(got[-1][1] - sent)
                        time.sleep(0.3)
                # without the helper, attempts stalled 10 s each (one in ~15 s)
                assert max(latencies) < RECONNECT_WAIT + 4.0, latencies
            finally:
                os.kill(postmaster, signal.SIGCONT)
        publish(conn, "billing", {"n": "b1"})
        again = drain(conn, ["billing", "other"], 1)
        assert [m.payload for m in again] == [{"n": "b1"}]
        wait_for(lambda: jobs(shard_server.dsn, schema) == [], 10, what="b1's ack")
        assert [r for r in jobs(DSN, schema) if r[0] == "other"] == []


def test_inspect_scheduled_lists_the_default_databases_eta_tasks_while_a_shard_is_down(
        shard_server: PrivateServer, url: str, recorder_tables: str,
        start_worker: Any) -> None:
    """celery_ext's `inspect scheduled` reads every database the worker consumes: with the
    shard's server stopped it still answers, listing the default database's ETA tasks (and
    logs PGJ-217 for the shard), rather than answering with an error."""
    from tests.conftest import import_app

    schema = recorder_tables
    env = {"PGJOBS_TEST_SHARDS": json.dumps({"billing": shard_server.url}),
           "PGJOBS_TEST_CELERY_EXT": "1"}
    app = import_app("tests.apps.sharded", schema, url, **env)
    worker = start_worker(name="sched", app="tests.apps.sharded", env=env,
                          extra=["-Q", "billing,other"])
    later = app.record.apply_async(("later",), queue="other", countdown=600)
    app.record.apply_async(("billing-later",), queue="billing", countdown=600)
    shard_server.halt()
    replies = app.app.control.inspect(timeout=10.0).scheduled()
    assert replies, "the worker answered"
    (_name, entries), = replies.items()
    assert isinstance(entries, list), entries
    assert [e["request"]["id"] for e in entries] == [later.id]
    wait_for(lambda: "pgjobs.shard.unavailable" in worker.output(), 5,
             what="the skipped shard logged")
    app.app.close()
