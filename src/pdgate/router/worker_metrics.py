"""One `/metrics` exposition for every worker of `pdgate router --workers N`.

The workers share one port (SO_REUSEPORT), so a scrape reaches one of them at random. Each
worker publishes its own exposition once a second to a file in a directory the supervisor
made for the pod (`PDGATE_WORKER_METRICS_DIR`, with its index in `PDGATE_WORKER_INDEX`; the
supervisor sets both, router/http/workers.py), and the worker that answers a scrape serves
its own series and every other worker's from those files: each series gains a
`worker="<index>"` label, so `sum without (worker)` is the pod. Another worker's series are
at most about a second old; a file not refreshed for `STALE_S` (its worker died or is
restarting) is left out. A single-process router is untouched (no label, no files).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from pdgate.common.metrics_registry import NoCreatedRegistry

__all__ = ["DIR_ENV", "INDEX_ENV", "PodRegistry", "pod_registry", "publish_forever"]

log = logging.getLogger("pdgate.router.worker_metrics")
DIR_ENV = "PDGATE_WORKER_METRICS_DIR"
INDEX_ENV = "PDGATE_WORKER_INDEX"
PUBLISH_S = 1.0
STALE_S = 10.0


class PodRegistry(NoCreatedRegistry):
    """This worker's metrics; its scrape (`collect`) is the whole pod's, each series
    labelled with the worker it came from."""

    def __init__(self, directory: Path, index: int) -> None:
        super().__init__()
        self.directory = directory
        self.index = index

    def own_text(self) -> bytes:
        """This worker's exposition alone (what it publishes)."""
        return generate_latest(_Own(self))

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        _add(merged, super().collect(), str(self.index))
        for index, text in self._peers():
            _add(merged, text_string_to_metric_families(text), index)
        return list(merged.values())

    def _peers(self) -> list[tuple[str, str]]:
        found = []
        now = time.time()
        for path in sorted(self.directory.glob("worker-*.prom")):
            index = path.stem.removeprefix("worker-")
            if index == str(self.index):
                continue
            try:
                if now - path.stat().st_mtime > STALE_S:
                    continue
                found.append((index, path.read_text()))
            except OSError:  # replaced or removed while we looked
                continue
        return found


class _Own:
    """The registry's own collectors only, for `generate_latest`."""

    def __init__(self, registry: PodRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return NoCreatedRegistry.collect(self._registry)


def _add(merged: dict[str, Metric], families: Iterable[Metric], worker: str) -> None:
    for family in families:
        target = merged.get(family.name)
        if target is None:
            target = merged[family.name] = Metric(family.name, family.documentation,
                                                  family.type, family.unit)
        target.samples += [Sample(s.name, {**s.labels, "worker": worker}, s.value,
                                  s.timestamp, s.exemplar) for s in family.samples]


def pod_registry(environ: Mapping[str, str]) -> PodRegistry | None:
    """The registry of a `--workers` worker (the supervisor set its directory and index in
    the environment); None for a single-process router."""
    directory, index = environ.get(DIR_ENV), environ.get(INDEX_ENV)
    if not directory or index is None or not index.isdigit():
        return None
    return PodRegistry(Path(directory), int(index))


async def publish_forever(registry: CollectorRegistry) -> None:
    """Write this worker's exposition for its peers every `PUBLISH_S` (a no-op for a
    single-process router's registry). Runs until cancelled."""
    if not isinstance(registry, PodRegistry):
        return
    path = registry.directory / f"worker-{registry.index}.prom"
    tmp = path.with_suffix(".tmp")
    while True:
        try:
            tmp.write_bytes(registry.own_text())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("cannot publish this worker's metrics to %s: %s", path, exc)
        await asyncio.sleep(PUBLISH_S)


def remove_published(registry: CollectorRegistry) -> None:
    """Remove this worker's file at exit (its series leave the pod's scrape at once)."""
    if isinstance(registry, PodRegistry):
        with contextlib.suppress(OSError):
            (registry.directory / f"worker-{registry.index}.prom").unlink()
