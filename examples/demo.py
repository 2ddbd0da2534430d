"""Run a real `celery worker` on pgjobs, publish tasks and watch them complete.

    python examples/demo.py            # embedded PostgreSQL (pgjobs:// with no host)
    PGJOBS_DEMO_URL=pgjobs://postgres@127.0.0.1:5432/test python examples/demo.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
N = int(os.environ.get("PGJOBS_DEMO_TASKS", "20"))


def main() -> int:
    # A queue of its own: a worker left running elsewhere on the same server cannot take
    # this run's tasks. SIGTERM (e.g. from `timeout`) still stops the worker below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    queue = f"demo-{uuid.uuid4().hex[:8]}"
    url = os.environ.setdefault("PGJOBS_DEMO_URL", "pgjobs://")
    print(f"broker: {url}  (pgjobs:// with no host = embedded PostgreSQL)", flush=True)
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "demo_app", "worker", "-l", "info",
         "-P", "threads", "-c", "4", "-n", f"{queue}@%h", "-Q", queue,
         "--without-gossip", "--without-mingle"],
        cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    assert worker.stdout is not None
    done = 0
    deadline = time.monotonic() + 120
    try:
        for line in worker.stdout:
            if ("pgjobs" in line and ("embedded" in line or "data" in line)) \
                    or "ERROR" in line or "Traceback" in line:
                print("worker:", line.strip(), flush=True)
            if " ready." in line:
                print("worker ready; publishing", N, "tasks", flush=True)
                sys.path.insert(0, str(HERE))
                from demo_app import add
                for i in range(N):
                    add.apply_async((i, i), queue=queue)
            if "succeeded" in line:
                done += 1
                print(f"[{done}/{N}]", line.split("]", 1)[-1].strip(), flush=True)
                if done == N:
                    print(f"all {N} tasks completed through pgjobs", flush=True)
                    return 0
            if time.monotonic() > deadline:
                print("timed out", file=sys.stderr)
                return 1
        print("worker exited early", file=sys.stderr)
        return 1
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
