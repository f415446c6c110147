"""Push-mode bookkeeping: P WRITEs a prompt's KV into D's blocks (design.md §3 notify/push).

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
after them (the router streamed them to the client from P's reply). Every notification's
encoding lives in `engine_shim/notices.py`.

kv_transfer_params keys (the router writes them; vLLM ignores unknown keys):
    pdgate_mode        "notify" | "push" (absent: vLLM pull)
    notify_endpoint    router proxy's zmq endpoint (P sends KVReady there), optional
    notify_request_id  request id in the KVReady message
    notify_token       the router's per-request random token, echoed in the KVReady message
                       (string, at most 128 characters; checked in openai_types)
    write_deadline     notify: wall-clock time after which P must not start the WRITE (the
                       router has given up and D's reservation is going away)
    reservation_id     notify: D's reservation, both legs; push: absent
    num_tokens         prompt tokens the router counted (D's reservation size)
    remote_*           notify P leg: D's engine id / side channel / agent / reserved blocks;
                       push D leg: P's engine id / side channel
    first_token_ids    P's reply (notify/push): the token(s) P sampled. A decode leg with it
                       continues after them (notify's early first token; also without a
                       transfer, when D must recompute the prompt)
    continue_after_prefill  push D leg: continue after the token(s) P's landed notice names
                       (the router streamed them from P's reply), or fail the stream
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from engine_shim.notices import Registration
from engine_shim.transfer_errors import KVTransferError

MODES = ("notify", "push")


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


def mode_of(params: Mapping[str, object] | None) -> str | None:
    """"notify" / "push" when `params` ask for a pdgate push flow, else None (vLLM pull)."""
    mode = params.get("pdgate_mode") if params else None
    return mode if isinstance(mode, str) and mode in MODES else None


def _int(params: Mapping[str, object], key: str) -> int:
    value = params.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise KVTransferError(f"kv_transfer_params.{key} must be an int, got {value!r}",
                              reason="params")
    return value


def _str(params: Mapping[str, object], key: str) -> str:
    value = params.get(key)
    if not isinstance(value, str) or not value:
        raise KVTransferError(f"kv_transfer_params.{key} must be a string, got {value!r}",
                              reason="params")
    return value


def _opt_str(params: Mapping[str, object], key: str) -> str | None:
    value = params.get(key)
    return value if isinstance(value, str) and value else None


def notify_target(params: Mapping[str, object]) -> WriteTarget:
    """The P leg of notify mode: D's reserved blocks from the router. Raises
    KVTransferError(reason="params") naming the first bad field."""
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        raise KVTransferError("kv_transfer_params.remote_block_ids must be ints >= 0",
                              reason="params")
    return WriteTarget(
        engine_id=_str(params, "remote_engine_id"), host=_str(params, "remote_host"),
        port=_int(params, "remote_port"), agent_name=_opt_str(params, "remote_agent_name"),
        block_ids=tuple(blocks), tag=_str(params, "reservation_id"),
        num_tokens=_int(params, "num_tokens"),
        notify_endpoint=_opt_str(params, "notify_endpoint"),
        notify_request_id=_opt_str(params, "notify_request_id"),
        notify_token=_opt_str(params, "notify_token") or "",
        deadline=_opt_float(params, "write_deadline"),
    )


def _opt_float(params: Mapping[str, object], key: str) -> float | None:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def registration_target(reg: Registration, params: Mapping[str, object] | None) -> WriteTarget:
    """The target of a push registration; P's own request params may name a proxy."""
    p = params or {}
    return WriteTarget(
        engine_id=reg.engine_id, host=reg.host, port=reg.port, agent_name=reg.agent_name,
        block_ids=tuple(reg.block_ids), tag=reg.request_id, num_tokens=reg.num_tokens,
        notify_endpoint=_opt_str(p, "notify_endpoint"),
        notify_request_id=_opt_str(p, "notify_request_id"),
        notify_token=_opt_str(p, "notify_token") or "",
    )


@dataclass
class _Blocks:
    block_ids: tuple[int, ...]
    num_tokens: int
    params: Mapping[str, object] | None
    expires_at: float
    first_token_ids: tuple[int, ...]


@dataclass
class _Reg:
    reg: Registration
    expires_at: float


@dataclass(frozen=True)
class Match:
    """P's finished blocks and D's registration for one request: write now."""

    request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    target: WriteTarget
    first_token_ids: tuple[int, ...] = ()  # what P sampled: named in the landed notice


class PendingPushes:
    """P side of push mode: finished prompts waiting for D's registration and registrations
    waiting for the prompt, keyed by request id. Thread-safe (blocks are offered on the event
    loop, registrations arrive on the agent thread).

    Both sides expire after `ttl` seconds; `max_entries` bounds each side (the oldest
    registration is dropped; an offer beyond the cap is refused so the caller frees the
    blocks). Expired and aborted blocks are returned for the caller to free."""

    def __init__(self, ttl: float, max_entries: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._blocks: OrderedDict[str, _Blocks] = OrderedDict()
        self._regs: OrderedDict[str, _Reg] = OrderedDict()
        self._lock = threading.Lock()

    def offer(self, request_id: str, block_ids: list[int], num_tokens: int,
              params: Mapping[str, object] | None,
              first_token_ids: tuple[int, ...] = ()) -> Match | None:
        """P's prompt is done: the Match if D already registered, else keep the blocks.
        Raises KVTransferError when the table is full (the caller keeps the blocks)."""
        with self._lock:
            reg = self._regs.pop(request_id, None)
            if reg is not None:
                return Match(request_id, tuple(block_ids), num_tokens,
                             registration_target(reg.reg, params), first_token_ids)
            if len(self._blocks) >= self._max or request_id in self._blocks:
                raise KVTransferError("too many prompts waiting for a push registration")
            self._blocks[request_id] = _Blocks(tuple(block_ids), num_tokens, params,
                                               self._clock() + self._ttl, first_token_ids)
            return None

    def register(self, reg: Registration) -> Match | None:
        """D registered: the Match if P's prompt is done, else keep the registration."""
        with self._lock:
            held = self._blocks.pop(reg.request_id, None)
            if held is not None:
                return Match(reg.request_id, held.block_ids, held.num_tokens,
                             registration_target(reg, held.params), held.first_token_ids)
            self._regs[reg.request_id] = _Reg(reg, self._clock() + self._ttl)
            self._regs.move_to_end(reg.request_id)
            while len(self._regs) > self._max:
                self._regs.popitem(last=False)
            return None

    def unregister(self, request_id: str) -> None:
        """D gave up (timeout, cancelled): never write for it."""
        with self._lock:
            self._regs.pop(request_id, None)

    def abort(self, request_id: str) -> tuple[int, ...]:
        """Drop everything of `request_id`; returns blocks the caller must free."""
        with self._lock:
            self._regs.pop(request_id, None)
            held = self._blocks.pop(request_id, None)
            return held.block_ids if held else ()

    def expire(self) -> list[tuple[str, tuple[int, ...]]]:
        """Drop what outlived the TTL; returns (request id, blocks to free) of expired
        prompts. Both maps are in insertion (= expiry) order."""
        now = self._clock()
        out: list[tuple[str, tuple[int, ...]]] = []
        with self._lock:
            while self._regs and next(iter(self._regs.values())).expires_at <= now:
                self._regs.popitem(last=False)
            while self._blocks and next(iter(self._blocks.values())).expires_at <= now:
                rid, held = self._blocks.popitem(last=False)
                out.append((rid, held.block_ids))
        return out

    def pop_all(self) -> tuple[int, ...]:
        """Everything held (shutdown); returns blocks to free."""
        with self._lock:
            blocks = tuple(b for h in self._blocks.values() for b in h.block_ids)
            self._blocks.clear()
            self._regs.clear()
            return blocks

    @property
    def blocks(self) -> int:
        """Blocks held for pushes right now."""
        with self._lock:
            return sum(len(h.block_ids) for h in self._blocks.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks) + len(self._regs)
