"""Kept for a documented import path (docs/testing.md: the embedded server): this name *is*
:mod:`kombu_pgjobs.store.embedded` (the same module object, so every name and a monkeypatch of
one are shared). New code imports kombu_pgjobs.store.embedded."""

import sys

from .store import embedded as _module

sys.modules[__name__] = _module
