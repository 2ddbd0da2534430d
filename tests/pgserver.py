"""A private PostgreSQL server for fault tests: restarted and stopped by the test that owns it.

Restarting the shared test server would break every other test (and every other run) using it,
so tests that restart the server get their own: `initdb` into a fresh directory, trust auth,
a free port on 127.0.0.1, fsync off. It uses the server binaries the machine has (the same
PostgreSQL the shared server runs); as root, the server runs as the ``postgres`` account.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

__all__ = ["PrivateServer", "find_bindir", "require_bindir"]


def find_bindir() -> Path | None:
    """The newest installed server's bin directory, or None."""
    for env in ("PGJOBS_PG_BINDIR",):
        if os.environ.get(env):
            return Path(os.environ[env])
    root = Path("/usr/lib/postgresql")
    if root.is_dir():
        versions = sorted((p for p in root.iterdir() if (p / "bin" / "pg_ctl").exists()),
                          key=lambda p: int(p.name) if p.name.isdigit() else 0)
        if versions:
            return versions[-1] / "bin"
    found = shutil.which("pg_ctl")
    return Path(found).parent if found else None


def require_bindir() -> Path:
    """The server binaries for a private server: a test that needs them FAILS under CI=true when
    they are missing and skips elsewhere."""
    import pytest

    bindir = find_bindir()
    if bindir is None:
        if os.environ.get("CI") == "true":
            pytest.fail("PostgreSQL server binaries (pg_ctl, initdb) are required under CI")
        pytest.skip("no PostgreSQL server binaries to run a private server")
    return bindir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateServer:
    """One throw-away server. ``dsn`` reaches it; ``restart()`` and ``terminate_all()`` are
    the faults a test applies; ``stop()`` removes it."""

    def __init__(self, bindir: Path, *, standby_of: PrivateServer | None = None) -> None:
        """A new primary, or with ``standby_of`` a streaming-replication standby of that
        server (``pg_basebackup -R``: hot standby, read-only until :meth:`promote`)."""
        self.bindir = bindir
        self.port = _free_port()
        self.base = Path(tempfile.mkdtemp(prefix="pgjobs-private-"))
        self.base.chmod(0o755)
        self.data = self.base / "data"
        self.log = self.base / "server.log"
        self._user: str | None = None
        if os.geteuid() == 0:
            self._user = "postgres"
            pw = pwd.getpwnam(self._user)
            os.chown(self.base, pw.pw_uid, pw.pw_gid)
        if standby_of is None:
            self._run("initdb", "-D", str(self.data), "-U", "postgres", "-A", "trust",
                      "--no-sync", "-E", "UTF8")
            with open(self.data / "postgresql.conf", "a") as fh:
                fh.write(f"port = {self.port}\nlisten_addresses = '127.0.0.1'\n"
                         "unix_socket_directories = ''\nfsync = off\nmax_connections = 200\n"
                         "shared_buffers = 64MB\n")
        else:
            self._run("pg_basebackup", "-h", "127.0.0.1", "-p", str(standby_of.port),
                      "-U", "postgres", "-D", str(self.data), "-R", "-X", "stream",
                      "--no-sync")
            with open(self.data / "postgresql.conf", "a") as fh:
                fh.write(f"port = {self.port}\n")
        self.start()
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.url = f"pgjobs://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        cmd = [str(self.bindir / tool), *args]
        if self._user:
            cmd = ["runuser", "-u", self._user, "--", *cmd]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "start")

    def restart(self) -> None:
        """A fast restart: every backend ends, the server comes back on the same port."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "-m", "fast", "restart")

    def halt(self) -> None:
        """The server stops at once (``-m immediate``, as a crash), its data kept."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-m", "immediate",
                  "stop")

    def snapshot(self) -> Path:
        """A copy of the data directory taken now, as a storage snapshot would be (the server
        keeps running: the copy is crash-consistent only if nothing writes meanwhile; stop the
        server first for a clean one)."""
        target = self.base / f"snapshot-{time.monotonic_ns()}"
        subprocess.run(["cp", "-a", str(self.data), str(target)], check=True)
        # the running server's lock file: its PID may still exist (unreaped) after a halt
        (target / "postmaster.pid").unlink(missing_ok=True)
        return target

    def restore(self, snapshot: Path) -> None:
        """Stop at once and start again from ``snapshot`` (:meth:`snapshot`): every commit
        made since it was taken is gone, as after a restore from a storage snapshot."""
        self.halt()
        shutil.rmtree(self.data)
        subprocess.run(["cp", "-a", str(snapshot), str(self.data)], check=True)
        self.start()

    def promote(self) -> None:
        """A standby becomes a primary (a new timeline) and accepts writes."""
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def replicate_synchronously(self) -> None:
        """A commit here returns only once a standby has flushed it."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")

    def terminate_all(self) -> int:
        """pg_terminate_backend on every client backend but this call's own."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchone()
        return int(row[0]) if row else 0

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "30", "-m", "immediate",
                      "stop")
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.base, ignore_errors=True)
