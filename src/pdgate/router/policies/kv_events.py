"""An exact prefix index fed by engines' KV cache events (vLLM's `--kv-events-config`).

Wire format (vLLM `ZmqEventPublisher`): a ZMQ PUB socket sends 3-frame messages
`[topic, seq (8-byte big-endian), payload]`; the payload is a msgpack `KVEventBatch`
`(ts, events, data_parallel_rank?)` whose events are tagged `BlockStored`
`(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...)`,
`BlockRemoved (block_hashes, medium?)` and `AllBlocksCleared`. vLLM up to 0.2x encodes
batches and events as positional arrays (tag first); newer vLLM encodes events as maps with a
`"type"` key. Both are accepted; unknown trailing/extra fields are ignored.

Matching: vLLM's block hashes are its own (sha256 over its own serialization, seeded per
deployment), so the router cannot recompute them from a prompt. Instead it re-hashes the
`token_ids` that every `BlockStored` carries with the router's chained hash
(`router.prefix_index.block_hashes`, continuing from the parent block's router hash) and
keeps, per engine, a map engine-hash -> router hashes, so a later `BlockRemoved` (which only
names engine hashes) can be applied. An engine block of k x the router's block size maps to
k router blocks; other sizes are ignored (counted as `block_size_mismatch`). A `BlockStored`
whose parent the router never saw (events lost) is skipped: its chain cannot be placed.
A chain's first block hangs from its adapter's root (`prefix_index.lora_root` of the event's
`lora_name`, or of a bare `lora_id`): blocks stored for a LoRA adapter never match a
base-model request or another adapter's, and the base model's never match an adapter's.

Data-parallel engines (router/dp_ranks.py): each DP rank of a vLLM engine has its own prefix
cache and publishes on its own socket (rank r binds the configured port + r) with its rank in
every batch (`data_parallel_rank`). For an engine URL the pool holds as N > 1 ranks, one
subscriber per rank feeds the index under the rank's endpoint key (`url@rank`, from the
batch's rank, else the socket's), so a prefix hit on rank 1 routes to rank 1. For an engine
the pool holds as one endpoint the batch's rank is ignored: with external load balancing
(`--data-parallel-rank r`, one URL per rank) the URL already is the rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdgate.router.dp_ranks import endpoint_key, rank_endpoint
from pdgate.router.policies.prefix_index import PrefixIndex, block_hashes, lora_root

__all__ = [
    "AllCleared",
    "KVEventIndex",
    "KVEventSubscriber",
    "Removed",
    "Stored",
    "decode_batch",
    "decode_batch_ranked",
    "parse_kv_event_endpoints",
]

log = logging.getLogger(__name__)

EngineHash = int | bytes
_RECV_POLL_MS = 500


@dataclass(frozen=True, slots=True)
class Stored:
    """`BlockStored`: blocks `block_hashes` (chain, root first) after `parent`."""

    block_hashes: list[EngineHash]
    parent: EngineHash | None
    token_ids: list[int]
    block_size: int
    # The LoRA adapter the blocks were computed with (vLLM 0.32: `lora_name`; `lora_id`,
    # deprecated, is the engine's own number for it). None, None: the base model.
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    """`BlockRemoved`: the engine evicted `block_hashes`."""

    block_hashes: list[EngineHash]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """`AllBlocksCleared`: the engine dropped its whole prefix cache."""


KVEvent = Stored | Removed | AllCleared


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM `KVEventBatch`."""


def decode_batch(payload: bytes) -> list[KVEvent]:
    """The events of one msgpack `KVEventBatch` (array or map encoding). Unknown event
    types are skipped; a payload that is not a batch raises `KVEventDecodeError`."""
    return decode_batch_ranked(payload)[0]


def decode_batch_ranked(payload: bytes) -> tuple[list[KVEvent], int | None]:
    """`decode_batch`, plus the batch's `data_parallel_rank` (None when absent)."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise KVEventDecodeError(f"not msgpack: {exc}") from None
    rank: Any = None
    if isinstance(raw, dict):
        events, rank = raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        events, rank = raw[1], raw[2] if len(raw) >= 3 else None
    else:
        events = None
    if not isinstance(events, list):
        raise KVEventDecodeError("not a KVEventBatch (no event list)")
    out = []
    for ev in events:
        parsed = _event(ev)
        if parsed is not None:
            out.append(parsed)
    valid = isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0
    return out, rank if valid else None


_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _event(ev: Any) -> KVEvent | None:
    values: list[Any]
    if isinstance(ev, dict):
        tag = ev.get("type")
        values = [ev.get(name) for name in _FIELDS.get(str(tag), ())]
    elif isinstance(ev, list) and ev:
        tag = ev[0]
        wanted = len(_FIELDS.get(str(tag), ()))
        values = list(ev[1 : 1 + wanted])
        values += [None] * (wanted - len(values))  # older vLLM: fewer trailing fields
    else:
        return None
    try:
        if tag == "BlockStored":
            hashes, parent, tokens, size, lora_id, _medium, lora_name = values
            return Stored(list(hashes), parent, list(tokens), int(size),
                          lora_name if isinstance(lora_name, str) else None,
                          lora_id if isinstance(lora_id, int) else None)
        if tag == "BlockRemoved":
            return Removed(list(values[0]))
        if tag == "AllBlocksCleared":
            return AllCleared()
    except (TypeError, ValueError):
        log.debug("malformed %s event ignored", tag)
    return None


class KVEventIndex:
    """Per-engine exact view of engines' prefix caches, in router block hashes.

    `index` answers prefix matches like the approximate index; `publishes(engine)` says
    whether `engine` has sent any event yet (policies fall back to the approximate index for
    engines that have not). `max_entries` bounds both the index and each engine's hash map.
    """

    def __init__(self, block_size: int, max_entries: int) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self.index = PrefixIndex(max_entries)
        self._maps: dict[str, OrderedDict[EngineHash, tuple[int, ...]]] = {}
        self.ignored: dict[str, int] = {}

    def publishes(self, engine: str) -> bool:
        return engine in self._maps

    def apply(self, engine: str, events: Sequence[KVEvent]) -> None:
        """Apply one batch of `engine`'s events in order."""
        known = self._maps.setdefault(engine, OrderedDict())
        for ev in events:
            if isinstance(ev, Stored):
                self._stored(engine, known, ev)
            elif isinstance(ev, Removed):
                for h in ev.block_hashes:
                    ours = known.pop(h, None)
                    if ours is not None:
                        self.index.remove(engine, ours)
            else:
                known.clear()
                self.index.clear(engine)

    def _stored(
        self, engine: str, known: OrderedDict[EngineHash, tuple[int, ...]], ev: Stored
    ) -> None:
        k, rem = divmod(ev.block_size, self.block_size)
        if rem or k == 0 or len(ev.token_ids) != len(ev.block_hashes) * ev.block_size:
            self._ignore("block_size_mismatch")
            return
        if ev.parent is None:  # a chain's root: keyed by its adapter, as requests are
            parent = lora_root(ev.lora_name, ev.lora_id)
        elif (parent_ours := known.get(ev.parent)) is not None:
            parent = parent_ours[-1]
        else:
            self._ignore("unknown_parent")
            return
        ours = block_hashes(ev.token_ids, self.block_size, parent)
        for i, h in enumerate(ev.block_hashes):
            known[h] = tuple(ours[i * k : (i + 1) * k])
            known.move_to_end(h)
        while len(known) > self.max_entries:
            known.popitem(last=False)
        self.index.insert(engine, ours)

    def _ignore(self, reason: str) -> None:
        self.ignored[reason] = self.ignored.get(reason, 0) + 1


def parse_kv_event_endpoints(entries: Sequence[str]) -> dict[str, str]:
    """`ENGINE_URL=tcp://host:port` entries -> {engine URL (no trailing /): endpoint}.
    Raises ValueError naming the bad entry."""
    out: dict[str, str] = {}
    for entry in entries:
        url, sep, endpoint = entry.rpartition("=")
        if not sep or not url.startswith(("http://", "https://")) or "://" not in endpoint:
            raise ValueError(
                f"{entry!r} is not ENGINE_URL=ENDPOINT (e.g. http://h:8100=tcp://h:5557)"
            )
        out[url.rstrip("/")] = endpoint
    return out


class KVEventSubscriber:
    """One SUB socket on one engine's KV-events endpoint, feeding `index` (event loop only).

    `rank`: the DP rank this socket publishes for, when the pool holds `engine` as DP
    ranks (events are then keyed `engine@rank`, the batch's own rank first); None: keyed
    by `engine` whatever rank the batch names.

    `run()` loops until cancelled; the socket is closed with linger 0 on exit. Each
    receive waits at most `_RECV_POLL_MS`, so cancellation is prompt. A gap in the sequence
    numbers (lost messages) is logged and counted; the index then may miss a few blocks,
    which only costs cache hits, never correctness.
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        engine: str,
        endpoint: str,
        index: KVEventIndex,
        on_batch: Callable[[str, int, bool], None] | None = None,
        topic: str = "",
        rank: int | None = None,
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.endpoint = endpoint
        self._ctx = ctx
        self._index = index
        self._on_batch = on_batch
        self._topic = topic.encode()
        self._last_seq: int | None = None
        self.connected = asyncio.Event()

    async def run(self) -> None:
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.endpoint)
            self.connected.set()
            while True:
                if not await sock.poll(_RECV_POLL_MS):
                    continue
                self._handle(await sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("kv events from %s: unexpected %d-frame message", self.engine,
                        len(frames))
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        gap = self._last_seq is not None and seq != self._last_seq + 1
        if gap:
            log.warning("kv events from %s: sequence gap %s -> %d", self.engine,
                        self._last_seq, seq)
        self._last_seq = seq
        try:
            events, rank = decode_batch_ranked(frames[2])
        except KVEventDecodeError as exc:
            log.warning("kv events from %s: %s", self.engine, exc)
            return
        key = self.engine if self.rank is None else endpoint_key(
            self.engine, self.rank if rank is None else rank)
        self._index.apply(key, events)
        if self._on_batch is not None:
            self._on_batch(key, len(events), gap)


@contextlib.asynccontextmanager
async def running_subscribers(
    endpoints: dict[str, str], index: KVEventIndex,
    on_batch: Callable[[str, int, bool], None] | None = None,
    dp_size: Callable[[str], int] | None = None,
) -> Any:
    """Run one subscriber per `endpoints` entry for the duration of the block, or one per
    DP rank of an engine URL `dp_size(url)` says has several (rank 0's endpoint given)."""
    ctx = zmq.asyncio.Context()
    subs = []
    for url, endpoint in endpoints.items():
        n = 1 if dp_size is None else dp_size(url)
        if n == 1:
            subs.append(KVEventSubscriber(ctx, url, endpoint, index, on_batch))
            continue
        subs += [KVEventSubscriber(ctx, url, rank_endpoint(endpoint, r), index, on_batch,
                                   rank=r) for r in range(n)]
    tasks = [asyncio.create_task(s.run(), name=f"kv-events {s.engine}@{s.rank}")
             for s in subs]
    try:
        yield subs
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.term()
