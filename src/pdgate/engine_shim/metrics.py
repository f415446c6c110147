"""Prometheus metrics of one shim engine (`pdgate_shim_` prefix) on an injected registry.

The series about requests (counts, prompt and generation tokens, time to first token,
duration) carry a `model` label, the served model name the request asked for (the first
`--served-model-name` when it named none), so an operator running several models behind one
router splits them with `sum by (model)`; the series about the engine itself (KV blocks,
transfers, handshakes, the transport probe) carry none. Record a request's series through
`ShimMetrics.series(model)`, which hands out pre-bound children (no label lookup per token).

Also on the registry, as on the router: `pdgate_build_info{version,commit}` (the installed
pdgate's version) and the process' own `process_*` series (common/metrics_registry.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdgate.common.metrics_registry import NoCreatedRegistry, register_process_series

_P = "pdgate_shim_"

# Seconds. A transfer between two GPUs on one host takes tens of microseconds; one over a
# slow network or a stalled peer, seconds.
_TRANSFER_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)
# Seconds, the router's buckets (router/metrics.py): a first token in a millisecond on a tiny
# model, a minute behind a long queue; a whole generation up to four hours.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
_DURATION_BUCKETS = _LATENCY_BUCKETS + (120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
                                        14400.0)


def _installed_version() -> str:
    """The installed pdgate's version (the shim image holds no router code, where
    `__version__` lives; pyproject's version is the same number, tests/deploy checks it)."""
    try:
        return version("pdgate")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


@dataclass(frozen=True)
class ModelSeries:
    """One served model's request series (`ShimMetrics.series`): the token counters bound
    to its `model` label (they are counted per token), the rest labelled per request.
    `role` is the request's KV role value: colocated, prefill or decode."""

    model: str
    prompt_tokens: Counter
    generation_tokens: Counter
    _requests: Counter
    _ttft: Histogram
    _duration: Histogram

    def count_request(self, role: str, status: str) -> None:
        self._requests.labels(model=self.model, role=role, status=status).inc()

    def observe_ttft(self, role: str, seconds: float) -> None:
        """Engine.open() called -> first output read (admission, KV transfer, prefill)."""
        self._ttft.labels(model=self.model, role=role).observe(seconds)

    def observe_duration(self, role: str, seconds: float) -> None:
        """Engine.open() called -> last output read, for a request that finished."""
        self._duration.labels(model=self.model, role=role).observe(seconds)


@dataclass(frozen=True)
class ShimMetrics:
    """Built once per engine process (or per test) and passed to the parts that record.
    The default registry leaves `*_created` series out of the scrape."""

    registry: CollectorRegistry
    requests: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    blocks_total: Gauge
    blocks_free: Gauge
    blocks_leased: Gauge
    kv_transfer_bytes: Counter
    kv_transfer_seconds: Histogram
    kv_transfers: Counter
    kv_transfer_failures: Counter
    handshakes: Counter
    leases_expired: Counter
    leases_released: Counter
    pushes_shed: Counter
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    blocks_cached: Gauge
    kv_events_published: Counter
    kv_probe_gbps: Gauge
    kv_probe_emulated: Gauge
    protocol_errors: Counter
    http_refused: Counter
    ttft: Histogram
    request_duration: Histogram
    # vLLM's own scheduler gauges under vLLM's names (labels model_name, engine: the DP
    # rank, always 0 here), so a router reads a shim's load as it reads vLLM's
    # (router/engine_load.py).
    vllm_waiting: Gauge
    vllm_running: Gauge
    vllm_kv_usage: Gauge
    _series: dict[str, ModelSeries] = field(default_factory=dict)

    def watch_load(self, model: str, waiting: Callable[[], float],
                   running: Callable[[], float], kv_usage: Callable[[], float]) -> None:
        """Read the engine's queue and KV use at each scrape, under vLLM's names."""
        ids = {"model_name": model, "engine": "0"}
        self.vllm_waiting.labels(**ids).set_function(waiting)
        self.vllm_running.labels(**ids).set_function(running)
        self.vllm_kv_usage.labels(**ids).set_function(kv_usage)

    def series(self, model: str) -> ModelSeries:
        """The request series of `model` (a served model name), created on first use. Call
        on the event-loop thread (the engine and scheduler do)."""
        got = self._series.get(model)
        if got is None:
            got = self._series[model] = ModelSeries(
                model, self.prompt_tokens.labels(model=model),
                self.generation_tokens.labels(model=model), self.requests, self.ttft,
                self.request_duration,
            )
        return got

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ShimMetrics:
        reg = registry if registry is not None else NoCreatedRegistry()
        register_process_series(reg, _installed_version(), os.environ)
        return cls(
            registry=reg,
            requests=Counter(_P + "requests", "Requests served", ["model", "role", "status"],
                             registry=reg),
            prompt_tokens=Counter(
                _P + "prompt_tokens", "Prompt tokens computed", ["model"], registry=reg
            ),
            generation_tokens=Counter(
                _P + "generation_tokens", "Tokens generated", ["model"], registry=reg
            ),
            ttft=Histogram(
                _P + "time_to_first_token_seconds", "From the engine's admission of a request "
                "(after tokenizing) to its first output: queue, KV transfer (decode role) and "
                "prefill", ["model", "role"], buckets=_LATENCY_BUCKETS, registry=reg,
            ),
            request_duration=Histogram(
                _P + "request_duration_seconds", "From the engine's admission of a request to "
                "its last output, for requests that finished", ["model", "role"],
                buckets=_DURATION_BUCKETS, registry=reg,
            ),
            # Not `_total`: that suffix means a counter to Prometheus tooling.
            blocks_total=Gauge(
                _P + "kv_blocks_capacity", "KV blocks in the pool", registry=reg
            ),
            blocks_free=Gauge(_P + "kv_blocks_free", "KV blocks free", registry=reg),
            blocks_leased=Gauge(
                _P + "kv_blocks_leased", "KV blocks pinned for a remote decode", registry=reg
            ),
            kv_transfer_bytes=Counter(
                _P + "kv_transfer_bytes", "KV bytes moved by NIXL", ["op"], registry=reg
            ),
            kv_transfer_seconds=Histogram(
                _P + "kv_transfer_seconds", "Duration of one request's KV transfer", ["op"],
                buckets=_TRANSFER_BUCKETS, registry=reg,
            ),
            kv_transfers=Counter(_P + "kv_transfers", "KV transfers done", ["op"], registry=reg),
            kv_transfer_failures=Counter(
                _P + "kv_transfer_failures", "KV transfers failed", ["op", "reason"],
                registry=reg,
            ),
            handshakes=Counter(
                _P + "handshakes", "Side-channel handshakes", ["result"], registry=reg
            ),
            leases_expired=Counter(
                _P + "kv_leases_expired", "Pinned blocks freed by lease expiry", registry=reg
            ),
            pushes_shed=Counter(
                _P + "kv_pushes_shed", "Computed push prompts freed before any decode engine "
                "registered for them, for a request waiting for blocks (push mode's circular "
                "wait; their decode engines compute them)", registry=reg,
            ),
            leases_released=Counter(
                _P + "kv_leases_released", "Pinned blocks freed by the reader's notice",
                registry=reg,
            ),
            prefix_cache_queries=Counter(
                _P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                registry=reg,
            ),
            prefix_cache_hits=Counter(
                _P + "prefix_cache_hits", "Prompt tokens served from the prefix cache",
                registry=reg,
            ),
            blocks_cached=Gauge(
                _P + "kv_blocks_cached", "KV blocks holding a cached prefix block "
                "(referenced or evictable; evictable ones also count as free)", registry=reg,
            ),
            kv_events_published=Counter(
                _P + "kv_events_published", "KV cache events published", ["type"],
                registry=reg,
            ),
            kv_probe_gbps=Gauge(
                _P + "kv_probe_gbps", "GB/s of the start-up KV transport probe (engine_shim/"
                "transport_probe.py)", ["op"], registry=reg,
            ),
            kv_probe_emulated=Gauge(
                _P + "kv_probe_emulated", "Start-up KV transport probe: 1 looked emulated "
                "(far below the hardware's speed), 0 not (or not probed), -1 probe failed",
                registry=reg,
            ),
            protocol_errors=Counter(
                _P + "protocol_errors", "Untrusted frames dropped undecoded or invalid, by "
                "channel (side_channel, nixl_notice) and reason (oversized, malformed, "
                "bad_version, bad_sender, internal)", ["channel", "reason"], registry=reg,
            ),
            vllm_waiting=Gauge(
                "vllm:num_requests_waiting", "Requests waiting for KV blocks (vLLM's name)",
                ["model_name", "engine"], registry=reg,
            ),
            vllm_running=Gauge(
                "vllm:num_requests_running", "Requests in the running batch (vLLM's name)",
                ["model_name", "engine"], registry=reg,
            ),
            vllm_kv_usage=Gauge(
                "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use, 0..1 (vLLM's "
                "name)", ["model_name", "engine"], registry=reg,
            ),
            http_refused=Counter(
                _P + "http_refused", "HTTP requests refused before a handler ran, by reason "
                "(unauthorized, body_too_large)", ["reason"], registry=reg,
            ),
        )
