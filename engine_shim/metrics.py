"""Prometheus metrics of one shim engine (`pdgate_shim_` prefix) on an injected registry."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdgate.proxy.metrics import NoCreatedRegistry

_P = "pdgate_shim_"

# Seconds. A transfer between two GPUs on one host takes tens of microseconds; one over a
# slow network or a stalled peer, seconds.
_TRANSFER_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
    0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)


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
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    blocks_cached: Gauge
    kv_events_published: Counter
    kv_probe_gbps: Gauge
    kv_probe_emulated: Gauge
    protocol_errors: Counter
    http_refused: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> ShimMetrics:
        reg = registry if registry is not None else NoCreatedRegistry()
        return cls(
            registry=reg,
            requests=Counter(_P + "requests", "Requests served", ["role", "status"], registry=reg),
            prompt_tokens=Counter(_P + "prompt_tokens", "Prompt tokens computed", registry=reg),
            generation_tokens=Counter(
                _P + "generation_tokens", "Tokens generated", registry=reg
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
            http_refused=Counter(
                _P + "http_refused", "HTTP requests refused before a handler ran, by reason "
                "(unauthorized, body_too_large)", ["reason"], registry=reg,
            ),
        )
