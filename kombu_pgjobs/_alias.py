"""Register the ``pgjobs`` URL scheme with kombu, so ``broker_url = "pgjobs://..."`` just works.

kombu has no entry point for transports; its aliases live in ``kombu.transport.TRANSPORT_ALIASES``.
The ``kombu_pgjobs.pth`` file installed with the package imports this module at interpreter start.
To keep every Python start-up cheap it imports nothing heavy and not kombu: it waits for
``kombu.transport`` to be imported (by anyone) and adds the alias then. ``import kombu_pgjobs``
registers it directly as well.
"""

from __future__ import annotations

import sys

ALIAS = "pgjobs"
TARGET = "kombu_pgjobs.transport:Transport"


def register(module: object = None) -> None:
    aliases = getattr(module or sys.modules.get("kombu.transport"), "TRANSPORT_ALIASES", None)
    if isinstance(aliases, dict):
        aliases.setdefault(ALIAS, TARGET)


class _RegisteringLoader:
    """Runs the real loader, then registers the alias on the fresh module."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def create_module(self, spec: object) -> object:
        return self.inner.create_module(spec)  # type: ignore[attr-defined]

    def exec_module(self, module: object) -> None:
        self.inner.exec_module(module)  # type: ignore[attr-defined]
        register(module)


class _Finder:
    """A meta-path finder that only wraps the loader of ``kombu.transport``."""

    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        if fullname != "kombu.transport":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


def install() -> None:
    if "kombu.transport" in sys.modules:
        register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
