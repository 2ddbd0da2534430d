"""A Celery app in poll-only mode, for a broker behind PgBouncer in transaction pooling.

``use_listen_notify=False``: LISTEN cannot work through transaction pooling (the listening
session is whichever server connection ran the LISTEN, shared with other clients) and no
statement is prepared. The broker URL (the bouncer's) comes from ``PGJOBS_TEST_BROKER``; the
recording connection goes straight to the database. Nothing here imports kombu_pgjobs.
"""

from __future__ import annotations

import os

from celery import Celery

from tests.apps import common

SCHEMA = common.schema()

app = Celery("bounced", broker=common.broker())
_settings = common.settings(task_acks_late=True)
_settings["broker_transport_options"].update(
    use_listen_notify=False,
    polling_interval=float(os.environ.get("PGJOBS_TEST_POLL", "0.2")),
    vacuum_every=int(os.environ.get("PGJOBS_TEST_VACUUM_EVERY", "2000")),
)
# options a stock PgBouncer cannot carry (startup parameters), set to 0 by the test
_settings["broker_transport_options"].update(
    dict.fromkeys(filter(None, os.environ.get("PGJOBS_TEST_ZERO_OPTIONS", "").split(",")), 0))
app.conf.update(_settings)


@app.task(name="record")
def record(label: str) -> None:
    common.db().execute(
        f'INSERT INTO "{SCHEMA}".pgjobs_test_run (label, pid, started, finished) '
        "VALUES (%s, %s, clock_timestamp(), clock_timestamp())",
        (label, os.getpid()),
    )
