"""The built-in status page: `GET /dashboard` (one self-contained HTML page, no external
assets) and `GET /dashboard/state` (the JSON it polls every two seconds). Both sit behind
the admin key (router/http/auth.py).

The state is read from what the router already keeps, never from the request path: the
endpoint pool (engines, health checks, circuit breakers, draining, in-flight), the TTFT
histogram and the request, token, prefill-leg and fallback counters. "Recent" TTFT is the
difference between the histogram now and its snapshot from about `window_s` ago; the rate
history (requests, errors, 429s, tokens, KV transfers and fallbacks per second) is sampled
from the counters every 5 s and kept for 15 minutes (180 points), in memory.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from pdgate.router import __version__
from pdgate.router.health import BreakerState
from pdgate.router.http.api import RouterState, StateHolder
from pdgate.router.http.dashboard_page import PAGE
from pdgate.router.http.routes import RouteTable
from pdgate.router.metrics import RouterMetrics
from pdgate.router.pool import Endpoint
from pdgate.router.served_models import ModelTable

__all__ = ["Dashboard", "EngineState", "History", "HistogramWindow", "RatePoint", "TTFTState",
           "install_dashboard"]


class EngineState(msgspec.Struct):
    """One engine as the page shows it. `status` is the one word the page prints:
    `draining`, `breaker open` (ejected after failed requests, whatever its health checks
    say), `unhealthy`, `half-open` (one trial request at a time) or `healthy`."""

    url: str
    role: str
    model: str  # the model whose pool holds it (an engine serving two models: two rows)
    status: str
    healthy: bool
    draining: bool
    breaker: str  # closed | open | half-open
    in_flight: int
    consecutive_errors: int
    kv_event_batches: int | None  # KV-event batches received from it (kv-events routing)
    # The engine's own queue and KV usage from its /metrics (router/engine_load.py); None
    # when the router does not poll it or could not read it.
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None


class TTFTState(msgspec.Struct):
    """TTFT over the recent window (seconds; None when no request finished in it)."""

    window_s: float
    count: int
    mean_s: float | None
    p50_s: float | None
    p95_s: float | None


class RatePoint(msgspec.Struct):
    """Rates over one sampling interval ending at `t` (unix seconds), per second."""

    t: float
    requests: float
    errors: float  # 4xx and 5xx answers, except 429 and 499 (client gone)
    rejected: float  # 429: admission control refused the request
    tokens: float  # completion tokens
    in_flight: int  # requests on engines at `t`
    kv_transfers: float  # prefill legs that handed their KV to decode (see `KVState`)
    fallbacks: float  # decode legs run without KV from prefill, all reasons


class KVState(msgspec.Struct):
    """What the router knows of KV caches, totals since the router started: its prefix
    indexes' sizes ((engine, block) entries, by index), its requests to engines to free a
    request's KV (by result), the KV transfers (prefill legs that finished and handed their
    KV to a decode engine: the router sees the handoff, not the bytes, which the engines
    count) and the fallbacks (`pdgate_fallbacks_total`, by reason)."""

    prefix_index_entries: dict[str, int]
    kv_aborts: dict[str, int]
    kv_transfers: int
    fallbacks: dict[str, int]


class DashboardState(msgspec.Struct):
    version: str
    mode: str  # --pd-mode
    models: dict[str, str]  # every model's first served name -> its pd_mode
    policies: dict[str, str]  # role -> policy
    ready: bool
    discovery: str
    uptime_s: float
    engines: list[EngineState]
    ttft: TTFTState
    now: RatePoint | None  # the latest interval (None until two samples exist)
    history: list[RatePoint]  # oldest first, about the last `history_span_s`
    history_span_s: float  # how long points are kept
    history_every_s: float  # sampling interval
    kv: KVState


@dataclass(frozen=True)
class _Snapshot:
    at: float
    count: float
    total: float
    buckets: tuple[tuple[float, float], ...]  # (upper bound, cumulative count)


def _snapshot(histogram: Collector, now: float) -> _Snapshot:
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

    histogram: Collector  # a histogram family
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


def _by_label(metric: Collector, label: str) -> dict[str, float]:
    """Current values of `metric`'s children keyed by one label (the `_total` or gauge
    samples only)."""
    out: dict[str, float] = {}
    for family in metric.collect():
        for s in family.samples:
            if not s.name.endswith(("_created", "_gsum", "_gcount")):
                key = s.labels.get(label, "")
                out[key] = out.get(key, 0.0) + s.value
    return out


# Fallback reasons counted after a prefill leg finished without handing decode any KV (P
# answered with no KV params, or without pushing): that leg is no KV transfer. The other
# reasons come before any prefill leg (none healthy) or switch the request to the pull
# flow, whose own prefill leg does transfer KV.
_NO_KV_AFTER_PREFILL = ("no_kv_params", "no_kv_push")


def _kv_transfers(metrics: RouterMetrics, fallbacks: dict[str, float]) -> float:
    """Prefill legs that finished (every flow observes `prefill_duration` once per leg)
    minus those that handed decode no KV."""
    legs = sum(s.value for family in metrics.prefill_duration.collect()
               for s in family.samples if s.name.endswith("_count"))
    return max(0.0, legs - sum(fallbacks.get(r, 0.0) for r in _NO_KV_AFTER_PREFILL))


@dataclass(frozen=True)
class _Totals:
    at: float
    requests: float
    errors: float
    rejected: float
    tokens: float
    kv_transfers: float
    fallbacks: float


def _totals(metrics: RouterMetrics, at: float) -> _Totals:
    by_status = _by_label(metrics.requests, "status")
    errors = sum(n for status, n in by_status.items()
                 if status[:1] in ("4", "5") and status not in ("429", "499"))
    fallbacks = _by_label(metrics.fallbacks, "reason")
    return _Totals(at, sum(by_status.values()), errors, by_status.get("429", 0.0),
                   sum(_by_label(metrics.generation_tokens, "model").values()),
                   _kv_transfers(metrics, fallbacks), sum(fallbacks.values()))


@dataclass
class History:
    """Request, error, 429, token, KV-transfer and fallback rates sampled every `every_s`
    seconds, kept for `span_s` seconds, in memory (180 points by default: one sample reads
    a handful of counters). Rates come from the cumulative counters, so a late or missed
    sample only widens one interval."""

    span_s: float = 900.0
    every_s: float = 5.0
    clock: Callable[[], float] = time.time
    _last: _Totals | None = None
    points: deque[RatePoint] = field(default_factory=deque)

    def due(self) -> bool:
        """Has `every_s` passed since the last sample (or was there none)?"""
        return self._last is None or self.clock() - self._last.at >= self.every_s

    def sample(self, metrics: RouterMetrics, in_flight: int) -> None:
        """Read the counters now and append the rates since the previous sample."""
        now = _totals(metrics, self.clock())
        last, self._last = self._last, now
        if last is not None and now.at > last.at:
            dt = now.at - last.at
            self.points.append(RatePoint(
                round(now.at, 3), (now.requests - last.requests) / dt,
                (now.errors - last.errors) / dt, (now.rejected - last.rejected) / dt,
                (now.tokens - last.tokens) / dt, in_flight,
                (now.kv_transfers - last.kv_transfers) / dt,
                (now.fallbacks - last.fallbacks) / dt))
        while self.points and self.points[0].t < now.at - self.span_s:
            self.points.popleft()


def _status(ep: Endpoint) -> str:
    breaker = ep.health.state
    if ep.draining:
        return "draining"
    if breaker is BreakerState.OPEN:
        return "breaker open"
    if not ep.healthy:
        return "unhealthy"
    return "half-open" if breaker is BreakerState.HALF_OPEN else "healthy"


def _engines(models: ModelTable, metrics: RouterMetrics) -> list[EngineState]:
    batches = _by_label(metrics.kv_event_batches, "engine")
    return [EngineState(ep.key, ep.role, m.name, _status(ep), ep.healthy, ep.draining,
                        ep.health.state.value, ep.in_flight, ep.health.consecutive_errors,
                        int(batches[ep.key]) if ep.key in batches else None,
                        *((ep.load.waiting, ep.load.running, ep.load.kv_usage)
                          if ep.load is not None else (None, None, None)))
            for m in models.models for ep in m.pool.all()]


def _kv(metrics: RouterMetrics) -> KVState:
    entries = _by_label(metrics.prefix_index_entries, "index")
    aborts = _by_label(metrics.kv_aborts, "result")
    fallbacks = _by_label(metrics.fallbacks, "reason")
    return KVState({k: int(v) for k, v in entries.items()},
                   {k: int(v) for k, v in aborts.items()},
                   int(_kv_transfers(metrics, fallbacks)),
                   {k: int(v) for k, v in sorted(fallbacks.items())})


def _policy_name(spec: object) -> str:
    return spec if isinstance(spec, str) else str(getattr(spec, "type", spec))


class Dashboard:
    """The page's state for one app: the TTFT window and the rate history (reset when the
    app's metrics change, i.e. a new lifespan). `sample_forever()` runs in the app's
    lifespan so the history covers the minutes before someone opened the page."""

    def __init__(self, holder: StateHolder) -> None:
        self._holder = holder
        self._started = time.monotonic()
        self._metrics_id: int | None = None
        self._window: HistogramWindow | None = None
        self.history = History()

    def _current(self, st: RouterState) -> tuple[HistogramWindow, History]:
        if self._window is None or self._metrics_id != id(st.metrics):
            self._metrics_id = id(st.metrics)
            self._window = HistogramWindow(st.metrics.ttft)
            self.history = History(self.history.span_s, self.history.every_s,
                                   self.history.clock)
        return self._window, self.history

    def _sample(self, st: RouterState) -> None:
        _, history = self._current(st)
        history.sample(st.metrics, sum(ep.in_flight for pool in st.models.pools()
                                       for ep in pool.all()))

    async def sample_forever(self) -> None:
        """Sample every `History.every_s` seconds until cancelled."""
        while True:
            self._sample(self._holder.state)
            await asyncio.sleep(self.history.every_s)

    def state(self) -> DashboardState:
        """Everything the page shows, now. A poll samples too when a sample is due, so the
        page works (with a shorter history) without the background sampler."""
        st = self._holder.state
        window, history = self._current(st)
        if history.due():
            self._sample(st)
        points = list(history.points)
        cfg = st.config
        return DashboardState(
            version=__version__, mode=cfg.pd_mode,
            models={m.name: m.config.pd_mode for m in st.models.models},
            policies={"prefill": _policy_name(cfg.prefill_policy),
                      "decode": _policy_name(cfg.decode_policy)},
            ready=st.models.ready(), discovery=cfg.discovery,
            uptime_s=round(time.monotonic() - self._started, 1),
            engines=_engines(st.models, st.metrics), ttft=window.recent(),
            now=points[-1] if points else None, history=points,
            history_span_s=history.span_s, history_every_s=history.every_s,
            kv=_kv(st.metrics),
        )


def install_dashboard(table: RouteTable, holder: StateHolder) -> Dashboard:
    """Declare `/dashboard` and `/dashboard/state` in `table` (called once by `create_app`,
    which runs the returned dashboard's `sample_forever()` in the lifespan)."""
    dashboard = Dashboard(holder)
    encode = msgspec.json.Encoder().encode

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})

    async def state(request: Request) -> Response:
        return Response(encode(dashboard.state()), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    table.add("GET", "/dashboard", page)
    table.add("GET", "/dashboard/state", state)
    return dashboard
