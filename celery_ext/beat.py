"""The leader scheduler by default: ``celery_ext.install(app)`` on a pgjobs broker makes
``celery_ext.scheduler:LeaderScheduler`` the app's ``beat_scheduler`` unless the app set one.

Why: Celery's default beat scheduler (``PersistentScheduler``) fires from every process that
runs it, so ``celery worker -B`` on two workers, or a second ``celery beat``, fires every
occurrence twice. With the broker on pgjobs the leader scheduler needs nothing more (its tables
live in the broker's database), so it is the safe default. And the flag users reach for is a
trap: for ``celery worker``, ``-S`` is ``--statedb``, not the scheduler, so ``worker -B -S
celery_ext.scheduler:LeaderScheduler`` silently runs the default scheduler (the worker's flag
is ``--scheduler``).

"Set one" means any layer of the app's configuration other than Celery's defaults names a
beat scheduler: ``Celery(..., beat_scheduler=...)``, ``app.conf.update()`` or
``app.conf.beat_scheduler = ...`` (before or after this runs), ``config_from_object``, or
Celery's older and namespaced names (``CELERYBEAT_SCHEDULER``, ``CELERY_BEAT_SCHEDULER``).
``celery beat -S X`` and ``celery worker --scheduler X`` still choose X.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LEADER", "default_to_leader"]

#: the scheduler made the default on a pgjobs broker
LEADER = "celery_ext.scheduler:LeaderScheduler"


def _on_pgjobs(conf: Any) -> bool:
    url = conf.broker_url  # the CELERY_BROKER_URL environment variable included
    return isinstance(url, str) and url.split(":", 1)[0] == "pgjobs"


def _set_by_app(conf: Any) -> bool:
    """A layer other than Celery's own defaults (the last one) names a beat scheduler."""
    for layer in conf.maps[:-1]:
        for key in layer:
            if str(key).lower().replace("celerybeat_", "beat_").endswith("beat_scheduler"):
                return True
    return False


def _apply(app: Any) -> None:
    conf = app.conf
    if _on_pgjobs(conf) and not _set_by_app(conf):
        conf.beat_scheduler = LEADER


def default_to_leader(app: Any) -> None:
    """Make the leader scheduler ``app``'s default beat scheduler on a pgjobs broker, once the
    app's configuration is loaded (at once when it already is)."""
    if getattr(app, "configured", False):
        _apply(app)
        return

    def configured(sender: Any = None, **_: Any) -> None:
        _apply(sender)

    app.on_after_configure.connect(configured, weak=False)
