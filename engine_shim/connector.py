"""`KVConnector`: the engine's one object for moving KV blocks between engines over NIXL.

P side (prefill engine): `hold_for_remote_decode` pins a finished prompt's blocks under a
lease and returns vLLM-compatible `kv_transfer_params`; the blocks go back to the pool (via
`free_blocks`) when the reader's "done" notification arrives, when the lease expires, or on
`abort`. D side (decode engine): `pull` handshakes with P's side channel the first time it
meets an engine id, READs the blocks with NIXL and lets P know (the READ carries the
notification, delivered after the data).

Threads: every NIXL call runs on one `AgentThread` (NIXL is not thread-safe), which also
polls notifications, in-flight reads and lease expiry: every 0.5 ms while reads are in
flight, 2 ms while leases are held, 50 ms when idle. Handshakes (blocking ZMQ round trips)
run in the event loop's default executor so they never stall the agent thread. `pull` never
blocks the event loop. `free_blocks` is called from the agent thread (notification, expiry)
or the caller's thread (`abort`, `close`), so it must be thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from engine_shim.agent_thread import AgentThread, AgentThreadStopped
from engine_shim.kv_layout import KVLayout
from engine_shim.kv_params import PullParams, hold_params, parse_pull_params
from engine_shim.kv_reader import BlockReader, Peer, mem_type
from engine_shim.leases import Lease, LeaseTable
from engine_shim.metrics import ShimMetrics
from engine_shim.nixl_agent import NixlAgent
from engine_shim.side_channel import (
    HandshakePayload,
    SideChannelServer,
    compat_hash,
    fetch_handshake,
    validate_peer,
)
from engine_shim.transfer_errors import (
    KVConnectorError,
    KVHandshakeError,
    KVTransferError,
    NixlAgentError,
)

__all__ = ["KVConnector", "KVConnectorError", "KVHandshakeError", "KVTransferError", "KVMemory"]

T = TypeVar("T")
log = logging.getLogger(__name__)
_BUSY_POLL_S = 0.0005   # reads in flight: completion latency matters
_LEASE_POLL_S = 0.002   # leases held: "done" notices free blocks; peers may need our progress
_IDLE_POLL_S = 0.05     # nothing to do: stay cheap
_OP = "read"


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


class KVConnector:
    """See the module docstring. Build, `start()` once, `close()` once.

    `side_channel_port=0` binds a free port (read `side_channel_port` after start).
    `lease_seconds`: how long P keeps blocks for a reader that never says done.
    `transfer_timeout` / `handshake_timeout`: deadlines of one pull (seconds)."""

    def __init__(
        self, *, engine_id: str, model_name: str, kv: KVMemory, side_channel_host: str,
        side_channel_port: int, lease_seconds: float, free_blocks: Callable[[list[int]], None],
        metrics: ShimMetrics, transfer_timeout: float = 30.0, handshake_timeout: float = 5.0,
    ) -> None:
        self.engine_id = engine_id
        self.model_name = model_name
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:12]}"  # new per process start
        self._kv = kv
        self._host = side_channel_host
        self._port = side_channel_port
        self._free_blocks = free_blocks
        self._metrics = metrics
        self._transfer_timeout = transfer_timeout
        self._handshake_timeout = handshake_timeout
        self._leases = LeaseTable(lease_seconds)
        self._thread = AgentThread(f"nixl-{engine_id}", self._tick)
        self._agent: NixlAgent | None = None
        self._reader: BlockReader | None = None
        self._server: SideChannelServer | None = None
        self._handshake_locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    @property
    def side_channel_port(self) -> int:
        """The bound side-channel port (differs from the argument when that was 0)."""
        return self._server.port if self._server is not None else self._port

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the agent, register the KV buffer, prepare the local descriptor list, start
        the agent thread and the side channel. Blocking (call before serving). On failure
        everything set up so far is torn down and KVConnectorError is raised."""
        try:
            self._thread.start()
            metadata = self._thread.call(self._open_agent)
            payload = HandshakePayload(
                engine_id=self.engine_id, agent_name=self.agent_name, agent_metadata=metadata,
                kv_base_addr=self._kv.base_addr, mem_type=self._kv.mem_type,
                device_id=self._kv.device_id, layout=self._kv.layout,
                model_name=self.model_name,
                compat_hash=compat_hash(self.model_name, self._kv.layout),
            )
            self._server = SideChannelServer(self._host, self._port, payload)
            self._server.start()
        except Exception:
            self.close()
            raise
        log.info("KV connector %s up: agent %s, side channel %s:%d", self.engine_id,
                 self.agent_name, self._host, self._server.port)

    def _open_agent(self) -> bytes:
        kv = self._kv
        agent = NixlAgent(self.agent_name)
        agent.register(kv.base_addr, kv.layout.total_bytes, mem_type(kv.mem_type), kv.device_id)
        self._reader = BlockReader(agent, kv.layout, kv.base_addr, kv.mem_type, kv.device_id)
        self._agent = agent
        return agent.metadata()

    def close(self) -> None:
        """Stop the side channel and the agent thread, free every leased block, deregister.
        Idempotent."""
        self._closed = True
        if self._server is not None:
            self._server.stop()
        if self._thread.running:
            try:
                self._thread.call(self._close_agent, timeout=10)
            except Exception as e:  # closing must go on: the leases below still need freeing
                log.warning("closing the NIXL agent failed: %s", e)
            self._thread.stop()
        self._release(self._leases.pop_all(), None)

    def _close_agent(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._agent is not None:
            self._agent.deregister()
            self._agent = None

    # -- P side ---------------------------------------------------------------------------
    def hold_for_remote_decode(self, request_id: str, block_ids: list[int]) -> dict[str, object]:
        """Pin `block_ids` (now owned by the lease, not the caller) for a remote reader and
        return the prefill reply's `kv_transfer_params` (vLLM NixlConnector fields).
        Raises KVConnectorError after `close()` (the caller keeps and frees the blocks)."""
        if self._closed:
            raise KVConnectorError("KV connector is closed")
        lease = self._leases.add(request_id, block_ids)
        self._metrics.blocks_leased.set(self._leases.blocks)
        return hold_params(
            engine_id=self.engine_id, request_id=lease.lease_id, block_ids=block_ids,
            host=self._host, port=self.side_channel_port, agent_name=self.agent_name,
        )

    def abort(self, request_id: str) -> None:
        """Free every lease `request_id` holds now (router abort, failed decode leg)."""
        self._release(self._leases.pop_request(request_id), None)

    def leased_blocks(self) -> int:
        """Blocks pinned for remote readers right now."""
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

    # -- agent thread ---------------------------------------------------------------------
    def _tick(self) -> float:
        """Poll notifications, in-flight reads and lease expiry; return the next interval."""
        if self._agent is None or self._reader is None:
            return _IDLE_POLL_S
        for msgs in self._agent.get_notifs().values():
            for msg in msgs:
                lease_id = msg.rsplit(b":", 1)[0].decode("utf-8", "replace")
                lease = self._leases.pop(lease_id)
                if lease is None:
                    log.debug("done notice for unknown lease %r", lease_id)
                else:
                    self._release([lease], "released")
        reads_in_flight = self._reader.poll()
        self._release(self._leases.pop_expired(), "expired")
        if reads_in_flight:
            return _BUSY_POLL_S
        return _LEASE_POLL_S if len(self._leases) else _IDLE_POLL_S

    # -- D side ---------------------------------------------------------------------------
    async def pull(self, params: Mapping[str, object], local_block_ids: list[int]) -> int:
        """READ P's `remote_block_ids` (from P's `params`) into `local_block_ids` (same
        length, same order); return the bytes read. Deadline: `handshake_timeout` +
        `transfer_timeout`, twice that when a read from a cached peer fails and a re-handshake
        finds a new agent (P restarted). Once it returns or raises, NIXL no longer writes the
        local blocks (unless cancelling a timed-out read failed, which is logged). Raises
        KVTransferError (KVHandshakeError for handshakes), never blocks the event loop."""
        t0 = time.perf_counter()
        try:
            req = parse_pull_params(params)
            if len(req.block_ids) != len(local_block_ids):
                raise KVTransferError(
                    f"{len(req.block_ids)} remote blocks but {len(local_block_ids)} local")
            nbytes = await self._pull_with_retry(req, list(local_block_ids))
        except KVTransferError as e:
            self._metrics.kv_transfer_failures.labels(op=_OP, reason=e.reason).inc()
            raise
        self._metrics.kv_transfers.labels(op=_OP).inc()
        self._metrics.kv_transfer_bytes.labels(op=_OP).inc(nbytes)
        self._metrics.kv_transfer_seconds.labels(op=_OP).observe(time.perf_counter() - t0)
        return nbytes

    async def _pull_with_retry(self, req: PullParams, local: list[int]) -> int:
        peer, fresh = await self._peer(req)
        try:
            return await self._read(peer, req, local)
        except KVTransferError as e:
            if fresh or e.reason != "transfer":
                raise
            # The peer may have restarted since we met it: re-handshake once, and read again
            # only when it really is a new agent (else the first error stands).
            log.info("read from %s failed; re-handshaking", req.engine_id)
            await self._submit(lambda: self._get_reader().drop_peer(req.engine_id))
            new_peer, _ = await self._peer(req)
            if new_peer.agent_name == peer.agent_name:
                raise
            return await self._read(new_peer, req, local)

    async def _read(self, peer: Peer, req: PullParams, local: list[int]) -> int:
        deadline = time.monotonic() + self._transfer_timeout
        notif = f"{req.request_id}:1".encode()  # vLLM's "<remote_request_id>:<tp_size>"
        done = await self._submit(lambda: self._get_reader().start_read(
            peer, local, req.block_ids, notif, deadline))
        try:  # the agent thread enforces the deadline; the extra second guards a stuck thread
            return await asyncio.wait_for(asyncio.wrap_future(done), self._transfer_timeout + 1)
        except TimeoutError as e:
            raise KVTransferError(f"KV read from {req.engine_id} timed out",
                                  reason="timeout") from e

    async def _peer(self, req: PullParams) -> tuple[Peer, bool]:
        """The cached peer for `req.engine_id`, handshaking first if there is none or if P's
        params name a different agent (P restarted). Returns (peer, handshaken now)."""
        lock = self._handshake_locks.setdefault(req.engine_id, asyncio.Lock())
        async with lock:
            peer = await self._submit(lambda: self._get_reader().peer(req.engine_id))
            if peer is not None and req.agent_name in (None, peer.agent_name):
                return peer, False
            payload = await self._handshake(req)
            peer = await self._submit(lambda: self._get_reader().add_peer(payload))
            return peer, True

    async def _handshake(self, req: PullParams) -> HandshakePayload:
        try:
            payload = await asyncio.get_running_loop().run_in_executor(
                None, lambda: fetch_handshake(req.host, req.port, self._handshake_timeout,
                                              engine_id=self.engine_id))
            validate_peer(payload, engine_id=req.engine_id, model_name=self.model_name,
                          layout=self._kv.layout)
        except KVHandshakeError:
            self._metrics.handshakes.labels(result="error").inc()
            raise
        self._metrics.handshakes.labels(result="ok").inc()
        return payload

    async def _submit(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.wrap_future(self._thread.submit(fn))
        except NixlAgentError as e:
            raise KVTransferError(str(e)) from e
        except AgentThreadStopped as e:
            raise KVTransferError(f"KV connector is closed: {e}") from e

    def _get_reader(self) -> BlockReader:
        if self._reader is None:
            raise KVTransferError("KV connector is not started")
        return self._reader

