"""The D side's inbound KV: a decode request's prompt KV arrives from the prefill engine
before the scheduler runs it.

- pull (vLLM's flow): READ P's leased blocks through the connector;
- notify: the router reserved our blocks (`POST /v1/kv/reserve`, `reserved`); the decode
  leg claims them at admission (`claim`) and awaits P's landed notice;
- push: register our blocks with P and await its WRITE (and the tokens P sampled, when the
  leg continues after P's first token).

With host staging the landed blocks are copied host -> device in a worker thread. Whatever
fails, the prompt is recomputed here (vLLM's recompute policy) or, under
`--kv-load-failure-policy fail`, the request ends with a 502. Blocks a transfer may still
write into go back to the pool only once it cannot (cancel during a READ, push grace).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

from pdgate.contract.kv_contract import NotifyDecodeParams, PushDecodeParams
from pdgate.engine_shim.connector_api import KVConnectorAPI
from pdgate.engine_shim.kv_cache import PagedKVCache
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.reservations import Reservation, Reservations
from pdgate.engine_shim.scheduler import Scheduler
from pdgate.engine_shim.sequence import GenerateRequest, KVLoadFailed, KVRole, Sequence
from pdgate.engine_shim.staging import HostStaging
from pdgate.engine_shim.tracing import annotate, span
from pdgate.engine_shim.transfer_errors import KVConnectorError
from pdgate.engine_shim.transfer_log import TransferLog

__all__ = ["InboundKV", "InboundSettings"]

log = logging.getLogger(__name__)


class InboundSettings:
    """The D side's knobs (from `EngineConfig`; seconds)."""

    __slots__ = ("failure_policy", "landing_timeout", "push_grace", "reserve_seconds",
                 "vocab_size")

    def __init__(self, *, failure_policy: str, landing_timeout: float, push_grace: float,
                 reserve_seconds: float, vocab_size: int) -> None:
        self.failure_policy = failure_policy
        self.landing_timeout = landing_timeout
        self.push_grace = push_grace
        self.reserve_seconds = reserve_seconds
        self.vocab_size = vocab_size


class InboundKV:
    """See the module docstring. `connector` is set by `Engine.attach_connector`."""

    def __init__(self, settings: InboundSettings, kv: PagedKVCache, staging: HostStaging | None,
                 scheduler: Scheduler, metrics: ShimMetrics, transfer_log: TransferLog) -> None:
        self.connector: KVConnectorAPI | None = None
        self._settings = settings
        self._kv = kv
        self._staging = staging
        self._scheduler = scheduler
        self._metrics = metrics
        self._log = transfer_log
        self.reservations = Reservations(settings.reserve_seconds, scheduler.free_blocks,
                                         on_gone=self._forget_landing)
        # Decode sequences admitted into reserved (notify) blocks -> the landing tag to await.
        self._landing_for: weakref.WeakKeyDictionary[Sequence, str] = \
            weakref.WeakKeyDictionary()
        self._reaper: asyncio.Task[None] | None = None

    # ---- lifecycle ----

    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_reservations(), name="shim-reserve-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
            self._reaper = None

    async def _reap_reservations(self, interval: float = 0.5) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.reservations.expire():
                log.warning("notify-mode reservations expired unclaimed; blocks freed")

    # ---- notify: reservations ----

    def reserved(self, request_id: str, blocks: list[int], num_tokens: int) -> Reservation:
        """`blocks` (taken from the pool for a `num_tokens` prompt) become a reservation
        whose landing the connector watches for."""
        r = self.reservations.add(request_id, blocks, num_tokens)
        if self.connector is not None:
            self.connector.expect_landing(r.reservation_id)
        return r

    def claim(self, seq: Sequence) -> bool:
        """A notify-mode decode takes its reserved blocks; True when they cover the prompt
        (it then awaits the landing in `receive`). A size mismatch frees them and the
        prompt is recomputed."""
        leg = seq.req.pdgate
        if seq.req.role is not KVRole.DECODE or not isinstance(leg, NotifyDecodeParams):
            return False
        rid = leg.reservation_id
        r = self.reservations.claim(rid)
        if r is None or r.num_tokens != seq.num_prompt:
            if r is not None:
                self._scheduler.free_blocks(list(r.block_ids))
                self._forget_landing(r.reservation_id)
            log.warning("request %s: reservation %r missing or for another prompt size; "
                        "recomputing the prompt", seq.req.request_id, rid)
            self._kv_load_failed(seq)
            return False
        seq.block_ids = list(r.block_ids)
        self._landing_for[seq] = r.reservation_id
        return True

    def _forget_landing(self, tag: str) -> None:
        if self.connector is not None:
            self.connector.forget_landing(tag)

    # ---- a decode's first read ----

    async def receive(self, seq: Sequence) -> None:
        """Get a DECODE-role request's prompt KV (pull: READ; notify: await the landed
        WRITE; push: register with P and await it); on failure recompute or fail."""
        leg = seq.req.pdgate
        with span("kv_transfer", **_transfer_attributes(seq.req)):
            if isinstance(leg, NotifyDecodeParams):
                await self._await_notified(seq, leg)
            elif isinstance(leg, PushDecodeParams):
                await self._await_pushed(seq, leg)
            else:
                await self._pull_remote(seq)
            annotate(**{"pdgate.kv.reused_tokens": seq.num_cached_tokens})

    async def _await_notified(self, seq: Sequence, leg: NotifyDecodeParams) -> None:
        tag = self._landing_for.pop(seq, None)
        if tag is None:
            return  # no reservation: recompute (counted in claim)
        timeout = self._settings.landing_timeout
        deadline = leg.push_deadline
        if deadline is not None:  # the router's: it stops waiting for this leg then
            timeout = max(0.0, min(timeout, deadline - time.time()))
        landed = self.connector is not None and await self.connector.await_landing(
            tag, timeout) is not None
        if not landed:
            log.warning("request %s: P's write notice for %s did not arrive; recomputing",
                        seq.req.request_id, tag)
            self._kv_load_failed(seq)
            return
        if await self._stage_in(seq, list(seq.block_ids)):
            await self._mark_transferred(seq, len(seq.block_ids), "decode-notify")

    async def _await_pushed(self, seq: Sequence, leg: PushDecodeParams) -> None:
        connector = self.connector
        n = seq.num_prompt
        if connector is None:
            self._kv_load_failed(seq)
            return
        local = seq.block_ids[: self._scheduler.blocks_for(n)]
        try:
            _, tokens = await connector.await_push(leg, seq.req.request_id, local, n)
        except asyncio.CancelledError:
            # P may be writing into these blocks right now (it was told to stop): keep them
            # out of the pool a little longer.
            blocks, seq.block_ids = seq.block_ids, []
            asyncio.get_running_loop().call_later(self._settings.push_grace,
                                                  self._scheduler.free_blocks, blocks)
            raise
        except Exception as e:
            log.warning("request %s: KV push failed (%s: %s); recomputing the prompt",
                        seq.req.request_id, type(e).__name__, e)
            self._no_prefill_token(seq)
            self._kv_load_failed(seq)
            return
        if seq.req.continue_after_prefill:
            vocab = self._settings.vocab_size
            if not tokens or len(tokens) >= seq.req.max_tokens or \
                    not all(0 <= t < vocab for t in tokens):
                self._no_prefill_token(seq)
            seq.resume(tokens)
        if await self._stage_in(seq, local):
            await self._mark_transferred(seq, len(local), "decode-push")

    async def _pull_remote(self, seq: Sequence) -> None:
        remote = seq.req.remote_block_ids
        n = seq.num_prompt
        connector = self.connector
        if connector is None or not remote:
            log.warning(
                "request %s: cannot pull %d remote blocks for a %d-token prompt (connector %s);"
                " recomputing the prompt", seq.req.request_id, len(remote), n,
                "missing" if connector is None else "present",
            )
            self._kv_load_failed(seq)
            return
        # The connector maps tokens: P's blocks whatever P's block size.
        local = seq.block_ids[: self._scheduler.blocks_for(n)]
        task = asyncio.ensure_future(self._pull_and_stage(connector, seq, local))
        try:
            nbytes = await asyncio.shield(task)
        except asyncio.CancelledError:
            # NIXL may still be writing into these blocks: free them only once it is done.
            blocks, seq.block_ids = seq.block_ids, []
            task.add_done_callback(lambda _t: self._scheduler.free_blocks(blocks))
            raise
        except Exception as e:  # a failed pull falls back to recompute, never to an error
            if not isinstance(e, KVConnectorError):
                log.exception("request %s: KV pull raised unexpectedly", seq.req.request_id)
            log.warning("request %s: KV pull failed (%s: %s); recomputing the prompt",
                        seq.req.request_id, type(e).__name__, e)
            self._kv_load_failed(seq)
            return
        layout = self._kv.layout
        received = nbytes // (2 * layout.num_layers * layout.token_bytes)
        seq.num_computed = _reusable(seq, received)
        seq.num_cached_tokens = seq.num_computed
        await self._log.record(seq.req.request_id, "decode", local, nbytes, num_tokens=n)

    async def _pull_and_stage(self, connector: KVConnectorAPI, seq: Sequence,
                              local: list[int]) -> int:
        """READ the prompt's KV into `local` (through the host staging mirror, then copied
        to the device, when staging is on); the bytes read."""
        nbytes = await connector.pull_tokens(seq.req.remote or {}, local, seq.num_prompt)
        if self._staging is not None:
            await asyncio.to_thread(self._staging.to_device, local)
        return nbytes

    async def _stage_in(self, seq: Sequence, blocks: list[int]) -> bool:
        """Host staging (D): copy the landed blocks host -> device before the model reads
        them. False (the prompt is recomputed) when the copy failed. On cancel the blocks go
        back to the pool only once the copy into them has finished."""
        staging = self._staging
        if staging is None:
            return True
        task = asyncio.ensure_future(asyncio.to_thread(staging.to_device, blocks))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            held, seq.block_ids = seq.block_ids, []
            task.add_done_callback(lambda _t: self._scheduler.free_blocks(held))
            raise
        except Exception:
            log.exception("request %s: staging the KV in failed; recomputing the prompt",
                          seq.req.request_id)
            self._kv_load_failed(seq)
            return False
        return True

    async def _mark_transferred(self, seq: Sequence, blocks: int, role: str) -> None:
        seq.num_computed = _reusable(seq, blocks * self._kv.layout.block_size)
        seq.num_cached_tokens = seq.num_computed
        await self._log.record(seq.req.request_id, role, seq.block_ids[:blocks],
                               self._log.nbytes(blocks), num_tokens=seq.num_prompt)

    def _no_prefill_token(self, seq: Sequence) -> None:
        """A decode asked to continue after P's token cannot learn that token: fail it (the
        router, which streamed P's token, continues it elsewhere) instead of sampling anew."""
        if seq.req.continue_after_prefill:
            self._metrics.series(seq.req.model).count_request("decode", "kv_load_failed")
            raise KVLoadFailed(f"request {seq.req.request_id}: no token from the prefill "
                               "engine to continue after (its KV push did not land)")

    def _kv_load_failed(self, seq: Sequence) -> None:
        """The remote KV of `seq` could not be used: count it, then recompute the prompt
        (the caller goes on) or, under the "fail" policy, end the request with a 502."""
        series = self._metrics.series(seq.req.model)
        if self._settings.failure_policy == "fail":
            series.count_request("decode", "kv_load_failed")
            raise KVLoadFailed(
                f"request {seq.req.request_id}: the prompt's KV could not be loaded from the "
                "prefill engine (kv_load_failure_policy=fail)")
        series.count_request("decode", "recompute")


def _transfer_attributes(req: GenerateRequest) -> dict[str, Any]:
    """The `kv_transfer` span's attributes known before it runs: mode, who moves the bytes
    (pull: D READs; notify/push: P WRITEs) and the peer (notify: D is not told which P)."""
    leg = req.pdgate
    if isinstance(leg, PushDecodeParams):
        mode, engine, host, port = "push", leg.remote_engine_id, leg.remote_host, leg.remote_port
    elif isinstance(leg, NotifyDecodeParams):
        mode, engine, host, port = "notify", None, None, None
    else:
        remote = req.remote or {}
        mode, engine = "pull", remote.get("remote_engine_id")
        host, port = remote.get("remote_host"), remote.get("remote_port")
    return {"pdgate.kv.mode": mode, "pdgate.kv.op": "READ" if mode == "pull" else "WRITE",
            "pdgate.kv.peer_engine_id": engine if isinstance(engine, str) else None,
            "pdgate.kv.peer": f"{host}:{port}" if host is not None else None}


def _reusable(seq: Sequence, received_tokens: int) -> int:
    """How many of `seq`'s tokens the transferred KV lets the model skip. The last known
    token is always computed: its logits give the next token (with `first_token_ids`, that
    is P's token, so the whole prompt's KV is used)."""
    return max(0, min(received_tokens, seq.num_prompt, len(seq.token_ids) - 1))

