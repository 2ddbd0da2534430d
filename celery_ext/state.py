"""The apps celery_ext is installed in (signals are process-wide; only these apps' tasks are
handled)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["add_app", "installed"]

_APPS: weakref.WeakSet[Any] = weakref.WeakSet()


def add_app(app: Any) -> None:
    _APPS.add(app)


def installed(app: Any) -> bool:
    return app in _APPS
