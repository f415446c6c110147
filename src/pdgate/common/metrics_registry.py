"""The Prometheus registry every pdgate process builds its metrics on."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

__all__ = ["NoCreatedRegistry"]


class NoCreatedRegistry(CollectorRegistry):
    """A registry whose scrape leaves out the `*_created` series prometheus_client adds to
    every counter and histogram child. They double the series count, dashboards never use
    them, and the library's own switch (`disable_created_metrics()` or
    PROMETHEUS_DISABLE_CREATED_SERIES) is process-global: two apps in one test process
    would fight over it. Every pdgate process builds its metrics on one of these."""

    def collect(self) -> Iterable[Metric]:
        for family in super().collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
