"""pgjobs's metrics as a ``prometheus_client`` Collector.

``pgjobs metrics --serve`` is a ready-made exporter; an app that already exposes metrics with
``prometheus_client`` registers pgjobs's in its own registry instead::

    from prometheus_client import REGISTRY
    from kombu_pgjobs.prometheus import PgJobsCollector

    REGISTRY.register(PgJobsCollector("postgresql://app@db/app", schema="pgjobs"))

Every scrape reads the schema's tables (:func:`kombu_pgjobs.ops.metrics.collect`, a few read-only
statements on one connection of the collector's own), so the numbers are the same from any
process: in a multiprocess setup (gunicorn with ``PROMETHEUS_MULTIPROC_DIR``) register it in the
one registry that serves the scrape, not in every worker, and register it once per database.
A scrape that cannot read the schema reports ``pgjobs_up 0`` and nothing else (logged), never
an exception into the exposition. Needs ``prometheus_client`` (``kombu-pgjobs[prometheus]``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..errors import PgJobsError
from .metrics import DEFAULT_QUEUES, DEFAULT_TENANTS, MetricsSource, log
from .metrics import Metric as PgMetric

__all__ = ["PgJobsCollector"]


def _family(m: PgMetric) -> Metric:
    labels = sorted({k for lb, _ in m.samples for k in lb})
    cls = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
    family = cls(m.name, m.help, labels=labels)
    for lb, value in m.samples:
        family.add_metric([str(lb.get(k, "")) for k in labels], float(value))
    return family


class PgJobsCollector(Collector):
    """The metrics of one pgjobs schema (``dsn``: a libpq connection string or URL).
    ``queues``: queues with series of their own (the rest summed as ``queue="(other)"``; 0:
    every queue); ``tenants``: tenants with series of their own (0: none)."""

    def __init__(self, dsn: str, schema: str = "pgjobs", *, queues: int = DEFAULT_QUEUES,
                 tenants: int = DEFAULT_TENANTS) -> None:
        self.source = MetricsSource(dsn, schema, queues=queues, tenants=tenants)

    def describe(self) -> list[Any]:
        """Nothing up front: registering must not query the database."""
        return []

    def collect(self) -> Iterator[Metric]:
        try:
            metrics = self.source.metrics()
        except (psycopg.Error, PgJobsError) as exc:
            log.warning("pgjobs.metrics.failed %s", exc, extra={"action": "metrics"})
            self.source.close()
            up = GaugeMetricFamily("pgjobs_up",
                                   "1 when the exporter could read the pgjobs schema.")
            up.add_metric([], 0.0)
            yield up
            return
        for m in metrics:
            yield _family(m)

    def close(self) -> None:
        self.source.close()
