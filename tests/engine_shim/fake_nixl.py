"""A fake NIXL for connector unit tests (as vLLM's `FakeNixlWrapper`): agents in one process
share a `FakeFabric`; transfers are `memmove`s between the registered in-process KV caches,
notifications go through the fabric's inboxes (and its `sent` log, for assertions).

Build connectors with `agent_factory=fabric.factory`; a test can also speak as any agent
with `fabric.send(sender, to, frame)` (a peer's notice, junk included)."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
from prometheus_client import CollectorRegistry

from pdgate.engine_shim.connector import KVConnector
from pdgate.engine_shim.kv_cache import PagedKVCache
from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.nixl_agent import (
    MemType,
    PreppedList,
    Regions,
    TransferAgent,
    Xfer,
    XferOp,
    XferState,
)
from pdgate.engine_shim.notices import Notice, decode_notice
from pdgate.engine_shim.transfer_errors import NixlAgentError

LAYOUT = KVLayout(num_layers=2, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=16)


class FakeFabric:
    """Agents by name, their inboxes, and every frame ever sent (`sent`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, dict[str, list[bytes]]] = defaultdict(dict)
        self.sent: list[tuple[str, str, bytes]] = []  # (sender, receiver, frame)

    def factory(self, name: str, vram: bool) -> TransferAgent:
        """An `AgentFactory`."""
        return FakeAgent(self, name)

    def send(self, sender: str, to: str, frame: bytes) -> None:
        with self._lock:
            self.sent.append((sender, to, frame))
            self._inboxes[to].setdefault(sender, []).append(frame)

    def take(self, name: str) -> dict[str, list[bytes]]:
        with self._lock:
            return self._inboxes.pop(name, {})

    def notices_to(self, name: str) -> list[Notice]:
        """The decodable notices sent to agent `name`, in order."""
        with self._lock:
            frames = [f for _, to, f in self.sent if to == name]
        return [decode_notice(f) for f in frames]


class FakeAgent:
    """A `TransferAgent` whose transfers complete at once (see the module docstring)."""

    def __init__(self, fabric: FakeFabric, name: str) -> None:
        self.name = name
        self._fabric = fabric
        self._registered: tuple[int, int] | None = None

    def register(self, addr: int, length: int, mem_type: MemType, device_id: int) -> None:
        self._registered = (addr, length)

    def deregister(self) -> None:
        self._registered = None

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_remote(self, metadata: bytes) -> str:
        return metadata.decode()

    def remove_remote(self, agent_name: str) -> None:
        pass

    def prep_local(self, regions: Regions, mem_type: MemType, device_id: int) -> PreppedList:
        return PreppedList(_array(regions), len(_array(regions)), "")

    def prep_remote(self, agent_name: str, regions: Regions, mem_type: MemType,
                    device_id: int) -> PreppedList:
        return PreppedList(_array(regions), len(_array(regions)), agent_name)

    def release_list(self, prepped: PreppedList) -> None:
        pass

    def make_xfer(self, op: XferOp, local: PreppedList, local_idx: npt.NDArray[np.int32],
                  remote: PreppedList, remote_idx: npt.NDArray[np.int32], notif: bytes,
                  nbytes: int, *, merge: bool = True) -> Xfer:
        pairs = (local.handle[local_idx], remote.handle[remote_idx])
        return Xfer((op, pairs, notif), remote.agent_name, nbytes)

    def make_xfer_regions(self, op: XferOp, local: Regions, local_mem: MemType,
                          local_dev: int, remote_agent: str, remote: Regions,
                          remote_mem: MemType, remote_dev: int, notif: bytes) -> Xfer:
        lo, re = _array(local), _array(remote)
        if lo.shape != re.shape or not np.array_equal(lo[:, 1], re[:, 1]):
            raise NixlAgentError("local and remote region lists differ in shape")
        return Xfer((op, (lo, re), notif), remote_agent, int(lo[:, 1].sum()))

    def post(self, xfer: Xfer) -> XferState:
        op, (local, remote), notif = xfer.handle
        for (laddr, llen), (raddr, rlen) in zip(local.tolist(), remote.tolist(), strict=True):
            size = min(llen, rlen)
            if op == "READ":
                ctypes.memmove(laddr, raddr, size)
            else:
                ctypes.memmove(raddr, laddr, size)
        if notif:
            self._fabric.send(self.name, xfer.remote_agent, notif)
        return "DONE"

    def state(self, xfer: Xfer) -> XferState:
        return "DONE"

    def release(self, xfer: Xfer) -> None:
        pass

    def get_notifs(self) -> dict[str, list[bytes]]:
        return self._fabric.take(self.name)

    def send_notif(self, agent_name: str, message: bytes) -> None:
        self._fabric.send(self.name, agent_name, message)


def _array(regions: Regions) -> npt.NDArray[np.uint64]:
    return np.asarray(regions, dtype=np.uint64).reshape(-1, 2)


def started_connector(fabric: FakeFabric, engine_id: str, *,
                      metrics: ShimMetrics | None = None,
                      free_blocks: Callable[[list[int]], None] = lambda ids: None,
                      layout: KVLayout = LAYOUT, lease_seconds: float = 60.0) -> KVConnector:
    """A started connector on a fake agent and a real side channel (127.0.0.1, free port),
    built on the running loop as the server's lifespan builds it. Close it after."""
    conn = KVConnector(engine_id=engine_id, model_name="m", kv=PagedKVCache(layout, "cpu"),
                       side_channel_host="127.0.0.1", side_channel_port=0,
                       lease_seconds=lease_seconds, free_blocks=free_blocks,
                       metrics=metrics or ShimMetrics.create(CollectorRegistry()),
                       agent_factory=fabric.factory)
    conn.start()
    return conn


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for `cond` (the connector's agent thread polls its inbox every few ms)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)
