"""Side-by-side Celery broker benchmark: one command, same app and worker settings per broker.

Run ``python -m bench --help``; ``bench/README.md`` explains every figure.
"""

from __future__ import annotations
