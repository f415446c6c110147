"""Data-parallel engines: one engine URL in front of N DP ranks, routed as N endpoints.

vLLM started with `--data-parallel-size N` (internal load balancing) serves N engine cores
behind one API server: each rank has its own scheduler, KV cache, NIXL identity and KV-event
publisher, and the API server picks a rank per request unless the request names one in the
`X-data-parallel-rank` header. pdgate makes each rank an endpoint of its own (its key is
`url@rank`), with its own load, in-flight count, prefix affinity and circuit breaker, and
pins every leg it sends to the rank it chose. Health probes stay per URL: the ranks share
one process and one `/health`.

External load balancing (`--data-parallel-rank r`, one API server per rank) needs nothing
from here: each rank has its own URL and is an ordinary engine (DP size 1, no header).

This module holds the naming rules, shared by the pool, the KV-event subscribers and the
push flow's identity cache; it imports nothing from the router.
"""

from __future__ import annotations

import re

__all__ = ["RANK_HEADER", "dp_size_of_metrics", "endpoint_key", "engine_series",
           "rank_endpoint", "split_key"]

# vLLM's API server reads this header (entrypoints/generate/base/serving.py) and sends
# the request to that rank's engine core; vllm-router uses the same name.
RANK_HEADER = "X-data-parallel-rank"


def endpoint_key(url: str, rank: int | None) -> str:
    """The name of one rank of `url` in the pool, indexes and metrics: `url@rank`, or
    `url` itself for an engine that is not data-parallel (rank None)."""
    return url if rank is None else f"{url}@{rank}"


def split_key(key: str) -> tuple[str, int | None]:
    """Inverse of `endpoint_key`: (url, rank or None)."""
    url, sep, rank = key.rpartition("@")
    if sep and rank.isdigit() and "://" in url:
        return url, int(rank)
    return key, None


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The KV-event endpoint of DP rank `rank`, given rank 0's: vLLM's ZMQ publisher binds
    rank r on the configured port + r (`ZmqEventPublisher.offset_endpoint_port`)."""
    if rank == 0:
        return endpoint
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"KV-event endpoint {endpoint!r} has no port to offset for rank "
                         f"{rank}")
    return f"{head}:{int(port) + rank}"


# vLLM labels its per-engine-core series with `engine="<dp rank>"` (one series per rank
# behind the API server), e.g. `vllm:num_requests_running{engine="1",model_name="m"}`; a
# series without that label belongs to the whole engine (rank None).
_ENGINE_LABEL = re.compile(rb'\bengine="(\d+)"')


def engine_series(text: bytes, name: bytes) -> dict[int | None, float]:
    """The values of the gauge `name` on a Prometheus text page, summed per DP rank (the
    `engine` label; None for series without it), e.g. `vllm:num_requests_waiting`. Lines
    that do not parse are skipped: a page is the engine's, not to be trusted."""
    out: dict[int | None, float] = {}
    start = 0
    while (at := text.find(name, start)) >= 0:
        end = text.find(b"\n", at)
        end = len(text) if end < 0 else end
        start = end
        if at and text[at - 1] != 0x0A:  # a match inside another line (a comment)
            continue
        line = text[at + len(name):end]
        labels = b""
        if line.startswith(b"{"):
            close = line.find(b"}")
            if close < 0:
                continue
            labels, line = line[1:close], line[close + 1:]
        elif not line.startswith(b" "):
            continue  # another series whose name starts with `name`
        fields = line.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        m = _ENGINE_LABEL.search(labels)
        rank = int(m.group(1)) if m else None
        out[rank] = out.get(rank, 0.0) + value
    return out


def dp_size_of_metrics(text: bytes) -> int | None:
    """The number of DP ranks a vLLM `/metrics` page shows (distinct `engine` labels of
    `vllm:num_requests_running`), or None when the page has no such series."""
    ranks = {r for r in engine_series(text, b"vllm:num_requests_running") if r is not None}
    return len(ranks) if ranks else None
