"""Kept for a documented import path (docs/reference/metrics.md: from kombu_pgjobs.prometheus import
PgJobsCollector): this name *is* :mod:`kombu_pgjobs.ops.prometheus` (the same module object, so
every name and a monkeypatch of one are shared). New code imports kombu_pgjobs.ops.prometheus."""

import sys

from .ops import prometheus as _module

sys.modules[__name__] = _module
