"""The pull flow (`--pd-mode pull`, vLLM NixlConnector; docs/flows.md), and the decode-only
path every mode falls back to.

Per request: prefill leg (one token; P keeps the prompt's KV and answers with its
`kv_transfer_params`) → decode leg naming them (D READs the KV) → the answer, non-streaming
or relayed as SSE. Each leg runs through `run_leg` (router/flows/failover.py): a retryable
failure before any byte reached the client is tried on another engine of the same role.
After the first byte, a failure ends the SSE stream with an error event and `[DONE]`.
When no prefill engine is healthy the decode engine computes the prompt itself (counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from pdgate.router.engines.client import (
    EngineStream,
    PrefillUsage,
    extract_kv_params,
    prefill_usage,
    rewrite_usage,
)
from pdgate.router.engines.sse import UsageRewriter
from pdgate.router.errors import EngineTimeout, EngineUnavailable, NoEndpointAvailable, RouterError
from pdgate.router.flows.base import FlowParts, StreamResult
from pdgate.router.flows.bodies import decode_leg_body, prefill_leg_body
from pdgate.router.flows.common import FlowMetrics, relay_chunks, rewrite_reply_usage
from pdgate.router.flows.early_token import head_chunks
from pdgate.router.flows.failover import run_leg
from pdgate.router.flows.pull_early import (
    ASK_TOKEN_IDS,
    FirstToken,
    bill,
    continuation,
    first_token,
    wants_early,
)
from pdgate.router.input.schema import ClientRequest
from pdgate.router.policies import PickContext, choose
from pdgate.router.pool import Endpoint
from pdgate.router.tracing import span

__all__ = ["PrefillOutcome", "PullFlow"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What the prefill leg produced: P's opaque KV params (None → fallback) and usage."""

    kv_params: Any | None
    usage: PrefillUsage | None
    first: FirstToken | None = None  # P's token, when it may open the stream (pull_early)


class PullFlow:
    """Runs requests in pull mode, and decode-only requests of every mode. With
    `early_first_token`, eligible streams get P's token at once (router/flows/pull_early.py;
    counted on `flow_metrics.early_tokens`)."""

    def __init__(self, parts: FlowParts, flow_metrics: FlowMetrics | None = None,
                 early_first_token: bool = False) -> None:
        self.parts = parts
        self.flow_metrics = flow_metrics
        self.early_first_token = early_first_token and flow_metrics is not None

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """Serve a disaggregated request: prefill (or decode-only fallback), then decode."""
        return await self._decode(req, await self.prefill_or_fallback(req), t0)

    async def direct(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """Serve a request the decider kept on one engine: the decode engine alone."""
        return await self._decode(req, None, t0)

    async def _decode(self, req: ClientRequest, prefill: PrefillOutcome | None,
                      t0: float) -> bytes | StreamResult:
        mode = "disagg" if prefill is not None else "direct"
        try:
            if req.stream and prefill is not None and prefill.first is not None \
                    and prefill.kv_params is not None:
                return await self.stream_early(req, prefill, prefill.first, t0)
            if req.stream:
                return await self.open_decode(req, prefill, t0, mode)
            return await self.run_decode(req, prefill, t0, mode)
        except BaseException:
            # No decode leg will read P's blocks now (failed, cancelled, client gone).
            self.abort_prefill(req, prefill)
            raise

    async def prefill_or_fallback(self, req: ClientRequest) -> PrefillOutcome | None:
        """`run_prefill`, or None (decode-only, counted) when no prefill engine is healthy:
        a P/D router must keep serving on its decode engines when every P is down."""
        try:
            return await self.run_prefill(req)
        except (NoEndpointAvailable, EngineUnavailable) as exc:
            if self.parts.pool.healthy("prefill"):
                raise
            self.parts.metrics.count_fallback("no_prefill")
            log.warning("request %s: no healthy prefill engine (%s); decode engine computes "
                        "the prompt", req.request_id, exc.message)
            return None

    def abort_prefill(self, req: ClientRequest, prefill: PrefillOutcome | None) -> None:
        """Tell the P that served `req` to free the blocks it pinned for it (best effort,
        in the background). No-op when P pinned nothing."""
        url = req.served_by.get("prefill")
        if prefill is not None and prefill.kv_params is not None and url is not None:
            self.parts.aborter.abort(url, req.request_id)

    async def run_prefill(self, req: ClientRequest) -> PrefillOutcome:
        """P leg: send the one-token prefill and read P's KV params and usage."""
        parts = self.parts
        early = self.early_first_token and wants_early(req)
        body = prefill_leg_body({**req.body, ASK_TOKEN_IDS: True} if early else req.body)
        t0 = time.perf_counter()

        async def call(ep: Endpoint) -> dict[str, Any]:
            with parts.pool.track(ep):
                try:
                    return await parts.engines.post_json(
                        ep.url, req.path, body, req.engine_headers)
                except (asyncio.CancelledError, EngineTimeout):
                    # P may still finish this prefill and pin blocks nobody will read.
                    parts.aborter.abort(ep.url, req.request_id)
                    raise

        with span("prefill_leg"):
            reply = await run_leg(parts, "prefill", req, call)
        parts.metrics.prefill_duration.observe(time.perf_counter() - t0)
        kv = extract_kv_params(reply)
        if kv is None:
            parts.metrics.count_fallback("no_kv_params")
            log.warning("request %s: prefill returned no kv_transfer_params; decode will "
                        "recompute the prompt", req.request_id)
        first = first_token(reply) if early and kv is not None else None
        return PrefillOutcome(kv, prefill_usage(reply), first)

    async def run_decode(self, req: ClientRequest, prefill: PrefillOutcome | None,
                         t0: float, mode: str) -> bytes:
        """Non-streaming D leg; returns the body for the client with billing fixed."""
        parts = self.parts
        bodies = _DecodeBodies(self, req, prefill)

        async def call(ep: Endpoint) -> bytes:
            with parts.pool.track(ep), bodies.attempt() as body:
                return await parts.engines.post_raw(ep.url, req.path, body, req.engine_headers)

        with span("decode_leg"):
            raw = await run_leg(parts, "decode", req, call, reuse=bodies.take_fresh)
        bodies.settle(prefill)
        parts.metrics.observe_ttft(mode, t0)
        usage_from_p = _usage_to_apply(bodies.prefill)
        if usage_from_p is None:
            return raw
        return rewrite_reply_usage(raw, usage_from_p)

    async def open_decode(self, req: ClientRequest, prefill: PrefillOutcome | None,
                          t0: float, mode: str) -> StreamResult:
        """Streaming D leg: open the stream (retrying before any byte), then relay it."""
        bodies = _DecodeBodies(self, req, prefill)
        stream, stack = await self._open_stream(req, bodies)
        bodies.settle(prefill)
        # Billed from P even when the client gets no usage chunk: the router counts it.
        usage = _usage_to_apply(bodies.prefill)
        # D's SSE bytes as they arrive; only usage chunks are rewritten (line-buffered).
        rewriter = UsageRewriter(lambda u: rewrite_usage(u, usage)) if usage else None
        chunks = relay_chunks(stream.chunks(), rewriter, self.parts.metrics, t0, mode,
                              req.wants_usage_chunks)
        return StreamResult(chunks, stack.close)

    async def _open_stream(self, req: ClientRequest, bodies: _DecodeBodies,
                           first: Endpoint | None = None
                           ) -> tuple[EngineStream, _OpenLeg]:
        """Open D's stream (retrying before any byte; `first`: the engine to try first);
        the stack closes it and D's slot."""
        parts = self.parts

        async def call(ep: Endpoint) -> tuple[EngineStream, _OpenLeg]:
            tracked = parts.pool.track(ep)
            tracked.__enter__()
            try:
                with bodies.attempt() as body:
                    stream = await parts.engines.open_stream(
                        ep.url, req.path, body, req.engine_headers)
                    # vLLM reports a decode it cannot start as 200 + an SSE error event.
                    await stream.check_start(parts.engines.first_byte_timeout_s)
            except BaseException:
                tracked.__exit__(None, None, None)
                raise
            return stream, _OpenLeg(stream, tracked)

        with span("decode_leg_open"):
            return await run_leg(parts, "decode", req, call, reuse=bodies.take_fresh,
                                 stream=True, first=first)

    async def stream_early(self, req: ClientRequest, prefill: PrefillOutcome,
                           first: FirstToken, t0: float, d_ep: Endpoint | None = None,
                           mode: str = "disagg") -> StreamResult:
        """A stream that opens with P's token; D continues after it (pull_early; the push
        flow's vLLM engines too, `prefill.kv_params` then naming P for D's registration).
        D (`d_ep`, else chosen here) is known before the first byte so the response
        headers name it (a retry after that byte goes to another D without changing them)."""
        parts = self.parts
        if d_ep is None:
            d_ep = await choose(parts.pool, "decode", parts.policies["decode"],
                                PickContext.of(req))
        req.served_by["decode"] = d_ep.url
        stack = contextlib.ExitStack()
        rewriter = UsageRewriter(lambda u: bill(u, first, prefill.usage))
        chunks = relay_chunks(self._early_chunks(req, prefill, first, d_ep, stack), rewriter,
                              parts.metrics, t0, mode, req.wants_usage_chunks)
        return StreamResult(chunks, stack.close)

    async def _early_chunks(self, req: ClientRequest, prefill: PrefillOutcome,
                            first: FirstToken, d_ep: Endpoint, stack: contextlib.ExitStack
                            ) -> AsyncGenerator[bytes, None]:
        """P's token, then D's continuation. After the first byte a decode that cannot
        open ends the stream with an error event (relay_chunks); P's blocks are freed
        unless a decode read them."""
        bodies = _DecodeBodies(self, req, prefill, continuation(req.body, first))
        settled = False
        try:
            yield head_chunks(first.reply, False, req.wants_usage_chunks)
            stream, leg = await self._open_stream(req, bodies, d_ep)
            stack.callback(leg.close)
            bodies.settle(prefill)
            settled = True
            if self.flow_metrics is not None:
                result = "kv" if bodies.prefill is prefill else "recompute"
                self.flow_metrics.early_tokens.labels(result).inc()
            async for chunk in stream.chunks():
                yield chunk
        finally:
            if not settled:
                self.abort_prefill(req, prefill)


class _OpenLeg:
    """An open decode stream and its engine's in-flight slot: `close()` (idempotent)
    closes the stream, then frees the slot, whatever the stream's close raised."""

    __slots__ = ("_stream", "_tracked")

    def __init__(self, stream: EngineStream,
                 tracked: contextlib.AbstractContextManager[Endpoint]) -> None:
        self._stream: EngineStream | None = stream
        self._tracked = tracked

    def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is None:
            return
        try:
            stream.close()
        finally:
            self._tracked.__exit__(None, None, None)


class _DecodeBodies:
    """The decode leg's body per attempt. P's KV params may be read once: after an attempt
    that reached a D (anything but a refused connection) that D may have read and released
    P's blocks, so a retry on another D must not read them again (they may hold another
    request's KV by then). Retries then carry no params, D recomputes the prompt (counted as
    a `decode_retry` fallback) and P is told to free whatever it still pins (`settle`)."""

    def __init__(self, flow: PullFlow, req: ClientRequest, prefill: PrefillOutcome | None,
                 base: dict[str, Any] | None = None) -> None:
        self._flow, self._req = flow, req
        self._base = req.body if base is None else base  # the early token's continuation
        self.prefill = prefill
        self._body = decode_leg_body(self._base, prefill.kv_params if prefill else None)
        self._fresh = False  # the params were just dropped; no attempt has run without them

    def attempt(self) -> _Attempt:
        """`with bodies.attempt() as body:` one attempt of the decode leg with `body`."""
        return _Attempt(self)

    def _started(self) -> bytes:
        self._fresh = False  # this attempt runs the current body
        return self._body

    def _failed(self, exc: RouterError) -> None:
        if isinstance(exc, EngineUnavailable) and exc.connect_failed:
            return  # D never saw the params: the next D may use them
        if self.prefill is not None and self.prefill.kv_params is not None:
            self._flow.parts.metrics.count_fallback("decode_retry")
            self.prefill = None  # billing: D's own usage from now on
            self._body = decode_leg_body(self._base, None)
            self._fresh = True

    def take_fresh(self) -> bool:
        """True once after the KV params were dropped: the recompute body has not run on
        any engine yet, so even the D that failed on the params may serve it (its failure
        may be P's: P died before D read the KV). Bounds that to one extra attempt."""
        fresh, self._fresh = self._fresh, False
        return fresh

    def settle(self, prefill: PrefillOutcome | None) -> None:
        """After a successful decode: free P's blocks if the retry did not use them (on
        failure `PullFlow._decode` does it)."""
        if self.prefill is not prefill:
            self._flow.abort_prefill(self._req, prefill)


class _Attempt:
    """`_DecodeBodies.attempt`'s context manager (a class: a generator-based one costs a
    generator and two frames per leg). A `RouterError` leaving the block is noted, then
    goes on."""

    __slots__ = ("_bodies",)

    def __init__(self, bodies: _DecodeBodies) -> None:
        self._bodies = bodies

    def __enter__(self) -> bytes:
        return self._bodies._started()

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        if isinstance(exc, RouterError):
            self._bodies._failed(exc)


def _usage_to_apply(prefill: PrefillOutcome | None) -> PrefillUsage | None:
    # After a fallback D computed the prompt itself, so D's own usage is already right.
    if prefill is None or prefill.kv_params is None:
        return None
    return prefill.usage
