"""The apps celery_ext is installed in (signals are process-wide; only these apps' tasks are
handled)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["UNSET", "add_app", "declared_option", "installed", "real_app"]

#: what declared_option returns for an option the class itself does not set
UNSET = object()

_APPS: weakref.WeakSet[Any] = weakref.WeakSet()


def real_app(app: Any) -> Any:
    """The app itself when given Celery's ``current_app`` (or any ``celery.local.Proxy``):
    a proxy is a different object, so recording it, or looking it up, would miss the app."""
    get = getattr(type(app), "_get_current_object", None)
    return app._get_current_object() if get is not None else app


def add_app(app: Any) -> None:
    _APPS.add(real_app(app))


def installed(app: Any) -> bool:
    return real_app(app) in _APPS


def declared_option(cls: type, option: str) -> Any:
    """The value a task class itself gives ``option`` (a function given as a task option is
    kept as a staticmethod: unwrapped here), or :data:`UNSET`."""
    value = cls.__dict__.get(option, UNSET)
    return value.__func__ if isinstance(value, staticmethod) else value
