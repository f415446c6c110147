"""The push flow (`--pd-mode push`, vLLM NixlPushConnector style; docs/flows.md).

Per request: pick P and D → send both legs at once. P's leg asks it to keep the prompt's KV
for a push; D's leg names P's engine id and side channel (`POST /v1/kv/info`, cached per
engine). D allocates the prompt's blocks and registers them with P over NIXL; P WRITEs as
soon as its prefill is done and D's registration is there (either may come first); D
decodes when the KV has landed. TTFT ≈ max(prefill, D's admission) + WRITE; for streams
that qualify (router/flows/early.py) the client gets P's own token when P answers and D
continues after it (D learns it from P's landed notice), so TTFT ≈ prefill + one hop.

The P leg is watched until it answers: if it fails, the decode leg is cancelled (D drops its
registration and frees its blocks) and the client gets P's error — or an SSE error event if
D's stream had already started. If P answers without pushing (it stopped early, as vLLM does
when no KV is worth keeping), D is told to stop waiting and computes the prompt itself
(counted as a fallback).

vLLM prefill engines (`NixlPushConnector`) have no `/v1/kv/info`: their identity is learnt
from their answers (router/flows/push_identity.py). The first request to one runs P, then D;
later ones run both legs at once. When P's answer shows that D's leg named a stale identity
(P restarted under a new engine id), or D failed before P answered and P's answer names
another identity, D's leg is sent again with the identity P answered: P still holds the
prompt for a registration. A vLLM D cannot be told a push deadline, so the router bounds
it: a stream must start within `kv_wait_s` of P's answer. A vLLM engine answering as a pull
engine makes that request read the KV (pull) and later ones run the pull flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pdgate.contract.kv_contract import Continuation, PushDecodeParams, PushPrefillParams
from pdgate.router.engines.client import EngineStream
from pdgate.router.engines.replies import rewrite_reply_usage
from pdgate.router.errors import EngineError, EngineTimeout, RouterError
from pdgate.router.flows.base import Fallback, FlowParts, StreamResult
from pdgate.router.flows.bodies import decode_leg_body, prefill_leg_body, remote_prefill
from pdgate.router.flows.common import FlowMetrics, KVInfoCache, relay
from pdgate.router.flows.early import (
    ASK_TOKEN_IDS,
    EarlyStream,
    FirstTokenCheck,
    eligible,
    head_chunks,
    wants_early,
)
from pdgate.router.flows.failover import (
    Exclusions,
    LegFailure,
    PullInstead,
    choose_prefill,
    run_or_pull,
)
from pdgate.router.flows.legs import DecodeLeg, PrefillLeg, PrefillOutcome, open_continuation
from pdgate.router.flows.push_identity import (
    Learned,
    PushPeers,
    ShimPeer,
    VllmIdentity,
    VllmPeer,
    vllm_request_id,
)
from pdgate.router.input.schema import ClientRequest
from pdgate.router.policies import PickContext, choose
from pdgate.router.pool import Endpoint
from pdgate.router.tracing import span

__all__ = ["PushFlow"]

log = logging.getLogger(__name__)
T = TypeVar("T")
MODE = "push"


class PushFlow:
    """Runs disaggregated requests in push mode. Built once per app, in the lifespan."""

    def __init__(self, parts: FlowParts, metrics: FlowMetrics, info: KVInfoCache,
                 decode: DecodeLeg, fallback: Fallback, *,
                 early: FirstTokenCheck | None = None, kv_wait_s: float = 30.0) -> None:
        self.kv_wait_s = kv_wait_s  # D stops waiting for P's push after this (push_deadline)
        self.parts = parts
        self.decode = decode  # D's leg after P answered (vLLM engines' early tokens)
        self.fallback = fallback  # the pull flow: P cannot push, or no healthy P
        self.metrics = metrics
        self.aborter = parts.aborter
        self.peers = PushPeers(info, parts.metrics)
        self.early = early  # None: no early first token

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """Serve `req`; when P cannot push or no prefill engine is healthy, `fallback`
        (the pull flow, which serves it on a decode engine alone if need be) does."""
        return await run_or_pull(req, lambda r, ex: self._attempt(r, ex, t0), self.parts,
                                 lambda r, alone: self.fallback(r, t0, alone))

    def _watch(self, req: ClientRequest, leg: PrefillLeg, p_ep: Endpoint, d_ep: Endpoint,
               *, vllm: bool = False, sent: VllmIdentity | None = None) -> _Watch:
        return _Watch(self.parts, self.metrics, self.peers, req, leg, p_ep, d_ep,
                      vllm=vllm, sent=sent)

    async def _attempt(self, req: ClientRequest, ex: Exclusions,
                       t0: float) -> bytes | StreamResult:
        """One try on one P and one D; a failure before the client's first byte releases
        what this attempt holds and raises `LegFailure` (router/flows/failover.py)."""
        o = self.parts
        ctx = PickContext.of(req)
        p_ep = await choose_prefill(o.pool, o.policies["prefill"], ctx, ex)
        d_ep = await choose(o.pool, "decode", o.policies["decode"], ctx, exclude=ex.decode)
        peer = await self._peer_or_fail(p_ep, req)
        if not isinstance(peer, ShimPeer):
            return await self._attempt_vllm(req, p_ep, d_ep, peer.identity, t0)
        info = peer.info
        n = len(req.prompt_token_ids or ())
        # P's landed notice names its token: D can continue after it, so the client may
        # get it from P's reply at once (router/flows/early.py).
        early = req.stream and self.early is not None and info.landed_tokens and eligible(req)
        p_body = prefill_leg_body(req.body, PushPrefillParams(num_tokens=n).to_params())
        d_params = PushDecodeParams(
            remote_engine_id=info.engine_id, remote_host=info.host,
            remote_port=info.port, remote_agent_name=info.agent_name, num_tokens=n,
            # Wall clock past which D stops waiting for P's KV (fails or recomputes, per its
            # --kv-load-failure-policy) instead of its own longer transfer timeout.
            push_deadline=time.time() + self.kv_wait_s, continue_after_prefill=bool(early),
        ).to_params()
        d_body = decode_leg_body(req.body, remote_prefill(d_params), req.track_ids)
        leg = PrefillLeg.start(o.pool, o.engines, p_ep, req, p_body)
        req.served_by["decode"] = d_ep.key
        watch = self._watch(req, leg, p_ep, d_ep)
        try:
            if early:
                return await self._stream_early(req, d_ep, d_body, watch, t0)
            if req.stream:
                return await self._open_decode(req, d_ep, d_body, watch, t0)
            return await self._run_decode(req, d_ep, d_body, watch)
        except LegFailure:
            raise
        except RouterError as exc:  # the decode leg's own failure; nothing sent yet
            raise LegFailure("decode", d_ep, exc) from None

    async def _peer_or_fail(self, p_ep: Endpoint, req: ClientRequest) -> ShimPeer | VllmPeer:
        if self.peers.pull_only(p_ep):
            self.parts.metrics.count_fallback("no_push")
            raise PullInstead
        try:
            return await self.peers.get(p_ep, req.engine_headers)
        except RouterError as exc:
            raise LegFailure("prefill", p_ep, exc) from None

    async def _attempt_vllm(self, req: ClientRequest, p_ep: Endpoint, d_ep: Endpoint,
                            identity: VllmIdentity | None, t0: float) -> bytes | StreamResult:
        """One try with a vLLM prefill engine: both legs at once when its identity is
        known, else P first (D's leg then names the identity P answered)."""
        o = self.parts
        if req.stream and self.early is not None and wants_early(req):
            return await self._vllm_early(req, p_ep, d_ep, t0)
        leg = PrefillLeg.start(o.pool, o.engines, p_ep, req, prefill_leg_body(req.body))
        req.served_by["decode"] = d_ep.key
        watch = self._watch(req, leg, p_ep, d_ep, vllm=True, sent=identity)
        try:
            if identity is None:
                d_params = await watch.answer()
            else:
                d_params = identity.decode_params(vllm_request_id(req))
            watch.redrive_ok = True
            for _ in range(2):  # once more at most: P's answer has settled what D needs
                body = decode_leg_body(req.body, d_params, req.track_ids)
                try:
                    if req.stream:
                        return await self._open_decode(req, d_ep, body, watch, t0)
                    return await self._run_decode(req, d_ep, body, watch)
                except _Redrive as redo:
                    log.info("request %s: sending the decode leg again with the prefill "
                             "engine's answer (%s)", req.request_id, redo.why)
                    d_params = redo.params
            raise AssertionError("unreachable")
        except LegFailure:
            raise
        except RouterError as exc:
            self.peers.forget(p_ep)  # it may be stale: the next request learns it anew
            raise LegFailure("decode", d_ep, exc) from None

    async def _vllm_early(self, req: ClientRequest, p_ep: Endpoint, d_ep: Endpoint,
                          t0: float) -> StreamResult:
        """An eligible stream with a vLLM P: P first, asked for its token ids; the client
        gets P's token at once, and D continues after it (prompt ids plus that token) with
        P's identity, registering its blocks with P, which holds the prompt's KV for that
        registration. vLLM's D loads the prompt's KV and computes P's token itself, so the
        greedy stream is the colocated one. The decode leg's early stream runs the rest (its
        retries, aborts and billing). P answering without a usable token: D continues the
        prompt without it, named as P answered."""
        o = self.parts
        body = prefill_leg_body({**req.body, ASK_TOKEN_IDS: True})
        leg = PrefillLeg.start(o.pool, o.engines, p_ep, req, body)
        watch = self._watch(req, leg, p_ep, d_ep, vllm=True)
        d_params = await watch.answer()  # P's failure: LegFailure (retried on another P)
        reply = leg.reply()
        assert self.early is not None
        first = self.early.listed(req, reply) if reply is not None and d_params is not None \
            else None
        outcome = PrefillOutcome(d_params, leg.usage(), first)
        req.served_by["decode"] = d_ep.key
        if first is None:
            return await self.decode.open(req, outcome, t0, MODE)
        return await self.decode.stream_early(req, outcome, first, t0, d_ep, MODE)

    async def _run_decode(self, req: ClientRequest, d_ep: Endpoint, body: bytes,
                          watch: _Watch) -> bytes:
        o = self.parts

        async def call() -> bytes:
            with o.pool.track(d_ep), span("decode_leg", **{"pdgate.engine": d_ep.key}):
                return await o.engines.post_raw(d_ep.url, req.path, body,
                                                d_ep.pin(req.engine_headers))

        raw = await watch.run(asyncio.create_task(call()))
        o.metrics.served_whole(MODE)
        usage = watch.leg.usage() if watch.pushed else None
        return raw if usage is None else rewrite_reply_usage(raw, usage)

    async def _open_watched(self, req: ClientRequest, d_ep: Endpoint, body: bytes,
                            watch: _Watch) -> tuple[EngineStream, contextlib.ExitStack]:
        """D's stream, opened while watching P; the stack closes it (and D's slot)."""
        stack = contextlib.ExitStack()
        stack.enter_context(self.parts.pool.track(d_ep))
        opening = asyncio.create_task(
            self.parts.engines.open_stream(d_ep.url, req.path, body,
                                           d_ep.pin(req.engine_headers)))
        try:
            with span("decode_leg_open", **{"pdgate.engine": d_ep.key}):
                stream = await watch.run(opening)
        except BaseException:
            stack.close()
            if opening.done() and not opening.cancelled() and opening.exception() is None:
                # Opened just as this leg was given up (the client left): cancelling the
                # finished task did nothing, so close D's stream here.
                opening.result().close()
            raise
        stack.callback(stream.close)  # closing it also tells D to drop its registration
        return stream, stack

    async def _open_decode(self, req: ClientRequest, d_ep: Endpoint, body: bytes,
                           watch: _Watch, t0: float) -> StreamResult:
        stream, stack = await self._open_watched(req, d_ep, body, watch)
        if watch.vllm:
            # vLLM sends a stream's headers at once, and a failure as 200 + an SSE error
            # event: its first line says whether the KV landed, before the client sees one.
            first = asyncio.create_task(stream.check_start(self.parts.engines.first_byte_timeout_s))
            try:
                await watch.run(first, after_answer_s=self.kv_wait_s)
            except BaseException:
                stack.close()
                raise
            watch.redrive_ok = False
        stack.callback(watch.leg.cancel)  # a no-op once P has answered
        source = _WatchedStream(stream, watch)
        stack.callback(self._release_prefill_unless, source, watch)
        chunks = relay(source, watch.leg, self.parts.metrics, t0, MODE, True,
                       req.wants_usage_chunks)
        return StreamResult(chunks, stack.close)

    def _release_prefill_unless(self, source: _WatchedStream | EarlyStream,
                                watch: _Watch) -> None:
        """On the stream's close: unless D's stream ran to its end (so the push happened, or
        D gave up on it), P may still hold the prompt's blocks for a registration that will
        not come (the client left first): tell P to free them now, not at its TTL."""
        if not source.finished:
            self.aborter.abort(watch.p_ep.url, watch.req.request_id)

    async def _stream_early(self, req: ClientRequest, d_ep: Endpoint, body: bytes,
                            watch: _Watch, t0: float) -> StreamResult:
        """Both legs are out; D was asked to continue after P's token. Once P answers, open
        the client's stream with P's token and relay D's continuation (D failing to learn
        the token: it continues after it by recomputing). P pushing nothing: a plain D leg."""
        o = self.parts
        stream, stack = await self._open_watched(req, d_ep, body, watch)
        try:
            await asyncio.wait({watch.leg.task})
            watch.prefill_done()
        except BaseException:
            stack.close()
            watch.leg.cancel()
            self.aborter.abort(watch.p_ep.url, req.request_id)
            raise
        reply = watch.leg.reply()
        assert self.early is not None
        token = self.early.pushed(req, reply) if watch.pushed and reply is not None else None
        if token is None:  # D waits for a token P will not name
            stack.close()
            self.aborter.abort(d_ep.url, req.request_id)
            body = decode_leg_body(req.body, None, req.track_ids)
            return await self._open_decode(req, d_ep, body, watch, t0)
        ids = token.token_ids

        async def rest(inner: contextlib.ExitStack) -> AsyncIterator[bytes]:
            """D's stream continuing after P's token; its first event being an error (the
            push did not land, or named no token) makes D recompute the prompt and
            continue after P's token on a fresh leg."""
            try:
                await stream.check_start(o.engines.first_byte_timeout_s)
                self.metrics.early_tokens.labels("kv").inc()
                return stream.chunks()
            except RouterError as exc:
                log.warning("request %s: decode engine could not continue after the "
                            "prefill engine's token with its KV (%s); recomputing",
                            req.request_id, exc.message)
            self.metrics.early_tokens.labels("recompute").inc()
            again = Continuation(first_token_ids=ids).to_params()
            fresh = await open_continuation(o.engines, req, d_ep, again, stack)
            return fresh.chunks()

        head = head_chunks(token, req.kind == "chat", req.wants_usage_chunks,
                           req.track_ids)
        source = EarlyStream(head, rest)
        stack.callback(self._release_prefill_unless, source, watch)
        chunks = relay(source, watch.leg, o.metrics, t0, MODE, True,
                       req.wants_usage_chunks)
        return StreamResult(chunks, stack.close)


class _Redrive(Exception):  # noqa: N818 -- a signal, not an error
    """P's answer changed what D's leg must carry (vLLM): send it again with `params`."""

    def __init__(self, params: dict[str, Any] | None, why: str) -> None:
        super().__init__(why)
        self.params, self.why = params, why


class _Watch:
    """Runs a decode-leg step while watching the prefill leg (see the module docstring).
    `vllm`: P is a vLLM engine and `sent` the identity D's leg names (None: not out yet)."""

    def __init__(self, parts: FlowParts, metrics: FlowMetrics, peers: PushPeers,
                 req: ClientRequest, leg: PrefillLeg, p_ep: Endpoint, d_ep: Endpoint, *,
                 vllm: bool = False, sent: VllmIdentity | None = None) -> None:
        self.parts, self.metrics, self.peers = parts, metrics, peers
        self.req = req
        self.leg = leg
        self.p_ep = p_ep
        self.d_ep = d_ep
        self.vllm, self.sent = vllm, sent
        self.pushed = False  # P answered and kept its KV for D
        self.d_params: dict[str, Any] | None = None  # vLLM: D's params P's answer settled
        self.redrive_ok = False  # vLLM: D's leg is out, and may be sent again
        self._settled = False  # prefill_done ran

    async def answer(self) -> dict[str, Any] | None:
        """vLLM, P first: wait for P's answer and return the decode params it settles
        (raises P's failure)."""
        try:
            await asyncio.wait({self.leg.task})
        except BaseException:
            self.leg.cancel()
            raise
        self.prefill_done()
        return self.d_params

    async def run(self, step: asyncio.Task[T], *, after_answer_s: float | None = None) -> T:
        """`step`'s result; cancels it and raises when P fails first. Any failure of `step`
        aborts P's side. `after_answer_s`: once P has answered, `step` must end within
        this many seconds (a vLLM D waits for a push without a deadline of its own)."""
        try:
            if not self.leg.task.done():
                await asyncio.wait({step, self.leg.task}, return_when=asyncio.FIRST_COMPLETED)
            if self.leg.task.done() and not step.done():
                self.prefill_done()
            if after_answer_s is not None and not step.done():
                done, _ = await asyncio.wait({step}, timeout=after_answer_s)
                if not done:
                    raise EngineTimeout(
                        f"decode engine {self.d_ep.url} received no KV from prefill engine "
                        f"{self.p_ep.url} within {after_answer_s:g} s of its answer")
            return await step
        except _Redrive:
            step.cancel()
            raise
        except RouterError as exc:
            if not isinstance(exc, LegFailure):
                try:
                    await self._answer_after_failure()
                except _Redrive:
                    step.cancel()  # P holds the prompt for D's next registration
                    raise
                except BaseException:
                    self._release(step)
                    raise
            self._release(step)
            raise
        except BaseException:
            self._release(step)
            raise

    def _release(self, step: asyncio.Task[Any]) -> None:
        step.cancel()
        self.leg.cancel()
        self.parts.aborter.abort(self.p_ep.url, self.req.request_id)

    async def _answer_after_failure(self) -> None:
        """vLLM: D failed before P answered. D's leg may have named a stale identity (P
        restarted under a new engine id), so P's answer decides: `_Redrive` when it names
        another one (or no push), else D's failure stands."""
        if not self.vllm or self._settled or not self.redrive_ok:
            return
        await asyncio.wait({self.leg.task})  # bounded by the prefill deadline
        self.prefill_done()

    def prefill_done(self) -> None:
        """React to P's answer: raise P's error, or tell D to stop waiting if P did not
        push, or note that it did. Idempotent."""
        if self._settled:
            return
        failure = self.leg.error()
        if self.leg.task.cancelled():
            raise LegFailure("prefill", self.p_ep, EngineError(
                f"prefill leg on {self.p_ep.url} was cancelled"))
        if failure is not None:
            self.metrics.flow_failures.labels(MODE, "prefill_failed").inc()
            if not isinstance(failure, RouterError):
                failure = EngineError(f"prefill leg on {self.p_ep.url} failed: {failure!r}")
            raise LegFailure("prefill", self.p_ep, failure)
        self.p_ep.health.record_success()
        self._settled = True
        reply = self.leg.reply()
        self.parts.metrics.observe_prefill(time.perf_counter() - self.leg.t0)
        if self.vllm:
            self._settle_vllm(reply.kv_params if reply is not None else None)
            return
        self.pushed = reply is not None and reply.pushed(MODE)
        if not self.pushed:
            self.parts.metrics.count_fallback("no_kv_push")
            self.parts.aborter.abort(self.d_ep.url, self.req.request_id)

    def _settle_vllm(self, params: Any) -> None:
        learned, d_params = self.peers.answer(self.p_ep, params, self.sent, self.req)
        self.pushed = learned in (Learned.SAME, Learned.CHANGED)
        if learned is Learned.SAME:
            return
        if not self.pushed:  # D reads the KV (a pull answer) or computes the prompt
            reason = "no_push" if learned is Learned.PULL else "no_kv_push"
            self.parts.metrics.count_fallback(reason)
        self.d_params = d_params
        if self.redrive_ok:
            raise _Redrive(d_params, f"the prefill engine answered {learned.value}")


class _WatchedStream:
    """D's stream, whose chunk reads also watch the prefill leg until P has answered: a P
    failure then ends the stream with an error (D was waiting for KV that never comes)."""

    def __init__(self, stream: EngineStream, watch: _Watch) -> None:
        self._stream = stream
        self._watch = watch
        self.finished = False  # read to its end

    async def chunks(self) -> AsyncIterator[bytes]:
        it = aiter(self._stream.chunks())
        while True:
            nxt = asyncio.ensure_future(anext(it))
            try:
                if not self._watch.leg.task.done():
                    await asyncio.wait({nxt, self._watch.leg.task},
                                       return_when=asyncio.FIRST_COMPLETED)
                    if not nxt.done():
                        self._watch.prefill_done()
                chunk = await nxt
            except StopAsyncIteration:
                self.finished = True
                return
            except BaseException:
                nxt.cancel()
                raise
            yield chunk
