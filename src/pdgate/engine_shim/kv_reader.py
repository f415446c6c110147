"""D-side NIXL reads of remote KV blocks. Every method runs on the agent thread.

Descriptor lists are prepared once: the local one at start, one per peer at handshake, both
per block in `region_list` order. Block-major (the default layout): one descriptor per block
(its slab of every layer, K and V), so descriptor `block` is that block, a pool's list is
`num_blocks` long and a run of consecutive blocks merges into ONE descriptor. Layer-major: one
per (layer, K|V, block), descriptor `(layer * 2 + kv) * num_blocks + block`, and a run moves as
one descriptor per (layer, K|V) (64 for Llama-3-8B; bench/kv_transfer.py). A read names the
request's blocks by index and NIXL merges descriptors adjacent on both sides. In-flight reads
are polled by `poll()`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pdgate.engine_shim.kv_layout import KVLayout, region_list
from pdgate.engine_shim.nixl_agent import MemType, PreppedList, TransferAgent, Xfer
from pdgate.engine_shim.side_channel import HandshakePayload
from pdgate.engine_shim.transfer_errors import KVTransferError, NixlAgentError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Peer:
    """A handshaken remote engine: its agent and its prepared per-block descriptor list, plus
    where its registered KV lives (for per-request region lists when block sizes differ)."""

    engine_id: str
    agent_name: str
    layout: KVLayout
    descs: PreppedList
    base_addr: int = 0
    mem: str = "DRAM"
    device_id: int = 0


@dataclass
class _Pending:
    xfer: Xfer
    done: Future[int]
    deadline: float  # time.monotonic()


def mem_type(value: str) -> MemType:
    """The NIXL memory type named by a KV cache's or a handshake's `mem_type` string."""
    return "VRAM" if value == "VRAM" else "DRAM"


def block_indices(layout: KVLayout, blocks: tuple[int, ...] | list[int]) -> npt.NDArray[np.int32]:
    """Descriptor indices of `blocks` in the prepared per-block list (`per_block_regions`):
    the block ids themselves in block-major, else every (layer, K|V) in region_list order."""
    if layout.block_major:
        return np.asarray(blocks, dtype=np.int32)
    per_kv = np.arange(layout.num_layers * 2, dtype=np.int64)[:, None] * layout.num_blocks
    idx = per_kv + np.asarray(blocks, dtype=np.int64)[None, :]
    return idx.ravel().astype(np.int32)


def per_block_regions(layout: KVLayout, base_addr: int) -> list[tuple[int, int]]:
    return region_list(layout, base_addr, [(b, 1) for b in range(layout.num_blocks)])


class BlockReader:
    """Owns the local descriptor list, the peers and the in-flight reads of one agent."""

    def __init__(self, agent: TransferAgent, layout: KVLayout, base_addr: int, mem: str,
                 device_id: int) -> None:
        self._agent = agent
        self._layout = layout
        self._base_addr, self._mem, self._device_id = base_addr, mem, device_id
        self._local = agent.prep_local(
            per_block_regions(layout, base_addr), mem_type(mem), device_id)
        self._peers: dict[str, Peer] = {}
        self._pending: list[_Pending] = []

    def peer(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    def add_peer(self, p: HandshakePayload) -> Peer:
        """Load a (validated) handshake; replaces an older agent of the same engine id."""
        self.drop_peer(p.engine_id)
        name = self._agent.add_remote(p.agent_metadata)
        try:
            regions = per_block_regions(p.layout, p.kv_base_addr)
            descs = self._agent.prep_remote(name, regions, mem_type(p.mem_type), p.device_id)
        except NixlAgentError:
            self._agent.remove_remote(name)
            raise
        peer = Peer(p.engine_id, name, p.layout, descs, p.kv_base_addr, p.mem_type, p.device_id)
        self._peers[p.engine_id] = peer
        return peer

    def drop_peer(self, engine_id: str) -> None:
        """Forget a peer (stale or dead). Best effort: a dead peer may refuse to disconnect."""
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        mine = [p for p in self._pending if p.xfer.remote_agent == peer.agent_name]
        self._pending = [p for p in self._pending if p.xfer.remote_agent != peer.agent_name]
        for p in mine:
            self._finish(p, "ERR")
        try:
            self._agent.release_list(peer.descs)
            self._agent.remove_remote(peer.agent_name)
        except NixlAgentError as e:
            log.warning("dropping peer %s: %s", engine_id, e)

    def start_read(self, peer: Peer, local: list[int], remote: tuple[int, ...], notif: bytes,
                   deadline: float) -> Future[int]:
        """Post a READ of `remote` blocks into `local`; the Future gets the byte count once
        the data has landed (or KVTransferError). `notif` reaches P after the data."""
        if self._peers.get(peer.engine_id) is not peer:  # its lists may be released already
            raise KVTransferError(f"peer {peer.engine_id} was re-handshaken meanwhile")
        self._check_ids(local, self._layout.num_blocks, "local")
        self._check_ids(list(remote), peer.layout.num_blocks, "remote")
        nbytes = len(local) * self._layout.slab_bytes
        xfer = self._agent.make_xfer(
            "READ", self._local, block_indices(self._layout, local), peer.descs,
            block_indices(peer.layout, remote), notif, nbytes)
        return self._start(xfer, deadline, f"a read from {peer.engine_id}")

    def _start(self, xfer: Xfer, deadline: float, what: str) -> Future[int]:
        """Post `xfer` and track it until `poll()` sees it end (or it fails at once)."""
        done: Future[int] = Future()
        self._pending.append(_Pending(xfer, done, deadline))
        try:
            state = self._agent.post(xfer)
        except NixlAgentError as e:
            state = "ERR"
            log.warning("posting %s failed: %s", what, e)
        if state != "PROC":
            self._finish(self._pending.pop(), state)
        return done

    @staticmethod
    def _check_ids(ids: list[int], num_blocks: int, side: str) -> None:
        bad = [b for b in ids if not 0 <= b < num_blocks]
        if bad:
            raise KVTransferError(
                f"{side} block ids {bad[:5]} outside 0..{num_blocks - 1}", reason="params")

    def poll(self) -> int:
        """Advance every in-flight read; returns how many are still in flight."""
        now = time.monotonic()
        still: list[_Pending] = []
        for p in self._pending:
            try:
                state = self._agent.state(p.xfer)
            except NixlAgentError:
                state = "ERR"
            if state == "PROC" and now < p.deadline:
                still.append(p)
            else:
                self._finish(p, "TIMEOUT" if state == "PROC" else state)
        self._pending = still
        return len(still)

    def _finish(self, p: _Pending, state: str) -> None:
        try:
            self._agent.release(p.xfer)  # cancels a read that timed out, if UCX can
        except NixlAgentError as e:
            log.warning("releasing a %s read failed: %s", state, e)
        if state == "DONE":
            p.done.set_result(p.xfer.nbytes)
        elif state == "TIMEOUT":
            p.done.set_exception(KVTransferError(
                f"KV read from {p.xfer.remote_agent} did not finish before its deadline",
                reason="timeout"))
        else:
            p.done.set_exception(KVTransferError(f"KV read from {p.xfer.remote_agent} failed"))

    def close(self) -> None:
        """Fail in-flight reads, forget peers, release the local list."""
        for p in self._pending:
            self._finish(p, "ERR")
        self._pending = []
        for engine_id in list(self._peers):
            self.drop_peer(engine_id)
        self._agent.release_list(self._local)
