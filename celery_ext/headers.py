"""Task options that travel as message headers.

``max_attempts`` becomes ``x-pgjobs-max-attempts`` on every message of the task. It is added in
the task's own ``apply_async`` (which ``delay``, canvas signatures and ``Task.retry`` all go
through) rather than in Celery's process-wide ``before_task_publish`` signal: that signal names
the task only by its name, so in a process with two apps it could not tell a celery_ext app's
task from a plain app's task of the same name. The transport reads the header at publish into
the row, so the cap holds wherever the message is consumed. A header given explicitly
(``apply_async(headers=...)``) wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kombu_pgjobs.store.core import MAX_ATTEMPTS_HEADER

__all__ = ["with_task_headers"]


def with_task_headers(task: Any, headers: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The headers to publish ``task`` with: ``headers`` plus those its options imply."""
    max_attempts = getattr(task, "max_attempts", None)
    if max_attempts is None:
        return dict(headers) if headers is not None else None
    out = dict(headers or {})
    out.setdefault(MAX_ATTEMPTS_HEADER, int(max_attempts))
    return out
