"""Kept for a documented import path (docs/dashboard.md: from kombu_pgjobs.dashboard import
create_app): this name *is* :mod:`kombu_pgjobs.ops.dashboard` (the same module object, so every
name and a monkeypatch of one are shared). New code imports kombu_pgjobs.ops.dashboard."""

import sys

from .ops import dashboard as _module

sys.modules[__name__] = _module
