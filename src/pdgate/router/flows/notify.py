"""The notify flow (`--pd-mode notify`; docs/flows.md): P pushes the KV, the router waits
for KV-ready, then D decodes.

Per request: pick D first → reserve the prompt's blocks on D (`POST /v1/kv/reserve`) →
register the KV-ready waiter → send P the prefill with D's blocks, side channel and this
router's proxy endpoint (P's HTTP reply is not awaited: it runs in the background and only
its failure matters) → await KV-ready (deadline `kv_ready_timeout_s`) → send D the decode
leg naming the reservation. TTFT ≈ prefill + WRITE + one notification, no HTTP round trip
and no serial READ between the legs. Streams that qualify (router/flows/early.py) do await
P's reply: its token opens the client's stream at once (TTFT ≈ prefill + one hop) and the
decode leg asks D to continue after it.

Failures before the decode leg: P's error, a `failed` KV-ready, or the deadline end the
request with a clear 502/504; P is told to abort and D's reservation is released, so no
block stays pinned. P stopping early (no KV to push) and a decode engine that cannot reserve
(not a shim) fall back: D computes the prompt itself / the pull flow serves the request
(`fallback`; both counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from pdgate.contract.engine_replies import KVReservation
from pdgate.contract.kv_contract import Continuation, NotifyDecodeParams, NotifyPrefillParams
from pdgate.proxy import (
    KVReadyTimeout,
    KVTransferFailed,
    NotifyServer,
    WaitCancelled,
    WaiterLimitExceeded,
    WaiterTable,
)
from pdgate.router.engines.replies import rewrite_reply_usage
from pdgate.router.errors import (
    EngineError,
    EngineRejected,
    EngineTimeout,
    Overloaded,
    RouterError,
)
from pdgate.router.flows.base import Fallback, FlowParts, StreamResult
from pdgate.router.flows.bodies import decode_leg_body, prefill_leg_body, remote_prefill
from pdgate.router.flows.common import FlowMetrics, relay
from pdgate.router.flows.early import EarlyStream, FirstTokenCheck, eligible, head_chunks
from pdgate.router.flows.failover import (
    Exclusions,
    LegFailure,
    PullInstead,
    choose_prefill,
    run_or_pull,
)
from pdgate.router.flows.legs import PrefillLeg, open_continuation
from pdgate.router.input.schema import ClientRequest
from pdgate.router.policies import PickContext, choose
from pdgate.router.pool import Endpoint
from pdgate.router.tracing import span

__all__ = ["NotifyFlow"]

log = logging.getLogger(__name__)
MODE = "notify"
_REPLY_AFTER_KV_S = 1.0  # P's reply trails its KV-ready notice by ~ms; past this, plain flow


class NotifyFlow:
    """Runs disaggregated requests in notify mode. Built once per app, in the lifespan."""

    def __init__(self, parts: FlowParts, proxy: NotifyServer, metrics: FlowMetrics,
                 kv_ready_timeout_s: float, fallback: Fallback, *,
                 early: FirstTokenCheck | None = None) -> None:
        self.parts = parts
        self.proxy = proxy
        self.metrics = metrics
        self.aborter = parts.aborter
        self.timeout = kv_ready_timeout_s
        self.fallback = fallback  # the pull flow: D cannot reserve, or no healthy P
        self.early = early  # None: no early first token

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """Serve `req`; when D cannot reserve or no prefill engine is healthy, `fallback`
        (the pull flow, which serves it on a decode engine alone if need be) does."""
        return await run_or_pull(req, lambda r, ex: self._attempt(r, ex, t0), self.parts,
                                 lambda r, alone: self.fallback(r, t0, alone))

    async def _attempt(self, req: ClientRequest, ex: Exclusions,
                       t0: float) -> bytes | StreamResult:
        """One try on one D and one P; a failure before the client's first byte releases
        what this attempt holds and raises `LegFailure` (router/flows/failover.py)."""
        o = self.parts
        ctx = PickContext.of(req)
        d_ep = await choose(o.pool, "decode", o.policies["decode"], ctx, exclude=ex.decode)
        p_ep = await choose_prefill(o.pool, o.policies["prefill"], ctx, ex)
        num_tokens = len(req.prompt_token_ids or ())
        slot = await self._reserve_or_fail(d_ep, req, num_tokens)
        try:
            leg = self._dispatch(req, p_ep, slot, num_tokens)
        except BaseException:  # P was never asked to write: D frees at once
            self.aborter.abort(d_ep.url, req.request_id, write_possible=False)
            raise
        wait = self._wait_kv(req, leg, p_ep, d_ep, slot, num_tokens)
        req.served_by["decode"] = d_ep.key
        if req.stream and self.early is not None and eligible(req):
            return await self._stream_early(req, d_ep, leg, asyncio.ensure_future(wait), t0)
        kv = await wait
        try:
            if req.stream:
                return await self._open_decode(req, d_ep, kv, t0)
            return await self._run_decode(req, d_ep, kv)
        except RouterError as exc:  # nothing reached the client yet
            raise LegFailure("decode", d_ep, exc) from None

    async def _reserve_or_fail(self, d_ep: Endpoint, req: ClientRequest,
                               n: int) -> KVReservation:
        try:
            slot = await self._reserve(d_ep, req, n)
        except EngineRejected as exc:
            if exc.status != 404:
                raise
            self.parts.metrics.count_fallback("no_reserve")
            raise PullInstead from None
        except RouterError as exc:
            raise LegFailure("decode", d_ep, exc) from None
        d_ep.health.record_success()
        return slot

    async def _reserve(self, d_ep: Endpoint, req: ClientRequest, n: int) -> KVReservation:
        o = self.parts
        with o.pool.track(d_ep):
            call = asyncio.ensure_future(o.engines.kv_reserve(
                d_ep.url, req.request_id, n, req.engine_headers))
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                # An abort sent now could overtake the reservation on its way to D, which
                # would then hold the blocks until they expire: free them once D answered.
                call.add_done_callback(lambda c: self._release_reserved(c, d_ep, req))
                raise
            except EngineTimeout:
                self.aborter.abort(d_ep.url, req.request_id, write_possible=False)
                raise

    def _release_reserved(self, call: asyncio.Future[KVReservation], d_ep: Endpoint,
                          req: ClientRequest) -> None:
        if not call.cancelled() and call.exception() is None:
            self.aborter.abort(d_ep.url, req.request_id, write_possible=False)

    def _dispatch(self, req: ClientRequest, p_ep: Endpoint, slot: KVReservation,
                  n: int) -> PrefillLeg:
        """Register the KV-ready waiter, then send P the prefill leg naming D's blocks."""
        rid = req.request_id
        waiters = self.proxy.waiters
        # A fresh secret per waiter that P echoes inside the signed notice: a notice P
        # signed for another request, or a replay, cannot wake or fail this one.
        token = secrets.token_hex(16)
        try:
            waiters.register(rid, token)  # before P can possibly notify
        except WaiterLimitExceeded:
            raise Overloaded("too many requests are waiting for their KV cache; retry",
                             reason="kv_waiters") from None
        body = prefill_leg_body(req.body, NotifyPrefillParams(
            remote_engine_id=slot.engine_id, remote_host=slot.host,
            remote_port=slot.port, remote_agent_name=slot.agent_name,
            remote_block_ids=slot.block_ids, reservation_id=slot.reservation_id,
            num_tokens=n, notify_endpoint=self.proxy.advertised_endpoint,
            notify_request_id=rid, notify_token=token,
            # Past this (wall clock) P must not start writing: D's blocks are going away.
            write_deadline=time.time() + self.timeout,
        ).to_params())
        o = self.parts
        leg = PrefillLeg.start(o.pool, o.engines, p_ep, req, body)
        # P failing, or answering without pushing (it stopped early), wakes the wait now.
        leg.task.add_done_callback(lambda _t: _cancel_unless_pushed(leg, waiters, rid))
        return leg

    async def _wait_kv(self, req: ClientRequest, leg: PrefillLeg, p_ep: Endpoint,
                       d_ep: Endpoint, slot: KVReservation, n: int) -> _Leg:
        """Wait for KV-ready. Returns how to run the decode leg; on failure cleans up both
        sides and raises (or falls back, see `_failed`)."""
        rid = req.request_id
        waiters = self.proxy.waiters
        o = self.parts
        try:
            with span("kv_ready_wait", **{"pdgate.reserved_tokens": n}):
                await waiters.wait(rid, self.timeout)
        except BaseException as exc:
            waiters.cancel(rid)
            return self._failed(req, leg, p_ep, d_ep, exc)
        p_ep.health.record_success()
        self.metrics.kv_wait.labels(MODE).observe(time.perf_counter() - leg.t0)
        o.metrics.observe_prefill(time.perf_counter() - leg.t0)
        return _Leg(leg, NotifyDecodeParams(reservation_id=slot.reservation_id,
                                            num_tokens=n).to_params())

    def _failed(self, req: ClientRequest, leg: PrefillLeg, p_ep: Endpoint, d_ep: Endpoint,
                exc: BaseException) -> _Leg:
        """Clean up after a wait that did not end in KV-ready; a fallback or raise."""
        rid = req.request_id
        self.aborter.abort(d_ep.url, rid)  # D's reservation
        if isinstance(exc, WaitCancelled) and leg.error() is None and leg.task.done():
            # P answered without pushing (early stop, as vLLM: no KV params): D recomputes.
            self.parts.metrics.count_fallback("no_kv_push")
            return _Leg(leg, None)
        leg.cancel()
        self.aborter.abort(p_ep.url, rid)  # P's blocks, if it pinned any
        failure = leg.error()
        if isinstance(failure, RouterError):
            self.metrics.flow_failures.labels(MODE, "prefill_failed").inc()
            raise LegFailure("prefill", p_ep, failure) from None
        if isinstance(exc, KVReadyTimeout):
            self.metrics.flow_failures.labels(MODE, "kv_ready_timeout").inc()
            raise LegFailure("prefill", p_ep, EngineTimeout(
                f"no KV-ready notification from prefill engine {p_ep.url} within "
                f"{self.timeout:g}s")) from None
        if isinstance(exc, KVTransferFailed):
            # P could not write into D: most often D died or is unreachable (P answered its
            # own notice, so P is alive). D is blamed and excluded; P is only avoided, so a
            # fleet with one prefill engine still retries on another decode engine.
            self.metrics.flow_failures.labels(MODE, "transfer_failed").inc()
            raise LegFailure("decode", d_ep, pair=p_ep, error=EngineError(
                f"KV transfer from prefill engine {p_ep.url} to {d_ep.url} failed: "
                f"{exc.error or 'unknown error'}")) from None
        if isinstance(exc, Exception):
            self.metrics.flow_failures.labels(MODE, "error").inc()
        raise exc

    async def _run_decode(self, req: ClientRequest, d_ep: Endpoint, kv: _Leg) -> bytes:
        o = self.parts
        body = decode_leg_body(req.body, None if kv.params is None else
                               remote_prefill(kv.params), req.track_ids)
        try:
            with o.pool.track(d_ep), span("decode_leg", **{"pdgate.engine": d_ep.key}):
                raw = await o.engines.post_raw(d_ep.url, req.path, body,
                                               d_ep.pin(req.engine_headers))
        except BaseException:
            self.aborter.abort(d_ep.url, req.request_id)
            raise
        o.metrics.served_whole(MODE)
        usage = kv.leg.usage() if kv.params is not None else None
        if usage is None and kv.params is not None and not kv.leg.task.done():
            # P's reply left before its KV did, so this wait is ~never taken.
            await asyncio.wait({kv.leg.task}, timeout=1.0)
            usage = kv.leg.usage()
        return raw if usage is None else rewrite_reply_usage(raw, usage)

    async def _open_decode(self, req: ClientRequest, d_ep: Endpoint, kv: _Leg,
                           t0: float) -> StreamResult:
        o = self.parts
        body = decode_leg_body(req.body, None if kv.params is None else
                               remote_prefill(kv.params), req.track_ids)
        stack = contextlib.ExitStack()
        stack.enter_context(o.pool.track(d_ep))
        try:
            with span("decode_leg_open", **{"pdgate.engine": d_ep.url}):
                stream = await o.engines.open_stream(d_ep.url, req.path, body,
                                                     req.engine_headers)
            stack.callback(stream.close)
            # Garbage or an error where the stream should start is a 502, not a 200.
            await stream.check_start(o.engines.first_byte_timeout_s)
        except BaseException:
            stack.close()
            self.aborter.abort(d_ep.url, req.request_id)
            raise
        stack.callback(kv.leg.cancel)  # a no-op once P has answered
        rewrite = kv.params is not None
        chunks = relay(stream, kv.leg, o.metrics, t0, MODE, rewrite,
                       req.wants_usage_chunks)
        return StreamResult(chunks, stack.close)


    async def _stream_early(self, req: ClientRequest, d_ep: Endpoint, leg: PrefillLeg,
                            wait: asyncio.Future[_Leg], t0: float) -> StreamResult:
        """Open the client's stream with P's token as soon as P answers, then relay D's
        continuation once KV-ready is in (router/flows/early.py). P's reply not allowing it
        (no push, an early stop, no `first_token_ids`, a token that fails its check): the
        plain stream. Should the KV never arrive, D recomputes the prompt and still
        continues after P's token: the client already has it."""
        try:
            first: set[asyncio.Future[Any]] = {leg.task, wait}
            await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            if not leg.task.done():  # KV-ready came first (or the wait failed: raise)
                await wait
                await asyncio.wait({leg.task}, timeout=_REPLY_AFTER_KV_S)
        except BaseException:
            # E.g. the client left while P's reply trailed its KV-ready notice.
            self._drop_wait(wait, d_ep, req.request_id)
            raise
        reply = leg.reply()
        assert self.early is not None
        token = self.early.pushed(req, reply) if reply is not None else None
        if token is None:
            return await self._open_decode(req, d_ep, await wait, t0)
        ids = token.token_ids
        o, rid = self.parts, req.request_id

        async def rest(stack: contextlib.ExitStack) -> AsyncIterator[bytes]:
            params = await self._continue_params(req, wait, ids)
            stack.enter_context(o.pool.track(d_ep))
            stream = await open_continuation(o.engines, req, d_ep, params, stack)
            return stream.chunks()

        def on_close(source: EarlyStream) -> None:
            if not source.finished:
                self._drop_wait(wait, d_ep, rid)

        head = head_chunks(token, req.kind == "chat", req.wants_usage_chunks,
                           req.track_ids)
        source = EarlyStream(head, rest, on_close)
        chunks = relay(source, leg, o.metrics, t0, MODE, True, req.wants_usage_chunks)
        return StreamResult(chunks, source.close)

    def _drop_wait(self, wait: asyncio.Future[_Leg], d_ep: Endpoint, rid: str) -> None:
        """No decode leg will claim D's reservation (the client left): a KV-ready wait still
        running is cancelled (`_failed` frees D's reservation and P's side); one that ended
        in KV-ready left the KV in D's reservation, which D would hold until it expires
        (cancelling a finished wait does nothing): D is told to free it now."""
        if not wait.done():
            wait.cancel()
        elif not wait.cancelled() and wait.exception() is None:
            self.aborter.abort(d_ep.url, rid)

    async def _continue_params(self, req: ClientRequest, wait: asyncio.Future[_Leg],
                               ids: list[int]) -> dict[str, Any]:
        """D's params to continue after P's token: the reservation P wrote into, or none
        (D recomputes) when the KV was lost."""
        try:
            kv: dict[str, Any] | None = (await wait).params
        except RouterError as exc:  # cleaned up by `_failed`; the client has P's token
            log.warning("request %s: KV from the prefill engine was lost after its first "
                        "token was sent (%s); the decode engine recomputes the prompt",
                        req.request_id, exc.message)
            kv = None
        if kv is None:
            self.metrics.early_tokens.labels("recompute").inc()
            return Continuation(first_token_ids=ids).to_params()
        self.metrics.early_tokens.labels("kv").inc()
        return remote_prefill({**kv, **Continuation(first_token_ids=ids).to_params()})


class _Leg:
    """The prefill leg and the decode leg's KV params (None: D computes the prompt)."""

    def __init__(self, leg: PrefillLeg, params: dict[str, Any] | None) -> None:
        self.leg = leg
        self.params = params


def _cancel_unless_pushed(leg: PrefillLeg, waiters: WaiterTable, rid: str) -> None:
    reply = leg.reply()
    if reply is None or not reply.pushed(MODE):
        waiters.cancel(rid)
