"""``celery inspect scheduled`` answered from Postgres: now in :mod:`kombu_pgjobs.broker.scheduled`,
installed with no step by the hook that registers the ``pgjobs`` URL scheme when Celery loads
``celery.worker.control``. Kept so imports of this module go on working."""

from __future__ import annotations

from celery.worker import control

from kombu_pgjobs.broker.scheduled import LIMIT, install, scheduled

__all__ = ["LIMIT", "install_scheduled", "scheduled"]


def install_scheduled() -> None:
    """Replace Celery's ``scheduled`` inspect command (process-wide; idempotent)."""
    install(control)
