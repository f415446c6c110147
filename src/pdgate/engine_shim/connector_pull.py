"""The pull direction of the KV connector (vLLM's flow): D READs P's blocks.

P side: `hold` pins a finished prompt's blocks under a lease and returns vLLM-compatible
`kv_transfer_params`; the blocks go back to the pool (via `free_blocks`) when the reader's
`done` notice arrives (`read_done`), when the lease expires (`expire`, agent thread) or on
`abort`. D side: `pull` handshakes with P's side channel the first time it meets an engine
id, READs the blocks with NIXL and lets P know (the READ carries the notice, delivered after
the data). `pull` never blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future

from pdgate.engine_shim.connector_link import AgentLink, encode
from pdgate.engine_shim.kv_params import PullParams, hold_params, parse_pull_params
from pdgate.engine_shim.kv_reader import Peer
from pdgate.engine_shim.leases import Lease, LeaseTable
from pdgate.engine_shim.notices import ReadDone
from pdgate.engine_shim.transfer_errors import KVTransferError

__all__ = ["PullSide"]

log = logging.getLogger(__name__)
_OP = "read"


class PullSide:
    """See the module docstring. `side_channel` gives (host, port) for the hold params."""

    def __init__(self, link: AgentLink, *, lease_seconds: float, transfer_timeout: float,
                 free_blocks: Callable[[list[int]], None],
                 side_channel: Callable[[], tuple[str, int]]) -> None:
        self._link = link
        self._metrics = link.metrics
        self._leases = LeaseTable(lease_seconds)
        # Request ids aborted lately, with when to forget them (monotonic; one span for all,
        # so in expiry order): an abort can overtake its prefill's hand-over (the router
        # gave up while P was finishing; the hand-over's staging copy or digest runs in a
        # thread), and the lease taken after it would pin the blocks until it expired.
        self._aborted: OrderedDict[str, float] = OrderedDict()
        self._aborted_span = lease_seconds
        self._transfer_timeout = transfer_timeout
        self._free_blocks = free_blocks
        self._side_channel = side_channel

    # -- P side ---------------------------------------------------------------------------
    def hold(self, request_id: str, block_ids: list[int]) -> dict[str, object]:
        """Pin `block_ids` (now owned by the lease) for a remote reader; the prefill reply's
        `kv_transfer_params` (vLLM NixlConnector fields). Raises KVTransferError for a
        request aborted before its blocks came (the caller keeps and frees them)."""
        self._forget_aborted()
        if request_id in self._aborted:
            raise KVTransferError(f"request {request_id} was aborted before its KV was "
                                  "handed over", reason="aborted")
        lease = self._leases.add(request_id, block_ids)
        self._metrics.blocks_leased.set(self._leases.blocks)
        self._link.thread.wake()  # the reader's READ needs our UCX progress soon
        host, port = self._side_channel()
        return hold_params(
            engine_id=self._link.engine_id, request_id=lease.lease_id, block_ids=block_ids,
            host=host, port=port, agent_name=self._link.agent_name,
        )

    def release_request(self, request_id: str) -> None:
        """Free every lease `request_id` holds now (router abort, failed decode leg), and
        refuse one it asks for within the lease span."""
        self._forget_aborted()
        self._aborted[request_id] = time.monotonic() + self._aborted_span
        self._aborted.move_to_end(request_id)
        self._release(self._leases.pop_request(request_id), None)

    def _forget_aborted(self) -> None:
        now = time.monotonic()
        while self._aborted and next(iter(self._aborted.values())) <= now:
            self._aborted.popitem(last=False)

    def read_done(self, lease_id: str) -> None:
        """Agent thread: the reader's `done` notice frees its lease."""
        lease = self._leases.pop(lease_id)
        if lease is None:
            log.debug("done notice for unknown lease %r", lease_id)
        else:
            self._release([lease], "released")

    def expire(self) -> None:
        """Agent thread: free the leases past their time."""
        self._release(self._leases.pop_expired(), "expired")

    def release_all(self) -> None:
        self._release(self._leases.pop_all(), None)

    @property
    def leases(self) -> int:
        return len(self._leases)

    @property
    def blocks(self) -> int:
        return self._leases.blocks

    def _release(self, leases: list[Lease], counter_name: str | None) -> None:
        for lease in leases:
            try:
                self._free_blocks(list(lease.block_ids))
            except Exception:
                log.exception("freeing the blocks of lease %s failed", lease.lease_id)
            if counter_name == "released":
                self._metrics.leases_released.inc()
            elif counter_name == "expired":
                self._metrics.leases_expired.inc()
                log.warning("lease %s expired; %d blocks freed unread", lease.lease_id,
                            len(lease.block_ids))
        if leases:
            self._metrics.blocks_leased.set(self._leases.blocks)

    # -- D side ---------------------------------------------------------------------------
    async def pull(self, params: Mapping[str, object], local: list[int],
                   num_tokens: int | None) -> int:
        """READ P's blocks into `local`; see `KVConnector.pull` / `pull_tokens`."""
        t0 = time.perf_counter()
        try:
            req = parse_pull_params(params)
            if num_tokens is None and len(req.block_ids) != len(local):
                raise KVTransferError(
                    f"{len(req.block_ids)} remote blocks but {len(local)} local")
            nbytes = await self._pull_with_retry(req, local, num_tokens)
        except KVTransferError as e:
            self._metrics.kv_transfer_failures.labels(op=_OP, reason=e.reason).inc()
            raise
        self._metrics.kv_transfers.labels(op=_OP).inc()
        self._metrics.kv_transfer_bytes.labels(op=_OP).inc(nbytes)
        self._metrics.kv_transfer_seconds.labels(op=_OP).observe(time.perf_counter() - t0)
        return nbytes

    async def _pull_with_retry(self, req: PullParams, local: list[int],
                               num_tokens: int | None) -> int:
        link = self._link
        peer, fresh = await link.peer(req)
        try:
            return await self._read(peer, req, local, num_tokens)
        except KVTransferError as e:
            if fresh or e.reason != "transfer":
                raise
            # The peer may have restarted since we met it: re-handshake once, and read again
            # only when it really is a new agent (else the first error stands).
            log.warning("request %s: read from %s failed (%s); re-handshaking",
                        req.request_id, req.engine_id, e)
            await link.submit(lambda: link.get_reader().drop_peer(req.engine_id))
            new_peer, _ = await link.peer(req)
            if new_peer.agent_name == peer.agent_name:
                raise
            nbytes = await self._read(new_peer, req, local, num_tokens)
            log.info("request %s: read from %s recovered: it restarted as agent %s",
                     req.request_id, req.engine_id, new_peer.agent_name)
            return nbytes

    async def _read(self, peer: Peer, req: PullParams, local: list[int],
                    num_tokens: int | None) -> int:
        deadline = time.monotonic() + self._transfer_timeout
        notif = encode(ReadDone(lease_id=req.request_id))
        done = await self._link.submit(lambda: self._start_read(
            peer, local, req.block_ids, num_tokens, notif, deadline))
        try:  # the agent thread enforces the deadline; the extra second guards a stuck thread
            return await asyncio.wait_for(asyncio.wrap_future(done), self._transfer_timeout + 1)
        except TimeoutError as e:
            raise KVTransferError(f"KV read from {req.engine_id} timed out",
                                  reason="timeout") from e

    def _start_read(self, peer: Peer, local: list[int], remote: tuple[int, ...],
                    num_tokens: int | None, notif: bytes, deadline: float) -> Future[int]:
        """Agent thread: whole blocks when the block sizes match (prepared descriptors),
        else the prompt's tokens mapped between the two block sizes."""
        reader = self._link.get_reader()
        ours = self._link.kv.layout.block_size
        if peer.layout.block_size != ours:
            if num_tokens is None:
                raise KVTransferError(
                    f"block size {peer.layout.block_size} of {peer.engine_id} differs from "
                    f"ours ({ours}); the prompt length is needed", reason="params")
            return reader.start_mapped("READ", peer, local, remote, num_tokens, notif,
                                       deadline)
        if num_tokens is not None:
            if len(remote) > len(local):
                raise KVTransferError(f"{len(remote)} remote blocks but {len(local)} local",
                                      reason="params")
            local = local[:len(remote)]
        return reader.start_read(peer, local, remote, notif, deadline)
