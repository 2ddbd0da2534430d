"""The trust boundary (issue 28, 0021_trust_boundary.sql): a database role outside the app
(CONNECT and nothing else) can neither run, read, replay nor stall the app's tasks.

PostgreSQL lets every role that can connect LISTEN, NOTIFY and take advisory locks. Each test
here makes a real second role with no grant on the pgjobs schema and attacks real kombu
consumers and publishers with it: it listens on every channel it can name, replays what it
heard, forges hand-offs in every format pgjobs ever sent, and holds every advisory lock key
it can compute or read off ``pg_locks``. Deliveries are counted by the consumers and read
back from the database.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import kombu
import psycopg
import pytest

from kombu_pgjobs.errors import DatabaseTimeout

from .conftest import import_app, wait_for
from .test_wake_one import Drainer, _producer, _waiters

QUEUE = "tb"


@pytest.fixture
def outsider(dsn: str) -> Iterator[str]:
    """The DSN of a fresh login role with CONNECT (PostgreSQL's default for every role) and
    no grant on anything of pgjobs's; dropped afterwards."""
    role = f"pgjt_out_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE ROLE "{role}" LOGIN')
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = role
    info.pop("password", None)
    yield psycopg.conninfo.make_conninfo(**info)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                      "WHERE usename = %s", [role])
        wait_for(lambda: admin.execute("SELECT count(*) FROM pg_stat_activity "
                                       "WHERE usename = %s", [role]).fetchone()[0] == 0,
                 10, what="the outsider's sessions to end")
        admin.execute(f'DROP ROLE "{role}"')


def _wake_ids(conn: psycopg.Connection[Any], db: psycopg.Connection[Any] | None = None,
              app: str | None = None) -> set[int]:
    """Every bigint advisory lock key held on the server, as anyone can read it; with ``db``
    (the test's own superuser connection) and ``app``, only those of the sessions of that
    application name: other tests running meanwhile have consumers too, and the attacks stay
    off them (they would reach them, to no effect, but they would hear this test's forgeries)."""
    rows = conn.execute(
        "SELECT (classid::bigint << 32) | objid::bigint, pid FROM pg_locks "
        "WHERE locktype = 'advisory' AND objsubid = 1 AND granted").fetchall()
    if db is None:
        return {r[0] for r in rows}
    ours = {r[0] for r in db.execute("SELECT pid FROM pg_stat_activity "
                                     "WHERE application_name = %s", [app]).fetchall()}
    return {key for key, pid in rows if pid in ours}


@contextmanager
def _idle_consumer(url: str, schema: str, db: psycopg.Connection[Any], name: str,
                   kind: type[Drainer] = Drainer, **options: Any
                   ) -> Iterator[tuple[kombu.Connection, Drainer, str]]:
    """A producer of QUEUE and a consumer of it, registered (idle) before the block: (the
    producer, the consumer, its application name, unique so that the attacks aim at it)."""
    producer = _producer(url, schema, QUEUE)
    app = f"{name}-{uuid.uuid4().hex[:8]}"
    consumer = kind(url, schema, [QUEUE], app, **options)
    consumer.start()
    try:
        wait_for(lambda: _waiters(db, schema, QUEUE) >= 1, 10, what="the consumer to wait")
        yield producer, consumer, app
    finally:
        consumer.stop_event.set()
        consumer.join(10)
        producer.release()


class Holding(Drainer):
    """A consumer whose callback holds each message a moment before it acks (the ack is then
    buffered: the row stays 'running' under its claim until the flush)."""

    def _on(self, body: Any, message: Any) -> None:
        self.got.append((body, time.monotonic()))
        time.sleep(0.5)
        message.ack()


@pytest.mark.parametrize("hand_off", [True, False])
def test_an_outsider_reads_no_message_and_runs_none_by_notify(
        hand_off: bool, outsider: str, url: str, schema: str,
        db: psycopg.Connection[Any]) -> None:
    heard: list[tuple[str, str]] = []
    listening: set[str] = set()
    with _idle_consumer(url, schema, db, "pgjt-trust", Holding, hand_off=hand_off) as (
            producer, consumer, app):
        with psycopg.connect(outsider, autocommit=True) as evil:
            # It has no grant: it cannot read a message from the table.
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                evil.execute(f'SELECT message FROM "{schema}".pgjobs_job')

            def listen_everywhere() -> None:
                channels = {f"pgjobs.{schema}"} | {f"pgjobs.w.{w}"
                                                   for w in _wake_ids(evil, db, app)}
                for ch in channels - listening:
                    evil.execute(f'LISTEN "{ch}"')
                    listening.add(ch)

            def hear(seconds: float) -> None:
                heard.extend((n.channel, n.payload)
                             for n in evil.notifies(timeout=seconds))

            listen_everywhere()
            assert any(ch.startswith("pgjobs.w.") for ch in listening)
            producer.SimpleQueue(QUEUE).put({"label": "real", "secret": "s3cr3t-body"})
            wait_for(lambda: len(consumer.got) >= 1, 10, what="the real message")
            hear(0.5)
            # Eavesdropping: no notification carries the message, its headers or its task.
            assert heard, "the outsider heard nothing: it listened on the wrong channels"
            for _, payload in heard:
                assert "s3cr3t" not in payload and "real" not in payload
                assert "body" not in payload and "headers" not in payload
            if hand_off:
                assert any(p.startswith("\x1e") for _, p in heard), heard

            # A message as pgjobs stores it, for the forgeries (published not due, then
            # deleted by the test: the outsider could have built the same text by hand).
            producer.Producer().publish({"label": "forged", "secret": "x"},
                                        routing_key=QUEUE,
                                        headers={"eta": "2999-01-01T00:00:00"})
            fid, fmsg = db.execute(
                f'SELECT id, message::text FROM "{schema}".pgjobs_job '
                "WHERE delayed").fetchone()
            db.execute(f'DELETE FROM "{schema}".pgjobs_job WHERE id = %s', [fid])
            real_id = max(int(p[1:].split(" ")[0]) for _, p in heard
                          if p.startswith("\x1e")) if hand_off else fid - 1

            # Replay while the real run holds its message (its ack not yet flushed), and
            # forged hand-offs in every format ever sent, on every channel it can name.
            producer.SimpleQueue(QUEUE).put({"label": "second", "secret": "s3cr3t-2"})
            wait_for(lambda: len(consumer.got) >= 2, 10, what="the second message")
            hear(0.1)
            listen_everywhere()
            forged = [p for _, p in heard]
            for mid, claim in ((real_id, 1), (real_id + 1, 1), (fid, 1), (fid, 0),
                               (real_id + 5, 1)):
                forged += [
                    # version 18: the message in the payload
                    f"\x1e{mid} {claim} {len(QUEUE)} {QUEUE}{fmsg}",
                    # version 21: ids only
                    f"\x1e{mid} {claim}:{QUEUE}",
                    # malformed
                    f"\x1e{mid}", f"\x1e{mid} {claim} 99 {QUEUE}",
                ]
            forged += [QUEUE, "no-such-queue", "\x1e", "\x1e\x1e 1 1"]
            for _ in range(2):
                for ch in sorted(listening):
                    for payload in forged:
                        evil.execute("SELECT pg_notify(%s, %s)", [ch, payload])
                time.sleep(0.3)
        time.sleep(1.5)
        bodies = [b["label"] for b, _ in consumer.got]
        assert sorted(bodies) == ["real", "second"], bodies
        assert consumer.error is None
        # Every forged or replayed hand-off settled nothing: no row is left, no dead letter.
        wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job')
                 .fetchone()[0] == 0, 10, what="the acks to land")
        assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter'
                          ).fetchone()[0] == 0


def _old_keys(schema: str) -> list[tuple[str, str]]:
    """The advisory lock keys versions up to 20 used: (class, key) text pairs."""
    channel = f"pgjobs.{schema}"
    return [("pgjobs.wake", f"{schema}.{QUEUE}"), (f"{channel}.limit", "k:1"),
            (f"{channel}.rate", "r:1"), (f"{channel}.queued", "acme"),
            ("pgjobs.epoch", schema)]


def test_an_outsider_holding_every_lock_key_stalls_no_publish_or_claim(
        outsider: str, url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """It holds every advisory key it can compute and every one it reads off pg_locks, and
    cannot lock pgjobs's rows: capped, limited and rate-limited publishes of tenant acme are
    published and run as if it were not there."""
    with _idle_consumer(url, schema, db, "pgjt-locks") as (producer, consumer, app):
        with psycopg.connect(outsider, autocommit=True) as evil:
            for cls, key in _old_keys(schema):
                assert evil.execute("SELECT pg_try_advisory_lock(hashtext(%s), hashtext(%s))",
                                    [cls, key]).fetchone()[0]
            assert evil.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                                [f"pgjobs.migrate.{schema}"]).fetchone()[0]
            for key in _wake_ids(evil, db, app):  # held by live consumers: it gets none
                evil.execute("SELECT pg_try_advisory_lock(%s)", [key])
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                evil.execute(f'SELECT 1 FROM "{schema}".pgjobs_lock FOR UPDATE')

            p = producer.Producer()
            started = time.monotonic()
            for i in range(6):
                p.publish({"label": f"m{i}"}, routing_key=QUEUE, headers={
                    "x-pgjobs-tenant": "acme", "x-pgjobs-tenant-max-queued": 100,
                    "x-pgjobs-limits": {
                        "concurrency": [{"key": "k:1", "limit": 2}],
                        "rate": [{"key": "r:1", "limit": 1000, "per": 60}]}})
            p.publish({"label": "plain"}, routing_key=QUEUE)
            published = time.monotonic() - started
            wait_for(lambda: len(consumer.got) >= 7, 20, what="every message to run")
            ran = time.monotonic() - started
        assert published < 5.0 and ran < 20.0
        assert sorted(b["label"] for b, _ in consumer.got) == \
            sorted([f"m{i}" for i in range(6)] + ["plain"])
        assert consumer.error is None


def test_a_publish_waits_for_a_tenant_lock_no_longer_than_lock_timeout(
        url: str, schema: str, dsn: str) -> None:
    """The rows that serialise a tenant's capped publishes can be held only by the app (its
    own long transaction): even then a publish waits at most lock_timeout and fails with a
    coded error, nothing written."""
    _producer(url, schema, QUEUE).release()  # the schema and the queue
    conn = kombu.Connection(url, transport_options={"schema": schema, "lock_timeout": 0.5})
    try:
        with psycopg.connect(dsn) as app:  # a transaction of the app's, left open
            app.execute(f'SELECT "{schema}".pgjobs_lock_v1(%s, %s, %s)',
                        ["queued", ["acme"], "wait"])
            started = time.monotonic()
            with pytest.raises(DatabaseTimeout) as caught:
                conn.Producer().publish({"n": 1}, routing_key=QUEUE, headers={
                    "x-pgjobs-tenant": "acme", "x-pgjobs-tenant-max-queued": 10})
            waited = time.monotonic() - started
            app.rollback()
        assert caught.value.code == "PGJ-108"
        assert waited < 5.0
    finally:
        conn.release()
    with psycopg.connect(dsn) as check:
        assert check.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0


def test_lock_rows_of_a_session_without_a_lock_timeout_are_still_bounded(
        url: str, schema: str, dsn: str) -> None:
    """An app connection with lock_timeout = 0 (the outbox publishes on the app's own
    connection): the row waits of pgjobs_lock_v1 are bounded anyway (10 s), and the session's
    setting is left as it was."""
    _producer(url, schema, QUEUE).release()
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as app:
        holder.execute(f'SELECT "{schema}".pgjobs_lock_v1(%s, %s, %s)',
                       ["queued", ["acme"], "wait"])
        app.execute("SET lock_timeout = 0")
        with app.transaction():
            assert app.execute(f'SELECT "{schema}".pgjobs_lock_v1(%s, %s, %s)',
                               ["queued", ["beta-not-acme"], "wait"]).fetchone()[0]
            assert app.execute("SHOW lock_timeout").fetchone()[0] == "0"
        box: dict[str, Any] = {}

        def wait() -> None:
            started = time.monotonic()
            try:
                app.execute(f'SELECT "{schema}".pgjobs_lock_v1(%s, %s, %s)',
                            ["queued", ["acme"], "wait"])
            except psycopg.errors.LockNotAvailable as exc:
                box["error"] = exc
            box["waited"] = time.monotonic() - started

        t = threading.Thread(target=wait)
        t.start()
        t.join(30)
        holder.rollback()
    assert isinstance(box.get("error"), psycopg.errors.LockNotAvailable)
    assert 8.0 < box["waited"] < 20.0


def test_old_hand_off_payload_parses_as_nothing() -> None:
    """A version 18 hand-off (the message in the payload) is in no format this version
    reads: a consumer never takes a message from a notification."""
    from kombu_pgjobs.broker.waiting import handed_ids

    msg = json.dumps({"body": "x", "headers": {}})
    assert handed_ids(f"\x1e12 1 2 tb{msg}", 7) is None
    got = handed_ids("\x1e12 1:tb", 7)
    assert got is not None and (got.waiter, got.id, got.claim, got.queue) == (7, 12, 1, "tb")
    for bad in ("\x1e12", "tb", "\x1e0 1:tb", f"\x1e1 {2**31}:tb", "\x1e12 1:", "\x1e-1 1:tb"):
        assert handed_ids(bad, 7) is None, bad


def test_an_outsider_cannot_stall_an_upgrade_and_only_bounds_a_first_install(
        outsider: str, dsn: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Migrations of an installed schema serialise on its migration table's lock, which an
    outsider cannot take; the advisory lock it can hold only delays a first install, for a
    bounded time, with a coded error."""
    from kombu_pgjobs.errors import MigrationError
    from kombu_pgjobs.store import schema as migrations

    with psycopg.connect(outsider, autocommit=True) as evil:
        assert evil.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                            [f"pgjobs.migrate.{schema}"]).fetchone()[0]
        monkeypatch.setattr(migrations, "FIRST_INSTALL_WAIT", "1s")
        with psycopg.connect(dsn, autocommit=True) as app:
            started = time.monotonic()
            with pytest.raises(MigrationError) as caught:
                migrations.migrate(app, schema)
            assert caught.value.code == "PGJ-701" and time.monotonic() - started < 10
            evil.execute("SELECT pg_advisory_unlock_all()")
            assert migrations.migrate(app, schema)  # installed
            with pytest.raises(psycopg.errors.InsufficientPrivilege), evil.transaction():
                evil.execute(f'LOCK TABLE "{schema}".pgjobs_migration IN SHARE MODE')
            assert evil.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                                [f"pgjobs.migrate.{schema}"]).fetchone()[0]
            # An upgrade (the last version taken back: its migration runs again, idempotent)
            # is not held up by the outsider.
            app.execute(f'DELETE FROM "{schema}".pgjobs_migration WHERE version = '
                        f'(SELECT max(version) FROM "{schema}".pgjobs_migration)')
            started = time.monotonic()
            assert migrations.migrate(app, schema) == [migrations.latest_version()]
            assert time.monotonic() - started < 10


@pytest.mark.e2e
def test_a_celery_worker_runs_no_forged_hand_off_and_the_real_task_once(
        outsider: str, db: psycopg.Connection[Any], recorder_tables: str, url: str,
        start_worker: Any) -> None:
    """A real ``celery worker`` (threads pool): the outsider forges hand-offs of a real task
    message (the version 18 format, which ran whatever it carried, and today's) on every
    channel it can name and replays what it hears; the task published for real runs once."""
    schema = recorder_tables
    app = import_app("tests.apps.recorder", schema, url)
    appname = f"pgjt-trusty-{uuid.uuid4().hex[:8]}"
    start_worker(name="trusty", concurrency=2, env={"PGJOBS_TEST_APPNAME": appname})

    def runs(label: str) -> int:
        return db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_test_run WHERE label = %s',
                          [label]).fetchone()[0]

    wait_for(lambda: _waiters(db, schema, "celery") >= 1, 30, what="the worker to wait")
    with psycopg.connect(outsider, autocommit=True) as evil:
        channels = {f"pgjobs.{schema}"} | {f"pgjobs.w.{w}" for w in _wake_ids(evil, db, appname)}
        for ch in channels:
            evil.execute(f'LISTEN "{ch}"')
        # The forged task: a real message for record("forged"), stored not due and deleted.
        app.record.apply_async(["forged"], countdown=86400)
        fid, fmsg = db.execute(f'SELECT id, message::text FROM "{schema}".pgjobs_job '
                               "WHERE delayed").fetchone()
        db.execute(f'DELETE FROM "{schema}".pgjobs_job WHERE id = %s', [fid])
        real = f"real-{uuid.uuid4().hex}"
        app.record.delay(real)
        wait_for(lambda: runs(real) == 1, 30, what="the real task")
        heard = [n.payload for n in evil.notifies(timeout=1.0)]
        assert heard and not any(real in p or '"body"' in p for p in heard), heard
        for ch in channels | {f"pgjobs.w.{w}" for w in _wake_ids(evil, db, appname)}:
            for payload in [*heard, f"\x1e{fid} 1 6 celery{fmsg}", f"\x1e{fid} 1:celery",
                            f"\x1e{fid + 1} 1:celery", f"\x1e{fid + 1} 1 6 celery{fmsg}"]:
                evil.execute("SELECT pg_notify(%s, %s)", [ch, payload])
    time.sleep(3.0)
    assert (runs(real), runs("forged")) == (1, 0)


@pytest.mark.parametrize("limits", [
    {"concurrency": [{"key": "dup", "limit": 2}, {"key": "dup", "limit": 3}]},
    {"rate": [{"key": "r-dup", "limit": 5, "per": 60}, {"key": "r-dup", "limit": 9, "per": 60}]},
])
def test_a_row_written_with_a_key_twice_stalls_no_claim(
        limits: dict[str, Any], schema: str, db: psycopg.Connection[Any]) -> None:
    """A publish refuses a key given twice (PGJ-303), but a role that may INSERT rows (a
    publisher, compromised) writes what it likes: such a row is admitted under each key once,
    and the claims of its queue go on (it made every claim of the queue fail before)."""
    from kombu_pgjobs.store.core import QueueCore, job_from_message
    from kombu_pgjobs.store.schema import migrate

    migrate(db, schema)
    core = QueueCore(schema, lease_ttl=30.0, max_attempts=5)
    core.publish_many(db, [job_from_message("q", {"body": "before", "headers": {},
                                                  "properties": {}})])
    db.execute(f'INSERT INTO "{schema}".pgjobs_job (queue, message, limits) VALUES '
               "('q', '{\"body\": \"dup\", \"headers\": {}, \"properties\": {}}', %s::jsonb)",
               [json.dumps(limits)])
    core.publish_many(db, [job_from_message("q", {"body": "after", "headers": {},
                                                  "properties": {}})])
    got = core.claim(db, ["q"], 10).claimed
    assert sorted(json.loads(c.message)["body"] for c in got) == ["after", "before", "dup"]


def test_a_role_without_grants_gets_a_coded_error_at_once_not_a_retry_loop(
        outsider: str, url: str, schema: str) -> None:
    """kombu and Celery retry a lost connection; a permission denied is no lost connection
    (it would fail the same way forever): PermissionDenied (PGJ-111), at once."""
    from kombu_pgjobs.errors import PermissionDenied

    _producer(url, schema, QUEUE).release()  # installed by the app's role
    role = psycopg.conninfo.conninfo_to_dict(outsider)["user"]
    started = time.monotonic()
    with kombu.Connection(f"pgjobs://{role}@127.0.0.1:5432/test",
                          transport_options={"schema": schema}) as conn:
        with pytest.raises(PermissionDenied) as caught:
            conn.Producer().publish({"n": 1}, routing_key=QUEUE, retry=True,
                                    retry_policy={"max_retries": None})
    assert caught.value.code == "PGJ-111"
    assert time.monotonic() - started < 10


def test_made_up_queue_names_in_notifications_cost_no_memory(
        outsider: str, url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """Thousands of wake-ups and hand-offs naming queues nobody consumes, on the schema's
    channel and the consumer's own: the consumer keeps no mark, no count and no pending take
    for any of them (each would be memory an outsider fills at will), and still runs a real
    message at once."""
    with _idle_consumer(url, schema, db, "pgjt-flood") as (producer, consumer, app):
        with psycopg.connect(outsider, autocommit=True) as evil:
            channels = [f"pgjobs.{schema}"] + [f"pgjobs.w.{w}"
                                              for w in _wake_ids(evil, db, app)]
            assert len(channels) == 2
            for i in range(1000):
                for ch in channels:
                    evil.execute("SELECT pg_notify(%s, %s), pg_notify(%s, %s)",
                                 [ch, f"junk-{i}", ch, f"\x1e{i + 1} 1:junk-{i}"])
        time.sleep(1.0)
        producer.SimpleQueue(QUEUE).put({"label": "real"})
        wait_for(lambda: len(consumer.got) == 1, 10, what="the real message")
        loop = consumer.conn.transport.consumer
        waits = loop.waits
        assert not any(q.startswith("junk-") for q in loop.dirty)
        assert not any(q.startswith("junk-") for q in waits._wakes)
        assert not any(q.startswith("junk-") for q in waits.rearm | waits.pass_on
                       | waits.unserved)
        assert not any(h.queue.startswith("junk-") for h in loop.handed)


def test_a_hand_off_whose_consumer_backend_is_terminated_runs_once(
        url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """A real fault on the take's path: the consumer's backend is terminated right after a
    publish hands it a message (before, while or after the take: each round lands somewhere
    else). The message runs exactly once and its ack lands: a hand-off whose take failed is
    taken on the reconnected session (its record names the old wake id, still this
    consumer's), and one whose notification died with the session comes back when its lease
    lapses."""
    with _idle_consumer(url, schema, db, "pgjt-cut", lease_ttl=2.0,
                        idle_poll_interval=1.0) as (producer, consumer, app):
        q = producer.SimpleQueue(QUEUE)
        for i in range(5):
            wait_for(lambda: _waiters(db, schema, QUEUE) >= 1, 15, what="registered again")
            q.put({"n": i})
            time.sleep(0.001 * i)  # a little later each round
            db.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE application_name = %s", [app])
            wait_for(lambda i=i: len(consumer.got) == i + 1, 15, what=f"message {i}")
        wait_for(lambda: db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job')
                 .fetchone()[0] == 0, 15, what="every ack to land")
        time.sleep(2.5)  # a lease's time: nothing comes back a second time
        assert [b["n"] for b, _ in consumer.got] == list(range(5))
        assert consumer.error is None
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 0


def test_an_outsiders_cancel_announcements_cancel_nothing_and_cost_a_renewal_a_second(
        outsider: str, url: str, schema: str, db: psycopg.Connection[Any]) -> None:
    """The wake-up a cancel sends on the schema's channel (issue 30) names nothing and carries
    no authority: a role with CONNECT only that floods it makes the holder's keeper renew at
    most once a second, and cancels, ends or settles nothing; the held message is acked as
    usual afterwards."""
    with kombu.Connection(url, transport_options={"schema": schema}) as conn:
        q = conn.SimpleQueue("held")
        q.put({"n": 1})
        held = q.get(timeout=10)
        backend = conn.default_channel.backend
        renewals: list[float] = []
        renew = backend.core.renew

        def counted(*args: Any, **kwargs: Any) -> Any:
            renewals.append(time.monotonic())
            return renew(*args, **kwargs)

        backend.core.renew = counted  # type: ignore[method-assign]
        started = time.monotonic()
        with psycopg.connect(outsider, autocommit=True) as evil:
            while time.monotonic() - started < 3.0:
                evil.execute("SELECT pg_notify(%s, %s)", [f"pgjobs.{schema}", "\x1dcancel"])
                try:
                    conn.drain_events(timeout=0.02)
                except TimeoutError:
                    pass
        took = time.monotonic() - started
        # heard (the keeper's own tick is 10 s away), and one a second at the most
        assert 2 <= len(renewals) <= took + 2, renewals
        assert not backend.cancelled
        row = db.execute(f'SELECT state, cancelled_at FROM "{schema}".pgjobs_job').fetchone()
        assert row == ("running", None)
        held.ack()
        q.close()
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_job').fetchone()[0] == 0
    assert db.execute(f'SELECT count(*) FROM "{schema}".pgjobs_dead_letter').fetchone()[0] == 0
