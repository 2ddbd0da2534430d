"""Register the ``pgjobs`` URL scheme with kombu, so ``broker_url = "pgjobs://..."`` just works.

kombu has no entry point for transports; its aliases live in ``kombu.transport.TRANSPORT_ALIASES``.
The ``kombu_pgjobs.pth`` file installed with the package imports this module at interpreter start.
To keep every Python start-up cheap it imports nothing heavy and not kombu: it waits for
``kombu.transport`` to be imported (by anyone) and adds the alias then. ``import kombu_pgjobs``
registers it directly as well.

The same hook makes the rest of what an app that only changed ``broker_url`` expects work, each
when (and only if) the module it completes is imported: Flower's broker page and queue-length
API (``flower.utils.broker``: :mod:`kombu_pgjobs.ops.flower`) and ``celery inspect scheduled``
(``celery.worker.control``: :mod:`kombu_pgjobs.broker.scheduled`). kombu_pgjobs imports neither
Flower nor Celery: it is handed their module as it is loaded.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote

ALIAS = "pgjobs"
TARGET = "kombu_pgjobs.broker.transport:Transport"


def register(module: object = None) -> None:
    aliases = getattr(module or sys.modules.get("kombu.transport"), "TRANSPORT_ALIASES", None)
    if isinstance(aliases, dict):
        aliases.setdefault(ALIAS, TARGET)
    _teach_host_lists()


def _teach_host_lists() -> None:
    """Let kombu's URL parser read libpq's multi-host URLs for pgjobs.

    ``pgjobs://app@db1:5432,db2:5432/app`` lists a port per host, which kombu's parser (one
    port per URL) refuses with ValueError before any transport runs. For a pgjobs URL whose host
    part lists hosts, the host list goes through whole as the hostname (ports included) with no
    port; the transport splits it (``kombu_pgjobs.url.host_list``). Every other URL, and every
    other scheme, is parsed by kombu exactly as before."""
    import kombu.utils.url as kombu_url  # kombu.transport is loaded: cheap

    original = kombu_url._parse_url
    if getattr(original, "pgjobs_hosts", False):
        return

    def parse(url: str) -> Any:
        scheme, sep, rest = url.partition("://")
        if scheme == ALIAS and sep:
            # a password with an unescaped / ? or # would be read as host and port, and
            # kombu's ValueError would quote it ("Port could not be cast ... as 'pa'")
            from .url import check_userinfo

            check_userinfo(url)
            netloc = re.split(r"[/?#]", rest, maxsplit=1)[0]
            userinfo, at, hosts = netloc.rpartition("@")
            try:
                if "," in hosts:
                    parts = original(f"{scheme}://{userinfo}{at}localhost{rest[len(netloc):]}")
                    return parts._replace(hostname=unquote(hosts), port=None)
                return original(url)
            except ValueError as exc:
                if "netloc" not in str(exc):  # a port that is not a number: no secret in it
                    raise
                from .errors import InvalidURL  # urllib's text quotes the netloc, password too
                from .url import masked

                raise InvalidURL(f"broker URL {masked(url)!r} is malformed: its user, password "
                                 "or host holds characters a URL cannot have (percent-encode "
                                 "the password)") from None
        return original(url)

    parse.pgjobs_hosts = True  # type: ignore[attr-defined]
    kombu_url._parse_url = parse


def _flower(module: object) -> None:
    try:
        from .ops.flower import register as register_flower

        register_flower(module)
    except Exception:  # never break the import of Flower itself
        _hook_failed("flower.utils.broker")


def _celery_control(module: object) -> None:
    try:
        from .broker.scheduled import install as install_scheduled

        install_scheduled(module)
    except Exception:  # never break the import of Celery itself
        _hook_failed("celery.worker.control")


def _hook_failed(name: str) -> None:
    import logging

    logging.getLogger("kombu_pgjobs").warning(
        "pgjobs could not complete %s (Flower queue lengths or inspect scheduled on pgjobs "
        "stay Celery's own)", name, exc_info=True)


#: module name -> what to do to that module once it is loaded
HOOKS: dict[str, Callable[[object], None]] = {
    "kombu.transport": register,
    "flower.utils.broker": _flower,
    "celery.worker.control": _celery_control,
}


class _RegisteringLoader:
    """Runs the real loader, then the module's hook on the fresh module."""

    def __init__(self, inner: object, hook: Callable[[object], None]) -> None:
        self.inner = inner
        self.hook = hook

    def create_module(self, spec: object) -> object:
        return self.inner.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        self.inner.exec_module(module)  # type: ignore[attr-defined]
        self.hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ...: the real loader's
        return getattr(self.inner, name)


class _Finder:
    """A meta-path finder that only wraps the loaders of the modules in :data:`HOOKS`."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        hook = HOOKS.get(fullname)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader, hook)
                return spec
        return None


def install() -> None:
    for name, hook in HOOKS.items():
        module = sys.modules.get(name)
        if module is not None:  # loaded before this hook: complete it now
            hook(module)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
