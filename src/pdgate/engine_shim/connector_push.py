"""The push direction of the KV connector (notify and push modes): P WRITEs into D.

P side: a finished prompt's blocks (`push_blocks`) are written into D's blocks at once in
notify mode (D's blocks are in the leg's params), or once D's registration (`register`, a
`reg` notice) is here in push mode; bookkeeping in `push.PendingPushes`. P sends a `landed`
notice after the data, or a `failed` one as soon as it knows the WRITE will not land, so D
never waits out its timeout for a push that P gave up on; a KV-ready notice goes to the
router named in the leg. D side: `await_push` registers D's blocks with P and waits for the
landing (`connector_landings.Landings`).

Threads: `push_blocks`, `fail_push` and `await_push` run on the event loop; `register`,
`unregister` and `expire` on the agent thread. Failed notices are sent from the event loop
(meeting D may need a handshake), whichever thread decided to send them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from pdgate.contract.kv_contract import NotifyPrefillParams, PushDecodeParams, PushPrefillParams
from pdgate.engine_shim.connector_landings import Landings
from pdgate.engine_shim.connector_link import AgentLink, encode
from pdgate.engine_shim.kv_params import PullParams
from pdgate.engine_shim.kv_reader import Peer
from pdgate.engine_shim.notices import Landed, Registration, Unregistration, failed
from pdgate.engine_shim.push import Match, PendingPushes, Refusal, WriteTarget, notify_target
from pdgate.engine_shim.transfer_errors import KVConnectorError, KVTransferError
from pdgate.proxy import KVReady, NotifySender

__all__ = ["PushSide", "push_peer_params"]

log = logging.getLogger(__name__)
_WRITE_OP = "write"


class PushSide:
    """See the module docstring. `side_channel` gives our (host, port) for registrations."""

    def __init__(self, link: AgentLink, landings: Landings, *, lease_seconds: float,
                 transfer_timeout: float, free_blocks: Callable[[list[int]], None],
                 side_channel: Callable[[], tuple[str, int]],
                 notify_secret: str | None) -> None:
        self._link = link
        self._landings = landings
        self._metrics = link.metrics
        self._transfer_timeout = transfer_timeout
        self._free_blocks = free_blocks
        self._side_channel = side_channel
        self._pushes = PendingPushes(lease_seconds)
        self.writing_blocks = 0
        self._tasks: set[asyncio.Task[None]] = set()  # writes and failure notices
        # The serving loop, where failure notices are sent from (they may need a handshake).
        # The server's lifespan builds us on it; loop-thread entry points set it too.
        self._loop: asyncio.AbstractEventLoop | None = _running_loop()
        self._notify_secret = notify_secret
        self._sender: NotifySender | None = None

    @property
    def pending(self) -> int:
        """Prompts waiting for a registration plus registrations waiting for a prompt."""
        return len(self._pushes)

    @property
    def blocks(self) -> int:
        return self._pushes.blocks + self.writing_blocks

    # -- P side: event loop ---------------------------------------------------------------
    def push_blocks(self, request_id: str, block_ids: list[int], num_tokens: int,
                    params: NotifyPrefillParams | PushPrefillParams,
                    first_token_ids: tuple[int, ...]) -> dict[str, object]:
        """See `KVConnector.push_blocks`."""
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
                self._link.thread.wake()  # D's registration is coming: poll for it
        # first_token_ids: the router may stream P's token at once and have D continue
        # after it.
        return {"pdgate_mode": params.mode, "do_remote_prefill": False, "do_remote_decode": False,
                "remote_engine_id": self._link.engine_id, "num_tokens": num_tokens,
                "first_token_ids": list(first_token_ids)}

    def fail_push(self, request_id: str, reason: str, detail: str) -> None:
        """See `KVConnector.fail_push`."""
        self._remember_loop()
        held, refusal = self._pushes.abort(request_id, reason, detail)
        if held:
            self._free_blocks(list(held))
        if refusal is not None:
            self._refuse(refusal)

    # -- P side: agent thread -------------------------------------------------------------
    def register(self, sender: str, reg: Registration) -> None:
        """D's registration, which must come from the agent it names, so one peer cannot
        point our WRITE at another."""
        if reg.agent_name != sender:
            self._metrics.protocol_errors.labels(channel="nixl_notice",
                                                 reason="bad_sender").inc()
            log.warning("push registration naming agent %r came from %r; dropped",
                        reg.agent_name, sender)
            return
        answer = self._pushes.register(reg)
        loop = self._loop
        if isinstance(answer, Refusal):
            log.warning("request %s: push registration from %s refused (%s)",
                        answer.request_id, sender, answer.reason)
            self._refuse(answer)
        elif answer is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._spawn_write, answer)

    def unregister(self, sender: str, request_id: str) -> None:
        self._pushes.unregister(request_id, sender)

    def expire(self) -> None:
        """Prompts and registrations that waited too long for the other."""
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

    def shed(self, need_blocks: int, min_age_s: float) -> None:
        """An admission has waited for blocks this engine holds for pushes nobody
        registered yet: free the oldest such prompts (`PendingPushes.shed`)."""
        for rid, blocks in self._pushes.shed(need_blocks, min_age_s):
            log.warning("request %s: no push registration after %.1f s while a request waits "
                        "for KV blocks; %d blocks freed (its decode engine will compute "
                        "the prompt)", rid, min_age_s, len(blocks))
            self._metrics.pushes_shed.inc()
            self._free_blocks(list(blocks))

    def shut_down(self) -> None:
        """Closing: free the waiting prompts' blocks and tell each registered D we have met
        already (its current agent) that no WRITE will come (best effort, no handshakes)."""
        held, refusals = self._pushes.pop_all()
        if self._link.thread.running:
            try:
                self._link.thread.call(lambda: self._refuse_known_peers(refusals), timeout=10)
            except Exception as e:
                log.warning("telling decode engines about the shutdown failed: %s", e)
        if held:
            self._free_blocks(list(held))

    def close_sender(self) -> None:
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def _refuse_known_peers(self, refusals: list[Refusal]) -> None:
        reader = self._link.reader
        if reader is None:
            return
        for r in refusals:
            peer = reader.peer(r.target.engine_id)
            if peer is None or peer.agent_name != r.target.agent_name:
                continue
            try:
                reader.send_notif(peer, encode(failed(r.target.tag, r.reason, r.detail)))
            except KVConnectorError as e:
                log.warning("request %s: could not tell %s: %s", r.request_id,
                            r.target.engine_id, e)

    # -- P side: writes and failure notices -----------------------------------------------
    def _spawn_write(self, match: Match) -> None:
        self.writing_blocks += len(match.block_ids)
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
        loop. Best effort: D's own timeout still holds."""
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
        link = self._link
        try:
            notif = encode(failed(target.tag, reason, detail))
            peer, _ = await link.peer(req)
            await link.submit(lambda: link.get_reader().send_notif(peer, notif))
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
            self.writing_blocks -= len(m.block_ids)
            self._free_blocks(list(m.block_ids))
        self._send_kv_ready(m, error)

    async def _write(self, m: Match) -> int:
        t = m.target
        if t.deadline is not None and time.time() > t.deadline:
            raise KVTransferError("the router's KV-ready deadline passed before the write",
                                  reason="timeout")
        req = PullParams(engine_id=t.engine_id, request_id=t.tag, block_ids=t.block_ids,
                         host=t.host, port=t.port, agent_name=t.agent_name)
        peer, _ = await self._link.peer(req)
        deadline = time.monotonic() + self._transfer_timeout
        notif = encode(Landed(tag=t.tag, first_token_ids=list(m.first_token_ids)))
        done = await self._link.submit(lambda: self._start_write(peer, m, notif, deadline))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self._transfer_timeout + 1)
        except TimeoutError as e:
            raise KVTransferError(f"KV write to {t.engine_id} timed out",
                                  reason="timeout") from e

    def _start_write(self, peer: Peer, m: Match, notif: bytes, deadline: float) -> Future[int]:
        """Agent thread: P's blocks into D's, whole blocks when the block sizes match, else
        the prompt's tokens mapped between the two block sizes."""
        writer, t = self._link.get_reader(), m.target
        if peer.layout.block_size != self._link.kv.layout.block_size:
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
        msg = KVReady(request_id=t.notify_request_id or m.request_id,
                      engine_id=self._link.engine_id, num_tokens=m.num_tokens,
                      num_blocks=len(m.block_ids), status="failed" if error else "ok",
                      error=error, token=t.notify_token)
        if not self._sender.send(t.notify_endpoint, msg):
            log.warning("request %s: KV-ready queue to %s is full; notice dropped",
                        m.request_id, t.notify_endpoint)

    # -- D side ---------------------------------------------------------------------------
    async def await_push(self, params: PushDecodeParams, request_id: str,
                         local_block_ids: list[int], num_tokens: int
                         ) -> tuple[int, tuple[int, ...]]:
        """See `KVConnector.await_push`."""
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
        layout = self._link.kv.layout
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
        link = self._link
        try:
            async with asyncio.timeout(left):
                peer, _ = await link.peer(req)
                self._landings.expect(request_id)
                host, port = self._side_channel()
                reg = Registration(request_id, link.engine_id, host, port, link.agent_name,
                                   list(local_block_ids), num_tokens)
                await link.submit(lambda: link.get_reader().send_notif(peer, encode(reg)))
                return await self._landings.wait(request_id, self._transfer_timeout)
        except TimeoutError as e:  # only asyncio.timeout's: Landings.wait raises its own
            raise KVTransferError(f"push_deadline passed before the KV from "
                                  f"{req.engine_id} landed", reason="timeout") from e

    def _unregister_later(self, params: PushDecodeParams, request_id: str) -> None:
        self._landings.forget(request_id)
        engine_id = params.remote_engine_id
        reader = self._link.reader
        if reader is None:
            return

        def unregister() -> None:
            peer = reader.peer(engine_id)
            if peer is not None:
                reader.send_notif(peer, encode(Unregistration(request_id=request_id)))

        self._link.thread.submit(unregister)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # built outside a loop (tests, tools)
        return None


def push_peer_params(params: PushDecodeParams, request_id: str) -> PullParams:
    """P's side channel from a push-mode decode leg's (checked) params."""
    return PullParams(engine_id=params.remote_engine_id, request_id=request_id, block_ids=(),
                      host=params.remote_host, port=params.remote_port,
                      agent_name=params.remote_agent_name)
