"""A Celery app whose tasks fail with text PostgreSQL's jsonb refuses (a NUL, a lone surrogate),
for the dead-letter tests of tests/test_bad_input.py.

celery_ext is installed, so a failure becomes a dead letter with its error text. The tasks are
``acks_late=False``: their message is acked before they run, so the dead letter is the only
record of the failure left. Each records its start in ``{schema}.pgjobs_test_start`` first.
"""

from __future__ import annotations

from celery import Celery

import celery_ext

from . import common

app = Celery("hostile", broker=common.broker())
celery_ext.install(app)
app.conf.update(**common.settings())


def _start(label: str) -> None:
    common.db().execute(
        f'INSERT INTO "{common.schema()}".pgjobs_test_start (label, pid) '
        "VALUES (%s, pg_backend_pid())", (label,))


@app.task(name="hostile.fail_nul", acks_late=False, shared=False)
def fail_nul(label: str) -> None:
    _start(label)
    raise ValueError(f"bad\x00byte in {label}")


@app.task(name="hostile.fail_surrogate", acks_late=False, shared=False)
def fail_surrogate(label: str) -> None:
    _start(label)
    raise ValueError(f"undecodable \udc80 file name in {label}")
