"""One real ``celery worker`` subprocess, started and always stopped by the orchestrator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

WORKER_FLAGS = (
    "--prefetch-multiplier=4",
    "--without-gossip",
    "--without-mingle",
    "--without-heartbeat",
    "--loglevel=WARNING",
)

_live: set[Worker] = set()


class WorkerFailed(Exception):
    """The worker did not become ready or died; the message carries its log tail."""


class Worker:
    def __init__(
        self,
        *,
        pool: str,
        concurrency: int,
        env: dict[str, str],
        state_dir: Path,
        cwd: Path,
    ) -> None:
        self.pool = pool
        self.concurrency = concurrency
        self.env = env
        self.state_dir = state_dir
        self.cwd = cwd
        self.log_path = state_dir / f"worker-{pool}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def argv(self) -> list[str]:
        return [
            sys.executable, "-m", "celery", "-A", "bench.app", "worker",
            f"--pool={self.pool}", f"--concurrency={self.concurrency}", *WORKER_FLAGS,
            "-Q", "bench", "-n", f"bench-{self.pool}@bench",
        ]  # fmt: skip

    def start(self) -> None:
        for name in ("ready", "count", "latency"):
            (self.state_dir / name).unlink(missing_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own process group: prefork children die with it
            )
        _live.add(self)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def _check_alive(self) -> None:
        assert self.proc is not None
        rc = self.proc.poll()
        if rc is not None:
            raise WorkerFailed(f"worker exited with {rc}:\n{self.log_tail()}")

    def wait_ready(self, timeout: float) -> float:
        """Block until the worker's ``worker_ready`` handler ran; return its time.time()."""
        path = self.state_dir / "ready"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if path.exists():
                return float(path.read_text())
            time.sleep(0.01)
        raise WorkerFailed(f"worker not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def count(self) -> int:
        try:
            return (self.state_dir / "count").stat().st_size
        except FileNotFoundError:
            return 0

    def wait_count(self, n: int, timeout: float) -> tuple[int, float]:
        """Poll the task counter every 2 ms until ``n`` ran or ``timeout``; return (count, t)."""
        deadline = time.monotonic() + timeout
        while True:
            done = self.count()
            now = time.time()
            if done >= n or time.monotonic() >= deadline:
                return done, now
            self._check_alive()
            time.sleep(0.002)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (warm shutdown), then SIGKILL the whole process group after ``timeout``."""
        proc, self.proc = self.proc, None
        _live.discard(self)
        if proc is None:
            return
        if proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # leftovers: the main process if it hung, or orphaned pool children
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
            pass

    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def stop_all() -> None:
    """Last-resort cleanup (atexit / signal): no worker outlives the orchestrator."""
    for worker in list(_live):
        worker.stop(timeout=5.0)
