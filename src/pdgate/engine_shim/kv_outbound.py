"""The P side's outbound KV: a prefill that ran to its length cap hands its prompt's blocks
to the connector (pull: a lease a decode engine READs; notify/push: a WRITE into D), and a
push-mode prefill that will never hand over tells the connector, which tells the D waiting
for it.

Off the event loop: the hand-over's device-to-host copy (host staging) and, with
`--kv-digests`, the hash of the handed-over blocks run in a worker thread; the scheduler
goes on stepping other requests meanwhile. The request's final output (with its
`kv_transfer_params`) is delivered, and its remaining blocks freed, once the hand-over is
done. The connector calls themselves are bookkeeping (the transfer runs on the connector's
agent thread) and run on the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from pdgate.contract.kv_contract import NotifyPrefillParams, PushPrefillParams
from pdgate.engine_shim.connector_api import KVConnectorAPI
from pdgate.engine_shim.scheduler import Scheduler
from pdgate.engine_shim.sequence import GenerateRequest, KVRole, Sequence, StepOutput
from pdgate.engine_shim.staging import HostStaging
from pdgate.engine_shim.transfer_errors import KVTransferError
from pdgate.engine_shim.transfer_log import TransferLog

__all__ = ["OutboundKV"]

log = logging.getLogger(__name__)


class OutboundKV:
    """See the module docstring. `connector` is set by `Engine.attach_connector`."""

    def __init__(self, scheduler: Scheduler, staging: HostStaging | None,
                 transfer_log: TransferLog) -> None:
        self.connector: KVConnectorAPI | None = None
        self._scheduler = scheduler
        self._staging = staging
        self._log = transfer_log
        self._tasks: set[asyncio.Task[None]] = set()

    def finish(self, seq: Sequence, final: StepOutput) -> StepOutput | None:
        """Scheduler hook (event loop), when `seq` finished: the final output to deliver
        now, or None when a hand-over started (it releases `seq` and delivers its final
        output itself). vLLM: an early stop sends no params and D recomputes."""
        if seq.req.role is not KVRole.PREFILL:
            return final
        connector = self.connector
        if seq.finish_reason != "length" or connector is None:
            if connector is None and seq.finish_reason == "length":
                log.warning("request %s: do_remote_decode without a connector; no "
                            "kv_transfer_params", seq.req.request_id)
            self.abandoned(seq.req, f"prefill ended ({seq.finish_reason}) without "
                           "handing its KV over")
            return final
        task = asyncio.ensure_future(self._deliver(seq, final, connector))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return None

    def released(self, seq: Sequence, status: str) -> None:
        """Scheduler hook: a sequence's blocks went back to the pool. A push-mode prefill
        that did not finish ("aborted": cancelled, "error": the model failed) will push
        nothing."""
        if status != "ok":
            self.abandoned(seq.req, f"prefill {status}")

    def abandoned(self, req: GenerateRequest, detail: str) -> None:
        """A push-mode prefill leg will never hand its KV over: have the connector tell the
        decode engine that registered for it (else D waits for its transfer timeout)."""
        if req.role is not KVRole.PREFILL or not isinstance(req.pdgate, PushPrefillParams):
            return
        if self.connector is not None:
            self.connector.fail_push(req.request_id, "prefill", detail)

    async def drain(self) -> None:
        """Wait for the hand-overs in flight (shutdown: before the connector closes)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _deliver(self, seq: Sequence, final: StepOutput,
                       connector: KVConnectorAPI) -> None:
        params = None
        try:
            params = await self._hand_over(seq, connector)
        finally:  # whatever happened, the request ends and its other blocks are freed
            if params is None:
                self.abandoned(seq.req, f"prefill ended ({seq.finish_reason}) without "
                               "handing its KV over")
            else:
                final = dataclasses.replace(final, kv_transfer_params=params)
            self._scheduler.release(seq, "ok")
            seq.queue.put_nowait(final)

    async def _hand_over(self, seq: Sequence, connector: KVConnectorAPI
                         ) -> dict[str, Any] | None:
        """Give the prompt's blocks to the connector; the params for the reply (None: not
        handed over, the blocks stay the sequence's)."""
        keep = self._scheduler.blocks_for(seq.num_prompt)
        held = seq.block_ids[:keep]
        leg = seq.req.pdgate
        try:
            # Before the connector holds them: a reader may free the blocks once it has.
            digest = await asyncio.to_thread(self._copy_out, held, seq.num_prompt)
            if isinstance(leg, NotifyPrefillParams | PushPrefillParams):
                params = connector.push_blocks(seq.req.request_id, held, seq.num_prompt,
                                               leg, tuple(seq.token_ids[seq.num_prompt:]))
            else:
                params = connector.hold_for_remote_decode(seq.req.request_id, held)
        except KVTransferError as exc:  # e.g. the router aborted it while it prefilled
            log.info("request %s: KV not handed over: %s", seq.req.request_id, exc)
            return None
        except Exception:
            log.exception("request %s: handing the KV over failed", seq.req.request_id)
            return None
        seq.block_ids = seq.block_ids[keep:]  # what the connector took is no longer ours
        self._log.add(seq.req.request_id, "prefill", held, self._log.nbytes(len(held)),
                      digest)
        return params

    def _copy_out(self, blocks: list[int], num_tokens: int) -> str | None:
        """Worker thread: the host staging copy (a peer may read the host mirror from the
        hand-over on) and the digest of the blocks, if asked for."""
        if self._staging is not None:
            self._staging.to_host(blocks)
        return self._log.digest(blocks, num_tokens)
