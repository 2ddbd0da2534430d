"""Shared fixtures: a real Postgres (never mocked), one schema per test, real worker processes.

The DSN comes from PGJOBS_TEST_DSN (default postgresql://postgres@127.0.0.1:5432/test). When
Postgres cannot be reached the tests that need it FAIL under CI=true and skip elsewhere with the
reason, so a missing database is never mistaken for a pass.

The suite runs on several pytest-xdist workers. ``@pytest.mark.exclusive`` marks a test that must
have the server to itself (it restarts or fails over a server, terminates every backend, runs a
bouncer, or asserts a tight timing bound): no other test is in progress while it runs. See
"Running in parallel" below.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from kombu_pgjobs.broker.backend import release_all

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


@pytest.fixture
def parity(db: psycopg.Connection[Any], recorder_tables: str, url: str) -> Any:
    """tests/apps/parity.py (celery_ext, a database result backend) for this test's schema,
    with the table its on_settled receiver writes to."""
    db.execute(f'CREATE TABLE "{recorder_tables}".pgjobs_test_settled (task text, outcome text, '
               "task_id text, attempts int, at timestamptz DEFAULT clock_timestamp())")
    return import_app("tests.apps.parity", recorder_tables, url)


@pytest.fixture
def private_server() -> Iterator[Any]:
    """A private server the test stops, restarts or restores (tests/pgserver.py; it FAILS
    under CI=true when the server binaries are missing), removed afterwards."""
    from tests.pgserver import PrivateServer, require_bindir

    s = PrivateServer(require_bindir())
    try:
        yield s
    finally:
        s.stop()


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
            except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                pass  # another test (or run) created it meanwhile
    base = broker_url()
    yield base.rsplit("/", 1)[0] + "/" + SECOND_DATABASE
    release_all()
    second = psycopg.conninfo.make_conninfo(DSN, dbname=SECOND_DATABASE)
    with psycopg.connect(second, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


# -- Running in parallel (pytest-xdist) and the ``exclusive`` marker ---------------------------
#
# pyproject's addopts run the suite on several xdist workers (``-n 3``). Every test has its own
# schema, so tests share the server safely, except the few marked ``@pytest.mark.exclusive``:
# they disturb more than their own schema (a server they restart, two clusters, a bouncer) or
# hold a timing bound that the load of other tests would break. An exclusive test runs with no
# other test of this run in progress on any worker:
#
# * they are sorted last, and the scheduler (``load``/``loadgroup``) sends all of them to one
#   worker as one unit, so they run back to back at the end and the other workers stop once (by
#   then they run short tests: the slow ones are sorted first), not once per exclusive test (the
#   workers list their exclusive tests in a file the scheduler reads);
# * a reader/writer lock across the workers of the run (flock on two files): every test holds
#   the lock shared from its setup to its teardown, an exclusive one holds it exclusively (kept
#   across consecutive exclusive tests). Both pass a turnstile first, so a waiting exclusive test
#   stops new tests from starting and is never starved by them.
#
# The lock waits come before pytest-timeout's clock starts. Run ``-n 0`` for one process (the
# lock then does nothing: tests run one at a time anyway).

EXCLUSIVE_LIST = "exclusive.json"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The slow tests first, then those starting worker processes (so the longest do not start
    last), the exclusive ones last; otherwise collection order (a stable sort). A worker lists
    its exclusive tests for the scheduler."""
    items.sort(key=lambda item: (item.get_closest_marker("exclusive") is not None,
                                 item.get_closest_marker("slow") is None,
                                 item.get_closest_marker("e2e") is None))
    workerinput = getattr(config, "workerinput", None)
    if workerinput and "pgjobs_lock_dir" in workerinput:
        listing = Path(workerinput["pgjobs_lock_dir"]) / EXCLUSIVE_LIST
        tmp = listing.with_suffix(f".{workerinput['workerid']}")
        tmp.write_text(json.dumps([i.nodeid for i in items if i.get_closest_marker("exclusive")]))
        os.replace(tmp, listing)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """(xdist controller) ``load`` scheduling, but every exclusive test in one unit of work;
    units in collection order (not the largest first)."""
    if config.getvalue("dist") not in ("load", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False
    listing = Path(config._pgjobs_lock_dir) / EXCLUSIVE_LIST

    class ExclusiveTogether(LoadScopeScheduling):
        exclusive: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.exclusive is None:  # read once the workers have collected
                self.exclusive = frozenset(
                    json.loads(listing.read_text()) if listing.exists() else ())
            return "exclusive" if nodeid in self.exclusive else nodeid

    return ExclusiveTogether(config, log)


class RunLock:
    """A reader/writer lock shared by the worker processes of one run, with a turnstile."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._gate = open(directory / "gate.lock", "a+b")  # both open for the session
        self._rw = open(directory / "rw.lock", "a+b")
        self.held: str | None = None

    def acquire(self, mode: str) -> None:
        if self.held == mode:
            return
        self.release()
        fcntl.flock(self._gate, fcntl.LOCK_EX)  # the turnstile: in arrival order, one at a time
        try:
            fcntl.flock(self._rw, fcntl.LOCK_EX if mode == "exclusive" else fcntl.LOCK_SH)
        finally:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.held = mode

    def release(self) -> None:
        if self.held is not None:
            fcntl.flock(self._rw, fcntl.LOCK_UN)
            self.held = None


_run_lock: RunLock | None = None


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(xdist controller) every worker of this run gets the same lock directory."""
    node.workerinput["pgjobs_lock_dir"] = node.config._pgjobs_lock_dir


def pytest_configure(config: pytest.Config) -> None:
    global _run_lock
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # the controller, or a run without xdist
        config._pgjobs_lock_dir = tempfile.mkdtemp(prefix="pgjobs-pytest-lock-")
    elif "pgjobs_lock_dir" in workerinput:
        _run_lock = RunLock(Path(workerinput["pgjobs_lock_dir"]))


def pytest_unconfigure(config: pytest.Config) -> None:
    if getattr(config, "workerinput", None) is None and hasattr(config, "_pgjobs_lock_dir"):
        shutil.rmtree(config._pgjobs_lock_dir, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Outermost (before pytest-timeout's clock starts): wait for the lock, run setup, call and
    teardown under it; an exclusive test followed by another keeps the lock for it."""
    if _run_lock is None:
        yield
        return
    exclusive = item.get_closest_marker("exclusive") is not None
    _run_lock.acquire("exclusive" if exclusive else "shared")
    try:
        yield
    finally:
        if not (exclusive and nextitem is not None
                and nextitem.get_closest_marker("exclusive") is not None):
            _run_lock.release()
