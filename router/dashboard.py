"""The built-in status page: `GET /dashboard` (one self-contained HTML page, no external
assets) and `GET /dashboard/state` (the JSON it polls every two seconds).

The state is read from what the router already keeps: the endpoint pool (engines, health,
draining, in-flight) and the TTFT histogram. "Recent" TTFT is the difference between the
histogram now and its snapshot from about `window_s` ago, so the page shows the last minute
rather than the whole uptime, without touching the request path.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from fastapi import FastAPI
from prometheus_client import Histogram
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from router.api import StateHolder
from router.dashboard_page import PAGE
from router.pool import EndpointPool

__all__ = ["EngineState", "HistogramWindow", "TTFTState", "install_dashboard"]


class EngineState(msgspec.Struct):
    """One engine as the page shows it."""

    url: str
    role: str
    healthy: bool
    draining: bool
    in_flight: int


class TTFTState(msgspec.Struct):
    """TTFT over the recent window (seconds; None when no request finished in it)."""

    window_s: float
    count: int
    mean_s: float | None
    p50_s: float | None
    p95_s: float | None


class DashboardState(msgspec.Struct):
    ready: bool
    discovery: str
    uptime_s: float
    engines: list[EngineState]
    ttft: TTFTState


@dataclass(frozen=True)
class _Snapshot:
    at: float
    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)


def _snapshot(histogram: Histogram, now: float) -> _Snapshot:
    count = total = 0.0
    buckets: dict[float, float] = {}
    for family in histogram.collect():
        for s in family.samples:  # summed over label values (e.g. mode)
            if s.name.endswith("_count"):
                count += s.value
            elif s.name.endswith("_sum"):
                total += s.value
            elif s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
    return _Snapshot(now, count, total, tuple(sorted(buckets.items())))


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: report that bound
            span = cumulative - below
            return lower + (upper - lower) * ((rank - below) / span if span else 0.0)
        lower, below = upper, cumulative
    return lower


@dataclass
class HistogramWindow:
    """Recent statistics of a cumulative histogram: the difference between the histogram
    now and the last snapshot taken at least `window_s` ago. Snapshots are taken when
    `recent()` is called (each poll); until one is that old, the baseline is empty, i.e.
    everything observed so far counts."""

    histogram: Histogram
    window_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _snapshots: deque[_Snapshot] = field(default_factory=deque)

    def recent(self) -> TTFTState:
        """Count, mean and p50/p95 of the observations made in about the last window."""
        now = self.clock()
        start = now - self.window_s
        snaps = self._snapshots
        while len(snaps) >= 2 and snaps[1].at <= start:
            snaps.popleft()  # a newer snapshot also predates the window: it is the baseline
        base = snaps[0] if snaps and snaps[0].at <= start else _Snapshot(start, 0, 0, ())
        current = _snapshot(self.histogram, now)
        snaps.append(current)
        count = int(current.count - base.count)
        old = dict(base.buckets)
        deltas = [(le, c - old.get(le, 0.0)) for le, c in current.buckets]
        if not count:
            return TTFTState(self.window_s, 0, None, None, None)
        return TTFTState(self.window_s, count, (current.total - base.total) / count,
                         _quantile(0.5, deltas), _quantile(0.95, deltas))


def _engines(pool: EndpointPool) -> list[EngineState]:
    return [EngineState(ep.url, ep.role, ep.healthy, ep.draining, ep.in_flight)
            for ep in pool.all()]


def install_dashboard(app: FastAPI, holder: StateHolder) -> None:
    """Register `/dashboard` and `/dashboard/state` on `app`. Called once by `create_app`;
    the TTFT window lives in this closure, one per app."""
    windows: dict[int, HistogramWindow] = {}  # keyed by the metrics object of this run
    started = time.monotonic()
    encode = msgspec.json.Encoder().encode

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def state(request: Request) -> Response:
        st = holder.state
        window = windows.setdefault(id(st.metrics), HistogramWindow(st.metrics.ttft))
        body = DashboardState(
            ready=st.pool.ready(), discovery=st.config.discovery,
            uptime_s=round(time.monotonic() - started, 1), engines=_engines(st.pool),
            ttft=window.recent(),
        )
        return Response(encode(body), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    app.router.add_route("/dashboard", page, methods=["GET"])
    app.router.add_route("/dashboard/state", state, methods=["GET"])
