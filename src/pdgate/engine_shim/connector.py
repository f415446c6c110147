"""`KVConnector`: the engine's one object for moving KV blocks between engines over NIXL, a
facade over the pull direction (`connector_pull.py`: P's leases, D's READs) and the push
direction (`connector_push.py`: P's WRITEs into D for notify/push, and
`connector_landings.py`: D's waits for them), which share one `connector_link.AgentLink`
(agent thread, agent, peers, handshakes).

The facade owns the lifecycle (agent, side channel, agent thread), the agent thread's poll
(`_tick`) and the dispatch of every NIXL notification: each is a typed, versioned
`engine_shim.notices` frame; a peer's bad frame is counted
(`pdgate_shim_protocol_errors_total{channel="nixl_notice"}`) and dropped, never fatal.

The NIXL agent is injected: `agent_factory` builds it on the agent thread (default: a real
`NixlAgent`; unit tests pass a fake). Threads: every NIXL call runs on one `AgentThread`,
which also polls notifications, in-flight transfers and lease expiry: every 0.5 ms while
transfers are in flight, 1 ms while a landing is awaited, 2 ms while leases are held, 50 ms
when idle. `free_blocks` is called from the agent thread (notification, expiry) or the
caller's thread (`abort`, `close`), so it must be thread-safe.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Mapping

from pdgate.contract.kv_contract import NotifyPrefillParams, PushDecodeParams, PushPrefillParams
from pdgate.engine_shim.connector_landings import Landings
from pdgate.engine_shim.connector_link import AgentLink, KVMemory
from pdgate.engine_shim.connector_pull import PullSide
from pdgate.engine_shim.connector_push import PushSide, push_peer_params
from pdgate.engine_shim.metrics import ShimMetrics
from pdgate.engine_shim.nixl_agent import AgentFactory, nixl_agent_factory
from pdgate.engine_shim.notices import (
    Failed,
    Landed,
    Notice,
    NoticeError,
    ReadDone,
    Unregistration,
    decode_notice,
)
from pdgate.engine_shim.side_channel import HandshakePayload, SideChannelServer, compat_hash
from pdgate.engine_shim.transfer_errors import (
    KVConnectorError,
    KVHandshakeError,
    KVTransferError,
)
from pdgate.engine_shim.transport_probe import probe_transport

__all__ = ["KVConnector", "KVConnectorError", "KVHandshakeError", "KVMemory",
           "KVTransferError", "push_peer_params"]

log = logging.getLogger(__name__)
_BUSY_POLL_S = 0.0005   # transfers in flight: completion latency matters
_LEASE_POLL_S = 0.002   # leases held: "done" notices free blocks; peers may need our progress
_IDLE_POLL_S = 0.05     # nothing to do: stay cheap
_LANDING_POLL_S = 0.001  # a request waits for a pushed WRITE's notice (can be a whole prefill)
# A push prompt unregistered this long while an admission waited this long for blocks is
# given up (PendingPushes.shed): a registration normally follows in milliseconds.
_SHED_AFTER_S = 0.5
# SideChannelServer results that are a peer's protocol error -> protocol_errors reason.
_SIDE_CHANNEL_ERRORS = {"malformed_frames": "malformed", "malformed_request": "malformed",
                        "oversized": "oversized", "internal": "internal"}


class KVConnector:
    """See the module docstring. Build, `start()` once, `close()` once.

    `side_channel_port=0` binds a free port (read `side_channel_port` after start).
    `lease_seconds`: how long P keeps blocks for a reader that never says done (and, in push
    mode, a prompt or a registration waiting for the other).
    `transfer_timeout`: one READ or WRITE, and a push-mode D's wait for the landing;
    `handshake_timeout`: one side-channel round trip; `probe_timeout`: the start-up
    transport probe (seconds). `agent_factory`: builds the NIXL agent (see module doc)."""

    def __init__(
        self, *, engine_id: str, model_name: str, kv: KVMemory, side_channel_host: str,
        side_channel_port: int, lease_seconds: float, free_blocks: Callable[[list[int]], None],
        metrics: ShimMetrics, transfer_timeout: float = 30.0, handshake_timeout: float = 5.0,
        probe_timeout: float = 10.0, notify_secret: str | None = None,
        agent_factory: AgentFactory = nixl_agent_factory,
        starved_need: Callable[[float], int] | None = None,
    ) -> None:
        self.engine_id = engine_id
        self.model_name = model_name
        self.agent_name = f"{engine_id}-{uuid.uuid4().hex[:12]}"  # new per process start
        self._kv = kv
        self._host = side_channel_host
        self._port = side_channel_port
        self._free_blocks = free_blocks
        # The engine's admission: blocks its first queued request still lacks after waiting
        # the given seconds (Scheduler.starved_need); any thread.
        self._starved_need = starved_need
        self._metrics = metrics
        self._probe_timeout = probe_timeout
        self._agent_factory = agent_factory
        self._server: SideChannelServer | None = None
        self._closed = False
        self._link = AgentLink(engine_id=engine_id, model_name=model_name,
                               agent_name=self.agent_name, kv=kv, metrics=metrics,
                               handshake_timeout=handshake_timeout, tick=self._tick)
        self._landings = Landings(self._link.thread.wake)
        self._pull = PullSide(self._link, lease_seconds=lease_seconds,
                              transfer_timeout=transfer_timeout, free_blocks=free_blocks,
                              side_channel=self._side_channel)
        self._push = PushSide(self._link, self._landings, lease_seconds=lease_seconds,
                              transfer_timeout=transfer_timeout, free_blocks=free_blocks,
                              side_channel=self._side_channel, notify_secret=notify_secret)

    @property
    def side_channel_port(self) -> int:
        """The bound side-channel port (differs from the argument when that was 0)."""
        return self._server.port if self._server is not None else self._port

    def _side_channel(self) -> tuple[str, int]:
        return self._host, self.side_channel_port

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Create the agent, register the KV buffer, prepare the local descriptor list, start
        the agent thread and the side channel. Blocking (call before serving). On failure
        everything set up so far is torn down and KVConnectorError is raised. With VRAM KV
        it then runs the transport probe (`transport_probe`: logs, metrics, never fails)."""
        link = self._link
        try:
            link.thread.start()
            metadata = link.thread.call(lambda: link.open(self._agent_factory))
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

    def close(self) -> None:
        """Stop the side channel and the agent thread, free every leased block, deregister.
        D engines waiting for our pushes are told (the peers we know). Idempotent."""
        self._closed = True
        if self._server is not None:
            self._server.stop()
        self._push.shut_down()
        thread = self._link.thread
        if thread.running:
            try:
                thread.call(self._link.close_agent, timeout=10)
            except Exception as e:  # closing must go on: the leases below still need freeing
                log.warning("closing the NIXL agent failed: %s", e)
            thread.stop()
        self._pull.release_all()
        self._push.close_sender()

    def _check_open(self) -> None:
        if self._closed:
            raise KVConnectorError("KV connector is closed")

    # -- P side ---------------------------------------------------------------------------
    def hold_for_remote_decode(self, request_id: str, block_ids: list[int]) -> dict[str, object]:
        """Pin `block_ids` (now owned by the lease, not the caller) for a remote reader and
        return the prefill reply's `kv_transfer_params` (vLLM NixlConnector fields).
        Raises KVConnectorError after `close()` (the caller keeps and frees the blocks)."""
        self._check_open()
        return self._pull.hold(request_id, block_ids)

    def push_blocks(self, request_id: str, block_ids: list[int], num_tokens: int,
                    params: NotifyPrefillParams | PushPrefillParams,
                    first_token_ids: tuple[int, ...] = ()) -> dict[str, object]:
        """P: a finished prompt's blocks (now owned by the connector) go to D by WRITE:
        at once in notify mode (D's blocks are in `params`), or once D's registration is
        here in push mode. The blocks are freed when the write ends, fails or expires. The
        landed notice names `first_token_ids` (what P sampled) for D.
        Returns the prefill reply's `kv_transfer_params`. Event-loop thread only; raises
        KVTransferError (table full, aborted: the caller keeps the blocks)."""
        self._check_open()
        return self._push.push_blocks(request_id, block_ids, num_tokens, params,
                                      first_token_ids)

    def abort(self, request_id: str) -> None:
        """Free every lease `request_id` holds now (router abort, failed decode leg), and any
        prompt of it still waiting for a push registration; a D registered for it is told
        at once (and one registering later too); a wait of ours for its push ends.
        Event-loop thread."""
        self._pull.release_request(request_id)
        self.fail_push(request_id, "aborted", "the router aborted the request on the "
                       "prefill engine")
        self._landings.abort(request_id)

    def fail_push(self, request_id: str, reason: str, detail: str) -> None:
        """P will not push `request_id` (aborted; its prefill failed, was cancelled or
        stopped before handing its KV over): free a prompt still waiting, tell a D that
        registered (a `notices.Failed`), and refuse a registration that comes later.
        `reason`: a `notices.FAILURE_REASONS` word. Event-loop thread."""
        self._push.fail_push(request_id, reason, detail)

    def leased_blocks(self) -> int:
        """Blocks pinned for remote peers right now (pull leases, prompts waiting for a push
        registration, writes in flight)."""
        return self._pull.blocks + self._push.blocks

    def pending_pushes(self) -> int:
        """Push-mode prompts waiting for D's registration plus registrations waiting for
        their prompt (`GET /metrics` shows their blocks; tests their count)."""
        return self._push.pending

    def kv_info(self) -> dict[str, object]:
        """What a router needs to point a peer at this engine (GET /v1/kv/info)."""
        layout = self._kv.layout
        return {"engine_id": self.engine_id, "agent_name": self.agent_name,
                "host": self._host, "port": self.side_channel_port,
                "block_size": layout.block_size, "num_blocks": layout.num_blocks,
                "kv_layout": layout.layout,
                # Our landed notices name the tokens we sampled (push: D continues after
                # them when asked to, so a router may stream them early).
                "landed_tokens": True}

    # -- D side ---------------------------------------------------------------------------
    async def pull(self, params: Mapping[str, object], local_block_ids: list[int]) -> int:
        """READ P's `remote_block_ids` (from P's `params`) into `local_block_ids` (same
        length, same order); return the bytes read. Deadline: `handshake_timeout` +
        `transfer_timeout`, twice that when a read from a cached peer fails and a re-handshake
        finds a new agent (P restarted). Once it returns or raises, NIXL no longer writes the
        local blocks (unless cancelling a timed-out read failed, which is logged). Raises
        KVTransferError (KVHandshakeError for handshakes), never blocks the event loop.
        P's block size must equal ours (else use `pull_tokens`)."""
        return await self._pull.pull(params, list(local_block_ids), None)

    async def pull_tokens(self, params: Mapping[str, object], local_block_ids: list[int],
                          num_tokens: int) -> int:
        """Like `pull`, for a `num_tokens` prompt whose blocks on this engine are
        `local_block_ids` (all of them, in order). P's block size may differ from ours: the
        prompt's tokens are then mapped onto our blocks (`block_mapping.py`); with equal
        sizes P's blocks go to the first `len(remote_block_ids)` local ones, as in `pull`.
        Returns the bytes read; tokens received = bytes / (2 * num_layers * token_bytes)."""
        return await self._pull.pull(params, list(local_block_ids), num_tokens)

    def expect_landing(self, tag: str) -> None:
        """D: a WRITE tagged `tag` is coming (keep UCX progressing for it, fast: the WRITE
        and its notice need our progress to complete)."""
        self._landings.expect(tag)

    def forget_landing(self, tag: str) -> None:
        self._landings.forget(tag)

    async def await_landing(self, tag: str, timeout: float) -> tuple[int, ...] | None:
        """D: wait (at most `timeout` s) for P's notice that the WRITE tagged `tag` landed
        (NIXL delivers it after the data). The tokens P named in it (maybe none) when it
        did, None when not (timeout, P's failed notice, abort); the entry is then
        forgotten."""
        try:
            return await self._landings.wait(tag, timeout)
        except KVTransferError:
            return None

    async def await_push(self, params: PushDecodeParams, request_id: str,
                         local_block_ids: list[int], num_tokens: int
                         ) -> tuple[int, tuple[int, ...]]:
        """D in push mode: register `local_block_ids` with P (named in `params`) and wait
        until P's WRITE landed; returns the bytes received and the tokens P sampled (as its
        landed notice names them; maybe none). Raises KVTransferError on a bad peer, when
        P says it will not write ("peer", at once), or when nothing landed within the
        transfer timeout or by the leg's `push_deadline` ("timeout"); P is then told to
        drop the registration."""
        return await self._push.await_push(params, request_id, local_block_ids, num_tokens)

    # -- agent thread ---------------------------------------------------------------------
    def _tick(self) -> float:
        """Poll notifications, in-flight transfers and expiry; return the next interval."""
        agent, reader = self._link.agent, self._link.reader
        if agent is None or reader is None:
            return _IDLE_POLL_S
        for sender, msgs in agent.get_notifs().items():
            for msg in msgs:
                self._on_notice(sender, msg)
        in_flight = reader.poll()
        self._pull.expire()
        self._push.expire()
        if self._starved_need is not None and self._push.pending:
            need = self._starved_need(_SHED_AFTER_S)
            if need:
                self._push.shed(need, _SHED_AFTER_S)
        if in_flight or self._push.writing_blocks:
            return _BUSY_POLL_S
        if self._landings.awaiting():
            return _LANDING_POLL_S
        busy = self._pull.leases or self._push.pending or len(self._landings)
        return _LEASE_POLL_S if busy else _IDLE_POLL_S

    def _on_notice(self, sender: str, frame: bytes) -> None:
        """One NIXL notification from agent `sender`. A bad one is counted and dropped;
        nothing in it may stop the rest of the batch (lost "done" notices would pin blocks
        until their lease expires)."""
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
        """A "done" frees a lease (we are P, pull); a landing ends a wait (we are D);
        registrations are P's in push mode."""
        if isinstance(notice, ReadDone):
            self._pull.read_done(notice.lease_id)
        elif isinstance(notice, Landed):
            self._landings.landed(notice.tag, tuple(notice.first_token_ids))
        elif isinstance(notice, Failed):
            self._landings.failed(notice)
        elif isinstance(notice, Unregistration):
            self._push.unregister(sender, notice.request_id)
        else:
            self._push.register(sender, notice)
