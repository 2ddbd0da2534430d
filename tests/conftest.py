"""Shared fixtures: a real Postgres (never mocked), one schema per test, real worker processes.

The DSN comes from PGJOBS_TEST_DSN (default postgresql://postgres@127.0.0.1:5432/test). When
Postgres cannot be reached the tests that need it FAIL under CI=true and skip elsewhere with the
reason, so a missing database is never mistaken for a pass.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.backend import release_all

DSN = os.environ.get("PGJOBS_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/test")
ROOT = Path(__file__).resolve().parent.parent


def broker_url() -> str:
    """The pgjobs:// URL for the test DSN."""
    info = psycopg.conninfo.conninfo_to_dict(DSN)
    user = info.get("user", "postgres")
    pw = f":{info['password']}" if info.get("password") else ""
    host = info.get("host", "127.0.0.1")
    port = info.get("port", "5432")
    return f"pgjobs://{user}{pw}@{host}:{port}/{info.get('dbname', 'test')}"


@pytest.fixture(scope="session")
def dsn() -> str:
    try:
        with psycopg.connect(DSN, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"PostgreSQL is required under CI=true and is unreachable: {exc}")
        pytest.skip(f"PostgreSQL unreachable at {DSN}: {exc}")
    return DSN


@pytest.fixture
def db(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    """A fresh schema for one test, dropped afterwards."""
    name = f"pgjt_{uuid.uuid4().hex[:12]}"
    yield name
    release_all()  # this process's pgjobs connections and keeper threads
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def url(dsn: str) -> str:
    return broker_url()


@pytest.fixture
def recorder_tables(db: psycopg.Connection[Any], schema: str) -> str:
    """Tables the e2e recorder app writes to (in the test's schema)."""
    db.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    db.execute(f'CREATE TABLE "{schema}".pgjobs_test_run (label text, pid int, '
               "started timestamptz, finished timestamptz)")
    db.execute(f'CREATE TABLE "{schema}".pgjobs_test_start (label text, pid int, '
               "at timestamptz DEFAULT clock_timestamp())")
    return schema


class Worker:
    """A real `celery worker` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc = proc
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.output():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.output()[-4000:]}")
            time.sleep(0.1)
        raise AssertionError(f"worker not ready in {timeout}s:\n{self.output()[-4000:]}")

    def kill(self) -> None:
        """SIGKILL the worker and its pool children (its process group)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)

    def stop(self, timeout: float = 30.0) -> int:
        """Warm shutdown (SIGTERM), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode


@pytest.fixture
def start_worker(tmp_path: Path, schema: str, url: str) -> Iterator[Any]:
    workers: list[Worker] = []

    def start(*, name: str = "w1", app: str = "tests.apps.recorder", pool: str = "threads",
              concurrency: int = 4, env: dict[str, str] | None = None,
              extra: list[str] | None = None, ready: bool = True,
              worker_sync: bool = False) -> Worker:
        log = tmp_path / f"{name}.log"
        environ = {**os.environ, "PGJOBS_TEST_DSN": DSN, "PGJOBS_TEST_SCHEMA": schema,
                   "PGJOBS_TEST_BROKER": url, "PYTHONPATH": str(ROOT),
                   **(env or {})}
        cmd = [sys.executable, "-m", "celery", "-A", app, "worker", "-l", "info",
               "-P", pool, "-c", str(concurrency), "-n", f"{name}@%h",
               *([] if worker_sync else ["--without-gossip", "--without-mingle"]),
               "--without-heartbeat", *(extra or [])]
        with open(log, "wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=environ,
                                    cwd=ROOT, start_new_session=True)
        w = Worker(proc, log)
        workers.append(w)
        if ready:
            w.wait_ready()
        return w

    yield start
    for w in workers:
        if w.proc.poll() is None:
            w.kill()


def wait_for(predicate: Any, timeout: float, interval: float = 0.2, what: str = "") -> Any:
    """Poll ``predicate`` until truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def import_app(module: str, schema: str, url: str, **env: str) -> Any:
    """A test app module imported afresh for this test's schema and broker (to publish from the
    test process); the environment it read at import is restored afterwards."""
    saved = dict(os.environ)
    os.environ.update({"PGJOBS_TEST_SCHEMA": schema, "PGJOBS_TEST_BROKER": url,
                       "PGJOBS_TEST_DSN": DSN, **env})
    try:
        sys.modules.pop(module, None)
        return importlib.import_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)


#: the second database of shard-map tests (created on the test server when absent)
SECOND_DATABASE = "pgjobs_test_shard2"


@pytest.fixture
def second_database(dsn: str, schema: str) -> Iterator[str]:
    """The pgjobs:// URL of a second database on the test server (``pgjobs_test_shard2``,
    created when absent), for shard maps. The test's schema is dropped there afterwards."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                        (SECOND_DATABASE,)).fetchone() is None:
            try:
                conn.execute(f'CREATE DATABASE "{SECOND_DATABASE}"')
            except psycopg.errors.DuplicateDatabase:  # another run created it meanwhile
                pass
    base = broker_url()
    yield base.rsplit("/", 1)[0] + "/" + SECOND_DATABASE
    release_all()
    second = psycopg.conninfo.make_conninfo(DSN, dbname=SECOND_DATABASE)
    with psycopg.connect(second, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
