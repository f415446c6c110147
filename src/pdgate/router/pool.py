"""Engine endpoints, their health, and in-flight accounting.

The pool starts from the static URLs in the config; membership can then change at run time
(`add`, `remove`, `drain`: Kubernetes discovery and the admin API call them on the event
loop). A background task probes every engine every `interval` seconds; the orchestrator
also marks an engine unhealthy the moment a connect fails, and the next passing probe
brings it back. In-flight counts are kept with
`track()`, a context manager, so every exit path (error, cancel, client disconnect) releases.

A data-parallel engine (one URL, N DP ranks: router/dp_ranks.py) is N endpoints, one per
rank, each with its own in-flight count and breaker; they are added, removed and drained
together, and probed once per URL (one process answers `/health` for all its ranks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from pdgate.router.dp_ranks import RANK_HEADER, endpoint_key
from pdgate.router.fast_metrics import GaugeChild
from pdgate.router.health import EngineHealth, HealthSettings
from pdgate.router.metrics import RouterMetrics

if TYPE_CHECKING:
    from pdgate.router.engine_load import EngineLoad

__all__ = ["Endpoint", "EndpointPool", "Role"]

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
Probe = Callable[["Endpoint"], Awaitable[bool]]


@dataclass(eq=False)
class Endpoint:
    """One engine, or one DP rank of one. `url` is its base URL without a trailing slash;
    `index` is its position within its role (stable, used by policies); `rank` is its DP
    rank behind `url` (None: the engine is not data-parallel). `key` names it in indexes,
    metrics and logs (`url@rank`, or the URL). Mutated only on the event loop."""

    url: str
    role: Role
    index: int
    rank: int | None = None
    healthy: bool = True
    in_flight: int = 0
    draining: bool = False
    # The engine's own queue and KV usage, from its /metrics (router/engine_load.py);
    # None until read, or when it cannot be.
    load: EngineLoad | None = None
    # Thresholded probe verdicts, passive ejection, circuit breaker (router/health.py).
    health: EngineHealth = field(default_factory=EngineHealth, repr=False)
    _in_flight_gauge: GaugeChild | None = field(default=None, repr=False)
    _healthy_gauge: GaugeChild | None = field(default=None, repr=False)
    _seen_healthy: bool = field(default=False, repr=False)  # has any probe passed yet?
    key: str = field(init=False)

    def __post_init__(self) -> None:
        self.key = endpoint_key(self.url, self.rank)

    def pin(self, headers: Mapping[str, str]) -> Mapping[str, str]:
        """`headers` for a leg sent to this endpoint: with the DP-rank header that makes
        the engine run it on this rank (the same mapping when not data-parallel)."""
        if self.rank is None:
            return headers
        return {**headers, RANK_HEADER: str(self.rank)}

    def set_healthy(self, healthy: bool) -> None:
        """Record a health verdict (logs transitions, updates the gauge). An engine that
        has never been healthy is starting, not failing: that is INFO, not a WARNING."""
        if healthy != self.healthy:
            failing = not healthy and self._seen_healthy
            log.log(logging.WARNING if failing else logging.INFO,
                    "engine %s (%s) is now %s", self.key, self.role,
                    "healthy" if healthy else
                    "UNHEALTHY" if failing else "not ready yet (starting)")
        self._seen_healthy = self._seen_healthy or healthy
        self.healthy = healthy
        self.publish_health()

    def publish_health(self) -> None:
        """Set the engine-healthy gauge to the current verdict."""
        if self._healthy_gauge is not None:
            self._healthy_gauge.set(1 if self.healthy else 0)


class EndpointPool:
    """The prefill and decode endpoints: a static start set plus run-time changes.

    Role lists are replaced, never mutated in place, so a caller iterating a list it got
    earlier is never disturbed by a concurrent `add`/`remove`. `dp_size` is each role's
    default number of DP ranks per engine URL (1: not data-parallel; 0: not known yet, one
    endpoint until `resize`). `decode_only`: a colocated model's pool, ready without a
    prefill engine.
    """

    def __init__(
        self, prefill: Sequence[str], decode: Sequence[str], metrics: RouterMetrics,
        *, health: HealthSettings | None = None, dp_size: Mapping[Role, int] | None = None,
        decode_only: bool = False,
    ) -> None:
        self._metrics = metrics
        self._decode_only = decode_only  # a colocated model: no prefill pool to wait for
        self._health_settings = health
        self._dp_size: dict[Role, int] = {"prefill": 1, "decode": 1, **(dp_size or {})}
        self._by_role: dict[Role, list[Endpoint]] = {"prefill": [], "decode": []}
        self._next_index: dict[Role, int] = {"prefill": 0, "decode": 0}
        roles: tuple[tuple[Role, Sequence[str]], ...] = (("prefill", prefill),
                                                          ("decode", decode))
        for role, urls in roles:
            for url in urls:
                self._by_role[role] += self._make_ranks(url.rstrip("/"), role, None)
        self._became_ready = asyncio.Event()  # set once ready() was first true

    def _make_ranks(self, url: str, role: Role, dp_size: int | None) -> list[Endpoint]:
        """One endpoint per DP rank of `url` (one without a rank when its size is 1)."""
        # 0: learn it from the engine (router/dp_learn.py); one endpoint until then.
        n = max(1, self._dp_size[role] if dp_size is None else dp_size)
        ranks: list[int | None] = [None] if n == 1 else list(range(n))
        eps = []
        for rank in ranks:
            ep = Endpoint(url, role, self._next_index[role], rank)
            self._next_index[role] += 1
            m = self._metrics
            ep._in_flight_gauge = m.labels(m.engine_in_flight, ep.key, role)
            ep._healthy_gauge = m.labels(m.engine_healthy, ep.key, role)
            ep.publish_health()  # assumed healthy until a probe says otherwise
            eps.append(self._attach_health(ep))
        return eps

    def dp_size(self, url: str) -> int:
        """How many DP ranks `url` has in the pool (1 when it is not data-parallel or
        unknown); the KV-event subscribers subscribe to that many publishers."""
        url = url.rstrip("/")
        ranks = {ep.rank for ep in self.all() if ep.url == url}
        return max(1, len(ranks - {None}))

    def add(self, url: str, role: Role, *, dp_size: int | None = None) -> Endpoint:
        """Start routing to `url` as a `role` engine with `dp_size` DP ranks (None: the
        role's default); returns its first endpoint (rank 0 of a data-parallel engine).

        Idempotent: an engine already present is returned as is (its ranks unchanged:
        `resize` changes them), and one that was draining is taken back into service. A
        new engine starts healthy (the caller knows it is up, e.g. its pod is Ready); the
        health loop corrects that if wrong. `index` values are never reused within a role.
        """
        url = url.rstrip("/")
        known = [ep for ep in self._by_role[role] if ep.url == url]
        if known:
            if any(ep.draining for ep in known):
                log.info("engine %s (%s) is back in service", url, role)
            for ep in known:
                ep.draining = False
            return known[0]
        eps = self._make_ranks(url, role, dp_size)
        self._by_role[role] = [*self._by_role[role], *eps]
        log.info("engine %s (%s) added%s", url, role,
                 f" with {len(eps)} DP ranks" if len(eps) > 1 else "")
        return eps[0]

    def resize(self, url: str, role: Role, dp_size: int) -> bool:
        """Give `url` (a `role` engine) `dp_size` DP ranks, e.g. once the engine said how
        many it has. Ranks that go away finish their requests in flight on the objects
        their legs hold. Returns False when nothing changed or `url` is unknown."""
        url = url.rstrip("/")
        eps = self._by_role[role]
        mine = [ep for ep in eps if ep.url == url]
        want: list[int | None] = [None] if dp_size == 1 else list(range(dp_size))
        if not mine or [ep.rank for ep in mine] == want:
            return False
        for ep in mine:
            self._forget_gauges(ep.key, role)
        at = eps.index(mine[0])
        rest = [ep for ep in eps if ep.url != url]
        self._by_role[role] = rest[:at] + self._make_ranks(url, role, dp_size) + rest[at:]
        log.info("engine %s (%s) now has %d DP rank(s)", url, role, dp_size)
        return True

    def remove(self, url: str) -> bool:
        """Forget `url` (every role and rank it has) at once, even with requests in
        flight: those finish on the `Endpoint` object they hold. Returns False if `url`
        was unknown."""
        url = url.rstrip("/")
        found = False
        for role, eps in self._by_role.items():
            gone = [ep for ep in eps if ep.url == url]
            if gone:
                found = True
                self._by_role[role] = [ep for ep in eps if ep.url != url]
                for ep in gone:
                    self._forget_gauges(ep.key, role)
                log.info("engine %s (%s) removed", url, role)
        return found

    def drain(self, url: str) -> bool:
        """Stop sending new requests to `url` (all its ranks); each endpoint is removed
        once its in-flight count is 0 (at once if it is idle). `add(url, role)` before
        then cancels the drain. Returns False if `url` was unknown."""
        url = url.rstrip("/")
        eps = [ep for ep in self.all() if ep.url == url]
        for ep in eps:
            ep.draining = True
            log.info("engine %s (%s) draining (%d in flight)", ep.key, ep.role, ep.in_flight)
            if ep.in_flight == 0:
                self._remove_endpoint(ep)
        return bool(eps)

    def _remove_endpoint(self, ep: Endpoint) -> None:
        eps = self._by_role[ep.role]
        if ep in eps:
            self._by_role[ep.role] = [e for e in eps if e is not ep]
            self._forget_gauges(ep.key, ep.role)
            log.info("engine %s (%s) drained and removed", ep.key, ep.role)

    def _forget_gauges(self, key: str, role: Role) -> None:
        # A removed engine must not linger in /metrics as a stale series.
        m = self._metrics
        for gauge in (m.engine_in_flight, m.engine_healthy, m.engine_breaker_state,
                      m.engine_requests_waiting, m.engine_requests_running,
                      m.engine_kv_usage):
            with contextlib.suppress(KeyError):
                m.remove(gauge, key, role)

    def endpoints(self, role: Role) -> list[Endpoint]:
        """All endpoints of `role`, healthy or not, draining or not, in the order added."""
        return self._by_role[role]

    def all(self) -> list[Endpoint]:
        """Every endpoint, prefill first."""
        return self._by_role["prefill"] + self._by_role["decode"]

    def _attach_health(self, ep: Endpoint) -> Endpoint:
        ep.health = EngineHealth(
            self._health_settings, f"{ep.key} ({ep.role})",
            on_open=self._metrics.labels(self._metrics.breaker_opened, ep.role).inc,
        )
        self._metrics.watch_breaker(ep.key, ep.role, ep.health)
        return ep

    def healthy(self, role: Role) -> list[Endpoint]:
        """Endpoints of `role` that may take new requests: last verdict healthy, not
        draining, circuit breaker not open (half-open: one trial at a time)."""
        return [ep for ep in self._by_role[role]
                if ep.healthy and not ep.draining and ep.health.admits(ep.in_flight)]

    def ready(self) -> bool:
        """True when at least one prefill and one decode engine may take new requests (a
        decode engine alone for a decode-only pool)."""
        return bool(self.healthy("decode")) and (self._decode_only
                                                  or bool(self.healthy("prefill")))

    def track(self, ep: Endpoint) -> _Tracked:
        """Count one in-flight request on `ep` for the duration of the `with` block."""
        return _Tracked(self, ep)

    async def check_all(self, probe: Probe) -> None:
        """Probe every engine URL once, concurrently, and record the verdict on each of
        its endpoints (all DP ranks of a URL share its process and its verdict)."""
        eps = self.all()
        heads: dict[str, Endpoint] = {}
        for ep in eps:
            heads.setdefault(ep.url, ep)
        results = await asyncio.gather(*(probe(ep) for ep in heads.values()),
                                       return_exceptions=True)
        verdicts = {url: ok is True for url, ok in zip(heads, results, strict=True)}
        for ep in eps:
            ep.set_healthy(ep.health.probe(verdicts[ep.url], ep.healthy))
        if self.ready():
            self._became_ready.set()

    async def wait_first_ready(self, timeout_s: float) -> bool:
        """Until the pool was ready once (a prefill and a decode engine healthy), at most
        `timeout_s` seconds; True when it has been. Returns at once after the first time:
        only requests that arrive while the router starts up wait here."""
        if self._became_ready.is_set():
            return True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._became_ready.wait()
        return self._became_ready.is_set()

    async def run_health_checks(self, probe: Probe, interval_s: float,
                                fast_interval_s: float = 0.2) -> None:
        """Probe forever every `interval_s` seconds, or every `fast_interval_s` while the
        pool is not ready (engines still starting: the router is ready as soon as they
        are, not up to a whole interval later); cancel the task to stop it."""
        while True:
            await asyncio.sleep(interval_s if self.ready() else min(fast_interval_s,
                                                                    interval_s))
            try:
                await self.check_all(probe)
            except Exception:  # a bug in a probe must not end health checking
                log.exception("health check round failed")


class _Tracked:
    """`EndpointPool.track`'s context manager (a class: a generator-based one costs a
    generator and two extra frames per leg)."""

    __slots__ = ("_pool", "_ep")

    def __init__(self, pool: EndpointPool, ep: Endpoint) -> None:
        self._pool, self._ep = pool, ep

    def __enter__(self) -> Endpoint:
        ep = self._ep
        ep.in_flight += 1
        if ep._in_flight_gauge is not None:
            ep._in_flight_gauge.inc()
        return ep

    def __exit__(self, *exc: object) -> None:
        ep = self._ep
        ep.in_flight -= 1
        if ep._in_flight_gauge is not None:
            ep._in_flight_gauge.dec()
        if ep.draining and ep.in_flight == 0:
            self._pool._remove_endpoint(ep)
