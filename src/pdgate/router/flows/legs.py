"""The legs every flow runs: the prefill leg in the background (notify, push) and the decode
leg (every mode, and the decode-only path every mode falls back to).

`DecodeLeg` runs D's leg after P answered (pull; push with vLLM engines answering first):
non-streaming, streamed, or continuing P's early first token. Each attempt runs through
`run_leg` (router/flows/failover.py): a retryable failure before any byte reached the client
is tried on another decode engine. P's KV params may be read once (`_DecodeBodies`); P is
told to free its blocks whenever no decode leg read them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from pdgate.router.dp_ranks import split_key
from pdgate.router.engines.client import EngineClient, EngineStream
from pdgate.router.engines.replies import (
    PrefillReply,
    PrefillUsage,
    rewrite_reply_usage,
    rewrite_usage,
)
from pdgate.router.engines.sse import UsageRewriter
from pdgate.router.errors import EngineUnavailable, RouterError
from pdgate.router.flows.base import FlowParts, StreamResult
from pdgate.router.flows.bodies import decode_leg_body
from pdgate.router.flows.common import FlowMetrics, relay_chunks
from pdgate.router.flows.early import EarlyStream, FirstToken, bill, continuation, head_chunks
from pdgate.router.flows.failover import run_leg
from pdgate.router.input.schema import ClientRequest
from pdgate.router.policies import PickContext, choose
from pdgate.router.pool import Endpoint, EndpointPool
from pdgate.router.tracing import span

__all__ = ["DecodeLeg", "PrefillLeg", "PrefillOutcome", "open_continuation"]


class PrefillLeg:
    """The P leg as a background task: its reply is not on the critical path, but it is
    always consumed (or cancelled with `cancel()`), and its failure is visible at once."""

    def __init__(self, task: asyncio.Task[PrefillReply], ep: Endpoint, t0: float) -> None:
        self.task = task
        self.ep = ep
        self.t0 = t0

    @classmethod
    def start(cls, pool: EndpointPool, engines: EngineClient, ep: Endpoint,
              req: ClientRequest, body: bytes) -> PrefillLeg:
        async def call() -> PrefillReply:
            # The task copies the request's context, so the span is the request's child.
            with pool.track(ep), span("prefill_leg", **{"pdgate.engine": ep.key}):
                return await engines.prefill(ep.url, req.path, body, ep.pin(req.engine_headers))

        task = asyncio.create_task(call(), name=f"prefill-{req.request_id}")
        task.add_done_callback(_consume)
        req.served_by["prefill"] = ep.key
        return cls(task, ep, time.perf_counter())

    def error(self) -> BaseException | None:
        """The leg's exception once it failed (None while running or after success)."""
        if not self.task.done() or self.task.cancelled():
            return None
        return self.task.exception()

    def reply(self) -> PrefillReply | None:
        """P's reply once it succeeded, else None."""
        if not self.task.done() or self.task.cancelled() or self.task.exception():
            return None
        return self.task.result()

    def kv_params(self) -> dict[str, Any] | None:
        """P's reply `kv_transfer_params` once it succeeded, else None."""
        reply = self.reply()
        return reply.kv_params if reply is not None else None

    def usage(self) -> PrefillUsage | None:
        """P's usage once it answered (None while running, after failure or without)."""
        reply = self.reply()
        return reply.usage if reply is not None else None

    def cancel(self) -> None:
        self.task.cancel()


def _consume(task: asyncio.Task[Any]) -> None:
    # A failed leg nobody awaits must not log "exception was never retrieved".
    if not task.cancelled():
        task.exception()


async def open_continuation(engines: EngineClient, req: ClientRequest, ep: Endpoint,
                            kv_params: dict[str, Any], stack: contextlib.ExitStack
                            ) -> EngineStream:
    """Open the decode leg that continues a stream the client already has (early first
    token): the client's body with `kv_params` as its `kv_transfer_params`. The stream is
    closed with `stack`."""
    body = decode_leg_body(req.body, kv_params, req.track_ids)
    stream = await engines.open_stream(ep.url, req.path, body, ep.pin(req.engine_headers))
    stack.callback(stream.close)
    return stream


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What the prefill leg produced: P's opaque KV params (None → D recomputes), usage,
    and P's token when it may open the stream."""

    kv_params: Any | None
    usage: PrefillUsage | None
    first: FirstToken | None = None


class DecodeLeg:
    """D's leg once P answered (or without P: decode-only). `early_tokens` counts streams
    opened with P's token, by how D went on."""

    def __init__(self, parts: FlowParts, flow_metrics: FlowMetrics | None) -> None:
        self.parts = parts
        self.early_tokens = flow_metrics.early_tokens if flow_metrics is not None else None

    async def serve(self, req: ClientRequest, prefill: PrefillOutcome | None, t0: float,
                    mode: str) -> bytes | StreamResult:
        """The decode leg of `req` in the way it asks for; P's blocks are freed when it
        fails (or is cancelled) before a decode read them."""
        try:
            if req.stream and prefill is not None and prefill.first is not None \
                    and prefill.kv_params is not None:
                return await self.stream_early(req, prefill, prefill.first, t0, None, mode)
            if req.stream:
                return await self.open(req, prefill, t0, mode)
            return await self.run(req, prefill, mode)
        except BaseException:
            self.abort_prefill(req, prefill)
            raise

    def abort_prefill(self, req: ClientRequest, prefill: PrefillOutcome | None) -> None:
        """Tell the P that served `req` to free the blocks it pinned for it (best effort,
        in the background). No-op when P pinned nothing."""
        key = req.served_by.get("prefill")
        if prefill is not None and prefill.kv_params is not None and key is not None:
            self.parts.aborter.abort(split_key(key)[0], req.request_id)

    def _bodies(self, req: ClientRequest, prefill: PrefillOutcome | None,
                base: dict[str, Any] | None = None) -> _DecodeBodies:
        return _DecodeBodies(req, prefill, base, self.parts.metrics.count_fallback,
                             lambda p: self.abort_prefill(req, p))

    async def run(self, req: ClientRequest, prefill: PrefillOutcome | None,
                  mode: str) -> bytes:
        """Non-streaming D leg; returns the body for the client with billing fixed."""
        parts = self.parts
        bodies = self._bodies(req, prefill)

        async def call(ep: Endpoint) -> bytes:
            with parts.pool.track(ep), bodies.attempt() as body:
                return await parts.engines.post_raw(ep.url, req.path, body,
                                                    ep.pin(req.engine_headers))

        with span("decode_leg"):
            raw = await run_leg(parts, "decode", req, call, reuse=bodies.take_fresh)
        bodies.settle(prefill)
        parts.metrics.served_whole(mode)
        usage_from_p = _usage_to_apply(bodies.prefill)
        if usage_from_p is None:
            return raw
        return rewrite_reply_usage(raw, usage_from_p)

    async def open(self, req: ClientRequest, prefill: PrefillOutcome | None,
                   t0: float, mode: str) -> StreamResult:
        """Streaming D leg: open the stream (retrying before any byte), then relay it."""
        bodies = self._bodies(req, prefill)
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
        the returned leg closes it and D's slot."""
        parts = self.parts

        async def call(ep: Endpoint) -> tuple[EngineStream, _OpenLeg]:
            tracked = parts.pool.track(ep)
            tracked.__enter__()
            try:
                with bodies.attempt() as body:
                    stream = await parts.engines.open_stream(
                        ep.url, req.path, body, ep.pin(req.engine_headers))
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
                           first: FirstToken, t0: float, d_ep: Endpoint | None,
                           mode: str) -> StreamResult:
        """A stream that opens with P's token; D continues after it (pull; push with vLLM
        engines, `prefill.kv_params` then naming P for D's registration). D (`d_ep`, else
        chosen here) is known before the first byte so the response headers name it (a
        retry after that byte goes to another D without changing them). After the first
        byte a decode that cannot open ends the stream with an error event; P's blocks are
        freed unless a decode read them."""
        parts = self.parts
        if d_ep is None:
            d_ep = await choose(parts.pool, "decode", parts.policies["decode"],
                                PickContext.of(req))
        req.served_by["decode"] = d_ep.key
        bodies = self._bodies(req, prefill, continuation(req.body, first))
        chosen = d_ep

        async def rest(stack: contextlib.ExitStack) -> AsyncIterator[bytes]:
            stream, leg = await self._open_stream(req, bodies, chosen)
            stack.callback(leg.close)
            bodies.settle(prefill)
            if self.early_tokens is not None:
                result = "kv" if bodies.prefill is prefill else "recompute"
                self.early_tokens.labels(result).inc()
            return stream.chunks()

        def on_close(source: EarlyStream) -> None:
            if not source.opened:
                self.abort_prefill(req, prefill)

        source = EarlyStream(head_chunks(first, False, req.wants_usage_chunks, req.track_ids), rest,
                             on_close)
        rewriter = UsageRewriter(lambda u: bill(u, first, prefill.usage))
        chunks = relay_chunks(source.chunks(), rewriter, parts.metrics, t0, mode,
                              req.wants_usage_chunks)
        return StreamResult(chunks, source.close)


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

    def __init__(self, req: ClientRequest, prefill: PrefillOutcome | None,
                 base: dict[str, Any] | None, count_fallback: Callable[[str], None],
                 abort_prefill: Callable[[PrefillOutcome | None], None]) -> None:
        self._base = req.body if base is None else base  # the early token's continuation
        self._ids = req.track_ids
        self.prefill = prefill
        self._count_fallback = count_fallback
        self._abort_prefill = abort_prefill
        self._body = decode_leg_body(self._base, prefill.kv_params if prefill else None,
                                     self._ids)
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
            self._count_fallback("decode_retry")
            self.prefill = None  # billing: D's own usage from now on
            self._body = decode_leg_body(self._base, None, self._ids)
            self._fresh = True

    def take_fresh(self) -> bool:
        """True once after the KV params were dropped: the recompute body has not run on
        any engine yet, so even the D that failed on the params may serve it (its failure
        may be P's: P died before D read the KV). Bounds that to one extra attempt."""
        fresh, self._fresh = self._fresh, False
        return fresh

    def settle(self, prefill: PrefillOutcome | None) -> None:
        """After a successful decode: free P's blocks if the retry did not use them (on
        failure `DecodeLeg.serve` does it)."""
        if self.prefill is not prefill:
            self._abort_prefill(prefill)


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
