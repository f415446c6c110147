"""`KVConnector`: the engine's one object for moving KV blocks between engines over NIXL.

P side (prefill engine): `hold_for_remote_decode` pins a finished prompt's blocks under a
lease and returns vLLM-compatible `kv_transfer_params`; the blocks go back to the pool (via
`free_blocks`) when the reader's "done" notification arrives, when the lease expires, or on
`abort`. D side (decode engine): `pull` handshakes with P's side channel the first time it
meets an engine id, READs the blocks with NIXL and lets P know (the READ carries the
notification, delivered after the data). Every NIXL notification is a typed, versioned
`engine_shim.notices` frame; a peer's bad frame is counted
(`pdgate_shim_protocol_errors_total{channel="nixl_notice"}`) and dropped, never fatal.
Notify/push (P WRITEs into D, `push.py`): P sends a `landed` notice after the data, or a
`failed` one as soon as it knows the WRITE will not land, so D never waits out its timeout
for a push that P gave up on.

Threads: every NIXL call runs on one `AgentThread` (NIXL is not thread-safe), which also
polls notifications, in-flight reads and lease expiry: every 0.5 ms while reads are in
flight, 2 ms while leases are held, 50 ms when idle. Handshakes (blocking ZMQ round trips)
run in the event loop's default executor so they never stall the agent thread. `pull` never
blocks the event loop. `free_blocks` is called from the agent thread (notification, expiry)
or the caller's thread (`abort`, `close`), so it must be thread-safe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol, TypeVar

from pdgate.contract.kv_contract import NotifyPrefillParams, PushDecodeParams, PushPrefillParams
from pdgate.engine_shim.agent_thread import AgentThread, AgentThreadStopped
from pdgate.engine_shim.kv_layout import KVLayout
from pdgate.engine_shim.kv_params import PullParams, hold_params, parse_pull_params
from pdgate.engine_shim.kv_reader import Peer, mem_type
from pdgate.engine_shim.kv_writer import BlockTransfer
from pdgate.engine_shim.leases import Lease, LeaseTable
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.nixl_agent import NixlAgent
from pdgate.engine_shim.notices import (
    Failed,
    Landed,
    Notice,
    NoticeError,
    ReadDone,
    Registration,
    Unregistration,
    decode_notice,
    encode_notice,
    failed,
)
from pdgate.engine_shim.push import (
    Match,
    PendingPushes,
    Refusal,
    WriteTarget,
    notify_target,
)
from pdgate.engine_shim.side_channel import (
    HandshakePayload,
    SideChannelServer,
    compat_hash,
    fetch_handshake,
    validate_peer,
)
from pdgate.engine_shim.transfer_errors import (
    KVConnectorError,
    KVHandshakeError,
    KVTransferError,
    NixlAgentError,
)
from pdgate.engine_shim.transport_probe import probe_transport
from pdgate.proxy import KVReady, NotifySender

__all__ = ["KVConnector", "KVConnectorError", "KVHandshakeError", "KVTransferError", "KVMemory"]

T = TypeVar("T")
log = logging.getLogger(__name__)
_BUSY_POLL_S = 0.0005   # reads in flight: completion latency matters
_LEASE_POLL_S = 0.002   # leases held: "done" notices free blocks; peers may need our progress
_IDLE_POLL_S = 0.05     # nothing to do: stay cheap
_LANDING_POLL_S = 0.001  # a request waits for a pushed WRITE's notice (can be a whole prefill)
_OP = "read"
_WRITE_OP = "write"
_MAX_LANDINGS = 65536  # landing notices kept for requests nobody awaits yet (bounded)
# SideChannelServer results that are a peer's protocol error -> protocol_errors reason.
_SIDE_CHANNEL_ERRORS = {"malformed_frames": "malformed", "malformed_request": "malformed",
                        "oversized": "oversized", "internal": "internal"}


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
    `lease_seconds`: how long P keeps blocks for a reader that never says done (and, in push
    mode, a prompt or a registration waiting for the other).
    `transfer_timeout`: one READ or WRITE, and a push-mode D's wait for the landing;
    `handshake_timeout`: one side-channel round trip; `probe_timeout`: the start-up
    transport probe (seconds)."""

    def __init__(
        self, *, engine_id: str, model_name: str, kv: KVMemory, side_channel_host: str,
        side_channel_port: int, lease_seconds: float, free_blocks: Callable[[list[int]], None],
        metrics: ShimMetrics, transfer_timeout: float = 30.0, handshake_timeout: float = 5.0,
        probe_timeout: float = 10.0, notify_secret: str | None = None,
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
        self._probe_timeout = probe_timeout
        self._leases = LeaseTable(lease_seconds)
        self._thread = AgentThread(f"nixl-{engine_id}", self._tick)
        self._agent: NixlAgent | None = None
        self._reader: BlockTransfer | None = None
        self._server: SideChannelServer | None = None
        self._handshake_locks: dict[str, asyncio.Lock] = {}
        self._closed = False
        # Push/notify (P writes into D): prompts waiting for D's registration, writes in
        # flight, landing notices on D, the KV-ready sender; see engine_shim/push.py.
        self._pushes = PendingPushes(lease_seconds)
        self._writing_blocks = 0
        self._tasks: set[asyncio.Task[None]] = set()  # writes and failure notices
        self._landings: OrderedDict[str, Future[tuple[int, ...]]] = OrderedDict()
        self._landings_lock = threading.Lock()
        self._expected: set[str] = set()
        # The serving loop, where failure notices are sent from (they may need a handshake).
        # The server's lifespan builds us on it; loop-thread entry points set it too.
        self._loop: asyncio.AbstractEventLoop | None = _running_loop()
        self._notify_secret = notify_secret
        self._sender: NotifySender | None = None

    @property
    def side_channel_port(self) -> int:
        """The bound side-channel port (differs from the argument when that was 0)."""
        return self._server.port if self._server is not None else self._port

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the agent, register the KV buffer, prepare the local descriptor list, start
        the agent thread and the side channel. Blocking (call before serving). On failure
        everything set up so far is torn down and KVConnectorError is raised. With VRAM KV
        it then runs the transport probe (`transport_probe`: logs, metrics, never fails)."""
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
            self._server = SideChannelServer(
                self._host, self._port, payload,
                on_request=self._count_side_channel)
            self._server.start()
        except Exception:
            self.close()
            raise
        log.info("KV connector %s up: agent %s, side channel %s:%d", self.engine_id,
                 self.agent_name, self._host, self._server.port)
        if self._kv.mem_type == "VRAM":  # catch a silently emulated UCX path before serving
            probe_transport("VRAM", self._kv.device_id, self._metrics, name=self.agent_name,
                            timeout=self._probe_timeout)

    def _count_side_channel(self, result: str) -> None:
        """Side-channel thread: every message counts as a handshake result; the ones that
        could not be served also as protocol errors (`SideChannelServer` results)."""
        self._metrics.handshakes.labels(result="side_channel_" + result).inc()
        reason = _SIDE_CHANNEL_ERRORS.get(result)
        if reason is not None:
            self._metrics.protocol_errors.labels(channel="side_channel", reason=reason).inc()

    def _open_agent(self) -> bytes:
        kv = self._kv
        agent = NixlAgent(self.agent_name, vram=self._kv.mem_type == "VRAM")
        agent.register(kv.base_addr, kv.layout.total_bytes, mem_type(kv.mem_type), kv.device_id)
        self._reader = BlockTransfer(agent, kv.layout, kv.base_addr, kv.mem_type, kv.device_id)
        self._agent = agent
        return agent.metadata()

    def close(self) -> None:
        """Stop the side channel and the agent thread, free every leased block, deregister.
        Idempotent."""
        self._closed = True
        if self._server is not None:
            self._server.stop()
        held, refusals = self._pushes.pop_all()
        if self._thread.running:
            try:  # D waits for these: tell the peers we know (no new handshakes now)
                self._thread.call(lambda: self._refuse_known_peers(refusals), timeout=10)
            except Exception as e:
                log.warning("telling decode engines about the shutdown failed: %s", e)
            try:
                self._thread.call(self._close_agent, timeout=10)
            except Exception as e:  # closing must go on: the leases below still need freeing
                log.warning("closing the NIXL agent failed: %s", e)
            self._thread.stop()
        self._release(self._leases.pop_all(), None)
        if held:
            self._free_blocks(list(held))
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def _refuse_known_peers(self, refusals: list[Refusal]) -> None:
        """Agent thread, shutdown: a Failed notice to each refused registration's D that we
        have met already (its current agent), best effort."""
        reader = self._reader
        if reader is None:
            return
        for r in refusals:
            peer = reader.peer(r.target.engine_id)
            if peer is None or peer.agent_name != r.target.agent_name:
                continue
            try:
                reader.send_notif(peer, _encode(failed(r.target.tag, r.reason, r.detail)))
            except KVConnectorError as e:
                log.warning("request %s: could not tell %s: %s", r.request_id,
                            r.target.engine_id, e)

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
        self._thread.wake()  # the reader's READ needs our UCX progress soon
        return hold_params(
            engine_id=self.engine_id, request_id=lease.lease_id, block_ids=block_ids,
            host=self._host, port=self.side_channel_port, agent_name=self.agent_name,
        )

    def abort(self, request_id: str) -> None:
        """Free every lease `request_id` holds now (router abort, failed decode leg), and any
        prompt of it still waiting for a push registration; a D registered for it is told
        at once (and one registering later too). Event-loop thread."""
        self._release(self._leases.pop_request(request_id), None)
        self.fail_push(request_id, "aborted", "the router aborted the request on the "
                       "prefill engine")
        with self._landings_lock:  # D waiting for a push that will not come: stop waiting
            fut = self._landings.get(request_id)
        if fut is not None:
            with contextlib.suppress(InvalidStateError):  # it landed meanwhile
                fut.set_exception(KVTransferError("the router aborted the push",
                                                  reason="aborted"))

    def fail_push(self, request_id: str, reason: str, detail: str) -> None:
        """P will not push `request_id` (aborted; its prefill failed, was cancelled or
        stopped before handing its KV over): free a prompt still waiting, tell a D that
        registered (a `notices.Failed`), and refuse a registration that comes later.
        `reason`: a `notices.FAILURE_REASONS` word. Event-loop thread."""
        self._remember_loop()
        held, refusal = self._pushes.abort(request_id, reason, detail)
        if held:
            self._free_blocks(list(held))
        if refusal is not None:
            self._refuse(refusal)

    def leased_blocks(self) -> int:
        """Blocks pinned for remote peers right now (pull leases, prompts waiting for a push
        registration, writes in flight)."""
        return self._leases.blocks + self._pushes.blocks + self._writing_blocks

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
        for sender, msgs in self._agent.get_notifs().items():
            for msg in msgs:
                self._on_notice(sender, msg)
        reads_in_flight = self._reader.poll()
        self._release(self._leases.pop_expired(), "expired")
        expired = self._pushes.expire()
        for rid, blocks in expired.blocks:
            log.warning("request %s: no push registration in time; %d blocks freed", rid,
                        len(blocks))
            self._metrics.leases_expired.inc()
            self._free_blocks(list(blocks))
        for refusal in expired.refusals:
            log.warning("request %s: %s registered, but the prompt did not come in time",
                        refusal.request_id, refusal.target.engine_id)
            self._refuse(refusal)
        if reads_in_flight or self._writing_blocks:
            return _BUSY_POLL_S
        if self._awaiting_landing():
            return _LANDING_POLL_S
        busy = len(self._leases) or len(self._pushes) or self._landings
        return _LEASE_POLL_S if busy else _IDLE_POLL_S

    # -- D side ---------------------------------------------------------------------------
    async def pull(self, params: Mapping[str, object], local_block_ids: list[int]) -> int:
        """READ P's `remote_block_ids` (from P's `params`) into `local_block_ids` (same
        length, same order); return the bytes read. Deadline: `handshake_timeout` +
        `transfer_timeout`, twice that when a read from a cached peer fails and a re-handshake
        finds a new agent (P restarted). Once it returns or raises, NIXL no longer writes the
        local blocks (unless cancelling a timed-out read failed, which is logged). Raises
        KVTransferError (KVHandshakeError for handshakes), never blocks the event loop.
        P's block size must equal ours (else use `pull_tokens`)."""
        return await self._pull(params, list(local_block_ids), None)

    async def pull_tokens(self, params: Mapping[str, object], local_block_ids: list[int],
                          num_tokens: int) -> int:
        """Like `pull`, for a `num_tokens` prompt whose blocks on this engine are
        `local_block_ids` (all of them, in order). P's block size may differ from ours: the
        prompt's tokens are then mapped onto our blocks (`block_mapping.py`); with equal
        sizes P's blocks go to the first `len(remote_block_ids)` local ones, as in `pull`.
        Returns the bytes read; tokens received = bytes / (2 * num_layers * token_bytes)."""
        return await self._pull(params, list(local_block_ids), num_tokens)

    async def _pull(self, params: Mapping[str, object], local: list[int],
                    num_tokens: int | None) -> int:
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
        peer, fresh = await self._peer(req)
        try:
            return await self._read(peer, req, local, num_tokens)
        except KVTransferError as e:
            if fresh or e.reason != "transfer":
                raise
            # The peer may have restarted since we met it: re-handshake once, and read again
            # only when it really is a new agent (else the first error stands).
            log.warning("request %s: read from %s failed (%s); re-handshaking",
                        req.request_id, req.engine_id, e)
            await self._submit(lambda: self._get_reader().drop_peer(req.engine_id))
            new_peer, _ = await self._peer(req)
            if new_peer.agent_name == peer.agent_name:
                raise
            nbytes = await self._read(new_peer, req, local, num_tokens)
            log.info("request %s: read from %s recovered: it restarted as agent %s",
                     req.request_id, req.engine_id, new_peer.agent_name)
            return nbytes

    async def _read(self, peer: Peer, req: PullParams, local: list[int],
                    num_tokens: int | None) -> int:
        deadline = time.monotonic() + self._transfer_timeout
        notif = _encode(ReadDone(lease_id=req.request_id))
        done = await self._submit(lambda: self._start_read(
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
        reader = self._get_reader()
        if peer.layout.block_size != self._kv.layout.block_size:
            if num_tokens is None:
                raise KVTransferError(
                    f"block size {peer.layout.block_size} of {peer.engine_id} differs from "
                    f"ours ({self._kv.layout.block_size}); the prompt length is needed",
                    reason="params")
            return reader.start_mapped("READ", peer, local, remote, num_tokens, notif,
                                       deadline)
        if num_tokens is not None:
            if len(remote) > len(local):
                raise KVTransferError(f"{len(remote)} remote blocks but {len(local)} local",
                                      reason="params")
            local = local[:len(remote)]
        return reader.start_read(peer, local, remote, notif, deadline)

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

    def _get_reader(self) -> BlockTransfer:
        if self._reader is None:
            raise KVTransferError("KV connector is not started")
        return self._reader


    # -- push / notify: P WRITEs into D (engine_shim/push.py) ------------------------------
    def kv_info(self) -> dict[str, object]:
        """What a router needs to point a peer at this engine (GET /v1/kv/info)."""
        return {"engine_id": self.engine_id, "agent_name": self.agent_name,
                "host": self._host, "port": self.side_channel_port,
                "block_size": self._kv.layout.block_size,
                "num_blocks": self._kv.layout.num_blocks,
                "kv_layout": self._kv.layout.layout,
                # Our landed notices name the tokens we sampled (push: D continues after
                # them when asked to, so a router may stream them early).
                "landed_tokens": True}

    def push_blocks(self, request_id: str, block_ids: list[int], num_tokens: int,
                    params: NotifyPrefillParams | PushPrefillParams,
                    first_token_ids: tuple[int, ...] = ()) -> dict[str, object]:
        """P: a finished prompt's blocks (now owned by the connector) go to D by WRITE:
        at once in notify mode (D's blocks are in `params`), or once D's registration is
        here in push mode. The blocks are freed when the write ends, fails or expires. The
        landed notice names `first_token_ids` (what P sampled) for D.
        Returns the prefill reply's `kv_transfer_params`. Event-loop thread only; raises
        KVTransferError (table full, aborted: the caller keeps the blocks)."""
        if self._closed:
            raise KVConnectorError("KV connector is closed")
        self._remember_loop()
        if isinstance(params, NotifyPrefillParams):
            self._spawn_write(Match(request_id, tuple(block_ids), num_tokens,
                                    notify_target(params), first_token_ids))
        else:
            match = self._pushes.offer(request_id, block_ids, num_tokens, params,
                                       first_token_ids)
            if match is not None:
                self._spawn_write(match)
            else:
                self._thread.wake()  # D's registration is coming: poll for it
        # first_token_ids: the router may stream P's token at once and have D continue
        # after it.
        return {"pdgate_mode": params.mode, "do_remote_prefill": False, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "num_tokens": num_tokens,
                "first_token_ids": list(first_token_ids)}

    def _spawn_write(self, match: Match) -> None:
        self._writing_blocks += len(match.block_ids)
        self._spawn(self._write_and_notify(match))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Event-loop thread: run `coro` as a task we keep a reference to until it ends."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _remember_loop(self) -> None:
        self._loop = _running_loop() or self._loop

    def _refuse(self, r: Refusal) -> None:
        """Any thread: tell the D of refused registration `r` that no WRITE will come."""
        self._tell_failed(r.target, r.reason, r.detail)

    def _tell_failed(self, target: WriteTarget, reason: str, detail: str) -> None:
        """Any thread: send `target`'s D a `Failed` notice for `target.tag`, from the event
        loop (meeting D may need a handshake). Best effort: D's own timeout still holds."""
        loop = self._loop
        if loop is None or loop.is_closed():
            log.warning("cannot tell %s that the KV for %r will not come: no event loop",
                        target.engine_id, target.tag)
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
            loop.call_soon_threadsafe(
                lambda: self._spawn(self._send_failed(target, reason, detail)))

    async def _send_failed(self, target: WriteTarget, reason: str, detail: str) -> None:
        req = PullParams(engine_id=target.engine_id, request_id=target.tag, block_ids=(),
                         host=target.host, port=target.port, agent_name=target.agent_name)
        try:
            notif = _encode(failed(target.tag, reason, detail))
            peer, _ = await self._peer(req)
            await self._submit(lambda: self._get_reader().send_notif(peer, notif))
        except KVConnectorError as e:
            log.warning("could not tell %s that the KV for %r will not come (%s): %s",
                        target.engine_id, target.tag, reason, e)
        else:
            log.info("told %s that the KV for %r will not come (%s)", target.engine_id,
                     target.tag, reason)

    async def _write_and_notify(self, m: Match) -> None:
        t0 = time.perf_counter()
        error: str | None = None
        try:
            nbytes = await self._write(m)
        except (KVTransferError, KVConnectorError) as e:
            error = str(e)
            reason = e.reason if isinstance(e, KVTransferError) else "transfer"
            self._metrics.kv_transfer_failures.labels(op=_WRITE_OP, reason=reason).inc()
            log.warning("request %s: KV write to %s failed: %s", m.request_id,
                        m.target.engine_id, e)
            if reason != "handshake":  # D unreachable: no way to tell it either
                self._tell_failed(m.target, reason, error)
        else:
            self._metrics.kv_transfers.labels(op=_WRITE_OP).inc()
            self._metrics.kv_transfer_bytes.labels(op=_WRITE_OP).inc(nbytes)
            self._metrics.kv_transfer_seconds.labels(op=_WRITE_OP).observe(
                time.perf_counter() - t0)
        finally:  # NIXL no longer touches the blocks once the write ended (or was released)
            self._writing_blocks -= len(m.block_ids)
            self._free_blocks(list(m.block_ids))
        self._send_kv_ready(m, error)

    async def _write(self, m: Match) -> int:
        t = m.target
        if t.deadline is not None and time.time() > t.deadline:
            raise KVTransferError("the router's KV-ready deadline passed before the write",
                                  reason="timeout")
        req = PullParams(engine_id=t.engine_id, request_id=t.tag, block_ids=t.block_ids,
                         host=t.host, port=t.port, agent_name=t.agent_name)
        peer, _ = await self._peer(req)
        deadline = time.monotonic() + self._transfer_timeout
        notif = _encode(Landed(tag=t.tag, first_token_ids=list(m.first_token_ids)))
        done = await self._submit(lambda: self._start_write(peer, m, notif, deadline))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self._transfer_timeout + 1)
        except TimeoutError as e:
            raise KVTransferError(f"KV write to {t.engine_id} timed out",
                                  reason="timeout") from e

    def _start_write(self, peer: Peer, m: Match, notif: bytes, deadline: float) -> Future[int]:
        """Agent thread: P's blocks into D's, whole blocks when the block sizes match, else
        the prompt's tokens mapped between the two block sizes."""
        writer, t = self._get_reader(), m.target
        if peer.layout.block_size != self._kv.layout.block_size:
            return writer.start_mapped("WRITE", peer, list(m.block_ids), t.block_ids,
                                       m.num_tokens, notif, deadline)
        if len(m.block_ids) > len(t.block_ids):
            raise KVTransferError(f"{len(m.block_ids)} prompt blocks but D has "
                                  f"{len(t.block_ids)}", reason="params")
        return writer.start_write(peer, list(m.block_ids), t.block_ids[:len(m.block_ids)],
                                  notif, deadline)

    def _send_kv_ready(self, m: Match, error: str | None) -> None:
        t = m.target
        if t.notify_endpoint is None:
            return
        if self._sender is None:
            self._sender = NotifySender(secret=self._notify_secret)
        msg = KVReady(request_id=t.notify_request_id or m.request_id, engine_id=self.engine_id,
                      num_tokens=m.num_tokens, num_blocks=len(m.block_ids),
                      status="failed" if error else "ok", error=error,
                      token=t.notify_token)
        if not self._sender.send(t.notify_endpoint, msg):
            log.warning("request %s: KV-ready queue to %s is full; notice dropped",
                        m.request_id, t.notify_endpoint)

    def _on_notice(self, sender: str, frame: bytes) -> None:
        """Agent thread: one NIXL notification from agent `sender`. A bad one is counted and
        dropped; nothing in it may stop the rest of the batch (lost "done" notices would pin
        blocks until their lease expires)."""
        try:
            notice = decode_notice(frame)
        except NoticeError as e:
            self._protocol_error(e.reason)
            log.debug("NIXL notification from %s dropped: %s", sender, e)
            return
        try:
            self._dispatch(sender, notice)
        except Exception:
            self._protocol_error("internal")
            log.exception("handling a %s notice from %s failed", type(notice).__name__, sender)

    def _protocol_error(self, reason: str) -> None:
        self._metrics.protocol_errors.labels(channel="nixl_notice", reason=reason).inc()

    def _dispatch(self, sender: str, notice: Notice) -> None:
        """A "done" frees a lease (we are P, pull); a landing completes a wait (we are D);
        registrations (we are P, push) must come from the agent they name, so one peer
        cannot point our WRITE at another."""
        if isinstance(notice, ReadDone):
            lease = self._leases.pop(notice.lease_id)
            if lease is None:
                log.debug("done notice for unknown lease %r", notice.lease_id)
            else:
                self._release([lease], "released")
        elif isinstance(notice, Landed):
            self._set_landed(notice.tag, tuple(notice.first_token_ids))
        elif isinstance(notice, Failed):
            self._set_failed(notice)
        elif isinstance(notice, Unregistration):
            self._pushes.unregister(notice.request_id, sender)
        elif notice.agent_name != sender:
            self._protocol_error("bad_sender")
            log.warning("push registration naming agent %r came from %r; dropped",
                        notice.agent_name, sender)
        else:
            answer = self._pushes.register(notice)
            loop = self._loop
            if isinstance(answer, Refusal):
                log.warning("request %s: push registration from %s refused (%s)",
                            answer.request_id, sender, answer.reason)
                self._refuse(answer)
            elif answer is not None and loop is not None and not loop.is_closed():
                loop.call_soon_threadsafe(self._spawn_write, answer)

    # -- D side of push / notify --------------------------------------------------------
    # Landings: one concurrent Future per tag, set by the agent thread when P's notice
    # arrives (possibly before anyone waits for it). `_expected` holds the tags still
    # waited for, so the agent thread polls fast only while one is outstanding.
    def _landing(self, tag: str) -> Future[tuple[int, ...]]:
        with self._landings_lock:
            fut = self._landings.get(tag)
            if fut is None:
                fut = self._landings[tag] = Future()
                while len(self._landings) > _MAX_LANDINGS:
                    old, _ = self._landings.popitem(last=False)
                    self._expected.discard(old)
            return fut

    def _set_landed(self, tag: str, first_token_ids: tuple[int, ...]) -> None:
        fut = self._landing(tag)
        with self._landings_lock:
            self._expected.discard(tag)
        with contextlib.suppress(InvalidStateError):  # landed twice, or aborted meanwhile
            fut.set_result(first_token_ids)

    def _set_failed(self, notice: Failed) -> None:
        """P says the WRITE tagged `notice.tag` will not land: fail the wait now. Only a
        landing we expect is failed (a stray notice must not poison a later request)."""
        with self._landings_lock:
            fut = self._landings.get(notice.tag)
            self._expected.discard(notice.tag)
        if fut is None:
            log.debug("failed notice for %r, which nobody awaits; dropped", notice.tag)
            return
        log.warning("the prefill engine says the KV for %r will not land (%s: %s)",
                    notice.tag, notice.reason, notice.detail)
        with contextlib.suppress(InvalidStateError):  # landed or aborted meanwhile
            fut.set_exception(KVTransferError(
                f"the prefill engine will not push ({notice.reason}: {notice.detail})",
                reason="peer"))

    def _awaiting_landing(self) -> bool:
        return bool(self._expected)

    def expect_landing(self, tag: str) -> None:
        """D: a WRITE tagged `tag` is coming (keep UCX progressing for it, fast: the WRITE
        and its notice need our progress to complete)."""
        self._expect(tag)

    def _expect(self, tag: str) -> Future[tuple[int, ...]]:
        fut = self._landing(tag)
        with self._landings_lock:
            if not fut.done():
                self._expected.add(tag)  # poll fast until it lands
        self._thread.wake()
        return fut

    def forget_landing(self, tag: str) -> None:
        with self._landings_lock:
            self._landings.pop(tag, None)
            self._expected.discard(tag)

    async def await_landing(self, tag: str, timeout: float) -> tuple[int, ...] | None:
        """D: wait (at most `timeout` s) for P's notice that the WRITE tagged `tag` landed
        (NIXL delivers it after the data). The tokens P named in it (maybe none) when it
        did, None when not (timeout, P's failed notice, abort); the entry is then
        forgotten."""
        try:
            return await self._wait_landed(tag, timeout)
        except KVTransferError:
            return None

    async def _wait_landed(self, tag: str, timeout: float) -> tuple[int, ...]:
        """Like `await_landing`; raises KVTransferError: "timeout", "peer" (P's failed
        notice) or "aborted"."""
        fut = self._expect(tag)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), timeout)
        except TimeoutError as e:
            raise KVTransferError(f"no KV landed for {tag!r} within {timeout:g}s",
                                  reason="timeout") from e
        finally:
            self.forget_landing(tag)

    async def await_push(self, params: PushDecodeParams, request_id: str,
                         local_block_ids: list[int], num_tokens: int
                         ) -> tuple[int, tuple[int, ...]]:
        """D in push mode: register `local_block_ids` with P (named in `params`) and wait
        until P's WRITE landed; returns the bytes received and the tokens P sampled (as its
        landed notice names them; maybe none). Raises KVTransferError on a bad peer, when
        P says it will not write ("peer", at once), or when nothing landed within the
        transfer timeout or by the leg's `push_deadline` ("timeout"); P is then told to
        drop the registration."""
        t0 = time.perf_counter()
        self._remember_loop()
        try:
            tokens = await self._register_and_wait(params, request_id, local_block_ids,
                                                   num_tokens)
        except BaseException as e:
            self._unregister_later(params, request_id)
            if isinstance(e, KVTransferError):
                self._metrics.kv_transfer_failures.labels(op="push", reason=e.reason).inc()
            raise
        layout = self._kv.layout
        nbytes = len(local_block_ids) * layout.block_bytes * layout.num_layers * 2
        self._metrics.kv_transfer_seconds.labels(op="push").observe(time.perf_counter() - t0)
        return nbytes, tokens

    async def _register_and_wait(self, params: PushDecodeParams, request_id: str,
                                 local_block_ids: list[int], num_tokens: int
                                 ) -> tuple[int, ...]:
        """The landing wait is `transfer_timeout` from the registration; `push_deadline`
        (wall clock, the router's) bounds the whole step, handshake included."""
        req = push_peer_params(params, request_id)
        deadline = params.push_deadline
        left = None if deadline is None else deadline - time.time()
        if left is not None and left <= 0:
            raise KVTransferError("push_deadline passed before the push wait began",
                                  reason="timeout")
        try:
            async with asyncio.timeout(left):
                peer, _ = await self._peer(req)
                self.expect_landing(request_id)
                reg = Registration(request_id, self.engine_id, self._host,
                                   self.side_channel_port, self.agent_name,
                                   list(local_block_ids), num_tokens)
                await self._submit(lambda: self._get_reader().send_notif(peer, _encode(reg)))
                return await self._wait_landed(request_id, self._transfer_timeout)
        except TimeoutError as e:  # only asyncio.timeout's: _wait_landed raises its own
            raise KVTransferError(f"push_deadline passed before the KV from "
                                  f"{req.engine_id} landed", reason="timeout") from e

    def _unregister_later(self, params: PushDecodeParams, request_id: str) -> None:
        self.forget_landing(request_id)
        engine_id = params.remote_engine_id
        if self._reader is None:
            return
        reader = self._reader

        def unregister() -> None:
            peer = reader.peer(engine_id)
            if peer is not None:
                reader.send_notif(peer, _encode(Unregistration(request_id=request_id)))

        self._thread.submit(unregister)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # built outside a loop (tests, tools)
        return None


def _encode(notice: Notice) -> bytes:
    try:
        return encode_notice(notice)
    except NoticeError as e:  # an id too long for any peer to accept: fail this transfer
        raise KVTransferError(f"cannot notify the peer: {e}", reason="params") from e


def push_peer_params(params: PushDecodeParams, request_id: str) -> PullParams:
    """P's side channel from a push-mode decode leg's (checked) params."""
    return PullParams(engine_id=params.remote_engine_id, request_id=request_id, block_ids=(),
                      host=params.remote_host, port=params.remote_port,
                      agent_name=params.remote_agent_name)
