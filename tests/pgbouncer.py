"""A private PgBouncer for the tests: transaction pooling in front of the test database.

Started as a subprocess from a generated ini in a temporary directory, on a free port of
127.0.0.1, never the system service. Transaction pooling is the mode that breaks what a
session would otherwise hide: a session ``SET`` lands on whichever server connection ran the
statement and stays there for the next client, a prepared statement may be missing on the next
server, and LISTEN hears nothing. ``default_pool_size`` is 1 unless asked otherwise, so every
client shares one server connection and a leaked setting shows at once.

PgBouncer refuses to run as root; as root it is started with ``-u postgres`` (the temporary
directory is handed to that user first).
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
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["PgBouncer", "find_pgbouncer"]


def find_pgbouncer() -> str | None:
    """The pgbouncer binary (Debian installs it in /usr/sbin, often not on a user's PATH)."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/local/sbin/pgbouncer", "/usr/bin/pgbouncer")
         if os.access(p, os.X_OK)), None)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """One PgBouncer process in ``pool_mode = transaction`` in front of ``upstream_dsn``."""

    def __init__(self, upstream_dsn: str, *, binary: str, pool_size: int = 1) -> None:
        self.upstream = conninfo_to_dict(upstream_dsn)
        self.binary = binary
        self.pool_size = pool_size
        self.dir = Path(tempfile.mkdtemp(prefix="pgjobs-bouncer-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    # -- what clients use ------------------------------------------------------------------
    @property
    def user(self) -> str:
        return str(self.upstream.get("user") or "postgres")

    @property
    def dbname(self) -> str:
        return str(self.upstream.get("dbname") or self.user)

    def dsn(self) -> str:
        """A libpq DSN through the bouncer (for psycopg and the CLI)."""
        return make_conninfo(host="127.0.0.1", port=self.port, user=self.user,
                             dbname=self.dbname)

    def url(self) -> str:
        """The pgjobs:// broker URL through the bouncer (for kombu and Celery)."""
        return f"pgjobs://{quote(self.user)}@127.0.0.1:{self.port}/{quote(self.dbname)}"

    def admin(self, command: str) -> list[dict[str, object]]:
        """A command on the bouncer's admin console (``SHOW STATS``, ``SHOW CLIENTS``). The
        console speaks the simple query protocol only: a client-side cursor sends it so."""
        info = make_conninfo(host="127.0.0.1", port=self.port, user=self.user,
                             dbname="pgbouncer")
        with psycopg.connect(info, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
            cur = conn.cursor()
            cur.execute(command)
            names = [d.name for d in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def transactions(self) -> int:
        """Transactions the bouncer carried to the test database so far."""
        return sum(int(r["total_xact_count"]) for r in self.admin("SHOW STATS")  # type: ignore[call-overload]
                   if r["database"] == self.dbname)

    # -- lifecycle --------------------------------------------------------------------------
    def _write_config(self) -> Path:
        host = str(self.upstream.get("host") or "127.0.0.1")
        port = str(self.upstream.get("port") or 5432)
        pw = self.upstream.get("password")
        server = f"host={host} port={port}" + (f" password={pw}" if pw else "")
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        ini.write_text("\n".join([
            "[databases]",
            f"* = {server}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.dir / 'users.txt'}",
            "pool_mode = transaction",
            f"default_pool_size = {self.pool_size}",
            "min_pool_size = 0",
            "reserve_pool_size = 0",
            "max_client_conn = 500",
            # what JDBC sends; the stock setting. An unknown startup parameter (libpq `options`)
            # is refused, as a default PgBouncer does: a client must not rely on one
            "ignore_startup_parameters = extra_float_digits",
            f"admin_users = {self.user}",
            "server_check_delay = 0",
            f"pidfile = {self.dir / 'pgbouncer.pid'}",
            "",
        ]))
        return ini

    def start(self, timeout: float = 15.0) -> PgBouncer:
        cmd_user: list[str] = []
        if os.geteuid() == 0:  # "PgBouncer should not run as root"
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            cmd_user = ["-u", "postgres"]
        last = ""
        for _ in range(5):  # a free port may be taken between probing and binding it
            self.port = _free_port()
            ini = self._write_config()
            if cmd_user:
                for f in self.dir.iterdir():
                    os.chown(f, pwd.getpwnam("postgres").pw_uid, -1)
            with open(self.dir / "pgbouncer.log", "wb") as log:
                self.proc = subprocess.Popen([self.binary, *cmd_user, str(ini)], stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=2,
                                         prepare_threshold=None) as conn:
                        conn.execute("SELECT 1")
                    return self
                except psycopg.OperationalError as exc:
                    last = str(exc)
                    time.sleep(0.1)
            self.stop()
            last = f"{last}\n{self.log()}"
        raise RuntimeError(f"pgbouncer did not start: {last}")

    def log(self) -> str:
        path = self.dir / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
