"""Learning how many DP ranks an engine runs, for a role configured with DP size 0.

vLLM's API server labels each engine core's series on `/metrics` with `engine="<dp rank>"`
(router/dp_ranks.py: `dp_size_of_metrics`); it has no cheaper place that says it (its
`/server_info` exists only in dev mode). `DPSizeLearner` reads that page from every engine
URL of the roles it learns for, once per URL, and reshapes the pool (`EndpointPool.resize`).
Until an engine's size is known (it is still starting, or is not vLLM) it is one endpoint
without a rank, whose legs vLLM balances itself. Runs on the event loop (app lifespan).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

from pdgate.router.config import RouterConfig
from pdgate.router.dp_ranks import dp_size_of_metrics
from pdgate.router.pool import EndpointPool, Role

__all__ = ["DPSizeLearner", "open_dp_learning"]

log = logging.getLogger(__name__)

MetricsPage = Callable[[str], Awaitable[bytes | None]]


class DPSizeLearner:
    """Learns each engine URL's DP size from `fetch(url)` (its `/metrics`, None when it
    cannot be read) for the `roles` configured with size 0."""

    def __init__(self, pool: EndpointPool, fetch: MetricsPage, roles: Sequence[Role]) -> None:
        self._pool = pool
        self._fetch = fetch
        self._roles = tuple(roles)
        self._learnt: set[tuple[str, Role]] = set()

    async def round(self) -> None:
        """Ask every engine not learnt yet, concurrently, and resize those that said."""
        todo = [(url, role) for role in self._roles
                for url in dict.fromkeys(ep.url for ep in self._pool.endpoints(role))]
        # A URL that left the pool is asked again if it comes back (a new pod).
        self._learnt &= set(todo)
        todo = [t for t in todo if t not in self._learnt]
        pages = await asyncio.gather(*(self._fetch(url) for url, _ in todo),
                                     return_exceptions=True)
        for (url, role), page in zip(todo, pages, strict=True):
            n = dp_size_of_metrics(page) if isinstance(page, bytes) else None
            if n is None:
                continue
            self._learnt.add((url, role))
            if self._pool.resize(url, role, n):
                log.info("engine %s (%s) runs %d DP rank(s) (from its /metrics)", url, role, n)

    async def run(self, interval_s: float) -> None:
        """`round()` every `interval_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.round()
            except Exception:  # a bug here must not end learning
                log.exception("DP size round failed")


async def open_dp_learning(config: RouterConfig, pool: EndpointPool, fetch: MetricsPage,
                           stack: contextlib.AsyncExitStack) -> None:
    """For the roles configured with DP size 0: learn the sizes once now (engines that
    already answer are routed per rank from the first request), then every health
    interval for engines that come later; the task ends with `stack`."""
    sizes: tuple[tuple[Role, int], ...] = (("prefill", config.prefill_dp_size),
                                           ("decode", config.decode_dp_size))
    roles = [role for role, n in sizes if n == 0]
    if not roles:
        return
    learner = DPSizeLearner(pool, fetch, roles)
    await learner.round()
    task = asyncio.create_task(learner.run(config.health_interval_s), name="dp-sizes")

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)
