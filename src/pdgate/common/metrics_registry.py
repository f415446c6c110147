"""The Prometheus registry every pdgate process builds its metrics on, and the series every
such process exports about itself (build info, `process_*`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector
from prometheus_client.metrics_core import Metric

__all__ = ["COMMIT_ENV", "NoCreatedRegistry", "register_process_series"]

COMMIT_ENV = "PDGATE_COMMIT"  # set by the Dockerfile's build argument of the same name


def register_process_series(registry: CollectorRegistry, version: str,
                            environ: Mapping[str, str]) -> None:
    """Register on `registry` what a pdgate process says about itself:
    `pdgate_build_info{version,commit}` (always 1; the commit from `environ`'s PDGATE_COMMIT,
    the images' build argument, else `unknown`) and the process' own `process_*` series
    (resident and virtual memory, CPU seconds, open and max fds, start time:
    prometheus_client's ProcessCollector, read from /proc at each scrape)."""
    build = Gauge("pdgate_build_info", "pdgate version and commit (always 1)",
                  ["version", "commit"], registry=registry)
    build.labels(version, environ.get(COMMIT_ENV) or "unknown").set(1)
    ProcessCollector(registry=registry)


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
