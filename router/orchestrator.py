"""The pull-mode P/D flow as small framework-free steps.

Per request: `tokenize` (count prompt tokens, check the context length) → `decide`
(disaggregate or not) → `run_prefill` (P leg: one token, KV kept for a remote decode) →
`run_decode` (non-streaming) or `open_decode` + `relay_decode` (streaming).

Retries: a leg that fails with a retryable error (connect failure, dropped connection, 5xx)
before any byte reached the client is tried once more on another engine of the same role.
After the first byte, a failure ends the SSE stream with an error event and `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec

from router.aborts import Aborter
from router.decider import Decider, Decision, PrefixDecider, decide
from router.engines import (
    EngineClient,
    EngineStream,
    PrefillUsage,
    extract_kv_params,
    prefill_usage,
    rewrite_usage,
)
from router.errors import (
    ContextLengthExceeded,
    EngineTimeout,
    EngineUnavailable,
    NoEndpointAvailable,
    RouterError,
)
from router.flows.bodies import decode_leg_body, prefill_leg_body
from router.flows.common import relay_chunks, rewrite_reply_usage
from router.flows.failover import note_failure
from router.health import backoff_s
from router.metrics import RouterMetrics
from router.policies import PickContext, Selector, choose
from router.pool import Endpoint, EndpointPool, Role
from router.schema import ChatParams, ClientRequest
from router.sse import UsageRewriter
from router.tokenization import PromptTokenizer

__all__ = ["Decision", "Orchestrator", "PrefillOutcome", "StreamResult", "decide"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What the prefill leg produced: P's opaque KV params (None → fallback) and usage."""

    kv_params: Any | None
    usage: PrefillUsage | None


class PDFlow(Protocol):
    """A `--pd-mode` flow other than pull (router/flows/notify.py, push.py)."""

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult | None:
        """Serve a disaggregated request; None: run the pull flow instead."""
        ...


@dataclass(slots=True)
class StreamResult:
    """A streaming answer: iterate `chunks`, then always call `close()` (idempotent),
    even when `chunks` was never started."""

    chunks: AsyncGenerator[bytes, None]
    close: Callable[[], None]


class Orchestrator:
    """Runs one client request through the engines. Built once per app; no framework."""

    def __init__(
        self,
        pool: EndpointPool,
        engines: EngineClient,
        prefill_policy: Selector,
        decode_policy: Selector,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
        decider: Decider | None = None,
        *,
        max_retries: int = 1,
        retry_backoff_s: float = 0.02,
        kv_abort_timeout_s: float = 2.0,
    ) -> None:
        self.pool = pool
        self.engines = engines
        self.policies: dict[Role, Selector] = {"prefill": prefill_policy, "decode": decode_policy}
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.decider: Decider = decider or PrefixDecider()
        self.pd_flow: PDFlow | None = None  # notify/push mode, set by the app's lifespan
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        # Every flow's best-effort KV aborts (router/aborts.py).
        self.aborter = Aborter(engines, metrics, kv_abort_timeout_s)

    async def handle(self, req: ClientRequest) -> bytes | StreamResult:
        """Run `req`: JSON body bytes for a non-streaming answer, else a `StreamResult`."""
        await self.tokenize(req)
        decision = self.decider.decide(req)
        self.metrics.child(self.metrics.disagg_decisions, decision.reason).inc()
        t0 = time.perf_counter()
        if decision.disagg and self.pd_flow is not None:
            result = await self.pd_flow.run(req, t0)
            if result is not None:
                return result
        prefill = await self.prefill_or_fallback(req) if decision.disagg else None
        mode = "disagg" if prefill is not None else "direct"
        try:
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
            if self.pool.healthy("prefill"):
                raise
            self.metrics.fallbacks.labels("no_prefill").inc()
            log.warning("request %s: no healthy prefill engine (%s); decode engine computes "
                        "the prompt", req.request_id, exc.message)
            return None

    def abort_prefill(self, req: ClientRequest, prefill: PrefillOutcome | None) -> None:
        """Tell the P that served `req` to free the blocks it pinned for it (best effort,
        in the background). No-op when P pinned nothing."""
        url = req.served_by.get("prefill")
        if prefill is not None and prefill.kv_params is not None and url is not None:
            self.aborter.abort(url, req.request_id)

    async def aclose(self) -> None:
        """Wait for pending KV aborts (each bounded by `kv_abort_timeout_s`)."""
        await self.aborter.aclose()

    async def tokenize(self, req: ClientRequest) -> None:
        """Fill `req.prompt_token_ids` (single prompts) and enforce the context length.

        A prompt whose length in characters already proves it cannot fit is refused before
        it is tokenized (or, for chat, before the template renders all of it)."""
        tok = self.tokenizer
        char_limit = tok.char_limit(req.max_tokens)
        if isinstance(req.params, ChatParams):
            text = await tok.render_chat(
                req.body["messages"], add_generation_prompt=req.params.add_generation_prompt,
                template_kwargs=req.params.chat_template_kwargs,
                chat_template=req.params.chat_template, stop_after=char_limit,
            )
            special = False  # the template wrote BOS and friends
        elif isinstance(req.prompt, str):
            text, special = req.prompt, True
        elif req.prompt is not None:
            req.prompt_token_ids = req.prompt
            check_context_length(len(req.prompt), req.max_tokens, tok.max_model_len)
            return
        else:
            return  # batch prompts: each entry is checked by the engine
        if char_limit is not None and len(text) > char_limit:
            check_context_length(tok.min_tokens(len(text)), req.max_tokens,
                                 tok.max_model_len, at_least=True)
        ids = await tok.encode_text(text, add_special_tokens=special)
        req.prompt_token_ids = ids
        check_context_length(len(ids), req.max_tokens, tok.max_model_len)

    async def run_prefill(self, req: ClientRequest) -> PrefillOutcome:
        """P leg: send the one-token prefill and read P's KV params and usage."""
        body = prefill_leg_body(req.body)
        t0 = time.perf_counter()

        async def call(ep: Endpoint) -> dict[str, Any]:
            with self.pool.track(ep):
                try:
                    return await self.engines.post_json(
                        ep.url, req.path, body, req.engine_headers
                    )
                except (asyncio.CancelledError, EngineTimeout):
                    # P may still finish this prefill and pin blocks nobody will read.
                    self.aborter.abort(ep.url, req.request_id)
                    raise

        reply = await self._with_retry("prefill", req, call)
        self.metrics.prefill_duration.observe(time.perf_counter() - t0)
        kv = extract_kv_params(reply)
        if kv is None:
            self.metrics.fallbacks.labels("no_kv_params").inc()
            log.warning("request %s: prefill returned no kv_transfer_params; decode will "
                        "recompute the prompt", req.request_id)
        return PrefillOutcome(kv, prefill_usage(reply))

    async def run_decode(
        self, req: ClientRequest, prefill: PrefillOutcome | None, t0: float, mode: str
    ) -> bytes:
        """Non-streaming D leg; returns the body for the client with billing fixed."""
        bodies = _DecodeBodies(self, req, prefill)

        async def call(ep: Endpoint) -> bytes:
            with self.pool.track(ep), bodies.attempt() as body:
                return await self.engines.post_raw(ep.url, req.path, body, req.engine_headers)

        raw = await self._with_retry("decode", req, call, reuse=bodies.take_fresh)
        bodies.settle(prefill)
        self.metrics.child(self.metrics.ttft, mode).observe(time.perf_counter() - t0)
        usage_from_p = _usage_to_apply(bodies.prefill)
        if usage_from_p is None:
            return raw
        return rewrite_reply_usage(raw, usage_from_p)

    async def open_decode(
        self, req: ClientRequest, prefill: PrefillOutcome | None, t0: float, mode: str
    ) -> StreamResult:
        """Streaming D leg: open the stream (retrying before any byte), then relay it."""
        bodies = _DecodeBodies(self, req, prefill)

        async def call(ep: Endpoint) -> tuple[EngineStream, contextlib.ExitStack]:
            stack = contextlib.ExitStack()
            stack.enter_context(self.pool.track(ep))
            try:
                with bodies.attempt() as body:
                    stream = await self.engines.open_stream(
                        ep.url, req.path, body, req.engine_headers
                    )
                    # vLLM reports a decode it cannot start as 200 + an SSE error event.
                    await stream.check_start(self.engines.first_byte_timeout_s)
            except BaseException:
                stack.close()
                raise
            stack.callback(stream.close)
            return stream, stack

        stream, stack = await self._with_retry("decode", req, call, reuse=bodies.take_fresh,
                                               stream=True)
        bodies.settle(prefill)
        usage = _usage_to_apply(bodies.prefill) if req.wants_usage_chunks else None
        chunks = self.relay_decode(stream, usage, t0, mode)
        return StreamResult(chunks, stack.close)

    async def relay_decode(
        self, stream: EngineStream, usage: PrefillUsage | None, t0: float, mode: str
    ) -> AsyncGenerator[bytes, None]:
        """D's SSE bytes as they arrive; only usage chunks are rewritten (line-buffered).
        An engine failure mid-stream ends the stream with an SSE error event and [DONE]."""
        rewriter = UsageRewriter(lambda u: rewrite_usage(u, usage)) if usage else None
        async for out in relay_chunks(stream.chunks(), rewriter, self.metrics, t0, mode):
            yield out

    async def _with_retry(
        self, role: Role, req: ClientRequest, call: Callable[[Endpoint], Awaitable[T]],
        reuse: Callable[[], bool] | None = None, *, stream: bool = False,
    ) -> T:
        """Run `call` on a `role` engine; after a failure that blames the engine, try other
        engines (up to `max_retries` more, jittered exponential backoff between attempts).
        When no other engine is left and `reuse()` says the next attempt's body differs
        (decode without the KV params a dead P could not serve), an engine already tried
        may serve it. Only called before any byte went to the client. Feeds each engine's
        breaker."""
        ctx = PickContext.of(req)
        policy = self.policies[role]
        tried: list[Endpoint] = []
        error: RouterError | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(backoff_s(attempt, self.retry_backoff_s))
            try:
                ep = await choose(self.pool, role, policy, ctx, exclude=tried)
            except NoEndpointAvailable:
                if error is None:
                    raise
                if reuse is None or not reuse():
                    raise error from None
                try:
                    ep = await choose(self.pool, role, policy, ctx)
                except NoEndpointAvailable:
                    raise error from None
            if error is not None:
                self.metrics.retries.labels(role).inc()
                log.warning("request %s: %s leg failed on %s (%s); retrying on %s",
                            req.request_id, role, tried[-1].url, error.message, ep.url)
            tried.append(ep)
            try:
                result = await call(ep)
            except RouterError as exc:
                if not note_failure(role, ep, exc):
                    raise
                error = exc
                continue
            if not stream:  # a stream's verdict comes when it ends (the engines' listener)
                ep.health.record_success()
            req.served_by[role] = ep.url
            return result
        assert error is not None
        raise error


class _DecodeBodies:
    """The decode leg's body per attempt. P's KV params may be read once: after an attempt
    that reached a D (anything but a refused connection) that D may have read and released
    P's blocks, so a retry on another D must not read them again (they may hold another
    request's KV by then). Retries then carry no params, D recomputes the prompt (counted as
    a `decode_retry` fallback) and P is told to free whatever it still pins (`settle`)."""

    def __init__(self, orch: Orchestrator, req: ClientRequest,
                 prefill: PrefillOutcome | None) -> None:
        self._orch, self._req = orch, req
        self.prefill = prefill
        self._body = decode_leg_body(req.body, prefill.kv_params if prefill else None)
        self._fresh = False  # the params were just dropped; no attempt has run without them

    @contextlib.contextmanager
    def attempt(self) -> Iterator[bytes]:
        self._fresh = False  # this attempt runs the current body
        try:
            yield self._body
        except RouterError as exc:
            if isinstance(exc, EngineUnavailable) and exc.connect_failed:
                raise
            if self.prefill is not None and self.prefill.kv_params is not None:
                self._orch.metrics.fallbacks.labels("decode_retry").inc()
                self.prefill = None  # billing: D's own usage from now on
                self._body = decode_leg_body(self._req.body, None)
                self._fresh = True
            raise

    def take_fresh(self) -> bool:
        """True once after the KV params were dropped: the recompute body has not run on
        any engine yet, so even the D that failed on the params may serve it (its failure
        may be P's: P died before D read the KV). Bounds that to one extra attempt."""
        fresh, self._fresh = self._fresh, False
        return fresh

    def settle(self, prefill: PrefillOutcome | None) -> None:
        """After a successful decode: free P's blocks if the retry did not use them (on
        failure `Orchestrator.handle` does it)."""
        if self.prefill is not prefill:
            self._orch.abort_prefill(self._req, prefill)


def check_context_length(prompt_tokens: int, max_tokens: int | None, limit: int | None,
                         *, at_least: bool = False) -> None:
    """Raise `ContextLengthExceeded` when the prompt plus the requested completion (at
    least one token) does not fit `limit` tokens. No check when the limit is unknown.
    `at_least`: `prompt_tokens` is a lower bound (the prompt was not tokenized)."""
    if limit is None:
        return
    wanted = prompt_tokens + (max_tokens or 1)
    if wanted > limit:
        some = "at least " if at_least else ""
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{some}{wanted} tokens ({some}{prompt_tokens} in the prompt, {max_tokens or 1} "
            "for the completion). Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if max_tokens else "prompt",
        )


def _usage_to_apply(prefill: PrefillOutcome | None) -> PrefillUsage | None:
    # After a fallback D computed the prompt itself, so D's own usage is already right.
    if prefill is None or prefill.kv_params is None:
        return None
    return prefill.usage
