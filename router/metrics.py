"""The router's Prometheus metrics (`pdgate_` prefix) on a registry owned by one app.

`RouterMetrics.create(registry)` registers everything; nothing is module-global, so two apps
in one process (tests) never collide. Callers record at the boundary: the API layer counts
requests, the orchestrator times legs and counts decisions, the pool keeps the gauges.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)

__all__ = ["RouterMetrics"]

# Seconds. TTFT/prefill span sub-millisecond fakes to multi-second real prompts.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


@dataclass(frozen=True)
class RouterMetrics:
    """Handles to every router metric. Label names are documented on each field."""

    requests: Counter  # route, status
    request_duration: Histogram  # route
    ttft: Histogram  # mode: dispatch -> first decode byte
    inter_token_latency: Histogram  # gap between streamed chunks from decode
    prefill_duration: Histogram  # prefill leg round trip
    fallbacks: Counter  # reason
    retries: Counter  # role
    disagg_decisions: Counter  # reason
    engine_healthy: Gauge  # engine, role (1 healthy, 0 not)
    engine_in_flight: Gauge  # engine, role
    _children: dict[tuple[int, tuple[str, ...]], Any] = field(default_factory=dict, repr=False)

    def child(self, metric: M, *labels: str) -> M:
        """`metric.labels(*labels)`, cached: label values on the hot path come from small
        fixed sets (routes, statuses, reasons), and `labels()` takes a lock each call."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found  # type: ignore[no-any-return]

    @classmethod
    def create(cls, registry: CollectorRegistry) -> RouterMetrics:
        """Register all metrics on `registry` (one registry per app)."""
        r = registry
        return cls(
            requests=Counter(
                "pdgate_requests", "HTTP requests by route and status", ["route", "status"],
                registry=r,
            ),
            request_duration=Histogram(
                "pdgate_request_duration_seconds", "End-to-end request time", ["route"],
                buckets=_LATENCY_BUCKETS, registry=r,
            ),
            ttft=Histogram(
                "pdgate_ttft_seconds", "Dispatch to first byte from the decode engine",
                ["mode"], buckets=_LATENCY_BUCKETS, registry=r,
            ),
            inter_token_latency=Histogram(
                "pdgate_inter_token_latency_seconds", "Gap between streamed decode chunks",
                buckets=_ITL_BUCKETS, registry=r,
            ),
            prefill_duration=Histogram(
                "pdgate_prefill_duration_seconds", "Prefill leg round trip",
                buckets=_LATENCY_BUCKETS, registry=r,
            ),
            fallbacks=Counter(
                "pdgate_fallbacks", "Decode legs run without KV from prefill", ["reason"],
                registry=r,
            ),
            retries=Counter(
                "pdgate_retries", "Engine legs retried on another engine", ["role"],
                registry=r,
            ),
            disagg_decisions=Counter(
                "pdgate_disagg_decisions", "Disaggregate-or-not decisions", ["reason"],
                registry=r,
            ),
            engine_healthy=Gauge(
                "pdgate_engine_healthy", "1 if the engine's last health check passed",
                ["engine", "role"], registry=r,
            ),
            engine_in_flight=Gauge(
                "pdgate_engine_in_flight", "Requests in flight per engine", ["engine", "role"],
                registry=r,
            ),
        )
