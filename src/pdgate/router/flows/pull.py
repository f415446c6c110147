"""The pull flow (`--pd-mode pull`, vLLM NixlConnector; docs/flows.md), and the decode-only
path every mode falls back to.

Per request: prefill leg (one token; P keeps the prompt's KV and answers with its
`kv_transfer_params`) → decode leg naming them (D READs the KV; router/flows/legs.py) → the
answer, non-streaming or relayed as SSE. Each leg runs through `run_leg`
(router/flows/failover.py): a retryable failure before any byte reached the client is tried
on another engine of the same role. After the first byte, a failure ends the SSE stream
with an error event and `[DONE]`. When no prefill engine is healthy the decode engine
computes the prompt itself (counted). Eligible streams get P's token at once
(router/flows/early.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdgate.router.engines.replies import PrefillReply
from pdgate.router.errors import EngineTimeout, EngineUnavailable, NoEndpointAvailable
from pdgate.router.flows.base import FlowParts, StreamResult
from pdgate.router.flows.bodies import prefill_leg_body
from pdgate.router.flows.common import FlowMetrics
from pdgate.router.flows.early import ASK_TOKEN_IDS, FirstTokenCheck, wants_early
from pdgate.router.flows.failover import run_leg
from pdgate.router.flows.legs import DecodeLeg, PrefillOutcome
from pdgate.router.input.schema import ClientRequest
from pdgate.router.pool import Endpoint
from pdgate.router.tracing import span

__all__ = ["PrefillOutcome", "PullFlow"]

log = logging.getLogger(__name__)


class PullFlow:
    """Runs requests in pull mode, and decode-only requests of every mode. With `early`
    (the first-token check), eligible streams get P's token at once (counted on
    `flow_metrics.early_tokens`)."""

    def __init__(self, parts: FlowParts, flow_metrics: FlowMetrics | None = None,
                 early: FirstTokenCheck | None = None) -> None:
        self.parts = parts
        self.decode = DecodeLeg(parts, flow_metrics)
        self.early = early if flow_metrics is not None else None

    async def run(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """Serve a disaggregated request: prefill (or decode-only fallback), then decode."""
        prefill = await self.prefill_or_fallback(req)
        return await self.decode.serve(req, prefill, t0,
                                       "disagg" if prefill is not None else "direct")

    async def direct(self, req: ClientRequest, t0: float) -> bytes | StreamResult:
        """Serve a request the decider kept on one engine: the decode engine alone."""
        return await self.decode.serve(req, None, t0, "direct")

    async def fallback(self, req: ClientRequest, t0: float,
                       decode_alone: bool) -> bytes | StreamResult:
        """Serve a request the notify/push flow handed over (`base.Fallback`): as `run`
        does, or on a decode engine alone, counted, when every prefill engine was
        unreachable for it (asked again, a P killed a moment ago refuses once more; a
        host gone dark costs another connect timeout)."""
        if not decode_alone:
            return await self.run(req, t0)
        self._without_prefill(req, "every prefill engine unreachable for this request")
        return await self.decode.serve(req, None, t0, "direct")

    async def prefill_or_fallback(self, req: ClientRequest) -> PrefillOutcome | None:
        """`run_prefill`, or None (decode-only, counted) when no prefill engine is healthy or
        every one tried could not be reached: a P/D router must keep serving on its decode
        engines when every P is down, also in the seconds before the health probes see it
        (a P killed a moment ago refuses connections while the pool still counts it)."""
        try:
            return await self.run_prefill(req)
        except (NoEndpointAvailable, EngineUnavailable) as exc:
            if self.parts.pool.healthy("prefill") and not isinstance(exc, EngineUnavailable):
                raise
            self._without_prefill(req, exc.message)
            return None

    def _without_prefill(self, req: ClientRequest, why: str) -> None:
        """Count and log a disaggregated request going to a decode engine alone."""
        self.parts.metrics.count_fallback("no_prefill")
        # A notify/push attempt may have named a P that then dropped the request: the
        # headers and the access log name the engines that served it.
        req.served_by.pop("prefill", None)
        log.warning("request %s: no healthy prefill engine (%s); decode engine computes the "
                    "prompt", req.request_id, why)

    async def run_prefill(self, req: ClientRequest) -> PrefillOutcome:
        """P leg: send the one-token prefill and read P's KV params and usage."""
        parts = self.parts
        early = self.early is not None and wants_early(req)
        body = prefill_leg_body({**req.body, ASK_TOKEN_IDS: True} if early else req.body)
        t0 = time.perf_counter()

        async def call(ep: Endpoint) -> PrefillReply:
            with parts.pool.track(ep):
                try:
                    return await parts.engines.prefill(
                        ep.url, req.path, body, ep.pin(req.engine_headers))
                except (asyncio.CancelledError, EngineTimeout):
                    # P may still finish this prefill and pin blocks nobody will read.
                    parts.aborter.abort(ep.url, req.request_id)
                    raise

        with span("prefill_leg"):
            reply = await run_leg(parts, "prefill", req, call)
        parts.metrics.observe_prefill(time.perf_counter() - t0)
        kv = reply.kv_params
        if kv is None:
            parts.metrics.count_fallback("no_kv_params")
            log.warning("request %s: prefill returned no kv_transfer_params; decode will "
                        "recompute the prompt", req.request_id)
        first = self.early.listed(req, reply) if self.early and early and kv is not None \
            else None
        return PrefillOutcome(kv, reply.usage, first)
