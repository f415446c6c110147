"""P-side NIXL WRITEs of local KV blocks into a peer's blocks (notify and push modes).

`BlockTransfer` is a `BlockReader` that can also write: the same prepared descriptor lists
(local at start, one per peer at handshake), the same in-flight list polled by `poll()`, so
reads and writes share one agent thread and one completion path. Every method runs on the
agent thread.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from pdgate.engine_shim.block_mapping import region_pairs, slot_runs
from pdgate.engine_shim.kv_reader import BlockReader, Peer, block_indices, mem_type
from pdgate.engine_shim.nixl_agent import XferOp
from pdgate.engine_shim.transfer_errors import KVTransferError

log = logging.getLogger(__name__)


class BlockTransfer(BlockReader):
    """A `BlockReader` plus `start_write` and `start_mapped` (block sizes differ)."""

    def start_write(self, peer: Peer, local: list[int], remote: tuple[int, ...], notif: bytes,
                    deadline: float) -> Future[int]:
        """Post a WRITE of `local` blocks into the peer's `remote` blocks (same length, same
        order); the Future gets the byte count once NIXL reports the write complete (or a
        KVTransferError). `notif` reaches the peer after the data."""
        if self._peers.get(peer.engine_id) is not peer:
            raise KVTransferError(f"peer {peer.engine_id} was re-handshaken meanwhile")
        self._check_ids(local, self._layout.num_blocks, "local")
        self._check_ids(list(remote), peer.layout.num_blocks, "remote")
        nbytes = len(local) * self._layout.slab_bytes
        xfer = self._agent.make_xfer(
            "WRITE", self._local, block_indices(self._layout, local), peer.descs,
            block_indices(peer.layout, remote), notif, nbytes)
        return self._start(xfer, deadline, f"a write to {peer.engine_id}")

    def start_mapped(self, op: XferOp, peer: Peer, local: list[int], remote: tuple[int, ...],
                     num_tokens: int, notif: bytes, deadline: float) -> Future[int]:
        """Move a request's first `num_tokens` tokens between caches whose block sizes differ
        (also works when they match): READ remote -> local or WRITE local -> remote, token
        for token (`block_mapping.py`), with region lists built for this request. The
        source's blocks cap the count (a P holding fewer tokens sends what it has); the
        destination must hold them all. The Future gets the byte count (all layers, K and V)
        once the data landed."""
        if self._peers.get(peer.engine_id) is not peer:
            raise KVTransferError(f"peer {peer.engine_id} was re-handshaken meanwhile")
        self._check_ids(local, self._layout.num_blocks, "local")
        self._check_ids(list(remote), peer.layout.num_blocks, "remote")
        lbs, rbs = self._layout.block_size, peer.layout.block_size
        src_tokens = len(remote) * rbs if op == "READ" else len(local) * lbs
        tokens = min(num_tokens, src_tokens)
        try:
            runs = slot_runs(lbs, local, rbs, remote, tokens)
            lregs, rregs = region_pairs(self._layout, self._base_addr, peer.layout,
                                        peer.base_addr, runs)
        except ValueError as e:
            raise KVTransferError(f"cannot map the KV onto {peer.engine_id}: {e}",
                                  reason="params") from e
        xfer = self._agent.make_xfer_regions(
            op, lregs, mem_type(self._mem), self._device_id, peer.agent_name, rregs,
            mem_type(peer.mem), peer.device_id, notif)
        log.debug("%s %d tokens (%d x %d -> %d x %d blocks) as %d regions", op, tokens,
                  len(remote), rbs, len(local), lbs, len(lregs))
        return self._start(xfer, deadline, f"a {op} with {peer.engine_id}")

    def send_notif(self, peer: Peer, message: bytes) -> None:
        """A NIXL notification to a handshaken peer (push registrations)."""
        self._agent.send_notif(peer.agent_name, message)
