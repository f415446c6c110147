"""Push-mode bookkeeping: P WRITEs a prompt's KV into D's blocks (notify and push modes).

Pure data and tables (no NIXL, no asyncio); `connector.py` does the transfers.

Two flows put a `WriteTarget` (where in D the KV goes) next to P's finished blocks:

- notify: the router reserved blocks on D (`POST /v1/kv/reserve`) and put them, with D's
  side channel and the router's KV-ready endpoint, in P's `kv_transfer_params`; the target
  is known when P's prefill ends.
- push: the router sent both legs at once; D allocates the prompt's blocks and *registers*
  them with P by a NIXL notification (a `notices.Registration`). P's prefill
  may end before or after the registration arrives: `PendingPushes` keeps whichever comes
  first (bounded, with a TTL) and hands back the pair once both are there.

When the WRITE lands, P's NIXL notification (a `notices.Landed`) reaches D after the data; it
names the token(s) P sampled, so a push-mode D asked to `continue_after_prefill` can go on
after them (the router streamed them to the client from P's reply). When P knows the
WRITE will not land (it failed, the router aborted the request on P, P's prefill failed or
stopped early, a registration or prompt expired, a duplicate registration, shutdown), it
sends D a `notices.Failed` with the same tag instead, and D fails or recomputes at once
(`--kv-load-failure-policy`) rather than at its timeout. Every notification's encoding
lives in `engine_shim/notices.py`.

The kv_transfer_params keys of both flows (the router writes them, vLLM ignores them) are
typed and versioned in contract/kv_contract.py; the HTTP edge (openai_types) parses them, so
everything here works on checked structs.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdgate.contract.kv_contract import NotifyPrefillParams, PushPrefillParams
from pdgate.engine_shim.notices import Registration
from pdgate.engine_shim.transfer_errors import KVTransferError


@dataclass(frozen=True)
class WriteTarget:
    """Where P writes one request's KV, and whom it tells. `tag` names the landing on D
    (reservation id in notify mode, request id in push mode)."""

    engine_id: str
    host: str
    port: int
    agent_name: str | None
    block_ids: tuple[int, ...]
    tag: str
    num_tokens: int
    notify_endpoint: str | None = None
    notify_request_id: str | None = None
    notify_token: str = ""  # echoed in the KVReady message (the router checks it)
    deadline: float | None = None  # wall clock (time.time()); no WRITE may start after it


def notify_target(params: NotifyPrefillParams) -> WriteTarget:
    """The P leg of notify mode: D's reserved blocks, as the router named them."""
    return WriteTarget(
        engine_id=params.remote_engine_id, host=params.remote_host, port=params.remote_port,
        agent_name=params.remote_agent_name, block_ids=tuple(params.remote_block_ids),
        tag=params.reservation_id, num_tokens=params.num_tokens,
        notify_endpoint=params.notify_endpoint, notify_request_id=params.notify_request_id,
        notify_token=params.notify_token or "", deadline=params.write_deadline,
    )


def registration_target(reg: Registration, params: PushPrefillParams | None) -> WriteTarget:
    """The target of a push registration; P's own request params may name a proxy."""
    return WriteTarget(
        engine_id=reg.engine_id, host=reg.host, port=reg.port, agent_name=reg.agent_name,
        block_ids=tuple(reg.block_ids), tag=reg.request_id, num_tokens=reg.num_tokens,
        notify_endpoint=params.notify_endpoint if params else None,
        notify_request_id=params.notify_request_id if params else None,
        notify_token=(params.notify_token if params else None) or "",
    )


@dataclass
class _Blocks:
    block_ids: tuple[int, ...]
    num_tokens: int
    params: PushPrefillParams | None
    expires_at: float
    first_token_ids: tuple[int, ...]


@dataclass
class _Reg:
    reg: Registration
    expires_at: float


@dataclass
class _Closed:
    """A request id P will not (again) write for: `reason` (a `notices.FAILURE_REASONS`
    word) answers a registration that comes late. `served`: the agent whose registration
    was matched, whose own resends are ignored rather than refused."""

    reason: str
    served: str | None
    expires_at: float


@dataclass(frozen=True)
class Match:
    """P's finished blocks and D's registration for one request: write now."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    target: WriteTarget
    first_token_ids: tuple[int, ...] = ()  # what P sampled: named in the landed notice


@dataclass(frozen=True)
class Refusal:
    """A registration P will never write for: tell `target` at once (`notices.Failed`
    tagged `target.tag`) so that D stops waiting. `reason`: a FAILURE_REASONS word."""

    request_id: str
    target: WriteTarget
    reason: str
    detail: str


@dataclass(frozen=True)
class Expired:
    """What `PendingPushes.expire` dropped: prompts whose blocks the caller frees (request
    id, blocks) and registrations whose D the caller tells."""

    blocks: list[tuple[str, tuple[int, ...]]]
    refusals: list[Refusal]


class PendingPushes:
    """P side of push mode: finished prompts waiting for D's registration and registrations
    waiting for the prompt, keyed by request id. Thread-safe (blocks are offered on the event
    loop, registrations arrive on the agent thread).

    Both sides expire after `ttl` seconds; `max_entries` bounds each side (an offer or a
    registration beyond the cap is refused: the caller frees the blocks / tells that D).
    Expired and aborted blocks are returned for the caller to free.

    Every registration gets exactly one answer, and none is lost or overwritten: a `Match`
    (write), a `Refusal` (tell D now), or None (kept until the prompt is done; expiry,
    `abort` and `pop_all` return it as a Refusal later). Request ids P will not write for
    (aborted, given up, expired, or already matched) are remembered for `ttl` ("closed"),
    so a registration arriving after that is refused at once instead of waiting out the
    TTL; a new `offer` for the id (a fresh prefill) reopens it, except after the router's
    abort (the abort overtook the prefill: the offer is refused, the caller frees).

    Duplicate registrations (same request id): the first one stands. A second from the
    same agent is ignored (a resend: answering it would wake the first's wait, which D
    keys by request id too); one from another agent is refused ("duplicate"), so a peer
    can neither take over nor cancel a write registered by another D. For the same reason
    `unregister` only drops a registration of the agent that asks."""

    def __init__(self, ttl: float, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._blocks: OrderedDict[str, _Blocks] = OrderedDict()
        self._regs: OrderedDict[str, _Reg] = OrderedDict()
        self._closed: OrderedDict[str, _Closed] = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, request_id: str, block_ids: list[int], num_tokens: int,
              params: PushPrefillParams | None,
              first_token_ids: tuple[int, ...] = ()) -> Match | None:
        """P's prompt is done: the Match if D already registered, else keep the blocks.
        Raises KVTransferError when the table is full or holds this id's prompt already
        (the caller keeps the blocks)."""
        with self._lock:
            closed = self._closed.pop(request_id, None)
            if closed is not None and closed.reason == "aborted":
                # The router's abort overtook this prefill on its way here: nobody will
                # register for it, so holding the prompt would pin its blocks for the TTL.
                self._closed[request_id] = closed
                raise KVTransferError("the router aborted this request before its prefill "
                                      "finished", reason="aborted")
            reg = self._regs.pop(request_id, None)
            if reg is not None:
                self._close(request_id, "duplicate", reg.reg.agent_name)
                return Match(request_id, tuple(block_ids), num_tokens,
                             registration_target(reg.reg, params), first_token_ids)
            if len(self._blocks) >= self._max or request_id in self._blocks:
                raise KVTransferError("too many prompts waiting for a push registration")
            self._blocks[request_id] = _Blocks(tuple(block_ids), num_tokens, params,
                                               self._clock() + self._ttl, first_token_ids)
            return None

    def register(self, reg: Registration) -> Match | Refusal | None:
        """D registered: the Match if P's prompt is done, a Refusal if P will not write for
        it (see the class docstring), else None (kept)."""
        rid = reg.request_id
        with self._lock:
            closed = self._closed.get(rid)
            if closed is not None:
                if closed.served == reg.agent_name:
                    return None  # a resend of the registration already served
                return _refusal(reg, closed.reason, "the prefill engine will not write "
                                f"for this request ({closed.reason})")
            pending = self._regs.get(rid)
            if pending is not None:
                if pending.reg.agent_name == reg.agent_name:
                    return None
                return _refusal(reg, "duplicate", "another decode engine registered first")
            held = self._blocks.pop(rid, None)
            if held is not None:
                self._close(rid, "duplicate", reg.agent_name)
                return Match(rid, held.block_ids, held.num_tokens,
                             registration_target(reg, held.params), held.first_token_ids)
            if len(self._regs) >= self._max:
                return _refusal(reg, "full", "too many registrations waiting for prompts")
            self._regs[rid] = _Reg(reg, self._clock() + self._ttl)
            return None

    def unregister(self, request_id: str, agent_name: str) -> None:
        """D (agent `agent_name`) gave up (timeout, cancelled): never write for it. Only
        that agent's own registration is dropped."""
        with self._lock:
            pending = self._regs.get(request_id)
            if pending is not None and pending.reg.agent_name == agent_name:
                del self._regs[request_id]

    def abort(self, request_id: str, reason: str = "aborted",
              detail: str = "") -> tuple[tuple[int, ...], Refusal | None]:
        """P will not write for `request_id` (router abort, failed prefill): drop its prompt
        and registration and close the id. Returns the blocks the caller must free and the
        registration whose D the caller must tell (if one was waiting)."""
        with self._lock:
            pending = self._regs.pop(request_id, None)
            held = self._blocks.pop(request_id, None)
            if request_id not in self._closed:  # keep who was served: resends stay quiet
                self._close(request_id, reason, None)
        refusal = None if pending is None else _refusal(pending.reg, reason, detail)
        return (held.block_ids if held else ()), refusal

    def expire(self) -> Expired:
        """Drop what outlived the TTL: prompts (their blocks for the caller to free; the id
        is closed so a late registration is refused) and registrations (to refuse). Every
        map is in insertion (= expiry) order."""
        now = self._clock()
        out = Expired([], [])
        with self._lock:
            while self._regs and next(iter(self._regs.values())).expires_at <= now:
                _, r = self._regs.popitem(last=False)
                out.refusals.append(_refusal(r.reg, "expired", "the prefill engine's "
                                             "prompt did not come within its TTL"))
            while self._blocks and next(iter(self._blocks.values())).expires_at <= now:
                rid, held = self._blocks.popitem(last=False)
                out.blocks.append((rid, held.block_ids))
                self._close(rid, "expired", None)
            while self._closed and next(iter(self._closed.values())).expires_at <= now:
                self._closed.popitem(last=False)
        return out

    def shed(self, need_blocks: int, min_age_s: float) -> list[tuple[str, tuple[int, ...]]]:
        """Give up the oldest prompts that have waited `min_age_s` for a registration, until
        they hold `need_blocks` (the caller frees them), when a registration waits for a
        prompt not computed yet. Their ids close as "expired", so a registration that
        comes later is refused at once and its D computes the prompt.

        Why: both legs of a push start together, and each engine admits in its own order.
        With both pools full, D's blocks can all be registered for prompts P has not
        computed, while P's are all held by computed prompts whose D legs wait for D's
        blocks: each waits for the other until the TTL (P's --kv-lease-seconds, D's push
        deadline). A prompt given up here costs its D one prefill; the wait cost them all.
        With no registration waiting, no D holds blocks for P's queue: D is only slow, and
        P waits for it rather than hand it prompts to compute again."""
        oldest_offer = self._clock() + self._ttl - min_age_s  # offered at expires_at - ttl
        shed: list[tuple[str, tuple[int, ...]]] = []
        with self._lock:
            while need_blocks > 0 and self._blocks and self._regs:
                rid, held = next(iter(self._blocks.items()))
                if held.expires_at > oldest_offer:
                    break
                del self._blocks[rid]
                self._close(rid, "expired", None)
                shed.append((rid, held.block_ids))
                need_blocks -= len(held.block_ids)
        return shed

    def pop_all(self) -> tuple[tuple[int, ...], list[Refusal]]:
        """Everything held (shutdown): blocks to free and registrations to refuse."""
        with self._lock:
            blocks = tuple(b for h in self._blocks.values() for b in h.block_ids)
            refusals = [_refusal(r.reg, "shutdown", "the prefill engine is shutting down")
                        for r in self._regs.values()]
            self._blocks.clear()
            self._regs.clear()
            self._closed.clear()
            return blocks, refusals

    def _close(self, request_id: str, reason: str, served: str | None) -> None:
        """Lock held. Remember `request_id` as closed (bounded: the oldest is forgotten)."""
        self._closed[request_id] = _Closed(reason, served, self._clock() + self._ttl)
        self._closed.move_to_end(request_id)
        while len(self._closed) > self._max:
            self._closed.popitem(last=False)

    @property
    def blocks(self) -> int:
        """Blocks held for pushes right now."""
        with self._lock:
            return sum(len(h.block_ids) for h in self._blocks.values())

    def __len__(self) -> int:
        """Prompts and registrations waiting (closed ids are not counted)."""
        with self._lock:
            return len(self._blocks) + len(self._regs)


def _refusal(reg: Registration, reason: str, detail: str) -> Refusal:
    return Refusal(reg.request_id, registration_target(reg, None), reason, detail)
