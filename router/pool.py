"""Engine endpoints, their health, and in-flight accounting.

The pool is static (URLs from the config). A background task probes every engine every
`interval` seconds; the orchestrator also marks an engine unhealthy the moment a connect
fails, and the next passing probe brings it back. In-flight counts are kept with
`track()`, a context manager, so every exit path (error, cancel, client disconnect) releases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client import Gauge

from router.metrics import RouterMetrics

__all__ = ["Endpoint", "EndpointPool", "Role"]

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
Probe = Callable[["Endpoint"], Awaitable[bool]]


@dataclass(eq=False)
class Endpoint:
    """One engine. `url` is its base URL without a trailing slash; `index` is its position
    within its role (stable, used by policies). Mutated only on the event loop."""

    url: str
    role: Role
    index: int
    healthy: bool = True
    in_flight: int = 0
    _in_flight_gauge: Gauge | None = field(default=None, repr=False)
    _healthy_gauge: Gauge | None = field(default=None, repr=False)

    def set_healthy(self, healthy: bool) -> None:
        """Record a health verdict (logs transitions, updates the gauge)."""
        if healthy != self.healthy:
            log.warning("engine %s (%s) is now %s", self.url, self.role,
                        "healthy" if healthy else "UNHEALTHY")
        self.healthy = healthy
        if self._healthy_gauge is not None:
            self._healthy_gauge.set(1 if healthy else 0)


class EndpointPool:
    """The static set of prefill and decode endpoints."""

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], metrics: RouterMetrics
    ) -> None:
        self._by_role: dict[Role, list[Endpoint]] = {
            "prefill": [self._make(u, "prefill", i, metrics) for i, u in enumerate(prefill)],
            "decode": [self._make(u, "decode", i, metrics) for i, u in enumerate(decode)],
        }

    @staticmethod
    def _make(url: str, role: Role, index: int, metrics: RouterMetrics) -> Endpoint:
        url = url.rstrip("/")
        ep = Endpoint(
            url, role, index,
            _in_flight_gauge=metrics.engine_in_flight.labels(url, role),
            _healthy_gauge=metrics.engine_healthy.labels(url, role),
        )
        ep.set_healthy(True)
        return ep

    def endpoints(self, role: Role) -> list[Endpoint]:
        """All endpoints of `role`, healthy or not, in config order."""
        return self._by_role[role]

    def all(self) -> list[Endpoint]:
        """Every endpoint, prefill first."""
        return self._by_role["prefill"] + self._by_role["decode"]

    def healthy(self, role: Role) -> list[Endpoint]:
        """Endpoints of `role` whose last verdict was healthy."""
        return [ep for ep in self._by_role[role] if ep.healthy]

    def ready(self) -> bool:
        """True when at least one prefill and one decode engine are healthy."""
        return any(ep.healthy for ep in self._by_role["prefill"]) and any(
            ep.healthy for ep in self._by_role["decode"]
        )

    @contextlib.contextmanager
    def track(self, ep: Endpoint) -> Iterator[Endpoint]:
        """Count one in-flight request on `ep` for the duration of the block."""
        ep.in_flight += 1
        gauge = ep._in_flight_gauge
        if gauge is not None:
            gauge.inc()
        try:
            yield ep
        finally:
            ep.in_flight -= 1
            if gauge is not None:
                gauge.dec()

    async def check_all(self, probe: Probe) -> None:
        """Probe every endpoint once, concurrently, and record the verdicts."""
        eps = self.all()
        results = await asyncio.gather(*(probe(ep) for ep in eps), return_exceptions=True)
        for ep, ok in zip(eps, results, strict=True):
            ep.set_healthy(ok is True)

    async def run_health_checks(self, probe: Probe, interval_s: float) -> None:
        """Probe forever every `interval_s` seconds; cancel the task to stop it."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_all(probe)
            except Exception:  # a bug in a probe must not end health checking
                log.exception("health check round failed")
