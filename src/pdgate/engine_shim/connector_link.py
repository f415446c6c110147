"""What both directions of the KV connector share: the agent thread, the NIXL agent on it
(built by the injected `AgentFactory`), the block transfer over that agent and the cached
peers with their side-channel handshakes.

Threads: every agent call runs on the one `AgentThread` (NIXL is not thread-safe);
handshakes (blocking ZMQ round trips) run in the event loop's default executor so they never
stall the agent thread. `submit` is the event loop's way onto the agent thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, TypeVar

from pdgate.engine_shim.agent_thread import AgentThread, AgentThreadStopped
from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.kv_params import PullParams
from pdgate.engine_shim.kv_reader import Peer, mem_type
from pdgate.engine_shim.kv_writer import BlockTransfer
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.nixl_agent import AgentFactory, TransferAgent
from pdgate.engine_shim.notices import Notice, NoticeError, encode_notice
from pdgate.engine_shim.side_channel import HandshakePayload, fetch_handshake, validate_peer
from pdgate.engine_shim.transfer_errors import KVHandshakeError, KVTransferError, NixlAgentError

__all__ = ["AgentLink", "KVMemory", "encode"]

T = TypeVar("T")
log = logging.getLogger(__name__)


class KVMemory(Protocol):
    """What the connector needs of the engine's KV cache (`kv_cache.PagedKVCache`)."""

    @property
    def layout(self) -> KVLayout: ...
    @property
    def base_addr(self) -> int: ...
    @property
    def mem_type(self) -> str: ...
    @property
    def device_id(self) -> int: ...


class AgentLink:
    """See the module docstring. `tick` is the agent thread's poll (the connector's)."""

    def __init__(self, *, engine_id: str, model_name: str, agent_name: str, kv: KVMemory,
                 metrics: ShimMetrics, handshake_timeout: float,
                 tick: Callable[[], float]) -> None:
        self.engine_id = engine_id
        self.model_name = model_name
        self.agent_name = agent_name
        self.kv = kv
        self.metrics = metrics
        self.thread = AgentThread(f"nixl-{engine_id}", tick)
        self.agent: TransferAgent | None = None
        self.reader: BlockTransfer | None = None
        self._handshake_timeout = handshake_timeout
        self._handshake_locks: dict[str, asyncio.Lock] = {}

    def open(self, factory: AgentFactory) -> bytes:
        """Agent thread: build the agent, register the KV buffer, prepare the local
        descriptor list; the agent's metadata for the handshake payload."""
        kv = self.kv
        agent = factory(self.agent_name, kv.mem_type == "VRAM")
        agent.register(kv.base_addr, kv.layout.total_bytes, mem_type(kv.mem_type), kv.device_id)
        self.reader = BlockTransfer(agent, kv.layout, kv.base_addr, kv.mem_type, kv.device_id)
        self.agent = agent
        return agent.metadata()

    def close_agent(self) -> None:
        """Agent thread: release the peers and descriptor lists, deregister."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.agent is not None:
            self.agent.deregister()
            self.agent = None

    def get_reader(self) -> BlockTransfer:
        if self.reader is None:
            raise KVTransferError("KV connector is not started")
        return self.reader

    async def submit(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the agent thread; its NIXL errors become KVTransferError."""
        try:
            return await asyncio.wrap_future(self.thread.submit(fn))
        except NixlAgentError as e:
            raise KVTransferError(str(e)) from e
        except AgentThreadStopped as e:
            raise KVTransferError(f"KV connector is closed: {e}") from e

    async def peer(self, req: PullParams) -> tuple[Peer, bool]:
        """The cached peer for `req.engine_id`, handshaking first if there is none or if the
        params name a different agent (the peer restarted). Returns (peer, handshaken now)."""
        lock = self._handshake_locks.setdefault(req.engine_id, asyncio.Lock())
        async with lock:
            peer = await self.submit(lambda: self.get_reader().peer(req.engine_id))
            if peer is not None and req.agent_name in (None, peer.agent_name):
                return peer, False
            payload = await self._handshake(req)
            peer = await self.submit(lambda: self.get_reader().add_peer(payload))
            return peer, True

    async def _handshake(self, req: PullParams) -> HandshakePayload:
        try:
            payload = await asyncio.get_running_loop().run_in_executor(
                None, lambda: fetch_handshake(req.host, req.port, self._handshake_timeout,
                                              engine_id=self.engine_id))
            validate_peer(payload, engine_id=req.engine_id, model_name=self.model_name,
                          layout=self.kv.layout)
        except KVHandshakeError:
            self.metrics.handshakes.labels(result="error").inc()
            raise
        self.metrics.handshakes.labels(result="ok").inc()
        return payload


def encode(notice: Notice) -> bytes:
    """A notice's frame; an id too long for any peer to accept fails this transfer."""
    try:
        return encode_notice(notice)
    except NoticeError as e:
        raise KVTransferError(f"cannot notify the peer: {e}", reason="params") from e
