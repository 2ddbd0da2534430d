"""Register the ``pgjobs`` URL scheme with kombu, so ``broker_url = "pgjobs://..."`` just works.

kombu has no entry point for transports; its aliases live in ``kombu.transport.TRANSPORT_ALIASES``.
The ``kombu_pgjobs.pth`` file installed with the package imports this module at interpreter start.
To keep start-up cheap it does not import kombu: it waits for ``kombu.transport`` to be imported
(by anyone) and adds the alias then. ``import kombu_pgjobs`` registers it directly as well.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

ALIAS = "pgjobs"
TARGET = "kombu_pgjobs.transport:Transport"


def register(module: ModuleType | None = None) -> None:
    aliases = getattr(module or sys.modules.get("kombu.transport"), "TRANSPORT_ALIASES", None)
    if isinstance(aliases, dict):
        aliases.setdefault(ALIAS, TARGET)


class _Finder(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``kombu.transport`` to register the alias right after it runs."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "kombu.transport":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                exec_module = loader.exec_module  # type: ignore[attr-defined]

                class _Loader(importlib.abc.Loader):
                    def create_module(self, spec: Any) -> Any:
                        return loader.create_module(spec)

                    def exec_module(self, module: ModuleType) -> None:
                        exec_module(module)
                        register(module)

                spec.loader = _Loader()
                return spec
        return None


def install() -> None:
    if "kombu.transport" in sys.modules:
        register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
