"""Kept for a documented import path (docs/outbox.md: kombu_pgjobs.outbox.transaction() /
publish()): this name *is* :mod:`kombu_pgjobs.broker.outbox` (the same module object, so every
name and a monkeypatch of one are shared). New code imports kombu_pgjobs.broker.outbox."""

import sys

from .broker import outbox as _module

sys.modules[__name__] = _module
