"""The notify flow (design.md §3, `--pd-mode notify`): P pushes the KV, the router waits for
KV-ready, then D decodes.

Per request: pick D first → reserve the prompt's blocks on D (`POST /v1/kv/reserve`) →
register the KV-ready waiter → send P the prefill with D's blocks, side channel and this
router's proxy endpoint (P's HTTP reply is not awaited: it runs in the background and only
its failure matters) → await KV-ready (deadline `kv_ready_timeout_s`) → send D the decode
leg naming the reservation. TTFT ≈ prefill + WRITE + one notification, no HTTP round trip
and no serial READ between the legs.

Failures before the decode leg: P's error, a `failed` KV-ready, or the deadline end the
request with a clear 502/504; P is told to abort and D's reservation is released, so no
block stays pinned. P stopping early (no KV to push) and a decode engine that cannot reserve
(not a shim) fall back: D computes the prompt itself / the pull flow runs (both counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec

from proxy import KVReadyTimeout, KVTransferFailed, NotifyServer, WaitCancelled, WaiterTable
from router.errors import EngineError, EngineRejected, EngineTimeout, RouterError
from router.flows_common import (
    Aborter,
    FlowMetrics,
    PrefillLeg,
    decode_leg_body,
    prefill_leg_body,
    relay,
    rewrite_reply_usage,
)
from router.orchestrator import Orchestrator, StreamResult
from router.policies import PickContext, choose
from router.pool import Endpoint
from router.schema import ClientRequest

__all__ = ["NotifyFlow"]

log = logging.getLogger(__name__)
_json_encode = msgspec.json.Encoder().encode
MODE = "notify"


class NotifyFlow:
    """Runs disaggregated requests in notify mode. Built once per app, in the lifespan."""

    def __init__(self, orch: Orchestrator, proxy: NotifyServer, metrics: FlowMetrics,
                 aborter: Aborter, kv_ready_timeout_s: float) -> None:
        self.orch = orch
        self.proxy = proxy
        self.metrics = metrics
        self.aborter = aborter
        self.timeout = kv_ready_timeout_s

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult | None:
        """Serve `req`; None means "not possible here, run the pull flow" (D cannot reserve)."""
        o = self.orch
        ctx = PickContext.of(req)
        d_ep = await choose(o.pool, "decode", o.policies["decode"], ctx)
        num_tokens = len(req.prompt_token_ids or ())
        try:
            slot = await self._reserve(d_ep, req, num_tokens)
        except EngineRejected as exc:
            if exc.status != 404:
                raise
            o.metrics.fallbacks.labels("no_reserve").inc()
            return None
        p_ep = await choose(o.pool, "prefill", o.policies["prefill"], ctx)
        kv = await self._prefill_and_wait(req, p_ep, d_ep, slot, num_tokens)
        req.served_by["decode"] = d_ep.url
        if req.stream:
            return await self._open_decode(req, d_ep, kv, t0)
        return await self._run_decode(req, d_ep, kv, t0)

    async def _reserve(self, d_ep: Endpoint, req: ClientRequest, n: int) -> dict[str, Any]:
        body = _json_encode({"request_id": req.request_id, "num_tokens": n})
        with self.orch.pool.track(d_ep):
            return await self.orch.engines.post_json(d_ep.url, "/v1/kv/reserve", body,
                                                     req.engine_headers)

    async def _prefill_and_wait(self, req: ClientRequest, p_ep: Endpoint, d_ep: Endpoint,
                                slot: dict[str, Any], n: int) -> _Leg:
        """Dispatch P and wait for KV-ready. Returns how to run the decode leg."""
        rid = req.request_id
        waiters = self.proxy.waiters
        waiters.register(rid)  # before P can possibly notify
        body = prefill_leg_body(req.body, {
            "pdgate_mode": MODE, "remote_engine_id": slot["engine_id"],
            "remote_host": slot["host"], "remote_port": slot["port"],
            "remote_agent_name": slot.get("agent_name"),
            "remote_block_ids": slot["block_ids"], "reservation_id": slot["reservation_id"],
            "num_tokens": n, "notify_endpoint": self.proxy.advertised_endpoint,
            "notify_request_id": rid,
            # Past this (wall clock) P must not start writing: D's blocks are going away.
            "write_deadline": time.time() + self.timeout,
        })
        o = self.orch
        leg = PrefillLeg.start(o.pool, o.engines, p_ep, req, body)
        # P failing, or answering without pushing (it stopped early), wakes the wait now.
        leg.task.add_done_callback(lambda _t: _cancel_unless_pushed(leg, waiters, rid))
        try:
            await waiters.wait(rid, self.timeout)
        except BaseException as exc:
            waiters.cancel(rid)
            return self._failed(req, leg, p_ep, d_ep, exc)
        self.metrics.kv_wait.labels(MODE).observe(time.perf_counter() - leg.t0)
        o.metrics.prefill_duration.observe(time.perf_counter() - leg.t0)
        return _Leg(leg, {"pdgate_mode": MODE, "reservation_id": slot["reservation_id"],
                          "num_tokens": n})

    def _failed(self, req: ClientRequest, leg: PrefillLeg, p_ep: Endpoint, d_ep: Endpoint,
                exc: BaseException) -> _Leg:
        """Clean up after a wait that did not end in KV-ready; a fallback or raise."""
        rid, headers = req.request_id, req.engine_headers
        self.aborter.abort(d_ep, rid, headers)  # D's reservation
        if isinstance(exc, WaitCancelled) and leg.error() is None and leg.task.done():
            # P answered without pushing (early stop, as vLLM: no KV params): D recomputes.
            self.orch.metrics.fallbacks.labels("no_kv_push").inc()
            return _Leg(leg, None)
        leg.cancel()
        self.aborter.abort(p_ep, rid, headers)  # P's blocks, if it pinned any
        failure = leg.error()
        if isinstance(failure, RouterError):
            self.metrics.flow_failures.labels(MODE, "prefill_failed").inc()
            raise failure
        if isinstance(exc, KVReadyTimeout):
            self.metrics.flow_failures.labels(MODE, "kv_ready_timeout").inc()
            raise EngineTimeout(f"no KV-ready notification from prefill engine {p_ep.url} "
                                f"within {self.timeout:g}s") from None
        if isinstance(exc, KVTransferFailed):
            self.metrics.flow_failures.labels(MODE, "transfer_failed").inc()
            raise EngineError(f"KV transfer from prefill engine {p_ep.url} to {d_ep.url} "
                              f"failed: {exc.error or 'unknown error'}") from None
        if isinstance(exc, Exception):
            self.metrics.flow_failures.labels(MODE, "error").inc()
        raise exc

    async def _run_decode(self, req: ClientRequest, d_ep: Endpoint, kv: _Leg,
                          t0: float) -> bytes:
        o = self.orch
        body = decode_leg_body(req.body, kv.params)
        try:
            with o.pool.track(d_ep):
                raw = await o.engines.post_raw(d_ep.url, req.path, body, req.engine_headers)
        except BaseException:
            self.aborter.abort(d_ep, req.request_id, req.engine_headers)
            raise
        o.metrics.child(o.metrics.ttft, MODE).observe(time.perf_counter() - t0)
        usage = kv.leg.usage() if kv.params is not None else None
        if usage is None and kv.params is not None and not kv.leg.task.done():
            # P's reply left before its KV did, so this wait is ~never taken.
            await asyncio.wait({kv.leg.task}, timeout=1.0)
            usage = kv.leg.usage()
        return raw if usage is None else rewrite_reply_usage(raw, usage)

    async def _open_decode(self, req: ClientRequest, d_ep: Endpoint, kv: _Leg,
                           t0: float) -> StreamResult:
        o = self.orch
        body = decode_leg_body(req.body, kv.params)
        stack = contextlib.ExitStack()
        stack.enter_context(o.pool.track(d_ep))
        try:
            stream = await o.engines.open_stream(d_ep.url, req.path, body, req.engine_headers)
        except BaseException:
            stack.close()
            self.aborter.abort(d_ep, req.request_id, req.engine_headers)
            raise
        stack.callback(stream.close)
        stack.callback(kv.leg.cancel)  # a no-op once P has answered
        rewrite = req.wants_usage_chunks and kv.params is not None
        chunks = relay(stream, kv.leg, o.metrics, t0, MODE, rewrite)
        return StreamResult(chunks, stack.close)


class _Leg:
    """The prefill leg and the decode leg's KV params (None: D computes the prompt)."""

    def __init__(self, leg: PrefillLeg, params: dict[str, Any] | None) -> None:
        self.leg = leg
        self.params = params


def _cancel_unless_pushed(leg: PrefillLeg, waiters: WaiterTable, rid: str) -> None:
    params = leg.kv_params()
    if leg.error() is not None or leg.task.cancelled() or not (
            isinstance(params, dict) and params.get("pdgate_mode") == MODE):
        waiters.cancel(rid)
