"""Pieces shared by the flows: their metrics, the engines' KV info (cached per engine) and
the one relay loop that streams D's answer to the client (TTFT, inter-token latency, usage
rewritten and counted, a failure mid-stream ended with an error event).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

from pdgate.contract.engine_replies import KVInfo
from pdgate.router.engines.client import EngineClient
from pdgate.router.engines.replies import PrefillUsage, rewrite_usage
from pdgate.router.engines.sse import UsageRewriter, strip_usage_events
from pdgate.router.errors import RouterError, error_json
from pdgate.router.metrics import RouterMetrics, StreamUsage
from pdgate.router.pool import Endpoint
from pdgate.router.tracing import record_span

__all__ = ["ChunkSource", "FlowMetrics", "KVInfoCache", "UsageSource", "relay",
           "relay_chunks"]

log = logging.getLogger(__name__)
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class FlowMetrics:
    """Metrics of the notify/push flows, on the app's registry."""

    kv_wait: Histogram  # mode: prefill dispatched -> KV ready (notify) / first decode byte
    flow_failures: Counter  # mode, reason
    early_tokens: Counter  # result: streams opened with P's token, and how D went on
    early_withheld: Counter  # reason: eligible streams whose P token kept the plain flow

    @classmethod
    def create(cls, registry: CollectorRegistry) -> FlowMetrics:
        return cls(
            kv_wait=Histogram(
                "pdgate_kv_wait_seconds", "Prefill dispatched to KV ready on decode",
                ["mode"], registry=registry,
                buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
            ),
            flow_failures=Counter(
                "pdgate_pd_flow_failures", "Notify/push flows that failed, by reason",
                ["mode", "reason"], registry=registry,
            ),
            early_tokens=Counter(
                "pdgate_early_first_tokens",
                "Streams that sent the prefill engine's token first, by how the decode engine "
                "went on (kv: with the transferred KV; recompute: the KV was lost)",
                ["result"], registry=registry,
            ),
            early_withheld=Counter(
                "pdgate_early_first_tokens_withheld",
                "Streams eligible for the prefill engine's token first that kept the plain "
                "flow, by reason (partial_character: the token is part of a character; "
                "full_block: the prompt may fill the prefill engine's KV blocks exactly)",
                ["reason"], registry=registry,
            ),
        )


class KVInfoCache:
    """Engine id and side channel of each engine (`POST /v1/kv/info`), fetched once per URL.
    An engine that restarts keeps its URL and side-channel port; its new NIXL agent is
    found by the peer's handshake, so the cache never needs refreshing for that."""

    def __init__(self, engines: EngineClient) -> None:
        self._engines = engines
        self._info: dict[str, KVInfo] = {}

    async def get(self, ep: Endpoint, headers: Mapping[str, str]) -> KVInfo:
        info = self._info.get(ep.url)
        if info is None:
            info = await self._engines.kv_info(ep.url, headers)
            self._info[ep.url] = info
        return info

    def forget(self, ep: Endpoint) -> None:
        self._info.pop(ep.url, None)


class ChunkSource(Protocol):
    """An open decode stream (`EngineStream`, or a stream that wraps one)."""

    def chunks(self) -> AsyncIterator[bytes]: ...


class UsageSource(Protocol):
    """Where P's usage comes from once P answered (a prefill leg running in the background)."""

    def usage(self) -> PrefillUsage | None: ...


async def relay(stream: ChunkSource, prefill: UsageSource | None, metrics: RouterMetrics,
                t0: float, mode: str, rewrite: bool, client_wants_usage: bool
                ) -> AsyncGenerator[bytes, None]:
    """D's SSE bytes as they arrive. With `rewrite`, usage chunks are billed from P's reply
    (when it is in by then; D's own count of the prompt is right otherwise). A failure
    mid-stream ends it with an SSE error event and [DONE]."""
    def fix(usage: dict[str, Any]) -> None:
        p_usage = prefill.usage() if prefill is not None else None
        if p_usage is not None:
            rewrite_usage(usage, p_usage)

    rewriter = UsageRewriter(fix) if rewrite else None
    async for out in relay_chunks(stream.chunks(), rewriter, metrics, t0, mode,
                                  client_wants_usage):
        yield out


def _keep(usage: dict[str, Any]) -> None:
    """A rewriter fix that changes nothing (the rewriter only buffers whole lines)."""


async def relay_chunks(chunks: AsyncIterator[bytes], rewriter: UsageRewriter | None,
                       metrics: RouterMetrics, t0: float, mode: str,
                       client_wants_usage: bool = True) -> AsyncGenerator[bytes, None]:
    """The one relay loop of every flow: bytes out as they arrive, TTFT and inter-token
    latency observed, usage chunks rewritten (line-buffered) when `rewriter` is given, the
    tokens of the last usage chunk the client got counted when the stream ends however it
    ends (`StreamUsage`: streams without usage chunks are not counted), and a failure
    mid-stream turned into an SSE error event plus [DONE].

    The engine stream checks the protocol and reports its failures to the engine's breaker
    (`EngineStream`); here they only end the client's stream, as an event of its own: a
    blank line first unless the bytes sent so far ended an event. Engine streams hand out
    whole lines, as does the rewriter, so usage chunks are found per relayed piece.

    D is always asked for the final usage chunk (flows/bodies.py) so every stream is
    counted; for a client that did not ask (`client_wants_usage` False) it is counted, then
    removed. Traced requests get a `decode_stream` span (relay start to end) and a
    `first_token` span (arrival to the first byte relayed)."""
    last = 0.0
    sent = b""  # the last bytes yielded
    usage = StreamUsage()
    if not client_wants_usage and rewriter is None:
        rewriter = UsageRewriter(_keep)  # whole lines, so the usage event can be cut out
    start_ns = time.time_ns()
    itl = metrics.child(metrics.inter_token_latency)  # the model's series, found once
    try:
        async for chunk in chunks:
            now = time.perf_counter()
            if last:
                itl.observe(now - last)
            else:
                metrics.observe_ttft(mode, t0, now)
                _record_first_token(t0, now)
            last = now
            out = rewriter.lines(chunk) if rewriter else chunk
            if b'"usage"' in out:  # one search of each piece (it costs ~1 ns a byte)
                out = _usage_chunks(out, rewriter, usage, client_wants_usage)
            if out:
                sent = out
                yield out
        if rewriter and (tail := rewriter.flush()):
            usage.feed(tail)
            if tail := tail if client_wants_usage else strip_usage_events(tail):
                yield tail
    except RouterError as exc:
        log.warning("decode stream failed mid-response: %s", exc.message)
        sep = b"" if not sent or sent.endswith(b"\n\n") else b"\n"
        yield sep + b"data: " + error_json(exc) + b"\n\n" + _DONE
    finally:
        usage.observe(metrics)
        record_span("decode_stream", start_ns, time.time_ns(), **{"pdgate.mode": mode})


def _usage_chunks(lines: bytes, rewriter: UsageRewriter | None, usage: StreamUsage,
                  client_wants_usage: bool) -> bytes:
    """Whole lines that mention usage: rewritten, counted, and cut out when the client did
    not ask for the usage chunk."""
    if rewriter is not None:
        lines = rewriter.rewrite(lines)
    usage.feed(lines)
    return lines if client_wants_usage else strip_usage_events(lines)


def _record_first_token(t0: float, now: float) -> None:
    """The `first_token` span: from the request's arrival (`t0`, perf_counter) to now."""
    end_ns = time.time_ns()
    record_span("first_token", end_ns - int((now - t0) * 1e9), end_ns,
                **{"pdgate.ttft_s": now - t0})
