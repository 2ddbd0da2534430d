"""Kept for a documented import path (docs/tenancy.md: kombu_pgjobs.core.take_publish_outcome()):
this name *is* :mod:`kombu_pgjobs.store.core` (the same module object, so every name and a
monkeypatch of one are shared). New code imports kombu_pgjobs.store.core."""

import sys

from .store import core as _module

sys.modules[__name__] = _module
