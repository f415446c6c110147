"""Engine load signals: each engine's own queue and KV usage, read from its `/metrics`.

The router's in-flight counts (`Endpoint.in_flight`) only see this router process; an
engine shared by several router replicas (or `--workers`), or one still busy with requests
the router gave up on, is busier than that. vLLM publishes its scheduler's state as gauges
(and the engine shim the same names, engine_shim/metrics.py):

| series                        | `EngineLoad` field | meaning                              |
|-------------------------------|--------------------|--------------------------------------|
| `vllm:num_requests_waiting`   | `waiting`          | requests queued, not yet scheduled   |
| `vllm:num_requests_running`   | `running`          | requests in the running batch        |
| `vllm:kv_cache_usage_perc`    | `kv_usage`         | fraction of KV blocks in use, 0..1   |

A data-parallel engine labels each rank's series `engine="<rank>"` (router/dp_ranks.py); the
rank's endpoint gets its own figures, and an endpoint without a rank the sum over ranks
(KV usage: the mean). `LoadPoller` reads every engine URL at most once per interval
(concurrently, each read bounded by the health timeout), so the cost is one small GET per
engine per interval whatever the request rate. A page that cannot be read leaves the
endpoint's `load` None: policies then fall back on the router's own in-flight counts.
Runs on the event loop (app lifespan); the figures are also published as router gauges
(`pdgate_engine_requests_waiting`, `pdgate_engine_requests_running`,
`pdgate_engine_kv_usage`) for the dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from pdgate.router.dp_ranks import engine_series
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pool import Endpoint, EndpointPool

__all__ = ["EngineLoad", "LoadPoller", "load_interval_s", "load_of_page",
           "open_load_polling"]

DEFAULT_INTERVAL_S = 1.0

log = logging.getLogger(__name__)

MetricsPage = Callable[[str], Awaitable[bytes | None]]

WAITING = b"vllm:num_requests_waiting"
RUNNING = b"vllm:num_requests_running"
KV_USAGE = b"vllm:kv_cache_usage_perc"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One endpoint's load as its engine last reported it. `at` is `time.monotonic()` of
    the read; `kv_usage` is in [0, 1] (None when the engine does not publish it). `mine` is
    how many of this router's requests were in flight there around the read: the engine's
    figures include them, and by the time a policy reads this they may have ended, so
    policies add the router's current count to what is left (`others_*`)."""

    waiting: float
    running: float
    kv_usage: float | None
    at: float
    mine: int = 0

    @property
    def queued(self) -> float:
        """Requests the engine holds, queued or running."""
        return self.waiting + self.running

    @property
    def others_running(self) -> float:
        """Running requests that were not this router's at the read."""
        return max(0.0, self.running - self.mine)

    @property
    def others_queued(self) -> float:
        """Queued or running requests that were not this router's at the read."""
        return max(0.0, self.queued - self.mine)


def load_of_page(page: bytes, at: float) -> dict[int | None, EngineLoad]:
    """The load of each DP rank a `/metrics` page shows (key None: a page without `engine`
    labels); empty when the page has no `vllm:num_requests_*` series (not an engine)."""
    waiting = engine_series(page, WAITING)
    running = engine_series(page, RUNNING)
    usage = engine_series(page, KV_USAGE)
    ranks = set(waiting) | set(running)
    return {r: EngineLoad(waiting.get(r, 0.0), running.get(r, 0.0),
                          _clamp01(usage[r]) if r in usage else None, at) for r in ranks}


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def _for_endpoint(ep: Endpoint, ranks: dict[int | None, EngineLoad]) -> EngineLoad | None:
    """`ep`'s own figures: its rank's, or for an endpoint without a rank every rank's."""
    if not ranks:
        return None
    if ep.rank is not None:
        return ranks.get(ep.rank)
    if len(ranks) == 1:
        return next(iter(ranks.values()))
    loads = list(ranks.values())
    usages = [x.kv_usage for x in loads if x.kv_usage is not None]
    return EngineLoad(sum(x.waiting for x in loads), sum(x.running for x in loads),
                      sum(usages) / len(usages) if usages else None, loads[0].at)


class LoadPoller:
    """Reads every engine's `/metrics` through `fetch(url)` (None: unreadable) and sets
    each endpoint's `load` and the router's load gauges."""

    def __init__(self, pool: EndpointPool, fetch: MetricsPage, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._pool = pool
        self._fetch = fetch
        self._metrics = metrics
        self._clock = clock

    async def round(self) -> None:
        """One read of every engine URL, concurrently; then every endpoint updated."""
        eps = self._pool.all()
        urls = list(dict.fromkeys(ep.url for ep in eps))
        # A request of ours in flight at any time during the read may be in the page: the
        # larger count of before and after is what the engine's figures may include.
        before = {ep.key: ep.in_flight for ep in eps}
        pages = await asyncio.gather(*(self._fetch(u) for u in urls), return_exceptions=True)
        now = self._clock()
        by_url = {u: load_of_page(p, now) if isinstance(p, bytes) else {}
                  for u, p in zip(urls, pages, strict=True)}
        for ep in eps:
            load = _for_endpoint(ep, by_url.get(ep.url, {}))
            if load is not None:
                load = replace(load, mine=max(before.get(ep.key, 0), ep.in_flight))
            self._set(ep, load)

    def _set(self, ep: Endpoint, load: EngineLoad | None) -> None:
        ep.load = load
        m = self._metrics
        gauges = (m.engine_requests_waiting, m.engine_requests_running, m.engine_kv_usage)
        if load is None:
            for gauge in gauges:
                with contextlib.suppress(KeyError):
                    m.remove(gauge, ep.key, ep.role)
            return
        m.labels(m.engine_requests_waiting, ep.key, ep.role).set(load.waiting)
        m.labels(m.engine_requests_running, ep.key, ep.role).set(load.running)
        if load.kv_usage is not None:
            m.labels(m.engine_kv_usage, ep.key, ep.role).set(load.kv_usage)

    async def run(self, interval_s: float) -> None:
        """`round()` every `interval_s` seconds until cancelled."""
        while True:
            try:
                await self.round()
            except Exception:  # a bug here must not end polling
                log.exception("engine load round failed")
            await asyncio.sleep(interval_s)


def load_interval_s(configured: float | None, needed: bool) -> float:
    """Seconds between polls (0: no polling) for `--engine-load-interval-s` (None: 1 s when
    a policy or the decider reads engine load, `needed`, else none)."""
    if configured is None:
        return DEFAULT_INTERVAL_S if needed else 0.0
    return configured


async def open_load_polling(pool: EndpointPool, fetch: MetricsPage, metrics: RouterMetrics,
                            interval_s: float, stack: contextlib.AsyncExitStack) -> LoadPoller:
    """Start polling every `interval_s` seconds (first round at once); the task ends with
    `stack`."""
    poller = LoadPoller(pool, fetch, metrics)
    task = asyncio.create_task(poller.run(interval_s), name="engine-load")

    async def stop() -> None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    stack.push_async_callback(stop)
    return poller
