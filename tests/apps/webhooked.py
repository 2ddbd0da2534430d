"""A Celery app with celery_ext and its webhook delivery task, for tests/test_webhooks.py.

Settings from the environment (besides tests/apps/common.py's): PGJOBS_TEST_WEBHOOK_ALLOW
(comma-separated pgjobs_webhook_allow_hosts; empty: none), PGJOBS_TEST_WEBHOOK_TIMEOUT,
PGJOBS_TEST_WEBHOOK_ATTEMPTS (pgjobs_webhook_max_attempts), PGJOBS_TEST_WEBHOOK_KEYS
(comma-separated pgjobs_webhook_secret_keys; unset: none). The backoff base is 0.1 s so that
retries take a fraction of a second.
"""

from __future__ import annotations

import os

from celery import Celery

import celery_ext
from tests.apps import common

app = Celery("webhooked", broker=common.broker())
celery_ext.install(app)
import celery_ext.webhooks  # noqa: E402  (registers the delivery task)

app.conf.update(common.settings(
    task_acks_late=True,
    pgjobs_webhook_allow_hosts=[h for h in os.environ.get(
        "PGJOBS_TEST_WEBHOOK_ALLOW", "127.0.0.1").split(",") if h],
    pgjobs_webhook_timeout=float(os.environ.get("PGJOBS_TEST_WEBHOOK_TIMEOUT", "5")),
    pgjobs_webhook_max_attempts=int(os.environ.get("PGJOBS_TEST_WEBHOOK_ATTEMPTS", "3")),
    pgjobs_webhook_backoff=0.1,
    pgjobs_webhook_backoff_max=5.0,
    pgjobs_webhook_disable_after=int(os.environ.get("PGJOBS_TEST_WEBHOOK_DISABLE_AFTER",
                                                    "20")),
    pgjobs_webhook_secret_keys=os.environ["PGJOBS_TEST_WEBHOOK_KEYS"].split(",")
    if os.environ.get("PGJOBS_TEST_WEBHOOK_KEYS") else None,
))
