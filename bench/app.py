"""The Celery app every broker is measured with. Only the broker URL and its options differ.

Environment:
  BENCH_BROKER_URL          broker URL (required for a real run; defaults to memory://)
  BENCH_TRANSPORT_OPTIONS   JSON object passed as ``broker_transport_options``
  BENCH_STATE_DIR           directory for the ready/count/latency files (see below)

Task completion is observed without a result backend and without touching any broker, so
the signal is the same for every broker: each no-op task appends one byte to
``$BENCH_STATE_DIR/count`` (an ``O_APPEND`` write of one byte is atomic across threads and
prefork children, so the file size is the number of executed tasks; one syscall, ~2 µs).
The latency task appends its own measured delay as a text line to ``latency``. The
``worker_ready`` signal writes ``time.time()`` to ``ready`` in the worker's main process,
right after the consumer started consuming and before the event loop runs.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery
from celery.signals import worker_ready

PGJOBS_IMPORT_ERROR: str | None = None
try:  # registers the pgjobs:// transport alias; the harness still runs without it
    import kombu_pgjobs  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the transport's state
    PGJOBS_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

QUEUE = "bench"

_STATE_DIR = os.environ.get("BENCH_STATE_DIR", "")
_fds: dict[tuple[int, str], int] = {}


def _append(name: str, data: bytes) -> None:
    """Append to a state file with one write; the fd is opened once per process."""
    if not _STATE_DIR:
        return
    key = (os.getpid(), name)
    fd = _fds.get(key)
    if fd is None:
        fd = os.open(os.path.join(_STATE_DIR, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        _fds[key] = fd
    os.write(fd, data)


def _transport_options() -> dict[str, Any]:
    raw = os.environ.get("BENCH_TRANSPORT_OPTIONS", "")
    if not raw:
        return {}
    opts = json.loads(raw)
    if not isinstance(opts, dict):
        raise ValueError("BENCH_TRANSPORT_OPTIONS must be a JSON object")
    return opts


app = Celery("bench", broker=os.environ.get("BENCH_BROKER_URL", "memory://"))
app.conf.update(
    broker_transport_options=_transport_options(),
    broker_connection_retry_on_startup=True,
    broker_connection_max_retries=3,
    result_backend=None,
    task_ignore_result=True,
    task_acks_late=False,
    task_default_queue=QUEUE,
    worker_prefetch_multiplier=4,
    worker_hijack_root_logger=True,
    worker_redirect_stdouts=False,
)


@app.task(name="bench.noop")
def noop(seq: int) -> None:
    """No work, one byte of evidence that it ran."""
    _append("count", b"1")


@app.task(name="bench.stamp")
def stamp(sent: float) -> None:
    """Record publish-to-start delay; ``sent`` is ``time.time()`` taken just before publish."""
    delay = time.time() - sent
    _append("latency", f"{delay:.6f}\n".encode())


@app.task(name="bench.stages", bind=True, acks_late=True)
def stages(self: Any, sent: float) -> None:
    """``bench.stages``: the body's start, and from the pgjobs row still held (acks late) the
    publish transaction's ``now()`` and the claim's (its lease's start)."""
    started = time.time()
    created = claimed = float("nan")
    url = os.environ.get("BENCH_BROKER_URL", "")
    if url.startswith("pgjobs://"):
        import psycopg

        opts = _transport_options()
        schema = str(opts.get("schema", "pgjobs")).replace('"', '""')
        ttl = float(opts.get("lease_ttl", 30))
        with psycopg.connect("postgresql://" + url[len("pgjobs://"):], autocommit=True) as db:
            row = db.execute(
                f'SELECT extract(epoch FROM created_at), '
                f'extract(epoch FROM lease_expires_at) - %s FROM "{schema}".pgjobs_job '
                f"WHERE queue = %s AND state = 'running' AND message -> 'headers' ->> 'id' = %s",
                (ttl, QUEUE, self.request.id)).fetchone()
        if row:
            created, claimed = float(row[0]), float(row[1])
    _append("stages", f"{sent:.6f} {started:.6f} {created:.6f} {claimed:.6f}\n".encode())


@worker_ready.connect
def _on_worker_ready(**_: Any) -> None:
    if not _STATE_DIR:
        return
    path = os.path.join(_STATE_DIR, "ready")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{time.time():.6f}")
    os.replace(tmp, path)
