"""The pull-mode P/D flow as small framework-free steps (design.md §2, §3).

Per request: `tokenize` (count prompt tokens, check the context length) → `decide`
(disaggregate or not) → `run_prefill` (P leg: one token, KV kept for a remote decode) →
`run_decode` (non-streaming) or `open_decode` + `relay_decode` (streaming).

Retries: a leg that fails with a retryable error (connect failure, dropped connection, 5xx)
before any byte reached the client is tried once more on another engine of the same role.
After the first byte, a failure ends the SSE stream with an error event and `[DONE]`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from router.engines import (
    EngineClient,
    EngineStream,
    PrefillUsage,
    decode_body,
    extract_kv_params,
    prefill_body,
    prefill_usage,
    rewrite_usage,
)
from router.errors import (
    ContextLengthExceeded,
    EngineUnavailable,
    NoEndpointAvailable,
    RouterError,
    error_json,
)
from router.metrics import RouterMetrics
from router.policies import PickContext, Policy, choose
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
class Decision:
    """Whether to disaggregate, and why (the `reason` label of the decisions metric)."""

    disagg: bool
    reason: str


def decide(req: ClientRequest) -> Decision:
    """Disaggregate single-prompt, single-choice requests only.

    `n > 1` and batch (list) prompts go straight to a decode engine, which computes the
    prompt itself: one set of P blocks must never be shared by several decode children
    (each child would pin or free the same blocks), and splitting them into per-prompt
    P/D pairs would change how the engine batches and orders choices. Not
    disaggregating is the safe choice; every decision is counted by reason.
    """
    if req.n > 1:
        return Decision(False, "n_gt_1")
    if req.batch:
        return Decision(False, "batch_prompt")
    return Decision(True, "disagg")


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What the prefill leg produced: P's opaque KV params (None → fallback) and usage."""

    kv_params: Any | None
    usage: PrefillUsage | None


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
        prefill_policy: Policy,
        decode_policy: Policy,
        tokenizer: PromptTokenizer,
        metrics: RouterMetrics,
    ) -> None:
        self.pool = pool
        self.engines = engines
        self.policies: dict[Role, Policy] = {"prefill": prefill_policy, "decode": decode_policy}
        self.tokenizer = tokenizer
        self.metrics = metrics

    async def handle(self, req: ClientRequest) -> bytes | StreamResult:
        """Run `req`: JSON body bytes for a non-streaming answer, else a `StreamResult`."""
        await self.tokenize(req)
        decision = decide(req)
        self.metrics.child(self.metrics.disagg_decisions, decision.reason).inc()
        t0 = time.perf_counter()
        prefill = await self.run_prefill(req) if decision.disagg else None
        mode = "disagg" if decision.disagg else "direct"
        if req.stream:
            return await self.open_decode(req, prefill, t0, mode)
        return await self.run_decode(req, prefill, t0, mode)

    async def tokenize(self, req: ClientRequest) -> None:
        """Fill `req.prompt_token_ids` (single prompts) and enforce the context length."""
        tok = self.tokenizer
        if isinstance(req.params, ChatParams):
            messages = req.body["messages"]
            kwargs = req.params.chat_template_kwargs
            ids = await tok.encode_chat(
                messages, add_generation_prompt=req.params.add_generation_prompt,
                template_kwargs=kwargs,
            )
        elif isinstance(req.prompt, str):
            ids = await tok.encode_prompt(req.prompt)
        elif req.prompt is not None:
            ids = req.prompt
        else:
            return  # batch prompts: each entry is checked by the engine
        req.prompt_token_ids = ids
        check_context_length(len(ids), req.max_tokens, tok.max_model_len)

    async def run_prefill(self, req: ClientRequest) -> PrefillOutcome:
        """P leg: send the one-token prefill and read P's KV params and usage."""
        body = prefill_body(req.body)
        t0 = time.perf_counter()

        async def call(ep: Endpoint) -> dict[str, Any]:
            with self.pool.track(ep):
                return await self.engines.post_json(ep.url, req.path, body, req.engine_headers)

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
        body = decode_body(req.body, prefill.kv_params if prefill else None)

        async def call(ep: Endpoint) -> bytes:
            with self.pool.track(ep):
                return await self.engines.post_raw(ep.url, req.path, body, req.engine_headers)

        raw = await self._with_retry("decode", req, call)
        self.metrics.child(self.metrics.ttft, mode).observe(time.perf_counter() - t0)
        usage_from_p = _usage_to_apply(prefill)
        if usage_from_p is None:
            return raw
        return _rewrite_reply_usage(raw, usage_from_p)

    async def open_decode(
        self, req: ClientRequest, prefill: PrefillOutcome | None, t0: float, mode: str
    ) -> StreamResult:
        """Streaming D leg: open the stream (retrying before any byte), then relay it."""
        body = decode_body(req.body, prefill.kv_params if prefill else None)

        async def call(ep: Endpoint) -> tuple[EngineStream, contextlib.ExitStack]:
            stack = contextlib.ExitStack()
            stack.enter_context(self.pool.track(ep))
            try:
                stream = await self.engines.open_stream(
                    ep.url, req.path, body, req.engine_headers
                )
            except BaseException:
                stack.close()
                raise
            stack.callback(stream.close)
            return stream, stack

        stream, stack = await self._with_retry("decode", req, call)
        usage = _usage_to_apply(prefill) if req.wants_usage_chunks else None
        chunks = self.relay_decode(stream, usage, t0, mode)
        return StreamResult(chunks, stack.close)

    async def relay_decode(
        self, stream: EngineStream, usage: PrefillUsage | None, t0: float, mode: str
    ) -> AsyncGenerator[bytes, None]:
        """D's SSE bytes as they arrive; only usage chunks are rewritten (line-buffered).
        An engine failure mid-stream ends the stream with an SSE error event and [DONE]."""
        rewriter = UsageRewriter(lambda u: rewrite_usage(u, usage)) if usage else None
        last = 0.0
        try:
            async for chunk in stream.chunks():
                now = time.perf_counter()
                if last:
                    self.metrics.inter_token_latency.observe(now - last)
                else:
                    self.metrics.child(self.metrics.ttft, mode).observe(now - t0)
                last = now
                out = rewriter.feed(chunk) if rewriter else chunk
                if out:
                    yield out
            if rewriter and (tail := rewriter.flush()):
                yield tail
        except RouterError as exc:
            log.warning("decode stream failed mid-response: %s", exc.message)
            yield b"data: " + error_json(exc) + b"\n\n" + _DONE

    async def _with_retry(
        self, role: Role, req: ClientRequest, call: Callable[[Endpoint], Awaitable[T]]
    ) -> T:
        """Run `call` on a `role` engine; on a retryable failure, once more on another."""
        ctx = PickContext(req.request_id, req.prompt_token_ids)
        policy = self.policies[role]
        ep = await choose(self.pool, role, policy, ctx)
        try:
            result = await call(ep)
            req.served_by[role] = ep.url
            return result
        except RouterError as exc:
            if isinstance(exc, EngineUnavailable) and exc.connect_failed:
                ep.set_healthy(False)
            if not exc.retryable:
                raise
            first_error = exc
        try:
            retry_ep = await choose(self.pool, role, policy, ctx, exclude=(ep,))
        except NoEndpointAvailable:
            raise first_error from None
        self.metrics.retries.labels(role).inc()
        log.warning("request %s: %s leg failed on %s (%s); retrying on %s", req.request_id,
                    role, ep.url, first_error.message, retry_ep.url)
        result = await call(retry_ep)
        req.served_by[role] = retry_ep.url
        return result


def check_context_length(prompt_tokens: int, max_tokens: int | None, limit: int | None) -> None:
    """Raise `ContextLengthExceeded` when the prompt plus the requested completion (at
    least one token) does not fit `limit` tokens. No check when the limit is unknown."""
    if limit is None:
        return
    wanted = prompt_tokens + (max_tokens or 1)
    if wanted > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{wanted} tokens ({prompt_tokens} in the prompt, {max_tokens or 1} for the "
            "completion). Please reduce the length of the prompt or of max_tokens.",
            param="max_tokens" if max_tokens else "prompt",
        )


def _usage_to_apply(prefill: PrefillOutcome | None) -> PrefillUsage | None:
    # After a fallback D computed the prompt itself, so D's own usage is already right.
    if prefill is None or prefill.kv_params is None:
        return None
    return prefill.usage


def _rewrite_reply_usage(raw: bytes, usage: PrefillUsage) -> bytes:
    try:
        reply = _json_decode(raw)
    except msgspec.DecodeError:
        return raw  # not ours to judge; the client gets what the engine said
    if isinstance(reply, dict) and isinstance(reply.get("usage"), dict):
        rewrite_usage(reply["usage"], usage)
        return _json_encode(reply)
    return raw
