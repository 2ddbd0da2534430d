"""Groups and chords publish in one statement, without a change to the app's code.

``celery_ext.install(app)`` makes every ``group(...).apply_async()`` of an installed app whose
producer is on pgjobs run inside :func:`kombu_pgjobs.batch`: the group's messages (and a
chord's: its header, and the ``celery.chord_unlock`` its result backend may send) are held
while Celery builds them and inserted in one statement when the group's last one is built.
What that gives the group is what ``batch()`` gives a block:

* **durable when ``apply_async()`` returns**: the statement has committed by then (with
  ``durable_publish=False``, committed and visible, its flush to disk not waited for, as for
  ``delay()``);
* **all or none**: a member that cannot be published (a message too large, a bad tenant or
  limit key, an argument that does not serialize, a tenant over its queue cap) fails the
  whole group, and nothing of it is written; the exception is the member's own, with a note
  saying so;
* **ids as Celery gives them**: the ``GroupResult`` and its members carry the ids Celery froze
  before publishing; nothing is renamed.

The messages are held in memory until the INSERT: a fan-out of hundreds of thousands is one
statement of that size (send it as several groups).

A group published inside an open ``kombu_pgjobs.batch()`` joins it (the outer block inserts
everything when it exits), and inside ``celery_ext.transaction(conn)`` the rows are written in
the app's transaction as any publish there is. A group of another broker, a group given a
``producer=`` of another broker, an app without ``celery_ext.install`` and eager mode
(``task_always_eager``) are left exactly as Celery runs them.

Two per-message costs are paid once per group instead (nothing else about a member changes):
kombu's ``maybe_declare`` of the member's queue (kombu copies and binds the queue entity on
every publish only to find it declared already: each distinct queue entity is declared once,
through kombu, on the group's producer), and celery_ext's reading and checking of the app's
limit settings (read once per group: a group is one publish call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from celery import canvas

from kombu_pgjobs.broker.batching import batch
from kombu_pgjobs.broker.transport import Transport

from .state import installed

__all__ = ["install_groups", "once_per_group"]

T = TypeVar("T")

_local = threading.local()
_installed_lock = threading.Lock()
_originals: dict[str, Callable[..., Any]] = {}
_NOTE = "celery_ext: nothing of this"


def once_per_group(conf: Any, read: Callable[[Any], T]) -> T:
    """``read(conf)``, evaluated once per batched group on this thread (every call outside
    one): the app's settings are read and validated per publish, and a group is one publish
    call. An invalid setting raises, uncached, at the first member."""
    memo: dict[tuple[int, Any], Any] | None = getattr(_local, "settings", None)
    if memo is None:
        return read(conf)
    key = (id(conf), read)
    try:
        return memo[key]  # type: ignore[no-any-return]
    except KeyError:
        value = memo[key] = read(conf)
        return value


def _on_pgjobs(producer: Any) -> bool:
    connection = getattr(producer, "connection", None)
    return connection is not None and isinstance(connection.transport, Transport)


@contextmanager
def _declare_once(producer: Any) -> Iterator[None]:
    """For the group's duration, kombu's ``producer.maybe_declare`` runs once per queue
    entity: later calls with the same entity return False (declared) without kombu's copy and
    bind of it. An outer group's wrapper on the same producer is left in charge."""
    if "maybe_declare" in vars(producer):
        yield
        return
    real = producer.maybe_declare
    seen: dict[int, Any] = {}  # id -> entity (kept, so an id is not reused meanwhile)

    def maybe_declare(entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        if id(entity) in seen:
            return False
        declared = real(entity, retry, **retry_policy)
        seen[id(entity)] = entity
        return declared

    producer.maybe_declare = maybe_declare
    try:
        yield
    finally:
        del producer.maybe_declare


@contextmanager
def _batched(what: str, size: str) -> Iterator[None]:
    """One ``batch()`` (joining an outer one), with the settings read once per group."""
    outer = getattr(_local, "settings", None)
    if outer is None:
        _local.settings = {}
    try:
        with batch():
            yield
    except Exception as exc:
        noted = any(str(n).startswith(_NOTE) for n in getattr(exc, "__notes__", ()))
        if hasattr(exc, "add_note") and not noted:  # Python 3.11+; once (a chord's header)
            exc.add_note(f"{_NOTE} {what} ({size}) was published (a group publishes all or "
                         "none)")
        raise
    finally:
        if outer is None:
            _local.settings = None


def _size(tasks: Any) -> str:
    """The member count for the error note, when known without reading a lazy generator
    (Celery reads one as it publishes)."""
    return f"{len(tasks)} messages" if isinstance(tasks, (list, tuple)) else "its messages"


def _group_apply_async(self: Any, args: Any = None, kwargs: Any = None,
                       add_to_parent: bool = True, producer: Any = None, link: Any = None,
                       link_error: Any = None, **options: Any) -> Any:
    original = _originals["group"]
    app = self.app
    if not installed(app) or not self.tasks or link is not None or link_error is not None \
            or app.conf.task_always_eager:
        return original(self, args, kwargs, add_to_parent, producer, link, link_error,
                        **options)
    if producer is None and not _pgjobs_url(app):
        return original(self, args, kwargs, add_to_parent, producer, link, link_error,
                        **options)
    with app.producer_or_acquire(producer) as prod:
        if not _on_pgjobs(prod):
            return original(self, args, kwargs, add_to_parent, prod, link, link_error,
                            **options)
        with _batched("group", _size(self.tasks)), _declare_once(prod):
            return original(self, args, kwargs, add_to_parent, prod, link, link_error,
                            **options)


def _chord_run(self: Any, header: Any, body: Any, partial_args: Any, app: Any = None,
               *args: Any, **kwargs: Any) -> Any:
    """The chord's header and what its result backend publishes to wait for it (Celery's
    ``chord_unlock`` on a backend without native joins) in one batch."""
    original = _originals["chord"]
    owner = app or self._get_app(body)
    if not installed(owner) or owner.conf.task_always_eager or not _pgjobs_url(owner):
        return original(self, header, body, partial_args, app, *args, **kwargs)
    with _batched("chord", _size(getattr(header, "tasks", ()))):
        return original(self, header, body, partial_args, app, *args, **kwargs)


def _pgjobs_url(app: Any) -> bool:
    """The app writes to a pgjobs broker (its producer's transport is checked as well)."""
    conf = app.conf
    url = conf.broker_write_url or conf.broker_url
    if isinstance(url, (list, tuple)):
        url = url[0] if url else None
    if not isinstance(url, str):
        return False
    return url.split(":", 1)[0].split("+", 1)[0] == "pgjobs"


def install_groups() -> None:
    """Wrap Celery's ``group.apply_async`` and ``chord.run`` once per process; the wrappers
    change nothing for an app celery_ext is not installed in."""
    with _installed_lock:
        if _originals:
            return
        _originals["group"] = canvas.group.apply_async
        _originals["chord"] = canvas._chord.run
        canvas.group.apply_async = _group_apply_async  # type: ignore[method-assign]
        canvas._chord.run = _chord_run  # type: ignore[method-assign]
